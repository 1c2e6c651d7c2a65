"""The decode sweep (issue #47): one decoding step over a paged KV cache on every
implementation that serves a page table, and on the peers, each alone in a process of
its own, against the memory read bandwidth measured in the same run.

The cases (:mod:`~._decode_cases`): llama.cpp's ``test-backend-ops perf -o
FLASH_ATTN_EXT`` grid (one query token, B = 1, keys 4096, 8192 and 16384, head widths
64 and 128, 8 key/value heads, G = N / K of 1 and 4), the same heads at 32768 keys, and
the serving part's batch (B = 16 sequences of 512-8192 keys, 32 query heads on 8 of
width 128), in float32, bfloat16 and int8 (int8 pages with float32 scales, bfloat16
queries). Each step's time (median and min microseconds of at least ``rounds`` calls
after a warm-up call that compiles), the GB/s of its keys and values read once, and
that as a fraction of the read bandwidth (:func:`~._bandwidth.measure_read`, in this
process, before the others start).

Who runs, each in a fresh process of its own (:func:`~._alone.run_alone`), one after
the other, every case and dtype in turn:

* every registered backend of nanoattn that serves a page table (asked first on a tiny
  call: one that refuses gets a line, not a process), through ``paged_attention(...,
  implementation=name)``; "nanoattn" in the table is the automatic choice's backend for
  that call (what ``implementation=None`` takes).
* the peers, when installed (else a line saying how): ONNX Runtime's
  ``GroupQueryAttention`` on a dense cache of the same numbers (:mod:`~._onnx`) and
  ejkernel's ragged paged attention, its XLA path (:mod:`~._ejkernel`), in float32.
* split-key decode: the native kernel on MQA (K = 1) and multi-head latent attention's
  absorbed decode (one key/value head of width 576, values its first 512 columns) at
  B = 1 and 32768 keys, on 2 threads (``NANOATTN_NUM_THREADS=2``), as it is and with
  ``NANOATTN_SPLIT_KEYS=0`` (the unsplit kernel), each in its own process.
* huge pages: the native kernel on the widest long case and the batch with its pools
  on 4 KiB pages of memory and on 2 MiB ones (``GLIBC_TUNABLES=glibc.malloc.hugetlb=1``,
  :mod:`~._huge_pages`), each in its own process; each row says how many MiB of the
  process were on huge pages. Not judged: the issue asks what they give.

Targets, judged at :data:`~._decode_cases.FULL` only: on every float32 case, nanoattn's
step at least 2x faster than ONNX Runtime's and 5x faster than ejkernel's (each alone);
split-key decode at least 1.8x faster than the unsplit kernel on MQA and MLA, in every
dtype.
"""

import dataclasses
import json
import os
import sys

import jax
import numpy as np

from .._backends import dispatch, registry
from .._base.rules import Rules
from .._base.validate import describe
from .._core.paged import paged_attention
from . import _ejkernel, _huge_pages, _onnx
from ._alone import run_alone
from ._bandwidth import measure_read
from ._decode_cases import FULL, QUICK, Case, Sweep, inputs
from ._masks import refusal_of_first_call
from ._measure import time_runs

PEERS = {"onnxruntime": _onnx, "ejkernel": _ejkernel}
PEER_SPEEDUP = {"onnxruntime": 2.0, "ejkernel": 5.0}  # nanoattn's step faster, at least
SPLIT_SPEEDUP = 1.8  # split-key decode against the unsplit kernel, at least
SPLIT_THREADS = "2"
SPLIT = {"split": {"NANOATTN_SPLIT_KEYS": "1"}, "unsplit": {"NANOATTN_SPLIT_KEYS": "0"}}
ENVIRONMENT = ("NANOATTN_NUM_THREADS", "NANOATTN_SPLIT_KEYS", "GLIBC_TUNABLES")  # in each row
MAX_RUNS, BUDGET_S = 50, 1.0  # a step timed at least `rounds` times, more within the budget
__all__ = ["FULL", "QUICK"]


