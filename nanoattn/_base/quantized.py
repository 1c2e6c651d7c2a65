"""Quantized keys and values: the storage dtypes, their scales, and the one
dequantization every kernel does.

A quantized key (or value) array holds ``q`` of a storage dtype (int8, or float8_e4m3fn
where jax has it) and a float scale per token and key/value head, so that the key it
stands for is ``k[..., s, k, h] = q[..., s, k, h] * scale[..., s, k]`` (symmetric, no
zero point). A kernel reads ``q`` and multiplies by the scales in at least float32 as it
reads each block (:func:`dequantize`); the reference dequantizes the whole array first,
and both are the same arithmetic. A NaN scale (a row that held NaN or inf when it was
quantized) makes that token NaN, visible where it is seen and never read where it is
not (docs/conventions.md, "Quantized keys and values").
"""

import jax.numpy as jnp
import numpy as np

from .validate import as_array, expect_floating, expect_shape

# The storage dtypes and the largest magnitude each holds: a row's absolute maximum
# maps to it (int8 keeps -128 unused, so the range is symmetric).
LIMITS = {"int8": 127.0}
if hasattr(jnp, "float8_e4m3fn"):
    LIMITS["float8_e4m3fn"] = 448.0
QUANTIZED_DTYPES = tuple(LIMITS)
# The blockwise kernels do not differentiate through a quantized cache.
NO_QUANTIZED_GRADIENTS = (
    "gradients through quantized keys and values (key_scales, value_scales) are not "
    "implemented by the 'flash' and 'native' kernels; use implementation='xla', which "
    "differentiates the query and the scales"
)


def storage_name(dtype) -> str | None:
    """The name of a storage dtype of :data:`QUANTIZED_DTYPES` (a string, a numpy or
    jax dtype), or None when ``dtype`` is not one."""
    try:
        name = jnp.dtype(dtype).name
    except TypeError:
        return None
    return name if name in LIMITS else None


def check_storage(name: str, dtype) -> str:
    """``dtype`` as the name of a storage dtype, or a one-line ValueError naming
    ``name`` and the dtypes there are."""
    found = storage_name(dtype)
    if found is None:
        raise ValueError(f"{name} must be one of {QUANTIZED_DTYPES}, got {dtype!r}")
    return found


def is_quantized(x) -> bool:
    """Whether an array's dtype is a storage dtype (int8, float8_e4m3fn)."""
    return storage_name(getattr(x, "dtype", None)) is not None


def dequantize(values, scales, dtype):
    """``values * scales[..., None]`` in ``dtype``: values (..., S, K, H) of a storage
    dtype (or already floating), scales (..., S, K). The product is formed in
    ``dtype`` (a kernel's float32 or float64), so every kernel rounds it alike."""
    return values.astype(dtype) * scales.astype(dtype)[..., None]


def dequantized_call(key, value, rules, dtype):
    """A call's quantized keys and values dequantized in ``dtype`` (the compute
    dtype) and its rules without their scales: ``(key, value, rules)``, unchanged for a
    call of float keys. The reference's way (a float copy of the cache); the
    blockwise kernels dequantize per block instead."""
    if rules.key_scales is None:
        return key, value, rules
    key = dequantize(key, rules.key_scales, dtype)
    value = dequantize(value, rules.value_scales, dtype)
    return key, value, rules.replace(key_scales=None, value_scales=None)


def check_kv_scales(key, value, key_scales, value_scales, axes: str):
    """The scales of quantized keys and values, checked: both or neither; with them,
    key and value of a storage dtype and scales floating of shape ``key.shape[:-1]``
    (``axes`` names it: "B S K" or "P page_size K"). Returns ``(key_scales,
    value_scales)`` as arrays, or ``(None, None)``.

    Raises:
      ValueError: one scale without the other, a key or value of a storage dtype
        without scales or of another dtype with them, or a scale of the wrong shape,
        naming the argument.
      TypeError: scales that are not floating.
    """
    if key_scales is None and value_scales is None:
        for name, x in (("key", key), ("value", value)):
            if x is not None and is_quantized(x):
                raise ValueError(
                    f"{name} of dtype {x.dtype} is quantized: give key_scales and value_scales"
                )
        return None, None
    if key_scales is None or value_scales is None:
        missing = "key_scales" if key_scales is None else "value_scales"
        raise ValueError(f"{missing} is missing: give key_scales and value_scales together")
    out = []
    for name, x, scale_name, scales in (
        ("key", key, "key_scales", key_scales),
        ("value", value, "value_scales", value_scales),
    ):
        if not is_quantized(x):
            raise ValueError(
                f"{name} must be of a quantized dtype {QUANTIZED_DTYPES} with {scale_name}, "
                f"got {np.dtype(x.dtype)}"
            )
        scales = as_array(scale_name, scales, f"a float array ({axes})")
        expect_floating(scale_name, scales.dtype)
        expect_shape(scale_name, scales.shape, axes, x.shape[:-1])
        out.append(scales)
    return tuple(out)
