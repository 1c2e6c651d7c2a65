"""One attention layer of a DeepSeek-V2/V3/V3.2 checkpoint (transformers'
``DeepseekV3Attention``, also Kimi K2's, and ``DeepseekV32Attention`` with its indexer)
as ``nanoattn.linen.LatentAttention``'s config and parameters
(docs/latent.md).

The state dict's names (transformers', relative to ``model.layers.{i}.self_attn.``):
``q_proj`` (no low-rank query) or ``q_a_proj``, ``q_a_layernorm``, ``q_b_proj``;
``kv_a_proj_with_mqa``, ``kv_a_layernorm``, ``kv_b_proj``, ``o_proj``; weights (out, in)
as torch stores them, so each kernel is the transpose. DeepSeek-V3.2 (``index_topk`` in
the config) adds ``indexer.wq_b``, ``indexer.wk``, ``indexer.k_norm`` (weight and bias)
and ``indexer.weights_proj``. ``rope_interleave`` (default True)
is ``rope_layout="interleaved"``: transformers regroups the rope features (2i, 2i + 1)
into halves before rotating queries and keys alike, which leaves every score equal to
the interleaved rotation's.

Axis letters: D model width, N heads, r ``kv_lora_rank``, rq ``q_lora_rank``, Hn, Hr,
Hv the nope, rope and value widths.
"""

from collections.abc import Mapping

import numpy as np

from .._layers.latent_config import LatentConfig
from .transformers import PREFIXES, _check_layer, _dtype, _get, _rope

# The linen parameters' names of transformers' tensors (without ".weight"/".bias").
_NAMES = {
    "q_proj": "q", "q_a_proj": "q_a", "q_b_proj": "q_b", "kv_a_proj_with_mqa": "kv_a",
    "kv_b_proj": "kv_b", "o_proj": "out",
}  # fmt: skip
_NORMS = {"q_a_layernorm": "q_a_norm", "kv_a_layernorm": "kv_a_norm"}
# DeepSeek-V3.2's indexer (under ``indexer.``): its projections and its key's LayerNorm.
_INDEXER = {"indexer.wq_b": "index_q", "indexer.wk": "index_k",
            "indexer.weights_proj": "index_weights"}  # fmt: skip
_BIASED = ("q_a", "kv_a", "out")  # transformers' attention_bias: these projections only


def _size(config: Mapping, key: str) -> int:
    if config.get(key) is None:
        raise ValueError(
            f"config has no {key} (an int >= 1): is it a DeepSeek-V2/V3 configuration?"
        )
    return _get(config, key, "an int >= 1")


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
        "q_lora_rank": _get(config, "q_lora_rank", "an int >= 1", None),  # None: one q_proj
    }
    if config.get("index_topk") is not None:  # DeepSeek-V3.2: its indexer
        sizes |= {name: _size(config, name)
                  for name in ("index_n_heads", "index_head_dim", "index_topk")}  # fmt: skip
    rope = _rope("deepseek_v3", config, "full_attention", sizes["qk_rope_head_dim"])
    if "rotary_dim" in rope:
        raise ValueError(
            "config partial_rotary_factor is not DeepSeek's: its rope part rotates whole"
        )
    # transformers' default where the key is absent (DeepSeek-V3's own config.json): True
    interleave = "rope_interleave" not in config or _get(config, "rope_interleave", "True or False")
    return LatentConfig(
        **sizes, **rope, rope_layout="interleaved" if interleave else "half",
        norm_eps=1e-6,  # transformers: the default of its RMSNorm, not rms_norm_eps
        attention_bias=_get(config, "attention_bias", "True or False", False), param_dtype=dtype,
    )  # fmt: skip


