"""Two implementations compared fairly: each measured alone, and alternated.

A thread pool keeps spinning for a while after its last task (OpenMP's in torch,
XLA's in JAX), and slows whichever implementation runs next in the same process: a
harness that alternates implementations round by round in one process can tilt the
ratio by half or more. So :func:`compare` measures each implementation **alone**, in a
fresh process of its own (``python -m nanoattn.bench._alone``), one after the other,
the previous process gone (its threads with it) before the next starts; then both
**alternated** in this process, round after round (:func:`~._measure.time_interleaved`),
which spreads a burst of load from other programs on both alike. It reports both
ratios; the targets are judged on the alone one, and a report shows the alternated one
beside it where the two differ by more than :data:`DIFFER` (10%).

The implementations are the names of :data:`nanoattn.bench._peers.PEERS` (nanoattn's
backends and the JAX peers) and ``"torch"`` (PyTorch's SDPA, when installed).
"""

import json
import os
import pathlib
import subprocess
import sys

import jax

from . import _torch
from ._cell import inputs
from ._measure import jax_pass, time_interleaved
from ._peers import PEERS

DIFFER = 0.10  # the relative gap between the alone and the alternated ratio that is shown
TIMEOUT_S = 1800


def make_run(name: str, B: int, T: int, N: int, H: int, backward: bool, dtype: str):
    """A zero-argument function running one causal pass of ``name`` on fixed inputs,
    blocking until its result is ready."""
    q, k, v = inputs(B, T, N, H, dtype)
    if name == "torch":
        return _torch.make_run(q, k, v, backward, dtype)
    fn = jax_pass(PEERS[name].fn, backward)
    return lambda: jax.block_until_ready(fn(q, k, v))


def measure_here(spec: dict) -> dict:
    """``spec``'s implementation timed in this process: median and min seconds over
    ``spec["rounds"]`` calls after one warm-up, and this process's id."""
    shape = [spec[a] for a in ("B", "T", "N", "H", "backward", "dtype")]
    run = make_run(spec["name"], *shape)
    ((median, best),) = time_interleaved({"run": run}, rounds=spec["rounds"]).values()
    return {"median_s": median, "min_s": best, "pid": os.getpid()}


def measure_alone(name: str, B: int, T: int, N: int, H: int, backward: bool, dtype: str,
                  rounds: int) -> dict:  # fmt: skip
    """``name`` timed in a fresh process of its own (:func:`measure_here` there); it has
    exited, its threads with it, when this returns."""
    spec = dict(name=name, B=B, T=T, N=N, H=H, backward=backward, dtype=dtype, rounds=rounds)
    return run_alone("nanoattn.bench._alone", spec, what=name)


def run_alone(module: str, spec: dict, *, what: str, env: dict | None = None,
              paths=(), timeout: float = TIMEOUT_S) -> dict:  # fmt: skip
    """``python -m module JSON`` (``spec`` as JSON) in a fresh process of its own, with
    ``env`` added to this process's environment and ``paths`` (and where this nanoattn
    lives) before ``PYTHONPATH``: the last line of its output that is a JSON object.
    The process has exited, its threads with it, when this returns.

    Raises:
      RuntimeError: the process failed or printed no JSON object (``what`` and the last
        line of its errors say which and why).
    """
    root = str(pathlib.Path(__file__).resolve().parents[2])  # where this nanoattn lives
    path = os.pathsep.join(filter(None, [*map(str, paths), root, os.environ.get("PYTHONPATH")]))
    done = subprocess.run(
        [sys.executable, "-m", module, json.dumps(spec)],
        env={**os.environ, **(env or {}), "PYTHONPATH": path},
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise RuntimeError(f"{what} alone: {tail[:200]}")
    return json.loads(lines[-1])


def compare(first: str, second: str, B: int, T: int, N: int, H: int, backward: bool,
            dtype: str, rounds: int) -> dict:  # fmt: skip
    """``first`` against ``second``, alone and alternated.

    Returns ``{"alone": {name: (median s, min s)}, "alternated": {...}, "pids": {name:
    process id}, "ratio_alone": second / first (> 1: first is faster), "ratio_alternated",
    "differ": whether the two ratios differ by more than DIFFER}``.
    """
    alone, pids = {}, {}
    for name in (first, second):
        got = measure_alone(name, B, T, N, H, backward, dtype, rounds)
        alone[name], pids[name] = (got["median_s"], got["min_s"]), got["pid"]
    runs = {name: make_run(name, B, T, N, H, backward, dtype) for name in (first, second)}
    alternated = time_interleaved(runs, rounds=rounds)
    ratio_alone = alone[second][0] / alone[first][0]
    ratio_alternated = alternated[second][0] / alternated[first][0]
    return {
        "alone": alone,
        "alternated": alternated,
        "pids": pids,
        "ratio_alone": ratio_alone,
        "ratio_alternated": ratio_alternated,
        "differ": abs(ratio_alternated / ratio_alone - 1) > DIFFER,
    }


if __name__ == "__main__":
    print(json.dumps(measure_here(json.loads(sys.argv[1]))), flush=True)
