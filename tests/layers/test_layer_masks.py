"""The layers' attention sinks (``AttentionConfig(sinks=True)``) and their per-call
``mask_fn`` and ``score_fn``, in linen and NNX: the ``sinks`` parameter, the
full-sequence call against a float64 numpy layer (outputs, sown weights and the
gradient to the sinks), decoding through the KV cache against the full forward,
conversion between the families, and the one-line errors.

Sizes are distinct where they can be (B=3, T=7, capacity 11, D=24, N=4, K=2, H=6), and
every mask is written twice, as a ``mask_fn`` of jax index arrays and as a literal
numpy array, so the library never checks itself.
"""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import nanoattn
from nanoattn import linen
from nanoattn import nnx as nanoattn_nnx

from _reference import np_attention, np_attention_vjp, randn

B, T, CAP, D, N, K = 3, 7, 11, 24, 4, 2
H = D // N
SINKS = np.array([1.5, -1.0, 0.5, 2.0], np.float32)  # one per query head, all distinct
SLOPES = np.array([0.5, 0.25, 0.125, 0.0625], np.float32)  # ALiBi, one per query head
WIDTHS = np.array([0, 1, 3, 6])  # a causal window per query head
IDS = np.arange(CAP)[None] // (2 + np.arange(B))[:, None]  # (B, CAP): documents of 2 + b


def documents(b, n, q, k):
    ids = jnp.asarray(IDS)
    return ids[b, q] == ids[b, k]


def per_head_window(b, n, q, k):
    return q - k <= jnp.asarray(WIDTHS)[n]


def streaming(b, n, q, k):  # the first two tokens, then a window of 2 (StreamingLLM)
    return (k < 2) | (q - k <= 2)


def prefix_lm(b, n, q, k):  # a prefix that sees itself both ways: ANDed with causality
    return (k <= q) | (k < 3)


def alibi(score, b, n, q, k):
    return score - jnp.asarray(SLOPES)[n] * (q - k).astype(score.dtype)


def np_grid(T, S):
    b = np.arange(B)[:, None, None, None]
    n = np.arange(N)[None, :, None, None]
    q = np.arange(T)[None, None, :, None]
    k = np.arange(S)[None, None, None, :]
    return np.broadcast_arrays(b, n, q, k)


NP_MASKS = {  # the same masks, written in numpy on (B, N, T, S) grids
    None: lambda b, n, q, k: np.ones(q.shape, bool),
    documents: lambda b, n, q, k: IDS[b, q] == IDS[b, k],
    per_head_window: lambda b, n, q, k: q - k <= WIDTHS[n],
    streaming: lambda b, n, q, k: (k < 2) | (q - k <= 2),
    prefix_lm: lambda b, n, q, k: (k <= q) | (k < 3),
}
NP_SCORES = {None: None, alibi: lambda b, n, q, k: -SLOPES[n] * (q - k)}


def random_params(shapes, seed=7):
    """Random parameters of the given tree, kernels scaled by 1/sqrt(fan-in), biases
    clearly non-zero; the sinks are SINKS, so a sink per head shows."""
    leaves, tree = jax.tree_util.tree_flatten_with_path(shapes)
    values = []
    for i, (path, a) in enumerate(leaves):
        if path[-1].key == "sinks":
            values.append(jnp.asarray(SINKS, a.dtype))
        else:
            scale = a.shape[0] ** -0.5 if len(a.shape) == 2 else 0.5
            values.append(jnp.asarray(randn(seed + i, *a.shape) * scale + 0.1, a.dtype))
    return jax.tree.unflatten(tree, values)


@functools.cache
def layer_and_params(seed=7, **options):
    layer = linen.CausalSelfAttention(linen.AttentionConfig(D, N, **options))
    empty = jnp.zeros((B, CAP, D))
    shapes = jax.eval_shape(functools.partial(layer.init, decode=True), jax.random.key(0), empty)
    cache = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), shapes["cache"])
    return layer, random_params(shapes["params"], seed), cache


