"""RMSNorm over the head width, the QK normalisation of Gemma 3 and OLMo 2."""

import jax
import jax.numpy as jnp

# Added to the mean square: keeps an all-zero head finite (the value of Gemma 3 and OLMo 2).
EPSILON = 1e-6


def head_rms_norm(x, scale, dtype=None):
    r"""RMSNorm of each head over its H features, with a learned scale per feature.

    ``y[..., h] = x[..., h] / sqrt(mean_h(x^2) + eps) * scale[h]``, ``eps = 1e-6``,
    computed in at least float32 and returned in ``dtype`` (the input's when None).

    Args:
      x: (..., H), e.g. query heads (B, T, N, H) or key heads (B, S, K, H).
      scale: (H,), shared by every head.
      dtype: the output dtype, or None for the input's.
    """
    acc = jnp.result_type(x.dtype, jnp.float32)
    xf = x.astype(acc)
    inv_rms = jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + EPSILON)
    y = xf * inv_rms * scale.astype(acc).reshape((1,) * (x.ndim - 1) + (-1,))  # (1, .., 1, H)
    return y.astype(x.dtype if dtype is None else dtype)
