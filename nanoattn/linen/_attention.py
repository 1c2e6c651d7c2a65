"""Flax linen attention modules. They own the parameters, project, split heads
and call the functional core; the math lives in ``nanoattn.dot_product_attention``.

Every reshape is followed by :func:`check_shape` (free under ``jit``), which
names the axes, so a refactor that swaps time and head axes fails loudly.
"""

import flax.linen as nn
import jax.numpy as jnp

from .._attention import attention_weights, dot_product_attention
from .._masks import padding_mask
from .._trace import check_shape
from .._validate import expect_bool, expect_shape
from ._config import AttentionConfig


def _split_heads(x, name: str, time: str, cfg: AttentionConfig):
    """(B, L, D) -> (B, L, N, H), with heads as contiguous ``head_dim`` slices of D."""
    B, L, _ = x.shape
    heads = x.reshape(B, L, cfg.n_heads, cfg.head_dim)  # (B, L, N, H)
    return check_shape(
        heads,
        f"{name} heads",
        f"B {time} N H",
        (B, L, cfg.n_heads, cfg.head_dim),
        op="reshape",
        source=name,
    )


def _attend(module: nn.Module, q, k, v, cfg: AttentionConfig, deterministic: bool, **mask_args):
    """Core attention, then heads concatenated and the output projection: (B, T, D)."""
    B, T, _, _ = q.shape
    rate = 0.0 if deterministic else cfg.dropout
    rng = module.make_rng("dropout") if rate > 0.0 else None
    out = dot_product_attention(
        q, k, v, dropout_rate=rate, dropout_rng=rng, implementation=cfg.implementation, **mask_args
    )
    if module.sow_weights and module.is_mutable_collection("intermediates"):
        module.sow("intermediates", "attention_weights", attention_weights(q, k, **mask_args))
    merged = out.reshape(B, T, cfg.d_model)  # (B, T, D)
    check_shape(
        merged,
        "concatenated heads",
        "B T D",
        (B, T, cfg.d_model),
        op="reshape",
        source="per-head output",
    )
    y = nn.Dense(cfg.d_model, name="out")(merged)
    return check_shape(
        y, "output", "B T D", (B, T, cfg.d_model), op="project", source="concatenated heads"
    )


class CausalSelfAttention(nn.Module):
    r"""Multi-head causal self-attention, a drop-in for the NanoMoE seed module.

    ``y = out(concat_n softmax(q_n k_n^T / sqrt(H) + causal) v_n)`` with
    ``[q | k | v] = qkv(x)``: one combined projection whose columns are ordered
    [Q | K | V], each block split into N contiguous slices of width H. The
    parameters are exactly the seed's (``Dense_0`` -> ``qkv``,
    ``Dense_1`` -> ``out``)::

        {"qkv": {"kernel": (D, 3D), "bias": (3D,)},
         "out": {"kernel": (D, D), "bias": (D,)}}

    Attributes:
      config: an :class:`AttentionConfig` (or any object with ``d_model``,
        ``n_heads`` and ``dropout``).
      sow_weights: if True, sow the attention weights (B, N, T, S), without
        dropout, into the ``intermediates`` collection.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> layer = CausalSelfAttention(AttentionConfig(d_model=128, n_heads=4))
      >>> x = jnp.ones((2, 5, 128))
      >>> params = layer.init(jax.random.key(0), x, deterministic=True)
      >>> layer.apply(params, x, deterministic=True).shape
      (2, 5, 128)
    """

    config: AttentionConfig
    sow_weights: bool = False

    @nn.compact
    def __call__(self, x, deterministic: bool = False, *, mask=None):
        """Attends every token to itself and the tokens before it.

        Args:
          x: (B, T, D).
          deterministic: disables dropout (evaluation mode).
          mask: optional boolean mask broadcastable to (B, N, T, T), True = may
            attend, ANDed with the causal triangle (e.g. a ``padding_mask``).

        Returns:
          (B, T, D).
        """
        cfg = AttentionConfig.from_config(self.config)
        expect_shape("x", jnp.shape(x), "B T D", (None, None, cfg.d_model))
        B, T, D = x.shape
        check_shape(x, "input", "B T D", (B, T, D), op="input")
        qkv = nn.Dense(3 * D, name="qkv")(x)
        check_shape(qkv, "qkv", "B T 3D", (B, T, 3 * D), op="project", source="input")
        q, k, v = jnp.split(qkv, 3, axis=-1)  # 3 x (B, T, D), in the order [Q | K | V]
        for name, part, time in (("q", q, "T"), ("k", k, "S"), ("v", v, "S")):
            check_shape(part, name, f"B {time} D", (B, T, D), op="split", source="qkv")
        q = _split_heads(q, "q", "T", cfg)
        k = _split_heads(k, "k", "S", cfg)
        v = _split_heads(v, "v", "S", cfg)
        return _attend(self, q, k, v, cfg, deterministic, mask=mask, is_causal=True)


