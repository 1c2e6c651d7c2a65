"""``mask_fn`` and ``score_fn``: masks and score modifications given as functions of
the four indices of a score cell.

``mask_fn(b, n, q_pos, k_pos) -> bool`` and ``score_fn(score, b, n, q_pos, k_pos)
-> score`` are called with int32 arrays that broadcast to (B, N, T, S), or to a
block of it: the batch row, the query head, the query's global position
(``q_offset + i``, per row when ``q_offset`` is per row) and the key's position.
Both must be elementwise (a cell's value depends on its four indices only), so
a kernel may call them on any block of cells, in any layout that broadcasts.

This module checks such functions once per call (:func:`check_mask_fn`,
:func:`check_score_fn`, by tracing them on abstract arrays, and
:func:`check_elementwise`, by evaluating them on a small grid of the call's cells
whole and in two blocks) and evaluates them on index grids (:func:`grid`,
:func:`evaluate_mask`, :func:`evaluate_score`).
"""

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

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
    :func:`~nanoattn._base.shard_map.eval_alike`, so it may be called inside
    ``jax.shard_map`` with arguments that vary over its axes."""
    example = (jax.ShapeDtypeStruct((B, N, T, S), dtype), *_abstract_grid(B, N, T, S, q_offset))
    # Traced through a fresh wrapper: jax caches traces by function, and a trace of
    # score_fn itself would keep what it read the first time (a rebound dict entry, a
    # rebound variable) for every later call.
    fresh = lambda *args: score_fn(*args)  # noqa: E731
    closed = jax.make_jaxpr(fresh)(*(jnp.zeros(x.shape, x.dtype) for x in example))
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
    check_elementwise("mask_fn", mask_fn, B, N, T, S, q_offset)
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
    check_elementwise("score_fn", score_fn, B, N, T, S, q_offset)
    return score_fn


PROBE = 12  # the most queries and keys of the grid check_elementwise evaluates


def check_elementwise(name: str, fn, B: int, N: int, T: int, S: int, q_offset) -> None:
    """Raises a one-line ValueError, naming ``name`` and saying "elementwise", when
    ``fn`` (a ``mask_fn``, or a ``score_fn`` when ``name`` says so) gives a cell a
    different value evaluated in a block than evaluated with its neighbours: a kernel
    calls it on blocks of any shape and offset, so such a function would give an
    answer that depends on the backend and the sequence length.

    It is evaluated on a small grid of the call's own cells (the first two batch rows
    and heads, up to :data:`PROBE` queries and keys: indices ``fn`` can read), whole
    and in two blocks of different shapes and offsets. Nothing is checked when the
    values depend on traced arrays (a closed-over array under ``jit``, a traced
    offset), which cannot be read at trace time."""
    tq, sk = min(T, PROBE), min(S, PROBE)
    if tq * sk <= 1:
        return
    b, n, q, k = grid(min(B, 2), min(N, 2), tq, sk, _first_rows(q_offset, min(B, 2)))
    score = None
    if name == "score_fn":
        rng = np.random.default_rng(0)
        score = jnp.asarray(rng.standard_normal((*b.shape[:1], n.shape[1], tq, sk)), jnp.float32)

    def values(rows: slice, cols: slice):
        at = (q[:, :, rows], k[..., cols])
        if score is None:
            return evaluate_mask(fn, b, n, *at)
        return evaluate_score(fn, score[:, :, rows, cols], b, n, *at)

    r, c = max(1, tq // 2), max(1, sk // 3)  # two blocks of other shapes and offsets
    first = (slice(0, r), slice(0, c))
    second = (slice(r, tq) if r < tq else slice(0, tq), slice(c, sk) if c < sk else slice(0, sk))
    regions = ((slice(0, tq), slice(0, sk)), first, second)
    try:
        with off_mesh(), jax.ensure_compile_time_eval():
            whole, *blocks = [values(*region) for region in regions]
    except Exception as error:  # the user's function: on a smaller block, or at trace time
        try:  # fails abstractly too: not elementwise; else it needs its trace (shard_map's axes)
            for region in regions:
                jax.eval_shape(lambda region=region: values(*region))
        except Exception:
            raise ValueError(
                f"{name} must be elementwise (a cell's value a function of its four "
                f"indices alone), but it fails on a block of the cells: {describe(error)}"
            ) from error
        return
    if any(isinstance(x, jax.core.Tracer) for x in (whole, *blocks)):
        return
    whole = np.broadcast_to(np.asarray(whole), (whole.shape[0], whole.shape[1], tq, sk))
    for (rows, cols), got in zip((first, second), blocks, strict=True):
        want = whole[:, :, rows, cols]
        got = np.broadcast_to(np.asarray(got), want.shape)
        same = (
            np.array_equal(got, want)
            if score is None
            else np.allclose(got, want, rtol=1e-6, atol=1e-6, equal_nan=True)
        )
        if not same:
            raise ValueError(
                f"{name} must be elementwise (a cell's value a function of its four "
                f"indices alone): evaluated on queries {rows.start}..{rows.stop - 1} and "
                f"keys {cols.start}..{cols.stop - 1} alone it gives other values than "
                f"with the rest of the row (a reduction such as max, sum or softmax over "
                f"the scores or positions, or an index past a block, is not elementwise)"
            )


def off_mesh():
    """A context without the caller's mesh, for evaluation at trace time: eager
    arrays made inside ``jax.shard_map`` under ``jax.set_mesh`` would take its manual
    axes."""
    return jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), ()))


def _first_rows(q_offset, rows: int):
    """``q_offset`` for the first ``rows`` batch rows (a per-row offset is cut)."""
    if q_offset is None or isinstance(q_offset, int) or jnp.ndim(q_offset) == 0:
        return q_offset
    return q_offset[:rows]


def evaluate_mask(mask_fn, b, n, q, k):
    """``mask_fn`` on index arrays of one rank, as a boolean array of that rank (an axis
    the function does not depend on may stay 1)."""
    out = jnp.asarray(mask_fn(b, n, q, k)).astype(jnp.bool_)
    return jnp.reshape(out, (1,) * (b.ndim - out.ndim) + out.shape)


def evaluate_score(score_fn, score, b, n, q, k):
    """``score_fn`` on scores and their index arrays, in the scores' dtype and shape."""
    out = jnp.asarray(score_fn(score, b, n, q, k))
    return jnp.broadcast_to(out, score.shape).astype(score.dtype)


def global_heads(mask_fn, score_fn, head_axis, heads: int):
    """``mask_fn`` and ``score_fn`` called with each head's index among all N on a
    device that holds ``heads`` heads of mesh axis ``head_axis`` (None: unchanged). The
    first head's index is computed at each call, in the trace that calls (inside
    ``shard_map``): a ring's backward pass is traced apart from its forward, so a
    closed-over device index would escape its trace."""
    if head_axis is None:
        return mask_fn, score_fn

    def first():
        return jax.lax.axis_index(head_axis) * heads

    def mask(b, n, q, k):
        return mask_fn(b, n + first(), q, k)

    def score(s, b, n, q, k):
        return score_fn(s, b, n + first(), q, k)

    return None if mask_fn is None else mask, None if score_fn is None else score
