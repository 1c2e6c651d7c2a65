"""The host side of a paged cache alone: ``PageAllocator``'s rules between two steps
(docs/decoding.md, "Between two steps"), each served exactly or refused in one line
that changes nothing, and its invariants under random operations. What a sequence
reads through the allocator's batches is tests/layers/test_paged_programs.py's."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nanoattn import PageAllocator, PoolExhausted


def _state(alloc):
    """Everything the allocator shows: a refusal must leave it equal."""
    held = {s: (alloc.length(s), alloc.unwritten(s), alloc.pages_of(s)) for s in alloc.sequences()}
    return held, alloc.free_page_ids(), alloc.pending_copies()


def _step(alloc, *rows, tokens=16):
    """A step's batch of every row's unwritten tokens, confirmed as if it ran."""
    batch = alloc.batch([(s, alloc.unwritten(s)) for s in rows], tokens)
    alloc.confirm(batch)
    return batch


def _written(pages=9, page_size=4, **options):
    """An allocator with sequence "a" of 6 written tokens (a partial second page)."""
    alloc = PageAllocator(pages, page_size, max_sequences=3, max_pages=5, **options)
    alloc.allocate("a", 6)
    _step(alloc, "a")
    return alloc


def test_a_fork_before_the_parent_is_written_is_refused():
    alloc = PageAllocator(8, 4, max_sequences=2, max_pages=4)
    alloc.allocate("sys", 6)
    before = _state(alloc)
    with pytest.raises(
        ValueError, match=r"^fork: sequence 'sys' has 6 tokens no step has written yet; run a step"
    ):
        alloc.fork("sys", "req")
    assert _state(alloc) == before
    _step(alloc, "sys")
    alloc.fork("sys", "req")  # now its keys are in its pages
    assert alloc.unwritten("req") == 0 and alloc.pages_of("req") == alloc.pages_of("sys")


def test_a_copy_whose_source_is_another_copys_target_reads_that_ones_source():
    """fork, extend, rewind, fork, extend: the second copy's source is the first's
    target, not filled before the step: it is resolved to the first's source."""
    alloc = _written()
    p1 = alloc.pages_of("a")[1]
    alloc.fork("a", "b")
    alloc.extend("b", 1)
    p2 = alloc.pages_of("b")[1]
    alloc.rewind("b", 1)
    alloc.fork("b", "c")
    alloc.extend("c", 1)
    p3 = alloc.pages_of("c")[1]
    assert alloc.pending_copies() == [(p1, p2), (p1, p3)]
    assert len({p1, p2, p3}) == 3


def test_a_freed_copy_target_drops_its_copy_and_may_take_another():
    alloc = _written(pages=4)
    alloc.fork("a", "b")
    alloc.extend("b", 1)
    target = alloc.pages_of("b")[1]
    alloc.free("b")
    assert alloc.pending_copies() == [] and target in alloc.free_page_ids()
    alloc.fork("a", "c")
    alloc.extend("c", 1)  # the last free page: the one b's copy had
    assert alloc.pending_copies() == [(alloc.pages_of("a")[1], target)]
    targets = [t for _, t in _step(alloc, "c").copies.tolist() if t >= 0]
    assert targets == [target]


def test_the_copy_page_counts_in_the_exhaustion_check():
    """A fork's write into the shared partial page needs the copy's page besides the new
    ones: with exactly the new ones free, the pool is exhausted and nothing changes."""
    alloc = _written(pages=4)  # a: pages 0-1 of 4
    alloc.fork("a", "b")
    alloc.allocate("c", 4)  # one page: one left
    before = _state(alloc)
    with pytest.raises(PoolExhausted, match=r"sequence 'b' needs 2 more page\(s\) and 1 are free"):
        alloc.extend("b", 3)  # 9 tokens: one new page, and the copy of the shared one
    assert _state(alloc) == before
    alloc.extend("b", 2)  # 8 tokens: only the copy
    assert alloc.free_page_ids() == []


def test_the_same_extension_rewound_twice():
    alloc = _written()
    alloc.extend("a", 3)
    alloc.rewind("a", 1)
    alloc.rewind("a", 1)
    assert alloc.length("a") == 7 and alloc.unwritten("a") == 1
    with pytest.raises(ValueError, match=r"rewind: n=2 is outside \[0, 1\]"):
        alloc.rewind("a", 2)
    alloc.rewind("a", 1)
    assert alloc.length("a") == 6 and alloc.unwritten("a") == 0
    assert len(alloc.pages_of("a")) == 2 and alloc.free_pages == 7


def test_a_rewind_takes_back_written_tokens_and_the_next_step_writes_them_again():
    alloc = _written()
    alloc.extend("a", 3)
    _step(alloc, "a")
    alloc.rewind("a", 2)
    assert alloc.length("a") == 7 and alloc.unwritten("a") == 0
    alloc.extend("a", 1)
    batch = _step(alloc, "a")
    assert batch.kv_lengths[0] == 8 and batch.query_starts[:2].tolist() == [0, 1]