MultiHeadAttention = CausalSelfAttention


class CrossAttention(nn.Module):
    r"""Multi-head cross-attention: T queries from ``x`` attend to S keys from ``context``.

    ``y = out(concat_n softmax(q_n k_n^T / sqrt(H)) v_n)`` with ``q = q(x)`` and
    ``[k | v] = kv(context)``; no causal triangle. Parameters::

        {"q": {"kernel": (D, D), "bias": (D,)},
         "kv": {"kernel": (D, 2D), "bias": (2D,)},
         "out": {"kernel": (D, D), "bias": (D,)}}

    Attributes:
      config: an :class:`AttentionConfig`.
      sow_weights: if True, sow the attention weights (B, N, T, S) into
        ``intermediates``.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> layer = CrossAttention(AttentionConfig(d_model=64, n_heads=4))
      >>> x, ctx = jnp.ones((2, 3, 64)), jnp.ones((2, 7, 64))
      >>> params = layer.init(jax.random.key(0), x, ctx, deterministic=True)
      >>> layer.apply(params, x, ctx, deterministic=True).shape
      (2, 3, 64)
    """

    config: AttentionConfig
    sow_weights: bool = False

    @nn.compact
    def __call__(self, x, context, deterministic: bool = False, *, context_mask=None):
        """Attends each query token to the context tokens.

        Args:
          x: (B, T, D) queries.
          context: (B, S, D) keys and values.
          deterministic: disables dropout (evaluation mode).
          context_mask: optional boolean; either (B, S), True at real context
            tokens, or any mask broadcastable to (B, N, T, S) of rank other than 2.

        Returns:
          (B, T, D).
        """
        cfg = AttentionConfig.from_config(self.config)
        D = cfg.d_model
        expect_shape("x", jnp.shape(x), "B T D", (None, None, D))
        B, T, _ = x.shape
        expect_shape("context", jnp.shape(context), "B S D", (B, None, D))
        S = context.shape[1]
        mask = context_mask
        if mask is not None and jnp.ndim(mask) == 2:
            expect_bool("context_mask", jnp.result_type(mask))
            expect_shape("context_mask", jnp.shape(mask), "B S", (B, S))
            mask = padding_mask(mask)  # (B, 1, 1, S)

        check_shape(x, "input", "B T D", (B, T, D), op="input")
        check_shape(context, "context", "B S D", (B, S, D), op="input")
        q = nn.Dense(D, name="q")(x)
        check_shape(q, "q", "B T D", (B, T, D), op="project", source="input")
        kv = nn.Dense(2 * D, name="kv")(context)
        check_shape(kv, "kv", "B S 2D", (B, S, 2 * D), op="project", source="context")
        k, v = jnp.split(kv, 2, axis=-1)  # 2 x (B, S, D), in the order [K | V]
        for name, part in (("k", k), ("v", v)):
            check_shape(part, name, "B S D", (B, S, D), op="split", source="kv")
        q = _split_heads(q, "q", "T", cfg)
        k = _split_heads(k, "k", "S", cfg)
        v = _split_heads(v, "v", "S", cfg)
        return _attend(self, q, k, v, cfg, deterministic, mask=mask)
