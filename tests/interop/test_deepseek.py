"""nanoattn.linen.from_deepseek against transformers' DeepseekV3Attention: fixtures made
by tools/make_deepseek_fixtures.py (small random configurations, float32 and float64
runs of transformers' own code; torch is not a test dependency)."""

import dataclasses
import functools
import json
import warnings

import jax
import numpy as np
import pytest

import nanoattn
from nanoattn.linen import LatentAttention, from_deepseek

from _paths import TESTS

FIXTURES = TESTS / "fixtures" / "models"

# A low-rank query with YaRN; one query projection with biases; DeepSeek-V3's config.json
# form (rope_theta and rope_scaling, no rope_interleave).
CASES = ["v3", "v2_lite", "v3_config_json"]
PREFIX = "model.layers.0.self_attn."


@functools.cache
def _fixture(case):
    data = np.load(FIXTURES / f"deepseek_{case}.npz")
    config = json.loads(str(data["config"]))
    return config, {k: data[k] for k in data.files if k != "config"}


@pytest.mark.parametrize("case", CASES)
def test_forward_equals_transformers_within_its_own_float32_error(case):
    config, arrays = _fixture(case)
    cfg, params = from_deepseek(config, arrays, 0)
    y = forward(cfg, params, arrays["x"])
    truth = arrays["y_f64"]
    theirs = np.abs(arrays["y_f32"] - truth).max()
    assert np.abs(y - truth).max() <= 2 * theirs + 1e-6, (np.abs(y - truth).max(), theirs)


@pytest.mark.parametrize(
    "case",
    # v3's decode is slow; its fast path: v3's forward above and v2_lite's decode here
    [pytest.param("v3", marks=pytest.mark.slow), "v2_lite"],
)
def test_absorbed_decoding_of_the_loaded_layer_equals_transformers(case):
    config, arrays = _fixture(case)
    cfg, params = from_deepseek(config, arrays, 0)
    layer, x = LatentAttention(cfg), arrays["x"]
    cache = layer.init(jax.random.key(0), np.zeros(x.shape, np.float32), decode=True)["cache"]
    outs = []
    for part in (slice(0, 6), slice(6, 7), slice(7, 11)):
        y, state = layer.apply({"params": params, "cache": cache}, x[:, part], decode=True,
                               mutable=["cache"])  # fmt: skip
        cache = state["cache"]
        outs.append(np.asarray(y))
    np.testing.assert_allclose(np.concatenate(outs, 1), arrays["y_f64"], atol=5e-5, rtol=1e-4)


def test_the_configuration_and_the_names():
    config, arrays = _fixture("v3")
    cfg, params = from_deepseek(config, arrays, 0)
    assert (cfg.q_lora_rank, cfg.rope_layout, cfg.rope_scaling.rope_type) == (
        17,
        "interleaved",
        "yarn",
    )
    assert sorted(params) == ["kv_a", "kv_a_norm", "kv_b", "out", "q_a", "q_a_norm", "q_b"]
    lite, params = from_deepseek(*_fixture("v2_lite"), 0)
    assert lite.q_lora_rank is None and lite.rope_layout == "half" and "bias" in params["kv_a"]
    broken = {k: v for k, v in arrays.items() if "kv_b_proj" not in k}
    with pytest.raises(ValueError, match=r"has no model\.layers\.0\.self_attn\.kv_b_proj"):
        from_deepseek(config, broken, 0)
    with pytest.raises(ValueError, match=r"config has no kv_lora_rank \(an int >= 1\): is it"):
        from_deepseek({k: v for k, v in config.items() if k != "kv_lora_rank"}, arrays, 0)


def forward(cfg, params, x) -> np.ndarray:
    return np.asarray(jax.jit(LatentAttention(cfg).apply)({"params": params}, x), np.float64)


def test_a_config_without_rope_interleave_is_read_as_transformers_reads_it():
    """DeepSeek-V3's own config.json has no rope_interleave; transformers' default for it
    is True (DeepseekV3Config), which is the interleaved layout. The fixture is
    transformers' run of such a configuration."""
    config, arrays = _fixture("v3_config_json")
    assert "rope_interleave" not in config and "rope_parameters" not in config
    cfg, params = from_deepseek(config, arrays, 0)
    assert cfg.rope_layout == "interleaved"
    assert from_deepseek(dict(config, rope_interleave=True), arrays, 0)[0] == cfg
    truth, theirs = arrays["y_f64"], np.abs(arrays["y_f32"] - arrays["y_f64"]).max()
    assert np.abs(forward(cfg, params, arrays["x"]) - truth).max() <= 2 * theirs + 1e-6
    # The layout shows in the outputs: the half layout misses transformers' by far.
    half, _ = from_deepseek(dict(config, rope_interleave=False), arrays, 0)
    assert half.rope_layout == "half"
    assert np.abs(forward(half, params, arrays["x"]) - truth).max() > 100 * theirs


