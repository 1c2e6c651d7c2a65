"""The tree part of ``nanoattn bench`` (nanoattn/bench/_tree.py) at a tiny size: its
tree's shape, a chain of drafts equal to the causal chunk, the table, the target the
right way round and the command line; no time is asserted."""

import numpy as np

from nanoattn.bench import _run, _tree
from nanoattn.cli import _bench, build_parser

TINY = _tree.TreeShape(T=7, C=13, N=4, K=2, H=8, page_size=4, rounds=1)


def test_the_tree_branches_at_the_root_then_runs_in_chains():
    assert _tree.tree_parents(11).tolist() == [-1, 0, 0, 0, 0, 1, 2, 3, 4, 5, 6]


def test_a_chain_tree_equals_the_chunk_and_the_row_reports():
    calls = _tree._calls(TINY, "native")
    fn, (q, k, v, _) = calls["tree"]
    chain = np.arange(TINY.T, dtype=np.int32) - 1  # each draft the child of the last
    np.testing.assert_allclose(np.asarray(fn(q, k, v, chain)), np.asarray(fn(q, k, v)),
                               atol=1e-5, rtol=1e-5)  # fmt: skip
    row = _tree.measure_tree(TINY, implementation="native")
    assert 0 < row["tree_min_ms"] <= row["tree_median_ms"] and row["tree_vs_chunk"] > 0
    assert "| a causal chunk of 7 |" in "\n".join(_tree.tree_markdown(row))


def test_the_target_compares_the_right_way_round():
    rows = [{"T": 64, "C": 4096, "tree_vs_chunk": r} for r in (1.1, 1.3)]
    assert [_tree.tree_targets(r, True)[0]["passed"] for r in rows] == [True, False]
    assert _tree.tree_targets(rows[0], False) == []


def test_the_command_line_runs_the_part(monkeypatch):
    monkeypatch.setattr(_run, "matmul_peak_gflops", lambda dtype: 1.0)
    monkeypatch.setattr(_tree, "QUICK", TINY)
    quick = _bench.config_from_args(build_parser().parse_args(["bench", "--quick", "--only",
                                                               "tree"]))  # fmt: skip
    assert (quick.tree, quick.grid, quick.selection) == ("quick", False, "")
    results = _run.run_bench(quick)
    assert results["tree"]["T"] == 7 and results["targets"] == []
