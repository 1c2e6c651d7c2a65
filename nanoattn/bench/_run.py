"""The benchmark grid: every implementation, length, head shape and pass, in one run."""

import dataclasses
import os
import platform
import sys

import jax
import jax.numpy as jnp

from . import (
    _cascade,
    _decode,
    _decode_cases,
    _decode_report,
    _engine,
    _engine_prefix,
    _generation,
    _latent,
    _masks,
    _native,
    _selection,
    _serving,
    _sharded,
    _targets,
    _torch,
    _tree,
    _window,
)
from ._cell import measure_cell
from ._measure import matmul_peak_gflops
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
      masks_length: T of the masks-as-functions benchmark (``mask_fn`` against
        segment ids and full causal, sinks and ``return_residual`` against the call
        without them, :mod:`nanoattn.bench._masks`); 0 to skip it.
      latent_context: the context of multi-head latent attention's decoding step
        (absorbed against rebuilding keys and values; with the latent cache's bytes,
        :mod:`nanoattn.bench._latent`); 0 to skip the part.
      serving: the serving part (decode over a paged KV cache against the read
        bandwidth and a full cache, over int8 pages against bfloat16 ones, the cache's
        bytes per token per dtype, a mixed prefill-and-decode call,
        :mod:`nanoattn.bench._serving`): "full" at the issue's sizes (judged),
        "quick" at small ones (reported, not judged), "" to skip it.
      engine: the recall example's engine against static batching (tokens/s,
        :mod:`nanoattn.bench._engine`), and with its prefix cache against without
        (:mod:`nanoattn.bench._engine_prefix`): "full", "quick" or "", as ``serving``.
      decode: the decode sweep (every paged implementation and the peers, each alone,
        against the read bandwidth; split-key decode against the unsplit kernel,
        :mod:`nanoattn.bench._decode`): "full", "quick" or "", as ``serving``.
      selection: one decode token over selected keys against a decode over only as
        many keys and the dense decode over all (:mod:`nanoattn.bench._selection`):
        "full", "quick" or "", as ``serving``.
      cascade: one decode token for each of B sequences sharing a prefix, with
        ``shared_prefixes`` against without (:mod:`nanoattn.bench._cascade`): "full",
        "quick" or "".
      sharded: one decoding step on one device against sharded by heads and by groups x
        heads on 8 host devices, in a process of its own, informational
        (:mod:`nanoattn.bench._sharded`): "full", "quick" or "".
      tree: a token tree's verify call against a causal chunk of as many tokens over
        the same paged keys (:mod:`nanoattn.bench._tree`): "full", "quick" or "".
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
    masks_length: int = 0
    latent_context: int = 0
    serving: str = ""
    engine: str = ""
    decode: str = ""
    selection: str = ""
    tree: str = ""
    cascade: str = ""
    sharded: str = ""


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
        "native_isa": _native_isa(),
    }


def _native_isa() -> str | None:
    """What the native kernel was built for, on the CPU (None elsewhere or unbuilt)."""
    if jax.default_backend() != "cpu":
        return None
    from .._backends import native as kernel

    return kernel.isa()


def will_skip(name: str, B: int, T: int, N: int, max_score_gib: float, torch_missing: bool) -> bool:
    """Whether :func:`measure_cell` returns this cell as skipped without measuring it:
    a materialising peer whose (B, N, T, T) float32 scores exceed ``max_score_gib``,
    or torch when it is missing."""
    peer = PEERS[name]
    if peer.materializes and B * N * T * T * 4 / 2**30 > max_score_gib:
        return True
    return peer.fn is None and torch_missing


TARGET_TORCH_ITEMS = 1  # measure_targets times torch once (fwd, T=4096): skipped without it


