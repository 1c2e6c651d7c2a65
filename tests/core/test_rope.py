"""apply_rope: the half-split rotary embedding against a float64 transcription, and
the properties attention relies on (relative positions, identity at 0, norms)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from nanoattn import apply_rope

from _reference import np_rope, randn

B, L, N, H = 2, 7, 3, 10  # every axis a different size; H/2 = 5 frequencies


def test_matches_float64_half_split_transcription():
    x = randn(0, B, L, N, H)
    positions = np.array([[0, 1, 2, 3, 5, 8, 13], [40, 3, 0, 7, 21, 63, 2]], np.int32)
    for base in (10000.0, 37.0):  # a base that is ignored, or used inverted, fails
        got = apply_rope(x, positions, base=base)
        assert got.shape == x.shape and got.dtype == jnp.float32
        np.testing.assert_allclose(got, np_rope(x, positions, base), atol=2e-5, err_msg=f"{base}")


def test_large_positions_in_float64(x64):
    # float64 stays float64, so even positions near 1e5 match the transcription tightly.
    x = randn(1, B, L, N, H, dtype=np.float64)
    positions = np.random.default_rng(2).integers(0, 100_000, (B, L))
    got = apply_rope(x, positions)
    assert got.dtype == jnp.float64
    np.testing.assert_allclose(got, np_rope(x, positions), atol=1e-9)


def test_half_split_pairs_feature_i_with_i_plus_half():
    # The rotation keeps the norm of each pair (i, i + H/2): the interleaved convention
    # (pairs 2i, 2i + 1) would mix these pairs and change their norms.
    x = randn(3, B, L, N, H)
    y = np.asarray(apply_rope(x, np.arange(3, 3 + L)), np.float64)
    half = H // 2
    pair_norm = lambda a: a[..., :half] ** 2 + a[..., half:] ** 2  # noqa: E731
    np.testing.assert_allclose(pair_norm(y), pair_norm(x.astype(np.float64)), rtol=1e-5)
    np.testing.assert_allclose(np.linalg.norm(y, axis=-1), np.linalg.norm(x, axis=-1), rtol=1e-5)


def test_position_zero_is_the_identity():
    x = randn(4, B, L, N, H)
    np.testing.assert_array_equal(apply_rope(x, np.zeros(L, np.int32)), x)


def test_scores_depend_only_on_the_relative_position():
    # <rope(q, m), rope(k, n)> over a grid of m and n is a Toeplitz matrix: it only
    # depends on m - n. Every feature contributes, so each frequency is checked.
    q, k = randn(5, 1, 1, 1, H), randn(6, 1, 1, 1, H)
    M = 24
    pos = np.arange(M)
    rq = np.asarray(apply_rope(np.broadcast_to(q, (1, M, 1, H)), pos))[0, :, 0]  # (M, H)
    rk = np.asarray(apply_rope(np.broadcast_to(k, (1, M, 1, H)), pos))[0, :, 0]
    scores = rq.astype(np.float64) @ rk.T.astype(np.float64)  # scores[m, n]
    for d in range(-M + 1, M):
        diag = np.diagonal(scores, offset=d)
        np.testing.assert_allclose(diag, diag[0], atol=1e-5, err_msg=f"m - n = {-d}")
    # ... and it does depend on m - n: RoPE is not the identity everywhere.
    assert np.ptp(scores[0]) > 0.1


def test_one_dimensional_positions_broadcast_over_the_batch():
    x = randn(7, B, L, N, H)
    pos = np.arange(5, 5 + L)
    np.testing.assert_array_equal(
        apply_rope(x, pos), apply_rope(x, np.broadcast_to(pos, (B, L)).astype(np.int32))
    )


def test_each_batch_row_uses_its_own_positions():
    x = randn(8, B, L, N, H)
    positions = np.stack([np.arange(L), np.arange(L) + 11])
    got = apply_rope(x, positions)
    for b in range(B):
        np.testing.assert_allclose(got[b : b + 1], apply_rope(x[b : b + 1], positions[b]), atol=0)


def test_under_jit_with_traced_positions():
    x = randn(9, B, L, N, H)
    f = jax.jit(apply_rope)
    np.testing.assert_allclose(f(x, np.arange(L) + 2), np_rope(x, np.arange(L) + 2), atol=2e-5)


def test_gradient_is_the_rotation_back():
    # RoPE is an orthogonal map, so its vjp rotates the cotangent by minus the angle.
    x, cot = randn(10, B, L, N, H), randn(11, B, L, N, H)
    positions = np.array([[0, 1, 2, 3, 4, 5, 6], [9, 8, 7, 6, 5, 4, 30]])
    _, vjp = jax.vjp(lambda a: apply_rope(a, positions), x)
    np.testing.assert_allclose(vjp(cot)[0], np_rope(cot, -positions), atol=2e-5)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_half_precision_in_and_out(dtype):
    x = jnp.asarray(randn(12, B, L, N, H), dtype)
    positions = np.arange(L) * 9
    got = apply_rope(x, positions)
    assert got.dtype == dtype
    # Computed in float32 from the same half-precision input: only the final rounding
    # to the half dtype differs, half a unit in the last place of each value.
    want = np_rope(np.asarray(x, np.float64), positions)
    eps = float(jnp.finfo(dtype).eps)
    np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=eps, atol=eps)


@pytest.mark.parametrize(
    "x_shape, positions, error, pattern",
    [
        (
            (B, L, N, 7),
            np.arange(L),
            ValueError,
            r"even head width H, got x of shape \(2, 7, 3, 7\)",
        ),
        ((B, L, H), np.arange(L), ValueError, r"x must have shape \(B, L, N, H\)"),
        ((B, L, N, H), np.arange(L + 1), ValueError, r"positions must have shape \(L,\) = \(7,\)"),
        (
            (B, L, N, H),
            np.zeros((B + 1, L), np.int32),
            ValueError,
            r"positions must have shape \(B, L\) = \(2, 7\), got \(3, 7\)",
        ),
        (
            (B, L, N, H),
            np.zeros((1, 1, L), np.int32),
            ValueError,
            r"positions must have shape \(B, L\) = \(2, 7\), got \(1, 1, 7\)",
        ),
        ((B, L, N, H), np.arange(L) * 1.0, TypeError, "positions must be an integer array"),
    ],
)
def test_invalid_inputs(x_shape, positions, error, pattern):
    with pytest.raises(error, match=pattern):
        apply_rope(np.ones(x_shape, np.float32), positions)


def test_base_must_be_positive():
    with pytest.raises(ValueError, match=r"base must be a finite float > 0, got base=0.0"):
        apply_rope(np.ones((B, L, N, H), np.float32), np.arange(L), base=0.0)
