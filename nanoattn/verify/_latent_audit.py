"""The shapes of a multi-head latent attention layer, for ``nanoattn audit --latent``:
its parameters, the arrays of one decoding step (absorbed form) and its cache, from
``jax.eval_shape`` (nothing is computed; docs/latent.md)."""

import jax
import jax.numpy as jnp

from .._layers.latent_config import LatentConfig
from .._layers.linen.latent import LatentAttention


def latent_shapes(config: LatentConfig, batch: int, seq_len: int) -> list[tuple[str, str, str]]:
    """``(name, shape, what)`` rows: each parameter, the forward's per-head keys and
    values, the absorbed decode's query and attention (K = 1, H = r + Hr, Hv = r), and
    the cache of ``seq_len`` slots with its bytes per token."""
    x = jnp.zeros((batch, seq_len, config.d_model), config.param_dtype)
    variables = jax.eval_shape(
        lambda: LatentAttention(config).init(jax.random.key(0), x, decode=True)
    )
    B, T, N = batch, seq_len, config.n_heads
    r, Hn, Hr, Hv = config.kv_lora_rank, config.qk_nope_head_dim, config.qk_rope_head_dim, (
        config.v_head_dim
    )  # fmt: skip
    rows = [
        (f"params/{name}/{leaf}", str(tuple(a.shape)), "")
        for name, leaves in sorted(variables["params"].items())
        for leaf, a in sorted(leaves.items())
    ]
    rows += [
        ("forward: query", str((B, T, N, Hn + Hr)), "B T N Hn+Hr"),
        ("forward: key", str((B, T, N, Hn + Hr)), "B S N Hn+Hr, rebuilt from the latent"),
        ("forward: value", str((B, T, N, Hv)), "B S N Hv"),
        ("decode: query in latent space", str((B, 1, N, r + Hr)), "B T N r+Hr: q_n W_uk^T | q_r"),
        ("decode: keys", str((B, T, 1, r + Hr)), "B C 1 r+Hr: the cache (K = 1)"),
        ("decode: values", str((B, T, 1, r)), "B C 1 r: the latent, a slice of the keys"),
        ("decode: output in latent space", str((B, 1, N, r)), "B T N r, then W_uv: B T N Hv"),
    ]
    cache = variables["cache"]
    rows += [(f"cache/{name}", str(tuple(a.shape)), "") for name, a in sorted(cache.items())]
    item = jnp.dtype(cache["key"].dtype).itemsize
    rows.append(("cache bytes per token", str((r + Hr) * item), f"(r + Hr) x {item}"))
    return rows
