"""Block skipping on nanoattn.parallel.ring_attention with ``mask_fn``, on simulated CPU
devices: the time of a document mask and a block-sparse mask against causal, in one
run (the table of docs/parallel.md).

    python benchmarks/ring_masks.py            # 4 simulated devices, T = 8192

Every call is causal, zigzag, float32, B=1, N=4, K=2, H=64; the forward+backward is
timed: the median of 3 to 7 runs after one warm-up (``nanoattn.bench``'s ``time_runs``). The calls:

* ``causal``: the plain causal ring (whole shards);
* ``documents (segment ids)``: 8 documents through ``q_segment_ids``/``kv_segment_ids``
  (whole shards: segment ids are data, no pair can be skipped);
* ``documents (mask_fn)``: the same 8 documents through ``mask_fn`` closing over the
  ids (classified at trace time, per chunk pair);
* ``sparse 25% (mask_fn)``: a block-sparse mask keeping the diagonal chunk pairs
  and the last chunk against the first: 9 of the 36 causal chunk pairs at P = 4.

On one CPU the simulated devices share the cores, so the times compare the work the
ring does, not a multi-device speed-up.
"""

import os
import platform
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from nanoattn.bench._measure import time_runs
from nanoattn.parallel import ring_attention, to_zigzag

N, K, H = 4, 2, 64


def main(T: int = 8192) -> None:
    P = jax.device_count()
    mesh = Mesh(np.array(jax.devices()), ("sp",))
    rng = np.random.default_rng(0)
    q, k, v = (
        to_zigzag(jnp.asarray(rng.standard_normal((1, T, h, H)), jnp.float32), P) for h in (N, K, K)
    )
    ids = np.arange(T) // (T // 8)  # 8 documents, natural order
    ids_zigzag = to_zigzag(jnp.asarray(ids)[None], P)
    C = T // (2 * P)  # the ring's chunk
    chunk_of = np.arange(T) // C

    def documents(b, n, q, k):
        return jnp.asarray(ids)[q] == jnp.asarray(ids)[k]

    def sparse(b, n, q, k):  # the diagonal chunk pairs and the last chunk against the first
        qc, kc = jnp.asarray(chunk_of)[q], jnp.asarray(chunk_of)[k]
        return (qc == kc) | ((qc == 2 * P - 1) & (kc == 0))

    calls = {
        "causal": {},
        "documents (segment ids)": dict(q_segment_ids=ids_zigzag, kv_segment_ids=ids_zigzag),
        "documents (mask_fn)": dict(mask_fn=documents),
        "sparse 25% (mask_fn)": dict(mask_fn=sparse),
    }
    pairs = chunk_of[:, None] >= chunk_of[None, :]
    kept = (sparse(0, 0, np.arange(T)[:, None], np.arange(T)[None, :]) & pairs)[::C, ::C]
    print(f"sparse mask keeps {kept.sum()} of {pairs[::C, ::C].sum()} causal chunk pairs")
    print(f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores; P={P}, T={T}")
    base = None
    for name, options in calls.items():

        def loss(q, k, v, options=options):
            out = ring_attention(q, k, v, axis_name="sp", mesh=mesh, is_causal=True, **options)
            return jnp.sum(out * out)

        step = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
        seconds, _ = time_runs(lambda step=step: jax.block_until_ready(step(q, k, v)))
        base = base or seconds
        print(f"{name:28s} {seconds:7.3f} s   {seconds / base:5.2f}x causal")


if __name__ == "__main__":
    main(*(int(a) for a in sys.argv[1:]))
