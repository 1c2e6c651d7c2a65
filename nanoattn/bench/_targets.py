"""The performance targets of the blockwise kernel, measured side by side.

On the CPU, f32, causal, batch 1, 4 heads of width 32 (the seed's shape):
forward+backward at T = 2048 and 4096 at least 3x faster than flax's
attention and the seed's computation; forward at T = 4096 within 1.5x of
PyTorch SDPA; compiled temporary memory of forward+backward at most 64 MiB
at T = 16384 and at most 2.5x from T = 8192 to 16384; forward+backward at
T = 65536 compiles in under 30 s and runs to completion.
"""

import time

import jax

from ._cell import inputs, measure_cell
from ._measure import jax_pass, temp_bytes
from ._peers import PEERS

N, H = 4, 32


def _ratio(cells: dict, numerator: str, denominator: str, T: int, pass_: str):
    """(median time of numerator / denominator, both times as text), or (None, why not)."""
    a, b = cells[numerator, T, pass_], cells[denominator, T, pass_]
    for cell in (a, b):
        if cell["status"] != "ok":
            return None, f"{cell['impl']} {cell['status']}"
    text = f"{numerator} {a['median_ms']:.1f} ms, {denominator} {b['median_ms']:.1f} ms"
    return a["median_ms"] / b["median_ms"], text


def time_targets(cells: dict) -> list[dict]:
    """The timing targets from cells keyed by (implementation, T, pass)."""
    rows = []
    for T in (2048, 4096):
        for peer in ("flax", "seed"):
            ratio, text = _ratio(cells, peer, "flash", T, "fwd+bwd")
            rows.append(
                {
                    "target": f"fwd+bwd T={T}: flash >= 3x faster than {peer}",
                    "measured": text if ratio is None else f"{text}: flash {ratio:.1f}x faster",
                    "passed": None if ratio is None else ratio >= 3,
                }
            )
    ratio, text = _ratio(cells, "flash", "torch", 4096, "fwd")
    rows.append(
        {
            "target": "fwd T=4096: flash within 1.5x of torch SDPA",
            "measured": text if ratio is None else f"{text}: flash takes {ratio:.2f}x torch's time",
            "passed": None if ratio is None else ratio <= 1.5,
        }
    )
    return rows


def measure_targets(peak: float, progress=None) -> list[dict]:
    """Measures each target; ``passed`` is None where a peer could not run."""
    jobs = [
        ("flash", 2048, True),
        ("flax", 2048, True),
        ("seed", 2048, True),
        ("flash", 4096, True),
        ("flax", 4096, True),
        ("seed", 4096, True),
        ("flash", 4096, False),
        ("torch", 4096, False),
    ]
    cells = {}
    for i, (name, T, backward) in enumerate(jobs):
        if progress:
            progress(i, len(jobs) + 1, f"targets: {name} T={T}")
        cell = measure_cell(name, 1, T, N, H, backward, "float32", peak)
        cells[name, T, cell["pass"]] = cell

    rows = time_targets(cells)

    if progress:
        progress(len(jobs), len(jobs) + 1, "targets: memory and T=65536")
    memory = {}
    for name, T in (("flash", 8192), ("flash", 16384), ("xla", 16384)):
        q = jax.ShapeDtypeStruct((1, T, N, H), "float32")
        memory[name, T] = temp_bytes(jax_pass(PEERS[name].fn, True), q, q, q)
    mib = {key: value / 2**20 for key, value in memory.items()}
    flash_8k, flash_16k, xla_16k = mib["flash", 8192], mib["flash", 16384], mib["xla", 16384]
    rows.append(
        {
            "target": "fwd+bwd temp memory at T=16384 <= 64 MiB (the reference needs GiBs)",
            "measured": f"flash {flash_16k:.1f} MiB, xla {xla_16k / 1024:.1f} GiB",
            "passed": flash_16k <= 64,
        }
    )
    growth = flash_16k / flash_8k
    rows.append(
        {
            "target": "fwd+bwd temp memory grows <= 2.5x from T=8192 to 16384",
            "measured": f"{flash_8k:.1f} -> {flash_16k:.1f} MiB ({growth:.2f}x)",
            "passed": growth <= 2.5,
        }
    )

    T = 65536
    q, k, v = inputs(1, T, N, H, "float32")
    grad = jax_pass(PEERS["flash"].fn, True)
    start = time.perf_counter()
    compiled = grad.lower(q, k, v).compile()
    compile_s = time.perf_counter() - start
    start = time.perf_counter()
    jax.block_until_ready(compiled(q, k, v))
    run_s = time.perf_counter() - start
    rows.append(
        {
            "target": f"fwd+bwd T={T} runs, compiles in < 30 s",
            "measured": f"compiled in {compile_s:.1f} s, ran in {run_s:.1f} s",
            "passed": compile_s < 30,
        }
    )
    return rows
