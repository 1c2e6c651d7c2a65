"""What the checks feed a model, made and changed the same way by every check:
float inputs (B, T, D), or int token ids (B, T) below a vocabulary size V.

Also the checks' own ``jit``: XLA's backend optimisation off, because a check
compiles once per length and runs each program a few times, so compile time
is what counts (a fifth of the default's for an attention layer on a CPU).
"""

import dataclasses
import numbers

import jax
import numpy as np

FAST_COMPILE = {"xla_backend_optimization_level": 0}


def jit(fn, **kwargs):
    """``jax.jit`` compiled for a short compile rather than a fast run."""
    return jax.jit(fn, compiler_options=FAST_COMPILE, **kwargs)


def _int_at_least(name: str, value, least: int) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < least:
        raise ValueError(f"{name} must be an int >= {least}, got {name}={value!r}")
    return int(value)


@dataclasses.dataclass(frozen=True)
class Inputs:
    """Float inputs (B, T, D) when ``d_model`` is set, token ids (B, T) when ``vocab`` is."""

    d_model: int | None = None
    vocab: int | None = None

    @classmethod
    def of(cls, d_model, vocab) -> "Inputs":
        """Validates the pair: exactly one of them, D >= 1, V >= 2 (so a token can change)."""
        if (d_model is None) == (vocab is None):
            raise ValueError(
                "pass d_model for float inputs (B, T, D) or vocab for token ids (B, T), "
                f"exactly one of them; got d_model={d_model!r}, vocab={vocab!r}"
            )
        if vocab is not None:
            return cls(vocab=_int_at_least("vocab", vocab, 2))
        return cls(d_model=_int_at_least("d_model", d_model, 1))

    @property
    def tokens(self) -> bool:
        return self.vocab is not None

    def random(self, rng: np.random.Generator, *shape: int) -> np.ndarray:
        """Random tokens of shape (B, T): float32 (B, T, D) normal, or int32 ids in [0, V)."""
        if self.tokens:
            return rng.integers(0, self.vocab, shape).astype(np.int32)
        return rng.standard_normal((*shape, self.d_model)).astype(np.float32)

    def changed(self, rng: np.random.Generator, x: np.ndarray) -> np.ndarray:
        """Other tokens in place of every token of ``x``: every id differs, floats are redrawn."""
        if self.tokens:
            shift = rng.integers(1, self.vocab, x.shape)
            return ((x + shift) % self.vocab).astype(np.int32)
        return rng.standard_normal(x.shape).astype(np.float32)

    def describe(self) -> str:
        if self.tokens:
            return f"token ids (B, T) in [0, {self.vocab})"
        return f"float32 (B, T, D) with D = {self.d_model}"


def as_features(y, x_shape: tuple[int, ...], name: str = "fn") -> np.ndarray:
    """An output (B, T, ...) as float64 (B, T, F); ValueError naming both shapes otherwise."""
    y = np.asarray(y)
    if y.ndim < 2 or y.shape[:2] != tuple(x_shape[:2]):
        axes = "(B, T)" if len(x_shape) == 2 else "(B, T, D)"
        raise ValueError(
            f"{name} must map an input of shape {axes} = {tuple(x_shape)} to (B, T, ...), "
            f"got {y.shape}"
        )
    return np.asarray(y.reshape(y.shape[0], y.shape[1], -1), np.float64)
