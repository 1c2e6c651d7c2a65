"""The linen module of multi-head latent attention (DeepSeek's MLA); the math is
``nanoattn._layers.latent`` (docs/latent.md)."""

import flax.linen as nn
import jax.numpy as jnp

from .. import latent, steps
from ..caches import kv_cache
from ..latent_config import LatentConfig
from .attention import CACHE
from .norm import HeadRMSNorm

_HINT = "create the cache with a longer input (init with jnp.zeros((B, max_len, D)), decode=True)"
_RING_HINT = "init with a longer input (jnp.zeros((B, C, D)), decode=True makes C slots)"
# The projections with a bias under attention_bias (transformers' DeepseekV3Attention).
_BIASED = ("q_a", "kv_a", "out")


class _Kernel(nn.Module):
    """A bare kernel (D_in, features), named like ``nn.Dense``'s ``{"kernel": ...}``."""

    features: int
    param_dtype: object = jnp.float32

    @nn.compact
    def __call__(self, d_in: int):
        init = nn.linear.default_kernel_init
        return self.param("kernel", init, (d_in, self.features), self.param_dtype)


class _Parameters:
    """The linen module's parameters, for ``nanoattn._layers.latent``."""

    def __init__(self, cfg: LatentConfig):
        self.cfg = cfg

    def dense(self, name, x, features, dtype):
        cfg = self.cfg
        if name == "kv_b":  # a bare kernel: the decoding step reads it
            kernel = self.kernel(name).astype(dtype)
            return jnp.einsum("BTr,rf->BTf", x.astype(dtype), kernel)
        use_bias = cfg.attention_bias and name in _BIASED
        return nn.Dense(features, use_bias=use_bias, dtype=dtype, param_dtype=cfg.param_dtype,
                        name=name)(x)  # fmt: skip

    def norm(self, name, x, dtype):
        return HeadRMSNorm(dtype=dtype, param_dtype=self.cfg.param_dtype, eps=self.cfg.norm_eps,
                           name=name)(x)  # fmt: skip

    def layer_norm(self, name, x, dtype):
        return nn.LayerNorm(epsilon=1e-6, dtype=dtype, param_dtype=self.cfg.param_dtype,
                            name=name)(x)  # fmt: skip

    def kernel(self, name):
        cfg = self.cfg
        features = cfg.n_heads * (cfg.qk_nope_head_dim + cfg.v_head_dim)
        return _Kernel(features, cfg.param_dtype, name=name)(cfg.kv_lora_rank)


