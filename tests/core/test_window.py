"""Local (sliding-window) attention: the float64 reference, jax.nn and the errors.

Query i sits at position p = q_offset + i and may see key j iff
p - left <= j <= p + right, combined by AND with causality.
"""

import jax
import numpy as np
import pytest

from nanoattn import attention_weights, dot_product_attention

from _cases import ENTRY_POINTS, Case, assert_cases_match
from _reference import np_causal, np_window, randn

B, N, K, H = 2, 6, 2, 8


def qkv(T, S, seed=0, n=N, k=K):
    return randn(seed, B, T, n, H), randn(seed + 1, B, S, k, H), randn(seed + 2, B, S, k, H)


def window_case(name, T, S, window, q_offset=None, is_causal=False, seed=0):
    left, right = (window, window) if isinstance(window, int) else window
    offset = 0 if q_offset is None else q_offset
    allowed = np_window(T, S, offset, left, right)
    if is_causal:
        offsets = np.broadcast_to(np.asarray(offset), (B,))
        allowed = allowed & np.stack([np_causal(T, S, int(o)) for o in offsets])[:, None]
    kwargs = dict(window=window, is_causal=is_causal)
    if q_offset is not None:
        kwargs["q_offset"] = q_offset
    return Case(name, *qkv(T, S, seed), allowed=allowed, kwargs=kwargs)


# The rule on the reference, which defines it. Each backend's windows (causal, two-sided,
# with every other rule) are held against float64 by the backend test base
# (tests/_backend_base.py), flash's at every offset by the sweep of test_flash.py, and
# with RoPE, a dense mask and bias by test_combined.py.
CASES = [
    window_case("T > S top-left, (5, 3), late rows see nothing", 53, 23, (5, 3), q_offset=0),
    window_case("square (5, 3)", 53, 53, (5, 3), seed=1),
    window_case("causal sliding (4, 0)", 53, 53, (4, 0), is_causal=True, seed=2),
    window_case("T < S bottom-right", 23, 53, (7, 2), q_offset=30, seed=4),
    window_case("negative offset, int window", 23, 37, 3, q_offset=-5, is_causal=True, seed=6),
    window_case("per-row traced offsets", 23, 53, (5, 1), np.array([0, 30], np.int32), True, 7),
    window_case("scalar array offset", 23, 37, (2, 4), q_offset=np.int32(7), seed=8),
    window_case("0: the diagonal only", 37, 37, 0, seed=11),
    window_case("causal, right side has no effect", 37, 37, (6, 3), is_causal=True, seed=3),
    window_case("wider than everything", 37, 37, (100, 100), seed=9),
    window_case("left unbounded = causal", 37, 37, (1000, 0), seed=10),
]


def test_matches_reference_outputs_and_gradients():
    results = assert_cases_match(CASES, implementations=["xla"])
    # Queries at 28.. are right of every key's band: exact zeros, zero gradients.
    for implementation, outs in results.items():
        out, (dq, *_) = outs[0]
        assert (np.asarray(out[:, 28:]) == 0).all(), implementation
        assert (np.asarray(dq[:, 28:]) == 0).all(), implementation
        assert (np.abs(np.asarray(out[:, :28])) > 0).all(), implementation


JAX_NN_WINDOWS = [((0, 0), False), ((3, 0), False), ((5, 7), False), (4, True)]


def test_equals_jax_nn_local_window_size():
    # T == S and q_offset 0: the same rule as jax.nn's local_window_size (every query
    # sees at least itself, so jax.nn's mean-of-V for empty rows never comes in).
    q, k, v = qkv(29, 29, seed=20)

    @jax.jit
    def run(q, k, v):
        ours = [dot_product_attention(q, k, v, window=w, is_causal=c) for w, c in JAX_NN_WINDOWS]
        theirs = [
            jax.nn.dot_product_attention(q, k, v, local_window_size=w, is_causal=c)
            for w, c in JAX_NN_WINDOWS
        ]
        return ours, theirs

    for (w, c), a, b in zip(JAX_NN_WINDOWS, *run(q, k, v)):
        np.testing.assert_allclose(a, b, atol=2e-5, rtol=2e-5, err_msg=f"window={w} causal={c}")


