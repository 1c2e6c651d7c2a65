"""Multi-head latent attention (docs/latent.md): the latent cache's bytes per token and
layer at DeepSeek-V3's shape against full multi-head keys and values, and one decoding
step at a long context in absorbed form against a step that rebuilds every cached
token's per-head keys and values from its latent.

The bytes are read off the layer's own cache (``jax.eval_shape`` of
``LatentAttention.init(..., decode=True)``: nothing is allocated). The two steps share
one filled cache of latents and RoPE keys and one query token, are timed in turn in one
process, and compute the same per-head outputs (B, 1, N, Hv).
"""

import jax
import jax.numpy as jnp

from .._base.validate import describe
from .._core.api import dot_product_attention
from .._layers.caches.kv_cache import cache_bytes
from .._layers.latent_config import LatentConfig
from .._layers.linen.latent import LatentAttention
from ._measure import time_interleaved

# DeepSeek-V3's attention (config.json of deepseek-ai/DeepSeek-V3).
V3 = dict(d_model=7168, n_heads=128, kv_lora_rank=512, qk_nope_head_dim=128,
          qk_rope_head_dim=64, v_head_dim=128, q_lora_rank=1536)  # fmt: skip
CONTEXT = 4096
HEADS = 16  # the timed step's heads: DeepSeek-V3's widths, fewer heads for a CPU
TARGET_BYTES = 0.04  # latent cache <= 0.04x full multi-head keys and values (2 x N x 128)
TARGET_SPEEDUP = 2.0  # absorbed step >= 2x faster than rebuilding keys and values
ROUNDS = 5


def cache_row(dtype: str = "bfloat16", sizes: dict = V3) -> dict:
    """Cache bytes per token and layer of the latent cache, against 2 x N x 128 numbers
    of full multi-head keys and values (and the exact MHA widths, N (Hn + Hr) + N Hv)."""
    cfg = LatentConfig(**sizes, dtype=dtype)
    x = jax.ShapeDtypeStruct((1, 1, cfg.d_model), dtype)
    shapes = jax.eval_shape(
        lambda: LatentAttention(cfg).init(jax.random.key(0), jnp.zeros(x.shape, dtype), decode=True)
    )
    item = jnp.dtype(dtype).itemsize
    per_token = cache_bytes(shapes["cache"])[""] - 8  # less position and last (B = 1)
    mha = 2 * cfg.n_heads * 128 * item
    exact = (cfg.n_heads * cfg.qk_head_dim + cfg.n_heads * cfg.v_head_dim) * item
    return {
        "dtype": dtype, "latent_bytes": per_token, "numbers": per_token // item,
        "mha_bytes": mha, "mha_exact_bytes": exact, "ratio": per_token / mha,
    }  # fmt: skip


def _steps(cfg: LatentConfig):
    """The absorbed and the rebuilding step: (q_nope, q_rope, cache, w_kvb, length) ->
    per-head outputs (B, 1, N, Hv)."""
    r, N, Hn = cfg.kv_lora_rank, cfg.n_heads, cfg.qk_nope_head_dim
    rules = dict(scale=cfg.scale)

    def absorbed(q_nope, q_rope, cache, w, length):
        w = w.reshape(r, N, Hn + cfg.v_head_dim)  # (r, N, Hn + Hv)
        q = jnp.concatenate([jnp.einsum("BTNh,rNh->BTNr", q_nope, w[..., :Hn]), q_rope], -1)
        o = dot_product_attention(q, cache, cache[..., :r], kv_lengths=length, **rules)
        return jnp.einsum("BTNr,rNv->BTNv", o, w[..., Hn:])

    def rebuilt(q_nope, q_rope, cache, w, length):
        B, C = cache.shape[:2]
        kv = jnp.einsum("BCr,rf->BCf", cache[:, :, 0, :r], w).reshape(B, C, N, -1)
        k_rope = jnp.broadcast_to(cache[..., r:], (B, C, N, cfg.qk_rope_head_dim))
        k = jnp.concatenate([kv[..., :Hn], k_rope], -1)  # (B, C, N, Hn + Hr)
        q = jnp.concatenate([q_nope, q_rope], -1)
        return dot_product_attention(q, k, kv[..., Hn:], kv_lengths=length, **rules)

    return {"absorbed": jax.jit(absorbed), "rebuilt": jax.jit(rebuilt)}


