"""`nanoattn bench --only decode` (nanoattn/bench/_decode.py, _decode_cases.py,
_decode_report.py, _onnx.py, _ejkernel.py): the sweep's cases are llama.cpp's grid and
the issue's, their inputs hold the same numbers paged and dense, the peers compute the
same attention as nanoattn's reference on them (where installed), each implementation
runs alone in a process of its own with the environment it was given, a backend that
serves no page table and a missing peer get lines instead of processes, and the targets
compare the right way round. No time is asserted."""

import dataclasses
import json
import os

import jax.numpy as jnp
import numpy as np
import pytest

from nanoattn import dequantize_kv, paged_attention
from nanoattn.bench import (
    _decode,
    _decode_cases,
    _decode_report,
    _ejkernel,
    _huge_pages,
    _onnx,
    _run,
)
from nanoattn.cli import main

from _backends import paged_serving

# Prime sizes: B = 2 sequences of 13 and 29 keys, N = 6 on K = 2 heads of width 8.
CASE = _decode_cases.Case("batch", (13, 29), 6, 2, 8)
LATENT = _decode_cases.Case("mla", (23,), 3, 1, 12, 8)
TINY = _decode_cases.Sweep(lengths=(17,), widths=(8,), kv_heads=2, groups=(1, 3), long=37,
                           batch=(2, 5, 11), batch_heads=(6, 2, 8), mqa=(3, 8), mla=(3, 12, 8),
                           page_size=4, rounds=1, read_mib=1)  # fmt: skip


def test_the_full_sweep_is_the_issues():
    full = _decode_cases.FULL
    cases = full.cases()
    grid = [c for c in cases if c.kind == "grid"]
    assert [(c.lengths, c.head_dim, c.n_heads, c.kv_heads) for c in grid] == [
        ((S,), H, 8 * G, 8) for S in (4096, 8192, 16384) for H in (64, 128) for G in (1, 4)
    ]
    assert [(c.lengths, c.head_dim, c.n_heads) for c in cases if c.kind == "long"] == [
        ((32768,), H, 8 * G) for H in (64, 128) for G in (1, 4)
    ]
    (batch,) = [c for c in cases if c.kind == "batch"]
    assert batch.batch == 16 and (min(batch.lengths), max(batch.lengths)) == (512, 8192)
    assert (batch.n_heads, batch.kv_heads, batch.head_dim) == (32, 8, 128)
    mqa, mla = full.split_cases()
    assert (mqa.lengths, mqa.kv_heads, mqa.head_dim) == ((32768,), 1, 128)
    assert (mla.lengths, mla.kv_heads, mla.head_dim, mla.hv) == ((32768,), 1, 576, 512)
    assert mla.n_heads <= 128 and full.dtypes == ("float32", "bfloat16", "int8")
    assert mla.label == "MLA absorbed S=32768 H=576 Hv=512 N=16 K=1"
    assert batch.label == "B=16 S=512-8192 H=128 N=32 K=8"


def test_read_bytes_are_the_keys_and_values_read_once():
    tokens = (13 + 29) * 2  # tokens held x K
    assert CASE.read_bytes("float32") == tokens * (8 + 8) * 4
    assert CASE.read_bytes("bfloat16") == tokens * (8 + 8) * 2
    assert CASE.read_bytes("int8") == tokens * (8 + 8) + tokens * 2 * 4  # and the scales
    assert LATENT.read_bytes("float32") == 23 * (12 + 8) * 4


def _reference(data, case):
    """nanoattn's reference ("xla") on the inputs, float32 (int8: scaled back)."""
    key_pages, value_pages = data.key_pages, data.value_pages
    if data.key_scales is not None:
        key_pages = dequantize_kv(key_pages, data.key_scales)
        value_pages = dequantize_kv(value_pages, data.value_scales)
    starts = np.arange(case.batch + 1, dtype=np.int32)
    return np.asarray(paged_attention(data.query.astype(jnp.float32), key_pages, value_pages,
                                      data.page_table, data.lengths, starts,
                                      implementation="xla"))  # fmt: skip


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int8"])
def test_the_pages_hold_the_dense_numbers(dtype):
    data = _decode_cases.inputs(CASE, dtype, 4)
    assert data.page_table.shape == (2, 8) and data.key_pages.shape[0] == 4 + 8
    held = np.concatenate([data.page_table[0, :4], data.page_table[1]])
    assert sorted(held.tolist()) == list(range(12))  # every page held once, shuffled
    assert (data.key_scales is None) == (dtype != "int8")
    for b, n in enumerate(CASE.lengths):
        keys, values = data.dense(b)
        assert keys.shape == values.shape == (n, 2, 8)
        # the dense keys, against the paged call: attention over them by hand
        q = np.asarray(data.query[b], np.float32).reshape(2, 3, 8)  # (K, G, H)
        scores = np.einsum("kgh,skh->kgs", q, keys) * 8**-0.5
        weights = np.exp(scores - scores.max(-1, keepdims=True))
        weights /= weights.sum(-1, keepdims=True)
        want = np.einsum("kgs,skh->kgh", weights, values).reshape(6, 8)
        np.testing.assert_allclose(_reference(data, CASE)[b], want, rtol=2e-5, atol=2e-5)


