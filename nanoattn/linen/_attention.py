"""Flax linen attention modules. They own the parameters and the KV cache,
project, split heads, normalise and rotate them, and call the functional core;
the math lives in ``nanoattn.dot_product_attention``.

Axis letters (docs/conventions.md): B batch, T query time, S key time (the
cache capacity when decoding), N query heads, K key/value heads, G = N / K,
H head width, D model width.
"""

import flax.linen as nn
import jax.numpy as jnp

from .._masks import padding_mask
from .._trace import check_shape
from .._validate import expect_bool, expect_integer, expect_shape
from . import _cache
from ._config import AttentionConfig
from ._heads import (
    attend,
    compute_dtype,
    core_options,
    dense,
    kv_letters,
    normalize_qk,
    rotate_qk,
    split_heads,
)


def _project_qkv(cfg: AttentionConfig, x, dtype):
    """x (B, T, D) -> query heads (B, T, N, H), key and value heads (B, T, K, H)."""
    B, T, D = x.shape
    N, K, H = cfg.n_heads, cfg.kv_heads, cfg.head_dim
    kv_axis, kv_width = kv_letters(cfg)
    width = "3D" if K == N else "(N+2K)H"
    qkv = dense(cfg, (N + 2 * K) * H, "qkv", dtype)(x)
    check_shape(qkv, "qkv", f"B T {width}", (B, T, (N + 2 * K) * H), op="project", source="input")
    q, k, v = jnp.split(qkv, [N * H, (N + K) * H], axis=-1)  # [Q (N*H) | K (K*H) | V (K*H)]
    check_shape(q, "q", "B T D", (B, T, D), op="split", source="qkv")
    for name, part in (("k", k), ("v", v)):
        check_shape(part, name, f"B S {kv_width}", (B, T, K * H), op="split", source="qkv")
    q = split_heads(q, "q", "B T N H", N, cfg)
    k = split_heads(k, "k", f"B S {kv_axis} H", K, cfg)
    v = split_heads(v, "v", f"B S {kv_axis} H", K, cfg)
    q, k = normalize_qk(cfg, q, k, dtype)
    return q, k, v


def _int_per_token(name: str, value, axes: str, dims) -> jnp.ndarray:
    value = jnp.asarray(value)
    expect_integer(name, value.dtype)
    expect_shape(name, value.shape, axes, dims)
    return value