def measure_decode(context: int = CONTEXT, *, heads: int = HEADS, sizes: dict = V3,
                   dtype: str = "float32", rounds: int = ROUNDS) -> dict:  # fmt: skip
    """Median and min time of one decoding step (B = 1, one query) over a cache filled to
    ``context`` tokens, absorbed and rebuilding, and their largest difference."""
    cfg = LatentConfig(**(sizes | {"n_heads": heads}))
    row = {"context": context, "N": heads, "r": cfg.kv_lora_rank, "dtype": dtype,
           "rounds": rounds}  # fmt: skip
    try:
        keys = jax.random.split(jax.random.key(0), 4)
        N, Hn, Hr = heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim
        q_nope = jax.random.normal(keys[0], (1, 1, N, Hn), dtype)
        q_rope = jax.random.normal(keys[1], (1, 1, N, Hr), dtype)
        cache = jax.random.normal(keys[2], (1, context, 1, cfg.cache_width), dtype)
        w = jax.random.normal(keys[3], (cfg.kv_lora_rank, N * (Hn + cfg.v_head_dim)), dtype)
        w = w / cfg.kv_lora_rank**0.5
        length = jnp.array([context], jnp.int32)
        args = (q_nope, q_rope, cache, w, length)
        steps = _steps(cfg)
        outs = {name: step(*args) for name, step in steps.items()}
        runs = {name: (lambda s=s: jax.block_until_ready(s(*args))) for name, s in steps.items()}
        times = time_interleaved(runs, rounds=rounds)
    except Exception as e:  # reported, not fatal to the rest of the bench
        return row | {"status": f"error: {describe(e)[:200]}"}
    for name, (median, best) in times.items():
        row[f"{name}_median_ms"], row[f"{name}_min_ms"] = median * 1e3, best * 1e3
    difference = jnp.abs(outs["absorbed"] - outs["rebuilt"]).max()
    return row | {
        "status": "ok", "max_difference": float(difference),
        "speedup": row["rebuilt_median_ms"] / row["absorbed_median_ms"],
    }  # fmt: skip


def latent_targets(cache: dict, decode: dict) -> list[dict]:
    """The cache at most 0.04x of full multi-head keys and values (DeepSeek-V3's shape);
    the absorbed step at least 2x faster at context 4096 (judged there only)."""
    targets = [{
        "target": f"latent cache bytes per token per layer, DeepSeek-V3, {cache['dtype']}: "
                  f"<= {TARGET_BYTES}x of 2 x 128 heads x 128",
        "measured": f"{cache['latent_bytes']} B ({cache['numbers']} numbers) vs "
                    f"{cache['mha_bytes']} B: {cache['ratio']:.4f}x",
        "passed": cache["ratio"] <= TARGET_BYTES,
    }]  # fmt: skip
    if decode["context"] != CONTEXT:
        return targets
    target = f"absorbed decode step at context {CONTEXT} >= {TARGET_SPEEDUP}x the rebuilding one"
    if decode["status"] != "ok":
        return [*targets, {"target": target, "measured": decode["status"], "passed": None}]
    measured = (
        f"rebuilt {decode['rebuilt_median_ms']:.2f} ms, absorbed "
        f"{decode['absorbed_median_ms']:.2f} ms: {decode['speedup']:.1f}x (N={decode['N']})"
    )
    return [*targets, {"target": target, "measured": measured,
                       "passed": decode["speedup"] >= TARGET_SPEEDUP}]  # fmt: skip


def measure_latent(context: int = CONTEXT, **options) -> dict:
    """Both measures of the part: ``{"cache": cache_row(), "decode": measure_decode()}``."""
    return {"cache": cache_row(), "decode": measure_decode(context, **options)}
