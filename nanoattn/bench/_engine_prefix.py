"""The recall example's engine with its prefix cache against the same engine without it
(issue #48): requests in groups that share their prompts, prompt tokens computed and
tokens/s.

``examples/recall/engine.py``'s :class:`Engine` with ``EngineConfig(prefix_cache=True)``
(a request shares the pages of its prompt's longest cached prefix and computes only
the rest; one whose first page is a prompt still being prefilled waits for it) and with
``prefix_cache=False``, on the shared-prompt workload (``engine.shared_workload`` of
``engine.SHARED``: 64 requests in 8 groups whose prompts share their first 512 tokens,
each with 1-32 tokens of its own after them and 1-64 new tokens, the groups arriving
interleaved) in the example's pool (``engine.SERVE``) at :data:`FULL`; ``--quick``
serves a smaller one (:data:`QUICK`). A randomly initialised model of the example's
configuration, attention on nanoattn's automatic choice, as the engine part's
(:mod:`._engine`).

Each of the two runs alone, in a fresh process of its own, as the engine part's:
a warm-up, then ``rounds`` runs of the whole workload (each with an empty cache: a new
allocator), tokens/s from the median run. Each reports the prompt tokens its steps
computed, those its prefix cache found (and the pages they shared), the cached pages
evicted, the pool's pages held at most, its steps and a digest of every request's
tokens. Targets (judged at :data:`FULL` only): the prefix cache's engine computes at
most :data:`PREFILL_TARGET` x the prompt tokens and makes at least :data:`TARGET` x
the tokens/s of the engine without it.
"""

import dataclasses
import hashlib
import json
import os
import sys
import time

from . import _engine
from ._markdown import section

PREFILL_TARGET = 0.2  # prompt tokens computed with the prefix cache / without, at most
TARGET = 2.0  # tokens/s with the prefix cache / without, at least
NAMES = ("prefix", "plain")


@dataclasses.dataclass(frozen=True)
class Shape:
    """A shared-prompt workload (``engine.shared_workload``'s arguments: ``requests``
    of ``seed`` in ``groups``, ``shared_length``, the inclusive ranges
    ``suffix_lengths`` and ``new_tokens``) and the engine's sizes (``EngineConfig``'s
    fields but ``prefix_cache``), served ``rounds`` times after the warm-up. None: the
    example's own (``engine.SHARED``, ``engine.SERVE``)."""

    workload: dict | None = None
    sizes: dict | None = None
    rounds: int = 3


FULL = Shape()
QUICK = Shape(
    workload=dict(seed=0, requests=16, groups=4, shared_length=64, suffix_lengths=(1, 8),
                  new_tokens=(1, 16)),
    sizes=dict(pages=96, page_size=16, max_sequences=16, step_tokens=64),
    rounds=2,
)  # fmt: skip


def _serve(spec: dict):
    """The engine of ``spec`` (``name`` "prefix": with the prefix cache) and its
    requests, in the measuring process."""
    from examples.recall import engine  # the repository root is on the path

    task, model = _engine.random_model()
    load = spec["workload"] or engine.SHARED
    sizes = engine.EngineConfig(**spec["sizes"]) if spec["sizes"] else engine.SERVE
    config = dataclasses.replace(sizes, prefix_cache=spec["name"] == "prefix")
    requests = engine.shared_workload(
        load["seed"], task, load["requests"], load["groups"], load["shared_length"],
        tuple(load["suffix_lengths"]), tuple(load["new_tokens"]),
    )  # fmt: skip
    return engine.Engine(model, config, max(r.need for r in requests)), requests