def np_self_attention(params, x, config, mask_fn=None, score_fn=None, d_y=None):
    """The layer in float64 numpy (no RoPE, norm or cap in these configs): the output,
    the weights (B, N, T, T) and, for a cotangent ``d_y``, the gradient to the sinks."""
    p = jax.tree.map(lambda a: np.asarray(a, np.float64), params)
    x = np.asarray(x, np.float64)
    qkv = x @ p["qkv"]["kernel"] + p["qkv"]["bias"]
    q = qkv[..., : N * H].reshape(B, T, N, H)
    k = qkv[..., N * H : (N + K) * H].reshape(B, T, K, H)
    v = qkv[..., (N + K) * H :].reshape(B, T, K, H)
    grid = np_grid(T, T)
    allowed = (grid[3] <= grid[2]) & NP_MASKS[mask_fn](*grid)
    bias = None if score_fn is None else NP_SCORES[score_fn](*grid)
    sinks = p.get("sinks") if config.sinks else None
    heads = np_attention(q, k, v, allowed, bias, sinks=sinks)  # (B, T, N, H)
    y = heads.reshape(B, T, D) @ p["out"]["kernel"] + p["out"]["bias"]
    weights = np_attention(q, k, v, allowed, bias, sinks=sinks, return_weights=True)
    if d_y is None:
        return y, weights
    d_heads = (np.asarray(d_y, np.float64) @ p["out"]["kernel"].T).reshape(B, T, N, H)
    *_, d_sinks = np_attention_vjp(q, k, v, d_heads, allowed, bias, sinks=sinks)[1]
    return y, weights, d_sinks


def test_sinks_are_a_zero_initialised_parameter_per_query_head_in_both_families():
    x = jnp.ones((B, T, D))
    for param_dtype in (jnp.float32, jnp.bfloat16):
        config = linen.AttentionConfig(D, N, n_kv_heads=K, sinks=True, param_dtype=param_dtype)
        modules = [
            nanoattn_nnx.CausalSelfAttention(config, rngs=nnx.Rngs(0)),
            nanoattn_nnx.CrossAttention(config, rngs=nnx.Rngs(0)),
        ]
        for sinks in (m.sinks for m in modules):
            assert isinstance(sinks, nnx.Param) and sinks.dtype == param_dtype
            np.testing.assert_array_equal(sinks[...], np.zeros(N))

    @jax.jit  # config: the bfloat16 one
    def init(key):
        return (
            linen.CausalSelfAttention(config).init(key, x, True)["params"],
            linen.CrossAttention(config).init(key, x, x[:, :5], True)["params"],
        )

    for params in init(jax.random.key(0)):
        assert params["sinks"].dtype == jnp.bfloat16
        np.testing.assert_array_equal(params["sinks"], np.zeros(N))
    plain = linen.AttentionConfig(D, N, n_kv_heads=K)
    shapes = jax.eval_shape(lambda: linen.CausalSelfAttention(plain).init(jax.random.key(0), x))
    assert "sinks" not in shapes["params"]
    assert not hasattr(nanoattn_nnx.CausalSelfAttention(plain, rngs=nnx.Rngs(0)), "sinks")
    # zeros are still sinks: each row's denominator gains exp(0) = 1, so the output changes
    layer, params, _ = layer_and_params(n_kv_heads=K, sinks=True)
    zero = {**params, "sinks": jnp.zeros(N)}
    without = {k: v for k, v in params.items() if k != "sinks"}
    xs = jnp.asarray(randn(1, B, T, D))
    plain_layer = linen.CausalSelfAttention(plain)
    a, b = jax.jit(
        lambda: (
            layer.apply({"params": zero}, xs, True),
            plain_layer.apply({"params": without}, xs, True),
        )
    )()
    assert np.abs(np.asarray(a - b)).max() > 1e-2


CASES = {  # name: (config options, mask_fn, score_fn)
    "sinks": (dict(sinks=True), None, None),
    "documents": (dict(), documents, None),
    "per_head_window+alibi+sinks": (dict(sinks=True), per_head_window, alibi),
}


