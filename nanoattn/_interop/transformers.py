"""One attention layer of a transformers checkpoint as nanoattn's layer, and back.

:func:`from_transformers` reads a model's configuration (``model.config.to_dict()``,
or the checkpoint's ``config.json`` in the older format with ``rope_theta`` and
``rope_scaling``) and the state dict of its ``...ForCausalLM`` (numpy arrays, as
``safetensors.numpy.load_file`` gives them; no torch needed) and returns the
``AttentionConfig`` of decoder layer ``layer`` and its linen ``params``:

* sizes: D ``hidden_size``, N ``num_attention_heads``, K ``num_key_value_heads``, H
  ``head_dim`` (or D / N); the fused ``qkv`` kernel is ``[Wq^T | Wk^T | Wv^T]`` (Phi-3's
  ``qkv_proj`` already is), ``out`` is ``Wo^T``, biases as the checkpoint has them;
* the layer's type (``layer_types``, or the family's older rule): a sliding layer of
  window W (transformers' ``sliding_window``: the query and the W - 1 keys before it)
  is nanoattn's ``window=(W - 1, 0)``;
* RoPE per layer type: ``rope_theta`` is ``rope_base``, a scaled RoPE
  (``linear``, ``llama3``, ``yarn``, ``dynamic``) is ``rope_scaling``,
  ``partial_rotary_factor`` is ``rotary_dim``;
* Gemma's ``query_pre_attn_scalar ** -0.5`` is ``scale``, its
  ``attn_logit_softcapping`` ``logit_soft_cap``, its ``1 + w`` norms
  ``qk_norm_offset=1.0``; Qwen3's and Gemma 3's per-head q/k norms are
  ``qk_norm="head"``, OLMo 2's whole-projection norms ``"projection"``, each with
  the model's ``rms_norm_eps``; gpt-oss's ``sinks`` are ``sinks``.

:func:`to_transformers` is the inverse: the state dict entries of the layer from
(fine-tuned) params, bit for bit the arrays :func:`from_transformers` read.

Axis letters (docs/conventions.md): D model width, N query heads, K key/value heads,
H head width.
"""

from collections.abc import Mapping

import numpy as np

from .._layers.config import AttentionConfig

FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3", "gpt_oss", "olmo2", "phi3")
# Where a ForCausalLM checkpoint keeps decoder layer i's attention, and the same without
# the "model." prefix (and Gemma 3's multimodal checkpoints, whose text model is nested).
PREFIXES = (
    "model.layers.{i}.self_attn.",
    "layers.{i}.self_attn.",
    "model.language_model.layers.{i}.self_attn.",
    "language_model.model.layers.{i}.self_attn.",
)
# What each family's attention holds besides the projections.
_QK_NORM = {"qwen3": "head", "gemma3": "head", "olmo2": "projection"}
_OFFSET_NORMS = ("gemma3",)  # x * (1 + w), w stored
_QUERY_SCALAR = ("gemma2", "gemma3")  # scale = query_pre_attn_scalar ** -0.5
_SINKS = ("gpt_oss",)
_FUSED_QKV = ("phi3",)
# Families whose sliding window, when set, applies to every layer.
_WINDOW_EVERYWHERE = ("mistral", "phi3")
_ROPE_KEYS = {
    "linear": ("factor",),
    "dynamic": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "yarn": (
        "factor",
        "original_max_position_embeddings",
        "beta_fast",
        "beta_slow",
        "mscale",
        "mscale_all_dim",
        "attention_factor",
        "truncate",
    ),
}


def _family(config: Mapping) -> tuple[str, Mapping]:
    """(family, the text model's configuration) of a transformers configuration dict."""
    if not isinstance(config, Mapping):
        raise TypeError(
            f"config must be the model's configuration as a dict (model.config.to_dict() or "
            f"config.json), got {type(config).__name__}"
        )
    kind = config.get("model_type")
    if kind == "gemma3" and isinstance(config.get("text_config"), Mapping):
        return "gemma3", config["text_config"]
    kind = {"gemma3_text": "gemma3"}.get(kind, kind)
    if kind not in FAMILIES:
        raise ValueError(
            f"config model_type {config.get('model_type')!r} is not supported; supported: "
            f"{', '.join(FAMILIES)}"
        )
    return kind, config


