"""``quantize_kv`` and ``dequantize_kv``: keys or values as int8 (or float8_e4m3fn)
with a float32 scale per token and key/value head (docs/conventions.md, "Quantized
keys and values")."""

import functools

import jax
import jax.numpy as jnp

from .._base.quantized import LIMITS, check_storage, dequantize
from .._base.validate import as_array, expect_floating, expect_shape, float_dtype

# Why jax cannot differentiate quantize_kv (its rounding is piecewise constant), and
# what to do instead: raised when jax differentiates it (forward or reverse, under jit).
NOT_DIFFERENTIABLE = (
    "quantize_kv is not differentiable (its rounding has no useful gradient): train with a "
    "float cache (kv_cache_dtype=None), or apply jax.lax.stop_gradient to its input"
)


def quantize_kv(x, dtype="int8"):
    r"""Symmetric quantization per token and key/value head.

    .. math::

       \mathrm{scale}_{\dots sk} = \max_h |x_{\dots skh}| / L, \qquad
       q_{\dots skh} = \mathrm{round}(x_{\dots skh} / \mathrm{scale}_{\dots sk})

    with ``L = 127`` for int8 (rounded to nearest, clipped to [-127, 127]) and ``L =
    448`` for float8_e4m3fn (rounded by the cast), so that ``x ≈ q * scale[..., None]``
    and, for int8, ``|x - q * scale| <= scale / 2`` per element. A row of zeros (or of
    width H = 0) gets scale 0 and decodes to exact zeros; a row holding NaN or inf, or
    (a float64 input) a magnitude so large that its scale passes float32's range, gets a
    NaN scale (it decodes to NaN: visible, never a silent finite value). Inputs within
    float32's range, the largest included, decode to finite float32 values (``L *
    scale`` never rounds past the float32 range).

    Not differentiable: jax differentiating it (``jax.grad``, ``jax.jvp``, under
    ``jit`` too, as through a decoding step of a layer with ``kv_cache_dtype``) raises
    a one-line ValueError saying what to do instead.

    Args:
      x: floating (..., S, K, H): keys or values.
      dtype: ``"int8"`` or ``"float8_e4m3fn"`` (where ``jnp.float8_e4m3fn`` exists).

    Returns:
      ``(values, scales)``: values (..., S, K, H) of ``dtype``, scales (..., S, K)
      float32.

    Example:
      >>> import jax.numpy as jnp, nanoattn
      >>> q, s = nanoattn.quantize_kv(jnp.array([[[1.0, -2.0, 0.5]]]))
      >>> q.tolist(), s.tolist()
      ([[[64, -127, 32]]], [[0.015748031437397003]])
    """
    name = check_storage("dtype", dtype)
    x = as_array("x", x, "a float array (..., S, K, H)")
    expect_floating("x", x.dtype)
    if x.ndim < 3:
        raise ValueError(f"x must have shape (..., S, K, H), got {x.shape}")
    return _quantize(x, name)


@functools.partial(jax.custom_jvp, nondiff_argnums=(1,))
def _quantize(x, name: str):
    """:func:`quantize_kv` of a checked floating ``x`` into the storage dtype ``name``."""
    wide = jnp.promote_types(x.dtype, jnp.float32)
    x = x.astype(wide)
    limit = LIMITS[name]
    absmax = jnp.max(jnp.abs(x), axis=-1, initial=0)  # (..., S, K): NaN or inf for a bad row
    scales = (absmax / limit).astype(jnp.float32)  # inf past float32's range (float64 x)
    finite = jnp.isfinite(scales)
    # The largest inputs: limit * scale could round past float32's range on decoding.
    scales = jnp.where(jnp.isfinite(scales * limit), scales, jnp.nextafter(scales, 0))
    scales = jnp.where(finite, scales, jnp.nan)
    divisor = jnp.where(finite & (scales > 0), scales, 1).astype(wide)[..., None]
    scaled = jnp.clip(x / divisor, -limit, limit)
    scaled = jnp.where(finite[..., None], scaled, 0)  # a bad row's values: its scale is NaN
    if name == "int8":
        values = jnp.round(scaled).astype(jnp.int8)
    else:
        values = scaled.astype(jnp.dtype(name))
    return values, scales


@_quantize.defjvp
def _quantize_jvp(name, primals, tangents):
    """Raises: jax asks for a derivative of quantize_kv (NOT_DIFFERENTIABLE)."""
    raise ValueError(NOT_DIFFERENTIABLE)


def dequantize_kv(values, scales, dtype=jnp.float32):
    """The inverse of :func:`quantize_kv`: ``values * scales[..., None]`` in ``dtype``.

    Args:
      values: (..., S, K, H) of a quantized dtype (int8, float8_e4m3fn).
      scales: float (..., S, K).
      dtype: the floating dtype of the result (the product is formed in it).

    Returns:
      (..., S, K, H) of ``dtype``; NaN in a token whose scale is NaN.
    """
    values = as_array("values", values, "an array (..., S, K, H)")
    check_storage("values", values.dtype)
    scales = as_array("scales", scales, "a float array (..., S, K)")
    expect_floating("scales", scales.dtype)
    expect_shape("scales", scales.shape, "... S K", values.shape[:-1])
    return dequantize(values, scales, float_dtype("dtype", dtype))