def test_float64_tensors_load_as_float64_params_under_jax_enable_x64(x64):
    config, arrays = _fixture("v3")
    wide = {k: v.astype(np.float64) for k, v in arrays.items() if k.startswith(PREFIX)}
    cfg, params = from_deepseek(config, wide, 0)
    assert cfg.param_dtype == np.float64 and params["q_a"]["kernel"].dtype == np.float64
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no dtype truncated
        y = LatentAttention(cfg).apply({"params": params}, arrays["x"].astype(np.float64))
    assert y.dtype == np.float64
    assert np.abs(np.asarray(y) - arrays["y_f64"]).max() < 1e-12


def one_line(error: pytest.ExceptionInfo) -> str:
    message = str(error.value)
    assert message and "\n" not in message
    return message


# Each mistake: (the configuration's changes, the state dict's changes (None: remove),
# layer, the error, the message). Before these checks, the unknown tensors, mixed dtypes,
# float64 and ill-typed keys loaded silently.
def mistakes():
    _, arrays = _fixture("v3")
    state = {k: v for k, v in arrays.items() if k.startswith(PREFIX)}
    q_b = PREFIX + "q_b_proj.weight"
    return {
        "a tensor the layer does not use": (
            {}, {PREFIX + "q_norm.weight": np.ones(3, np.float32)}, 0, ValueError,
            f"state_dict has {PREFIX}q_norm.weight, which a DeepSeek attention layer without "
            "attention_bias does not use"),
        "a bias without attention_bias": (
            {}, {PREFIX + "o_proj.bias": np.ones(29, np.float32)}, 0, ValueError,
            f"state_dict has {PREFIX}o_proj.bias, which a DeepSeek attention layer without "
            "attention_bias does not use"),
        "the low-rank query's tensors without q_lora_rank": (
            {"q_lora_rank": None}, {}, 0, ValueError,
            f"state_dict has {PREFIX}q_a_layernorm.weight, which a DeepSeek attention layer"),
        "mixed dtypes": (
            {}, {q_b: state[q_b].astype(np.float16)}, 0, ValueError,
            f"state_dict {q_b} is float16 but {PREFIX}kv_a_proj_with_mqa.weight is float32; "
            "cast the layer's tensors to one dtype first"),
        "float64 without jax_enable_x64": (
            {}, {k: v.astype(np.float64) for k, v in state.items()}, 0, ValueError,
            f"state_dict {PREFIX}kv_a_proj_with_mqa.weight is float64, which JAX truncates to "
            "float32 without jax_enable_x64; cast the tensors to float32 first"),
        "integer tensors": (
            {}, {k: v.astype(np.int32) for k, v in state.items()}, 0, ValueError,
            f"state_dict {PREFIX}kv_a_proj_with_mqa.weight is int32; expected floating-point"),
        "a size of another type": (
            {"kv_lora_rank": 13.0}, {}, 0, ValueError,
            "config kv_lora_rank must be an int >= 1, got 13.0"),
        "q_lora_rank 0": (
            {"q_lora_rank": 0}, {}, 0, ValueError, "config q_lora_rank must be an int >= 1, got 0"),
        "rope_interleave a string": (
            {"rope_interleave": "false"}, {}, 0, ValueError,
            "config rope_interleave must be True or False, got 'false'"),
        "rope_interleave None": (
            {"rope_interleave": None}, {}, 0, ValueError,
            "config rope_interleave must be True or False, got None"),
        "attention_bias a string": (
            {"attention_bias": "no"}, {}, 0, ValueError,
            "config attention_bias must be True or False, got 'no'"),
        "rope_scaling a string": (
            {"rope_parameters": None, "rope_scaling": "yarn"}, {}, 0, ValueError,
            "config rope_scaling must be a dict of RoPE parameters, got 'yarn'"),
        "a layer past num_hidden_layers": (
            {}, {}, 1, ValueError, "layer must be in [0, 1) (num_hidden_layers), got layer=1"),
        "a layer of another type": ({}, {}, "0", TypeError, "layer must be an int, got layer='0'"),
        "a state_dict of another type": (
            {}, [1], 0, TypeError, "state_dict must be a mapping from names to arrays, got list"),
    }  # fmt: skip


MISTAKES = mistakes()


