"""The attention layer written out in float64 numpy from the issues' contract, without
the library's code: the independent reference of the linen and NNX module tests."""

import jax
import numpy as np


def np_rms_norm(x, scale):
    return x / np.sqrt((x**2).mean(-1, keepdims=True) + 1e-6) * scale


def np_rope(x, positions, base):
    """Half-split RoPE in float64: feature i pairs with i + H/2, angle p * base^(-2i/H)."""
    half = x.shape[-1] // 2
    angles = np.asarray(positions, np.float64)[..., None] * base ** (
        -2 * np.arange(half) / (2 * half)
    )
    cos, sin = np.cos(angles)[..., None, :], np.sin(angles)[..., None, :]  # (B|1, L, 1, H/2)
    a, b = x[..., :half], x[..., half:]
    return np.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1)


def np_softmax(logits, allowed):
    z = np.where(allowed, logits, -np.inf)
    top = z.max(-1, keepdims=True)
    e = np.where(allowed, np.exp(z - np.where(np.isfinite(top), top, 0)), 0)
    total = e.sum(-1, keepdims=True)
    return e / np.where(total == 0, 1, total)


def np_layer(params, x, config, *, positions=None, segment_ids=None, valid=None):
    """CausalSelfAttention written out in float64 numpy from the issue's contract."""
    p = jax.tree.map(lambda a: np.asarray(a, np.float64), params["params"])
    x = np.asarray(x, np.float64)
    b, t, _ = x.shape
    n, k_heads, h = config.n_heads, config.kv_heads, config.head_dim
    qkv = x @ p["qkv"]["kernel"] + (p["qkv"]["bias"] if config.use_bias else 0)
    q = qkv[..., : n * h].reshape(b, t, n, h)
    k = qkv[..., n * h : (n + k_heads) * h].reshape(b, t, k_heads, h)
    v = qkv[..., (n + k_heads) * h :].reshape(b, t, k_heads, h)
    if config.qk_norm:
        q, k = np_rms_norm(q, p["q_norm"]["scale"]), np_rms_norm(k, p["k_norm"]["scale"])
    if config.rope_base is not None:
        pos = np.arange(t)[None] if positions is None else np.asarray(positions)
        q, k = np_rope(q, pos, config.rope_base), np_rope(k, pos, config.rope_base)
    i, j = np.arange(t)[:, None], np.arange(t)[None, :]
    allowed = np.broadcast_to(j <= i, (b, 1, t, t))
    if config.window is not None:
        left, right = config.window
        allowed = allowed & ((i - left <= j) & (j <= i + right))
    if segment_ids is not None:
        seg = np.asarray(segment_ids)
        allowed = allowed & (seg[:, None, :, None] == seg[:, None, None, :])
    if valid is not None:
        allowed = allowed & np.asarray(valid)[:, None, None, :]
    g = n // k_heads
    logits = np.einsum("btnh,bsnh->bnts", q, np.repeat(k, g, axis=2)) / np.sqrt(h)
    if config.logit_soft_cap is not None:
        logits = config.logit_soft_cap * np.tanh(logits / config.logit_soft_cap)
    weights = np_softmax(logits, allowed)
    heads = np.einsum("bnts,bsnh->btnh", weights, np.repeat(v, g, axis=2)).reshape(b, t, n * h)
    return heads @ p["out"]["kernel"] + (p["out"]["bias"] if config.use_bias else 0)