def test_batch_is_pure_and_confirm_takes_its_copies():
    alloc = _written()
    alloc.fork("a", "b")
    alloc.extend("b", 1)
    first = alloc.batch([("b", 1)], tokens=7)
    again = alloc.batch([("b", 1)], tokens=7)  # a retried step: the same batch
    for name in ("page_table", "kv_lengths", "query_starts", "copies"):
        np.testing.assert_array_equal(getattr(first, name), getattr(again, name))
    assert first.page_table.shape == (3, 5) and first.copies.shape == (3, 2)
    assert (first.page_size, first.pool_pages) == (4, 9)
    assert first.copies[0].tolist() == [alloc.pages_of("a")[1], alloc.pages_of("b")[1]]
    assert first.query_starts.tolist() == [0, 1, 1, 1] and first.kv_lengths.tolist() == [7, 0, 0]
    assert len(alloc.pending_copies()) == 1  # until the step is confirmed
    alloc.confirm(again)
    assert alloc.pending_copies() == [] and alloc.unwritten("b") == 0
    assert (alloc.batch([("b", 0)], tokens=7).copies == -1).all()


def test_nothing_changes_the_allocator_while_a_batch_waits_for_its_confirm():
    alloc = _written()
    alloc.extend("a", 1)
    batch = alloc.batch([("a", 1)], tokens=4)
    before = _state(alloc)
    calls = [("allocate", "b", 1), ("extend", "a", 1), ("fork", "a", "b"), ("rewind", "a", 1),
             ("free", "a")]  # fmt: skip
    for name, *args in calls:
        with pytest.raises(ValueError, match=rf"^{name}: a step's batch is waiting to be"):
            getattr(alloc, name)(*args)
    assert _state(alloc) == before
    other = PageAllocator(9, 4, max_sequences=3, max_pages=5)
    other.allocate("a", 7)
    with pytest.raises(ValueError, match=r"^confirm: this is not the batch the allocator made"):
        alloc.confirm(other.batch([("a", 7)], tokens=8))
    alloc.confirm(batch)
    with pytest.raises(ValueError, match=r"confirmed already"):
        alloc.confirm(batch)
    alloc.extend("a", 1)


@pytest.mark.parametrize(
    "rows, tokens, message",
    [
        ([("a", 2), ("a", 2)], 8, r"sequence 'a' is in rows twice; a step takes each"),
        ([("a", 2.0)], 8, r"q_len of sequence 'a' must be 2, the tokens allocate/extend .* 2.0"),
        ([("a", True)], 8, r"q_len of sequence 'a' must be 2, .* got True"),
        ([("a", 1)], 8, r"q_len of sequence 'a' must be 2, .* got 1"),
        ([("a", 3)], 8, r"q_len of sequence 'a' must be 2, .* got 3"),
        ([("b", 0)], 8, r"no sequence 'b' is allocated"),
        ([("a", 2)], 1, r"the step's rows bring 2 tokens, more than its tokens=1"),
        ([("a", 2)], 0, r"tokens must be an int >= 1, got 0"),
        ([("a",)], 8, r"rows\[0\] must be \(seq_id, q_len\)"),
    ],
)  # fmt: skip
def test_a_batch_that_would_misplace_a_token_is_refused(rows, tokens, message):
    """The same sequence twice (two writes to one slot), a float or wrong q_len (a token
    extended but never fed would be read by every later step)."""
    alloc = _written()
    alloc.extend("a", 2)
    before = _state(alloc)
    with pytest.raises((ValueError, KeyError), match=message):
        alloc.batch(rows, tokens)
    assert _state(alloc) == before
    alloc.extend("a", 0)  # no batch is waiting


@pytest.mark.parametrize(
    "options, message",
    [
        (dict(max_copies=-1), r"max_copies must be an int >= 0, got -1"),
        (dict(pages=0), r"pages must be an int >= 1, got 0"),
        (dict(page_size=2.0), r"page_size must be an int >= 1, got 2.0"),
        (dict(max_pages=True), r"max_pages must be an int >= 1, got True"),
        (dict(seed=-3), r"seed must be an int >= 0, got -3"),
    ],
)
def test_bad_sizes_are_refused(options, message):
    sizes = dict(pages=4, page_size=2, max_sequences=2, max_pages=2) | options
    with pytest.raises(ValueError, match=message):
        PageAllocator(sizes.pop("pages"), sizes.pop("page_size"), **sizes)


def test_numpy_integers_are_taken_where_ints_are():
    alloc = PageAllocator(np.int64(6), np.int32(3), max_sequences=np.int64(2),
                          max_pages=np.int16(3), max_copies=np.int64(1))  # fmt: skip
    alloc.allocate("a", np.int64(4))
    alloc.rewind("a", np.int32(1))
    alloc.extend("a", np.int64(2))
    batch = alloc.batch([("a", np.int64(5))], tokens=np.int32(8))
    assert batch.kv_lengths[0] == 5 and alloc.refs(np.int64(alloc.pages_of("a")[0])) == 1