class LatentAttention(nn.Module):
    r"""Multi-head latent attention (DeepSeek-V2/V3): causal self-attention whose keys and
    values are rebuilt per head from one latent per token.

    .. math::

       c = \mathrm{RMSNorm}(x W_{kv_a}[:r]),\ k_r = \mathrm{RoPE}(x W_{kv_a}[r:]),\
       [k_n | v] = c W_{kv_b},\ q = [q_n | \mathrm{RoPE}(q_r)],\
       y = \mathrm{out}\big(\mathrm{softmax}(\mathrm{scale}\,(q_n k_n + q_r k_r)) v\big)

    Parameters (linen names): ``q`` (D, N (Hn + Hr)) or ``q_a`` (D, rq), ``q_a_norm``
    (rq,), ``q_b`` (rq, N (Hn + Hr)); ``kv_a`` (D, r + Hr), ``kv_a_norm`` (r,), ``kv_b``
    (r, N (Hn + Hv)) (each head's key part, then its value), ``out`` (N Hv, D); with
    DeepSeek-V3.2's indexer (``index_topk``) also ``index_q`` (rq, Hi Hi_d), ``index_k``
    (D, Hi_d), ``index_k_norm`` (LayerNorm ``scale`` and ``bias`` (Hi_d,)) and
    ``index_weights`` (D, Hi), and each query attends to its top keys only (the full
    forward; ``decode=True`` refuses it in one line for now).

    ``decode=True``: ``layer.init(key, jnp.zeros((B, C, D)), decode=True)`` also makes a
    ``"cache"`` collection holding per token only the latent and the rotated RoPE key,
    ``key`` (B, C, 1, r + Hr) (``value`` (B, C, 1, 0): the values are the latent
    itself), ``position`` and ``last`` as in ``CausalSelfAttention`` (with
    ``kv_cache_dtype``, int8 or float8 keys and ``key_scales`` and ``value_scales``
    (B, C, 1)); each
    ``apply(..., chunk, decode=True, mutable=["cache"])`` takes a chunk of any length
    and attends in absorbed form (``nanoattn._layers.latent.decode``), equal to the full
    forward. ``lengths`` (B,) makes rows ragged; ``nanoattn.linen.rewind`` rewinds it.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from nanoattn.linen import LatentAttention, LatentConfig
      >>> cfg = LatentConfig(d_model=32, n_heads=4, kv_lora_rank=16, qk_nope_head_dim=8,
      ...                    qk_rope_head_dim=4, v_head_dim=6, q_lora_rank=12)
      >>> layer = LatentAttention(cfg)
      >>> x = jax.random.normal(jax.random.key(0), (2, 5, 32))
      >>> variables = layer.init(jax.random.key(1), x)
      >>> layer.apply(variables, x).shape
      (2, 5, 32)
      >>> cache = layer.init(jax.random.key(1), jnp.zeros((2, 8, 32)), decode=True)["cache"]
      >>> jax.tree.map(jnp.shape, cache)["key"]
      (2, 8, 1, 20)
    """

    config: LatentConfig

    @nn.compact
    def __call__(self, x, *, mask=None, positions=None, segment_ids=None, decode: bool = False,
                 lengths=None, pages=None, mask_fn=None, score_fn=None, tree_parents=None,
                 deterministic: bool | None = None):  # fmt: skip
        """x (B, T, D) -> (B, T, D); the options as ``CausalSelfAttention``'s (``mask``
        broadcastable to (B, N, T, S); ``positions`` and ``segment_ids`` only without
        ``decode``; ``lengths``, ``pages`` and ``tree_parents``, a token tree whose
        accepted path ``nanoattn.linen.accept(cache, kept, config)`` keeps, only with
        it). ``deterministic`` is accepted as the other layers take it (this layer has
        no dropout)."""
        cfg = self.config
        params = _Parameters(cfg)
        steps.check_mode(decode, positions=positions, segment_ids=segment_ids, lengths=lengths,
                         pages=pages, tree_parents=tree_parents)  # fmt: skip
        if not decode:
            return latent.forward(
                params, cfg, x, mask=mask, positions=positions, segment_ids=segment_ids,
                mask_fn=mask_fn, score_fn=score_fn,
            )  # fmt: skip
        fresh = not self.has_variable(CACHE, "key")
        if fresh and not self.is_initializing():
            raise ValueError(
                "decode=True needs a cache: create one with variables = layer.init(key, "
                "jnp.zeros((B, max_len, D)), decode=True)"
            )
        B, T, _ = x.shape
        dtype = latent.compute_dtype(cfg, x)
        variables = {
            name: self.variable(CACHE, name, lambda name=name: getattr(
                latent.empty_cache(cfg, B, T, dtype), name))
            for name in kv_cache.fields(quantized=cfg.kv_cache_dtype is not None)
        }  # fmt: skip
        if fresh:  # init: an empty cache of capacity T; the output is the full forward
            return latent.forward(params, cfg, x, mask=mask, mask_fn=mask_fn, score_fn=score_fn)
        cache = kv_cache.KVCache(**{name: v.value for name, v in variables.items()})
        hint = _RING_HINT if cfg.rolling_cache else _HINT
        y, cache = latent.decode(params, cfg, x, cache, mask=mask, lengths=lengths, pages=pages,
                                 mask_fn=mask_fn, score_fn=score_fn, tree_parents=tree_parents,
                                 hint=hint)  # fmt: skip
        for name, variable in variables.items():
            variable.value = getattr(cache, name)
        return y
