"""A paged KV cache under a sliding window with sink tokens: a linen layer with
``window=(W - 1, 0)`` and ``sink_tokens`` decoding mixed steps (prefill chunks, decode
tokens) of several sequences through a PageAllocator, over sequences longer than the
window, the sinks and a few pages, so that the window slides past whole pages while the
sink tokens' first page stays in view. Each sequence equals its own full forward (the
same config without ``page_size``, by the reference); the pool starts full of NaN and
inf.

A windowed allocator (``PageAllocator(window=, sink_tokens=)``, docs/decoding.md,
"Windowed layers in a paged pool") gives the pages no query can read any more back to
the pool: the entries it returns and when (a rewind never needs one), the bound on the
pages a decoding sequence holds (W = 512 over 16k tokens, on the allocator alone), a
returned page reused by another sequence that writes NaN into it while the first goes
on, a model of global and windowed layers with one allocator per kind, and the layer's
refusal of a page given back that its queries see."""

import functools
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from nanoattn import PageAllocator
from nanoattn.linen import AttentionConfig, CausalSelfAttention

from _layer_configs import paged_step, random_params

D, N, K = 24, 6, 2  # H = 4
PS, PAGES, SEQS, MAX_PAGES, TQ = 5, 19, 3, 7, 13  # page size and pool: primes
WINDOW, SINKS = 7, 3  # W keys in view (window=(W - 1, 0)), and the first 3 positions


@functools.cache
def _layer():
    """The jitted paged step (the automatic choice of backend), the full forward (the
    reference) and the pool (NaN and inf throughout)."""
    options = dict(n_kv_heads=K, rope_base=100.0, window=(WINDOW - 1, 0), sink_tokens=SINKS)
    layer = CausalSelfAttention(AttentionConfig(D, N, page_size=PS, **options))
    plain = CausalSelfAttention(AttentionConfig(D, N, implementation="xla", **options))
    params, shapes, apply = paged_step(layer, PAGES * PS, 5)
    step = jax.jit(apply)
    step.eager = apply  # unjitted: its checks raise when the batch is concrete
    full = jax.jit(lambda x: plain.apply({"params": params}, x, True))
    bad = np.random.default_rng(0).choice([np.nan, np.inf, -np.inf], size=shapes["key"].shape)
    pool = {name: jnp.zeros(a.shape, a.dtype) for name, a in shapes.items()}
    pool |= dict(key=jnp.asarray(bad, jnp.float32), value=jnp.asarray(bad[::-1], jnp.float32))
    return step, full, pool


def test_a_sliding_window_with_sink_tokens_over_pages_equals_each_full_forward():
    step, full, cache = _layer()
    alloc = PageAllocator(PAGES, PS, max_sequences=SEQS, max_pages=MAX_PAGES, seed=1)
    rng = np.random.default_rng(2)
    x = {s: rng.standard_normal((n, D)).astype(np.float32) for s, n in zip("abc", (34, 27, 12))}
    steps = [  # (sequence, first token, last token + 1): prefill chunks and decode tokens
        [("a", 0, 11), ("b", 0, 2)],
        [("a", 11, 12), ("b", 2, 13)],
        [("a", 12, 17), ("b", 13, 14), ("c", 0, 6)],
        [("a", 17, 29), ("b", 14, 15)],
        [("a", 29, 30), ("b", 15, 27)],
        [("a", 30, 34), ("c", 6, 12)],
    ]
    outputs = {s: [] for s in x}
    for rows in steps:
        for s, start, end in rows:
            (alloc.extend if start else alloc.allocate)(s, end - start)
        tokens = np.concatenate([x[s][start:end] for s, start, end in rows])
        tokens = np.pad(tokens, ((0, TQ - len(tokens)), (0, 0)))[None]
        batch = alloc.batch([(s, end - start) for s, start, end in rows], tokens=TQ)
        y, cache = step(cache, jnp.asarray(tokens), batch)
        alloc.confirm(batch)
        y, at = np.asarray(y[0]), 0
        for s, start, end in rows:
            outputs[s].append(y[at : at + end - start])
            at += end - start
        assert (y[at:] == 0).all()  # padding rows
    assert min(len(x["a"]), len(x["b"])) > WINDOW + SINKS + 2 * PS  # c: within the window
    # one full forward of the three, each padded at its end (causal: its rows unchanged)
    longest = max(len(t) for t in x.values())
    padded = np.stack([np.pad(t, ((0, longest - len(t)), (0, 0))) for t in x.values()])
    want = np.asarray(full(jnp.asarray(padded)))
    for b, (s, tokens) in enumerate(x.items()):
        got = np.concatenate(outputs[s])
        np.testing.assert_allclose(got, want[b, : len(tokens)], atol=2e-5, rtol=2e-5, err_msg=s)


