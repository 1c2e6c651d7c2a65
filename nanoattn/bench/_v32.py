"""DeepSeek-V3.2's sparse attention at decode (docs/latent.md, "DeepSeek-V3.2's sparse
attention"): one decoding step of a latent attention layer with the indexer, its query
choosing its top k of a long cache, against the same layer's dense MLA decode over
every cached key.

Both steps are the whole layer (projections, the cache write, the indexer, the absorbed
attention), jitted with the cache donated as a server runs them, over one cache of
random latents, RoPE keys and indexer keys filled to the context (the query at its last
position), timed in turn in one process. Issue 51's target, at DeepSeek-V3.2's heads
(128 query heads, kv_lora_rank 512, RoPE width 64, an indexer of 64 heads of width 128
keeping 2048 keys; d_model 1024 for a CPU) and a context of 32768: at least 3x faster.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp

from .._base.validate import describe
from .._layers.latent_config import LatentConfig
from .._layers.linen.latent import LatentAttention
from ._measure import time_interleaved

V32 = dict(d_model=1024, n_heads=128, kv_lora_rank=512, qk_nope_head_dim=128,
           qk_rope_head_dim=64, v_head_dim=128, q_lora_rank=1536, index_n_heads=64,
           index_head_dim=128, index_topk=2048)  # fmt: skip
QUICK_V32 = dict(d_model=64, n_heads=4, kv_lora_rank=32, qk_nope_head_dim=16,
                 qk_rope_head_dim=8, v_head_dim=16, q_lora_rank=48, index_n_heads=4,
                 index_head_dim=16, index_topk=64)  # fmt: skip
TARGET = 3.0  # the indexed step >= 3x faster than the dense one


def _step(cfg: LatentConfig, context: int):
    """(jitted step, params, a filled cache): the step writes one token at position
    ``context - 1`` and attends; it returns the output and the cache with its positions
    back there (so that every timed call is the same step)."""
    layer = LatentAttention(cfg)
    shapes = jax.eval_shape(functools.partial(layer.init, decode=True), jax.random.key(0),
                            jnp.zeros((1, context, cfg.d_model)))  # fmt: skip
    keys = iter(jax.random.split(jax.random.key(1), 64))
    params = jax.tree.map(lambda a: 0.05 * jax.random.normal(next(keys), a.shape, a.dtype),
                          shapes["params"])  # fmt: skip
    cache = {name: (jax.random.normal(next(keys), a.shape, a.dtype) if a.dtype.kind == "f"
                    else jnp.full(a.shape, context - 1, a.dtype))
             for name, a in shapes["cache"].items()}  # fmt: skip

    def step(params, cache, x):
        y, state = layer.apply({"params": params, "cache": cache}, x, decode=True,
                               mutable=["cache"])  # fmt: skip
        return y, dict(state["cache"], position=cache["position"], last=cache["last"])

    return jax.jit(step, donate_argnums=1), params, cache


def measure_v32(context: int, sizes: dict = V32, rounds: int = 5) -> dict:
    """Median and min ms of the indexed and the dense layer step at ``context``, and the
    ratio dense / indexed."""
    row = {"context": context, "N": sizes["n_heads"], "topk": sizes["index_topk"],
           "index_heads": sizes["index_n_heads"], "rounds": rounds}  # fmt: skip
    try:
        indexed = LatentConfig(**sizes)
        dense = dataclasses.replace(indexed, index_n_heads=None, index_head_dim=None,
                                    index_topk=None)  # fmt: skip
        x = 0.5 * jax.random.normal(jax.random.key(2), (1, 1, indexed.d_model))
        runs = {}
        for name, cfg in (("indexed", indexed), ("dense", dense)):
            step, params, cache = _step(cfg, context)
            state = {"cache": cache}

            def run(step=step, params=params, state=state):
                y, state["cache"] = step(params, state["cache"], x)
                y.block_until_ready()

            runs[name] = run
        times = time_interleaved(runs, rounds=rounds)
    except Exception as e:  # reported, not fatal to the rest of the bench
        return row | {"status": f"error: {describe(e)[:200]}"}
    for name, (median, best) in times.items():
        row[f"{name}_median_ms"], row[f"{name}_min_ms"] = median * 1e3, best * 1e3
    return row | {"status": "ok", "speedup": row["dense_median_ms"] / row["indexed_median_ms"]}


def v32_target(row: dict) -> dict:
    """Issue 51's: the indexed step at least 3x faster than the dense one."""
    target = (f"DeepSeek-V3.2 layer decode at {row['context']} keys (top {row['topk']}) "
              f">= {TARGET}x faster than its dense MLA decode")  # fmt: skip
    if row["status"] != "ok":
        return {"target": target, "measured": row["status"], "passed": None}
    measured = (f"dense {row['dense_median_ms']:.1f} ms, indexed "
                f"{row['indexed_median_ms']:.1f} ms: {row['speedup']:.2f}x")  # fmt: skip
    return {"target": target, "measured": measured, "passed": row["speedup"] >= TARGET}


def v32_markdown(row: dict) -> list[str]:
    """The V3.2 step's lines of the selection part's table."""
    if row["status"] != "ok":
        return ["", f"DeepSeek-V3.2 decode: {row['status']}"]
    return [
        "", f"### DeepSeek-V3.2 decode: a layer step at {row['context']} keys, top "
        f"{row['topk']} (N={row['N']}, an indexer of {row['index_heads']} heads)", "",
        "| step | median ms (min) |", "| --- | --- |",
        f"| indexed (top {row['topk']}) | {row['indexed_median_ms']:.2f} "
        f"({row['indexed_min_ms']:.2f}) |",
        f"| dense MLA | {row['dense_median_ms']:.2f} ({row['dense_min_ms']:.2f}) |",
        "", f"dense / indexed: {row['speedup']:.2f}x",
    ]  # fmt: skip
