"""The Flax linen modules: parameters, seed parity, masks, dropout and shape checks."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from nanoattn import apply_rope, dot_product_attention, padding_mask
from nanoattn._base.trace import check_shape
from nanoattn.linen import AttentionConfig, CausalSelfAttention, CrossAttention, MultiHeadAttention

from _np_layer import np_layer, np_rms_norm, np_softmax
from _reference import np_attention, np_causal, randn
from _seed import NanoMoEConfig, SeedMultiHeadAttention, rename_seed_params, seed_forward_numpy

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


@pytest.mark.slow
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
    with pytest.raises(ValueError, match="needs a 'dropout' rng"):
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


# --- The modern layer: grouped-query heads, RoPE, window, soft-cap, QK norm, packing, dtypes.

K, TL = 2, 11  # key/value heads; a longer sequence for the positional features
H = D // N


def random_params(module, *inputs, seed=7, **kwargs):
    """Random parameters of ``module``'s shapes (traced, not compiled): kernels scaled
    by 1/sqrt(fan-in), biases and norm scales clearly away from their initial values."""
    shapes = jax.eval_shape(
        lambda: module.init(jax.random.key(0), *inputs, deterministic=True, **kwargs)
    )
    leaves, tree = jax.tree.flatten(shapes)
    values = [
        randn(seed + i, *a.shape) * (a.shape[0] ** -0.5 if len(a.shape) == 2 else 0.5) + 0.1
        for i, a in enumerate(leaves)
    ]
    return jax.tree.unflatten(tree, [jnp.asarray(v, a.dtype) for v, a in zip(values, leaves)])


def test_config_options_are_validated_with_one_line_errors():
    cases = [
        (dict(n_kv_heads=4), ValueError, r"^n_kv_heads=4 does not divide n_heads=6, so the query "
         r"heads cannot share key/value heads in equal groups; key/value head counts that "
         r"divide 6: 1, 2, 3, 6$"),
        (dict(n_kv_heads=0), ValueError, r"^n_kv_heads must be an int >= 1 or None, got "
         r"n_kv_heads=0$"),
        (dict(n_kv_heads=2.0), TypeError, r"^n_kv_heads must be an int >= 1 or None, got "
         r"n_kv_heads=2.0$"),
        (dict(rope_base=0.0), ValueError, r"^rope_base must be a finite float > 0, got "
         r"rope_base=0.0$"),
        (dict(rope_base=float("inf")), ValueError, "rope_base must be a finite float > 0"),
        (dict(rope_base="1e4"), TypeError, r"^rope_base must be a float > 0 or "
         r"None, got rope_base='1e4'$"),
        (dict(d_model=30, rope_base=1e4), ValueError, r"^rope_base needs an even head width H, "
         r"got H=5 \(d_model=30 / n_heads=6\)$"),
        (dict(window=-1), ValueError, r"window sides must be >= 0"),
        (dict(window=(1, 2, 3)), TypeError, r"window must be an int w \(meaning \(w, w\)\) or a "
         r"pair \(left, right\) of ints, got \(1, 2, 3\)"),
        (dict(window=1.5), TypeError, "window must be an int w"),
        (dict(logit_soft_cap=0.0), ValueError, "logit_soft_cap must be a finite float > 0"),
        (dict(logit_soft_cap="5"), TypeError, "logit_soft_cap must be a float > 0 or None"),
        (dict(qk_norm=1), TypeError, r"^qk_norm must be True or False, got 1$"),
        (dict(use_bias="yes"), TypeError, r"^use_bias must be True or False, got 'yes'$"),
        (dict(dtype=jnp.int32), TypeError, r"^dtype must be a floating dtype such as "
         r"jnp.float32, got <class 'jax.numpy.int32'>$"),
        (dict(dtype="nonsense"), TypeError, r"^dtype must be a floating dtype .* got 'nonsense'$"),
        (dict(param_dtype=jnp.int8), TypeError, r"^param_dtype must be a floating dtype"),
    ]  # fmt: skip
    for options, error, message in cases:
        options = {"d_model": D, "n_heads": N, **options}
        with pytest.raises(error, match=message):
            AttentionConfig(**options)
        try:
            AttentionConfig(**options)
        except error as e:
            assert len(str(e).splitlines()) == 1


def test_config_normalizes_options_and_derives_sizes():
    config = AttentionConfig(
        D, N, n_kv_heads=K, window=3, logit_soft_cap=5, dtype="bfloat16", rope_base=1e4
    )
    assert (config.head_dim, config.kv_heads, config.groups) == (H, K, N // K)
    assert config.window == (3, 3) and AttentionConfig(window=[2, 0]).window == (2, 0)
    assert config.logit_soft_cap == 5.0 and isinstance(config.logit_soft_cap, float)
    assert config.dtype == jnp.bfloat16 and config.param_dtype == jnp.float32
    assert AttentionConfig(D, N).kv_heads == N and AttentionConfig(D, N, n_kv_heads=1).groups == N
    hash(config)  # usable as a static argument
    assert config == AttentionConfig(
        D, N, n_kv_heads=K, window=(3, 3), logit_soft_cap=5.0, dtype=jnp.bfloat16, rope_base=1e4
    )


def test_from_config_takes_every_field_the_object_has():
    seed = AttentionConfig.from_config(NanoMoEConfig(d_model=D, n_heads=N, dropout=0.25))
    assert seed == AttentionConfig(D, N, 0.25)

    @dataclasses.dataclass
    class Llama:
        d_model: int = D
        n_heads: int = N
        n_kv_heads: int = K
        rope_base: float = 5e5
        vocab_size: int = 100  # not an attention field: ignored

    assert AttentionConfig.from_config(Llama()) == AttentionConfig(
        D, N, n_kv_heads=K, rope_base=5e5
    )
    with pytest.raises(ValueError, match="n_kv_heads=4 does not divide n_heads=6"):
        AttentionConfig.from_config(Llama(n_kv_heads=4))


@pytest.mark.parametrize(
    "options, want",
    [
        (dict(n_kv_heads=K), {"qkv": {"kernel": (D, (N + 2 * K) * H), "bias": ((N + 2 * K) * H,)},
                              "out": {"kernel": (D, D), "bias": (D,)}}),
        (dict(n_kv_heads=1), {"qkv": {"kernel": (D, (N + 2) * H), "bias": ((N + 2) * H,)},
                              "out": {"kernel": (D, D), "bias": (D,)}}),
        (dict(use_bias=False), {"qkv": {"kernel": (D, 3 * D)}, "out": {"kernel": (D, D)}}),
        (dict(n_kv_heads=K, qk_norm=True, use_bias=False, rope_base=1e4, window=4),
         {"qkv": {"kernel": (D, (N + 2 * K) * H)}, "out": {"kernel": (D, D)},
          "q_norm": {"scale": (H,)}, "k_norm": {"scale": (H,)}}),
    ],
)  # fmt: skip
def test_self_attention_parameter_shapes(options, want):
    module = CausalSelfAttention(AttentionConfig(D, N, **options))
    shapes = jax.eval_shape(lambda: init(module, jnp.ones((B, T, D))))
    assert jax.tree.map(jnp.shape, shapes) == {"params": want}


def test_cross_attention_parameter_shapes_and_dtypes():
    config = AttentionConfig(D, N, n_kv_heads=K, qk_norm=True, param_dtype=jnp.bfloat16)
    module = CrossAttention(config)
    shapes = jax.eval_shape(lambda: init(module, jnp.ones((B, T, D)), jnp.ones((B, S, D))))
    assert jax.tree.map(lambda a: (a.shape, a.dtype), shapes["params"]) == {
        "q": {"kernel": ((D, D), jnp.bfloat16), "bias": ((D,), jnp.bfloat16)},
        "kv": {"kernel": ((D, 2 * K * H), jnp.bfloat16), "bias": ((2 * K * H,), jnp.bfloat16)},
        "out": {"kernel": ((D, D), jnp.bfloat16), "bias": ((D,), jnp.bfloat16)},
        "q_norm": {"scale": ((H,), jnp.bfloat16)},
        "k_norm": {"scale": ((H,), jnp.bfloat16)},
    }


EVERYTHING = dict(n_kv_heads=K, rope_base=100.0, window=(3, 0), logit_soft_cap=1.5, qk_norm=True)


@pytest.mark.parametrize(
    "options",
    [
        dict(n_kv_heads=K),
        dict(n_kv_heads=1, qk_norm=True),
        dict(n_kv_heads=K, rope_base=100.0),
        dict(window=(3, 0)),
        dict(n_kv_heads=K, logit_soft_cap=1.5),
        dict(EVERYTHING, implementation="xla"),
        dict(EVERYTHING, implementation="flash", use_bias=False),
    ],
    ids=["gqa", "mqa-qk_norm", "rope", "window", "soft_cap", "all-xla", "all-flash-no-bias"],
)
def test_full_sequence_mode_matches_a_float64_numpy_layer(options):
    config = AttentionConfig(D, N, **options)
    module = CausalSelfAttention(config)
    x = jnp.asarray(randn(4, B, TL, D))
    params = random_params(module, x)
    valid = np.ones((B, TL), bool)
    valid[1, 2] = False
    forward = jax.jit(lambda p, x: module.apply(p, x, True, mask=padding_mask(valid)))
    got = forward(params, x)
    np.testing.assert_allclose(got, np_layer(params, x, config, valid=valid), atol=2e-5, rtol=1e-5)


def test_positions_feed_rope_like_a_direct_computation():
    config = AttentionConfig(D, N, n_kv_heads=K, rope_base=50.0)
    module = CausalSelfAttention(config)
    x = jnp.asarray(randn(5, B, TL, D))
    params = random_params(module, x)
    positions = jnp.asarray(np.stack([np.arange(TL) + 7, np.arange(TL)[::-1] * 3]))  # (B, T)

    def direct(p, x, positions):
        p = p["params"]
        qkv = x @ p["qkv"]["kernel"] + p["qkv"]["bias"][None, None]
        q = qkv[..., : N * H].reshape(B, TL, N, H)
        k = qkv[..., N * H : (N + K) * H].reshape(B, TL, K, H)
        v = qkv[..., (N + K) * H :].reshape(B, TL, K, H)
        q, k = apply_rope(q, positions, base=50.0), apply_rope(k, positions, base=50.0)
        heads = dot_product_attention(q, k, v, is_causal=True).reshape(B, TL, D)
        return heads @ p["out"]["kernel"] + p["out"]["bias"][None, None]

    @jax.jit
    def run(p, x, positions):  # one compilation for the four results
        return (
            module.apply(p, x, True, positions=positions),
            direct(p, x, positions),
            module.apply(p, x, True),
            module.apply(p, x, True, positions=jnp.arange(TL)),
        )

    got, want, default, arange = run(params, x, positions)
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(got, np_layer(params, x, config, positions=positions), atol=2e-5)
    np.testing.assert_allclose(default, arange, atol=1e-6)
    assert np.abs(got - default).max() > 1e-3  # the positions mattered


def test_packed_documents_equal_each_document_alone():
    """Row 0 packs documents of 4 and 7 tokens, row 1 of 7 and 4; RoPE positions
    restart at 0 in each document, and no token attends across documents."""
    module = CausalSelfAttention(AttentionConfig(D, N, **EVERYTHING))
    x = jnp.asarray(randn(6, B, TL, D))
    params = random_params(module, x)
    segment_ids = jnp.array([[0] * 4 + [1] * 7, [5] * 7 + [2] * 4])
    positions = jnp.array([list(range(4)) + list(range(7)), list(range(7)) + list(range(4))])

    @jax.jit
    def run(x, seg, pos):  # one compilation for the four results
        def alone(docs):
            return module.apply(params, docs, True)

        return (
            module.apply(params, x, True, segment_ids=seg, positions=pos),
            module.apply(params, x, True, positions=pos),
            alone(jnp.stack([x[0, :4], x[1, 7:]])),  # (2, 4, D)
            alone(jnp.stack([x[0, 4:], x[1, :7]])),  # (2, 7, D)
        )

    packed, unpacked, short, long = run(x, segment_ids, positions)
    want = jnp.stack([jnp.concatenate([short[0], long[0]]), jnp.concatenate([long[1], short[1]])])
    np.testing.assert_allclose(packed, want, atol=1e-5, rtol=1e-5)
    assert np.abs(unpacked - want).max() > 1e-3  # without segment ids, documents would mix


def test_full_sequence_argument_errors():
    module = CausalSelfAttention(AttentionConfig(D, N, rope_base=1e4))
    x = jnp.ones((B, T, D))
    params = random_params(module, x)
    cases = [
        (dict(positions=jnp.zeros((B, T + 1), jnp.int32)), ValueError,
         r"positions must have shape \(B, T\) = \(2, 5\), got \(2, 6\)"),
        (dict(positions=jnp.zeros((T + 1,), jnp.int32)), ValueError,
         r"positions must have shape \(T,\) = \(5,\), got \(6,\)"),
        (dict(positions=jnp.zeros((B, T))), TypeError, "positions must be an integer array"),
        (dict(segment_ids=jnp.zeros((1, T), jnp.int32)), ValueError,
         r"segment_ids must have shape \(B, T\) = \(2, 5\), got \(1, 5\)"),
        (dict(segment_ids=jnp.zeros((B, T), bool)), TypeError,
         "segment_ids must be an integer array"),
    ]  # fmt: skip
    for kwargs, error, message in cases:
        with pytest.raises(error, match=message):
            module.apply(params, x, True, **kwargs)


def test_compute_dtype_and_param_dtype():
    x = jnp.asarray(randn(8, B, TL, D))
    f32 = CausalSelfAttention(AttentionConfig(D, N, **EVERYTHING))
    params = random_params(f32, x)
    want = jax.jit(lambda p, x: f32.apply(p, x, True))(params, x)
    bf16 = CausalSelfAttention(AttentionConfig(D, N, **EVERYTHING, dtype=jnp.bfloat16))
    got = jax.jit(lambda p, x: bf16.apply(p, x, True))(params, x)
    assert got.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.float32(got), want, atol=5e-2, rtol=5e-2)
    # dtype=None computes in the input's dtype, with float32 parameters.
    out = jax.eval_shape(lambda p, x: f32.apply(p, x, True), params, x.astype(jnp.bfloat16))
    assert out.dtype == jnp.bfloat16
    half = CausalSelfAttention(AttentionConfig(D, N, param_dtype=jnp.bfloat16))
    shapes = jax.eval_shape(lambda: init(half, x))
    assert {a.dtype for a in jax.tree.leaves(shapes)} == {jnp.dtype(jnp.bfloat16)}


def test_cross_attention_gqa_and_qk_norm_match_numpy():
    config = AttentionConfig(D, N, n_kv_heads=K, qk_norm=True, logit_soft_cap=1.5, use_bias=False)
    module = CrossAttention(config)
    x, ctx = jnp.asarray(randn(9, B, T, D)), jnp.asarray(randn(10, B, S, D))
    params = random_params(module, x, ctx)
    valid = np.array([[True] * S, [True] * 3 + [False] * 4])
    got = jax.jit(lambda p: module.apply(p, x, ctx, True, context_mask=valid))(params)
    p = jax.tree.map(lambda a: np.asarray(a, np.float64), params["params"])
    q = (np.asarray(x, np.float64) @ p["q"]["kernel"]).reshape(B, T, N, H)
    kv = np.asarray(ctx, np.float64) @ p["kv"]["kernel"]
    k, v = kv[..., : K * H].reshape(B, S, K, H), kv[..., K * H :].reshape(B, S, K, H)
    q, k = np_rms_norm(q, p["q_norm"]["scale"]), np_rms_norm(k, p["k_norm"]["scale"])
    logits = np.einsum("btnh,bsnh->bnts", q, np.repeat(k, N // K, axis=2)) / np.sqrt(H)
    weights = np_softmax(1.5 * np.tanh(logits / 1.5), valid[:, None, None, :])
    heads = np.einsum("bnts,bsnh->btnh", weights, np.repeat(v, N // K, axis=2))
    want = heads.reshape(B, T, D) @ p["out"]["kernel"]
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-5)
