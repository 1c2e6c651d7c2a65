"""Per-device memory and time of nanoattn.parallel.ring_attention on simulated CPU
devices, against the one-device flash kernel: the table of docs/parallel.md.

    python benchmarks/ring_memory.py            # 8 simulated devices

Memory: ``compiled.memory_analysis()`` of the jitted forward+backward (causal,
zigzag, float32, B=1, N=4, K=2, H=64), per device, compiled but not run.
Time: the median of 3 runs of the forward+backward at T=4096 after one warm-up.
On one CPU the simulated devices share the cores, so the time shows the ring's
overhead, not a speed-up.
"""

import os
import platform
import statistics
import sys
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

import nanoattn
from nanoattn.parallel import ring_attention

N, K, H = 4, 2, 64


def grads(attend):
    return jax.jit(jax.grad(lambda q, k, v: jnp.sum(attend(q, k, v) ** 2), argnums=(0, 1, 2)))


def program(P: int | None):
    if P is None:
        return grads(lambda q, k, v: nanoattn.flash_attention(q, k, v, is_causal=True))
    mesh = Mesh(np.array(jax.devices()[:P]), ("sp",))
    return grads(lambda q, k, v: ring_attention(q, k, v, axis_name="sp", mesh=mesh, is_causal=True))


def memory(P, T):
    q = jax.ShapeDtypeStruct((1, T, N, H), jnp.float32)
    k = jax.ShapeDtypeStruct((1, T, K, H), jnp.float32)
    analysis = program(P).lower(q, k, k).compile().memory_analysis()
    return analysis.temp_size_in_bytes, analysis.argument_size_in_bytes


def seconds(P, T):
    keys = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(keys[0], (1, T, N, H))
    k, v = (jax.random.normal(key, (1, T, K, H)) for key in keys[1:])
    fn = program(P)
    jax.block_until_ready(fn(q, k, v))
    runs = []
    for _ in range(3):
        start = time.perf_counter()
        jax.block_until_ready(fn(q, k, v))
        runs.append(time.perf_counter() - start)
    return statistics.median(runs)


def main():
    cpu = platform.processor() or platform.machine()
    try:
        cpu = next(
            line.split(":", 1)[1].strip()
            for line in open("/proc/cpuinfo")
            if line.startswith("model name")
        )
    except (OSError, StopIteration):
        pass
    print(f"{cpu}, {os.cpu_count()} cores, jax {jax.__version__}, {len(jax.devices())} devices")
    T = int(sys.argv[1]) if len(sys.argv) > 1 else 65536
    print(f"\nforward+backward, causal, float32, B=1 T={T} N={N} K={K} H={H}, per device:\n")
    print("| devices | layout | temporaries (MiB) | arguments (MiB) | vs one device |")
    print("| --- | --- | --- | --- | --- |")
    base = None
    for P in (None, 2, 4, 8):
        temp, args = memory(P, T)
        base = base or temp
        label = "1 (flash_attention)" if P is None else str(P)
        layout = "-" if P is None else "zigzag"
        cells = f"{temp / 2**20:.1f} | {args / 2**20:.1f} | {temp / base:.2f}"
        print(f"| {label} | {layout} | {cells} |")
    Tt = 4096
    print(f"\ntime of forward+backward at T={Tt} (median of 3):\n")
    print("| devices | seconds |")
    print("| --- | --- |")
    for P in (None, 2, 4, 8):
        print(f"| {'1 (flash_attention)' if P is None else P} | {seconds(P, Tt):.3f} |")


if __name__ == "__main__":
    main()
