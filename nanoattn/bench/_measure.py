"""Timing and memory measurement: warm-up, block until ready, several runs."""

import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np


def time_runs(run, *, min_runs: int = 3, max_runs: int = 7, budget_s: float = 2.0):
    """Median and minimum seconds of ``run()`` after one warm-up call.

    Runs at least ``min_runs`` times, and more (up to ``max_runs``) while the
    total stays within ``budget_s``. ``run`` must block until its result is
    ready.
    """
    run()  # warm-up: compilation and first-touch allocation
    times: list[float] = []
    while len(times) < min_runs or (len(times) < max_runs and sum(times) < budget_s):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return float(np.median(times)), float(min(times))


def time_interleaved(runs: dict, *, rounds: int, warmup: int = 1, order=None) -> dict:
    """Median and minimum seconds of each ``runs[name]()``, timed in turn.

    Every round calls the runs in ``order`` (names, repeats allowed; default
    each run once), so that a burst of load on a shared machine falls on all
    of them alike and their ratio stays fair; ``warmup`` rounds come first and
    are not timed. Each run must block until its result is ready. Returns
    ``{name: (median, min)}`` over every timed call.
    """
    order = list(runs) if order is None else list(order)
    times: dict = {name: [] for name in runs}
    for round_ in range(warmup + rounds):
        for name in order:
            run = runs[name]
            start = time.perf_counter()
            run()
            if round_ >= warmup:
                times[name].append(time.perf_counter() - start)
    return {name: (float(np.median(t)), float(min(t))) for name, t in times.items()}


def time_calls(calls: dict, rounds: int) -> dict:
    """Each ``calls[name] = (fn, args)`` (``fn(*args)`` an array, blocked on) timed in
    turn (:func:`time_interleaved`): ``{f"{name}_median_ms": ..., f"{name}_min_ms":
    ...}``."""
    runs = {name: (lambda fn=fn, args=args: fn(*args).block_until_ready())
            for name, (fn, args) in calls.items()}  # fmt: skip
    row = {}
    for name, (median, best) in time_interleaved(runs, rounds=rounds).items():
        row[f"{name}_median_ms"], row[f"{name}_min_ms"] = median * 1e3, best * 1e3
    return row


@dataclasses.dataclass(frozen=True, kw_only=True)
class Heads:
    """The heads of a part's shape (keywords, after its own fields): ``N`` query heads
    on ``K`` key/value heads of width ``H``, each call timed ``rounds`` times."""

    N: int = 32
    K: int = 8
    H: int = 128
    rounds: int = 7


def timed_row(shape, calls: dict, implementation, progress=None, label="", *, ratios: dict,
              omit=()) -> dict:  # fmt: skip
    """A part's row: the fields of its ``shape`` (a dataclass with ``rounds``) but those
    in ``omit``, ``status`` and ``implementation``, the median and min ms of its
    ``calls`` (:func:`time_calls`), and each of ``ratios``, ``{name: (a, b)}``, the
    median of call a over call b's; ``progress(0, 1, label)`` first."""
    if progress:
        progress(0, 1, label)
    fields = {k: v for k, v in dataclasses.asdict(shape).items() if k not in omit}
    row = fields | {"status": "ok", "implementation": implementation}
    row |= time_calls(calls, shape.rounds)
    return row | {name: row[f"{a}_median_ms"] / row[f"{b}_median_ms"]
                  for name, (a, b) in ratios.items()}  # fmt: skip


def ratio_target(target: str, ratio: float, bound: float, at_most: bool) -> dict:
    """A target row of a ratio: ``{"target", "measured" (as "1.23x"), "passed"}``,
    passed when ``ratio`` is at most ``bound`` (``at_most``), else at least."""
    passed = ratio <= bound if at_most else ratio >= bound
    return {"target": target, "measured": f"{ratio:.2f}x", "passed": passed}


def jax_pass(fn, backward: bool):
    """The forward, or forward+backward, of ``fn`` as one jitted function of (q, k, v)."""
    if not backward:
        return jax.jit(fn)

    def loss(q, k, v, cotangent):
        return (fn(q, k, v).astype(jnp.float32) * cotangent).sum()

    grad = jax.grad(loss, argnums=(0, 1, 2))
    return jax.jit(lambda q, k, v: grad(q, k, v, jnp.ones(q.shape, jnp.float32)))


def temp_bytes(compiled_fn, *args) -> int:
    """XLA's compiled temporary memory: deterministic, no run needed."""
    return int(compiled_fn.lower(*args).compile().memory_analysis().temp_size_in_bytes)


def matmul_peak_gflops(size: int = 2048, dtype=jnp.float32) -> float:
    """This machine's measured matrix-multiply rate, the yardstick for MFU."""
    a = jax.random.normal(jax.random.key(0), (size, size), dtype)
    mm = jax.jit(lambda a: a @ a)
    _, best = time_runs(lambda: mm(a).block_until_ready(), min_runs=5, max_runs=10)
    return 2 * size**3 / best / 1e9


def causal_flops(B: int, T: int, N: int, H: int, backward: bool) -> float:
    """Ideal FLOPs of causal attention: two T x T x H products per head, half
    of them skipped by causality; the backward pass does 2.5 times the forward's."""
    forward = 2 * 2 * B * N * T * T * H / 2
    return forward * (3.5 if backward else 1.0)


def pair_target(target: str, row: dict, first: str, second: str, ratio: str, passed) -> dict:
    """A target judged on a measured ``row``'s ratio of two timings: its
    ``{first}_median_ms`` and ``{second}_median_ms``, ``row[ratio]`` and ``passed(ratio)``;
    a row that was not measured gives its status and None."""
    if row["status"] != "ok":
        return {"target": target, "measured": row["status"], "passed": None}
    measured = (
        f"{first} {row[f'{first}_median_ms']:.2f} ms, {second} "
        f"{row[f'{second}_median_ms']:.2f} ms: {row[ratio]:.2f}x"
    )
    return {"target": target, "measured": measured, "passed": passed(row[ratio])}
