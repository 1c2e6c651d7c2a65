"""Builds the fixtures of tests/interop/test_transformers.py from transformers itself.

Run from the repository root with a Python that has torch and transformers (they are
never dependencies of nanoattn or of its tests, which read only the .npz files):

    /path/to/venv-with-torch/bin/python tools/make_model_fixtures.py [NAME ...]

(NAME: a family, a variant or ``rope``; none: every fixture.) For each family (llama,
mistral, qwen2, qwen3, gemma2, gemma3, gpt_oss, olmo2, phi3) it builds the
``...ForCausalLM`` with a small random configuration (two layers where the family
alternates layer types or sliding windows), gives the attention weights random values
of a useful size, and runs, with the eager attention:

* a forward over B x T tokens, recording each layer's attention input ``x{i}`` and
  output ``y{i}_f32`` (hooks on ``model.layers[i].self_attn``);
* a cached decode of the same tokens (a prompt, then one token per call, through
  transformers' ``DynamicCache``), recording each call's attention inputs and outputs,
  concatenated along T as ``dx{i}`` and ``dy{i}_f32``;
* both again with the model in float64 on exactly the recorded float32 inputs (a
  pre-hook swaps them in), ``y{i}_f64`` and ``dy{i}_f64``: the truth that both
  transformers' and nanoattn's float32 results are measured against. transformers
  asks for float32 in places (RMSNorm, the rotary table, the softmax); for this run
  every such request is given float64 (:func:`float64_everywhere`), so the truth is
  transformers' own code in float64.

The same for each variant of a family (``VARIANTS``: qwen3_yarn_derived, YaRN with
``factor`` None, which transformers derives from the lengths). It writes
tests/fixtures/models/<family or variant>.npz: ``config`` (``model.config.to_dict()`` as
JSON), the attention weights under their checkpoint names
(``model.layers.{i}.self_attn.*``, float32), the arrays above and ``chunks`` (the
decode's call lengths). And tests/fixtures/models/rope.npz: transformers' inverse
frequencies and attention factor (computed in float64 the same way) for each RoPE
scaling, held against ``nanoattn._core.rope.frequencies``.
"""

import contextlib
import json
import pathlib
import sys

import numpy as np
import torch
import transformers
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

OUT = pathlib.Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "models"
B, T, PROMPT = 2, 11, 6  # the decode: a prompt of 6 tokens, then 5 calls of one token
VOCAB = 40
SMALL = dict(
    vocab_size=VOCAB,
    intermediate_size=16,
    max_position_embeddings=256,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)

# Each family: its ForCausalLM, its config class and the options of its small config.
# The sizes differ between axes (D, N, K, H), head widths of their own where the family
# has them, RoPE bases small enough that a scaled frequency moves the angles of 11
# positions, windows shorter than T.
FAMILIES = {
    "llama": (
        "LlamaForCausalLM", "LlamaConfig",
        dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=1,
             rope_parameters=dict(rope_type="llama3", rope_theta=100.0, factor=8.0,
                                  low_freq_factor=1.0, high_freq_factor=4.0,
                                  original_max_position_embeddings=32)),
    ),
    "mistral": (
        "MistralForCausalLM", "MistralConfig",
        dict(hidden_size=24, num_attention_heads=4, num_key_value_heads=1, head_dim=6,
             num_hidden_layers=1, sliding_window=4, rope_parameters=dict(rope_theta=50.0)),
    ),
    "qwen2": (
        "Qwen2ForCausalLM", "Qwen2Config",
        dict(hidden_size=24, num_attention_heads=6, num_key_value_heads=2, num_hidden_layers=2,
             use_sliding_window=True, sliding_window=5, max_window_layers=1,
             rope_parameters=dict(rope_theta=1000.0)),
    ),
    "qwen3": (
        "Qwen3ForCausalLM", "Qwen3Config",
        dict(hidden_size=24, num_attention_heads=4, num_key_value_heads=2, head_dim=10,
             num_hidden_layers=1, rms_norm_eps=1e-6, max_position_embeddings=32,
             rope_parameters=dict(rope_type="yarn", rope_theta=100.0, factor=4.0,
                                  original_max_position_embeddings=8)),
    ),
    "gemma2": (
        "Gemma2ForCausalLM", "Gemma2Config",
        dict(hidden_size=24, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
             num_hidden_layers=2, query_pre_attn_scalar=12, attn_logit_softcapping=2.0,
             sliding_window=4, layer_types=["sliding_attention", "full_attention"],
             rope_parameters=dict(rope_theta=100.0)),
    ),
    "gemma3": (
        "Gemma3ForCausalLM", "Gemma3TextConfig",
        dict(hidden_size=24, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
             num_hidden_layers=2, query_pre_attn_scalar=10, sliding_window=4, rms_norm_eps=1e-6,
             layer_types=["sliding_attention", "full_attention"],
             rope_parameters={
                 "sliding_attention": dict(rope_type="default", rope_theta=100.0),
                 "full_attention": dict(rope_type="linear", rope_theta=1000.0, factor=8.0),
             }),
    ),
    "gpt_oss": (
        "GptOssForCausalLM", "GptOssConfig",
        dict(hidden_size=24, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
             num_hidden_layers=2, sliding_window=4, num_local_experts=2, num_experts_per_tok=1,
             layer_types=["sliding_attention", "full_attention"], max_position_embeddings=512,
             rope_parameters=dict(rope_type="yarn", rope_theta=100.0, factor=8.0,
                                  beta_fast=8.0, beta_slow=1.0, truncate=False,
                                  original_max_position_embeddings=64)),
    ),
    "olmo2": (
        "Olmo2ForCausalLM", "Olmo2Config",
        dict(hidden_size=24, num_attention_heads=4, num_key_value_heads=4, num_hidden_layers=1,
             rms_norm_eps=1e-5, rope_parameters=dict(rope_theta=100.0)),
    ),
    "phi3": (
        "Phi3ForCausalLM", "Phi3Config",
        dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=1,
             sliding_window=6,
             rope_parameters=dict(rope_theta=100.0, partial_rotary_factor=0.5)),
    ),
}  # fmt: skip

