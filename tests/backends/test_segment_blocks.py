"""Segment ids skip blocks: the kernels classify each pair of a query block and a key
block from the blocks' smallest and largest ids at run time (docs/masks.md, "Packed
documents"). A pair whose id ranges do not meet is never computed; on the native kernel
a pair of one and the same id that the positional rules show wholly is full.

Checked three ways: packed documents at prime sizes against the float64 reference
(outputs and gradients, every backend that serves segment ids), the native kernel's
classification against the literal mask block by block, and the flash kernel's live
items against the literal mask (the steps it runs are fewer than its schedule's). Concrete
ids (closed over as jax arrays) are classified before the run on the flash kernel too:
its items of one id are then full, its items whose ids never meet out of the schedule."""

import ctypes

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from nanoattn._backends.flash.kernel import BlockInputs, RuleBlocks, kernel_rules, live_schedule
from nanoattn._backends.flash.plan import kernel_plans, segment_kinds, with_segment_kinds
from nanoattn._base.rules import Rules

from _cases import Case, assert_cases_match
from _reference import np_causal, np_lengths, np_segments, np_window, randn

B, N, K, H = 2, 3, 1, 8
# Four documents in one row of 263 (the third spans whole 64-token blocks, so the
# native kernel meets full blocks of one id), a single document in the other.
LENGTHS = [50, 3, 170, 40]
T = sum(LENGTHS)


def packed(lengths):
    return np.repeat(np.arange(len(lengths)), lengths).astype(np.int32)


IDS = np.stack([packed(LENGTHS), packed([T])])


def qkv(T, S, seed):
    return randn(seed, B, T, N, H), randn(seed + 1, B, S, K, H), randn(seed + 2, B, S, K, H)


def test_packed_documents_match_the_reference():
    causal = Case(
        "packed causal documents",
        *qkv(T, T, 0),
        allowed=np_segments(IDS, IDS) & np_causal(T, T),
        kwargs=dict(q_segment_ids=IDS, kv_segment_ids=IDS, is_causal=True),
    )
    # Cross-attention over 131 keys of three documents: no causality, so every block
    # pair is classified by its ids alone.
    S = 131
    kv_ids = np.stack([packed([20, 71, 40]), packed([S])])
    q_ids = np.stack([packed([90, 73, 100]), packed([T])])
    cross = Case(
        "packed documents, T != S",
        *qkv(T, S, 10),
        allowed=np_segments(q_ids, kv_ids),
        kwargs=dict(q_segment_ids=q_ids, kv_segment_ids=kv_ids),
    )
    assert_cases_match([causal, cross])


