"""The NNX module of multi-head latent attention (DeepSeek's MLA): the same parameters
(names and shapes), math and cache as ``nanoattn.linen.LatentAttention``; the math is
``nanoattn._layers.latent`` (docs/latent.md)."""

import jax.numpy as jnp
from flax import nnx

from ..._base.validate import float_dtype
from .. import latent, steps
from ..caches.kinds import policy_of
from ..latent_config import LatentConfig
from ..norm import layer_norm
from .attention import KVCache
from .parameters import HeadRMSNorm, linear

_HINT = "allocate a larger cache: init_cache(batch, max_len) with a longer max_len"
_BIASED = ("q_a", "kv_a", "out")


class _Parameters:
    def __init__(self, module: "LatentAttention"):
        self.module = module

    def dense(self, name, x, features, dtype):
        return linear(getattr(self.module, name), x, dtype)

    def norm(self, name, x, dtype):
        return getattr(self.module, name)(x, dtype)

    def kernel(self, name):
        return getattr(self.module, name).kernel[...]

    def layer_norm(self, name, x, dtype):
        norm = getattr(self.module, name)
        return layer_norm(x, norm.scale[...], norm.bias[...], eps=1e-6).astype(dtype)


class LatentAttention(nnx.Module):
    """Multi-head latent attention (DeepSeek-V2/V3), as ``nanoattn.linen.LatentAttention``:
    ``module(x)`` is the training forward; after ``module.init_cache(batch, max_len)``,
    ``module(chunk, decode=True)`` decodes in absorbed form over a latent cache
    (``module.cache``: ``key`` (B, C, 1, r + Hr), ``value`` (B, C, 1, 0)), and
    ``module.rewind(n)`` takes tokens back. Parameters: ``q`` or ``q_a``/``q_a_norm``/
    ``q_b``, ``kv_a``, ``kv_a_norm``, ``kv_b``, ``out`` (``nnx.Linear``, kernels
    (D_in, features), and RMSNorm scales), named as the linen module's.
    """

    def __init__(self, config: LatentConfig, *, rngs: nnx.Rngs):
        cfg = self.config = config
        N, D = cfg.n_heads, cfg.d_model
        qk = N * cfg.qk_head_dim

        def linear_(d_in, features, name):
            use_bias = cfg.attention_bias and name in _BIASED
            return nnx.Linear(d_in, features, use_bias=use_bias, param_dtype=cfg.param_dtype,
                              rngs=rngs)  # fmt: skip

        def norm(features):
            return HeadRMSNorm(features, param_dtype=cfg.param_dtype, eps=cfg.norm_eps)

        if cfg.q_lora_rank is None:
            self.q = linear_(D, qk, "q")
        else:
            self.q_a = linear_(D, cfg.q_lora_rank, "q_a")
            self.q_a_norm = norm(cfg.q_lora_rank)
            self.q_b = linear_(cfg.q_lora_rank, qk, "q_b")
        self.kv_a = linear_(D, cfg.cache_width, "kv_a")
        self.kv_a_norm = norm(cfg.kv_lora_rank)
        self.kv_b = linear_(cfg.kv_lora_rank, N * (cfg.qk_nope_head_dim + cfg.v_head_dim), "kv_b")
        self.out = linear_(N * cfg.v_head_dim, D, "out")
        if cfg.indexed:  # DeepSeek-V3.2's indexer
            Hi, Hd = cfg.index_n_heads, cfg.index_head_dim
            self.index_q = linear_(cfg.q_lora_rank, Hi * Hd, "index_q")
            self.index_k = linear_(D, Hd, "index_k")
            self.index_k_norm = nnx.LayerNorm(Hd, epsilon=1e-6, param_dtype=cfg.param_dtype,
                                              rngs=rngs)  # fmt: skip
            self.index_weights = linear_(D, Hi, "index_weights")
        self.cache = nnx.data(None)

    def init_cache(self, batch: int, max_len: int, dtype=None) -> None:
        """An empty latent cache of ``max_len`` tokens for ``batch`` rows, in ``dtype``
        (default ``config.dtype``, else ``config.param_dtype``); with
        ``config.kv_cache_dtype``, in that dtype with its scales."""
        cfg = self.config
        if dtype is None:
            dtype = cfg.param_dtype if cfg.dtype is None else cfg.dtype
        policy_of(cfg).check_capacity(max_len, _HINT)
        self.cache = KVCache(latent.empty_cache(cfg, batch, max_len, float_dtype("dtype", dtype)))

    def __call__(self, x, *, mask=None, positions=None, segment_ids=None, decode: bool = False,
                 lengths=None, pages=None, mask_fn=None, score_fn=None, tree_parents=None,
                 deterministic: bool | None = None):  # fmt: skip
        """x (B, T, D) -> (B, T, D); the options as the linen module's (``deterministic``
        accepted, unused: no dropout; ``tree_parents``, a token tree, with ``decode``:
        keep its accepted path with :meth:`accept`)."""
        params = _Parameters(self)
        steps.check_mode(decode, positions=positions, segment_ids=segment_ids, lengths=lengths,
                         pages=pages, tree_parents=tree_parents)  # fmt: skip
        if not decode:
            return latent.forward(
                params, self.config, x, mask=mask, positions=positions, segment_ids=segment_ids,
                mask_fn=mask_fn, score_fn=score_fn,
            )  # fmt: skip
        if self.cache is None:
            raise ValueError("decode=True needs a cache: call init_cache(batch, max_len) first")
        y, cache = latent.decode(
            params, self.config, jnp.asarray(x), self.cache.get(), mask=mask, lengths=lengths,
            pages=pages, mask_fn=mask_fn, score_fn=score_fn, tree_parents=tree_parents,
            hint=_HINT,
        )  # fmt: skip
        self.cache.set(cache)
        return y

    def rewind(self, n) -> None:
        """Moves each row b of the cache back by ``n[b]`` tokens (its last call's at most)."""
        if self.cache is None:
            raise ValueError("rewind needs a cache: call init_cache(batch, max_len) first")
        self.cache.set(policy_of(self.config).rewind(self.cache.get(), n))

    def accept(self, kept) -> None:
        """Keeps the accepted path of the last call's token tree (``kept`` (B, A), as
        ``nanoattn.linen.accept`` takes it), moved into place; the rest taken back."""
        if self.cache is None:
            raise ValueError("accept needs a cache: call init_cache(batch, max_len) first")
        self.cache.set(policy_of(self.config).accept(self.cache.get(), kept))