@pytest.mark.parametrize("name", list(CASES))
def test_the_full_sequence_call_matches_a_float64_layer_with_its_gradient_to_the_sinks(name):
    options, mask_fn, score_fn = CASES[name]
    layer, params, _ = layer_and_params(n_kv_heads=K, **options)
    layer = layer.clone(sow_weights=True)
    x = jnp.asarray(randn(1, B, T, D))
    d_y = jnp.asarray(randn(2, B, T, D))

    @jax.jit
    def run(params, x):
        def loss(params):
            y, state = layer.apply(
                {"params": params}, x, True, mask_fn=mask_fn, score_fn=score_fn,
                mutable="intermediates",
            )  # fmt: skip
            return jnp.sum(y * d_y), (y, state["intermediates"]["attention_weights"][0])

        return jax.grad(loss, has_aux=True)(params)

    grads, (y, weights) = run(params, x)
    want = np_self_attention(params, x, layer.config, mask_fn, score_fn, d_y)
    np.testing.assert_allclose(y, want[0], atol=2e-5, rtol=1e-5)
    np.testing.assert_allclose(weights, want[1], atol=2e-6)
    if layer.config.sinks:
        np.testing.assert_allclose(grads["sinks"], want[2], atol=2e-5, rtol=1e-4)
        assert np.abs(want[2]).min() > 1e-3  # every head's sink has a real gradient


def test_a_prefix_lm_mask_fn_is_anded_with_causality():
    layer, params, _ = layer_and_params(n_kv_heads=K)
    x = jnp.asarray(randn(1, B, T, D))
    apply = jax.jit(lambda x: layer.apply({"params": params}, x, True, mask_fn=prefix_lm))
    causal = jax.jit(lambda x: layer.apply({"params": params}, x, True))
    np.testing.assert_allclose(apply(x), causal(x), atol=1e-6)
    np.testing.assert_allclose(apply(x), np_self_attention(params, x, layer.config)[0], atol=2e-5)


def test_init_with_decode_returns_the_full_forward_with_the_calls_functions():
    layer, _, _ = layer_and_params(n_kv_heads=K, sinks=True)
    x = jnp.asarray(randn(1, B, T, D))
    fns = dict(mask_fn=documents, score_fn=alibi)

    @jax.jit
    def run(key):
        y, variables = layer.init_with_output(key, x, True, decode=True, **fns)
        return y, layer.apply({"params": variables["params"]}, x, True, **fns)

    y, full = run(jax.random.key(0))
    np.testing.assert_array_equal(y, full)
    plain = jax.jit(lambda key: layer.init_with_output(key, x, True, decode=True)[0])
    assert np.abs(np.asarray(plain(jax.random.key(0)) - y)).max() > 1e-3


# Each row's chunk sizes, every call a chunk of width 3 with ``lengths``: prompts and
# one-token steps, with the rows at different positions at every call.
SCHEDULE = [[3, 1, 1, 1, 1], [2, 3, 1, 1], [1, 1, 3, 2]]
WIDTH = 3


def decode_in_chunks(step, x):
    """Feeds row b of x (B, T, D) in the chunk sizes SCHEDULE[b] through ``step(chunk,
    lengths) -> y``; returns the outputs at the real tokens, (B, T, D)."""
    x = np.asarray(x)
    done, outs = [0] * B, [[] for _ in range(B)]
    for call in range(max(map(len, SCHEDULE))):
        lengths = [s[call] if call < len(s) else 0 for s in SCHEDULE]
        chunk = np.full((B, WIDTH, D), np.nan, np.float32)  # padding holds NaN
        for b, n in enumerate(lengths):
            chunk[b, :n] = x[b, done[b] : done[b] + n]
        y = np.asarray(step(jnp.asarray(chunk), jnp.asarray(lengths, jnp.int32)))
        for b, n in enumerate(lengths):
            outs[b].append(y[b, :n])
            np.testing.assert_array_equal(y[b, n:], 0)
            done[b] += n
    return np.stack([np.concatenate(o) for o in outs])


