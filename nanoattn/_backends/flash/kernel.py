"""Blockwise ("flash") attention in pure JAX: online softmax, O(T) memory.

The forward pass walks the work items of :mod:`nanoattn._backends.flash.schedule` (pairs of
a query block and a key block) and keeps, per query row, the running maximum
``m``, the running sum ``l`` of ``exp(logit - m)`` and the running weighted
sum of values (FlashAttention-2). It saves only the output and the
log-sum-exp ``m + log l`` per row; the backward pass (a ``jax.custom_vjp``)
recomputes the weights block by block from them, so neither pass holds
anything of size T x S.

Block layout: queries (B, nQ, bq, K, G, H) and keys and values
(B, nK, bk, K, H), free reshapes of the inputs; per-row statistics
(B, nQ, K, G, bq). A step gathers one item per lane (a lane axis L after B)
and turns it head-major, (B, L, K, G, bq, H), for the matrix products.

The semantics are the reference's (docs/conventions.md): positional
causality and sliding windows with ``q_offset``, key lengths, segment ids, a
dense boolean mask and an additive bias sliced per block, logit soft-capping,
grouped-query heads, zeros (and zero gradients) for a row with no visible
key, and softmax statistics in at least float32.
Dropout is not supported here: the dispatcher sends it to the reference.

The interface, also used by the ring (:mod:`nanoattn.parallel._blocks`): a
call's arrays are a :class:`BlockInputs` (queries, keys, values and the call's
:class:`~nanoattn._base.rules.Rules`), its static part a
:class:`~nanoattn._backends.flash.plan.Plan` per pass; :func:`forward_block` returns the
output and the log-sum-exp, :func:`backward_block` takes them back as
:class:`Residuals` and returns :class:`BlockGrads`. Within a pass the rules' arrays
are cut into the pass's blocks once (:class:`RuleBlocks`), and every helper reads them
from there.
"""

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from ..._base.block_mask import EMPTY, BlockMask, block_mask
from ..._base.mask_fn import closure_converted, evaluate_mask, evaluate_score
from ..._base.numerics import large_negative, softmax_dtype, zero_unseen_keys
from ..._base.quantized import NO_QUANTIZED_GRADIENTS, dequantize, is_quantized
from ..._base.rules import Rules
from ..._base.shard_map import sum_to_varying, varying_like
from .plan import Plan, block_id_ranges, kernel_plans, with_segment_kinds
from .schedule import Schedule
from .step import Layout, Scores, backward_step, finish, forward_step, scores

_ITEM = "BLKGqk"  # the axes of one step's scores: batch, lane, kv head, group, query, key
# A step's blocks: queries (and the output and its cotangent) head-major (B, L, K, G, bq,
# H), keys and values (B, L, K, bk, H); the gradients of queries, keys and values come
# out in the layout of their blocks, (B, L, bq, K, G, H) and (B, L, bk, K, H).
_LAYOUT = Layout(
    scores=f"BLKGqH,BLKkH->{_ITEM}",
    values=f"{_ITEM},BLKkH->BLKGqH",
    d_weights=f"BLKGqH,BLKkH->{_ITEM}",
    d_queries=f"{_ITEM},BLKkH->BLqKGH",
    d_keys=f"{_ITEM},BLKGqH->BLkKH",
    d_values=f"{_ITEM},BLKGqH->BLkKH",
)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class BlockInputs:
    """The arrays of one kernel call (a pytree), named; what is static about the call
    (causality, window, soft-cap, scale, tiles, mask_fn, score_fn) is in its
    :class:`Plan`.

    Attributes:
      query: (B, T, N, H).
      key, value: (B, S, K, H).
      rules: the call's :class:`~nanoattn._base.rules.Rules`, whose arrays the
        kernel reads: a bias and a dense mask (rank 4, broadcastable to (B, N, T, S)),
        a traced offset (int () or (B,), read when the plan has no static one), key
        lengths (B,), segment ids (B, T) and (B, S). Its functions and sinks are
        left out (:func:`kernel_rules`): the plan holds the functions, and sinks are
        merged outside the kernel.
      kinds: int8 (nQ, nK), a ``mask_fn``'s block classification at the forward
        plan's blocks and ``backward_kinds`` at the backward plan's, when they are
        traced (``plan.traced_kinds``); None otherwise.
      score_consts: the arrays ``score_fn`` closes over, hoisted for the forward
        and for the backward plan's ``score_fn`` (a pair of tuples; gradients flow
        to them); None without ``score_fn``.
      index_shift: int (), added to the query and the key positions ``mask_fn`` and
        ``score_fn`` see (not to the positional rule's, which are relative): the
        global position of the first key when the call is one piece of a longer
        sequence (the ring's chunk pairs); None means 0.
    """

    query: jax.Array
    key: jax.Array
    value: jax.Array
    rules: Rules
    kinds: jax.Array | None = None
    backward_kinds: jax.Array | None = None
    score_consts: tuple | None = None
    index_shift: jax.Array | None = None