def _int(config: Mapping, key: str, default=None) -> int:
    value = config.get(key, default)
    if value is None and default is not None:
        value = default
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"config {key} must be an int >= 1, got {value!r}")
    return int(value)


def _sizes(config: Mapping) -> tuple[int, int, int, int]:
    D = _int(config, "hidden_size")
    N = _int(config, "num_attention_heads")
    K = _int(config, "num_key_value_heads", N)
    H = config.get("head_dim")
    H = _int(config, "head_dim") if H is not None else D // N
    return D, N, K, H


def _layer_type(family: str, config: Mapping, layer: int) -> str:
    """``"sliding_attention"`` or ``"full_attention"`` of decoder layer ``layer``."""
    types = config.get("layer_types")
    if types is not None:
        return types[layer]
    window = config.get("sliding_window")
    if family in _WINDOW_EVERYWHERE:
        return "full_attention" if window is None else "sliding_attention"
    if family in ("qwen2", "qwen3"):  # transformers' rule before layer_types
        sliding = config.get("use_sliding_window") and window is not None
        sliding = sliding and layer >= config.get("max_window_layers", 0)
        return "sliding_attention" if sliding else "full_attention"
    if family == "gemma3":
        pattern = config.get("sliding_window_pattern", config.get("_sliding_window_pattern", 6))
        return "full_attention" if (layer + 1) % pattern == 0 else "sliding_attention"
    if family in ("gemma2", "gpt_oss"):
        return "full_attention" if layer % 2 else "sliding_attention"
    return "full_attention"


def _window(config: Mapping, layer_type: str):
    """transformers' ``sliding_window=W`` (each query sees itself and the W - 1 keys
    before it) as nanoattn's ``window=(W - 1, 0)``, on sliding layers."""
    if layer_type != "sliding_attention":
        return None
    W = _int(config, "sliding_window")
    return (W - 1, 0)


def _rope_parameters(family: str, config: Mapping, layer_type: str) -> dict:
    """The RoPE parameters of a layer type, in transformers' current form
    (``rope_type``, ``rope_theta``, ...), from either form of the configuration."""
    params = config.get("rope_parameters")
    if params is not None:
        if layer_type in params and isinstance(params[layer_type], Mapping):  # per layer type
            params = params[layer_type]
        params = dict(params)
    else:  # config.json before transformers 5: rope_theta and rope_scaling
        params = dict(config.get("rope_scaling") or {})
        params["rope_theta"] = config.get("rope_theta", 10000.0)
        if family == "gemma3" and layer_type == "sliding_attention":
            params = {"rope_theta": config.get("rope_local_base_freq", 10000.0)}
        if config.get("partial_rotary_factor") is not None:
            params["partial_rotary_factor"] = config["partial_rotary_factor"]
    params["rope_type"] = params.get("rope_type", params.get("type", "default"))
    return params


def _rope(family: str, config: Mapping, layer_type: str, head_dim: int) -> dict:
    """The layer's RoPE as AttentionConfig options."""
    params = _rope_parameters(family, config, layer_type)
    kind = params["rope_type"]
    options = {"rope_base": float(params.get("rope_theta", 10000.0))}
    partial = params.get("partial_rotary_factor")
    if partial is not None and int(head_dim * partial) != head_dim:
        options["rotary_dim"] = int(head_dim * partial)
    if kind == "default":
        return options
    if kind not in _ROPE_KEYS:
        raise ValueError(
            f"config rope_type {kind!r} is not supported; supported: default, "
            f"{', '.join(_ROPE_KEYS)}"
        )
    scaling = {"rope_type": kind}
    scaling |= {key: params[key] for key in _ROPE_KEYS[kind] if params.get(key) is not None}
    longest = config.get("max_position_embeddings")
    if kind == "dynamic":  # transformers grows the base past max_position_embeddings
        scaling["original_max_position_embeddings"] = longest
    elif kind in ("llama3", "yarn") and "original_max_position_embeddings" not in scaling:
        scaling["original_max_position_embeddings"] = config.get(
            "original_max_position_embeddings", longest
        )
    if kind == "yarn":
        if scaling.get("factor") is None:  # transformers: the extension ratio
            scaling["factor"] = longest / scaling["original_max_position_embeddings"]
        top = config.get("rope_parameters") or config.get("rope_scaling") or {}
        if "truncate" in top:  # transformers reads yarn's truncate at the top level
            scaling["truncate"] = top["truncate"]
    options["rope_scaling"] = scaling
    return options


