"""What the causality check runs ``fn`` on: the lengths and where each is probed,
the two ways of calling ``fn`` (under ``jax.jit`` and eagerly), and for every length
and mode the input, its output and every random input the probes use.

Everything here is computed once per check and read by every probe, so the probes
share no state and a seed gives the same inputs whichever probes run.
"""

import dataclasses

import jax
import numpy as np

from .._base.validate import describe
from ._bounds import SubjectFailed, call
from ._inputs import Inputs, as_features, jit

# Up to and past the block sizes of blockwise kernels (64, 128, 256, 512): a mask
# built per block can be right below a block size and leak above it.
DEFAULT_SEQ_LENS = (1, 2, 3, 5, 8, 16, 17, 33, 64, 129, 257, 513)
EVERY_SPLIT_UP_TO = 17  # sequences this short are split at every position
EVERY_POSITION_UP_TO = 64  # sequences this short have every token changed, every output's gradient
EAGER_UP_TO = 17  # the eager sweep runs at the longest requested length up to this
FIRST_BLOCK = 32  # longer sequences are probed around every power of two from here on


def _block_marks(T: int) -> set[int]:
    """The positions around every power of two b from 32 below T: b - 1, b, b + 1."""
    marks, b = set(), FIRST_BLOCK
    while b < T:
        marks |= {b - 1, b, b + 1}
        b *= 2
    return marks


