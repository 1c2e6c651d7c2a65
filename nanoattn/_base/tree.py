"""The tree rule (speculative decoding with token trees): a call's chunk of queries is a
tree of drafts, each query token naming its parent within the chunk.

``tree_parents`` is int (B, T) for a dense call, (Tq,) for a paged one: the index,
within its own row's (or sequence's) chunk, of each query token's parent, -1 for a
token whose parent is the last committed token. A chunk's token i sits at depth
``depth(i)`` (0 for a root, one more than its parent's otherwise), so at position
``committed + depth(i)`` (``committed``: a dense row's ``q_offset``, a paged sequence's
``kv_lengths - q_len``), while its key sits in slot ``committed + i``. Inside the chunk a
query sees exactly its ancestors and itself; a key before the chunk is seen as the
other rules say at those positions (causality, windows, ``mask_fn``, ``score_fn``), so
each query gives what decoding its root-to-leaf path alone would.

A parent at or after its child, or outside the chunk (another sequence's), is an invalid
tree: one line naming it when concrete, NaN rows under ``jit``. Axis letters: B rows,
T (Tq) query tokens.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from .validate import as_array, expect_integer, expect_shape


class Tree(NamedTuple):
    """A tree's ancestry and depths, traced or not.

    Attributes:
      ancestors: bool (..., T, T): ``ancestors[..., i, j]``, token j is token i or one of
        its ancestors (False on a broken row).
      depth: int32 (..., T), each token's depth (0 on a broken row).
      broken: bool (..., T): tokens whose chain of parents is invalid.
    """

    ancestors: jax.Array
    depth: jax.Array
    broken: jax.Array


def check_tree(parents, shape: tuple, axes: str):
    """``tree_parents`` as an int32 array of ``shape`` (named ``axes``), or None; when
    concrete, each parent in [-1, i) for token i (dense rows; a paged call's parents are
    checked against its sequences by :func:`check_paged_tree`)."""
    if parents is None:
        return None
    parents = as_array("tree_parents", parents, f"an int array ({', '.join(axes.split())})")
    expect_integer("tree_parents", parents.dtype)
    expect_shape("tree_parents", parents.shape, axes, shape)
    parents = parents.astype(jnp.int32)
    if len(shape) == 2 and not isinstance(parents, jax.core.Tracer):
        values = np.asarray(parents)
        bad = np.argwhere((values < -1) | (values >= np.arange(values.shape[1])[None]))
        if bad.size:
            b, i = (int(x) for x in bad[0])
            raise ValueError(
                f"tree_parents[{b}, {i}]={int(values[b, i])}: a token's parent is -1 (the "
                f"last committed token) or an earlier token of its chunk, in [-1, {i})"
            )
    return parents


def check_paged_tree(parents, query_starts) -> None:
    """Raises ValueError, when both are concrete, for a paged call's token whose parent
    is not -1 or an earlier token of its own sequence's chunk."""
    if parents is None or any(isinstance(x, jax.core.Tracer) for x in (parents, query_starts)):
        return
    values, starts = np.asarray(parents), np.asarray(query_starts)
    within = _index_within(starts, values.shape[0])
    real = np.arange(values.shape[0]) < starts[-1]  # padding rows' parents are not read
    bad = np.flatnonzero(real & ((values < -1) | (values >= within)))
    if bad.size:
        t = int(bad[0])
        raise ValueError(
            f"tree_parents[{t}]={int(values[t])}: row {t} is token {int(within[t])} of its "
            f"sequence's chunk, whose parent is -1 (the last committed token) or an earlier "
            f"token of the same chunk, in [-1, {int(within[t])})"
        )


def _index_within(starts: np.ndarray, Tq: int) -> np.ndarray:
    """Each row's index within its sequence's rows (rows past the last start: their
    index from it)."""
    rows = np.arange(Tq)
    first = starts[np.clip(np.searchsorted(starts, rows, side="right") - 1, 0, len(starts) - 1)]
    return rows - first


def dense_tree(parents) -> Tree:
    """The :class:`Tree` of each row of a dense call's parents (B, T)."""
    return jax.vmap(_tree)(parents)


def paged_tree(parents, sequence, first_row, real) -> Tree:
    """The :class:`Tree` of a paged call's parents (Tq,), rows of a sequence being a chunk:
    ``sequence`` (Tq,) each row's sequence, ``first_row`` (Tq,) the index of its
    sequence's first row, ``real`` (Tq,) the rows that belong to a sequence. A parent
    index is read within the row's own chunk (row ``first_row + parent``)."""
    Tq = parents.shape[0]
    rows = jnp.arange(Tq, dtype=jnp.int32)
    within = rows - first_row
    valid = (parents >= -1) & (parents < within)
    glob = jnp.where(parents >= 0, first_row + parents, -1)  # the parent's row, -1: a root
    tree = _tree(jnp.where(valid, glob, -1))  # parents as rows: a valid chain by now
    same = sequence[:, None] == sequence[None, :]
    bad_seq = jax.ops.segment_max((~valid & real).astype(jnp.int32), sequence, Tq) > 0
    broken = bad_seq[sequence] & real
    ancestors = tree.ancestors & same & real[:, None] & real[None, :] & ~broken[:, None]
    return Tree(ancestors, jnp.where(broken, 0, tree.depth), broken)


