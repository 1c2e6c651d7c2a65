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
        (config, state | {q: state[q].astype(np.float16)}, 0, ValueError,
         f"state_dict {q} is float16 but model.layers.0.self_attn.o_proj.weight is float32; "
         "cast the layer's tensors to one dtype first"),
        (config, {k: v.astype(np.float64) for k, v in state.items()}, 0, ValueError,
         "state_dict model.layers.0.self_attn.o_proj.weight is float64, which JAX truncates "
         "to float32 without jax_enable_x64; cast the tensors to float32 first"),
        (config, {k: v.astype(np.int32) for k, v in state.items()}, 0, ValueError,
         "state_dict model.layers.0.self_attn.o_proj.weight is int32; expected "
         "floating-point tensors"),
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


def test_float64_tensors_load_as_float64_params_under_jax_enable_x64(x64):
    config, state, arrays = LOADED["qwen2"]
    wide = {k: v.astype(np.float64) for k, v in state.items()}
    attention, params = from_transformers(config, wide, 0)
    assert attention.param_dtype == np.float64 and params["qkv"]["kernel"].dtype == np.float64
    y = CausalSelfAttention(attention).apply({"params": params}, arrays["x0"].astype(np.float64))
    assert y.dtype == np.float64 and error(y, arrays["y0_f64"]) < 1e-12


def without(mapping: dict, *keys: str) -> dict:
    return {k: v for k, v in mapping.items() if k not in keys}


def rope(config: dict, **changes) -> dict:
    """The configuration with its (flat) rope_parameters changed: None removes a key."""
    params = dict(config["rope_parameters"]) | changes
    return dict(config, rope_parameters={k: v for k, v in params.items() if v is not None})