def split_points(T: int) -> list[int]:
    """Where the shared prefix ends: every p when T <= 17, else 1, T//2, T-1 and the
    powers of two from 32 below T (a block's first key)."""
    if T <= EVERY_SPLIT_UP_TO:
        return list(range(1, T))
    blocks = {b for b in _block_marks(T) if b & (b - 1) == 0}
    return sorted({1, T // 2, T - 1} | blocks)


def changed_positions(T: int) -> list[int]:
    """The single tokens changed: every one when T <= 64; else 1, 2, T//2, T-2, T-1
    and b - 1, b, b + 1 around every power of two b from 32 below T (bounded: at
    most 3 log2(T) calls however long the sequence)."""
    if T <= EVERY_POSITION_UP_TO:
        return list(range(1, T))
    return sorted(p for p in {1, 2, T // 2, T - 2, T - 1} | _block_marks(T) if 1 <= p < T)


@dataclasses.dataclass(frozen=True)
class Mode:
    """One way of calling ``fn``: ``"jit"`` (under ``jax.jit``) or ``"eager"``, at ``lengths``."""

    name: str
    call: object
    lengths: frozenset


def modes(fn, inputs: Inputs, seq_lens: list[int], batch: int, seed: int):
    """Every length under ``jax.jit``, and one length eagerly (``jax.disable_jit``, so
    a jitted ``fn`` runs op by op too); a function jax cannot trace (at the shortest
    length where it runs as given) runs as given at every length. Returns the modes
    and, for such a function, why."""
    short, long = jit(fn), jax.jit(fn)

    def jitted(x):  # past 64 tokens a call costs more than its compile: optimise it
        return (short if x.shape[1] <= EVERY_POSITION_UP_TO else long)(x)

    for T in sorted(set(seq_lens)):  # the shortest first: a bounded fn runs there
        x = inputs.random(np.random.default_rng((seed, T)), batch, T)
        try:
            jax.block_until_ready(jitted(x))
            break
        except Exception as e:  # not a jax function, or fn raises at this length
            why = describe(e)
        try:
            np.asarray(fn(x))
        except Exception:  # fn raises at T however it is called: the sweep says so
            continue
        return [Mode("eager", fn, frozenset(seq_lens))], why  # runs, but not under jit

    def eager(x):
        with jax.disable_jit():
            return fn(x)

    up_to = [T for T in seq_lens if T <= EAGER_UP_TO]
    eager_at = max(up_to) if up_to else min(seq_lens)
    return [
        Mode("jit", jitted, frozenset(seq_lens)),
        Mode("eager", eager, frozenset({eager_at})),
    ], None


@dataclasses.dataclass(frozen=True)
class Draws:
    """The random inputs of one run, drawn from one stream in this order. Tokens are
    (B, D) floats or (B,) ids; ``rows`` and ``every`` only for token ids in the main mode."""

    futures: tuple  # per split point p: new tokens for x[:, p:], (B, T - p, ...)
    singles: tuple  # per changed position s: a new token for x[:, s]
    first: np.ndarray  # a new first token, for x[:, 0]
    rows: tuple  # per batch row b when B > 1: every token of x changed, (B, T)
    every: np.ndarray | None  # every token of x changed, (B, T)

    @classmethod
    def of(cls, inputs: Inputs, rng, x, splits, positions, exact: bool) -> "Draws":
        B, T = x.shape[:2]
        return cls(
            futures=tuple(inputs.random(rng, B, T - p) for p in splits),
            singles=tuple(inputs.changed(rng, x[:, s]) for s in positions),
            first=inputs.changed(rng, x[:, 0]),
            rows=tuple(inputs.changed(rng, x) for _ in range(B if exact and B > 1 else 0)),
            every=inputs.changed(rng, x) if exact else None,
        )


def _outputs(mode: Mode, x: np.ndarray) -> np.ndarray:
    """``fn`` on ``x`` (B, T, ...) called in ``mode``, as (B, T, F) float64;
    :class:`SubjectFailed` when ``fn`` raises."""
    return as_features(call(mode.call, x.shape[1], mode.name, x), x.shape)


@dataclasses.dataclass(frozen=True)
class Run:
    """One length under one mode: the input ``x`` (B, T, ...), its output ``y``
    (B, T, F) and the random inputs the probes change it with. The main mode (the
    first, ``index`` 0) runs every probe; the eager sweep of a traceable ``fn`` only
    the prefix pairs and the positive control."""

    mode: Mode
    index: int
    x: np.ndarray
    y: np.ndarray
    splits: list[int]  # split_points(T)
    positions: list[int]  # changed_positions(T) in the main mode, else none
    draws: Draws

    @classmethod
    def of(cls, inputs: Inputs, mode: Mode, index: int, x: np.ndarray, seed: int) -> "Run":
        T = x.shape[1]
        rng = np.random.default_rng((seed, T, index + 1))
        splits, positions = split_points(T), changed_positions(T) if index == 0 else []
        exact = inputs.tokens and index == 0  # token ids: the receptive field's rows
        draws = Draws.of(inputs, rng, x, splits, positions, exact)
        return cls(mode, index, x, _outputs(mode, x), splits, positions, draws)

    @property
    def T(self) -> int:
        return self.x.shape[1]

    @property
    def main(self) -> bool:
        return self.index == 0

    @property
    def tag(self) -> dict:
        return {"length": self.T, "mode": self.mode.name}

    @property
    def suffix(self) -> str:
        return f"(T={self.T}, {self.mode.name})"

    def outputs(self, x: np.ndarray) -> np.ndarray:
        """``fn`` on ``x`` (B, T, ...) in this run's mode, as (B, T, F) float64."""
        return _outputs(self.mode, x)


@dataclasses.dataclass(frozen=True)
class Sweep:
    """Every run of the check: each length, under each mode that runs at it, in order.
    ``untraceable``: why jax cannot trace ``fn`` (then it runs as given), else None.
    ``failures``: where ``fn`` raised (those runs are left out); ``lengths``: the
    lengths tried."""

    inputs: Inputs
    modes: list[Mode]
    runs: list[Run]
    untraceable: str | None
    failures: tuple[SubjectFailed, ...] = ()
    lengths: tuple[int, ...] = ()

    @classmethod
    def of(cls, fn, inputs: Inputs, seq_lens: list[int], batch: int, seed: int) -> "Sweep":
        """Calls ``fn`` once per run, for its output ``y``; one input per length. A run
        where ``fn`` raises is left out, and its failure kept. Every run is kept until
        the probes are done: with the default lengths, each about doubling, about
        twice the memory of the longest run."""
        all_modes, untraceable = modes(fn, inputs, seq_lens, batch, seed)
        runs, failures = [], []
        for T in seq_lens:
            x = inputs.random(np.random.default_rng((seed, T)), batch, T)
            for index, mode in enumerate(all_modes):
                if T in mode.lengths:
                    try:
                        runs.append(Run.of(inputs, mode, index, x, seed))
                    except SubjectFailed as failure:
                        failures.append(failure)
        return cls(inputs, all_modes, runs, untraceable, tuple(failures), tuple(seq_lens))

    def without(self, failure: SubjectFailed) -> "Sweep":
        """This sweep less the runs at ``failure``'s length and mode, which it keeps."""
        runs = [r for r in self.runs if (r.T, r.mode.name) != (failure.length, failure.mode)]
        return dataclasses.replace(self, runs=runs, failures=(*self.failures, failure))

    @property
    def main_runs(self) -> list[Run]:
        """One run per requested length, in the main mode."""
        return [run for run in self.runs if run.main]

    @property
    def eager_at(self) -> int:
        """The (shortest) length the last mode runs at: the eager sweep's."""
        return min(self.modes[-1].lengths)