def _kinds_of(allowed, bq, bk):
    """0 (no visible cell), 1 (some) or 2 (all) per (bq, bk) block of a (T, S) mask."""
    T, S = allowed.shape
    kinds = np.zeros((-(-T // bq), -(-S // bk)), np.int8)
    for qb in range(kinds.shape[0]):
        for kb in range(kinds.shape[1]):
            cells = allowed[qb * bq : (qb + 1) * bq, kb * bk : (kb + 1) * bk]
            kinds[qb, kb] = 2 if cells.all() else 1 if cells.any() else 0
    return kinds


@pytest.mark.parametrize(
    "rule",
    [
        dict(q_offset=0, left=-1, right=0, length=T),  # causal
        dict(q_offset=7, left=90, right=0, length=T),  # causal window at an offset
        dict(q_offset=0, left=-1, right=-1, length=T),  # the ids alone
    ],
)
def test_native_classifies_blocks_by_segment_ids(rule):
    # Packed documents (ids sorted along the row): a block pair whose id ranges meet
    # then shares an id, so the classification by ranges is exact.
    from nanoattn._backends.native import build, kernel

    library, reason = build.load()
    if library is None:
        pytest.skip(reason)
    bq, bk = kernel.block_sizes()
    ids = np.ascontiguousarray(IDS[0])
    got = np.zeros((-(-T // bq), -(-T // bk)), np.int8)
    pointer = ctypes.POINTER(ctypes.c_int32)
    library.NanoattnClassify(
        ctypes.c_int64(T), ctypes.c_int64(T), ctypes.c_int32(rule["q_offset"]),
        ctypes.c_int32(rule["length"]), ctypes.c_int64(rule["left"]),
        ctypes.c_int64(rule["right"]), ids.ctypes.data_as(pointer),
        ids.ctypes.data_as(pointer), got.ctypes.data_as(ctypes.POINTER(ctypes.c_int8)),
    )  # fmt: skip
    left, right = (None if x < 0 else x for x in (rule["left"], rule["right"]))
    band = np_window(T, T, rule["q_offset"], left or T + 8, T + 8 if right is None else right)
    allowed = np_segments(ids[None], ids[None])[0, 0] & band
    allowed &= np_lengths([rule["length"]], T)[0, 0]
    want = _kinds_of(allowed, bq, bk)
    np.testing.assert_array_equal(got, want)
    assert (want == 0).any() and (want == 2).any()  # the ids skip, and leave full blocks


@pytest.mark.parametrize("causal", [True, False])
def test_flash_runs_only_the_items_the_ids_leave_live(causal):
    q, k, v = qkv(T, T, 20)
    ids = np.stack([packed(LENGTHS), packed([100, 63, 100])])  # both rows packed
    rules = Rules.make(
        jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), is_causal=causal,
        q_segment_ids=ids, kv_segment_ids=ids,
    )  # fmt: skip
    tiles = (16, 32, 3)
    for plan in kernel_plans(rules, tiles, tiles):
        masked, full = plan.schedules()
        assert full.items == 0  # segment ids: every item masked
        inputs = BlockInputs(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), kernel_rules(rules))
        blocks = RuleBlocks.of(plan, inputs, jnp.float32)
        live = jax.jit(lambda blocks, plan=plan, masked=masked: live_schedule(
            plan, None, blocks, masked))(blocks)  # fmt: skip
        # Each lane keeps its items, live ones first.
        for lane in range(masked.q_block.shape[1]):
            before = sorted(zip(masked.q_block[:, lane], masked.k_block[:, lane]))
            after = sorted(
                zip(np.asarray(live.q_block[:, lane]), np.asarray(live.k_block[:, lane]))
            )
            assert before == after
            flags = np.asarray(live.live[:, lane])
            assert not (flags[1:] & ~flags[:-1]).any()
        # An item is live iff a query of its block sees a key of its block in some row.
        allowed = np_segments(ids, ids)[:, 0] & (np_causal(T, T) if causal else True)
        kinds = np.max([_kinds_of(a, plan.block_q, plan.block_k) for a in allowed], axis=0)
        real = masked.q_block < plan.n_q
        want = np.zeros_like(real)
        want[real] = kinds[masked.q_block[real], masked.k_block[real]] > 0
        assert int(np.asarray(live.live).sum()) == int(want.sum())
        assert int(live.steps) < masked.steps


def test_concrete_ids_classify_the_flash_items_before_the_run():
    # Row 0 packed (sorted ids: ranges meet only where an id is shared, so the kinds are
    # exact); row 1 unsorted, where ranges may meet with no id in common: never EMPTY
    # then (safe), and FULL exactly where every row holds one id throughout.
    unsorted = np.where(np.arange(T) % 50 < 25, 5, 7).astype(np.int32)
    both = np.stack([packed(LENGTHS), packed([100, 63, 100])])  # both rows packed
    for ids, exact in ((both, True), (np.stack([IDS[0], unsorted]), False)):
        got = segment_kinds(ids, ids, 16, 32)
        per_row = [_kinds_of(np_segments(ids, ids)[b, 0], 16, 32) for b in range(B)]
        least, most = np.min(per_row, axis=0), np.max(per_row, axis=0)
        np.testing.assert_array_equal(got == 2, least == 2)
        assert not ((got == 0) & (most > 0)).any()  # an item some row sees is never skipped
        if exact:
            np.testing.assert_array_equal(got == 0, most == 0)
            assert (got == 0).any() and (got == 1).any() and (got == 2).any()
    q, k, v = qkv(T, T, 30)
    rules = Rules.make(
        jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), is_causal=True,
        q_segment_ids=both, kv_segment_ids=both,
    )  # fmt: skip
    for plan in kernel_plans(rules, (16, 32, 3), (16, 32, 3)):
        classified = with_segment_kinds(plan, both, both)
        masked, full = classified.schedules()
        kinds = segment_kinds(both, both, plan.block_q, plan.block_k)
        assert full.items > 0  # items of one id (under the diagonal): no mask computed
        for schedule in (masked, full):
            real = schedule.q_block < plan.n_q
            assert (kinds[schedule.q_block[real], schedule.k_block[real]] > 0).all()
        traced = jax.jit(lambda ids, plan=plan: jnp.asarray(
            with_segment_kinds(plan, ids, ids).schedules()[1].items))(both)  # fmt: skip
        assert int(traced) == 0  # traced ids: classified as the kernel runs, every item masked


def test_concrete_ids_on_flash_match_the_reference():
    # The ids closed over as jax arrays (concrete under jit), small tiles so that the
    # third document holds whole items: full items, masked ones and skipped ones.
    ids = jnp.asarray(IDS)
    case = Case(
        "packed causal documents, concrete ids",
        *qkv(T, T, 40),
        allowed=np_segments(IDS, IDS) & np_causal(T, T),
        kwargs=dict(q_segment_ids=ids, kv_segment_ids=ids, is_causal=True),
    )
    tiles = dict(forward_tiles=(16, 32, 3), backward_tiles=(16, 32, 3))
    assert_cases_match([case], implementations=["flash"], tiles=tiles)
