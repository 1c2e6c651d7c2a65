"""from_transformers / to_transformers against transformers' own attention modules.

The fixtures (tests/fixtures/models/<family>.npz, made by tools/make_model_fixtures.py
with torch and transformers, which the tests never import) hold each family's small
random checkpoint, its configuration, the inputs of each layer's attention and
transformers' outputs for them in float32 and in float64, for a forward and for a
cached decode (a prompt of 6 tokens, then one token per call). Every family is ported
by from_transformers alone, and:

* its float32 forward and decode are within FlashAttention's criterion of the float64
  truth: an error at most twice transformers' own float32 error, plus 1e-6;
* its cached decode equals its own full forward;
* to_transformers gives the checkpoint's tensors back bit for bit;
* the NNX layer built through from_linen gives the linen layer's outputs;
* the config of each layer is the one its family's options say (windows, scales, RoPE),
  from the current form of transformers' configuration and from the older config.json.
"""

import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from nanoattn import nnx as nanoattn_nnx
from nanoattn.linen import AttentionConfig, CausalSelfAttention, from_transformers, to_transformers

FIXTURES = pathlib.Path(__file__).resolve().parent.parent / "fixtures" / "models"
FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3", "gpt_oss", "olmo2", "phi3")
FLOOR = 1e-6  # FlashAttention's criterion: error <= 2 x transformers' float32 error + FLOOR


def load(family: str):
    """(config dict, state dict, arrays) of a family's fixture."""
    with np.load(FIXTURES / f"{family}.npz") as z:
        arrays = {k: z[k] for k in z.files}
    config = json.loads(str(arrays.pop("config")))
    state = {k: arrays.pop(k) for k in list(arrays) if ".self_attn." in k}
    return config, state, arrays


LOADED = {family: load(family) for family in FAMILIES}
CASES = [
    (family, i)
    for family, (config, _, _) in LOADED.items()
    for i in range(config["num_hidden_layers"])
]
IDS = [f"{family}-{i}" for family, i in CASES]


def run(config: AttentionConfig, params, x, dx, chunks):
    """The layer's full forward of x, its full forward of dx and its cached decode of
    dx (a prompt of ``chunks[0]`` tokens, then one token per call): one compiled
    program per layer."""
    layer = CausalSelfAttention(config)
    prompt = chunks[0]
    assert all(n == 1 for n in chunks[1:]) and sum(chunks) == dx.shape[1]

    @jax.jit
    def all_of(params, x, dx):
        variables = {"params": params}
        full = layer.apply(variables, x, deterministic=True)
        full_dx = layer.apply(variables, dx, deterministic=True)

        def step(cache, chunk):
            y, state = layer.apply(
                {**variables, "cache": cache}, chunk, True, decode=True, mutable=["cache"]
            )
            return state["cache"], y

        cache = layer.init(jax.random.key(0), jnp.zeros_like(dx), decode=True)["cache"]
        cache, first = step(cache, dx[:, :prompt])
        tokens = jnp.swapaxes(dx[:, prompt:, None], 0, 1)  # (T - prompt, B, 1, D)
        _, rest = jax.lax.scan(step, cache, tokens)  # (T - prompt, B, 1, D)
        rest = jnp.swapaxes(rest[:, :, 0], 0, 1)  # (B, T - prompt, D)
        return full, full_dx, jnp.concatenate([first, rest], axis=1)

    return [np.asarray(a, np.float64) for a in all_of(params, x, dx)]


def error(a, b) -> float:
    return float(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64)).max())


@pytest.mark.parametrize("family, i", CASES, ids=IDS)
def test_forward_and_decode_match_transformers(family, i):
    config, state, arrays = LOADED[family]
    attention, params = from_transformers(config, state, i)
    chunks = [int(n) for n in arrays["chunks"]]
    full, full_dx, decoded = run(attention, params, arrays[f"x{i}"], arrays[f"dx{i}"], chunks)
    truth, theirs = arrays[f"y{i}_f64"], arrays[f"y{i}_f32"]
    assert error(full, truth) <= 2 * error(theirs, truth) + FLOOR, (
        f"forward: ours {error(full, truth):.2e}, transformers' {error(theirs, truth):.2e}"
    )
    truth, theirs = arrays[f"dy{i}_f64"], arrays[f"dy{i}_f32"]
    assert error(decoded, truth) <= 2 * error(theirs, truth) + FLOOR, (
        f"decode: ours {error(decoded, truth):.2e}, transformers' {error(theirs, truth):.2e}"
    )
    np.testing.assert_allclose(decoded, full_dx, atol=2e-6, rtol=0)


@pytest.mark.parametrize("family, i", CASES, ids=IDS)
def test_to_transformers_gives_the_checkpoint_back_bit_for_bit(family, i):
    config, state, _ = LOADED[family]
    _, params = from_transformers(config, state, i)
    back = to_transformers(config, params, layer=i)
    layer_state = {k: v for k, v in state.items() if k.startswith(f"model.layers.{i}.")}
    assert sorted(back) == sorted(layer_state)
    for name, value in back.items():
        assert value.dtype == layer_state[name].dtype and value.shape == layer_state[name].shape
        assert value.tobytes() == layer_state[name].tobytes(), name
    # Without a layer: names relative to the attention module; through {"params": ...} too.
    relative = to_transformers(config, {"params": params})
    prefix = f"model.layers.{i}.self_attn."
    assert relative.keys() == {k.removeprefix(prefix) for k in back}
    assert all(np.array_equal(relative[k.removeprefix(prefix)], v) for k, v in back.items())


