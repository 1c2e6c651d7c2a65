r"""Multi-head latent attention (DeepSeek-V2/V3's MLA), written once for linen and NNX:
the training forward, and the decoding step in absorbed form over a latent cache
(docs/latent.md).

Per token, the keys and values of every head are rebuilt from one latent
``c = RMSNorm(x W_dkv)`` (width r) and one RoPE key ``k_r = RoPE(x W_kr)`` (width Hr)
shared by the heads; the queries are ``q = [q_n | RoPE(q_r)]`` per head (from ``x``
directly, or through a low-rank ``q_a``/RMSNorm/``q_b``):

.. math::

   k_n = c W_{uk}, \quad v = c W_{uv}, \quad
   \mathrm{score} = \mathrm{scale}\,(q_n \cdot k_n + q_r \cdot k_r)

The decoding step never rebuilds ``k_n`` or ``v`` for the cached tokens: since
``q_n \cdot (c W_uk) = (q_n W_uk^T) \cdot c``, the query moves into latent space, and
``softmax(.) (c W_uv) = (softmax(.) c) W_uv``, the value projection follows the
attention. So the step is multi-query attention (K = 1) with key ``[c | k_r]`` (width
r + Hr) and value ``c`` (width r, :attr:`Rules.Hv` != H), over a cache of
(B, C, 1, r + Hr) per layer: the values are a slice of the keys, stored once (the
cache's value array has width 0). A quantized cache (``kv_cache_dtype``) keeps one scale
per token for its r + Hr numbers, and the values, that slice, are read with it.

Axis letters: B batch, T query time, S key time, C cache capacity, N heads, D model
width, r latent width, Hn, Hr, Hv the nope, rope and value widths.
"""

from typing import Protocol

import jax
import jax.numpy as jnp
import numpy as np

from .._base.paged import safe_page_table, token_layout
from .._base.trace import check_shape
from .._base.validate import expect_floating, expect_integer, expect_shape
from .._core.api import dot_product_attention
from .._core.paged import paged_attention
from .._core.rope import apply_rope
from .absorbed import key_absorbed, up_projections, values_projected
from .caches import kv_cache
from .caches.kinds import policy_of
from .caches.tree import parents_of
from .indexer import (
    cached_key_scores,
    index_key,
    index_query,
    index_scores,
    top_keys,
    visible_top_keys,
)
from .latent_config import LatentConfig


class LatentParameters(Protocol):
    """What a latent attention module provides to these steps."""

    def dense(self, name: str, x: jax.Array, features: int, dtype) -> jax.Array:
        """The projection ``name`` (kernel (D_in, features), optional bias) of x."""

    def norm(self, name: str, x: jax.Array, dtype) -> jax.Array:
        """The RMSNorm ``name`` (``q_a_norm`` or ``kv_a_norm``) over x's last axis."""

    def kernel(self, name: str) -> jax.Array:
        """The kernel (D_in, features) of the projection ``name`` (``kv_b``)."""

    def layer_norm(self, name: str, x: jax.Array, dtype) -> jax.Array:
        """The LayerNorm ``name`` (``index_k_norm``: scale and bias) over x's last axis."""


def compute_dtype(cfg: LatentConfig, x):
    """``cfg.dtype``, else the input's (a floating dtype)."""
    if cfg.dtype is None:
        expect_floating("x", jnp.result_type(x))
        return jnp.dtype(x.dtype)
    return cfg.dtype


def query(params: LatentParameters, cfg: LatentConfig, x, dtype):
    """x (B, T, D) -> the query's parts (B, T, N, Hn) and (B, T, N, Hr), not rotated, and
    its normalized low rank (B, T, rq) (None without ``q_lora_rank``)."""
    B, T, _ = x.shape
    N, Hn, Hr = cfg.n_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim
    low = None
    if cfg.q_lora_rank is None:
        q = params.dense("q", x, N * (Hn + Hr), dtype)
    else:
        low = params.norm("q_a_norm", params.dense("q_a", x, cfg.q_lora_rank, dtype), dtype)
        q = params.dense("q_b", low, N * (Hn + Hr), dtype)
    q = q.reshape(B, T, N, Hn + Hr)  # (B, T, N, Hn + Hr)
    check_shape(q, "q heads", "B T N H", (B, T, N, Hn + Hr), op="reshape", source="q")
    return q[..., :Hn], q[..., Hn:], low


