"""Flax linen attention modules. They own the parameters and the KV cache,
project, split heads, normalise and rotate them, and call the functional core;
the math lives in ``nanoattn.dot_product_attention``.

Axis letters (docs/conventions.md): B batch, T query time, S key time (the
cache capacity when decoding), N query heads, K key/value heads, G = N / K,
H head width, D model width.
"""

import flax.errors
import flax.linen as nn

from .. import steps
from ..caches import kv_cache
from ..caches.full import FullCache
from ..caches.kinds import policy_of
from ..config import AttentionConfig
from ..heads import compute_dtype
from ..sharded import parameter_axes
from .norm import HeadRMSNorm

# The "cache" collection: {"key": (B, S, K, H), "value": (B, S, K, H), "position": (B,),
# "last": (B,)}.
CACHE = "cache"
# How to make a larger cache, ending the capacity errors: a cache that fills is sized by
# the longest sequence, one that wraps (a ring) by its slots.
_OVERFLOW_HINT = (
    "create the cache with a longer input (init with jnp.zeros((B, max_len, D)), decode=True)"
)
_RING_HINT = "init with a longer input (jnp.zeros((B, C, D)), decode=True makes C slots)"


def rewind(cache, n):
    """Moves each row b of a KV cache back by ``n[b]`` tokens; returns the new cache.

    ``cache``: one layer's ``"cache"`` collection (``{"key", "value", "position",
    "last"}``), or any nested mapping of them (a model's whole collection: every
    layer is rewound alike). ``n``: an int or (B,) int with 0 <= n[b] <= the tokens
    row b took in its last call (``cache["last"][b]``), e.g. the rejected draft
    tokens of a speculative step. Works on full and rolling caches: the slots past
    the new position are never read again (docs/decoding.md says why that holds for
    a rolling cache too). Raises ValueError when ``n`` is concrete and out of range;
    under ``jit`` such a row is poisoned instead (NaN outputs until reset).

    Example:
      >>> import jax, jax.numpy as jnp
      >>> layer = CausalSelfAttention(AttentionConfig(d_model=16, n_heads=2))
      >>> variables = layer.init(jax.random.key(0), jnp.zeros((2, 8, 16)), decode=True)
      >>> _, state = layer.apply(variables, jnp.ones((2, 3, 16)), True, decode=True,
      ...                        lengths=jnp.array([3, 2]), mutable=["cache"])
      >>> cache = rewind(state["cache"], jnp.array([1, 2]))  # row 0 keeps 2, row 1 none
      >>> cache["position"], cache["last"]
      (Array([2, 0], dtype=int32), Array([2, 0], dtype=int32))
    """
    if kv_cache.is_cache(cache):
        return kv_cache.as_mapping(kv_cache.rewind(kv_cache.KVCache(**cache), n))
    if not hasattr(cache, "items"):
        raise TypeError(
            f"cache must be a layer's 'cache' collection (a mapping of key, value, position "
            f"and last) or a mapping of them, got {type(cache).__name__}"
        )
    return {name: rewind(child, n) for name, child in cache.items()}


def accept(cache, kept, config=None):
    """Keeps the accepted path of a token tree: each row b keeps the tokens
    ``kept[b, :m]`` of its last call, moved into place; returns the new cache.

    After a decoding call with ``tree_parents`` (speculative decoding), the drafts'
    keys sit in the slots after the committed ones, in the chunk's order. ``kept``: int
    (B, A), each row's kept indices into its last call's tokens, a root-to-leaf path
    (or a prefix of one) in order, then -1s (a row that keeps nothing: all -1). Their
    keys and values (and a quantized cache's scales) move at once to the slots of
    positions ``start .. start + m - 1`` (``start``: the position the last call
    began at), and the rest is taken back as :func:`rewind` takes it: the row's
    position is ``start + m`` and ``last`` m. ``cache``: one layer's ``"cache"``
    collection or any nested mapping of them (every layer alike). ``config``: the
    layers' ``AttentionConfig`` (or ``LatentConfig``), which says where a position's
    slot is; None reads slots as positions (a full cache, or a rolling one that has not
    wrapped: a row past the capacity is refused). Raises ValueError naming the entry
    when ``kept`` is concrete and no path of the last call (an index outside its
    tokens, not increasing, after a -1); under ``jit`` such a row is poisoned (NaN
    outputs until reset). A paged cache accepts through its ``PageAllocator``.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> layer = CausalSelfAttention(AttentionConfig(d_model=16, n_heads=2))
      >>> variables = layer.init(jax.random.key(0), jnp.zeros((1, 8, 16)), decode=True)
      >>> parents = jnp.array([[-1, 0, 0, 2]])  # 0 -> {1, 2}, 2 -> 3
      >>> _, state = layer.apply(variables, jnp.ones((1, 4, 16)), True, decode=True,
      ...                        tree_parents=parents, mutable=["cache"])
      >>> cache = accept(state["cache"], jnp.array([[0, 2, 3]]))  # the path 0, 2, 3
      >>> cache["position"], cache["last"]
      (Array([3], dtype=int32), Array([3], dtype=int32))
    """
    policy = FullCache() if config is None else policy_of(config)
    if kv_cache.is_cache(cache):
        state = kv_cache.KVCache(**cache)
        return kv_cache.as_mapping(policy.accept(state, kept))
    if not hasattr(cache, "items"):
        raise TypeError(
            f"cache must be a layer's 'cache' collection (a mapping of key, value, position "
            f"and last) or a mapping of them, got {type(cache).__name__}"
        )
    return {name: accept(child, kept, config) for name, child in cache.items()}


