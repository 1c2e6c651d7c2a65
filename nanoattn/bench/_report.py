"""Writing benchmark results: JSON, a markdown table and a plot."""

import json
import pathlib

from ._cascade import cascade_markdown
from ._decode_report import decode_markdown
from ._engine import engine_markdown
from ._engine_prefix import prefix_markdown
from ._masks import masks_markdown
from ._native import native_markdown
from ._selection import selection_markdown
from ._serving import serving_markdown
from ._sharded import sharded_markdown
from ._tree import tree_markdown


def _cell_map(results: dict) -> dict:
    return {(c["impl"], c["shape"], c["T"], c["pass"]): c for c in results["cells"]}


def _ms(cell) -> str:
    if cell is None:
        return ""
    if cell["status"] != "ok":
        return "skipped" if cell["status"].startswith("skipped") else "error"
    return f"{cell['median_ms']:.1f} ({cell['min_ms']:.1f})"


def markdown(results: dict) -> str:
    """Tables of median times, flash's speedup over each peer, throughput and memory."""
    m = results["machine"]
    lines = [
        f"Machine: {m['platform']} ({m['device']}, {m['cpu_count']} CPUs, {m['processor']}); "
        f"jax {m['jax']}; torch {m['torch'] or 'not installed'}; measured f32 matmul peak "
        f"{m['matmul_peak_gflops']:.0f} GFLOP/s.",
    ]
    lines += grid_markdown(results)
    lines += generation_markdown(results.get("generation") or [])
    lines += window_markdown(results.get("window"))
    lines += native_markdown(results.get("native") or [], m.get("native_isa"))
    lines += masks_markdown(results.get("masks") or [])
    lines += serving_markdown(results.get("serving"))
    lines += decode_markdown(results.get("decode"))
    lines += engine_markdown(results.get("engine"))
    lines += prefix_markdown((results.get("engine") or {}).get("prefix"))
    lines += selection_markdown(results.get("selection"))
    lines += tree_markdown(results.get("tree"))
    lines += cascade_markdown(results.get("cascade"))
    lines += sharded_markdown(results.get("sharded"))
    lines += targets_markdown(results["targets"])
    notes = sorted(
        {
            f"{c['impl']} {c['shape']} T={c['T']}: {c['status']}"
            for c in results["cells"]
            if c["status"] != "ok"
        }
    )
    if notes:
        lines += ["", "Not measured:", *[f"- {n}" for n in notes]]
    return "\n".join(lines) + "\n"


def grid_markdown(results: dict) -> list[str]:
    """The grid's tables: for each head shape, the times of each pass and the memory."""
    if not results["cells"]:
        return []
    config, cells = results["config"], _cell_map(results)
    impls = [i for i in config["implementations"] if any(k[0] == i for k in cells)]
    lines = [
        f"Causal attention, {config['dtype']}, batch B = {config['tokens']} / T (at least "
        "1). Times are in ms, the median (and the minimum) of at least 3 runs after a "
        "warm-up; ratios use the medians; GFLOP/s counts the ideal causal FLOPs (the "
        "backward pass as 2.5x the forward)."
    ]
    for N, H in config["shapes"]:
        for pass_ in ("fwd", "fwd+bwd"):
            lines += _times_table(cells, impls, config["lengths"], N, H, pass_)
        lines += _memory_table(cells, impls, config["lengths"], N, H)
    return lines