def _prefix(state_dict: Mapping, layer: int, first: str) -> str:
    for prefix in PREFIXES:
        if prefix.format(i=layer) + first in state_dict:
            return prefix.format(i=layer)
    raise ValueError(
        f"state_dict has no {PREFIXES[0].format(i=layer)}{first} (nor without the 'model.' "
        f"prefix): is it this model's checkpoint, and does it have layer {layer}?"
    )


def _expect(name: str, array, shape: tuple[int, ...]) -> np.ndarray:
    array = np.asarray(array)
    if array.shape != shape:
        raise ValueError(f"state_dict {name} has shape {array.shape}; the config gives {shape}")
    return array


def _check_layer(config: Mapping, layer) -> int:
    layers = _int(config, "num_hidden_layers")
    if isinstance(layer, bool) or not isinstance(layer, (int, np.integer)):
        raise TypeError(f"layer must be an int, got layer={layer!r}")
    if not 0 <= layer < layers:
        raise ValueError(f"layer must be in [0, {layers}) (num_hidden_layers), got layer={layer}")
    return int(layer)


def _attention_config(family: str, config: Mapping, layer: int, dtype, biases) -> AttentionConfig:
    D, N, K, H = _sizes(config)
    layer_type = _layer_type(family, config, layer)
    if family in _QUERY_SCALAR and config.get("use_bidirectional_attention"):
        raise ValueError("config use_bidirectional_attention=True is not causal attention")
    options = dict(
        d_model=D,
        n_heads=N,
        n_kv_heads=None if K == N else K,
        head_dim=H,
        dropout=float(config.get("attention_dropout") or 0.0),
        window=_window(config, layer_type),
        param_dtype=dtype,
        sinks=family in _SINKS,
        use_bias=biases[0],
        **_rope(family, config, layer_type, H),
    )
    if biases[1] != biases[0]:  # Qwen2: q, k, v biases, none on the output
        options["out_bias"] = biases[1]
    if family in _QUERY_SCALAR:
        options["scale"] = float(config["query_pre_attn_scalar"]) ** -0.5
        if config.get("attn_logit_softcapping") is not None:
            options["logit_soft_cap"] = float(config["attn_logit_softcapping"])
    if family in _QK_NORM:
        options |= dict(qk_norm=_QK_NORM[family], qk_norm_eps=float(config["rms_norm_eps"]))
        if family in _OFFSET_NORMS:
            options["qk_norm_offset"] = 1.0
    return AttentionConfig(**options)


def _names(family: str) -> dict[str, str]:
    """The checkpoint's names of the layer's tensors (relative to ``self_attn.``)."""
    names = {"o": "o_proj.weight", "o_bias": "o_proj.bias"}
    if family in _FUSED_QKV:
        names |= {"qkv": "qkv_proj.weight", "qkv_bias": "qkv_proj.bias"}
    else:
        for p in "qkv":
            names |= {p: f"{p}_proj.weight", f"{p}_bias": f"{p}_proj.bias"}
    if family in _QK_NORM:
        names |= {"q_norm": "q_norm.weight", "k_norm": "k_norm.weight"}
    if family in _SINKS:
        names["sinks"] = "sinks"
    return names


