"""Slot moves of a paged step: what ``PageAllocator.accept`` leaves for the next step
to carry out (speculative decoding with token trees, docs/decoding.md "Speculative
trees").

A move ``(source, target)`` copies one token's key and value (and their scales) from
one slot of the pool to another, both as flat slot ids ``page * page_size + slot``;
``(-1, -1)`` is an unused entry. A step carries its moves after its copy-on-write
copies and before its writes, every moved slot read as the pool was before the step
(as the copies read it), so a move's source may lie in a page the allocator has
since handed to another sequence. Two moves into one slot, or a slot outside the
pool, is a bad move list: one line when concrete; under ``jit`` the move is dropped
and the sequences holding its target page are broken (NaN, never written), as a bad
copy's. Axis letters: V moves, B sequences, M pages per sequence, P pages.
"""

import jax
import jax.numpy as jnp
import numpy as np

from ..._base.paged import held_pages


def no_moves() -> jax.Array:
    """The move list of a batch that carries none: (0, 2) int32."""
    return jnp.zeros((0, 2), jnp.int32)


def move_faults(moves, slots: int):
    """(V, 2) bool, traced or not: whether each used move names a slot outside the pool
    of ``slots`` = P * page_size (column 0), and whether another used move has its
    target (column 1)."""
    source, target = moves[:, 0], moves[:, 1]
    unused = (source == -1) & (target == -1)
    outside = ~unused & ((source < 0) | (source >= slots) | (target < 0) | (target >= slots))
    same = (target[:, None] == target[None, :]) & ~unused[:, None] & ~unused[None, :]
    twice = (same & ~jnp.eye(moves.shape[0], dtype=bool)).any(axis=1)
    return jnp.stack([outside, twice & ~outside], axis=1)


def check_moves(moves, slots: int) -> None:
    """Raises ValueError for a move naming a slot outside the pool, or two moves into
    one slot, when concrete (under ``jit``: :func:`move_spoils`)."""
    if isinstance(moves, jax.core.Tracer):
        return
    values = np.asarray(moves)
    faults = np.asarray(move_faults(jnp.asarray(values), slots))
    if faults[:, 0].any():
        v = int(np.flatnonzero(faults[:, 0])[0])
        raise ValueError(
            f"moves[{v}]={values[v].tolist()} names a slot outside the pool's {slots} "
            f"(P * page_size); an unused entry is [-1, -1]"
        )
    if faults[:, 1].any():
        v, w = (int(i) for i in np.flatnonzero(values[:, 1] == values[faults[:, 1]][0, 1])[:2])
        raise ValueError(
            f"moves[{v}] and moves[{w}] both move into slot {int(values[v, 1])}; a slot "
            f"takes one move per step"
        )


def move_spoils(moves, page_table, kv_lengths, P: int, page_size: int):
    """(B,) bool: the sequences holding the page a faulty move was to fill (their
    tokens are NaN under ``jit``, and never written)."""
    faulty = move_faults(moves, P * page_size).any(axis=1)
    target = moves[:, 1]
    lost = faulty & (target >= 0) & (target < P * page_size)  # (V,): a slot left unfilled
    held = held_pages(kv_lengths, page_size, page_table.shape[1])  # (B, M)
    pages = jnp.where(lost, target // page_size, -2)  # -2: no page (never RETURNED's -1)
    hits = (page_table[:, :, None] == pages[None, None, :]) & held[..., None]  # (B, M, V)
    return hits.any(axis=(1, 2))


def move_slots(moves, slots: int):
    """``(source, target)`` (V,) each of the used, sound moves; the others read slot 0
    and write past the pool (dropped)."""
    used = ~move_faults(moves, slots).any(axis=1) & (moves[:, 0] >= 0)
    return jnp.where(used, moves[:, 0], 0), jnp.where(used, moves[:, 1], slots)


def path_positions(kept, last: int, length: int) -> tuple[list[int], list[tuple[int, int]]]:
    """``(kept, moves)``: the indices ``kept`` as a list of ints, checked (increasing,
    in [0, last): a root-to-leaf path of a tree, in order; ValueError naming ``kept``
    otherwise), and the moves of positions ``(source, target)`` that keep a sequence's
    last ``last`` tokens (of ``length``) at those indices in the positions from
    ``length - last`` on, a token already in place not moved (the allocator's
    ``accept``)."""
    values = np.asarray(kept)
    values = np.zeros(0, int) if values.shape == (0,) else values  # [] is no float array
    integral = values.ndim == 1 and np.issubdtype(values.dtype, np.integer)
    if (
        not integral
        or (values.size and (values[0] < 0 or values[-1] >= last))
        or (np.diff(values) <= 0).any()
    ):
        raise ValueError(
            f"accept: kept must be increasing indices of the last extension's {last} "
            f"tokens, in [0, {last}) (a root-to-leaf path, in order), got {kept!r}"
        )
    start, kept = length - last, [int(k) for k in values]
    return kept, [(start + k, start + m) for m, k in enumerate(kept) if k != m]
