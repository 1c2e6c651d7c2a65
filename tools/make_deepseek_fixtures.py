"""Builds the fixtures of tests/interop/test_deepseek.py from transformers itself.

Run from the repository root with a Python that has torch and transformers (never
dependencies of nanoattn or of its tests, which read only the .npz files):

    /path/to/venv-with-torch/bin/python tools/make_deepseek_fixtures.py [CASE ...]

For each case it builds transformers' ``DeepseekV3Attention`` (layer 0) with a small
random configuration, gives every weight random values of a useful size (the RMSNorm
scales too, so a forgotten norm shows), and runs it with the eager attention, causal,
on B x T random inputs at positions 0 .. T - 1: in float32 (``y_f32``) and, on the
same inputs, in float64 (``y_f64``, every float32 transformers asks for made float64,
the rotary table included, as tools/make_model_fixtures.py does: the truth). It writes
tests/fixtures/models/deepseek_<case>.npz: ``config`` (``config.to_dict()`` as JSON,
or as the case writes it), the weights under the checkpoint's names
(``model.layers.0.self_attn.*``, float32), ``x``, ``y_f32`` and ``y_f64``.

    /path/to/venv-with-torch/bin/python tools/make_deepseek_fixtures.py v3_config_json

makes only the cases named. Cases: ``v3`` (a low-rank query, YaRN with DeepSeek's mscale,
interleaved rope), ``v32`` (DeepSeek-V3.2: V3's attention with the
indexer of DeepSeek Sparse Attention, each query's top 5 keys; the float64 run's choices
saved as ``selected`` (B, T, 5)), ``v2_lite`` (one query projection, plain RoPE, the half layout,
biases) and ``v3_config_json``, whose configuration is written as DeepSeek-V3's own
config.json is (``rope_theta`` and ``rope_scaling`` with ``type`` at the top, and no
``rope_interleave``: transformers reads it with its default, True). transformers runs
each case from the configuration the fixture holds.
"""

import contextlib
import json
import pathlib
import sys

import numpy as np
import torch
import transformers
from make_model_fixtures import float64_everywhere  # tools/, the script's folder
from transformers.models.deepseek_v3 import modeling_deepseek_v3 as deepseek
from transformers.models.deepseek_v32 import modeling_deepseek_v32 as deepseek_v32

OUT = pathlib.Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "models"
B, T = 2, 11
SIZES = dict(hidden_size=29, num_attention_heads=3, num_key_value_heads=3, kv_lora_rank=13,
             qk_nope_head_dim=7, qk_rope_head_dim=4, v_head_dim=5, num_hidden_layers=1,
             vocab_size=40, intermediate_size=16, moe_intermediate_size=8, n_routed_experts=4,
             num_experts_per_tok=2, n_group=1, topk_group=1, first_k_dense_replace=1,
             max_position_embeddings=32, rms_norm_eps=1e-6)  # fmt: skip
CASES = {
    "v3": dict(q_lora_rank=17, rope_interleave=True, rope_parameters=dict(
        rope_type="yarn", rope_theta=100.0, factor=8.0, original_max_position_embeddings=4,
        beta_fast=32.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0)),
    "v2_lite": dict(q_lora_rank=None, rope_interleave=False, attention_bias=True,
                    rope_parameters=dict(rope_type="default", rope_theta=50.0)),
    "v3_config_json": dict(q_lora_rank=11, rope_parameters=dict(
        rope_type="yarn", rope_theta=200.0, factor=4.0, original_max_position_embeddings=8,
        beta_fast=16.0, beta_slow=2.0, mscale=1.0, mscale_all_dim=0.8)),
    "v32": dict(q_lora_rank=17, index_n_heads=8, index_head_dim=6, index_topk=5,
                rope_parameters=dict(rope_type="default", rope_theta=100.0)),
}  # fmt: skip
# DeepSeek-V3.2's cases: its attention with the indexer (DeepSeek Sparse Attention).
V32 = ("v32",)
# The cases written in the form of DeepSeek-V3's config.json (no rope_interleave).
CONFIG_JSON = ("v3_config_json",)


def saved_config(name: str, config) -> dict:
    """The configuration the fixture holds: ``config.to_dict()``, or for the cases of
    CONFIG_JSON the form of DeepSeek-V3's config.json."""
    saved = json.loads(config.to_json_string())
    if name in CONFIG_JSON:
        rope = saved.pop("rope_parameters")
        saved |= dict(rope_theta=rope.pop("rope_theta"), rope_scaling=dict(
            type=rope.pop("rope_type"), **rope))  # fmt: skip
        del saved["rope_interleave"]
        assert read(saved).rope_interleave is True
    return saved


