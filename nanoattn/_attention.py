"""The public functional API: ``dot_product_attention`` and ``attention_weights``."""

import jax.numpy as jnp

from . import _dispatch, _flash, _reference
from ._dropout import check_dropout
from ._registry import Implementation, get
from ._spec import attention_spec
from ._validate import check_scale, check_tiles


def dot_product_attention(
    query,
    key,
    value,
    *,
    mask=None,
    bias=None,
    is_causal: bool = False,
    q_offset=None,
    kv_lengths=None,
    window=None,
    q_segment_ids=None,
    kv_segment_ids=None,
    logit_soft_cap: float | None = None,
    scale: float | None = None,
    dropout_rate: float = 0.0,
    dropout_rng=None,
    implementation: Implementation | None = None,
):
    r"""Multi-head scaled dot-product attention.

    .. math::

       \mathrm{out}_{btnh} = \sum_s P_{bnts} \, V_{bskh}, \qquad
       P_{bnt\cdot} = \mathrm{softmax}_{s \in \mathrm{allowed}}
         \Big(\mathrm{scale} \sum_h Q_{btnh} K_{bskh} + \mathrm{bias}_{bnts}\Big)

    where key/value head ``k = n // G`` serves query head ``n`` (``G = N / K``).
    The axis letters (docs/conventions.md): B batch, T query time, S key/value
    time, N query heads, K key/value heads, H head width.

    With ``logit_soft_cap`` the logits become ``cap * tanh(logits / cap)``
    before masking and the softmax (Gemma 2).

    A key is allowed when ``mask``, the causal rule, the window, ``kv_lengths``
    and the segment ids all allow it (they combine by AND). Differences from
    other libraries:

    * causality and windows are positional: query i sits at position
      ``p = q_offset + i``; causality lets it see key j iff ``j <= p``, a
      window ``(left, right)`` iff ``p - left <= j <= p + right``. With T != S,
      ``q_offset`` must be given (0 = top-left like ``jax.nn``, S - T =
      bottom-right like FlashAttention);
    * a query row with no allowed key returns zeros (``jax.nn`` and flax
      return the mean of V), with zero, finite gradients;
    * content that no query may see is never read: NaN or inf in a key or
      value past ``kv_lengths`` (an unwritten cache slot), outside every
      window or in another segment, in the bias at a blocked cell, or in a
      query that sees no key, does not reach the output;
    * the mask must be boolean, True = may attend (a float mask raises).

    The softmax runs in at least float32; the output has the query's dtype.

    Args:
      query: (B, T, N, H).
      key: (B, S, K, H), K dividing N (grouped-query attention when K < N).
      value: (B, S, K, H).
      mask: optional boolean, broadcastable to (B, N, T, S).
      bias: optional float, broadcastable to (B, N, T, S), added to the
        scaled logits.
      is_causal: apply the positional causal mask.
      q_offset: position of the first query; int, or int array () or (B,).
        Defaults to 0 when T == S; only with ``is_causal`` or ``window``.
      kv_lengths: optional int array (B,): key j of row b is valid iff
        ``j < kv_lengths[b]``.
      window: local attention: an int ``w`` (meaning ``(w, w)``) or a pair
        ``(left, right)`` of ints >= 0; combine with ``is_causal`` for causal
        sliding-window attention (then ``right`` has no effect).
      q_segment_ids: optional int (B, T); with ``kv_segment_ids`` (B, S), a
        query may see a key only when their ids are equal (packed sequences).
      kv_segment_ids: optional int (B, S); both segment arguments or neither.
      logit_soft_cap: optional float > 0, the cap of ``cap * tanh(s / cap)``.
      scale: factor on ``q . k``; defaults to ``1 / sqrt(H)``.
      dropout_rate: dropout on the weights (inverted scaling); 0 disables it.
      dropout_rng: a ``jax.random`` key, needed when ``dropout_rate > 0``.
      implementation: ``"xla"`` (the reference: full score tensor, every
        feature), ``"flash"`` (blockwise kernel, O(T) memory, no dropout),
        ``"native"`` (C++ CPU kernel, float32, O(T) memory, no dense mask,
        bias or dropout; built on first use),
        ``"cudnn"`` (NVIDIA GPUs, half precision), or None to choose the
        fastest one that can serve the call (docs/performance.md). A named
        implementation that cannot serve the call raises ValueError.

    Returns:
      (B, T, N, H), the query's dtype.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> q = k = v = jnp.ones((2, 5, 4, 32))
      >>> dot_product_attention(q, k, v, is_causal=True).shape
      (2, 5, 4, 32)
    """
    check_dropout(dropout_rate, dropout_rng)
    scale = check_scale(scale)
    spec = attention_spec(
        query,
        key,
        value,
        mask=mask,
        bias=bias,
        is_causal=is_causal,
        q_offset=q_offset,
        kv_lengths=kv_lengths,
        window=window,
        q_segment_ids=q_segment_ids,
        kv_segment_ids=kv_segment_ids,
        logit_soft_cap=logit_soft_cap,
        scale=scale,
    )
    query, key, value = jnp.asarray(query), jnp.asarray(key), jnp.asarray(value)
    backend = get(_dispatch.choose(implementation, spec, query.dtype, dropout_rate))
    return backend(query, key, value, spec, dropout_rate=dropout_rate, dropout_rng=dropout_rng)