def test_state_dict_without_the_model_prefix_is_accepted():
    config, state, _ = LOADED["qwen2"]
    bare = {k.removeprefix("model."): v for k, v in state.items()}
    for i in range(2):
        want, got = from_transformers(config, state, i), from_transformers(config, bare, i)
        assert want[0] == got[0]
        assert jax.tree.all(jax.tree.map(np.array_equal, want[1], got[1]))


# Every kind of parameter a converted layer has: the projection norm, Gemma's offset
# norms and scale, sinks with biases, q/k/v biases without an output bias.
@pytest.mark.parametrize("family", ["olmo2", "gemma3", "gpt_oss", "qwen2"])
def test_nnx_layer_through_from_linen_gives_the_same_outputs(family):
    config, state, arrays = LOADED[family]
    i = config["num_hidden_layers"] - 1
    attention, params = from_transformers(config, state, i)
    module = nanoattn_nnx.from_linen(attention, params, rngs=nnx.Rngs(0))
    x = arrays[f"x{i}"]
    linen = CausalSelfAttention(attention)

    @nnx.jit
    def both(module, x):
        return module(x, deterministic=True), linen.apply({"params": params}, x, True)

    got, want = both(module, x)
    np.testing.assert_allclose(got, want, atol=1e-6, rtol=0)
    assert (
        error(got, arrays[f"y{i}_f64"])
        <= 2 * error(arrays[f"y{i}_f32"], arrays[f"y{i}_f64"]) + FLOOR
    )


# What each layer's config must be: the family's options, literally.
EXPECTED = {
    ("llama", 0): dict(head_dim=8, n_kv_heads=2, rope_base=100.0, use_bias=False,
                       rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                         high_freq_factor=4.0,
                                         original_max_position_embeddings=32)),
    ("mistral", 0): dict(head_dim=6, n_kv_heads=1, window=(3, 0), rope_base=50.0,
                         use_bias=False),
    ("qwen2", 0): dict(head_dim=4, n_kv_heads=2, window=None, use_bias=True, out_bias=False),
    ("qwen2", 1): dict(window=(4, 0), use_bias=True, out_bias=False),
    ("qwen3", 0): dict(head_dim=10, qk_norm="head", qk_norm_eps=1e-6, use_bias=False,
                       rope_scaling=dict(rope_type="yarn", factor=4.0,
                                         original_max_position_embeddings=8)),
    ("gemma2", 0): dict(head_dim=8, scale=12**-0.5, logit_soft_cap=2.0, window=(3, 0),
                        qk_norm=False),
    ("gemma2", 1): dict(head_dim=8, scale=12**-0.5, logit_soft_cap=2.0, window=None),
    ("gemma3", 0): dict(scale=10**-0.5, logit_soft_cap=None, window=(3, 0), rope_base=100.0,
                        rope_scaling=None, qk_norm="head", qk_norm_offset=1.0),
    ("gemma3", 1): dict(window=None, rope_base=1000.0, qk_norm_offset=1.0,
                        rope_scaling=dict(rope_type="linear", factor=8.0)),
    ("gpt_oss", 0): dict(sinks=True, window=(3, 0), use_bias=True,
                         rope_scaling=dict(rope_type="yarn", factor=8.0, beta_fast=8.0,
                                           beta_slow=1.0, truncate=False,
                                           original_max_position_embeddings=64)),
    ("gpt_oss", 1): dict(sinks=True, window=None),
    ("olmo2", 0): dict(n_kv_heads=None, qk_norm="projection", qk_norm_eps=1e-5,
                       qk_norm_offset=0.0),
    ("phi3", 0): dict(head_dim=8, rotary_dim=4, window=(5, 0), use_bias=False),
}  # fmt: skip


@pytest.mark.parametrize("family, i", CASES, ids=IDS)
def test_each_layer_gets_its_familys_options(family, i):
    config, state, _ = LOADED[family]
    attention, _ = from_transformers(config, state, i)
    assert attention.param_dtype == np.float32
    for name, want in EXPECTED[(family, i)].items():
        got = getattr(attention, name)
        if name == "rope_scaling" and got is not None:
            got = got.as_dict()
        assert got == want, (name, got, want)