# Each mistake in a configuration: (family, the configuration, layer, the message). Every
# message is one line naming the key and what it must be; before these checks each was
# a KeyError, IndexError, ZeroDivisionError or TypeError, or went through silently.
def config_mistakes():
    llama, gemma2, gemma3, qwen2, qwen3, gpt_oss, phi3 = (
        LOADED[f][0] for f in ("llama", "gemma2", "gemma3", "qwen2", "qwen3", "gpt_oss", "phi3")
    )
    old_gemma3 = older_form("gemma3", gemma3)
    old_qwen2 = older_form("qwen2", qwen2)
    return {
        "gemma2 without query_pre_attn_scalar": (
            "gemma2", without(gemma2, "query_pre_attn_scalar"), 0,
            "config has no query_pre_attn_scalar (a number > 0)"),
        "gemma2 query_pre_attn_scalar 0": (
            "gemma2", dict(gemma2, query_pre_attn_scalar=0), 0,
            "config query_pre_attn_scalar must be a number > 0, got 0"),
        "qwen3 without rms_norm_eps": (
            "qwen3", without(qwen3, "rms_norm_eps"), 0,
            "config has no rms_norm_eps (a number > 0)"),
        "gemma3 rms_norm_eps a string": (
            "gemma3", dict(gemma3, rms_norm_eps="1e-6"), 0,
            "config rms_norm_eps must be a number > 0, got '1e-6'"),
        "gemma3 sliding_window_pattern 0": (
            "gemma3", dict(old_gemma3, sliding_window_pattern=0), 0,
            "config sliding_window_pattern must be an int >= 1, got 0"),
        "layer_types shorter than the layers, layer past it": (
            "qwen2", dict(qwen2, layer_types=["full_attention"]), 1,
            "config layer_types must have one entry per layer (num_hidden_layers=2), got 1"),
        "layer_types shorter than the layers, layer within it": (
            "qwen2", dict(qwen2, layer_types=["full_attention"]), 0,
            "config layer_types must have one entry per layer (num_hidden_layers=2), got 1"),
        "layer_types a string": (
            "qwen2", dict(qwen2, layer_types="full_attention"), 0,
            "config layer_types must be a list of layer types, got 'full_attention'"),
        "layer_types of an unknown type": (
            "qwen2", dict(qwen2, layer_types=["chunked_attention", "full_attention"]), 0,
            "config layer_types[0] is 'chunked_attention', which from_transformers does not "
            "load; known: full_attention, sliding_attention"),
        "yarn without factor nor max_position_embeddings": (
            "qwen3", without(rope(qwen3, factor=None), "max_position_embeddings"), 0,
            "config has no max_position_embeddings (an int >= 1), which rope_type 'yarn' "
            "without a factor needs"),
        "rope_theta None": (
            "llama", dict(older_form("llama", llama), rope_theta=None), 0,
            "config rope_theta must be a number > 0, got None"),
        "rope_parameters' rope_theta None": (
            "llama", dict(llama, rope_parameters=dict(llama["rope_parameters"], rope_theta=None)),
            0, "config rope_parameters['rope_theta'] must be a number > 0, got None"),
        "rope_scaling a string": (
            "llama", dict(older_form("llama", llama), rope_scaling="linear"), 0,
            "config rope_scaling must be a dict of RoPE parameters, got 'linear'"),
        "rope_parameters a string": (
            "llama", dict(llama, rope_parameters="default"), 0,
            "config rope_parameters must be a dict of RoPE parameters, got 'default'"),
        "rope_parameters without the layer's type": (
            "gemma3", dict(gemma3, rope_parameters=without(gemma3["rope_parameters"],
                                                           "sliding_attention")), 0,
            "config rope_parameters has no 'sliding_attention' entry"),
        "linear without factor": (
            "gemma3", dict(gemma3, rope_parameters=dict(
                gemma3["rope_parameters"], full_attention=dict(rope_type="linear"))), 1,
            "config rope_parameters['full_attention'] has no 'factor', which rope_type "
            "'linear' needs"),
        "llama3 without low_freq_factor": (
            "llama", rope(llama, low_freq_factor=None), 0,
            "config rope_parameters has no 'low_freq_factor', which rope_type 'llama3' needs"),
        "factor a string": (
            "llama", rope(llama, factor="8"), 0,
            "config rope_parameters['factor'] must be a number > 0, got '8'"),
        "yarn original_max_position_embeddings a float": (
            "qwen3", rope(qwen3, original_max_position_embeddings=8.5), 0,
            "config rope_parameters['original_max_position_embeddings'] must be an int >= 1, "
            "got 8.5"),
        "yarn truncate a string": (
            "gpt_oss", rope(gpt_oss, truncate="no"), 0,
            "config rope_parameters['truncate'] must be True or False, got 'no'"),
        "dynamic without max_position_embeddings": (
            "llama", without(dict(llama, rope_parameters=dict(rope_type="dynamic", factor=2.0)),
                             "max_position_embeddings"), 0,
            "config has no max_position_embeddings (an int >= 1), which rope_type 'dynamic' "
            "needs"),
        "partial_rotary_factor 0": (
            "phi3", rope(phi3, partial_rotary_factor=0.0), 0,
            "config rope_parameters['partial_rotary_factor'] must be a number in (0, 1], got 0.0"),
        "without num_attention_heads": (
            "qwen2", without(qwen2, "num_attention_heads"), 0,
            "config has no num_attention_heads (an int >= 1)"),
        "without hidden_size": (
            "qwen2", without(qwen2, "hidden_size"), 0, "config has no hidden_size (an int >= 1)"),
        "without num_hidden_layers": (
            "qwen2", without(qwen2, "num_hidden_layers"), 0,
            "config has no num_hidden_layers (an int >= 1)"),
        "head_dim a string": (
            "gemma2", dict(gemma2, head_dim="8"), 0,
            "config head_dim must be an int >= 1, got '8'"),
        "num_key_value_heads 0": (
            "qwen2", dict(qwen2, num_key_value_heads=0), 0,
            "config num_key_value_heads must be an int >= 1, got 0"),
        "attention_dropout a string": (
            "qwen2", dict(qwen2, attention_dropout="0.1"), 0,
            "config attention_dropout must be a number in [0, 1), got '0.1'"),
        "attn_logit_softcapping a string": (
            "gemma2", dict(gemma2, attn_logit_softcapping="50"), 0,
            "config attn_logit_softcapping must be a number > 0, got '50'"),
        "max_window_layers missing where the sliding rule reads it": (
            "qwen2", without(old_qwen2, "max_window_layers"), 1,
            "config has no max_window_layers (an int >= 0)"),
        "use_sliding_window a string": (
            "qwen2", dict(old_qwen2, use_sliding_window="true"), 1,
            "config use_sliding_window must be True or False, got 'true'"),
        "model_type a list": (
            "qwen2", dict(qwen2, model_type=["qwen2"]), 0,
            "config model_type ['qwen2'] is not supported; supported: llama"),
    }  # fmt: skip


CONFIG_MISTAKES = config_mistakes()


@pytest.mark.parametrize("case", list(CONFIG_MISTAKES))
def test_each_configuration_mistake_is_a_one_line_value_error_naming_the_key(case):
    family, config, layer, message = CONFIG_MISTAKES[case]
    with pytest.raises(ValueError) as e:
        from_transformers(config, LOADED[family][1], layer)
    assert message in one_line(e), (message, str(e.value))


