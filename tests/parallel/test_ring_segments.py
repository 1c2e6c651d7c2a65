"""The ring's skip of calls whose segment ids cannot meet (nanoattn/parallel/_segments.py),
in process: the range test on hand-made ids, then the choice the ring makes for every
call of every step on every device, against a brute-force count of the call's cells.
That the skipped calls change nothing is checked end to end on 4 devices by
tests/parallel/test_parallel.py ("...-chunk-documents")."""

import jax.numpy as jnp
import numpy as np
import pytest

from nanoattn._base.rules import Rules
from nanoattn.parallel import _blocks
from nanoattn.parallel._segments import id_range, ids_meet, ranges_meet

from _parallel_cases import chunk_documents


def test_ids_meet_when_some_row_can_hold_an_equal_id():
    q = jnp.array([[0, 1, 1], [5, 5, 6]], jnp.int32)  # rows in [0, 1] and [5, 6]
    assert not bool(ids_meet(q, jnp.array([[2, 3, 2], [7, 9, 8]])))  # [2, 3], [7, 9]
    # row 1 touches at the single id 6: one row is enough to run the pair
    assert bool(ids_meet(q, jnp.array([[2, 3, 2], [6, 9, 8]])))
    # ... unless that key is past the row's length
    valid = jnp.array([[True, True, True], [False, True, True]])
    assert not bool(ids_meet(q, jnp.array([[2, 3, 2], [6, 9, 8]]), valid))
    # a row whose keys are all padding meets nothing, whatever its ids
    assert not bool(ids_meet(q, q, jnp.zeros((2, 3), bool)))
    # unsorted ids: the ranges overlap though no id is equal; the ring runs the pair
    assert bool(ids_meet(jnp.array([[0, 2]]), jnp.array([[1, 1]])))
    assert ids_meet(None, None) is None


def test_id_range_of_a_row_without_valid_keys_is_empty_in_the_ids_dtype():
    ids = jnp.array([[3, -2, 7], [4, 4, 4]], jnp.int8)
    low, high = id_range(ids, jnp.array([[True, True, False], [False, False, False]]))
    assert low.tolist() == [-2, 127] and high.tolist() == [3, -128]
    assert low.dtype == jnp.int8
    assert not bool(ranges_meet((low[1:], high[1:]), (jnp.array([-128]), jnp.array([127]))))


B, P = 2, 4


def _held(layout: str, r: int, C: int) -> np.ndarray:
    """The global positions device ``r`` holds, in its order."""
    chunks = (r, 2 * P - 1 - r) if layout == "zigzag" else (r,)
    return np.concatenate([np.arange(c * C, (c + 1) * C) for c in chunks])


