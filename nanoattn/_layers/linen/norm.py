"""The linen module of the QK RMSNorm; the math is ``nanoattn._layers.norm.rms_norm``."""

from typing import Any

import flax.linen as nn
import jax.numpy as jnp

from ..norm import EPSILON, rms_norm


class HeadRMSNorm(nn.Module):
    r"""RMSNorm of heads over their last ``axes`` axes, with a learned scale per feature.

    ``y = x / sqrt(mean(x^2) + eps) * (offset + scale)``, the mean over each head's H
    features (``axes=1``) or over all heads and features jointly (``axes=2``, a whole
    projection), computed in at least float32 and returned in ``dtype`` (the input's
    when None). Parameters: ``{"scale": (H,)}`` shared by every head, or ``(N H,)``
    with ``axes=2``, initialised to ``1 - offset`` (a fresh norm multiplies by 1).

    Attributes:
      dtype: the output dtype, or None for the input's.
      param_dtype: the dtype of ``scale``.
      axes: 1 (per head) or 2 (per projection).
      eps: added to the mean square.
      offset: added to ``scale`` (1 for Gemma's ``1 + w``).
    """

    dtype: Any = None
    param_dtype: Any = jnp.float32
    axes: int = 1
    eps: float = EPSILON
    offset: float = 0.0

    @nn.compact
    def __call__(self, x):
        """x: (..., H), e.g. query heads (B, T, N, H) or key heads (B, S, K, H)."""
        features = 1
        for size in x.shape[x.ndim - self.axes :]:
            features *= size

        def init(key, shape, dtype):
            return jnp.full(shape, 1.0 - self.offset, dtype)

        scale = self.param("scale", init, (features,), self.param_dtype)
        return rms_norm(
            x, scale, axes=self.axes, eps=self.eps, offset=self.offset, dtype=self.dtype
        )