def test_yarn_without_a_factor_takes_the_ratio_of_the_lengths_as_transformers_does():
    """transformers derives YaRN's factor, where the configuration has none, as
    max_position_embeddings / original_max_position_embeddings (40 / 8 = 5 here): the
    fixture is transformers' own run of a configuration with factor None."""
    config, state, arrays = load("qwen3_yarn_derived")
    assert config["rope_parameters"]["factor"] is None and config["max_position_embeddings"] == 40
    old = older_form("qwen3", config)
    forms = {
        "factor None, as transformers writes it": config,
        "no factor key": rope(config, factor=None),
        "a config.json whose rope_scaling has no factor": dict(
            old, rope_scaling=without(old["rope_scaling"], "factor")
        ),
    }
    derived = dict(rope_type="yarn", factor=5.0, original_max_position_embeddings=8)
    loaded = {name: from_transformers(form, state, 0) for name, form in forms.items()}
    for name, (attention, _) in loaded.items():
        assert attention.rope_scaling.as_dict() == derived, name
    attention, params = loaded["no factor key"]
    x, truth, theirs = arrays["x0"], arrays["y0_f64"], arrays["y0_f32"]
    y = CausalSelfAttention(attention).apply({"params": params}, x, deterministic=True)
    assert error(y, truth) <= 2 * error(theirs, truth) + FLOOR, error(y, truth)
    # The factor shows in the outputs: the qwen3 fixture's 4 misses transformers' 5.
    other, _ = from_transformers(rope(config, factor=4.0), state, 0)
    y = CausalSelfAttention(other).apply({"params": params}, x, deterministic=True)
    assert error(y, truth) > 100 * error(theirs, truth)


def nested(config: dict, **entries) -> dict:
    """Gemma 3's configuration with rope_parameters' layer-type entries replaced."""
    return dict(config, rope_parameters=dict(config["rope_parameters"], **entries))


# Keys transformers fills in where a configuration lacks them, and what it fills in
# (transformers 5.25: modeling_rope_utils.py and each family's configuration_*.py), as
# (family, layer, the configuration, what from_transformers must read). RoPE bases: its
# configs' default_theta (10000; Gemma 3's {"global": 1e6, "local": 1e4}, gpt-oss's
# 150000); yarn's and llama3's original length: max_position_embeddings; head_dim:
# D // N; Gemma 3's sliding_window_pattern: 6.
def derived_keys():
    llama, gemma3, gpt_oss, qwen3, olmo2 = (
        LOADED[f][0] for f in ("llama", "gemma3", "gpt_oss", "qwen3", "olmo2")
    )
    old_gemma3 = without(older_form("gemma3", gemma3), "rope_theta", "rope_local_base_freq")
    default = dict(rope_type="default")
    return {
        "llama rope_theta": ("llama", 0, rope(llama, rope_theta=None), "rope_base", 10_000.0),
        "gpt_oss rope_theta": (
            "gpt_oss", 0, rope(gpt_oss, rope_theta=None), "rope_base", 150_000.0),
        "gemma3 global rope_theta": (
            "gemma3", 1, nested(gemma3, full_attention=default), "rope_base", 1_000_000.0),
        "gemma3 local rope_theta": (
            "gemma3", 0, nested(gemma3, sliding_attention=default), "rope_base", 10_000.0),
        "gemma3 config.json rope_theta": ("gemma3", 1, old_gemma3, "rope_base", 1_000_000.0),
        "gemma3 config.json rope_local_base_freq": (
            "gemma3", 0, old_gemma3, "rope_base", 10_000.0),
        "gemma3 sliding_window_pattern": (
            "gemma3", 1, without(old_gemma3, "sliding_window_pattern"), "window", (3, 0)),
        "yarn original_max_position_embeddings": (
            "qwen3", 0, rope(qwen3, original_max_position_embeddings=None), "rope_scaling",
            dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=32)),
        "llama3 original_max_position_embeddings": (
            "llama", 0, rope(llama, original_max_position_embeddings=None), "rope_scaling",
            dict(llama["rope_parameters"], original_max_position_embeddings=256)),
        "head_dim": ("llama", 0, without(llama, "head_dim"), "head_dim", 8),
        "num_key_value_heads": ("olmo2", 0, without(olmo2, "num_key_value_heads"), "kv_heads", 4),
    }  # fmt: skip


DERIVED_KEYS = derived_keys()


@pytest.mark.parametrize("case", list(DERIVED_KEYS))
def test_a_missing_key_is_what_transformers_makes_of_it(case):
    family, layer, config, name, want = DERIVED_KEYS[case]
    attention, _ = from_transformers(config, LOADED[family][1], layer)
    got = getattr(attention, name)
    if name == "rope_scaling":
        got, want = got.as_dict(), {k: v for k, v in want.items() if k != "rope_theta"}
    assert got == want, (got, want)
