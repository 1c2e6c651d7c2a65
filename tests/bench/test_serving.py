"""`nanoattn bench --only serving` (nanoattn/bench/_serving.py, _quantized.py,
_bandwidth.py): the part runs at tiny sizes and reports the read bandwidth, the cache's
bytes per token per dtype and a row per case, dtype and implementation (refusals with
their reason), its two calls of each case compute the same attention, the targets
compare the right way round, and the command line registers the part. No time is
asserted."""

import dataclasses
import json

import jax.numpy as jnp
import numpy as np
import pytest

from nanoattn import dequantize_kv, paged_attention
from nanoattn._backends import registry
from nanoattn._backends.native import build
from nanoattn._layers.caches import kv_cache
from nanoattn.bench import _bandwidth, _quantized, _run, _serving
from nanoattn.cli import main

from _backends import paged_serving, serving

TINY = _serving.Shape(3, 8, 23, 4, 2, 8, 4, 8, 1, rounds=1)  # B, lengths 8-23, N, K, H


@pytest.fixture(autouse=True)
def combined_at_tiny_sizes(monkeypatch):
    """TINY's tokens (128 bytes of float32 keys and values) kept as a layer keeps 2-4
    KiB ones (one combined pool and full cache), so that the part's combined path runs;
    the inputs built afresh under it."""
    monkeypatch.setattr(kv_cache, "COMBINED_BYTES", (0, 4096))
    _serving.pool.cache_clear(), _quantized.quantized_pool.cache_clear()
    yield
    _serving.pool.cache_clear(), _quantized.quantized_pool.cache_clear()


