"""Block classification of a ``mask_fn``: which blocks of the score matrix are empty,
full or partial, computed once and reused.

The score matrix (B, N, T, S) is cut into blocks of ``block_q`` queries and
``block_k`` keys. A block is *empty* when ``mask_fn`` hides every one of its
cells, *full* when it shows every one, *partial* otherwise. A blockwise kernel
skips the empty blocks and the masking of the full ones, and calls ``mask_fn``
only on the partial ones.

The classification is made at trace time when ``mask_fn`` depends only on static
things (a Python offset, closed-over numpy arrays or concrete jax arrays): the
kinds are then a numpy array and the kernel's schedule leaves the empty blocks
out. Otherwise (closed-over traced arrays, a traced offset) it is computed at run
time, in chunks of query blocks, so that no (T, S) array is ever held, and the
kernel skips the empty blocks as it meets them.

:func:`block_mask` builds a :class:`BlockMask` once, to be passed as ``mask_fn=``
to many calls (the layers of a model, the steps of a loop).
"""

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .mask_fn import check_mask_fn, evaluate_mask, grid, off_mesh
from .validate import expect_size

EMPTY, PARTIAL, FULL = 0, 1, 2
BLOCK = 64  # the default granularity: coarsens exactly to any multiple of it
CHUNK_CELLS = 2**22  # the most cells evaluated at once while classifying


