"""Logit soft-capping (Gemma 2): the logits s = scale * q . k + bias become
cap * tanh(s / cap) before masking and the softmax; gradients are exact."""

import jax
import numpy as np
import pytest
from jax.test_util import check_grads

from nanoattn import attention_weights, dot_product_attention

from _cases import ENTRY_POINTS, Case, assert_cases_match
from _reference import np_attention_vjp, np_causal, randn, sum_to_shape

B, N, K, H = 2, 6, 2, 8


def qkv(T, S, seed=0, spread=3.0, dtype=np.float32):
    # Scaled up so that many logits lie well beyond the cap, where tanh bends.
    return (
        randn(seed, B, T, N, H, dtype=dtype) * spread,
        randn(seed + 1, B, S, K, H, dtype=dtype),
        randn(seed + 2, B, S, K, H, dtype=dtype),
    )


def soft_cap_cases():
    T = 37
    bias = randn(5, 1, N, T, T) * 2  # the cap applies to the bias too
    causal = Case(
        "cap 2 with bias and causality",
        *qkv(T, T),
        allowed=np_causal(T, T),
        bias=bias,
        kwargs=dict(logit_soft_cap=2.0, is_causal=True),
    )
    T, S = 23, 41
    mask = np.random.default_rng(6).random((B, 1, T, S)) > 0.3
    masked = Case(
        "cap 0.7, explicit scale, dense mask, T != S",
        *qkv(T, S, seed=10),
        allowed=mask,
        kwargs=dict(logit_soft_cap=0.7, scale=0.9, mask=mask),
    )
    return [causal, masked]


def test_matches_reference_outputs_and_gradients():
    # On the reference, which defines the rule. Every backend's soft-cap is held against
    # float64 by the backend test base (tests/_backend_base.py) and, with bias and a
    # dense mask, by test_combined.py, which also puts NaN and inf in the bias at blocked
    # cells (tanh(NaN) is NaN, so they must be set aside before the cap).
    assert_cases_match(soft_cap_cases(), implementations=["xla"])


def test_the_numpy_gradient_is_exact():
    # The hand-derived float64 gradient of the tests' reference, against central
    # differences: so the comparisons above check against the true gradient.
    T, S = 3, 4
    q, k, v = (a.astype(np.float64) for a in qkv(T, S, seed=20))
    bias, cot = randn(21, 1, N, T, S, dtype=np.float64), randn(22, B, T, N, H, dtype=np.float64)
    allowed = np_causal(T, S, 1)

    def loss(q, k, v, bias):
        return (np_attention_vjp(q, k, v, cot, allowed, bias, None, 0.8)[0] * cot).sum()

    _, grads = np_attention_vjp(q, k, v, cot, allowed, bias, None, 0.8)
    grads = (*grads[:3], sum_to_shape(grads[3], bias.shape))
    for i, (x, g) in enumerate(zip((q, k, v, bias), grads)):
        numeric = np.zeros_like(x)
        for idx in np.ndindex(x.shape):
            args = [q, k, v, bias]
            for sign in (1, -1):
                bumped = x.copy()
                bumped[idx] += sign * 1e-6
                args[i] = bumped
                numeric[idx] += sign * loss(*args) / 2e-6
        np.testing.assert_allclose(g, numeric, atol=1e-7, err_msg=f"argument {i}")


def test_check_grads_float64(x64):
    T, S = 5, 7
    q, k, v = (a.astype(np.float64) for a in qkv(T, S, seed=30))
    bias = randn(31, 1, N, T, S, dtype=np.float64)
    f = jax.jit(
        lambda q, k, v, bias: dot_product_attention(
            q, k, v, bias=bias, is_causal=True, q_offset=2, logit_soft_cap=1.5
        )
    )
    check_grads(f, (q, k, v, bias), order=1, modes=["rev", "fwd"], eps=1e-5)


def test_weights_ratio_is_bounded_by_the_cap():
    # Capped logits lie in (-c, c), so two visible weights of a row differ by at most
    # a factor exp(2c), however large q . k is. Without the cap the rows are one-hot.
    q, k, _ = qkv(11, 13, seed=40, spread=1e3)
    cap = 1.25
    w = np.asarray(jax.jit(lambda q, k: attention_weights(q, k, logit_soft_cap=cap))(q, k))
    w = w.astype(np.float64)
    ratio = w.max(-1) / w.min(-1)
    assert (ratio <= np.exp(2 * cap) * (1 + 1e-5)).all(), ratio.max()
    assert ratio.max() > np.exp(2 * cap) * 0.9  # the bound is nearly reached
    np.testing.assert_allclose(w.sum(-1), 1, atol=1e-6)


def test_a_huge_cap_changes_nothing():
    q, k, v = qkv(11, 13, seed=50, spread=1.0)
    capped, plain = jax.jit(
        lambda q, k, v: (
            dot_product_attention(q, k, v, logit_soft_cap=1e6),
            dot_product_attention(q, k, v),
        )
    )(q, k, v)
    np.testing.assert_allclose(capped, plain, atol=1e-6)


FUNCTIONS = ENTRY_POINTS


@pytest.mark.parametrize("function", FUNCTIONS)
@pytest.mark.parametrize(
    "cap, error, pattern",
    [
        (
            0.0,
            ValueError,
            r"logit_soft_cap must be a finite float > 0, "
            r"got logit_soft_cap=0.0",
        ),
        (
            -1.0,
            ValueError,
            r"logit_soft_cap must be a finite float > 0, "
            r"got logit_soft_cap=-1.0",
        ),
        (
            float("inf"),
            ValueError,
            r"logit_soft_cap must be a finite float > 0, "
            r"got logit_soft_cap=inf",
        ),
        (
            float("nan"),
            ValueError,
            r"logit_soft_cap must be a finite float > 0, "
            r"got logit_soft_cap=nan",
        ),
        ("2", TypeError, r"logit_soft_cap must be a float > 0 or None, got logit_soft_cap='2'"),
        (True, TypeError, r"logit_soft_cap must be a float > 0 or None, got logit_soft_cap=True"),
    ],
)
def test_invalid_cap(function, cap, error, pattern):
    q, k, v = qkv(5, 7, seed=60)
    with pytest.raises(error, match=pattern):
        FUNCTIONS[function](q, k, v, logit_soft_cap=cap)