def _tree(parents) -> Tree:
    """The ancestry of one chunk's parents (T,), each in [-1, i) for token i (a chunk with
    another parent is broken, every token of it): token by token, each its own ancestor
    and its parent's ancestors'."""
    T = parents.shape[0]
    rows = jnp.arange(T, dtype=jnp.int32)
    valid = (parents >= -1) & (parents < rows)
    broken = jnp.broadcast_to(~valid.all(), (T,))
    safe = jnp.where(valid, parents, -1)

    def add(i, state):
        ancestors, depth = state
        p = safe[i]
        inherited = jnp.where(p >= 0, ancestors[jnp.maximum(p, 0)], False)
        ancestors = ancestors.at[i].set(inherited | (rows == i))
        depth = depth.at[i].set(jnp.where(p >= 0, depth[jnp.maximum(p, 0)] + 1, 0))
        return ancestors, depth

    start = (jnp.zeros((T, T), bool), jnp.zeros((T,), jnp.int32))
    ancestors, depth = jax.lax.fori_loop(0, T, add, start)
    ancestors = ancestors & ~broken[:, None]
    return Tree(ancestors, jnp.where(broken, 0, depth), broken)


def tree_as_mask(rules):
    """A call with a tree rule as the same call without it: its band (causality, a
    window) and ``mask_fn``/``score_fn`` moved into one ``mask_fn`` on the cells' slots
    that measures them on the tree's positions, and ANDs the ancestry inside the chunk.
    What the reference computes (docs/conventions.md, "Token trees"), and how a kernel
    that serves ``mask_fn`` serves a tree."""
    if rules.tree_parents is None:
        return rules
    view = _paged_view(rules) if rules.paged else _dense_view(rules)
    left, right = rules.band if rules.band is not None else (None, None)
    user_mask, user_score = rules.mask_fn, rules.score_fn

    def mask_fn(b, n, q, k):
        q_pos, k_pos, in_chunk, seen = view(b, q, k)
        allowed = jnp.where(in_chunk, seen, True)
        if right is not None:
            allowed &= k_pos <= q_pos + right
        if left is not None:
            allowed &= k_pos >= q_pos - left
        if user_mask is not None:
            allowed &= user_mask(b, n, q_pos, k_pos)
        return allowed

    score_fn = None
    if user_score is not None:

        def score_fn(s, b, n, q, k):
            q_pos, k_pos, _, _ = view(b, q, k)
            return user_score(s, b, n, q_pos, k_pos)

    return rules.replace(
        tree_parents=None, is_causal=False, window=None, mask_fn=mask_fn, score_fn=score_fn
    )


def _dense_view(rules):
    """``view(b, q, k) -> (q_pos, k_pos, in_chunk, seen)`` of a dense call's cells: the
    query at slot ``q`` (token ``q - committed`` of row b's chunk) at its tree position,
    the key in slot ``k`` at its position (its tree position inside the chunk), whether
    it is in the chunk, and whether the query's ancestry holds it."""
    tree = dense_tree(rules.tree_parents)
    B, T = rules.tree_parents.shape
    committed = jnp.broadcast_to(jnp.asarray(rules.index_offset, jnp.int32), (B,))

    def view(b, q, k):
        start = committed[b]
        i, j = jnp.clip(q - start, 0, T - 1), k - start
        in_chunk = (j >= 0) & (j < T)
        jj = jnp.clip(j, 0, T - 1)
        q_pos = start + tree.depth[b, i]
        k_pos = jnp.where(in_chunk, start + tree.depth[b, jj], k)
        return q_pos, k_pos, in_chunk, tree.ancestors[b, i, jj]

    return view


def _paged_view(rules):
    """:func:`_dense_view` for a paged call: ``b`` a sequence, ``q`` and ``k`` positions
    in it (a query at ``kv_lengths[b] - q_len + i``, its chunk's token i, row
    ``query_starts[b] + i``)."""
    layout = rules.layout()
    starts = rules.query_starts.astype(jnp.int32)
    first_row = starts[layout.sequence]
    tree = paged_tree(rules.tree_parents, layout.sequence, first_row, layout.real)
    q_lens = starts[1:] - starts[:-1]
    committed = rules.kv_lengths - q_lens  # (B,)
    Tq = rules.T

    def view(b, q, k):
        start = committed[b]
        row = jnp.clip(starts[b] + q - start, 0, Tq - 1)
        j = k - start
        in_chunk = (j >= 0) & (j < q_lens[b])
        key_row = jnp.clip(starts[b] + j, 0, Tq - 1)
        q_pos = start + tree.depth[row]
        k_pos = jnp.where(in_chunk, start + tree.depth[key_row], k)
        return q_pos, k_pos, in_chunk, tree.ancestors[row, key_row]

    return view


def broken_rows(rules):
    """The rows a tree rule cannot serve (traced, invalid trees): (B,) for a dense call,
    (Tq,) for a paged one; None without a tree."""
    if rules.tree_parents is None:
        return None
    if not rules.paged:
        return dense_tree(rules.tree_parents).broken.any(axis=1)
    layout = rules.layout()
    starts = rules.query_starts.astype(jnp.int32)
    tree = paged_tree(rules.tree_parents, layout.sequence, starts[layout.sequence], layout.real)
    return tree.broken
