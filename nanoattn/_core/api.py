"""The public functional API: ``dot_product_attention``, ``attention_weights`` and
``flash_attention``; each turns its keywords into one :class:`~.base.rules.Rules`
(:meth:`Rules.make`) and hands it on (:func:`attend`)."""

import dataclasses
import functools

import jax
import jax.numpy as jnp

from .._backends import dispatch
from .._backends.registry import Implementation, get
from .._base.debug import one_program
from .._base.dropout import check_dropout
from .._base.numerics import softmax_dtype
from .._base.paged import split_pool
from .._base.quantized import is_quantized
from .._base.rules import ARGUMENTS, Rules, batched, combined_cache, poison_rows
from .._base.validate import check_scale, check_tiles
from .eager import cacheable, is_eager
from .merge import add_sinks


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
    mask_fn=None,
    score_fn=None,
    sinks=None,
    return_residual: bool = False,
    key_scales=None,
    value_scales=None,
    tree_parents=None,
    key_indices=None,
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
      query: (B, T, N, H), or unbatched (T, N, H) as ``jax.nn`` takes it (then key
        and value are (S, K, H), a mask or bias broadcastable to (N, T, S),
        ``kv_lengths`` a scalar, segment ids (T,) and (S,), and the results lose
        the batch axis too); ``jax.vmap`` over a batch axis gives such calls.
      key: (B, S, K, H), K dividing N (grouped-query attention when K < N); or one
        combined cache (B, S, 2, K, H) with ``value`` None: each slot's keys then its
        values (``key[:, :, 0]`` and ``key[:, :, 1]``), which ``"native"`` reads in
        place for a decoding step (docs/conventions.md).
      value: (B, S, K, H), or None with a combined ``key``.
      mask: optional boolean, broadcastable to (B, N, T, S).
      bias: optional float, broadcastable to (B, N, T, S), added to the
        scaled logits.
      is_causal: apply the positional causal mask.
      q_offset: position of the first query; int, or int array () or (B,).
        Defaults to 0 when T == S; only with ``is_causal`` or ``window``.
      kv_lengths: optional int array (B,) of values in [0, S]: key j of row b is
        valid iff ``j < kv_lengths[b]``. A value outside [0, S] raises ValueError
        naming the row; under ``jit``, where it cannot be checked, that row's output
        (and log-sum-exp) is NaN and no other row changes.
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
      mask_fn: ``mask_fn(b, n, q_pos, k_pos) -> bool``, any mask as a function
        of a score cell's indices: int32 arrays that broadcast to (B, N, T, S)
        (or to a block of it): the batch row, the query head, the query's
        position ``q_offset + i`` (``q_offset`` defaults to 0 here, per row when
        it is per row) and the key's position j. True = may attend. It must be
        elementwise and may close over arrays (document ids, per-head widths);
        it is ANDed with every other rule. A :func:`nanoattn.block_mask` of it
        carries its block classification for reuse. The blockwise kernel skips
        the blocks it hides entirely (docs/masks.md).
      score_fn: ``score_fn(score, b, n, q_pos, k_pos) -> score``: modifies the
        float32 scores after ``scale`` and ``bias``, before ``logit_soft_cap``
        (ALiBi, relative biases); elementwise, differentiable (gradients reach
        q, k and the arrays it closes over).
      sinks: optional float (N,), one logit per query head: each row's softmax
        denominator gains ``exp(sinks[n])`` and no value is attended for it
        (attention sinks, gpt-oss); differentiable. A row with no visible key
        still gives zeros.
      return_residual: also return the log-sum-exp of each row's logits, as
        ``jax.nn.dot_product_attention`` does (docs/conventions.md): gradients
        flow through both results; with ``sinks`` the sink is in the sum.
      key_scales, value_scales: float (B, S, K), the scales of quantized keys and
        values (:func:`nanoattn.quantize_kv`): key and value are then int8 or
        float8_e4m3fn and token s of head k stands for ``key[b, s, k] *
        key_scales[b, s, k]``; both or neither. The scores and the softmax stay in
        at least float32; a NaN scale is a NaN token (visible where it is seen).
        Served by ``"xla"`` (dequantized first) and ``"flash"`` (per key block);
        gradients through ``"flash"`` raise (the reference differentiates the query
        and the scales).
      tree_parents: optional int (B, T): speculative decoding with a token tree: each
        query token's parent within the call's chunk of queries (-1: the last committed
        token, at ``q_offset - 1``). Token i sits at position ``q_offset + depth(i)``
        (its key in slot ``q_offset + i``); inside the chunk it sees exactly its
        ancestors and itself, before it what the other rules say at those positions
        (docs/conventions.md, "Token trees"). A parent at or after its child raises
        ValueError when concrete; under ``jit`` that row is NaN.
      key_indices: optional int (B, T, k): sparse attention over chosen keys (DeepSeek
        Sparse Attention's top-k): the key positions each query may read, -1 for an
        unused entry; a selected key is seen where causality, the window and
        ``kv_lengths`` let it be, an index selected twice counts once
        (docs/conventions.md, "Selected keys"). ``"flash"`` and ``"native"`` read only
        the selected keys. An index outside [-1, S) raises ValueError when concrete;
        under ``jit`` its batch row is NaN. Not with ``mask``, ``bias``, segment ids,
        ``mask_fn``, ``score_fn`` or ``tree_parents``.
      implementation: ``"xla"`` (the reference: full score tensor, every
        feature), ``"flash"`` (blockwise kernel, O(T) memory, no dropout),
        ``"native"`` (C++ CPU kernel, float32, O(T) memory, no dense mask,
        bias or dropout; built on first use),
        ``"cudnn"`` (NVIDIA GPUs, half precision), or None to choose the
        fastest one that can serve the call (docs/performance.md). A named
        implementation that cannot serve the call raises ValueError.

    Returns:
      (B, T, N, H), the query's dtype; with ``return_residual``, ``(out, lse)``
      with ``lse`` (B, T, N) in the softmax's dtype (float32, or float64 for
      float64 inputs): ``log sum_s exp(logit_s)`` over the visible keys, ``-inf``
      for a row that sees none (with ``sinks``: the sink's logit there).

    Example:
      >>> import jax, jax.numpy as jnp
      >>> q = k = v = jnp.ones((2, 5, 4, 32))
      >>> dot_product_attention(q, k, v, is_causal=True).shape
      (2, 5, 4, 32)
    """
    check_dropout(dropout_rate, dropout_rng)
    call = _Call.of(query, key, value, _rule_arguments(locals()), combined=value is None)
    out = attend(
        call.query, call.key, call.value, call.rules, implementation=implementation,
        dropout_rate=dropout_rate, dropout_rng=dropout_rng,
    )  # fmt: skip
    return call.unbatch(out)


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
    mask_fn=None,
    score_fn=None,
    sinks=None,
    tree_parents=None,
    key_indices=None,
):
    r"""The normalised attention weights of :func:`dot_product_attention`.

    ``P_{bnts} = softmax_s(scale * q . k + bias)`` over the allowed keys, exactly
    0 at blocked keys; a row with no allowed key is all zeros. Every argument
    follows the rules of :func:`dot_product_attention` (``mask_fn``, ``score_fn``
    and ``sinks`` included; with sinks a row sums to less than 1).

    Args:
      query: (B, T, N, H), or unbatched (T, N, H).
      key: (B, S, K, H), K dividing N; (S, K, H) with an unbatched query.

    Returns:
      (B, N, T, S), the query's dtype ((N, T, S) unbatched). Every row with an
      allowed key sums to 1 (without ``sinks``).

    Example:
      >>> import jax.numpy as jnp
      >>> w = attention_weights(jnp.ones((1, 3, 1, 4)), jnp.ones((1, 3, 1, 4)), is_causal=True)
      >>> print(w[0, 0])
      [[1.         0.         0.        ]
       [0.5        0.5        0.        ]
       [0.33333334 0.33333334 0.33333334]]
    """
    call = _Call.of(query, key, None, _rule_arguments(locals()))

    def run(query, key, rules):
        weights = get("xla").weights(query, key, rules).astype(query.dtype)
        return poison_rows(weights, rules.broken_rows())

    weights = one_program(run, call.query, call.key, call.rules)
    return weights[0] if call.unbatched else weights


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
    mask_fn=None,
    score_fn=None,
    sinks=None,
    return_residual: bool = False,
    tree_parents=None,
    key_indices=None,
    forward_tiles: tuple[int, int, int] | None = None,
    backward_tiles: tuple[int, int, int] | None = None,
):
    """:func:`dot_product_attention` with ``implementation="flash"`` and its tiles exposed.

    The blockwise kernel (docs/performance.md): same arguments, same output
    contract (``return_residual`` and unbatched inputs included), no dropout.
    ``forward_tiles`` and ``backward_tiles`` are ``(block_q, block_k, lanes)``
    for each pass: block sizes along T and S (capped at T and S) and the number
    of block pairs processed side by side per step. By default they are sized
    for the call from tiles measured on a 2-core CPU.

    Example:
      >>> import jax.numpy as jnp
      >>> q = k = v = jnp.ones((1, 300, 2, 16))
      >>> flash_attention(q, k, v, is_causal=True, forward_tiles=(64, 128, 2)).shape
      (1, 300, 2, 16)
    """
    tiles = (check_tiles("forward_tiles", forward_tiles),
             check_tiles("backward_tiles", backward_tiles))  # fmt: skip
    call = _Call.of(query, key, value, _rule_arguments(locals()))
    result = attend(call.query, call.key, call.value, call.rules, implementation="flash",
                    tiles=tiles)  # fmt: skip
    return call.unbatch(result)


def attend(query, key, value, rules: Rules, *, implementation=None, dropout_rate=0.0,
           dropout_rng=None, tiles=None):  # fmt: skip
    """Attention under ``rules`` by the backend ``implementation`` (None: the automatic
    choice): what :func:`dot_product_attention` and ``paged_attention`` compute once
    their keywords are :class:`Rules`. query (B, T, N, H), key and value (B, S, K, H),
    batched; for a paged call (``rules.paged``) query (Tq, N, H) and the pool's pages
    (P, page_size, K, H). ``tiles``: a blockwise kernel's ``(forward_tiles,
    backward_tiles)`` (:func:`flash_attention`).

    Returns:
      (B, T, N, H) in the query's dtype; with ``rules.return_residual`` also the
      log-sum-exp (B, T, N).
    """
    backend = get(dispatch.choose(implementation, rules, query.dtype, dropout_rate))
    arrays = (query, key, value, rules, dropout_rng)
    if is_eager(*arrays) and (kept := cacheable(rules)) is not None:
        # compiled once for the call's static parts (nanoattn/_core/eager.py)
        return _compiled(backend, dropout_rate, tiles, query, key, value, kept, dropout_rng)
    return one_program(functools.partial(_run, backend, dropout_rate, tiles), *arrays)


def _run(backend, dropout_rate, tiles, query, key, value, rules, dropout_rng):
    """:func:`attend`'s work once its backend is chosen: a paged call through the
    backend's ``paged``, a dense one through the backend itself."""
    if value is None and not getattr(backend, "reads_combined", False):
        key, value = split_pool(key)  # a combined cache or pool: its two halves
    if rules.paged:
        kernel = backend.paged
    else:
        options = {} if tiles is None else {"tiles": tiles}
        kernel = functools.partial(
            backend, dropout_rate=dropout_rate, dropout_rng=dropout_rng, **options
        )
    sinks_inside = getattr(backend, "applies_sinks", False)
    result = _with_sinks(kernel, query, key, value, rules, sinks_inside)
    return poison_rows(result, rules.broken_rows())