def test_latent_values_are_the_keys_first_columns():
    data = _decode_cases.inputs(LATENT, "float32", 4)
    assert data.key_pages.shape[-1] == 12 and data.value_pages.shape[-1] == 8
    np.testing.assert_array_equal(data.value_pages, data.key_pages[..., :8])


@pytest.mark.parametrize("peer", [_onnx, _ejkernel], ids=["onnxruntime", "ejkernel"])
def test_each_peer_computes_nanoattns_attention(peer):
    """Checked against nanoattn's reference on the same numbers (and the reference
    against a hand computation above): two readings of the same contract."""
    if peer.available():
        pytest.skip(peer.available())
    data = _decode_cases.inputs(CASE, "float32", 4)
    run, output = peer.make_run(data)
    run()
    run()  # a second step gives the same: ORT writes the step's key in place, once
    np.testing.assert_allclose(output(), _reference(data, CASE), rtol=2e-5, atol=2e-5)
    assert peer.unsupported(CASE, "bfloat16") and peer.unsupported(LATENT, "float32")
    assert peer.unsupported(CASE, "float32") is None


def test_onnx_local_window_is_nanoattns_window():
    """GroupQueryAttention's local_window_size=W is nanoattn's window=(W - 1, 0)."""
    if _onnx.available():
        pytest.skip(_onnx.available())
    data = _decode_cases.inputs(CASE, "float32", 4)
    run, output = _onnx.make_run(data, window=5)
    run()
    starts = np.arange(3, dtype=np.int32)
    want = paged_attention(data.query, data.key_pages, data.value_pages, data.page_table,
                           data.lengths, starts, window=(4, 0), implementation="xla")  # fmt: skip
    np.testing.assert_allclose(output(), want, rtol=2e-5, atol=2e-5)
    assert not np.allclose(output(), _reference(data, CASE), atol=1e-3)


def test_a_backend_runs_alone_with_the_environment_it_was_given():
    """One process per job: its rows, its pid, the environment it ran in, and rows for
    every case and dtype; the automatic choice's row is marked."""
    spec = {"sweep": dataclasses.asdict(TINY), "cases": "split", "impl": "xla"}
    env = {"NANOATTN_NUM_THREADS": "2", "NANOATTN_SPLIT_KEYS": "0"}
    rows = _decode._rows_of(TINY, "xla unsplit", spec, env)
    assert len(rows) == 2 * 3 and {r["pid"] for r in rows} != {os.getpid()}
    assert len({r["pid"] for r in rows}) == 1
    assert all(r["env"] == env | {"GLIBC_TUNABLES": os.environ.get("GLIBC_TUNABLES")} for r in rows)
    assert [(r["kind"], r["dtype"]) for r in rows] == [
        (kind, dtype) for kind in ("mqa", "mla") for dtype in ("float32", "bfloat16", "int8")
    ]
    for row in rows:
        assert row["status"] == "ok", row
        assert 0 < row["min_us"] <= row["median_us"] and row["gb_per_s"] > 0
    # 37 keys of one head: MQA's keys and values of width 8, MLA's of widths 12 and 8
    assert [r["read_bytes"] for r in rows if r["dtype"] == "float32"] == [
        37 * (8 + 8) * 4,
        37 * (12 + 8) * 4,
    ]


def test_the_automatic_choice_is_one_of_the_backends_that_serve():
    data = _decode_cases.inputs(CASE, "float32", 4)
    arrays, scales = _decode._arguments(data)
    assert _decode.chosen(data) in paged_serving(*arrays, **scales)


