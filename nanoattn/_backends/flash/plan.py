"""The static plan of one blockwise-kernel call: sizes, rules and tiles.

A :class:`Plan` is everything static about one pass of the kernel
(:mod:`nanoattn._backends.flash.kernel`): the sizes, the positional rule, which masks apply,
the soft-cap, and the tiles ``(block_q, block_k, lanes)``. It is hashable, so
it can be a static argument of ``jax.custom_vjp``; :func:`kernel_plans` makes
the forward and backward plans of a call, sizing the tiles with
:func:`fit_tiles` unless they are given.
"""

import dataclasses
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from ..._base.block_mask import EMPTY, FULL, PARTIAL, BlockMask
from ..._base.rules import Rules
from .schedule import Schedule, block_schedules

# (block_q, block_k, most lanes) per pass, and the most score cells one step may
# hold (B * N * lanes * block_q * block_k); measured on a 2-core x86 CPU with
# benchmarks/tune_tiles.py (docs/performance.md). A larger batch or more heads
# get fewer lanes, then smaller blocks: the step's size sets the speed of XLA's
# CPU kernels and the memory of the pass.
FORWARD_TILES = (256, 512, 4)
BACKWARD_TILES = (128, 128, 8)
FORWARD_STEP_CELLS = 2**21
BACKWARD_STEP_CELLS = 2**20
MIN_BLOCK = 64


