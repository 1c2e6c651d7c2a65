"""Serving (issues #33 and #35): decode attention over a paged KV cache, against the
memory read bandwidth and a full cache, over int8 pages against bfloat16 ones, and a
mixed call of a prefill chunk and decode tokens.

B = 16 sequences of lengths spread evenly over 512-8192 keys, N = 32 query heads on
K = 8 key/value heads of width 128 (:data:`FULL`), in each of :data:`DTYPES`, their
keys and values in pages of :data:`PAGE_SIZE` tokens laid in a shuffled order in one
pool, for every implementation that serves a page table (the others get a row with
their refusal):

* ``read``: the machine's memory read bandwidth, measured in the same run: the best
  of a jitted sum and numpy sums in a thread per core over ``read_mib`` MiB of float32
  (:mod:`nanoattn.bench._bandwidth`).
* ``page walk``: the same reads over chunks of one page of one pool (int8, bfloat16,
  float32) in a shuffled order: how far runs of memory that short (a decode's tile
  reads no longer ones) stay below the in-order read bandwidth on this machine
  (reported, not judged).
* ``quantized``: the cache's bytes per token per layer per dtype, and the decode batch
  below over int8 pages against bfloat16 pages (:mod:`nanoattn.bench._quantized`).
* ``decode``: one query token per sequence through ``paged_attention`` over the pool
  as a paged attention layer keeps it (one combined pool (P, page_size, 2, K, H) where a
  token's keys and values take 2-4 KiB, as bfloat16's and int8's here, else two
  pools: ``nanoattn._layers.caches.paged.combines``); the bytes of
  the pages the sequences hold (keys and values), read once, divided by the call's
  time, as a fraction of the read bandwidth (target >= 60%). A combined pool's step
  is also timed over the same pages as two pools (reported, not judged). Then the same batch
  through a full cache of capacity 8192 (``dot_product_attention`` with
  ``kv_lengths`` over (16, 8192, 8, 128) keys and values, the same implementation):
  the dense step within 1.1x of the paged one (a decoding step over a full cache reads
  only the keys its rows hold, as the paged one does), the cache as a layer keeps it
  (combined where the pool is). The two are timed in turn.
* ``mixed``: one call with a 512-token prefill chunk (sequence 0, 512 keys) and one
  decode token of each of the 15 others, against the prefill chunk alone and the 15
  decode tokens alone (two calls): at most 1.1x their sum (issue #47; the bound was
  1.2x the chunk alone). The three are timed in turn.

Every pair is called once first (compiling it, and finding whether the implementation
serves it), then timed round after round (:func:`time_interleaved`), each
implementation alone. The targets are judged at :data:`FULL` only; ``--quick``
(:data:`QUICK`) runs the same code at small sizes. The engine's target (continuous
batching at least 5x the tokens/s of static batching in the same cache memory) is the
engine part's (:mod:`nanoattn.bench._engine`).
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from .._backends import registry
from .._base.validate import describe
from .._core.api import dot_product_attention
from .._core.paged import paged_attention
from .._layers.caches.kv_cache import combines
from . import _quantized
from ._bandwidth import bandwidth_target, measure_page_walk, measure_read
from ._decode_cases import page_table
from ._markdown import table
from ._masks import refusal_of_first_call
from ._measure import pair_target, time_interleaved

DTYPES = ("bfloat16", "float32")
PAGE_SIZE = 16
ROUNDS = 5
DENSE_BOUND = 1.1  # the full cache's decode step against the paged one, at most
MIXED_BOUND = 1.1  # the mixed call against the prefill chunk alone + the decodes alone, at most


@dataclasses.dataclass(frozen=True)
class Shape:
    """The sizes of the serving part: B sequences of lengths spread evenly over
    [shortest, longest] (the full cache's capacity), N query heads on K key/value heads
    of width H, pages of ``page_size`` tokens, a prefill chunk of ``prefill`` tokens
    (sequence 0 holds exactly that many), a read bandwidth measured over ``read_mib``
    MiB, ``rounds`` timed rounds of each pair."""

    batch: int
    shortest: int
    longest: int
    n_heads: int
    kv_heads: int
    head_dim: int
    page_size: int
    prefill: int
    read_mib: int
    rounds: int = ROUNDS

    def lengths(self) -> np.ndarray:
        """(B,) int32 keys per sequence, from ``shortest`` to ``longest``."""
        return np.linspace(self.shortest, self.longest, self.batch).round().astype(np.int32)


FULL = Shape(16, 512, 8192, 32, 8, 128, PAGE_SIZE, 512, 1024)
QUICK = Shape(16, 64, 512, 8, 2, 32, PAGE_SIZE, 64, 256, rounds=3)


@dataclasses.dataclass(frozen=True)
class Pool:
    """One dtype's inputs: the pool (P, page_size, K, H) twice, and the same pages as
    one combined pool (P, page_size, 2, K, H) where a layer would keep them so (else
    None), the page table (B, M), the lengths (B,), a decode query (B, N, H), a
    prefill chunk (prefill, N, H), the full cache as a layer keeps it ((B, longest, K,
    H) twice, or one (B, longest, 2, K, H) and None), and the bytes of the pages
    held."""

    key_pages: jax.Array
    value_pages: jax.Array
    combined: jax.Array | None
    page_table: np.ndarray
    lengths: np.ndarray
    query: jax.Array
    chunk: jax.Array
    key_cache: jax.Array
    value_cache: jax.Array | None
    held_bytes: int

    def layer_pools(self) -> tuple:
        """``(key_pages, value_pages)`` as a paged attention layer keeps them: the
        combined pool and None where there is one, else the two pools."""
        if self.combined is not None:
            return self.combined, None
        return self.key_pages, self.value_pages


@functools.lru_cache(maxsize=1)  # one dtype's arrays at a time: GiBs at the full shape
def pool(shape: Shape, dtype: str) -> Pool:
    """The inputs of ``shape`` in ``dtype``: each sequence's pages drawn from a shuffled
    pool, its keys and values random (the full cache holds the same in its rows)."""
    ps, K, H = shape.page_size, shape.kv_heads, shape.head_dim
    lengths = shape.lengths()
    table, P = page_table(lengths, ps)  # (B, M): M pages hold the longest
    keys = jax.random.split(jax.random.key(0), 4)
    dt = jnp.dtype(dtype)
    key_pages = jax.random.normal(keys[0], (P, ps, K, H), dt)
    value_pages = jax.random.normal(keys[1], (P, ps, K, H), dt)

    def cache(pages):  # (B, longest, ...): row b's keys at their positions
        rows = pages[table].reshape(shape.batch, -1, *pages.shape[2:])  # (B, M * ps, ...)
        return rows[:, : shape.longest]

    query = jax.random.normal(keys[2], (shape.batch, shape.n_heads, H), dt)
    chunk = jax.random.normal(keys[3], (shape.prefill, shape.n_heads, H), dt)
    held_bytes = 2 * P * ps * K * H * dt.itemsize  # keys and values of the pages held
    if combines(K, H, dt):  # as a layer keeps them: a combined pool and full cache
        combined = jnp.stack([key_pages, value_pages], axis=2)
        return Pool(key_pages, value_pages, combined, table, lengths, query, chunk,
                    cache(combined), None, held_bytes)  # fmt: skip
    return Pool(key_pages, value_pages, None, table, lengths, query, chunk,
                cache(key_pages), cache(value_pages), held_bytes)  # fmt: skip


def _calls(case: str, shape: Shape, data: Pool, implementation: str) -> dict:
    """The two calls of a case, as functions of nothing: subject first."""
    B = shape.batch
    paged = jax.jit(functools.partial(paged_attention, implementation=implementation))
    (kp, vp), table, lengths = data.layer_pools(), data.page_table, data.lengths
    if case == "decode":
        starts = np.arange(B + 1, dtype=np.int32)  # one query each
        full = jax.jit(
            lambda q, k, v, n: dot_product_attention(
                q, k, v, kv_lengths=n, implementation=implementation
            )
        )
        q_full = data.query[:, None]  # (B, 1, N, H)
        calls = {
            "paged": lambda: paged(data.query, kp, vp, table, lengths, starts),
            "full": lambda: full(q_full, data.key_cache, data.value_cache, lengths),
        }
        if data.combined is not None:  # the same pages as two pools
            k2, v2 = data.key_pages, data.value_pages
            calls["two"] = lambda: paged(data.query, k2, v2, table, lengths, starts)
        return calls
    # mixed: sequence 0's prefill chunk of all its keys, one decode token of the others
    if lengths[0] != shape.prefill:
        raise ValueError(f"sequence 0 must hold the {shape.prefill} keys of the prefill chunk")
    q_mixed = jnp.concatenate([data.chunk, data.query[1:]])  # (prefill + B - 1, N, H)
    starts = np.concatenate([[0], shape.prefill + np.arange(B)]).astype(np.int32)
    alone = np.array([0, shape.prefill], np.int32)
    decodes = np.arange(B, dtype=np.int32)  # one query each of the B - 1 others
    return {
        "mixed": lambda: paged(q_mixed, kp, vp, table, lengths, starts),
        "alone": lambda: paged(data.chunk, kp, vp, table[:1], lengths[:1], alone),
        "decodes": lambda: paged(data.query[1:], kp, vp, table[1:], lengths[1:], decodes),
    }


def measure_case(case: str, implementation: str, dtype: str, shape: Shape = FULL) -> dict:
    """One case ("decode" or "mixed") on one implementation in one dtype: median and
    min ms of both calls and their measures; or a status saying why not."""
    row = {
        "case": case, "impl": implementation, "dtype": dtype, "B": shape.batch,
        "N": shape.n_heads, "K": shape.kv_heads, "H": shape.head_dim,
        "page_size": shape.page_size, "lengths": [shape.shortest, shape.longest],
        "prefill": shape.prefill, "rounds": shape.rounds,
    }  # fmt: skip
    try:
        data = pool(shape, dtype)
        runs = {}
        for name, call in _calls(case, shape, data, implementation).items():
            run = lambda call=call: jax.block_until_ready(call())  # noqa: E731
            if reason := refusal_of_first_call(run):  # compiles, or the backend refuses
                what = "a full cache" if name == "full" else "a page table"
                return row | {"status": f"{implementation} does not serve {what}",
                              "reason": reason}  # fmt: skip
            runs[name] = run
        times = time_interleaved(runs, rounds=shape.rounds, warmup=0)  # the calls above warmed up
    except Exception as e:  # reported in the table, not fatal to the rest of the bench
        return row | {"status": f"error: {describe(e)[:200]}"}
    for name, (median, best) in times.items():
        row[f"{name}_median_ms"], row[f"{name}_min_ms"] = median * 1e3, best * 1e3
    row["status"] = "ok"
    if case == "decode":
        row["held_bytes"] = data.held_bytes
        row["paged_gb_per_s"] = data.held_bytes / (row["paged_median_ms"] / 1e3) / 1e9
        row["full_vs_paged"] = row["full_median_ms"] / row["paged_median_ms"]
        row["pool"] = "one" if data.combined is not None else "two"
        if "two_median_ms" in row:
            row["two_vs_paged"] = row["two_median_ms"] / row["paged_median_ms"]
    else:
        row["parts_median_ms"] = row["alone_median_ms"] + row["decodes_median_ms"]
        row["mixed_vs_parts"] = row["mixed_median_ms"] / row["parts_median_ms"]
    return row


def page_bytes(shape: Shape) -> dict[str, int]:
    """The bytes of one page of one pool (keys or values), int8, bfloat16 and float32."""
    tokens = shape.page_size * shape.kv_heads * shape.head_dim
    return {"int8": tokens, "bfloat16": 2 * tokens, "float32": 4 * tokens}


def jobs(shape: Shape = FULL, dtypes=DTYPES, implementations=None) -> list[tuple[str, tuple]]:
    """(progress label, the measuring function and its arguments) of the read bandwidth,
    the cache's bytes per dtype, the int8 decode of every implementation (default: every
    registered one; first, while the bfloat16 inputs it shares with the decode case are
    kept), then every case, dtype and implementation."""
    names = registry.names() if implementations is None else implementations
    items = [
        ("read bandwidth", (measure_read, shape.read_mib, shape.rounds)),
        ("page walk", (measure_page_walk, shape.read_mib, page_bytes(shape), shape.rounds)),
        ("cache bytes per dtype", (_quantized.cache_row, shape.n_heads, shape.kv_heads,
                                   shape.head_dim)),
    ]  # fmt: skip
    for name in names:
        items.append((f"int8 decode {name}", (_quantized.measure_quantized, name, shape, pool)))
    for case in ("decode", "mixed"):
        for dtype in dtypes:
            for name in names:
                items.append((f"{case} {name} {dtype}", (measure_case, case, name, dtype, shape)))
    return items


def measure_serving(shape: Shape = FULL, report=None, **options) -> dict:
    """The read bandwidth, the cache bytes and every case; ``report(i, n, label)`` is
    called before each."""
    items = jobs(shape, **options)
    rows = []
    for i, (label, (fn, *args)) in enumerate(items):
        if report:
            report(i, len(items), label)
        rows.append(fn(*args))
    read, walk, cache, *cases = rows
    bandwidth = read.get("gb_per_s")
    for row in cases:
        if row["status"] == "ok" and row["case"] == "decode" and bandwidth:
            row["fraction_of_bandwidth"] = row["paged_gb_per_s"] / bandwidth
    quantized = _quantized.with_bandwidth([r for r in cases if r["case"] == "quantized"],
                                          bandwidth)  # fmt: skip
    return {
        "shape": dataclasses.asdict(shape), "bandwidth": read, "page_walk": walk,
        "cache_bytes": cache,
        "quantized": quantized, "rows": [r for r in cases if r["case"] != "quantized"],
    }  # fmt: skip


def serving_targets(result: dict) -> list[dict]:
    """The targets, judged at :data:`FULL` only (None where a row has no measure), and
    the quantized cache's accuracy, which ``python -m examples.recall quantized``
    measures."""
    if result["shape"] != dataclasses.asdict(FULL):
        return []
    read = result["bandwidth"]
    out = _quantized.quantized_targets(result["cache_bytes"], result["quantized"], read)
    for row in result["rows"]:
        what = f"serving {row['case']} {row['impl']} {row['dtype']}"
        if row["case"] == "decode":
            held = f"{row.get('held_bytes', 0) / 2**20:.0f} MiB"  # held where measured
            out.append(bandwidth_target(f"{what}: pages held", held, "paged", row, read))
            target = (f"{what}: a full cache of {FULL.longest} (kv_lengths) within "
                      f"{DENSE_BOUND}x the paged step on the same keys")  # fmt: skip
            out.append(pair_target(target, row, "full", "paged", "full_vs_paged",
                                   lambda ratio: ratio <= DENSE_BOUND))  # fmt: skip
        else:
            target = (
                f"{what}: a {FULL.prefill}-token prefill chunk + {FULL.batch - 1} decode "
                f"tokens <= {MIXED_BOUND}x (the chunk alone + the decodes alone)"
            )
            out.append(pair_target(target, row, "mixed", "parts", "mixed_vs_parts",
                                   lambda ratio: ratio <= MIXED_BOUND))  # fmt: skip
    return out


def _status(row: dict) -> str:
    """A row's status, with the refusal's reason when an implementation refused."""
    return f"{row['status']} ({row['reason']})" if "reason" in row else row["status"]


def _walk_line(walk: dict | None) -> list[str]:
    """The page walk's bandwidths (not judged), one line."""
    if not walk:
        return []
    if walk["status"] != "ok":
        return ["", f"Page walk: {walk['status']}."]
    each = ", ".join(
        f"{walk['chunk_bytes'][name] / 1024:g} KiB ({name}) {gb:.1f} GB/s"
        for name, gb in walk["gb_per_s"].items()
    )
    return [
        "",
        f"Page walk (chunks of one page of one pool, in a shuffled order, a thread per "
        f"core; not judged): {each}.",
    ]


