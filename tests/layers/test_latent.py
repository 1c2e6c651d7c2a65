"""Multi-head latent attention (nanoattn.linen / nanoattn.nnx LatentAttention): the
training forward against the float64 numpy transcription (tests/_np_latent.py), and the
absorbed decoding step over the latent cache against the forward, at prime sizes
(B=2, T=11, D=29, N=3, r=13, Hn=7, Hr=4 (even), Hv=5, rq=17)."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _np_latent import np_latent
from flax import nnx

import nanoattn
import nanoattn.nnx
from nanoattn.linen import LatentAttention, LatentConfig

B, T, D = 2, 11, 29
SIZES = dict(d_model=D, n_heads=3, kv_lora_rank=13, qk_nope_head_dim=7, qk_rope_head_dim=4,
             v_head_dim=5)  # fmt: skip
CONFIG = LatentConfig(**SIZES, q_lora_rank=17)


def _x(seed=0):
    return jax.random.normal(jax.random.key(seed), (B, T, D))


@functools.cache
def _layer(cfg=CONFIG):
    """The layer, its parameters (norm scales made random: a forgotten norm shows) and
    its full forward."""
    layer = LatentAttention(cfg)
    params = layer.init(jax.random.key(1), _x())
    params = jax.tree_util.tree_map_with_path(
        lambda path, a: a + 0.3 * jax.random.normal(jax.random.key(len(str(path))), a.shape)
        if "norm" in str(path) else a,
        params,
    )  # fmt: skip
    return layer, params


@pytest.mark.parametrize("q_lora_rank", [17, None])
def test_forward_equals_the_float64_transcription(q_lora_rank):
    cfg = LatentConfig(**SIZES, q_lora_rank=q_lora_rank)
    layer, params = _layer(cfg)
    got = layer.apply(params, _x())
    np.testing.assert_allclose(got, np_latent(params, _x(), cfg), atol=2e-5, rtol=2e-5)


def test_window_soft_cap_and_padding_equal_the_float64_transcription():
    cfg = LatentConfig(**SIZES, q_lora_rank=17, window=(3, 0), logit_soft_cap=2.0)
    layer, params = _layer(cfg)
    pad = np.arange(T)[None] < np.array([[T], [6]])  # row 1: its last 5 keys are padding
    mask = pad[:, None, None, :]  # (B, 1, 1, S)
    got = layer.apply(params, _x(), mask=jnp.asarray(mask))
    i, j = np.arange(T)[:, None], np.arange(T)[None]
    allowed = (j >= i - 3)[None, None] & mask
    np.testing.assert_allclose(got, np_latent(params, _x(), cfg, allowed=allowed), atol=2e-5)


def test_segment_ids_equal_each_segment_alone():
    layer, params = _layer()
    ids = jnp.asarray((np.arange(T) >= 4).astype(np.int32))[None].repeat(B, 0)
    got = layer.apply(params, _x(), segment_ids=ids, positions=np.r_[np.arange(4), np.arange(7)])
    first, second = layer.apply(params, _x()[:, :4]), layer.apply(params, _x()[:, 4:])
    np.testing.assert_allclose(got, np.concatenate([first, second], 1), atol=2e-5)


def _decode(layer, params, chunks, capacity=T + 2, lengths=None):
    """Decodes ``chunks`` (slices of x) in turn; returns the outputs and the cache."""
    cache = layer.init(jax.random.key(1), jnp.zeros((B, capacity, D)), decode=True)["cache"]
    outs = []
    for i, part in enumerate(chunks):
        extra = {} if lengths is None else dict(lengths=jnp.asarray(lengths[i]))
        y, state = layer.apply({**params, "cache": cache}, _x()[:, part], decode=True,
                               mutable=["cache"], **extra)  # fmt: skip
        outs.append(y)
        cache = state["cache"]
    return outs, cache


def test_decoding_in_chunks_of_any_length_equals_the_forward_at_every_position():
    layer, params = _layer()
    outs, cache = _decode(layer, params, [slice(0, 5), slice(5, 6), slice(6, 8), slice(8, T)])
    full = layer.apply(params, _x())
    np.testing.assert_allclose(np.concatenate(outs, 1), full, atol=2e-5, rtol=2e-5)
    r, Hr = CONFIG.kv_lora_rank, CONFIG.qk_rope_head_dim
    assert cache["key"].shape == (B, T + 2, 1, r + Hr) and cache["value"].shape[-1] == 0
    assert nanoattn.linen.cache_bytes(cache)[""] == B * (T + 2) * (r + Hr) * 4 + 2 * B * 4


def test_ragged_rows_and_rewind():
    layer, params = _layer()
    # row 1 takes 3 of 5 prompt tokens, then its 4th and 5th token come one by one
    outs, cache = _decode(layer, params, [slice(0, 5)], lengths=[[5, 3]])
    assert list(cache["position"]) == [5, 3]
    full = layer.apply(params, _x()[:, :5])
    np.testing.assert_allclose(outs[0][0], full[0], atol=2e-5)
    np.testing.assert_allclose(outs[0][1, :3], full[1, :3], atol=2e-5)
    assert (np.asarray(outs[0][1, 3:]) == 0).all()
    cache = nanoattn.linen.rewind(cache, jnp.array([2, 0]))  # row 0 takes back 2 tokens
    y, _ = layer.apply({**params, "cache": cache}, _x()[:, 3:4], decode=True, mutable=["cache"])
    np.testing.assert_allclose(y[0, 0], full[0, 3], atol=2e-5)  # row 0 at position 3 again
    np.testing.assert_allclose(y[1, 0], full[1, 3], atol=2e-5)  # row 1 at position 3 anew


@pytest.mark.slow  # fast path: test_decoding_in_chunks_... (the same absorbed step) and
# tests/layers/test_rolling_cache.py (the rolling policy it goes through)
def test_rolling_cache_decodes_past_its_slots_equal_to_the_windowed_forward():
    cfg = LatentConfig(**SIZES, q_lora_rank=17, window=(3, 0), rolling_cache=True)
    layer, params = _layer(cfg)
    chunks = [slice(0, 2), slice(2, 4), slice(4, 6), slice(6, 8), slice(8, 10), slice(10, T)]
    outs, _ = _decode(layer, params, chunks, capacity=6)  # 6 slots for 11 tokens
    np.testing.assert_allclose(np.concatenate(outs, 1), layer.apply(params, _x()), atol=2e-5)


@pytest.mark.slow  # fast path: test_decoding_in_chunks_... (the same absorbed step) and
# tests/layers/test_paged_cache.py (the paged policy it goes through)
def test_paged_cache_equals_the_forward():
    cfg = LatentConfig(**SIZES, q_lora_rank=17, page_size=3)
    layer, params = _layer(cfg)
    pool = layer.init(jax.random.key(1), jnp.zeros((1, 12, D)), decode=True)["cache"]
    allocator = nanoattn.PageAllocator(pages=4, page_size=3, max_sequences=B, max_pages=2)
    outs = []
    for part in (slice(0, 5), slice(5, 6)):
        length = part.stop - part.start
        for row in range(B):
            if part.start == 0:
                allocator.allocate(row, length)
            else:
                allocator.extend(row, length)
        batch = allocator.batch([(row, length) for row in range(B)], tokens=B * length)
        x = _x()[:, part].reshape(1, B * length, D)  # token-major: row 0's tokens, then row 1's
        y, state = layer.apply({**params, "cache": pool}, x, decode=True, pages=batch,
                               mutable=["cache"])  # fmt: skip
        pool = state["cache"]
        allocator.confirm(batch)
        outs.append(np.asarray(y).reshape(B, length, D))
    full = layer.apply(params, _x()[:, :6])
    np.testing.assert_allclose(np.concatenate(outs, 1), full, atol=2e-5, rtol=2e-5)


def test_nnx_equals_linen_forward_and_decoding():
    layer, params = _layer()
    module = nanoattn.nnx.LatentAttention(CONFIG, rngs=nnx.Rngs(0))
    for name, leaves in params["params"].items():  # the same names and shapes
        for leaf, value in leaves.items():
            getattr(getattr(module, name), leaf)[...] = value
    np.testing.assert_allclose(module(_x()), layer.apply(params, _x()), atol=1e-6)
    module.init_cache(B, T)
    ys = [module(_x()[:, :4], decode=True), module(_x()[:, 4:T], decode=True)]
    np.testing.assert_allclose(np.concatenate(ys, 1), layer.apply(params, _x()), atol=2e-5)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (dict(qk_rope_head_dim=5), "qk_rope_head_dim must be even"),
        (dict(kv_lora_rank=0), "kv_lora_rank must be a positive int"),
        (dict(rolling_cache=True), "rolling_cache needs a causal window"),
        (dict(rope_layout="sideways"), "rope_layout must be 'half' or 'interleaved'"),
        (dict(index_topk=4), "index_topk needs index_n_heads too"),
        (
            dict(index_topk=4, index_n_heads=2, index_head_dim=8, q_lora_rank=None),
            "index_topk needs q_lora_rank",
        ),
        (
            dict(index_topk=4, index_n_heads=2, index_head_dim=2, q_lora_rank=8),
            "index_head_dim must be at least qk_rope_head_dim",
        ),
        (
            dict(
                index_topk=4,
                index_n_heads=2,
                index_head_dim=8,
                q_lora_rank=8,
                window=(3, 0),
                rolling_cache=True,
            ),
            "index_topk is not supported with rolling_cache",
        ),
    ],
)
def test_config_errors_name_the_argument(change, message):
    with pytest.raises(ValueError, match=message):
        LatentConfig(**(SIZES | change))


def test_scale_is_of_the_query_key_width_with_deepseeks_mscale():
    assert CONFIG.scale == pytest.approx(11**-0.5)
    yarn = dict(rope_type="yarn", factor=40.0, original_max_position_embeddings=64,
                mscale=1.0, mscale_all_dim=1.0)  # fmt: skip
    m = 0.1 * np.log(40.0) + 1
    assert LatentConfig(**SIZES, rope_scaling=yarn).scale == pytest.approx(11**-0.5 * m * m)


def test_a_paged_latent_cache_decodes_mixed_steps_equal_to_the_forward():
    """The fast case of the paged latent cache (the slow one above: eager steps):
    jitted steps of pages of 3 over a pool of NaN, row 0 a prefill of 5 then a decode
    token, row 1 a prefill of 2 then a chunk of 4, token-major and padded, equal to
    the forward."""
    layer, params = _layer()
    paged = LatentAttention(LatentConfig(**SIZES, q_lora_rank=17, page_size=3))
    shapes = jax.eval_shape(
        lambda: paged.init(jax.random.key(1), jnp.zeros((1, 15, D)), decode=True)["cache"]
    )  # a pool of 5 pages
    pool = jax.tree.map(lambda a: jnp.full(a.shape, jnp.nan if a.dtype.kind == "f" else 0,
                                          a.dtype), shapes)  # fmt: skip
    step = jax.jit(lambda pool, x, batch: paged.apply(
        {**params, "cache": pool}, x, decode=True, pages=batch, mutable=["cache"]
    ))  # fmt: skip
    allocator = nanoattn.PageAllocator(pages=5, page_size=3, max_sequences=B, max_pages=2)
    x, tokens, outs = np.asarray(_x()), 7, [[], []]
    for rows in ([(0, 0, 5), (1, 0, 2)], [(0, 5, 6), (1, 2, 6)]):  # (row, first, end)
        for row, first, end in rows:
            (allocator.extend if first else allocator.allocate)(row, end - first)
        batch = allocator.batch([(row, end - first) for row, first, end in rows], tokens=tokens)
        chunk = np.concatenate([x[row, first:end] for row, first, end in rows])
        chunk = np.pad(chunk, ((0, tokens - len(chunk)), (0, 0)))[None]
        y, state = step(pool, jnp.asarray(chunk), batch)
        pool = state["cache"]
        allocator.confirm(batch)
        at = 0
        for row, first, end in rows:
            outs[row].append(np.asarray(y[0, at : at + end - first]))
            at += end - first
        assert (np.asarray(y[0, at:]) == 0).all()  # padding rows
    full = layer.apply(params, _x())
    for row in range(B):
        np.testing.assert_allclose(np.concatenate(outs[row]), full[row, :6], atol=2e-5,
                                   rtol=2e-5)  # fmt: skip


# A quantized latent cache (LatentConfig(kv_cache_dtype=)): the same chunks decoded into
# a float and a quantized cache of the same layer, full, rolling and paged; the quantized
# cache holds exactly quantize_kv of what the float one holds (one scale a token over its
# r + Hr numbers, each token quantized once, at its own slot), the values (a slice of the
# keys) are read with the keys' scales, and the outputs stay within the quantization's
# error of the float decode's (and differ: the stored values are read).
QUANTIZED_KINDS = {
    "full": {}, "rolling": dict(window=(3, 0), rolling_cache=True), "paged": dict(page_size=3),
}  # fmt: skip
QUANTIZED_CHUNKS = ((0, 3), (3, 5), (5, 6), (6, 9), (9, T))  # within the rolling limit 3
# the largest difference from the float decode's outputs (largest output about 3):
# int8 keeps 8 bits a number, float8_e4m3fn 4 (measured 0.013 and 0.076 on this layer)
QUANTIZED_DTYPES = nanoattn._base.quantized.QUANTIZED_DTYPES
QUANTIZED_BOUND = {"int8": 0.04, "float8_e4m3fn": 0.25}


@functools.cache
def _quantized_decode(kind, kv_cache_dtype):
    """The outputs (B, T, D) of decoding x in QUANTIZED_CHUNKS through a jitted step of
    the layer with the cache kind ``kind`` and ``kv_cache_dtype``, and its last cache."""
    _, params = _layer()
    layer = LatentAttention(LatentConfig(**SIZES, q_lora_rank=17, kv_cache_dtype=kv_cache_dtype,
                                         **QUANTIZED_KINDS[kind]))  # fmt: skip
    step = jax.jit(lambda cache, x, **pages: layer.apply(
        {**params, "cache": cache}, x, decode=True, mutable=["cache"], **pages
    ))  # fmt: skip
    x = np.asarray(_x())
    if kind != "paged":
        capacity = 6 if kind == "rolling" else T + 2
        cache = layer.init(jax.random.key(1), jnp.zeros((B, capacity, D)), decode=True)["cache"]
        outs = []
        for a, b in QUANTIZED_CHUNKS:
            y, state = step(cache, jnp.asarray(x[:, a:b]))
            cache = state["cache"]
            outs.append(np.asarray(y))
        return np.concatenate(outs, 1), cache
    cache = layer.init(jax.random.key(1), jnp.zeros((1, 27, D)), decode=True)["cache"]
    allocator = nanoattn.PageAllocator(pages=9, page_size=3, max_sequences=B, max_pages=4, seed=2)
    outs = [[], []]
    for a, b in QUANTIZED_CHUNKS:  # both rows' tokens, token-major, padded to 6
        for row in range(B):
            (allocator.extend if a else allocator.allocate)(row, b - a)
        batch = allocator.batch([(row, b - a) for row in range(B)], tokens=6)
        chunk = np.pad(x[:, a:b].reshape(-1, D), ((0, 6 - B * (b - a)), (0, 0)))[None]
        y, state = step(cache, jnp.asarray(chunk), pages=batch)
        cache = state["cache"]
        allocator.confirm(batch)
        for row in range(B):
            outs[row].append(np.asarray(y[0, row * (b - a) : (row + 1) * (b - a)]))
    return np.stack([np.concatenate(rows) for rows in outs]), cache


def _assert_holds_the_quantized_float_latent_cache(quantized, float_cache, dtype):
    """Keys and their scales: exactly quantize_kv of the float cache's; values of width
    0, whose scales (never read) are zeros."""
    values, scales = nanoattn.quantize_kv(float_cache["key"], dtype)
    assert quantized["key"].dtype == jnp.dtype(dtype)
    np.testing.assert_array_equal(np.asarray(quantized["key"], np.float32),
                                  np.asarray(values, np.float32))  # fmt: skip
    np.testing.assert_array_equal(quantized["key_scales"], scales)
    assert quantized["value"].shape[-1] == 0 and not np.asarray(quantized["value_scales"]).any()


@pytest.mark.parametrize(
    "kind, dtype",
    [
        # float8 on the rolling and paged caches in make test-all; its fast path: the
        # full cache here (the same store and read), and the int8 cases of every kind
        pytest.param(kind, dtype, marks=[pytest.mark.slow] * (dtype != "int8" and kind != "full"))
        for dtype in QUANTIZED_DTYPES
        for kind in QUANTIZED_KINDS
    ],
)
def test_a_quantized_latent_cache_holds_each_token_quantized_once(kind, dtype):
    y_float, float_cache = _quantized_decode(kind, None)
    y, cache = _quantized_decode(kind, dtype)
    assert sorted(cache) == ["key", "key_scales", "last", "position", "value", "value_scales"]
    _assert_holds_the_quantized_float_latent_cache(cache, float_cache, dtype)
    error = np.abs(y - y_float).max()
    assert 1e-5 < error <= QUANTIZED_BOUND[dtype], error
    if kind == "full":  # the float decode is the forward's, as the tests above hold
        layer, params = _layer()
        np.testing.assert_allclose(y_float, layer.apply(params, _x()), atol=2e-5, rtol=2e-5)


def test_a_quantized_nnx_latent_cache_holds_each_token_quantized_once():
    decoded = {}
    for dtype in (None, "int8"):
        module = nanoattn.nnx.LatentAttention(
            LatentConfig(**SIZES, q_lora_rank=17, kv_cache_dtype=dtype), rngs=nnx.Rngs(3)
        )
        module.init_cache(B, T)
        ys = [np.asarray(module(_x()[:, a:b], decode=True)) for a, b in QUANTIZED_CHUNKS]
        decoded[dtype] = (np.concatenate(ys, 1), module.cache.get()._asdict())
    (y_float, float_cache), (y, cache) = decoded[None], decoded["int8"]
    _assert_holds_the_quantized_float_latent_cache(cache, float_cache, "int8")
    assert 1e-5 < np.abs(y - y_float).max() <= QUANTIZED_BOUND["int8"]


def test_a_quantized_latent_cache_s_bytes_and_its_config_error():
    _, cache = _quantized_decode("full", "int8")
    r, Hr, C = CONFIG.kv_lora_rank, CONFIG.qk_rope_head_dim, T + 2
    # int8 keys, a float32 scale a token for the keys and one for the width-0 values
    assert nanoattn.linen.cache_bytes(cache)[""] == B * C * (r + Hr) + 2 * B * C * 4 + 8 * B
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of") as error:
        LatentConfig(**SIZES, kv_cache_dtype="int4")
    assert "\n" not in str(error.value)


def test_an_indexed_int8_cache_selecting_every_key_decodes_as_plain_mla():
    """DeepSeek-V3.2's indexer over an int8 latent cache (its keys quantized in the
    value slots with their own scales): keeping k >= T keys decodes exactly as the same
    parameters without an indexer through a full cache; a smaller k changes the outputs."""
    v32 = dataclasses.replace(CONFIG, index_n_heads=2, index_head_dim=6, index_topk=T,
                              kv_cache_dtype="int8")  # fmt: skip
    layer, params = _layer(v32)
    plain = {"params": {k: v for k, v in params["params"].items() if not k.startswith("index")}}
    chunks = [slice(0, 6), slice(6, T)]
    want, _ = _decode(
        LatentAttention(
            dataclasses.replace(v32, index_topk=None, index_n_heads=None, index_head_dim=None)
        ),
        plain,
        chunks,
    )
    got, cache = _decode(layer, params, chunks)
    assert cache["value"].dtype == jnp.int8 and cache["value"].shape[-1] == 6
    np.testing.assert_allclose(np.concatenate(got, 1), np.concatenate(want, 1), atol=1e-6)
    few, _ = _decode(LatentAttention(dataclasses.replace(v32, index_topk=2)), params, chunks)
    assert np.abs(np.concatenate(few, 1) - np.concatenate(want, 1)).max() > 1e-3
