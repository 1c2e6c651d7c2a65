"""Targets for docs/verify.md: flax's attention with and without its causal mask.

nanoattn verify examples.verify_demo:flax_causal --d-model 64
nanoattn verify examples.verify_demo:flax_no_mask --d-model 64
"""

import flax.linen as nn
import jax
import jax.numpy as jnp


def _flax_attention(with_mask: bool):
    layer = nn.MultiHeadDotProductAttention(num_heads=4, qkv_features=64)
    params = layer.init(jax.random.key(0), jnp.ones((1, 2, 64)))

    @jax.jit
    def attend(x):  # (B, T, 64) -> (B, T, 64), evaluation mode
        mask = nn.make_causal_mask(x[..., 0]) if with_mask else None
        return layer.apply(params, x, mask=mask)

    return attend


def flax_causal():
    """A zero-argument factory: the layer with flax's causal mask."""
    return _flax_attention(with_mask=True)


def flax_no_mask():
    """The same layer with the mask forgotten: it sees the future."""
    return _flax_attention(with_mask=False)