def serving_markdown(result: dict | None) -> list[str]:
    """The serving tables: the read bandwidth, the cache bytes per dtype, the int8
    decode rows, the decode rows, the mixed rows."""
    if not result:
        return []
    s, read = result["shape"], result["bandwidth"]
    bandwidth = (
        f"{read['gb_per_s']:.1f} GB/s, the best of "
        + ", ".join(f"{name} {gb:.1f}" for name, gb in read["measures"].items())
        + f" ({read['bytes'] / 2**20:.0f} MiB read in {read['best_ms']:.2f} ms by the "
        f"{read['how']}, {read['cores']} cores)"
        if read["status"] == "ok"
        else read["status"]
    )
    lines = [
        "",
        f"### Serving: B={s['batch']} sequences of {s['shortest']}-{s['longest']} keys, "
        f"{s['n_heads']} query heads on {s['kv_heads']} key/value heads of width "
        f"{s['head_dim']}, pages of {s['page_size']} tokens; median (min) ms, each pair "
        "timed in turn",
        "",
        f"Read bandwidth (a jitted sum and numpy sums in a thread per core over float32): "
        f"{bandwidth}.",
        *_walk_line(result.get("page_walk")),
        *_quantized.quantized_markdown(
            result.get("cache_bytes"), result.get("quantized", []), _status
        ),
        "",
    ]

    def label(r):
        return f"| {r['impl']} | {r['dtype']} |"

    walk = result.get("page_walk") or {}
    walked = walk.get("gb_per_s", {}) if walk.get("status") == "ok" else {}

    def decode(r):
        fraction, ceiling = r.get("fraction_of_bandwidth"), walked.get(r["dtype"])
        two = r.get("two_vs_paged")
        return [
            r.get("pool", ""), f"{r['paged_median_ms']:.2f} ({r['paged_min_ms']:.2f})",
            "" if two is None else f"{r['two_median_ms']:.2f} ({r['two_min_ms']:.2f}): {two:.2f}x",
            f"{r['full_median_ms']:.2f} ({r['full_min_ms']:.2f})", f"{r['full_vs_paged']:.2f}x",
            f"{r['paged_gb_per_s']:.1f}", "" if fraction is None else f"{fraction:.0%}",
            "" if ceiling is None else f"{r['paged_gb_per_s'] / ceiling:.0%}",
        ]  # fmt: skip

    def mixed(r):
        return [
            f"{r['mixed_median_ms']:.2f} ({r['mixed_min_ms']:.2f})",
            f"{r['alone_median_ms']:.2f} ({r['alone_min_ms']:.2f})",
            f"{r['decodes_median_ms']:.2f} ({r['decodes_min_ms']:.2f})",
            f"{r['mixed_vs_parts']:.2f}x",
        ]  # fmt: skip

    rows = {case: [r for r in result["rows"] if r["case"] == case] for case in ("decode", "mixed")}
    lines += table(
        "| decode | dtype | pool | paged ms | over two pools ms: / paged | full cache ms "
        "| full / paged | pages held GB/s | of read bandwidth | of its page walk |", 10,
        rows["decode"], label, decode, _status,
    )  # fmt: skip
    lines += ["", *table(
        f"| mixed: {s['prefill']}-token chunk + {s['batch'] - 1} decodes | dtype | mixed ms "
        "| chunk alone ms | decodes alone ms | mixed / (chunk + decodes) |", 6, rows["mixed"],
        label, mixed, _status,
    )]  # fmt: skip
    return lines