class Residuals(NamedTuple):
    """What the backward pass of a block needs from its forward pass.

    Attributes:
      inputs: the block's :class:`BlockInputs`.
      out: (B, T, N, H), the output in the softmax's dtype (not rounded to the
        query's: the row term of the gradient reads it).
      lse: (B, T, N), the log-sum-exp of each row's visible logits; ``-inf`` for a
        row that sees no key.
    """

    inputs: BlockInputs
    out: jax.Array
    lse: jax.Array


def kernel_rules(rules: Rules) -> Rules:
    """``rules`` as :class:`BlockInputs` carries them: without ``mask_fn``, ``score_fn``
    (the plan holds them, ``score_fn`` closure-converted) and ``sinks`` (merged outside
    the kernel), so that nothing in them closes over the caller's traced arrays."""
    return rules.replace(mask_fn=None, score_fn=None, sinks=None)


class BlockGrads(NamedTuple):
    """Gradients of a block: dq (B, T, N, H), dk and dv (B, S, K, H) in the inputs'
    dtypes, dbias in the bias's shape and dtype (None without a bias), and those of
    ``score_fn``'s hoisted arrays, as ``BlockInputs.score_consts`` (None without)."""

    query: jax.Array
    key: jax.Array
    value: jax.Array
    bias: jax.Array | None
    score_consts: tuple | None = None


def _pad(x, axis: int, size: int, value=0):
    extra = size - x.shape[axis]
    if extra == 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, extra)
    return jnp.pad(x, widths, constant_values=value)


def _query_blocks(x, plan: Plan, dtype):
    """(B, T, N, H) -> (B, nQ, bq, K, G, H): a reshape, no copy unless T is padded (H:
    the width of ``x``, Hv for the output's cotangent)."""
    x = _pad(x.astype(dtype), 1, plan.n_q * plan.block_q)
    return x.reshape(plan.B, plan.n_q, plan.block_q, plan.K, plan.G, x.shape[-1])


def _key_blocks(x, plan: Plan, dtype):
    """(B, S, K, H) -> (B, nK, bk, K, H): a reshape, no copy unless S is padded (H: the
    width of ``x``, Hv for values). Quantized keys and values keep their dtype: each
    step dequantizes its blocks."""
    x = _pad(x if is_quantized(x) else x.astype(dtype), 1, plan.n_k * plan.block_k)
    return x.reshape(plan.B, plan.n_k, plan.block_k, plan.K, x.shape[-1])


def _take_queries(blocks, qi, scale=None):
    """Each lane's query block, head-major: (B, L, K, G, bq, H), times ``scale`` if given
    (before the transpose, so that the transpose stays a plain copy)."""
    taken = jnp.take(blocks, qi, axis=1)
    return jnp.einsum("BLqKGH->BLKGqH", taken if scale is None else taken * scale)


def _take_keys(blocks, kj):
    """Each lane's key block, head-major: (B, L, K, bk, H)."""
    return jnp.einsum("BLkKH->BLKkH", jnp.take(blocks, kj, axis=1))


def _unblock_queries(x, plan: Plan):
    """(B, nQ, bq, K, G, H) -> (B, T, N, H) (H: the width of ``x``)."""
    x = x.reshape(plan.B, plan.n_q * plan.block_q, plan.K * plan.G, x.shape[-1])  # (B, Tpad, N, H)
    return x[:, : plan.T]


def _row_blocks(x, plan: Plan):
    """Per-row statistics (B, T, K, G) -> (B, nQ, K, G, bq)."""
    x = _pad(x, 1, plan.n_q * plan.block_q)
    x = x.reshape(plan.B, plan.n_q, plan.block_q, plan.K, plan.G)  # (B, nQ, bq, K, G)
    return jnp.einsum("BnqKG->BnKGq", x)


def _unblock_rows(x, plan: Plan):
    """(B, nQ, K, G, bq) -> (B, T, K, G)."""
    x = jnp.einsum("BnKGq->BnqKG", x).reshape(plan.B, -1, plan.K, plan.G)
    return x[:, : plan.T]


def _pair_blocks(x, plan: Plan, fill):
    """A mask or bias (xB, xN, xT, xS), each axis 1 or full, as blocks
    (xB, xN, nQ or 1, bq or 1, nK or 1, bk or 1)."""
    xB, xN, xT, xS = x.shape
    if xT > 1:
        x = _pad(x, 2, plan.n_q * plan.block_q, fill)
    if xS > 1:
        x = _pad(x, 3, plan.n_k * plan.block_k, fill)
    rows = (plan.n_q, plan.block_q) if xT > 1 else (1, 1)
    cols = (plan.n_k, plan.block_k) if xS > 1 else (1, 1)
    return x.reshape(xB, xN, *rows, *cols)


def _gather_pairs(blocks, qi, kj, plan: Plan):
    """The blocks of each lane's item: (xB, L, K or 1, G or 1, bq or 1, bk or 1)."""
    qi = qi if blocks.shape[2] > 1 else jnp.zeros_like(qi)
    kj = kj if blocks.shape[4] > 1 else jnp.zeros_like(kj)
    picked = blocks[:, :, qi, :, kj, :]  # (L, xB, xN, bq', bk'): advanced axes come first
    picked = jnp.moveaxis(picked, 0, 1)  # (xB, L, xN, bq', bk')
    heads = (plan.K, plan.G) if picked.shape[2] > 1 else (1, 1)
    return picked.reshape(*picked.shape[:2], *heads, *picked.shape[3:])