@pytest.mark.parametrize("case", list(MISTAKES))
def test_each_mistake_is_a_one_line_error_naming_the_key_or_the_tensor(case):
    config, arrays = _fixture("v3")
    changes, tensors, layer, kind, message = MISTAKES[case]
    state = {k: v for k, v in arrays.items() if k.startswith(PREFIX)}
    state = tensors if isinstance(tensors, list) else state | tensors
    with pytest.raises(kind) as e:
        from_deepseek(config | changes, state, layer)
    assert message in one_line(e), (message, str(e.value))


def test_deepseek_v32_selects_transformers_keys_and_equals_its_output():
    """DeepSeek-V3.2 (transformers' DeepseekV32Attention, its indexer keeping each
    query's top 5 of 11 keys): the indexer's choices equal transformers' (as sets, among
    the keys causality lets a query see), the output equals transformers' within its
    own float32 error, in linen and NNX alike; the choices matter (keeping every key
    moves the output); decoding through a full cache (a prefill chunk, then one token
    a call) and a paged one (pages of 3, the rows token-major) equals it too, each
    query choosing among the indexer keys the cache holds."""
    from flax import nnx

    from nanoattn._layers import indexer, latent
    from nanoattn._layers.nnx.latent import _Parameters
    from nanoattn.nnx import LatentAttention as NnxLatent

    config, arrays = _fixture("v32")
    cfg, params = from_deepseek(config, arrays, 0)
    assert (cfg.index_n_heads, cfg.index_head_dim, cfg.index_topk) == (8, 6, 5)
    x = arrays["x"]
    B, T = x.shape[:2]

    module = NnxLatent(cfg, rngs=nnx.Rngs(0))
    for name, leaves in params.items():
        for leaf, value in leaves.items():
            getattr(getattr(module, name), leaf)[...] = value
    p = _Parameters(module)
    low = latent.query(p, cfg, x, np.float32)[2]
    scores = indexer.index_scores(p, cfg, x, low, np.arange(T), np.float32)
    ours = np.asarray(indexer.top_keys(scores, cfg.index_topk))
    for b, t in np.ndindex(B, T):
        theirs = {int(j) for j in arrays["selected"][b, t] if j <= t}
        assert {int(j) for j in ours[b, t] if j <= t} == theirs, (b, t)
    y = forward(cfg, params, x)
    truth = arrays["y_f64"]
    theirs = np.abs(arrays["y_f32"] - truth).max()
    assert np.abs(y - truth).max() <= 2 * theirs + 1e-6, (np.abs(y - truth).max(), theirs)
    dense = forward(dataclasses.replace(cfg, index_topk=T), params, x)
    assert np.abs(dense - truth).max() > 100 * theirs  # the selection is not a no-op
    np.testing.assert_allclose(np.asarray(module(x)), y, atol=1e-5, rtol=1e-5)
    layer = LatentAttention(cfg)
    cache = layer.init(jax.random.key(0), np.zeros(x.shape, np.float32), decode=True)["cache"]
    assert cache["value"].shape == (B, T, 1, cfg.index_head_dim)  # the indexer's keys
    step = jax.jit(lambda cache, x: layer.apply({"params": params, "cache": cache}, x,
                                                decode=True, mutable=["cache"]))  # fmt: skip
    outs = []
    for part in [slice(0, 4), *(slice(t, t + 1) for t in range(4, T))]:
        out, state = step(cache, x[:, part])
        cache = state["cache"]
        outs.append(np.asarray(out))
    np.testing.assert_allclose(np.concatenate(outs, 1), y, atol=2e-5, rtol=2e-5)
    paged = LatentAttention(dataclasses.replace(cfg, page_size=3))
    pool = paged.init(jax.random.key(0), np.zeros((1, 36, cfg.d_model), np.float32),
                      decode=True)["cache"]  # fmt: skip
    alloc = nanoattn.PageAllocator(pages=12, page_size=3, max_sequences=B, max_pages=4)
    paged_step = jax.jit(
        lambda pool, x, batch: paged.apply(
            {"params": params, "cache": pool}, x, decode=True, pages=batch, mutable=["cache"]
        )
    )
    outs = [[] for _ in range(B)]
    for part in (slice(0, 5), slice(5, 6), slice(6, T)):
        n = part.stop - part.start
        for row in range(B):
            (alloc.extend if part.start else alloc.allocate)(row, n)
        batch = alloc.batch([(row, n) for row in range(B)], tokens=B * n)
        chunk = x[:, part].reshape(1, B * n, -1)  # token-major
        out, state = paged_step(pool, chunk, batch)
        pool = state["cache"]
        alloc.confirm(batch)
        for row in range(B):
            outs[row].append(np.asarray(out[0, row * n : (row + 1) * n]))
    np.testing.assert_allclose(np.stack([np.concatenate(o) for o in outs]), y, atol=2e-5,
                               rtol=2e-5)  # fmt: skip
