"""Query-aware page selection on a paged cache (``AttentionConfig(page_selection=k)``,
docs/decoding.md "Page selection"): each page's key bounds against a plain model of
the keys written into it over random programs (prefill chunks, decode tokens, forks
with their copies, rewinds, frees and reuse of pages), the pages a decode query reads
against a numpy ranking of those bounds and its output against the float64 attention
over those pages' keys, every row that is not reduced equal to the layer without
selection, ``k`` >= the pages equal to it throughout, a NaN key kept visible, and
misuse refused in one line."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _caches import halves
from flax import nnx

import nanoattn._layers.steps as steps
from nanoattn import PageAllocator
from nanoattn import nnx as nanoattn_nnx
from nanoattn.linen import AttentionConfig, CausalSelfAttention

from _layer_configs import paged_step

D, N, K = 24, 6, 2  # H = 4, G = 3
PS, PAGES, SEQS, MAX_PAGES, TQ = 3, 41, 3, 13, 11  # primes
SELECT = 2


def _config(**options):
    return AttentionConfig(D, N, n_kv_heads=K, rope_base=100.0, page_size=PS, **options)


@functools.cache
def _layer(select):
    """A paged layer with page selection ``select`` (None: none), the parameters all
    layers share, its empty cache and its jitted step."""
    layer = CausalSelfAttention(_config(page_selection=select))
    params, shapes, step = paged_step(layer, PAGES * PS, 3)
    empty = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), shapes)
    return layer, params, empty, step, jax.jit(step)


def _x(rng, n):
    return rng.standard_normal((n, D)).astype(np.float32)


class BoundsModel:
    """The plain model of the bounds: the keys written into each page since its first
    slot was last written (a copy takes its source's)."""

    def __init__(self):
        self.keys = {}

    def step(self, batch, pool):
        """After a confirmed step: its copies, then each written token's key."""
        for source, target in np.asarray(batch.copies).tolist():
            if target >= 0:
                self.keys[target] = list(self.keys.get(source, []))
        table, lengths = np.asarray(batch.page_table), np.asarray(batch.kv_lengths)
        starts = np.asarray(batch.query_starts)
        for b in range(len(lengths)):
            q_len = starts[b + 1] - starts[b]
            for position in range(lengths[b] - q_len, lengths[b]):
                page, slot = table[b, position // PS], position % PS
                if slot == 0:
                    self.keys[page] = []
                self.keys[page].append(pool[page, slot])

    def bounds(self, page):
        keys = np.stack(self.keys[page])  # (n, K, H)
        return np.stack([keys.min(0), keys.max(0)])


def test_bounds_follow_every_write_copy_and_reuse_and_unreduced_rows_equal_no_selection():
    """Seeded random programs through three layers sharing parameters: with selection
    k = 2, with k >= every sequence's pages, and without. After every step each held
    page's bounds equal the model's; rows that are not reduced (prefill chunks, decode
    rows of at most k + 1 pages) and every row of the k >= pages layer equal the
    layer without selection."""
    step, wide_step, plain_step = (_layer(s)[4] for s in (SELECT, MAX_PAGES, None))
    for seed in range(3):
        rng = np.random.default_rng(seed)
        alloc = PageAllocator(PAGES, PS, max_sequences=SEQS, max_pages=MAX_PAGES, seed=seed)
        caches = [_layer(s)[2] for s in (SELECT, MAX_PAGES, None)]
        model, reduced_rows, names = BoundsModel(), 0, iter(range(1000))
        for _ in range(24):
            live = alloc.sequences()
            op = rng.choice(["fork", "free", "rewind", "step", "step", "step"])
            if op == "fork" and live and len(live) < SEQS:
                alloc.fork(live[rng.integers(len(live))], next(names))
                continue
            if op == "free" and len(live) > 1:
                alloc.free(live[rng.integers(len(live))])
                continue
            rows, budget = [], TQ
            for seq_id in live:
                n = 1 if rng.random() < 0.7 else int(rng.integers(2, 5))
                room = MAX_PAGES * PS - alloc.length(seq_id)
                n = min(n, budget, room)
                if n and alloc.free_pages >= 2:
                    alloc.extend(seq_id, n)
                    rows.append((seq_id, n))
                    budget -= n
            if len(live) < SEQS and budget >= 2 and alloc.free_pages >= 4:
                seq_id, n = next(names), int(rng.integers(2, budget + 1))
                alloc.allocate(seq_id, n)
                rows.append((seq_id, n))
                budget -= n
            if not rows:
                continue
            x = np.pad(_x(rng, TQ - budget), ((0, budget), (0, 0)))[None]
            batch = alloc.batch(rows, tokens=TQ)
            outs = []
            for i, f in enumerate((step, wide_step, plain_step)):
                y, caches[i] = f(caches[i], jnp.asarray(x), batch)
                outs.append(np.asarray(y[0]))
            alloc.confirm(batch)
            model.step(batch, np.asarray(halves(caches[0])["key"]))
            np.testing.assert_allclose(outs[1], outs[2], atol=2e-5, rtol=2e-5)
            at = 0
            for seq_id, n in rows:
                pages = -(-alloc.length(seq_id) // PS)
                if n > 1 or pages <= SELECT + 1:
                    np.testing.assert_allclose(outs[0][at : at + n], outs[2][at : at + n],
                                               atol=2e-5, rtol=2e-5)  # fmt: skip
                else:
                    reduced_rows += 1
                at += n
            for seq_id in alloc.sequences():
                for page in alloc.pages_of(seq_id):
                    for cache in caches[:2]:
                        np.testing.assert_array_equal(
                            np.asarray(cache["key_bounds"][page]), model.bounds(page)
                        )
            if op == "rewind" and rows and rows[0][1] > 1:
                alloc.rewind(rows[0][0], 1)  # its key stays in the page's box
        assert reduced_rows > 5, reduced_rows  # the programs reach rows that select


def _attention64(q, keys, values):
    """Float64 attention of one query (N, H) over keys, values (S, K, H)."""
    q, keys, values = (np.asarray(a, np.float64) for a in (q, keys, values))
    G = N // K
    out = np.zeros(q.shape)
    for n in range(N):
        s = keys[:, n // G] @ q[n] / np.sqrt(q.shape[-1])
        w = np.exp(s - s.max())
        out[n] = (w / w.sum()) @ values[:, n // G]
    return out


def test_a_decode_row_reads_the_pages_of_highest_bound_and_attends_over_them(monkeypatch):
    """One mixed step, eager: a decode row of 7 pages (reduced to 2 and its last), a
    decode row of 2 pages and a prefill chunk. The attention's page table for the
    reduced row is numpy's ranking of the bounds of the keys in the pool, and its
    output the float64 attention over those pages' keys; the other rows' outputs equal
    the layer without selection."""
    _, _, empty, step, _ = _layer(SELECT)
    plain_step = _layer(None)[3]
    seen = []
    core = steps.paged_core

    def spy(params, cfg, q, key_pages, value_pages, pages, **rules):
        out = core(params, cfg, q, key_pages, value_pages, pages, **rules)
        if cfg.page_selection is not None:
            seen.append((q[0], key_pages, value_pages, pages.page_table, pages.kv_lengths, out[0]))
        return out

    monkeypatch.setattr(steps, "paged_core", spy)
    rng = np.random.default_rng(5)
    alloc = PageAllocator(PAGES, PS, max_sequences=SEQS, max_pages=MAX_PAGES, seed=5)
    caches = [empty, _layer(None)[2]]
    for rows in ([("a", 10), ("b", 1)], [("a", 10)], [("b", 4)], [("a", 1), ("b", 1), ("c", 6)]):
        for seq_id, n in rows:
            (alloc.extend if seq_id in alloc.sequences() else alloc.allocate)(seq_id, n)
        used = sum(n for _, n in rows)
        x = jnp.asarray(np.pad(_x(rng, used), ((0, TQ - used), (0, 0)))[None])
        batch = alloc.batch(rows, tokens=TQ)
        (y, caches[0]), (want, caches[1]) = (
            step(caches[0], x, batch),
            plain_step(caches[1], x, batch),
        )
        alloc.confirm(batch)
    q, keys, values, table, lengths, out = (None if a is None else np.asarray(a) for a in seen[-1])
    if values is None:  # a combined pool (P, PS, 2, K, H)
        keys, values = keys[:, :, 0], keys[:, :, 1]
    full = np.asarray(batch.page_table)[0][:7]  # a: 21 tokens, 7 full pages
    low, high = keys[full].min(1), keys[full].max(1)  # (7, K, H): each page's box
    qg = q[0].reshape(K, N // K, -1)[None]  # (1, K, G, H)
    score = np.maximum(qg * low[:, :, None], qg * high[:, :, None]).sum(-1).max((1, 2))
    chosen = [*sorted(np.argsort(-score[:6])[:SELECT].tolist()), 6]
    np.testing.assert_array_equal(table[0, : SELECT + 1], full[chosen])
    assert lengths[0] == (SELECT + 1) * PS
    kv = [np.concatenate([arr[p] for p in full[chosen]]) for arr in (keys, values)]
    np.testing.assert_allclose(out[0], _attention64(q[0], *kv), atol=2e-5, rtol=2e-5)
    y, want = np.asarray(y[0]), np.asarray(want[0])
    assert not np.allclose(y[0], want[0], atol=1e-3)  # the left-out pages mattered
    np.testing.assert_allclose(y[1:8], want[1:8], atol=2e-5, rtol=2e-5)  # b's decode, c's chunk


def test_nnx_selects_the_same_pages_as_linen():
    _, params, empty, _, step = _layer(SELECT)
    module = nanoattn_nnx.from_linen(_config(page_selection=SELECT), params, rngs=nnx.Rngs(0))
    module.init_cache(1, PAGES * PS)
    assert module.cache.key_bounds[...].shape == (PAGES, 2, K, D // N)
    alloc = PageAllocator(PAGES, PS, max_sequences=SEQS, max_pages=MAX_PAGES, seed=6)
    rng, cache = np.random.default_rng(6), empty
    for n in (11, 1, 1):
        (alloc.extend if "a" in alloc.sequences() else alloc.allocate)("a", n)
        x = jnp.asarray(np.pad(_x(rng, n), ((0, TQ - n), (0, 0)))[None])
        batch = alloc.batch([("a", n)], tokens=TQ)
        want, cache = step(cache, x, batch)
        got = module(x, decode=True, pages=batch, deterministic=True)
        alloc.confirm(batch)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, rtol=2e-5)


def test_a_nan_key_stays_visible_to_a_decode_query():
    """A NaN in a real key makes its page's bounds NaN: that page is always read, so the
    NaN reaches the output instead of hiding in a page left out."""
    *_, empty, _, step = _layer(SELECT)
    alloc = PageAllocator(PAGES, PS, max_sequences=SEQS, max_pages=MAX_PAGES, seed=7)
    rng = np.random.default_rng(7)
    prompt = _x(rng, 10)
    prompt[1, 0] = np.nan  # the first page's key
    alloc.allocate("a", 10)
    batch = alloc.batch([("a", 10)], tokens=TQ)
    _, cache = step(empty, jnp.asarray(np.pad(prompt, ((0, 1), (0, 0)))[None]), batch)
    alloc.confirm(batch)
    for _ in range(6):  # decode rows of 4 .. 6 pages: reduced to 3
        alloc.extend("a", 1)
        batch = alloc.batch([("a", 1)], tokens=TQ)
        x = np.pad(_x(rng, 1), ((0, TQ - 1), (0, 0)))[None]
        y, cache = step(cache, jnp.asarray(x), batch)
        alloc.confirm(batch)
        assert np.isnan(np.asarray(y[0, 0])).all()


def test_misuse_is_refused_in_one_line():
    with pytest.raises(ValueError, match=r"page_selection=2 needs page_size"):
        AttentionConfig(D, N, page_selection=2)
    with pytest.raises(ValueError, match=r"page_selection=2 is for a global layer"):
        _config(page_selection=2, window=(4, 0))
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match=r"page_selection must be an int >= 1"):
            _config(page_selection=bad)
    layer, params, empty, _, _ = _layer(SELECT)
    alloc = PageAllocator(PAGES, PS, max_sequences=SEQS, max_pages=MAX_PAGES)
    alloc.allocate("a", 2)
    batch = alloc.batch([("a", 2)], tokens=TQ)
    with pytest.raises(ValueError, match=r"mask_fn is not served with page_selection"):
        layer.apply({"params": params, "cache": empty}, jnp.zeros((1, TQ, D)), True,
                    decode=True, pages=batch, mask_fn=lambda q, k: q >= k,
                    mutable=["cache"])  # fmt: skip


def test_moves_widen_or_restart_their_target_pages_box():
    """update_bounds on its own: a key moved into a page's later slot widens its box, one
    moved into slot 0 starts it afresh, a copy takes its source's box, and entries past
    the pool (P: nothing) change nothing."""
    from nanoattn._layers.caches.page_selection import update_bounds

    P = 4
    rng = np.random.default_rng(8)
    bounds = np.sort(rng.standard_normal((P, 2, K, 3)), axis=1).astype(np.float32)
    moved = rng.standard_normal((3, K, 3)).astype(np.float32) * 5
    none = dict(new=np.zeros((1, K, 3), np.float32), page=np.array([P]), slot=np.array([0]))
    got = np.asarray(update_bounds(
        jnp.asarray(bounds), copy_source=np.array([0, 0]), copy_target=np.array([3, P]),
        moved=moved, moved_page=np.array([1, 2, P]), moved_slot=np.array([2, 0, 0]), **none,
    ))  # fmt: skip
    want = bounds.copy()
    want[3] = bounds[0]
    want[1, 0] = np.minimum(bounds[1, 0], moved[0])
    want[1, 1] = np.maximum(bounds[1, 1], moved[0])
    want[2] = np.stack([moved[1], moved[1]])  # afresh: the moved key alone
    np.testing.assert_array_equal(got, want)
    assert not np.array_equal(want[1], bounds[1])  # the move did widen it


def test_an_int8_pool_keeps_float_boxes_and_reads_every_page_when_k_is_large():
    """With kv_cache_dtype="int8" the pool keeps float32 boxes beside its int8 keys, and
    a selection of k >= the pages equals the int8 layer without selection."""
    outs = []
    for select in (MAX_PAGES, None):
        layer = CausalSelfAttention(_config(page_selection=select, kv_cache_dtype="int8"))
        params = _layer(SELECT)[1]
        cache = jax.tree.map(
            lambda a: jnp.zeros(a.shape, a.dtype),
            jax.eval_shape(functools.partial(layer.init, decode=True), jax.random.key(0),
                           jnp.zeros((1, PAGES * PS, D)))["cache"],
        )  # fmt: skip
        alloc = PageAllocator(PAGES, PS, max_sequences=SEQS, max_pages=MAX_PAGES, seed=9)
        rng, ys = np.random.default_rng(9), []
        for n in (11, 1, 1):
            (alloc.extend if "a" in alloc.sequences() else alloc.allocate)("a", n)
            x = jnp.asarray(np.pad(_x(rng, n), ((0, TQ - n), (0, 0)))[None])
            batch = alloc.batch([("a", n)], tokens=TQ)
            y, state = layer.apply({"params": params, "cache": cache}, x, True, decode=True,
                                   pages=batch, mutable=["cache"])  # fmt: skip
            cache = state["cache"]
            alloc.confirm(batch)
            ys.append(np.asarray(y))
        outs.append(ys)
        if select is not None:
            assert cache["key"].dtype == jnp.int8 and cache["key_bounds"].dtype == jnp.float32
            assert np.isfinite(np.asarray(cache["key_bounds"])[alloc.pages_of("a")]).all()
    for got, want in zip(*outs):
        np.testing.assert_allclose(got, want, atol=1e-6, rtol=1e-6)