EVERYTHING = dict(rope_base=100.0, window=(4, 0), logit_soft_cap=2.0, qk_norm=True)
DECODE_CASES = {  # name: (config options, mask_fn, score_fn)
    "sinks": (dict(sinks=True), None, None),
    "documents+sinks": (dict(sinks=True), documents, None),
    "per_head_window": (dict(), per_head_window, None),
    "alibi": (dict(), None, alibi),
    "everything-flash": (
        dict(EVERYTHING, sinks=True, implementation="flash"),
        streaming,
        alibi,
    ),
}


@pytest.mark.parametrize("name", list(DECODE_CASES))
def test_decoding_through_the_cache_equals_the_full_forward(name):
    options, mask_fn, score_fn = DECODE_CASES[name]
    layer, params, cache = layer_and_params(n_kv_heads=K, **options)
    fns = dict(mask_fn=mask_fn, score_fn=score_fn)
    x = jnp.asarray(randn(1, B, T, D))
    full = jax.jit(lambda x: layer.apply({"params": params}, x, True, **fns))(x)

    @jax.jit
    def step(cache, chunk, lengths):
        variables = {"params": params, "cache": cache}
        y, state = layer.apply(
            variables, chunk, True, decode=True, lengths=lengths, mutable=["cache"], **fns
        )
        return y, state["cache"]

    state = {"cache": cache}

    def linen_step(chunk, lengths):
        y, state["cache"] = step(state["cache"], chunk, lengths)
        return y

    np.testing.assert_allclose(decode_in_chunks(linen_step, x), full, atol=2e-5, rtol=1e-5)
    np.testing.assert_array_equal(state["cache"]["position"], [T] * B)
    if name == "everything-flash":  # the NNX module decodes through the same steps
        module = nanoattn_nnx.from_linen(layer.config, params, rngs=nnx.Rngs(0))
        module.init_cache(B, CAP)
        nnx_step = nnx.jit(lambda m, chunk, lengths: m(chunk, decode=True, lengths=lengths, **fns))
        got = decode_in_chunks(functools.partial(nnx_step, module), x)
        np.testing.assert_allclose(got, full, atol=2e-5, rtol=1e-5)


def test_conversion_carries_the_sinks_with_equal_outputs_and_gradients():
    layer, params, _ = layer_and_params(n_kv_heads=K, sinks=True)
    fns = dict(mask_fn=per_head_window, score_fn=alibi)
    x = jnp.asarray(randn(1, B, T, D))
    module = nanoattn_nnx.from_linen(layer.config, params, rngs=nnx.Rngs(0))
    np.testing.assert_array_equal(module.sinks[...], SINKS)
    np.testing.assert_array_equal(nanoattn_nnx.to_linen(module)["sinks"], SINKS)

    @nnx.jit
    def both(params, module):
        def linen_loss(params):
            return jnp.sum(layer.apply({"params": params}, x, True, **fns) ** 2)

        def nnx_loss(module):
            return jnp.sum(module(x, deterministic=True, **fns) ** 2)

        return jax.value_and_grad(linen_loss)(params), nnx.value_and_grad(nnx_loss)(module)

    (a, grads), (b, nnx_grads) = both(params, module)
    np.testing.assert_array_equal(b, a)
    np.testing.assert_allclose(nnx_grads["sinks"][...], grads["sinks"], rtol=1e-6, atol=1e-7)
    # cross-attention: the sinks and the functions reach its core call too
    config = layer.config
    cross = linen.CrossAttention(config)
    ctx = jnp.asarray(randn(3, B, 5, D))
    shapes = jax.eval_shape(lambda: cross.init(jax.random.key(0), x, ctx, True))
    cross_params = random_params(shapes["params"])
    cross_module = nanoattn_nnx.from_linen(config, cross_params, rngs=nnx.Rngs(0))
    ys = nnx.jit(
        lambda m, p, x, ctx: (
            cross.apply({"params": p}, x, ctx, True, **fns),
            m(x, ctx, deterministic=True, **fns),
            cross.apply({"params": {**p, "sinks": jnp.zeros(N)}}, x, ctx, True),
        )
    )(cross_module, cross_params, x, ctx)
    np.testing.assert_array_equal(ys[1], ys[0])
    grid = np_grid(T, 5)
    p = jax.tree.map(lambda a: np.asarray(a, np.float64), cross_params)
    q = (np.asarray(x, np.float64) @ p["q"]["kernel"] + p["q"]["bias"]).reshape(B, T, N, H)
    kv = np.asarray(ctx, np.float64) @ p["kv"]["kernel"] + p["kv"]["bias"]
    k, v = kv[..., : K * H].reshape(B, 5, K, H), kv[..., K * H :].reshape(B, 5, K, H)
    for y, sinks, allowed, bias in [
        (ys[0], SINKS, NP_MASKS[per_head_window](*grid), NP_SCORES[alibi](*grid)),
        (ys[2], np.zeros(N), None, None),
    ]:
        heads = np_attention(q, k, v, allowed, bias, sinks=sinks).reshape(B, T, D)
        np.testing.assert_allclose(y, heads @ p["out"]["kernel"] + p["out"]["bias"], atol=2e-5)


