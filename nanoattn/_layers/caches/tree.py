"""A decoding step's token tree (speculative decoding, docs/conventions.md "Token
trees"), as the cache policies read it.

A step may bring a tree of drafts instead of a chain: ``tree_parents`` int (B, L), the
same leading axes as the step's x ((1, Tq) for a paged step), gives each token's parent
as an index within its own row's chunk (a paged step: within its own sequence's rows),
-1 for a token whose parent is the last committed token. A token at index i of its
chunk sits at depth ``depth(i)`` (0 for a root), so at position ``committed + depth(i)``
(what RoPE rotates it by), while its key is written in the next free slot, as a chain's
token i would be (position ``committed + i`` of the slot order). Inside the chunk a
query sees its ancestors and itself only; so each query gives what decoding its
root-to-leaf path alone would. The parents of padded tokens are not read.

A parent at or after its child, or below -1, is a bad tree: a one-line ValueError
naming ``tree_parents`` when concrete; under ``jit`` the row (a paged step: the
sequence) is broken as any call a policy cannot serve (NaN outputs, nothing written,
a slot cache's row poisoned). Axis letters: B rows, L chunk length, Tq a paged step's
tokens.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from ..._base.paged import TokenLayout, returned_reads
from ..._base.tree import dense_tree, paged_tree
from ..._base.validate import as_array, expect_integer, expect_shape
from .kv_cache import Rule, is_concrete


class ChunkTree(NamedTuple):
    """A slot cache's step tree.

    Attributes:
      parents: int32 (B, L), the padded tokens' parents -1.
      depth: int32 (B, L), each token's depth (0 on a bad row).
      ancestors: bool (B, L, L): ``ancestors[b, i, j]``, token j is token i or one of
        its ancestors (False on a bad row).
    """

    parents: jax.Array
    depth: jax.Array
    ancestors: jax.Array


def parents_of(tree_parents, shape) -> jax.Array | None:
    """``tree_parents`` as int32 of x's leading axes ``shape`` (B, L), or None."""
    if tree_parents is None:
        return None
    parents = as_array("tree_parents", tree_parents, "an int array (B, T), x's leading axes")
    expect_integer("tree_parents", parents.dtype)
    expect_shape("tree_parents", parents.shape, "B T", tuple(shape))
    return parents.astype(jnp.int32)


def _message(t: int, parent: int, within: int, where: str) -> str:
    return (
        f"tree_parents[{where}]={parent}: a token's parent is -1 (the last committed "
        f"token) or an earlier token of its own chunk, in [-1, {within}) for token {within}"
        + ("" if within == t else f" of its sequence (row {t})")
    )


def slot_tree(parents, real) -> tuple[ChunkTree, Rule]:
    """The :class:`ChunkTree` of a slot cache's step (``parents`` (B, L), ``real`` (B,
    L) its real tokens) and the :class:`~.kv_cache.Rule` of its bad rows."""
    parents = jnp.where(real, parents, -1).astype(jnp.int32)
    L = parents.shape[1]
    bad = (parents < -1) | (parents >= jnp.arange(L)[None])  # (B, L)

    def message(b: int) -> str:
        i = int(np.flatnonzero(np.asarray(bad[b]))[0])
        return _message(i, int(parents[b, i]), i, f"{b}, {i}")

    tree = dense_tree(parents)
    return ChunkTree(parents, tree.depth, tree.ancestors), Rule(bad.any(axis=1), message)


def chunk_view(tree: ChunkTree, start):
    """``view(b, q, key_position) -> (q_pos, k_pos, in_chunk, seen)`` of a slot cache's
    cells, for rules written on slots: the query at slot-order position ``q`` (``start[b]
    + i``, as the core places a chunk's queries) at its tree position ``start[b] +
    depth(i)``, the key at slot-order position ``key_position`` (-1: an empty slot) at
    its tree position inside the chunk (its own before), whether it is in the chunk,
    and whether the query's ancestry holds it (True before the chunk)."""
    L = tree.parents.shape[1]

    def view(b, q, key_position):
        begin = start[b]
        i = jnp.clip(q - begin, 0, L - 1)
        j = key_position - begin
        in_chunk = (j >= 0) & (j < L)
        jj = jnp.clip(j, 0, L - 1)
        q_pos = begin + tree.depth[b, i]
        k_pos = jnp.where(in_chunk, begin + tree.depth[b, jj], key_position)
        return q_pos, k_pos, in_chunk, jnp.where(in_chunk, tree.ancestors[b, i, jj], True)

    return view


class PagedTree(NamedTuple):
    """A paged step's tree, per token row (Tq,).

    Attributes:
      parents: int32 (Tq,), the padding rows' parents -1.
      positions: int32 (Tq,): each row's tree position ``committed + depth`` (0 where
        not real).
      broken: bool (Tq,): the rows of sequences whose tree is bad (only under ``jit``).
    """

    parents: jax.Array
    positions: jax.Array
    broken: jax.Array


def paged_rows(parents, query_starts, layout: TokenLayout) -> PagedTree:
    """The :class:`PagedTree` of a paged step's ``parents`` (1, Tq), each row's parent
    an index within its own sequence's rows; raises ValueError for a bad one when
    concrete."""
    rows = jnp.arange(parents.shape[1], dtype=jnp.int32)
    parents = jnp.where(layout.real, parents[0], -1).astype(jnp.int32)
    first = query_starts.astype(jnp.int32)[layout.sequence]
    within = rows - first
    if all(map(is_concrete, (parents, query_starts, layout.real))):
        bad = np.flatnonzero(np.asarray(layout.real & ((parents < -1) | (parents >= within))))
        if bad.size:
            t = int(bad[0])
            raise ValueError(_message(t, int(parents[t]), int(within[t]), f"0, {t}"))
    tree = paged_tree(parents, layout.sequence, first, layout.real)
    positions = jnp.where(layout.real, layout.position - within + tree.depth, 0)
    return PagedTree(parents, positions.astype(jnp.int32), tree.broken)


def tree_returned_reads(page_table, kv_lengths, layout: TokenLayout, tree: PagedTree,
                        page_size: int, band, sink_tokens: int, hint: str):  # fmt: skip
    """(Tq,) bool: the rows whose tree positions see a page their sequence gave back
    (``returned_reads`` at the tree's positions, which a token's depth puts earlier than
    its slot); raises ValueError naming the entry when concrete."""
    at_depth = layout._replace(position=tree.positions)
    cells = returned_reads(page_table, kv_lengths, at_depth, page_size, band, sink_tokens)
    if is_concrete(cells) and np.asarray(cells).any():
        t, j = (int(i) for i in np.argwhere(np.asarray(cells))[0])
        raise ValueError(
            f"page_table[{int(layout.sequence[t])}, {j}] is a page sequence "
            f"{int(layout.sequence[t])} gave back, but its tree's token at position "
            f"{int(tree.positions[t])} (by depth) sees its keys; {hint}"
        )
    return cells.any(axis=1)