def older_form(family: str, config: dict) -> dict:
    """The same configuration as a config.json of transformers 4: rope_theta and
    rope_scaling at the top, no layer_types (each family's own rule places its sliding
    layers), Gemma 3's local base apart."""
    old = {k: v for k, v in config.items() if k not in ("rope_parameters", "layer_types")}
    params = config["rope_parameters"]
    if family == "gemma3":
        old |= dict(rope_local_base_freq=params["sliding_attention"]["rope_theta"],
                    sliding_window_pattern=2)  # fmt: skip
        params = params["full_attention"]
    old["rope_theta"] = params["rope_theta"]
    if params.get("partial_rotary_factor") is not None:
        old["partial_rotary_factor"] = params["partial_rotary_factor"]
    scaling = {k: v for k, v in params.items() if k not in ("rope_theta", "partial_rotary_factor")}
    if scaling.get("rope_type", "default") != "default":
        old["rope_scaling"] = {"type" if family == "llama" else "rope_type": scaling["rope_type"]}
        old["rope_scaling"] |= {k: v for k, v in scaling.items() if k != "rope_type"}
    return old


@pytest.mark.parametrize("family, i", CASES, ids=IDS)
def test_the_older_config_json_form_gives_the_same_layer(family, i):
    config, state, _ = LOADED[family]
    want, _ = from_transformers(config, state, i)
    got, _ = from_transformers(older_form(family, config), state, i)
    assert got == want


def test_gemma3_multimodal_config_reads_its_text_config():
    config, state, _ = LOADED["gemma3"]
    nested = {"model_type": "gemma3", "text_config": config}
    renamed = {k.replace("model.", "model.language_model.", 1): v for k, v in state.items()}
    for i in range(2):
        assert from_transformers(nested, renamed, i)[0] == from_transformers(config, state, i)[0]


def test_dynamic_and_unsupported_rope_types():
    config, state, _ = LOADED["llama"]
    dynamic = dict(config, rope_parameters=dict(rope_type="dynamic", rope_theta=100.0, factor=2.0))
    attention, _ = from_transformers(dynamic, state, 0)
    assert attention.rope_scaling.as_dict() == dict(
        rope_type="dynamic", factor=2.0, original_max_position_embeddings=256
    )
    longrope = dict(config, rope_parameters=dict(rope_type="longrope", rope_theta=1.0))
    with pytest.raises(ValueError, match=r"^config rope_type 'longrope' is not supported; "
                       r"supported: default, linear, dynamic, llama3, yarn$"):  # fmt: skip
        from_transformers(longrope, state, 0)


def one_line(error: pytest.ExceptionInfo) -> str:
    message = str(error.value)
    assert message and "\n" not in message
    return message


def test_errors_name_what_is_wrong_in_one_line():
    config, state, _ = LOADED["qwen2"]
    q = "model.layers.0.self_attn.q_proj.weight"
    cases = [
        (dict(config, model_type="bert"), state, 0, ValueError,
         "config model_type 'bert' is not supported; supported: llama, mistral, qwen2, qwen3, "
         "gemma2, gemma3, gpt_oss, olmo2, phi3"),
        (config, state, 2, ValueError,
         "layer must be in [0, 2) (num_hidden_layers), got layer=2"),
        (config, state, 1.0, TypeError, "layer must be an int, got layer=1.0"),
        ("qwen2", state, 0, TypeError, "config must be the model's configuration as a dict"),
        (config, [1], 0, TypeError, "state_dict must be a mapping from names to arrays"),
        (config, {k: v for k, v in state.items() if k != q}, 0, ValueError,
         f"state_dict has no {q} (nor without the 'model.' prefix)"),
        (config, {k: v for k, v in state.items() if "0.self_attn.v_proj.weight" not in k}, 0,
         ValueError, "state_dict has no model.layers.0.self_attn.v_proj.weight"),
        (config, state | {q: state[q][:-1]}, 0, ValueError,
         f"state_dict {q} has shape (23, 24); the config gives (24, 24)"),
        (config, state | {"model.layers.0.self_attn.q_norm.weight": np.ones(4, np.float32)}, 0,
         ValueError, "state_dict has model.layers.0.self_attn.q_norm.weight, which a qwen2 "
         "layer does not use"),
        (config, {k: v for k, v in state.items() if k != "model.layers.0.self_attn.k_proj.bias"},
         0, ValueError, "state_dict has model.layers.0.self_attn.q_proj.bias but not "
         "model.layers.0.self_attn.k_proj.bias: nanoattn's fused qkv projection has one bias"),
        (config, state | {q: state[q].astype(np.float64)}, 0, ValueError,
         "have dtypes ['float32', 'float64']; cast them to one dtype first"),
        (dict(config, sliding_window=0), state, 1, ValueError,
         "config sliding_window must be an int >= 1, got 0"),
    ]  # fmt: skip
    for cfg, sd, layer, kind, message in cases:
        with pytest.raises(kind) as e:
            from_transformers(cfg, sd, layer)
        assert message in one_line(e), (message, str(e.value))
    _, params = from_transformers(config, state, 0)
    bad = {**params, "out": {"kernel": params["out"]["kernel"][:-1]}}
    with pytest.raises(ValueError) as e:
        to_transformers(config, bad, layer=0)
    assert one_line(e) == "params out/kernel has shape (23, 24); the config gives (24, 24)"
    with pytest.raises(ValueError) as e:
        to_transformers(config, {"out": params["out"]}, layer=0)
    assert one_line(e) == "params has no qkv/kernel (24, 40)"
