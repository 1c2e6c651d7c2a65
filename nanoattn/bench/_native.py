"""The native kernel against PyTorch's SDPA: the targets of docs/performance.md.

Causal, float32, on the CPU. Each (shape, T, B, pass) pair is timed in turn,
native then torch, round after round in one process, so that load on a
shared machine falls on both alike (:func:`time_interleaved`). torch runs
with its default thread count (one per core); the native kernel with XLA's
CPU thread pool (one per core) and the calling thread.

Targets:
- T = 1024 to 8192, both head shapes, at B = 1 and at B x T = 8192, forward
  and forward+backward: at least as fast as torch.
- Forward at T = 4096, B = 1: at least 50% of the measured float32 matmul peak.
- T = 128 and 256 at B x T = 8192: within 1.5x of torch's time.
"""

import jax

from .._validate import describe
from . import _torch
from ._cell import inputs
from ._measure import causal_flops, jax_pass, time_interleaved
from ._peers import PEERS

LENGTHS = (128, 256, 1024, 2048, 4096, 8192)
SHORT = (128, 256)
TOKENS = 8192
ROUNDS = 3
PEAK_FRACTION = 0.5
SHORT_SLACK = 1.5


def batches(T: int) -> list[int]:
    """B = 8192 // T always; B = 1 as well from T = 1024."""
    sizes = [max(1, TOKENS // T)]
    return [*sizes, 1] if T >= 1024 and sizes[0] != 1 else sizes


def measure_pair(B: int, T: int, N: int, H: int, backward: bool, peak: float) -> dict:
    """Median and min ms of native and torch on the same inputs, and native's GFLOP/s."""
    cell = {"B": B, "T": T, "N": N, "H": H, "pass": "fwd+bwd" if backward else "fwd"}
    reason = _torch.available()
    if reason:
        return cell | {"status": f"skipped: {reason}"}
    try:
        q, k, v = inputs(B, T, N, H, "float32")
        fn = jax_pass(PEERS["native"].fn, backward)
        runs = {
            "native": lambda: jax.block_until_ready(fn(q, k, v)),
            "torch": _torch.make_run(q, k, v, backward, "float32"),
        }
        times = time_interleaved(runs, rounds=ROUNDS)
    except Exception as e:  # reported, not fatal
        return cell | {"status": f"error: {describe(e)[:200]}"}
    (native, native_min), (torch, torch_min) = times["native"], times["torch"]
    gflops = causal_flops(B, T, N, H, backward) / native / 1e9
    return cell | {
        "status": "ok",
        "native_ms": native * 1e3,
        "native_min_ms": native_min * 1e3,
        "torch_ms": torch * 1e3,
        "torch_min_ms": torch_min * 1e3,
        "speedup": torch / native,
        "gflops": gflops,
        "pct_peak": 100 * gflops / peak,
    }


def measure_native(lengths, shapes, peak: float, progress=None) -> list[dict]:
    """Every pair of the grid: lengths x shapes x batches x passes."""
    jobs = [
        (B, T, N, H, backward)
        for N, H in shapes
        for T in lengths
        for B in batches(T)
        for backward in (False, True)
    ]
    cells = []
    for i, (B, T, N, H, backward) in enumerate(jobs):
        if progress:
            progress(i, len(jobs), f"native vs torch: {N}x{H} B={B} T={T}")
        cells.append(measure_pair(B, T, N, H, backward, peak))
    return cells


def native_targets(cells: list[dict]) -> list[dict]:
    """The targets, judged from the measured pairs (None where torch could not run)."""
    rows = []
    for c in cells:
        what = f"{c['pass']} {c['N']}x{c['H']} B={c['B']} T={c['T']}"
        ok = c["status"] == "ok"
        short = c["T"] in SHORT
        bar = 1 / SHORT_SLACK if short else 1.0
        rows.append(
            {
                "target": f"native {what}: "
                + ("within 1.5x of torch's time" if short else "at least as fast as torch"),
                "measured": (
                    f"native {c['native_ms']:.1f} ms, torch {c['torch_ms']:.1f} ms: "
                    f"{c['speedup']:.2f}x torch's speed"
                    if ok
                    else c["status"]
                ),
                "passed": (c["speedup"] >= bar) if ok else None,
            }
        )
        if ok and c["pass"] == "fwd" and c["T"] == 4096 and c["B"] == 1:
            rows.append(
                {
                    "target": f"native {what}: >= 50% of the float32 matmul peak",
                    "measured": f"{c['gflops']:.1f} GFLOP/s, {c['pct_peak']:.0f}% of peak",
                    "passed": c["pct_peak"] >= 100 * PEAK_FRACTION,
                }
            )
    return rows


def native_markdown(cells: list[dict]) -> list[str]:
    """The table of pairs: times, speed relative to torch, share of the peak."""
    if not cells:
        return []
    lines = [
        "",
        "### Native kernel against torch SDPA (f32, causal; median ms, timed in turn)",
        "",
        "| shape | B | T | pass | native ms | torch ms | native speed / torch | % of peak |",
        "|" + " --- |" * 8,
    ]
    for c in cells:
        head = f"| {c['N']}x{c['H']} | {c['B']} | {c['T']} | {c['pass']} |"
        if c["status"] != "ok":
            lines.append(f"{head} {c['status']} | | | |")
            continue
        lines.append(
            f"{head} {c['native_ms']:.1f} | {c['torch_ms']:.1f} | {c['speedup']:.2f}x "
            f"| {c['pct_peak']:.0f}% |"
        )
    return lines
