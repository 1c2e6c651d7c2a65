"""Automatic prefix caching (``PageAllocator(prefix_cache=True)``,
nanoattn/_layers/caches/prefix_cache.py; docs/decoding.md, "Prefix caching"): the
allocator alone (hits of whole written pages, at least one token left to compute,
namespaces, a forced hash collision, the LRU of reusable pages and its eviction
order, rewinds and forks, the statistics and the key), then a linen layer, an int8
pool and the latent layer's pool decoding through hits: every token a step computes
equals its sequence's full forward (or, for the int8 pool, the same sequence
prefilled without a hit). Random programs with hits and evictions are
tests/layers/test_paged_programs.py's."""

import functools
import hashlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from nanoattn import PageAllocator, PoolExhausted
from nanoattn._layers.caches import prefix_cache
from nanoattn.linen import AttentionConfig, CausalSelfAttention, LatentAttention, LatentConfig

from _layer_configs import random_params

PS = 4


def _alloc(pages=11, **options):
    return PageAllocator(pages, PS, max_sequences=3, max_pages=6, prefix_cache=True, **options)


def _ids(*runs):
    """Token ids: each run (start, n) gives n consecutive ids from start."""
    return [t for start, n in runs for t in range(start, start + n)]


def _step(alloc, *rows):
    batch = alloc.batch([(s, alloc.unwritten(s)) for s in rows], tokens=32)
    alloc.confirm(batch)


def _state(alloc):
    held = {s: (alloc.length(s), alloc.unwritten(s), alloc.pages_of(s)) for s in alloc.sequences()}
    return held, alloc.free_page_ids(), alloc.pending_copies(), alloc.stats()


def _written(alloc, seq, ids, namespace=None):
    cached = alloc.allocate(seq, len(ids), tokens=ids, namespace=namespace)
    _step(alloc, seq)
    return cached


def test_a_hit_shares_written_whole_pages_and_leaves_a_token_to_compute():
    alloc = _alloc()
    prompt = _ids((100, 10))  # two full pages and a partial one
    assert alloc.allocate("a", 10, tokens=prompt) == 0
    assert alloc.allocate("early", 10, tokens=prompt) == 0  # not written yet: no hit
    _step(alloc, "a", "early")
    assert alloc.allocate("b", 10, tokens=prompt) == 8  # the partial page is not cached
    assert alloc.unwritten("b") == 2 and alloc.length("b") == 10
    assert alloc.pages_of("b")[:2] == alloc.pages_of("a")[:2]
    assert alloc.pages_of("b")[2] != alloc.pages_of("a")[2]
    assert [alloc.refs(p) for p in alloc.pages_of("b")[:2]] == [2, 2]
    assert alloc.allocate("c", 8, tokens=prompt[:8]) == 4  # one token left to compute
    assert alloc.allocate("d", 4, tokens=prompt[:4]) == 0
    assert alloc.allocate("e", 9, tokens=[*prompt[:5], 7, 7, 7, 7]) == 4  # differs in page 1
    batch = alloc.batch([("b", 2), ("c", 4), ("d", 4)], tokens=32)
    assert batch.kv_lengths.tolist() == [10, 8, 4]  # the queries are the last positions
    assert batch.query_starts.tolist() == [0, 2, 6, 10]


def test_two_namespaces_never_share_a_page():
    alloc = _alloc()
    prompt = _ids((5, 9))
    _written(alloc, "a", prompt, namespace="adapter-1")
    for other in ("adapter-2", None, b"adapter-1", 1):
        assert alloc.allocate(("x", other), 9, tokens=prompt, namespace=other) == 0, other
        alloc.free(("x", other))
    assert alloc.allocate("b", 9, tokens=prompt, namespace="adapter-1") == 8
    _written(alloc, "one", prompt[:5], namespace=1)
    assert alloc.allocate("str", 5, tokens=prompt[:5], namespace="1") == 0
    assert alloc.allocate("int", 5, tokens=prompt[:5], namespace=1) == 4


