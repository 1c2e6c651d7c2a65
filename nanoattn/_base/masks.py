"""Boolean mask builders. True means "may attend"; see docs/conventions.md.

Masks broadcast against attention scores of shape (B, N, T, S): B batch,
N query heads, T query time, S key/value time.
"""

import functools

import jax.numpy as jnp
import numpy as np

from .rules import normalize_window
from .validate import expect_bool, expect_integer, expect_shape, expect_size


def causal_mask(q_len: int, kv_len: int | None = None, *, q_offset=0) -> jnp.ndarray:
    """The positional causal mask: query i may see key j iff ``j <= q_offset + i``.

    Query i sits at position ``q_offset + i`` and key j at position j. With
    ``q_offset=0`` the triangle is aligned top-left (as ``jax.nn`` and PyTorch's
    ``is_causal``); with ``q_offset = kv_len - q_len`` it is aligned
    bottom-right (as FlashAttention, and decoding with a KV cache).

    Args:
      q_len: T, the number of queries.
      kv_len: S, the number of keys; defaults to ``q_len``.
      q_offset: position of the first query: an int, or an integer array of
        shape () or (B,) (one offset per batch row).

    Returns:
      A boolean array of shape (T, S), or (B, T, S) for a (B,) offset.

    Example:
      >>> import numpy as np
      >>> np.asarray(causal_mask(3)).astype(int)
      array([[1, 0, 0],
             [1, 1, 0],
             [1, 1, 1]])
    """
    return band_mask(q_len, kv_len, None, 0, q_offset=q_offset)


def window_mask(q_len: int, kv_len: int | None = None, *, window, q_offset=0) -> jnp.ndarray:
    """The local-attention mask: query i may see key j iff ``p - left <= j <= p + right``
    with ``p = q_offset + i``.

    ``window`` is an int ``w`` (meaning ``(w, w)``) or a pair ``(left, right)``.
    AND it with :func:`causal_mask` for causal local attention (or pass both
    ``is_causal=True`` and ``window`` to the attention functions).

    Returns:
      A boolean array of shape (T, S), or (B, T, S) for a (B,) offset.

    Example:
      >>> np.asarray(window_mask(4, window=(1, 0))).astype(int)
      array([[1, 0, 0, 0],
             [1, 1, 0, 0],
             [0, 1, 1, 0],
             [0, 0, 1, 1]])
    """
    if window is None:
        raise TypeError(
            "window must be an int w (meaning (w, w)) or a pair (left, right), got None"
        )
    left, right = normalize_window(window)
    return band_mask(q_len, kv_len, left, right, q_offset=q_offset)


def band_mask(q_len: int, kv_len: int | None, left, right, *, q_offset) -> jnp.ndarray:
    """Query i (at ``p = q_offset + i``) may see key j iff ``p - left <= j <= p + right``;
    ``left`` or ``right`` None leaves that side unbounded. Shape (T, S) or (B, T, S)."""
    q_len = expect_size("q_len", q_len)
    kv_len = q_len if kv_len is None else expect_size("kv_len", kv_len)
    offset = jnp.asarray(q_offset)
    expect_integer("q_offset", offset.dtype)
    if offset.ndim > 1:
        raise ValueError(f"q_offset must have shape () or (B,), got {offset.shape}")
    steps = jnp.arange(q_len).reshape((1,) * offset.ndim + (q_len,))  # (T,) or (1, T)
    q_pos = (offset[..., None] + steps)[..., None]  # (T, 1) or (B, T, 1)
    k_pos = jnp.arange(kv_len).reshape((1,) * offset.ndim + (1, kv_len))  # (1, S) or (1, 1, S)
    sees = jnp.ones((*q_pos.shape[:-1], kv_len), bool)
    if left is not None:
        sees &= k_pos >= q_pos - left
    if right is not None:
        sees &= k_pos <= q_pos + right
    return sees


