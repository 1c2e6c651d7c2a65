"""The benchmark grid: every implementation, length, head shape and pass, in one run."""

import dataclasses
import os
import platform
import sys

import jax
import jax.numpy as jnp

from .._validate import describe
from . import _torch
from ._measure import causal_flops, jax_pass, matmul_peak_gflops, temp_bytes, time_runs
from ._peers import PEERS

FULL_LENGTHS = (128, 512, 1024, 2048, 4096, 8192)
QUICK_LENGTHS = (256, 1024, 4096)
SHAPES = ((4, 32), (12, 64))  # (heads, head width): the seed's, and GPT-2 small's


@dataclasses.dataclass(frozen=True)
class BenchConfig:
    """What to measure.

    Attributes:
      lengths: sequence lengths T.
      shapes: (N, H) head shapes.
      tokens: B * T, kept constant: B = max(1, tokens // T).
      dtype: "float32" or "bfloat16".
      implementations: names from :data:`nanoattn.bench._peers.PEERS`.
      max_score_gib: skip an implementation that materialises the scores when
        one (B, N, T, T) float32 score tensor would exceed this.
      grid: measure the grid of implementations x lengths x shapes x passes.
      targets: also measure the flash kernel's performance targets of
        docs/performance.md.
      generation: context lengths of the generation benchmark (time per
        token with the KV cache, by recomputing, and flax's cached step;
        :mod:`nanoattn.bench._generation`); empty to skip it.
      native_lengths: T of the native kernel's targets against torch
        (:mod:`nanoattn.bench._native`); empty to skip them.
      window_length: T of the sliding-window benchmark (causal
        ``window=(512, 0)`` against full causal, :mod:`nanoattn.bench._window`);
        0 to skip it.
    """

    lengths: tuple[int, ...] = FULL_LENGTHS
    shapes: tuple[tuple[int, int], ...] = SHAPES
    tokens: int = 8192
    dtype: str = "float32"
    implementations: tuple[str, ...] = ("flash", "xla", "seed", "flax", "jax.nn", "torch")
    max_score_gib: float = 2.0
    targets: bool = True
    grid: bool = True
    generation: tuple[int, ...] = (1024, 4096)
    window_length: int = 16384
    native_lengths: tuple[int, ...] = ()


def default_implementations() -> tuple[str, ...]:
    names = ("flash", "xla", "seed", "flax", "jax.nn", "torch")
    if jax.default_backend() == "gpu":
        return (*names, "cudnn")
    return ("native", *names) if jax.default_backend() == "cpu" else names


def machine() -> dict:
    devices = jax.devices()
    return {
        "platform": jax.default_backend(),
        "device": devices[0].device_kind,
        "cpu_count": os.cpu_count(),
        "processor": platform.processor() or platform.machine(),
        "python": sys.version.split()[0],
        "jax": jax.__version__,
        "torch": _torch.version(),
    }


def inputs(B: int, T: int, N: int, H: int, dtype: str):
    keys = jax.random.split(jax.random.key(0), 3)
    return [jax.random.normal(key, (B, T, N, H), jnp.dtype(dtype)) for key in keys]


def measure_cell(
    name: str,
    B: int,
    T: int,
    N: int,
    H: int,
    backward: bool,
    dtype: str,
    peak: float,
    max_score_gib: float = float("inf"),
) -> dict:
    """One implementation at one size and pass: times, throughput and memory."""
    cell = {
        "impl": name,
        "shape": f"{N}x{H}",
        "B": B,
        "T": T,
        "N": N,
        "H": H,
        "pass": "fwd+bwd" if backward else "fwd",
        "dtype": dtype,
    }
    peer = PEERS[name]
    score_gib = B * N * T * T * 4 / 2**30
    if peer.materializes and score_gib > max_score_gib:
        return cell | {"status": f"skipped: its scores need {score_gib:.1f} GiB"}
    try:
        q, k, v = inputs(B, T, N, H, dtype)
        if peer.fn is None:
            reason = _torch.available()
            if reason:
                return cell | {"status": f"skipped: {reason}"}
            run = _torch.make_run(q, k, v, backward, dtype)
            memory = None
        else:
            fn = jax_pass(peer.fn, backward)
            memory = temp_bytes(fn, q, k, v)

            def run():
                jax.block_until_ready(fn(q, k, v))

        median, best = time_runs(run)
    except Exception as e:  # an implementation that cannot run a size is reported, not fatal
        return cell | {"status": f"error: {describe(e)[:200]}"}
    gflops = causal_flops(B, T, N, H, backward) / median / 1e9
    return cell | {
        "status": "ok",
        "median_ms": median * 1e3,
        "min_ms": best * 1e3,
        "gflops": gflops,
        "pct_peak": 100 * gflops / peak,
        "temp_bytes": memory,
    }


def run_bench(config: BenchConfig, progress=None) -> dict:
    """Runs the grid, the targets, the generation and the window benchmarks that
    ``config`` asks for, and returns every measurement as plain data.

    ``progress(done, total, label)`` is called before each cell.
    """
    from ._generation import generation_targets, measure_generation
    from ._native import measure_native, native_targets
    from ._targets import measure_targets
    from ._window import measure_window, window_targets

    peak = matmul_peak_gflops(dtype=jnp.dtype(config.dtype))
    jobs = [
        (name, N, H, T, backward)
        for N, H in config.shapes
        for T in config.lengths
        for backward in (False, True)
        for name in config.implementations
        if config.grid
    ]
    cells = []
    for done, (name, N, H, T, backward) in enumerate(jobs):
        B = max(1, config.tokens // T)
        if progress:
            progress(done, len(jobs), f"{name} {'fwd+bwd' if backward else 'fwd'} {N}x{H} T={T}")
        cells.append(
            measure_cell(name, B, T, N, H, backward, config.dtype, peak, config.max_score_gib)
        )
    if progress and jobs:
        progress(len(jobs), len(jobs), "grid done")
    targets = measure_targets(peak, progress) if config.targets else []
    generation = []
    for i, context in enumerate(config.generation):
        if progress:
            progress(i, len(config.generation), f"generation: context {context}")
        generation.append(measure_generation(context))
    targets += generation_targets(generation)
    window = None
    if config.window_length:
        if progress:
            progress(0, 1, f"window: fwd+bwd T={config.window_length}")
        window = measure_window(config.window_length)
        targets += window_targets(window)
    native = []
    if config.native_lengths:
        native = measure_native(config.native_lengths, config.shapes, peak, progress)
        targets += native_targets(native)
    return {
        "machine": machine() | {"matmul_peak_gflops": peak},
        "config": dataclasses.asdict(config),
        "cells": cells,
        "targets": targets,
        "generation": generation,
        "window": window,
        "native": native,
    }
