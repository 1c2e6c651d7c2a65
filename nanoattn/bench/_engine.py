"""The recall example's serving engine (issue #47): continuous batching against static
batching in the same cache memory, tokens/s and their ratio.

``examples/recall/engine.py``'s :class:`Engine` (continuous batching over a paged KV
cache: requests admitted as others finish, each step one jitted call mixing prompt
chunks and decode tokens) and its :class:`Static` (the requests ``batch`` at a time
through full caches, ``batch * capacity <= pages * page_size``: the engine's pool),
on a randomly initialised model of the example's configuration (``ModelConfig`` with
the task's vocabulary, as its default run trains it): throughput needs no checkpoint,
the tokens are garbage, the steps are not. Attention on nanoattn's automatic choice
(``engine.with_implementation(model, None)``), as ``serve`` runs by default. The
workload and the sizes are the example's own (``engine.WORKLOAD``: 96 requests of
seed 0, prompts of 16-384 tokens, 1-128 new tokens each; ``engine.SERVE``: 512 pages
of 16 tokens, 32 requests in flight, 128 tokens a step) at :data:`FULL`; ``--quick``
serves a smaller workload in a smaller pool (:data:`QUICK`).

Each of the two runs alone, in a fresh process of its own (:func:`~._alone.run_alone`:
the other's thread pools are gone), one after the other: a warm-up that compiles (the
engine's step at each of its sizes, the static prefill and step), then ``rounds`` runs
of the whole workload; tokens/s from the median run. Each reports the backends its
attention took, its steps, the programs its step compiled (the engine's: one per step
size, none during the runs) and a digest of every request's tokens: both are greedy,
so equal digests say they served the same tokens (with random weights a near-tie of two
logits may still tip one way in one and the other way in the other). Target
(:data:`TARGET`): continuous batching at least 5x static batching's tokens/s, judged at
:data:`FULL` only.

The examples are not in the installed package: the part needs the repository (run
from its root, or an editable install, whose package sits beside ``examples/``);
elsewhere it reports one line saying so.
"""

import dataclasses
import hashlib
import json
import os
import pathlib
import sys
import time

from .._base.validate import describe
from ._alone import run_alone
from ._markdown import section

TARGET = 5.0  # continuous batching's tokens/s over static batching's, at least
NAMES = ("engine", "static")
MISSING = (
    "the recall example is not importable (examples/recall lives in the repository, not "
    "in the installed package): run `nanoattn bench --only engine` from the repository's "
    "root, or from an editable install (pip install -e .)"
)


@dataclasses.dataclass(frozen=True)
class Shape:
    """A workload (``requests`` of ``seed``, prompt lengths and new tokens drawn from
    the inclusive ranges) and the engine's sizes (``engine.EngineConfig``'s fields), the
    workload served ``rounds`` times after the warm-up. None: the example's own
    (``engine.WORKLOAD``, ``engine.SERVE``)."""

    workload: dict | None = None
    sizes: dict | None = None
    rounds: int = 3


FULL = Shape()
QUICK = Shape(
    workload=dict(seed=0, requests=24, prompt_lengths=(8, 64), new_tokens=(1, 32)),
    sizes=dict(pages=96, page_size=16, max_sequences=16, step_tokens=64),
    rounds=2,
)


def example_root() -> pathlib.Path | None:
    """The directory that holds ``examples/recall`` (the working directory, or the one
    this nanoattn lives in: the repository of an editable install), or None."""
    for root in (pathlib.Path.cwd(), pathlib.Path(__file__).resolve().parents[2]):
        if (root / "examples" / "recall" / "engine.py").is_file():
            return root
    return None


def random_model():
    """The example's task and a randomly initialised model of its configuration, its
    attention on nanoattn's automatic choice as ``serve``'s (in the measuring process:
    the repository root is on the path)."""
    from flax import nnx

    from examples.recall import data, engine
    from examples.recall.model import Decoder, ModelConfig

    task = data.TaskConfig()
    random = Decoder(ModelConfig(vocab=task.vocab), rngs=nnx.Rngs(0))
    return task, engine.with_implementation(random, None)


def _serve(spec: dict):
    """The example's model, requests and server of ``spec`` (in the measuring process)."""
    from examples.recall import engine  # the repository root is on the path

    task, model = random_model()
    load = spec["workload"] or engine.WORKLOAD
    sizes = engine.EngineConfig(**spec["sizes"]) if spec["sizes"] else engine.SERVE
    requests = engine.workload(
        load["seed"],
        task,
        load["requests"],
        tuple(load["prompt_lengths"]),
        tuple(load["new_tokens"]),
    )
    if spec["name"] == "engine":
        server = engine.Engine(model, sizes, max(r.need for r in requests))
        about = {"step_sizes": list(server.sizes), "pool_tokens": sizes.cache_tokens,
                 "max_sequences": sizes.max_sequences}  # fmt: skip
    else:
        server = engine.static_for(model, sizes, requests)
        capacity = engine.static_capacity(requests)
        about = {
            "batch": server.batch,
            "capacity": capacity,
            "cache_tokens": server.batch * capacity,
            "pool_tokens": sizes.cache_tokens,
        }
    return server, requests, about