def cache_bytes(cache) -> dict[str, int]:
    """The bytes of each layer's KV cache in a ``"cache"`` collection:
    ``{"path/to/layer": bytes}`` (``""`` for one layer's own cache), counting
    ``2 * B * S * K * H * itemsize`` for keys and values plus ``8 * B`` for
    ``position`` and ``last``. Takes arrays or shapes (``jax.eval_shape``); for NNX
    pass ``nnx.to_pure_dict(nnx.state(model, nnx.Cache))``."""
    return kv_cache.cache_bytes(cache)


class _Parameters:
    """The parameters of a linen module, for the shared steps (``nanoattn._layers.heads``):
    submodules created in the module's compact call, named as the steps ask."""

    def __init__(self, module: nn.Module, cfg: AttentionConfig):
        self.module, self.cfg = module, cfg

    def dense(self, name, x, features, dtype):
        cfg = self.cfg
        inits = {}
        if cfg.head_axis is not None:  # logical axis names (nanoattn.parallel.logical_rules)
            kernel_axes, bias_axes = parameter_axes(name)
            inits = {
                "kernel_init": nn.with_logical_partitioning(
                    nn.linear.default_kernel_init, kernel_axes
                ),
                "bias_init": nn.with_logical_partitioning(nn.initializers.zeros_init(), bias_axes),
            }
        layer = nn.Dense(
            features, use_bias=cfg.has_bias(name), dtype=dtype, param_dtype=cfg.param_dtype,
            name=name, **inits,
        )  # fmt: skip
        return layer(x)

    def norm(self, name, x, dtype):
        cfg = self.cfg
        return HeadRMSNorm(
            dtype=dtype, param_dtype=cfg.param_dtype, axes=2 if cfg.qk_norm == "projection" else 1,
            eps=cfg.qk_norm_eps, offset=cfg.qk_norm_offset, name=name,
        )(x)  # fmt: skip

    def sinks(self):
        N = self.cfg.n_heads
        return self.module.param("sinks", nn.initializers.zeros_init(), (N,), self.cfg.param_dtype)

    def dropout_rng(self):
        try:
            return self.module.make_rng("dropout")
        except flax.errors.InvalidRngError:
            raise ValueError(
                f"dropout={self.cfg.dropout} with deterministic=False needs a 'dropout' rng: "
                "apply(..., rngs={'dropout': key}), or pass deterministic=True"
            ) from None

    def sow_weights(self, weights):
        module = self.module
        if module.sow_weights and module.is_mutable_collection("intermediates"):
            module.sow("intermediates", "attention_weights", weights())


