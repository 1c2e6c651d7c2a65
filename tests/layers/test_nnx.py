"""The Flax NNX modules: the linen modules' parameters and outputs, conversion both
ways, decoding through nnx.Cache variables, NNX dropout conventions, and the
NNX transforms (jit, grad, split/merge, scan over a stack, an optax Optimizer).

Sizes are distinct (B=2, T=11, capacity 13, D=48, N=6, K=2, H=8) so a swapped
axis fails.
"""

import doctest

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _caches import slot_mask
from flax import nnx

import nanoattn._layers.nnx.attention
from nanoattn import linen, padding_mask
from nanoattn.nnx import (
    AttentionConfig,
    CausalSelfAttention,
    CrossAttention,
    MultiHeadAttention,
    from_linen,
    to_linen,
)

from _np_layer import np_layer
from _reference import randn

B, T, S, CAP, D, N, K = 2, 11, 7, 13, 48, 6, 2
H = D // N
WIDTH = 5  # the width of the right-padded chunks of the jitted decode step
EVERYTHING = dict(n_kv_heads=K, rope_base=100.0, window=(4, 0), logit_soft_cap=2.0, qk_norm=True)
CONFIGS = {
    "mha": dict(),
    "mqa-qk_norm-no_bias": dict(n_kv_heads=1, qk_norm=True, use_bias=False),
    "everything-flash": dict(EVERYTHING, implementation="flash"),
    "bfloat16": dict(EVERYTHING, dtype=jnp.bfloat16),
    "bfloat16-params": dict(n_kv_heads=K, param_dtype=jnp.bfloat16),
}


def nonzero(params, seed=3):
    """Random parameters of the same tree: biases and norm scales clearly non-zero and
    not one, so a dropped bias or a skipped norm shows."""
    leaves, tree = jax.tree.flatten(params)
    values = [
        randn(seed + i, *a.shape) * (a.shape[0] ** -0.5 if a.ndim == 2 else 0.5) + 0.1
        for i, a in enumerate(leaves)
    ]
    return jax.tree.unflatten(tree, [jnp.asarray(v, a.dtype) for v, a in zip(values, leaves)])


def linen_params(config, module=linen.CausalSelfAttention, *args, seed=3):
    layer = module(config)
    x = jnp.ones((B, T, D))
    shapes = jax.eval_shape(lambda: layer.init(jax.random.key(0), x, *args, deterministic=True))
    return layer, nonzero(jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes), seed)


def test_parameters_have_the_linen_names_and_shapes():
    for options in (dict(), dict(n_kv_heads=K, qk_norm=True, use_bias=False)):
        config = AttentionConfig(D, N, **options)
        _, params = linen_params(config)
        module = CausalSelfAttention(config, rngs=nnx.Rngs(0))
        assert jax.tree.map(jnp.shape, to_linen(module)) == jax.tree.map(
            jnp.shape, params["params"]
        )
    assert jax.tree.map(jnp.shape, to_linen(module)) == {
        "qkv": {"kernel": (D, (N + 2 * K) * H)},
        "out": {"kernel": (D, D)},
        "q_norm": {"scale": (H,)},
        "k_norm": {"scale": (H,)},
    }
    cross = CrossAttention(AttentionConfig(D, N, n_kv_heads=K), rngs=nnx.Rngs(0))
    assert jax.tree.map(jnp.shape, to_linen(cross)) == {
        "q": {"kernel": (D, D), "bias": (D,)},
        "kv": {"kernel": (D, 2 * K * H), "bias": (2 * K * H,)},
        "out": {"kernel": (D, D), "bias": (D,)},
    }
    assert MultiHeadAttention is CausalSelfAttention