class _Relay:
    """A part's own ``progress(i, n, label)`` calls (the targets', the native pairs')
    passed on as ``progress(part, done, total, label)``, leaving out the ``skips``
    items whose label (less ``prefix``) ``skipped`` picks."""

    def __init__(self, progress, part: str, prefix: str, skipped=None, skips: int = 0):
        self.progress, self.part, self.prefix = progress, part, prefix
        self.skipped, self.skips = skipped or (lambda what: False), skips
        self.done = self.total = 0

    def __call__(self, i: int, n: int, label: str) -> None:
        what = label.removeprefix(self.prefix)
        if self.skipped(what):
            return
        self.total = n - self.skips
        self.progress(self.part, self.done, self.total, what)
        self.done += 1

    def end(self) -> None:
        if self.done:
            self.progress(self.part, self.total, self.total, "")


def _part(report, part: str, items: list, measure) -> list:
    """``measure(*args)`` for each ``(label, args)`` of ``items`` (None: skipped, not
    reported), in order; reported as one part."""
    total = sum(label is not None for label, _ in items)
    if items and not total:
        report(part, 0, 0, "nothing to measure: every item is skipped")
    done, results = 0, []
    for label, args in items:
        if label is not None:
            report(part, done, total, label)
            done += 1
        results.append(measure(*args))
    if total:
        report(part, total, total, "")
    return results


def run_bench(config: BenchConfig, progress=None) -> dict:
    """Runs the grid, the targets and the generation, window, native, masks and serving
    benchmarks that ``config`` asks for, and returns every measurement as plain data.

    ``progress(part, done, total, label)`` (e.g. :class:`nanoattn.bench._progress.ItemLines`)
    is called before each measured item of each part ("peak", "grid", "targets",
    "generation", "window", "native", "masks", "serving", "decode", "engine",
    "selection", "tree", "cascade", "sharded"), ``done``
    of the part's ``total`` items being finished, and once with ``done == total`` when
    the part ends.
    Items skipped without being measured (torch missing, scores over ``max_score_gib``)
    are neither reported nor counted; a part with nothing left to measure is reported once, with
    ``total == 0`` and why in ``label``.
    """
    report = progress or (lambda part, done, total, label: None)
    no_torch = _torch.available()  # why torch cannot run, or None
    (peak,) = _part(
        report,
        "peak",
        [(f"{config.dtype} matmul peak", ())],
        lambda: matmul_peak_gflops(dtype=jnp.dtype(config.dtype)),
    )
    cells = _grid(config, report, peak, no_torch)
    targets, found = _kernel_targets(config, report, peak, no_torch), {}
    for name, measure in PARTS.items():
        found[name], judged = measure(config, report, peak, no_torch)
        targets += judged
    return {
        "machine": machine() | {"matmul_peak_gflops": peak},
        "config": dataclasses.asdict(config),
        "cells": cells,
        "targets": targets,
        **found,
    }


# Each part after the grid and the kernel's targets: (config, report, peak, no_torch) ->
# (its measurements, or None / [] when config skips it; its judged targets).