def _arguments(data) -> tuple[tuple, dict]:
    """A paged call's arrays and keywords for ``data`` (one query per sequence)."""
    starts = np.arange(len(data.lengths) + 1, dtype=np.int32)
    arrays = (data.query, data.key_pages, data.value_pages, data.page_table, data.lengths, starts)
    scales = {}
    if data.key_scales is not None:
        scales = dict(key_scales=data.key_scales, value_scales=data.value_scales)
    return arrays, scales


def chosen(data) -> str:
    """The backend nanoattn's automatic choice takes for the step of ``data``."""
    arrays, scales = _arguments(data)
    return dispatch.choose(None, Rules.make_paged(*arrays, **scales), data.query.dtype, 0.0)


def _nanoattn_run(name: str, data):
    """``run()`` of one paged step of ``data`` on backend ``name``, jitted."""
    arrays, scales = _arguments(data)
    step = jax.jit(lambda *a: paged_attention(*a, **scales, implementation=name))
    return lambda: jax.block_until_ready(step(*arrays))


def _row(name: str, case: Case, dtype: str) -> dict:
    return {
        "impl": name,
        "case": case.label,
        "kind": case.kind,
        "dtype": dtype,
        "B": case.batch,
        "N": case.n_heads,
        "K": case.kv_heads,
        "H": case.head_dim,
        "Hv": case.hv,
        "keys": sum(case.lengths),
        "read_bytes": case.read_bytes(dtype),
    }


def measure_one(name: str, case: Case, dtype: str, sweep: Sweep) -> dict:
    """One step of ``case`` in ``dtype`` on ``name`` (a backend or a peer), in this
    process: median and min microseconds and GB/s; or a status saying why not."""
    row = _row(name, case, dtype)
    peer = PEERS.get(name)
    if peer is not None and (reason := peer.available() or peer.unsupported(case, dtype)):
        return row | {"status": f"not measured: {reason}"}
    try:
        data = inputs(case, dtype, sweep.page_size)
        if peer is not None:
            run = peer.make_run(data)[0]
            run()  # compiles
        else:
            row["chosen"] = chosen(data) == name
            run = _nanoattn_run(name, data)
            if reason := refusal_of_first_call(run):  # compiles, or the backend refuses
                return row | {"status": f"{name} does not serve it", "reason": reason}
        median, best = time_runs(run, min_runs=sweep.rounds, max_runs=MAX_RUNS, budget_s=BUDGET_S)
        huge_mib = _huge_pages.mib()  # while the case's pools are alive
    except Exception as e:  # reported in the table, not fatal to the rest of the bench
        return row | {"status": f"error: {describe(e)[:200]}"}
    return row | {"status": "ok", "median_us": median * 1e6, "min_us": best * 1e6,
                  "gb_per_s": row["read_bytes"] / median / 1e9, "huge_mib": huge_mib}  # fmt: skip


def _sweep(spec: dict) -> Sweep:
    """The :class:`Sweep` of a JSON spec (its lists back to tuples)."""
    fields = {k: tuple(v) if isinstance(v, list) else v for k, v in spec["sweep"].items()}
    return Sweep(**fields)


def _cases(sweep: Sweep, kind: str) -> list[Case]:
    """The cases of a process: ``kind`` "main", "split" or "huge"."""
    return {"main": sweep.cases, "split": sweep.split_cases, "huge": sweep.huge_cases}[kind]()


def measure_here(spec: dict) -> dict:
    """Every case of ``spec`` (``"cases"``: ``"main"``, ``"split"`` or ``"huge"``) and
    dtype on ``spec["impl"]``, in this process."""
    sweep = _sweep(spec)
    cases = _cases(sweep, spec["cases"])
    rows = [measure_one(spec["impl"], case, dtype, sweep)
            for case in cases for dtype in sweep.dtypes]  # fmt: skip
    env = {name: os.environ.get(name) for name in ENVIRONMENT}
    return {"rows": [r | {"env": env} for r in rows], "pid": os.getpid()}