@pytest.mark.parametrize("name", list(CONFIGS))
def test_outputs_equal_the_linen_module_with_the_same_weights_both_ways(name):
    config = AttentionConfig(D, N, **CONFIGS[name])
    layer, params = linen_params(config)
    x = jnp.asarray(randn(1, B, T, D))
    valid = np.ones((B, T), bool)
    valid[1, 3] = False
    positions = jnp.asarray(np.stack([np.arange(T) + 4, np.arange(T) * 2]))  # (B, T)
    segments = jnp.asarray(np.repeat([[0] * 6 + [1] * 5], B, 0))
    extras = dict(mask=padding_mask(valid), positions=positions, segment_ids=segments)

    def both(params, module, x):
        return (
            layer.apply(params, x, True, **extras),
            layer.apply(params, x, True),
            module(x, **extras),
            module(x),
        )

    # linen -> NNX
    module = from_linen(config, params, rngs=nnx.Rngs(0))
    a, b, c, d = nnx.jit(both)(params, module, x)
    np.testing.assert_array_equal(c, a)
    np.testing.assert_array_equal(d, b)
    assert c.dtype == a.dtype == (config.dtype or jnp.float32)
    assert np.abs(np.asarray(a, np.float32) - np.asarray(b, np.float32)).max() > 1e-2
    # NNX -> linen: a freshly initialised module's weights, through to_linen
    module = CausalSelfAttention(config, rngs=nnx.Rngs(5))
    a, b, c, d = nnx.jit(both)({"params": to_linen(module)}, module, x)
    np.testing.assert_array_equal(c, a)
    np.testing.assert_array_equal(d, b)


def test_outputs_match_a_float64_numpy_layer():
    config = AttentionConfig(D, N, **EVERYTHING)
    _, params = linen_params(config)
    module = from_linen(config, params, rngs=nnx.Rngs(0))
    x = jnp.asarray(randn(2, B, T, D))
    segments = np.repeat([[0] * 4 + [1] * 7], B, 0)
    got = nnx.jit(lambda m, x: m(x, segment_ids=jnp.asarray(segments)))(module, x)
    want = np_layer(params, x, config, segment_ids=segments)
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-5)


def test_cross_attention_equals_linen_both_ways():
    config = AttentionConfig(D, N, n_kv_heads=K, qk_norm=True, logit_soft_cap=1.5)
    x, context = jnp.asarray(randn(1, B, T, D)), jnp.asarray(randn(2, B, S, D))
    valid = jnp.asarray(np.arange(S)[None] < np.array([[S], [4]]))  # (B, S)
    layer, params = linen_params(config, linen.CrossAttention, jnp.ones((B, S, D)))
    module = from_linen(config, params, rngs=nnx.Rngs(0))
    assert isinstance(module, CrossAttention)

    def both(params, module):
        return layer.apply(params, x, context, True, context_mask=valid), module(
            x, context, context_mask=valid
        )

    a, b = nnx.jit(both)(params, module)
    np.testing.assert_array_equal(b, a)
    module = CrossAttention(config, rngs=nnx.Rngs(1))
    a, b = nnx.jit(both)({"params": to_linen(module)}, module)
    np.testing.assert_array_equal(b, a)


def test_from_linen_names_what_does_not_fit():
    config = AttentionConfig(D, N, n_kv_heads=K)
    _, params = linen_params(config)
    p = params["params"]
    with pytest.raises(ValueError, match=r"^linen_params lacks k_norm/scale \(8,\) of the config$"):
        from_linen(AttentionConfig(D, N, n_kv_heads=K, qk_norm=True), p, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"^linen_params has out/bias, which the config"):
        from_linen(AttentionConfig(D, N, n_kv_heads=K, use_bias=False), p, rngs=nnx.Rngs(0))
    with pytest.raises(
        ValueError,
        match=r"^linen_params qkv/bias is float32\[80\]; the config expects float32\[144\]$",
    ):
        from_linen(AttentionConfig(D, N), p, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"^linen_params qkv/bias is bfloat16\[80\]"):
        bad = {**p, "qkv": {**p["qkv"], "bias": p["qkv"]["bias"].astype(jnp.bfloat16)}}
        from_linen(config, bad, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"must hold a self-attention .* got keys \['out'\]$"):
        from_linen(config, {"out": p["out"]}, rngs=nnx.Rngs(0))


# Decoding ----------------------------------------------------------------------------