def attention_weights(
    query,
    key,
    *,
    mask=None,
    bias=None,
    is_causal: bool = False,
    q_offset=None,
    kv_lengths=None,
    window=None,
    q_segment_ids=None,
    kv_segment_ids=None,
    logit_soft_cap: float | None = None,
    scale: float | None = None,
):
    r"""The normalised attention weights of :func:`dot_product_attention`.

    ``P_{bnts} = softmax_s(scale * q . k + bias)`` over the allowed keys, exactly
    0 at blocked keys; a row with no allowed key is all zeros. Every argument
    follows the rules of :func:`dot_product_attention`.

    Args:
      query: (B, T, N, H).
      key: (B, S, K, H), K dividing N.

    Returns:
      (B, N, T, S), the query's dtype. Every row with an allowed key sums to 1.

    Example:
      >>> import jax.numpy as jnp
      >>> w = attention_weights(jnp.ones((1, 3, 1, 4)), jnp.ones((1, 3, 1, 4)), is_causal=True)
      >>> print(w[0, 0])
      [[1.         0.         0.        ]
       [0.5        0.5        0.        ]
       [0.33333334 0.33333334 0.33333334]]
    """
    scale = check_scale(scale)
    spec = attention_spec(
        query,
        key,
        mask=mask,
        bias=bias,
        is_causal=is_causal,
        q_offset=q_offset,
        kv_lengths=kv_lengths,
        window=window,
        q_segment_ids=q_segment_ids,
        kv_segment_ids=kv_segment_ids,
        logit_soft_cap=logit_soft_cap,
        scale=scale,
    )
    query, key = jnp.asarray(query), jnp.asarray(key)
    return _reference.weights(query, key, spec).astype(query.dtype)


def flash_attention(
    query,
    key,
    value,
    *,
    mask=None,
    bias=None,
    is_causal: bool = False,
    q_offset=None,
    kv_lengths=None,
    window=None,
    q_segment_ids=None,
    kv_segment_ids=None,
    logit_soft_cap: float | None = None,
    scale: float | None = None,
    forward_tiles: tuple[int, int, int] | None = None,
    backward_tiles: tuple[int, int, int] | None = None,
):
    """:func:`dot_product_attention` with ``implementation="flash"`` and its tiles exposed.

    The blockwise kernel (docs/performance.md): same arguments, same output
    contract, no dropout. ``forward_tiles`` and ``backward_tiles`` are
    ``(block_q, block_k, lanes)`` for each pass: block sizes along T and S
    (capped at T and S) and the number of block pairs processed side by side
    per step. By default they are sized for the call from tiles measured on
    a 2-core CPU.

    Example:
      >>> import jax.numpy as jnp
      >>> q = k = v = jnp.ones((1, 300, 2, 16))
      >>> flash_attention(q, k, v, is_causal=True, forward_tiles=(64, 128, 2)).shape
      (1, 300, 2, 16)
    """
    forward_tiles = check_tiles("forward_tiles", forward_tiles)
    backward_tiles = check_tiles("backward_tiles", backward_tiles)
    scale = check_scale(scale)
    spec = attention_spec(
        query, key, value, mask=mask, bias=bias, is_causal=is_causal, q_offset=q_offset,
        kv_lengths=kv_lengths, window=window, q_segment_ids=q_segment_ids,
        kv_segment_ids=kv_segment_ids, logit_soft_cap=logit_soft_cap, scale=scale,
    )  # fmt: skip
    query, key, value = jnp.asarray(query), jnp.asarray(key), jnp.asarray(value)
    _dispatch.choose("flash", spec, query.dtype, 0.0)  # raises if the kernel cannot serve
    return _flash.flash_attention(
        query, key, value, spec, forward_tiles=forward_tiles, backward_tiles=backward_tiles
    )
