"""The machine's memory read bandwidth: the yardstick of a decoding step, which reads
its keys and values once and computes little.

A step that reads B bytes in t seconds runs at B / t; against what? A jitted ``x + 1``
(the first measure of the serving part) reads and writes its array, and its output is
a fresh allocation that every call touches for the first time: it measured 3.4 GB/s on
a machine whose native decode read its pages at 3.8 GB/s. A reduction reads its input
and writes one number, as a decode step nearly does. So the read bandwidth is the best
of two reductions over the same array of ``mib`` MiB of float32 (large against any
cache: 1 GiB at the judged shape), each taken ``rounds`` times after a warm-up:

* ``jit sum``: a jitted sum of the array as (rows, -1) with one row per core and then
  some, which XLA's CPU runtime splits over its threads;
* ``numpy threads``: ``np.sum`` of one contiguous part per core, in a thread each
  (numpy's reductions release the GIL).

Each is the bytes of the array over its best time; the better of the two is the
machine's read bandwidth, as a stated peak is: what the machine reached at least once.
"""

import os
import time
from concurrent.futures import ThreadPoolExecutor

import jax
import jax.numpy as jnp
import numpy as np

from .._backends.native import build
from .._base.validate import describe

BANDWIDTH_FRACTION = 0.6  # the decode targets: of the read bandwidth, at least (#47)
ROWS_PER_CORE = 8  # the jitted sum's rows: several per core, so that XLA can split them


def cores() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def _best(run, rounds: int) -> float:
    """The best seconds of ``run()`` over ``rounds`` calls after one warm-up call."""
    run()
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return min(times)


def measure_read(mib: int, rounds: int) -> dict:
    """The read bandwidth over ``mib`` MiB of float32: ``{"case": "read", "bytes",
    "cores", "status", "gb_per_s", "best_ms", "how", "measures": {name: GB/s}}``, or a
    status saying why not (an error is reported, not raised)."""
    n = cores()
    size = mib * 2**18  # float32 elements
    row = {"case": "read", "bytes": 4 * size, "cores": n}
    try:
        x = np.ones(size, np.float32)  # written: every page is in memory before a timed read
        rows = n * ROWS_PER_CORE
        whole = size - size % rows
        on_device = jnp.asarray(x[:whole])
        summed = jax.jit(lambda a: a.reshape(rows, -1).sum(axis=1))
        parts = np.array_split(x, n)
        with ThreadPoolExecutor(n) as pool:
            times = {
                "jit sum": (
                    4 * whole,
                    _best(lambda: summed(on_device).block_until_ready(), rounds),
                ),
                "numpy threads": (4 * size, _best(lambda: list(pool.map(np.sum, parts)), rounds)),
            }
    except Exception as e:  # reported, not fatal to the rest of the bench
        return row | {"status": f"error: {describe(e)[:200]}"}
    measures = {name: nbytes / seconds / 1e9 for name, (nbytes, seconds) in times.items()}
    how = max(measures, key=measures.get)
    return row | {
        "status": "ok",
        "gb_per_s": measures[how],
        "best_ms": times[how][1] * 1e3,
        "how": how,
        "measures": measures,
    }


def measure_page_walk(mib: int, chunks: dict[str, int], rounds: int) -> dict:
    """The read bandwidth of a walk over ``mib`` MiB of float32 in chunks of a page's
    bytes, in a shuffled order, as a decoding step walks a pool whose pages sit
    anywhere: for each ``name: chunk_bytes`` of ``chunks``, the native kernel's
    ``NanoattnReadWalk`` (vector loads into sums, a thread per core, each a part of the
    order; numpy's gathers measured a third of it). ``{"case": "page walk", "cores",
    "status", "gb_per_s": {name: GB/s}, "chunk_bytes": chunks}``, or a status saying why
    not (no native kernel, an error).

    Not judged: it says how far below the read bandwidth (whose reads run in order) runs
    of memory that short stay on this machine (a decode's tile reads none longer: 32
    tokens of keys, then of values). Each walk is checked before it is
    timed: the array is ones, so the sum it returns is the count of numbers it read."""
    n = cores()
    row = {"case": "page walk", "cores": n, "chunk_bytes": dict(chunks)}
    try:
        x = np.ones(mib * 2**18, np.float32)
        measures = {}
        for name, nbytes in chunks.items():
            floats = nbytes // 4
            count = x.size // floats
            order = np.random.default_rng(0).permutation(count).astype(np.int64)
            read = build.read_walk(x, floats, order, n)
            if read is None:
                return row | {"status": "not measured: the native kernel is not available"}
            if read != count * floats:
                raise RuntimeError(f"the walk read {read:g} of {count * floats} numbers")
            seconds = _best(lambda f=floats, o=order: build.read_walk(x, f, o, n), rounds)
            measures[name] = count * nbytes / seconds / 1e9
    except Exception as e:  # reported, not fatal to the rest of the bench
        return row | {"status": f"error: {describe(e)[:200]}"}
    return row | {"status": "ok", "gb_per_s": measures}


def bandwidth_target(what: str, amount: str, name: str, row: dict, read: dict) -> dict:
    """The target "``what`` / step time >= BANDWIDTH_FRACTION of the read bandwidth" of a
    measured ``row`` (its ``{name}_median_ms``, ``{name}_gb_per_s`` or ``gb_per_s``, and
    ``fraction_of_bandwidth`` or ``fraction``), ``amount`` saying what was read, against
    the bandwidth measured in the same run (``read``)."""
    ok = row["status"] == "ok"
    fraction = row.get("fraction_of_bandwidth", row.get("fraction"))
    rate = row.get(f"{name}_gb_per_s", row.get("gb_per_s"))
    return {
        "target": f"{what} / step time >= {BANDWIDTH_FRACTION:.0%} of the read bandwidth",
        "measured": (
            f"{amount} in {row[f'{name}_median_ms']:.2f} ms: {rate:.1f} GB/s, "
            f"{fraction:.0%} of {read['gb_per_s']:.1f} GB/s"
            if ok and fraction is not None
            else row["status"]
            if not ok
            else read["status"]
        ),
        "passed": fraction >= BANDWIDTH_FRACTION if ok and fraction is not None else None,
    }
