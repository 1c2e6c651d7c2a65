"""Segment ids across the ring: whether a (query chunk, key chunk) pair can hold a
visible cell at all, from the ranges of its ids.

Query i may see key j only when ``q_segment_ids[b, i] == kv_segment_ids[b, j]``
(docs/conventions.md). If in every batch row the query chunk's ids lie in
``[q_low, q_high]``, the ids of the key chunk's visible keys (those before the
row's key length) in ``[kv_low, kv_high]``, and the two intervals are disjoint,
then no query id equals any key id: the pair is empty (output zeros, log-sum-exp
``-inf``) and the ring skips it without a kernel call. Packed documents (ids sorted
within a row) thus lose the pairs between different documents; unsorted ids give
overlapping ranges and lose nothing, which is still correct. The decision is made
at run time, per step, from the ids that arrived with the keys.

Axis letters (docs/conventions.md): B batch, T query time, S key time (here those of
one chunk, or one shard).
"""

import jax.numpy as jnp


def id_range(ids, valid=None):
    """The smallest and the largest id of each row: ``(low, high)``, both (B,), of
    ``ids`` (B, L) over the positions ``valid`` (B, L) bool leaves (all when None).
    A row with no valid position gives ``low`` the dtype's largest value and ``high``
    its smallest: an empty interval (``low > high``), which meets nothing."""
    info = jnp.iinfo(ids.dtype)
    lows = ids if valid is None else jnp.where(valid, ids, info.max)
    highs = ids if valid is None else jnp.where(valid, ids, info.min)
    return jnp.min(lows, axis=1), jnp.max(highs, axis=1)


def ranges_meet(q_range, kv_range):
    """Whether, in some batch row, the query ids' interval ``q_range`` and the key ids'
    ``kv_range`` (each ``(low, high)``, (B,), from :func:`id_range`) overlap: a bool
    scalar, False only when no query id can equal any key id in any row. An empty
    interval (``low > high``) meets nothing, even an interval holding the dtype's
    extremes."""
    (q_low, q_high), (kv_low, kv_high) = q_range, kv_range
    filled = (q_low <= q_high) & (kv_low <= kv_high)
    return jnp.any(filled & (q_low <= kv_high) & (kv_low <= q_high))


def ids_meet(q_ids, kv_ids, kv_valid=None):
    """Whether queries with ids ``q_ids`` (B, T) can see any key with ids ``kv_ids``
    (B, S) among those ``kv_valid`` (B, S) bool leaves visible (all when None), judged
    by the ranges alone (:func:`ranges_meet`): a bool scalar; None without ids."""
    if q_ids is None:
        return None
    return ranges_meet(id_range(q_ids), id_range(kv_ids, kv_valid))
