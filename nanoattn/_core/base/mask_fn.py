"""``mask_fn`` and ``score_fn``: masks and score modifications given as functions of
the four indices of a score cell.

``mask_fn(b, n, q_pos, k_pos) -> bool`` and ``score_fn(score, b, n, q_pos, k_pos)
-> score`` are called with int32 arrays that broadcast to (B, N, T, S), or to a
block of it: the batch row, the query head, the query's global position
(``q_offset + i``, per row when ``q_offset`` is per row) and the key's position.
Both must be elementwise (a cell's value depends on its four indices only), so
a kernel may call them on any block of cells, in any layout that broadcasts.

This module checks such functions once per call (:func:`check_mask_fn`,
:func:`check_score_fn`, by tracing them on abstract arrays) and evaluates them on
index grids (:func:`grid`, :func:`evaluate_mask`, :func:`evaluate_score`).
"""

from collections.abc import Callable

import jax
import jax.numpy as jnp

from .shard_map import eval_alike
from .validate import describe, expect_broadcastable

SCORE_AXES = "B N T S"


def _signature(name: str) -> str:
    if name == "mask_fn":
        return "mask_fn(b, n, q_pos, k_pos) -> bool array"
    return "score_fn(score, b, n, q_pos, k_pos) -> float array"


def _check_callable(name: str, fn) -> None:
    if not callable(fn):
        raise TypeError(f"{name} must be a function {_signature(name)}, got {type(fn).__name__}")


def query_positions(q_offset, B: int, T: int):
    """Each query's global position, int32, (1 or B, T): ``q_offset + i``."""
    offset = jnp.asarray(0 if q_offset is None else q_offset, jnp.int32)
    return jnp.reshape(offset, (-1, 1)) + jnp.arange(T, dtype=jnp.int32)[None]


def grid(B: int, N: int, T: int, S: int, q_offset, k_start=0):
    """The four index arrays of the cells (B, N, T, S), broadcastable to it:
    b (B, 1, 1, 1), n (1, N, 1, 1), q_pos (1 or B, 1, T, 1), k_pos (1, 1, 1, S)
    (keys at ``k_start + j``)."""
    b = jnp.arange(B, dtype=jnp.int32).reshape(B, 1, 1, 1)
    n = jnp.arange(N, dtype=jnp.int32).reshape(1, N, 1, 1)
    q = query_positions(q_offset, B, T)[:, None, :, None]
    k = (k_start + jnp.arange(S, dtype=jnp.int32)).reshape(1, 1, 1, S)
    return b, n, q, k


def closure_converted(score_fn, B: int, N: int, T: int, S: int, q_offset, dtype):
    """``score_fn`` traced on scores (B, N, T, S) of ``dtype`` (one block of a
    kernel's) and the index grid: ``(fn(score, b, n, q_pos, k_pos, *arrays),
    arrays)``, the floating arrays it closes over hoisted out (as
    ``jax.closure_convert``), so that they can cross a kernel's ``custom_vjp`` as
    inputs and receive their gradients. ``fn`` evaluates the traced program with
    :func:`~nanoattn._core.base.shard_map.eval_alike`, so it may be called inside
    ``jax.shard_map`` with arguments that vary over its axes."""
    example = (jax.ShapeDtypeStruct((B, N, T, S), dtype), *_abstract_grid(B, N, T, S, q_offset))
    closed = jax.make_jaxpr(score_fn)(*(jnp.zeros(x.shape, x.dtype) for x in example))
    hoisted = [jnp.issubdtype(jnp.result_type(c), jnp.inexact) for c in closed.consts]
    arrays = [c for c, h in zip(closed.consts, hoisted, strict=True) if h]
    kept = [c for c, h in zip(closed.consts, hoisted, strict=True) if not h]

    def fn(score, b, n, q_pos, k_pos, *arrays):
        given, rest = iter(arrays), iter(kept)
        consts = [next(given) if h else next(rest) for h in hoisted]
        (out,) = eval_alike(closed.jaxpr, consts, score, b, n, q_pos, k_pos)
        return out

    return fn, arrays


def _abstract_grid(B: int, N: int, T: int, S: int, q_offset):
    rows = 1 if q_offset is None or jnp.ndim(q_offset) == 0 else B
    shapes = ((B, 1, 1, 1), (1, N, 1, 1), (rows, 1, T, 1), (1, 1, 1, S))
    return [jax.ShapeDtypeStruct(s, jnp.int32) for s in shapes]


def _traced(name: str, fn, *args):
    """The abstract result of ``fn(*args)``; a one-line error if the call fails."""
    try:
        return jax.eval_shape(fn, *args)
    except Exception as error:  # the user's function: any failure is theirs to read
        raise ValueError(
            f"{name} failed on int32 index arrays that broadcast to (B, N, T, S) "
            f"(a function {_signature(name)} is expected): {describe(error)}"
        ) from error


def _expect_one_array(name: str, out) -> None:
    if not isinstance(out, jax.ShapeDtypeStruct):
        raise TypeError(f"{name} must return one array, {_signature(name)}; got {type(out)}")


def check_mask_fn(mask_fn, B: int, N: int, T: int, S: int, q_offset) -> Callable | None:
    """``mask_fn``, checked: a function whose result on the index grid is boolean and
    broadcasts to (B, N, T, S); or None.

    Raises:
      TypeError: not callable, or a result that is not one boolean array.
      ValueError: a result that does not broadcast to (B, N, T, S), or a call that fails.
    """
    if mask_fn is None:
        return None
    _check_callable("mask_fn", mask_fn)
    out = _traced("mask_fn", mask_fn, *_abstract_grid(B, N, T, S, q_offset))
    _expect_one_array("mask_fn", out)
    if out.dtype != jnp.bool_:
        raise TypeError(
            f"mask_fn must return a boolean array (True = may attend), got dtype {out.dtype}"
        )
    expect_broadcastable("mask_fn's result", out.shape, SCORE_AXES, (B, N, T, S))
    return mask_fn


def check_score_fn(score_fn, B: int, N: int, T: int, S: int, q_offset) -> Callable | None:
    """``score_fn``, checked: a function of float32 scores (B, N, T, S) and the index
    grid that returns a floating array of the scores' shape; or None.

    Raises:
      TypeError: not callable, or a result that is not one floating array.
      ValueError: a result of another shape, or a call that fails.
    """
    if score_fn is None:
        return None
    _check_callable("score_fn", score_fn)
    score = jax.ShapeDtypeStruct((B, N, T, S), jnp.float32)
    out = _traced("score_fn", score_fn, score, *_abstract_grid(B, N, T, S, q_offset))
    _expect_one_array("score_fn", out)
    if not jnp.issubdtype(out.dtype, jnp.floating):
        raise TypeError(f"score_fn must return a floating array, got dtype {out.dtype}")
    expect_broadcastable("score_fn's result", out.shape, SCORE_AXES, (B, N, T, S))
    return score_fn


def evaluate_mask(mask_fn, b, n, q, k):
    """``mask_fn`` on index arrays of one rank, as a boolean array of that rank (an axis
    the function does not depend on may stay 1)."""
    out = jnp.asarray(mask_fn(b, n, q, k)).astype(jnp.bool_)
    return jnp.reshape(out, (1,) * (b.ndim - out.ndim) + out.shape)


def evaluate_score(score_fn, score, b, n, q, k):
    """``score_fn`` on scores and their index arrays, in the scores' dtype and shape."""
    out = jnp.asarray(score_fn(score, b, n, q, k))
    return jnp.broadcast_to(out, score.shape).astype(score.dtype)