def decode_case(name, capacity=CAP, seed=0):
    config = AttentionConfig(D, N, **CONFIGS[name])
    _, params = linen_params(config, seed=seed + 3)
    module = from_linen(config, params, rngs=nnx.Rngs(0))
    x = jnp.asarray(randn(seed, B, T, D))
    full = nnx.jit(lambda m, x: m(x))(module, x)
    module.init_cache(B, capacity)
    return module, x, full


@nnx.jit
def step(module, chunk, lengths):
    return module(chunk, decode=True, lengths=lengths)


@pytest.mark.parametrize("name", ["everything-flash", "bfloat16"])
def test_decoding_in_ragged_chunks_equals_the_full_forward(name):
    module, x, full = decode_case(name)
    x = np.asarray(x, np.float32)
    chunkings = [[4, 1, 1, 5], [1, 3, 0, 2, 5]]  # row 1 takes no token at step 2
    done, outs = [0, 0], [[], []]
    for i in range(max(map(len, chunkings))):
        lengths = [c[i] if i < len(c) else 0 for c in chunkings]
        chunk = np.full((B, WIDTH, D), np.nan, np.float32)  # padding holds NaN
        for b, n in enumerate(lengths):
            chunk[b, :n] = x[b, done[b] : done[b] + n]
        y = step(module, jnp.asarray(chunk, full.dtype), jnp.asarray(lengths))
        for b, n in enumerate(lengths):
            outs[b].append(np.asarray(y[b, :n], np.float32))
            np.testing.assert_array_equal(y[b, n:], 0)  # padded positions give zeros
            done[b] += n
        np.testing.assert_array_equal(module.cache.position[...], done)
    atol = 2e-2 if full.dtype == jnp.bfloat16 else 2e-5
    for b in range(B):
        np.testing.assert_allclose(np.concatenate(outs[b]), full[b], atol=atol, rtol=atol)


def test_unpadded_chunks_and_the_cache_state():
    module, x, full = decode_case("everything-flash")
    cache = nnx.state(module, nnx.Cache)
    assert jax.tree.map(jnp.shape, nnx.to_pure_dict(cache)) == {
        "cache": {"key": (B, CAP, K, H), "value": (B, CAP, K, H), "position": (B,), "last": (B,)}
    }
    assert module.cache.key[...].dtype == jnp.float32
    y = nnx.jit(lambda m, x: m(x, decode=True))(module, x)  # the whole sequence as one chunk
    np.testing.assert_allclose(y, full, atol=2e-5, rtol=1e-5)
    assert module.cache.position[...].tolist() == [T, T]
    module.init_cache(B, CAP, jnp.bfloat16)  # a fresh cache: position 0 again
    assert module.cache.position[...].tolist() == [0, 0]
    assert module.cache.key[...].dtype == jnp.bfloat16


# (dtype, param_dtype): each pair differs, so taking the wrong one shows.
CACHE_DTYPES = [
    (jnp.bfloat16, jnp.float32),
    (jnp.float16, jnp.bfloat16),
    (None, jnp.bfloat16),
    (None, jnp.float16),
]


@pytest.mark.parametrize("dtype, param_dtype", CACHE_DTYPES)
def test_the_cache_takes_config_dtype_else_param_dtype_as_linen_does(dtype, param_dtype):
    """NNX's init_cache: config.dtype, else config.param_dtype (there is no input yet).
    Linen's init(..., decode=True) makes its cache in the compute dtype, config.dtype,
    else its input's: the same cache as NNX for an input in param_dtype, and with
    config.dtype set whatever the input."""
    config = AttentionConfig(16, 2, dtype=dtype, param_dtype=param_dtype)
    want = param_dtype if dtype is None else dtype
    module = CausalSelfAttention(config, rngs=nnx.Rngs(0))
    module.init_cache(B, 7)
    cache = module.cache.get()
    assert (cache.key.dtype, cache.value.dtype, cache.position.dtype) == (want, want, jnp.int32)
    module.init_cache(B, 7, dtype=jnp.float32)  # an explicit dtype wins
    assert module.cache.key[...].dtype == module.cache.value[...].dtype == jnp.float32
    layer = linen.CausalSelfAttention(config)
    for x_dtype in (param_dtype, jnp.float32):
        x = jnp.zeros((B, 7, 16), x_dtype)
        shapes = jax.eval_shape(lambda x=x: layer.init(jax.random.key(0), x, decode=True))
        expected = x_dtype if dtype is None else dtype
        got = {name: a.dtype for name, a in shapes["cache"].items()}
        counters = {"position": jnp.int32, "last": jnp.int32}
        assert got == {"key": expected, "value": expected, **counters}, x_dtype


