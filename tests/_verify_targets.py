"""Targets for `nanoattn verify MODULE:OBJECT` in the CLI tests."""

import jax
import jax.numpy as jnp

from nanoattn.linen import AttentionConfig, CausalSelfAttention

D = 16


def causal_attention():
    """A zero-argument factory: returns a jitted evaluation-mode layer."""
    layer = CausalSelfAttention(AttentionConfig(D, 2))
    params = layer.init(jax.random.key(0), jnp.ones((1, 2, D)), deterministic=True)
    return jax.jit(lambda x: layer.apply(params, x, deterministic=True))


def reversed_time(x):
    """Every output sees the whole sequence backwards: leaks the future."""
    return jnp.cumsum(x[:, ::-1], axis=1)


def broken(x):
    raise RuntimeError("boom")


def wrong_shape(x):
    return x[:, :1]


def failing_factory():
    raise ValueError("no weights here")


not_callable = 3


def nanogpt_like():
    """A zero-argument factory: causal, raises past its block size of 20 tokens."""
    from _verify_functions import nanogpt_like

    return nanogpt_like([])
