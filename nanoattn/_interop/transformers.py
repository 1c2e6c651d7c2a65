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

Where transformers fills in a missing key (``head_dim``, a RoPE base, yarn's ``factor``
and original length), the same is filled in; any other key the layer needs that is
missing or of the wrong kind, a layer type or RoPE type it does not load, and tensors
of mixed dtypes (or float64 without ``jax_enable_x64``) are refused in one line naming
the key or the tensor (docs/models.md).

:func:`to_transformers` is the inverse: the state dict entries of the layer from
(fine-tuned) params, bit for bit the arrays :func:`from_transformers` read.

Axis letters (docs/conventions.md): D model width, N query heads, K key/value heads,
H head width.
"""

import math
import numbers
from collections.abc import Mapping, Sequence

import jax
import numpy as np

from .._layers.config import AttentionConfig

FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3", "gpt_oss", "olmo2", "phi3")
# The layer types a layer can be loaded as; any other (chunked_attention, ...) is refused.
LAYER_TYPES = ("full_attention", "sliding_attention")
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
# transformers' RoPE base where a configuration has none (its configs' default_theta);
# Gemma 3's sliding layers: rope_local_base_freq, 10000 where absent.
_DEFAULT_THETA = {"gemma3": 1_000_000.0, "gpt_oss": 150_000.0}
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
# What each scaled RoPE needs in the configuration (the lengths come from
# max_position_embeddings where absent, and yarn's factor from the lengths).
_ROPE_NEEDS = {"linear": ("factor",), "dynamic": ("factor",),
               "llama3": ("factor", "low_freq_factor", "high_freq_factor")}  # fmt: skip
# What a RoPE parameter must be, where not "a number > 0" (mscale 0: unset, as transformers).
_ROPE_KINDS = {
    "original_max_position_embeddings": "an int >= 1",
    "mscale": "a number >= 0",
    "mscale_all_dim": "a number >= 0",
    "truncate": "True or False",
}


def _is_int(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, (bool, np.bool_))


def _is_real(value) -> bool:
    real = isinstance(value, numbers.Real) and not isinstance(value, (bool, np.bool_))
    return real and math.isfinite(value)


# What a configuration value may be: the words the messages say, the test, the conversion.
_KINDS = {
    "an int >= 1": (lambda v: _is_int(v) and v >= 1, int),
    "an int >= 0": (lambda v: _is_int(v) and v >= 0, int),
    "a number > 0": (lambda v: _is_real(v) and v > 0, float),
    "a number >= 0": (lambda v: _is_real(v) and v >= 0, float),
    "a number in [0, 1)": (lambda v: _is_real(v) and 0 <= v < 1, float),
    "a number in (0, 1]": (lambda v: _is_real(v) and 0 < v <= 1, float),
    "True or False": (lambda v: isinstance(v, (bool, np.bool_)), bool),
}
_REQUIRED = object()


def _get(config: Mapping, key: str, kind: str, default=_REQUIRED, name: str | None = None):
    """``config[key]``, checked to be ``kind`` (a key of ``_KINDS``) and converted;
    ``default`` where the key is absent or None. Otherwise (no default, a value of
    another kind) a one-line ValueError naming the key: ``name``, where it sits in the
    configuration (``rope_parameters['factor']``), else ``key``."""
    name = name or key
    value = config.get(key)
    if value is None and default is not _REQUIRED:
        return default
    if key not in config:
        raise ValueError(f"config has no {name} ({kind})")
    test, convert = _KINDS[kind]
    if not test(value):
        raise ValueError(f"config {name} must be {kind}, got {value!r}")
    return convert(value)


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
    kind = "gemma3" if kind == "gemma3_text" else kind
    if kind not in FAMILIES:
        raise ValueError(
            f"config model_type {config.get('model_type')!r} is not supported; supported: "
            f"{', '.join(FAMILIES)}"
        )
    return kind, config


def _sizes(config: Mapping) -> tuple[int, int, int, int]:
    D = _get(config, "hidden_size", "an int >= 1")
    N = _get(config, "num_attention_heads", "an int >= 1")
    K = _get(config, "num_key_value_heads", "an int >= 1", N)
    H = _get(config, "head_dim", "an int >= 1", D // N)  # transformers' default: D // N
    return D, N, K, H


def _layer_type(family: str, config: Mapping, layer: int) -> str:
    """``"sliding_attention"`` or ``"full_attention"``: decoder layer ``layer``'s entry of
    ``layer_types`` (one per layer; any other type is refused), or the family's older
    rule."""
    types = config.get("layer_types")
    if types is not None:
        layers = _get(config, "num_hidden_layers", "an int >= 1")
        if isinstance(types, (str, bytes)) or not isinstance(types, Sequence):
            raise ValueError(f"config layer_types must be a list of layer types, got {types!r}")
        if len(types) != layers:
            raise ValueError(
                f"config layer_types must have one entry per layer (num_hidden_layers="
                f"{layers}), got {len(types)}"
            )
        if types[layer] not in LAYER_TYPES:
            raise ValueError(
                f"config layer_types[{layer}] is {types[layer]!r}, which from_transformers does "
                f"not load; known: {', '.join(LAYER_TYPES)}"
            )
        return types[layer]
    window = config.get("sliding_window")
    if family in _WINDOW_EVERYWHERE:
        return "full_attention" if window is None else "sliding_attention"
    if family in ("qwen2", "qwen3"):  # transformers' rule before layer_types
        sliding = _get(config, "use_sliding_window", "True or False", False) and window is not None
        sliding = sliding and layer >= _get(config, "max_window_layers", "an int >= 0")
        return "sliding_attention" if sliding else "full_attention"
    if family == "gemma3":
        keys = [k for k in ("sliding_window_pattern", "_sliding_window_pattern") if k in config]
        pattern = _get(config, (keys or ["sliding_window_pattern"])[0], "an int >= 1", 6)
        return "full_attention" if (layer + 1) % pattern == 0 else "sliding_attention"
    if family in ("gemma2", "gpt_oss"):
        return "full_attention" if layer % 2 else "sliding_attention"
    return "full_attention"


def _window(config: Mapping, layer_type: str):
    """transformers' ``sliding_window=W`` (each query sees itself and the W - 1 keys
    before it) as nanoattn's ``window=(W - 1, 0)``, on sliding layers."""
    if layer_type != "sliding_attention":
        return None
    W = _get(config, "sliding_window", "an int >= 1")
    return (W - 1, 0)