def latent(params: LatentParameters, cfg: LatentConfig, x, dtype):
    """x (B, T, D) -> the normalized latent (B, T, r) and the RoPE key (B, T, 1, Hr),
    not rotated: what the cache holds per token, once rotated."""
    B, T, _ = x.shape
    r = cfg.kv_lora_rank
    ckv = params.dense("kv_a", x, cfg.cache_width, dtype)  # (B, T, r + Hr)
    check_shape(ckv, "kv_a", "B T r+Hr", (B, T, cfg.cache_width), op="project", source="input")
    c = params.norm("kv_a_norm", ckv[..., :r], dtype)
    return c, ckv[..., None, r:]  # (B, T, r), (B, T, 1, Hr)


def rotate(cfg: LatentConfig, x, positions):
    """RoPE on the rope parts (B, T, N|1, Hr) at ``positions`` (B, T) or (T,)."""
    return apply_rope(
        x, positions, base=cfg.rope_base, rope_scaling=cfg.rope_scaling,
        rope_layout=cfg.rope_layout,
    )  # fmt: skip


def _out(params: LatentParameters, cfg: LatentConfig, out, dtype):
    """Per-head outputs (B, T, N, Hv) concatenated and projected: (B, T, D)."""
    B, T = out.shape[:2]
    merged = out.reshape(B, T, cfg.n_heads * cfg.v_head_dim)  # (B, T, N Hv)
    y = params.dense("out", merged, cfg.d_model, dtype)
    return check_shape(y, "output", "B T D", (B, T, cfg.d_model), op="project", source="heads")


def _options(cfg: LatentConfig) -> dict:
    return dict(scale=cfg.scale, logit_soft_cap=cfg.logit_soft_cap,
                implementation=cfg.implementation)  # fmt: skip


def forward(params: LatentParameters, cfg: LatentConfig, x, *, mask=None, positions=None,
            segment_ids=None, mask_fn=None, score_fn=None):  # fmt: skip
    """Causal self-attention over the whole of x (B, T, D) -> (B, T, D), each head's key
    and value rebuilt from the latent: keys (B, T, N, Hn + Hr), values (B, T, N, Hv).

    ``mask`` broadcastable to (B, N, T, T) (a padding mask), ``positions`` (B, T) or
    (T,) int what RoPE rotates by (default ``arange(T)``), ``segment_ids`` (B, T);
    ``mask_fn`` and ``score_fn`` see positions ``0 .. T - 1``; the config's window
    and soft-cap apply. With the config's indexer (DeepSeek-V3.2) each query attends to
    its ``index_topk`` best keys only (:mod:`.indexer`), which ``mask``, ``segment_ids``,
    ``mask_fn`` and ``score_fn`` do not go with (one line).
    """
    expect_shape("x", jnp.shape(x), "B T D", (None, None, cfg.d_model))
    B, T, _ = x.shape
    dtype = compute_dtype(cfg, x)
    if positions is None:
        positions = np.arange(T)
    else:
        positions = jnp.asarray(positions)
        expect_integer("positions", positions.dtype)
        if positions.ndim == 1:
            expect_shape("positions", positions.shape, "T", (T,))
        else:
            expect_shape("positions", positions.shape, "B T", (B, T))
    rules = dict(mask=mask, is_causal=True, window=cfg.window, mask_fn=mask_fn, score_fn=score_fn)
    if segment_ids is not None:
        segment_ids = jnp.asarray(segment_ids)
        expect_integer("segment_ids", segment_ids.dtype)
        expect_shape("segment_ids", segment_ids.shape, "B T", (B, T))
        rules |= dict(q_segment_ids=segment_ids, kv_segment_ids=segment_ids)
    q_nope, q_rope, low = query(params, cfg, x, dtype)
    if cfg.indexed:  # DeepSeek-V3.2: each query reads only its indexer's top keys
        scores = index_scores(params, cfg, x, low, positions, dtype)
        rules["key_indices"] = top_keys(scores, cfg.index_topk)
    c, k_rope = latent(params, cfg, x, dtype)
    N, Hn = cfg.n_heads, cfg.qk_nope_head_dim
    kv = params.dense("kv_b", c, N * (Hn + cfg.v_head_dim), dtype)
    kv = kv.reshape(B, T, N, Hn + cfg.v_head_dim)  # (B, T, N, Hn + Hv)
    k_rope = jnp.broadcast_to(rotate(cfg, k_rope, positions), (B, T, N, cfg.qk_rope_head_dim))
    q = jnp.concatenate([q_nope, rotate(cfg, q_rope, positions)], axis=-1)  # (B, T, N, Hn+Hr)
    k = jnp.concatenate([kv[..., :Hn], k_rope], axis=-1)  # (B, T, N, Hn + Hr)
    out = dot_product_attention(q, k, kv[..., Hn:], **rules, **_options(cfg))  # (B, T, N, Hv)
    return _out(params, cfg, out, dtype)


