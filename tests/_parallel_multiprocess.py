"""One process of the two-process ring test (tests/parallel/test_parallel.py starts both).

    python tests/_parallel_multiprocess.py PORT PROCESS_ID OUT.npy

Each process has 4 CPU devices; ``jax.distributed.initialize`` on 127.0.0.1
joins them into one job of 8 devices with gloo CPU collectives, and the ring
runs over all 8 (P = 8, zigzag, causal). Process 0 writes the gathered
output to OUT.npy; the test compares it with the one-device reference.
"""

import os
import sys

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
).strip()

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from nanoattn.parallel import ring_attention

B, T, N, K, H = 2, 32, 6, 3, 8


def inputs():
    """The same inputs in every process (and in the test): numpy, from a seed."""
    rng = np.random.default_rng(0)
    q = rng.standard_normal((B, T, N, H), np.float32)
    k = rng.standard_normal((B, T, K, H), np.float32)
    v = rng.standard_normal((B, T, K, H), np.float32)
    return q, k, v


def main(port: str, process_id: str, out_path: str):
    from _two_processes import join

    join(port, process_id)
    mesh = Mesh(np.array(jax.devices()), ("sp",))
    seq = NamedSharding(mesh, PartitionSpec(None, "sp"))
    # inputs already in zigzag order: each process builds its devices' shards
    from nanoattn.parallel import to_zigzag

    arrays = [
        jax.make_array_from_callback(x.shape, seq, lambda index, x=x: x[index])
        for x in (np.asarray(to_zigzag(x, 8)) for x in inputs())
    ]

    @jax.jit
    def ring(q, k, v):
        return ring_attention(q, k, v, axis_name="sp", is_causal=True, mesh=mesh)

    out = multihost_utils.process_allgather(ring(*arrays), tiled=True)
    if int(process_id) == 0:
        np.save(out_path, np.asarray(out))
    jnp.zeros(()).block_until_ready()
    jax.distributed.shutdown()


if __name__ == "__main__":
    main(*sys.argv[1:])
