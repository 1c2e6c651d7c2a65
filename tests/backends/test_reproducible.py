"""A backward pass is bitwise the same from run to run (docs/conventions.md,
"Reproducibility"): on every backend that serves the call, the gradients of one call
run again, and run by several Python threads at once on the same thread pool (which
changes which worker takes which task), are the same bits."""

import concurrent.futures

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from nanoattn import dot_product_attention

from _backends import each_backend, require
from _reference import randn

# Prime sizes, long enough for several of the native kernel's 64-key blocks per query
# block, so that its dQ gathers the work of many tasks.
B, T, N, K, H = 2, 331, 6, 2, 16
IDS = np.repeat(np.arange(4), [101, 53, 150, 27]).astype(np.int32)  # four documents
RULES = dict(is_causal=True, q_segment_ids=np.stack([IDS] * B), kv_segment_ids=np.stack([IDS] * B))
RUNS = 4


def _gradients(implementation):
    """A jitted ``f(q, k, v, d_out) -> (dq, dk, dv)`` of one backend."""

    @jax.jit
    def grads(q, k, v, d_out):
        def attend(q, k, v):
            return dot_product_attention(q, k, v, implementation=implementation, **RULES)

        _, vjp = jax.vjp(attend, q, k, v)
        return vjp(d_out)

    return grads


def _bits(arrays):
    return [np.asarray(a).view(np.uint32) for a in arrays]


@each_backend()
def test_backward_is_bitwise_reproducible(implementation):
    q, k, v = randn(0, B, T, N, H), randn(1, B, T, K, H), randn(2, B, T, K, H)
    require(implementation, q, k, v, **RULES)
    d_out = randn(3, B, T, N, H)
    grads = _gradients(implementation)
    args = tuple(map(jnp.asarray, (q, k, v, d_out)))
    first = _bits(grads(*args))
    again = [_bits(grads(*args)) for _ in range(RUNS)]
    with concurrent.futures.ThreadPoolExecutor(RUNS) as pool:  # runs that share the workers
        again += [_bits(g) for g in pool.map(lambda _: grads(*args), range(RUNS))]
    for run, got in enumerate(again):
        for name, a, b in zip(("dq", "dk", "dv"), first, got):
            assert np.array_equal(a, b), f"{implementation}: run {run + 1}'s {name} differs"


NATIVE_PATHS = {  # (B, T, N, K) on two threads
    # a short call with B x K >= 4 x threads runs one task per (b, key/value head),
    # which sums its group's dQ alone: 8 groups here
    "short calls by group": (4, 97, 6, 2),
    # a long one, tasks of up to four key blocks (16 blocks x 4 (b, key/value head):
    # 16 tasks of four), their dQ parts added in each lane's order
    "key blocks in groups": (2, 1021, 6, 2),
}


@pytest.mark.parametrize("path", NATIVE_PATHS)
def test_native_paths_are_bitwise_reproducible(path, monkeypatch):
    # Each of the native backward's ways of sharing work (docs/conventions.md), run again
    # and from several Python threads at once.
    from nanoattn._backends.native import build

    if build.load()[0] is None:
        pytest.skip("the native kernel could not be built here")
    monkeypatch.setenv("NANOATTN_NUM_THREADS", "2")
    b, t, n, k = NATIVE_PATHS[path]
    q, kk, v = randn(4, b, t, n, H), randn(5, b, t, k, H), randn(6, b, t, k, H)
    d_out = randn(7, b, t, n, H)

    @jax.jit
    def grads(q, kk, v, d_out):
        def attend(q, kk, v):
            return dot_product_attention(q, kk, v, implementation="native", is_causal=True)

        return jax.vjp(attend, q, kk, v)[1](d_out)

    args = tuple(map(jnp.asarray, (q, kk, v, d_out)))
    first = _bits(grads(*args))
    with concurrent.futures.ThreadPoolExecutor(RUNS) as pool:
        again = [_bits(g) for g in pool.map(lambda _: grads(*args), range(2 * RUNS))]
    for run, got in enumerate(again):
        for name, x, y in zip(("dq", "dk", "dv"), first, got):
            assert np.array_equal(x, y), f"native, {path}: run {run + 1}'s {name} differs"
