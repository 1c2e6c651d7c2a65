"""The native kernel's block classification under windows, offsets and key lengths.

The kernel (visibility.h) classifies each (query block, key block) as skipped, wholly visible or
partial, with blocks of BQ = BK = 64 (``NANOATTN_BQ``, ``NANOATTN_BK``) in all three
passes that use it: the transposed forward (T >= VW, the vector width: 16 floats with
AVX-512, 8 with AVX2), the rows forward of a decode step (T < VW) and the backward.
A block is wholly visible only if every (query, key) cell in it is: the block's last
query row sees its first key (the window's left bound) and its first row sees its
last key (causality, the window's right bound, the key length). A block whose first
query row cannot see the block's last key, or whose last row cannot see its first,
is masked cell by cell, never served as visible; and a wholly visible last block
still masks its columns past S (the products run over whole vectors of keys).

The sweep puts the band's edges inside 64-blocks (prime lengths, windows wider than a
block, unaligned static offsets, per-row (B,) offsets, key lengths inside a block) and
checks outputs and gradients against the float64 reference; the first test checks
that the sweep reaches the blocks in which exactly one corner is hidden, on both
forward paths, so that a classification looking at the wrong corner fails here.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import nanoattn
from nanoattn._backends import native

from _reference import np_attention_vjp, np_causal, np_lengths, np_window, randn

pytestmark = pytest.mark.skipif(
    native.load()[0] is None, reason="the native kernel could not be built here"
)

BQ = BK = 64  # attention.cc's default blocks
B, N, K, H = 2, 6, 2, 7
VW_AVX2 = 8  # below this many queries both builds take the rows (decode) forward


def per_row(*values):
    """(B,) int32: one offset or key length per batch row (traced by the kernel's call)."""
    return np.array(values, np.int32)


def point(name, T, S, **kwargs):
    return pytest.param(T, S, kwargs, id=name)


# Every window and offset puts a band edge inside a block.
SWEEP = [
    point("causal (100, 0), T = S = 193", 193, 193, is_causal=True, window=(100, 0)),
    point("window (70, 45), static offset 13", 197, 181, window=(70, 45), q_offset=13),
    point("causal bottom-right, offset 45", 150, 195, is_causal=True, q_offset=45),
    point("per-row offsets (37, -19), window (90, 20), lengths (211, 150)", 150, 211,
          window=(90, 20), q_offset=per_row(37, -19), kv_lengths=per_row(211, 150)),
    point("left bound BK - 1 = 63, soft-cap, offset 61", 131, 263,
          window=(63, 1000), q_offset=61, logit_soft_cap=3.0),
    point("decode T = 5, per-row offsets (200, 258), causal (138, 0)", 5, 263,
          is_causal=True, window=(138, 0), q_offset=per_row(200, 258)),
    point("decode T = 7, window (75, 2), offset 121, lengths (127, 131)", 7, 131,
          window=(75, 2), q_offset=121, kv_lengths=per_row(127, 131)),
    point("decode T = 1, window (40, 17), offset 70", 1, 97, window=(40, 17), q_offset=70),
    # The last key block [64, 89) wholly visible, its columns padded past S = 89.
    point("decode T = 3, causal offset 88, S = 89", 3, 89, is_causal=True, q_offset=88),
]  # fmt: skip


def np_allowed(T, S, kwargs):
    """(B, 1, T, S): the literal positional rules and key lengths of a sweep point."""
    offsets = np.broadcast_to(np.asarray(kwargs.get("q_offset", 0)), (B,))
    allowed = np.ones((B, 1, T, S), bool)
    for b, offset in enumerate(offsets):
        left, right = kwargs["window"] if "window" in kwargs else (S + T, S + T)
        allowed[b, 0] &= np_window(T, S, int(offset), left, right)
        if kwargs.get("is_causal"):
            allowed[b, 0] &= np_causal(T, S, int(offset))
    if "kv_lengths" in kwargs:
        allowed &= np_lengths(kwargs["kv_lengths"], S)
    return allowed


def one_hidden_corner(allowed):
    """The blocks of `allowed` (B, 1, T, S) in which exactly one corner is hidden:
    {"first row, last key": n, "last row, first key": n}; and the numbers of wholly
    visible and of skipped blocks."""
    counts = dict.fromkeys(("first row, last key", "last row, first key", "full", "skip"), 0)
    T, S = allowed.shape[2:]
    for b in range(allowed.shape[0]):
        for i0 in range(0, T, BQ):
            for j0 in range(0, S, BK):
                cells = allowed[b, 0, i0 : i0 + BQ, j0 : j0 + BK]
                if cells.all() or not cells.any():
                    counts["full" if cells.all() else "skip"] += 1
                    continue
                seen = cells[0, 0] & cells[-1, -1]
                counts["first row, last key"] += bool(seen & cells[-1, 0] & ~cells[0, -1])
                counts["last row, first key"] += bool(seen & cells[0, -1] & ~cells[-1, 0])
    return counts


def test_the_sweep_reaches_blocks_with_one_hidden_corner_on_both_forward_paths():
    for path, points in (
        ("blocks", [p.values for p in SWEEP if p.values[0] >= 16]),  # transposed, both ISAs
        ("decode", [p.values for p in SWEEP if p.values[0] < VW_AVX2]),  # rows, both ISAs
    ):
        total = dict.fromkeys(("first row, last key", "last row, first key", "full", "skip"), 0)
        for T, S, kwargs in points:
            for corner, n in one_hidden_corner(np_allowed(T, S, kwargs)).items():
                total[corner] += n
        assert all(n > 0 for n in total.values()), (path, total)


def run_and_truth(T, S, kwargs, seed):
    """The native output and (dq, dk, dv) under jit, and the float64 truth."""
    q, k, v = randn(seed, B, T, N, H), randn(seed + 1, B, S, K, H), randn(seed + 2, B, S, K, H)
    cot = randn(seed + 3, B, T, N, H)

    @jax.jit
    def forward_backward(q, k, v, cot):
        def attend(q, k, v):
            return nanoattn.dot_product_attention(q, k, v, implementation="native", **kwargs)

        out, vjp = jax.vjp(attend, q, k, v)
        return out, vjp(cot)

    got = forward_backward(q, k, v, cot)
    cap = kwargs.get("logit_soft_cap")
    want = np_attention_vjp(q, k, v, cot, np_allowed(T, S, kwargs), None, None, cap)
    return got, want


@pytest.mark.parametrize("T, S, kwargs", SWEEP)
def test_outputs_and_gradients_match_the_reference(T, S, kwargs):
    kwargs = {k: jnp.asarray(v) if isinstance(v, np.ndarray) else v for k, v in kwargs.items()}
    (out, grads), (want, want_grads) = run_and_truth(T, S, kwargs, seed=T + S)
    np.testing.assert_allclose(out, want, atol=1e-5, rtol=1e-5)
    for name, g, w in zip(("dq", "dk", "dv"), grads, want_grads):
        np.testing.assert_allclose(g, w, atol=1e-4, rtol=1e-4, err_msg=name)
