"""Three probes of the causality check, each over the whole sweep and each returning
its :class:`CheckResult`: prefix invariance, future perturbation and the positive
control (the receptive field is in ``_receptive_field.py``).

A probe changes a run's input ``x`` (B, T, ...) with the run's own random draws and
compares ``fn``'s outputs (B, T, F) feature by feature with the run's ``y``.
"""

import dataclasses

import numpy as np

from ._leaks import Leaks, per_feature, positive_control
from ._report import CheckResult
from ._sweep import Run, Sweep


def _sentence(run: Run, changed: str) -> str:
    """A leak's sentence for :meth:`Leaks.add`; ``changed``: what alone was changed."""
    return (
        f"output {{position}} of row {{batch}} (feature {{feature}}) changed by "
        f"{{deviation:.3g}} when only {changed} changed {run.suffix}"
    )


def _count(sweep: Sweep, what: str, count) -> str:
    """``"single-token changes: 140 under jit and 16 eagerly (length 17)"``, with
    ``count(run)`` the trials of one run."""
    trials = {mode.name: 0 for mode in sweep.modes}
    for run in sweep.runs:
        trials[run.mode.name] += count(run)
    if "jit" not in trials:
        return f"{what}: {trials['eager']} (fn run as given)"
    parts = [f"{trials['jit']} under jit"]
    if trials["eager"]:
        parts.append(f"{trials['eager']} eagerly (length {sweep.eager_at})")
    return f"{what}: {' and '.join(parts)}"


def prefix_invariance(sweep: Sweep, atol: float) -> CheckResult:
    """Inputs that share ``x[:, :p]`` give outputs equal within ``atol`` on ``[:, :p]``,
    at every split point p of every run (one call of ``fn`` each)."""
    leaks = Leaks(atol)
    for run in sweep.runs:
        for p, future in zip(run.splits, run.draws.futures):
            other = run.x.copy()
            other[:, p:] = future
            leaks.add(
                per_feature(run.outputs(other)[:, :p], run.y[:, :p]),
                run.tag | {"split": p},
                (run.T, run.index),
                _sentence(run, f"positions >= {p}"),
            )
    result = leaks.result(
        "prefix invariance", _count(sweep, "shared-prefix pairs", lambda run: len(run.splits))
    )
    if sweep.untraceable is None:
        return result
    note = f"not under jit, jax cannot trace fn ({sweep.untraceable})"
    return dataclasses.replace(result, detail=f"{result.detail}; {note}")


@dataclasses.dataclass(frozen=True)
class SingleChanges:
    """The single-token changes of every run in the main mode, compared twice: within
    ``atol`` (future perturbation) and ``exact``-ly (the token-id receptive field)."""

    within: Leaks
    exact: Leaks

    @classmethod
    def of(cls, sweep: Sweep, atol: float) -> "SingleChanges":
        """Changes the token s (every batch row) at every changed position s of every
        run: outputs before s must not move (one call of ``fn`` each)."""
        changes = cls(Leaks(atol), Leaks(0.0))
        for run in sweep.runs:
            for s, token in zip(run.positions, run.draws.singles):
                other = run.x.copy()
                other[:, s] = token
                deviation = per_feature(run.outputs(other)[:, :s], run.y[:, :s])
                for leaks in (changes.within, changes.exact):
                    leaks.add(
                        deviation,
                        run.tag | {"changed": s},
                        (run.T, run.index),
                        _sentence(run, f"position {s}"),
                    )
        return changes


def future_perturbation(sweep: Sweep, changes: SingleChanges) -> CheckResult:
    """No single-token change moved an output before it by more than ``atol``."""
    what = _count(sweep, "single-token changes", lambda run: len(run.positions))
    return changes.within.result("future perturbation", what)


def _first_token_moved(run: Run) -> float:
    """How far changing ``x[:, 0]`` moves the later outputs (the only one when T = 1):
    the largest change of any feature (NaN when an output is not finite)."""
    changed = run.x.copy()
    changed[:, 0] = run.draws.first
    later = slice(1, None) if run.T > 1 else slice(0, 1)
    return float(np.abs(run.outputs(changed)[:, later] - run.y[:, later]).max())


def first_token_control(sweep: Sweep, atol: float) -> CheckResult:
    """The positive control: in every run, changing the first token moves a later
    output by more than ``SENSITIVITY * atol`` (one call of ``fn`` per run); the
    weakest run is reported."""
    weakest, weakest_at = np.inf, None
    for run in sweep.runs:
        moved = _first_token_moved(run)
        if not moved > weakest:  # NaN counts as the weakest
            weakest, weakest_at = moved, run.tag
    suffix = f" in each of {len(sweep.runs)} runs"
    return positive_control(weakest, atol, "later outputs", weakest_at, suffix)
