"""Keys that no query can see, so that their content is never read.

An unwritten cache slot, padding past ``kv_lengths`` or a key outside every
query's window may hold NaN or inf. A weight of exactly 0 does not protect
the output from it (``0 * NaN = NaN`` in the weighted sum of values, and in
the gradients), so every backend zeroes such keys and values before use. The
test is cheap, O(B * S) from the spec's ingredients, never O(T * S), and
errs on the safe side: a key it keeps may still be blocked for every query
by a combination of rules; a key it zeroes is certainly never visible.
"""

import functools

import jax
import jax.numpy as jnp

from ._spec import AttentionSpec


def _present(q_ids, kv_ids):
    """(B, S) bool: whether kv_ids[b, j] occurs among q_ids[b, :]."""
    ordered = jnp.sort(q_ids, axis=1)  # (B, T)
    where = jax.vmap(jnp.searchsorted)(ordered, kv_ids)  # (B, S)
    where = jnp.minimum(where, ordered.shape[1] - 1)
    return jnp.take_along_axis(ordered, where, axis=1) == kv_ids


def visible_keys(spec: AttentionSpec):
    """Bool (B or 1, S or 1): False where no query of the row can see key j;
    None when every key may be visible."""
    if spec.T == 0:
        return None
    k_pos = jnp.arange(spec.S)
    parts = []
    if spec.kv_lengths is not None:
        parts.append(k_pos < spec.kv_lengths[:, None])
    if spec.band is not None:
        left, right = spec.band
        # The queries sit at q_offset .. q_offset + T - 1, so together they see the
        # keys q_offset - left .. q_offset + T - 1 + right.
        offset = spec.static_q_offset
        if offset is None or offset + spec.T - 1 + right < spec.S - 1:
            last = jnp.reshape(jnp.asarray(spec.q_offset), (-1, 1)) + spec.T - 1 + right
            parts.append(k_pos <= last)
        if left is not None and (offset is None or offset - left > 0):
            first = jnp.reshape(jnp.asarray(spec.q_offset), (-1, 1)) - left
            parts.append(k_pos >= first)
    if spec.mask is not None:
        parts.append(spec.mask.any(axis=(1, 2)))  # (B or 1, S or 1)
    if spec.q_segment_ids is not None:
        parts.append(_present(spec.q_segment_ids, spec.kv_segment_ids))
    return functools.reduce(jnp.logical_and, parts) if parts else None


def hide_unseen_keys(spec: AttentionSpec, key, value=None):
    """Zeroes the keys and values (B, S, K, H) that no query can see."""
    sees = visible_keys(spec)
    if sees is None:
        return key, value
    sees = sees[:, :, None, None]  # (B or 1, S or 1, 1, 1)
    key = jnp.where(sees, key, jnp.zeros((), key.dtype))
    if value is not None:
        value = jnp.where(sees, value, jnp.zeros((), value.dtype))
    return key, value