@pytest.mark.parametrize("garbage", [np.nan, np.inf])
def test_unused_cache_slots_never_change_the_outputs(garbage):
    module, x, _ = decode_case("everything-flash")
    step(module, x[:, :WIDTH], jnp.array([4, 2]))
    clean = step(module, x[:, 4:9], jnp.array([3, 5]))
    module.init_cache(B, CAP)
    step(module, x[:, :WIDTH], jnp.array([4, 2]))
    slots = np.arange(CAP)[None, :] >= np.array([4, 2])[:, None]
    for variable in (module.cache.key, module.cache.value):
        if variable[...].size:  # a combined cache's value is empty
            variable[...] = jnp.where(slot_mask(slots, variable[...]), garbage, variable[...])
    np.testing.assert_array_equal(step(module, x[:, 4:9], jnp.array([3, 5])), clean)


def test_a_write_past_the_capacity_raises_or_gives_nan_under_jit():
    module, x, _ = decode_case("mha", capacity=6)
    module(x[:, :4], decode=True)
    with pytest.raises(
        ValueError,
        match=r"^the KV cache is full: capacity 6, row 0 is at position 4 and a chunk of "
        r"length 3 brings 3 real tokens; create a larger cache with "
        r"module.init_cache\(batch, max_len\)$",
    ):
        module(x[:, 4:7], decode=True)
    y = step(module, x[:, 4:7], jnp.array([2, 3]))  # row 1 overflows; jit cannot raise
    assert np.isfinite(y[0]).all() and np.isnan(y[1]).all()
    assert module.cache.position[...].tolist() == [6, -1]  # row 1 is poisoned


def test_decode_argument_errors():
    config = AttentionConfig(D, N)
    module = CausalSelfAttention(config, rngs=nnx.Rngs(0))
    x = jnp.ones((B, 3, D))
    with pytest.raises(ValueError, match=r"^decode=True needs a cache: call module.init_cache"):
        module(x, decode=True)
    for bad in (dict(batch=0, max_len=4), dict(batch=2, max_len=2.5)):
        with pytest.raises(ValueError, match=r"^(batch|max_len) must be an int >= 1, got"):
            module.init_cache(**bad)
    with pytest.raises(TypeError, match=r"^dtype must be a floating dtype"):
        module.init_cache(B, 4, jnp.int32)
    module.init_cache(B, 8)
    with pytest.raises(
        ValueError, match=r"^x must have shape \(B, T, D\) = \(2, \*, 48\), got \(3, 1, 48\)$"
    ):
        module(jnp.ones((3, 1, D)), decode=True)
    with pytest.raises(ValueError, match=r"^positions is not supported with decode=True"):
        module(x, decode=True, positions=jnp.arange(3))
    with pytest.raises(ValueError, match=r"^lengths only applies with decode=True"):
        module(x, lengths=jnp.array([1, 1]))
    with pytest.raises(ValueError, match=r"^lengths must be in \[0, 3\] \(the chunk length\)"):
        module(x, decode=True, lengths=jnp.array([4, 1]))


# Dropout -----------------------------------------------------------------------------


