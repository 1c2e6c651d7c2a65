"""Flax NNX attention modules. They own the parameters, the dropout stream and
the KV cache, and call the steps the linen modules call (``nanoattn._layers.steps``),
so both give the same outputs from the same weights.

Axis letters (docs/conventions.md): B batch, T query time, S key time (the
cache capacity when decoding), N query heads, K key/value heads, G = N / K,
H head width, D model width.
"""

import numbers

import jax
import jax.numpy as jnp
from flax import nnx

from ..._base.validate import float_dtype
from .. import steps
from ..caches import kv_cache
from ..caches.kinds import policy_of
from ..config import AttentionConfig
from ..sharded import parameter_axes
from .parameters import HeadRMSNorm, Parameters

# How to make a larger cache, ending the capacity errors: a cache that fills is sized by
# the longest sequence, one that wraps (a ring) by its slots.
_OVERFLOW_HINT = "create a larger cache with module.init_cache(batch, max_len)"
_RING_HINT = "create the cache with module.init_cache(batch, max_len) (max_len slots)"


class KVCache(nnx.Module):
    """The decoding cache of one layer as ``nnx.Cache`` variables: ``key`` and
    ``value`` (B, S, K, H) in the cache dtype, ``position`` (B,) int32 (the
    tokens each row has taken) and ``last`` (B,) int32 (the tokens of its last
    call, what ``rewind`` may take back); a quantized cache's ``key_scales`` and
    ``value_scales`` (B, S, K) float32 too. Slots at and past ``position[b]`` are
    never read (in a rolling cache: slots holding positions out of view)."""

    def __init__(self, cache: kv_cache.KVCache):
        if not isinstance(cache, kv_cache.KVCache):
            raise TypeError(
                "cache must be a KVCache of key, value (B, S, K, H) and position (B,), "
                f"got {type(cache).__name__}; create one with module.init_cache(batch, max_len)"
            )
        self.fields = tuple(kv_cache.as_mapping(cache))  # the scales of a quantized cache too
        for name in self.fields:
            setattr(self, name, nnx.Cache(getattr(cache, name)))

    def get(self) -> kv_cache.KVCache:
        return kv_cache.KVCache(**{name: getattr(self, name)[...] for name in self.fields})

    def set(self, cache: kv_cache.KVCache) -> None:
        for name in self.fields:
            getattr(self, name)[...] = getattr(cache, name)


def _hint(policy) -> str:
    return _RING_HINT if policy.wraps else _OVERFLOW_HINT


def _positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {name}={value!r}")
    return int(value)


def _dropout_stream(rngs: nnx.Rngs, cfg: AttentionConfig):
    try:
        return rngs.dropout.fork()
    except AttributeError:
        raise ValueError(
            f"dropout={cfg.dropout} needs a dropout stream, and rngs has no 'dropout' stream "
            "(nor a default one): pass nnx.Rngs(0) or nnx.Rngs(params=0, dropout=1)"
        ) from None


class _Attention(nnx.Module):
    """What both NNX modules share: config, output projection, QK norms, sinks,
    dropout stream and the train/eval flag."""

    def __init__(self, config, *, sow_weights: bool, deterministic: bool, rngs: nnx.Rngs):
        cfg = AttentionConfig.from_config(config)
        if not isinstance(rngs, nnx.Rngs):
            raise TypeError(f"rngs must be an nnx.Rngs, e.g. nnx.Rngs(0), got {rngs!r}")
        self.config = cfg
        D, H = cfg.d_model, cfg.head_dim
        self.out = self._linear(cfg.q_width, D, rngs, "out")  # N H -> D
        if cfg.qk_norm:
            joint = cfg.qk_norm == "projection"  # over N H and K H, else over H per head
            norm = dict(
                param_dtype=cfg.param_dtype,
                axes=2 if joint else 1,
                eps=cfg.qk_norm_eps,
                offset=cfg.qk_norm_offset,
            )
            self.q_norm = HeadRMSNorm(cfg.q_width if joint else H, **norm)
            self.k_norm = HeadRMSNorm(cfg.kv_heads * H if joint else H, **norm)
        if cfg.sinks:  # one logit per query head, as linen's zeros-initialised "sinks"
            self.sinks = nnx.Param(jnp.zeros((cfg.n_heads,), cfg.param_dtype))  # (N,)
        self.sow_weights = sow_weights
        self.deterministic = deterministic
        self.rngs = nnx.data(_dropout_stream(rngs, cfg) if cfg.dropout > 0 else None)

    def _linear(self, d_in: int, features: int, rngs: nnx.Rngs, name: str) -> nnx.Linear:
        cfg = self.config
        metadata = {}
        if cfg.head_axis is not None:  # logical axis names (nanoattn.parallel.logical_rules)
            kernel_axes, bias_axes = parameter_axes(name)
            metadata = {
                "kernel_metadata": {"out_sharding": kernel_axes, "eager_sharding": False},
                "bias_metadata": {"out_sharding": bias_axes, "eager_sharding": False},
            }
        return nnx.Linear(
            d_in, features, use_bias=cfg.has_bias(name), param_dtype=cfg.param_dtype, rngs=rngs,
            **metadata,
        )  # fmt: skip

    def _deterministic(self, deterministic: bool | None) -> bool:
        return self.deterministic if deterministic is None else deterministic


