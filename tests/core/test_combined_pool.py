"""paged_attention over one combined pool (P, page_size, 2, K, H), value_pages None: a
token's keys then its values. The same call over the two halves as separate pools is
checked against the float64 reference in test_paged_attention.py; here the combined
call must equal it exactly (outputs, log-sum-exp, and the gradient to the pool the
halves' gradients side by side), on every backend that serves it, for float pools,
bfloat16 ones and int8 ones with their scales; the native forward pass reads the pool
in place (no copy of either half in the compiled program); a combined pool of the wrong
shape is a one-line error.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_paged_attention import MIXED, Layout

import nanoattn
from nanoattn._backends import registry

from _backends import require, require_paged


@functools.cache
def _program(name: str, quantized: bool):
    """The call over (keys, values) or over the combined pool (values None), with its
    log-sum-exp and, for float pools, the VJP to the query and the pool(s)."""

    def call(q, kp, vp, table, lengths, starts, scales):
        return nanoattn.paged_attention(
            q, kp, vp, table, lengths, starts, window=(9, 0), return_residual=True,
            implementation=name, **scales,
        )  # fmt: skip

    @jax.jit
    def run(q, kp, vp, table, lengths, starts, scales, d_out):
        if quantized:
            return call(q, kp, vp, table, lengths, starts, scales), None
        (out, lse), vjp = jax.vjp(
            lambda q, kp, vp: call(q, kp, vp, table, lengths, starts, scales), q, kp, vp
        )  # fmt: skip
        return (out, lse), vjp((d_out, jnp.zeros_like(lse)))

    return run


def _both(name, layout, dtype=jnp.float32, quantized=False):
    """(the two pools' results, the combined pool's): ((out, lse), grads)."""
    q, kp, vp, table, lengths, starts = layout.arrays()
    kp, vp = np.nan_to_num(kp, nan=0.0), vp  # keys: finite, so that int8 scales are
    scales = {}
    if quantized:
        (kp, ks), (vp, vs) = (nanoattn.quantize_kv(jnp.asarray(x), "int8") for x in (kp, vp))
        scales = dict(key_scales=ks, value_scales=vs)
    else:
        kp, vp = jnp.asarray(kp, dtype), jnp.asarray(vp, dtype)
    q = jnp.asarray(q, jnp.float32 if quantized else dtype)
    rest = [jnp.asarray(x) for x in (table, lengths, starts)]
    require_paged(name, q, kp, vp, *rest, window=(9, 0), **scales)
    run = _program(name, quantized)
    d_out = jnp.asarray(layout.d_out, q.dtype)
    two = run(q, kp, vp, *rest, scales, d_out)
    one = run(q, jnp.stack([kp, vp], axis=2), None, *rest, scales, d_out)
    return two, one


@pytest.mark.parametrize("name", registry.names())
def test_a_combined_pool_equals_its_two_halves(name):
    """Float32, pages of 5 in shuffled order, a window, NaN and inf in the slots no
    sequence reads; the gradient to the pool is (dk, dv) stacked on its axis 2."""
    (two, grads_two), (one, grads_one) = _both(name, Layout(**MIXED, page_size=5, seed=11))
    for got, want in zip(one, two):
        np.testing.assert_array_equal(got, want, err_msg=name)
    dq, dk, dv = grads_two
    np.testing.assert_array_equal(grads_one[0], dq, err_msg=name)
    np.testing.assert_array_equal(grads_one[1], np.stack([dk, dv], axis=2), err_msg=name)
    assert grads_one[2] is None


@pytest.mark.parametrize("dtype, quantized", [(jnp.bfloat16, False), (jnp.float32, True)],
                         ids=["bfloat16", "int8"])  # fmt: skip
def test_combined_bfloat16_and_int8_pools_on_native(dtype, quantized):
    (two, _), (one, _) = _both("native", Layout(**MIXED, page_size=16, seed=12), dtype,
                               quantized)  # fmt: skip
    for got, want in zip(one, two):
        np.testing.assert_array_equal(got, want)


def test_the_native_forward_reads_the_pool_in_place():
    """The compiled decode over a combined pool of 1.2 MiB holds no copy of either half:
    its temporaries stay below a quarter of a half's bytes."""
    P, ps, K, H, N = 149, 16, 2, 64, 4
    shapes = (
        jax.ShapeDtypeStruct((3, N, H), jnp.float32),
        jax.ShapeDtypeStruct((P, ps, 2, K, H), jnp.float32),
        None,
        jax.ShapeDtypeStruct((3, 50), jnp.int32),
        jax.ShapeDtypeStruct((3,), jnp.int32),
        jax.ShapeDtypeStruct((4,), jnp.int32),
    )
    require_paged("native", *(jnp.zeros(s.shape, s.dtype) if s else None for s in shapes))
    call = functools.partial(nanoattn.paged_attention, implementation="native")
    temp = jax.jit(call).lower(*shapes).compile().memory_analysis().temp_size_in_bytes
    half = P * ps * K * H * 4
    assert temp < half / 4, (temp, half)