@dataclasses.dataclass(frozen=True, eq=False)
class BlockMask:
    """A ``mask_fn`` with its block classification; callable as the ``mask_fn`` itself.

    Attributes:
      mask_fn: ``mask_fn(b, n, q_pos, k_pos) -> bool``.
      B, N, T, S: the sizes of the score matrix it was classified for.
      q_offset: the position of the first query it was classified for (int, or
        int array () or (B,)).
      block_q, block_k: the block sizes of the classification.
      kinds: int8 (B or 1, N or 1, ceil(T / block_q), ceil(S / block_k)): EMPTY,
        PARTIAL or FULL per block (an axis the mask does not depend on is 1); a
        numpy array when classified at trace time, a jax array otherwise.
    """

    mask_fn: Callable
    B: int
    N: int
    T: int
    S: int
    q_offset: Any
    block_q: int
    block_k: int
    kinds: Any

    def __call__(self, b, n, q_pos, k_pos):
        return self.mask_fn(b, n, q_pos, k_pos)

    @property
    def static(self) -> bool:
        """Whether the kinds were found at trace time (a numpy array)."""
        return isinstance(self.kinds, np.ndarray)

    def check_fits(self, B: int, N: int, T: int, S: int, q_offset) -> None:
        """Raises a one-line ValueError unless this mask was classified for these sizes
        and this offset."""
        if (self.B, self.N, self.T, self.S) != (B, N, T, S):
            raise ValueError(
                f"mask_fn is a BlockMask for (B, N, T, S) = {(self.B, self.N, self.T, self.S)}, "
                f"but the call has {(B, N, T, S)}; build it with block_mask(mask_fn, {B}, {N}, "
                f"{T}, {S}, q_offset=...)"
            )
        mine, theirs = _offset_value(self.q_offset), _offset_value(q_offset)
        if mine is None or theirs is None:
            if self.q_offset is not q_offset and not (mine is None and theirs is None):
                raise ValueError(
                    "mask_fn is a BlockMask classified for another q_offset than the call's "
                    "(a traced offset must be the very array the BlockMask was built with)"
                )
        elif not np.array_equal(mine, theirs):
            raise ValueError(
                f"mask_fn is a BlockMask classified for q_offset={mine.tolist()}, but the call "
                f"has q_offset={theirs.tolist()}"
            )

    def kinds_at(self, block_q: int, block_k: int):
        """The kinds at blocks of ``block_q`` x ``block_k``, reduced over B and N
        (a block is empty or full only when it is so in every batch row and head):
        (ceil(T / block_q), ceil(S / block_k)), numpy when static."""
        kinds = self.kinds
        fits = (block_q % self.block_q == 0 or block_q >= self.T) and (
            block_k % self.block_k == 0 or block_k >= self.S
        )
        if not fits:  # not a coarsening of this classification: classify afresh
            kinds = classify(self.mask_fn, self.B, self.N, self.T, self.S, self.q_offset,
                             block_q, block_k)  # fmt: skip
            fq = fk = 1
        else:
            fq = -(-self.T // self.block_q) if block_q >= self.T else block_q // self.block_q
            fk = -(-self.S // self.block_k) if block_k >= self.S else block_k // self.block_k
        return coarsen(kinds, fq, fk)


def _offset_value(q_offset):
    """The offset as a numpy array when it is concrete, else None."""
    if q_offset is None:
        return np.zeros((), np.int64)
    if isinstance(q_offset, jax.core.Tracer):
        return None
    return np.asarray(q_offset)


def coarsen(kinds, fq: int, fk: int):
    """Kinds (xB, xN, nQ, nK) merged over ``fq`` x ``fk`` blocks and over B and N:
    (ceil(nQ / fq), ceil(nK / fk)); empty when every part is, full when every part is."""
    xp = np if isinstance(kinds, np.ndarray) else jnp
    _, _, nq, nk = kinds.shape
    cq, ck = -(-nq // fq), -(-nk // fk)
    pads = ((0, 0), (0, 0), (0, cq * fq - nq), (0, ck * fk - nk))
    most = xp.pad(kinds, pads, constant_values=EMPTY).reshape(-1, cq, fq, ck, fk)
    least = xp.pad(kinds, pads, constant_values=FULL).reshape(-1, cq, fq, ck, fk)
    most, least = most.max(axis=(0, 2, 4)), least.min(axis=(0, 2, 4))
    return xp.where(least == FULL, FULL, xp.where(most == EMPTY, EMPTY, PARTIAL)).astype(xp.int8)


def classify(mask_fn, B: int, N: int, T: int, S: int, q_offset, block_q: int, block_k: int):
    """The kinds (xB, xN, ceil(T / block_q), ceil(S / block_k)) of ``mask_fn``'s blocks:
    numpy when they can be found at trace time, a jax array otherwise. Padding cells
    (past T or S) count as neither visible nor hidden."""
    with jax.ensure_compile_time_eval():
        kinds = _classify(mask_fn, B, N, T, S, q_offset, block_q, block_k)
    if isinstance(kinds, jax.core.Tracer):
        return kinds
    return np.asarray(kinds)


def _classify(mask_fn, B, N, T, S, q_offset, block_q, block_k, k_start=0):
    n_q, n_k = -(-T // block_q), -(-S // block_k)
    S_pad = n_k * block_k
    b, n, q, k = grid(B, N, block_q, S_pad, q_offset, k_start)
    # The axes it depends on, from one block's result (not eval_shape, which loses the
    # mesh axes of arguments that vary inside shard_map).
    xB, xN = evaluate_mask(mask_fn, b, n, q, k).shape[:2]
    # Query blocks per chunk: as many as CHUNK_CELLS allows, at least one.
    per_block = xB * xN * block_q * S_pad
    chunk = max(1, min(n_q, CHUNK_CELLS // max(per_block, 1)))
    n_chunks = -(-n_q // chunk)
    real_k = (jnp.arange(S_pad) < S).reshape(n_k, block_k)  # (nK, bk)

    def kinds_of(first_block):
        rows = first_block * block_q + jnp.arange(chunk * block_q, dtype=jnp.int32)  # (R,)
        b, n, q, k = grid(B, N, chunk * block_q, S_pad, q_offset, k_start)
        q = q + first_block * block_q
        seen = evaluate_mask(mask_fn, b, n, q, k)
        seen = jnp.broadcast_to(seen, (xB, xN, chunk * block_q, S_pad))
        seen = seen.reshape(xB, xN, chunk, block_q, n_k, block_k)
        real = (rows < T).reshape(chunk, block_q)[:, :, None, None] & real_k[None, None]
        real = real[None, None]  # (1, 1, c, bq, nK, bk)
        some = (seen & real).any(axis=(3, 5))  # (xB, xN, c, nK)
        every = (seen | ~real).all(axis=(3, 5))
        return jnp.where(every, FULL, jnp.where(some, PARTIAL, EMPTY)).astype(jnp.int8)

    starts = jnp.arange(n_chunks, dtype=jnp.int32) * chunk
    kinds = jax.lax.map(kinds_of, starts)  # (n_chunks, xB, xN, c, nK)
    kinds = jnp.moveaxis(kinds, 0, 2).reshape(xB, xN, n_chunks * chunk, n_k)
    return kinds[:, :, :n_q]


def chunk_pair_kinds(mask_fn, B: int, N: int, C: int, q_chunks, k_chunks, block_q: int,
                     block_k: int):  # fmt: skip
    """The kinds of ``mask_fn``'s blocks within each (query chunk, key chunk) pair of a
    sequence cut into chunks of ``C`` positions (chunk ``c`` holds ``c C .. c C + C - 1``),
    reduced over B and N: int8 (len(q_chunks), len(k_chunks), ceil(C / block_q),
    ceil(C / block_k)); numpy when found at trace time, else a jax array computed one
    pair at a time (as :func:`classify`, so no (C, C) array per pair is held at once
    beyond ``CHUNK_CELLS``). ``q_chunks`` and ``k_chunks`` are int sequences (the
    query chunks may be traced: then the kinds are computed at run time)."""
    n_q, n_k = -(-C // block_q), -(-C // block_k)

    def one(pair):
        qc, kc = pair
        kinds = _classify(mask_fn, B, N, C, C, qc * C, block_q, block_k, k_start=kc * C)
        return coarsen(kinds, 1, 1)  # (nQ, nK), reduced over B and N

    def kinds_of(xp):
        qs, ks = xp.asarray(q_chunks, np.int32), np.asarray(k_chunks, np.int32)
        pairs = (xp.repeat(qs, len(ks)), xp.tile(ks, len(q_chunks)))
        return jax.lax.map(one, pairs).reshape(len(q_chunks), len(ks), n_q, n_k)

    if any(isinstance(c, jax.core.Tracer) for c in q_chunks):  # run time (and in shard_map,
        return kinds_of(jnp)  # whose mesh axes compile-time evaluation would lose)
    with off_mesh(), jax.ensure_compile_time_eval():
        kinds = kinds_of(np)
    if isinstance(kinds, jax.core.Tracer):
        return kinds
    return np.asarray(kinds)


def block_mask(
    mask_fn, B: int, N: int, T: int, S: int, *, q_offset=None, block_q: int = BLOCK,
    block_k: int = BLOCK,
) -> BlockMask:  # fmt: skip
    """Classifies ``mask_fn``'s blocks once, for reuse across calls.

    The result is passed as ``mask_fn=`` to :func:`nanoattn.dot_product_attention`
    (and ``flash_attention``, ``attention_weights``) for calls with these sizes and
    this ``q_offset``; it is called like ``mask_fn`` itself. Built outside ``jit``
    (or from static data) its kinds are a numpy array, and every call that closes
    over it skips the empty blocks from its schedule; built from traced arrays
    inside ``jit`` they are computed at run time, once, where it is built.

    Args:
      mask_fn: ``mask_fn(b, n, q_pos, k_pos) -> bool``, elementwise (see
        :func:`nanoattn.dot_product_attention`).
      B, N, T, S: batch, query heads, query time, key time.
      q_offset: the position of the first query (int, or int array () or (B,));
        None means 0.
      block_q, block_k: the classification's block sizes (64: kernels coarsen it
        to their own blocks, any multiple of 64).

    Returns:
      A :class:`BlockMask`.

    Example:
      >>> import jax.numpy as jnp, nanoattn
      >>> ids = jnp.repeat(jnp.arange(4), 64)[None]  # (B, T): 4 documents of 64 tokens
      >>> same_doc = lambda b, n, q, k: ids[b, q] == ids[b, k]
      >>> mask = nanoattn.block_mask(same_doc, 1, 2, 256, 256)
      >>> print(mask.kinds[0, 0])  # 2 = full, 0 = empty
      [[2 0 0 0]
       [0 2 0 0]
       [0 0 2 0]
       [0 0 0 2]]
    """
    B, N, T, S = (expect_size(name, x) for name, x in zip("BNTS", (B, N, T, S)))
    block_q, block_k = expect_size("block_q", block_q), expect_size("block_k", block_k)
    if block_q == 0 or block_k == 0:
        raise ValueError(f"block_q and block_k must be >= 1, got {block_q} and {block_k}")
    if q_offset is not None and not isinstance(q_offset, int):
        q_offset = jnp.asarray(q_offset)
    check_mask_fn(mask_fn, B, N, T, S, q_offset)
    if isinstance(mask_fn, BlockMask):
        mask_fn = mask_fn.mask_fn
    kinds = classify(mask_fn, B, N, T, S, q_offset, block_q, block_k)
    return BlockMask(mask_fn, B, N, T, S, q_offset, block_q, block_k, kinds)