def test_dropout_follows_nnx_conventions():
    config = AttentionConfig(D, N, dropout=0.5)
    module = CausalSelfAttention(config, rngs=nnx.Rngs(0, dropout=1))
    x = jnp.asarray(randn(4, B, T, D))
    plain = module(x, deterministic=True)
    a, b = module(x), module(x)  # train mode by default: the stream advances
    assert np.abs(a - plain).max() > 1e-2 and np.abs(a - b).max() > 1e-2
    module.eval()
    np.testing.assert_array_equal(module(x), plain)
    assert not np.array_equal(module(x, deterministic=False), plain)  # per-call override
    module.train()
    c = module(x)
    assert np.abs(c - plain).max() > 1e-2
    # The same stream gives the same masks, eagerly and under nnx.jit.
    one, two = (CausalSelfAttention(config, rngs=nnx.Rngs(0, dropout=1)) for _ in range(2))
    np.testing.assert_array_equal(one(x), a)
    jitted = nnx.jit(lambda m, x: m(x))
    np.testing.assert_allclose(jitted(two, x), a, atol=1e-6)  # jit rounds differently
    np.testing.assert_allclose(jitted(two, x), b, atol=1e-6)
    # A call's rngs override the module's stream: the same rngs, the same output.
    d, e = (module(x, rngs=nnx.Rngs(dropout=7)) for _ in range(2))
    np.testing.assert_array_equal(d, e)
    assert np.abs(d - a).max() > 1e-2 and np.abs(d - b).max() > 1e-2


@pytest.mark.parametrize("module", [CausalSelfAttention, CrossAttention])
@pytest.mark.parametrize("streams", [{}, {"dropout": 1}], ids=["default-stream", "dropout-stream"])
def test_the_dropout_stream_is_forked_from_the_construction_rngs(module, streams):
    """As nnx.Dropout(rate, rngs=rngs): the module keeps rngs.dropout.fork() (the
    default stream's when there is no dropout stream), so drawing from the caller's
    Rngs afterwards leaves the module's masks alone, and the module's calls leave the
    caller's draws alone."""
    config = AttentionConfig(16, 2, dropout=0.5)
    x = jnp.asarray(randn(6, B, 5, 16))
    args = (x,) if module is CausalSelfAttention else (x, x[:, :3])
    drawn, called, idle = (nnx.Rngs(0, **streams) for _ in range(3))
    a, b = module(config, rngs=drawn), module(config, rngs=called)
    module(config, rngs=idle)  # idle's draws: construction's only
    plain = a(*args, deterministic=True)
    for _ in range(2):
        drawn(), drawn.dropout(), drawn.params()  # the caller draws; a's masks stay
    masks_a = [a(*args) for _ in range(2)]
    masks_b = [b(*args) for _ in range(2)]  # b's calls; its caller draws nothing
    assert np.abs(masks_a[0] - plain).max() > 1e-2  # dropout is on
    assert np.abs(masks_a[0] - masks_a[1]).max() > 1e-2  # and the stream advances
    for got, want in zip(masks_a, masks_b):
        np.testing.assert_array_equal(got, want)
    # `called` drew as `idle` did (construction only): the module's calls took nothing.
    for name in ("dropout", "default", "params"):
        np.testing.assert_array_equal(
            jax.random.key_data(called[name]()), jax.random.key_data(idle[name]()), err_msg=name
        )


def test_dropout_needs_a_stream():
    config = AttentionConfig(D, N, dropout=0.1)
    module = CausalSelfAttention(config, rngs=nnx.Rngs(0))
    module.rngs = None  # as when a user strips the stream
    with pytest.raises(ValueError, match=r"^dropout is on but this module has no random stream"):
        module(jnp.ones((B, 3, D)))
    module(jnp.ones((B, 3, D)), deterministic=True)  # fine without dropout
    module(jnp.ones((B, 3, D)), rngs=nnx.Rngs(dropout=0))


def test_sow_weights_stores_the_attention_weights():
    config = AttentionConfig(D, N, n_kv_heads=K, window=(3, 0))
    _, params = linen_params(config)
    module = from_linen(config, params, rngs=nnx.Rngs(0), sow_weights=True)
    x = jnp.asarray(randn(6, B, T, D))
    _, sown = nnx.capture(module, nnx.Intermediate)(x)
    (weights,) = sown["attention_weights"]
    assert weights.shape == (B, N, T, T)
    np.testing.assert_allclose(weights.sum(-1), 1, atol=1e-6)
    i, j = np.arange(T)[:, None], np.arange(T)[None]
    assert (np.asarray(weights)[..., (j > i) | (j < i - 3)] == 0).all()
    _, state = linen.CausalSelfAttention(config, sow_weights=True).apply(
        params, x, True, mutable=["intermediates"]
    )
    np.testing.assert_array_equal(weights, state["intermediates"]["attention_weights"][0])