@pytest.mark.parametrize(
    "pool, message",
    [
        ((3, 2, 1, 4), r"value_pages is None, so key_pages must be one combined pool"),
        ((3, 2, 3, 1, 4), r"value_pages is None, so key_pages must be one combined pool"),
        ((3, 2, 2, 1, 5), r"key_pages must have shape \(P, page_size, 2, K, H\)"),
    ],
    ids=["four axes", "three halves", "another width"],
)
def test_a_combined_pool_of_the_wrong_shape_raises_one_line(pool, message):
    with pytest.raises(ValueError, match=message):
        nanoattn.paged_attention(
            jnp.ones((1, 2, 4)), jnp.ones(pool), None, jnp.zeros((1, 2), jnp.int32),
            jnp.ones((1,), jnp.int32), jnp.arange(2, dtype=jnp.int32),
        )  # fmt: skip


# A dense call over one combined cache (B, S, 2, K, H), value None.
B, S, DN, DK, DH = 3, 37, 6, 2, 8


@functools.cache
def _dense_program(name: str, T: int, quantized: bool):
    """A call over a cache of S = 37 slots with kv_lengths and causal queries at their
    rows' ends (a decoding step at T = 1, a chunk at T = 17), with its log-sum-exp and,
    for float caches, the VJP to the query and the cache(s)."""
    lengths = jnp.array([37, 11, 20])
    rules = dict(kv_lengths=lengths, q_offset=lengths - T, is_causal=True, window=(13, 0),
                 return_residual=True, implementation=name)  # fmt: skip

    def call(q, k, v, scales):
        return nanoattn.dot_product_attention(q, k, v, **rules, **scales)

    @jax.jit
    def run(q, k, v, scales, d_out):
        if quantized:
            return call(q, k, v, scales), None
        (out, lse), vjp = jax.vjp(lambda q, k, v: call(q, k, v, scales), q, k, v)
        return (out, lse), vjp((d_out, jnp.zeros_like(lse)))

    return run, rules


@pytest.mark.parametrize("T", [1, 17], ids=["decode", "chunk"])
@pytest.mark.parametrize("name", registry.names())
def test_a_combined_dense_cache_equals_its_two_halves(name, T):
    """Float32, slots past each row's length NaN (never read); a decoding step (read in
    place by native) and a chunk (native packs the halves); outputs, log-sum-exp and
    gradients exact."""
    rng = np.random.default_rng(T)
    cache = rng.standard_normal((B, S, 2, DK, DH)).astype(np.float32)
    cache[1, 11:], cache[2, 20:] = np.nan, np.inf
    cache = jnp.asarray(cache)
    q = jnp.asarray(rng.standard_normal((B, T, DN, DH)), jnp.float32)
    d_out = jnp.asarray(rng.standard_normal((B, T, DN, DH)), jnp.float32)
    run, rules = _dense_program(name, T, False)
    k, v = cache[:, :, 0], cache[:, :, 1]
    require(name, q, k, v, **{n: x for n, x in rules.items() if n != "implementation"})
    (two, (dq, dk, dv)), (one, grads) = run(q, k, v, {}, d_out), run(q, cache, None, {}, d_out)
    for got, want in zip(one, two):
        np.testing.assert_array_equal(got, want, err_msg=name)
    np.testing.assert_array_equal(grads[0], dq)
    np.testing.assert_array_equal(grads[1], np.stack([dk, dv], axis=2))
    assert grads[2] is None


def test_a_combined_int8_dense_cache_decodes_in_place_on_native():
    rng = np.random.default_rng(3)
    halves = [jnp.asarray(rng.standard_normal((B, S, DK, DH)), jnp.float32) for _ in "kv"]
    (k, ks), (v, vs) = (nanoattn.quantize_kv(x, "int8") for x in halves)
    q = jnp.asarray(rng.standard_normal((B, 1, DN, DH)), jnp.float32)
    run, _ = _dense_program("native", 1, True)
    scales = dict(key_scales=ks, value_scales=vs)
    two, one = run(q, k, v, scales, None)[0], run(q, jnp.stack([k, v], 2), None, scales, None)[0]
    for got, want in zip(one, two):
        np.testing.assert_array_equal(got, want)


def test_the_native_dense_decode_reads_the_cache_in_place():
    shapes = (jax.ShapeDtypeStruct((4, 1, 8, 64), jnp.float32),
              jax.ShapeDtypeStruct((4, 599, 2, 2, 64), jnp.float32))  # fmt: skip
    lengths = jnp.array([599, 7, 300, 1])
    call = functools.partial(nanoattn.dot_product_attention, kv_lengths=lengths,
                             implementation="native")  # fmt: skip
    compiled = jax.jit(lambda q, kv: call(q, kv, None)).lower(*shapes).compile()
    half = 4 * 599 * 2 * 64 * 4
    assert compiled.memory_analysis().temp_size_in_bytes < half / 4


@pytest.mark.parametrize(
    "key, query, message",
    [((3, 5, 2, 4), (3, 1, 2, 4), r"value is None, so key must be one combined cache"),
     ((3, 5, 2, 1, 4), (1, 2, 4), r"value is None, so key must be one combined cache"),
     ((3, 5, 2, 1, 5), (3, 1, 2, 4), r"key must have shape \(B, S, K, H\)")],
    ids=["four axes", "unbatched query", "another width"],
)  # fmt: skip
def test_a_combined_dense_cache_of_the_wrong_shape_raises_one_line(key, query, message):
    with pytest.raises(ValueError, match=message):
        nanoattn.dot_product_attention(jnp.ones(query), jnp.ones(key), None)