def paged_refusal(name: str) -> str | None:
    """Why backend ``name`` serves no paged call (asked on a tiny one), or None."""
    data = inputs(Case("probe", (8,), 2, 1, 8), "float32", 4)
    arrays, scales = _arguments(data)
    rules = Rules.make_paged(*arrays, **scales)
    return dispatch.refusal(registry.get(name), rules, data.query.dtype, 0.0)


def jobs(sweep: Sweep, implementations=None) -> list[tuple[str, dict, dict]]:
    """(label, spec, environment) of each process: every backend (default: every
    registered one), every peer, the split and the unsplit kernel, then the kernel on
    4 KiB and on huge pages."""
    names = registry.names() if implementations is None else implementations
    base = {"sweep": dataclasses.asdict(sweep), "cases": "main"}
    out = [(name, base | {"impl": name}, {}) for name in (*names, *PEERS)]
    for label, env in SPLIT.items():
        spec = base | {"impl": "native", "cases": "split", "label": label}
        out.append((f"native {label}", spec, {"NANOATTN_NUM_THREADS": SPLIT_THREADS, **env}))
    for label, env in _huge_pages.ENV.items():
        spec = base | {"impl": "native", "cases": "huge", "label": label}
        out.append((f"native {label}", spec, env))
    return out


def _without_process(sweep: Sweep, spec: dict) -> str | None:
    """Why ``spec``'s process is not started (its rows get the status), or None."""
    name = spec["impl"]
    if spec["cases"] == "huge" and (reason := _huge_pages.refusal()):
        return f"skipped: {reason}"
    if name in PEERS:
        reason = PEERS[name].available()
        return None if reason is None else f"skipped: {reason}"
    reason = paged_refusal(name)
    return None if reason is None else f"{name} does not serve a page table: {reason}"


def _rows_of(sweep: Sweep, label: str, spec: dict, env: dict) -> list[dict]:
    """The rows of one process (or, where it is not started or fails, its cases with
    the status)."""
    cases = _cases(sweep, spec["cases"])
    status = _without_process(sweep, spec)
    if status is None:
        try:
            got = run_alone("nanoattn.bench._decode", spec, what=label, env=env)
            return [r | {"pid": got["pid"]} for r in got["rows"]]
        except Exception as e:  # reported in the table, not fatal to the rest of the bench
            status = f"error: {describe(e)[:200]}"
    return [_row(spec["impl"], case, dtype) | {"status": status}
            for case in cases for dtype in sweep.dtypes]  # fmt: skip


def measure_decode(sweep: Sweep = FULL, report=None, implementations=None) -> dict:
    """The read bandwidth, then every process of :func:`jobs` (``report(i, n, label)``
    before each): ``{"sweep", "bandwidth", "rows", "split", "huge", "peers"}``."""
    items = jobs(sweep, implementations)
    if report:
        report(0, len(items) + 1, "read bandwidth")
    read = measure_read(sweep.read_mib, sweep.rounds)
    rows, extra = [], {"split": [], "huge": []}
    for i, (label, spec, env) in enumerate(items):
        if report:
            report(i + 1, len(items) + 1, f"{label}, alone")
        got = _rows_of(sweep, label, spec, env)
        if spec["cases"] in extra:
            extra[spec["cases"]] += [r | {"impl": f"native {spec['label']}"} for r in got]
        else:
            rows += got
    bandwidth = read.get("gb_per_s")
    for row in (*rows, *extra["split"], *extra["huge"]):
        if row["status"] == "ok" and bandwidth:
            row["fraction"] = row["gb_per_s"] / bandwidth
    peers = {name: {"version": peer.version(), "status": peer.available()}
             for name, peer in PEERS.items()}  # fmt: skip
    return {"sweep": dataclasses.asdict(sweep), "bandwidth": read, "rows": rows, **extra,
            "peers": peers}  # fmt: skip


if __name__ == "__main__":
    print(json.dumps(measure_here(json.loads(sys.argv[1]))), flush=True)