# Fixtures of a family with other options: (family, the options that replace its own).
# qwen3_yarn_derived: YaRN with factor None, which transformers derives from the lengths
# (max_position_embeddings / original_max_position_embeddings = 40 / 8 = 5).
VARIANTS = {
    "qwen3_yarn_derived": (
        "qwen3",
        dict(max_position_embeddings=40,
             rope_parameters=dict(rope_type="yarn", rope_theta=100.0, factor=None,
                                  original_max_position_embeddings=8)),
    ),
}  # fmt: skip

# Gemma's norms multiply by 1 + w and store w; the others store the scale itself.
OFFSET_NORMS = ("gemma2", "gemma3")


@contextlib.contextmanager
def float64_everywhere():
    """Every float32 that transformers asks for (``torch.float32``, ``torch.float``,
    ``Tensor.float()``) is float64, and new tensors default to float64."""
    saved = torch.float32, torch.float, torch.Tensor.float, torch.get_default_dtype()
    torch.float32 = torch.float = torch.float64
    torch.Tensor.float = torch.Tensor.double
    torch.set_default_dtype(torch.float64)
    try:
        yield
    finally:
        torch.float32, torch.float, torch.Tensor.float = saved[:3]
        torch.set_default_dtype(saved[3])


def build(name: str, dtype=torch.float32):
    """The ForCausalLM of a family or a variant (VARIANTS), in ``dtype``."""
    family, changes = VARIANTS.get(name, (name, {}))
    model_name, config_name, options = FAMILIES[family]
    config = getattr(transformers, config_name)(**(SMALL | options | changes))
    config._attn_implementation = "eager"
    config._experts_implementation = "eager"  # gpt-oss: grouped_mm has no float64
    model = getattr(transformers, model_name)(config).to(dtype).eval()
    return model


def randomize(model, family: str, generator: torch.Generator) -> None:
    """Attention weights of a useful size: kernels ~ N(0, 1/fan_in), biases ~ N(0, 0.3^2),
    norm scales 1 + N(0, 0.3^2) (Gemma's w ~ N(0, 0.3^2)), sinks ~ N(0, 1); and token
    embeddings ~ N(0, 1), so that a post-norm model's (OLMo 2's) attention input is of
    the size a pre-norm model's is."""
    with torch.no_grad():
        embed = model.model.embed_tokens.weight
        embed.copy_(torch.randn(embed.shape, generator=generator, dtype=torch.float64))
        for layer in model.model.layers:
            for name, p in layer.self_attn.named_parameters():
                noise = torch.randn(p.shape, generator=generator, dtype=torch.float64)
                if name.endswith("proj.weight"):
                    value = noise * p.shape[1] ** -0.5
                elif name.endswith("bias"):
                    value = 0.3 * noise
                elif "norm" in name:
                    value = 0.3 * noise + (0.0 if family in OFFSET_NORMS else 1.0)
                else:  # gpt-oss sinks
                    value = noise
                p.copy_(value.to(p.dtype))


