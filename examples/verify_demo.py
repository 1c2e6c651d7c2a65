"""Targets for docs/verify.md: flax's attention with and without its causal mask, and
three decoders: nanoattn's layer, flax linen's and flax NNX's decode paths.

nanoattn verify examples.verify_demo:flax_causal --d-model 64
nanoattn verify examples.verify_demo:flax_no_mask --d-model 64
nanoattn verify examples.verify_demo:nanoattn_decoder --decode --d-model 16
nanoattn verify examples.verify_demo:flax_nnx_decoder --decode --d-model 16
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


# Decoders for `nanoattn verify ... --decode --d-model 16`: (full, init, step) triples.


def nanoattn_decoder():
    """nanoattn's linen layer through its cache: grouped-query heads, RoPE, a window,
    soft-capping and QK norm."""
    from nanoattn.linen import AttentionConfig, CausalSelfAttention
    from nanoattn.verify import decoders

    config = AttentionConfig(
        16, 4, n_kv_heads=2, rope_base=10000.0, window=(4, 0), logit_soft_cap=5.0, qk_norm=True
    )
    layer = CausalSelfAttention(config)
    params = jax.jit(lambda key: layer.init(key, jnp.ones((1, 2, 16)), deterministic=True))
    return decoders.linen(layer, params(jax.random.key(0)))


def flax_linen_decoder():
    """flax linen's MultiHeadDotProductAttention with decode=True (one token per call)."""
    from nanoattn.verify import decoders

    layer = nn.MultiHeadDotProductAttention(num_heads=4, qkv_features=16, decode=True)
    variables = jax.jit(lambda key: layer.init(key, jnp.ones((1, 2, 16))))(jax.random.key(0))
    return decoders.flax_linen(layer, variables)


def flax_nnx_decoder():
    """flax NNX's MultiHeadAttention decoding with is_causal=True (google/flax#5591)."""
    from flax import nnx

    from nanoattn.verify import decoders

    layer = nnx.MultiHeadAttention(num_heads=4, in_features=16, rngs=nnx.Rngs(0))
    return decoders.flax_nnx(layer, is_causal=True)
