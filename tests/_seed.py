"""The NanoMoE seed module (shared/seed/000_*.txt) and a float64 numpy transcription of it.

Kept exactly as the seed computes, so parity tests compare against the
original behaviour, not against our reading of it.
"""

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class NanoMoEConfig:
    d_model: int = 128
    n_heads: int = 4
    dropout: float = 0.0


class SeedMultiHeadAttention(nn.Module):
    config: NanoMoEConfig

    @nn.compact
    def __call__(self, x, deterministic=False):
        cfg = self.config
        B, T, D = x.shape
        head_dim = D // cfg.n_heads
        qkv = nn.Dense(3 * D)(x)
        q, k, v = jnp.split(qkv, 3, axis=-1)
        q = q.reshape(B, T, cfg.n_heads, head_dim).transpose(0, 2, 1, 3)
        k = k.reshape(B, T, cfg.n_heads, head_dim).transpose(0, 2, 1, 3)
        v = v.reshape(B, T, cfg.n_heads, head_dim).transpose(0, 2, 1, 3)
        scale = head_dim**-0.5
        attn = (q @ k.transpose(0, 1, 3, 2)) * scale
        mask = jnp.triu(jnp.ones((T, T)), k=1).astype(bool)
        attn = jnp.where(mask, -1e9, attn)
        attn = jax.nn.softmax(attn, axis=-1)
        attn = nn.Dropout(cfg.dropout)(attn, deterministic=deterministic)
        out = (attn @ v).transpose(0, 2, 1, 3).reshape(B, T, D)
        return nn.Dense(D)(out)


def seed_forward_numpy(params, x, n_heads):
    """The seed's evaluation-mode forward pass in float64 numpy, loop over heads."""
    p = jax.tree.map(lambda a: np.asarray(a, np.float64), params["params"])
    x = np.asarray(x, np.float64)
    B, T, D = x.shape
    hd = D // n_heads
    qkv = x @ p["Dense_0"]["kernel"] + p["Dense_0"]["bias"]
    q, k, v = qkv[..., :D], qkv[..., D : 2 * D], qkv[..., 2 * D :]
    out = np.zeros((B, T, D))
    for h in range(n_heads):
        cols = slice(h * hd, (h + 1) * hd)
        s = q[..., cols] @ np.swapaxes(k[..., cols], 1, 2) / np.sqrt(hd)  # (B, T, T)
        s = np.where(np.triu(np.ones((T, T), bool), 1), -np.inf, s)
        w = np.exp(s - s.max(-1, keepdims=True))
        w /= w.sum(-1, keepdims=True)
        out[..., cols] = w @ v[..., cols]
    return out @ p["Dense_1"]["kernel"] + p["Dense_1"]["bias"]


def rename_seed_params(params):
    """A seed checkpoint in nanoattn's names: Dense_0 -> qkv, Dense_1 -> out."""
    p = params["params"]
    return {"params": {"qkv": p["Dense_0"], "out": p["Dense_1"]}}