# Eager calls as jitted programs, kept by jit's cache: the backend (a registered one by
# identity, so another under the same name compiles anew), the rate and the tiles are
# static.
_compiled = jax.jit(_run, static_argnums=(0, 1, 2))


def _rule_arguments(arguments: dict) -> dict:
    """The rule keywords (:data:`~.base.rules.ARGUMENTS`) among a public function's
    arguments (its ``locals()``), so the list is written once, in ``rules.py``."""
    return {name: arguments[name] for name in ARGUMENTS if name in arguments}


def _with_sinks(kernel, query, key, value, rules: Rules, sinks_inside: bool):
    """``kernel(query, key, value, rules)``; when the call has ``sinks`` and the kernel
    does not apply them itself, the kernel attends over the keys alone and the sinks
    are merged into its output through its log-sum-exp."""
    if rules.sinks is None or sinks_inside:
        return kernel(query, key, value, rules)
    keys_only = rules.replace(sinks=None, return_residual=True)
    # In half precision the kernel attends in float32 and the merged output is rounded
    # once: rounding the kernel's output first (and its cotangent on the way back) made
    # the output, dv and dsinks several times less accurate than the reference's.
    dtype = query.dtype
    wide = softmax_dtype(dtype, key.dtype)  # value None: key a combined cache or pool
    # quantized keys and values stay as they are: the kernel reads them with their scales
    q, k, v = (x if x is None or is_quantized(x) else x.astype(wide)
               for x in (query, key, value))  # fmt: skip
    out, lse = kernel(q, k, v, keys_only)
    out, lse = add_sinks(out, lse, rules.sinks)
    out = out.astype(dtype)
    return (out, lse) if rules.return_residual else out


