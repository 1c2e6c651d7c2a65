"""The paged KV cache: the host's PageAllocator (its invariants under random
operations: no page held twice unless shared, every page freed once, a fork's write
never changes the parent, the pool's exhaustion), and the linen and NNX layers
decoding through it: mixed steps of prefill chunks and decode tokens of many
sequences, forks that share a prompt, pages reused after free holding stale NaN and
inf, and rewinds, each sequence equal to its own full forward (docs/decoding.md,
"Paged caches")."""

import dataclasses
import functools
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from nanoattn import PageAllocator
from nanoattn import nnx as nanoattn_nnx
from nanoattn._layers.caches import kv_cache
from nanoattn._layers.caches import paged as paged_cache
from nanoattn.linen import AttentionConfig, CausalSelfAttention

from _layer_configs import paged_step, random_params

D, N, K = 24, 6, 2  # H = 4
PS, PAGES, SEQS, MAX_PAGES, TQ = 5, 23, 4, 7, 13  # page size and pool: primes


def _config(**options):
    return AttentionConfig(D, N, n_kv_heads=K, rope_base=100.0, page_size=PS, **options)


@functools.cache
def _layer(two_pools=False, **options):
    """A paged layer, its full-cache twin, random parameters and a jitted step; its
    pool one combined pool (P, PS, 2, K, H), or with ``two_pools`` keys and values of
    their own (as a layer keeps them unless its token holds 2-4 KiB, COMBINED_BYTES)."""
    layer = CausalSelfAttention(_config(**options))
    plain = CausalSelfAttention(AttentionConfig(D, N, n_kv_heads=K, rope_base=100.0, **options))
    with mock.patch.object(kv_cache, "COMBINED_BYTES", (0, 0 if two_pools else 4096)):
        params, shapes, step = paged_step(layer, PAGES * PS, 3)
    full = jax.jit(lambda x: plain.apply({"params": params}, x, True))
    empty = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), shapes)
    return jax.jit(step), full, empty


class Driver:
    """Runs steps of a paged layer: ``feed(rows)`` with rows ``(seq_id, tokens)`` of new
    tokens (a prefill chunk or one decode token each), allocating and extending as it
    goes; keeps every sequence's tokens and outputs."""

    def __init__(self, seed=0, stale=True, two_pools=False, **options):
        self.step, self.full, self.cache = _layer(two_pools, **options)
        self.alloc = PageAllocator(PAGES, PS, max_sequences=SEQS, max_pages=MAX_PAGES, seed=seed)
        if stale:  # the pool as a long-running server leaves it: NaN, inf, old keys
            rng = np.random.default_rng(seed)
            for name in ("key", "value"):  # a combined pool's "value" is empty
                shape = self.cache[name].shape
                bad = rng.choice([np.nan, np.inf, -np.inf, 3.0], size=shape)
                self.cache = dict(self.cache, **{name: jnp.asarray(bad, jnp.float32)})
        self.tokens, self.outputs = {}, {}

    def feed(self, rows):
        xs = []
        for seq_id, x in rows:
            if seq_id in self.alloc.sequences():
                self.alloc.extend(seq_id, len(x))
            else:
                self.alloc.allocate(seq_id, len(x))
            self.tokens.setdefault(seq_id, []).append(x)
            xs.append(x)
        x = np.concatenate(xs)
        x = np.pad(x, ((0, TQ - len(x)), (0, 0)))[None].astype(np.float32)
        batch = self.alloc.batch([(s, len(t)) for s, t in rows], tokens=TQ)
        y, self.cache = self.step(self.cache, jnp.asarray(x), batch)
        self.alloc.confirm(batch)
        at = 0
        for seq_id, t in rows:
            self.outputs.setdefault(seq_id, []).append(np.asarray(y[0, at : at + len(t)]))
            at += len(t)
        return np.asarray(y[0, at:])  # the padding rows' outputs

    def check(self, seq_id, tokens=None):
        tokens = np.concatenate(self.tokens[seq_id]) if tokens is None else tokens
        want = np.asarray(self.full(jnp.asarray(tokens)[None]))[0]
        got = np.concatenate(self.outputs[seq_id])
        np.testing.assert_allclose(got, want[-len(got) :], atol=2e-5, rtol=2e-5, err_msg=seq_id)