def measure_here(spec: dict) -> dict:
    """The engine of ``spec`` warmed up, then serving the workload ``rounds`` times, in
    this process: median and min seconds, tokens, steps, prompt tokens computed and
    found cached, pages shared, evictions, pages held at most, the backends its
    attention took, the programs compiled, a digest of the tokens, this process's id."""
    server, requests = _serve(spec)
    start = time.perf_counter()
    backends = server.warm_up()
    warm_s, compiled = time.perf_counter() - start, server.compiled()
    runs = [server.run(requests) for _ in range(spec["rounds"])]
    seconds, last = sorted(run.seconds for run in runs), runs[-1]
    outputs = json.dumps(sorted(last.outputs.items())).encode()
    return {
        "median_s": seconds[len(seconds) // 2], "min_s": seconds[0], "warm_up_s": warm_s,
        "requests": len(requests), "prompt_tokens": sum(len(r.prompt) for r in requests),
        "tokens": last.tokens, "steps": last.steps, "prefill_tokens": last.prefill_tokens,
        "cached_tokens": last.cached_tokens, "cached_pages": last.cached_pages,
        "evictions": last.evictions, "peak_pages": last.peak_pages,
        "pool_pages": server.config.pages, "backends": list(backends),
        "compiled_warm": compiled, "compiled_after": server.compiled(),
        "digest": hashlib.sha256(outputs).hexdigest()[:16], "pid": os.getpid(),
    }  # fmt: skip


def measure_prefix(shape: Shape = FULL, report=None) -> dict:
    """Both engines, each alone in a process of its own (``report(i, n, label)`` before
    each): their rows and the ratios of their prompt tokens computed and tokens/s; or a
    status saying why not."""
    result = _engine.servers_alone("nanoattn.bench._engine_prefix", NAMES, shape, report)
    if result["status"] != "ok":
        return result
    prefix, plain = result["rows"]
    return result | {
        "ratio": prefix["tokens_per_s"] / plain["tokens_per_s"],
        "prefill_ratio": prefix["prefill_tokens"] / plain["prefill_tokens"],
        "same_tokens": prefix["digest"] == plain["digest"],
    }  # fmt: skip


def measure_engine_part(engine_shape: _engine.Shape, shape: Shape, report=None) -> dict:
    """The ``engine`` part: continuous against static batching (``_engine.measure_engine``),
    then the prefix cache (:func:`measure_prefix`, its result under ``"prefix"``),
    reported as one part of four items."""

    def items(first: int):
        return lambda i, n, label: report(first + i, 2 * n, label) if report else None

    result = _engine.measure_engine(engine_shape, items(0))
    return result | {"prefix": measure_prefix(shape, items(len(NAMES)))}


def prefix_targets(result: dict | None) -> list[dict]:
    """The prefix cache's engine: prompt tokens computed at most :data:`PREFILL_TARGET`
    x, tokens/s at least :data:`TARGET` x the engine's without it (judged at
    :data:`FULL` only: none at other shapes)."""
    if not result or result["shape"] != dataclasses.asdict(FULL):
        return []
    about = "the recall example's engine, 64 requests in 8 groups sharing 512-token prompts"
    targets = [
        f"engine, prefix cache: prompt tokens computed <= {PREFILL_TARGET:g}x without it ({about})",
        f"engine, prefix cache: >= {TARGET:g}x the tokens/s without it ({about}, each alone)",
    ]
    if result["status"] != "ok":
        return [{"target": t, "measured": result["status"], "passed": None} for t in targets]
    prefix, plain = result["rows"]
    computed = (f"{prefix['prefill_tokens']} of {plain['prefill_tokens']} prompt tokens: "
                f"{result['prefill_ratio']:.3f}x")  # fmt: skip
    speed = (f"with {prefix['tokens_per_s']:,.0f} tokens/s, without "
             f"{plain['tokens_per_s']:,.0f} tokens/s: {result['ratio']:.2f}x")  # fmt: skip
    return [
        {"target": targets[0], "measured": computed,
         "passed": result["prefill_ratio"] <= PREFILL_TARGET},
        {"target": targets[1], "measured": speed, "passed": result["ratio"] >= TARGET},
    ]  # fmt: skip


def prefix_markdown(result: dict | None) -> list[str]:
    """The prefix cache's table: each engine's tokens/s, prompt tokens and pages, and
    the ratios."""
    lines, measured = section(result, "Engine: prefix caching, requests in groups sharing "
                              "their prompts; a random model, each alone")  # fmt: skip
    if not measured:
        return lines
    lines += ["| engine | tokens/s | median s (min) | tokens | steps | prompt tokens computed "
              "| found cached (pages) | evictions | pages held at most |",
              "|" + " --- |" * 9]  # fmt: skip
    for r in result["rows"]:
        lines.append(
            f"| {r['name']} | {r['tokens_per_s']:,.0f} | {r['median_s']:.3f} ({r['min_s']:.3f}) "
            f"| {r['tokens']} | {r['steps']} | {r['prefill_tokens']} of {r['prompt_tokens']} "
            f"| {r['cached_tokens']} ({r['cached_pages']}) | {r['evictions']} "
            f"| {r['peak_pages']} of {r['pool_pages']} |"
        )
    same = "yes" if result["same_tokens"] else "no (a near-tie of random logits tipped)"
    return [*lines, "", f"with / without the prefix cache: {result['prefill_ratio']:.3f}x the "
            f"prompt tokens computed (target <= {PREFILL_TARGET:g}x), {result['ratio']:.2f}x "
            f"the tokens/s (target >= {TARGET:g}x); every request's tokens equal in both: "
            f"{same}."]  # fmt: skip


if __name__ == "__main__":
    print(json.dumps(measure_here(json.loads(sys.argv[1]))), flush=True)