class CausalSelfAttention(nn.Module):
    r"""Causal self-attention with grouped-query heads, RoPE, a sliding window,
    soft-capping, QK norm and a KV cache; a drop-in for the NanoMoE seed module.

    .. math::

       y = \mathrm{out}\Big(\mathrm{concat}_n\, \mathrm{softmax}_{j \in \mathrm{allowed}(i)}
           \big(c \tanh(s\, q_{in} \cdot k_{j,n/G} / c)\big)\, v_{j,n/G}\Big)

    with ``[q | k | v] = qkv(x)`` (columns [Q (N*H) | K (K*H) | V (K*H)]), ``q, k``
    RMS-normalised (``qk_norm``: per head, or per projection) and then rotated by
    RoPE at their positions (``rope_base``, with ``rope_scaling``, ``rotary_dim``
    and ``rope_layout``), ``s = scale`` (``1 / sqrt(H)`` by default), query head n
    reading key/value head ``n // G``, and ``c = logit_soft_cap`` (no tanh when
    None). Query i may see key j iff ``j <= i``, ``i - left <= j <= i + right``
    (``window``), the ``mask`` and the call's ``mask_fn`` allow it and, when
    packing, both have the same segment id. With ``sinks`` the softmax's denominator
    also holds ``exp(sinks[n])`` for head n (no value is attended for it), and a
    call's ``score_fn`` modifies the scaled logits before the soft-cap.

    Parameters, with K = N and ``use_bias=True`` exactly the seed's
    (``Dense_0`` -> ``qkv``, ``Dense_1`` -> ``out``)::

        {"qkv": {"kernel": (D, (N + 2K) H), "bias": ((N + 2K) H,)},   # (D, 3D) when K = N
         "out": {"kernel": (N H, D), "bias": (D,)},                   # (D, D) when H = D / N
         "q_norm": {"scale": (H,)}, "k_norm": {"scale": (H,)},        # with qk_norm only
         "sinks": (N,)}                                               # with sinks only, zeros

    (``qkv_bias``/``out_bias`` say which biases there are, ``use_bias`` by
    default; with ``qk_norm="projection"`` the norms' scales are (N H,) and (K H,).)

    **Decoding** (the flax convention): ``layer.init(key, jnp.zeros((B,
    max_len, D)), decode=True)`` also returns a ``"cache"`` collection of
    capacity ``max_len`` with every row at position 0 (see
    ``nanoattn._layers.caches.kv_cache``). Each ``layer.apply({"params": p, "cache": c},
    chunk, decode=True, mutable=["cache"])`` takes a chunk of any length
    L >= 1 (a prompt, one token, anything between), writes its keys and values
    at each row's position, attends causally with the row's position as
    ``q_offset`` over the keys written so far, and advances the row by
    ``lengths[b]`` (default L). Outputs equal those of one causal call on the
    whole sequence (with the same ``mask_fn`` and ``score_fn``, which see each
    query at its position in the row and each key at its cache slot). A write
    past the capacity raises ValueError when the position is concrete; under
    ``jit`` it cannot raise, and the overflowing rows' outputs are NaN instead
    (nothing of theirs is stored, and they are poisoned: NaN in every later call
    until reset).

    Attributes:
      config: an :class:`AttentionConfig` (or any object with ``d_model``,
        ``n_heads`` and optionally ``dropout`` and the other fields).
      sow_weights: if True, sow the attention weights (B, N, T, S), without
        dropout, into the ``intermediates`` collection.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> config = AttentionConfig(d_model=128, n_heads=4, n_kv_heads=2, rope_base=10000.0)
      >>> layer = CausalSelfAttention(config)
      >>> # init with decode=True: the parameters, and an empty cache of capacity 8.
      >>> init = jax.jit(lambda key: layer.init(key, jnp.zeros((2, 8, 128)), decode=True))
      >>> variables = init(jax.random.key(0))
      >>> jax.tree.map(jnp.shape, variables)  # qkv: (N + 2K) H = 256 columns
      {'cache': {'key': (2, 8, 2, 32), 'last': (2,), 'position': (2,),
                 'value': (2, 8, 2, 32)},
       'params': {'out': {'bias': (128,), 'kernel': (128, 128)},
                  'qkv': {'bias': (256,), 'kernel': (128, 256)}}}
      >>> params = {"params": variables["params"]}
      >>> x = jax.random.normal(jax.random.key(1), (2, 5, 128))  # (B, T, D)
      >>> full = jax.jit(lambda x: layer.apply(params, x, deterministic=True))(x)
      >>> @jax.jit
      ... def step(cache, chunk):  # a chunk of any length: a prompt, one token, ...
      ...     variables = {**params, "cache": cache}
      ...     y, state = layer.apply(variables, chunk, True, decode=True, mutable=["cache"])
      ...     return y, state["cache"]
      >>> y1, cache = step(variables["cache"], x[:, :3])  # the prompt
      >>> y2, cache = step(cache, x[:, 3:4])  # then one token per step
      >>> y3, cache = step(cache, x[:, 4:5])
      >>> bool(jnp.allclose(jnp.concatenate([y1, y2, y3], 1), full, atol=1e-5))
      True
      >>> cache["position"]
      Array([5, 5], dtype=int32)
    """

    config: AttentionConfig
    sow_weights: bool = False

    @nn.compact
    def __call__(
        self,
        x,
        deterministic: bool = False,
        *,
        mask=None,
        positions=None,
        segment_ids=None,
        decode: bool = False,
        lengths=None,
        pages=None,
        mask_fn=None,
        score_fn=None,
        tree_parents=None,
    ):
        """Attends every token to itself and the tokens before it.

        Args:
          x: (B, T, D); with ``decode=True`` a chunk of T >= 1 new tokens.
          deterministic: disables dropout (evaluation mode).
          mask: optional boolean mask broadcastable to (B, N, T, S), True = may
            attend, ANDed with the causal triangle (e.g. a ``padding_mask``).
            S = T, or the cache capacity when decoding.
          positions: optional int (B, T) or (T,): the positions RoPE rotates
            by (default ``arange(T)``; unused without ``rope_base``).
            Causality and the window follow the index in the sequence, not
            these positions. Not with ``decode=True``, where the cache keeps
            the positions.
          segment_ids: optional int (B, T): packed documents; a token attends
            only to tokens with the same id. Not with ``decode=True``.
          decode: use and advance the ``"cache"`` collection (see the class
            docstring); the first call (``init``) creates it.
          lengths: only with ``decode=True``: optional int (B,), the real
            tokens of each row of a right-padded chunk, in [0, T]. Row b
            advances by ``lengths[b]``; its outputs at padded tokens are zeros.
          pages: only with ``decode=True`` and a paged cache (``config.page_size``):
            the step's ``PagedBatch`` (``nanoattn.PageAllocator.batch``); x is then
            (1, Tq, D), the new tokens of many sequences token-major.
          mask_fn: optional ``mask_fn(b, n, q_pos, k_pos) -> bool`` (True = may
            attend), ANDed with causality, the window, ``mask``, ``lengths``
            and the segment ids (``nanoattn.dot_product_attention``). Positions
            are indices in the sequence, ``0 .. T - 1``; with ``decode=True``
            ``q_pos`` is each row's position in the cache (its position plus
            ``t``) and ``k_pos`` the key's position (in a full cache its slot),
            so decoding equals the full forward with the same ``mask_fn``. Not
            RoPE's ``positions``.
          score_fn: optional ``score_fn(score, b, n, q_pos, k_pos) -> score``
            (ALiBi, relative biases), on the float32 scaled logits before the
            soft-cap, with the positions of ``mask_fn``.
          tree_parents: only with ``decode=True``: optional int (B, T), x's leading
            axes ((1, Tq) with ``pages``): the chunk is a token tree (speculative
            decoding), each token's parent within its row's chunk (with ``pages``:
            within its sequence's tokens), -1 for the last committed token. Token i
            sits at position ``position + depth(i)`` (RoPE, ``mask_fn`` and the window
            see that), its key in the next slot; it sees its ancestors and itself
            inside the chunk, so its output is its root-to-leaf path decoded alone.
            Keep the accepted path with :func:`accept` (a paged cache:
            ``PageAllocator.accept``); docs/decoding.md, "Speculative trees".

        Returns:
          (B, T, D) in the compute dtype (``config.dtype``, else ``x``'s).

        Raises:
          ValueError: a shape or argument error, or (concrete positions only)
            a chunk that does not fit in the cache.
        """
        cfg = AttentionConfig.from_config(self.config)
        steps.check_input(cfg, x, decode=decode, positions=positions, segment_ids=segment_ids,
                          lengths=lengths, pages=pages, tree_parents=tree_parents)  # fmt: skip
        params = _Parameters(self, cfg)
        if not decode:
            return steps.self_attention(
                params,
                cfg,
                x,
                deterministic=deterministic,
                mask=mask,
                positions=positions,
                segment_ids=segment_ids,
                mask_fn=mask_fn,
                score_fn=score_fn,
            )
        B, T, _ = x.shape
        fresh = not self.has_variable(CACHE, "key")
        dtype = compute_dtype(cfg, x)
        policy = policy_of(cfg)
        hint = _RING_HINT if policy.wraps else _OVERFLOW_HINT

        if fresh and not self.is_initializing():
            raise ValueError(
                "decode=True needs a cache: create one with variables = layer.init(key, "
                "jnp.zeros((B, max_len, D)), decode=True), then apply({'params': ..., "
                "'cache': variables['cache']}, ..., decode=True, mutable=['cache'])"
            )

        if fresh:
            policy.check_capacity(T, hint)

        def empty():  # called only by init, when the cache is created
            return policy.empty(B, T, cfg.kv_heads, cfg.head_dim, cfg.kv_cache_dtype or dtype)

        variables = {
            name: self.variable(CACHE, name, lambda name=name: getattr(empty(), name))
            for name in kv_cache.fields(
                cfg.kv_cache_dtype is not None, cfg.page_selection is not None
            )
        }
        if fresh:  # init: an empty cache of capacity T; the output is the full forward of x
            return steps.self_attention(
                params, cfg, x, deterministic=deterministic, mask=mask, mask_fn=mask_fn,
                score_fn=score_fn,
            )  # fmt: skip
        cache = kv_cache.KVCache(**{name: v.value for name, v in variables.items()})
        y, cache = steps.decode(
            params,
            cfg,
            x,
            cache,
            deterministic=deterministic,
            mask=mask,
            lengths=lengths,
            pages=pages,
            mask_fn=mask_fn,
            score_fn=score_fn,
            tree_parents=tree_parents,
            hint=hint,
        )
        for name, value in kv_cache.as_mapping(cache).items():
            variables[name].value = value
        return y


