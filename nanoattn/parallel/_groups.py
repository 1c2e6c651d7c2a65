"""Data-parallel groups of a paged server (docs/parallel.md, "Serving on a mesh"): each
group has its own ``PageAllocator`` and its own pool, and one step serves every group at
once under ``jax.shard_map`` over the data axis. :func:`concat_batches` lays the groups'
batches end to end, as ``shard_map`` cuts them; :func:`cache_shardings` places a
cache's arrays: pools (and dense caches) split by groups on their first axis and by
heads on K. Axis letters: G groups, B sequences (rows) of a group's batch, M pages per
sequence at most, C copies, P pages of a group's pool, S slots of a dense cache's row, K
key/value heads, H head width.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from ._paged import check_heads

_ALIKE = (
    "make every group's allocator alike (max_sequences, max_pages) and its batch with the "
    "same tokens="
)


def concat_batches(batches):
    """The paged batches of G groups (``PageAllocator.batch`` of each group's allocator,
    made alike: the same ``max_sequences``, ``max_pages``, copies and pool) as one
    batch, every array end to end: page_table (G B, M), kv_lengths (G B,),
    query_starts (G (B + 1),) (each group's own, from 0), copies (G C, 2), ...; its
    static fields (``page_size``, ``pool_pages``) are a group's. Under
    ``jax.shard_map`` over the data axis (in_specs ``PartitionSpec(data_axis)``) each
    device gets its group's batch.

    Raises:
      ValueError: no batch, or batches of different shapes, page sizes or pools.
    """
    batches = list(batches)
    if not batches:
        raise ValueError("concat_batches needs the batch of at least one group, got none")
    first, joined = batches[0], {}
    for field in dataclasses.fields(first):
        values = [getattr(batch, field.name) for batch in batches]
        if field.metadata.get("static") or values[0] is None:  # None: a batch without it
            _check_alike(field.name, values, "every group's pool is alike")
        else:
            shapes = [np.shape(x) for x in values]
            _check_alike(field.name, shapes, _ALIKE)
            joined[field.name] = np.concatenate([np.asarray(x) for x in values])
    return dataclasses.replace(first, **joined)


def _check_alike(name: str, values, hint: str) -> None:
    for g, value in enumerate(values):
        if value != values[0]:
            raise ValueError(
                f"batches[{g}].{name} is {value}, batches[0].{name} {values[0]}: {hint}"
            )


def cache_shardings(cache, mesh, *, head_axis=None, data_axis=None):
    """The ``NamedSharding`` of every array of a KV cache (a pytree: a linen ``"cache"``
    collection, an ``nnx.State`` of ``nnx.Cache``, or a list of its arrays) on
    ``mesh``: a pool (G P, page_size, K, H) (a combined one (G P, page_size, 2, K,
    H)) or a dense cache (B, S, K, H) split by
    groups on its first axis (``data_axis``) and by heads on K (``head_axis``), their
    scales (..., K) alike, a dense cache's positions (B,) by groups, and arrays of no
    element (a paged cache's empty positions) replicated.

    Raises:
      ValueError: an axis that is not the mesh's, or a ``head_axis`` whose size does not
        divide the cache's K (a latent cache has one head: it shards by groups only).
    """
    for name, axis in (("head_axis", head_axis), ("data_axis", data_axis)):
        if axis is not None and axis not in mesh.shape:
            raise ValueError(
                f"{name}={axis!r} is not an axis of the mesh, whose axes are {tuple(mesh.shape)}"
            )

    def sharding(x):
        shape = jnp.shape(x)
        if not shape or 0 in shape:
            return NamedSharding(mesh, PartitionSpec())
        if len(shape) == 5:  # a combined pool (G P, page_size, 2, K, H)
            check_heads(mesh, head_axis, shape[3])
            return NamedSharding(mesh, PartitionSpec(data_axis, None, None, head_axis, None))
        if len(shape) >= 3:
            check_heads(mesh, head_axis, shape[2])
            heads = (head_axis,) if len(shape) == 3 else (head_axis, None)
            return NamedSharding(mesh, PartitionSpec(data_axis, None, *heads))
        return NamedSharding(mesh, PartitionSpec(data_axis))

    return jax.tree.map(sharding, cache)
