"""nanoattn.quantize_kv and dequantize_kv: the round-trip bound per element, zero rows,
NaN and inf rows, the largest finite inputs, shapes, and the one-line errors."""

import jax.numpy as jnp
import numpy as np
import pytest

import nanoattn
from nanoattn._core.base.quantized import QUANTIZED_DTYPES

from _reference import randn

S, K, H = 7, 3, 5  # primes: a swapped axis changes the scales' shape


def test_int8_round_trip_within_half_a_step_per_element():
    x = randn(0, 2, S, K, H) * np.float32(3.0)
    values, scales = nanoattn.quantize_kv(x)
    assert values.dtype == jnp.int8 and scales.dtype == jnp.float32
    assert values.shape == (2, S, K, H) and scales.shape == (2, S, K)
    s = np.asarray(scales, np.float64)
    np.testing.assert_allclose(s, np.abs(x).max(-1) / 127, rtol=1e-6)
    back = np.asarray(nanoattn.dequantize_kv(values, scales), np.float64)
    error = np.abs(x.astype(np.float64) - back)
    assert np.all(error <= s[..., None] / 2 * (1 + 1e-5))
    assert np.abs(np.asarray(values)).max() == 127  # each row's maximum maps to 127


@pytest.mark.skipif("float8_e4m3fn" not in QUANTIZED_DTYPES, reason="no float8 in jax")
def test_float8_round_trip_within_the_format_s_relative_step():
    x = randn(1, S, K, H)
    values, scales = nanoattn.quantize_kv(x, "float8_e4m3fn")
    assert values.dtype == jnp.float8_e4m3fn
    np.testing.assert_allclose(np.asarray(scales), np.abs(x).max(-1) / 448, rtol=1e-6)
    back = np.asarray(nanoattn.dequantize_kv(values, scales), np.float64)
    # 3 mantissa bits: half a step is 2**-4 of the value; subnormals step 2**-9 * scale
    bound = np.abs(x) * 2.0**-4 + np.asarray(scales)[..., None] * 2.0**-9
    assert np.all(np.abs(x - back) <= bound * (1 + 1e-5))


@pytest.mark.parametrize("dtype", QUANTIZED_DTYPES)
def test_a_zero_row_has_scale_zero_and_decodes_to_exact_zeros(dtype):
    x = randn(2, S, K, H)
    x[3, 1] = 0
    values, scales = nanoattn.quantize_kv(x, dtype)
    assert float(scales[3, 1]) == 0.0
    back = np.asarray(nanoattn.dequantize_kv(values, scales))
    assert np.all(back[3, 1] == 0) and not np.any(np.isnan(back))


@pytest.mark.parametrize("dtype", QUANTIZED_DTYPES)
def test_nan_or_inf_in_a_row_makes_that_row_s_scale_nan_and_no_other(dtype):
    x = randn(3, S, K, H)
    x[2, 0, 4] = np.nan
    x[5, 2, 1] = -np.inf
    values, scales = nanoattn.quantize_kv(x, dtype)
    bad = np.isnan(np.asarray(scales))
    expected = np.zeros((S, K), bool)
    expected[2, 0] = expected[5, 2] = True
    np.testing.assert_array_equal(bad, expected)
    back = np.asarray(nanoattn.dequantize_kv(values, scales))
    assert np.all(np.isnan(back[2, 0])) and np.all(np.isnan(back[5, 2]))
    assert np.all(np.isfinite(back[~expected]))


@pytest.mark.parametrize("dtype", QUANTIZED_DTYPES)
def test_the_largest_finite_inputs_decode_to_finite_values(dtype):
    big = np.finfo(np.float32).max
    x = np.array([[[big, -big, 1.0], [big / 3, 0.0, -big]]], np.float32)  # (1, 2, 3)
    values, scales = nanoattn.quantize_kv(x[None], dtype)
    back = np.asarray(nanoattn.dequantize_kv(values, scales))
    assert np.all(np.isfinite(back))
    np.testing.assert_allclose(back[0, 0, :, :2].ravel(), x[0, :, :2].ravel(), rtol=0.07)


def test_bfloat16_inputs_are_quantized_from_their_float32_values():
    x = randn(4, S, K, H)
    low = jnp.asarray(x, jnp.bfloat16)
    v_low, s_low = nanoattn.quantize_kv(low)
    v_wide, s_wide = nanoattn.quantize_kv(jnp.asarray(low, jnp.float32))
    np.testing.assert_array_equal(np.asarray(v_low), np.asarray(v_wide))
    np.testing.assert_array_equal(np.asarray(s_low), np.asarray(s_wide))


def test_dequantize_gives_the_dtype_asked_for():
    values, scales = nanoattn.quantize_kv(randn(5, S, K, H))
    assert nanoattn.dequantize_kv(values, scales, jnp.bfloat16).dtype == jnp.bfloat16


def _values():
    return nanoattn.quantize_kv(randn(0, S, K, H))[0]


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: nanoattn.quantize_kv(randn(0, S, K, H), "int4"), "dtype must be one of"),
        (lambda: nanoattn.quantize_kv(randn(0, K, H)), r"x must have shape \(\.\.\., S, K, H\)"),
        (
            lambda: nanoattn.dequantize_kv(_values(), np.ones((S, H), np.float32)),
            r"scales must have shape \(\.\.\., S, K\)",
        ),
        (
            lambda: nanoattn.dequantize_kv(randn(0, S, K, H), np.ones((S, K), np.float32)),
            "values must be one of",
        ),
    ],
)
def test_bad_arguments_raise_one_line_errors_naming_them(call, message):
    with pytest.raises(ValueError, match=message) as error:
        call()
    assert "\n" not in str(error.value)
