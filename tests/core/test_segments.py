"""Segment ids (packed sequences): query i may see key j only when their ids are equal."""

import itertools

import jax
import numpy as np
import pytest

from nanoattn import attention_weights, dot_product_attention

from _cases import ENTRY_POINTS, Case, assert_cases_match
from _reference import np_attention, np_causal, np_segments, randn

B, N, K, H = 2, 6, 2, 8


def qkv(T, S, seed=0):
    return randn(seed, B, T, N, H), randn(seed + 1, B, S, K, H), randn(seed + 2, B, S, K, H)


def packed_ids(lengths):
    """Ids 0, 1, 2, ... repeated over each document's length: one packed row."""
    return np.concatenate([np.full(n, i) for i, n in enumerate(lengths)]).astype(np.int32)


def segment_cases():
    # Packed causal self-attention: row 0 holds three documents, row 1 a single one.
    T = 37
    ids = np.stack([packed_ids([10, 20, 7]), packed_ids([37])])
    packed = Case(
        "packed causal self-attention",
        *qkv(T, T),
        allowed=np_segments(ids, ids) & np_causal(T, T),
        kwargs=dict(q_segment_ids=ids, kv_segment_ids=ids, is_causal=True),
    )
    # Cross-attention with unsorted ids; query id 7 occurs in no key, so those
    # queries see nothing and give zeros.
    T, S = 23, 41
    rng = np.random.default_rng(3)
    q_ids = rng.integers(0, 3, (B, T)).astype(np.int32)
    q_ids[0, [4, 5, 17]] = 7
    kv_ids = rng.integers(0, 3, (B, S)).astype(np.int64)  # any integer dtype, each its own
    cross = Case(
        "unsorted ids, T != S, queries that see nothing",
        *qkv(T, S, seed=10),
        allowed=np_segments(q_ids, kv_ids),
        kwargs=dict(q_segment_ids=q_ids, kv_segment_ids=kv_ids),
    )
    return [packed, cross]


def test_matches_reference_outputs_and_gradients():
    # The kernel's compile time dominates the run time: its segment cases are the
    # combined ones of test_combined.py (packed rows, ids no key has).
    cases = segment_cases()
    (_, (out, (dq, *_))) = assert_cases_match(cases, implementations=["xla"])["xla"]
    assert (np.asarray(out[0, [4, 5, 17]]) == 0).all()
    assert (np.asarray(dq[0, [4, 5, 17]]) == 0).all()


def test_packed_rows_equal_separate_documents():
    # Packing documents into one row with segment ids gives each document's own
    # causal attention, as if it were run alone.
    lengths = [6, 9, 4]
    T = sum(lengths)
    q, k, v = qkv(T, T, seed=20)
    ids = np.broadcast_to(packed_ids(lengths), (B, T))
    bounds = np.cumsum([0, *lengths])
    docs = [slice(a, b) for a, b in itertools.pairwise(bounds)]

    @jax.jit
    def run(q, k, v):
        packed = dot_product_attention(
            q, k, v, is_causal=True, q_segment_ids=ids, kv_segment_ids=ids
        )
        alone = [dot_product_attention(q[:, d], k[:, d], v[:, d], is_causal=True) for d in docs]
        return packed, alone

    packed, alone = run(q, k, v)
    for d, a in zip(docs, alone):
        np.testing.assert_allclose(packed[:, d], a, atol=1e-6, err_msg=f"{d}")


def test_weights_literal():
    # Equal logits: each query spreads its weight over the earlier keys of its document.
    ids = np.array([[0, 0, 1, 1, 1]])
    z = np.zeros((1, 5, 1, 4), np.float32)
    w = jax.jit(
        lambda z: attention_weights(z, z, is_causal=True, q_segment_ids=ids, kv_segment_ids=ids)
    )(z)
    expected = [
        [1, 0, 0, 0, 0],
        [1 / 2, 1 / 2, 0, 0, 0],
        [0, 0, 1, 0, 0],
        [0, 0, 1 / 2, 1 / 2, 0],
        [0, 0, 1 / 3, 1 / 3, 1 / 3],
    ]
    np.testing.assert_allclose(w[0, 0], expected, atol=1e-7)


def test_under_jit_with_traced_ids():
    case = segment_cases()[1]
    f = jax.jit(
        lambda q, k, v, qi, ki: dot_product_attention(q, k, v, q_segment_ids=qi, kv_segment_ids=ki)
    )
    kw = case.kwargs
    got = f(case.q, case.k, case.v, kw["q_segment_ids"], kw["kv_segment_ids"])
    want = np_attention(case.q, case.k, case.v, allowed=case.allowed)
    np.testing.assert_allclose(got, want, atol=2e-5)


T0, S0 = 5, 7
IDS_Q, IDS_KV = np.zeros((B, T0), np.int32), np.zeros((B, S0), np.int32)
FUNCTIONS = ENTRY_POINTS


@pytest.mark.parametrize("function", FUNCTIONS)
@pytest.mark.parametrize(
    "kwargs, error, pattern",
    [
        (dict(q_segment_ids=IDS_Q), ValueError, r"q_segment_ids and kv_segment_ids go together"),
        (dict(kv_segment_ids=IDS_KV), ValueError, r"q_segment_ids and kv_segment_ids go together"),
        (
            dict(q_segment_ids=np.zeros((B, T0 + 1), np.int32), kv_segment_ids=IDS_KV),
            ValueError,
            r"q_segment_ids must have shape \(B, T\) = \(2, 5\), got \(2, 6\)",
        ),
        (
            dict(q_segment_ids=np.zeros((T0,), np.int32), kv_segment_ids=IDS_KV),
            ValueError,
            r"q_segment_ids must have shape \(B, T\) = \(2, 5\), got \(5,\)",
        ),
        (
            dict(q_segment_ids=IDS_Q, kv_segment_ids=np.zeros((B + 1, S0), np.int32)),
            ValueError,
            r"kv_segment_ids must have shape \(B, S\) = \(2, 7\), got \(3, 7\)",
        ),
        (
            dict(q_segment_ids=IDS_Q, kv_segment_ids=np.zeros((B, T0), np.int32)),
            ValueError,
            r"kv_segment_ids must have shape \(B, S\) = \(2, 7\), got \(2, 5\)",
        ),
        (
            dict(q_segment_ids=IDS_Q.astype(np.float32), kv_segment_ids=IDS_KV),
            TypeError,
            r"q_segment_ids must be an integer array, got dtype float32",
        ),
        (
            dict(q_segment_ids=IDS_Q, kv_segment_ids=IDS_KV.astype(bool)),
            TypeError,
            r"kv_segment_ids must be an integer array, got dtype bool",
        ),
    ],
)
def test_invalid_segment_ids(function, kwargs, error, pattern):
    q, k, v = qkv(T0, S0, seed=30)
    with pytest.raises(error, match=pattern):
        FUNCTIONS[function](q, k, v, **kwargs)