def test_the_part_reports_every_case_dtype_and_implementation():
    result = _serving.measure_serving(TINY, dtypes=("float32",))
    assert result["shape"] == dataclasses.asdict(TINY)
    read = result["bandwidth"]
    assert read["status"] == "ok" and read["bytes"] == 2**20  # 1 MiB of float32
    assert read["gb_per_s"] == max(read["measures"].values()) > 0
    assert sorted(read["measures"]) == ["jit sum", "numpy threads"]
    walk = result["page_walk"]  # a page of one pool: 4 tokens of K = 2 heads of H = 8
    assert walk["chunk_bytes"] == {"int8": 64, "bfloat16": 128, "float32": 256}
    if build.load()[0] is None:
        assert walk["status"] == "not measured: the native kernel is not available"
    else:
        assert walk["status"] == "ok", walk
        assert list(walk["gb_per_s"]) == ["int8", "bfloat16", "float32"]
        assert all(gb > 0 for gb in walk["gb_per_s"].values())
    # One token of one layer: K = 2 heads of H = 8, keys and values (+ float32 scales).
    assert result["cache_bytes"]["bytes"] == {
        "float32": 2 * 2 * 8 * 4, "bfloat16": 2 * 2 * 8 * 2, "int8": 2 * 2 * 8 + 2 * 2 * 4,
        "float8_e4m3fn": 2 * 2 * 8 + 2 * 2 * 4,
    }  # fmt: skip
    assert result["cache_bytes"]["ratios"] == {"float32": 48 / 128, "bfloat16": 48 / 64}
    names = registry.names()
    quantized = {r["impl"]: r for r in result["quantized"]}
    assert list(quantized) == list(names)
    for name, row in quantized.items():
        if row["status"] != "ok":  # refused: the dispatcher's reason, nothing measured
            assert row["status"] == f"{name} does not serve quantized keys", row
            assert row["reason"] and "int8_median_ms" not in row
            continue
        # 12 pages of 4 tokens: int8 keys and values, float32 scales; 3 bfloat16 queries
        assert row["read_bytes"] == 2 * 12 * 4 * 2 * 8 + 2 * 12 * 4 * 2 * 4 + 3 * 4 * 8 * 2
        assert row["fraction"] == row["gb_per_s"] / read["gb_per_s"] and row["speedup"] > 0
        assert row["wide_speedup"] == row["float32_median_ms"] / row["bfloat16_median_ms"]
    # measured exactly where the registry's backends serve the int8 call (both of them)
    int8 = _quantized.quantized_pool(TINY, _serving.pool)
    data, starts = _serving.pool(TINY, "bfloat16"), np.arange(TINY.batch + 1, dtype=np.int32)
    served = paged_serving(data.query, int8.key_pages, int8.value_pages, data.page_table,
                           data.lengths, starts, key_scales=int8.key_scales,
                           value_scales=int8.value_scales)  # fmt: skip
    assert [n for n, row in quantized.items() if row["status"] == "ok"] == served
    assert len(served) >= 2  # the reference and a kernel at least
    rows = {(r["case"], r["impl"]): r for r in result["rows"]}
    assert list(rows) == [(case, name) for case in ("decode", "mixed") for name in names]
    for (case, name), row in rows.items():
        if row["status"] != "ok":  # refused: the dispatcher's reason, nothing measured
            assert row["status"] == f"{name} does not serve a page table", row
            assert row["reason"] and "paged_median_ms" not in row
            continue
        if case == "decode":
            assert row["held_bytes"] == 2 * (2 + 4 + 6) * 4 * 2 * 8 * 4  # pages x ps K H f32
            assert row["fraction_of_bandwidth"] > 0 and row["full_vs_paged"] > 0
            # 128 bytes a token: one combined pool, as a layer keeps it; and two pools
            assert row["pool"] == "one"
            assert row["two_vs_paged"] == row["two_median_ms"] / row["paged_median_ms"]
        else:
            assert row["mixed_vs_parts"] > 0
            assert row["parts_median_ms"] == row["alone_median_ms"] + row["decodes_median_ms"]
    # measured exactly where the registry's backends serve the paged call (and for the
    # decode case the full cache's dense call too); the mixed call has the same rules
    data = _serving.pool(TINY, "float32")
    paged = paged_serving(data.query, data.key_pages, data.value_pages, data.page_table,
                          data.lengths, starts)  # fmt: skip
    assert data.value_cache is None  # a combined full cache (B, longest, 2, K, H)
    dense = serving(data.query[:, None], data.key_cache[:, :, 0], data.key_cache[:, :, 1],
                    kv_lengths=data.lengths)  # fmt: skip
    for case, served in (("decode", [n for n in paged if n in dense]), ("mixed", paged)):
        assert [n for n in names if rows[case, n]["status"] == "ok"] == served, case
        assert len(served) >= 2, case  # the reference and a kernel at least
    text = "\n".join(_serving.serving_markdown(result))
    assert "### Serving: B=3 sequences of 8-23 keys, 4 query heads on 2 key/value heads" in text
    assert "| mixed: 8-token chunk + 2 decodes | dtype | mixed ms | chunk alone ms |" in text
    assert "| int8 | 48 | 1.000x |" in text and "| float32 | 128 | 0.375x |" in text
    assert "| decode: int8 pages against bfloat16 and float32 | int8 ms |" in text
    assert "| of read bandwidth | of its page walk |" in text
    assert "| decode | dtype | pool | paged ms | over two pools ms: / paged |" in text
    if walk["status"] == "ok":  # the decode rows' GB/s over their dtype's walk
        row = next(r for r in result["rows"] if r["case"] == "decode" and r["status"] == "ok")
        share = row["paged_gb_per_s"] / walk["gb_per_s"][row["dtype"]]
        assert f"{row['fraction_of_bandwidth']:.0%} | {share:.0%} |" in text
    assert _serving.serving_targets(result) == []  # judged at the full shape only


