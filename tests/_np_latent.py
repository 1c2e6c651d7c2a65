"""Multi-head latent attention written out in float64 numpy from DeepSeek's equations
(transformers' DeepseekV3Attention: per-head keys and values rebuilt from the latent,
never absorbed), without the library's code: the independent reference of
tests/layers/test_latent.py."""

import jax
import numpy as np

from _np_layer import np_rms_norm, np_rope_table, np_softmax


def np_latent(params, x, cfg, *, positions=None, allowed=None):
    """The layer's output (B, T, D) for linen parameters ``params`` (``{"params": ...}``);
    ``allowed`` (B|1, 1, T, T) bool on top of causality (a window, a padding mask)."""
    p = jax.tree.map(lambda a: np.asarray(a, np.float64), params["params"])
    x = np.asarray(x, np.float64)
    B, T, _ = x.shape
    N, r = cfg.n_heads, cfg.kv_lora_rank
    Hn, Hr, Hv = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
    positions = np.arange(T)[None] if positions is None else np.asarray(positions)
    inv_freq = cfg.rope_base ** (-np.arange(0, Hr, 2) / Hr)
    if cfg.q_lora_rank is None:
        q = x @ p["q"]["kernel"]
    else:
        low = np_rms_norm(x @ p["q_a"]["kernel"], p["q_a_norm"]["scale"], cfg.norm_eps)
        q = low @ p["q_b"]["kernel"]
    q = q.reshape(B, T, N, Hn + Hr)
    ckv = x @ p["kv_a"]["kernel"]
    c = np_rms_norm(ckv[..., :r], p["kv_a_norm"]["scale"], cfg.norm_eps)
    kv = (c @ p["kv_b"]["kernel"]).reshape(B, T, N, Hn + Hv)
    rope = lambda z: np_rope_table(z, positions, inv_freq, layout=cfg.rope_layout)  # noqa: E731
    q = np.concatenate([q[..., :Hn], rope(q[..., Hn:])], -1)
    k_rope = np.broadcast_to(rope(ckv[..., None, r:]), (B, T, N, Hr))
    k = np.concatenate([kv[..., :Hn], k_rope], -1)
    logits = np.einsum("btnh,bsnh->bnts", q, k) / np.sqrt(Hn + Hr)
    if cfg.logit_soft_cap is not None:
        logits = cfg.logit_soft_cap * np.tanh(logits / cfg.logit_soft_cap)
    seen = np.tril(np.ones((T, T), bool))[None, None]
    if allowed is not None:
        seen = seen & allowed
    out = np.einsum("bnts,bsnh->btnh", np_softmax(logits, seen), kv[..., Hn:])
    return out.reshape(B, T, N * Hv) @ p["out"]["kernel"]