def _x(seed, n):
    return np.random.default_rng(seed).standard_normal((n, D)).astype(np.float32)


@pytest.mark.parametrize("two_pools", [False, True], ids=["one combined pool", "two pools"])
def test_mixed_steps_of_prefill_chunks_and_decode_tokens_equal_each_full_forward(two_pools):
    run = Driver(two_pools=two_pools)
    assert run.cache["key"].ndim == (4 if two_pools else 5)
    a, b, c = _x(1, 14), _x(2, 9), _x(3, 6)
    padding = run.feed([("a", a[:8]), ("b", b[:4])])
    assert (padding == 0).all()
    run.feed([("a", a[8:9]), ("b", b[4:5]), ("c", c[:6])])  # two decode tokens, a prefill
    run.feed([("b", b[5:9]), ("a", a[9:10])])  # a speculative chunk of 4, a decode token
    run.feed([("a", a[10:14])])
    for seq_id in "abc":
        run.check(seq_id)


def test_a_freed_sequences_pages_serve_the_next_with_their_stale_content():
    run = Driver(seed=1)
    a, b = _x(4, 12), _x(5, 17)
    run.feed([("a", a)])
    run.alloc.free("a")
    assert run.alloc.free_pages == PAGES
    run.feed([("b", b[:12])])  # the pages a held, holding a's keys
    run.feed([("b", b[12:17])])
    run.check("b")


def test_forks_share_a_prompt_and_never_change_each_other():
    run = Driver(seed=2)
    prompt, left, right = _x(6, 7), _x(7, 4), _x(8, 3)  # 7 tokens: a partial second page
    run.feed([("p", prompt)])
    run.alloc.fork("p", "q")
    shared = run.alloc.pages_of("p")
    assert run.alloc.pages_of("q") == shared and all(run.alloc.refs(p) == 2 for p in shared)
    run.feed([("q", left), ("p", right)])  # both write into the shared partial page
    assert run.alloc.pages_of("p")[0] == shared[0] == run.alloc.pages_of("q")[0]  # full page
    assert run.alloc.pages_of("p")[1] != run.alloc.pages_of("q")[1]  # the partial one copied
    run.check("p")
    run.outputs["q"] = run.outputs["q"][-1:]
    run.check("q", np.concatenate([prompt, left]))


def test_a_rewound_speculative_chunk_is_never_read_again():
    run = Driver(seed=3)
    a = _x(9, 10)
    run.feed([("a", a[:6])])
    run.feed([("a", _x(10, 4))])  # a draft of 4 tokens, all rejected
    run.alloc.rewind("a", 4)
    run.outputs["a"].pop()
    run.tokens["a"].pop()
    run.feed([("a", a[6:10])])
    run.check("a")


def test_nnx_decodes_the_same_through_pages():
    cfg = _config()
    _, full, _ = _layer()
    linen_params = random_params(
        jax.eval_shape(functools.partial(CausalSelfAttention(cfg).init, decode=True),
                       jax.random.key(0), jnp.zeros((1, PAGES * PS, D)))["params"], 3,
    )  # fmt: skip
    module = nanoattn_nnx.from_linen(cfg, linen_params, rngs=nnx.Rngs(0))
    module.init_cache(1, PAGES * PS)
    alloc = PageAllocator(PAGES, PS, max_sequences=SEQS, max_pages=MAX_PAGES, seed=4)
    a = _x(11, 9)
    outs = []
    for chunk in (a[:5], a[5:6], a[6:9]):
        if "a" in alloc.sequences():
            alloc.extend("a", len(chunk))
        else:
            alloc.allocate("a", len(chunk))
        x = np.pad(chunk, ((0, TQ - len(chunk)), (0, 0)))[None]
        batch = alloc.batch([("a", len(chunk))], tokens=TQ)
        y = nnx.jit(lambda m, x, p: m(x, decode=True, pages=p, deterministic=True))(
            module, jnp.asarray(x), batch
        )
        alloc.confirm(batch)
        outs.append(np.asarray(y[0, : len(chunk)]))
    want = full(jnp.asarray(a)[None])[0]
    np.testing.assert_allclose(np.concatenate(outs), want, atol=2e-5, rtol=2e-5)