@pytest.mark.parametrize("page", [-1, 9, 1.0, True])
def test_refs_of_a_page_outside_the_pool_is_refused(page):
    with pytest.raises(ValueError, match=r"page must be an int in \[0, 9\)"):
        _written().refs(page)


def test_a_copy_past_max_copies_is_refused_until_a_step_carries_them():
    alloc = _written(max_copies=1)
    alloc.fork("a", "b")
    alloc.fork("a", "c")
    alloc.extend("b", 1)
    before = _state(alloc)
    with pytest.raises(ValueError, match=r"^extend: sequence 'c' writes into a page it shares"):
        alloc.extend("c", 1)
    assert _state(alloc) == before
    _step(alloc, "b")
    alloc.extend("c", 1)
    assert len(alloc.pending_copies()) == 1


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from("afxrsbk"), st.integers(0, 4), st.integers(0, 9)),
                max_size=40))  # fmt: skip
def test_the_allocator_keeps_its_invariants(operations):
    """Random allocate, extend, fork, rewind, free, step and accept (after a step if
    the sequence has unwritten tokens; the last extension's tokens at the indices the
    bits of a number say): every page is held by as many sequences as its count says,
    no page is free and held, a pending copy's or slot move's target is held by one
    sequence and no two share one, and freeing everything returns every page once."""
    _keeps_its_invariants(operations)


def test_accepts_keep_the_allocator_invariants():
    """The same invariants over seeded programs rich in trees' steps and accepts (the
    hypothesis programs above rarely reach an accept that moves tokens): accepts that
    move tokens, then rewinds, frees and forks before the step that carries them."""
    moved = 0
    for seed in range(40):
        rng = np.random.default_rng(seed)
        kinds = rng.choice(list("afxrsbk"), 40, p=[0.15, 0.2, 0.1, 0.1, 0.05, 0.1, 0.3])
        operations = [(k, int(rng.integers(0, 3)), int(rng.integers(0, 16))) for k in kinds]
        moved += _keeps_its_invariants(operations)
    assert moved >= 20, moved


def _keeps_its_invariants(operations) -> int:
    """Runs ``operations`` (kind, sequence, number), checking the invariants after each;
    returns how many accepts left slot moves pending."""
    moving = 0
    alloc = PageAllocator(16, 3, max_sequences=5, max_pages=6, seed=1, max_moves=8)
    contents = {}  # seq -> the token ids it holds, to check that a write never reaches another
    for kind, seq, n in operations:
        sid, other = f"s{seq}", f"s{(seq + 1) % 5}"
        try:
            if kind == "a" and sid not in contents:
                alloc.allocate(sid, n)
                contents[sid] = [(sid, i) for i in range(n)]
            elif kind == "x" and sid in contents:
                alloc.extend(sid, n)
                contents[sid] += [(sid, len(contents[sid]) + i) for i in range(n)]
            elif kind == "f" and sid in contents and other not in contents:
                alloc.fork(sid, other)
                contents[other] = list(contents[sid])
            elif kind == "r" and sid in contents:
                back = min(n, alloc.last_extension(sid))
                alloc.rewind(sid, back)
                del contents[sid][len(contents[sid]) - back :]
            elif kind == "s" and sid in contents:
                alloc.free(sid)
                del contents[sid]
            elif kind == "b":
                _step(alloc, *alloc.sequences()[:5], tokens=200)
            elif kind == "k" and sid in contents:  # a step (the tree's), then the accept
                if alloc.unwritten(sid):
                    _step(alloc, *alloc.sequences()[:5], tokens=200)
                start = alloc.length(sid) - alloc.last_extension(sid)
                kept = [i for i in range(alloc.last_extension(sid)) if n >> i & 1]
                alloc.accept(sid, kept)
                contents[sid] = contents[sid][:start] + [contents[sid][start + i] for i in kept]
                moving += bool(alloc.pending_moves())
        except ValueError:  # PoolExhausted, or a fork of unwritten tokens
            pass
        held = {}
        for s in alloc.sequences():
            assert alloc.length(s) == len(contents[s])
            assert len(alloc.pages_of(s)) == -(-alloc.length(s) // 3)
            for page in alloc.pages_of(s):
                held[page] = held.get(page, 0) + 1
        assert all(alloc.refs(p) == held.get(p, 0) for p in range(16))
        free = alloc.free_page_ids()
        assert not set(free) & set(held) and len(free) == 16 - len(held)
        targets = [t for _, t in alloc.pending_copies()]
        assert len(set(targets)) == len(targets) and all(held.get(t) == 1 for t in targets)
        moved = [t for _, t in alloc.pending_moves()]
        assert len(set(moved)) == len(moved) and all(held.get(t // 3) == 1 for t in moved)
    for s in alloc.sequences():
        alloc.free(s)
    assert sorted(alloc.free_page_ids()) == list(range(16))
    return moving
