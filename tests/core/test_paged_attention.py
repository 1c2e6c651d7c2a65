"""nanoattn.paged_attention against the float64 reference of each sequence alone.

Each sequence's keys are gathered from the pool in numpy through its page table, its
queries cut from the token-major query, and np_attention (tests/_reference.py) gives
its rows; padding rows must be zeros (log-sum-exp -inf). Every backend that serves
the call (tests/_backends.py), outputs, log-sum-exp and gradients (query, pages,
sinks) on those that differentiate; pages in shuffled physical order, page sizes 1,
16 and a prime, sequences with no query, NaN and inf in every page and slot a
sequence must not read, and invalid page tables, lengths and starts: one-line errors
when concrete, NaN in the rows concerned (and no other row changed) under jit. Entries
-1 (pages a windowed sequence gave back): exact where no query sees them (a window, or
sink tokens a mask_fn keeps), NaN for a query that does, on every backend.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import nanoattn
from nanoattn._backends import registry
from nanoattn._backends.flash import paged as flash_paged
from nanoattn._base.rules import Rules

from _backends import paged_serving, require_paged
from _reference import np_attention_vjp, np_lse, randn

N, K, H = 6, 2, 8


@functools.cache
def _jitted(implementation, rules_key):
    """The paged call and its VJP, jitted once per backend and rules: every backend that
    serves a paged call gives gradients for the query, the pages and the sinks
    (docs/conventions.md, "Paged attention")."""
    rules = dict(rules_key)

    def call(q, kp, vp, table, lengths, starts, sinks):
        extra = dict(rules)
        if sinks is not None:
            extra["sinks"] = sinks
        return nanoattn.paged_attention(
            q, kp, vp, table, lengths, starts, return_residual=True,
            implementation=implementation, **extra,
        )  # fmt: skip

    @jax.jit
    def forward_backward(q, kp, vp, table, lengths, starts, sinks, d_out):
        (out, lse), vjp = jax.vjp(
            lambda q, kp, vp, sinks: call(q, kp, vp, table, lengths, starts, sinks),
            q, kp, vp, sinks,
        )  # fmt: skip
        return out, lse, vjp((d_out, jnp.zeros_like(lse)))

    return forward_backward


class Layout:
    """A paged batch: B sequences with their lengths and query counts, pages of
    ``page_size`` placed in shuffled physical order in a pool with spare pages, and
    the inputs (NaN and inf in every page and slot no sequence may read)."""

    def __init__(self, lengths, q_lens, page_size, seed=0, pad_rows=3, spare=4, value_width=H):
        rng = np.random.default_rng(seed)
        self.lengths = np.asarray(lengths, np.int32)
        self.q_lens = np.asarray(q_lens, np.int32)
        self.page_size = ps = page_size
        B = len(lengths)
        held = [-(-int(n) // ps) for n in lengths]
        M = max(max(held), 1) + 1  # one entry past every sequence's pages
        P = sum(held) + spare
        order = rng.permutation(P)  # physical pages in shuffled order, the spare ones last
        table = np.full((B, M), -5, np.int32)  # entries past the held pages: garbage
        used = 0
        for b, count in enumerate(held):
            table[b, :count] = order[used : used + count]
            used += count
        self.table = table
        self.starts = np.concatenate([[0], np.cumsum(self.q_lens)]).astype(np.int32)
        Tq = int(self.starts[-1]) + pad_rows
        self.q = randn(seed + 1, Tq, N, H)
        self.q[self.starts[-1] :] = np.nan  # padding rows hold anything
        kp, vp = randn(seed + 2, P, ps, K, H), randn(seed + 3, P, ps, K, value_width)
        readable = np.zeros((P, ps), bool)  # the slots some sequence holds
        for b in range(B):
            for j in range(held[b]):
                slots = min(ps, int(lengths[b]) - j * ps)
                readable[table[b, j], :slots] = True
        for i, bad in enumerate((np.nan, np.inf, -np.inf)):  # stale content elsewhere
            kp[~readable] = np.where(rng.random((~readable).sum())[:, None, None] < 0.5, bad, 0)
            vp[~readable] = bad if i == 0 else vp[~readable]
        self.kp, self.vp = kp, vp
        self.d_out = randn(seed + 4, Tq, N, value_width)
        self.d_out[self.starts[-1] :] = 0

    def arrays(self):
        return (self.q, self.kp, self.vp, self.table, self.lengths, self.starts)

    def sequence(self, b):
        """Sequence b's queries (1, q_len, N, H), keys and values (1, length, K, H)."""
        ps, length = self.page_size, int(self.lengths[b])
        pages = self.table[b, : -(-length // ps)]
        keys = self.kp[pages].reshape(-1, K, H)[:length][None]
        values = self.vp[pages].reshape(-1, K, self.vp.shape[-1])[:length][None]
        rows = slice(self.starts[b], self.starts[b + 1])
        return self.q[rows][None], keys, values, rows, pages


def _allowed(q_len, length, window=None, causal=True, mask=None, b=0):
    positions = length - q_len + np.arange(q_len)[:, None]
    j = np.arange(length)[None]
    allowed = np.ones((q_len, length), bool)
    if causal:
        allowed &= j <= positions
    if window is not None:
        allowed &= (j >= positions - window[0]) & (j <= positions + window[1])
    if mask is not None:
        allowed = allowed[None] & mask(b, np.arange(N)[:, None, None], positions[None], j[None])
    return allowed


def _check(layout, implementation, sinks=None, window=None, causal=True, cap=None,
           mask=None, np_mask=None):  # fmt: skip
    rules = dict(window=window, is_causal=causal, logit_soft_cap=cap, mask_fn=mask)
    rules = {k: v for k, v in rules.items() if v is not None}
    args = [jnp.asarray(x) for x in layout.arrays()]
    sinks = None if sinks is None else jnp.asarray(sinks)
    # skipped only on the backend's refusal: an error of a backend that serves the
    # call (its forward or its VJP) fails the test
    require_paged(implementation, *args, sinks=sinks, return_residual=True, **rules)
    run = _jitted(implementation, tuple(sorted(rules.items(), key=lambda kv: kv[0])))
    out, lse, grads = run(*args, sinks, jnp.asarray(layout.d_out))
    out, lse = np.asarray(out), np.asarray(lse)
    end = layout.starts[-1]
    empty = -np.inf if sinks is None else np.asarray(sinks, np.float32)  # a row with nothing
    assert (out[end:] == 0).all() and (lse[end:] == empty).all()  # padding rows
    dq = np.zeros(layout.q.shape)
    dk, dv = np.zeros(layout.kp.shape), np.zeros(layout.vp.shape)
    dsinks = np.zeros(N)
    for b in range(len(layout.lengths)):
        q, k, v, rows, pages = layout.sequence(b)
        if q.shape[1] == 0:
            continue
        allowed = _allowed(q.shape[1], k.shape[1], window, causal, np_mask, b)
        d_out = layout.d_out[rows][None]
        want, g = np_attention_vjp(q, k, v, d_out, allowed, None, None, cap, sinks)
        where = f"{implementation}, sequence {b}"
        np.testing.assert_allclose(out[rows], want[0], atol=2e-5, rtol=2e-5, err_msg=where)
        want_lse = np_lse(q, k, allowed, None, None, cap, sinks)[0]
        finite = np.isfinite(want_lse)
        assert (np.isfinite(lse[rows]) == finite).all(), where
        np.testing.assert_allclose(lse[rows][finite], want_lse[finite], atol=2e-5, rtol=2e-5)
        dq[rows] = g[0][0]
        flat = slice(0, k.shape[1])
        for pool, grad in ((dk, g[1]), (dv, g[2])):
            full = np.zeros((len(pages) * layout.page_size, K, pool.shape[-1]))
            full[flat] = grad[0]
            np.add.at(pool, pages, full.reshape(len(pages), layout.page_size, K, -1))
        if sinks is not None:
            dsinks += g[4]
    for name, got, want in zip(("dq", "dk", "dv"), grads, (dq, dk, dv)):
        got = np.asarray(got)
        readable = np.isfinite(want) if name == "dq" else slice(None)
        np.testing.assert_allclose(
            got[readable], want[readable], atol=1e-4, rtol=1e-4, err_msg=f"{name}"
        )
    if sinks is not None:
        np.testing.assert_allclose(grads[3], dsinks, atol=1e-4, rtol=1e-4)


MIXED = dict(lengths=[37, 1, 13, 20, 0, 9], q_lens=[5, 1, 0, 4, 0, 9])


@pytest.mark.parametrize("name", registry.names())
@pytest.mark.parametrize("page_size", [1, 5, 16])
def test_a_mixed_batch_equals_each_sequence_alone(name, page_size):
    _check(Layout(**MIXED, page_size=page_size), name)


@pytest.mark.parametrize("name", registry.names())
def test_values_of_their_own_width(name):
    """Value pages (P, page_size, K, Hv) with Hv != H give outputs (Tq, N, Hv)."""
    _check(Layout(**MIXED, page_size=5, value_width=5), name)


@pytest.mark.parametrize("name", registry.names())
def test_windows_soft_cap_sinks_and_bidirectional_rows(name):
    layout = Layout(**MIXED, page_size=5, seed=3)
    _check(layout, name, window=(6, 0), cap=3.0, sinks=randn(9, N))
    _check(layout, name, causal=False)


@pytest.mark.parametrize("name", registry.names())
def test_mask_fn_sees_the_sequence_and_positions(name):
    def mask_fn(b, n, q, k):
        return (k + b + n) % 3 != 0

    _check(Layout(**MIXED, page_size=5, seed=5), name, mask=mask_fn, np_mask=mask_fn)


@pytest.mark.parametrize("name", registry.names())
def test_the_result_does_not_depend_on_where_pages_sit(name):
    layout = Layout(**MIXED, page_size=5, seed=7)
    arrays = [jnp.asarray(x) for x in layout.arrays()]
    require_paged(name, *arrays)
    call = functools.partial(nanoattn.paged_attention, implementation=name)
    first = call(*arrays)
    P = layout.kp.shape[0]
    moved = np.random.default_rng(1).permutation(P)  # page p moves to slot moved[p]
    kp, vp = np.empty_like(layout.kp), np.empty_like(layout.vp)
    kp[moved], vp[moved] = layout.kp, layout.vp
    table = np.where(layout.table >= 0, moved[np.clip(layout.table, 0, None)], layout.table)
    second = call(arrays[0], jnp.asarray(kp), jnp.asarray(vp), jnp.asarray(table), *arrays[4:])
    np.testing.assert_array_equal(first, second)


@pytest.mark.parametrize("name", registry.names())
def test_sequences_longer_than_a_flash_key_block(name):
    """Pages of 7 (flash takes 18 a block: 126 keys): 300 keys (three blocks, the first
    out of a window of 130), 131 and 127 (a second block of 5 keys and of 1), so that
    each block's pages and positions come from its offset."""
    layout = Layout([300, 131, 3, 127], [20, 2, 3, 1], page_size=7, seed=13)
    rules = Rules.make_paged(*(jnp.asarray(x) for x in layout.arrays()))
    plan, _ = flash_paged.plan_of(rules, None, jnp.float32)
    assert 2 * plan.block_k < 300 and plan.block_k < 127 < 131 < 2 * plan.block_k
    _check(layout, name, window=(130, 0))


def test_a_row_that_attends_to_a_nan_key_is_nan():
    """NaN in one held key of sequence 0 (position 34, key/value head 1; its queries sit
    at 32 .. 36): the heads of that group of the rows that see it are NaN, output and
    log-sum-exp, on every backend that serves paged calls; the rows before it (causal),
    past the window, the other group's heads and every other sequence's rows are as in
    the clean call."""
    layout = Layout(**MIXED, page_size=5, seed=11)
    b, j, k = 0, 34, 1
    kp = layout.kp.copy()
    kp[layout.table[b, j // 5], j % 5, k] = np.nan
    clean = [jnp.asarray(x) for x in layout.arrays()]
    dirty = [clean[0], jnp.asarray(kp), *clean[2:]]
    rows = np.arange(layout.starts[b], layout.starts[b + 1])
    positions = layout.lengths[b] - len(rows) + np.arange(len(rows))
    heads = np.arange(N) // (N // K) == k
    names = paged_serving(*layout.arrays())
    assert len(names) >= 2  # the reference and a kernel at least
    for name in names:
        for window in (None, (1, 0)):  # (1, 0): the row at 36 no longer sees key 34
            rules = dict(window=window, return_residual=True, implementation=name)
            call = jax.jit(functools.partial(nanoattn.paged_attention, **rules))
            want, got = (jax.tree.map(np.asarray, call(*arrays)) for arrays in (clean, dirty))
            reach = (positions >= j) & (window is None or positions - 1 <= j)
            sees = np.zeros(want[1].shape, bool)  # (Tq, N)
            sees[rows[reach]] = heads
            assert reach.any() and not reach.all()
            where = f"{name}, window={window}"
            for x, w in zip(got, want):
                assert np.isnan(x[sees]).all(), where
                assert not np.isnan(x[~sees]).any(), where
                np.testing.assert_array_equal(x[~sees], w[~sees], err_msg=where)


class GivenBack(Layout):
    """A :class:`Layout` whose sequences gave back (page-table entry -1) every page that
    no query of theirs sees under ``window=(left, 0)`` past the first ``sinks`` keys (a
    sequence with no query: every page), those pages' content NaN in the call's pool;
    the reference (``sequence``) reads the table and the pool before, whose pages no
    query sees."""

    def __init__(self, *args, left: int, sinks: int = 0, **options):
        super().__init__(*args, **options)
        ps, self.kept = self.page_size, (self.table.copy(), self.kp.copy(), self.vp.copy())
        for b, (length, q_len) in enumerate(zip(self.lengths, self.q_lens)):
            end = max(0, length - q_len - left) // ps if q_len else -(-length // ps)
            for j in range(-(-sinks // ps) if q_len else 0, end):
                self.kp[self.table[b, j]] = self.vp[self.table[b, j]] = np.nan
                self.table[b, j] = -1
        self.given_back = int((self.table == -1).sum())

    def sequence(self, b):
        given, (self.table, self.kp, self.vp) = (self.table, self.kp, self.vp), self.kept
        try:
            return super().sequence(b)
        finally:
            self.table, self.kp, self.vp = given


GIVEN_BACK = dict(lengths=[37, 1, 13, 30, 0, 19], q_lens=[5, 1, 0, 4, 0, 9])


@pytest.mark.parametrize("name", registry.names())
@pytest.mark.parametrize("page_size", [1, 5])
def test_a_page_given_back_is_never_read_where_no_query_sees_it(name, page_size):
    """Entries -1 (pages a windowed layer gave back, NaN in the pages they were) wholly
    before every query's window: outputs, log-sum-exp and gradients of the call on
    the table without them, on every backend; no page is read for them."""
    layout = GivenBack(**GIVEN_BACK, page_size=page_size, seed=17, left=6)
    assert layout.given_back >= 4
    _check(layout, name, window=(6, 0))


@pytest.mark.parametrize("name", registry.names())
def test_a_page_given_back_past_sink_tokens_is_never_read(name):
    """The sink tokens' page stays, the pages between them and the window are given
    back: a mask_fn that keeps the window and the first 3 keys (a layer's sink tokens)
    never reads them (native does not serve mask_fn: skipped with its reason)."""
    left, sinks = 6, 3

    def window_or_sink(b, n, q, k):
        return (q - k <= left) | (k < sinks)

    layout = GivenBack(**GIVEN_BACK, page_size=5, seed=19, left=left, sinks=sinks)
    assert layout.given_back >= 3 and (layout.table[:, 0] != -1)[layout.q_lens > 0].all()
    _check(layout, name, mask=window_or_sink, np_mask=window_or_sink)


def test_a_page_given_back_that_a_query_sees_makes_that_query_nan():
    """An entry -1 inside a query's window reads as NaN keys (no page is read for it):
    the rows that see one of its positions are NaN on every backend, eager and under
    jit; every other sequence's rows are as in the call on the table without it (a
    row of the same sequence that does not see it may share a kernel's block with
    one that does: docs/conventions.md, "Masked content is never read")."""
    layout = Layout(**GIVEN_BACK, page_size=5, seed=23)
    layout.kp[0], layout.vp[0] = randn(29, 5, K, H), randn(31, 5, K, H)  # finite: a page 0
    table = layout.table.copy()  # read in place of the one given back would not be NaN
    b = 0  # 37 keys, queries at 32..36: with window (31, 0) all but the query at 36 see
    table[b, 0] = -1  # keys 0..4, given back
    rows = np.arange(layout.starts[b], layout.starts[b + 1])
    others = np.ones(layout.q.shape[0], bool)
    others[rows] = False
    window = dict(window=(31, 0))  # a band (every backend), then the same as a mask_fn
    as_mask = dict(mask_fn=lambda b, n, q, k: q - k <= 31)
    calls = [(name, rules) for rules in (window, as_mask)
             for name in paged_serving(*layout.arrays(), **rules)]  # fmt: skip
    assert len(calls) >= 4
    for name, rules in calls:
        call = functools.partial(nanoattn.paged_attention, **rules, implementation=name)
        good = np.asarray(call(*(jnp.asarray(x) for x in layout.arrays())))
        arrays = [jnp.asarray(x) for x in layout.arrays()]
        arrays[3] = jnp.asarray(table)
        for run in (call, jax.jit(call)):
            out = np.asarray(run(*arrays))
            assert np.isnan(out[rows[:4]]).all(), name  # positions 32..35 see key <= 4
            np.testing.assert_array_equal(out[others], good[others], err_msg=name)
            if name == "xla":  # the reference: each row alone
                np.testing.assert_array_equal(out[rows[4]], good[rows[4]])


def _paged_kernels():
    """The registered backends other than the reference ("xla", the contract's
    definition) that serve a plain paged call here (each example below runs one)."""
    return [name for name in paged_serving(*Layout([3], [1], 2).arrays()) if name != "xla"]


@settings(max_examples=6, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 23), st.integers(0, 6)), min_size=1, max_size=5),
    st.sampled_from([1, 3, 16]),
    st.integers(0, 2**16),
    st.sampled_from(_paged_kernels()),
)
def test_random_layouts_equal_each_sequence_alone(sequences, page_size, seed, name):
    lengths = [max(n, q) for n, q in sequences]
    q_lens = [q for _, q in sequences]
    _check(Layout(lengths, q_lens, page_size, seed=seed), name)


ALL = "every row"  # query starts that are no layout: no row's sequence can be told


def _bad_calls():
    layout = Layout(**MIXED, page_size=5)
    _, _, _, table, lengths, starts = layout.arrays()
    bad_table = table.copy()
    bad_table[3, 1] = 99  # a page sequence 3 holds, outside the pool
    partial = table.copy()
    partial[2, 2] = -2  # sequence 2's last page, partial (13 keys in pages of 5); -1 is
    # a page given back, served (test_a_page_given_back_...)
    long = lengths.copy()
    long[1] = table.shape[1] * 5 + 1
    short = lengths.copy()
    short[5] = 8  # below its 9 queries
    down = starts.copy()
    down[3] = down[2] - 1  # sequence 2's rows end before they start
    Tq = layout.q.shape[0]

    def starts_with(b, value):
        moved = starts.copy()
        moved[b] = value
        return dict(query_starts=moved)

    return layout, {
        "page id": (dict(page_table=bad_table), r"page_table\[3, 1\]=99 is not a page", [3]),
        "partial last page": (dict(page_table=partial), r"page_table\[2, 2\]=-2 is not", [2]),
        "lengths above": (dict(kv_lengths=long), r"kv_lengths\[1\]=", [1]),
        "lengths below": (dict(kv_lengths=short), r"kv_lengths\[5\]=8", [5]),
        "decreasing starts": (
            dict(query_starts=down), r"query_starts must be non-decreasing", ALL
        ),
        "starts past Tq": (starts_with(-1, Tq + 1), r"query_starts\[6\]=.* is past", ALL),
        "starts from 1": (starts_with(0, 1), r"query_starts\[0\] must be 0, got 1", ALL),
        "starts from -1": (starts_with(0, -1), r"query_starts\[0\] must be 0, got -1", ALL),
    }  # fmt: skip


@pytest.mark.parametrize("case", list(_bad_calls()[1]))
def test_invalid_inputs_raise_when_concrete_and_poison_their_rows_under_jit(case):
    """One line naming the argument when concrete; under jit NaN in exactly the rows
    of the sequences concerned (every row, for starts that are no layout), the other
    rows as in the good call."""
    layout, cases = _bad_calls()
    changes, message, sequences = cases[case]
    names = ("query", "key_pages", "value_pages", "page_table", "kv_lengths", "query_starts")
    arrays = dict(zip(names, (jnp.asarray(x) for x in layout.arrays())))
    good = nanoattn.paged_attention(**arrays, implementation="xla")  # the reference
    arrays |= {k: jnp.asarray(v) for k, v in changes.items()}
    with pytest.raises(ValueError, match=message):
        nanoattn.paged_attention(**arrays)
    served = paged_serving(*layout.arrays())  # asked of the good call: the same rules
    for name in served:
        bad = np.asarray(
            jax.jit(functools.partial(nanoattn.paged_attention, implementation=name))(**arrays)
        )
        hit = np.full(bad.shape[0], sequences == ALL)
        for b in [] if sequences == ALL else sequences:
            hit[layout.starts[b] : layout.starts[b + 1]] = True
        assert np.isnan(bad[hit]).all(), name
        np.testing.assert_allclose(bad[~hit], np.asarray(good)[~hit], atol=2e-5, err_msg=name)
    assert len(served) >= 2  # the reference and the kernels


@pytest.mark.parametrize(
    "shapes, message",
    [
        (((1, 2, 4), (0, 2, 1, 4), (1, 2)), r"key_pages must hold at least one page"),
        (((2, 2, 4), (3, 2, 1, 4), (0, 2)), r"page_table must have at least one sequence"),
        (((1, 2, 0), (3, 2, 1, 0), (1, 2)), r"head width H is 0"),
    ],
    ids=["empty pool", "no sequence", "heads of width 0"],
)
def test_empty_sizes_raise_one_line(shapes, message):
    (q, pages, table) = shapes
    B = table[0]
    with pytest.raises(ValueError, match=message):
        nanoattn.paged_attention(
            jnp.ones(q), jnp.ones(pages), jnp.ones(pages), jnp.zeros(table, jnp.int32),
            jnp.ones((B,), jnp.int32), jnp.arange(B + 1, dtype=jnp.int32),
        )  # fmt: skip


def test_a_call_with_no_query_token_is_empty_on_every_backend():
    pages, table = jnp.ones((3, 2, 1, 4)), jnp.zeros((1, 2), jnp.int32)
    lengths, starts = jnp.array([2]), jnp.array([0, 0])
    arrays = (jnp.ones((0, 2, 4)), pages, pages, table, lengths, starts)
    names = paged_serving(*arrays, return_residual=True)
    assert len(names) >= 2  # the reference and a kernel at least
    for name in names:
        out, lse = nanoattn.paged_attention(*arrays, return_residual=True, implementation=name)
        assert out.shape == (0, 2, 4) and lse.shape == (0, 2), name


def test_flash_memory_grows_with_the_block_not_the_page_table():
    """Compiled temporaries of the flash kernel at 64 and at 512 pages per sequence (the
    same tokens held): O(pages held and blocks), never O(B * capacity)."""

    def temp_bytes(M):
        Tq, B, ps, P = 20, 4, 16, 64
        shapes = (
            jax.ShapeDtypeStruct((Tq, N, H), jnp.float32),
            jax.ShapeDtypeStruct((P, ps, K, H), jnp.float32),
            jax.ShapeDtypeStruct((P, ps, K, H), jnp.float32),
            jax.ShapeDtypeStruct((B, M), jnp.int32),
            jax.ShapeDtypeStruct((B,), jnp.int32),
            jax.ShapeDtypeStruct((B + 1,), jnp.int32),
        )
        call = functools.partial(nanoattn.paged_attention, implementation="flash")
        return jax.jit(call).lower(*shapes).compile().memory_analysis().temp_size_in_bytes

    small, large = temp_bytes(64), temp_bytes(512)
    per_token_capacity = 4 * 512 * 16 * K * H * 4  # B * capacity keys, f32
    assert large < small + 4 * 512 * 16 and large < per_token_capacity / 8, (small, large)
