"""The arguments of ``jax.nn.dot_product_attention``, checked as it checks them, for
:func:`nanoattn.jax_nn_attention`.

jax.nn takes every array with up to four axes and puts ones in front of the missing
ones: query (T, N, H) is (1, T, N, H), a mask (T, S) is (1, 1, T, S). It checks that
query, key and value share one dtype, that the mask is boolean, that the sequence
lengths are int32 of shape (B,). :func:`checked` does the same and raises a one-line
ValueError naming the argument where jax.nn raises, and so do :func:`check_window`
and :func:`check_implementation` for the two things nanoattn cannot serve: a window
side below 0 and an implementation name that is not jax.nn's. The rest (a mask or
bias that does not broadcast to (B, N, T, S), where jax.nn fails with an
AssertionError or a TypeError; N not a multiple of K) the core checks, with the
same kind of message.

Axis letters (docs/conventions.md): B batch, T query time, S key time, N query heads,
K key/value heads, H head width.
"""

import dataclasses

import jax
import numpy as np

from .._base.validate import as_array, lengths_within

# jax.nn's names for ``implementation`` (or None); nanoattn.dot_product_attention takes its own.
IMPLEMENTATIONS = ("xla", "cudnn")


@dataclasses.dataclass(frozen=True)
class Arrays:
    """One call's arrays with four axes, as jax.nn makes them.

    Attributes:
      query: (B, T, N, H); key, value: (B, S, K, H), one dtype for the three.
      bias: broadcastable to (B, N, T, S), rank 4, or None.
      mask: boolean, broadcastable to (B, N, T, S), rank 4, or None.
      q_lengths, kv_lengths: int32 (B,), or None.
      shape: the query's shape as given, which the output takes again.
    """

    query: jax.Array
    key: jax.Array
    value: jax.Array
    bias: jax.Array | None
    mask: jax.Array | None
    q_lengths: jax.Array | None
    kv_lengths: jax.Array | None
    shape: tuple[int, ...]


def check_implementation(implementation) -> None:
    """Raises a one-line ValueError unless ``implementation`` is one of jax.nn's names."""
    if not (
        implementation is None
        or (isinstance(implementation, str) and implementation in IMPLEMENTATIONS)
    ):
        raise ValueError(
            "implementation must be None, 'xla' or 'cudnn', as in jax.nn.dot_product_attention "
            f"(nanoattn's backends are named in nanoattn.dot_product_attention), "
            f"got {implementation!r}"
        )


def check_window(local_window_size) -> tuple[int, int] | None:
    """``local_window_size`` as ``(left, right)`` (an int ``w`` is ``(w, w)``), or None.

    Raises:
      ValueError: not an int or a pair of ints, or a side below 0 (jax.nn takes one,
        a band that leaves the diagonal out; nanoattn's window cannot express it).
    """
    if local_window_size is None:
        return None
    what = "an int w (meaning (w, w)) or a pair (left, right) of ints >= 0"
    pair = local_window_size
    if isinstance(pair, (int, np.integer)) and not isinstance(pair, bool):
        pair = (pair, pair)
    if not (isinstance(pair, (tuple, list)) and len(pair) == 2) or any(
        isinstance(side, bool) or not isinstance(side, (int, np.integer)) for side in pair
    ):
        raise ValueError(f"local_window_size must be {what}, got {local_window_size!r}")
    left, right = (int(side) for side in pair)
    if left < 0 or right < 0:
        raise ValueError(
            f"local_window_size must be {what}, got {local_window_size!r}: a side below 0 "
            "(a band without the diagonal) is not served here; pass that band as mask"
        )
    return left, right


def checked(query, key, value, bias, mask, query_seq_lengths, key_value_seq_lengths) -> Arrays:
    """jax.nn's arrays with four axes, checked as jax.nn checks them.

    Raises:
      ValueError: an array with more than four axes, a value whose shape is not the
        key's, a query whose B or H is not the key's, query, key and value of
        different dtypes, a mask that is not boolean, sequence lengths that are not
        int32 (B,): one line naming the argument, the expected and the actual.
      TypeError: an argument that is not an array (a string, None), naming it.
    """
    query = as_array("query", query, "an array (B, T, N, H) or (T, N, H)")
    q = _rank4("query", query, "(B, T, N, H) or (T, N, H)")
    k = _rank4("key", key, "(B, S, K, H) or (S, K, H)")
    v = _rank4("value", value, "(B, S, K, H) or (S, K, H)")
    B, _, _, H = k.shape
    if v.shape != k.shape:
        raise ValueError(
            f"value must have the shape of key, (B, S, K, H) = {k.shape}, got {v.shape}"
        )
    if q.shape[0] != B or q.shape[3] != H:
        raise ValueError(
            f"query must have shape (B, T, N, H) = ({B}, *, *, {H}) to match key (B, S, K, H) "
            f"= {k.shape}, got {q.shape}"
        )
    if not q.dtype == k.dtype == v.dtype:
        raise ValueError(
            f"query, key and value must have one dtype, got {q.dtype}, {k.dtype} and {v.dtype}"
        )
    if mask is not None:
        mask = _rank4("mask", mask, "broadcastable to (B, N, T, S) or (N, T, S)")
        if mask.dtype != np.bool_:
            raise ValueError(
                f"mask must be boolean (True = may attend), got dtype {mask.dtype}; an "
                "additive mask goes in bias"
            )
    if bias is not None:
        bias = _rank4("bias", bias, "broadcastable to (B, N, T, S) or (N, T, S)")
    q_lengths = _lengths("query_seq_lengths", query_seq_lengths, B, q.shape[1])
    kv_lengths = _lengths("key_value_seq_lengths", key_value_seq_lengths, B, k.shape[1])
    return Arrays(q, k, v, bias, mask, q_lengths, kv_lengths, query.shape)


def _rank4(name: str, x, layout: str):
    """``x`` as an array with four axes, ones put in front (jax.nn's ``_ensure_4d``)."""
    x = as_array(name, x, f"an array {layout}")
    if x.ndim > 4:
        raise ValueError(f"{name} must be {layout}, got an array of shape {x.shape}")
    return x.reshape((1,) * (4 - x.ndim) + x.shape)


def _lengths(name: str, lengths, B: int, most: int):
    """A sequence-length argument: None, or an int32 array (B,) of values in [0, most]
    when concrete (a traced one's rows outside it are made NaN by the caller)."""
    if lengths is None:
        return None
    lengths = as_array(name, lengths, "an int32 array (B,)")
    if lengths.shape != (B,) or lengths.dtype != np.int32:
        raise ValueError(
            f"{name} must be an int32 array of shape (B,) = ({B},), got {lengths.dtype} "
            f"of shape {lengths.shape}"
        )
    lengths_within(name, lengths, most)
    return lengths
