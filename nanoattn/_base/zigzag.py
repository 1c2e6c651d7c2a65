"""Sequence layouts of the ring: which chunks of the sequence each device holds.

The sequence of T tokens is cut into equal chunks. With ``layout="contiguous"``
device r of P holds chunk r of P (the plain ``P("sp")`` sharding of the
sequence axis). With ``layout="zigzag"`` it is cut into 2P chunks and device r
holds chunks r and 2P - 1 - r, in that order, so under causality every device
has one early and one late chunk and does the same work::

    T = 8 chunks of C tokens, P = 4 devices
    sequence  | 0 | 1 | 2 | 3 | 4 | 5 | 6 | 7 |
    device    | 0 | 1 | 2 | 3 | 3 | 2 | 1 | 0 |
    zigzag    | 0 7 | 1 6 | 2 5 | 3 4 |          (what each device holds)

:func:`to_zigzag` permutes a sequence axis into that order (so that the plain
sharding ``P(None, "sp")`` gives each device its two chunks) and
:func:`from_zigzag` undoes it.
"""

import numbers

import jax.numpy as jnp
import numpy as np

LAYOUTS = ("zigzag", "contiguous")


def check_layout(layout, name: str = "layout") -> int:
    """The number of chunks per device of ``layout``: 2 for zigzag, 1 for contiguous.

    Raises:
      ValueError: not one of :data:`LAYOUTS` (the message names the argument ``name``).
    """
    if layout not in LAYOUTS:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, LAYOUTS))}, got {layout!r}")
    return 2 if layout == "zigzag" else 1


def check_divisible(T: int, P: int, layout: str) -> int:
    """The chunk length C of a sequence of T tokens over P devices, or a ValueError."""
    chunks = check_layout(layout) * P
    if T % chunks:
        raise ValueError(
            f"layout={layout!r} over P={P} devices cuts the sequence into {chunks} equal chunks, "
            f"but T={T} is not a multiple of {chunks}; pad T to {-(-T // chunks) * chunks} "
            f"(and hide the padding with kv_lengths)"
        )
    return T // chunks


def chunk_ids(layout: str, P: int, r):
    """The chunks device ``r`` (an int or a traced index) holds, in order."""
    return (r, 2 * P - 1 - r) if layout == "zigzag" else (r,)


def zigzag_order(P: int) -> np.ndarray:
    """The 2P chunks in the order the devices hold them: 0, 2P-1, 1, 2P-2, ..."""
    return np.array([c for r in range(P) for c in (r, 2 * P - 1 - r)])


def _check_devices(P) -> int:
    if isinstance(P, bool) or not isinstance(P, numbers.Integral):
        raise TypeError(f"P must be an int >= 1 (the devices on the ring), got P={P!r}")
    if P < 1:
        raise ValueError(f"P must be an int >= 1 (the devices on the ring), got P={P!r}")
    return int(P)


def _permute(x, P: int, axis: int, order: np.ndarray):
    x = jnp.asarray(x)
    if isinstance(axis, bool) or not isinstance(axis, numbers.Integral):
        raise TypeError(f"axis must be an int, got axis={axis!r}")
    if not -x.ndim <= axis < x.ndim:
        raise ValueError(f"axis={axis} is out of range for x of shape {x.shape}")
    axis = axis % x.ndim
    C = check_divisible(x.shape[axis], P, "zigzag")
    chunks = x.reshape(*x.shape[:axis], 2 * P, C, *x.shape[axis + 1 :])  # (..., 2P, C, ...)
    return jnp.take(chunks, order, axis=axis).reshape(x.shape)


def to_zigzag(x, P: int, axis: int = 1):
    """Permutes the sequence axis of ``x`` into the zigzag layout of P devices.

    Args:
      x: any array whose ``axis`` has length T, a multiple of 2P: queries
        (B, T, N, H), segment ids (B, T), positions (T,) with ``axis=0``, ...
      P: the number of devices on the ring.
      axis: the sequence axis (1 for (B, T, ...)).

    Returns:
      ``x`` with the 2P chunks of the axis in the order 0, 2P-1, 1, 2P-2, ...

    Example:
      >>> import jax.numpy as jnp
      >>> to_zigzag(jnp.arange(8), 2, axis=0)
      Array([0, 1, 6, 7, 2, 3, 4, 5], dtype=int32)
    """
    P = _check_devices(P)
    return _permute(x, P, axis, zigzag_order(P))


def from_zigzag(x, P: int, axis: int = 1):
    """Undoes :func:`to_zigzag`: the sequence axis back in order 0 .. T - 1."""
    P = _check_devices(P)
    return _permute(x, P, axis, np.argsort(zigzag_order(P)))
