"""Attention over quantized keys and values (key_scales, value_scales) on every backend
that serves it, against the float64 reference applied to the dequantized values (the
arithmetic every kernel must do): GQA, causality with an offset, a window, sinks, key
lengths, blocks of queries, the paged call; a NaN scale visible where its token is seen
and never read where it is not (a NaN value scale on a later token of a paged chunk:
the rows that never see it finite); the native kernel reading the stored int8 arrays;
refusals, one-line errors, and gradients (the reference's; flash's and native's clear
error)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import nanoattn
from nanoattn._backends import registry
from nanoattn._backends.interface import unserved
from nanoattn._base.quantized import QUANTIZED_DTYPES
from nanoattn._base.rules import Rules

from _backends import each_backend, require, require_paged, serving
from _reference import np_attention, np_causal, np_lengths, np_window, randn

B, T, S, N, K, H = 2, 5, 11, 6, 2, 7  # G = 3
OFFSET = S - T
LENGTHS = np.array([S, 8], np.int32)
SINKS = np.linspace(-1.0, 1.0, N).astype(np.float32)


def _np_dequantized(values, scales):
    """Dequantized in float64 numpy, without the library's code."""
    return np.asarray(values).astype(np.float64) * np.asarray(scales, np.float64)[..., None]


def _quantized(seed, dtype, shape=(B, S, K, H)):
    values, scales = nanoattn.quantize_kv(randn(seed, *shape) * np.float32(2.0), dtype)
    return values, np.asarray(scales)


CASES = {
    "causal": (dict(is_causal=True, q_offset=OFFSET), lambda: np_causal(T, S, OFFSET)),
    "window": (dict(is_causal=True, q_offset=OFFSET, window=(3, 0)),
               lambda: np_window(T, S, OFFSET, 3, 0)),
    "lengths_sinks": (dict(is_causal=True, q_offset=OFFSET, kv_lengths=LENGTHS, sinks=SINKS),
                      lambda: np_causal(T, S, OFFSET) & np_lengths(LENGTHS, S)),
}  # fmt: skip


@each_backend()
@pytest.mark.parametrize("dtype", QUANTIZED_DTYPES)
@pytest.mark.parametrize("case", CASES)
def test_output_is_the_reference_s_on_the_dequantized_keys_and_values(implementation, dtype,
                                                                     case):  # fmt: skip
    rules, allowed = CASES[case]
    q = randn(0, B, T, N, H)
    (kq, ks), (vq, vs) = _quantized(1, dtype), _quantized(2, dtype)
    scales = dict(key_scales=ks, value_scales=vs)
    require(implementation, q, kq, vq, **rules, **scales)
    out = nanoattn.dot_product_attention(q, kq, vq, **rules, **scales,
                                         implementation=implementation)  # fmt: skip
    assert out.dtype == q.dtype
    expected = np_attention(q, _np_dequantized(kq, ks), _np_dequantized(vq, vs),
                            allowed=allowed(), sinks=rules.get("sinks"))  # fmt: skip
    np.testing.assert_allclose(np.asarray(out), expected, atol=2e-5, rtol=2e-5)


@each_backend()
def test_blocks_of_queries_read_quantized_keys_like_a_decode_step(implementation):
    """A prefill chunk (T = 19, whole blocks of query rows on the blockwise kernels) over
    int8 keys, in bfloat16: the queries' blocks, not only a decode step's rows."""
    t, s = 19, 23
    q = jnp.asarray(randn(9, B, t, N, H), jnp.bfloat16)
    (kq, ks), (vq, vs) = _quantized(10, "int8", (B, s, K, H)), _quantized(11, "int8", (B, s, K, H))
    rules = dict(is_causal=True, q_offset=s - t, key_scales=ks, value_scales=vs)
    require(implementation, q, kq, vq, **rules)
    out = nanoattn.dot_product_attention(q, kq, vq, **rules, implementation=implementation)
    assert out.dtype == jnp.bfloat16
    expected = np_attention(np.asarray(q, np.float64), _np_dequantized(kq, ks),
                            _np_dequantized(vq, vs), allowed=np_causal(t, s, s - t))  # fmt: skip
    np.testing.assert_allclose(np.asarray(out, np.float64), expected, atol=1e-2, rtol=1e-2)


