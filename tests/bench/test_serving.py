"""`nanoattn bench --only serving` (nanoattn/bench/_serving.py): the part runs at tiny
sizes and reports a row per case, dtype and implementation (refusals with their
reason), its two calls of each case compute the same attention, the targets compare
the right way round, and the command line registers the part. No time is asserted."""

import dataclasses
import json

import jax.numpy as jnp
import numpy as np
import pytest

from nanoattn._backends import registry
from nanoattn.bench import _run, _serving
from nanoattn.cli import main

TINY = _serving.Shape(3, 8, 23, 4, 2, 8, 4, 8, 1, rounds=1)  # B, lengths 8-23, N, K, H


def test_the_part_reports_every_case_dtype_and_implementation():
    result = _serving.measure_serving(TINY, dtypes=("float32",))
    assert result["shape"] == dataclasses.asdict(TINY)
    assert result["copy"]["status"] == "ok" and result["copy"]["bytes"] == 2 * 2**20
    rows = {(r["case"], r["impl"]): r for r in result["rows"]}
    names = registry.names()
    assert list(rows) == [(case, name) for case in ("decode", "mixed") for name in names]
    for (case, name), row in rows.items():
        if row["status"] != "ok":  # refused: the dispatcher's reason, nothing measured
            assert row["status"] == f"{name} does not serve a page table", row
            assert row["reason"] and "paged_median_ms" not in row
            continue
        if case == "decode":
            assert row["held_bytes"] == 2 * (2 + 4 + 6) * 4 * 2 * 8 * 4  # pages x ps K H f32
            assert row["fraction_of_copy"] > 0 and row["full_vs_paged"] > 0
        else:
            assert row["mixed_vs_alone"] > 0
    assert rows["decode", "xla"]["status"] == rows["mixed", "flash"]["status"] == "ok"
    text = "\n".join(_serving.serving_markdown(result))
    assert "### Serving: B=3 sequences of 8-23 keys, 4 query heads on 2 key/value heads" in text
    assert "| mixed: 8-token chunk + 2 decodes | dtype |" in text
    assert _serving.serving_targets(result) == []  # judged at the full shape only


def test_the_paired_calls_compute_the_same_attention():
    """What the decode pair times (paged pool, full cache) and what the mixed pair times
    (the chunk among decodes, the chunk alone) are the same attention."""
    data = _serving.pool(TINY, "float32")
    lengths = TINY.lengths()
    assert lengths.tolist() == [8, 16, 23] and (data.key_pages.shape[0], TINY.prefill) == (12, 8)
    held = np.concatenate([data.page_table[b, : -(-n // 4)] for b, n in enumerate(lengths)])
    assert sorted(held.tolist()) == list(range(12))  # every page held once, shuffled
    calls = _serving._calls("decode", TINY, data, "xla")
    np.testing.assert_allclose(calls["paged"](), calls["full"]()[:, 0], rtol=1e-5, atol=1e-5)
    calls = _serving._calls("mixed", TINY, data, "xla")
    mixed, alone = calls["mixed"](), calls["alone"]()
    np.testing.assert_allclose(mixed[: TINY.prefill], alone, rtol=1e-5, atol=1e-5)
    decode = _serving._calls("decode", TINY, data, "xla")["paged"]()
    np.testing.assert_allclose(mixed[TINY.prefill :], decode[1:], rtol=1e-5, atol=1e-5)
    assert not jnp.allclose(mixed[: TINY.prefill], 0)


def _full_result(fraction=0.5, full_vs_paged=2.0, mixed_vs_alone=1.2):  # the bounds
    decode = {
        "case": "decode",
        "impl": "flash",
        "dtype": "float32",
        "status": "ok",
        "held_bytes": 2**30,
        "paged_median_ms": 2.0,
        "full_median_ms": 2.0 * full_vs_paged,
        "paged_min_ms": 1.5,
        "full_min_ms": 1.5,
        "paged_gb_per_s": 1.0,
        "fraction_of_copy": fraction,
        "full_vs_paged": full_vs_paged,
    }
    mixed = {
        "case": "mixed",
        "impl": "flash",
        "dtype": "float32",
        "status": "ok",
        "mixed_median_ms": mixed_vs_alone,
        "alone_median_ms": 1.0,
        "mixed_min_ms": 1.0,
        "alone_min_ms": 1.0,
        "mixed_vs_alone": mixed_vs_alone,
    }
    refused = {"case": "mixed", "impl": "native", "dtype": "float32",
               "status": "native does not serve a page table", "reason": "why"}  # fmt: skip
    copy = {"case": "copy", "status": "ok", "gb_per_s": 2.0, "bytes": 2**20, "median_ms": 1.0}
    return {"shape": dataclasses.asdict(_serving.FULL), "copy": copy,
            "rows": [decode, mixed, refused]}  # fmt: skip


@pytest.mark.parametrize(
    "measures, passed",
    [
        ({}, [True, True, True]),
        ({"fraction": 0.49}, [False, True, True]),
        ({"full_vs_paged": 1.9}, [True, False, True]),
        ({"mixed_vs_alone": 1.25}, [True, True, False]),
    ],
)
def test_targets_compare_the_right_way_round(measures, passed):
    targets = _serving.serving_targets(_full_result(**measures))
    assert [t["passed"] for t in targets] == [*passed, None, None]
    assert "50% of the copy bandwidth" in targets[0]["target"]
    assert "2x faster than a full cache of 8192" in targets[1]["target"]
    assert "512-token prefill chunk + 15 decode tokens <= 1.2x" in targets[2]["target"]
    assert targets[3]["measured"] == "native does not serve a page table"
    assert (
        targets[4]["target"] == _serving.ENGINE_TARGET
        and "examples.recall serve" in (targets[4]["measured"])
    )


def test_cli_bench_only_serving(tmp_path, capsys, monkeypatch):
    shapes = []

    def fake(shape, report=None):
        shapes.append(shape)
        report(0, 1, "copy bandwidth")
        return _full_result(mixed_vs_alone=1.5) | {"shape": dataclasses.asdict(shape)}

    monkeypatch.setattr(_serving, "measure_serving", fake)
    monkeypatch.setattr(_run, "matmul_peak_gflops", lambda dtype: 100.0)
    argv = ["bench", "--only", "serving", "--out", str(tmp_path)]
    assert main([*argv, "--quick"]) == 0  # small sizes: reported, not judged
    out, err = capsys.readouterr()
    assert shapes == [_serving.QUICK] and "[serving 1/1] copy bandwidth" in err
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["cells"] == [] and results["targets"] == []
    assert results["serving"]["rows"][0]["impl"] == "flash"
    assert "| mixed: 64-token chunk + 15 decodes |" in out
    assert "| native | float32 | native does not serve a page table (why) | | |" in out
    assert main(argv) == 1  # the full sizes are judged: the mixed call misses its bound
    assert shapes[-1] == _serving.FULL
    assert "| serving mixed flash float32: a 512-token" in capsys.readouterr().out


def test_the_part_is_chosen_by_only_and_sized_by_quick():
    from nanoattn.cli import build_parser
    from nanoattn.cli._bench import config_from_args

    def config(*argv):
        return config_from_args(build_parser().parse_args(["bench", *argv]))

    assert config().serving == "full" and config("--quick").serving == ""
    assert config("--only", "serving").serving == "full"
    assert config("--quick", "--only", "serving").serving == "quick"
    assert config("--only", "masks").serving == ""
