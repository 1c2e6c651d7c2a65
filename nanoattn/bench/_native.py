"""The native kernel against PyTorch's SDPA: the targets of docs/performance.md.

Causal, on the CPU, float32 and bfloat16 (torch in the same dtype). Each
(dtype, shape, T, B, pass) pair is measured twice (:func:`nanoattn.bench._alone.compare`):
each implementation alone, in a fresh process of its own, so that no thread pool of the
other (torch's OpenMP, XLA's) still spins while it runs; and both alternated round after
round in this process, so that load on a shared machine falls on both alike. The targets
are judged on the alone figures; the report shows the alternated ratio beside the alone
one where they differ by more than 10%. torch runs with its default thread count (one per
core); the native kernel with XLA's CPU thread pool (one per core) and the calling thread.

Targets (issue #22):
- float32, T = 1024 to 8192, both head shapes, at B = 1 and at B x T = 8192,
  forward and forward+backward: at least as fast as torch.
- float32 forward at T = 4096, B = 1: at least 60% of the measured float32
  matmul peak.
- float32, T = 128 and 256 at B x T = 8192: at least 0.9x torch's speed (issue #34;
  0.8x before).
- bfloat16, T = 1024 to 4096, both head shapes, B = 1, forward and
  forward+backward: at least as fast as torch's bfloat16.
"""

from .._base.validate import describe
from . import _torch
from ._alone import compare
from ._measure import causal_flops

LENGTHS = (128, 256, 1024, 2048, 4096, 8192)
SHORT = (128, 256)
TOKENS = 8192
ROUNDS = 3
PEAK_FRACTION = 0.6
SHORT_SPEED = 0.9  # of torch's, at the SHORT lengths
BF16_LENGTHS = (1024, 2048, 4096)


def batches(T: int) -> list[int]:
    """B = 8192 // T always; B = 1 as well from T = 1024."""
    sizes = [max(1, TOKENS // T)]
    return [*sizes, 1] if T >= 1024 and sizes[0] != 1 else sizes


def measure_pair(
    B: int, T: int, N: int, H: int, backward: bool, peak: float, dtype: str = "float32"
) -> dict:
    """Median and min ms of native and torch on the same inputs, each alone (judged) and
    alternated, and native's GFLOP/s alone (its share of the float32 matmul ``peak``)."""
    cell = {"B": B, "T": T, "N": N, "H": H, "pass": "fwd+bwd" if backward else "fwd"}
    cell |= {"dtype": dtype}
    reason = _torch.available()
    if reason:
        return cell | {"status": f"skipped: {reason}"}
    try:
        got = compare("native", "torch", B, T, N, H, backward, dtype, rounds=ROUNDS)
    except Exception as e:  # reported, not fatal
        return cell | {"status": f"error: {describe(e)[:200]}"}
    (native, native_min), (torch, torch_min) = got["alone"]["native"], got["alone"]["torch"]
    alternated = got["alternated"]
    gflops = causal_flops(B, T, N, H, backward) / native / 1e9
    return cell | {
        "status": "ok",
        "native_ms": native * 1e3,
        "native_min_ms": native_min * 1e3,
        "torch_ms": torch * 1e3,
        "torch_min_ms": torch_min * 1e3,
        "speedup": got["ratio_alone"],
        "alternated_native_ms": alternated["native"][0] * 1e3,
        "alternated_torch_ms": alternated["torch"][0] * 1e3,
        "alternated_speedup": got["ratio_alternated"],
        "ratios_differ": got["differ"],
        "gflops": gflops,
        "pct_peak": 100 * gflops / peak,
    }


def measure_native(lengths, shapes, peak: float, progress=None) -> list[dict]:
    """Every pair of the grid: lengths x shapes x batches x passes in float32, then
    the bfloat16 lengths among ``lengths`` x shapes x passes at B = 1."""
    jobs = [
        (B, T, N, H, backward, "float32")
        for N, H in shapes
        for T in lengths
        for B in batches(T)
        for backward in (False, True)
    ]
    jobs += [
        (1, T, N, H, backward, "bfloat16")
        for N, H in shapes
        for T in lengths
        if T in BF16_LENGTHS
        for backward in (False, True)
    ]
    cells = []
    for i, (B, T, N, H, backward, dtype) in enumerate(jobs):
        if progress:
            tag = " bf16" if dtype == "bfloat16" else ""
            progress(i, len(jobs), f"native vs torch: {N}x{H} B={B} T={T}{tag}")
        cells.append(measure_pair(B, T, N, H, backward, peak, dtype))
    return cells


def native_targets(cells: list[dict]) -> list[dict]:
    """The targets, judged from the measured pairs (None where torch could not run)."""
    rows = []
    for c in cells:
        dtype = c.get("dtype", "float32")
        what = f"{dtype} {c['pass']} {c['N']}x{c['H']} B={c['B']} T={c['T']}"
        ok = c["status"] == "ok"
        short = c["T"] in SHORT
        bar = SHORT_SPEED if short else 1.0
        rows.append(
            {
                "target": f"native {what}: "
                + (
                    f"at least {SHORT_SPEED}x torch's speed"
                    if short
                    else "at least as fast as torch"
                ),
                "measured": _measured(c) if ok else c["status"],
                "passed": (c["speedup"] >= bar) if ok else None,
            }
        )
        if ok and dtype == "float32" and c["pass"] == "fwd" and c["T"] == 4096 and c["B"] == 1:
            rows.append(
                {
                    "target": f"native {what}: >= 60% of the float32 matmul peak",
                    "measured": f"{c['gflops']:.1f} GFLOP/s, {c['pct_peak']:.0f}% of peak",
                    "passed": c["pct_peak"] >= 100 * PEAK_FRACTION,
                }
            )
    return rows


def _measured(c: dict) -> str:
    """A pair's alone figures, and its alternated ratio where the two differ."""
    text = (
        f"native {c['native_ms']:.1f} ms, torch {c['torch_ms']:.1f} ms, each alone: "
        f"{c['speedup']:.2f}x torch's speed"
    )
    if c.get("ratios_differ"):
        text += f" (alternated in one process: {c['alternated_speedup']:.2f}x)"
    return text


def native_markdown(cells: list[dict], isa: str | None = None) -> list[str]:
    """The table of pairs: times, speed relative to torch, share of the peak."""
    if not cells:
        return []
    lines = [
        "",
        "### Native kernel against torch SDPA (causal; median ms, each alone)",
        "",
        f"The kernel was built for {isa or 'an unknown instruction set'}; % of peak is of "
        "the float32 matmul peak. Each implementation ran alone, in a process of its own; "
        "where the ratio of the two run alternated in one process differs by more than "
        "10%, it follows in brackets.",
        "",
        "| dtype | shape | B | T | pass | native ms | torch ms | native speed / torch "
        "| % of peak |",
        "|" + " --- |" * 9,
    ]
    for c in cells:
        dtype = c.get("dtype", "float32")
        head = f"| {dtype} | {c['N']}x{c['H']} | {c['B']} | {c['T']} | {c['pass']} |"
        if c["status"] != "ok":
            lines.append(f"{head} {c['status']} | | | |")
            continue
        speed = f"{c['speedup']:.2f}x"
        if c.get("ratios_differ"):
            speed += f" (alternated {c['alternated_speedup']:.2f}x)"
        lines.append(
            f"{head} {c['native_ms']:.1f} | {c['torch_ms']:.1f} | {speed} | {c['pct_peak']:.0f}% |"
        )
    return lines
