"""nanoattn.quantize_kv and dequantize_kv: the round-trip bound per element, zero rows,
NaN and inf rows, the largest finite inputs, shapes, and the one-line errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import nanoattn
from nanoattn._base.quantized import QUANTIZED_DTYPES

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


# quantize_kv is not differentiable: jax asking for its derivative gets the library's
# one-line refusal, in reverse and forward mode, under jit and outside it.
_SUM_OF_SCALES = lambda x: nanoattn.quantize_kv(x)[1].sum()  # noqa: E731


@pytest.mark.parametrize(
    "differentiate",
    [
        jax.grad(_SUM_OF_SCALES),
        jax.jit(jax.grad(_SUM_OF_SCALES)),
        jax.grad(jax.jit(_SUM_OF_SCALES)),
        lambda x: jax.jvp(_SUM_OF_SCALES, (x,), (x,)),
    ],
    ids=["grad", "jit(grad)", "grad(jit)", "jvp"],
)
def test_differentiating_quantize_kv_raises_one_line_naming_what_to_do(differentiate):
    with pytest.raises(ValueError, match="quantize_kv is not differentiable") as error:
        differentiate(jnp.asarray(randn(6, S, K, H)))
    assert "\n" not in str(error.value) and "float cache" in str(error.value)


def test_quantize_kv_of_an_input_not_differentiated_still_runs_under_grad():
    """Only a derivative through quantize_kv is refused: a function that quantizes a
    constant (or a stop_gradient) differentiates its other inputs."""
    x = jnp.asarray(randn(7, S, K, H))

    def loss(w):
        values, scales = nanoattn.quantize_kv(jax.lax.stop_gradient(x * w))
        return jnp.sum(nanoattn.dequantize_kv(values, scales) * w)

    got = jax.grad(loss)(jnp.float32(2.0))
    values, scales = nanoattn.quantize_kv(x * 2)
    np.testing.assert_allclose(got, np.sum(nanoattn.dequantize_kv(values, scales)), rtol=1e-6)


# The largest inputs: the scale of a row whose largest magnitude is near float32's
# maximum is stepped down where L * scale would round past float32's range, so every
# such row decodes finite. XLA on CPU divides a vector by L through a reciprocal that
# rounds float32 max / 127 one ulp low, and a lone row exactly; float64 inputs divide
# exactly; so each value is quantized alone and all together, float32 and float64.
_F32_MAX = np.finfo(np.float32).max
_TOP_F32 = (np.float32(_F32_MAX).view(np.uint32) - np.arange(64, dtype=np.uint32)).view(np.float32)


def _assert_big_rows_decode_finite_within_the_error(top, dtype, batched):
    """Rows (v, -v / 3, 1) for each v of ``top`` (float32 or float64, each within
    float32's range): every decode finite in float32, within the quantization error."""
    rows = np.stack([top, -top / 3, np.ones_like(top)], axis=-1)[:, None, None]  # (n, 1, 1, 3)
    if batched:
        values, scales = nanoattn.quantize_kv(rows, dtype)
        back = np.asarray(nanoattn.dequantize_kv(values, scales))
        s = np.asarray(scales, np.float64)
    else:
        decoded = [nanoattn.quantize_kv(row, dtype) for row in rows]
        back = np.stack([np.asarray(nanoattn.dequantize_kv(*pair)) for pair in decoded])
        s = np.stack([np.asarray(pair[1], np.float64) for pair in decoded])
    assert np.all(np.isfinite(back)), np.argwhere(~np.isfinite(back))[:3]
    x, back = rows.astype(np.float64), back.astype(np.float64)
    if dtype == "int8":
        bound = s[..., None] / 2
    else:  # 3 mantissa bits: half a step is 2**-4 of the value; subnormals 2**-9 * scale
        bound = np.abs(x) * 2.0**-4 + s[..., None] * 2.0**-9
    assert np.all(np.abs(x - back) <= bound * (1 + 1e-5))


@pytest.mark.parametrize("batched", [False, True], ids=["alone", "together"])
@pytest.mark.parametrize("dtype", QUANTIZED_DTYPES)
def test_the_64_largest_float32_values_decode_finite_within_the_error(dtype, batched):
    _assert_big_rows_decode_finite_within_the_error(_TOP_F32, dtype, batched)


@pytest.mark.parametrize("batched", [False, True], ids=["alone", "together"])
@pytest.mark.parametrize("dtype", QUANTIZED_DTYPES)
def test_float64_values_up_to_float32_max_decode_finite_within_the_error(dtype, batched, x64):
    """Under x64, float64 inputs divide by L in float64 and round once to the float32
    scale: float32 max / 127 then rounds up, past what 127 * scale can hold. The top
    float32 values as float64, and float64 values between them (steps of 2**99, a
    fifth of float32's top ulp, 2**104)."""
    between = np.float64(_F32_MAX) - np.arange(64) * 2.0**99
    top = np.concatenate([_TOP_F32.astype(np.float64), between])
    _assert_big_rows_decode_finite_within_the_error(top, dtype, batched)


@pytest.mark.parametrize("dtype", QUANTIZED_DTYPES)
def test_a_float64_row_past_float32_s_range_decodes_to_nan_never_finite(dtype, x64):
    """A float64 magnitude whose scale (absmax / L) passes float32's range gets a NaN
    scale, as a row holding inf: decoded (in float32 or float64), it is NaN, never the
    finite 127 * float32 max of a clipped row. One just past float32's max keeps its
    scale: its largest element decodes to inf in float32, its own value in float64."""
    x = np.array([[[1e300, 1.0, -2.0], [1.0, 2.0, 3.0]], [[-1e39, 1e38, 0.0], [0, 0, 0]]])
    values, scales = nanoattn.quantize_kv(x, dtype)  # (2, 2, 3): S = 2, K = 2
    s = np.asarray(scales)
    assert np.isnan(s[0, 0]) and np.all(np.isfinite(s[[0, 1, 1], [1, 0, 1]]))
    for wide in (jnp.float32, jnp.float64):
        back = np.asarray(nanoattn.dequantize_kv(values, scales, wide))
        assert np.all(np.isnan(back[0, 0])) and np.all(np.isfinite(back[0, 1]))
    back = np.asarray(nanoattn.dequantize_kv(values, scales, jnp.float64))
    np.testing.assert_allclose(back[1, 0, :2], x[1, 0, :2], rtol=0.07)
    assert np.isinf(np.asarray(nanoattn.dequantize_kv(values, scales))[1, 0, 0])