def _scatter_pairs(blocks, qi, kj, grad):
    """Adds an item gradient (B, L, K, G, bq, bk), summed to the blocks' broadcast
    shape, into ``blocks`` at each lane's item."""
    xB, xN, nq, bq, nk, bk = blocks.shape
    axes = tuple(
        a
        for a, keep in [(0, xB > 1), (2, xN > 1), (3, xN > 1), (4, bq > 1), (5, bk > 1)]
        if not keep
    )
    grad = grad.sum(axis=axes, keepdims=True)
    grad = grad.reshape(grad.shape[0], grad.shape[1], xN, *grad.shape[4:])  # (xB, L, xN, ., .)
    qi = qi if nq > 1 else jnp.zeros_like(qi)
    kj = kj if nk > 1 else jnp.zeros_like(kj)
    return blocks.at[:, :, qi, :, kj, :].add(jnp.moveaxis(grad, 1, 0))


def _cells(plan: Plan, qc, kj, q_offset, shift):
    """The indices of each lane's item as ``mask_fn`` and ``score_fn`` see them, one
    block of (B, N, T, S) per lane: b (B, 1, 1, 1), n (1, N, 1, 1), q_pos
    (L, 1 or B, 1, bq, 1) and k_pos (L, 1, 1, 1, bk), the last two with a lane axis,
    both moved by ``shift`` (``BlockInputs.index_shift``; None = 0)."""
    N = plan.K * plan.G
    b = jnp.arange(plan.B, dtype=jnp.int32).reshape(plan.B, 1, 1, 1)
    n = jnp.arange(N, dtype=jnp.int32).reshape(1, N, 1, 1)
    offset = plan.index_offset if plan.index_offset is not None else q_offset
    offset = jnp.reshape(jnp.asarray(offset, jnp.int32), (1, -1, 1, 1, 1))  # (1, 1|B, 1, 1, 1)
    rows = qc.astype(jnp.int32)[:, None] * plan.block_q + jnp.arange(plan.block_q)[None]  # (L, bq)
    q = offset + rows[:, None, None, :, None]  # (L, 1|B, 1, bq, 1)
    cols = kj.astype(jnp.int32)[:, None] * plan.block_k + jnp.arange(plan.block_k)[None]
    k = cols[:, None, None, None, :]  # (L, 1, 1, 1, bk)
    if shift is not None:
        shift = jnp.asarray(shift, jnp.int32)
        q, k = q + shift, k + shift
    return b, n, q, k


def _per_lane(fn):
    """``fn(*lane_args, b, n, q, k)`` mapped over the lanes: the lane axis of the
    scores is 1 (B, L, ...), of the positions 0, b and n are shared."""

    def call(lane_args, cells):
        b, n, q, k = cells

        def one(lane_args, q, k):
            return fn(*lane_args, b, n, q, k)

        axes = tuple(1 for _ in lane_args)
        return jax.vmap(one, in_axes=(axes, 0, 0), out_axes=1)(lane_args, q, k)

    return call


def _mask_of(plan: Plan, cells):
    """``mask_fn`` on each lane's item: bool (B or 1, L, K or 1, G or 1, bq, bk)."""

    def one(b, n, q, k):
        m = evaluate_mask(plan.mask_fn, b, n, q, k)  # (xB, xN, bq|1, bk|1)
        return jnp.broadcast_to(m, (*m.shape[:2], plan.block_q, plan.block_k))

    m = _per_lane(one)((), cells)  # (xB, L, xN, bq, bk)
    heads = (plan.K, plan.G) if m.shape[2] > 1 else (1, 1)
    return m.reshape(m.shape[0], m.shape[1], *heads, plan.block_q, plan.block_k)


class RuleBlocks(NamedTuple):
    """The call's rules as one pass reads them, cut into its blocks once.

    Attributes:
      mask: the dense mask as pair blocks (:func:`_pair_blocks`), or None.
      bias: the bias as pair blocks, in the softmax's dtype, or None.
      segments: the segment ids as blocks, (B, nQ, bq) and (B, nK, bk), or None.
      q_offset: the traced position of the first query (int () or (B,)) where the
        plan has no static one, or None.
      kv_lengths: int (B,), or None.
      index_shift: int (), added to the positions ``mask_fn`` and ``score_fn`` see
        (:attr:`BlockInputs.index_shift`), or None.
      key_scales, value_scales: the scales of quantized keys and values as blocks
        (B, nK, bk, K) in the softmax's dtype, or None.
      segment_ranges: each block's smallest and largest segment id, ``(q_min, q_max)``
        (B, nQ) and ``(kv_min, kv_max)`` (B, nK), or None: an item whose two ranges do
        not meet is hidden wholly (:func:`_item_live`).
    """

    mask: jax.Array | None
    bias: jax.Array | None
    segments: tuple | None
    q_offset: jax.Array | None
    kv_lengths: jax.Array | None
    index_shift: jax.Array | None
    key_scales: jax.Array | None = None
    value_scales: jax.Array | None = None
    segment_ranges: tuple | None = None

    @classmethod
    def of(cls, plan: Plan, inputs: BlockInputs, acc) -> "RuleBlocks":
        rules = inputs.rules
        mask, bias = rules.mask, rules.bias
        return cls(
            mask=None if mask is None else _pair_blocks(mask, plan, False),
            bias=None if bias is None else _pair_blocks(bias.astype(acc), plan, 0),
            segments=_segment_blocks(rules.q_segment_ids, rules.kv_segment_ids, plan),
            q_offset=rules.offset,
            kv_lengths=rules.kv_lengths,
            index_shift=inputs.index_shift,
            key_scales=_scale_blocks(rules.key_scales, plan, acc),
            value_scales=_scale_blocks(rules.value_scales, plan, acc),
            segment_ranges=_segment_ranges(rules.q_segment_ids, rules.kv_segment_ids, plan),
        )