def test_native_reads_the_stored_int8_keys_without_a_float_copy():
    """The native kernel takes the int8 arrays themselves: its call's operands are int8
    and nothing converts the cache to float before it (dense, a dense decoding step
    read in place by the paged pass, and paged)."""
    q = jnp.asarray(randn(0, B, T, N, H))
    long_q = jnp.asarray(randn(0, B, 17, N, H))  # more rows than a decoding step (16)
    (kq, ks), (vq, vs) = _quantized(1, "int8"), _quantized(2, "int8")
    rules = dict(is_causal=True, key_scales=ks, value_scales=vs)
    require("native", q, kq, vq, q_offset=OFFSET, **rules)
    table, lengths, starts = np.array([[0, 1, 2, 3]], np.int32), np.array([11]), np.array([0, 5])
    pages = [nanoattn.quantize_kv(randn(seed, 4, 3, K, H)) for seed in (3, 4)]
    calls = [
        ("nanoattn_forward_quantized", long_q, lambda q: nanoattn.dot_product_attention(
            q, kq, vq, q_offset=0, **rules, implementation="native")),
        ("nanoattn_paged_forward_quantized", q, lambda q: nanoattn.dot_product_attention(
            q, kq, vq, q_offset=OFFSET, **rules, implementation="native")),
        ("nanoattn_paged_forward_quantized", q[0], lambda q: nanoattn.paged_attention(
            q, pages[0][0], pages[1][0], table, lengths, starts, key_scales=pages[0][1],
            value_scales=pages[1][1], implementation="native")),
    ]  # fmt: skip
    for target, x, call in calls:
        text = jax.jit(call).lower(x).as_text()
        line = next(x for x in text.splitlines() if target in x)
        assert line.count("xi8>") >= 2, line  # keys and values as stored
        assert "xi8>) -> tensor" not in text.replace(line, ""), "a convert of the cache"


@pytest.mark.skipif("float8_e4m3fn" not in QUANTIZED_DTYPES, reason="no float8 in this jax")
@each_backend()
def test_every_float8_code_is_read_exactly(implementation):
    """A single key whose value row holds all 256 float8_e4m3fn codes (subnormals, both
    zeros, the largest, the two NaN): the output is that row, each code's exact value
    (NaN where the code is NaN), dense and paged, so every code is widened right."""
    codes = np.arange(256, dtype=np.uint8).view(jnp.float8_e4m3fn)
    value = jnp.asarray(codes).reshape(1, 1, 1, 256)
    key, ones = jnp.zeros_like(value), jnp.ones((1, 1, 1), jnp.float32)
    q = jnp.ones((1, 1, 1, 256), jnp.float32)
    scales = dict(key_scales=ones, value_scales=ones)
    require(implementation, q, key, value, **scales)
    want = np.asarray(codes, np.float32)
    dense = nanoattn.dot_product_attention(q, key, value, **scales, implementation=implementation)
    args = (np.zeros((1, 1), np.int32), np.array([1]), np.array([0, 1]))
    paged = nanoattn.paged_attention(
        q[0], key, value, *args, **scales, implementation=implementation
    )  # one page of one slot
    for got in (dense, paged):
        np.testing.assert_array_equal(np.asarray(got).reshape(256), want)


@each_backend()
def test_a_nan_scale_is_visible_where_its_token_is_seen_and_never_read_past_the_lengths(
    implementation,
):
    q = randn(3, B, T, N, H)
    (kq, ks), (vq, vs) = _quantized(4, "int8"), _quantized(5, "int8")
    vs = vs.copy()
    vs[0, 2, 1] = np.nan  # row 0, token 2, kv head 1: query heads 3, 4, 5 see it
    ks = ks.copy()
    ks[1, 9, 0] = np.nan  # row 1, token 9: past its length 8, never read
    rules = dict(is_causal=True, q_offset=OFFSET, kv_lengths=LENGTHS,
                 key_scales=ks, value_scales=vs)  # fmt: skip
    require(implementation, q, kq, vq, **rules)
    out = np.asarray(nanoattn.dot_product_attention(q, kq, vq, **rules,
                                                    implementation=implementation))  # fmt: skip
    assert np.all(np.isnan(out[0, :, 3:]))
    assert np.all(np.isfinite(out[0, :, :3])) and np.all(np.isfinite(out[1]))


