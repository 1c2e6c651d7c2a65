"""The check of each rule of a call, one helper per rule: each takes what the caller
gave and the call's sizes, raises a one-line error naming the argument, and returns
what :class:`~nanoattn._base.rules.Rules` keeps (the table of rules,
:mod:`.rule_table`, says which rule uses which helper).

Axis letters (docs/conventions.md): B batch, T query time, S key time, N query heads,
K key/value heads, H head width, Hv the values' head width.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np

from .quantized import is_quantized
from .validate import (
    as_array,
    expect_bool,
    expect_broadcastable,
    expect_floating,
    expect_integer,
    expect_shape,
    lengths_within,
    positive_number,
)

SCORE_AXES = "B N T S"


def normalize_window(window) -> tuple[int, int] | None:
    """A ``window`` argument as ``(left, right)``, or None.

    An int ``w`` means ``(w, w)``; a pair is ``(left, right)``: query at position p may
    see keys at positions ``p - left .. p + right``.

    Raises:
      TypeError: not None, an int or a pair of ints.
      ValueError: a negative side.
    """
    if window is None:
        return None
    pair = (window, window) if isinstance(window, int) and not isinstance(window, bool) else window
    try:
        left, right = pair
    except (TypeError, ValueError):
        raise TypeError(
            f"window must be an int w (meaning (w, w)) or a pair (left, right) of ints, "
            f"got {window!r}"
        ) from None
    for side in (left, right):
        if isinstance(side, bool) or not isinstance(side, (int, np.integer)):
            raise TypeError(
                f"window must be an int w (meaning (w, w)) or a pair (left, right) of ints, "
                f"got {window!r}"
            )
    if left < 0 or right < 0:
        raise ValueError(f"window sides must be >= 0, got (left, right) = ({left}, {right})")
    return int(left), int(right)


def check_soft_cap(cap) -> float | None:
    """A ``logit_soft_cap`` argument as a float > 0, or None (:func:`positive_number`)."""
    return positive_number("logit_soft_cap", cap, optional=True)


def check_sinks(sinks, N: int):
    """``sinks`` as a float array (N,), one logit per query head, or None."""
    if sinks is None:
        return None
    sinks = as_array("sinks", sinks, "a float array (N,), one logit per query head")
    expect_floating("sinks", sinks.dtype)
    expect_shape("sinks", sinks.shape, "N", (N,))
    return sinks


def check_sizes(query, key, value) -> tuple[int, ...]:
    """(B, T, S, N, K, H, Hv) of query (B, T, N, H), key (B, S, K, H) and value
    (B, S, K, Hv) (Hv = H without a value)."""
    query = as_array("query", query, "an array (B, T, N, H)")
    if not is_shape(key):  # a combined cache's half: its shape (rules.combined_cache)
        key = as_array("key", key, "an array (B, S, K, H)")
    expect_shape("query", query.shape, "B T N H", (None,) * 4)
    B, T, N, H = query.shape
    expect_shape("key", key.shape, "B S K H", (B, None, None, H))
    _, S, K, _ = key.shape
    Hv = H
    if value is not None and not is_shape(value):
        value = as_array("value", value, "an array (B, S, K, Hv)")
    if value is not None:
        expect_shape("value", value.shape, "B S K Hv", (B, S, K, None))
        Hv = value.shape[3]
    if K == 0 or N % K != 0:
        raise ValueError(
            f"the number of query heads N={N} must be a multiple of the number of key/value "
            f"heads K={K} (query shape (B, T, N, H) = {query.shape}, key shape "
            f"(B, S, K, H) = {key.shape})"
        )
    for name, x in (("query", query), ("key", key), ("value", value)):
        if x is not None and not (name != "query" and is_quantized(x)):  # scales: make
            expect_floating(name, x.dtype if is_shape(x) else jnp.result_type(x))
    return B, T, S, N, K, H, Hv


def is_shape(x) -> bool:
    """Whether ``x`` stands for an array by its shape and dtype alone
    (``jax.ShapeDtypeStruct``: a combined cache's half, never sliced for a check)."""
    return isinstance(x, jax.ShapeDtypeStruct)


def as_rank4(x):
    return jnp.reshape(x, (1,) * (4 - x.ndim) + x.shape)


def check_scores_array(name: str, x, scores):
    """A dense ``mask`` (boolean) or ``bias`` (floating) broadcastable to the scores
    (B, N, T, S), as rank 4; None when not given."""
    if x is None:
        return None
    kind, expect_dtype = ("boolean", expect_bool) if name == "mask" else ("float", expect_floating)
    x = as_array(name, x, f"a {kind} array broadcastable to (B, N, T, S)")
    expect_dtype(name, x.dtype)
    expect_broadcastable(name, x.shape, SCORE_AXES, scores)
    return as_rank4(x)


def check_lengths(kv_lengths, B: int, most: int):
    """``kv_lengths`` as an int array (B,) of values in [0, ``most``] (S, or the whole
    sequence of a ring) when concrete; a traced one's rows outside it are made NaN
    (:meth:`Rules.broken_rows`)."""
    if kv_lengths is None:
        return None
    kv_lengths = as_array("kv_lengths", kv_lengths, "an int array (B,)")
    expect_integer("kv_lengths", kv_lengths.dtype)
    expect_shape("kv_lengths", kv_lengths.shape, "B", (B,))
    lengths_within("kv_lengths", kv_lengths, most)
    return kv_lengths


def check_segments(q_ids, kv_ids, B: int, T: int, S: int):
    if (q_ids is None) != (kv_ids is None):
        raise ValueError(
            "q_segment_ids and kv_segment_ids go together: pass both (for self-attention "
            "over packed sequences, the same ids twice) or neither"
        )
    if q_ids is None:
        return None, None
    q_ids = as_array("q_segment_ids", q_ids, "an int array (B, T)")
    kv_ids = as_array("kv_segment_ids", kv_ids, "an int array (B, S)")
    expect_integer("q_segment_ids", q_ids.dtype)
    expect_integer("kv_segment_ids", kv_ids.dtype)
    expect_shape("q_segment_ids", q_ids.shape, "B T", (B, T))
    expect_shape("kv_segment_ids", kv_ids.shape, "B S", (B, S))
    return q_ids, kv_ids


def split_scale(scale, H: int):
    """(fixed, traced): a checked scale (``check_scale`` upstream) as a Python number
    or as an array; the default ``1 / sqrt(H)`` when None."""
    if scale is None:
        if H == 0:
            raise ValueError(
                "the head width H is 0, so the default scale 1 / sqrt(H) does not exist: "
                "pass scale= (or heads of width >= 1)"
            )
        return 1.0 / math.sqrt(H), None
    if isinstance(scale, (int, float, np.floating, np.integer)):
        return scale, None
    return None, scale


def check_q_offset(q_offset, B: int, T: int, S: int, is_causal: bool, window, indexed: bool):
    """The offset of a call: an int, an int array () or (B,), or None."""
    if not is_causal and window is None and not indexed and q_offset is not None:
        raise ValueError(
            "q_offset only applies to causal or windowed attention, or to the positions "
            "mask_fn and score_fn see; pass is_causal=True, a window, mask_fn or score_fn"
        )
    if is_causal or window is not None:
        what = "is_causal=True" if is_causal else f"window={window}"
    elif q_offset is not None:  # positions for mask_fn and score_fn only: 0 by default
        what = "mask_fn or score_fn"
    else:
        return None
    if q_offset is None:
        if T != S:
            raise ValueError(
                f"{what} with T={T} queries and S={S} keys needs q_offset, the "
                f"position of the first query: q_offset=0 aligns the queries top-left "
                f"(query i sits at key position i, as jax.nn and PyTorch's is_causal), "
                f"q_offset=S-T={S - T} aligns them bottom-right (the last query sits at the "
                f"last key, as FlashAttention and decoding with a KV cache)"
            )
        return 0
    kind = "an int or an int array"
    if isinstance(q_offset, bool):
        raise TypeError(f"q_offset must be {kind}, got bool {q_offset!r}")
    if isinstance(q_offset, int):
        return q_offset
    q_offset = as_array("q_offset", q_offset, kind)
    expect_integer("q_offset", q_offset.dtype)
    if q_offset.ndim != 0:
        expect_shape("q_offset", q_offset.shape, "B", (B,))
    return q_offset