def _scale_blocks(scales, plan: Plan, acc):
    """Scales (B, S, K) of quantized keys or values -> (B, nK, bk, K) in ``acc``."""
    if scales is None:
        return None
    scales = _pad(scales.astype(acc), 1, plan.n_k * plan.block_k)
    return scales.reshape(plan.B, plan.n_k, plan.block_k, plan.K)


def _take_dequantized(blocks, scales, kj):
    """Each lane's key (or value) block, head-major (B, L, K, bk, H), dequantized with
    its scales (B, nK, bk, K) in their dtype when it is quantized (None: float)."""
    x = _take_keys(blocks, kj)
    if scales is None:
        return x
    s = jnp.einsum("BLkK->BLKk", jnp.take(scales, kj, axis=1))  # (B, L, K, bk)
    return dequantize(x, s, scales.dtype)


def _allowed(plan: Plan, blocks: RuleBlocks, qi, kj, cells=None):
    """Which cells of each lane's item are visible: bool, broadcastable to
    (B, L, K, G, bq, bk)."""
    k_pos = kj[:, None] * plan.block_k + jnp.arange(plan.block_k)[None, :]  # (L, bk)
    q_pos = qi[:, None] * plan.block_q + jnp.arange(plan.block_q)[None, :]  # (L, bq)
    parts = []
    if plan.band is not None:
        left, right = plan.band
        offset = plan.static_offset if plan.static_offset is not None else blocks.q_offset
        offset = jnp.reshape(jnp.asarray(offset), (-1, 1, 1))  # (1 or B, 1, 1)
        p = (offset + q_pos[None])[..., None]  # (1 or B, L, bq, 1): each query's position
        j = k_pos[None, :, None, :]  # (1, L, 1, bk)
        if right is not None:
            parts.append((j <= p + right)[:, :, None, None])
        if left is not None:
            parts.append((j >= p - left)[:, :, None, None])
    if plan.n_k * plan.block_k > plan.S:
        parts.append((k_pos < plan.S)[None, :, None, None, None, :])
    if plan.n_q * plan.block_q > plan.T:  # padded query rows see nothing, so read nothing
        q_real = q_pos < plan.T  # (L, bq)
        parts.append(q_real[None, :, None, None, :, None])
    if blocks.kv_lengths is not None:
        valid = k_pos[None] < blocks.kv_lengths[:, None, None]  # (B, L, bk)
        parts.append(valid[:, :, None, None, None, :])
    if blocks.mask is not None:
        parts.append(_gather_pairs(blocks.mask, qi, kj, plan))
    if blocks.segments is not None:
        q_ids, kv_ids = blocks.segments  # (B, nQ, bq), (B, nK, bk)
        same = jnp.take(q_ids, qi, axis=1)[..., None] == jnp.take(kv_ids, kj, axis=1)[:, :, None]
        parts.append(same[:, :, None, None])  # (B, L, 1, 1, bq, bk)
    if plan.mask_fn is not None:
        parts.append(_mask_of(plan, cells))
    return functools.reduce(jnp.logical_and, parts)


def _item_keys(plan: Plan, masked: bool, kb, vb, blocks: RuleBlocks, qc, kj):
    """Each lane's keys and values (B, L, K, bk, H), the indices of its cells for
    ``mask_fn`` and ``score_fn`` (None without them) and, for a masked schedule, which
    cells are visible, with the keys and values no query of the item sees zeroed (None
    for a full one): what both passes read of an item before its scores."""
    ks = _take_dequantized(kb, blocks.key_scales, kj)
    vs = _take_dequantized(vb, blocks.value_scales, kj)
    cells = None
    if plan.mask_fn or plan.score_fn:
        cells = _cells(plan, qc, kj, blocks.q_offset, blocks.index_shift)
    allowed = None
    if masked:
        allowed = _allowed(plan, blocks, qc, kj, cells)
        # allowed (B|1, L, K|1, G|1, bq|1, bk|1): no query of the group and block sees
        ks, vs = zero_unseen_keys(ks, allowed, (3, 4)), zero_unseen_keys(vs, allowed, (3, 4))
    return ks, vs, cells, allowed


