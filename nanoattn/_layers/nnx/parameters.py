"""How an NNX module hands its parameters to the shared layer steps
(``nanoattn._layers.heads.Parameters``), and the NNX QK norm.

The projections are ``nnx.Linear`` (so the parameters are named ``kernel`` and
``bias``, as in linen), but they are applied here in the compute dtype chosen
per call (``config.dtype``, else the input's), exactly as the linen modules
apply ``nn.Dense``: inputs, kernel and bias cast to that dtype, one
``dot_general``, then the bias.
"""

import jax
import jax.numpy as jnp
from flax import nnx

from ..norm import EPSILON, rms_norm


class HeadRMSNorm(nnx.Module):
    r"""RMSNorm of heads over their last ``axes`` axes (``nanoattn._layers.norm.rms_norm``),
    with a learned ``scale`` (``features``,): (H,) shared by every head, or (N H,) over a
    whole projection with ``axes=2``; initialised to ``1 - offset`` (a fresh norm
    multiplies by 1)."""

    def __init__(
        self,
        features: int,
        *,
        param_dtype=jnp.float32,
        axes: int = 1,
        eps: float = EPSILON,
        offset: float = 0.0,
    ):
        self.scale = nnx.Param(jnp.full((features,), 1.0 - offset, param_dtype))
        self.axes, self.eps, self.offset = axes, eps, offset

    def __call__(self, x, dtype=None):
        """x: (..., H), e.g. query heads (B, T, N, H) or key heads (B, S, K, H)."""
        return rms_norm(
            x, self.scale[...], axes=self.axes, eps=self.eps, offset=self.offset, dtype=dtype
        )


def linear(layer: nnx.Linear, x, dtype):
    """``x @ kernel + bias`` with all three in ``dtype``: (..., D_in) -> (..., features)."""
    x = jnp.asarray(x, dtype)
    kernel = jnp.asarray(layer.kernel[...], dtype)
    y = jax.lax.dot_general(x, kernel, (((x.ndim - 1,), (0,)), ((), ())))
    if layer.bias is not None:
        y = y + jnp.reshape(jnp.asarray(layer.bias[...], dtype), (1,) * (y.ndim - 1) + (-1,))
    return y


class Parameters:
    """The parameters of an NNX attention module, for the shared steps: its
    submodules by name, its dropout stream (or the call's ``rngs``), and
    ``sow`` into ``nnx.Intermediate`` when the module sows weights."""

    def __init__(self, module: nnx.Module, rngs: nnx.Rngs | None):
        self.module, self.rngs = module, rngs

    def dense(self, name, x, features, dtype):
        return linear(getattr(self.module, name), x, dtype)

    def norm(self, name, x, dtype):
        return getattr(self.module, name)(x, dtype)

    def sinks(self):
        return self.module.sinks[...]

    def dropout_rng(self):
        if self.rngs is not None:
            return self.rngs.dropout()
        if self.module.rngs is None:
            raise ValueError(
                "dropout is on but this module has no random stream: construct it with "
                "rngs, pass rngs=nnx.Rngs(dropout=...) to the call, or use deterministic=True"
            )
        return self.module.rngs()

    def sow_weights(self, weights):
        if self.module.sow_weights:
            self.module.sow(nnx.Intermediate, "attention_weights", weights())