def test_a_forced_hash_collision_is_never_served(monkeypatch):
    """Every page's key the same (a hash broken by hand): a lookup finds a registered
    page for any tokens, and must still miss unless that page's tokens, parent and
    namespace are the asked ones (the allocator compares them on every hit)."""
    monkeypatch.setattr(prefix_cache, "page_key", lambda parent, tokens, namespace: b"k" * 32)
    alloc = _alloc()
    _written(alloc, "a", _ids((0, 9)))
    assert alloc.stats().cached_pages == 1  # page 1's key is taken: the first one stays
    assert alloc.allocate("other tokens", 9, tokens=_ids((50, 9))) == 0
    assert alloc.allocate("other namespace", 9, tokens=_ids((0, 9)), namespace="t") == 0
    assert alloc.allocate("same", 9, tokens=_ids((0, 9))) == 4  # page 1 was never cached


def test_the_key_is_blake2b_of_the_namespace_the_previous_key_and_the_ids():
    first = prefix_cache.page_key(prefix_cache.ROOT, [1, 2, 3, 4], b"ns")
    h = hashlib.blake2b(digest_size=32, person=b"nanoattn.prefix")
    for part in (b"\x02" + bytes(7), b"ns", bytes(32), np.array([1, 2, 3, 4], "<i8").tobytes()):
        h.update(part)
    assert first == h.digest() and len(first) == 32
    second = prefix_cache.page_key(first, [5, 6, 7, 8], b"ns")
    other_first = prefix_cache.page_key(prefix_cache.ROOT, [1, 2, 3, 5], b"ns")
    assert prefix_cache.page_key(other_first, [5, 6, 7, 8], b"ns") != second  # a chain
    assert prefix_cache.page_key(prefix_cache.ROOT, [1, 2, 3, 4], b"nt") != first
    # a namespace's length is hashed first: ("ab", ids) and ("a", "b" + ...) differ
    assert prefix_cache.page_key(prefix_cache.ROOT, [], b"ab") != prefix_cache.page_key(
        prefix_cache.ROOT, [], b"a"
    )


def test_freed_prefix_pages_are_reusable_and_count_as_free():
    alloc = _alloc()
    _written(alloc, "a", _ids((0, 13)))  # three full pages, one partial
    held = alloc.pages_of("a")
    alloc.free("a")
    assert alloc.free_pages == 11 and sorted(alloc.free_page_ids()) == list(range(11))
    assert alloc.stats().reusable_pages == 3 and alloc.stats().cached_pages == 3
    assert alloc.free_page_ids()[:3] == held[:3]  # the reusable ones, head most recent
    assert alloc.cached_tokens(held[1]) == tuple(range(4, 8))
    assert alloc.cached_tokens(held[3]) is None  # the partial page is plainly free
    assert alloc.allocate("b", 13, tokens=_ids((0, 13))) == 12
    assert alloc.pages_of("b")[:3] == held[:3] and alloc.stats().reusable_pages == 0


def _fill(alloc, seq, start):
    """Sequence ``seq`` of two cached pages (ids from ``start``), freed."""
    _written(alloc, seq, _ids((start, 8)))
    pages = alloc.pages_of(seq)
    alloc.free(seq)
    return pages


def test_eviction_takes_the_least_recently_freed_first():
    alloc = _alloc(pages=4)
    a, b = _fill(alloc, "a", 0), _fill(alloc, "b", 100)  # the LRU: a's pages, then b's
    assert alloc.free_page_ids() == [b[0], b[1], a[0], a[1]]  # the most recent first
    assert alloc.allocate("touch", 9, tokens=_ids((0, 8), (9, 1))) == 8  # a used again
    assert alloc.pages_of("touch")[2] == b[1] and alloc.stats().evictions == 1  # b's tail
    alloc.free("touch")  # a is now the most recently freed; its third page plainly free
    assert alloc.allocate("new", 4, tokens=_ids((500, 4))) == 0  # that free page
    alloc.allocate("pressure", 4, tokens=_ids((600, 4)))  # one eviction: b's, not a's
    assert alloc.pages_of("pressure") == [b[0]] and alloc.stats().evictions == 2
    alloc.free("pressure")
    alloc.free("new")
    assert alloc.allocate("b again", 5, tokens=_ids((100, 5))) == 0  # evicted: forgotten
    alloc.free("b again")
    assert alloc.allocate("a again", 9, tokens=_ids((0, 8), (9, 1))) == 8


