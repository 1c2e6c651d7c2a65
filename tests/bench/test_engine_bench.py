"""`nanoattn bench --only engine` (nanoattn/bench/_engine.py, _engine_prefix.py): the
recall example's engine and its static batches, then the engine with its prefix cache
and without it, each served alone in a process of its own on a random model, their rows
and ratios, the targets judged the right way round at the example's own sizes only, a
line saying how to run it where the example is not importable, and the command line's
choice of the part. No time is asserted."""

import dataclasses
import json
import os

import pytest

from nanoattn.bench import _engine, _engine_prefix, _run
from nanoattn.cli import build_parser, main
from nanoattn.cli._bench import config_from_args

# The example's engine test's pool and steps: 5 requests of at most 12 tokens of cache.
TINY = _engine.Shape(
    workload=dict(seed=7, requests=5, prompt_lengths=(2, 9), new_tokens=(1, 4)),
    sizes=dict(pages=13, page_size=5, max_sequences=3, step_tokens=7),
    rounds=1,
)


def test_each_server_runs_alone_and_serves_every_request():
    result = _engine.measure_engine(TINY)
    assert result["status"] == "ok", result
    assert result["shape"] == dataclasses.asdict(TINY)
    engine, static = result["rows"]
    assert (engine["name"], static["name"]) == ("engine", "static")
    assert len({engine["pid"], static["pid"], os.getpid()}) == 3  # two fresh processes
    for row in (engine, static):
        assert row["requests"] == 5 and row["tokens"] == engine["tokens"] > 0
        assert 0 < row["min_s"] <= row["median_s"]
        assert row["tokens_per_s"] == row["tokens"] / row["median_s"]
        assert row["backends"] and len(row["digest"]) == 16
    assert result["ratio"] == engine["tokens_per_s"] / static["tokens_per_s"]
    assert result["same_tokens"] == (engine["digest"] == static["digest"])
    # the same cache memory: static rows of the longest need, within the engine's pool
    assert engine["pool_tokens"] == static["pool_tokens"] == 13 * 5
    assert static["batch"] * static["capacity"] == static["cache_tokens"] <= 13 * 5
    # one program per step size, compiled by the warm-up; none during the runs
    assert engine["step_sizes"] == [7] and engine["compiled_warm"] == 1
    assert engine["compiled_after"] == engine["compiled_warm"]
    assert _engine.engine_targets(result) == []  # judged at the example's own sizes only
    text = "\n".join(_engine.engine_markdown(result))
    assert "| engine |" in text and "| static |" in text and "(target >= 5x)" in text


def test_without_the_example_the_part_says_how_to_run_it(monkeypatch):
    monkeypatch.setattr(_engine, "example_root", lambda: None)
    result = _engine.measure_engine(_engine.FULL)
    assert result["status"] == f"skipped: {_engine.MISSING}" and result["rows"] == []
    (target,) = _engine.engine_targets(result)
    assert target["passed"] is None and target["measured"] == result["status"]
    assert "run `nanoattn bench --only engine` from the repository's root" in result["status"]
    assert _engine.engine_markdown(result)[-1] == result["status"]


def _result(ratio: float, shape=_engine.FULL) -> dict:
    rows = [
        {"name": "engine", "tokens_per_s": 1000.0 * ratio, "median_s": 1.0, "min_s": 1.0,
         "tokens": 1000, "steps": 10, "pool_tokens": 8192, "max_sequences": 32,
         "backends": ["native"], "compiled_warm": 4, "compiled_after": 4,
         "step_sizes": [16, 32, 64, 128]},
        {"name": "static", "tokens_per_s": 1000.0, "median_s": 1.0, "min_s": 1.0,
         "tokens": 1000, "steps": 30, "batch": 16, "capacity": 511, "cache_tokens": 8176,
         "backends": ["native"]},
    ]  # fmt: skip
    return {"shape": dataclasses.asdict(shape), "rows": rows, "status": "ok", "ratio": ratio,
            "same_tokens": True}  # fmt: skip