def _times_table(cells: dict, impls: list, lengths, N: int, H: int, pass_: str) -> list[str]:
    """One pass at one head shape: each implementation's time, flash's speedup over each
    peer and flash's throughput, a row per length T."""
    shape, peers = f"{N}x{H}", [i for i in impls if i != "flash"]
    lines = [
        "",
        f"### {N} heads of width {H}, {pass_}",
        "",
        "| T | B | "
        + " | ".join(f"{i} ms" for i in impls)
        + " | "
        + " | ".join(f"flash vs {p}" for p in peers)
        + " | flash GFLOP/s (% peak) |",
        "|" + " --- |" * (3 + len(impls) + len(peers)),
    ]
    for T in lengths:
        row = {i: cells.get((i, shape, T, pass_)) for i in impls}
        flash = row.get("flash")
        ratios = []
        for p in peers:
            cell = row.get(p)
            ok = flash and cell and flash["status"] == cell["status"] == "ok"
            ratios.append(f"{cell['median_ms'] / flash['median_ms']:.2f}x" if ok else "")
        B = next((c["B"] for c in row.values() if c), "")
        rate = (
            f"{flash['gflops']:.0f} ({flash['pct_peak']:.0f}%)"
            if flash and flash["status"] == "ok"
            else ""
        )
        lines.append(
            f"| {T} | {B} | "
            + " | ".join(_ms(row[i]) for i in impls)
            + " | "
            + " | ".join(ratios)
            + f" | {rate} |"
        )
    return lines


def _memory_table(cells: dict, impls: list, lengths, N: int, H: int) -> list[str]:
    """The compiled temporary memory of fwd+bwd of each JAX implementation, a row per T."""
    shape, jax_impls = f"{N}x{H}", [i for i in impls if i != "torch"]
    lines = [
        "",
        f"### {N} heads of width {H}, fwd+bwd compiled temporary memory (MiB)",
        "",
        "| T | " + " | ".join(jax_impls) + " |",
        "|" + " --- |" * (1 + len(jax_impls)),
    ]
    for T in lengths:
        row = []
        for i in jax_impls:
            cell = cells.get((i, shape, T, "fwd+bwd"))
            ok = cell and cell["status"] == "ok" and cell.get("temp_bytes") is not None
            row.append(f"{cell['temp_bytes'] / 2**20:.1f}" if ok else _ms(cell))
        lines.append(f"| {T} | " + " | ".join(row) + " |")
    return lines


def targets_markdown(targets: list[dict]) -> list[str]:
    """The targets table: each target, what was measured, and whether it was met."""
    if not targets:
        return []
    lines = [
        "",
        "### Targets (f32, causal; batch 1 and 4 heads of width 32 unless named)",
        "",
        "| target | measured | met |",
        "| --- | --- | --- |",
    ]
    for t in targets:
        met = {True: "yes", False: "NO", None: "n/a"}[t["passed"]]
        lines.append(f"| {t['target']} | {t['measured']} | {met} |")
    return lines


def generation_markdown(rows: list[dict]) -> list[str]:
    """The generation table: ms per token of each way, and the two ratios."""
    if not rows:
        return []
    first = rows[0]
    lines = [
        "",
        f"### Generation: ms per token, one layer D={first['D']}, {first['N']} heads, "
        f"B={first['B']}, {first['dtype']}",
        "",
        "cached: nanoattn's `CausalSelfAttention` one-token step with its KV cache; flax: "
        "`flax.linen.MultiHeadDotProductAttention(decode=True)` one-token step; both jitted, "
        "with projections, the cache donated, capacity = context + steps. recompute: the "
        "same layer's full causal forward on context + 1 tokens (NanoMoE's `generate`). "
        "prefill: nanoattn's one call writing the whole context into the empty cache (not "
        "part of a step). Median (min) per call, in one process: the two cached steps "
        "alternate token by token, with a recompute every few tokens "
        "(`nanoattn/bench/_generation.py`).",
        "",
        "| context | capacity | cached ms | flax ms | recompute ms | prefill ms "
        "| recompute / cached | flax / cached |",
        "|" + " --- |" * 8,
    ]
    for row in rows:
        if row["status"] != "ok":
            lines.append(f"| {row['context']} | {row['capacity']} | {row['status']} |")
            continue
        times = " | ".join(
            f"{row[f'{name}_median_ms']:.2f} ({row[f'{name}_min_ms']:.2f})"
            for name in ("cached", "flax", "recompute", "prefill")
        )
        lines.append(
            f"| {row['context']} | {row['capacity']} | {times} | "
            f"{row['recompute_vs_cached']:.1f}x | {row['flax_vs_cached']:.2f}x |"
        )
    for row in rows:  # the target context's two steps, each alone in its own process
        if "flax_vs_cached_alone" in row:
            lines += ["", (
                f"Each alone in a fresh process (context {row['context']}): cached "
                f"{row['cached_alone_median_ms']:.2f} ({row['cached_alone_min_ms']:.2f}) ms, "
                f"flax {row['flax_alone_median_ms']:.2f} ({row['flax_alone_min_ms']:.2f}) ms: "
                f"flax / cached {row['flax_vs_cached_alone']:.2f}x (the target's measure)."
            )]  # fmt: skip
        elif "alone_status" in row:
            lines += ["", f"Each alone (context {row['context']}): {row['alone_status']}."]
    return lines