def _traced_band(plan: Plan, blocks: RuleBlocks) -> bool:
    return plan.band is not None and plan.static_offset is None and blocks.q_offset is not None


def _hides_items(plan: Plan, blocks: RuleBlocks) -> bool:
    """Whether a traced rule can hide a whole item (:func:`_item_live`)."""
    return (
        plan.traced_kinds or blocks.kv_lengths is not None
        or blocks.segment_ranges is not None or _traced_band(plan, blocks)
    )  # fmt: skip


def _item_live(plan: Plan, kinds, blocks: RuleBlocks, qi, kj):
    """Whether the traced rules leave each real (not idle) item of a step, query block
    ``qi`` (L,) and key block ``kj`` (L,), a visible cell in some batch row: bool (L,).
    The traced rules are mask_fn's traced kinds, the key lengths (a block at or past a
    row's length is hidden: a decoding step over a cache does the work of what each row
    holds, not of its capacity), the band of a traced offset (a block above a chunk's
    diagonal is hidden) and the segment ids (a block pair whose id ranges do not meet is
    hidden: packed documents cost the blocks of each document only)."""
    qc = jnp.minimum(qi, plan.n_q - 1)
    live = (qi < plan.n_q)[None]  # (1, L); (1 or B, L) once a row's rule joins
    if plan.traced_kinds:
        live = live & (kinds[qc, kj] != EMPTY)[None]
    j0 = (kj * plan.block_k)[None]  # (1, L): the item's first key, and its last
    j1 = jnp.minimum(j0 + plan.block_k, plan.S) - 1
    if blocks.kv_lengths is not None:
        live = live & (j0 < blocks.kv_lengths[:, None])  # (B, L)
    if _traced_band(plan, blocks):
        left, right = plan.band
        offset = jnp.reshape(jnp.asarray(blocks.q_offset), (-1, 1))  # (1 or B, 1)
        first = offset + (qc * plan.block_q)[None]  # (1 or B, L): the item's first query
        last = offset + jnp.minimum(qc * plan.block_q + plan.block_q, plan.T)[None] - 1
        if right is not None:
            live = live & (j0 <= last + right)
        if left is not None:
            live = live & (j1 >= first - left)
    if blocks.segment_ranges is not None:
        (q_min, q_max), (kv_min, kv_max) = blocks.segment_ranges  # (B, nQ), (B, nK)
        meet = (jnp.take(q_min, qc, axis=1) <= jnp.take(kv_max, kj, axis=1)) & (
            jnp.take(kv_min, kj, axis=1) <= jnp.take(q_max, qc, axis=1)
        )  # (B, L)
        live = live & meet
    return jnp.any(live, axis=0)


class LiveSchedule(NamedTuple):
    """A schedule as the traced rules leave it: in each lane, the items they leave live
    first (in the schedule's order), then the hidden ones.

    Attributes:
      q_block, k_block: int32 (steps, lanes), the reordered items.
      live: bool (steps, lanes), whether each reordered item is live.
      steps: int32 (), the steps that hold a live item: the pass runs only those.
    """

    q_block: jax.Array
    k_block: jax.Array
    live: jax.Array
    steps: jax.Array


def live_schedule(plan: Plan, kinds, blocks: RuleBlocks, schedule: Schedule) -> LiveSchedule:
    """``schedule`` with each lane's live items first (:class:`LiveSchedule`). Within a
    lane the items are independent (one query block per lane per step still holds: a
    lane's items change order, never lane), so the pass runs the live steps only."""
    q_block, k_block = jnp.asarray(schedule.q_block), jnp.asarray(schedule.k_block)
    live = jax.vmap(lambda qi, kj: _item_live(plan, kinds, blocks, qi, kj))(q_block, k_block)
    order = jnp.argsort(~live, axis=0, stable=True)  # (steps, lanes): live first
    pick = functools.partial(jnp.take_along_axis, indices=order, axis=0)
    steps = live.sum(axis=0).max().astype(jnp.int32)
    return LiveSchedule(pick(q_block), pick(k_block), pick(live), steps)


def _run_steps(plan: Plan, kinds, blocks: RuleBlocks, schedule: Schedule, step, carry):
    """``step(carry, (qi, kj)) -> carry`` over the schedule's steps: all of them, or,
    where a traced rule can hide whole items, the steps of :func:`live_schedule` that
    hold a live item (the others are never run)."""
    if not _hides_items(plan, blocks):
        carry, _ = jax.lax.scan(
            lambda c, item: (step(c, item), None),
            carry,
            (jnp.asarray(schedule.q_block), jnp.asarray(schedule.k_block)),
        )
        return carry
    live = live_schedule(plan, kinds, blocks, schedule)
    return jax.lax.fori_loop(
        0, live.steps, lambda t, c: step(c, (live.q_block[t], live.k_block[t])), carry
    )