def empty_cache(cfg: LatentConfig, batch: int, capacity: int, dtype) -> kv_cache.KVCache:
    """A fresh latent cache: keys (B, C, 1, r + Hr), the latent and the rotated RoPE key
    of each token; values of width 0 (they are the keys' first r features), or with the
    indexer (DeepSeek-V3.2) of width Hi_d: each token's rotated indexer key, in the
    value slots (every kind of cache writes, moves and takes them back with the keys).
    In ``dtype``, or quantized with ``cfg.kv_cache_dtype``: then ``key_scales`` (B, C,
    1), one scale a token, and ``value_scales`` (B, C, 1), the value slots' (the
    indexer keys' own; never read without an indexer: the attention's values are read
    with the keys' scales)."""
    storage = cfg.kv_cache_dtype or dtype
    index_width = cfg.index_head_dim if cfg.indexed else 0
    return policy_of(cfg).empty(batch, capacity, 1, cfg.cache_width, storage,
                                value_dim=index_width)  # fmt: skip


def _scales(key_scales) -> dict:
    """The scale keywords of a latent attention call: none for a float cache; for a
    quantized one the keys' scales, for the values too (they are a slice of the keys;
    the cache's ``value_scales`` are the width-0 values' and are never read)."""
    return {} if key_scales is None else dict(key_scales=key_scales, value_scales=key_scales)


