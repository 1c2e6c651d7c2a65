"""`nanoattn bench`: measurement helpers, the report, and the command line.

No test asserts a time: times are noisy. Memory comes from XLA's compiled
memory analysis, which is deterministic.
"""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from nanoattn.bench import _generation, _measure, _report, _run, _torch, _window
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


@pytest.mark.slow
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
    argv += ["--only", "grid,targets", "--impls", "flash", "--out", str(tmp_path)]
    assert main(argv) == 1
    assert "| x | y | NO |" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--shapes", "4x"], "--shapes must look like 4x32,12x64"),
        (["--impls", "flash,triton"], "unknown implementation 'triton'"),
        (["--lengths", "0,8"], "--lengths must be >= 1"),
        (["--tokens", "0"], "--tokens must be >= 1"),
        (["--dtype", "int8"], "invalid choice: 'int8'"),
        (["--only", "grid,speed"], "expected parts from grid, targets, generation, window"),
        (["--contexts", "0"], "--contexts must be >= 1"),
        (["--window-length", "0"], "--window-length must be >= 1"),
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


def test_time_interleaved_alternates_and_skips_the_warm_up():
    calls = []
    times = _measure.time_interleaved(
        {"a": lambda: calls.append("a"), "b": lambda: calls.append("b")}, rounds=3
    )
    assert calls == ["a", "b"] * 4  # one warm-up round, then three timed rounds
    assert set(times) == {"a", "b"} and all(0 <= lo <= med for med, lo in times.values())
    calls.clear()
    _measure.time_interleaved(
        {"a": lambda: calls.append("a"), "b": lambda: calls.append("b")},
        rounds=1,
        warmup=0,
        order=["a", "b", "a"],
    )
    assert calls == ["a", "b", "a"]


def test_generation_round_alternates_the_cached_steps_around_the_recomputes():
    order = _generation.round_order()
    assert order.count("cached") == order.count("flax") == 2 * _generation.PAIRS
    recomputes = [i for i, name in enumerate(order) if name == "recompute"]
    assert recomputes == [2 * _generation.PAIRS, len(order) - 1]
    # Rounds repeat, so the call after each recompute is once flax's, once nanoattn's.
    assert {order[recomputes[0] + 1], order[0]} == {"cached", "flax"}
    assert order.count("recompute") == 2


# Generation: a layer of width 16 with 2 heads, a context of 5 tokens.
D, N, C = 16, 2, 5
KEY = jax.random.key(0)


def test_empty_cache_is_what_init_creates():
    # Built from shapes alone: zeros at position 0, exactly the caches init returns.
    x = jnp.ones((2, 7, D))
    nano, flax = _generation.nanoattn_layer(D, N), _generation.flax_layer(D, N, "float32")
    for init in (lambda x: nano.init(KEY, x, decode=True), lambda x: flax.init(KEY, x)):
        expected = jax.jit(init)(x)["cache"]
        cache = _generation.empty_cache(init, 2, 7, D, jnp.float32)
        assert jax.tree.structure(cache) == jax.tree.structure(expected)
        for got, want in zip(jax.tree.leaves(cache), jax.tree.leaves(expected)):
            assert got.dtype == want.dtype
            np.testing.assert_array_equal(got, want)


def test_cached_step_computes_what_recomputing_computes():
    # The benchmark compares two ways of producing the same output: token C + 1's.
    x = _generation.tokens(1, C + 2, D, "float32")
    layer = _generation.nanoattn_layer(D, N)
    # Under jit: one program instead of one per operation of the initialisers.
    params = jax.jit(lambda key, x: layer.init(key, x, True))(KEY, x[:, :1])["params"]
    decoder, run_prefill = _generation.nanoattn_decoder(layer, params, x, C, C + 2)
    run_prefill()
    assert int(decoder.cache["position"][0]) == C
    cached = decoder()  # feeds token C (0-based): the first token after the context
    full = _generation.recompute(layer, params, x, C)()
    np.testing.assert_allclose(cached[:, 0], full, atol=1e-5)
    assert int(decoder.cache["position"][0]) == C + 1 and decoder.fed == 1


def test_flax_cache_filled_as_feeding_the_context_token_by_token():
    x = _generation.tokens(1, C + 1, D, "float32")
    layer = _generation.flax_layer(D, N, "float32")
    decoder = _generation.flax_decoder(layer, x, C, C + 1)
    variables = jax.jit(layer.init)(KEY, jnp.zeros((1, C + 1, D)))
    step = jax.jit(lambda c, t: layer.apply({**variables, "cache": c}, t, mutable=["cache"]))
    cache = variables["cache"]
    for i in range(C):
        _, state = step(cache, x[:, i : i + 1])
        cache = state["cache"]
    for name in ("cached_key", "cached_value"):
        np.testing.assert_allclose(decoder.cache[name], cache[name], atol=1e-6)
    assert int(decoder.cache["cache_index"]) == int(cache["cache_index"]) == C
    expected, _ = step(cache, x[:, C:])
    np.testing.assert_allclose(decoder(), expected, atol=1e-6)


def test_measure_generation_row_and_targets():
    row = _generation.measure_generation(C, d_model=D, n_heads=N, rounds=1)
    assert row["status"] == "ok" and row["capacity"] == C + 2 * 2 * _generation.PAIRS
    for name in ("cached", "flax", "recompute", "prefill"):
        assert 0 < row[f"{name}_min_ms"] <= row[f"{name}_median_ms"]
    assert row["recompute_vs_cached"] == row["recompute_median_ms"] / row["cached_median_ms"]
    assert row["flax_vs_cached"] == row["flax_median_ms"] / row["cached_median_ms"]
    assert _generation.generation_targets([row]) == []  # judged at context 4096 only
    text = "\n".join(_report.generation_markdown([row]))
    assert f"| {C} | {row['capacity']} | {row['cached_median_ms']:.2f} (" in text