# --- a windowed allocator --------------------------------------------------------


def _given_back(alloc, seq):
    """The entries of ``seq`` that are -1, and the pages it holds."""
    entries = alloc.pages_of(seq)
    return [j for j, p in enumerate(entries) if p == -1], [p for p in entries if p != -1]


def _step(alloc, *rows):
    batch = alloc.batch([(s, alloc.unwritten(s)) for s in rows], tokens=64)
    alloc.confirm(batch)
    return batch


def test_pages_go_back_once_no_query_can_read_them_and_a_rewind_never_needs_one():
    """Pages of 4, window=(5, 0) (W = 6), 2 sink tokens (page 0 stays): page j goes back
    once every query the sequence may still make sits past 4 j + 3 + 5, a rewind's
    included (its first query is at length - last extension)."""
    alloc = PageAllocator(12, 4, max_sequences=2, max_pages=8, window=(5, 0), sink_tokens=2)
    alloc.allocate("a", 14)  # queries 0..13 read everything
    assert _given_back(alloc, "a")[0] == []
    _step(alloc, "a")  # a rewind may take back all 14: its first query would be at 0
    assert _given_back(alloc, "a")[0] == []
    alloc.extend("a", 3)  # now a rewind takes back at most 3: queries from 14 read from 9
    assert _given_back(alloc, "a")[0] == [1]  # page 1 (positions 4..7); page 0: sinks
    batch = _step(alloc, "a")
    assert batch.page_table[0, :5].tolist()[:2] == [alloc.pages_of("a")[0], -1]
    alloc.rewind("a", 3)  # queries from 14 again: page 2 (8..11) is still there
    assert _given_back(alloc, "a")[0] == [1]
    alloc.extend("a", 4)
    _step(alloc, "a")  # 18 tokens, first query after a rewind at 14: reads from 9
    assert _given_back(alloc, "a")[0] == [1]
    alloc.extend("a", 1)  # first query at 18: reads from 13, page 2 goes
    assert _given_back(alloc, "a")[0] == [1, 2]
    _step(alloc, "a")
    alloc.fork("a", "b")  # written: b's queries start at 19, reading from 14
    assert _given_back(alloc, "b")[0] == [1, 2]
    free = alloc.free_pages
    alloc.free("a")
    assert alloc.free_pages == free  # b still holds every page a held
    alloc.free("b")
    assert alloc.free_pages == 12