def _scores(plan: Plan, qs, ks, qi, kj, blocks: RuleBlocks, allowed=None, cells=None,
            consts=(), with_vjp=False) -> Scores:  # fmt: skip
    """:func:`~nanoattn._backends.flash.step.scores` of each lane's item (the query
    blocks pre-scaled): with its bias, and ``score_fn`` mapped over the lanes at the
    item's ``cells``. Blocked cells hold ``large_negative`` when ``allowed`` is given."""
    bias = None if blocks.bias is None else _gather_pairs(blocks.bias, qi, kj, plan)
    score = None
    if plan.score_fn is not None:

        def score(s, consts):
            def one(s, b, n, q, k):
                return evaluate_score(lambda *a: plan.score_fn(*a, *consts), s, b, n, q, k)

            shape = s.shape
            flat = s.reshape(shape[0], shape[1], plan.K * plan.G, *shape[4:])  # (B, L, N, ., .)
            return _per_lane(one)((flat,), cells).reshape(shape)

    return scores(
        _LAYOUT, qs, ks, allowed, bias=bias, score=score, consts=consts,
        soft_cap=plan.soft_cap, with_vjp=with_vjp,
    )  # fmt: skip


def _segment_ranges(q_ids, kv_ids, plan: Plan):
    """Each block's smallest and largest segment id (padding left out):
    ((q_min, q_max) (B, nQ), (kv_min, kv_max) (B, nK)), or None."""
    if q_ids is None:
        return None
    return block_id_ranges(q_ids, plan.block_q), block_id_ranges(kv_ids, plan.block_k)


def _segment_blocks(q_ids, kv_ids, plan: Plan):
    """Segment ids as blocks: (B, nQ, bq) and (B, nK, bk), or None."""
    if q_ids is None:
        return None
    q_ids = _pad(q_ids, 1, plan.n_q * plan.block_q).reshape(plan.B, plan.n_q, plan.block_q)
    kv_ids = _pad(kv_ids, 1, plan.n_k * plan.block_k).reshape(plan.B, plan.n_k, plan.block_k)
    return q_ids, kv_ids


def forward_block(plan: Plan, inputs: BlockInputs):
    """The forward pass: (out (B, T, N, Hv), lse (B, T, N)), both in the softmax's
    dtype (at least float32); ``lse`` is ``-inf`` for a row that sees no key (the
    convention of ``jax.nn``'s residuals and of the log-sum-exp of an empty set)."""
    q, k, v = inputs.query, inputs.key, inputs.value
    acc = softmax_dtype(q.dtype, k.dtype, v.dtype)
    neg = large_negative(acc)
    # The queries as blocks: a reshape of the input, no copy (each step scales its own
    # lanes' queries, so that no scaled copy of all of them is held).
    qb, scale = _query_blocks(q, plan, acc), jnp.asarray(plan.scale, acc)
    kb, vb = _key_blocks(k, plan, acc), _key_blocks(v, plan, acc)
    blocks = RuleBlocks.of(plan, inputs, acc)
    kinds = inputs.kinds
    consts = () if inputs.score_consts is None else inputs.score_consts[0]
    rows = (plan.B, plan.n_q + 1, plan.K, plan.G, plan.block_q)  # one spare row for idle slots
    values = (plan.B, plan.n_q + 1, plan.block_q, plan.K, plan.G, v.shape[-1])  # Hv
    state = (jnp.full(rows, neg, acc), jnp.zeros(rows, acc), jnp.zeros(values, acc))
    state = varying_like(state, inputs)

    def run(state, schedule: Schedule, masked: bool):
        if schedule.steps == 0:
            return state
        item_keys = functools.partial(_item_keys, plan, masked, kb, vb, blocks)

        def step(state, item):
            m, l, o = state
            qi, kj = item
            qc = jnp.minimum(qi, plan.n_q - 1)
            m_old, l_old = jnp.take(m, qi, axis=1), jnp.take(l, qi, axis=1)
            o_old = jnp.take(o, qi, axis=1)  # (B, L, bq, K, G, H)

            def update():
                qs = _take_queries(qb, qc, scale)  # (B, L, K, G, bq, H)
                ks, vs, cells, allowed = item_keys(qc, kj)  # (B, L, K, bk, H) twice
                s = _scores(plan, qs, ks, qc, kj, blocks, allowed, cells, consts).logits
                o_prev = jnp.einsum("BLqKGH->BLKGqH", o_old)
                m_new, l_new, o_new = forward_step(_LAYOUT, (m_old, l_old, o_prev), s, vs, allowed)
                return m_new, l_new, jnp.einsum("BLKGqH->BLqKGH", o_new)

            m_new, l_new, o_new = update()
            return m.at[:, qi].set(m_new), l.at[:, qi].set(l_new), o.at[:, qi].set(o_new)

        return _run_steps(plan, kinds, blocks, schedule, step, state)

    masked, full = plan.schedules()
    m, l, o = run(run(state, masked, True), full, False)
    m, l, o = m[:, :-1], l[:, :-1], o[:, :-1]
    seen = l != 0  # NaN content counts as seen (docs/conventions.md)
    denominator, lse = finish(m, l, seen)  # lse (B, nQ, K, G, bq)
    out = o / jnp.einsum("BnKGq->BnqKG", denominator)[..., None]
    # log 0 = -inf marks a row that sees no key (the backward pass never reads its query),
    # set once the padded query rows are cut off, so that no array holds an inf that the
    # call's results do not (jax's debug_infs checks every operation's output).
    lse = _unblock_rows(lse, plan).reshape(plan.B, plan.T, plan.K * plan.G)  # (B, T, N)
    seen = _unblock_rows(seen, plan).reshape(lse.shape)
    return _unblock_queries(out, plan), jnp.where(seen, lse, -jnp.inf)