def test_the_part_gives_lines_not_processes_where_nothing_can_run(monkeypatch):
    """A backend that serves no page table and a peer that is not installed: their rows
    carry why, and no process starts for them; every other job's process does."""
    started = []

    def fake_alone(module, spec, *, what, env=None):
        started.append((spec["impl"], spec["cases"], env))
        sweep = _decode._sweep(spec)
        cases = _decode._cases(sweep, spec["cases"])
        us = 8.0 if spec.get("label") == "huge pages" else 10.0
        rows = [_decode._row(spec["impl"], c, d) | {"status": "ok", "median_us": us,
                "min_us": 9.0, "gb_per_s": 1.0, "chosen": spec["impl"] == "native"}
                for c in cases for d in sweep.dtypes]  # fmt: skip
        return {"rows": rows, "pid": 1}

    monkeypatch.setattr(_decode, "run_alone", fake_alone)
    monkeypatch.setattr(_decode, "measure_read", lambda mib, rounds: {
        "status": "ok", "gb_per_s": 4.0, "how": "jit sum", "bytes": mib * 2**20})  # fmt: skip
    monkeypatch.setattr(_onnx, "available", lambda: "onnxruntime is not installed (how)")
    monkeypatch.setattr(_ejkernel, "available", lambda: None)  # installed or not: its process fakes
    monkeypatch.setattr(_decode, "paged_refusal", lambda name: "no" if name == "cudnn" else None)
    monkeypatch.setattr(_huge_pages, "refusal", lambda: None)
    labels = []
    result = _decode.measure_decode(TINY, lambda i, n, label: labels.append(label),
                                    implementations=("xla", "native", "cudnn"))  # fmt: skip
    assert labels[0] == "read bandwidth" and "native split, alone" in labels
    assert [s[:2] for s in started] == [("xla", "main"), ("native", "main"), ("ejkernel", "main"),
                                        ("native", "split"), ("native", "split"),
                                        ("native", "huge"), ("native", "huge")]  # fmt: skip
    assert started[-4][2] == {"NANOATTN_NUM_THREADS": "2", "NANOATTN_SPLIT_KEYS": "1"}
    assert started[-3][2] == {"NANOATTN_NUM_THREADS": "2", "NANOATTN_SPLIT_KEYS": "0"}
    assert started[-2][2] == {"GLIBC_TUNABLES": ""}
    assert started[-1][2] == {"GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}
    rows = {(r["impl"], r["case"], r["dtype"]): r for r in result["rows"]}
    assert len(rows) == 5 * len(TINY.cases()) * 3
    cudnn = [r for r in result["rows"] if r["impl"] == "cudnn"]
    assert {r["status"] for r in cudnn} == {"cudnn does not serve a page table: no"}
    onnx = [r for r in result["rows"] if r["impl"] == "onnxruntime"]
    assert {r["status"] for r in onnx} == {"skipped: onnxruntime is not installed (how)"}
    assert all(r["fraction"] == 0.25 for r in result["rows"] if r["status"] == "ok")
    assert {r["impl"] for r in result["split"]} == {"native split", "native unsplit"}
    assert {r["impl"] for r in result["huge"]} == {"native huge pages", "native 4 KiB pages"}
    assert len(result["huge"]) == 2 * len(TINY.huge_cases()) * 3
    assert result["peers"]["onnxruntime"]["status"] == "onnxruntime is not installed (how)"
    text = "\n".join(_decode_report.decode_markdown(result))
    assert "- onnxruntime: skipped: onnxruntime is not installed (how)" in text
    assert "| xla us | native us | ejkernel us | nanoattn |" in text
    assert "| split-key decode, 2 threads | dtype | split us | unsplit us |" in text
    huge = [line for line in text.splitlines() if "| 8 (9) |" in line]
    assert len(huge) == 2 * 3 and all("| 10 (9) | 8 (9) | 1.25x |" in line for line in huge), huge
    assert _decode_report.decode_targets(result) == []  # judged at the full sweep only


def _row(impl, case, dtype="float32", us=100.0, chosen=None, status="ok"):
    row = {"impl": impl, "case": case, "dtype": dtype, "status": status, "median_us": us,
           "min_us": us, "gb_per_s": 1.0, "fraction": 0.5}  # fmt: skip
    return row | ({} if chosen is None else {"chosen": chosen})


def _full(ort_ratio=2.0, ej_ratio=5.0, split_ratio=1.8, ort_status="ok"):
    case = "S=4096 H=128 N=32 K=8"
    rows = [
        _row("xla", case, us=900.0, chosen=False),
        _row("native", case, chosen=True),
        _row("onnxruntime", case, us=100.0 * ort_ratio, status=ort_status),
        _row("ejkernel", case, us=100.0 * ej_ratio),
        _row("native", case, "bfloat16", chosen=True),  # no peer runs it: not judged
        _row("onnxruntime", case, "bfloat16", status="not measured: float32 only"),
    ]
    split = [_row("native split", "MQA", us=100.0),
             _row("native unsplit", "MQA", us=100.0 * split_ratio)]  # fmt: skip
    return {"sweep": dataclasses.asdict(_decode_cases.FULL), "rows": rows, "split": split,
            "bandwidth": {"status": "ok", "gb_per_s": 2.0, "how": "jit sum", "bytes": 2**30},
            "peers": {"onnxruntime": {"version": "1", "status": None},
                      "ejkernel": {"version": "2", "status": None}}}  # fmt: skip


@pytest.mark.parametrize(
    "measures, passed",
    [
        ({}, [True, True, True]),
        ({"ort_ratio": 1.99}, [False, True, True]),
        ({"ej_ratio": 4.99}, [True, False, True]),
        ({"split_ratio": 1.79}, [True, True, False]),
        ({"ort_status": "error: boom"}, [None, True, True]),
    ],
)
def test_targets_compare_the_right_way_round(measures, passed):
    targets = _decode_report.decode_targets(_full(**measures))
    assert [t["passed"] for t in targets] == passed
    ort, ej, split = targets
    assert (
        ort["target"]
        == "decode S=4096 H=128 N=32 K=8 float32: nanoattn >= 2x faster than onnxruntime"
    )
    assert ej["target"].endswith("nanoattn >= 5x faster than ejkernel")
    assert ej["measured"].startswith("nanoattn (native) 100 us, ejkernel ")
    assert "split-key native >= 1.8x the unsplit kernel (NANOATTN_SPLIT_KEYS=0)" in split["target"]
    if "ort_status" in measures:
        assert ort["measured"] == "error: boom"


def test_cli_bench_only_decode(tmp_path, capsys, monkeypatch):
    sweeps = []

    def fake(sweep, report=None):
        sweeps.append(sweep)
        report(0, 1, "read bandwidth")
        return _full(ort_ratio=1.5) | {"sweep": dataclasses.asdict(sweep)}

    monkeypatch.setattr(_decode, "measure_decode", fake)
    monkeypatch.setattr(_run, "matmul_peak_gflops", lambda dtype: 100.0)
    argv = ["bench", "--only", "decode", "--out", str(tmp_path)]
    assert main([*argv, "--quick"]) == 0  # small sizes: reported, not judged
    out, err = capsys.readouterr()
    assert sweeps == [_decode_cases.QUICK] and "[decode 1/1] read bandwidth" in err
    assert json.loads((tmp_path / "results.json").read_text())["targets"] == []
    assert (
        "| S=4096 H=128 N=32 K=8 | float32 | 900 (900) | 100 (100) | 150 (150) | 500 (500) "
        "| native | 1.0 | 50% | 1.50x | 5.00x |" in out
    )
    assert "| MQA | float32 | 100 (100) | 180 (180) | 1.80x | 1.0 | 50% |" in out
    assert main(argv) == 1  # judged at the full sweep: 1.5x misses ONNX Runtime's 2x
    assert sweeps[-1] == _decode_cases.FULL


def test_huge_pages_are_refused_where_the_kernel_has_none(monkeypatch, tmp_path):
    """Transparent huge pages off: the huge-pages processes give a line each, not a
    process; on: none (this machine's glibc and setting decide), and a process's MiB on
    huge pages is read from /proc (Linux)."""
    off = tmp_path / "enabled"
    off.write_text("always madvise [never]\n")
    monkeypatch.setattr(_huge_pages, "THP", off)
    assert "transparent huge pages are off" in _huge_pages.refusal()
    spec = {"sweep": dataclasses.asdict(TINY), "cases": "huge", "impl": "native",
            "label": "huge pages"}  # fmt: skip
    monkeypatch.setattr(_decode, "run_alone", lambda *a, **k: pytest.fail("a process started"))
    rows = _decode._rows_of(TINY, "native huge pages", spec, {})
    assert len(rows) == len(TINY.huge_cases()) * len(TINY.dtypes)
    assert all(r["status"].startswith("skipped: transparent huge pages are off") for r in rows)
    off.write_text("always [madvise] never\n")
    assert _huge_pages.refusal() is None or "glibc" in _huge_pages.refusal()
    assert _huge_pages.mib() is None or _huge_pages.mib() >= 0