def generation_row(cached, flax, recompute, status="ok"):
    return {
        "context": 4096,
        "capacity": 4112,
        "status": status,
        "cached_median_ms": cached,
        "flax_median_ms": flax,
        "recompute_median_ms": recompute,
        "recompute_vs_cached": recompute / cached,
        "flax_vs_cached": flax / cached,
    }


def test_generation_targets_compare_the_right_way_round():
    recompute, flax = _generation.generation_targets([generation_row(2.0, 2.0, 20.0)])
    assert recompute["passed"] is True and flax["passed"] is True  # 10x, and level
    assert "recompute 20.0 ms/token, nanoattn cached 2.00 ms/token: 10.0x" in recompute["measured"]
    recompute, flax = _generation.generation_targets([generation_row(2.0, 1.9, 19.0)])
    assert recompute["passed"] is False and flax["passed"] is False
    assert "flax takes 0.95x nanoattn's time" in flax["measured"]
    rows = _generation.generation_targets([generation_row(1, 1, 1, status="error: boom")])
    assert [r["passed"] for r in rows] == [None, None]


def test_measure_window_row_and_targets():
    row = _window.measure_window(64, window=(8, 0), n_heads=2, head_dim=8, rounds=1)
    assert row["status"] == "ok" and row["pass"] == "fwd+bwd" and row["window"] == [8, 0]
    for name in ("full", "windowed"):
        assert 0 < row[f"{name}_min_ms"] <= row[f"{name}_median_ms"]
        assert isinstance(row[f"{name}_temp_bytes"], int) and row[f"{name}_temp_bytes"] > 0
    assert _window.window_targets(row) == []  # judged at T = 16384, window (512, 0) only
    text = "\n".join(_report.window_markdown(row))
    assert "| causal, window=(8, 0) |" in text


def test_window_target_compares_the_right_way_round():
    row = {
        "T": 16384,
        "window": [512, 0],
        "status": "ok",
        "full_median_ms": 2000.0,
        "windowed_median_ms": 500.0,
        "windowed_vs_full": 0.25,
        "full_temp_bytes": 50 * 2**20,
        "windowed_temp_bytes": 20 * 2**20,
    }
    (target,) = _window.window_targets(row)
    assert target["passed"] is True
    assert "full 2000 ms, windowed 500 ms: 0.250 of the time (1/4.0)" in target["measured"]
    assert "temp memory 50.0 -> 20.0 MiB" in target["measured"]
    (target,) = _window.window_targets(
        row | {"windowed_median_ms": 520.0, "windowed_vs_full": 0.26}
    )
    assert target["passed"] is False


def test_cli_bench_only_generation(tmp_path, capsys, monkeypatch):
    import nanoattn.bench._run as run

    measured = []

    def fake_window(T):
        measured.append(T)
        row = {"T": T, "window": [512, 0], "B": 1, "N": 4, "H": 32, "dtype": "float32"}
        return row | {"status": "error: not measured here"}

    def fake_generation(context):
        measured.append(context)
        row = {"context": context, "capacity": context + 16, "B": 1, "D": 128, "N": 4}
        return row | {"dtype": "float32", "status": "error: not measured either"}

    monkeypatch.setattr(_window, "measure_window", fake_window)
    monkeypatch.setattr(_generation, "measure_generation", fake_generation)
    argv = ["bench", "--only", "generation,window", "--contexts", "3,4096", "--out", str(tmp_path)]
    assert main([*argv, "--window-length", "16384"]) == 0
    out = capsys.readouterr().out
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["cells"] == [] and measured == [3, 4096, 16384]
    assert [row["context"] for row in results["generation"]] == [3, 4096]
    assert "### Generation: ms per token, one layer D=128, 4 heads, B=1, float32" in out
    assert "| 3 | 19 | error: not measured either |" in out
    assert "| causal, window=" not in out and "error: not measured here" in out
    generation = [t["target"] for t in results["targets"][:2]]
    assert generation == [
        "generation C=4096: cached step >= 10x faster than recomputing",
        "generation C=4096: nanoattn step at least as fast as flax's",
    ]
    assert results["targets"][2:] == [
        {
            "target": "fwd+bwd T=16384: window=(512, 0) takes <= 1/4 of full causal time",
            "measured": "error: not measured here",
            "passed": None,
        }
    ]
    assert not (tmp_path / "results.png").exists() and run.BenchConfig().grid


def test_cli_bench_parts():
    from nanoattn.cli import build_parser
    from nanoattn.cli._bench import config_from_args

    def config(*argv):
        return config_from_args(build_parser().parse_args(["bench", *argv]))

    full = config()
    assert full.grid and full.targets and full.generation == (1024, 4096)
    assert full.window_length == 16384
    quick = config("--quick")
    assert quick.grid and not quick.targets and quick.generation == (1024,)
    assert not quick.window_length
    only = config("--only", "window", "--window-length", "4096")
    assert not only.grid and not only.targets and only.generation == ()
    assert only.window_length == 4096
    for argv in (["--no-targets"], ["--dtype", "bfloat16"]):
        grid_only = config(*argv)
        assert grid_only.grid and not grid_only.targets
        assert grid_only.generation == () and not grid_only.window_length