def backward_block(plan: Plan, residuals: Residuals, d_out, d_lse=None) -> BlockGrads:
    """The backward pass for the cotangents ``d_out`` (B, T, N, Hv) and, when the
    log-sum-exp is an output too, ``d_lse`` (B, T, N): the weights are recomputed
    block by block from ``residuals.lse``. Since d lse / d logits is the softmax,
    ``d_lse`` enters as a shift of the row term: dS = P (dP - (D - d_lse))."""
    inputs, out, lse = residuals
    q, k, v, bias = inputs.query, inputs.key, inputs.value, inputs.rules.bias
    acc = lse.dtype
    lse = _row_blocks(lse.reshape(plan.B, plan.T, plan.K, plan.G), plan)  # (B, nQ, K, G, bq)
    seen = lse != -jnp.inf  # rows that see at least one key (NaN included)
    lse = jnp.where(seen, lse, 0)
    qb = _query_blocks(q, plan, acc) * jnp.asarray(plan.scale, acc)
    # A query that sees no key is never read: NaN there must not reach dK.
    qb = jnp.where(jnp.einsum("BnKGq->BnqKG", seen)[..., None], qb, 0)
    dob = _query_blocks(d_out, plan, acc)
    kb, vb = _key_blocks(k, plan, acc), _key_blocks(v, plan, acc)
    # D_i = sum_h dO_ih O_ih, the row term of the softmax gradient.
    delta = (d_out.astype(acc) * out.astype(acc)).sum(-1)  # (B, T, N)
    if d_lse is not None:
        delta = delta - d_lse.astype(acc)
    delta = _row_blocks(delta.reshape(plan.B, plan.T, plan.K, plan.G), plan)  # (B, nQ, K, G, bq)
    blocks = RuleBlocks.of(plan, inputs, acc)
    kinds = inputs.backward_kinds
    consts = () if inputs.score_consts is None else tuple(inputs.score_consts[1])
    grads = (
        jnp.zeros((plan.B, plan.n_q + 1, plan.block_q, plan.K, plan.G, plan.H), acc),
        jnp.zeros_like(kb),
        jnp.zeros_like(vb),
        None if bias is None else jnp.zeros_like(blocks.bias),
        tuple(jnp.zeros_like(c) for c in consts),
    )
    grads = varying_like(grads, inputs, d_out)

    def run(grads, schedule: Schedule, masked: bool):
        if schedule.steps == 0:
            return grads
        item_keys = functools.partial(_item_keys, plan, masked, kb, vb, blocks)

        def step(grads, item):
            dq, dk, dv, dbias, dconsts = grads
            qi, kj = item
            qc = jnp.minimum(qi, plan.n_q - 1)

            def contributions():
                live = (qi < plan.n_q).astype(acc)[None, :, None, None, None]  # idle slots add
                qs = _take_queries(qb, qc)  # (B, L, K, G, bq, H)      nothing: with dO = 0
                dos = _take_queries(dob, qc) * live[..., None]  # and D = 0 there, both p dO
                delta_i = jnp.take(delta, qc, axis=1) * live  # and dS vanish
                lse_i = jnp.take(lse, qc, axis=1)
                ks, vs, cells, allowed = item_keys(qc, kj)
                block = _scores(plan, qs, ks, qc, kj, blocks, allowed, cells, consts, True)
                return backward_step(_LAYOUT, block, lse_i, delta_i, qs, ks, vs, dos, allowed)

            g = contributions()
            dq = dq.at[:, qi].add(g.query)
            dk = dk.at[:, kj].add(g.key)
            dv = dv.at[:, kj].add(g.value)
            if dbias is not None:
                dbias = _scatter_pairs(dbias, qc, kj, g.logits)
            dconsts = jax.tree.map(jnp.add, dconsts, g.consts)
            return dq, dk, dv, dbias, dconsts

        return _run_steps(plan, kinds, blocks, schedule, step, grads)

    masked, full = plan.schedules()
    dq, dk, dv, dbias, dconsts = run(run(grads, masked, True), full, False)
    dq = _unblock_queries(dq[:, :-1] * jnp.asarray(plan.scale, acc), plan).astype(q.dtype)
    dk = dk.reshape(plan.B, -1, plan.K, plan.H)[:, : plan.S]
    dv = dv.reshape(plan.B, -1, plan.K, v.shape[-1])[:, : plan.S]
    if dbias is not None:
        xB, xN, xT, xS = bias.shape
        dbias = dbias.reshape(xB, xN, -1, dbias.shape[4] * dbias.shape[5])[:, :, :xT, :xS]
        dbias = dbias.astype(bias.dtype)
    score_grads = None
    if inputs.score_consts is not None:  # the forward's copies get nothing: one use each
        forward, backward = inputs.score_consts
        score_grads = (
            tuple(jnp.zeros_like(c) for c in forward),
            tuple(g.astype(c.dtype) for g, c in zip(dconsts, backward)),
        )
    return BlockGrads(dq, dk.astype(k.dtype), dv.astype(v.dtype), dbias, score_grads)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _attend(plan, backward_plan, inputs: BlockInputs):
    """(out (B, T, N, Hv) in the query's dtype, lse (B, T, N)), differentiable in both."""
    out, lse = forward_block(plan, inputs)
    return out.astype(inputs.query.dtype), lse


