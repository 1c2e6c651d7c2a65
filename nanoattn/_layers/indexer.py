r"""DeepSeek-V3.2's indexer (DeepSeek Sparse Attention): which keys each query of a
latent attention layer reads (docs/latent.md, "DeepSeek-V3.2's sparse attention").

A light attention of Hi heads of width Hi_d scores every key for every query,

.. math::

   I_{ts} = \sum_h w_{th}\, \mathrm{ReLU}\big(\mathrm{scale}\; q_{th} \cdot k_s\big),
   \quad w_{th} = (x_t W_w)_h / \sqrt{Hi}

with ``q = index_q(c_q)`` (from the low-rank query ``c_q``, per head), one key per token
``k = LayerNorm(index_k(x))`` shared by the heads, the first Hr features of both
rotated by RoPE in the half layout at the tokens' positions, and ``scale = Hi_d^-1/2``.
Each query keeps its ``index_topk`` best keys among those causality lets it see: they
become ``key_indices`` of the attention call, which reads only them.

Axis letters: B batch, T queries, S keys, D model width, rq the query's low rank, Hi
the indexer's heads, Hi_d its head width, Hr the RoPE width, k the keys kept.
"""

import jax
import jax.numpy as jnp

from .._core.rope import apply_rope
from .latent_config import LatentConfig


def index_scores(params, cfg: LatentConfig, x, low, positions, dtype):
    """x (B, T, D), the normalized low-rank query ``low`` (B, T, rq), RoPE
    ``positions`` (B, T) or (T,) -> the scores (B, T, T) of every key for every query,
    float32 (no mask applied)."""
    B, T, _ = x.shape
    Hi, Hd, Hr = cfg.index_n_heads, cfg.index_head_dim, cfg.qk_rope_head_dim
    q = params.dense("index_q", low, Hi * Hd, dtype).reshape(B, T, Hi, Hd)  # (B, T, Hi, Hi_d)
    k = params.layer_norm("index_k_norm", params.dense("index_k", x, Hd, dtype), dtype)
    k = k[:, :, None]  # (B, T, 1, Hi_d): one key per token

    def rotate(part):  # the first Hr features, half layout, at the tokens' positions
        turned = apply_rope(part[..., :Hr], positions, base=cfg.rope_base,
                            rope_scaling=cfg.rope_scaling, rope_layout="half")  # fmt: skip
        return jnp.concatenate([turned, part[..., Hr:]], axis=-1).astype(jnp.float32)

    q, k = rotate(q), rotate(k)[:, :, 0]  # (B, T, Hi, Hi_d), (B, T, Hi_d)
    scores = jax.nn.relu(jnp.einsum("BThd,BSd->BThS", q, k) * Hd**-0.5)  # (B, T, Hi, S)
    weights = params.dense("index_weights", x, Hi, dtype).astype(jnp.float32) * Hi**-0.5
    return jnp.einsum("BTh,BThS->BTS", weights, scores)


def top_keys(scores, k: int):
    """The ``k`` best keys (at most T) of each query among its causal ones: ``scores``
    (B, T, T) -> ``key_indices`` int32 (B, T, min(k, T)). A query with fewer than k
    causal keys also names later ones, which causality hides (as DeepSeek's top-k)."""
    T = scores.shape[-1]
    causal = jnp.arange(T)[None, :] <= jnp.arange(T)[:, None]  # (T, T)
    masked = jnp.where(causal, scores, -jnp.inf)
    return jax.lax.top_k(masked, min(k, T))[1].astype(jnp.int32)
