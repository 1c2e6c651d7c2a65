"""The benchmark grid: every implementation, length, head shape and pass, in one run."""

import dataclasses
import os
import platform
import sys

import jax
import jax.numpy as jnp

from . import _generation, _native, _targets, _torch, _window
from ._cell import measure_cell
from ._measure import matmul_peak_gflops

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


def run_bench(config: BenchConfig, progress=None) -> dict:
    """Runs the grid, the targets, the generation and the window benchmarks that
    ``config`` asks for, and returns every measurement as plain data.

    ``progress(done, total, label)`` is called before each cell.
    """
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
    targets = _targets.measure_targets(peak, progress) if config.targets else []
    generation = []
    for i, context in enumerate(config.generation):
        if progress:
            progress(i, len(config.generation), f"generation: context {context}")
        generation.append(_generation.measure_generation(context))
    targets += _generation.generation_targets(generation)
    window = None
    if config.window_length:
        if progress:
            progress(0, 1, f"window: fwd+bwd T={config.window_length}")
        window = _window.measure_window(config.window_length)
        targets += _window.window_targets(window)
    native = []
    if config.native_lengths:
        native = _native.measure_native(config.native_lengths, config.shapes, peak, progress)
        targets += _native.native_targets(native)
    return {
        "machine": machine() | {"matmul_peak_gflops": peak},
        "config": dataclasses.asdict(config),
        "cells": cells,
        "targets": targets,
        "generation": generation,
        "window": window,
        "native": native,
    }