class CausalSelfAttention(_Attention):
    r"""Causal self-attention with grouped-query heads, RoPE, a sliding window,
    soft-capping, QK norm and a KV cache: the NNX twin of
    ``nanoattn.linen.CausalSelfAttention`` (same math, same parameters: its docstring
    has the formula and every rule of which key a query may see).

    Parameters (``nnx.Param``), named and shaped as the linen module's, so
    ``from_linen``/``to_linen`` convert them::

        qkv: Linear, kernel (D, (N + 2K) H), bias ((N + 2K) H,)
        out: Linear, kernel (N H, D), bias (D,)          # (D, D) when H = D / N
        q_norm, k_norm: HeadRMSNorm, scale (H,)          # with qk_norm only
        sinks: (N,), zeros                               # with sinks only

    (biases as ``qkv_bias``/``out_bias`` say; with ``qk_norm="projection"`` the
    norms' scales are (N H,) and (K H,).)

    **Dropout** (on the attention weights, rate ``config.dropout``) follows
    NNX: as ``nnx.Dropout(rate, rngs=rngs)``, the module forks its own stream
    from ``rngs`` at construction (``rngs.dropout``, or the default stream), so
    the caller's later draws from ``rngs`` do not change its masks and its
    calls do not advance ``rngs``; ``model.train()`` / ``model.eval()`` switch the
    ``deterministic`` attribute, and a call's ``deterministic=`` or ``rngs=``
    overrides them.

    **Decoding**: ``module.init_cache(batch, max_len)`` allocates an empty
    cache (``module.cache``, ``nnx.Cache`` variables, every row at position
    0); each ``module(chunk, decode=True, lengths=None)`` then takes a chunk of
    any length L >= 1, writes its keys and values at each row's position,
    attends causally over the keys written so far and advances the row by
    ``lengths[b]`` (default L): outputs equal those of one causal call on the
    whole sequence (with the same ``mask_fn`` and ``score_fn``, which see each
    query at its position in the row and each key at its cache slot), with
    zeros at padded tokens. A write past the capacity raises ValueError when
    the position is concrete; under ``nnx.jit`` it cannot raise, and the
    overflowing rows' outputs are NaN instead (the rows are poisoned: NaN until
    reset). With ``config.rolling_cache`` the cache is a ring of ``max_len``
    slots that decodes past any length (chunks of at most ``max_len - W -
    sink_tokens`` tokens); ``module.rewind(n)`` takes back up to the tokens of
    each row's last call, on either kind (docs/decoding.md).

    Args:
      config: an :class:`AttentionConfig` (or any object with ``d_model``,
        ``n_heads`` and optionally the other fields).
      sow_weights: if True, each call sows the attention weights (B, N, T, S),
        without dropout, as ``nnx.Intermediate`` ``attention_weights``; collect
        them with ``nnx.capture(module, nnx.Intermediate)(x)``.
      deterministic: the initial train/eval flag (False: dropout on).
      rngs: ``nnx.Rngs`` for the parameters and the dropout stream.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from flax import nnx
      >>> config = AttentionConfig(d_model=128, n_heads=4, n_kv_heads=2, rope_base=10000.0)
      >>> layer = CausalSelfAttention(config, rngs=nnx.Rngs(0))
      >>> layer.qkv.kernel.shape  # (N + 2K) H = 256 columns
      (128, 256)
      >>> x = jax.random.normal(jax.random.key(1), (2, 5, 128))  # (B, T, D)
      >>> full = nnx.jit(lambda layer, x: layer(x))(layer, x)
      >>> layer.init_cache(batch=2, max_len=8)
      >>> step = nnx.jit(lambda layer, chunk: layer(chunk, decode=True))
      >>> y1 = step(layer, x[:, :3])  # the prompt, then one token per step
      >>> y2, y3 = step(layer, x[:, 3:4]), step(layer, x[:, 4:5])
      >>> bool(jnp.allclose(jnp.concatenate([y1, y2, y3], 1), full, atol=1e-5))
      True
      >>> layer.cache.position[...]
      Array([5, 5], dtype=int32)
    """

    def __init__(
        self, config, *, sow_weights: bool = False, deterministic: bool = False, rngs: nnx.Rngs
    ):
        super().__init__(config, sow_weights=sow_weights, deterministic=deterministic, rngs=rngs)
        cfg = self.config
        width = (cfg.n_heads + 2 * cfg.kv_heads) * cfg.head_dim  # (N + 2K) H
        self.qkv = self._linear(cfg.d_model, width, rngs, "qkv")
        self.cache = nnx.data(None)

    def init_cache(self, batch: int, max_len: int, dtype=None) -> None:
        """Allocates an empty KV cache: capacity ``max_len`` tokens for ``batch`` rows.

        With ``config.rolling_cache`` the cache is a ring of ``max_len`` slots
        (at least window + 1 + ``sink_tokens``) that decodes past any length.

        Args:
          batch: B, the rows every decoding call must have.
          max_len: S, the most tokens a row can hold (the slots of a rolling cache).
          dtype: the dtype of the cached keys and values; default
            ``config.dtype``, else ``config.param_dtype`` (linen's
            ``init(x, decode=True)``, which has an input, takes ``config.dtype``,
            else ``x``'s: the same cache when ``x`` is in ``param_dtype``). With
            ``config.kv_cache_dtype`` the cache stores that dtype and its scales.
        """
        cfg = self.config
        batch, max_len = _positive_int("batch", batch), _positive_int("max_len", max_len)
        if dtype is None:  # tested against None: a dtype's truth value is numpy's to define
            dtype = cfg.param_dtype if cfg.dtype is None else cfg.dtype
        else:
            dtype = float_dtype("dtype", dtype)
        policy = policy_of(cfg)
        policy.check_capacity(max_len, _hint(policy))
        storage = cfg.kv_cache_dtype or dtype  # a quantized cache: int8 or float8 and scales
        self.cache = KVCache(policy.empty(batch, max_len, cfg.kv_heads, cfg.head_dim, storage))

    def __call__(
        self,
        x,
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
        deterministic: bool | None = None,
        rngs: nnx.Rngs | None = None,
    ) -> jax.Array:
        """Attends every token to itself and the tokens before it.

        Args:
          x: (B, T, D); with ``decode=True`` a chunk of T >= 1 new tokens.
          mask: optional boolean mask broadcastable to (B, N, T, S), True = may
            attend, ANDed with the causal triangle (e.g. a ``padding_mask``).
            S = T, or the cache capacity when decoding.
          positions: optional int (B, T) or (T,): the positions RoPE rotates
            by (default ``arange(T)``). Not with ``decode=True``.
          segment_ids: optional int (B, T): packed documents; a token attends
            only to tokens with the same id. Not with ``decode=True``.
          decode: write x into the cache (``init_cache`` first) and attend
            over everything cached.
          lengths: only with ``decode=True``: optional int (B,), the real
            tokens of each row of a right-padded chunk, in [0, T].
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
            axes ((1, Tq) with ``pages``): a token tree (speculative decoding), as
            ``nanoattn.linen.CausalSelfAttention`` takes it; keep the accepted path
            with :meth:`accept` (a paged cache: ``PageAllocator.accept``).
          deterministic: overrides the module's flag for this call.
          rngs: overrides the module's dropout stream for this call.

        Returns:
          (B, T, D) in the compute dtype (``config.dtype``, else ``x``'s).
        """
        cfg = self.config
        steps.check_input(
            cfg,
            x,
            decode=decode,
            positions=positions,
            segment_ids=segment_ids,
            lengths=lengths,
            pages=pages,
            tree_parents=tree_parents,
        )
        params = Parameters(self, rngs)
        deterministic = self._deterministic(deterministic)
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
        if self.cache is None:
            raise ValueError(
                "decode=True needs a cache: call module.init_cache(batch, max_len) first"
            )
        y, cache = steps.decode(
            params,
            cfg,
            x,
            self.cache.get(),
            deterministic=deterministic,
            mask=mask,
            lengths=lengths,
            pages=pages,
            mask_fn=mask_fn,
            score_fn=score_fn,
            tree_parents=tree_parents,
            hint=_hint(policy_of(cfg)),
        )
        self.cache.set(cache)
        return y

    def rewind(self, n) -> None:
        """Moves each row b of the cache back by ``n[b]`` tokens (an int or (B,) int,
        0 <= n[b] <= the tokens row b took in its last call): ``nanoattn.linen.rewind``
        on ``module.cache``, full or rolling. Raises ValueError when ``n`` is concrete
        and out of range; under ``nnx.jit`` such a row is poisoned (NaN outputs)."""
        if self.cache is None:
            raise ValueError("rewind needs a cache: call module.init_cache(batch, max_len) first")
        self.cache.set(policy_of(self.config).rewind(self.cache.get(), n))

    def accept(self, kept) -> None:
        """Keeps the accepted path of the last call's token tree: row b keeps the tokens
        ``kept[b, :m]`` (int (B, A), a root-to-leaf path in order, then -1s), moved
        into place, the rest taken back (``nanoattn.linen.accept`` on ``module.cache``,
        full or rolling). Raises ValueError when ``kept`` is concrete and no path;
        under ``nnx.jit`` such a row is poisoned (NaN outputs)."""
        if self.cache is None:
            raise ValueError("accept needs a cache: call module.init_cache(batch, max_len) first")
        self.cache.set(policy_of(self.config).accept(self.cache.get(), kept))


