"""The attention configuration: a frozen dataclass validated on construction."""

import dataclasses
from typing import Any

import jax.numpy as jnp
import numpy as np

from .._backends.registry import check_implementation
from .._base.dropout import check_rate
from .._base.quantized import check_storage
from .._base.rules import check_soft_cap, normalize_window
from .._base.validate import expect_flag, expect_real, float_dtype, positive_number
from .._base.zigzag import check_layout
from .._core.rope import check_layout as check_rope_layout
from .._core.rope import check_rotary_dim, rope_scaling_of
from .norm import EPSILON

# The projections of the layers, by which bias option covers them.
_INPUT_PROJECTIONS = ("qkv", "q", "kv")
QK_NORMS = ("head", "projection")


def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)


def _is_int(x) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


def _count_or_none(name: str, value) -> int | None:
    """``value`` as an int >= 1, or None; a TypeError or ValueError naming ``name``."""
    if value is None:
        return None
    if not _is_int(value):
        raise TypeError(f"{name} must be an int >= 1 or None, got {name}={value!r}")
    if value < 1:
        raise ValueError(f"{name} must be an int >= 1 or None, got {name}={value}")
    return int(value)


@dataclasses.dataclass(frozen=True)
class AttentionConfig:
    """Sizes and options of an attention layer.

    Axis letters (docs/conventions.md): D model width, N query heads, K
    key/value heads, G = N / K query heads per key/value head, H head width
    (D / N unless ``head_dim`` says otherwise), R the rotated width.

    Attributes:
      d_model: D, the model width.
      n_heads: N, the number of query heads; must divide ``d_model`` unless
        ``head_dim`` is given.
      dropout: dropout rate on the attention weights, in [0, 1).
      implementation: the attention backend, ``"xla"``, ``"flash"``,
        ``"native"``, ``"cudnn"`` or None for the automatic choice (see
        ``nanoattn.dot_product_attention``). Training with dropout uses the
        reference under the automatic choice.
      n_kv_heads: K, the number of key/value heads; must divide ``n_heads``.
        None means K = N (multi-head attention); 1 < K < N is grouped-query
        attention, K = 1 multi-query attention.
      rope_base: None for no rotary embedding, else the frequency base of
        ``nanoattn.apply_rope`` applied to queries and keys (needs an even H, or
        an even ``rotary_dim``).
      window: None, an int ``w`` (meaning ``(w, w)``) or ``(left, right)``:
        a query at position p sees keys at ``p - left .. p + right`` (ANDed
        with causality). Stored as ``(left, right)``.
      logit_soft_cap: None or a float ``cap`` > 0: logits become
        ``cap * tanh(logits / cap)`` before the softmax (Gemma 2).
      qk_norm: RMSNorm of queries and keys before RoPE, with a learned scale
        per feature: ``"head"`` (or True) over H on every query and key head,
        one scale (H,) shared by the heads (Qwen3, Gemma 3); ``"projection"``
        over the whole query projection (N H) and the whole key projection
        (K H), all heads jointly, scales (N H,) and (K H,) (OLMo 2); False: none.
        Stored as ``"head"``, ``"projection"`` or False.
      sinks: attention sinks (gpt-oss): a learned parameter ``sinks`` (N,),
        one logit per query head, initialised to zeros, in ``param_dtype``;
        each row's softmax denominator gains ``exp(sinks[n])`` and no value is
        attended for it (``nanoattn.dot_product_attention(..., sinks=...)``),
        in training, decoding and cross-attention.
      rolling_cache: a rolling (ring-buffer) KV cache for a local layer: needs
        ``window=(W, 0)``; a cache of C slots (C >= W + 1 + ``sink_tokens``)
        keeps the sink tokens and the keys still in view, decodes past any
        length in chunks of at most C - W - ``sink_tokens`` tokens, and
        equals the full windowed forward (docs/decoding.md).
      page_size: None, or the tokens of a page of a paged KV cache: the layer decodes
        through a pool of pages shared by many sequences, a step bringing the tokens
        of any of them token-major (x (1, Tq, D)) with ``pages=``, a ``PagedBatch``
        of a ``nanoattn.PageAllocator`` (docs/decoding.md, "Paged caches"). Not with
        ``rolling_cache`` or ``sequence_axis``.
      page_selection: None, or k >= 1, needs ``page_size`` and no ``window``:
        query-aware page selection (Quest): the pool keeps each page's elementwise
        minimum and maximum key per key/value head, and a decode row (a sequence
        bringing one token) of more than k + 1 pages reads only the k pages whose
        keys can score highest for its query (the maximum over its heads of
        ``sum_h max(q_h min_h, q_h max_h)``) and its last page. This changes the
        answer (docs/decoding.md, "Page selection"); prefill chunks and token trees
        read every page. Not with ``mask_fn`` or ``score_fn`` at the call.
      sink_tokens: S0 >= 0, needs a ``window``: the first S0 positions stay
        visible to every later query in addition to the window (StreamingLLM),
        in training and decoding; a rolling cache keeps their slots. Not the
        learned logit ``sinks``.
      use_bias: whether the projections have biases (the default of
        ``qkv_bias`` and ``out_bias``).
      dtype: the compute dtype of projections and attention, and the dtype of
        the KV cache; None means the input's dtype.
      param_dtype: the dtype of the parameters.
      head_axis: None, or the mesh axis that shards the heads (tensor
        parallelism, e.g. ``"model"``): the parameters carry logical axis
        names (``nanoattn.parallel.logical_rules``) and q, k, v and the
        attention output are sharded over heads; the output projection
        reduces once. Needs ``jax.set_mesh``; the axis size must divide K.
      sequence_axis: None, or the mesh axis that shards the sequence
        (e.g. ``"sp"``): self-attention runs ``nanoattn.parallel.ring_attention``
        over it (causal, no dense mask, no dropout, no KV cache). The layer's
        input and output are then in ``sequence_layout`` order along T, and
        the default RoPE positions follow it.
      sequence_layout: ``"zigzag"`` (the default) or ``"contiguous"``, the
        layout of the sequence over ``sequence_axis``
        (``nanoattn.parallel.to_zigzag``).
      head_dim: H, the width of one head; None means ``d_model // n_heads``
        (stored as that int, which ``dataclasses.replace`` then keeps). Given,
        H is independent of D: q projects D -> N H, k and v D -> K H, and the
        output N H -> D (Gemma 2/3, small Qwen3).
      scale: the softmax scale of the logits ``scale * q . k``; None means
        ``1 / sqrt(H)`` (Gemma's ``query_pre_attn_scalar ** -0.5`` differs).
      rope_scaling: None, or a mapping with ``rope_type`` (``"linear"``,
        ``"llama3"``, ``"yarn"``, ``"dynamic"``) and that type's parameters with
        transformers' names (``nanoattn.apply_rope``); needs ``rope_base``. Stored
        as a frozen ``RopeScaling`` (``.as_dict()`` gives the mapping back).
        ``"dynamic"`` reads the longest position, so it cannot decode under ``jit``.
      rotary_dim: R, an even int <= H, needs ``rope_base``: only the first R
        features of each head rotate (partial rotary); None: all H.
      rope_layout: ``"half"`` (feature i pairs with i + R/2) or ``"interleaved"``
        (2i with 2i + 1), ``nanoattn.apply_rope``'s conventions.
      qk_norm_eps: the epsilon of ``qk_norm`` (1e-6; OLMo 2 uses 1e-5).
      qk_norm_offset: added to the learned scale of ``qk_norm``: 1.0 for Gemma's
        ``x * (1 + w)`` convention, whose checkpoints store ``w``; the scale is
        initialised to ``1 - qk_norm_offset``, so a fresh norm multiplies by 1.
      qkv_bias: whether the input projections (``qkv``; cross-attention's ``q``
        and ``kv``) have biases; None: ``use_bias``.
      out_bias: whether the output projection has a bias; None: ``use_bias``
        (Qwen2 has q, k, v biases and none on its output).
      kv_cache_dtype: None (the cache holds keys and values in the compute dtype),
        ``"int8"`` or ``"float8_e4m3fn"``: every kind of KV cache stores them
        quantized with a float32 scale per token and key/value head
        (``nanoattn.quantize_kv``); each step quantizes only its new tokens and the
        kernel reads them with their scales (docs/decoding.md, "Quantized caches").

    Example:
      >>> config = AttentionConfig(d_model=128, n_heads=4, n_kv_heads=2, window=16)
      >>> config.head_dim, config.kv_heads, config.groups, config.window
      (32, 2, 2, (16, 16))
    """

    d_model: int = 128
    n_heads: int = 4
    dropout: float = 0.0
    implementation: str | None = None
    n_kv_heads: int | None = None
    rope_base: float | None = None
    window: Any = None
    logit_soft_cap: float | None = None
    qk_norm: bool | str = False
    use_bias: bool = True
    dtype: Any = None
    param_dtype: Any = jnp.float32
    head_axis: str | None = None
    sequence_axis: str | None = None
    sequence_layout: str = "zigzag"
    sinks: bool = False
    rolling_cache: bool = False
    sink_tokens: int = 0
    head_dim: int | None = None
    scale: float | None = None
    rope_scaling: Any = None
    rotary_dim: int | None = None
    rope_layout: str = "half"
    qk_norm_eps: float = EPSILON
    qk_norm_offset: float = 0.0
    qkv_bias: bool | None = None
    out_bias: bool | None = None
    page_size: int | None = None
    kv_cache_dtype: str | None = None
    page_selection: int | None = None

    def __post_init__(self):
        for name in ("d_model", "n_heads"):
            if not _is_int(getattr(self, name)):
                raise TypeError(f"{name} must be an int >= 1, got {name}={getattr(self, name)!r}")
        if self.n_heads < 1:
            raise ValueError(f"n_heads must be >= 1, got n_heads={self.n_heads}")
        if self.d_model < 1:
            raise ValueError(f"d_model must be >= 1, got d_model={self.d_model}")
        self._check_head_dim()
        if self.head_dim is None and self.d_model % self.n_heads != 0:
            raise ValueError(
                f"d_model={self.d_model} is not divisible by n_heads={self.n_heads}, so the "
                f"heads cannot split it into equal widths; head counts that divide "
                f"{self.d_model}: {_divisors(self.d_model)}"
            )
        derived = self.head_dim is None
        if derived:
            object.__setattr__(self, "head_dim", self.d_model // self.n_heads)
        check_rate("dropout", self.dropout)
        check_implementation(self.implementation)
        self._check_kv_heads()
        self._check_rope(derived)
        object.__setattr__(self, "scale", positive_number("scale", self.scale, optional=True))
        self._check_mesh_axes()
        object.__setattr__(self, "window", normalize_window(self.window))
        object.__setattr__(self, "logit_soft_cap", check_soft_cap(self.logit_soft_cap))
        for name in ("use_bias", "sinks", "rolling_cache"):
            expect_flag(name, getattr(self, name))
        for name in ("qkv_bias", "out_bias"):
            if getattr(self, name) is not None:
                expect_flag(name, getattr(self, name))
        self._check_qk_norm()
        self._check_streaming()
        self._check_paging()
        if self.kv_cache_dtype is not None:
            object.__setattr__(
                self, "kv_cache_dtype", check_storage("kv_cache_dtype", self.kv_cache_dtype)
            )
        if self.dtype is not None:
            object.__setattr__(self, "dtype", float_dtype("dtype", self.dtype))
        object.__setattr__(self, "param_dtype", float_dtype("param_dtype", self.param_dtype))

    def _check_paging(self) -> None:
        size, k = self.page_size, self.page_selection
        if k is not None:
            if not _is_int(k) or k < 1:
                raise ValueError(
                    f"page_selection must be an int >= 1 (the pages a decode query reads "
                    f"besides its last) or None, got page_selection={k!r}"
                )
            if size is None:
                raise ValueError(
                    f"page_selection={k} needs page_size: it selects pages of a paged KV cache"
                )
            if self.window is not None:
                raise ValueError(
                    f"page_selection={k} is for a global layer, got window={self.window}: a "
                    f"windowed layer reads only the pages in its window already"
                )
        if size is None:
            return
        if not _is_int(size) or size < 1:
            raise ValueError(f"page_size must be an int >= 1 or None, got page_size={size!r}")
        if self.rolling_cache:
            raise ValueError(
                "page_size (a paged KV cache) and rolling_cache=True are two kinds of cache; "
                "choose one per layer"
            )
        if self.sequence_axis is not None:
            raise ValueError(
                f"page_size is not supported with sequence_axis={self.sequence_axis!r}: "
                "the ring has no KV cache"
            )

    def _check_kv_heads(self) -> None:
        K = _count_or_none("n_kv_heads", self.n_kv_heads)
        if K is None:
            return
        if self.n_heads % K != 0:
            raise ValueError(
                f"n_kv_heads={K} does not divide n_heads={self.n_heads}, so the query heads "
                f"cannot share key/value heads in equal groups; key/value head counts that "
                f"divide {self.n_heads}: {_divisors(self.n_heads)}"
            )

    def _check_mesh_axes(self) -> None:
        for name in ("head_axis", "sequence_axis"):
            axis = getattr(self, name)
            if axis is not None and not isinstance(axis, str):
                raise TypeError(f"{name} must be a mesh axis name (str) or None, got {axis!r}")
        if self.head_axis is not None and self.head_axis == self.sequence_axis:
            raise ValueError(
                f"head_axis and sequence_axis must be different mesh axes, got "
                f"{self.head_axis!r} for both"
            )
        check_layout(self.sequence_layout, "sequence_layout")

    def _check_streaming(self) -> None:
        S0 = self.sink_tokens
        if not _is_int(S0):
            raise TypeError(f"sink_tokens must be an int >= 0, got sink_tokens={S0!r}")
        if S0 < 0:
            raise ValueError(f"sink_tokens must be >= 0, got sink_tokens={S0}")
        if S0 and self.window is None:
            raise ValueError(
                f"sink_tokens={S0} needs a window: the sink tokens stay visible in addition "
                f"to window=(W, 0), and without a window every key is visible already"
            )
        if S0 and self.sequence_axis is not None:
            raise ValueError(
                f"sink_tokens={S0} is not supported with sequence_axis={self.sequence_axis!r}: "
                f"the ring attends with the plain window only"
            )
        if self.rolling_cache and (self.window is None or self.window[1] != 0):
            raise ValueError(
                f"rolling_cache=True needs window=(W, 0) (no look-ahead), got window={self.window}"
            )

    def _check_head_dim(self) -> None:
        H = _count_or_none("head_dim", self.head_dim)
        if H is not None:
            object.__setattr__(self, "head_dim", H)

    def _check_rope(self, derived: bool) -> None:
        scaling = rope_scaling_of(self.rope_scaling)
        object.__setattr__(self, "rope_scaling", scaling)
        check_rope_layout(self.rope_layout)
        if positive_number("rope_base", self.rope_base, optional=True) is None:
            unset = (("rope_scaling", None), ("rotary_dim", None), ("rope_layout", "half"))
            for name, default in unset:
                if getattr(self, name) != default:
                    raise ValueError(
                        f"{name}={getattr(self, name)!r} needs rope_base: without it no RoPE "
                        f"is applied"
                    )
            return
        if self.rotary_dim is not None:
            object.__setattr__(self, "rotary_dim", check_rotary_dim(self.rotary_dim, self.head_dim))
        elif self.head_dim % 2:
            if derived:
                raise ValueError(
                    f"rope_base needs an even head width H, got H={self.head_dim} "
                    f"(d_model={self.d_model} / n_heads={self.n_heads})"
                )
            raise ValueError(
                f"rope_base needs an even head width H, got head_dim={self.head_dim}; "
                f"rotary_dim can rotate an even part of it"
            )
        if scaling is not None and scaling.rope_type == "dynamic" and self.rotary_width <= 2:
            raise ValueError(
                f"rope_scaling rope_type 'dynamic' needs a rotated width above 2, got "
                f"{self.rotary_width}"
            )

    def _check_qk_norm(self) -> None:
        kind = self.qk_norm
        if isinstance(kind, str):
            if kind not in QK_NORMS:
                raise ValueError(
                    f"qk_norm must be 'head', 'projection', True or False, got qk_norm={kind!r}"
                )
        else:
            kind = "head" if expect_flag("qk_norm", kind) else False
        object.__setattr__(self, "qk_norm", kind)
        eps = positive_number("qk_norm_eps", self.qk_norm_eps)
        expect_real("qk_norm_offset", self.qk_norm_offset, "a finite float")
        offset = float(self.qk_norm_offset)
        if not np.isfinite(offset):
            raise ValueError(f"qk_norm_offset must be a finite float, got qk_norm_offset={offset}")
        if not kind:
            for name, value, default in (
                ("qk_norm_eps", eps, EPSILON),
                ("qk_norm_offset", offset, 0.0),
            ):
                if value != default:
                    raise ValueError(f"{name}={value} needs qk_norm ('head' or 'projection')")
        object.__setattr__(self, "qk_norm_eps", eps)
        object.__setattr__(self, "qk_norm_offset", offset)

    @property
    def rotary_width(self) -> int:
        """R, the features of each head that RoPE rotates: ``rotary_dim``, else H."""
        return self.head_dim if self.rotary_dim is None else self.rotary_dim

    @property
    def q_width(self) -> int:
        """N H, the width of the query projection and of the concatenated heads."""
        return self.n_heads * self.head_dim

    def has_bias(self, projection: str) -> bool:
        """Whether the projection ``projection`` (``"qkv"``, ``"q"``, ``"kv"`` or
        ``"out"``) has a bias: ``qkv_bias`` or ``out_bias``, else ``use_bias``."""
        own = self.qkv_bias if projection in _INPUT_PROJECTIONS else self.out_bias
        return self.use_bias if own is None else own

    @property
    def kv_heads(self) -> int:
        """K, the number of key/value heads: ``n_kv_heads``, or ``n_heads`` when None."""
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads

    @property
    def groups(self) -> int:
        """G, the query heads that share one key/value head: ``n_heads // kv_heads``."""
        return self.n_heads // self.kv_heads

    @classmethod
    def from_config(cls, config) -> "AttentionConfig":
        """Accepts an AttentionConfig or any object with ``d_model`` and ``n_heads``,
        such as the NanoMoE seed's config; every other field it has (``dropout``,
        ``n_kv_heads``, ...) is taken too, the rest keep their defaults."""
        if isinstance(config, cls):
            return config
        try:
            sizes = {"d_model": config.d_model, "n_heads": config.n_heads}
        except AttributeError as e:
            raise TypeError(
                f"config must be an AttentionConfig or have d_model and n_heads, "
                f"got {type(config).__name__}"
            ) from e
        optional = {
            f.name: getattr(config, f.name)
            for f in dataclasses.fields(cls)
            if f.name not in sizes and hasattr(config, f.name)
        }
        return cls(**sizes, **optional)
