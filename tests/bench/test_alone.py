"""The fair harness (nanoattn/bench/_alone.py): each implementation measured alone, in
a process of its own, and both alternated in this one; both ratios reported. No time is
asserted: only who ran where, and what the report says."""

import os

import jax.numpy as jnp
import pytest

from nanoattn.bench import _alone, _native, _torch

from _backends import serving

TINY = dict(B=1, T=32, N=2, H=8, backward=True, dtype="float32", rounds=1)


def test_each_implementation_runs_alone_in_a_process_of_its_own():
    # Any two of nanoattn's backends that serve the call (each a peer of the bench): the
    # last two the registry lists, native and flash where native is built.
    q = jnp.zeros((TINY["B"], TINY["T"], TINY["N"], TINY["H"]))
    first, second = serving(q, q, q, is_causal=True)[-2:]
    got = _alone.compare(first, second, **TINY)
    pids = got["pids"]
    assert len({pids[first], pids[second], os.getpid()}) == 3  # two fresh processes
    for part in ("alone", "alternated"):
        for name in (first, second):
            median, best = got[part][name]
            assert 0 < best <= median
    assert got["ratio_alone"] == got["alone"][second][0] / got["alone"][first][0]
    alternated = got["alternated"][second][0] / got["alternated"][first][0]
    assert got["ratio_alternated"] == alternated
    gap = abs(got["ratio_alternated"] / got["ratio_alone"] - 1)
    assert got["differ"] == (gap > _alone.DIFFER)


def test_a_failing_implementation_names_itself():
    with pytest.raises(RuntimeError, match="no-such-peer alone"):
        _alone.measure_alone("no-such-peer", **TINY)


def fake_compare(ratio_alone, ratio_alternated):
    def compare(first, second, B, T, N, H, backward, dtype, rounds):
        alone = {first: (1.0, 0.9), second: (ratio_alone, ratio_alone)}
        alternated = {first: (1.0, 0.9), second: (ratio_alternated, ratio_alternated)}
        gap = abs(ratio_alternated / ratio_alone - 1)
        return dict(alone=alone, alternated=alternated, pids={}, ratio_alone=ratio_alone,
                    ratio_alternated=ratio_alternated, differ=gap > _alone.DIFFER)  # fmt: skip

    return compare


@pytest.mark.parametrize("alternated, shown", [(0.8, True), (1.15, False)])
def test_native_pairs_are_judged_alone_and_show_a_differing_alternated_ratio(
    monkeypatch, alternated, shown
):
    monkeypatch.setattr(_torch, "available", lambda: None)
    monkeypatch.setattr(_native, "compare", fake_compare(1.2, alternated))
    cell = _native.measure_pair(1, 1024, 4, 32, False, peak=100.0)
    assert cell["speedup"] == 1.2 and cell["alternated_speedup"] == alternated
    assert cell["ratios_differ"] == shown
    (row,) = _native.native_targets([cell])
    assert row["passed"]  # judged on the alone ratio, 1.2x
    assert ("alternated in one process: 0.80x" in row["measured"]) == shown
    table = "\n".join(_native.native_markdown([cell]))
    assert ("| 1.20x (alternated 0.80x) |" in table) == shown
    assert "| 1.20x |" in table or shown


def test_without_torch_the_pairs_say_so(monkeypatch):
    monkeypatch.setattr(_torch, "available", lambda: "torch is not installed")
    cell = _native.measure_pair(1, 1024, 4, 32, False, peak=100.0)
    assert cell["status"] == "skipped: torch is not installed"
    (row,) = _native.native_targets([cell])
    assert row["passed"] is None and row["measured"] == cell["status"]
