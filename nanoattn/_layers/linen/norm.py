"""The linen module of the QK RMSNorm; the math is ``nanoattn._layers.norm.head_rms_norm``."""

from typing import Any

import flax.linen as nn
import jax.numpy as jnp

from ..norm import head_rms_norm


class HeadRMSNorm(nn.Module):
    r"""RMSNorm of each head over its H features, with a learned scale per feature.

    ``y[..., h] = x[..., h] / sqrt(mean_h(x^2) + eps) * scale[h]``, ``eps = 1e-6``,
    computed in at least float32 and returned in ``dtype`` (the input's when None).
    Parameters: ``{"scale": (H,)}``, initialised to ones, shared by every head.

    Attributes:
      dtype: the output dtype, or None for the input's.
      param_dtype: the dtype of ``scale``.
    """

    dtype: Any = None
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x):
        """x: (..., H), e.g. query heads (B, T, N, H) or key heads (B, S, K, H)."""
        scale = self.param("scale", nn.initializers.ones, (x.shape[-1],), self.param_dtype)
        return head_rms_norm(x, scale, self.dtype)