def one_line(error, pattern, fn):
    """``fn()`` raises ``error`` whose message (without the notes jax may add) is one
    line that ``pattern`` matches."""
    with pytest.raises(error) as info:
        fn()
    message = str(info.value)
    assert re.search(pattern, message) and len(message.splitlines()) == 1, message


def test_bad_inputs_get_one_line_errors():
    for bad in (1, "yes", None):
        one_line(
            TypeError,
            rf"^sinks must be True or False, got {bad!r}$",
            lambda bad=bad: linen.AttentionConfig(D, N, sinks=bad),
        )
    layer, params, cache = layer_and_params(n_kv_heads=K, sinks=True)
    x = jnp.ones((B, T, D))

    def apply(**fns):  # traced only: the errors come before anything compiles
        return jax.jit(lambda x: layer.apply({"params": params}, x, True, **fns))(x)

    def decode(**fns):
        variables = {"params": params, "cache": cache}
        return jax.jit(
            lambda x: layer.apply(variables, x, True, decode=True, mutable=["cache"], **fns)
        )(x[:, :1])

    one_line(TypeError, "^mask_fn must be a function", lambda: apply(mask_fn=3))
    one_line(TypeError, "^score_fn must be a function", lambda: apply(score_fn="alibi"))
    one_line(TypeError, "^mask_fn must return a boolean", lambda: apply(mask_fn=lambda *i: i[3]))
    one_line(TypeError, "^mask_fn must return a boolean", lambda: decode(mask_fn=lambda *i: i[3]))
    module = nanoattn_nnx.CausalSelfAttention(layer.config, rngs=nnx.Rngs(0))
    call = nnx.jit(lambda m, x: m(x, score_fn=1.0))
    one_line(TypeError, "^score_fn must be a function", lambda: call(module, x))
    # conversion names the sinks a config lacks or does not use
    no_sinks = {k: v for k, v in params.items() if k != "sinks"}
    one_line(
        ValueError,
        rf"^linen_params lacks sinks \({N},\) of the config$",
        lambda: nanoattn_nnx.from_linen(layer.config, no_sinks, rngs=nnx.Rngs(0)),
    )
    plain = linen.AttentionConfig(D, N, n_kv_heads=K)
    one_line(
        ValueError,
        "^linen_params has sinks, which the config does not use$",
        lambda: nanoattn_nnx.from_linen(plain, params, rngs=nnx.Rngs(0)),
    )
    # (the sequence-parallel layer serves mask_fn, score_fn and sinks through the ring:
    # tests/parallel/test_parallel.py's mask-layer-sequence-heads case)
    # flax's attention_fn convention has no such arguments: Python names the one passed
    q = jnp.ones((B, T, N, H))
    one_line(
        TypeError,
        "unexpected keyword argument 'mask_fn'",
        lambda: nanoattn.flax_attention_fn(q, q, q, mask_fn=streaming),
    )