@pytest.mark.parametrize("ratio, passed", [(5.0, True), (4.99, False), (12.0, True)])
def test_the_target_compares_the_right_way_round(ratio, passed):
    (target,) = _engine.engine_targets(_result(ratio))
    assert target["passed"] is passed
    assert target["target"].startswith("engine: continuous batching >= 5x static batching's")
    assert target["measured"].endswith(f"each alone: {ratio:.2f}x")
    assert _engine.engine_targets(_result(ratio, _engine.QUICK)) == []
    error = _result(ratio) | {"status": "error: boom"}
    assert _engine.engine_targets(error)[0]["passed"] is None


def test_cli_bench_only_engine(tmp_path, capsys, monkeypatch):
    shapes = []

    def fake(shape, report=None):
        shapes.append(shape)
        report(0, 2, "engine, alone")
        report(1, 2, "static, alone")
        return _result(3.0, shape)

    def fake_prefix(shape, report=None):
        shapes.append(shape)
        report(0, 2, "prefix, alone")
        report(1, 2, "plain, alone")
        return _prefix_result(2.5, 0.15, shape)

    monkeypatch.setattr(_engine, "measure_engine", fake)
    monkeypatch.setattr(_engine_prefix, "measure_prefix", fake_prefix)
    monkeypatch.setattr(_run, "matmul_peak_gflops", lambda dtype: 100.0)
    argv = ["bench", "--only", "engine", "--out", str(tmp_path)]
    assert main([*argv, "--quick"]) == 0  # small sizes: reported, not judged
    out, err = capsys.readouterr()
    assert shapes == [_engine.QUICK, _engine_prefix.QUICK]
    assert "[engine 1/4] engine, alone" in err and "[engine 4/4] plain, alone" in err, err
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["targets"] == [] and results["engine"]["ratio"] == 3.0
    assert results["engine"]["prefix"]["ratio"] == 2.5
    assert "| engine | 3,000 | 1.000 (1.000) | 1000 | 10 | pool 8192, 32 in flight |" in out
    assert "| static | 1,000 |" in out and "16 rows x 511 = 8176" in out
    assert "continuous / static: 3.00x the tokens/s (target >= 5x)" in out
    assert "| prefix | 2,500 | 1.000 (1.000) | 1000 | 40 | 1500 of 10000 | 8500 (531) |" in out
    assert "0.150x the prompt tokens computed (target <= 0.2x), 2.50x the tokens/s" in out
    assert main(argv) == 1  # judged at the example's sizes: 3x misses 5x
    assert shapes[-2:] == [_engine.FULL, _engine_prefix.FULL]
    out = capsys.readouterr().out
    assert "| engine: continuous batching >= 5x" in out
    assert "| engine, prefix cache: prompt tokens computed <= 0.2x without it" in out


def test_the_parts_are_chosen_by_only_and_sized_by_quick():
    def config(*argv):
        return config_from_args(build_parser().parse_args(["bench", *argv]))

    full = config()
    assert full.engine == full.decode == "full"
    assert config("--quick").engine == config("--quick").decode == ""
    assert config("--only", "engine").engine == "full" and config("--only", "engine").decode == ""
    assert config("--quick", "--only", "decode,engine").decode == "quick"
    assert config("--quick", "--only", "decode,engine").engine == "quick"
    assert config("--only", "masks").engine == config("--only", "masks").decode == ""


# The prefix-cache part at the example engine test's pool: 6 requests in 2 groups.
TINY_PREFIX = _engine_prefix.Shape(
    workload=dict(seed=5, requests=6, groups=2, shared_length=11, suffix_lengths=(0, 4),
                  new_tokens=(1, 4)),
    sizes=dict(pages=20, page_size=5, max_sequences=3, step_tokens=7),
    rounds=1,
)  # fmt: skip


