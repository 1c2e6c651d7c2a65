"""Every new argument at once: window, segment ids, soft-cap and RoPE together with
causality, a dense mask, key lengths, bias and grouped-query heads, against the
float64 reference on outputs and gradients, in both backends.

The cases are built so that some keys are seen by no query of their row, some
queries see no key and some bias cells are blocked: test_nonfinite.py feeds the
same compiled programs NaN and inf there.
"""

import numpy as np

from conftest import (
    Case,
    assert_cases_match,
    np_causal,
    np_lengths,
    np_segments,
    np_window,
    randn,
)


def static_offset_gqa():
    """T < S, causal sliding window at a static offset, GQA (N=6, K=2), RoPE."""
    B, T, S, N, K, H, off = 2, 23, 41, 6, 2, 8, 18
    rng = np.random.default_rng(100)
    kv_ids = np.stack([[0] * 20 + [1] * 21, [0] * 10 + [1] * 31]).astype(np.int32)
    q_ids = kv_ids[:, off:].copy()
    q_ids[0, -3:] = 5  # three queries of row 0 match no key: they see nothing
    lengths = np.array([41, 33], np.int32)  # keys 33.. of row 1 are padding
    mask = rng.random((B, 1, T, S)) > 0.15
    mask[0, :, :, 25] = False  # key 25 of row 0 is masked for every query
    allowed = (
        mask
        & np_causal(T, S, off)
        & np_window(T, S, off, 9, 0)  # keys 0..8 are left of every query's window
        & np_lengths(lengths, S)
        & np_segments(q_ids, kv_ids)
    )
    return Case(
        "static offset, GQA, RoPE, everything",
        randn(101, B, T, N, H) * 2,
        randn(102, B, S, K, H),
        randn(103, B, S, K, H),
        allowed=allowed,
        bias=randn(104, B, 1, T, S),
        kwargs=dict(
            mask=mask,
            is_causal=True,
            q_offset=off,
            window=(9, 0),
            kv_lengths=lengths,
            q_segment_ids=q_ids,
            kv_segment_ids=kv_ids,
            logit_soft_cap=3.0,
        ),
        rope=(off + np.arange(T), np.arange(S), 100.0),
    )


def traced_offsets_mqa():
    """Per-row traced offsets, a two-sided window without causality, MQA (K=1)."""
    B, T, S, N, K, H = 2, 29, 31, 5, 1, 8
    offsets = np.array([6, 0], np.int32)  # row 0: keys 0..2 are left of every window
    kv_ids = np.stack([[0] * 15 + [1] * 16, [0] * 5 + [4] * 3 + [0] * 23]).astype(np.int32)
    q_ids = np.stack([kv_ids[0, np.minimum(offsets[0] + np.arange(T), S - 1)], np.zeros(T)])
    q_ids = q_ids.astype(np.int32)
    q_ids[0, [10, 11]] = 9  # match no key
    lengths = np.array([31, 24], np.int32)  # row 1: queries 27, 28 see no valid key
    allowed = np_window(T, S, offsets, 3, 2) & np_lengths(lengths, S) & np_segments(q_ids, kv_ids)
    return Case(
        "traced per-row offsets, MQA, two-sided window",
        randn(111, B, T, N, H) * 2,
        randn(112, B, S, K, H),
        randn(113, B, S, K, H),
        allowed=allowed,
        bias=randn(114, 1, 1, 1, S),
        kwargs=dict(
            q_offset=offsets,
            window=(3, 2),
            kv_lengths=lengths,
            q_segment_ids=q_ids,
            kv_segment_ids=kv_ids,
            logit_soft_cap=1.5,
        ),
        rope=(offsets[:, None] + np.arange(T), np.arange(S), 10000.0),
    )


def square_gqa3():
    """T == S, default offset, causal + symmetric int window, K=3, full bias."""
    B, T, N, K, H = 2, 37, 6, 3, 8
    ids = np.stack([[0] * 10 + [1] * 20 + [2] * 7, [3] * 37]).astype(np.int32)
    mask = np.random.default_rng(120).random((T, T)) > 0.1
    allowed = mask & np_causal(T, T) & np_window(T, T, 0, 6, 6) & np_segments(ids, ids)
    return Case(
        "square, K=3, causal + window 6",
        randn(121, B, T, N, H) * 2,
        randn(122, B, T, K, H),
        randn(123, B, T, K, H),
        allowed=allowed,
        bias=randn(124, B, N, T, T),
        kwargs=dict(
            mask=mask,
            is_causal=True,
            window=6,
            q_segment_ids=ids,
            kv_segment_ids=ids,
            logit_soft_cap=5.0,
        ),
    )


CASES = [static_offset_gqa(), traced_offsets_mqa(), square_gqa3()]
FLASH_CASES = CASES[:2]  # compiling the kernel dominates the run time


def test_everything_at_once_matches_reference():
    # FLASH_CASES form one program per backend, which test_nonfinite.py reuses.
    assert_cases_match(FLASH_CASES)
    assert_cases_match(CASES[len(FLASH_CASES) :], implementations=["xla"])


def test_the_cases_exercise_what_they_claim():
    # Guards the case construction that test_nonfinite.py relies on.
    for case in CASES:
        B, T, N, _ = case.q.shape
        allowed = np.broadcast_to(case.allowed, (B, N, T, case.k.shape[1]))
        assert allowed.any(-1).any() and allowed.mean() < 0.5, case.name
    for case in FLASH_CASES:
        B, T, N, _ = case.q.shape
        allowed = np.broadcast_to(case.allowed, (B, N, T, case.k.shape[1]))
        assert (~allowed.any(axis=(1, 2))).any(), f"{case.name}: no key unseen by all"
        assert (~allowed.any(-1)).any(), f"{case.name}: no query that sees nothing"
