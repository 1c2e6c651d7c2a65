"""The sharded part of ``nanoattn bench`` (nanoattn/bench/_sharded.py) at a tiny size:
its process of 8 host devices runs the three steps and finds the sharded outputs equal
to one device's; the table and the command line; nothing is judged, no time asserted."""

from nanoattn.bench import _run, _sharded
from nanoattn.cli import _bench, build_parser

TINY = _sharded.ShardedShape(B=4, lengths=(5, 23), N=8, K=4, H=8, page_size=4, rounds=1)


def test_the_steps_run_on_8_devices_and_equal_one_device():
    row = _sharded.measure_sharded(TINY)
    assert row["devices"] == 8 and row["max_difference"] <= 1e-6
    for name in ("one", "heads", "groups_heads"):
        assert 0 < row[f"{name}_min_ms"] <= row[f"{name}_median_ms"]
    text = "\n".join(_sharded.sharded_markdown(row))
    assert "| 2 groups x heads over 4 (8 devices) |" in text
    assert _sharded.sharded_targets(row, True) == []


def test_the_command_line_asks_for_the_part(monkeypatch):
    monkeypatch.setattr(_run, "matmul_peak_gflops", lambda dtype: 1.0)
    monkeypatch.setattr(_sharded, "run_alone", lambda module, spec, what, env: {"ran": spec["B"]})
    quick = _bench.config_from_args(build_parser().parse_args(["bench", "--quick", "--only",
                                                               "sharded"]))  # fmt: skip
    assert (quick.sharded, quick.cascade, quick.grid) == ("quick", "", False)
    row = _run.run_bench(quick)["sharded"]
    assert row["ran"] == row["B"] == _sharded.QUICK.B and row["status"] == "ok"