# Transforms --------------------------------------------------------------------------


@pytest.mark.slow  # 9 s; in `make test-all`
def test_grad_split_merge_and_an_optax_step_agree_with_linen():
    config = AttentionConfig(D, N, **EVERYTHING)
    layer, params = linen_params(config)
    module = from_linen(config, params, rngs=nnx.Rngs(0))
    x, target = jnp.asarray(randn(7, B, T, D)), jnp.asarray(randn(8, B, T, D))

    def linen_loss(p):
        return jnp.mean((layer.apply({"params": p}, x, True) - target) ** 2)

    def nnx_loss(m):
        return jnp.mean((m(x) - target) ** 2)

    value, grads = nnx.jit(nnx.value_and_grad(nnx_loss))(module)
    want_value, want_grads = jax.jit(jax.value_and_grad(linen_loss))(params["params"])
    np.testing.assert_allclose(value, want_value, rtol=1e-6)
    jax.tree.map(
        lambda g, w: np.testing.assert_allclose(g, w, atol=1e-6, rtol=1e-5),
        nnx.to_pure_dict(grads),
        want_grads,
    )
    # split / merge: the same module back
    graphdef, state = nnx.split(module)
    np.testing.assert_array_equal(nnx.merge(graphdef, state)(x), module(x))
    # one optax (adam) step through nnx.Optimizer equals optax on the linen params
    tx = optax.adam(1e-2)
    optimizer = nnx.Optimizer(module, tx, wrt=nnx.Param)

    @nnx.jit
    def train_step(module, optimizer):
        loss, grads = nnx.value_and_grad(nnx_loss)(module)
        optimizer.update(module, grads)
        return loss

    for _ in range(2):
        train_step(module, optimizer)
    p, opt_state = params["params"], tx.init(params["params"])

    @jax.jit
    def linen_step(p, opt_state):
        updates, opt_state = tx.update(jax.grad(linen_loss)(p), opt_state, p)
        return optax.apply_updates(p, updates), opt_state

    for _ in range(2):
        p, opt_state = linen_step(p, opt_state)
    jax.tree.map(
        lambda g, w: np.testing.assert_allclose(g, w, atol=1e-6, rtol=1e-5), to_linen(module), p
    )
    assert (
        np.abs(to_linen(module)["qkv"]["kernel"] - params["params"]["qkv"]["kernel"]).max() > 1e-3
    )


def test_scan_over_a_stack_of_layers_equals_applying_them_in_turn():
    config = AttentionConfig(D, N, n_kv_heads=K, rope_base=100.0)
    layers = 3

    @nnx.split_rngs(splits=layers)
    @nnx.vmap(in_axes=0, out_axes=0)
    def stack(rngs):
        return CausalSelfAttention(config, rngs=rngs)

    model = stack(nnx.Rngs(0))

    @nnx.jit
    def forward(model, x):
        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        def block(x, layer):
            return x + layer(x)

        return block(x, model)

    x = jnp.asarray(randn(9, B, T, D))
    got = forward(model, x)
    stacked, want = to_linen(model), x
    layer = linen.CausalSelfAttention(config)
    for i in range(layers):
        p = jax.tree.map(lambda a, i=i: a[i], stacked)
        want = want + layer.apply({"params": p}, want, True)
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-5)
    assert stacked["qkv"]["kernel"].shape == (layers, D, (N + 2 * K) * H)


def test_docstring_examples():
    result = doctest.testmod(
        nanoattn._layers.nnx.attention, optionflags=doctest.NORMALIZE_WHITESPACE
    )
    assert result.attempted > 0 and result.failed == 0