P, PAGE = 7, 3  # pool pages, keys per page


@each_backend()
@pytest.mark.parametrize("dtype", QUANTIZED_DTYPES)
def test_paged_output_is_the_reference_s_on_the_dequantized_pages(implementation, dtype):
    table = np.array([[4, 0, 6], [2, 5, 1]], np.int32)  # shuffled pages, page 3 spare
    lengths, starts = np.array([8, 4], np.int32), np.array([0, 3, 4], np.int32)
    (kq, ks), (vq, vs) = (
        _quantized(6, dtype, (P, PAGE, K, H)),
        _quantized(7, dtype, (P, PAGE, K, H)),
    )
    ks, vs = ks.copy(), vs.copy()
    ks[3], vs[3] = np.nan, np.nan  # a page no sequence holds
    ks[1, 2] = np.nan  # sequence 1's key 8: past its 4 keys
    q = randn(8, 5, N, H)  # row 4 is padding
    try:
        out = nanoattn.paged_attention(q, kq, vq, table, lengths, starts, key_scales=ks,
                                       value_scales=vs, implementation=implementation)  # fmt: skip
    except ValueError as error:
        if "cannot serve this call" not in str(error):
            raise
        pytest.skip(str(error))
    keys, values = _np_dequantized(kq, ks), _np_dequantized(vq, vs)
    expected = np.zeros((5, N, H))
    for b in range(2):
        rows = slice(starts[b], starts[b + 1])
        n = starts[b + 1] - starts[b]
        k = keys[table[b]].reshape(-1, K, H)[: lengths[b]][None]
        v = values[table[b]].reshape(-1, K, H)[: lengths[b]][None]
        allowed = np_causal(n, lengths[b], lengths[b] - n)
        expected[rows] = np_attention(q[rows][None], k, v, allowed=allowed)[0]
    np.testing.assert_allclose(np.asarray(out), expected, atol=2e-5, rtol=2e-5)


# A NaN value scale on a later token of a prefill chunk (a zero weight times a NaN
# scale is NaN): sequence 0 brings 40 tokens at positions 3 .. 42 (more rows than one
# task of the native kernel takes, keys in two of its tiles); its token at position 37,
# key/value head 1, has a NaN value scale. Sequence 1 brings one decode token.
PS_NAN, P_NAN, K_NAN, N_NAN = 5, 11, 3, 6  # G = 2
NAN_AT = 37