def test_weights_literal():
    # Equal logits: each query spreads its weight evenly over the keys of its window.
    # T=3 queries at positions 2, 3, 4; window (1, 2); S=6 keys.
    q, k = np.zeros((1, 3, 1, 4), np.float32), np.zeros((1, 6, 1, 4), np.float32)
    w, causal = jax.jit(
        lambda q, k: [
            attention_weights(q, k, window=(1, 2), q_offset=2, is_causal=c) for c in (False, True)
        ]
    )(q, k)
    expected = [
        [0, 1 / 4, 1 / 4, 1 / 4, 1 / 4, 0],  # p=2 sees keys 1..4
        [0, 0, 1 / 4, 1 / 4, 1 / 4, 1 / 4],  # p=3 sees keys 2..5
        [0, 0, 0, 1 / 3, 1 / 3, 1 / 3],  # p=4 sees keys 3..6; there is no key 6
    ]
    np.testing.assert_allclose(w[0, 0], expected, atol=1e-7)
    expected = [[0, 1 / 2, 1 / 2, 0, 0, 0], [0, 0, 1 / 2, 1 / 2, 0, 0], [0, 0, 0, 1 / 2, 1 / 2, 0]]
    np.testing.assert_allclose(causal[0, 0], expected, atol=1e-7)


def test_same_as_its_mask_and_square_default_offset_is_zero():
    q, k, v = qkv(11, 17, seed=30)

    @jax.jit
    def run(q, k, v):
        return (
            dot_product_attention(q, k, v, window=(3, 1), q_offset=4),
            dot_product_attention(q, k, v, mask=np_window(11, 17, 4, 3, 1)),
            dot_product_attention(q, k[:, :11], v[:, :11], window=(2, 1)),
            dot_product_attention(q, k[:, :11], v[:, :11], window=(2, 1), q_offset=0),
        )

    window, mask, default, zero = run(q, k, v)
    np.testing.assert_allclose(window, mask, atol=1e-6)
    np.testing.assert_array_equal(default, zero)


FUNCTIONS = ENTRY_POINTS


@pytest.mark.parametrize("function", FUNCTIONS)
@pytest.mark.parametrize(
    "kwargs, error, pattern",
    [
        (
            dict(window=-1),
            ValueError,
            r"window sides must be >= 0, got \(left, right\) = \(-1, -1\)",
        ),
        (dict(window=(2, -3)), ValueError, r"got \(left, right\) = \(2, -3\)"),
        (
            dict(window=(1, 2, 3)),
            TypeError,
            r"window must be an int w .* or a pair .*got \(1, 2, 3\)",
        ),
        (dict(window=1.5), TypeError, r"window must be an int w .*got 1.5"),
        (dict(window=(1.0, 2)), TypeError, r"window must be an int w .*got \(1.0, 2\)"),
        (dict(window=True), TypeError, r"window must be an int w .*got True"),
        (dict(window="ab"), TypeError, r"window must be an int w .*got 'ab'"),
        (
            dict(window=(2, 0)),
            ValueError,
            r"window=\(2, 0\) with T=5 queries and S=7 keys needs q_offset.*q_offset=S-T=2",
        ),
        (
            dict(q_offset=1),
            ValueError,
            r"q_offset only applies to causal or windowed attention, or to the positions "
            r"mask_fn and score_fn see; pass is_causal=True, a window, mask_fn or score_fn",
        ),
        (
            dict(window=2, q_offset=True),
            TypeError,
            r"^q_offset must be an int or an int array, got bool True$",
        ),
        (dict(window=2, q_offset=np.array([1.0, 2.0])), TypeError, r"q_offset must be an integer"),
        (
            dict(window=2, q_offset=np.array([1, 2, 3])),
            ValueError,
            r"q_offset must have shape \(B,\)",
        ),
    ],
)
def test_invalid_window_arguments(function, kwargs, error, pattern):
    q, k, v = qkv(5, 7, seed=40)
    with pytest.raises(error, match=pattern):
        FUNCTIONS[function](q, k, v, **kwargs)