def read(saved: dict):
    """transformers' configuration from the fixture's (a copy: transformers changes the
    dicts it is given)."""
    kind = (
        transformers.DeepseekV32Config if "index_topk" in saved else transformers.DeepseekV3Config
    )
    return kind(**json.loads(json.dumps(saved)))


def classes(config):
    """The attention and rotary classes of ``config``'s model (V3, or V3.2 with its
    indexer)."""
    module = deepseek_v32 if isinstance(config, transformers.DeepseekV32Config) else deepseek
    prefix = "DeepseekV32" if module is deepseek_v32 else "DeepseekV3"
    return getattr(module, f"{prefix}Attention"), getattr(module, f"{prefix}RotaryEmbedding")


def run(saved: dict, state, x, dtype):
    """The attention's output for x (B, T, D) in ``dtype`` (float32 or float64), with
    the configuration as the fixture holds it. In float64 every float32 that
    transformers asks for is float64 too (the rotary table's inverse frequencies and
    angles, the RMSNorm), so the truth is transformers' own code in float64."""
    wide = dtype == torch.float64
    with float64_everywhere() if wide else contextlib.nullcontext():
        config = read(saved)
        config._attn_implementation = "eager"
        attention_class, rotary_class = classes(config)
        attention = attention_class(config, layer_idx=0).to(dtype)
        attention.load_state_dict({k: torch.tensor(v, dtype=dtype) for k, v in state.items()})
        rotary = rotary_class(config).to(dtype)
        positions = torch.arange(T)[None].repeat(B, 1)
        xs = torch.tensor(x, dtype=dtype)
        with torch.autocast("cpu", enabled=False):
            cos, sin = rotary(xs, positions)
        assert cos.dtype == dtype and rotary.inv_freq.dtype == dtype
        causal = torch.full((T, T), float("-inf"), dtype=dtype).triu(1)[None, None]
        selected = []
        if hasattr(attention, "indexer"):  # V3.2: keep the indexer's choices
            attention.indexer.register_forward_hook(lambda m, args, out: selected.append(out))
        with torch.no_grad():
            y, _ = attention(xs, (cos, sin), causal.repeat(B, 1, 1, 1))
    y = y.numpy().astype(np.float64 if wide else np.float32)
    return (y, selected[0].numpy()) if selected else y


def main(names: list[str]) -> None:
    unknown = sorted(set(names) - set(CASES))
    if unknown:
        raise SystemExit(f"no case {unknown[0]!r}; the cases: {', '.join(CASES)}")
    OUT.mkdir(parents=True, exist_ok=True)
    for name, options in CASES.items():
        if names and name not in names:
            continue
        torch.manual_seed(0)
        kind = transformers.DeepseekV32Config if name in V32 else transformers.DeepseekV3Config
        config = kind(**SIZES, **options)
        config._attn_implementation = "eager"
        attention = classes(config)[0](config, layer_idx=0)
        rng = np.random.default_rng(1)
        state = {}
        for key, tensor in attention.state_dict().items():
            if "layernorm" in key or "k_norm" in key:
                value = 1.0 + 0.3 * rng.standard_normal(tuple(tensor.shape))
            else:
                value = rng.standard_normal(tuple(tensor.shape)) / np.sqrt(tensor.shape[-1])
            state[key] = value.astype(np.float32)
        x = rng.standard_normal((B, T, SIZES["hidden_size"])).astype(np.float32)
        saved = saved_config(name, config)
        arrays = {f"model.layers.0.self_attn.{k}": v for k, v in state.items()}
        y_f32, y_f64 = (run(saved, state, x, dtype) for dtype in (torch.float32, torch.float64))
        if name in V32:  # (y, the indexer's top-k (B, T, k)): the float64 run's choices
            (y_f32, _), (y_f64, selected) = y_f32, y_f64
            arrays["selected"] = selected.astype(np.int32)
        arrays |= dict(config=np.array(json.dumps(saved)), x=x, y_f32=y_f32, y_f64=y_f64)
        path = OUT / f"deepseek_{name}.npz"
        np.savez_compressed(path, **arrays)
        print(path, {k: v.shape for k, v in arrays.items() if k != "config"})


if __name__ == "__main__":
    main(sys.argv[1:])