def from_transformers(config, state_dict, layer):
    """The ``AttentionConfig`` and linen params of decoder layer ``layer`` of a
    transformers checkpoint.

    Args:
      config: the model's configuration as a dict: ``model.config.to_dict()``, or
        the checkpoint's ``config.json`` (either form of the RoPE parameters). Its
        ``model_type`` is one of llama, mistral, qwen2, qwen3, gemma2, gemma3 (or
        gemma3_text), gpt_oss, olmo2, phi3.
      state_dict: a mapping from the checkpoint's names to arrays (numpy, as
        ``safetensors.numpy.load_file`` gives them): ``model.layers.{layer}.self_attn.*``
        as in the ``...ForCausalLM`` checkpoint, or without the ``model.`` prefix.
        Only the layer's attention tensors are read.
      layer: the decoder layer's index, in [0, ``num_hidden_layers``).

    Returns:
      ``(config, params)``: the layer's :class:`AttentionConfig` (its window, RoPE and
      options for this layer's type; ``param_dtype`` the checkpoint's dtype) and its
      parameters as numpy arrays, ``{"qkv": {"kernel": (D, (N + 2K) H), "bias"},
      "out": {"kernel": (N H, D), "bias"}, "q_norm", "k_norm", "sinks"}`` as the config
      has them: ``CausalSelfAttention(config).apply({"params": params}, x)``, or
      ``nanoattn.nnx.from_linen(config, params, rngs=...)`` for NNX.

    Raises:
      ValueError: an unsupported family or RoPE type, a layer out of range, a missing
        tensor or one of another shape than the config gives, or a tensor of the
        layer's attention that the family does not use.

    Example:
      >>> import numpy as np
      >>> config = {"model_type": "qwen2", "hidden_size": 8, "num_attention_heads": 2,
      ...           "num_key_value_heads": 1, "num_hidden_layers": 1, "rope_theta": 1e6}
      >>> rng = np.random.default_rng(0)
      >>> shapes = {"q": (8, 8), "k": (4, 8), "v": (4, 8), "o": (8, 8)}
      >>> state = {f"model.layers.0.self_attn.{p}_proj.weight": rng.normal(size=s)
      ...          for p, s in shapes.items()}
      >>> state |= {f"model.layers.0.self_attn.{p}_proj.bias": rng.normal(size=s[0])
      ...           for p, s in shapes.items() if p != "o"}  # Qwen2: no output bias
      >>> attention, params = from_transformers(config, state, 0)
      >>> attention.head_dim, attention.kv_heads, attention.has_bias("out")
      (4, 1, False)
      >>> {name: part["kernel"].shape for name, part in params.items()}
      {'qkv': (8, 16), 'out': (8, 8)}
    """
    family, config = _family(config)
    layer = _check_layer(config, layer)
    if not isinstance(state_dict, Mapping):
        raise TypeError(
            f"state_dict must be a mapping from names to arrays, got {type(state_dict).__name__}"
        )
    names = _names(family)
    prefix = _prefix(state_dict, layer, names["qkv" if family in _FUSED_QKV else "q"])
    found = {key for key in state_dict if key.startswith(prefix)}
    unknown = sorted(found - {prefix + n for n in names.values()})
    if unknown:
        raise ValueError(f"state_dict has {unknown[0]}, which a {family} layer does not use")
    get = {key: state_dict[prefix + n] for key, n in names.items() if prefix + n in found}
    for key in [k for k in names if not k.endswith("bias")]:
        if key not in get:
            raise ValueError(f"state_dict has no {prefix}{names[key]}")
    inputs = ("qkv",) if family in _FUSED_QKV else ("q", "k", "v")
    has = [f"{p}_bias" in get for p in inputs]
    if any(has) and not all(has):
        raise ValueError(
            f"state_dict has {prefix}{names[inputs[has.index(True)] + '_bias']} but not "
            f"{prefix}{names[inputs[has.index(False)] + '_bias']}: nanoattn's fused qkv "
            f"projection has one bias for all of q, k and v"
        )
    dtypes = {np.asarray(a).dtype for a in get.values()}
    if len(dtypes) != 1:
        raise ValueError(
            f"state_dict's tensors of {prefix[:-1]} have dtypes {sorted(d.name for d in dtypes)}; "
            f"cast them to one dtype first"
        )
    (dtype,) = dtypes
    cfg = _attention_config(family, config, layer, dtype, (all(has), "o_bias" in get))
    return cfg, _params(family, cfg, prefix, get)


