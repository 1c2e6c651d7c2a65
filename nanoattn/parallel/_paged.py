"""Paged attention on a mesh (docs/parallel.md, "Serving on a mesh"): the sequences of
data-parallel groups split over one mesh axis, each group with a pool and a page table
of its own, and the heads over another, each device reading only its heads' slice of
every page of its group's pool. Every device runs ``nanoattn.paged_attention`` on its
own arrays under ``jax.shard_map``, so no key or value moves between devices, on every
backend.

The arrays of G groups lie end to end along their first axis, as ``shard_map`` cuts
them (G, the size of the data axis): group g's queries are rows g Tq .. (g + 1) Tq - 1,
its pool pages g P .. (g + 1) P - 1, its page table rows g B .. (g + 1) B - 1 (entries
are pages of its own pool: 0 .. P - 1), its query starts entries g (B + 1) .. (g + 1)
(B + 1) - 1 (from 0, as one group's). Axis letters: G groups, Tq query tokens of a
group, B sequences of a group, P pages of a group's pool, M pages per sequence at most,
N query heads, K key/value heads, H head width.
"""

import jax
import numpy as np
from jax.sharding import PartitionSpec

from .._base.mask_fn import global_heads
from .._base.validate import expect_shape
from .._core.paged import paged_attention
from ._ring import _place

# The keywords whose arrays follow the heads or the groups, by the roles of their axes.
_ARRAY_SPECS = {
    "sinks": ("heads",),
    "key_scales": ("groups", None, "heads"),
    "value_scales": ("groups", None, "heads"),
    "tree_parents": ("groups",),
    "key_indices": ("groups", None),
    "shared_prefixes": ("groups",),
}


def sharded_paged_attention(query, key_pages, value_pages, page_table, kv_lengths, query_starts,
                            *, data_axis=None, head_axis=None, mesh=None, **rules):  # fmt: skip
    r"""``nanoattn.paged_attention`` of G data-parallel groups, each with its own pool,
    page table and sequences, split over ``data_axis``, and with the heads split over
    ``head_axis``: each device attends its group's sequences with its heads (N / M
    query heads and their K / M key/value heads, M the size of ``head_axis``) over its
    slice of its group's pool, and nothing moves between devices.

    Args:
      query: (G Tq, N, H), the groups' queries end to end (the module's layout).
      key_pages, value_pages: (G P, page_size, K, H): group g's pool is pages
        g P .. (g + 1) P - 1.
      page_table: int (G B, M): group g's sequences are rows g B .. (g + 1) B - 1,
        their entries pages of the group's own pool (0 .. P - 1, or -1).
      kv_lengths: int (G B,).
      query_starts: int (G (B + 1),): each group's own starts (from 0, up to Tq).
      data_axis: the mesh axis of the G groups (None: one group, G = 1).
      head_axis: the mesh axis the heads are split over (None: every device holds
        every head); its size must divide K.
      mesh: a ``jax.sharding.Mesh``, or None for the mesh set with ``jax.set_mesh``.
      **rules: the keywords of :func:`nanoattn.paged_attention`: ``sinks`` (N,) are
        split with the heads, ``key_scales`` and ``value_scales`` (G P, page_size, K)
        with the pool, ``tree_parents`` (G Tq,) and ``key_indices`` (G Tq, k) with the
        queries, ``shared_prefixes`` (G B,) with the page table (each group's own
        groups); ``mask_fn(b, n, q_pos, k_pos)`` and ``score_fn`` see b, the sequence's
        row in its group's page table, and n, the query head's index among all N.

    Returns:
      (G Tq, N, H) in the query's dtype, sharded over ``data_axis`` and ``head_axis``
      as the query; with ``return_residual`` also the log-sum-exp (G Tq, N).

    Raises:
      ValueError: an axis that is not the mesh's, the two the same, a ``head_axis``
        whose size does not divide K (one line naming the axis and K; a pool of one
        head, as the latent layer's, shards by groups only), or arrays whose first
        axis is not G groups end to end; and what ``paged_attention`` raises.
    """
    if data_axis is None and head_axis is None:
        return paged_attention(query, key_pages, value_pages, page_table, kv_lengths,
                               query_starts, **rules)  # fmt: skip
    mesh = _mesh_of(mesh, data_axis, head_axis)
    expect_shape("key_pages", np.shape(key_pages), "P page_size K H", (None,) * 4)
    check_heads(mesh, head_axis, np.shape(key_pages)[2])
    arrays = (query, key_pages, value_pages, page_table, kv_lengths, query_starts)
    groups = 1 if data_axis is None else mesh.shape[data_axis]
    _check_groups(groups, data_axis, arrays)
    roles = {"groups": data_axis, "heads": head_axis, None: None}
    given = {name: rules.pop(name) for name in _ARRAY_SPECS if rules.get(name) is not None}
    specs = {name: PartitionSpec(*(roles[r] for r in _ARRAY_SPECS[name])) for name in given}
    rows, pool = PartitionSpec(data_axis, head_axis), PartitionSpec(data_axis, None, head_axis)
    in_specs = (rows, pool, pool, *(PartitionSpec(data_axis),) * 3, specs)
    mask_fn, score_fn = rules.pop("mask_fn", None), rules.pop("score_fn", None)
    heads = np.shape(query)[1] // (1 if head_axis is None else mesh.shape[head_axis])

    def local(q, key_pages, value_pages, table, lengths, starts, given):
        shifted = global_heads(mask_fn, score_fn, head_axis, heads)
        return paged_attention(q, key_pages, value_pages, table, lengths, starts, **rules,
                               **given, mask_fn=shifted[0], score_fn=shifted[1])  # fmt: skip

    out_specs = (rows, rows) if rules.get("return_residual") else rows
    placed = [_place(x, mesh, spec) for x, spec in zip(arrays, in_specs, strict=False)]
    placed.append({name: _place(x, mesh, specs[name]) for name, x in given.items()})
    axes = {a for a in (data_axis, head_axis) if a is not None}
    call = jax.shard_map(local, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                         axis_names=axes)  # fmt: skip
    return call(*placed)


