"""The selection part of ``nanoattn bench`` (nanoattn/bench/_selection.py) at a tiny
size: its four calls agree where they must, it reports its table, its targets compare
the right way round, and the command line runs it; no time is asserted."""

import numpy as np

from nanoattn.bench import _run, _selection
from nanoattn.cli import _bench, build_parser

TINY = _selection.SelectionShape(S=48, k=48, N=4, K=2, H=8, rounds=1)  # 3 pages of 16


def test_selecting_every_key_or_page_equals_the_dense_call_and_the_row_reports():
    calls = _selection._calls(TINY, "native")
    selected, dense, pages = (np.asarray(fn(*args)) for fn, args in
                              (calls["selected"], calls["dense"], calls["pages"]))  # fmt: skip
    np.testing.assert_allclose(selected, dense, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(pages, dense[0], atol=1e-5, rtol=1e-5)  # (1, N, H): token-major
    row = _selection.measure_selection(TINY, implementation="native")
    for name in ("selected", "small", "dense", "pages"):
        assert 0 < row[f"{name}_min_ms"] <= row[f"{name}_median_ms"]
    text = "\n".join(_selection.selection_markdown(row))
    assert "| 48 selected of 48 |" in text and "dense over 48 keys" in text
    assert "| page selection: 3 of 3 pages of 16 |" in text


def test_the_targets_compare_the_right_way_round():
    def row(selected):
        return {"S": 32768, "k": 2048, "selected_vs_small": selected / 1.0,
                "dense_vs_selected": 10.0 / selected}  # fmt: skip

    judged = [[t["passed"] for t in _selection.selection_targets(row(ms), True)]
              for ms in (1.2, 1.4, 0.5)]  # fmt: skip
    assert judged == [[True, True], [False, False], [True, True]]
    assert _selection.selection_targets(row(1.0), False) == []  # quick: not judged


def test_the_command_line_runs_the_part(monkeypatch):
    monkeypatch.setattr(_run, "matmul_peak_gflops", lambda dtype: 1.0)
    monkeypatch.setattr(_selection, "QUICK", TINY)

    def config(*argv):
        return _bench.config_from_args(build_parser().parse_args(["bench", *argv]))

    assert config("--only", "selection").selection == "full"
    quick = config("--quick", "--only", "selection")
    assert (quick.selection, quick.grid, quick.engine) == ("quick", False, "")
    results = _run.run_bench(quick)
    assert results["selection"]["k"] == 48 and results["targets"] == []


def test_the_v32_step_times_both_layers_and_judges_the_right_way_round():
    """DeepSeek-V3.2's decode row at a tiny size (its layers decode one token over a
    filled cache of 23 keys, top 5): both steps timed, the table and the target read
    the ratio dense / indexed, >= 3x passing."""
    from nanoattn.bench import _v32

    sizes = _v32.QUICK_V32 | {"index_topk": 5}
    row = _v32.measure_v32(23, sizes, rounds=1)
    assert row["status"] == "ok", row
    assert 0 < row["indexed_min_ms"] <= row["indexed_median_ms"]
    assert row["speedup"] == row["dense_median_ms"] / row["indexed_median_ms"]
    assert "| indexed (top 5) |" in "\n".join(_v32.v32_markdown(row))
    for speedup, passed in ((3.5, True), (2.5, False)):
        judged = _v32.v32_target(row | {"speedup": speedup})
        assert judged["passed"] is passed and f"{speedup:.2f}x" in judged["measured"]
    assert _v32.v32_target({**row, "status": "error: x"})["passed"] is None
