"""A token tree (``tree_parents``) as the native paged pass reads it: per query row its
position and the bits of its ancestors in its chunk (paged.h, ``paged_mask``), for a
paged call and for a dense one read in place.

Axis letters: Tq query rows, W words of 32 bits (W * 32 >= Tq: a chunk is at most
every row of the call).
"""

import jax
import jax.numpy as jnp

from ..._base.paged import returned_reads
from ..._base.rules import Rules
from ..._base.tree import dense_tree, paged_tree


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
    token = jnp.arange(_words(Tq) * 32, dtype=jnp.int32)[None]  # (1, W * 32): chunk tokens
    columns = jnp.clip(first_row[:, None] + token, 0, max(Tq - 1, 0))
    bits = jnp.take_along_axis(tree.ancestors, columns, axis=1)
    bits &= token < q_lens[layout.sequence][:, None]
    return positions, _packed_rows(positions, bits)


def dense_tree_rows(rules: Rules):
    """(B * T, 1 + W) int32: a dense call's tree as the paged pass reads it over the
    cache in place (row b of the cache a page, its chunk at slots ``q_offset[b]`` on),
    as :func:`tree_rows` lays out a paged call's: row b * T + i holds token i's position
    (``q_offset[b]`` plus its depth), then the bits of its ancestors among row b's T
    chunk tokens."""
    B, T = rules.tree_parents.shape
    tree = dense_tree(rules.tree_parents)
    committed = jnp.broadcast_to(jnp.asarray(rules.index_offset, jnp.int32), (B,))
    positions = (committed[:, None] + tree.depth).reshape(B * T)
    bits = jnp.pad(tree.ancestors, ((0, 0), (0, 0), (0, _words(T) * 32 - T)))
    return _packed_rows(positions, bits.reshape(B * T, -1))


def _words(T: int) -> int:
    """The 32-bit words that hold the bits of a chunk of at most T tokens."""
    return -(-T // 32)


def _packed_rows(positions, bits):
    """(R, 1 + W) int32: each row's position (R,), then its bits (R, W * 32) packed, bit
    i at bit ``i % 32`` of word ``i // 32``."""
    R = bits.shape[0]
    shifts = jnp.arange(32, dtype=jnp.uint32)[None, None]
    packed = (bits.reshape(R, -1, 32).astype(jnp.uint32) << shifts).sum(-1, jnp.uint32)
    packed = jax.lax.bitcast_convert_type(packed, jnp.int32)
    return jnp.concatenate([positions[:, None].astype(jnp.int32), packed], axis=1)


def tree_returned_reads(rules: Rules, positions):
    """(Tq,) bool: the rows of a paged call with a tree whose band, measured at their
    tree positions ``positions`` (Tq,), reaches a page their sequence gave back
    (:func:`~nanoattn._base.paged.returned_reads`; a chunk's own keys are never given
    back)."""
    layout = rules.layout()._replace(position=positions)
    reads = returned_reads(rules.page_table, rules.kv_lengths, layout, rules.page_size,
                           rules.band)  # fmt: skip
    return reads.any(axis=1)


def tree_in_place(rules: Rules) -> bool:
    """Whether a dense call with a tree is served by the paged pass over its cache in
    place (kernel.py's ``tree_decode``): causal (its band ends at each query's position,
    so that no row reads a slot past its chunk's), no ``mask_fn`` or segment ids, float
    keys and values of one width."""
    band = rules.band
    return (
        rules.tree_parents is not None
        and not rules.paged
        and rules.T >= 1
        and rules.S >= 1
        and band is not None
        and band[1] <= 0
        and rules.mask_fn is None
        and rules.q_segment_ids is None
        and rules.key_scales is None
        and rules.Hv == rules.H
    )
