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

from _cases import attention_case
from _reference import np_attention

# One compiled program per example, instead of one per operation: much faster here.
STATIC = ("is_causal", "window", "logit_soft_cap")
dot_product_attention = jax.jit(dot_product_attention, static_argnames=STATIC)
attention_weights = jax.jit(attention_weights, static_argnames=STATIC)


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
