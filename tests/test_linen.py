"""The Flax linen modules: parameters, seed parity, masks, dropout and shape checks."""

import dataclasses

import flax
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from nanoattn import padding_mask
from nanoattn._trace import check_shape
from nanoattn.linen import AttentionConfig, CausalSelfAttention, CrossAttention, MultiHeadAttention

from conftest import np_attention, np_causal, randn
from seed import NanoMoEConfig, SeedMultiHeadAttention, rename_seed_params, seed_forward_numpy

B, T, S, D, N = 2, 5, 7, 48, 6  # H = 8


def init(module, *args):
    return module.init(jax.random.key(0), *args, deterministic=True)


def test_config_head_dim_and_errors():
    assert AttentionConfig().head_dim == 32
    assert AttentionConfig(96, 12).head_dim == 8
    with pytest.raises(
        ValueError,
        match=r"d_model=130 is not divisible by n_heads=4.*"
        r"1, 2, 5, 10, 13, 26, 65, 130$",
    ):
        AttentionConfig(d_model=130, n_heads=4)
    with pytest.raises(ValueError, match="n_heads must be >= 1, got n_heads=0"):
        AttentionConfig(n_heads=0)
    with pytest.raises(ValueError, match="d_model must be >= 1"):
        AttentionConfig(d_model=0)
    for rate in (-0.1, 1.0):
        with pytest.raises(ValueError, match=r"dropout must be in \[0, 1\)"):
            AttentionConfig(dropout=rate)
    with pytest.raises(dataclasses.FrozenInstanceError):
        AttentionConfig().d_model = 64  # type: ignore[misc]


def test_self_attention_parameter_tree_is_exact():
    params = init(CausalSelfAttention(AttentionConfig(D, N)), jnp.ones((B, T, D)))
    shapes = jax.tree.map(jnp.shape, params)
    assert shapes == {
        "params": {
            "qkv": {"kernel": (D, 3 * D), "bias": (3 * D,)},
            "out": {"kernel": (D, D), "bias": (D,)},
        }
    }
    assert MultiHeadAttention is CausalSelfAttention


def test_cross_attention_parameter_tree_is_exact():
    params = init(CrossAttention(AttentionConfig(D, N)), jnp.ones((B, T, D)), jnp.ones((B, S, D)))
    shapes = jax.tree.map(jnp.shape, params)
    assert shapes == {
        "params": {
            "q": {"kernel": (D, D), "bias": (D,)},
            "kv": {"kernel": (D, 2 * D), "bias": (2 * D,)},
            "out": {"kernel": (D, D), "bias": (D,)},
        }
    }


def seed_params(config, x, seed=0):
    """Seed weights with non-zero biases, so a misplaced bias slice shows."""
    params = SeedMultiHeadAttention(config).init(jax.random.key(seed), x, deterministic=True)
    leaves, tree = jax.tree.flatten(params)
    noise = [0.1 * jax.random.normal(jax.random.key(i + 7), a.shape) for i, a in enumerate(leaves)]
    return jax.tree.unflatten(tree, [a + n for a, n in zip(leaves, noise)])


