"""One attention layer of a DeepSeek-V2/V3 checkpoint (transformers' ``DeepseekV3Attention``,
also Kimi K2's) as ``nanoattn.linen.LatentAttention``'s config and parameters
(docs/latent.md).

The state dict's names (transformers', relative to ``model.layers.{i}.self_attn.``):
``q_proj`` (no low-rank query) or ``q_a_proj``, ``q_a_layernorm``, ``q_b_proj``;
``kv_a_proj_with_mqa``, ``kv_a_layernorm``, ``kv_b_proj``, ``o_proj``; weights (out, in)
as torch stores them, so each kernel is the transpose. ``rope_interleave`` (default True)
is ``rope_layout="interleaved"``: transformers regroups the rope features (2i, 2i + 1)
into halves before rotating queries and keys alike, which leaves every score equal to
the interleaved rotation's.

Axis letters: D model width, N heads, r ``kv_lora_rank``, rq ``q_lora_rank``, Hn, Hr,
Hv the nope, rope and value widths.
"""

from collections.abc import Mapping

import numpy as np

from .._layers.latent_config import LatentConfig
from .transformers import PREFIXES, _rope

# The linen parameters' names of transformers' tensors (without ".weight"/".bias").
_NAMES = {
    "q_proj": "q", "q_a_proj": "q_a", "q_b_proj": "q_b", "kv_a_proj_with_mqa": "kv_a",
    "kv_b_proj": "kv_b", "o_proj": "out",
}  # fmt: skip
_NORMS = {"q_a_layernorm": "q_a_norm", "kv_a_layernorm": "kv_a_norm"}


def _size(config: Mapping, key: str, default=None):
    value = config.get(key, default)
    if value is None and default is None and key != "q_lora_rank":
        raise ValueError(f"config has no {key!r}: is it a DeepSeek-V2/V3 configuration?")
    return None if value is None else int(value)


def deepseek_config(config: Mapping, dtype=np.float32) -> LatentConfig:
    """The :class:`LatentConfig` of a DeepSeek-V2/V3 configuration dict
    (``model.config.to_dict()`` or ``config.json``)."""
    if not isinstance(config, Mapping):
        raise TypeError(f"config must be a dict, got {type(config).__name__}")
    sizes = {
        "d_model": _size(config, "hidden_size"),
        "n_heads": _size(config, "num_attention_heads"),
        "kv_lora_rank": _size(config, "kv_lora_rank"),
        "qk_nope_head_dim": _size(config, "qk_nope_head_dim"),
        "qk_rope_head_dim": _size(config, "qk_rope_head_dim"),
        "v_head_dim": _size(config, "v_head_dim"),
        "q_lora_rank": _size(config, "q_lora_rank"),
    }
    rope = _rope("deepseek_v3", config, "full_attention", sizes["qk_rope_head_dim"])
    if "rotary_dim" in rope:
        raise ValueError("a partial rotary factor is not DeepSeek's: the rope part rotates whole")
    layout = "interleaved" if config.get("rope_interleave", True) else "half"
    return LatentConfig(
        **sizes, **rope, rope_layout=layout,
        norm_eps=1e-6,  # transformers: the default of its RMSNorm, not rms_norm_eps
        attention_bias=bool(config.get("attention_bias", False)), param_dtype=dtype,
    )  # fmt: skip


def from_deepseek(config: Mapping, state_dict: Mapping, layer: int = 0):
    """The :class:`LatentConfig` and linen params of decoder layer ``layer``'s attention.

    Args:
      config: the model's configuration dict (``model_type`` deepseek_v2, deepseek_v3,
        kimi_k2 ...: the keys ``hidden_size``, ``num_attention_heads``,
        ``kv_lora_rank``, ``q_lora_rank``, ``qk_nope_head_dim``, ``qk_rope_head_dim``,
        ``v_head_dim``, the RoPE's, ``rms_norm_eps``, ``attention_bias``,
        ``rope_interleave``).
      state_dict: checkpoint names to numpy arrays: ``model.layers.{layer}.self_attn.*``
        (or without ``model.``), or the attention module's own names (``q_a_proj.weight``).
      layer: the decoder layer.

    Returns:
      ``(config, params)``: ``LatentAttention(config).apply({"params": params}, x)``.

    Raises:
      ValueError: a missing key or tensor, or a tensor of another shape than the
        config gives.

    Example:
      >>> import numpy as np
      >>> cfg = dict(hidden_size=8, num_attention_heads=2, kv_lora_rank=4, q_lora_rank=None,
      ...            qk_nope_head_dim=3, qk_rope_head_dim=2, v_head_dim=3, rope_theta=1e4)
      >>> shapes = {"q_proj": (10, 8), "kv_a_proj_with_mqa": (6, 8), "kv_b_proj": (12, 4),
      ...           "o_proj": (8, 6)}
      >>> state = {f"{name}.weight": np.ones(shape) for name, shape in shapes.items()}
      >>> state["kv_a_layernorm.weight"] = np.ones(4)
      >>> latent, params = from_deepseek(cfg, state)
      >>> latent.cache_width, params["kv_b"]["kernel"].shape
      (6, (4, 12))
    """
    cfg = deepseek_config(config)
    prefix = _prefix(state_dict, layer)
    N, r, D = cfg.n_heads, cfg.kv_lora_rank, cfg.d_model
    shapes = {
        "kv_a_proj_with_mqa": (cfg.cache_width, D),
        "kv_b_proj": (N * (cfg.qk_nope_head_dim + cfg.v_head_dim), r),
        "o_proj": (D, N * cfg.v_head_dim),
        "kv_a_layernorm": (r,),
    }
    if cfg.q_lora_rank is None:
        shapes["q_proj"] = (N * cfg.qk_head_dim, D)
    else:
        rq = cfg.q_lora_rank
        shapes |= {"q_a_proj": (rq, D), "q_b_proj": (N * cfg.qk_head_dim, rq),
                   "q_a_layernorm": (rq,)}  # fmt: skip
    params, dtype = {}, None
    for name, shape in shapes.items():
        weight = _tensor(state_dict, prefix + name + ".weight", shape)
        dtype = dtype or weight.dtype
        if name in _NORMS:
            params[_NORMS[name]] = {"scale": weight}
            continue
        params[_NAMES[name]] = {"kernel": np.ascontiguousarray(weight.T)}
        bias = prefix + name + ".bias"
        if cfg.attention_bias and _NAMES[name] in ("q_a", "kv_a", "out"):
            params[_NAMES[name]]["bias"] = _tensor(state_dict, bias, shape[:1])
    if dtype != np.float32:
        cfg = deepseek_config(config, dtype)
    return cfg, params


def _prefix(state_dict: Mapping, layer: int) -> str:
    for prefix in (*(p.format(i=layer) for p in PREFIXES), ""):
        if prefix + "kv_a_proj_with_mqa.weight" in state_dict:
            return prefix
    raise ValueError(
        f"state_dict has no {PREFIXES[0].format(i=layer)}kv_a_proj_with_mqa.weight (nor "
        "without the 'model.' prefix, nor the module's own name): is it a DeepSeek checkpoint?"
    )


def _tensor(state_dict: Mapping, name: str, shape: tuple[int, ...]) -> np.ndarray:
    if name not in state_dict:
        raise ValueError(f"state_dict has no {name}")
    array = np.asarray(state_dict[name])
    if array.shape != shape:
        raise ValueError(f"state_dict {name} has shape {array.shape}; the config gives {shape}")
    return array
