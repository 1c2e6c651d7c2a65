"""The layer options of today's open models (issue 36): a head width of its own
(``head_dim``), a softmax ``scale``, RoPE scaling, partial and interleaved RoPE, both
QK-norm conventions with their epsilon and offset, and biases per projection. Each
against the float64 numpy layer (tests/_np_layer.py), linen and NNX alike; decoding
with them is in layers/test_kv_cache.py and verify/test_verify_decoding.py (the
``open_models`` configuration of tests/_layer_configs.py)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from nanoattn import nnx as nanoattn_nnx
from nanoattn._layers.norm import rms_norm
from nanoattn.linen import AttentionConfig, CausalSelfAttention, CrossAttention

from _np_layer import np_layer, np_rms_norm, np_softmax
from _reference import randn

B, T, S, D, N, K = 2, 7, 5, 30, 6, 2  # D / N = 5, so a head width of 4 or 7 is its own
H = 7


def random_params(module, *inputs, seed=3):
    """Random parameters of the module's shapes: kernels ~ 1/sqrt(fan-in), the rest
    0.5 N(0, 1) + 0.1, so a skipped bias, norm or offset shows."""
    shapes = jax.eval_shape(lambda: module.init(jax.random.key(0), *inputs, deterministic=True))
    leaves, tree = jax.tree.flatten(shapes)
    values = [
        randn(seed + i, *a.shape) * (a.shape[0] ** -0.5 if len(a.shape) == 2 else 0.5) + 0.1
        for i, a in enumerate(leaves)
    ]
    return jax.tree.unflatten(tree, [jnp.asarray(v, a.dtype) for v, a in zip(values, leaves)])


def shapes(config, *inputs, cls=CausalSelfAttention):
    params = jax.eval_shape(
        lambda: cls(config).init(jax.random.key(0), *inputs, deterministic=True)
    )
    return jax.tree.map(jnp.shape, params["params"])


def test_head_dim_of_its_own_sizes_every_projection():
    x, ctx = jnp.ones((B, T, D)), jnp.ones((B, S, D))
    config = AttentionConfig(D, N, n_kv_heads=K, head_dim=H, qk_norm="projection")
    assert (config.head_dim, config.q_width) == (H, N * H) and config.d_model % N == 0
    assert shapes(config, x) == {
        "qkv": {"kernel": (D, (N + 2 * K) * H), "bias": ((N + 2 * K) * H,)},
        "out": {"kernel": (N * H, D), "bias": (D,)},
        "q_norm": {"scale": (N * H,)},
        "k_norm": {"scale": (K * H,)},
    }
    assert shapes(config, x, ctx, cls=CrossAttention) == {
        "q": {"kernel": (D, N * H), "bias": (N * H,)},
        "kv": {"kernel": (D, 2 * K * H), "bias": (2 * K * H,)},
        "out": {"kernel": (N * H, D), "bias": (D,)},
        "q_norm": {"scale": (N * H,)},
        "k_norm": {"scale": (K * H,)},
    }
    # D need not split into N heads when the head width is given.
    assert AttentionConfig(32, 6, head_dim=H).q_width == 42


def test_biases_per_projection():
    x, ctx = jnp.ones((B, T, D)), jnp.ones((B, S, D))
    qwen2 = shapes(AttentionConfig(D, N, out_bias=False), x)
    assert qwen2 == {"qkv": {"kernel": (D, 3 * D), "bias": (3 * D,)}, "out": {"kernel": (D, D)}}
    only_out = shapes(
        AttentionConfig(D, N, use_bias=False, out_bias=True), x, ctx, cls=CrossAttention
    )
    assert only_out == {"q": {"kernel": (D, D)}, "kv": {"kernel": (D, 2 * D)},
                        "out": {"kernel": (D, D), "bias": (D,)}}  # fmt: skip
    config = AttentionConfig(D, N, use_bias=False, qkv_bias=True)
    assert [config.has_bias(p) for p in ("qkv", "q", "kv", "out")] == [True, True, True, False]


def test_norm_scales_start_so_that_a_fresh_norm_multiplies_by_one():
    x = jnp.ones((B, T, D))
    for offset, start in ((0.0, 1.0), (1.0, 0.0)):
        config = AttentionConfig(D, N, qk_norm="head", qk_norm_offset=offset)
        params = CausalSelfAttention(config).init(jax.random.key(0), x, deterministic=True)
        np.testing.assert_array_equal(params["params"]["q_norm"]["scale"], np.full(D // N, start))
        module = nanoattn_nnx.CausalSelfAttention(config, rngs=nnx.Rngs(0))
        np.testing.assert_array_equal(module.k_norm.scale[...], np.full(D // N, start))


def test_rms_norm_over_a_projection_is_over_every_head_jointly():
    x = randn(1, B, T, N, H).astype(np.float64)
    scale = randn(2, N * H).astype(np.float64)
    got = rms_norm(jnp.asarray(x, jnp.float32), jnp.asarray(scale), axes=2, eps=1e-5, offset=1.0)
    flat = x.reshape(B, T, N * H)
    want = flat / np.sqrt((flat**2).mean(-1, keepdims=True) + 1e-5) * (1.0 + scale)
    np.testing.assert_allclose(got, want.reshape(B, T, N, H), atol=2e-6, rtol=1e-5)
    # ... which is not the per-head norm: the heads' mean squares differ.
    per_head = np_rms_norm(x, scale.reshape(N, H)[0], eps=1e-5, offset=1.0)
    assert np.abs(per_head - want.reshape(B, T, N, H)).max() > 1e-2


OPTIONS = {
    "head_dim": dict(n_kv_heads=K, head_dim=H, rope_base=100.0, rotary_dim=4),
    "scale": dict(n_kv_heads=K, scale=0.9, logit_soft_cap=3.0),
    "head_norm_eps_offset": dict(qk_norm="head", qk_norm_eps=0.5, qk_norm_offset=1.0),
    "projection_norm": dict(n_kv_heads=1, head_dim=4, qk_norm="projection", qk_norm_eps=1e-5),
    "linear_rope": dict(head_dim=H + 1, rope_base=30.0,
                        rope_scaling=dict(rope_type="linear", factor=3.0)),
    "interleaved_partial": dict(n_kv_heads=K, head_dim=H, rope_base=30.0, rotary_dim=6,
                                rope_layout="interleaved", out_bias=False),
    "everything": dict(n_kv_heads=K, head_dim=H + 3, scale=0.25, rope_base=50.0, rotary_dim=8,
                       rope_layout="interleaved", rope_scaling=dict(rope_type="linear", factor=2.0),
                       qk_norm="projection", qk_norm_eps=1e-3, qk_norm_offset=1.0,
                       use_bias=False, qkv_bias=True, window=(3, 0)),
}  # fmt: skip


@pytest.mark.parametrize("name", list(OPTIONS))
def test_linen_and_nnx_match_the_float64_numpy_layer(name):
    config = AttentionConfig(D, N, **OPTIONS[name])
    linen = CausalSelfAttention(config)
    x = jnp.asarray(randn(4, B, T, D))
    params = random_params(linen, x)
    module = nanoattn_nnx.from_linen(config, params, rngs=nnx.Rngs(0))
    positions = np.array([[0, 1, 2, 3, 4, 5, 6], [9, 2, 40, 3, 3, 0, 17]])

    @nnx.jit
    def both(module, x, positions):  # one compilation for both families
        return (
            linen.apply(params, x, True, positions=positions),
            module(x, positions=positions, deterministic=True),
        )

    got, got_nnx = both(module, x, positions)
    want = np_layer(params, x, config, positions=positions)
    np.testing.assert_allclose(got, want, atol=3e-5, rtol=1e-5)
    np.testing.assert_allclose(got_nnx, got, atol=1e-6, rtol=0)


def test_cross_attention_with_a_head_width_scale_and_projection_norm():
    config = AttentionConfig(D, N, n_kv_heads=K, head_dim=H, scale=0.6, qk_norm="projection",
                             qk_norm_eps=1e-4, qk_norm_offset=1.0, out_bias=False)  # fmt: skip
    module = CrossAttention(config)
    x, ctx = jnp.asarray(randn(9, B, T, D)), jnp.asarray(randn(10, B, S, D))
    params = random_params(module, x, ctx)
    got = jax.jit(lambda p: module.apply(p, x, ctx, True))(params)
    p = jax.tree.map(lambda a: np.asarray(a, np.float64), params["params"])
    q = (np.asarray(x, np.float64) @ p["q"]["kernel"] + p["q"]["bias"]).reshape(B, T, N, H)
    kv = np.asarray(ctx, np.float64) @ p["kv"]["kernel"] + p["kv"]["bias"]
    k, v = kv[..., : K * H].reshape(B, S, K, H), kv[..., K * H :].reshape(B, S, K, H)
    norm = dict(eps=1e-4, offset=1.0, axes=2)
    q, k = (
        np_rms_norm(q, p["q_norm"]["scale"], **norm),
        np_rms_norm(k, p["k_norm"]["scale"], **norm),
    )
    logits = np.einsum("btnh,bsnh->bnts", q, np.repeat(k, N // K, axis=2)) * 0.6
    weights = np_softmax(logits, np.ones((1, 1, 1, S), bool))
    heads = np.einsum("bnts,bsnh->btnh", weights, np.repeat(v, N // K, axis=2))
    want = heads.reshape(B, T, N * H) @ p["out"]["kernel"]
    np.testing.assert_allclose(got, want, atol=3e-5, rtol=1e-5)


def test_options_are_validated_with_one_line_errors():
    rope = dict(rope_base=1e4)
    cases = [
        (dict(head_dim=0), ValueError, r"^head_dim must be an int >= 1 or None, got head_dim=0$"),
        (dict(head_dim=4.0), TypeError, r"^head_dim must be an int >= 1 or None, got "
         r"head_dim=4.0$"),
        (dict(scale=-1.0), ValueError, r"^scale must be a finite float > 0, got scale=-1.0$"),
        (dict(scale="1"), TypeError, r"^scale must be a float > 0 or None, got scale='1'$"),
        (dict(rotary_dim=4), ValueError, r"^rotary_dim=4 needs rope_base: without it no RoPE"),
        (dict(rope_layout="interleaved"), ValueError,
         r"^rope_layout='interleaved' needs rope_base"),
        (dict(rope_scaling=dict(rope_type="linear", factor=2.0)), ValueError,
         r"^rope_scaling=RopeScaling\(rope_type='linear', .*\) needs rope_base"),
        (dict(rope, rotary_dim=3), ValueError, r"^rotary_dim must be an even int in \[2, H\] \(the "
         r"rotated features of each head\), got rotary_dim=3 with H=5$"),
        (dict(rope, head_dim=8, rotary_dim=10), ValueError, r"got rotary_dim=10 with H=8$"),
        (dict(rope, rotary_dim=True), TypeError, r"^rotary_dim must be an even int >= 2 or None"),
        (dict(rope, head_dim=5), ValueError, r"^rope_base needs an even head width H, got "
         r"head_dim=5; rotary_dim can rotate an even part of it$"),
        (dict(rope, rope_layout="split"), ValueError,
         r"^rope_layout must be 'half' or 'interleaved', got rope_layout='split'$"),
        (dict(rope, head_dim=8, rope_scaling="yarn"), TypeError,
         r"^rope_scaling must be None or a mapping with a rope_type, got str$"),
        (dict(rope, head_dim=8, rope_scaling=dict(rope_type="longrope")), ValueError,
         r"^rope_scaling rope_type must be one of \('linear', 'llama3', 'yarn', 'dynamic'\), "
         r"got 'longrope'$"),
        (dict(rope, head_dim=8, rope_scaling=dict(rope_type="yarn", factor=2.0)), ValueError,
         r"^rope_scaling rope_type 'yarn' needs original_max_position_embeddings$"),
        (dict(rope, head_dim=8, rope_scaling=dict(rope_type="linear", factor=0.0)), ValueError,
         r"^rope_scaling factor must be a finite float > 0, got rope_scaling factor=0.0$"),
        (dict(rope, head_dim=8, rope_scaling=dict(rope_type="linear", factor=2.0, beta_fast=4)),
         ValueError, r"^rope_scaling key 'beta_fast' is not a parameter of rope_type 'linear', "
         r"which takes factor$"),
        (dict(rope, head_dim=8, rope_scaling=dict(rope_type="llama3", factor=8.0,
                                                  low_freq_factor=4.0, high_freq_factor=1.0,
                                                  original_max_position_embeddings=64)),
         ValueError, r"^rope_scaling low_freq_factor=4.0 must be below high_freq_factor=1.0$"),
        (dict(qk_norm="joint"), ValueError,
         r"^qk_norm must be 'head', 'projection', True or False, got qk_norm='joint'$"),
        (dict(qk_norm_eps=1e-5), ValueError, r"^qk_norm_eps=1e-05 needs qk_norm"),
        (dict(qk_norm="head", qk_norm_eps=0.0), ValueError,
         r"^qk_norm_eps must be a finite float > 0, got qk_norm_eps=0.0$"),
        (dict(qk_norm_offset=1.0), ValueError, r"^qk_norm_offset=1.0 needs qk_norm"),
        (dict(qk_norm="head", qk_norm_offset=float("nan")), ValueError,
         r"^qk_norm_offset must be a finite float, got qk_norm_offset=nan$"),
        (dict(qk_norm="head", qk_norm_offset="1"), TypeError,
         r"^qk_norm_offset must be a finite float, got qk_norm_offset='1'$"),
        (dict(qkv_bias=1), TypeError, r"^qkv_bias must be True or False, got 1$"),
        (dict(out_bias="no"), TypeError, r"^out_bias must be True or False, got 'no'$"),
    ]  # fmt: skip
    for options, error, message in cases:
        with pytest.raises(error, match=message) as e:
            AttentionConfig(**{"d_model": D, "n_heads": N, **options})
        assert "\n" not in str(e.value)


def test_options_are_normalized_and_hashable():
    config = AttentionConfig(D, N, head_dim=6, qk_norm=True, rope_base=10.0,
                             rope_scaling={"type": "linear", "factor": 2})  # fmt: skip
    assert config.qk_norm == "head" and AttentionConfig(D, N, qk_norm=False).qk_norm is False
    assert config == AttentionConfig(D, N, head_dim=6, qk_norm="head", rope_base=10.0,
                                     rope_scaling=config.rope_scaling)  # fmt: skip
    assert config.rope_scaling.as_dict() == {"rope_type": "linear", "factor": 2.0}
    assert AttentionConfig(D, N).head_dim == D // N and AttentionConfig(D, N).scale is None
    hash(config)
