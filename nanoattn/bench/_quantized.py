"""Quantized KV caches in the serving part (issue #35): their bytes per token and layer,
and a decoding step over int8 pages against the same step over bfloat16 pages.

* bytes: ``nanoattn.linen.cache_bytes`` of a ``CausalSelfAttention`` cache of the
  serving shape (N query heads on K key/value heads of width H) per dtype, from
  ``jax.eval_shape`` (nothing allocated): the bytes of a cache of 2 tokens less those
  of 1 token, so that only what a token adds is counted (keys, values and, quantized,
  their float32 scales), not the per-row position. Targets: int8 at most 0.27x float32
  and 0.53x bfloat16 (2 K H + 8 K against 8 K H and 4 K H bytes: 0.258x and 0.516x at
  K = 8, H = 128).
* decode: the serving part's decode batch (one query token of each of B sequences)
  over the bfloat16 pool quantized by ``nanoattn.quantize_kv`` to int8 pages with their
  scales, through ``paged_attention(..., key_scales=, value_scales=)``, against the same
  call over the bfloat16 pool and over those pages widened to float32 (the same
  numbers), the three timed in turn, per implementation (one that does not serve
  quantized keys gets a row with its refusal). The bytes the int8 step reads are the
  int8 keys and values of the pages held, their float32 scales and the bfloat16
  queries; over the step's median time they are a fraction of the machine's read
  bandwidth (``nanoattn.bench._bandwidth``). Targets (issue #47): native's int8 step
  at least 1.6x faster than its bfloat16 step, and its bfloat16 step at least 1.6x
  faster than its float32 step; every implementation's int8 step reading at least 60%
  of the read bandwidth.

The recall example's accuracy target (greedy tokens with an int8 cache equal the float
cache's on at least 99% of the steps) needs the trained model, which the bench does not
have: ``python -m examples.recall quantized`` measures it.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from .._base.validate import describe
from .._core.paged import paged_attention
from .._core.quantize import quantize_kv
from .._layers.caches.kv_cache import cache_bytes, combines
from .._layers.config import AttentionConfig
from .._layers.linen.attention import CausalSelfAttention
from ._bandwidth import bandwidth_target
from ._markdown import table
from ._masks import refusal_of_first_call
from ._measure import pair_target, time_interleaved

STORAGE = "int8"
BASELINE = "bfloat16"
WIDE = "float32"  # the baseline's pages widened: what the bfloat16 step is held against
CACHE_DTYPES = ("float32", "bfloat16", "int8", "float8_e4m3fn")
BYTES_BOUND = {"float32": 0.27, "bfloat16": 0.53}  # int8's bytes per token, at most
NATIVE_SPEEDUP = 1.6  # native's int8 step against its bfloat16 step, and bfloat16 against
# float32, at least
EXAMPLE_TARGET = (
    "recall example: greedy tokens with an int8 cache equal the float cache's on >= 99% "
    "of the steps"
)


def bytes_per_token(n_heads: int, kv_heads: int, head_dim: int, dtype: str) -> int:
    """Bytes one token adds to one layer's cache in ``dtype`` (a float dtype: the
    layer's compute dtype; a storage dtype: ``kv_cache_dtype``, float32 compute), as
    ``cache_bytes`` counts them."""
    quantized = dtype in ("int8", "float8_e4m3fn")
    config = AttentionConfig(
        d_model=n_heads * head_dim, n_heads=n_heads, n_kv_heads=kv_heads,
        dtype="float32" if quantized else dtype,
        kv_cache_dtype=dtype if quantized else None,
    )  # fmt: skip
    layer = CausalSelfAttention(config)

    def total(capacity: int) -> int:
        x = jnp.zeros((1, capacity, config.d_model), config.dtype)
        init = functools.partial(layer.init, deterministic=True, decode=True)
        (count,) = cache_bytes(jax.eval_shape(init, jax.random.key(0), x)["cache"]).values()
        return count

    return total(2) - total(1)


def cache_row(n_heads: int, kv_heads: int, head_dim: int) -> dict:
    """Bytes per token and layer for each of :data:`CACHE_DTYPES`, and int8's ratio to
    each float dtype of :data:`BYTES_BOUND`."""
    sizes = {d: bytes_per_token(n_heads, kv_heads, head_dim, d) for d in CACHE_DTYPES}
    ratios = {d: sizes[STORAGE] / sizes[d] for d in BYTES_BOUND}
    return {"N": n_heads, "K": kv_heads, "H": head_dim, "bytes": sizes, "ratios": ratios}


@dataclasses.dataclass(frozen=True)
class QuantizedPool:
    """The bfloat16 pool of the serving shape and the same pages quantized: values
    (P, page_size, K, H) of :data:`STORAGE` twice, scales (P, page_size, K) float32
    twice, and the bytes the quantized decode step reads."""

    key_pages: jax.Array
    value_pages: jax.Array
    key_scales: jax.Array
    value_scales: jax.Array
    read_bytes: int


@functools.lru_cache(maxsize=1)
def quantized_pool(shape, pool) -> QuantizedPool:
    """The bfloat16 inputs ``pool(shape, "bfloat16")`` (the serving part's
    :func:`~._serving.pool`) with their pages quantized by ``nanoattn.quantize_kv``."""
    data = pool(shape, BASELINE)
    (kq, ks), (vq, vs) = (quantize_kv(p, STORAGE) for p in (data.key_pages, data.value_pages))
    arrays = (kq, vq, ks, vs, data.query)
    read = sum(int(np.prod(a.shape)) * a.dtype.itemsize for a in arrays)
    return QuantizedPool(kq, vq, ks, vs, read)


def calls(implementation: str, shape, pool) -> dict:
    """The int8, the bfloat16 and the float32 decode step over the inputs of
    ``pool(shape, "bfloat16")`` (float32: its pages widened, the same numbers), as
    functions of nothing: ``{"int8": ..., "bfloat16": ..., "float32": ...}``."""
    quantized = quantized_pool(shape, pool)
    data = pool(shape, BASELINE)
    paged = jax.jit(functools.partial(paged_attention, implementation=implementation))
    starts = np.arange(shape.batch + 1, dtype=np.int32)  # one query each
    table, lengths = data.page_table, data.lengths
    wide = [x.astype(WIDE) for x in (data.query, data.key_pages, data.value_pages)]
    kq, vq = quantized.key_pages, quantized.value_pages
    K, H = kq.shape[2:]
    # each pool as a paged attention layer keeps it (combines)
    stored = (jnp.stack([kq, vq], axis=2), None) if combines(K, H, kq.dtype) else (kq, vq)
    baseline = data.layer_pools()
    if combines(K, H, WIDE):
        wide = [wide[0], jnp.stack(wide[1:], axis=2), None]
    return {
        STORAGE: lambda: paged(
            data.query, *stored, table, lengths, starts,
            key_scales=quantized.key_scales, value_scales=quantized.value_scales,
        ),
        BASELINE: lambda: paged(data.query, *baseline, table, lengths, starts),
        WIDE: lambda: paged(*wide, table, lengths, starts),
    }  # fmt: skip


def measure_quantized(implementation: str, shape, pool) -> dict:
    """The int8, bfloat16 and float32 decode steps on one implementation, over the inputs
    of ``pool(shape, "bfloat16")``: median and min ms of each, the speedups (bfloat16
    over int8, float32 over bfloat16), the bytes read and the int8 step's GB/s; or a
    status saying why not."""
    row = {
        "case": "quantized", "impl": implementation, "storage": STORAGE, "baseline": BASELINE,
        "B": shape.batch, "N": shape.n_heads, "K": shape.kv_heads, "H": shape.head_dim,
        "page_size": shape.page_size, "lengths": [shape.shortest, shape.longest],
        "rounds": shape.rounds,
    }  # fmt: skip
    try:
        runs = {}
        for name, call in calls(implementation, shape, pool).items():
            run = lambda call=call: jax.block_until_ready(call())  # noqa: E731
            if reason := refusal_of_first_call(run):  # compiles, or the backend refuses
                what = "quantized keys" if name == STORAGE else "a page table"
                return row | {"status": f"{implementation} does not serve {what}",
                              "reason": reason}  # fmt: skip
            runs[name] = run
        times = time_interleaved(runs, rounds=shape.rounds, warmup=0)  # warmed up above
    except Exception as e:  # reported in the table, not fatal to the rest of the bench
        return row | {"status": f"error: {describe(e)[:200]}"}
    for name, (median, best) in times.items():
        row[f"{name}_median_ms"], row[f"{name}_min_ms"] = median * 1e3, best * 1e3
    row["read_bytes"] = quantized_pool(shape, pool).read_bytes
    row["gb_per_s"] = row["read_bytes"] / (row[f"{STORAGE}_median_ms"] / 1e3) / 1e9
    row["speedup"] = row[f"{BASELINE}_median_ms"] / row[f"{STORAGE}_median_ms"]
    row["wide_speedup"] = row[f"{WIDE}_median_ms"] / row[f"{BASELINE}_median_ms"]
    return row | {"status": "ok"}


def with_bandwidth(rows: list[dict], bandwidth: float | None) -> list[dict]:
    """The rows, each measured one with its fraction of the read ``bandwidth``."""
    if not bandwidth:
        return rows
    return [r | {"fraction": r["gb_per_s"] / bandwidth} if r["status"] == "ok" else r
            for r in rows]  # fmt: skip


def quantized_targets(cache: dict, rows: list[dict], bandwidth: dict) -> list[dict]:
    """The targets of the quantized cache: its bytes, native's speedup, every
    implementation's share of the read bandwidth, and the example's accuracy (measured
    by the example, not here)."""
    out = []
    sizes = cache["bytes"]
    for dtype, bound in BYTES_BOUND.items():
        ratio = cache["ratios"][dtype]
        out.append({
            "target": f"serving int8 cache: bytes per token per layer <= {bound}x {dtype}",
            "measured": f"{sizes[STORAGE]} bytes (scales included) against {sizes[dtype]}: "
            f"{ratio:.3f}x (N={cache['N']}, K={cache['K']}, H={cache['H']})",
            "passed": ratio <= bound,
        })  # fmt: skip
    for row in rows:
        what = f"serving int8 decode {row['impl']}"
        if row["impl"] == "native":
            target = f"{what}: >= {NATIVE_SPEEDUP}x faster than {BASELINE} pages"
            out.append(pair_target(target, row, STORAGE, BASELINE, "speedup",
                                   lambda speedup: speedup >= NATIVE_SPEEDUP))  # fmt: skip
            target = (f"serving {BASELINE} decode native: >= {NATIVE_SPEEDUP}x faster than "
                      f"{WIDE} pages (the same numbers)")  # fmt: skip
            out.append(pair_target(target, row, BASELINE, WIDE, "wide_speedup",
                                   lambda speedup: speedup >= NATIVE_SPEEDUP))  # fmt: skip
        read = row.get("read_bytes", 0) / 2**20  # read where measured
        amount = f"{read:.0f} MiB (int8 keys and values, float32 scales, queries)"
        out.append(bandwidth_target(f"{what}: bytes read", amount, STORAGE, row, bandwidth))
    out.append({
        "target": EXAMPLE_TARGET,
        "measured": "not measured by the bench: `python -m examples.recall quantized` prints it",
        "passed": None,
    })  # fmt: skip
    return out


def quantized_markdown(cache: dict | None, rows: list[dict], status) -> list[str]:
    """The bytes table and the int8 decode table (``status(row)``: a refused row's text)."""
    lines = []
    if cache:
        sizes = cache["bytes"]
        lines += [
            "",
            f"| cache dtype: bytes per token per layer (N={cache['N']}, K={cache['K']}, "
            f"H={cache['H']}, scales included) | bytes | int8 / this |",
            "|" + " --- |" * 3,
        ]
        for dtype, size in sizes.items():
            lines.append(f"| {dtype} | {size} | {sizes[STORAGE] / size:.3f}x |")
    if rows:

        def cells(r):
            fraction = r.get("fraction")
            return [
                f"{r[f'{STORAGE}_median_ms']:.2f} ({r[f'{STORAGE}_min_ms']:.2f})",
                f"{r[f'{BASELINE}_median_ms']:.2f} ({r[f'{BASELINE}_min_ms']:.2f})",
                f"{r['speedup']:.2f}x",
                f"{r[f'{WIDE}_median_ms']:.2f} ({r[f'{WIDE}_min_ms']:.2f})",
                f"{r['wide_speedup']:.2f}x",
                f"{r['read_bytes'] / 2**20:.1f}", f"{r['gb_per_s']:.1f}",
                "" if fraction is None else f"{fraction:.0%}",
            ]  # fmt: skip

        lines += ["", *table(
            f"| decode: int8 pages against {BASELINE} and {WIDE} | int8 ms | {BASELINE} ms | "
            f"{BASELINE} / int8 | {WIDE} ms | {WIDE} / {BASELINE} | int8 MiB read | int8 GB/s "
            "| of read bandwidth |", 9, rows,
            lambda r: f"| {r['impl']} |", cells, status,
        )]  # fmt: skip
    return lines