def _grid(config: BenchConfig, report, peak: float, no_torch) -> list:
    """Every implementation x length x head shape x pass, or none without ``config.grid``."""
    grid = []
    for N, H in config.shapes if config.grid else ():
        for T in config.lengths:
            B = max(1, config.tokens // T)
            for backward in (False, True):
                for name in config.implementations:
                    skip = will_skip(name, B, T, N, config.max_score_gib, bool(no_torch))
                    label = f"{name} {'fwd+bwd' if backward else 'fwd'} {N}x{H} T={T}"
                    grid.append((None if skip else label, (name, B, T, N, H, backward)))
    return _part(
        report,
        "grid",
        grid,
        lambda *job: measure_cell(*job, config.dtype, peak, config.max_score_gib),
    )


def _kernel_targets(config: BenchConfig, report, peak: float, no_torch) -> list:
    """The flash kernel's targets of docs/performance.md, with ``config.targets``."""
    if not config.targets:
        return []
    relay = _Relay(
        report,
        "targets",
        "targets: ",
        skipped=lambda what: bool(no_torch) and what.startswith("torch "),
        skips=TARGET_TORCH_ITEMS if no_torch else 0,
    )
    targets = _targets.measure_targets(peak, relay)
    relay.end()
    return targets


def _generation_part(config: BenchConfig, report, peak: float, no_torch):
    contexts = [(f"context {C}", (C,)) for C in config.generation]
    generation = _part(report, "generation", contexts, _generation.measure_generation)
    return generation, _generation.generation_targets(generation)


def _window_part(config: BenchConfig, report, peak: float, no_torch):
    if not config.window_length:
        return None, []
    T = config.window_length
    (window,) = _part(report, "window", [(f"fwd+bwd T={T}", (T,))], _window.measure_window)
    return window, _window.window_targets(window)


def _native_part(config: BenchConfig, report, peak: float, no_torch):
    if not config.native_lengths:
        return [], []
    relay = None
    if no_torch:  # measure_pair skips every pair at once
        report("native", 0, 0, f"skipped: {no_torch}")
    else:
        relay = _Relay(report, "native", "native vs torch: ")
    native = _native.measure_native(config.native_lengths, config.shapes, peak, relay)
    if relay:
        relay.end()
    return native, _native.native_targets(native)


def _masks_part(config: BenchConfig, report, peak: float, no_torch):
    if not config.masks_length:
        return [], []
    items = _masks.jobs(config.masks_length)
    masks = _part(report, "masks", items, lambda *job: _masks.measure_pair(*job))
    judged = config.masks_length == _masks.LENGTH  # judged at the length only
    return masks, _masks.masks_targets(masks) if judged else []


def _latent_part(config: BenchConfig, report, peak: float, no_torch):
    if not config.latent_context:
        return None, []
    C = config.latent_context
    items = [(f"cache bytes and decode step, context {C}", (C,))]
    (latent,) = _part(report, "latent", items, _latent.measure_latent)
    return latent, _latent.latent_targets(latent["cache"], latent["decode"])


def _engine_part(config: BenchConfig, report, peak: float, no_torch):
    if not config.engine:
        return None, []
    shape = {"full": _engine.FULL, "quick": _engine.QUICK}[config.engine]
    prefix = {"full": _engine_prefix.FULL, "quick": _engine_prefix.QUICK}[config.engine]
    relay = _Relay(report, "engine", "")
    engine = _engine_prefix.measure_engine_part(shape, prefix, relay)
    relay.end()
    return engine, _engine.engine_targets(engine) + _engine_prefix.prefix_targets(engine["prefix"])


def _sized_part(part: str, module, measure, targets):
    """The part ``part`` of a module with ``FULL`` and ``QUICK`` shapes, measured by
    ``measure(shape, progress)`` and judged by ``targets(row, judged)`` (``judged``: at
    full size; the serving and decode parts' targets see it in the row). Either may be
    the name of the module's function, looked up when the part runs (tests stub them)."""

    def run(config: BenchConfig, report, peak: float, no_torch):
        size = getattr(config, part)
        if not size:
            return None, []
        shape = {"full": module.FULL, "quick": module.QUICK}[size]
        relay = _Relay(report, part, "")
        measured = getattr(module, measure) if isinstance(measure, str) else measure
        row = measured(shape, relay)
        relay.end()
        judge = getattr(module, targets) if isinstance(targets, str) else targets
        return row, judge(row, size == "full")

    return run


# The parts after the grid and the kernel's targets, in the order they run and report.
PARTS = {
    "generation": _generation_part,
    "window": _window_part,
    "native": _native_part,
    "masks": _masks_part,
    "latent": _latent_part,
    # measured and judged by name or through lambdas: looked up when the part runs (tests
    # stub them)
    "serving": _sized_part(
        "serving",
        _serving,
        "measure_serving",
        lambda row, judged: _serving.serving_targets(row),
    ),
    "decode": _sized_part(
        "decode",
        _decode_cases,
        lambda *a: _decode.measure_decode(*a),
        lambda row, judged: _decode_report.decode_targets(row),
    ),
    "engine": _engine_part,
    "selection": _sized_part("selection", _selection, "measure_selection", "selection_targets"),
    "tree": _sized_part("tree", _tree, "measure_tree", "tree_targets"),
    "cascade": _sized_part("cascade", _cascade, "measure_cascade", "cascade_targets"),
    "sharded": _sized_part("sharded", _sharded, "measure_sharded", "sharded_targets"),
}