def test_eviction_takes_leaves_before_the_pages_they_chain_from():
    """Two sequences compute one prompt at once: b's first page is never registered (a's
    holds its key), but b's second page chains from that key. Once both are freed the
    LRU holds a's first page (older, with a cached successor) and b's second page; the
    pressure takes b's second page, not the older page it chains from."""
    alloc = _alloc(pages=5)
    prompt = _ids((0, 8))
    alloc.allocate("a", 5, tokens=prompt[:5])
    alloc.allocate("b", 8, tokens=prompt)
    _step(alloc, "a", "b")
    a0, b1 = alloc.pages_of("a")[0], alloc.pages_of("b")[1]
    assert alloc.cached_tokens(alloc.pages_of("b")[0]) is None
    alloc.free("a")
    alloc.free("b")
    assert alloc.free_page_ids()[:2] == [b1, a0]  # a0 the least recently freed
    alloc.allocate("pressure", 16, tokens=_ids((300, 16)))  # 3 free pages, one eviction
    assert b1 in alloc.pages_of("pressure") and alloc.stats().evictions == 1
    alloc.free("pressure")
    assert alloc.allocate("prompt", 9, tokens=[*prompt, 9]) == 4  # a0 kept, b1 gone


def test_pressure_evicts_before_the_pool_is_exhausted_and_refusal_changes_nothing():
    alloc = _alloc(pages=5)
    _fill(alloc, "a", 0)
    _fill(alloc, "b", 100)  # 4 reusable pages, 1 free
    before = _state(alloc)
    with pytest.raises(PoolExhausted, match=r"needs 6 more page\(s\) and 5 are free"):
        alloc.allocate("big", 24, tokens=_ids((900, 24)))
    with pytest.raises(PoolExhausted, match=r"needs 4 more page\(s\) and 3 are free"):
        alloc.allocate("hit too", 24, tokens=_ids((0, 8), (900, 16)))  # its hit isn't free
    assert _state(alloc) == before
    assert alloc.allocate("fits", 20, tokens=_ids((900, 20))) == 0
    assert alloc.stats().evictions == 4 and alloc.free_pages == 0


def test_a_rewound_page_is_unregistered_only_if_its_tokens_change():
    alloc = _alloc()
    ids = _ids((0, 8))
    _written(alloc, "a", ids)
    page = alloc.pages_of("a")[1]
    alloc.rewind("a", 2)
    alloc.extend("a", 2, tokens=ids[6:])  # the same tokens again: still cached
    assert alloc.cached_tokens(page) == tuple(ids[4:])
    _step(alloc, "a")
    assert alloc.allocate("same", 9, tokens=[*ids, 1]) == 8
    alloc.free("same")
    alloc.rewind("a", 2)
    alloc.extend("a", 2, tokens=[50, 51])  # written in place with other tokens
    assert alloc.cached_tokens(page) is None
    assert alloc.allocate("old", 9, tokens=[*ids, 1]) == 4
    _step(alloc, "a", "old")
    assert alloc.allocate("new", 9, tokens=[*ids[:6], 50, 51, 1]) == 8
    assert alloc.pages_of("new")[1] == page


def test_a_rewind_into_a_shared_cached_page_copies_it_and_keeps_it_cached():
    alloc = _alloc()
    ids = _ids((0, 8))
    _written(alloc, "a", ids)
    assert alloc.allocate("b", 9, tokens=[*ids, 3]) == 8
    _step(alloc, "b")
    alloc.rewind("b", 9)  # all it brought, its cached prefix included
    assert alloc.length("b") == 0 and alloc.pages_of("b") == []
    assert alloc.stats().cached_pages == 2  # a's, shared, stay cached
    assert alloc.allocate("c", 9, tokens=[*ids, 3]) == 8
    _step(alloc, "c")
    alloc.rewind("c", 3)  # c now ends inside the shared page 1
    alloc.extend("c", 2, tokens=[60, 61])
    assert alloc.pending_copies() == [(alloc.pages_of("a")[1], alloc.pages_of("c")[1])]
    assert alloc.cached_tokens(alloc.pages_of("a")[1]) == tuple(ids[4:])