def test_the_paired_calls_compute_the_same_attention():
    """What the decode pair times (paged pool, full cache) and what the mixed case times
    (the chunk among decodes, the chunk alone, the decodes alone) are the same
    attention."""
    data = _serving.pool(TINY, "float32")
    lengths = TINY.lengths()
    assert lengths.tolist() == [8, 16, 23] and (data.key_pages.shape[0], TINY.prefill) == (12, 8)
    held = np.concatenate([data.page_table[b, : -(-n // 4)] for b, n in enumerate(lengths)])
    assert sorted(held.tolist()) == list(range(12))  # every page held once, shuffled
    calls = _serving._calls("decode", TINY, data, "xla")
    np.testing.assert_allclose(calls["paged"](), calls["full"]()[:, 0], rtol=1e-5, atol=1e-5)
    assert data.combined.shape == (12, 4, 2, 2, 8)  # the same pages, one combined pool
    np.testing.assert_array_equal(calls["paged"](), calls["two"]())
    calls = _serving._calls("mixed", TINY, data, "xla")
    mixed, alone, decodes = calls["mixed"](), calls["alone"](), calls["decodes"]()
    np.testing.assert_allclose(mixed[: TINY.prefill], alone, rtol=1e-5, atol=1e-5)
    decode = _serving._calls("decode", TINY, data, "xla")["paged"]()
    np.testing.assert_allclose(mixed[TINY.prefill :], decode[1:], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(decodes, decode[1:], rtol=1e-5, atol=1e-5)
    assert decodes.shape == (TINY.batch - 1, TINY.n_heads, TINY.head_dim)
    assert not jnp.allclose(mixed[: TINY.prefill], 0)


def test_the_int8_step_reads_the_quantized_bfloat16_pool():
    """The int8 call computes attention over the bfloat16 pages quantized by
    quantize_kv (equal to the same call over their dequantized pages), near the
    bfloat16 call and not equal to it."""
    calls = _quantized.calls("xla", TINY, _serving.pool)
    data, pages = _serving.pool(TINY, "bfloat16"), _quantized.quantized_pool(TINY, _serving.pool)
    assert pages.key_pages.dtype == jnp.int8 and pages.key_scales.shape == (12, 4, 2)
    dequantized = [
        dequantize_kv(v, s)
        for v, s in ((pages.key_pages, pages.key_scales), (pages.value_pages, pages.value_scales))
    ]
    starts = np.arange(TINY.batch + 1, dtype=np.int32)
    want = paged_attention(data.query.astype(jnp.float32), *dequantized, data.page_table,
                           data.lengths, starts)  # fmt: skip
    int8, bf16, f32 = (np.asarray(calls[n](), np.float32) for n in ("int8", "bfloat16",
                                                                     "float32"))  # fmt: skip
    np.testing.assert_allclose(int8, want, rtol=1e-2, atol=1e-2)  # the output is bfloat16
    np.testing.assert_allclose(int8, bf16, rtol=0.1, atol=0.1)
    assert not np.array_equal(int8, bf16)
    # float32: the bfloat16 numbers widened, computed in float32 (the reference's output)
    wide = [x.astype(jnp.float32) for x in (data.query, data.key_pages, data.value_pages)]
    want = paged_attention(*wide, data.page_table, data.lengths, starts)
    np.testing.assert_allclose(f32, want, rtol=1e-6, atol=1e-6)
    assert calls["float32"]().dtype == jnp.float32


def test_the_read_bandwidth_is_the_best_of_its_measures():
    read = _bandwidth.measure_read(3, rounds=1)
    assert read["status"] == "ok" and read["bytes"] == 3 * 2**20
    assert read["cores"] == _bandwidth.cores() >= 1
    assert read["gb_per_s"] == read["measures"][read["how"]] == max(read["measures"].values())


def test_the_page_walk_reads_every_chunk_once():
    """The native walk sums every number of each chunk once (the array is ones: the
    sum is the count read; the walk checks it before timing): chunks of 96 bytes (no
    whole vector: the tail path) and of 4 KiB (vectors only); a walk that skips or
    repeats chunks, or a tail, reads a status saying so."""
    if build.load()[0] is None:
        pytest.skip("the native kernel is not available")
    walk = _bandwidth.measure_page_walk(3, {"odd": 96, "page": 4096}, rounds=1)
    assert walk["status"] == "ok", walk
    assert walk["cores"] == _bandwidth.cores() and walk["chunk_bytes"]["odd"] == 96
    assert sorted(walk["gb_per_s"]) == ["odd", "page"]
    x = np.arange(12, dtype=np.float32)  # chunks of 3: [0 1 2] [3 4 5] [6 7 8] [9 10 11]
    assert build.read_walk(x, 3, np.array([3, 1], np.int64), 2) == 30 + 12
    with pytest.raises(ValueError, match="order: contiguous int64"):
        build.read_walk(x, 3, np.array([3, 1], np.int32), 2)


def test_the_int8_cache_bytes_at_the_serving_shape_meet_both_targets():
    """From the layer's own cache (cache_bytes of eval_shape): 2 K H + 2 K 4 bytes a
    token against 2 K H 4 and 2 K H 2 (K = 8, H = 128)."""
    cache = _quantized.cache_row(32, 8, 128)
    assert cache["bytes"] == {"float32": 8192, "bfloat16": 4096, "int8": 2112,
                              "float8_e4m3fn": 2112}  # fmt: skip
    bytes_targets = _quantized.quantized_targets(cache, [], {})[:2]
    assert [t["passed"] for t in bytes_targets] == [True, True]
    assert "0.258x" in bytes_targets[0]["measured"] and "0.516x" in bytes_targets[1]["measured"]


def _full_result(fraction=0.6, full_vs_paged=1.1, mixed_vs_parts=1.1, int8_bytes=2112,
                 speedup=1.6, wide_speedup=1.6, int8_fraction=0.6):  # fmt: skip  # the bounds
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
        "fraction_of_bandwidth": fraction,
        "full_vs_paged": full_vs_paged,
    }
    mixed = {
        "case": "mixed",
        "impl": "flash",
        "dtype": "float32",
        "status": "ok",
        "mixed_median_ms": 2 * mixed_vs_parts,
        "alone_median_ms": 1.5,
        "decodes_median_ms": 0.5,
        "parts_median_ms": 2.0,
        "mixed_min_ms": 1.0,
        "alone_min_ms": 1.0,
        "decodes_min_ms": 0.25,
        "mixed_vs_parts": mixed_vs_parts,
    }
    refused = {"case": "mixed", "impl": "native", "dtype": "float32",
               "status": "native does not serve a page table", "reason": "why"}  # fmt: skip
    read = {"case": "read", "status": "ok", "gb_per_s": 2.0, "bytes": 2**20, "best_ms": 0.5,
            "how": "jit sum", "cores": 2,
            "measures": {"jit sum": 2.0, "numpy threads": 1.0}}  # fmt: skip
    sizes = {"float32": 8192, "bfloat16": 4096, "int8": int8_bytes, "float8_e4m3fn": 2112}
    cache = {"N": 32, "K": 8, "H": 128, "bytes": sizes,
             "ratios": {d: int8_bytes / sizes[d] for d in ("float32", "bfloat16")}}  # fmt: skip
    int8 = {"case": "quantized", "impl": "native", "status": "ok", "int8_median_ms": 2.0,
            "int8_min_ms": 2.0, "bfloat16_median_ms": 2.0 * speedup, "bfloat16_min_ms": 3.0,
            "float32_median_ms": 2.0 * speedup * wide_speedup, "float32_min_ms": 4.0,
            "speedup": speedup, "wide_speedup": wide_speedup, "read_bytes": 2**30,
            "gb_per_s": 2.0 * int8_fraction, "fraction": int8_fraction}  # fmt: skip
    int8_refused = {"case": "quantized", "impl": "cudnn", "reason": "no GPU",
                    "status": "cudnn does not serve quantized keys"}  # fmt: skip
    return {"shape": dataclasses.asdict(_serving.FULL), "bandwidth": read, "cache_bytes": cache,
            "quantized": [int8, int8_refused], "rows": [decode, mixed, refused]}  # fmt: skip


# bytes x2, native int8 / bfloat16, native bfloat16 / float32, native's and cudnn's share of
# the read bandwidth, the example's accuracy
QUANTIZED_PASSED = [True, True, True, True, True, None, None]


@pytest.mark.parametrize(
    "measures, passed",
    [
        ({}, [*QUANTIZED_PASSED, True, True, True]),
        ({"fraction": 0.59}, [*QUANTIZED_PASSED, False, True, True]),
        ({"full_vs_paged": 1.11}, [*QUANTIZED_PASSED, True, False, True]),
        ({"full_vs_paged": 0.5}, [*QUANTIZED_PASSED, True, True, True]),
        ({"mixed_vs_parts": 1.11}, [*QUANTIZED_PASSED, True, True, False]),
        ({"int8_bytes": 2170}, [*QUANTIZED_PASSED, True, True, True]),  # 0.5298x bfloat16
        ({"int8_bytes": 2171}, [True, False, *QUANTIZED_PASSED[2:], True, True, True]),
        ({"int8_bytes": 2212}, [False, False, *QUANTIZED_PASSED[2:], True, True, True]),
        ({"speedup": 1.59}, [True, True, False, True, True, None, None, True, True, True]),
        ({"wide_speedup": 1.59}, [True, True, True, False, True, None, None, True, True, True]),
        ({"int8_fraction": 0.59}, [True, True, True, True, False, None, None, True, True, True]),
    ],
)
def test_targets_compare_the_right_way_round(measures, passed):
    targets = _serving.serving_targets(_full_result(**measures))
    assert [t["passed"] for t in targets] == [*passed, None]
    assert targets[0]["target"].endswith("bytes per token per layer <= 0.27x float32")
    assert targets[1]["target"].endswith("bytes per token per layer <= 0.53x bfloat16")
    assert "native: >= 1.6x faster than bfloat16 pages" in targets[2]["target"]
    assert targets[3]["target"] == (
        "serving bfloat16 decode native: >= 1.6x faster than float32 pages (the same numbers)"
    )
    assert "native: bytes read / step time >= 60% of the read bandwidth" in targets[4]["target"]
    assert targets[5]["measured"] == "cudnn does not serve quantized keys"
    assert targets[6]["target"] == _quantized.EXAMPLE_TARGET
    assert "examples.recall quantized" in targets[6]["measured"]
    assert "60% of the read bandwidth" in targets[7]["target"]
    assert "a full cache of 8192 (kv_lengths) within 1.1x the paged step" in targets[8]["target"]
    assert (
        "512-token prefill chunk + 15 decode tokens <= 1.1x (the chunk alone + the decodes "
        "alone)" in targets[9]["target"]
    )
    assert targets[9]["measured"].startswith("mixed 2.")
    assert "parts 2.00 ms" in targets[9]["measured"]
    assert targets[10]["measured"] == "native does not serve a page table"
    assert len(targets) == 11  # the engine's target is the engine part's


def test_cli_bench_only_serving(tmp_path, capsys, monkeypatch):
    shapes = []

    def fake(shape, report=None):
        shapes.append(shape)
        report(0, 1, "read bandwidth")
        return _full_result(mixed_vs_parts=1.5) | {"shape": dataclasses.asdict(shape)}

    monkeypatch.setattr(_serving, "measure_serving", fake)
    monkeypatch.setattr(_run, "matmul_peak_gflops", lambda dtype: 100.0)
    argv = ["bench", "--only", "serving", "--out", str(tmp_path)]
    assert main([*argv, "--quick"]) == 0  # small sizes: reported, not judged
    out, err = capsys.readouterr()
    assert shapes == [_serving.QUICK] and "[serving 1/1] read bandwidth" in err
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["cells"] == [] and results["targets"] == []
    assert results["serving"]["rows"][0]["impl"] == "flash"
    assert "| mixed: 64-token chunk + 15 decodes |" in out
    assert "| native | float32 | native does not serve a page table (why) | | | |" in out
    assert "| cudnn | cudnn does not serve quantized keys (no GPU) | | | | | | | |" in out
    assert (
        "| native | 2.00 (2.00) | 3.20 (3.00) | 1.60x | 5.12 (4.00) | 1.60x | 1024.0 | 1.2 "
        "| 60% |" in out
    )
    assert "| flash | float32 | 3.00 (1.00) | 1.50 (1.00) | 0.50 (0.25) | 1.50x |" in out
    assert (
        "Read bandwidth (a jitted sum and numpy sums in a thread per core over float32): "
        "2.0 GB/s, the best of jit sum 2.0, numpy threads 1.0" in out
    )
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
