"""`nanoattn bench`: measurement helpers, the report, and the command line.

No test asserts a time: times are noisy. Memory comes from XLA's compiled
memory analysis, which is deterministic.
"""

import json

import pytest

from nanoattn.bench import _measure, _report, _run, _torch
from nanoattn.cli import main

TINY = ["bench", "--lengths", "32,64", "--shapes", "2x8", "--tokens", "64", "--no-targets"]


def test_causal_flops():
    # Two T x T x H products per head, 2 FLOPs per multiply-add, half skipped by causality.
    assert _measure.causal_flops(1, 4, 2, 8, backward=False) == 2 * 2 * 2 * 4 * 4 * 8 / 2
    assert _measure.causal_flops(3, 8, 1, 4, backward=True) == 3.5 * 2 * 2 * 3 * 8 * 8 * 4 / 2


def test_time_runs_warms_up_then_runs_at_least_three_times():
    calls = []
    median, best = _measure.time_runs(lambda: calls.append(1), budget_s=0.0)
    assert len(calls) == 4 and 0 <= best <= median


def test_measure_cell_reports_time_throughput_and_memory():
    cell = _run.measure_cell("flash", 1, 64, 2, 8, True, "float32", peak=100.0)
    assert cell["status"] == "ok" and cell["pass"] == "fwd+bwd"
    assert cell["min_ms"] <= cell["median_ms"] and cell["gflops"] > 0
    assert cell["pct_peak"] == pytest.approx(cell["gflops"])
    assert isinstance(cell["temp_bytes"], int) and cell["temp_bytes"] > 0


def test_materializing_peer_skipped_above_the_score_budget():
    cell = _run.measure_cell("seed", 1, 64, 2, 8, False, "float32", peak=1.0, max_score_gib=0.0)
    assert cell["status"].startswith("skipped: its scores need")


def test_torch_missing_is_a_note(monkeypatch):
    monkeypatch.setattr(_torch, "available", lambda: "torch is not installed")
    cell = _run.measure_cell("torch", 1, 32, 2, 8, False, "float32", peak=1.0)
    assert cell["status"] == "skipped: torch is not installed"


def synthetic_results():
    cells = []
    for impl, ms in (("flash", 2.0), ("seed", 8.0)):
        for pass_ in ("fwd", "fwd+bwd"):
            cells.append(
                {
                    "impl": impl,
                    "shape": "4x32",
                    "B": 2,
                    "T": 128,
                    "N": 4,
                    "H": 32,
                    "pass": pass_,
                    "dtype": "float32",
                    "status": "ok",
                    "median_ms": ms,
                    "min_ms": ms - 0.5,
                    "gflops": 10.0,
                    "pct_peak": 5.0,
                    "temp_bytes": 3 * 2**20,
                }
            )
    return {
        "machine": {
            "platform": "cpu",
            "device": "cpu",
            "cpu_count": 2,
            "processor": "x",
            "jax": "0",
            "torch": None,
            "matmul_peak_gflops": 200.0,
        },
        "config": {
            "lengths": [128],
            "shapes": [[4, 32]],
            "tokens": 256,
            "dtype": "float32",
            "implementations": ["flash", "seed"],
        },
        "cells": cells,
        "targets": [{"target": "t", "measured": "m", "passed": False}],
    }


def test_markdown_reports_ratios_against_flash():
    text = _report.markdown(synthetic_results())
    assert "| T | B | flash ms | seed ms | flash vs seed | flash GFLOP/s (% peak) |" in text
    assert "| 128 | 2 | 2.0 (1.5) | 8.0 (7.5) | 4.00x | 10 (5%) |" in text
    assert "| 128 | 3.0 | 3.0 |" in text  # memory in MiB
    assert "| t | m | NO |" in text


def test_cli_bench_writes_json_markdown_and_plot(tmp_path, capsys):
    code = main([*TINY, "--impls", "flash,xla,seed,flax,jax.nn", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert code == 0
    results = json.loads((tmp_path / "results.json").read_text())
    assert {c["impl"] for c in results["cells"]} == {"flash", "xla", "seed", "flax", "jax.nn"}
    assert all(c["status"] == "ok" for c in results["cells"])
    assert len(results["cells"]) == 5 * 2 * 2  # implementations x lengths x passes
    assert (tmp_path / "results.md").read_text() in out
    assert (tmp_path / "results.png").read_bytes()[:4] == b"\x89PNG"
    assert "### 2 heads of width 8, fwd+bwd" in out


def test_cli_bench_exits_1_when_a_target_is_missed(tmp_path, monkeypatch, capsys):
    import nanoattn.bench._targets as targets

    monkeypatch.setattr(
        targets,
        "measure_targets",
        lambda peak, progress=None: [{"target": "x", "measured": "y", "passed": False}],
    )
    argv = [a for a in TINY if a != "--no-targets"]
    assert main([*argv, "--impls", "flash", "--out", str(tmp_path)]) == 1
    assert "| x | y | NO |" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--shapes", "4x"], "--shapes must look like 4x32,12x64"),
        (["--impls", "flash,triton"], "unknown implementation 'triton'"),
        (["--lengths", "0,8"], "--lengths must be >= 1"),
        (["--tokens", "0"], "--tokens must be >= 1"),
        (["--dtype", "int8"], "invalid choice: 'int8'"),
    ],
)
def test_cli_bench_bad_input(capsys, argv, message):
    assert main(["bench", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1


def test_time_targets_compare_the_right_way_round():
    from nanoattn.bench._targets import time_targets

    def cell(impl, T, pass_, ms):
        return {"impl": impl, "T": T, "pass": pass_, "status": "ok", "median_ms": ms}

    cells = {}
    for T, flash, peer in ((2048, 10.0, 31.0), (4096, 10.0, 29.0)):
        for name, ms in (("flash", flash), ("flax", peer), ("seed", peer)):
            cells[name, T, "fwd+bwd"] = cell(name, T, "fwd+bwd", ms)
    cells["flash", 4096, "fwd"] = cell("flash", 4096, "fwd", 30.0)
    cells["torch", 4096, "fwd"] = cell("torch", 4096, "fwd", 20.0)
    rows = {r["target"]: r for r in time_targets(cells)}
    assert rows["fwd+bwd T=2048: flash >= 3x faster than flax"]["passed"] is True
    assert rows["fwd+bwd T=4096: flash >= 3x faster than seed"]["passed"] is False  # 2.9x
    torch = rows["fwd T=4096: flash within 1.5x of torch SDPA"]
    assert torch["passed"] is True and "flash takes 1.50x torch's time" in torch["measured"]
    cells["torch", 4096, "fwd"] = cell("torch", 4096, "fwd", 19.0)  # flash 1.58x slower
    assert time_targets(cells)[-1]["passed"] is False
    cells["torch", 4096, "fwd"] = {"impl": "torch", "status": "skipped: no torch"}
    assert time_targets(cells)[-1]["passed"] is None