def segment_mask(q_segment_ids, kv_segment_ids=None) -> jnp.ndarray:
    """Packed sequences: query i may see key j iff their segment ids are equal.

    Args:
      q_segment_ids: integer (B, T).
      kv_segment_ids: integer (B, S); defaults to ``q_segment_ids``
        (self-attention).

    Returns:
      Boolean (B, 1, T, S).

    Example:
      >>> ids = np.array([[0, 0, 1]])
      >>> np.asarray(segment_mask(ids))[0, 0].astype(int)
      array([[1, 1, 0],
             [1, 1, 0],
             [0, 0, 1]])
    """
    q_ids = jnp.asarray(q_segment_ids)
    kv_ids = q_ids if kv_segment_ids is None else jnp.asarray(kv_segment_ids)
    expect_integer("q_segment_ids", q_ids.dtype)
    expect_integer("kv_segment_ids", kv_ids.dtype)
    expect_shape("q_segment_ids", q_ids.shape, "B T", (None, None))
    expect_shape("kv_segment_ids", kv_ids.shape, "B S", (q_ids.shape[0], None))
    return (q_ids[:, :, None] == kv_ids[:, None, :])[:, None]


def lengths_to_valid(lengths, max_len: int) -> jnp.ndarray:
    """Turns valid-token counts into a boolean valid-position mask.

    Args:
      lengths: integer array of shape (B,); position j of row b is valid iff
        ``j < lengths[b]``.
      max_len: the padded length (S or T).

    Returns:
      A boolean array of shape (B, max_len).

    Example:
      >>> np.asarray(lengths_to_valid(np.array([3, 1]), 4)).astype(int)
      array([[1, 1, 1, 0],
             [1, 0, 0, 0]])
    """
    lengths = jnp.asarray(lengths)
    expect_integer("lengths", lengths.dtype)
    expect_shape("lengths", lengths.shape, "B", (None,))
    if lengths.dtype.itemsize < 4:  # int8 and friends: exact in int32, which holds max_len
        lengths = lengths.astype(jnp.int32)
    # Positions in the lengths' own type: no promotion (jax's strict mode refuses one
    # between int64 positions and int32 lengths under x64).
    positions = jnp.arange(expect_size("max_len", max_len), dtype=lengths.dtype)
    return positions[None, :] < lengths[:, None]


def padding_mask(kv_valid, q_valid=None) -> jnp.ndarray:
    """A padding mask from valid-token flags.

    Args:
      kv_valid: boolean (B, S), True at real (non-placeholder) keys.
      q_valid: optional boolean (B, T), True at real queries. A padded query
        then sees nothing, so its output row is zeros.

    Returns:
      Boolean (B, 1, 1, S), or (B, 1, T, S) when ``q_valid`` is given.
    """
    kv_valid = jnp.asarray(kv_valid)
    expect_bool("kv_valid", kv_valid.dtype)
    expect_shape("kv_valid", kv_valid.shape, "B S", (None, None))
    if q_valid is None:
        return kv_valid[:, None, None, :]
    q_valid = jnp.asarray(q_valid)
    expect_bool("q_valid", q_valid.dtype)
    expect_shape("q_valid", q_valid.shape, "B T", (kv_valid.shape[0], None))
    return q_valid[:, None, :, None] & kv_valid[:, None, None, :]


def combine_masks(*masks):
    """ANDs the masks that are not None; returns None when all are None.

    Every mask must be boolean; shapes broadcast with numpy rules.
    """
    present = [jnp.asarray(m) for m in masks if m is not None]
    if not present:
        return None
    for i, m in enumerate(present):
        expect_bool(f"mask {i}", m.dtype)
    try:
        np.broadcast_shapes(*(m.shape for m in present))
    except ValueError:
        shapes = ", ".join(str(m.shape) for m in present)
        raise ValueError(f"masks must broadcast together, got shapes {shapes}") from None
    rank = max(m.ndim for m in present)  # numpy's broadcasting, written out (rank promotion)
    present = [m.reshape((1,) * (rank - m.ndim) + m.shape) for m in present]
    return functools.reduce(jnp.logical_and, present)