def from_deepseek(config: Mapping, state_dict: Mapping, layer: int = 0):
    """The :class:`LatentConfig` and linen params of decoder layer ``layer``'s attention.

    Args:
      config: the model's configuration dict (``model_type`` deepseek_v2, deepseek_v3,
        deepseek_v32 (with ``index_n_heads``, ``index_head_dim``, ``index_topk``),
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
      TypeError: a config, state_dict or layer of another type.
      ValueError: in one line naming the key or the tensor: a configuration key that is
        missing or not what it must be (the sizes ints >= 1, ``rope_interleave`` and
        ``attention_bias`` True or False, the RoPE's as for ``from_transformers``); a
        missing tensor or one of another shape than the config gives; a tensor under the
        layer's prefix that the layer does not use; tensors of mixed dtypes, or float64
        without ``jax_enable_x64`` (cast to float32 first), as ``from_transformers``.

    Example:
      >>> import numpy as np
      >>> cfg = dict(hidden_size=8, num_attention_heads=2, kv_lora_rank=4, q_lora_rank=None,
      ...            qk_nope_head_dim=3, qk_rope_head_dim=2, v_head_dim=3, rope_theta=1e4)
      >>> shapes = {"q_proj": (10, 8), "kv_a_proj_with_mqa": (6, 8), "kv_b_proj": (12, 4),
      ...           "o_proj": (8, 6)}
      >>> state = {f"{name}.weight": np.ones(shape, np.float32) for name, shape in shapes.items()}
      >>> state["kv_a_layernorm.weight"] = np.ones(4, np.float32)
      >>> latent, params = from_deepseek(cfg, state)
      >>> latent.cache_width, params["kv_b"]["kernel"].shape
      (6, (4, 12))
    """
    cfg = deepseek_config(config)
    layer = _layer(config, layer)
    if not isinstance(state_dict, Mapping):
        raise TypeError(
            f"state_dict must be a mapping from names to arrays, got {type(state_dict).__name__}"
        )
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
    if cfg.indexed:
        Hi, Hd = cfg.index_n_heads, cfg.index_head_dim
        shapes |= {"indexer.wq_b": (Hi * Hd, cfg.q_lora_rank), "indexer.wk": (Hd, D),
                   "indexer.weights_proj": (Hi, D), "indexer.k_norm": (Hd,)}  # fmt: skip
    expected = {f"{prefix}{name}.weight": shape for name, shape in shapes.items()}
    if cfg.indexed:
        expected[f"{prefix}indexer.k_norm.bias"] = (cfg.index_head_dim,)
    if cfg.attention_bias:
        expected |= {f"{prefix}{name}.bias": shape[:1] for name, shape in shapes.items()
                     if _NAMES.get(name) in _BIASED}  # fmt: skip
    unknown = sorted(key for key in state_dict if key.startswith(prefix) and key not in expected)
    if unknown:
        bias = "with" if cfg.attention_bias else "without"
        raise ValueError(
            f"state_dict has {unknown[0]}, which a DeepSeek attention layer {bias} "
            f"attention_bias does not use"
        )
    arrays = {key: _tensor(state_dict, key, shape) for key, shape in expected.items()}
    dtype = _dtype(arrays)
    params = {}
    for name in shapes:
        weight = arrays[f"{prefix}{name}.weight"]
        if name in _NORMS:
            params[_NORMS[name]] = {"scale": weight}
            continue
        if name == "indexer.k_norm":
            params["index_k_norm"] = {"scale": weight, "bias": arrays[f"{prefix}{name}.bias"]}
            continue
        params[(_NAMES | _INDEXER)[name]] = {"kernel": np.ascontiguousarray(weight.T)}
        if f"{prefix}{name}.bias" in arrays:
            params[_NAMES[name]]["bias"] = arrays[f"{prefix}{name}.bias"]
    if dtype != cfg.param_dtype:
        cfg = deepseek_config(config, dtype)
    return cfg, params


def _layer(config: Mapping, layer) -> int:
    """``layer`` as an int in [0, num_hidden_layers) (>= 0 where the config has no
    num_hidden_layers), or a one-line error."""
    if config.get("num_hidden_layers") is not None:
        return _check_layer(config, layer)
    if isinstance(layer, bool) or not isinstance(layer, (int, np.integer)):
        raise TypeError(f"layer must be an int, got layer={layer!r}")
    if layer < 0:
        raise ValueError(f"layer must be >= 0, got layer={layer}")
    return int(layer)


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
