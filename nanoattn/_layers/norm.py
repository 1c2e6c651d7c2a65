"""The QK RMSNorm, in both conventions of today's models: per head over its H features
(``qk_norm="head"``: Qwen3, Gemma 3) or over a whole projection, all heads jointly
(``qk_norm="projection"``: OLMo 2, over N H for queries and K H for keys); and the
LayerNorm of DeepSeek-V3.2's indexer key."""

import jax
import jax.numpy as jnp

# The default added to the mean square: keeps an all-zero head finite (Qwen3's and Gemma
# 3's value; OLMo 2 uses 1e-5, AttentionConfig.qk_norm_eps).
EPSILON = 1e-6


def rms_norm(x, scale, *, axes: int = 1, eps: float = EPSILON, offset: float = 0.0, dtype=None):
    r"""RMSNorm over the last ``axes`` axes of ``x``, with a learned scale per feature.

    ``y = x / sqrt(mean(x^2) + eps) * (offset + scale)``, the mean over the last
    ``axes`` axes, computed in at least float32 and returned in ``dtype`` (the input's
    when None). ``offset`` is 1 for Gemma's ``1 + w`` convention, 0 otherwise.

    Args:
      x: (..., H) with ``axes=1`` (each head alone), or (..., N, H) with ``axes=2``
        (all heads of a projection jointly).
      scale: the features' scales, flat: (H,) or (N H,).
      eps: added to the mean square.
      offset: added to ``scale``.
      dtype: the output dtype, or None for the input's.
    """
    acc = jnp.result_type(x.dtype, jnp.float32)
    xf = x.astype(acc)
    reduced = tuple(range(x.ndim - axes, x.ndim))
    inv_rms = jax.lax.rsqrt(jnp.mean(xf * xf, axis=reduced, keepdims=True) + eps)
    lead = (1,) * (x.ndim - axes)
    weight = scale.astype(acc).reshape(lead + x.shape[x.ndim - axes :])  # (1, .., 1, [N,] H)
    if offset:
        weight = offset + weight
    y = xf * inv_rms * weight
    return y.astype(x.dtype if dtype is None else dtype)


def head_rms_norm(x, scale, dtype=None):
    r"""RMSNorm of each head over its H features, with a learned scale per feature.

    ``y[..., h] = x[..., h] / sqrt(mean_h(x^2) + eps) * scale[h]``, ``eps = 1e-6``,
    computed in at least float32 and returned in ``dtype`` (the input's when None):
    :func:`rms_norm` with its defaults.

    Args:
      x: (..., H), e.g. query heads (B, T, N, H) or key heads (B, S, K, H).
      scale: (H,), shared by every head.
      dtype: the output dtype, or None for the input's.
    """
    return rms_norm(x, scale, dtype=dtype)


def layer_norm(x, scale, bias, *, eps: float = 1e-6):
    """LayerNorm over x's last axis (H,) with a learned ``scale`` and ``bias`` (H,),
    computed in at least float32 (DeepSeek-V3.2's indexer key); returns that dtype."""
    acc = jnp.result_type(x.dtype, jnp.float32)
    xf = x.astype(acc)
    mean = jnp.mean(xf, axis=-1, keepdims=True)
    centered = xf - mean
    inv = jax.lax.rsqrt(jnp.mean(centered * centered, axis=-1, keepdims=True) + eps)
    shape = (*(1,) * (x.ndim - 1), -1)
    return centered * inv * scale.astype(acc).reshape(shape) + bias.astype(acc).reshape(shape)
