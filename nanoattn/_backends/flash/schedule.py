"""The static work schedule of the blockwise kernel.

The query and key axes are cut into blocks of ``block_q`` and ``block_k``. A
work item is a pair (query block i, key block j) that holds at least one
visible (query, key) pair: under causality items above the diagonal are never
listed, and under a sliding window neither are items wholly left of the band,
so a windowed call does work linear in T. Items whose every pair is visible
are *full*; the others (on the band's edges, in a padded last key block, or
under a dense mask, key lengths, segment ids or a traced offset) are *masked*
and are the only ones that pay for masking.

XLA on CPU runs a small operation on one core but spreads a large one over
all of them. So the kernel does not walk one block at a time: each step
processes ``lanes`` items side by side, one per lane, as one batched
operation. The items of a query block are packed into one lane, and query
blocks are assigned to lanes longest first (LPT scheduling), so every lane
carries about the same work and the query blocks of one step are distinct:
their running softmax state can be gathered and scattered without conflicts.
"""

import dataclasses
import functools

import numpy as np

from ..._base.block_mask import EMPTY, FULL


@dataclasses.dataclass(frozen=True)
class Schedule:
    """Work items packed into lanes: entry [t, l] is what lane l does at step t.

    Attributes:
      q_block: (steps, lanes) query block indices; ``n_q_blocks`` marks an
        idle slot (a dummy item whose results are discarded).
      k_block: (steps, lanes) key block indices (0 in idle slots).
      n_q_blocks: the number of query blocks.
    """

    q_block: np.ndarray
    k_block: np.ndarray
    n_q_blocks: int

    @property
    def steps(self) -> int:
        return self.q_block.shape[0]

    @property
    def items(self) -> int:
        """The number of real (not idle) slots."""
        return int((self.q_block < self.n_q_blocks).sum())


def pack(rows: list[list[int]], lanes: int) -> Schedule:
    """Packs each query block's key blocks into lanes, longest rows first.

    ``rows[i]`` lists the key blocks of query block i. Idle slots point at
    the dummy query block ``len(rows)``.
    """
    n = len(rows)
    order = sorted((i for i in range(n) if rows[i]), key=lambda i: -len(rows[i]))
    lanes = max(1, min(lanes, len(order)))
    bins: list[list[int]] = [[] for _ in range(lanes)]
    load = [0] * lanes
    for i in order:
        b = load.index(min(load))
        bins[b].append(i)
        load[b] += len(rows[i])
    steps = max(load)  # lanes >= 1, so load is never empty
    q_block = np.full((steps, lanes), n, np.int32)
    k_block = np.zeros((steps, lanes), np.int32)
    for lane, members in enumerate(bins):
        items = [(i, j) for i in members for j in rows[i]]
        for t, (i, j) in enumerate(items):
            q_block[t, lane], k_block[t, lane] = i, j
    return Schedule(q_block, k_block, n)


@functools.lru_cache(maxsize=256)
def block_schedules(
    T: int,
    S: int,
    block_q: int,
    block_k: int,
    lanes: int,
    q_offset: int | None,
    all_masked: bool,
    band: tuple[int | None, int | None] = (None, 0),
    kinds: tuple[tuple[int, ...], ...] | None = None,
) -> tuple[Schedule, Schedule]:
    """The (masked, full) schedules of an attention call.

    Args:
      T, S: query and key lengths (before padding to whole blocks).
      q_offset: the static position of the first query, or None when no
        positional rule lets blocks be skipped (none applies, or the offset
        is traced).
      all_masked: every item needs a mask (dense mask, key lengths, segment
        ids or a traced offset), so no item is full.
      band: ``(left, right)``: query at position p may see keys
        ``p - left .. p + right`` (None = unbounded). The default ``(None, 0)``
        is causality; a causal sliding window is ``(left, 0)``.
      kinds: a ``mask_fn``'s block classification at these blocks, (nQ, nK) rows of
        0 (empty: never computed), 1 (partial: masked) or 2 (full), or None.
    """
    n_q, n_k = -(-T // block_q), -(-S // block_k)
    left, right = band if q_offset is not None else (None, None)
    masked: list[list[int]] = [[] for _ in range(n_q)]
    full: list[list[int]] = [[] for _ in range(n_q)]
    for i in range(n_q):
        # The block's queries sit at first_p .. last_p; its keys at first_k .. last_k.
        first_p = (q_offset or 0) + i * block_q
        last_p = (q_offset or 0) + min((i + 1) * block_q, T) - 1
        for j in range(n_k):
            first_k, last_k = j * block_k, (j + 1) * block_k - 1
            if right is not None and first_k > last_p + right:
                continue  # every key is right of every query's band: never computed
            if left is not None and min(last_k, S - 1) < first_p - left:
                continue  # every key is left of every query's band
            kind = FULL if kinds is None else kinds[i][j]
            if kind == EMPTY:
                continue  # mask_fn hides every cell
            whole = (
                kind == FULL
                and last_k < S
                and (right is None or last_k <= first_p + right)
                and (left is None or first_k >= last_p - left)
            )
            (full if whole and not all_masked else masked)[i].append(j)
    return pack(masked, lanes), pack(full, lanes)
