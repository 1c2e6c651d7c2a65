"""Property tests: random shapes, masks, offsets, lengths, windows, segment ids and
soft-caps against the numpy reference.

Hypothesis runs derandomised by default, so CI always draws the same examples;
`HYPOTHESIS_PROFILE=dev` draws fresh ones on each run (profiles in conftest.py).
"""

import jax
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from nanoattn import attention_weights, dot_product_attention

from conftest import np_attention, np_causal, np_segments, np_window

# One compiled program per example, instead of one per operation: much faster here.
STATIC = ("is_causal", "window", "logit_soft_cap")
dot_product_attention = jax.jit(dot_product_attention, static_argnames=STATIC)
attention_weights = jax.jit(attention_weights, static_argnames=STATIC)


@st.composite
def attention_case(draw, extended=False):
    """(q, k, v, kwargs, allowed). ``extended`` also draws a window, segment ids and a
    soft-cap (static arguments: ``window`` and ``logit_soft_cap`` under ``jit``)."""
    B, T, S = draw(st.integers(1, 3)), draw(st.integers(1, 9)), draw(st.integers(1, 9))
    K, G, H = draw(st.integers(1, 3)), draw(st.integers(1, 3)), draw(st.integers(1, 6))
    N = K * G
    rng = np.random.default_rng(draw(st.integers(0, 2**31)))
    q = rng.standard_normal((B, T, N, H)).astype(np.float32)
    k = rng.standard_normal((B, S, K, H)).astype(np.float32)
    v = rng.standard_normal((B, S, K, H)).astype(np.float32)
    kwargs = {}
    allowed = np.ones((B, N, T, S), bool)
    mask_shape = draw(st.sampled_from([None, (T, S), (B, 1, T, S), (1, N, 1, S), (B, N, T, S)]))
    if mask_shape is not None:
        kwargs["mask"] = rng.random(mask_shape) > draw(st.floats(0.0, 0.9))
        allowed &= kwargs["mask"]
    if draw(st.booleans()):
        kwargs["is_causal"] = True
    if extended and draw(st.booleans()):
        kwargs["window"] = (draw(st.integers(0, S + 1)), draw(st.integers(0, S + 1)))
    if kwargs.get("is_causal") or "window" in kwargs:
        kwargs["q_offset"] = draw(st.integers(-2, S + 1))
        if kwargs.get("is_causal"):
            allowed &= np_causal(T, S, kwargs["q_offset"])
        if "window" in kwargs:
            allowed &= np_window(T, S, kwargs["q_offset"], *kwargs["window"])
    if draw(st.booleans()):
        kwargs["kv_lengths"] = rng.integers(0, S + 2, size=B).astype(np.int32)
        allowed &= (np.arange(S) < kwargs["kv_lengths"][:, None])[:, None, None, :]
    if extended and draw(st.booleans()):
        ids = draw(st.integers(1, 3))
        kwargs["q_segment_ids"] = rng.integers(0, ids, (B, T)).astype(np.int32)
        kwargs["kv_segment_ids"] = rng.integers(0, ids, (B, S)).astype(np.int32)
        allowed &= np_segments(kwargs["q_segment_ids"], kwargs["kv_segment_ids"])
    if extended and draw(st.booleans()):
        kwargs["logit_soft_cap"] = draw(st.floats(0.25, 30.0))
    if draw(st.booleans()):
        kwargs["bias"] = rng.standard_normal((1, N, T, S)).astype(np.float32)
    return q, k, v, kwargs, allowed


# Magnitudes up to 1e15 make logits near 1e30: under jit this once gave NaN in about
# one run of three, depending on the examples drawn (test_nonfinite.py pins it). The
# derandomised CI profile keeps the outcome fixed; the dev profile keeps hunting.
# Both checks draw from one case: the scaled inputs keep the shapes and the static
# arguments, so they run the program compiled for the reference check instead of a
# program of their own (the compiling dominates the run time).
@settings(max_examples=40, deadline=None)
@given(attention_case(extended=True), st.floats(1e-3, 1e15))
def test_matches_reference_and_finite_for_any_finite_scale_of_inputs(case, magnitude):
    q, k, v, kwargs, allowed = case
    got = np.asarray(dot_product_attention(q, k, v, **kwargs))
    want = np_attention(
        q, k, v, allowed=allowed, bias=kwargs.get("bias"), soft_cap=kwargs.get("logit_soft_cap")
    )
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=2e-5)
    scaled = np.asarray(dot_product_attention(q * magnitude, k * magnitude, v, **kwargs))
    assert np.isfinite(scaled).all()


@settings(max_examples=40, deadline=None)
@given(attention_case(extended=True))
def test_rows_sum_to_one_or_zero(case):
    q, k, _, kwargs, allowed = case
    w = np.asarray(attention_weights(q, k, **kwargs))
    assert np.isfinite(w).all()
    assert (w[~allowed] == 0).all()
    sums = w.sum(-1)
    has_key = allowed.any(-1)
    np.testing.assert_allclose(sums[has_key], 1.0, atol=1e-5)
    assert (sums[~has_key] == 0).all()
