"""Slot moves of a paged step: what ``PageAllocator.accept`` leaves for the next step
to carry out (speculative decoding with token trees, docs/decoding.md "Speculative
trees").

A move ``(source, target)`` copies one token's key and value (and their scales) from
one slot of the pool to another, both as flat slot ids ``page * page_size + slot``;
``(-1, -1)`` is an unused entry. A step carries its moves after its copy-on-write
copies and before its writes, every moved slot read as the pool was before the step
(as the copies read it), so a move's source may lie in a page the allocator has
since handed to another sequence. Two moves into one slot, or a slot outside the
pool, is a bad move list (:data:`.transfers.MOVES`): one line when concrete; under
``jit`` the move is dropped and the sequences holding its target page are broken (NaN,
never written), as a bad copy's. Axis letters: V moves, B sequences, M pages per
sequence, P pages.
"""

import jax
import jax.numpy as jnp
import numpy as np


def no_moves() -> jax.Array:
    """The move list of a batch that carries none: (0, 2) int32."""
    return jnp.zeros((0, 2), jnp.int32)


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
