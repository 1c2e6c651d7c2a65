"""A paged KV cache under a sliding window with sink tokens: a linen layer with
``window=(W - 1, 0)`` and ``sink_tokens`` decoding mixed steps (prefill chunks, decode
tokens) of several sequences through a PageAllocator, over sequences longer than the
window, the sinks and a few pages, so that the window slides past whole pages while the
sink tokens' first page stays in view. Each sequence equals its own full forward (the
same config without ``page_size``, by the reference); the pool starts full of NaN and
inf."""

import functools

import jax
import jax.numpy as jnp
import numpy as np

from nanoattn import PageAllocator
from nanoattn.linen import AttentionConfig, CausalSelfAttention

from _layer_configs import random_params

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
    shapes = jax.eval_shape(
        functools.partial(layer.init, decode=True), jax.random.key(0), jnp.zeros((1, PAGES * PS, D))
    )
    params = random_params(shapes["params"], 5)

    @jax.jit
    def step(cache, x, pages):
        y, state = layer.apply(
            {"params": params, "cache": cache}, x, True, decode=True, pages=pages,
            mutable=["cache"],
        )  # fmt: skip
        return y, state["cache"]

    full = jax.jit(lambda x: plain.apply({"params": params}, x, True))
    bad = np.random.default_rng(0).choice(
        [np.nan, np.inf, -np.inf], size=shapes["cache"]["key"].shape
    )
    pool = {name: jnp.zeros(a.shape, a.dtype) for name, a in shapes["cache"].items()}
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