def test_an_extension_without_ids_stops_registration_and_a_fork_carries_the_ids():
    alloc = _alloc()
    _written(alloc, "a", _ids((0, 6)))
    alloc.extend("a", 2)  # no ids: page 1 (positions 4-7) is never cached
    _step(alloc, "a")
    assert alloc.stats().cached_pages == 1
    alloc.rewind("a", 2)  # the unknown tokens taken back: a's ids are whole again
    alloc.extend("a", 2, tokens=[6, 7])
    _step(alloc, "a")
    assert alloc.stats().cached_pages == 2
    alloc.fork("a", "child")
    alloc.extend("child", 5, tokens=_ids((40, 5)))
    _step(alloc, "child")
    assert alloc.allocate("hit", 13, tokens=_ids((0, 8), (40, 5))) == 12


def test_the_statistics_count_tokens_and_pages():
    alloc = _alloc()
    assert alloc.stats() == prefix_cache.PrefixStats()
    _written(alloc, "a", _ids((0, 10)))
    alloc.allocate("b", 10, tokens=_ids((0, 10)))
    alloc.allocate("c", 3)  # no ids: neither a hit nor a miss
    stats = alloc.stats()
    assert (stats.hit_tokens, stats.miss_tokens, stats.cached_pages) == (8, 12, 2)
    assert stats.hit_rate == pytest.approx(0.4)
    plain = PageAllocator(4, PS, max_sequences=1, max_pages=2)
    assert plain.allocate("a", 3, tokens=[1, 2, 3]) == 0 and not plain.prefix_cache
    assert plain.stats() == prefix_cache.PrefixStats()


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda a: a.allocate("x", 3, tokens=[1, 2]), r"tokens must be the 3 token ids"),
        (lambda a: a.allocate("x", 2, tokens=[1.0, 2.0]), r"tokens must be the 2 token ids"),
        (lambda a: a.allocate("x", 2, tokens=[[1, 2]]), r"tokens must be the 2 token ids"),
        (lambda a: a.allocate("x", 1, tokens=[2**70]), r"tokens must be the 1 token ids"),
        (lambda a: a.allocate("x", 1, tokens=[1], namespace=1.5), r"namespace must be None"),
        (lambda a: a.extend("a", 2, tokens=[1]), r"tokens must be the 2 token ids"),
    ],
)  # fmt: skip
def test_bad_ids_and_namespaces_are_refused_and_change_nothing(call, message):
    alloc = _alloc()
    _written(alloc, "a", _ids((0, 5)))
    before = _state(alloc)
    with pytest.raises((ValueError, TypeError), match=message):
        call(alloc)
    assert _state(alloc) == before


def test_a_prefix_cache_with_a_window_is_refused():
    with pytest.raises(ValueError, match=r"prefix_cache=True with a window is not served"):
        PageAllocator(4, 2, max_sequences=1, max_pages=2, prefix_cache=True, window=(3, 0))


# --- layers decoding through hits --------------------------------------------------

D, N, K, V = 12, 3, 1, 50  # width, heads, key/value heads, vocabulary
PAGES, TQ = 13, 20
EMBED = np.random.default_rng(0).standard_normal((V, D)).astype(np.float32)


@functools.cache
def _layer(kind: str):
    """(step(pool, x, batch) -> (y, pool), full(x) -> y, a pool of NaN) of a paged
    layer: "float", "int8" or "latent", pages of PS."""
    if kind == "latent":
        layer = LatentAttention(LatentConfig(d_model=D, n_heads=N, kv_lora_rank=5,
                                             qk_nope_head_dim=3, qk_rope_head_dim=2,
                                             v_head_dim=3, page_size=PS))  # fmt: skip
    else:
        dtype = None if kind == "float" else "int8"
        layer = CausalSelfAttention(
            AttentionConfig(D, N, n_kv_heads=K, rope_base=100.0, page_size=PS, kv_cache_dtype=dtype)
        )
    x = jnp.zeros((1, PAGES * PS, D))
    init = functools.partial(layer.init, decode=True, deterministic=True)
    shapes = jax.eval_shape(init, jax.random.key(0), x)
    params = random_params(shapes["params"], 4)
    pool = jax.tree.map(
        lambda a: jnp.full(a.shape, jnp.nan if a.dtype == jnp.float32 else 1, a.dtype),
        shapes["cache"],
    )

    @jax.jit
    def step(pool, x, batch):
        y, state = layer.apply({"params": params, "cache": pool}, x, decode=True, pages=batch,
                               deterministic=True, mutable=["cache"])  # fmt: skip
        return y, state["cache"]

    full = jax.jit(lambda x: layer.apply({"params": params}, x, deterministic=True))
    return step, full, pool


