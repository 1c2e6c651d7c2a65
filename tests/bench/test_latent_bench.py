"""The latent part of ``nanoattn bench`` (nanoattn/bench/_latent.py) at tiny sizes: it
runs and reports its rows; no time is asserted."""

import pytest

from nanoattn.bench import _latent, _run
from nanoattn.cli import _bench

SMALL = dict(d_model=16, n_heads=2, kv_lora_rank=8, qk_nope_head_dim=4, qk_rope_head_dim=2,
             v_head_dim=3, q_lora_rank=None)  # fmt: skip


def test_cache_bytes_at_deepseek_v3s_shape_are_576_numbers_per_token():
    row = _latent.cache_row("bfloat16")
    assert (row["numbers"], row["latent_bytes"], row["mha_bytes"]) == (576, 1152, 65536)
    assert row["ratio"] == pytest.approx(576 / (2 * 128 * 128))
    (target,) = _latent.latent_targets(row, {"context": 16})  # the step: judged at 4096 only
    assert target["passed"] is True and "0.0176x" in target["measured"]


def test_both_decode_steps_compute_the_same_heads():
    row = _latent.measure_decode(16, heads=2, sizes=SMALL, rounds=1)
    assert row["status"] == "ok" and row["max_difference"] < 1e-5
    for name in ("absorbed", "rebuilt"):
        assert 0 < row[f"{name}_min_ms"] <= row[f"{name}_median_ms"]


def test_decode_target_compares_the_right_way_round():
    cache = _latent.cache_row()
    rows = [{"context": 4096, "status": "ok", "N": 16, "rebuilt_median_ms": 10.0,
             "absorbed_median_ms": ms, "speedup": 10.0 / ms} for ms in (4.0, 6.0)]  # fmt: skip
    passed = [_latent.latent_targets(cache, row)[1]["passed"] for row in rows]
    assert passed == [True, False]


def test_bench_runs_the_part_when_asked(monkeypatch):
    monkeypatch.setattr(_run, "matmul_peak_gflops", lambda dtype: 1.0)
    monkeypatch.setattr(_latent, "measure_decode", lambda C, **o: {"context": C, "status": "ok",
                        "N": 2, "rebuilt_median_ms": 2.0, "absorbed_median_ms": 1.0,
                        "speedup": 2.0})  # fmt: skip
    config = _run.BenchConfig(grid=False, targets=False, generation=(), window_length=0,
                              latent_context=4096)  # fmt: skip
    results = _run.run_bench(config)
    assert results["latent"]["cache"]["numbers"] == 576
    assert [t["passed"] for t in results["targets"]] == [True, True]
    assert "latent" in _bench.PARTS
