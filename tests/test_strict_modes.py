"""nanoattn under jax's strict modes: every backend forward and backward, the layers,
decoding, the flax adapter, verify and the ring run with
``jax_numpy_dtype_promotion='strict'`` (no implicit promotion between dtypes) and
with ``jax_enable_checks`` (jax checks every jaxpr it builds). The whole suite
already runs with ``jax_numpy_rank_promotion='raise'`` (tests/conftest.py); each
test here checks that it is on, so the three modes hold together."""

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec

import nanoattn
from nanoattn import linen
from nanoattn import nnx as nanoattn_nnx
from nanoattn.parallel import ring_attention
from nanoattn.verify import check_causality

from _backends import each_backend, refusal, require

B, T, N, K, H = 2, 9, 4, 2, 8
D = N * H

MODES = {
    "dtype-strict": lambda: jax.numpy_dtype_promotion("strict"),
    "enable-checks": lambda: jax.enable_checks(True),
}


# dtype-strict in `make test`; enable-checks (jax re-checking every jaxpr, about as long
# again) with the slow cases in `make test-all`.
@pytest.fixture(params=["dtype-strict", pytest.param("enable-checks", marks=pytest.mark.slow)])
def strict(request):
    assert jax.config.jax_numpy_rank_promotion == "raise"  # the suite's own mode
    with MODES[request.param]():
        yield request.param


def _qkv(dtype=jnp.float32):
    keys = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(keys[0], (B, T, N, H), dtype)
    k, v = (jax.random.normal(key, (B, T, K, H), dtype) for key in keys[1:])
    return q, k, v


RULES = {
    "causal": dict(is_causal=True),
    "window-lengths": dict(is_causal=True, window=(3, 0), kv_lengths=jnp.array([T, 4])),
    "offsets": dict(is_causal=True, q_offset=jnp.array([0, 2])),
    "segments-cap": dict(
        q_segment_ids=jnp.array([[0] * 5 + [1] * 4] * 2),
        kv_segment_ids=jnp.array([[0] * 5 + [1] * 4] * 2),
        logit_soft_cap=5.0,
    ),
    "mask-bias": dict(mask=jnp.ones((B, 1, T, T), bool), bias=jnp.zeros((1, N, T, T))),
    "mask_fn-sinks": dict(
        mask_fn=lambda b, n, q, k: (k <= q) | (k < 3),
        q_offset=jnp.array([0, 2]),
        sinks=jnp.linspace(-1.0, 1.0, N),
    ),
    "score_fn": dict(
        score_fn=lambda s, b, n, q, k: s - jnp.linspace(0.1, 0.4, N)[n] * (q - k).astype(s.dtype),
        is_causal=True,
    ),
}


@each_backend()
def test_every_backend_forward_and_backward(strict, implementation):
    require(implementation, *_qkv())
    rules = {n: r for n, r in RULES.items() if refusal(implementation, *_qkv(), **r) is None}

    def loss(q, k, v):  # every rule in one program: one compilation per backend and mode
        total = 0.0
        for r in rules.values():
            out, lse = nanoattn.dot_product_attention(
                q, k, v, implementation=implementation, return_residual=True, **r
            )
            total = total + out.sum() + jnp.where(jnp.isfinite(lse), lse, 0).sum()
        return total

    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(*_qkv())
    assert all(np.isfinite(np.asarray(g)).all() for g in grads)


def test_half_precision_unbatched_vmap_dropout_and_weights(strict):
    q, k, v = _qkv(jnp.bfloat16)

    @jax.jit
    def calls(q, k, v):
        unbatched = nanoattn.dot_product_attention(
            q[0], k[0], v[0], is_causal=True, implementation="flash"
        )
        batched = jax.vmap(lambda q, k, v: nanoattn.dot_product_attention(q, k, v, is_causal=True))
        dropped = nanoattn.dot_product_attention(
            q, k, v, is_causal=True, dropout_rate=0.2, dropout_rng=jax.random.key(1)
        )
        weights = nanoattn.attention_weights(q, k, window=2, kv_lengths=jnp.array([T, 3]))
        return unbatched, batched(q, k, v), dropped, weights

    unbatched, batched, dropped, weights = calls(q, k, v)
    assert unbatched.shape == (T, N, H) and unbatched.dtype == jnp.bfloat16
    assert batched.shape == q.shape and weights.shape == (B, N, T, T)
    assert np.isfinite(np.asarray(dropped, np.float32)).all()


CONFIG = linen.AttentionConfig(
    d_model=D, n_heads=N, n_kv_heads=K, rope_base=1e4, window=(5, 0), logit_soft_cap=20.0,
    qk_norm=True, dropout=0.1,
)  # fmt: skip


