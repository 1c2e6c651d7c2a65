"""The steps every attention layer shares, whatever framework owns its parameters:
projections, head splits, QK norm, RoPE, and the call of the functional core
followed by the output projection.

A layer hands its parameters to these steps as a :class:`Parameters` object
(the linen and NNX modules each have a small one), so the math is written
once. Every reshape is followed by :func:`check_shape` (free under ``jit``),
which names the axes, so a refactor that swaps time and head axes fails loudly.
"""

from collections.abc import Callable
from typing import Protocol

import jax
import jax.numpy as jnp

from .._base.paged import split_pool
from .._base.trace import check_shape
from .._core.api import attention_weights, dot_product_attention
from .._core.paged import paged_attention
from .._core.quantize import dequantize_kv
from .._core.rope import apply_rope
from .axes import labels
from .config import AttentionConfig
from .sharded import attend_sharded


class Parameters(Protocol):
    """What a module provides to the shared steps."""

    def dense(self, name: str, x: jax.Array, features: int, dtype) -> jax.Array:
        """The projection called ``name`` (kernel (D_in, features), optional bias)."""

    def norm(self, name: str, x: jax.Array, dtype) -> jax.Array:
        """The QK RMSNorm called ``name`` (``q_norm`` or ``k_norm``) of heads x
        (B, L, N|K, H), as the config's ``qk_norm`` says: over H per head, or over
        the heads and H jointly (``"projection"``)."""

    def sinks(self) -> jax.Array:
        """The learned attention sinks (N,), one logit per query head, named
        ``sinks``; only asked for when ``config.sinks`` is on."""

    def dropout_rng(self) -> jax.Array:
        """A fresh key for dropout; only asked for when dropout is on."""

    def sow_weights(self, weights: Callable[[], jax.Array]) -> None:
        """Stores ``weights()`` (B, N, T, S) when the module sows them; else does nothing."""


def compute_dtype(cfg: AttentionConfig, x):
    """The dtype of projections, attention and cache: ``cfg.dtype``, else ``x``'s."""
    return jnp.dtype(x.dtype) if cfg.dtype is None else cfg.dtype


def split_heads(x, name: str, axes: str, heads: int, cfg: AttentionConfig):
    """(B, L, heads * H) -> (B, L, heads, H): heads are contiguous slices of width H."""
    B, L, _ = x.shape
    out = x.reshape(B, L, heads, cfg.head_dim)  # (B, L, N|K, H)
    return check_shape(
        out, f"{name} heads", axes, (B, L, heads, cfg.head_dim), op="reshape", source=name
    )


def normalize_qk(params: Parameters, cfg: AttentionConfig, q, k, dtype):
    """RMSNorm of the query and key heads (params ``q_norm``, ``k_norm``), if on: over H
    per head (``qk_norm="head"``) or over N H and K H (``"projection"``)."""
    if not cfg.qk_norm:
        return q, k
    return params.norm("q_norm", q, dtype), params.norm("k_norm", k, dtype)


def rotate_qk(cfg: AttentionConfig, q, k, positions):
    """RoPE on queries and keys at integer ``positions`` (B, L) or (L,), if on, with the
    config's scaling, rotated width and layout."""
    if cfg.rope_base is None:
        return q, k
    options = dict(
        base=cfg.rope_base,
        rope_scaling=cfg.rope_scaling,
        rotary_dim=cfg.rotary_dim,
        rope_layout=cfg.rope_layout,
    )
    return apply_rope(q, positions, **options), apply_rope(k, positions, **options)


def core_options(cfg: AttentionConfig, *, positional: bool) -> dict:
    """The config's options of the core call: the scale, the soft-cap, and the window when
    ``positional`` (self-attention over a whole sequence; it has no meaning between
    two sequences) and no ``sink_tokens`` (the layer then passes the window as a
    mask_fn that keeps them, ``nanoattn._layers.positional.window_mask``). A decoding
    step leaves the window to its cache policy's read rules."""
    options = {"logit_soft_cap": cfg.logit_soft_cap}
    if cfg.scale is not None:
        options["scale"] = cfg.scale
    if positional and not cfg.sink_tokens:
        options["window"] = cfg.window
    return options


def attend(
    params: Parameters, q, k, v, cfg: AttentionConfig, deterministic: bool, dtype, **mask_args
):
    """Core attention, then heads concatenated (B, T, N H) and the output projection:
    (B, T, D).

    ``mask_args`` are the core's rules of the call (``mask``, ``is_causal``,
    ``q_offset``, ``mask_fn``, ``score_fn``, ...); the config's ``sinks``
    parameter (N,) joins them here, the one place every layer call passes.
    """
    out = core(params, q, k, v, cfg, deterministic, **mask_args)
    return project_out(params, cfg, out, dtype)


def paged_core(params: Parameters, cfg: AttentionConfig, q, key_pages, value_pages, pages,
               **rules):  # fmt: skip
    """The core attention of a paged decoding step: ``nanoattn.paged_attention`` of the
    token-major queries q (1, Tq, N, H) over the layer's pools (P, page_size, K, H),
    through ``pages`` (a :class:`~nanoattn._layers.caches.paged.PagedBatch`), with the
    config's sinks and soft-cap: (1, Tq, N, H)."""
    if cfg.sinks:
        rules["sinks"] = params.sinks()  # (N,)
    out = paged_attention(
        q[0], key_pages, value_pages, pages.page_table, pages.kv_lengths, pages.query_starts,
        logit_soft_cap=cfg.logit_soft_cap, scale=cfg.scale, implementation=cfg.implementation,
        **rules,
    )  # fmt: skip
    return out[None]


def core(params: Parameters, q, k, v, cfg: AttentionConfig, deterministic: bool, **mask_args):
    """The core attention of a layer call, per head: (B, T, N, H) (:func:`attend`)."""
    rate = 0.0 if deterministic else cfg.dropout
    rng = params.dropout_rng() if rate > 0.0 else None
    if cfg.sinks:
        mask_args["sinks"] = params.sinks()  # (N,), in param_dtype; the core upcasts it
    if cfg.head_axis is None and cfg.sequence_axis is None:
        out = dot_product_attention(
            q, k, v, dropout_rate=rate, dropout_rng=rng, implementation=cfg.implementation,
            **mask_args,
        )  # fmt: skip
    else:  # sharded over a mesh: nanoattn.parallel, over a combined cache's halves
        k, v = split_pool(k, v)
        out = attend_sharded(cfg, q, k, v, dropout_rate=rate, dropout_rng=rng, **mask_args)
    params.sow_weights(lambda: _weights(q, split_pool(k, v)[0], mask_args))
    return out


def _weights(q, k, mask_args):
    """The attention weights a layer sows, of float or of quantized keys (dequantized)."""
    rules = dict(mask_args)
    key_scales = rules.pop("key_scales", None)
    rules.pop("value_scales", None)
    keys = k if key_scales is None else dequantize_kv(k, key_scales, q.dtype)
    return attention_weights(q, keys, **rules)


def project_out(params: Parameters, cfg: AttentionConfig, out, dtype):
    """The heads (B, T, N, H) concatenated and projected: (B, T, D)."""
    B, T = out.shape[:2]
    merged = out.reshape(B, T, cfg.q_width)  # (B, T, N H)
    check_shape(
        merged,
        "concatenated heads",
        f"B T {labels(cfg).q_width}",
        (B, T, cfg.q_width),
        op="reshape",
        source="per-head output",
    )
    y = params.dense("out", merged, cfg.d_model, dtype)
    return check_shape(
        y, "output", "B T D", (B, T, cfg.d_model), op="project", source="concatenated heads"
    )