def _setting(layout: str, T: int, **rules):
    """(ids (B, T) in natural order, key lengths (B,), C, the per-step rules of
    devices r and source, the ring's step plans), as tests/_parallel_cases.py runs
    them: documents on chunk edges, lengths T - 3 and T / 2 + 1."""
    C = T // (2 * P if layout == "zigzag" else P)
    ids = np.asarray(chunk_documents(T, C))
    lengths = np.array([T - 3, T // 2 + 1], np.int32)
    x = jnp.zeros((B, T // P, 1, 4))

    def step_rules(r: int, source: int) -> Rules:
        q_ids, kv_ids = (jnp.asarray(ids[:, _held(layout, d, C)]) for d in (r, source))
        made = Rules.make(x, x, x, q_segment_ids=q_ids, kv_segment_ids=kv_ids, **rules)
        return made.replace(kv_lengths=jnp.asarray(lengths))  # global, as the ring's

    return ids, lengths, C, step_rules, _blocks.step_plans(step_rules(0, 0), layout, P)


def _meet(ids, lengths, q_pos, k_pos) -> bool:
    """Whether some query at ``q_pos`` has the id of some visible key at ``k_pos``."""
    same = ids[:, q_pos][:, :, None] == ids[:, k_pos][:, None, :]  # (B, T, S)
    return bool((same & (k_pos[None, None, :] < lengths[:, None, None])).any())


KINDS = (*_blocks.MASKED_PAIR_KINDS, *_blocks.MASKED_DIAGONAL_KINDS)


def _naming(plans, kind: str):
    """A branch for ``_blocks._pair_call`` that names the kind it stands for (an index
    into KINDS) instead of computing it."""
    return lambda *operands: jnp.int32(KINDS.index(kind))


def _band_kind(rel: int, C: int, left: int) -> str:
    d = rel + np.arange(C)[:, None] - np.arange(C)[None, :]  # query - key position
    cells = (d >= 0) & (d <= left)
    return "skip" if not cells.any() else "full" if cells.all() else "general"


@pytest.mark.parametrize(
    "layout, T, left", [("contiguous", 12, 4), ("zigzag", 24, 10)]
)  # the sizes of the end-to-end cases
def test_the_ring_skips_every_chunk_pair_whose_documents_differ(layout, T, left):
    """Chunk pairs (a causal window): each pair the ring computes takes the band's kind,
    or skip when no row holds a query and a visible key of the same document; the sweep
    meets pairs skipped by the ids alone, a diagonal pair that the lengths leave empty,
    and pairs run for one row though the other row's documents differ."""
    ids, lengths, C, step_rules, plans = _setting(layout, T, is_causal=True, window=(left, 0))
    assert plans.pairs and plans.diagonal_kinds == ("skip", "own")
    seen = set()
    for r in range(P):
        for step in range(P):
            source = (r - step) % P
            rules = step_rules(r, source)
            chunks = _blocks._chunks(plans, *(jnp.zeros((B, T // P, 1, 4)),) * 3, rules)
            for a, c, qc, kc, diagonal in _blocks._pair_calls(plans, step == 0, r, source):
                pair = _blocks._pair_inputs(plans, chunks, rules, a, c, kc, ((), ()))
                rel = (qc - kc) * C
                got = KINDS[int(_blocks._pair_call(plans, _naming, rel, pair, None, diagonal))]
                q_pos, k_pos = np.arange(qc * C, (qc + 1) * C), np.arange(kc * C, (kc + 1) * C)
                meet = _meet(ids, lengths, q_pos, k_pos)
                band = "own" if diagonal else _band_kind(rel, C, left)
                assert got == (band if meet else "skip"), (layout, r, step, qc, kc)
                rows_meet = [
                    _meet(ids[b : b + 1], lengths[b : b + 1], q_pos, k_pos) for b in (0, 1)
                ]
                seen.add("diagonal skip" if diagonal and not meet else got)
                if band != "skip" and not meet:
                    seen.add("skipped by the ids alone")
                if band != "skip" and sum(rows_meet) == 1:
                    seen.add("run for one row")
    assert {"skipped by the ids alone", "diagonal skip", "run for one row"} <= seen, seen


@pytest.mark.parametrize("layout, causal", [("zigzag", True), ("contiguous", False)])
def test_the_ring_skips_every_whole_shard_call_whose_documents_differ(layout, causal):
    """Whole shards (causal or no rule): the ring makes the calls the positional rule
    picks, or none when none of them holds a query and a visible key of the same
    document in any row; the sweep meets such skips."""
    T = 24
    ids, lengths, C, step_rules, plans = _setting(layout, T, is_causal=causal)
    assert not plans.pairs
    skipped = 0
    for r in range(P):
        for step in range(P):
            source = (r - step) % P
            index, alternatives = _blocks._whole_choice(
                plans, step == 0, r, source, step_rules(r, source)
            )
            got = alternatives[int(index)]
            base_index, base = _blocks._whole_calls(plans, step == 0, r, source)
            positional = base[int(base_index)]
            q_held, k_held = _held(layout, r, C), _held(layout, source, C)
            meet = any(
                _meet(ids, lengths, q_held[rows], k_held[cols]) for _, rows, cols in positional
            )
            assert got == (positional if meet else []), (layout, r, step)
            skipped += bool(positional) and not meet
    assert skipped > 0
