"""Quantized KV caches (AttentionConfig(kv_cache_dtype=)): the full, rolling and paged
caches, linen and NNX. Exactness: decoding the same chunks into a quantized and a float
cache of the same model, the quantized cache holds exactly ``quantize_kv`` of what the
float one holds (each token quantized once, with its own scale, at its own slot, never
requantized); the outputs stay within a bound of the float decode's (and differ: the
quantized values are read). Rewind, the true bytes, the config's error."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import nanoattn
from nanoattn import PageAllocator
from nanoattn import nnx as nanoattn_nnx
from nanoattn._base.quantized import QUANTIZED_DTYPES
from nanoattn.linen import AttentionConfig, CausalSelfAttention, cache_bytes, rewind

from _layer_configs import random_params
from _reference import randn

D, N, K, B, C = 24, 6, 2, 2, 13  # H = 4; capacity C
CHUNKS = ((0, 5), (5, 6), (6, 9), (9, 10), (10, 12))
# the largest difference from the float decode's outputs: int8 keeps 8 bits a value,
# float8_e4m3fn 4 (measured 0.007 and 0.03 on this model)
BOUND = {"int8": 0.03, "float8_e4m3fn": 0.15}
KINDS = {"full": {}, "rolling": dict(rolling_cache=True, window=(4, 0), sink_tokens=1)}


def _config(kind, kv_cache_dtype=None, **options):
    return AttentionConfig(D, N, n_kv_heads=K, rope_base=100.0, kv_cache_dtype=kv_cache_dtype,
                           **KINDS.get(kind, {}), **options)  # fmt: skip


@functools.cache
def _linen(kind, kv_cache_dtype):
    """A jitted decoding step of a linen layer, its parameters and its empty cache."""
    layer = CausalSelfAttention(_config(kind, kv_cache_dtype))
    variables = layer.init(jax.random.key(0), jnp.zeros((B, C, D)), True, decode=True)
    params = random_params(variables["params"], 3)

    @jax.jit
    def step(cache, x):
        y, state = layer.apply({"params": params, "cache": cache}, x, True, decode=True,
                               mutable=["cache"])  # fmt: skip
        return y, state["cache"]

    return step, variables["cache"]


def _decode_linen(kind, kv_cache_dtype, x):
    step, cache = _linen(kind, kv_cache_dtype)
    ys = []
    for a, b in CHUNKS:
        y, cache = step(cache, x[:, a:b])
        ys.append(y)
    return np.concatenate(ys, axis=1), cache


def _halves(cache) -> dict:
    """A cache's keys and values: its two arrays, or a combined pool's (P, PS, 2, K, H)
    halves."""
    if cache["key"].ndim == 5:
        return {"key": cache["key"][:, :, 0], "value": cache["key"][:, :, 1]}
    return {"key": cache["key"], "value": cache["value"]}


def _assert_holds_the_quantized_float_cache(quantized, float_cache, dtype, pools=False):
    got, want = _halves(quantized), _halves(float_cache)
    for name in ("key", "value"):
        values, scales = nanoattn.quantize_kv(want[name], dtype)
        assert got[name].dtype == jnp.dtype(dtype)
        np.testing.assert_array_equal(np.asarray(got[name], np.float32),
                                      np.asarray(values, np.float32), err_msg=name)  # fmt: skip
        np.testing.assert_array_equal(quantized[f"{name}_scales"], scales, err_msg=name)


def _assert_near_the_float_decode(y, y_float, dtype):
    error = np.abs(y - y_float).max()
    assert 1e-5 < error <= BOUND[dtype], error


@pytest.mark.parametrize(
    "kind, dtype",
    [
        # float8 on the slot caches in make test-all; its fast path: the int8 cases here
        # (the same store and read) and the float8 paged pool below
        pytest.param(kind, dtype, marks=[pytest.mark.slow] if dtype != "int8" else [])
        for dtype in QUANTIZED_DTYPES
        for kind in KINDS
    ],
)
def test_linen_cache_holds_each_token_quantized_once_at_its_slot(kind, dtype):
    x = randn(1, B, 12, D)
    y_float, float_cache = _decode_linen(kind, None, x)
    y, cache = _decode_linen(kind, dtype, x)
    assert sorted(cache) == ["key", "key_scales", "last", "position", "value", "value_scales"]
    _assert_holds_the_quantized_float_cache(cache, float_cache, dtype)
    _assert_near_the_float_decode(y, y_float, dtype)


def test_nnx_cache_holds_each_token_quantized_once_at_its_slot():
    x = randn(2, B, 12, D)
    modules = {}
    for dtype in (None, "int8"):
        module = nanoattn_nnx.CausalSelfAttention(_config("full", dtype), rngs=nnx.Rngs(4))
        module.init_cache(B, C)
        ys = [np.asarray(module(x[:, a:b], decode=True)) for a, b in CHUNKS]
        modules[dtype] = (np.concatenate(ys, axis=1), module.cache.get())
    (y_float, float_cache), (y, cache) = modules[None], modules["int8"]
    _assert_holds_the_quantized_float_cache(cache._asdict(), float_cache._asdict(), "int8")
    _assert_near_the_float_decode(y, y_float, "int8")


PS, PAGES = 3, 11


@functools.cache
def _paged(kv_cache_dtype):
    layer = CausalSelfAttention(_config("paged", kv_cache_dtype, page_size=PS))
    shapes = jax.eval_shape(functools.partial(layer.init, decode=True), jax.random.key(0),
                            jnp.zeros((1, PAGES * PS, D)))  # fmt: skip
    params = random_params(shapes["params"], 3)

    @jax.jit
    def step(cache, x, pages):
        y, state = layer.apply({"params": params, "cache": cache}, x, True, decode=True,
                               pages=pages, mutable=["cache"])  # fmt: skip
        return y, state["cache"]

    return step, jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), shapes["cache"])


def _decode_paged(kv_cache_dtype, a, b):
    """Two sequences through a shuffled pool: prompts, then a decode token each, then a
    chunk of one of them (Tq = 8 rows, padding included)."""
    step, cache = _paged(kv_cache_dtype)
    alloc = PageAllocator(PAGES, PS, max_sequences=2, max_pages=5, seed=1)
    ys = []
    for rows in ([("a", a[:5]), ("b", b[:3])], [("a", a[5:6]), ("b", b[3:4])], [("b", b[4:8])]):
        for seq_id, x in rows:
            if seq_id in alloc.sequences():
                alloc.extend(seq_id, len(x))
            else:
                alloc.allocate(seq_id, len(x))
        x = np.concatenate([x for _, x in rows])
        batch = alloc.batch([(s, len(x)) for s, x in rows], tokens=8)
        y, cache = step(cache, jnp.asarray(np.pad(x, ((0, 8 - len(x)), (0, 0)))[None]), batch)
        alloc.confirm(batch)
        ys.append(np.asarray(y[0, : len(x)]))
    return np.concatenate(ys), cache


@pytest.mark.parametrize("dtype", QUANTIZED_DTYPES)
def test_paged_pool_holds_each_token_quantized_once_at_its_slot(dtype):
    a, b = randn(5, 6, D), randn(6, 8, D)
    y_float, float_cache = _decode_paged(None, a, b)
    y, cache = _decode_paged(dtype, a, b)
    assert cache["key_scales"].shape == (PAGES, PS, K)
    _assert_holds_the_quantized_float_cache(cache, float_cache, dtype)
    _assert_near_the_float_decode(y, y_float, dtype)


def test_a_rewound_chunk_decoded_again_gives_the_same_cache_and_outputs():
    step, cache = _linen("rolling", "int8")
    x = randn(7, B, 9, D)
    _, cache = step(cache, x[:, :5])
    y_once, once = step(cache, x[:, 5:8])
    _, cache = step(cache, x[:, 5:8])
    cache = rewind(cache, 3)
    y_again, again = step(cache, x[:, 5:8])
    np.testing.assert_array_equal(y_again, y_once)
    for name in once:
        np.testing.assert_array_equal(again[name], once[name], err_msg=name)


def test_cache_bytes_counts_the_quantized_values_and_their_scales():
    _, cache = _linen("full", "int8")
    H = D // N
    assert cache_bytes(cache) == {"": 2 * B * C * K * H * 1 + 2 * B * C * K * 4 + 8 * B}
    _, float_cache = _linen("full", None)
    assert cache_bytes(float_cache) == {"": 2 * B * C * K * H * 4 + 8 * B}


def test_an_unknown_kv_cache_dtype_raises_a_one_line_error_naming_it():
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of") as error:
        _config("full", "int4")
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_a_gradient_through_a_quantized_cache_step_raises_one_line_a_float_one_runs(jit):
    """jax.grad over a decoding step: through a quantized cache, quantize_kv's one-line
    refusal (not jax's missing rule ten frames deep); through a float cache, gradients."""
    x = randn(8, B, 4, D)

    def loss_of(kv_cache_dtype):
        layer = CausalSelfAttention(_config("full", kv_cache_dtype))
        variables = layer.init(jax.random.key(0), jnp.zeros((B, C, D)), True, decode=True)

        def loss(params):
            y, _ = layer.apply({"params": params, "cache": variables["cache"]}, x, True,
                               decode=True, mutable=["cache"])  # fmt: skip
            return jnp.sum(y**2)

        grad = jax.grad(loss)
        return (jax.jit(grad) if jit else grad), variables["params"]

    grad, params = loss_of(None)
    assert all(np.all(np.isfinite(g)) for g in jax.tree.leaves(grad(params)))
    grad, params = loss_of("int8")
    with pytest.raises(ValueError, match="quantize_kv is not differentiable") as error:
        grad(params)
    assert "\n" not in str(error.value) and "kv_cache_dtype=None" in str(error.value)