class CausalSelfAttention(nn.Module):
    r"""Causal self-attention with grouped-query heads, RoPE, a sliding window,
    soft-capping, QK norm and a KV cache; a drop-in for the NanoMoE seed module.

    .. math::

       y = \mathrm{out}\Big(\mathrm{concat}_n\, \mathrm{softmax}_{j \in \mathrm{allowed}(i)}
           \big(c \tanh(q_{in} \cdot k_{j,n/G} / (c \sqrt{H}))\big)\, v_{j,n/G}\Big)

    with ``[q | k | v] = qkv(x)`` (columns [Q (N*H) | K (K*H) | V (K*H)]),
    ``q, k`` RMS-normalised per head (``qk_norm``) and then rotated by RoPE at
    their positions (``rope_base``), query head n reading key/value head
    ``n // G``, and ``c = logit_soft_cap`` (no tanh when None). Query i may
    see key j iff ``j <= i``, ``i - left <= j <= i + right`` (``window``),
    the ``mask`` allows it and, when packing, both have the same segment id.

    Parameters, with K = N and ``use_bias=True`` exactly the seed's
    (``Dense_0`` -> ``qkv``, ``Dense_1`` -> ``out``)::

        {"qkv": {"kernel": (D, (N + 2K) H), "bias": ((N + 2K) H,)},   # (D, 3D) when K = N
         "out": {"kernel": (D, D), "bias": (D,)},
         "q_norm": {"scale": (H,)}, "k_norm": {"scale": (H,)}}        # with qk_norm only

    **Decoding** (the flax convention): ``layer.init(key, jnp.zeros((B,
    max_len, D)), decode=True)`` also returns a ``"cache"`` collection of
    capacity ``max_len`` with every row at position 0 (see
    ``nanoattn.linen._cache``). Each ``layer.apply({"params": p, "cache": c},
    chunk, decode=True, mutable=["cache"])`` takes a chunk of any length
    L >= 1 (a prompt, one token, anything between), writes its keys and values
    at each row's position, attends causally with the row's position as
    ``q_offset`` over the keys written so far, and advances the row by
    ``lengths[b]`` (default L). Outputs equal those of one causal call on the
    whole sequence. A write past the capacity raises ValueError when the
    position is concrete; under ``jit`` it cannot raise, and the overflowing
    rows' outputs are NaN instead (their excess tokens are not stored).

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
      {'cache': {'key': (2, 8, 2, 32), 'position': (2,), 'value': (2, 8, 2, 32)},
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

        Returns:
          (B, T, D) in the compute dtype (``config.dtype``, else ``x``'s).

        Raises:
          ValueError: a shape or argument error, or (concrete positions only)
            a chunk that does not fit in the cache.
        """
        cfg = AttentionConfig.from_config(self.config)
        expect_shape("x", jnp.shape(x), "B T D", (None, None, cfg.d_model))
        B, T, D = x.shape
        check_shape(x, "input", "B T D", (B, T, D), op="input")
        dtype = compute_dtype(cfg, x)
        options = core_options(cfg, positional=True)
        if decode:
            for name, value in (("positions", positions), ("segment_ids", segment_ids)):
                if value is not None:
                    raise ValueError(
                        f"{name} is not supported with decode=True: the cache keeps each "
                        f"row's position (use lengths for ragged rows)"
                    )
            return self._decode(cfg, x, deterministic, dtype, mask, lengths, options)
        if lengths is not None:
            raise ValueError(
                "lengths only applies with decode=True; in full-sequence mode pass a "
                "padding mask or segment_ids"
            )
        if positions is None:
            positions = jnp.arange(T)
        elif jnp.ndim(positions) == 1:
            positions = _int_per_token("positions", positions, "T", (T,))
        else:
            positions = _int_per_token("positions", positions, "B T", (B, T))
        if segment_ids is not None:
            segment_ids = _int_per_token("segment_ids", segment_ids, "B T", (B, T))
            options |= {"q_segment_ids": segment_ids, "kv_segment_ids": segment_ids}
        q, k, v = _project_qkv(cfg, x, dtype)
        q, k = rotate_qk(cfg, q, k, positions)
        return attend(
            self, q, k, v, cfg, deterministic, dtype, mask=mask, is_causal=True, **options
        )

    def _decode(self, cfg: AttentionConfig, x, deterministic, dtype, mask, lengths, options):
        """One call of decode mode: create the cache (init), or write a chunk and attend."""
        B, T, D = x.shape
        K, H = cfg.kv_heads, cfg.head_dim
        cache_k, cache_v, cache_pos, fresh = _cache.cache_variables(self, B, T, K, H, dtype)
        if fresh:  # init: an empty cache of capacity T; the output is the full forward of x
            q, k, v = _project_qkv(cfg, x, dtype)
            q, k = rotate_qk(cfg, q, k, jnp.arange(T))
            return attend(
                self, q, k, v, cfg, deterministic, dtype, mask=mask, is_causal=True, **options
            )
        capacity = cache_k.value.shape[1]
        expect_shape("x", x.shape, "B T D", (cache_k.value.shape[0], None, D))
        position = cache_pos.value  # (B,)
        if lengths is None:
            lengths = jnp.full((B,), T, jnp.int32)
        lengths = _int_per_token("lengths", lengths, "B", (B,))
        _cache.check_chunk(position, lengths, T, capacity)
        lengths = jnp.clip(lengths, 0, T)  # under jit, where it could not be checked
        q, k, v = _project_qkv(cfg, x, dtype)
        q, k = rotate_qk(cfg, q, k, position[:, None] + jnp.arange(T))  # (B, T) positions
        cache_k.value = _cache.write(cache_k.value, k, position, lengths)
        cache_v.value = _cache.write(cache_v.value, v, position, lengths)
        end = position + lengths  # (B,)
        cache_pos.value = end.astype(jnp.int32)
        # Slots at and past `end` are never read: kv_lengths hides them from every backend.
        y = attend(
            self,
            q,
            cache_k.value,
            cache_v.value,
            cfg,
            deterministic,
            dtype,
            mask=mask,
            is_causal=True,
            q_offset=position,
            kv_lengths=end,
            **options,
        )
        real = jnp.arange(T) < lengths[:, None]  # (B, T)
        y = jnp.where(real[..., None], y, 0)
        overflow = end > capacity  # only reachable under jit: the ValueError above
        return jnp.where(overflow[:, None, None], jnp.nan, y).astype(y.dtype)