def window_markdown(row: dict | None) -> list[str]:
    """The sliding-window table: full causal against windowed, time and memory."""
    if not row:
        return []
    lines = [
        "",
        f"### Sliding window: fwd+bwd, flash, T={row['T']}, B={row['B']}, "
        f"{row['N']} heads of width {row['H']}, {row['dtype']}",
        "",
        "| attention | ms | temp MiB |",
        "| --- | --- | --- |",
    ]
    if row["status"] != "ok":
        return [*lines, f"| {row['status']} | | |"]
    for name, label in (("full", "causal"), ("windowed", f"causal, window={tuple(row['window'])}")):
        ms = f"{row[f'{name}_median_ms']:.1f} ({row[f'{name}_min_ms']:.1f})"
        lines.append(f"| {label} | {ms} | {row[f'{name}_temp_bytes'] / 2**20:.1f} |")
    lines += ["", f"windowed / full time: {row['windowed_vs_full']:.3f}"]
    return lines


def plot(results: dict, path: pathlib.Path) -> str | None:
    """Time and memory against T on log axes; returns why not when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install 'nanoattn[bench]'): no plot"
    config, cells = results["config"], results["cells"]
    shapes = config["shapes"]
    fig, axes = plt.subplots(len(shapes), 3, figsize=(15, 4.2 * len(shapes)), squeeze=False)
    for row, (N, H) in enumerate(shapes):
        shape = f"{N}x{H}"
        panels = [
            ("fwd", "median_ms", "forward time (ms)"),
            ("fwd+bwd", "median_ms", "forward+backward time (ms)"),
            ("fwd+bwd", "temp_bytes", "forward+backward temp memory (MiB)"),
        ]
        for col, (pass_, key, title) in enumerate(panels):
            ax = axes[row][col]
            for impl in config["implementations"]:
                points = [
                    (c["T"], c[key])
                    for c in cells
                    if c["impl"] == impl
                    and c["shape"] == shape
                    and c["pass"] == pass_
                    and c["status"] == "ok"
                    and c.get(key) is not None
                ]
                if points:
                    xs, ys = zip(*sorted(points))
                    if key == "temp_bytes":
                        ys = [y / 2**20 for y in ys]
                    ax.plot(xs, ys, marker="o", label=impl)
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("T")
            ax.set_title(f"{N} heads x {H}: {title}")
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


def write(results: dict, out_dir: pathlib.Path) -> tuple[list[pathlib.Path], str | None]:
    """Writes results.json, results.md and results.png; returns the paths and a note."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / "results.json", out_dir / "results.md"]
    paths[0].write_text(json.dumps(results, indent=2))
    paths[1].write_text(markdown(results))
    if not results["cells"]:
        return paths, "no grid measured: no plot"
    note = plot(results, out_dir / "results.png")
    if note is None:
        paths.append(out_dir / "results.png")
    return paths, note
