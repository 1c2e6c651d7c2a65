"""The configuration of multi-head latent attention (DeepSeek-V2/V3's MLA): a frozen
dataclass validated on construction (docs/latent.md).

Axis letters (docs/conventions.md): D model width, N heads, r the latent width
(``kv_lora_rank``), Hn the per-head key width without position (``qk_nope_head_dim``),
Hr the width of the shared RoPE key (``qk_rope_head_dim``), Hv the value width
(``v_head_dim``), rq the query's low rank (``q_lora_rank``).
"""

import dataclasses
import math
from typing import Any

import jax.numpy as jnp
import numpy as np

from .._backends.registry import check_implementation
from .._base.quantized import check_storage
from .._base.rules import check_soft_cap, normalize_window
from .._base.validate import expect_flag, float_dtype, positive_number
from .._core.rope import check_layout as check_rope_layout
from .._core.rope import rope_scaling_of


def _positive_int(name: str, value) -> int:
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return int(value)


def yarn_mscale(factor: float, mscale: float) -> float:
    """DeepSeek's YaRN magnitude ``0.1 * mscale * ln(factor) + 1`` (1 for factor <= 1)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


@dataclasses.dataclass(frozen=True)
class LatentConfig:
    """Sizes and options of a multi-head latent attention layer.

    Attributes:
      d_model: D, the model width.
      n_heads: N, the query (and key and value) heads.
      kv_lora_rank: r, the width of the latent each token's keys and values are
        rebuilt from (512 in DeepSeek-V3); the cache holds it.
      qk_nope_head_dim: Hn, each head's key and query features without position (128).
      qk_rope_head_dim: Hr, the width of the RoPE part: a query part per head, one key
        shared by every head (64); even.
      v_head_dim: Hv, each head's value width (128).
      q_lora_rank: rq, the low rank of the query (``q_a`` D -> rq, its RMSNorm, ``q_b``
        rq -> N (Hn + Hr)), or None for one projection ``q`` (DeepSeek-V2-Lite).
      rope_base: the RoPE frequency base.
      rope_scaling: None or a ``rope_scaling`` mapping (``nanoattn.apply_rope``); with
        ``mscale_all_dim`` the softmax scale grows by ``yarn_mscale(factor,
        mscale_all_dim) ** 2``, as DeepSeek's.
      rope_layout: ``"interleaved"`` (features 2i and 2i + 1 pair, DeepSeek's
        ``rope_interleave=True``) or ``"half"``.
      window, logit_soft_cap: as in ``AttentionConfig`` (a causal window (W, 0) for a
        rolling cache).
      rolling_cache, page_size: the cache kind when decoding, as in
        ``AttentionConfig``: a full cache by default.
      kv_cache_dtype: None (the cache holds the latent and the RoPE key in the compute
        dtype), ``"int8"`` or ``"float8_e4m3fn"``: every kind of latent cache stores
        them quantized, one float32 scale per token over its r + Hr numbers
        (``nanoattn.quantize_kv``); the attention reads the values, a slice of the
        keys, with the keys' scales (docs/latent.md, "A quantized latent cache").
      index_n_heads, index_head_dim, index_topk: DeepSeek-V3.2's indexer (DeepSeek
        Sparse Attention), all three or none; it needs ``q_lora_rank``. Hi heads of
        width Hi_d (at least Hr) score every earlier key, ReLU(q . k) weighted per
        head, and each query attends to its ``index_topk`` best keys only
        (``key_indices``; docs/latent.md, "DeepSeek-V3.2's sparse attention"). A
        decoding step keeps each token's indexer key in the cache's value slots (full
        and paged caches, quantized too; not a rolling one) and chooses among the
        cached keys.
      norm_eps: the epsilon of the latent's and the query's RMSNorm (1e-6).
      attention_bias: biases on ``q_a``, ``kv_a`` and ``out`` (never on ``q``, ``q_b``
        and ``kv_b``), as transformers' ``attention_bias``.
      implementation: the backend (``nanoattn.dot_product_attention``), None: automatic.
      dtype: the compute dtype, None: the input's.
      param_dtype: the parameters' dtype.
    """

    d_model: int
    n_heads: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    q_lora_rank: int | None = None
    rope_base: float = 10000.0
    rope_scaling: Any = None
    rope_layout: str = "interleaved"
    window: Any = None
    logit_soft_cap: float | None = None
    rolling_cache: bool = False
    page_size: int | None = None
    kv_cache_dtype: str | None = None
    index_n_heads: int | None = None
    index_head_dim: int | None = None
    index_topk: int | None = None
    norm_eps: float = 1e-6
    attention_bias: bool = False
    implementation: str | None = None
    dtype: Any = None
    param_dtype: Any = jnp.float32

    def __post_init__(self):
        for name in ("d_model", "n_heads", "kv_lora_rank", "qk_nope_head_dim",
                     "qk_rope_head_dim", "v_head_dim"):  # fmt: skip
            _positive_int(name, getattr(self, name))
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"qk_rope_head_dim must be even, got {self.qk_rope_head_dim}")
        if self.q_lora_rank is not None:
            _positive_int("q_lora_rank", self.q_lora_rank)
        self._check_indexer()
        positive_number("rope_base", self.rope_base)
        positive_number("norm_eps", self.norm_eps)
        set_ = object.__setattr__
        set_(self, "rope_scaling", rope_scaling_of(self.rope_scaling))
        check_rope_layout(self.rope_layout)
        set_(self, "window", normalize_window(self.window))
        set_(self, "logit_soft_cap", check_soft_cap(self.logit_soft_cap))
        expect_flag("rolling_cache", self.rolling_cache)
        expect_flag("attention_bias", self.attention_bias)
        if self.rolling_cache and (self.window is None or self.window[1] != 0):
            raise ValueError(f"rolling_cache needs a causal window=(W, 0), got {self.window}")
        if self.page_size is not None:
            _positive_int("page_size", self.page_size)
            if self.rolling_cache:
                raise ValueError("page_size and rolling_cache are two cache kinds: pick one")
        if self.kv_cache_dtype is not None:
            set_(self, "kv_cache_dtype", check_storage("kv_cache_dtype", self.kv_cache_dtype))
        check_implementation(self.implementation)
        if self.dtype is not None:
            set_(self, "dtype", float_dtype("dtype", self.dtype))
        set_(self, "param_dtype", float_dtype("param_dtype", self.param_dtype))

    def _check_indexer(self) -> None:
        names = ("index_n_heads", "index_head_dim", "index_topk")
        given = [name for name in names if getattr(self, name) is not None]
        if not given:
            return
        if len(given) < 3:
            missing = next(name for name in names if name not in given)
            raise ValueError(f"{given[0]} needs {missing} too: the indexer takes all three")
        for name in names:
            _positive_int(name, getattr(self, name))
        if self.q_lora_rank is None:
            raise ValueError("index_topk needs q_lora_rank: the indexer's query reads the "
                             "low-rank query")  # fmt: skip
        if self.rolling_cache:
            raise ValueError(
                "index_topk is not supported with rolling_cache: the indexer chooses keys by "
                "position, and a ring's slots are not positions (use a full or paged cache)"
            )
        if self.index_head_dim < self.qk_rope_head_dim:
            raise ValueError(
                f"index_head_dim must be at least qk_rope_head_dim ({self.qk_rope_head_dim}): "
                f"RoPE turns its first Hr features, got {self.index_head_dim}"
            )

    @property
    def indexed(self) -> bool:
        """Whether the layer has DeepSeek-V3.2's indexer (``index_topk`` set)."""
        return self.index_topk is not None

    sink_tokens = 0  # the cache policies' question; MLA keeps no sink tokens

    @property
    def qk_head_dim(self) -> int:
        """Hn + Hr: the width of a query and of a key head."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def cache_width(self) -> int:
        """r + Hr: what the cache holds per token (the latent and the RoPE key)."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def scale(self) -> float:
        """The softmax scale ``1 / sqrt(Hn + Hr)``, times ``yarn_mscale(factor,
        mscale_all_dim) ** 2`` when ``rope_scaling`` sets ``mscale_all_dim``."""
        scale = self.qk_head_dim**-0.5
        scaling = self.rope_scaling
        if scaling is not None and getattr(scaling, "mscale_all_dim", None):
            scale *= yarn_mscale(scaling.factor, scaling.mscale_all_dim) ** 2
        return scale