def test_misuse_is_refused_in_one_line():
    run = Driver()
    cache = run.cache
    batch = run.alloc.batch([], tokens=TQ)
    step, _, _ = _layer()
    with pytest.raises(ValueError, match=r"must be \(1, Tq, D\)"):
        step(cache, jnp.zeros((2, TQ, D)), batch)
    layer = CausalSelfAttention(_config())
    params = jax.tree.map(
        jnp.zeros_like, layer.init(jax.random.key(0), jnp.zeros((1, PS, D)), True)
    )
    with pytest.raises(ValueError, match=r"decodes with pages="):
        layer.apply({**params, "cache": cache}, jnp.zeros((1, TQ, D)), True, decode=True,
                    mutable=["cache"])  # fmt: skip
    with pytest.raises(ValueError, match=r"lengths= is for a slot cache"):
        layer.apply({**params, "cache": cache}, jnp.zeros((1, TQ, D)), True, decode=True,
                    pages=batch, lengths=jnp.zeros((1,), jnp.int32), mutable=["cache"])  # fmt: skip
    with pytest.raises(ValueError, match=r"page_size .* and rolling_cache=True"):
        AttentionConfig(D, N, window=(3, 0), rolling_cache=True, page_size=PS)


def test_a_batch_of_another_allocators_geometry_is_refused_even_under_jit():
    """The batch says its allocator's page size and pool; unused page-table entries are
    0, a valid page, so a mismatch would read and write the wrong slots silently."""
    step, _, cache = _layer()
    for pages, page_size, message in (
        (PAGES, 4, r"pages: the batch is for pages of 4 tokens .* page_size=5"),
        (PAGES + 1, PS, r"pages: the batch's PageAllocator has 24 pages, but this layer's pool"),
    ):
        alloc = PageAllocator(pages, page_size, max_sequences=SEQS, max_pages=MAX_PAGES)
        alloc.allocate("a", 3)
        with pytest.raises(ValueError, match=message):
            step(cache, jnp.ones((1, TQ, D)), alloc.batch([("a", 3)], tokens=TQ))


def _two_sequences():
    """A driver holding a (7 tokens) and b (6 tokens, fed), and the next step's
    batch: a's decode token and b's chunk of 3; its inputs x (1, TQ, D)."""
    run = Driver(seed=5)
    run.feed([("a", _x(20, 7)), ("b", _x(21, 6))])
    run.alloc.extend("a", 1)
    run.alloc.extend("b", 3)
    batch = run.alloc.batch([("a", 1), ("b", 3)], tokens=TQ)
    x = np.concatenate([_x(22, 1), _x(23, 3), np.zeros((TQ - 4, D), np.float32)])[None]
    return run, batch, jnp.asarray(x)


def _spoil(case, batch):
    table, starts, copies = (np.array(a) for a in (batch.page_table, batch.query_starts,
                                                    batch.copies))  # fmt: skip
    if case == "page id":  # b's second page outside the pool
        table[1, 1] = PAGES
    elif case == "copies":  # a copy into b's last page from outside the pool
        copies[0] = [PAGES + 3, table[1, 1]]
    elif case == "two copies into one page":
        copies[0], copies[1] = [table[0, 0], table[1, 1]], [table[0, 1], table[1, 1]]
    else:  # starts that decrease
        starts[2] = 0
    return dataclasses.replace(batch, page_table=table, query_starts=starts, copies=copies)


