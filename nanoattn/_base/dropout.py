"""The dropout arguments: one rule for a rate and its random key, used by every
entry point that takes them (the functional core, flax's ``attention_fn``
adapter, ``AttentionConfig``)."""

import jax
import jax.numpy as jnp
import numpy as np

from .validate import expect_real


def is_key(rng) -> bool:
    """A ``jax.random.key`` (scalar, typed) or a raw ``jax.random.PRNGKey`` (uint32 (2,))."""
    dtype = getattr(rng, "dtype", None)
    if dtype is None:
        return False
    if jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
        return jnp.ndim(rng) == 0
    return dtype == np.uint32 and jnp.ndim(rng) == 1


def check_rate(name: str, rate) -> float:
    """``rate`` as a float in [0, 1), or a one-line error naming ``name``.

    Raises:
      TypeError: not a real number.
      ValueError: outside [0, 1) (a rate of 1 would drop every weight).
    """
    expect_real(name, rate, "a float in [0, 1)")
    if not 0.0 <= rate < 1.0:
        raise ValueError(f"{name} must be in [0, 1), got {name}={rate}")
    return float(rate)


def check_dropout(rate, rng, *, name: str = "dropout_rate") -> None:
    """The rate (:func:`check_rate`) and, when it is above 0, its key.

    Raises:
      ValueError: a bad rate, or a rate above 0 without ``dropout_rng``.
      TypeError: a ``dropout_rng`` that is not a ``jax.random`` key.
    """
    rate = check_rate(name, rate)
    if rate == 0.0:
        return
    if rng is None:
        raise ValueError(
            f"{name}={rate} needs dropout_rng (a jax.random key); pass {name}=0.0 for evaluation"
        )
    if not is_key(rng):
        raise TypeError(
            f"dropout_rng must be a jax.random key (jax.random.key(0) or "
            f"jax.random.PRNGKey(0)), got {rng!r}"
        )
