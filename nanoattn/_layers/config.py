"""The attention configuration: a frozen dataclass validated on construction."""

import dataclasses
from typing import Any

import jax.numpy as jnp
import numpy as np

from .._backends.registry import check_implementation
from .._core.base.dropout import check_rate
from .._core.base.rules import check_soft_cap, normalize_window
from .._core.base.validate import expect_flag, float_dtype, positive_number
from .._core.base.zigzag import check_layout


def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)


def _is_int(x) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


@dataclasses.dataclass(frozen=True)
class AttentionConfig:
    """Sizes and options of an attention layer.

    Axis letters (docs/conventions.md): D model width, N query heads, K
    key/value heads, G = N / K query heads per key/value head, H = D / N head
    width.

    Attributes:
      d_model: D, the model width.
      n_heads: N, the number of query heads; must divide ``d_model``.
      dropout: dropout rate on the attention weights, in [0, 1).
      implementation: the attention backend, ``"xla"``, ``"flash"``,
        ``"native"``, ``"cudnn"`` or None for the automatic choice (see
        ``nanoattn.dot_product_attention``). Training with dropout uses the
        reference under the automatic choice.
      n_kv_heads: K, the number of key/value heads; must divide ``n_heads``.
        None means K = N (multi-head attention); 1 < K < N is grouped-query
        attention, K = 1 multi-query attention.
      rope_base: None for no rotary embedding, else the frequency base of
        ``nanoattn.apply_rope`` applied to queries and keys (needs an even H).
      window: None, an int ``w`` (meaning ``(w, w)``) or ``(left, right)``:
        a query at position p sees keys at ``p - left .. p + right`` (ANDed
        with causality). Stored as ``(left, right)``.
      logit_soft_cap: None or a float ``cap`` > 0: logits become
        ``cap * tanh(logits / cap)`` before the softmax (Gemma 2).
      qk_norm: RMSNorm over H on every query and key head, with a learned
        scale per feature, before RoPE (Gemma 3, OLMo 2).
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
      sink_tokens: S0 >= 0, needs a ``window``: the first S0 positions stay
        visible to every later query in addition to the window (StreamingLLM),
        in training and decoding; a rolling cache keeps their slots. Not the
        learned logit ``sinks``.
      use_bias: whether the projections have biases.
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
    qk_norm: bool = False
    use_bias: bool = True
    dtype: Any = None
    param_dtype: Any = jnp.float32
    head_axis: str | None = None
    sequence_axis: str | None = None
    sequence_layout: str = "zigzag"
    sinks: bool = False
    rolling_cache: bool = False
    sink_tokens: int = 0
    page_size: int | None = None

    def __post_init__(self):
        for name in ("d_model", "n_heads"):
            if not _is_int(getattr(self, name)):
                raise TypeError(f"{name} must be an int >= 1, got {name}={getattr(self, name)!r}")
        if self.n_heads < 1:
            raise ValueError(f"n_heads must be >= 1, got n_heads={self.n_heads}")
        if self.d_model < 1:
            raise ValueError(f"d_model must be >= 1, got d_model={self.d_model}")
        if self.d_model % self.n_heads != 0:
            raise ValueError(
                f"d_model={self.d_model} is not divisible by n_heads={self.n_heads}, so the "
                f"heads cannot split it into equal widths; head counts that divide "
                f"{self.d_model}: {_divisors(self.d_model)}"
            )
        check_rate("dropout", self.dropout)
        check_implementation(self.implementation)
        self._check_kv_heads()
        self._check_rope()
        self._check_mesh_axes()
        object.__setattr__(self, "window", normalize_window(self.window))
        object.__setattr__(self, "logit_soft_cap", check_soft_cap(self.logit_soft_cap))
        for name in ("qk_norm", "use_bias", "sinks", "rolling_cache"):
            expect_flag(name, getattr(self, name))
        self._check_streaming()
        self._check_paging()
        if self.dtype is not None:
            object.__setattr__(self, "dtype", float_dtype("dtype", self.dtype))
        object.__setattr__(self, "param_dtype", float_dtype("param_dtype", self.param_dtype))

    def _check_paging(self) -> None:
        size = self.page_size
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
        K = self.n_kv_heads
        if K is None:
            return
        if not _is_int(K):
            raise TypeError(f"n_kv_heads must be an int or None, got {K!r}")
        if K < 1:
            raise ValueError(f"n_kv_heads must be >= 1 or None, got n_kv_heads={K}")
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

    def _check_rope(self) -> None:
        if positive_number("rope_base", self.rope_base, optional=True) is None:
            return
        if self.head_dim % 2:
            raise ValueError(
                f"rope_base needs an even head width H, got H={self.head_dim} "
                f"(d_model={self.d_model} / n_heads={self.n_heads})"
            )

    @property
    def head_dim(self) -> int:
        """H, the width of one head: ``d_model // n_heads``."""
        return self.d_model // self.n_heads

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