@each_backend()
@pytest.mark.parametrize("dtype", QUANTIZED_DTYPES)
@pytest.mark.parametrize("window", [None, (4, 0)], ids=["causal", "window"])
def test_a_nan_value_scale_leaves_the_paged_rows_that_never_see_its_token_finite(
    implementation, dtype, window
):
    """The rows of the chunk before the token (causal), or past the window, never see
    it: finite, and equal to the call whose scale is clean; the rows that see it are NaN
    in the heads of its group; the other heads and sequence 1 are untouched."""
    table = np.array([[7, 2, 9, 0, 5, 10, 3, 8, 1], [4, 6, -1, -1, -1, -1, -1, -1, -1]],
                     np.int32)  # fmt: skip
    lengths, starts = np.array([43, 7], np.int32), np.array([0, 40, 41], np.int32)
    shape = (P_NAN, PS_NAN, K_NAN, H)
    (kq, ks), (vq, vs) = _quantized(12, dtype, shape), _quantized(13, dtype, shape)
    q = randn(14, 41, N_NAN, H)
    arrays = (q, kq, vq, table, lengths, starts)
    rules = dict(key_scales=ks, window=window)
    require_paged(implementation, *arrays, value_scales=vs, **rules)
    dirty = vs.copy()
    dirty[table[0, NAN_AT // PS_NAN], NAN_AT % PS_NAN, 1] = np.nan
    call = functools.partial(nanoattn.paged_attention, **rules, implementation=implementation)
    clean, got = (np.asarray(call(*arrays, value_scales=scales)) for scales in (vs, dirty))
    positions = np.arange(3, 43)
    reach = positions >= NAN_AT
    if window is not None:
        reach &= positions - NAN_AT <= window[0]
    sees = np.zeros(got.shape[:2], bool)  # (Tq, N)
    sees[:40][reach] = np.arange(N_NAN) // (N_NAN // K_NAN) == 1
    assert reach.any() and reach[NAN_AT - 3 :].all() == (window is None)  # 42 is past (4, 0)
    assert np.isnan(got[sees]).all()
    assert not np.isnan(got[~sees]).any()
    np.testing.assert_array_equal(got[~sees], clean[~sees])


def test_backends_that_do_not_serve_a_quantized_cache_say_so():
    q = randn(0, B, T, N, H)
    (kq, ks), (vq, vs) = _quantized(1, "int8"), _quantized(2, "int8")
    rules = Rules.make(jnp.asarray(q), kq, vq, key_scales=ks, value_scales=vs)
    assert "kv_scales" in rules.active()
    serve = [name for name in registry.names() if "kv_scales" in registry.get(name).serves]
    for name in registry.names():
        reason = unserved(registry.get(name), rules)
        if name in serve:
            assert reason is None
        else:  # the refusal names the rule and every backend that serves it
            assert "key_scales" in reason and all(repr(n) in reason for n in serve), reason


def test_the_reference_differentiates_the_query_and_the_kernels_raise_a_clear_error():
    q = jnp.asarray(randn(0, B, T, N, H))
    (kq, ks), (vq, vs) = _quantized(1, "int8"), _quantized(2, "int8")
    k, v = nanoattn.dequantize_kv(kq, ks), nanoattn.dequantize_kv(vq, vs)

    def loss(q, implementation, quantized):
        keys = (kq, vq) if quantized else (k, v)
        scales = dict(key_scales=ks, value_scales=vs) if quantized else {}
        out = nanoattn.dot_product_attention(q, *keys, is_causal=True, q_offset=OFFSET,
                                             implementation=implementation, **scales)  # fmt: skip
        return jnp.sum(out * jnp.arange(H).reshape(1, 1, 1, H))

    got = jax.grad(loss)(q, "xla", True)  # the reference
    np.testing.assert_allclose(got, jax.grad(loss)(q, "xla", False), atol=1e-6)
    # every other backend that serves quantized keys and values: its forward pass only
    kernels = [n for n in serving(q, kq, vq, key_scales=ks, value_scales=vs) if n != "xla"]
    assert kernels
    for implementation in kernels:
        with pytest.raises(ValueError, match="gradients through quantized keys and values"):
            jax.grad(loss)(q, implementation, True)


def _bad(**changes):
    q = randn(0, B, T, N, H)
    (kq, ks), (vq, vs) = _quantized(1, "int8"), _quantized(2, "int8")
    arguments = dict(key=kq, value=vq, key_scales=ks, value_scales=vs) | changes
    return lambda: nanoattn.dot_product_attention(q, **arguments, is_causal=True,
                                                  q_offset=OFFSET)  # fmt: skip


@pytest.mark.parametrize(
    "call, message",
    [
        (_bad(value_scales=None), "value_scales is missing"),
        (_bad(key_scales=None, value_scales=None), "key of dtype int8 is quantized"),
        (_bad(key=randn(1, B, S, K, H)), "key must be of a quantized dtype"),
        (_bad(key_scales=np.ones((B, S, N), np.float32)),
         r"key_scales must have shape \(B, S, K\) = \(2, 11, 2\)"),
    ],
)  # fmt: skip
def test_bad_scales_raise_one_line_errors_naming_the_argument(call, message):
    with pytest.raises(ValueError, match=message) as error:
        call()
    assert "\n" not in str(error.value)
