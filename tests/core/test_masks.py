"""Mask builders: literal expected masks, many lengths, polarity and errors."""

import jax.numpy as jnp
import numpy as np
import pytest

from nanoattn import (
    causal_mask,
    combine_masks,
    lengths_to_valid,
    padding_mask,
    segment_mask,
    window_mask,
)

from _cases import LENGTHS, PRODUCT_LENGTHS
from _reference import np_causal, np_segments, np_window


def test_causal_mask_tiny_literal():
    expected = np.array(
        [
            [1, 0, 0, 0],
            [1, 1, 0, 0],
            [1, 1, 1, 0],
            [1, 1, 1, 1],
        ],
        bool,
    )
    got = causal_mask(4)
    assert got.dtype == jnp.bool_
    np.testing.assert_array_equal(got, expected)


def test_causal_mask_rectangular_offsets_literal():
    # T=2 queries, S=4 keys. Top-left: query 0 sees key 0 only.
    np.testing.assert_array_equal(causal_mask(2, 4, q_offset=0), [[1, 0, 0, 0], [1, 1, 0, 0]])
    # Bottom-right (q_offset = S - T = 2): the last query sees every key.
    np.testing.assert_array_equal(causal_mask(2, 4, q_offset=2), [[1, 1, 1, 0], [1, 1, 1, 1]])
    # More queries than keys, top-left: rows past the keys see all of them.
    np.testing.assert_array_equal(causal_mask(3, 2), [[1, 0], [1, 1], [1, 1]])


def test_causal_mask_batched_offsets():
    got = causal_mask(2, 3, q_offset=jnp.array([0, 1]))
    assert got.shape == (2, 2, 3)
    np.testing.assert_array_equal(got[0], np_causal(2, 3, 0))
    np.testing.assert_array_equal(got[1], np_causal(2, 3, 1))


@pytest.mark.parametrize("L", LENGTHS + PRODUCT_LENGTHS)
def test_causal_mask_at_many_lengths(L):
    got = np.asarray(causal_mask(L))
    np.testing.assert_array_equal(got, np.tril(np.ones((L, L), bool)))
    # The first position sees only itself; the last sees the whole prefix.
    assert got[0].sum() == 1 and got[-1].all()


@pytest.mark.parametrize("T,S,off", [(3, 5, 0), (3, 5, 2), (5, 3, 0), (4, 4, 3), (2, 6, -1)])
def test_causal_mask_matches_positional_rule(T, S, off):
    np.testing.assert_array_equal(causal_mask(T, S, q_offset=off), np_causal(T, S, off))


@pytest.mark.parametrize(
    "T,S,off,window,left,right",
    [
        (4, 4, 0, (1, 0), 1, 0),
        (3, 7, 2, 1, 1, 1),
        (5, 3, -1, (0, 2), 0, 2),
        (6, 9, 3, (4, 3), 4, 3),
    ],
)
def test_window_mask_matches_positional_rule(T, S, off, window, left, right):
    np.testing.assert_array_equal(
        window_mask(T, S, window=window, q_offset=off), np_window(T, S, off, left, right)
    )


def test_window_mask_square_default_and_batched_offsets():
    np.testing.assert_array_equal(window_mask(5, window=(2, 0)), np_window(5, 5, 0, 2, 0))
    got = window_mask(2, 6, window=(1, 1), q_offset=jnp.array([0, 3]))
    assert got.shape == (2, 2, 6)
    np.testing.assert_array_equal(got[0], np_window(2, 6, 0, 1, 1))
    np.testing.assert_array_equal(got[1], np_window(2, 6, 3, 1, 1))


def test_segment_mask_self_and_cross():
    q_ids = np.array([[0, 0, 1], [2, 2, 2]], np.int32)
    kv_ids = np.array([[1, 0, 0, 1], [2, 3, 2, 3]], np.int32)
    got = segment_mask(q_ids)  # self-attention: the keys' ids default to the queries'
    assert got.shape == (2, 1, 3, 3)
    np.testing.assert_array_equal(got, np_segments(q_ids, q_ids))
    np.testing.assert_array_equal(segment_mask(q_ids, kv_ids), np_segments(q_ids, kv_ids))


def test_lengths_to_valid_literal():
    got = lengths_to_valid(jnp.array([3, 0, 5]), 4)
    np.testing.assert_array_equal(got, [[1, 1, 1, 0], [0, 0, 0, 0], [1, 1, 1, 1]])


def test_padding_mask_shapes_and_values():
    kv_valid = jnp.array([[True, True, False], [True, False, False]])
    m = padding_mask(kv_valid)
    assert m.shape == (2, 1, 1, 3)
    np.testing.assert_array_equal(m[:, 0, 0], kv_valid)
    q_valid = jnp.array([[True, False], [True, True]])
    m = padding_mask(kv_valid, q_valid)
    assert m.shape == (2, 1, 2, 3)
    np.testing.assert_array_equal(m[0, 0], [[1, 1, 0], [0, 0, 0]])
    np.testing.assert_array_equal(m[1, 0], [[1, 0, 0], [1, 0, 0]])


def test_causal_and_padding_are_different_masks():
    # Padding hides placeholders even in the past; causality hides valid future tokens.
    causal = np.asarray(causal_mask(4))
    pad = np.asarray(padding_mask(lengths_to_valid(jnp.array([2]), 4)))[0, 0]  # (1, S)
    assert not np.array_equal(np.broadcast_to(pad, (4, 4)), causal)
    assert causal[3, 2] and not pad[0, 2]  # valid past token that padding hides
    assert pad[0, 1] and not causal[0, 1]  # real future token that causality hides


def test_combine_masks_ands_and_broadcasts():
    a = jnp.array([[True, False], [True, True]])
    b = jnp.array([True, False])
    np.testing.assert_array_equal(combine_masks(a, None, b), [[True, False], [True, False]])
    assert combine_masks(None, None) is None
    assert combine_masks() is None


def test_mask_errors():
    with pytest.raises(TypeError, match=r"boolean.*float32"):
        combine_masks(jnp.ones((2, 2)))
    with pytest.raises(ValueError, match=r"broadcast together.*\(2, 3\).*\(4,\)"):
        combine_masks(jnp.ones((2, 3), bool), jnp.ones((4,), bool))
    with pytest.raises(TypeError, match="kv_valid must be a boolean"):
        padding_mask(jnp.ones((2, 3)))
    with pytest.raises(ValueError, match=r"kv_valid must have shape \(B, S\) = \(\*, \*\), got"):
        padding_mask(jnp.ones((3,), bool))
    with pytest.raises(ValueError, match=r"q_valid must have shape \(B, T\) = \(2, \*\), got \(3"):
        padding_mask(jnp.ones((2, 3), bool), jnp.ones((3, 4), bool))
    with pytest.raises(TypeError, match="lengths must be an integer"):
        lengths_to_valid(jnp.array([1.5]), 3)
    with pytest.raises(ValueError, match=r"lengths must have shape \(B,\)"):
        lengths_to_valid(jnp.array([[1]]), 3)
    with pytest.raises(ValueError, match=r">= 0"):
        causal_mask(-1)
    with pytest.raises(TypeError, match="q_offset must be an integer"):
        causal_mask(2, q_offset=0.5)
