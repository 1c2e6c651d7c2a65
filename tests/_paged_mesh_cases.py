"""Paged attention with the heads split over a mesh axis, on 8 simulated CPU devices
(run by tests/parallel/test_paged_mesh.py in a subprocess with
``XLA_FLAGS=--xla_force_host_platform_device_count=8``): each case prints one JSON line.

The query's heads and the pool's key/value heads are split over the 4-way axis of a
2 x 4 mesh, the page table, lengths and starts replicated: every backend that serves
the call gives the one-device result, and the native kernel's compiled program moves
no key or value between devices (no collective in it)."""

import json
import sys

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import nanoattn

COLLECTIVES = ("all-gather", "all-to-all", "collective-permute", "all-reduce", "reduce-scatter")


def inputs(K: int, N: int, H: int = 8, pages: int = 40, page_size: int = 4, seed: int = 0):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((7, N, H)).astype(np.float32)
    kp = rng.standard_normal((pages, page_size, K, H)).astype(np.float32)
    vp = rng.standard_normal((pages, page_size, K, H)).astype(np.float32)
    table = np.array([[3, 1, 4, 0, 9], [5, 2, 6, 7, 8], [11, 12, 13, 14, 15]], np.int32)
    lengths = np.array([13, 9, 20], np.int32)
    starts = np.array([0, 4, 5, 7], np.int32)
    return q, kp, vp, table, lengths, starts


def heads_split(implementation: str, K: int = 8, N: int = 16) -> dict:
    mesh = jax.make_mesh((2, 4), ("data", "model"))
    q, kp, vp, table, lengths, starts = inputs(K, N)

    def call(q, kp, vp):
        return nanoattn.paged_attention(q, kp, vp, table, lengths, starts,
                                        implementation=implementation)  # fmt: skip

    one = np.asarray(jax.jit(call)(q, kp, vp))
    heads = NamedSharding(mesh, P(None, "model", None))
    pool = NamedSharding(mesh, P(None, None, "model", None))
    args = (jax.device_put(q, heads), jax.device_put(kp, pool), jax.device_put(vp, pool))
    out = jax.jit(call)(*args)
    text = jax.jit(call).lower(*args).compile().as_text()
    return {
        "case": f"heads-{implementation}",
        "error": float(np.abs(np.asarray(out) - one).max()),
        "spec": str(out.sharding.spec),
        "collectives": [c for c in COLLECTIVES if c in text],
    }


if __name__ == "__main__":
    for name in sys.argv[1:] or ["native", "xla"]:
        try:
            print(json.dumps(heads_split(name)), flush=True)
        except Exception as e:
            print(json.dumps({"case": f"heads-{name}", "raised": f"{type(e).__name__}: {e}"}))