def _attend_fwd(plan, backward_plan, inputs: BlockInputs):
    out, lse = forward_block(plan, inputs)
    # The backward pass's row term rowsum(dO * O) reads the output in the softmax's
    # precision: rounded to bfloat16 or float16 first, it made dq and dk several
    # times less accurate than the reference's (tests/test_fuzz.py).
    return (out.astype(inputs.query.dtype), lse), Residuals(inputs, out, lse)


def _attend_bwd(plan, backward_plan, residuals: Residuals, cotangents):
    if residuals.inputs.rules.key_scales is not None:
        raise ValueError(NO_QUANTIZED_GRADIENTS)
    d_out, d_lse = cotangents
    grads = backward_block(backward_plan, residuals, d_out, d_lse=d_lse)
    inputs = residuals.inputs
    bias = None if grads.bias is None else sum_to_varying(grads.bias, inputs.rules.bias)
    # Of the rules only the bias has a gradient: no cotangent for masks, offsets and ids.
    rules = dataclasses.replace(
        inputs.rules, mask=None, offset=None, kv_lengths=None, q_segment_ids=None,
        kv_segment_ids=None, traced_scale=None, bias=bias,
    )  # fmt: skip
    differentiable = BlockInputs(
        query=sum_to_varying(grads.query, inputs.query),
        key=sum_to_varying(grads.key, inputs.key),
        value=sum_to_varying(grads.value, inputs.value),
        rules=rules,
        score_consts=grads.score_consts,
    )
    return (differentiable,)


_attend.defvjp(_attend_fwd, _attend_bwd)


def flash_attention(query, key, value, rules: Rules, *, forward_tiles=None, backward_tiles=None):
    """Blockwise attention with the reference's output contract.

    Args:
      query: (B, T, N, H); key (B, S, K, H), value (B, S, K, Hv); ``rules`` from
        :meth:`nanoattn._base.rules.Rules.make`.
      forward_tiles, backward_tiles: ``(block_q, block_k, lanes)`` for each
        pass: block sizes along T and S (capped at T and S; lengths need not
        be multiples of them) and the work items processed side by side per
        step. By default :func:`fit_tiles` sizes them for the call.

    Returns:
      (B, T, N, Hv) in the query's dtype; zeros when T or S is 0 (no query, or no key
      to see), as every backend gives. With ``rules.return_residual``, also the
      log-sum-exp (B, T, N) in the softmax's dtype (``-inf`` where nothing is seen).
    """
    if rules.T == 0 or rules.S == 0:
        out = jnp.zeros((*query.shape[:3], value.shape[-1]), query.dtype)
        lse = jnp.full(query.shape[:3], -jnp.inf, softmax_dtype(query.dtype, key.dtype))
        return (out, lse) if rules.return_residual else out
    mask = None
    if rules.mask_fn is not None:
        mask = rules.mask_fn
        if not isinstance(mask, BlockMask):
            mask = block_mask(mask, rules.B, rules.N, rules.T, rules.S, q_offset=rules.q_offset)
    plans = kernel_plans(rules, forward_tiles, backward_tiles, mask)
    if rules.q_segment_ids is not None:  # concrete ids: their empty and full items known now
        ids = (rules.q_segment_ids, rules.kv_segment_ids)
        plans = type(plans)(*(with_segment_kinds(p, *ids) for p in plans))
    kinds = [
        None if mask is None or mask.static else mask.kinds_at(p.block_q, p.block_k) for p in plans
    ]
    score_consts = None
    if rules.score_fn is not None:
        acc = softmax_dtype(query.dtype, key.dtype, value.dtype)
        converted = [_converted_score_fn(rules, p, acc) for p in plans]
        plans = type(plans)(
            *(dataclasses.replace(p, score_fn=c[0]) for p, c in zip(plans, converted))
        )
        score_consts = tuple(tuple(c[1]) for c in converted)
    inputs = BlockInputs(
        query=query, key=key, value=value, rules=kernel_rules(rules), kinds=kinds[0],
        backward_kinds=kinds[1], score_consts=score_consts,
    )  # fmt: skip
    out, lse = _attend(*plans, inputs)
    return (out, lse) if rules.return_residual else out


def _converted_score_fn(rules: Rules, plan: Plan, acc):
    """``rules.score_fn`` closure-converted for one block of ``plan``'s (B, N, bq, bk)
    (:func:`~nanoattn._base.mask_fn.closure_converted`)."""
    return closure_converted(
        rules.score_fn, plan.B, plan.K * plan.G, plan.block_q, plan.block_k, rules.q_offset, acc
    )