@pytest.mark.parametrize("case", ["page id", "copies", "two copies into one page", "starts"])
def test_a_bad_batch_raises_when_concrete_and_poisons_its_rows_under_jit(case):
    run, batch, x = _two_sequences()
    good, good_cache = run.step(run.cache, x, batch)
    bad_batch = _spoil(case, batch)
    layer = CausalSelfAttention(_config())
    params = layer.init(jax.random.key(0), jnp.zeros((1, PS, D)), True)
    with pytest.raises(ValueError, match=r"page_table\[1, 1\]|copies\[[01]\]|query_starts"):
        layer.apply({**params, "cache": run.cache}, x, True, decode=True, pages=bad_batch,
                    mutable=["cache"])  # fmt: skip
    y, cache = run.step(run.cache, x, bad_batch)  # jitted: NaN rows instead
    y, good = np.asarray(y), np.asarray(good)
    rows = (np.arange(TQ) >= 1) & (np.arange(TQ) < 4)  # b's (starts: every row)
    rows |= case == "starts"
    assert np.isnan(y[0, rows]).all()
    np.testing.assert_array_equal(y[0, ~rows], good[0, ~rows])  # a's row, the padding
    if case != "starts":  # a's token is written as in the good step, at slot 7 % 5
        page = run.alloc.pages_of("a")[1]
        np.testing.assert_array_equal(cache["key"][page, 2], good_cache["key"][page, 2])


def test_a_fresh_pool_is_buffers_of_its_own_so_a_step_may_donate_it():
    """The empty pool's keys and values (NNX's init_cache) are two arrays, not one
    shared: a step that donates the cache would be given the same buffer twice."""
    module = nanoattn_nnx.CausalSelfAttention(_config(), rngs=nnx.Rngs(0))
    module.init_cache(1, PAGES * PS)
    graphdef, state = nnx.split(module)
    pools = [x for path, x in nnx.to_flat_state(state) if path[-1] in ("key", "value")]
    assert len(pools) == 2 and pools[0].shape == pools[1].shape == (PAGES, PS, K, D // N)
    pointers = {leaf.unsafe_buffer_pointer() for leaf in jax.tree.leaves(pools)}
    assert len(pointers) == 2
    alloc = PageAllocator(PAGES, PS, max_sequences=SEQS, max_pages=MAX_PAGES)
    alloc.allocate("a", 3)

    @functools.partial(jax.jit, donate_argnums=0)
    def step(cache, x, pages):
        module = nnx.merge(graphdef, cache)
        return nnx.state(module), module(x, decode=True, pages=pages)

    state, y = step(state, jnp.ones((1, TQ, D)), alloc.batch([("a", 3)], tokens=TQ))
    assert np.isfinite(np.asarray(y)).all() and (np.asarray(y[0, 3:]) == 0).all()


@pytest.mark.parametrize(
    "heads, width, dtype, combined",
    [(8, 128, "bfloat16", True), (8, 128, "int8", True), (4, 128, "float32", True),
     (8, 128, "float32", False), (16, 128, "bfloat16", False), (1, 128, "float32", False),
     (K, D // N, "float32", False)],
)  # fmt: skip
def test_a_pool_is_combined_where_a_token_holds_2_to_4_kib(heads, width, dtype, combined):
    """PagedCache.empty: one pool (P, PS, 2, K, H) and an empty "value" where a token's
    keys and values take 2-4 KiB (bfloat16 at 8 heads of 128: 4 KiB; int8: 2 KiB), else
    two pools (float32 at 8 heads: 8 KiB; at 1 head: 1 KiB; this file's layers: 64 B);
    quantized scales two arrays (P, PS, K) either way; a latent layer's pool (values of
    a width of their own) two pools always."""
    policy = paged_cache.PagedCache(PS)
    cache = jax.eval_shape(lambda: policy.empty(1, 2 * PS, heads, width, dtype))
    if combined:
        assert cache.key.shape == (2, PS, 2, heads, width) and cache.value.shape == (0,)
    else:
        assert cache.key.shape == cache.value.shape == (2, PS, heads, width)
    if dtype == "int8":
        assert cache.key_scales.shape == cache.value_scales.shape == (2, PS, heads)
    latent = jax.eval_shape(lambda: policy.empty(1, 2 * PS, 1, 8, dtype, value_dim=4))
    assert latent.key.shape == (2, PS, 1, 8) and latent.value.shape == (2, PS, 1, 4)