@pytest.mark.parametrize("d_model,n_heads,t", [(128, 4, 5), (48, 6, 11), (30, 5, 1)])
def test_seed_checkpoint_loads_and_matches(d_model, n_heads, t):
    config = NanoMoEConfig(d_model=d_model, n_heads=n_heads)
    x = jnp.asarray(randn(1, 3, t, d_model))
    params = seed_params(config, x)
    seed_out = SeedMultiHeadAttention(config).apply(params, x, deterministic=True)
    ours = CausalSelfAttention(config).apply(rename_seed_params(params), x, deterministic=True)
    np.testing.assert_allclose(ours, seed_out, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(ours, seed_forward_numpy(params, x, n_heads), atol=1e-5, rtol=1e-5)


def test_seed_parity_in_float64(x64):
    config = NanoMoEConfig(d_model=48, n_heads=6)
    x = jnp.asarray(randn(2, 2, 9, 48, dtype=np.float64))
    params = jax.tree.map(lambda a: a.astype(jnp.float64), seed_params(config, x))
    ours = CausalSelfAttention(config).apply(rename_seed_params(params), x, deterministic=True)
    np.testing.assert_allclose(ours, seed_forward_numpy(params, x, 6), atol=1e-12, rtol=1e-12)


def module_and_params(dropout=0.0, seed=0):
    module = CausalSelfAttention(AttentionConfig(D, N, dropout))
    x = jnp.asarray(randn(seed, B, T, D))
    return module, init(module, x), x


def manual_self_attention(params, x, allowed):
    """Projection, heads and the numpy reference, written out independently."""
    p = jax.tree.map(lambda a: np.asarray(a, np.float64), params["params"])
    qkv = np.asarray(x, np.float64) @ p["qkv"]["kernel"] + p["qkv"]["bias"]
    q, k, v = (qkv[..., i * D : (i + 1) * D].reshape(B, T, N, D // N) for i in range(3))
    heads = np_attention(q, k, v, allowed=allowed).reshape(B, T, D)
    return heads @ p["out"]["kernel"] + p["out"]["bias"]


def test_mask_is_anded_with_the_causal_triangle():
    module, params, x = module_and_params()
    valid = np.array([[True] * T, [True, True, True, False, False]])
    got = module.apply(params, x, deterministic=True, mask=padding_mask(valid))
    allowed = np_causal(T, T) & valid[:, None, None, :]
    np.testing.assert_allclose(got, manual_self_attention(params, x, allowed), atol=1e-4)


def test_prefix_invariance_with_positive_control():
    module, params, x = module_and_params(dropout=0.3)  # evaluation mode turns dropout off
    p = 3
    future = jnp.asarray(randn(5, B, T - p, D))
    other = x.at[:, p:].set(future * 10)
    run = jax.jit(lambda x: module.apply(params, x, deterministic=True))
    y1, y2 = run(x), run(other)
    np.testing.assert_allclose(y1[:, :p], y2[:, :p], atol=1e-6)
    assert np.abs(y1[:, p:] - y2[:, p:]).max() > 1e-3  # the futures themselves did change
    # Positive control: changing a permitted prefix token changes later outputs.
    changed = x.at[:, 1].add(1.0)
    y3 = run(changed)
    np.testing.assert_allclose(y3[:, :1], y1[:, :1], atol=1e-6)
    assert (np.abs(y3[:, 1:] - y1[:, 1:]).max(axis=-1) > 1e-4).all()


def test_padded_tokens_with_huge_content_change_nothing():
    module, params, x = module_and_params()
    valid = np.array([[True] * T, [True, True, False, False, False]])
    mask = padding_mask(valid)
    base = module.apply(params, x, deterministic=True, mask=mask)
    noisy = x.at[1, 2:].set(1e6)
    got = module.apply(params, noisy, deterministic=True, mask=mask)
    np.testing.assert_allclose(got[1, :2], base[1, :2], atol=1e-5)
    np.testing.assert_array_equal(got[0], base[0])


def test_dropout_off_when_deterministic_and_on_otherwise():
    module, params, x = module_and_params(dropout=0.5)
    plain = CausalSelfAttention(AttentionConfig(D, N, 0.0)).apply(params, x, deterministic=True)
    np.testing.assert_array_equal(module.apply(params, x, deterministic=True), plain)
    a = module.apply(params, x, rngs={"dropout": jax.random.key(1)})
    b = module.apply(params, x, rngs={"dropout": jax.random.key(2)})
    again = module.apply(params, x, rngs={"dropout": jax.random.key(1)})
    assert np.abs(a - plain).max() > 1e-3 and np.abs(a - b).max() > 1e-3
    np.testing.assert_array_equal(a, again)
    with pytest.raises(flax.errors.InvalidRngError, match="dropout"):
        module.apply(params, x)
    # No rng is needed when the rate is zero, even with deterministic=False.
    zero = CausalSelfAttention(AttentionConfig(D, N, 0.0))
    np.testing.assert_array_equal(zero.apply(params, x), plain)


def test_cross_attention_matches_reference_with_different_lengths():
    module = CrossAttention(AttentionConfig(D, N))
    x, ctx = jnp.asarray(randn(1, B, T, D)), jnp.asarray(randn(2, B, S, D))
    params = init(module, x, ctx)
    valid = np.array([[True] * S, [True] * 3 + [False] * 4])
    got = module.apply(params, x, ctx, deterministic=True, context_mask=valid)
    assert got.shape == (B, T, D)
    p = jax.tree.map(lambda a: np.asarray(a, np.float64), params["params"])
    q = (np.asarray(x, np.float64) @ p["q"]["kernel"] + p["q"]["bias"]).reshape(B, T, N, D // N)
    kv = np.asarray(ctx, np.float64) @ p["kv"]["kernel"] + p["kv"]["bias"]
    k, v = kv[..., :D].reshape(B, S, N, D // N), kv[..., D:].reshape(B, S, N, D // N)
    heads = np_attention(q, k, v, allowed=valid[:, None, None, :]).reshape(B, T, D)
    want = heads @ p["out"]["kernel"] + p["out"]["bias"]
    np.testing.assert_allclose(got, want, atol=1e-4)
    # The same restriction given as a rank-4 mask gives the same answer.
    rank4 = module.apply(params, x, ctx, deterministic=True, context_mask=padding_mask(valid))
    np.testing.assert_array_equal(rank4, got)
    # No causal triangle: the first query depends on the last context token.
    moved = module.apply(params, x, ctx.at[0, -1].add(1.0), deterministic=True)
    base = module.apply(params, x, ctx, deterministic=True)
    assert np.abs(moved[0, 0] - base[0, 0]).max() > 1e-4


def test_sown_weights_are_the_attention_weights():
    module = CausalSelfAttention(AttentionConfig(D, N), sow_weights=True)
    x = jnp.asarray(randn(3, B, T, D))
    params = init(module, x)
    _, state = module.apply(params, x, deterministic=True, mutable="intermediates")
    (w,) = state["intermediates"]["attention_weights"]
    assert w.shape == (B, N, T, T)
    np.testing.assert_allclose(w.sum(-1), 1.0, atol=1e-6)
    assert (np.asarray(w)[:, :, ~np_causal(T, T)] == 0).all()


def test_module_input_errors():
    module, params, x = module_and_params()
    with pytest.raises(
        ValueError,
        match=r"x must have shape \(B, T, D\) = \(\*, \*, 48\), "
        r"got \(2, 5, 40\)",
    ):
        module.apply(params, x[..., :40], deterministic=True)
    with pytest.raises(TypeError, match="mask must be a boolean"):
        module.apply(params, x, deterministic=True, mask=jnp.ones((T, T)))
    cross = CrossAttention(AttentionConfig(D, N))
    ctx = jnp.ones((B, S, D))
    cparams = init(cross, x, ctx)
    with pytest.raises(ValueError, match=r"context must have shape \(B, S, D\) = \(2, \*, 48\)"):
        cross.apply(cparams, x, ctx[:1], deterministic=True)
    with pytest.raises(ValueError, match=r"context_mask must have shape \(B, S\) = \(2, 7\)"):
        cross.apply(cparams, x, ctx, deterministic=True, context_mask=jnp.ones((2, 5), bool))
    with pytest.raises(TypeError, match="context_mask must be a boolean"):
        cross.apply(cparams, x, ctx, deterministic=True, context_mask=jnp.ones((2, 7)))
    with pytest.raises(TypeError, match="must be an AttentionConfig or have d_model"):
        CausalSelfAttention(config=object()).init(jax.random.key(0), x)


def test_shape_check_names_swapped_axes():
    # The layout nanoGPT uses, (B, N, T, H), where (B, T, N, H) is expected.
    swapped = jnp.zeros((B, N, T, D // N))
    with pytest.raises(
        ValueError,
        match=r"q heads: expected shape \(B, T, N, H\) with B=2, T=5, "
        r"N=6, H=8, got \(2, 6, 5, 8\)",
    ):
        check_shape(swapped, "q heads", "B T N H", (B, T, N, D // N), op="reshape")


def test_modules_work_under_jit_and_grad():
    module, params, x = module_and_params()
    loss = jax.jit(jax.grad(lambda p: (module.apply(p, x, deterministic=True) ** 2).sum()))
    grads = loss(params)
    assert all(np.isfinite(g).all() and np.abs(g).max() > 0 for g in jax.tree.leaves(grads))
