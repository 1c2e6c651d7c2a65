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

from .._backends.native.layer_ops import native_index_scores, serves_layer_ops
from .._core.rope import apply_rope
from .latent_config import LatentConfig


def index_query(params, cfg: LatentConfig, x, low, positions, dtype):
    """x (B, T, D), the normalized low-rank query ``low`` (B, T, rq), RoPE ``positions``
    (B, T) or (T,) -> the indexer's queries (B, T, Hi, Hi_d), rotated, and their head
    weights (B, T, Hi) (``Hi^-1/2`` folded in), float32."""
    B, T, _ = x.shape
    Hi, Hd = cfg.index_n_heads, cfg.index_head_dim
    q = params.dense("index_q", low, Hi * Hd, dtype).reshape(B, T, Hi, Hd)  # (B, T, Hi, Hi_d)
    weights = params.dense("index_weights", x, Hi, dtype).astype(jnp.float32) * Hi**-0.5
    return _rotate(cfg, q, positions), weights


def index_key(params, cfg: LatentConfig, x, positions, dtype):
    """x (B, T, D), RoPE ``positions`` -> the indexer's key of every token (B, T, Hi_d),
    rotated, float32: what a cache keeps of it (one key a token, shared by the heads)."""
    k = params.layer_norm("index_k_norm", params.dense("index_k", x, cfg.index_head_dim, dtype),
                          dtype)  # fmt: skip
    return _rotate(cfg, k[:, :, None], positions)[:, :, 0]


def _rotate(cfg: LatentConfig, part, positions):
    """RoPE on the first Hr features of (B, T, heads, Hi_d), half layout, float32."""
    Hr = cfg.qk_rope_head_dim
    turned = apply_rope(part[..., :Hr], positions, base=cfg.rope_base,
                        rope_scaling=cfg.rope_scaling, rope_layout="half")  # fmt: skip
    return jnp.concatenate([turned, part[..., Hr:]], axis=-1).astype(jnp.float32)


def key_scores(q, weights, keys):
    """The indexer's scores of ``keys`` (B, S, Hi_d) for the queries q (B, T, Hi, Hi_d)
    with their ``weights`` (B, T, Hi): (B, T, S), float32 (no mask applied)."""
    scale = q.shape[-1] ** -0.5
    scores = jax.nn.relu(jnp.einsum("BThd,BSd->BThS", q, keys.astype(jnp.float32)) * scale)
    return jnp.einsum("BTh,BThS->BTS", weights, scores)


def cached_key_scores(cfg: LatentConfig, q, weights, keys):
    """:func:`key_scores` for a decoding step, by the native kernel where it serves the
    layer's ``implementation`` on a CPU (it reads the cached keys in place), else by
    XLA: q (B, T, Hi, Hi_d), weights (B, T, Hi), keys (B, S, 1, Hi_d) (as the cache
    holds them: a slice would be a copy of the cache) -> (B, T, S)."""
    if serves_layer_ops(cfg.implementation):
        return native_index_scores(q, weights, keys, q.shape[-1] ** -0.5)
    return key_scores(q, weights, keys[:, :, 0])


def index_scores(params, cfg: LatentConfig, x, low, positions, dtype):
    """x (B, T, D), the normalized low-rank query ``low`` (B, T, rq), RoPE
    ``positions`` (B, T) or (T,) -> the scores (B, T, T) of every key for every query,
    float32 (no mask applied)."""
    q, weights = index_query(params, cfg, x, low, positions, dtype)
    return key_scores(q, weights, index_key(params, cfg, x, positions, dtype))


def visible_top_keys(scores, positions, k: int):
    """The ``k`` best keys (at most S) of each query among those at or before its
    position: ``scores`` (..., T, S) over key positions 0 .. S - 1, ``positions`` (...,
    T) -> ``key_indices`` int32 (..., T, min(k, S)). A query with fewer than k such keys
    also names later ones, which causality hides (as DeepSeek's top-k)."""
    S = scores.shape[-1]
    keys = jnp.arange(S).reshape((1,) * positions.ndim + (S,))
    visible = keys <= positions[..., None]
    masked = jnp.where(visible, scores, -jnp.inf)
    return jax.lax.top_k(masked, min(k, S))[1].astype(jnp.int32)


def top_keys(scores, k: int):
    """The ``k`` best keys (at most T) of each query among its causal ones: ``scores``
    (B, T, T) -> ``key_indices`` int32 (B, T, min(k, T)) (:func:`visible_top_keys` at
    positions 0 .. T - 1)."""
    return visible_top_keys(scores, jnp.arange(scores.shape[-1]), k)
