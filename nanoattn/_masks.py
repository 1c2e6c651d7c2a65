"""Boolean mask builders. True means "may attend"; see docs/conventions.md.

Masks broadcast against attention scores of shape (B, N, T, S): B batch,
N query heads, T query time, S key/value time.
"""

import functools

import jax.numpy as jnp
import numpy as np

from ._validate import expect_bool, expect_integer, expect_shape


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
    kv_len = q_len if kv_len is None else kv_len
    if q_len < 0 or kv_len < 0:
        raise ValueError(f"causal_mask lengths must be >= 0, got q_len={q_len}, kv_len={kv_len}")
    offset = jnp.asarray(q_offset)
    expect_integer("q_offset", offset.dtype)
    if offset.ndim > 1:
        raise ValueError(f"q_offset must have shape () or (B,), got {offset.shape}")
    q_pos = offset[..., None] + jnp.arange(q_len)  # (T,) or (B, T)
    k_pos = jnp.arange(kv_len)  # (S,)
    return k_pos <= q_pos[..., None]


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
    return jnp.arange(max_len) < lengths[:, None]


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
    return functools.reduce(jnp.logical_and, present)
