"""Serving on a mesh (docs/parallel.md, "Serving on a mesh"): one decoding step of a
batch through ``nanoattn.paged_attention`` on one device against
``nanoattn.parallel.sharded_paged_attention`` on a mesh of host devices, by heads (4
devices) and by two data-parallel groups times heads (2 x 4).

On a CPU the devices are simulated (``--xla_force_host_platform_device_count=8``) and
share the machine's cores, so the times are informational only: what they show is
that the sharded step runs and what it costs in dispatch, not a speed-up. The part
runs in a process of its own (its ``XLA_FLAGS`` must be set before jax starts), the
three calls timed in turn there, and checks that the sharded outputs equal one
device's. Nothing is judged.
"""

import dataclasses
import json
import sys

import numpy as np

from ._alone import run_alone

DEVICES = 8


@dataclasses.dataclass(frozen=True)
class ShardedShape:
    """``B`` sequences (an even number: two groups) of ``lengths`` keys, one decode
    token each."""

    B: int
    lengths: tuple[int, int]
    N: int = 32
    K: int = 8
    H: int = 128
    page_size: int = 16
    rounds: int = 5


FULL = ShardedShape(B=16, lengths=(512, 8192))
QUICK = ShardedShape(B=4, lengths=(16, 64), N=8, K=4, H=32, rounds=2)


def _group(shape: ShardedShape, seed: int):
    """One group's call: B / 2 sequences, one decode token each, pages shuffled."""
    s, rng = shape, np.random.default_rng(seed)
    B = s.B // 2
    lengths = np.linspace(*s.lengths, B).round().astype(np.int32)
    held = -(-lengths // s.page_size)
    P, M = int(held.sum()), int(held.max())
    order = rng.permutation(P).astype(np.int32)
    table = np.full((B, M), -1, np.int32)
    for b, first in enumerate(np.concatenate([[0], np.cumsum(held)[:-1]])):
        table[b, : held[b]] = order[first : first + held[b]]
    q = rng.standard_normal((B, s.N, s.H), dtype=np.float32)
    k, v = (rng.standard_normal((P, s.page_size, s.K, s.H), dtype=np.float32) for _ in "kv")
    return q, k, v, table, lengths, np.arange(B + 1, dtype=np.int32)


def _pad_pools(groups):
    """The groups' pools to one size (pages never read), their tables unchanged."""
    P = max(g[1].shape[0] for g in groups)
    pad = lambda x: np.concatenate([x, np.zeros((P - len(x), *x.shape[1:]), x.dtype)])  # noqa: E731
    return [(q, pad(k), pad(v), *rest) for q, k, v, *rest in groups]


def measure_here(spec: dict) -> dict:
    """In a process with 8 host devices: median and min ms of the step on one device
    (both groups' sequences in one call), by heads and by groups x heads, and the
    largest difference of the sharded outputs from one device's."""
    import jax

    import nanoattn
    from nanoattn.parallel import sharded_paged_attention

    from ._measure import time_calls

    shape = ShardedShape(**{**spec, "lengths": tuple(spec["lengths"])})
    groups = _pad_pools([_group(shape, seed) for seed in (0, 1)])
    joined = [np.concatenate(parts) for parts in zip(*groups, strict=True)]  # G = 2 end to end
    P = groups[0][1].shape[0]
    one = [np.concatenate([g[0] for g in groups]), joined[1], joined[2],
           np.concatenate([groups[0][3], np.where(groups[1][3] >= 0, groups[1][3] + P, -1)]),
           joined[4], np.arange(shape.B + 1, dtype=np.int32)]  # fmt: skip
    heads = jax.make_mesh((4,), ("model",), axis_types=(jax.sharding.AxisType.Auto,))
    both = jax.make_mesh((2, 4), ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    by_heads = jax.jit(lambda *a: sharded_paged_attention(*a, head_axis="model", mesh=heads))
    by_both = jax.jit(lambda *a: sharded_paged_attention(*a, data_axis="data",
                                                         head_axis="model", mesh=both))  # fmt: skip
    calls = {"one": (jax.jit(nanoattn.paged_attention), one), "heads": (by_heads, one),
             "groups_heads": (by_both, joined)}  # fmt: skip
    want = np.asarray(calls["one"][0](*one))
    error = max(float(np.abs(np.asarray(fn(*args)) - want).max()) for fn, args in
                list(calls.values())[1:])  # fmt: skip
    return time_calls(calls, shape.rounds) | {"max_difference": error}


def measure_sharded(shape: ShardedShape, progress=None) -> dict:
    """The step on one device and sharded, in a process of 8 host devices."""
    if progress:
        progress(0, 1, f"sharded decode: {shape.B} sequences on 1, 4 and 2 x 4 devices")
    spec = dataclasses.asdict(shape)
    env = {"XLA_FLAGS": f"--xla_force_host_platform_device_count={DEVICES}"}
    row = run_alone("nanoattn.bench._sharded", spec, what="sharded decode", env=env)
    return spec | row | {"status": "ok", "devices": DEVICES}


def sharded_targets(row: dict | None, judged: bool) -> list[dict]:
    """None: on simulated devices the part is informational."""
    return []


def sharded_markdown(row: dict | None) -> list[str]:
    """The part's table: each step's median (min) ms."""
    if row is None:
        return []
    shape = (f"B={row['B']} of {row['lengths'][0]}-{row['lengths'][1]} keys, N={row['N']} "
             f"on K={row['K']}, H={row['H']}, float32")  # fmt: skip
    lines = ["", f"### Sharded decode on {row['devices']} host devices ({shape}; "
             "informational: simulated devices share the cores)", "",
             "| step | median ms (min) |", "| --- | --- |"]  # fmt: skip
    for name, label in (("one", "one device"), ("heads", "heads over 4 devices"),
                        ("groups_heads", "2 groups x heads over 4 (8 devices)")):  # fmt: skip
        lines.append(f"| {label} | {row[f'{name}_median_ms']:.2f} ({row[f'{name}_min_ms']:.2f}) |")
    lines += ["", f"largest difference from one device: {row['max_difference']:.2e}"]
    return lines


if __name__ == "__main__":
    print(json.dumps(measure_here(json.loads(sys.argv[1]))))