def _decode(kind, programs, prefix_cache=True):
    """Runs ``programs``: steps, each a list of ``(seq, ids)`` new tokens (allocated
    with their ids the first time, feeding only what is not cached), or ``"free
    seq"``. Returns each sequence's outputs by position (the cached ones missing) and
    the allocator."""
    step, _, pool = _layer(kind)
    alloc = PageAllocator(PAGES, PS, max_sequences=3, max_pages=6, seed=3,
                          prefix_cache=prefix_cache)  # fmt: skip
    outputs, held = {}, {}
    for rows in programs:
        if isinstance(rows, str):
            alloc.free(rows.split()[1])
            continue
        x, fed = [], []
        for seq, ids in rows:
            if seq in alloc.sequences():
                alloc.extend(seq, len(ids), tokens=ids)
            else:
                held[seq] = alloc.allocate(seq, len(ids), tokens=ids)
                ids, outputs[seq] = ids[held[seq] :], {}
            x.append(EMBED[ids])
            fed.append((seq, held[seq], len(ids)))
            held[seq] += len(ids)
        x = np.concatenate(x)
        x = np.pad(x, ((0, TQ - len(x)), (0, 0)))[None]
        batch = alloc.batch([(seq, n) for seq, _, n in fed], TQ)
        y, pool = step(pool, jnp.asarray(x), batch)
        alloc.confirm(batch)
        y, at = np.asarray(y[0]), 0
        for seq, start, n in fed:
            outputs[seq] |= {start + i: y[at + i] for i in range(n)}
            at += n
        assert (y[at:] == 0).all()  # padding rows
    return outputs, alloc


PROMPT = list(range(3, 14))  # 11 tokens: two full pages and a partial one
PROGRAM = [
    [("a", PROMPT), ("b", PROMPT[:6])],
    [("a", [20]), ("c", [*PROMPT, 30, 31])],  # c hits a's two pages
    "free a",
    [("d", [*PROMPT[:9], 40, 41]), ("c", [32])],  # d hits two pages a freed
    [("d", [42]), ("e", [*PROMPT[:4], 44, 45, 46, 47, 48])],  # e hits one
]


def _all_ids(program):
    ids = {}
    for rows in program:
        for seq, new in [] if isinstance(rows, str) else rows:
            ids[seq] = ids.get(seq, []) + list(new)
    return ids


@pytest.mark.parametrize("kind", ["float", "latent"])
def test_hits_give_every_computed_token_its_full_forward(kind):
    outputs, alloc = _decode(kind, PROGRAM)
    assert alloc.stats().hit_tokens == 8 + 8 + 4
    _, full, _ = _layer(kind)
    for seq, ids in _all_ids(PROGRAM).items():
        want = np.asarray(full(jnp.asarray(EMBED[ids])[None]))[0]
        got = outputs[seq]
        assert len(got) and max(got) == len(ids) - 1
        for position, y in got.items():
            np.testing.assert_allclose(y, want[position], atol=3e-5, rtol=3e-5,
                                       err_msg=f"{kind}: {seq} at {position}")  # fmt: skip


def test_hits_on_an_int8_pool_equal_a_fresh_prefill():
    """Quantized pages are quantized once, when a step writes them: a hit reads the very
    values a fresh prefill of the same tokens would write, so every computed token
    equals the run without a prefix cache."""
    hit, alloc = _decode("int8", PROGRAM)
    fresh, _ = _decode("int8", PROGRAM, prefix_cache=False)
    assert alloc.stats().hit_tokens == 20
    for seq, got in hit.items():
        for position, y in got.items():
            np.testing.assert_allclose(y, fresh[seq][position], atol=1e-6, rtol=1e-6,
                                       err_msg=f"{seq} at {position}")  # fmt: skip
