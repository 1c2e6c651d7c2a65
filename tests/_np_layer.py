"""The attention layer written out in float64 numpy from the issues' contract, without
the library's code: the independent reference of the linen and NNX module tests."""

import jax
import numpy as np


def np_rms_norm(x, scale, eps=1e-6, offset=0.0, axes=1):
    """RMSNorm over the last ``axes`` axes (1: each head, 2: heads and features jointly)."""
    axis = tuple(range(-axes, 0))
    scale = np.reshape(scale, x.shape[-axes:])
    return x / np.sqrt((x**2).mean(axis, keepdims=True) + eps) * (offset + scale)


def np_rope_table(x, positions, inv_freq, rotary_dim=None, layout="half", factor=1.0):
    """RoPE in float64 from an explicit frequency table (R/2,): the first R features
    rotate, pairs (i, i + R/2) (``"half"``) or (2i, 2i + 1) (``"interleaved"``), cos and
    sin times ``factor``; the rest pass through."""
    R = x.shape[-1] if rotary_dim is None else rotary_dim
    angles = np.asarray(positions, np.float64)[..., None] * np.asarray(inv_freq)  # (B|1, L, R/2)
    cos, sin = factor * np.cos(angles)[..., None, :], factor * np.sin(angles)[..., None, :]
    turned = x[..., :R]
    if layout == "half":
        a, b = turned[..., : R // 2], turned[..., R // 2 :]
        out = np.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1)
    else:
        a, b = turned[..., 0::2], turned[..., 1::2]
        out = np.empty_like(turned)
        out[..., 0::2], out[..., 1::2] = a * cos - b * sin, b * cos + a * sin
    return np.concatenate([out, x[..., R:]], axis=-1)


def np_inv_freq(config):
    """The frequencies of a config's RoPE: base^(-2i/R), divided by a linear scaling's
    factor (the other scalings are held against transformers' tables in
    layers/test_rope_scaling.py)."""
    R = config.rotary_width
    inv_freq = config.rope_base ** (-np.arange(0, R, 2) / R)
    scaling = config.rope_scaling
    if scaling is not None:
        assert scaling.rope_type == "linear", "np_layer transcribes linear scaling only"
        inv_freq = inv_freq / scaling.factor
    return inv_freq


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
    qkv = x @ p["qkv"]["kernel"] + (p["qkv"]["bias"] if config.has_bias("qkv") else 0)
    q = qkv[..., : n * h].reshape(b, t, n, h)
    k = qkv[..., n * h : (n + k_heads) * h].reshape(b, t, k_heads, h)
    v = qkv[..., (n + k_heads) * h :].reshape(b, t, k_heads, h)
    if config.qk_norm:
        norm = dict(eps=config.qk_norm_eps, offset=config.qk_norm_offset)
        norm["axes"] = 2 if config.qk_norm == "projection" else 1
        q, k = (
            np_rms_norm(q, p["q_norm"]["scale"], **norm),
            np_rms_norm(k, p["k_norm"]["scale"], **norm),
        )
    if config.rope_base is not None:
        pos = np.arange(t)[None] if positions is None else np.asarray(positions)
        rope = dict(inv_freq=np_inv_freq(config), rotary_dim=config.rotary_dim,
                    layout=config.rope_layout)  # fmt: skip
        q, k = np_rope_table(q, pos, **rope), np_rope_table(k, pos, **rope)
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
    scale = 1 / np.sqrt(h) if config.scale is None else config.scale
    logits = np.einsum("btnh,bsnh->bnts", q, np.repeat(k, g, axis=2)) * scale
    if config.logit_soft_cap is not None:
        logits = config.logit_soft_cap * np.tanh(logits / config.logit_soft_cap)
    weights = np_softmax(logits, allowed)
    heads = np.einsum("bnts,bsnh->btnh", weights, np.repeat(v, g, axis=2)).reshape(b, t, n * h)
    return heads @ p["out"]["kernel"] + (p["out"]["bias"] if config.has_bias("out") else 0)