@pytest.mark.slow  # 17 s a mode; the NNX layer and every backend stay in `make test`
def test_linen_layers_training_decoding_and_cross_attention(strict):
    layer = linen.CausalSelfAttention(CONFIG, sow_weights=True)
    x = jax.random.normal(jax.random.key(3), (B, T, D))
    params = layer.init(jax.random.key(0), x, deterministic=True)
    rngs = {"dropout": jax.random.key(1)}

    def loss(params):
        return layer.apply(params, x, False, rngs=rngs, mutable=["intermediates"])[0].sum()

    grads = jax.jit(jax.grad(loss))(params)
    assert all(np.isfinite(np.asarray(g)).all() for g in jax.tree.leaves(grads))
    ids = jnp.array([[0] * 4 + [1] * 5] * 2)
    packed = jax.jit(lambda p: layer.apply(p, x, True, segment_ids=ids, positions=jnp.arange(T)))
    assert np.isfinite(np.asarray(packed(params))).all()
    cache = layer.init(jax.random.key(0), jnp.zeros((B, 16, D)), decode=True)["cache"]
    step = jax.jit(
        lambda cache, chunk, lengths: layer.apply(
            {**params, "cache": cache}, chunk, True, decode=True, lengths=lengths,
            mutable=["cache"],
        )
    )  # fmt: skip
    y, state = step(cache, x[:, :4], jnp.array([4, 2]))
    y, state = step(state["cache"], x[:, 4:5], jnp.array([1, 1]))
    assert np.isfinite(np.asarray(y)).all()
    cross = linen.CrossAttention(CONFIG)
    context = jax.random.normal(jax.random.key(4), (B, 5, D))
    mask = jnp.array([[True] * 5, [True] * 3 + [False] * 2])
    init = jax.jit(lambda key: cross.init_with_output(key, x, context, True, context_mask=mask))
    assert np.isfinite(np.asarray(init(jax.random.key(0))[0])).all()


def test_nnx_layer_training_and_decoding(strict):
    layer = nanoattn_nnx.CausalSelfAttention(CONFIG, rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(3), (B, T, D))
    grads = nnx.jit(nnx.grad(lambda layer: layer(x).sum()))(layer)
    assert all(np.isfinite(np.asarray(g)).all() for g in jax.tree.leaves(grads))
    layer.init_cache(B, 16)
    step = nnx.jit(lambda layer, chunk: layer(chunk, decode=True, deterministic=True))
    assert np.isfinite(np.asarray(step(layer, x[:, :3]))).all()
    assert np.isfinite(np.asarray(step(layer, x[:, 3:4]))).all()


def test_flax_adapter_with_dropout_and_sown_weights(strict):
    layer = nnx.MultiHeadAttention(
        num_heads=N, in_features=D, attention_fn=nanoattn.flax_attention_fn, decode=False,
        rngs=nnx.Rngs(0), dropout_rate=0.1,
    )  # fmt: skip
    x = jax.random.normal(jax.random.key(3), (B, T, D))
    assert layer(x, is_causal=True, deterministic=True).shape == (B, T, D)
    q, k, v = _qkv(jnp.bfloat16)
    k, v = (jnp.repeat(a, N // K, axis=2) for a in (k, v))  # flax's function: K = N
    out = nanoattn.flax_attention_fn(q, k, v, is_causal=True)
    assert out.shape == q.shape
    dropped = nanoattn.flax_attention_fn(
        q, k, v, dropout_rate=0.2, dropout_rng=jax.random.key(1), force_fp32_for_softmax=True
    )
    assert np.isfinite(np.asarray(dropped, np.float32)).all()


@pytest.mark.slow  # 10 s a mode; in `make test-all`
def test_verify_on_a_layer(strict):
    layer = linen.CausalSelfAttention(linen.AttentionConfig(d_model=D, n_heads=N))
    params = layer.init(jax.random.key(0), jnp.ones((1, 2, D)), deterministic=True)
    check_causality(
        lambda x: layer.apply(params, x, deterministic=True), d_model=D, seq_lens=(1, 5)
    ).raise_if_failed()


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
def test_ring_forward_and_backward_on_one_device(strict, layout):
    q, k, v = (x[:, :8] for x in _qkv())
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("sp",))
    seq = PartitionSpec(None, "sp")

    def loss(q, k, v):
        out = ring_attention(
            q, k, v, axis_name="sp", is_causal=True, window=(3, 0),
            kv_lengths=jnp.array([8, 5]), layout=layout,
        )  # fmt: skip
        return out.sum()

    run = jax.shard_map(
        jax.grad(loss, argnums=(0, 1, 2)), mesh=mesh, in_specs=(seq, seq, seq),
        out_specs=(seq, seq, seq),
    )  # fmt: skip
    grads = jax.jit(run)(q, k, v)
    assert all(np.isfinite(np.asarray(g)).all() for g in grads)


def test_strict_modes_are_strict():
    # The positive control: each mode does refuse what it should, so the tests above
    # ran with something switched on.
    a, b = jnp.ones((2, 3)), jnp.ones(3)
    with pytest.raises(ValueError, match="rank_promotion"):
        a + b
    with MODES["dtype-strict"](), pytest.raises(Exception, match="promotion"):
        jnp.ones(3, jnp.float32) + jnp.ones(3, jnp.bfloat16)
    with contextlib.ExitStack() as stack:
        stack.enter_context(MODES["enable-checks"]())
        assert jax.config.jax_enable_checks


@pytest.mark.parametrize("dtype", [np.int8, np.int32, np.int64])
def test_key_lengths_of_any_int_type_under_x64_and_strict_dtypes(x64, dtype):
    # With x64, positions default to int64; comparing them with int32 lengths is a
    # promotion that strict mode refuses (jax.nn's seq lengths are int32).
    q = jnp.asarray(np.random.default_rng(0).normal(size=(2, 5, 2, 4)), jnp.float32)
    lengths = np.array([3, 1], dtype)
    with MODES["dtype-strict"]():
        valid = nanoattn.lengths_to_valid(lengths, 300)
        out = nanoattn.dot_product_attention(q, q, q, kv_lengths=lengths, implementation="xla")
    assert valid.shape == (2, 300) and valid.sum() == 4
    want = nanoattn.dot_product_attention(q[:1, :, :, :], q[:1, :3], q[:1, :3])
    np.testing.assert_allclose(out[:1], want, atol=1e-6)