def _mapping(value, name: str) -> dict:
    if not isinstance(value, Mapping):
        raise ValueError(f"config {name} must be a dict of RoPE parameters, got {value!r}")
    return dict(value)


def _rope_parameters(family: str, config: Mapping, layer_type: str) -> tuple[dict, str]:
    """The RoPE parameters of a layer type in transformers' current form, from either
    form of the configuration: ``rope_type``, ``rope_theta`` and
    ``partial_rotary_factor`` (None: whole heads) checked, the rest as given; and where
    they sit in the configuration, for the messages."""
    local = family == "gemma3" and layer_type == "sliding_attention"
    if config.get("rope_parameters") is not None:
        where = "rope_parameters"
        params = _mapping(config[where], where)
        if any(key in LAYER_TYPES for key in params):  # one entry per layer type (Gemma 3)
            if layer_type not in params:
                raise ValueError(f"config rope_parameters has no {layer_type!r} entry")
            where = f"rope_parameters[{layer_type!r}]"
            params = _mapping(params[layer_type], where)
    else:  # config.json before transformers 5: rope_theta and rope_scaling
        where = "rope_scaling"
        scaling = config.get(where)
        params = {} if local or scaling is None else _mapping(scaling, where)
    # Where the layer type's own parameters have no base: transformers' order.
    if local:
        top, theta = "rope_local_base_freq", 10_000.0
    else:
        top, theta = "rope_theta", _DEFAULT_THETA.get(family, 10_000.0)
    if "rope_theta" in params:
        theta = _get(params, "rope_theta", "a number > 0", name=f"{where}['rope_theta']")
    else:
        theta = _get(config, top, "a number > 0", _REQUIRED if top in config else theta)
    key = "partial_rotary_factor"
    source, name = (params, f"{where}[{key!r}]") if key in params else (config, key)
    params[key] = _get(source, key, "a number in (0, 1]", None, name=name)
    params["rope_theta"] = theta
    params["rope_type"] = params.get("rope_type", params.get("type", "default"))
    return params, where