def _params(family: str, cfg: AttentionConfig, prefix: str, get: dict) -> dict:
    D, N, K, H = cfg.d_model, cfg.n_heads, cfg.kv_heads, cfg.head_dim
    names = _names(family)
    widths = {"q": N * H, "k": K * H, "v": K * H, "qkv": (N + 2 * K) * H}

    def tensor(key, shape):
        return _expect(prefix + names[key], get[key], shape)

    inputs = ("qkv",) if family in _FUSED_QKV else ("q", "k", "v")
    kernel = np.concatenate([tensor(p, (widths[p], D)).T for p in inputs], axis=1)
    params = {"qkv": {"kernel": kernel}, "out": {"kernel": tensor("o", (D, N * H)).T.copy()}}
    if cfg.has_bias("qkv"):
        params["qkv"]["bias"] = np.concatenate([tensor(f"{p}_bias", (widths[p],)) for p in inputs])
    if cfg.has_bias("out"):
        params["out"]["bias"] = tensor("o_bias", (D,)).copy()
    if cfg.qk_norm:
        joint = cfg.qk_norm == "projection"
        for key, heads in (("q_norm", N), ("k_norm", K)):
            params[key] = {"scale": tensor(key, ((heads if joint else 1) * H,)).copy()}
    if cfg.sinks:
        params["sinks"] = tensor("sinks", (N,)).copy()
    return params


def to_transformers(config, params, layer=None) -> dict[str, np.ndarray]:
    """The state dict entries of one attention layer from nanoattn's linen params: the
    inverse of :func:`from_transformers`, bit for bit.

    Args:
      config: the model's transformers configuration as a dict, as for
        :func:`from_transformers` (its family decides the names and the layout).
      params: the layer's linen params (``{"qkv", "out", ...}`` or ``{"params": ...}``;
        for NNX, ``nanoattn.nnx.to_linen(module)``).
      layer: the decoder layer's index: the names are then those of the
        ``...ForCausalLM`` checkpoint, ``model.layers.{layer}.self_attn.*``; None:
        relative to the attention module (``q_proj.weight``, ...).

    Returns:
      ``{name: numpy array}``, in the params' dtype: q, k, v (or Phi-3's fused qkv) and
      o projection weights (out, in) and the biases the params have, the q/k norm
      weights, the sinks.

    Raises:
      ValueError: params whose shapes are not the config's.
    """
    family, config = _family(config)
    if layer is not None:
        layer = _check_layer(config, layer)
    if not isinstance(params, Mapping):
        raise TypeError(f"params must be a dict of parameters, got {type(params).__name__}")
    if set(params) == {"params"}:
        params = params["params"]
    D, N, K, H = _sizes(config)
    prefix = "" if layer is None else PREFIXES[0].format(i=layer)
    names = _names(family)

    def array(path: str, shape):
        node = params
        for part in path.split("/"):
            if not isinstance(node, Mapping) or part not in node:
                raise ValueError(f"params has no {path} {shape}")
            node = node[part]
        node = np.asarray(node)
        if node.shape != shape:
            raise ValueError(f"params {path} has shape {node.shape}; the config gives {shape}")
        return node

    widths = [N * H, K * H, K * H]
    kernel = array("qkv/kernel", (D, sum(widths)))
    out = {prefix + names["o"]: np.ascontiguousarray(array("out/kernel", (N * H, D)).T)}
    parts = [kernel] if family in _FUSED_QKV else np.split(kernel, np.cumsum(widths)[:2], axis=1)
    inputs = ("qkv",) if family in _FUSED_QKV else ("q", "k", "v")
    for p, part in zip(inputs, parts):
        out[prefix + names[p]] = np.ascontiguousarray(part.T)
    if "bias" in params.get("qkv", {}):
        bias = array("qkv/bias", (sum(widths),))
        split = [bias] if family in _FUSED_QKV else np.split(bias, np.cumsum(widths)[:2])
        for p, part in zip(inputs, split):
            out[prefix + names[f"{p}_bias"]] = part.copy()
    if "bias" in params.get("out", {}):
        out[prefix + names["o_bias"]] = array("out/bias", (D,)).copy()
    if family in _QK_NORM:
        joint = _QK_NORM[family] == "projection"
        for key, heads in (("q_norm", N), ("k_norm", K)):
            out[prefix + names[key]] = array(f"{key}/scale", ((heads if joint else 1) * H,)).copy()
    if family in _SINKS:
        out[prefix + names["sinks"]] = array("sinks", (N,)).copy()
    return out
