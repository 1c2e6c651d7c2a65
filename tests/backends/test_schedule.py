"""The blockwise kernel's schedule (nanoattn/_backends/flash/schedule.py): which block pairs
each step runs, classified as masked or fully visible, packed into lanes; checked against the
literal positional rules, without compiling anything.
"""

import numpy as np
import pytest

from nanoattn._backends.flash.schedule import block_schedules, pack

from _reference import np_causal, np_window


def test_schedule_covers_each_visible_block_pair_once():
    T, S, bq, bk, offset = 100, 127, 16, 32, 60  # the last key block has one padded key
    masked, full = block_schedules(T, S, bq, bk, 3, offset, False)
    n_q, n_k = -(-T // bq), -(-S // bk)
    seen = {}
    for sched, kind in ((masked, "masked"), (full, "full")):
        for t in range(sched.steps):
            real = sched.q_block[t] < n_q
            rows = sched.q_block[t][real]
            assert len(set(rows.tolist())) == len(rows)  # distinct query blocks per step
            for i, j in zip(rows, sched.k_block[t][real]):
                assert (i, j) not in seen
                seen[int(i), int(j)] = kind
    visible = np_causal(T, S, offset)
    for i in range(n_q):
        for j in range(n_k):
            cells = visible[i * bq : (i + 1) * bq, j * bk : (j + 1) * bk]
            expect = (
                None
                if not cells.any()
                else "full"
                if cells.all() and cells.shape[1] == bk
                else "masked"
            )
            assert seen.get((i, j)) == expect, (i, j)


def test_schedule_balances_the_lanes():
    masked, full = block_schedules(4096, 4096, 256, 256, 8, 0, False)
    assert masked.items == 16 and full.items == 120  # the diagonal, and everything below it
    assert full.steps == 15  # 120 items over 8 lanes: no lane idles
    none, everything = block_schedules(64, 64, 16, 16, 2, None, True)
    assert everything.items == 0 and none.items == 16


def test_pack_uses_no_more_lanes_than_query_blocks_with_work():
    # One query block with two key blocks, one without any: one lane, two steps, and
    # int32 indices (the kernel gathers with them); a second lane would be all idle.
    one = pack([[0, 1], []], lanes=4)
    assert one.q_block.shape == (2, 1) and one.q_block.dtype == np.int32
    np.testing.assert_array_equal(one.q_block[:, 0], [0, 0])
    np.testing.assert_array_equal(one.k_block[:, 0], [0, 1])
    # Longest first, each to the least loaded lane: block 2 (3 items) fills lane A,
    # blocks 1 and 0 (2 + 1) share lane B: three steps, no idle slot.
    three = pack([[0], [0, 1], [0, 1, 2]], lanes=2)
    assert three.steps == 3 and three.items == 6 and three.k_block.dtype == np.int32
    assert sorted(map(sorted, three.q_block.T.tolist())) == [[0, 1, 1], [2, 2, 2]]
    # Unequal lanes: the short lane's idle slots point at the dummy block n = 2.
    idle = pack([[0], [0, 1, 2]], lanes=2)
    assert sorted(map(sorted, idle.q_block.T.tolist())) == [[0, 2, 2], [1, 1, 1]]
    assert idle.items == 4
    assert pack([[], []], lanes=3).steps == 0


# Static offsets that are not multiples of the block sizes: a block wrongly classified
# as fully visible survived until every offset over two key blocks was swept
# (test_flash.py sweeps them end to end).


def expected_items(T, S, bq, bk, q_offset, band):
    """{(i, j): "full" or "masked"} from the literal rule: a block pair is listed iff
    one of its cells is visible, full iff all are and its key block is not padded."""
    left, right = band
    big = S + abs(q_offset) + T
    visible = np_window(
        T, S, q_offset, big if left is None else left, big if right is None else right
    )
    items = {}
    for i in range(-(-T // bq)):
        for j in range(-(-S // bk)):
            cells = visible[i * bq : (i + 1) * bq, j * bk : (j + 1) * bk]
            if cells.any():
                items[i, j] = "full" if cells.all() and cells.shape[1] == bk else "masked"
    return items


def scheduled_items(masked, full):
    items = {}
    for schedule, kind in ((masked, "masked"), (full, "full")):
        for t in range(schedule.steps):
            real = schedule.q_block[t] < schedule.n_q_blocks
            rows = schedule.q_block[t][real]
            assert len(set(rows.tolist())) == len(rows)  # distinct query blocks per step
            for i, j in zip(rows.tolist(), schedule.k_block[t][real].tolist()):
                assert (i, j) not in items, (i, j)  # each block pair once
                items[i, j] = kind
    return items


BANDS = [(None, 0), (3, 0), (0, 0), (2, 2), (0, 5), (7, 1)]  # causal, windows


@pytest.mark.parametrize("T, S", [(7, 19), (20, 13)])
@pytest.mark.parametrize("bq, bk", [(3, 4), (4, 3), (5, 8), (8, 5)])
def test_schedule_classifies_every_block_pair_at_every_offset(T, S, bq, bk):
    for band in BANDS:
        for q_offset in range(-bk, 2 * bk + 1):
            masked, full = block_schedules(T, S, bq, bk, 2, q_offset, False, band)
            got = scheduled_items(masked, full)
            assert got == expected_items(T, S, bq, bk, q_offset, band), (band, q_offset)


# A sliding window makes the kernel's work grow linearly in T, shown by counting
# scheduled block pairs (never by timing); test_flash.py checks its memory.


def scheduled_pairs(T, band, tiles=(256, 512, 4)):
    masked, full = block_schedules(T, T, tiles[0], tiles[1], tiles[2], 0, False, band)
    return masked.items + full.items


def test_window_block_pairs_grow_linearly():
    # With blocks of 256 queries and 512 keys: 62 and 126 pairs for window (512, 0)
    # at T = 8192 and 16384, against 272 and 1056 for full causal attention.
    window = [scheduled_pairs(T, (512, 0)) for T in (8192, 16384)]
    causal = [scheduled_pairs(T, (None, 0)) for T in (8192, 16384)]
    assert window[1] <= 2.1 * window[0], window  # linear: twice the length, twice the pairs
    assert causal[1] >= 3.8 * causal[0], causal  # quadratic
    assert window[1] * 6 <= causal[1], (window, causal)
