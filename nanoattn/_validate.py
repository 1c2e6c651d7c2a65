"""Validation of user input: one place that turns a bad shape into a clear error.

Every message names the expected shape with the axis legend of
docs/conventions.md and the actual shape, so the caller can see which axis is
wrong. Nothing here uses ``assert``: user input is always checked, also under
``python -O``.
"""

from collections.abc import Sequence

import numpy as np

Dim = int | None  # None: any size is accepted on this axis


def _fmt(dims: Sequence[Dim]) -> str:
    inner = ", ".join("*" if d is None else str(d) for d in dims)
    return f"({inner},)" if len(dims) == 1 else f"({inner})"


def _fmt_axes(axes: str) -> str:
    letters = axes.split()
    return f"({letters[0]},)" if len(letters) == 1 else "(" + ", ".join(letters) + ")"


def expect_shape(name: str, shape: Sequence[int], axes: str, dims: Sequence[Dim]) -> None:
    """Raises ValueError unless ``shape`` matches ``dims`` (None matches any size).

    ``axes`` names the axes with the legend letters, e.g. ``"B S K H"``.
    """
    shape = tuple(shape)
    ok = len(shape) == len(dims) and all(d is None or d == s for d, s in zip(dims, shape))
    if not ok:
        raise ValueError(
            f"{name} must have shape {_fmt_axes(axes)} = {_fmt(dims)}, got {_fmt(shape)}"
        )


def expect_broadcastable(name: str, shape: Sequence[int], axes: str, dims: Sequence[int]) -> None:
    """Raises ValueError unless ``shape`` broadcasts to ``dims`` (numpy rules, no growth)."""
    shape = tuple(shape)
    ok = len(shape) <= len(dims) and all(
        s in (1, d) for s, d in zip(reversed(shape), reversed(tuple(dims)))
    )
    if not ok:
        raise ValueError(
            f"{name} must be broadcastable to {_fmt_axes(axes)} = {_fmt(dims)}, got {_fmt(shape)}"
        )


def expect_bool(name: str, dtype) -> None:
    """Raises TypeError unless ``dtype`` is boolean (masks are True = may attend)."""
    if np.dtype(dtype) != np.bool_:
        raise TypeError(
            f"{name} must be a boolean array (True = may attend), got dtype {np.dtype(dtype)}; "
            "convert a 0/1 mask with `mask.astype(bool)` or `mask > 0`"
        )


def expect_integer(name: str, dtype) -> None:
    """Raises TypeError unless ``dtype`` is an integer dtype."""
    if not np.issubdtype(np.dtype(dtype), np.integer):
        raise TypeError(f"{name} must be an integer array, got dtype {np.dtype(dtype)}")


def expect_floating(name: str, dtype) -> None:
    """Raises TypeError unless ``dtype`` is a floating dtype (bfloat16 included)."""
    import jax.numpy as jnp

    if not jnp.issubdtype(dtype, jnp.floating):
        raise TypeError(f"{name} must be a floating-point array, got dtype {dtype}")


def describe(error: BaseException) -> str:
    """An exception as one line: its type and the first line of its message."""
    message = str(error).splitlines()[0] if str(error) else ""
    return f"{type(error).__name__}: {message}"