def attention_state(model) -> dict[str, np.ndarray]:
    """The attention weights under their names in the ForCausalLM checkpoint."""
    return {
        name: p.detach().numpy().copy()
        for name, p in model.state_dict().items()
        if ".self_attn." in name
    }


class Recorder:
    """Hooks on each layer's attention: records its inputs and outputs; with
    ``replace``, swaps each call's input for the given one first."""

    def __init__(self, model, replace=None):
        self.inputs = {i: [] for i in range(len(model.model.layers))}
        self.outputs = {i: [] for i in range(len(model.model.layers))}
        self.replace = replace
        self.handles = []
        for i, layer in enumerate(model.model.layers):
            attn = layer.self_attn
            self.handles.append(attn.register_forward_pre_hook(self._pre(i), with_kwargs=True))
            self.handles.append(attn.register_forward_hook(self._post(i), with_kwargs=True))

    def _pre(self, i):
        def hook(module, args, kwargs):
            if self.replace is not None:
                given = self.replace[i][len(self.inputs[i])]
                kwargs["hidden_states"] = torch.as_tensor(
                    given, dtype=kwargs["hidden_states"].dtype
                )
            self.inputs[i].append(kwargs["hidden_states"].detach().numpy().copy())
            return args, kwargs

        return hook

    def _post(self, i):
        def hook(module, args, kwargs, output):
            self.outputs[i].append(output[0].detach().numpy().copy())

        return hook

    def close(self):
        for h in self.handles:
            h.remove()


def run(model, ids, replace_full=None, replace_decode=None):
    """(full inputs, full outputs, decode inputs, decode outputs), per layer."""
    with torch.no_grad():
        rec = Recorder(model, replace_full)
        model.model(input_ids=ids)
        rec.close()
        full = rec
        rec = Recorder(model, replace_decode)
        cache = transformers.DynamicCache(config=model.config)
        for start, stop in zip([0, *range(PROMPT, T)], [*range(PROMPT, T), T]):
            model.model(input_ids=ids[:, start:stop], cache=cache, use_cache=True)
        rec.close()
    return full, rec


def make(name: str, seed: int) -> dict[str, np.ndarray]:
    torch.manual_seed(seed)
    generator = torch.Generator().manual_seed(seed)
    model = build(name)
    family = VARIANTS.get(name, (name,))[0]
    randomize(model, family, generator)
    weights = attention_state(model)
    ids = torch.randint(0, VOCAB, (B, T), generator=generator)
    full, decode = run(model, ids)
    with float64_everywhere():
        model64 = build(name, torch.float64)
        model64.load_state_dict({k: v.double() for k, v in model.state_dict().items()}, strict=True)
        full64, decode64 = run(model64, ids, full.inputs, decode.inputs)
    arrays = {"config": np.array(json.dumps(model.config.to_dict(), default=str))}
    arrays |= weights
    for i in full.inputs:
        (x,), (y,), (y64,) = full.inputs[i], full.outputs[i], full64.outputs[i]
        arrays |= {f"x{i}": x, f"y{i}_f32": y, f"y{i}_f64": y64}
        arrays |= {
            f"dx{i}": np.concatenate(decode.inputs[i], axis=1),
            f"dy{i}_f32": np.concatenate(decode.outputs[i], axis=1),
            f"dy{i}_f64": np.concatenate(decode64.outputs[i], axis=1),
        }
        error = np.abs(arrays[f"y{i}_f32"] - arrays[f"y{i}_f64"]).max()
        assert 0 < error < 1e-4, (name, i, error)  # a float64 truth, and not a copy
        assert np.array_equal(full64.inputs[i][0], x.astype(np.float64))
    arrays["chunks"] = np.array([PROMPT] + [1] * (T - PROMPT))
    return arrays


