"""A token tree (``tree_parents``) as the native paged pass reads it: per query row its
position and the bits of its ancestors in its chunk (paged.h, ``paged_mask``).

Axis letters: Tq query rows, W words of 32 bits (W * 32 >= Tq: a chunk is at most
every row of the call).
"""

import jax
import jax.numpy as jnp

from ..._base.paged import returned_reads
from ..._base.rules import Rules
from ..._base.tree import paged_tree


def tree_rows(rules: Rules):
    """(positions (Tq,), rows (Tq, 1 + W)) int32 of a paged call with a tree, or (None,
    None) without one: each row's position (its sequence's committed length plus its
    depth), and in ``rows`` that position, then the bits of its ancestors (itself
    included) among its chunk's tokens, token i at bit ``i % 32`` of word
    ``1 + i // 32``. A row of a broken tree sees no chunk key (its row is NaN: the
    caller poisons it)."""
    if rules.tree_parents is None:
        return None, None
    layout = rules.layout()
    starts = rules.query_starts.astype(jnp.int32)
    first_row = starts[layout.sequence]
    tree = paged_tree(rules.tree_parents, layout.sequence, first_row, layout.real)
    q_lens = starts[1:] - starts[:-1]
    committed = rules.kv_lengths.astype(jnp.int32) - q_lens
    positions = committed[layout.sequence] + tree.depth
    Tq = rules.T
    words = -(-Tq // 32)
    token = jnp.arange(words * 32, dtype=jnp.int32)[None]  # (1, W * 32): chunk tokens
    columns = jnp.clip(first_row[:, None] + token, 0, max(Tq - 1, 0))
    bits = jnp.take_along_axis(tree.ancestors, columns, axis=1)
    bits &= token < q_lens[layout.sequence][:, None]
    shifts = jnp.arange(32, dtype=jnp.uint32)[None, None]
    packed = (bits.reshape(Tq, words, 32).astype(jnp.uint32) << shifts).sum(-1, jnp.uint32)
    packed = jax.lax.bitcast_convert_type(packed, jnp.int32)
    return positions, jnp.concatenate([positions[:, None], packed], axis=1)


def tree_returned_reads(rules: Rules, positions):
    """(Tq,) bool: the rows of a paged call with a tree whose band, measured at their
    tree positions ``positions`` (Tq,), reaches a page their sequence gave back
    (:func:`~nanoattn._base.paged.returned_reads`; a chunk's own keys are never given
    back)."""
    layout = rules.layout()._replace(position=positions)
    reads = returned_reads(rules.page_table, rules.kv_lengths, layout, rules.page_size,
                           rules.band)  # fmt: skip
    return reads.any(axis=1)