@dataclasses.dataclass(frozen=True)
class Plan:
    """Everything static about one kernel call (hashable: a custom_vjp argument)."""

    B: int
    T: int
    S: int
    K: int
    G: int
    H: int
    block_q: int
    block_k: int
    lanes: int
    scale: float
    band: tuple[int | None, int | None] | None  # (left, right) of the positional rule, if any
    static_offset: int | None  # a Python int offset: blocks outside the band can be skipped
    has_lengths: bool
    has_mask: bool
    has_segments: bool
    soft_cap: float | None
    # mask_fn (called on each masked block), and its kinds at this plan's blocks when they
    # are static (a tuple of rows of EMPTY/PARTIAL/FULL); with traced kinds the kernel
    # reads them from its inputs and skips the empty items as it meets them.
    mask_fn: Callable | None = None
    kinds: tuple[tuple[int, ...], ...] | None = None
    traced_kinds: bool = False
    # Whether ``kinds`` holds the segment ids' classification too (concrete ids: an item
    # within one segment in every batch row is full, one whose ids never meet empty), so
    # that the segment ids no longer make every item masked.
    segments_classified: bool = False
    # score_fn as the kernel calls it (closure-converted: its hoisted arrays are inputs).
    score_fn: Callable | None = None
    index_offset: int | None = None  # a Python int offset for mask_fn and score_fn

    @property
    def n_q(self) -> int:
        return -(-self.T // self.block_q)

    @property
    def n_k(self) -> int:
        return -(-self.S // self.block_k)

    def schedules(self) -> tuple[Schedule, Schedule]:
        """The (masked, full) schedules."""
        traced_offset = self.band is not None and self.static_offset is None
        segments = self.has_segments and not self.segments_classified
        all_masked = (
            self.has_lengths or self.has_mask or segments or traced_offset or self.traced_kinds
        )  # fmt: skip
        offset = self.static_offset if self.band is not None else None
        return block_schedules(
            self.T, self.S, self.block_q, self.block_k, self.lanes, offset, all_masked,
            self.band or (None, None), self.kinds,
        )  # fmt: skip


class Plans(NamedTuple):
    """The plans of the two passes of one call."""

    forward: Plan
    backward: Plan


def kernel_plans(
    rules: Rules, forward_tiles=None, backward_tiles=None, mask: BlockMask | None = None
) -> Plans:
    """The (forward, backward) plans of a call: its static sizes and rules, and the
    tiles of each pass (``forward_tiles``/``backward_tiles``, else :func:`fit_tiles`).
    Only the flags of ``rules``'s arrays are read (whether there are lengths, a mask,
    segment ids), so the ring (:mod:`nanoattn.parallel`) plans its blocks with it.
    ``mask`` is the classification of ``rules.mask_fn`` (needed when it is set); its
    static kinds become each plan's, at the plan's blocks."""
    static_offset = rules.static_q_offset
    shared = Plan(
        B=rules.B, T=rules.T, S=rules.S, K=rules.K, G=rules.G, H=rules.H, block_q=0, block_k=0,
        lanes=0, scale=float(rules.scale), band=rules.band, static_offset=static_offset,
        has_lengths=rules.kv_lengths is not None, has_mask=rules.mask is not None,
        has_segments=rules.q_segment_ids is not None, soft_cap=rules.logit_soft_cap,
    )  # fmt: skip
    plans = []
    passes = (
        (forward_tiles, FORWARD_TILES, FORWARD_STEP_CELLS),
        (backward_tiles, BACKWARD_TILES, BACKWARD_STEP_CELLS),
    )
    for tiles, default, budget in passes:
        if tiles is not None and min(tiles) < 1:
            raise ValueError(f"block sizes and lanes must be >= 1, got {tiles}")
        block_q, block_k, lanes = tiles or fit_tiles(default, budget, rules)
        plan = dataclasses.replace(
            shared, block_q=min(block_q, rules.T), block_k=min(block_k, rules.S), lanes=lanes
        )
        plans.append(_with_mask_fn(plan, rules, mask))
    return Plans(*plans)


def _with_mask_fn(plan: Plan, rules: Rules, mask: BlockMask | None) -> Plan:
    """``plan`` with the call's ``mask_fn`` and its kinds at the plan's blocks."""
    offset = rules.index_offset
    index_offset = offset if isinstance(offset, int) else None
    if rules.mask_fn is None:
        return dataclasses.replace(plan, index_offset=index_offset)
    if not mask.static:
        return dataclasses.replace(
            plan, mask_fn=mask.mask_fn, traced_kinds=True, index_offset=index_offset
        )
    kinds = mask.kinds_at(plan.block_q, plan.block_k)
    return dataclasses.replace(
        plan, mask_fn=mask.mask_fn, kinds=tuple(map(tuple, kinds.tolist())),
        index_offset=index_offset,
    )  # fmt: skip


def fit_tiles(tiles, budget: int, rules: Rules) -> tuple[int, int, int]:
    """Shrinks ``tiles`` until one step holds at most ``budget`` score cells:
    first fewer lanes, then smaller blocks (halving the larger one, keys at a tie)."""
    block_q, block_k, lanes = tiles
    block_q, block_k = min(block_q, rules.T), min(block_k, rules.S)
    per_lane = rules.B * rules.N * block_q * block_k
    while per_lane > budget and max(block_q, block_k) > MIN_BLOCK:
        if block_k >= block_q:
            block_k = max(MIN_BLOCK, block_k // 2)
        else:
            block_q = max(MIN_BLOCK, block_q // 2)
        per_lane = rules.B * rules.N * block_q * block_k
    return block_q, block_k, max(1, min(lanes, budget // per_lane))


def with_segment_kinds(plan: Plan, q_ids, kv_ids) -> Plan:
    """``plan`` with concrete segment ids (B, T) and (B, S) classified at its blocks and
    merged into its kinds (:func:`segment_kinds`); unchanged when the ids are traced (the
    kernel then hides the items whose id ranges do not meet as it runs) or when a
    ``mask_fn``'s kinds are traced."""
    if plan.traced_kinds or any(isinstance(x, jax.core.Tracer) for x in (q_ids, kv_ids)):
        return plan
    kinds = segment_kinds(np.asarray(q_ids), np.asarray(kv_ids), plan.block_q, plan.block_k)
    if plan.kinds is not None:
        theirs = np.asarray(plan.kinds, np.int8)
        kinds = np.where(
            (kinds == EMPTY) | (theirs == EMPTY), EMPTY,
            np.where((kinds == FULL) & (theirs == FULL), FULL, PARTIAL),
        ).astype(np.int8)  # fmt: skip
    return dataclasses.replace(
        plan, kinds=tuple(map(tuple, kinds.tolist())), segments_classified=True
    )


def block_id_ranges(ids, size: int):
    """Each block of ``size`` ids' smallest and largest id along axis 1, the padding of
    the last block left out: ``(low, high)``, (B, ceil(L / size)) each, from ids (B, L);
    numpy for numpy ids (a plan's classification), jax otherwise (the kernel's)."""
    xp = np if isinstance(ids, np.ndarray) else jnp
    B, L = ids.shape
    n = -(-L // size)
    info, pad = xp.iinfo(ids.dtype), ((0, 0), (0, n * size - L))
    low = xp.pad(ids, pad, constant_values=info.max).reshape(B, n, size).min(-1)
    high = xp.pad(ids, pad, constant_values=info.min).reshape(B, n, size).max(-1)
    return low, high


def segment_kinds(q_ids: np.ndarray, kv_ids: np.ndarray, block_q: int, block_k: int):
    """The blocks of ``block_q`` queries by ``block_k`` keys as segment ids (B, T) and
    (B, S) leave them, int8 (ceil(T / block_q), ceil(S / block_k)): EMPTY where in every
    batch row the block's query ids and key ids span ranges that do not meet (no id in
    common), FULL where in every batch row all of them are one and the same id, PARTIAL
    otherwise (the kernel compares their ids cell by cell)."""
    (q_lo, q_hi), (k_lo, k_hi) = block_id_ranges(q_ids, block_q), block_id_ranges(kv_ids, block_k)
    q_lo, q_hi = q_lo[:, :, None], q_hi[:, :, None]  # (B, nQ, 1) against (B, 1, nK)
    k_lo, k_hi = k_lo[:, None, :], k_hi[:, None, :]
    meet = (q_lo <= k_hi) & (k_lo <= q_hi)
    one = (q_lo == q_hi) & (k_lo == k_hi) & (q_lo == k_lo)
    kinds = np.where(meet.any(0), PARTIAL, EMPTY)
    return np.where(one.all(0), FULL, kinds).astype(np.int8)