def _mesh_of(mesh, data_axis, head_axis):
    """The mesh to run on (given, or the one set with ``jax.set_mesh``), its axes checked."""
    if mesh is None:
        mesh = jax.sharding.get_abstract_mesh()
        if mesh.empty:
            raise ValueError(
                "data_axis and head_axis name axes of a mesh: pass mesh= or set one with "
                "jax.set_mesh"
            )
    elif not isinstance(mesh, jax.sharding.Mesh | jax.sharding.AbstractMesh):
        raise TypeError(f"mesh must be a jax.sharding.Mesh or None, got {mesh!r}")
    for name, axis in (("data_axis", data_axis), ("head_axis", head_axis)):
        if axis is not None and axis not in mesh.shape:
            raise ValueError(
                f"{name}={axis!r} is not an axis of the mesh, whose axes are {tuple(mesh.shape)}"
            )
    if data_axis is not None and data_axis == head_axis:
        raise ValueError(f"data_axis and head_axis must be different mesh axes, got {data_axis!r}")
    return mesh


def check_heads(mesh, head_axis, K: int) -> None:
    """Raises ValueError when the size of ``head_axis`` does not divide the K key/value
    heads of a pool (one line naming the axis and K)."""
    if head_axis is None or K % mesh.shape[head_axis] == 0:
        return
    M = mesh.shape[head_axis]
    latent = (
        " (a pool of one head, as the latent layer's, shards by sequences only: data_axis)"
        if K == 1
        else ""
    )
    raise ValueError(
        f"head_axis={head_axis!r} has {M} devices, which must divide the pool's key/value "
        f"heads K={K}{latent}"
    )


_NAMES = ("query", "key_pages", "value_pages", "page_table", "kv_lengths", "query_starts")


def _check_groups(G: int, data_axis, arrays) -> None:
    """Raises ValueError unless every array's first axis holds G groups alike (the
    query starts: B + 1 entries a group, B the page table's rows a group)."""
    for name, x in zip(_NAMES, arrays, strict=True):
        if np.ndim(x) < 1 or np.shape(x)[0] % G:
            raise ValueError(
                f"{name} {np.shape(x)}: its first axis must hold the {G} groups of "
                f"data_axis={data_axis!r} end to end (a multiple of {G})"
            )
    B = np.shape(arrays[3])[0] // G
    if np.shape(arrays[5])[0] != G * (B + 1):
        raise ValueError(
            f"query_starts {np.shape(arrays[5])}: each of the {G} groups of data_axis="
            f"{data_axis!r} has B + 1 = {B + 1} starts (page_table's {B} rows a group), "
            f"{G * (B + 1)} in all"
        )