def _rope(family: str, config: Mapping, layer_type: str, head_dim: int) -> dict:
    """The layer's RoPE as AttentionConfig options."""
    params, where = _rope_parameters(family, config, layer_type)
    kind = params["rope_type"]
    options = {"rope_base": params["rope_theta"]}
    partial = params["partial_rotary_factor"]
    if partial is not None and int(head_dim * partial) != head_dim:
        options["rotary_dim"] = int(head_dim * partial)
    if kind == "default":
        return options
    if kind not in _ROPE_KEYS:
        raise ValueError(
            f"config rope_type {kind!r} is not supported; supported: default, "
            f"{', '.join(_ROPE_KEYS)}"
        )
    for key in _ROPE_NEEDS.get(kind, ()):
        if params.get(key) is None:
            raise ValueError(f"config {where} has no {key!r}, which rope_type {kind!r} needs")
    scaling = {"rope_type": kind}
    for key in _ROPE_KEYS[kind]:
        if params.get(key) is not None:
            kind_of = _ROPE_KINDS.get(key, "a number > 0")
            scaling[key] = _get(params, key, kind_of, name=f"{where}[{key!r}]")
    if kind == "dynamic":  # transformers grows the base past max_position_embeddings
        scaling["original_max_position_embeddings"] = _longest(config, "rope_type 'dynamic'")
    elif kind in ("llama3", "yarn") and "original_max_position_embeddings" not in scaling:
        key = "original_max_position_embeddings"  # transformers: the top level's, else
        top = _get(config, key, "an int >= 1", None)  # max_position_embeddings
        scaling[key] = top or _longest(config, f"rope_type {kind!r}")
    if kind == "yarn":
        if "factor" not in scaling:  # transformers: the extension ratio
            longest = _longest(config, "rope_type 'yarn' without a factor")
            scaling["factor"] = longest / scaling["original_max_position_embeddings"]
        top = config.get("rope_parameters") or config.get("rope_scaling") or {}
        if "truncate" in top:  # transformers reads yarn's truncate at the top level
            name = "rope_parameters" if config.get("rope_parameters") else "rope_scaling"
            scaling["truncate"] = _get(top, "truncate", "True or False", name=f"{name}['truncate']")
    options["rope_scaling"] = scaling
    return options


def _longest(config: Mapping, needs: str) -> int:
    """max_position_embeddings, which ``needs`` (a RoPE type) reads."""
    if config.get("max_position_embeddings") is None:
        raise ValueError(
            f"config has no max_position_embeddings (an int >= 1), which {needs} needs"
        )
    return _get(config, "max_position_embeddings", "an int >= 1")


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
    layers = _get(config, "num_hidden_layers", "an int >= 1")
    if isinstance(layer, bool) or not isinstance(layer, (int, np.integer)):
        raise TypeError(f"layer must be an int, got layer={layer!r}")
    if not 0 <= layer < layers:
        raise ValueError(f"layer must be in [0, {layers}) (num_hidden_layers), got layer={layer}")
    return int(layer)