MultiHeadAttention = CausalSelfAttention


class CrossAttention(nn.Module):
    r"""Cross-attention: T queries from ``x`` attend to S keys from ``context``.

    .. math::

       y = \mathrm{out}\Big(\mathrm{concat}_n\, \mathrm{softmax}_{j \in \mathrm{allowed}}
           \big(c \tanh(q_{in} \cdot k_{j,n/G} / (c \sqrt{H}))\big)\, v_{j,n/G}\Big)

    with ``q = q(x)``, ``[k | v] = kv(context)`` (columns [K (K*H) | V (K*H)]),
    query head n reading key/value head ``n // G``, q and k RMS-normalised per
    head with ``qk_norm``, and ``c = logit_soft_cap`` (no tanh when None). No
    causal triangle and no cache (the keys do not grow). The positional
    options of the config, ``rope_base`` and ``window``, do not apply between
    two sequences and are ignored. Parameters::

        {"q": {"kernel": (D, D), "bias": (D,)},
         "kv": {"kernel": (D, 2KH), "bias": (2KH,)},                # (D, 2D) when K = N
         "out": {"kernel": (D, D), "bias": (D,)},
         "q_norm": {"scale": (H,)}, "k_norm": {"scale": (H,)}}     # with qk_norm only

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
    def __call__(self, x, context, deterministic: bool = False, *, context_mask=None):
        """Attends each query token to the context tokens.

        Args:
          x: (B, T, D) queries.
          context: (B, S, D) keys and values.
          deterministic: disables dropout (evaluation mode).
          context_mask: optional boolean; either (B, S), True at real context
            tokens, or any mask broadcastable to (B, N, T, S) of rank other than 2.

        Returns:
          (B, T, D) in the compute dtype (``config.dtype``, else ``x``'s).
        """
        cfg = AttentionConfig.from_config(self.config)
        D, N, K, H = cfg.d_model, cfg.n_heads, cfg.kv_heads, cfg.head_dim
        expect_shape("x", jnp.shape(x), "B T D", (None, None, D))
        B, T, _ = x.shape
        expect_shape("context", jnp.shape(context), "B S D", (B, None, D))
        S = context.shape[1]
        mask = context_mask
        if mask is not None and jnp.ndim(mask) == 2:
            expect_bool("context_mask", jnp.result_type(mask))
            expect_shape("context_mask", jnp.shape(mask), "B S", (B, S))
            mask = padding_mask(mask)  # (B, 1, 1, S)

        dtype = compute_dtype(cfg, x)
        kv_axis, kv_width = kv_letters(cfg)
        check_shape(x, "input", "B T D", (B, T, D), op="input")
        check_shape(context, "context", "B S D", (B, S, D), op="input")
        q = dense(cfg, N * H, "q", dtype)(x)
        check_shape(q, "q", "B T D", (B, T, D), op="project", source="input")
        kv = dense(cfg, 2 * K * H, "kv", dtype)(context)
        check_shape(kv, "kv", f"B S 2{kv_width}", (B, S, 2 * K * H), op="project", source="context")
        k, v = jnp.split(kv, 2, axis=-1)  # 2 x (B, S, K*H), in the order [K | V]
        for name, part in (("k", k), ("v", v)):
            check_shape(part, name, f"B S {kv_width}", (B, S, K * H), op="split", source="kv")
        q = split_heads(q, "q", "B T N H", N, cfg)
        k = split_heads(k, "k", f"B S {kv_axis} H", K, cfg)
        v = split_heads(v, "v", f"B S {kv_axis} H", K, cfg)
        q, k = normalize_qk(cfg, q, k, dtype)
        options = core_options(cfg, positional=False)
        return attend(self, q, k, v, cfg, deterministic, dtype, mask=mask, **options)