MultiHeadAttention = CausalSelfAttention


class CrossAttention(_Attention):
    r"""Cross-attention: T queries from ``x`` attend to S keys from ``context``;
    the NNX twin of ``nanoattn.linen.CrossAttention``.

    .. math::

       y = \mathrm{out}\Big(\mathrm{concat}_n\, \mathrm{softmax}_{j \in \mathrm{allowed}}
           \big(c \tanh(s\, q_{in} \cdot k_{j,n/G} / c)\big)\, v_{j,n/G}\Big)

    with ``q = q(x)``, ``[k | v] = kv(context)`` (columns [K (K*H) | V (K*H)]),
    query head n reading key/value head ``n // G``, q and k RMS-normalised with
    ``qk_norm``, ``s = scale`` (``1 / sqrt(H)`` by default), and ``c =
    logit_soft_cap``. No causal triangle and no cache; ``rope_base`` and ``window``
    do not apply between two sequences and are ignored; ``sinks`` applies as in
    :class:`CausalSelfAttention`. Parameters::

        q: Linear, kernel (D, N H), bias (N H,)                   # (D, D) when H = D / N
        kv: Linear, kernel (D, 2KH), bias (2KH,)                  # (D, 2D) when K = N
        out: Linear, kernel (N H, D), bias (D,)
        q_norm, k_norm: HeadRMSNorm, scale (H,)                   # with qk_norm only
        sinks: (N,), zeros                                        # with sinks only

    Dropout and ``sow_weights`` work as in :class:`CausalSelfAttention`.

    Example:
      >>> import jax.numpy as jnp
      >>> from flax import nnx
      >>> layer = CrossAttention(AttentionConfig(64, 4, n_kv_heads=1), rngs=nnx.Rngs(0))
      >>> layer.kv.kernel.shape  # one key/value head of width 16: [K | V]
      (64, 32)
      >>> layer(jnp.ones((2, 3, 64)), jnp.ones((2, 7, 64))).shape
      (2, 3, 64)
    """

    def __init__(
        self, config, *, sow_weights: bool = False, deterministic: bool = False, rngs: nnx.Rngs
    ):
        super().__init__(config, sow_weights=sow_weights, deterministic=deterministic, rngs=rngs)
        cfg = self.config
        self.q = self._linear(cfg.d_model, cfg.q_width, rngs, "q")  # D -> N H
        self.kv = self._linear(cfg.d_model, 2 * cfg.kv_heads * cfg.head_dim, rngs, "kv")

    def __call__(
        self,
        x,
        context,
        *,
        context_mask=None,
        mask_fn=None,
        score_fn=None,
        deterministic: bool | None = None,
        rngs: nnx.Rngs | None = None,
    ) -> jax.Array:
        """Attends each query token to the context tokens.

        Args:
          x: (B, T, D) queries.
          context: (B, S, D) keys and values.
          context_mask: optional boolean; either (B, S), True at real context
            tokens, or any mask broadcastable to (B, N, T, S) of rank other than 2.
          mask_fn: optional ``mask_fn(b, n, q_pos, k_pos) -> bool``, ANDed with
            ``context_mask``; query positions ``0 .. T - 1``, key positions
            ``0 .. S - 1``.
          score_fn: optional ``score_fn(score, b, n, q_pos, k_pos) -> score``,
            with the same positions.
          deterministic: overrides the module's flag for this call.
          rngs: overrides the module's dropout stream for this call.

        Returns:
          (B, T, D) in the compute dtype (``config.dtype``, else ``x``'s).
        """
        return steps.cross_attention(
            Parameters(self, rngs),
            self.config,
            x,
            context,
            deterministic=self._deterministic(deterministic),
            context_mask=context_mask,
            mask_fn=mask_fn,
            score_fn=score_fn,
        )