# RoPE scalings whose frequency tables transformers computes (ROPE_INIT_FUNCTIONS), held
# against nanoattn's in tests/layers/test_rope_scaling.py: (name, head_dim, parameters,
# seq_len for dynamic).
ROPE_CASES = [
    ("linear", 12, dict(rope_type="linear", rope_theta=500.0, factor=4.0), None),
    ("linear_partial", 12, dict(rope_type="linear", rope_theta=500.0, factor=2.5,
                                partial_rotary_factor=0.5), None),
    ("llama3", 16, dict(rope_type="llama3", rope_theta=10000.0, factor=8.0, low_freq_factor=1.0,
                        high_freq_factor=4.0, original_max_position_embeddings=64), None),
    ("yarn", 16, dict(rope_type="yarn", rope_theta=10000.0, factor=16.0,
                      original_max_position_embeddings=128), None),
    ("yarn_untruncated_betas", 16, dict(rope_type="yarn", rope_theta=150000.0, factor=32.0,
                                        beta_fast=16.0, beta_slow=2.0, truncate=False,
                                        original_max_position_embeddings=256), None),
    ("yarn_mscale", 16, dict(rope_type="yarn", rope_theta=10000.0, factor=40.0, mscale=1.0,
                             mscale_all_dim=0.707, original_max_position_embeddings=64), None),
    ("yarn_attention_factor", 10, dict(rope_type="yarn", rope_theta=1000.0, factor=4.0,
                                       attention_factor=1.25,
                                       original_max_position_embeddings=32), None),
    ("dynamic_short", 12, dict(rope_type="dynamic", rope_theta=10000.0, factor=2.0), 100),
    ("dynamic_long", 12, dict(rope_type="dynamic", rope_theta=10000.0, factor=2.0), 1000),
]  # fmt: skip
ROPE_MAX_POSITIONS = 256  # max_position_embeddings of the other RoPE cases (dynamic's length)


def rope_fixtures() -> dict[str, np.ndarray]:
    arrays, cases = {}, []
    with float64_everywhere():
        for name, head_dim, parameters, seq_len in ROPE_CASES:
            longest = ROPE_MAX_POSITIONS
            if parameters["rope_type"] == "yarn":  # the context yarn extends to
                longest = int(parameters["factor"] * parameters["original_max_position_embeddings"])
            config = transformers.LlamaConfig(
                hidden_size=4 * head_dim, num_attention_heads=4, head_dim=head_dim,
                max_position_embeddings=longest, rope_parameters=dict(parameters),
            )  # fmt: skip
            init = ROPE_INIT_FUNCTIONS[parameters["rope_type"]]
            inv_freq, factor = init(config, "cpu", seq_len=seq_len)
            assert inv_freq.dtype == torch.float64
            arrays[f"{name}.inv_freq"] = inv_freq.numpy()
            arrays[f"{name}.attention_factor"] = np.float64(factor)
            cases.append(dict(name=name, head_dim=head_dim, parameters=parameters,
                              seq_len=seq_len, max_position_embeddings=longest))  # fmt: skip
    arrays["cases"] = np.array(json.dumps(cases))
    return arrays


def main(names: list[str]) -> None:
    """Writes the fixtures named (families, variants, ``rope``), or all of them."""
    every = [*FAMILIES, *VARIANTS, "rope"]
    unknown = sorted(set(names) - set(every))
    if unknown:
        raise SystemExit(f"no fixture {unknown[0]!r}; the fixtures: {', '.join(every)}")
    OUT.mkdir(parents=True, exist_ok=True)
    print(f"transformers {transformers.__version__}, torch {torch.__version__}")
    for seed, name in enumerate([*FAMILIES, *VARIANTS]):  # each fixture's seed is its place
        if names and name not in names:
            continue
        arrays = make(name, seed)
        path = OUT / f"{name}.npz"
        np.savez_compressed(path, **arrays)
        error = max(
            np.abs(arrays[f"y{i}_f32"] - arrays[f"y{i}_f64"]).max()
            for i in range(sum(k.startswith("x") and k[1:].isdigit() for k in arrays))
        )
        size = path.stat().st_size / 1024
        print(f"{name:8s} {size:5.1f} KiB  transformers' float32 error {error:.2e}")
    if not names or "rope" in names:
        np.savez_compressed(OUT / "rope.npz", **rope_fixtures())
        print(f"rope     {(OUT / 'rope.npz').stat().st_size / 1024:5.1f} KiB")


if __name__ == "__main__":
    main(sys.argv[1:])
