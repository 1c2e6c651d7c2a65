"""Measures the flash kernel's tile choices on this machine.

    .venv/bin/python benchmarks/tune_tiles.py

For each candidate (block_q, block_k, lanes), used for both passes, it prints
the forward time, the backward time (forward+backward minus forward) and the
compiled temporary memory of forward+backward at T=16384, for causal f32
attention with batch 1 and two head shapes. Times are the minimum of five
runs after a warm-up. docs/performance.md records a run and the choice.
"""

import functools
import itertools
import time

import jax
import jax.numpy as jnp

from nanoattn._backends.flash.kernel import flash_attention
from nanoattn._base.rules import Rules

CANDIDATES = [
    (128, 128, 8),
    (128, 128, 16),
    (128, 256, 8),
    (256, 128, 8),
    (256, 256, 4),
    (256, 256, 8),
    (256, 512, 4),
    (512, 256, 4),
    (512, 512, 2),
    (64, 128, 16),
]
SHAPES = [(4, 32), (12, 64)]


def best_time(fn, *args, runs=5):
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return min(times)


def attend(q, k, v, spec, tiles):
    return flash_attention(q, k, v, spec, forward_tiles=tiles, backward_tiles=tiles)


def compiled(T, N, H, tiles):
    """Jitted forward and forward+backward for one size and tiling."""
    zeros = jnp.zeros((1, T, N, H))
    spec = Rules.make(zeros, zeros, zeros, is_causal=True)
    forward = functools.partial(attend, spec=spec, tiles=tiles)
    loss = lambda q, k, v: forward(q, k, v).sum()  # noqa: E731
    return jax.jit(forward), jax.jit(jax.grad(loss, argnums=(0, 1, 2)))


def main():
    print("shape  T  block_q block_k lanes  forward_ms  backward_ms  fwd+bwd_temp_MiB@16384")
    for (N, H), T, tiles in itertools.product(SHAPES, (2048, 4096), CANDIDATES):
        q, k, v = (jax.random.normal(jax.random.key(i), (1, T, N, H)) for i in range(3))
        forward, grad = compiled(T, N, H, tiles)
        t_fwd = best_time(forward, q, k, v)
        t_bwd = best_time(grad, q, k, v) - t_fwd
        memory = ""
        if T == 4096:
            big = jax.ShapeDtypeStruct((1, 16384, N, H), jnp.float32)
            analysis = compiled(16384, N, H, tiles)[1].lower(big, big, big).compile()
            memory = f"{analysis.memory_analysis().temp_size_in_bytes / 2**20:.1f}"
        print(
            f"{N}x{H}  {T}  {tiles[0]} {tiles[1]} {tiles[2]}  {t_fwd * 1e3:.1f}  "
            f"{t_bwd * 1e3:.1f}  {memory}",
            flush=True,
        )


if __name__ == "__main__":
    main()