def test_the_prefix_cache_and_the_engine_without_each_run_alone():
    result = _engine_prefix.measure_prefix(TINY_PREFIX)
    assert result["status"] == "ok", result
    prefix, plain = result["rows"]
    assert (prefix["name"], plain["name"]) == ("prefix", "plain")
    assert len({prefix["pid"], plain["pid"], os.getpid()}) == 3  # two fresh processes
    for row in (prefix, plain):
        assert row["requests"] == 6 and row["tokens"] == prefix["tokens"] > 0
        assert row["prompt_tokens"] == prefix["prompt_tokens"] == plain["prefill_tokens"]
        assert row["tokens_per_s"] == row["tokens"] / row["median_s"]
        assert row["compiled_after"] == row["compiled_warm"] == 1
    # every request but its group's first shares the group's two full pages
    assert prefix["cached_tokens"] == 4 * 10 and prefix["cached_pages"] == 4 * 2
    assert prefix["prefill_tokens"] == plain["prefill_tokens"] - 40 and plain["cached_tokens"] == 0
    assert result["prefill_ratio"] == prefix["prefill_tokens"] / plain["prefill_tokens"]
    assert result["ratio"] == prefix["tokens_per_s"] / plain["tokens_per_s"]
    assert _engine_prefix.prefix_targets(result) == []  # judged at the example's own sizes
    text = "\n".join(_engine_prefix.prefix_markdown(result))
    assert "| prefix |" in text and "| plain |" in text and "(target <= 0.2x)" in text


def _prefix_result(ratio: float, prefill_ratio: float, shape=_engine_prefix.FULL) -> dict:
    rows = [
        {"name": "prefix", "tokens_per_s": 1000.0 * ratio, "median_s": 1.0, "min_s": 1.0,
         "tokens": 1000, "steps": 40, "prefill_tokens": round(10000 * prefill_ratio),
         "prompt_tokens": 10000, "cached_tokens": 10000 - round(10000 * prefill_ratio),
         "cached_pages": 531, "evictions": 0, "peak_pages": 300, "pool_pages": 512},
        {"name": "plain", "tokens_per_s": 1000.0, "median_s": 1.0, "min_s": 1.0,
         "tokens": 1000, "steps": 90, "prefill_tokens": 10000, "prompt_tokens": 10000,
         "cached_tokens": 0, "cached_pages": 0, "evictions": 0, "peak_pages": 500,
         "pool_pages": 512},
    ]  # fmt: skip
    return {"shape": dataclasses.asdict(shape), "rows": rows, "status": "ok", "ratio": ratio,
            "prefill_ratio": prefill_ratio, "same_tokens": True}  # fmt: skip


@pytest.mark.parametrize(
    "ratio, prefill_ratio, passed",
    [(2.0, 0.2, [True, True]), (1.99, 0.1, [True, False]), (3.0, 0.21, [False, True])],
)
def test_the_prefix_targets_compare_the_right_way_round(ratio, prefill_ratio, passed):
    computed, speed = _engine_prefix.prefix_targets(_prefix_result(ratio, prefill_ratio))
    assert [computed["passed"], speed["passed"]] == passed
    assert computed["target"].startswith("engine, prefix cache: prompt tokens computed <= 0.2x")
    assert speed["target"].startswith("engine, prefix cache: >= 2x the tokens/s without it")
    assert computed["measured"].endswith(f": {prefill_ratio:.3f}x")
    assert speed["measured"].endswith(f": {ratio:.2f}x")
    assert _engine_prefix.prefix_targets(_prefix_result(ratio, 0.1, _engine_prefix.QUICK)) == []


def test_without_the_example_the_prefix_part_says_how_to_run_it(monkeypatch):
    monkeypatch.setattr(_engine, "example_root", lambda: None)
    result = _engine_prefix.measure_prefix(_engine_prefix.FULL)
    assert result["status"] == f"skipped: {_engine.MISSING}" and result["rows"] == []
    targets = _engine_prefix.prefix_targets(result)
    assert len(targets) == 2 and all(t["passed"] is None for t in targets)
    assert _engine_prefix.prefix_markdown(result)[-1] == result["status"]