@pytest.mark.parametrize("page_size, sinks", [(16, 4), (7, 0)])
def test_a_windowed_sequence_holds_at_most_ceil_w_over_page_size_plus_one_pages(page_size, sinks):
    """W = 512 (window=(511, 0)) decoding a 16k-token sequence one token per step after
    a prompt of W, on the allocator alone (each step's batch confirmed without a
    model): after every call it holds at most ceil(512 / page_size) + 1 pages besides
    its sink tokens' (a pool of that many and one spare serves it, where a full cache
    needs 16384 / page_size), ceil((W + page_size - 1) / page_size) is reached (the
    bound when page_size divides W), and every page its queries may read
    (the window of the token the step brings, the sinks) is in the step's batch."""
    W, ps, length = 512, page_size, 16384
    bound = -(-W // ps) + 1 + -(-sinks // ps)
    alloc = PageAllocator(bound + 1, ps, max_sequences=1, max_pages=-(-length // ps),
                          window=(W - 1, 0), sink_tokens=sinks)  # fmt: skip
    alloc.allocate("a", W)
    alloc.confirm(alloc.batch([("a", W)], tokens=W))
    most = 0
    while alloc.length("a") < length:
        alloc.extend("a", 1)
        most = max(most, sum(p != -1 for p in alloc.pages_of("a")))
        batch = alloc.batch([("a", 1)], tokens=1)
        alloc.confirm(batch)
        held = sum(p != -1 for p in alloc.pages_of("a"))
        most = max(most, held)
        q = alloc.length("a") - 1  # the step's query
        read = [j for j in range(q // ps + 1) if j * ps < sinks or (j + 1) * ps > q - W + 1]
        assert (batch.page_table[0, read] >= 0).all(), q
        assert alloc.free_pages + held == bound + 1
    # reached: ceil((W + page_size - 1) / page_size), the bound itself when page_size | W
    assert most == -(-(W + ps - 1) // ps) + -(-sinks // ps) <= bound


def test_a_windowed_allocator_refuses_bad_window_options():
    sizes = dict(max_sequences=1, max_pages=2)
    with pytest.raises(ValueError, match=r"sink_tokens must be >= 0 and needs a window"):
        PageAllocator(4, 2, sink_tokens=2, **sizes)
    with pytest.raises(ValueError, match=r"sink_tokens must be an int >= 0, got 1.5"):
        PageAllocator(4, 2, window=(3, 0), sink_tokens=1.5, **sizes)
    with pytest.raises(ValueError, match=r"window sides must be >= 0"):
        PageAllocator(4, 2, window=(-1, 0), **sizes)


def _feed(step, cache, alloc, rows):
    """One step of the layer: ``rows`` ``[(seq, new tokens)]`` already extended."""
    chunk = np.concatenate([t for _, t in rows])
    chunk = np.pad(chunk, ((0, TQ - len(chunk)), (0, 0)))[None]
    batch = alloc.batch([(s, len(t)) for s, t in rows], tokens=TQ)
    y, cache = step(cache, jnp.asarray(chunk), batch)
    alloc.confirm(batch)
    return np.asarray(y[0]), cache


def test_pages_given_back_are_reused_with_nan_while_the_sequence_goes_on():
    """Sequence a decodes 29 tokens in prefill chunks, decode tokens and speculative
    chunks whose last 3 drafts are rejected (each ending where the rejection takes its
    first query back across a page); its pages past the window and the sinks go
    back to the pool, and poison sequences take them, write NaN and huge keys into them
    and are freed while a goes on. Every token a keeps equals its full forward, and
    after a step of n tokens a holds at most ceil((W - 1 + n) / page_size) + 1 pages
    besides its sink tokens' page (ceil(W / page_size) + 1 decoding)."""
    step, full, cache = _layer()
    alloc = PageAllocator(PAGES, PS, max_sequences=SEQS, max_pages=MAX_PAGES, seed=4,
                          window=(WINDOW - 1, 0), sink_tokens=SINKS)  # fmt: skip
    rng = np.random.default_rng(6)
    x, drafts = (rng.standard_normal((34, D)).astype(np.float32) for _ in range(2))
    poison = np.where(np.arange(D) % 2, np.nan, 1e38).astype(np.float32)[None].repeat(4, 0)
    outputs, at, ever, reused = [], 0, set(), set()
    for k, n in enumerate((9, 1, 1, 1, 4, 1, 1, 5, 1, 1, 1, 3, 1, 4, 1)):
        (alloc.extend if at else alloc.allocate)("a", n)
        new = x[at : at + n] if n != 4 else np.concatenate([x[at : at + 1], drafts[:3]])
        rows = [("a", new)]
        held = {p for p in alloc.pages_of("a") if p != -1}
        if at and k % 2 == 0:  # a poison sequence on the free pages, the returned first
            alloc.allocate(("poison", k), 4)
            reused |= set(alloc.pages_of(("poison", k))) & (ever - held)
            rows.append((("poison", k), poison))
        y, cache = _feed(step, cache, alloc, rows)
        outputs.append(y[: 1 if n == 4 else n])
        if len(rows) > 1:
            alloc.free(rows[1][0])
        if n == 4:  # the 3 drafts rejected
            alloc.rewind("a", 3)
        at += 1 if n == 4 else n
        held = [p for p in alloc.pages_of("a") if p != -1]
        assert len(held) <= -(-(WINDOW - 1 + n) // PS) + 1 + -(-SINKS // PS), (k, held)
        ever |= set(held)
    assert reused, "no poison sequence took a page a gave back"
    want = np.asarray(full(jnp.asarray(x[:at])[None]))[0]
    np.testing.assert_allclose(np.concatenate(outputs), want, atol=2e-5, rtol=2e-5)


@functools.cache
def _global_layer():
    """A paged layer without a window (a global one): its jitted and eager steps, its
    full forward and a pool of zeros."""
    layer = CausalSelfAttention(AttentionConfig(D, N, n_kv_heads=K, rope_base=100.0, page_size=PS))
    params, shapes, apply = paged_step(layer, PAGES * PS, 7)
    step = jax.jit(apply)
    step.eager = apply
    full = jax.jit(lambda x: layer.apply({"params": params}, x, True))
    return step, full, jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), shapes)


@pytest.mark.parametrize("kind", ["global", "sinks"])
def test_a_layer_refuses_a_page_given_back_that_its_queries_see(kind):
    """An allocator with window=(6, 0) and no sink tokens gives page 0 back once a's
    queries start at 13; a global layer, or a windowed one with sink tokens, reads it:
    one line when concrete; under jit NaN in a's rows (never written), b's unchanged."""
    step, full, cache = _global_layer() if kind == "global" else _layer()
    alloc = PageAllocator(PAGES, PS, max_sequences=SEQS, max_pages=MAX_PAGES,
                          window=(WINDOW - 1, 0))  # fmt: skip
    x = np.random.default_rng(1).standard_normal((18, D)).astype(np.float32)
    alloc.allocate("a", 13)
    _, cache = _feed(step, cache, alloc, [("a", x[:13])])
    alloc.extend("a", 1)
    alloc.allocate("b", 4)
    assert alloc.pages_of("a")[:2] == [-1, alloc.pages_of("a")[1]]
    chunk = jnp.asarray(np.pad(x[13:18], ((0, TQ - 5), (0, 0)))[None])
    batch = alloc.batch([("a", 1), ("b", 4)], tokens=TQ)
    rule = "(window (None, 0), 0 sink tokens)" if kind == "global" else "(window (6, 0), 3 sink"
    with pytest.raises(ValueError, match=(
        r"^page_table\[0, 0\]=-1 is a page sequence 0 gave back, but its query at position "
        rf"13 sees its keys 0..4 {re.escape(rule)}.*; a layer reads every page in its window"
    )):  # fmt: skip
        step.eager(cache, chunk, batch)
    y, after = step(cache, chunk, batch)
    y = np.asarray(y[0])
    assert np.isnan(y[0]).all() and not np.isnan(y[1:5]).any()
    page = alloc.pages_of("a")[2]  # a's token at 13: slot 3 of its third page, not written
    np.testing.assert_array_equal(after["key"][page, 3], cache["key"][page, 3])
    want = np.asarray(full(jnp.asarray(x[14:18])[None]))[0]
    np.testing.assert_allclose(y[1:5], want, atol=2e-5, rtol=2e-5)


# --- a model of global and windowed layers: one allocator per kind ----------------

HYBRID_GLOBAL_PAGES, HYBRID_WINDOW_PAGES = 16, 9


class Hybrid(nn.Module):
    """Two paged layers, a global one and a windowed one with sink tokens, each with a
    pool of its own size: ``pages`` is ``(global batch, windowed batch)``."""

    @nn.compact
    def __call__(self, x, pages=None, decode=False):
        base = dict(n_kv_heads=K, rope_base=100.0, page_size=PS)
        layers = [
            (AttentionConfig(D, N, **base), HYBRID_GLOBAL_PAGES),
            (AttentionConfig(D, N, window=(WINDOW - 1, 0), sink_tokens=SINKS, **base),
             HYBRID_WINDOW_PAGES),
        ]  # fmt: skip
        for i, (config, pool) in enumerate(layers):
            layer = CausalSelfAttention(config, name=f"layer_{i}")
            if decode and self.is_initializing():  # each layer's pool of its own size
                layer(jnp.zeros((1, pool * PS, D)), True, decode=True)
            else:
                batch = None if pages is None else pages[i]
                x = x + layer(x, True, decode=decode, pages=batch)
        return x


def test_a_model_of_global_and_windowed_layers_runs_one_allocator_per_kind():
    """The engine holds two allocators, one per kind of layer, and makes every call on
    both (same sequences, same tokens); each step takes both batches. The windowed
    layer's pool (9 pages) is smaller than what the sequences hold (16 pages in the
    global pool): it holds only their windows and sink tokens. Each sequence equals the
    model's full forward."""
    model = Hybrid()
    variables = model.init(jax.random.key(0), jnp.zeros((1, 1, D)), decode=True)
    params = random_params(variables["params"], 8)
    cache = jax.tree.map(lambda a: jnp.full(a.shape, jnp.nan, a.dtype), variables["cache"])

    @jax.jit
    def step(cache, x, batches):
        y, state = model.apply({"params": params, "cache": cache}, x, pages=batches,
                               decode=True, mutable=["cache"])  # fmt: skip
        return y, state["cache"]

    sizes = dict(max_sequences=2, max_pages=10, seed=2)
    both = (
        PageAllocator(HYBRID_GLOBAL_PAGES, PS, **sizes),
        PageAllocator(HYBRID_WINDOW_PAGES, PS, window=(WINDOW - 1, 0), sink_tokens=SINKS,
                      **sizes),
    )  # fmt: skip
    rng = np.random.default_rng(9)
    x = {s: rng.standard_normal((n, D)).astype(np.float32) for s, n in (("a", 38), ("b", 33))}
    at, outputs = {"a": 0, "b": 0}, {"a": [], "b": []}
    schedule = [("a", 8), ("b", 5)], [("a", 1), ("b", 9)], [("a", 10)], [("a", 1), ("b", 1)]
    schedule = [*schedule, *([("a", 2), ("b", 2)],) * 9]
    for rows in schedule:
        for s, n in rows:
            for alloc in both:  # every call on both allocators, in the same order
                (alloc.extend if at[s] else alloc.allocate)(s, n)
        chunk = np.concatenate([x[s][at[s] : at[s] + n] for s, n in rows])
        chunk = np.pad(chunk, ((0, TQ - len(chunk)), (0, 0)))[None]
        batches = tuple(alloc.batch(rows, tokens=TQ) for alloc in both)
        y, cache = step(cache, jnp.asarray(chunk), batches)
        for alloc, batch in zip(both, batches):
            alloc.confirm(batch)
        y, first = np.asarray(y[0]), 0
        for s, n in rows:
            outputs[s].append(y[first : first + n])
            first, at[s] = first + n, at[s] + n
    assert sum(len(both[0].pages_of(s)) for s in "ab") == 8 + 7 > HYBRID_WINDOW_PAGES
    for s in "ab":
        want = np.asarray(model.apply({"params": params}, jnp.asarray(x[s])[None]))[0]
        np.testing.assert_allclose(np.concatenate(outputs[s]), want, atol=3e-5, rtol=3e-5,
                                   err_msg=s)  # fmt: skip
