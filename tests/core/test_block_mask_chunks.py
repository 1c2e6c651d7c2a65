"""Block classification past one chunk (nanoattn/_base/block_mask.py): a block row
of more than CHUNK_CELLS cells (64 queries x S >= 65536 keys, or far fewer keys with a
per-row, per-head mask) is classified one query block at a time; every later chunk
must be classified at its own positions, and the kernels that skip by these kinds must
still match the float64 reference."""

import jax
import jax.numpy as jnp
import numpy as np

import nanoattn
from nanoattn._base.block_mask import BLOCK, CHUNK_CELLS, EMPTY, FULL, PARTIAL

from _backends import serving
from _reference import np_attention, randn


def causal(b, n, q, k):
    return k <= q


def test_a_causal_mask_past_one_chunk_has_the_causal_kinds():
    T, S = 2 * BLOCK, 65536  # each 64-query block row holds 2^22 cells: one chunk each
    assert BLOCK * S >= CHUNK_CELLS
    kinds = nanoattn.block_mask(causal, 1, 1, T, S).kinds[0, 0]
    want = np.full((2, S // BLOCK), EMPTY, np.int8)
    want[0, 0] = want[1, 1] = PARTIAL
    want[1, 0] = FULL
    np.testing.assert_array_equal(kinds, want)


B, N, T, S = 2, 3, 131, 11003  # 3 query blocks; B * N * 64 * S > 2^22: chunks of one


def per_row_and_head(b, n, q, k):
    """Causal, with a gap that moves with the row and the head, and a band per head."""
    return (k <= q) & ((k + 5 * b + n) % 97 != 0) & (q - k <= 4000 + 2000 * n)


def test_kernels_match_float64_where_the_classification_takes_several_chunks():
    assert B * N * BLOCK * S > CHUNK_CELLS
    offset = S - T
    q = jnp.asarray(randn(1, B, T, N, 8))
    k, v = (jnp.asarray(randn(s, B, S, 1, 8)) for s in (2, 3))
    i = offset + np.arange(T)[:, None]
    j = np.arange(S)[None]
    b = np.arange(B)[:, None, None, None]
    n = np.arange(N)[None, :, None, None]
    allowed = (j <= i) & ((j + 5 * b + n) % 97 != 0) & (i - j <= 4000 + 2000 * n)
    want = np_attention(q, k, v, allowed)
    mask = nanoattn.block_mask(per_row_and_head, B, N, T, S, q_offset=offset)
    kinds = np.asarray(mask.kinds)
    assert kinds.shape == (B, N, 3, -(-S // BLOCK))
    assert (kinds[:, :, 2] != kinds[:, :, 0]).any()  # later chunks differ from the first
    # the kernels that serve mask_fn: the reference ("xla") classifies no blocks
    kernels = [n for n in serving(q, k, v, mask_fn=per_row_and_head, is_causal=True,
                                  q_offset=offset) if n != "xla"]  # fmt: skip
    assert kernels
    for name in kernels:
        for fn in (per_row_and_head, mask):
            got = jax.jit(
                lambda q, k, v, fn=fn, name=name: nanoattn.dot_product_attention(
                    q, k, v, mask_fn=fn, is_causal=True, q_offset=offset, implementation=name
                )
            )(q, k, v)
            np.testing.assert_allclose(got, want, atol=2e-5, rtol=2e-5, err_msg=name)