MultiHeadAttention = CausalSelfAttention


class CrossAttention(nn.Module):
    r"""Cross-attention: T queries from ``x`` attend to S keys from ``context``.

    .. math::

       y = \mathrm{out}\Big(\mathrm{concat}_n\, \mathrm{softmax}_{j \in \mathrm{allowed}}
           \big(c \tanh(s\, q_{in} \cdot k_{j,n/G} / c)\big)\, v_{j,n/G}\Big)

    with ``q = q(x)``, ``[k | v] = kv(context)`` (columns [K (K*H) | V (K*H)]),
    query head n reading key/value head ``n // G``, q and k RMS-normalised with
    ``qk_norm``, ``s = scale`` (``1 / sqrt(H)`` by default), and ``c =
    logit_soft_cap`` (no tanh when None). No causal triangle and no cache (the keys
    do not grow). The positional options of the config, ``rope_base`` and
    ``window``, do not apply between two sequences and are ignored; ``sinks``
    applies as in :class:`CausalSelfAttention`. Parameters::

        {"q": {"kernel": (D, N H), "bias": (N H,)},                # (D, D) when H = D / N
         "kv": {"kernel": (D, 2KH), "bias": (2KH,)},                # (D, 2D) when K = N
         "out": {"kernel": (N H, D), "bias": (D,)},
         "q_norm": {"scale": (H,)}, "k_norm": {"scale": (H,)},     # with qk_norm only
         "sinks": (N,)}                                            # with sinks only, zeros

    Attributes:
      config: an :class:`AttentionConfig`.
      sow_weights: if True, sow the attention weights (B, N, T, S) into
        ``intermediates``.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> layer = CrossAttention(AttentionConfig(d_model=64, n_heads=4, n_kv_heads=1))
      >>> x, ctx = jnp.ones((2, 3, 64)), jnp.ones((2, 7, 64))
      >>> params = jax.jit(lambda key: layer.init(key, x, ctx, deterministic=True))(
      ...     jax.random.key(0)
      ... )
      >>> params["params"]["kv"]["kernel"].shape  # one key/value head of width 16: [K | V]
      (64, 32)
      >>> jax.jit(lambda p: layer.apply(p, x, ctx, deterministic=True))(params).shape
      (2, 3, 64)
    """

    config: AttentionConfig
    sow_weights: bool = False

    @nn.compact
    def __call__(
        self,
        x,
        context,
        deterministic: bool = False,
        *,
        context_mask=None,
        mask_fn=None,
        score_fn=None,
    ):
        """Attends each query token to the context tokens.

        Args:
          x: (B, T, D) queries.
          context: (B, S, D) keys and values.
          deterministic: disables dropout (evaluation mode).
          context_mask: optional boolean; either (B, S), True at real context
            tokens, or any mask broadcastable to (B, N, T, S) of rank other than 2.
          mask_fn: optional ``mask_fn(b, n, q_pos, k_pos) -> bool``, ANDed with
            ``context_mask``; query positions ``0 .. T - 1``, key positions
            ``0 .. S - 1``.
          score_fn: optional ``score_fn(score, b, n, q_pos, k_pos) -> score``,
            with the same positions.

        Returns:
          (B, T, D) in the compute dtype (``config.dtype``, else ``x``'s).
        """
        cfg = AttentionConfig.from_config(self.config)
        return steps.cross_attention(
            _Parameters(self, cfg),
            cfg,
            x,
            context,
            deterministic=deterministic,
            context_mask=context_mask,
            mask_fn=mask_fn,
            score_fn=score_fn,
        )