def decode(params: LatentParameters, cfg: LatentConfig, x, cache: kv_cache.KVCache, *, mask=None,
           lengths=None, pages=None, mask_fn=None, score_fn=None, tree_parents=None,
           hint: str):  # fmt: skip
    """One decoding step in absorbed form: writes the chunk's latents and RoPE keys into
    the cache and attends, equal to :func:`forward` at every position.

    Row b's tokens sit at positions ``cache.position[b] + t``, the first ``lengths[b]``
    real, as in ``nanoattn._layers.steps.decode`` (the same cache policies: full,
    rolling, paged with ``pages``; invalid calls raise when concrete and poison their
    rows under ``jit``), a token tree with ``tree_parents`` as there (RoPE by depth,
    each query its root-to-leaf path alone). With W_uk, W_uv the slices of ``kv_b``:

      q_lat = q_n W_uk^T (B, T, N, r);  o_lat = attention([q_lat | q_r], [c | k_r], c)
      out = o_lat W_uv (B, T, N, Hv)

    Returns:
      (y (B, T, D), the advanced cache).
    """
    expect_shape("x", jnp.shape(x), "B T D", (None, None, cfg.d_model))
    B = x.shape[0]
    dtype = compute_dtype(cfg, x)
    if lengths is not None:
        lengths = jnp.asarray(lengths)
        expect_integer("lengths", lengths.dtype)
        expect_shape("lengths", lengths.shape, "B", (B,))
    policy = policy_of(cfg)
    tree_parents = parents_of(tree_parents, x.shape[:2])
    layout = policy.prepare(cache, x.shape, lengths=lengths, pages=pages, hint=hint,
                            tree_parents=tree_parents)  # fmt: skip
    c, k_rope = latent(params, cfg, x, dtype)
    entry = jnp.concatenate([c[:, :, None], rotate(cfg, k_rope, layout.positions)], axis=-1)
    values = entry[..., :0]  # width 0, or the indexer's keys
    if cfg.indexed:
        values = index_key(params, cfg, x, layout.positions, dtype)[:, :, None].astype(dtype)
    cache = policy.write_step(cache, entry, values, layout)  # keys (B, T, 1, r + Hr)
    q_nope, q_rope, low = query(params, cfg, x, dtype)
    selection = {}
    if cfg.indexed:  # DeepSeek-V3.2: each query reads its indexer's top cached keys
        selection["key_indices"] = cached_top_keys(params, cfg, x, low, cache, layout, dtype)
    w = up_projections(params, cfg, dtype)  # (r, N, Hn + Hv)
    q_lat = key_absorbed(cfg, q_nope, w)  # the key projection absorbed (B, T, N, r)
    q = jnp.concatenate([q_lat, rotate(cfg, q_rope, layout.positions)], axis=-1)  # (.., r+Hr)
    r = cfg.kv_lora_rank

    # The values are the keys' first r features (c): the call reads the whole key rows
    # as values, with the keys' scales when quantized, and keeps the first r features of
    # its output. A slice keys[..., :r] would be a strided copy of the cache every step
    # (about 10 ms at 32768 keys of DeepSeek's widths); the Hr more output features
    # cost Hr / r of the value product.
    def dense(q, keys, values, key_scales=None, value_scales=None, **rules):
        # keys (B, C, 1, r + Hr)
        out = dot_product_attention(q, keys, keys, **rules, **selection,
                                    **_scales(key_scales), **_options(cfg))  # fmt: skip
        return out[..., :r]

    def paged(q, key_pages, value_pages, batch, key_scales=None, value_scales=None, **rules):
        out = paged_attention(
            q[0], key_pages, key_pages, batch.page_table, batch.kv_lengths,
            batch.query_starts, **rules, **selection, **_scales(key_scales), **_options(cfg),
        )  # fmt: skip
        return out[None, ..., :r]

    o_lat = policy.attention(
        cache, layout, q, dense=dense, paged=paged, mask=mask, mask_fn=mask_fn, score_fn=score_fn
    )  # (B, T, N, r)
    out = values_projected(cfg, o_lat, w)  # the value projection after (B, T, N, Hv)
    y = _out(params, cfg, out, dtype)
    y = jnp.where(layout.real[..., None], y, 0)
    y = jnp.where(layout.broken[..., None], jnp.nan, y).astype(y.dtype)  # only under jit
    return y, policy.advance(cache, layout)


def cached_top_keys(params: LatentParameters, cfg: LatentConfig, x, low, cache, layout, dtype):
    """The indexer's choice for a decoding step (DeepSeek-V3.2): each query's
    ``index_topk`` best keys among the cached ones at or before its position, scored
    against the indexer keys the cache holds in its value slots (this step's written):
    ``key_indices`` (B, T, k) over a full cache's slots (its positions), or (Tq, k) over
    a paged step's sequences' positions (each query scores its own sequence's keys,
    gathered through the page table)."""
    q, weights = index_query(params, cfg, x, low, layout.positions, dtype)
    keys = cache.value.astype(jnp.float32)  # (B, C, 1, Hi_d) or the pool (P, ps, 1, Hi_d)
    if cache.value_scales is not None:
        keys = keys * cache.value_scales[..., None]
    if layout.pages is None:  # a full cache: slot = position
        scores = cached_key_scores(cfg, q, weights, keys)  # (B, T, C)
        return visible_top_keys(scores, layout.positions, cfg.index_topk)
    pages = layout.pages
    P, ps = keys.shape[:2]
    table = safe_page_table(pages.page_table, pages.kv_lengths, ps, P)  # (B, M)
    Tq = x.shape[1]
    tokens = token_layout(pages.page_table, pages.kv_lengths, pages.query_starts, Tq, P, ps)
    own = keys[table].reshape(table.shape[0], -1, keys.shape[-1])[
        tokens.sequence
    ]  # (Tq, M ps, Hi_d)
    scores = cached_key_scores(cfg, q[0][:, None], weights[0][:, None], own[:, :, None])[:, 0]
    return visible_top_keys(scores, tokens.position, cfg.index_topk)
