"""Shared prefixes in a paged layer (docs/decoding.md, "Shared prefixes"): which rows
of a step the allocator groups (nanoattn/_layers/caches/shared_prefix.py: the trie of
their written pages, whole pages only, none past a page given back, one group per
name), what ``PageAllocator.batch`` carries (forks and prefix-cache hits grouped;
nothing with ``cascade=False`` or a window), and a layer decoding forks of a prompt
through a pool of stale pages: each sequence equal to its own full forward with the
cascade and without, the jitted step compiled once whatever the grouping."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from nanoattn import PageAllocator
from nanoattn._layers.caches.shared_prefix import shared_prefixes
from nanoattn.linen import AttentionConfig, CausalSelfAttention

from _layer_configs import random_params

D, N, K = 24, 6, 2  # H = 4
PS, PAGES, SEQS, MAX_PAGES, TQ = 5, 29, 5, 7, 23  # page size and pool: primes


@pytest.mark.parametrize(
    "rows, want",
    [
        ([([4, 5, 6], 9), ([4, 5, 7], 8), ([8], 2)], [2, 2, 0]),  # written whole pages only
        ([([4, 5, 6], 7), ([4, 5, 6], 7)], [1, 1]),  # the page of the first query: never
        ([([1, 2, 3, 9], 16), ([1, 2, 3, 8], 16), ([1, 5, 6], 12), ([1, 5, 6], 12), ([1], 4)],
         [3, 3, 3, 3, 0]),  # two branches beat one group of five sharing one page
        ([([1, 2, 3, 4, 5], 20), ([1, 2, 3, 4, 5], 20), ([1, 2, 7], 12)], [5, 5, 0]),
        ([([1, 2, 3], 12), ([1, 2, 3], 12), ([1, 2, 7], 12), ([1, 2, 7], 12), ([1, 2], 8)],
         [2, 2, 2, 2, 2]),  # one group of five sharing 2 pages (8) beats two of 3 (6)
        ([([-1, 2, 3], 12), ([-1, 2, 3], 12)], [0, 0]),  # a page given back: nothing after
        ([([5, 9], 8), ([5, 9], 8), ([6, 9], 8), ([6, 9], 8)], [2, 2, 0, 0]),  # one name
        ([([3], 4)], [0]),  # a group of one shares nothing
    ],
    ids=["whole pages", "partial page", "branches", "subset", "one group", "returned",
         "name taken", "alone"],
)  # fmt: skip
def test_rows_are_grouped_on_the_trie_of_their_written_pages(rows, want):
    rows = [(pages, written) for pages, written in rows]
    got = shared_prefixes(rows, 4, len(rows) + 1)
    assert got.dtype == np.int32 and got.tolist() == [*want, 0]


def _served(alloc, rows, tokens=16):
    """The batch of ``rows`` (seq_id, new tokens) after allocating or extending them."""
    for seq_id, n in rows:
        if seq_id in alloc.sequences():
            alloc.extend(seq_id, n)
        else:
            alloc.allocate(seq_id, n)
    return alloc.batch(rows, tokens=tokens)


def test_the_allocator_groups_forks_and_prefix_hits():
    alloc = PageAllocator(12, 4, max_sequences=4, max_pages=4)
    alloc.confirm(_served(alloc, [("a", 10), ("z", 3)]))
    for child in "bc":
        alloc.fork("a", child)
    batch = _served(alloc, [("a", 1), ("b", 1), ("z", 1), ("c", 1)])
    assert batch.shared_prefixes.tolist() == [2, 2, 0, 2]  # a's 2 full pages, not the third
    alloc.confirm(batch)

    ids = list(range(9))
    cached = PageAllocator(12, 4, max_sequences=2, max_pages=4, prefix_cache=True)
    cached.allocate("x", 9, tokens=ids)
    cached.confirm(cached.batch([("x", 9)], tokens=16))
    assert cached.allocate("y", 9, tokens=ids) == 8  # a hit: two pages
    cached.extend("x", 1, tokens=[9])
    assert cached.batch([("x", 1), ("y", 1)], tokens=16).shared_prefixes.tolist() == [2, 2]

    for options in (dict(cascade=False), dict(window=(7, 0))):
        other = PageAllocator(12, 4, max_sequences=2, max_pages=4, **options)
        other.confirm(_served(other, [("a", 9)]))
        other.fork("a", "b")
        assert _served(other, [("a", 1), ("b", 1)]).shared_prefixes is None, options
    with pytest.raises(TypeError, match=r"cascade must be True or False, got 1"):
        PageAllocator(12, 4, max_sequences=2, max_pages=4, cascade=1)


TRACES = []  # the step's traces (one per compiled program)


@functools.cache
def _layer():
    """A paged layer, its full-cache twin, random parameters, a jitted step."""
    layer = CausalSelfAttention(AttentionConfig(D, N, n_kv_heads=K, rope_base=100.0, page_size=PS))
    plain = CausalSelfAttention(AttentionConfig(D, N, n_kv_heads=K, rope_base=100.0))
    shapes = jax.eval_shape(
        functools.partial(layer.init, decode=True), jax.random.key(0), jnp.zeros((1, PAGES * PS, D))
    )
    params = random_params(shapes["params"], 3)

    @jax.jit
    def step(cache, x, pages):
        TRACES.append(pages)  # once per program compiled
        y, state = layer.apply(
            {"params": params, "cache": cache}, x, True, decode=True, pages=pages,
            mutable=["cache"],
        )  # fmt: skip
        return y, state["cache"]

    full = jax.jit(lambda x: plain.apply({"params": params}, x, True))
    bad = np.random.default_rng(0).choice([np.nan, np.inf, 3.0], size=shapes["cache"]["key"].shape)
    cache = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), shapes["cache"])
    cache = dict(cache, key=jnp.asarray(bad, jnp.float32),
                 value=jnp.asarray(bad[::-1], jnp.float32))  # fmt: skip
    return step, full, cache


def _decode_forks(cascade: bool) -> tuple[dict, list]:
    """A 12-token prompt forked into three sequences besides an unrelated one, each
    decoding 3 tokens: every sequence's inputs and outputs, and each step's groups."""
    step, _, cache = _layer()
    alloc = PageAllocator(PAGES, PS, max_sequences=SEQS, max_pages=MAX_PAGES, seed=3,
                          cascade=cascade)  # fmt: skip
    rng = np.random.default_rng(1)
    prompt = rng.standard_normal((12, D)).astype(np.float32)
    inputs = {"a": [prompt], "z": [rng.standard_normal((7, D)).astype(np.float32)]}
    outputs, groups = {s: [] for s in "abcdz"}, []
    rows = [("a", 12), ("z", 7)]
    for t in range(4):
        if t:  # one new token each
            for s, _ in rows:
                inputs[s].append(rng.standard_normal((1, D)).astype(np.float32))
        batch = _served(alloc, rows, TQ)
        groups.append(None if batch.shared_prefixes is None else batch.shared_prefixes.tolist())
        x = np.concatenate([inputs[s][-1] for s, _ in rows])
        x = np.pad(x, ((0, TQ - len(x)), (0, 0)))[None]
        y, cache = step(cache, jnp.asarray(x), batch)
        alloc.confirm(batch)
        at = 0
        for s, n in rows:
            outputs[s].append(np.asarray(y[0, at : at + n]))
            at += n
        if t == 0:
            for child in "bcd":
                alloc.fork("a", child)
                inputs[child] = [prompt]
        rows = [("b", 1), ("a", 1), ("z", 1), ("d", 1), ("c", 1)]
    return {s: (np.concatenate(inputs[s]), np.concatenate(outputs[s])) for s in inputs}, groups


def test_a_layer_decoding_forks_equals_each_full_forward_with_and_without_the_cascade():
    _, full, _ = _layer()
    before = len(TRACES)
    shared, groups = _decode_forks(True)
    assert groups[0] == [0] * SEQS and groups[1:] == [[2, 2, 0, 2, 2]] * 3
    assert len(TRACES) == before + 1  # one program for every grouping
    plain, none = _decode_forks(False)
    assert none == [None] * 4
    for s, (x, y) in shared.items():
        want = np.asarray(full(jnp.asarray(x)[None]))[0]
        if s in "bcd":  # a fork's outputs: its own tokens after the prompt
            want = want[12:]
        np.testing.assert_allclose(y, want, atol=2e-5, rtol=2e-5, err_msg=s)
        np.testing.assert_allclose(y, plain[s][1], atol=2e-5, rtol=2e-5, err_msg=s)