def measure_here(spec: dict) -> dict:
    """One server of ``spec`` (``name``: "engine" or "static") warmed up, then serving
    the workload ``rounds`` times, in this process: median and min seconds, tokens,
    steps, the backends its attention took, the programs compiled, a digest of the
    tokens, this process's id."""
    server, requests, about = _serve(spec)
    start = time.perf_counter()
    backends = server.warm_up() if spec["name"] == "engine" else server.warm_up(requests)
    warm_s = time.perf_counter() - start
    compiled = server.compiled() if spec["name"] == "engine" else None
    runs = [server.run(requests) for _ in range(spec["rounds"])]
    seconds = sorted(run.seconds for run in runs)
    outputs = json.dumps(sorted(runs[-1].outputs.items())).encode()
    return about | {
        "median_s": seconds[len(seconds) // 2], "min_s": seconds[0], "warm_up_s": warm_s,
        "requests": len(requests), "tokens": runs[-1].tokens, "steps": runs[-1].steps,
        "mixed_steps": runs[-1].mixed_steps, "backends": list(backends),
        "compiled_warm": compiled,
        "compiled_after": server.compiled() if compiled is not None else None,
        "digest": hashlib.sha256(outputs).hexdigest()[:16], "pid": os.getpid(),
    }  # fmt: skip


def servers_alone(module: str, names, shape, report=None) -> dict:
    """The servers ``names`` of ``module`` (its ``measure_here``), each alone in a
    process of its own (``report(i, n, label)`` before each): ``{"shape", "rows",
    "status": "ok"}``, each row with its tokens/s; or a status saying why not."""
    result = {"shape": dataclasses.asdict(shape), "rows": []}
    root = example_root()
    if root is None:
        return result | {"status": f"skipped: {MISSING}"}
    for i, name in enumerate(names):
        if report:
            report(i, len(names), f"{name}, alone")
        spec = {"name": name, **dataclasses.asdict(shape)}
        try:
            row = run_alone(module, spec, what=name, paths=[root])
        except Exception as e:  # reported, not fatal to the rest of the bench
            return result | {"status": f"error: {describe(e)[:200]}"}
        row["tokens_per_s"] = row["tokens"] / row["median_s"]
        result["rows"].append({"name": name} | row)
    return result | {"status": "ok"}


def measure_engine(shape: Shape = FULL, report=None) -> dict:
    """Both servers, each alone in a process of its own (``report(i, n, label)`` before
    each): their rows and the ratio of their tokens/s; or a status saying why not."""
    result = servers_alone("nanoattn.bench._engine", NAMES, shape, report)
    if result["status"] != "ok":
        return result
    engine, static = result["rows"]
    return result | {
        "ratio": engine["tokens_per_s"] / static["tokens_per_s"],
        "same_tokens": engine["digest"] == static["digest"],
    }  # fmt: skip


def engine_targets(result: dict) -> list[dict]:
    """Continuous batching at least :data:`TARGET` x static batching's tokens/s (judged
    at :data:`FULL` only: none at other shapes)."""
    if result["shape"] != dataclasses.asdict(FULL):
        return []
    target = (f"engine: continuous batching >= {TARGET:g}x static batching's tokens/s, same "
              "cache memory (the recall example, a random model, its workload)")  # fmt: skip
    if result["status"] != "ok":
        return [{"target": target, "measured": result["status"], "passed": None}]
    engine, static = result["rows"]
    measured = (
        f"engine {engine['tokens_per_s']:,.0f} tokens/s, static "
        f"{static['tokens_per_s']:,.0f} tokens/s, each alone: {result['ratio']:.2f}x"
    )
    return [{"target": target, "measured": measured, "passed": result["ratio"] >= TARGET}]


def engine_markdown(result: dict | None) -> list[str]:
    """The engine's table: each server's tokens/s, steps and cache, and the ratio."""
    lines, measured = section(result, "Engine: the recall example's continuous batching "
                              "against static batching, same cache memory; a random model, "
                              "each alone")  # fmt: skip
    if not measured:
        return lines
    lines += ["| server | tokens/s | median s (min) | tokens | steps | cache tokens | attention "
              "| compiled |", "|" + " --- |" * 8]  # fmt: skip
    for r in result["rows"]:
        if r["name"] == "engine":
            cache = f"pool {r['pool_tokens']}, {r['max_sequences']} in flight"
            compiled = (
                f"{r['compiled_warm']} (sizes {r['step_sizes']}), {r['compiled_after']} after"
            )
        else:
            cache = f"{r['batch']} rows x {r['capacity']} = {r['cache_tokens']}"
            compiled = ""
        lines.append(
            f"| {r['name']} | {r['tokens_per_s']:,.0f} | {r['median_s']:.3f} ({r['min_s']:.3f}) "
            f"| {r['tokens']} | {r['steps']} | {cache} | {', '.join(r['backends'])} | {compiled} |"
        )
    same = "yes" if result["same_tokens"] else "no (a near-tie of random logits tipped)"
    return [*lines, "", f"continuous / static: {result['ratio']:.2f}x the tokens/s (target >= "
            f"{TARGET:g}x); every request's tokens equal in both: {same}."]  # fmt: skip


if __name__ == "__main__":
    print(json.dumps(measure_here(json.loads(sys.argv[1]))), flush=True)
