"""The checklist of the textbook chapter (shared/seed/001_*.txt), item by item."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from nanoattn import (
    attention_weights,
    causal_mask,
    combine_masks,
    dot_product_attention,
    lengths_to_valid,
    padding_mask,
)
from nanoattn.linen import AttentionConfig, CausalSelfAttention, CrossAttention
from nanoattn.verify import check_shapes
from nanoattn.verify._shapes import trace_stages

from _cases import LENGTHS, PRODUCT_LENGTHS
from _reference import np_attention, randn


def test_worked_example_shapes_of_the_seed_configuration():
    # d_model 128, 4 heads, batch 2, 5 tokens: head width 128 / 4 = 32.
    config = AttentionConfig(128, 4)
    assert config.head_dim == 32
    shapes = {s.name: s.shape for s in trace_stages(config, batch=2, seq_len=5)}
    assert shapes["qkv"] == (2, 5, 384)
    assert shapes["q"] == (2, 5, 128)
    assert shapes["q heads"] == (2, 5, 4, 32)
    assert shapes["scores"] == (2, 4, 5, 5)
    assert shapes["concatenated heads"] == (2, 5, 128)
    assert shapes["output"] == (2, 5, 128)


def test_the_reference_records_its_stages_with_axes_and_ops():
    stages = {s.name: s for s in trace_stages(AttentionConfig(128, 4), batch=2, seq_len=5)}
    got = [(stages[n].shape, stages[n].axes, stages[n].op) for n in REFERENCE_STAGES]
    assert got == [
        ((2, 4, 5, 5), ("B", "N", "T", "S"), "einsum"),
        ((2, 4, 5, 5), ("B", "N", "T", "S"), "softmax"),
        ((2, 5, 4, 32), ("B", "T", "N", "H"), "einsum"),
    ]


REFERENCE_STAGES = ("scores", "weights", "per-head output")


def test_element_counts_are_kept_through_every_reshape():
    config = AttentionConfig(96, 6)
    report = check_shapes(config, batch=3, seq_len=7)
    assert report.passed
    by_name = {c.name: c.data["elements"] for c in report.checks}
    assert by_name["q"] + by_name["k"] + by_name["v"] == by_name["qkv"]
    assert by_name["q heads"] == by_name["q"] == by_name["concatenated heads"]


def test_cross_attention_scores_are_query_length_by_key_length():
    config = AttentionConfig(64, 4)
    shapes = {s.name: s.shape for s in trace_stages(config, batch=2, seq_len=3, kv_len=11)}
    assert shapes["scores"] == (2, 4, 3, 11)
    assert shapes["output"] == (2, 3, 64)  # the output keeps the query length
    module = CrossAttention(config)
    x, ctx = jnp.ones((2, 3, 64)), jnp.ones((2, 11, 64))
    # Under jit: one program each instead of one per operation (some thirty).
    params = jax.jit(functools.partial(module.init, deterministic=True))(jax.random.key(0), x, ctx)
    out = jax.jit(functools.partial(module.apply, deterministic=True))(params, x, ctx)
    assert out.shape == (2, 3, 64)


def test_tiny_mask_first_row_sees_itself_last_row_sees_all():
    m = np.asarray(causal_mask(4))
    assert m[0].tolist() == [True, False, False, False]
    assert m[1].tolist() == [True, True, False, False]
    assert m[3].all()


def test_row_with_both_kinds_of_blocked_cell_still_sums_to_one():
    T = 5
    valid = lengths_to_valid(jnp.array([3]), T)  # positions 4 and 5 are placeholders
    mask = combine_masks(causal_mask(T), padding_mask(valid))  # (1, 1, T, S)
    row = np.asarray(mask)[0, 0, 3]  # token 4: padding blocks key 4, causality key 5
    assert row.tolist() == [True, True, True, False, False]
    assert np.asarray(causal_mask(T))[3, 3] and not np.asarray(valid)[0, 3]
    q, k = randn(0, 1, T, 2, 4), randn(1, 1, T, 2, 4)
    w = np.asarray(attention_weights(q, k, mask=mask))
    np.testing.assert_allclose(w[0, :, 3].sum(-1), 1.0, atol=1e-6)
    assert (w[0, :, 3, 3:] == 0).all()


SOWING = CausalSelfAttention(AttentionConfig(12, 3), sow_weights=True)
sown_weights = jax.jit(
    lambda p, x: SOWING.apply(p, x, deterministic=True, mutable="intermediates")[1]
)


@functools.cache
def sowing_params():
    """The parameters do not depend on the length: initialised once, under jit
    (eagerly, the initialisers compile some forty small programs)."""
    init = jax.jit(functools.partial(SOWING.init, deterministic=True))
    return init(jax.random.key(0), jnp.zeros((2, 1, 12)))


@pytest.mark.parametrize("L", LENGTHS + PRODUCT_LENGTHS)
def test_module_weights_are_causal_at_many_lengths(L):
    x = jnp.asarray(randn(L, 2, L, 12))
    (w,) = sown_weights(sowing_params(), x)["intermediates"]["attention_weights"]
    w = np.asarray(w)
    assert w.shape == (2, 3, L, L)
    assert (w[:, :, ~np.tril(np.ones((L, L), bool))] == 0).all()
    np.testing.assert_allclose(w.sum(-1), 1.0, atol=1e-5)
    assert (w[:, :, 0, 0] == 1).all()  # the first token sees only itself


@pytest.mark.parametrize("L", [1, 8, 17, 65, 129])
def test_functional_causal_matches_reference_at_lengths(L):
    q, k, v = randn(0, 1, L, 2, 4), randn(1, 1, L, 1, 4), randn(2, 1, L, 1, 4)
    got = jax.jit(lambda q, k, v: dot_product_attention(q, k, v, is_causal=True))(q, k, v)
    want = np_attention(q, k, v, allowed=np.tril(np.ones((L, L), bool)))
    np.testing.assert_allclose(got, want, atol=1e-5)


def test_model_width_must_divide_by_head_count():
    with pytest.raises(ValueError, match="d_model=100 is not divisible by n_heads=8"):
        AttentionConfig(d_model=100, n_heads=8)
