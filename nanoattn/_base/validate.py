"""Validation of user input: one place that turns a bad shape into a clear error.

Every message names the expected shape with the axis legend of
docs/conventions.md and the actual shape, so the caller can see which axis is
wrong. Nothing here uses ``assert``: user input is always checked, also under
``python -O``.
"""

import math
import numbers
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


def as_array(name: str, value, what: str):
    """``value`` as a jax array, or a one-line TypeError naming ``name`` and saying it
    must be ``what`` (a string, None, a ragged list, an object)."""
    import jax.numpy as jnp

    try:
        if isinstance(value, (str, bytes)) or value is None:
            raise TypeError
        return jnp.asarray(value)
    except (TypeError, ValueError):
        shown = repr(value)
        shown = shown if len(shown) <= 40 else shown[:37] + "..."
        raise TypeError(f"{name} must be {what}, got {type(value).__name__} {shown}") from None


def expect_flag(name: str, value) -> bool:
    """``value`` as a bool, or a TypeError: ``True`` or ``False`` (a numpy bool too),
    never a truthy string or number."""
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be True or False, got {value!r}")
    return bool(value)


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


def expect_size(name: str, value) -> int:
    """``value`` as an int >= 0 (a length such as T or S), or a one-line error.

    Raises:
      TypeError: not an int (a bool or a float such as 4.0 is not one).
      ValueError: a negative int.
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int >= 0, got {name}={value!r}")
    if value < 0:
        raise ValueError(f"{name} must be an int >= 0, got {name}={value!r}")
    return int(value)


def float_dtype(name: str, dtype):
    """``dtype`` as a floating numpy dtype (bfloat16 included), or a one-line TypeError."""
    import jax.numpy as jnp

    try:
        dt = None if dtype is None else jnp.dtype(dtype)
    except TypeError:
        dt = None
    if dt is None or not jnp.issubdtype(dt, jnp.floating):
        raise TypeError(f"{name} must be a floating dtype such as jnp.float32, got {dtype!r}")
    return dt


def expect_real(name: str, value, what: str) -> None:
    """Raises TypeError, saying ``name`` must be ``what``, unless ``value`` is a real
    number or a numeric scalar array (not a bool, a string or None)."""
    if isinstance(value, bool):
        ok = False
    elif isinstance(value, numbers.Real):
        ok = True
    else:
        dtype = getattr(value, "dtype", None)
        ok = (
            dtype is not None
            and dtype != np.bool_
            and np.issubdtype(np.dtype(dtype), np.number)
            and np.shape(value) == ()
        )
    if not ok:
        raise TypeError(f"{name} must be {what}, got {name}={value!r}")


def positive_number(name: str, value, *, optional: bool = False) -> float | None:
    """``value`` as a finite float > 0 (a cap, a frequency base), or None when
    ``optional`` and ``value`` is None; otherwise a one-line error naming ``name``.

    Raises:
      TypeError: not a real number or a numeric scalar array (a bool, a string).
      ValueError: zero, negative, infinite or NaN.
    """
    if value is None and optional:
        return None
    expect_real(name, value, "a float > 0 or None" if optional else "a float > 0")
    value = float(value)
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be a finite float > 0, got {name}={value!r}")
    return value


def check_scale(scale):
    """A ``scale`` argument: None, a finite real number, or a scalar numeric array
    (which may be traced under ``jit``).

    Raises:
      TypeError: a string, a bool or an array that is not numeric.
      ValueError: a non-finite number, or an array that is not a scalar.
    """
    if scale is None:
        return None
    if isinstance(scale, numbers.Real) and not isinstance(scale, bool):
        if not math.isfinite(scale):
            raise ValueError(f"scale must be finite, got scale={scale!r}")
        return scale
    import jax.numpy as jnp

    dtype = getattr(scale, "dtype", None)
    numeric = dtype is not None and (
        jnp.issubdtype(dtype, jnp.floating) or jnp.issubdtype(dtype, jnp.integer)
    )
    if not numeric:
        raise TypeError(f"scale must be a real number or a scalar array, got {scale!r}")
    if np.shape(scale) != ():
        raise ValueError(f"scale must be a scalar, got an array of shape {np.shape(scale)}")
    return scale


def check_tiles(name: str, tiles):
    """A ``forward_tiles``/``backward_tiles`` argument: None, or ``(block_q, block_k,
    lanes)``, three ints >= 1, returned as a tuple of ints.

    Raises:
      TypeError: not a sequence of ints.
      ValueError: not three of them, or one below 1.
    """
    if tiles is None:
        return None
    what = f"{name} must be (block_q, block_k, lanes), three ints >= 1"
    if isinstance(tiles, str) or not isinstance(tiles, Sequence):
        raise TypeError(f"{what}, got {tiles!r}")
    if len(tiles) != 3:
        raise ValueError(f"{what}, got {tiles!r}")
    for t in tiles:
        if isinstance(t, bool) or not isinstance(t, numbers.Integral):
            raise TypeError(f"{what}, got {tiles!r}")
    if min(tiles) < 1:
        raise ValueError(f"{what} (block sizes and lanes must be >= 1), got {tiles!r}")
    return tuple(int(t) for t in tiles)


def lengths_within(name: str, lengths, most: int) -> None:
    """Raises a one-line ValueError naming ``name`` and the first row whose length is
    outside [0, ``most``], when ``lengths`` is concrete; a traced one cannot be read
    here (the caller makes those rows NaN, :func:`lengths_outside`)."""
    import jax

    if isinstance(lengths, jax.core.Tracer):
        return
    values = np.asarray(lengths)
    bad = np.flatnonzero((values < 0) | (values > most))
    if bad.size:
        b = int(bad[0])
        raise ValueError(f"{name} must be in [0, {most}], got {name}[{b}]={int(values[b])}")


def lengths_outside(lengths, most: int):
    """(B,) bool: the rows whose length is outside [0, ``most``] (traced or not)."""
    return (lengths < 0) | (lengths > most)


def describe(error: BaseException) -> str:
    """An exception as one line: its type and the first line of its message."""
    message = str(error).splitlines()[0] if str(error) else ""
    return f"{type(error).__name__}: {message}"