def _dtype(tensors: Mapping[str, np.ndarray]) -> np.dtype:
    """The one dtype of a layer's tensors (checkpoint name to array), or a one-line
    ValueError naming a tensor: one of another dtype than the first, or of a dtype that
    is not floating point or that JAX would not keep (float64 without jax_enable_x64)."""
    (first, array), *rest = tensors.items()
    for name, other in rest:
        if other.dtype != array.dtype:
            raise ValueError(
                f"state_dict {name} is {other.dtype.name} but {first} is {array.dtype.name}; "
                f"cast the layer's tensors to one dtype first"
            )
    dtype = array.dtype
    if not jax.dtypes.issubdtype(dtype, np.floating):  # bfloat16 included
        raise ValueError(f"state_dict {first} is {dtype.name}; expected floating-point tensors")
    if jax.dtypes.canonicalize_dtype(dtype) != dtype:
        raise ValueError(
            f"state_dict {first} is {dtype.name}, which JAX truncates to "
            f"{jax.dtypes.canonicalize_dtype(dtype).name} without jax_enable_x64; cast the "
            f"tensors to float32 first (or enable jax_enable_x64)"
        )
    return dtype


def _attention_config(family: str, config: Mapping, layer: int, dtype, biases) -> AttentionConfig:
    D, N, K, H = _sizes(config)
    layer_type = _layer_type(family, config, layer)
    bidirectional = "use_bidirectional_attention"
    if family in _QUERY_SCALAR and _get(config, bidirectional, "True or False", False):
        raise ValueError("config use_bidirectional_attention=True is not causal attention")
    options = dict(
        d_model=D,
        n_heads=N,
        n_kv_heads=None if K == N else K,
        head_dim=H,
        dropout=_get(config, "attention_dropout", "a number in [0, 1)", 0.0),
        window=_window(config, layer_type),
        param_dtype=dtype,
        sinks=family in _SINKS,
        use_bias=biases[0],
        **_rope(family, config, layer_type, H),
    )
    if biases[1] != biases[0]:  # Qwen2: q, k, v biases, none on the output
        options["out_bias"] = biases[1]
    if family in _QUERY_SCALAR:
        options["scale"] = _get(config, "query_pre_attn_scalar", "a number > 0") ** -0.5
        cap = _get(config, "attn_logit_softcapping", "a number > 0", None)
        if cap is not None:
            options["logit_soft_cap"] = cap
    if family in _QK_NORM:
        eps = _get(config, "rms_norm_eps", "a number > 0")
        options |= dict(qk_norm=_QK_NORM[family], qk_norm_eps=eps)
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
      TypeError: a config, state_dict or layer of another type.
      ValueError: in one line naming the key or the tensor: an unsupported family, layer
        type or RoPE type; a layer out of range; a configuration key the layer needs
        that is missing or not what it must be (``hidden_size`` an int >= 1,
        ``query_pre_attn_scalar`` a number > 0, ``layer_types`` one type per layer,
        ``rope_scaling`` a dict, ...); a missing tensor or one of another shape than
        the config gives; a tensor of the layer's attention that the family does not
        use; tensors of mixed dtypes, or float64 without ``jax_enable_x64``.

    Example:
      >>> import numpy as np
      >>> config = {"model_type": "qwen2", "hidden_size": 8, "num_attention_heads": 2,
      ...           "num_key_value_heads": 1, "num_hidden_layers": 1, "rope_theta": 1e6}
      >>> rng = np.random.default_rng(0)
      >>> shapes = {"q": (8, 8), "k": (4, 8), "v": (4, 8), "o": (8, 8)}
      >>> state = {f"model.layers.0.self_attn.{p}_proj.weight": rng.standard_normal(s, np.float32)
      ...          for p, s in shapes.items()}
      >>> state |= {f"model.layers.0.self_attn.{p}_proj.bias": rng.standard_normal(s[0], np.float32)
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
    dtype = _dtype({prefix + names[key]: np.asarray(a) for key, a in get.items()})
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