@dataclasses.dataclass(frozen=True)
class _Call:
    """One call of the functional API, validated: batched arrays and their rules.

    Attributes:
      query: (B, T, N, H); key, value: (B, S, K, H) (value None for the weights).
      rules: the call's :class:`~nanoattn._base.rules.Rules`.
      unbatched: the call came as query (T, N, H), key and value (S, K, H), as
        ``jax.nn.dot_product_attention`` also takes it; B = 1 here, and
        :meth:`unbatch` takes the axis off the results.
    """

    query: jax.Array
    key: jax.Array
    value: jax.Array | None
    rules: Rules
    unbatched: bool

    @classmethod
    def of(cls, query, key, value, arguments: dict, combined: bool = False) -> "_Call":
        """The call of ``query``, ``key``, ``value`` and the rule keywords ``arguments``;
        ``combined``: ``key`` one combined cache (B, S, 2, K, H) (value None), checked
        as its two halves' shapes (no slice taken) and kept whole."""
        arguments = dict(arguments, scale=check_scale(arguments.get("scale")))
        if combined:
            cache, half = combined_cache(query, key)
            call = batched(query, half, half, **arguments)
            return cls(call.query, cache, None, Rules.make(call.query, half, half, **call.rules),
                       False)  # fmt: skip
        call = batched(query, key, value, **arguments)
        rules = Rules.make(call.query, call.key, call.value, **call.rules)
        key = jnp.asarray(call.key)
        value = None if call.value is None else jnp.asarray(call.value)
        return cls(call.query, key, value, rules, call.unbatched)

    def unbatch(self, result):
        """The output (and log-sum-exp) without the batch axis an unbatched call gained."""
        if not self.unbatched:
            return result
        return jax.tree.map(lambda x: x[0], result)
