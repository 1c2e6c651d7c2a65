"""The cascade part of ``nanoattn bench`` (nanoattn/bench/_cascade.py) at a tiny size:
its layout shares the first pages, the shared call equals the unshared one, the table,
the target the right way round and the command line; no time is asserted."""

import numpy as np

from nanoattn.bench import _cascade, _run
from nanoattn.cli import _bench, build_parser

TINY = _cascade.CascadeShape(B=3, prefix=8, suffix=5, N=4, K=2, H=8, page_size=4, rounds=1)


def test_the_sequences_share_their_first_pages_and_no_other():
    table, lengths, shared, pool = _cascade.layout(TINY)
    assert table.shape == (3, 4) and lengths.tolist() == [14] * 3 and shared.tolist() == [2] * 3
    assert (table[:, :2] == table[0, :2]).all() and len(set(table[:, 2:].ravel())) == 6
    assert sorted(set(table.ravel())) == list(range(pool))


def test_the_shared_call_equals_the_unshared_one_and_the_row_reports():
    calls = _cascade._calls(TINY, "native")
    shared, plain = (np.asarray(fn(*args)) for fn, args in (calls["shared"], calls["unshared"]))
    np.testing.assert_allclose(shared, plain, atol=1e-5, rtol=1e-5)
    row = _cascade.measure_cascade(TINY, implementation="native")
    assert 0 < row["shared_min_ms"] <= row["shared_median_ms"] and row["speedup"] > 0
    assert row["shared_bf16_min_ms"] > 0 and row["speedup_bf16"] > 0
    table = "\n".join(_cascade.cascade_markdown(row))
    assert "| shared_prefixes (cascade), float32 |" in table
    assert "| unshared, bfloat16 |" in table


def test_the_targets_compare_the_right_way_round_in_each_type():
    rows = [{"B": 32, "prefix": 4096, "speedup": r, "speedup_bf16": 5 - r} for r in (4.5, 0.5)]
    judged = [[t["passed"] for t in _cascade.cascade_targets(r, True)] for r in rows]
    assert judged == [[True, False], [False, True]]
    assert "bfloat16" in _cascade.cascade_targets(rows[0], True)[1]["target"]
    assert _cascade.cascade_targets(rows[0], False) == []


def test_the_command_line_runs_the_part(monkeypatch):
    monkeypatch.setattr(_run, "matmul_peak_gflops", lambda dtype: 1.0)
    monkeypatch.setattr(_cascade, "QUICK", TINY)
    quick = _bench.config_from_args(build_parser().parse_args(["bench", "--quick", "--only",
                                                               "cascade"]))  # fmt: skip
    assert (quick.cascade, quick.tree, quick.grid) == ("quick", "", False)
    results = _run.run_bench(quick)
    assert results["cascade"]["B"] == 3 and results["targets"] == []
