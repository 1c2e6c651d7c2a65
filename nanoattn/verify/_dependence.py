"""Which inputs each output of one run depends on, measured exactly: by gradients for
float inputs when ``fn`` is differentiable with jax, else by perturbation (token ids,
numpy functions). The mask check (``_mask.py``) compares it with what ``mask_fn``
claims.

Gradients give, for every measured output (b, t), the largest |d output / d input|
over the input features of every input (b', s), each output's features weighted by one
random probe (``_receptive_field._output_gradients``). Perturbation changes one input
position s in every batch row at a time and reads which outputs move, bit for bit,
then changes every other row to see that row b stays the same; it measures the eager
run too, since gradients would trace ``fn`` instead of feeding it concrete arrays.
Either way the last measure, changing every token, is the positive control.
"""

import dataclasses

import numpy as np

from ._leaks import per_feature
from ._receptive_field import _output_gradients
from ._sweep import EVERY_POSITION_UP_TO, Run, Sweep, changed_positions

GRADIENTS, PERTURBATION = "gradients", "perturbation"
STREAM = 23  # the random stream of the mask check's changes, apart from the sweep's own


def probed_positions(T: int) -> list[int]:
    """The outputs (gradients) or inputs (perturbation) measured at length T: every
    position when T <= 64, else 0 and ``changed_positions(T)``."""
    if T <= EVERY_POSITION_UP_TO:
        return list(range(T))
    return [0, *changed_positions(T)]


@dataclasses.dataclass(frozen=True)
class Dependence:
    """How much each output of one run (B, T, ...) moves with each input of its row.

    ``effect`` (B, T, T): output (b, t) on input (b, s), >= 0, inf where a result was
    not finite, read only where ``measured`` (T, T) (output t, input s) is True.
    ``other_rows`` (B, T): output (b, t) on every other batch row (NaN where not
    measured). ``moved`` (B, T): how far each output moved when every token changed.
    ``method``: :data:`GRADIENTS` or :data:`PERTURBATION`; ``why``: why not gradients
    (None for the eager run, which never takes them).
    """

    effect: np.ndarray
    measured: np.ndarray
    other_rows: np.ndarray
    moved: np.ndarray
    method: str
    why: str | None = None


def _largest(dev: np.ndarray) -> np.ndarray:
    """The largest deviation over the last axis, a non-finite one counting as inf."""
    return np.nan_to_num(dev, nan=np.inf).max(-1)


def _every_token_moved(run: Run, rng, inputs) -> np.ndarray:
    """How far each output (b, t) moves when every token of every row changes."""
    return _largest(per_feature(run.outputs(inputs.changed(rng, run.x)), run.y))


def _by_gradients(grads: np.ndarray, outputs: list[int], T: int, moved) -> Dependence:
    """``grads`` (R, B, T) from ``_output_gradients``, R ordered (b, t) over ``outputs``."""
    B = grads.shape[1]
    g = np.nan_to_num(grads, nan=np.inf).reshape(B, len(outputs), B, T)
    rows = np.arange(B)
    effect = np.zeros((B, T, T))
    effect[:, outputs] = g[rows, :, rows]  # (B, O, T): each output on its own row
    other_rows = np.full((B, T), np.nan)
    if B > 1:
        others = np.where((rows[:, None] != rows[None, :])[:, None, :, None], g, 0.0)
        other_rows[:, outputs] = others.max(axis=(2, 3))
    measured = np.zeros((T, T), bool)
    measured[outputs] = True
    return Dependence(effect, measured, other_rows, moved, GRADIENTS)


def _by_perturbation(run: Run, rng, inputs, moved, why: str | None) -> Dependence:
    """One call of ``fn`` per probed position (that token changed in every row) and per
    batch row (every other row changed) when B > 1."""
    B, T = run.x.shape[:2]
    positions = probed_positions(T)
    effect = np.zeros((B, T, T))
    for s in positions:
        other = run.x.copy()
        other[:, s] = inputs.changed(rng, run.x[:, s])
        effect[:, :, s] = _largest(per_feature(run.outputs(other), run.y))
    other_rows = np.full((B, T), np.nan)
    for b in range(B if B > 1 else 0):
        other = inputs.changed(rng, run.x)
        other[b] = run.x[b]
        other_rows[b] = _largest(per_feature(run.outputs(other)[b], run.y[b]))
    measured = np.zeros((T, T), bool)
    measured[:, positions] = True
    return Dependence(effect, measured, other_rows, moved, PERTURBATION, why)


def measure(fn, sweep: Sweep, run: Run, seed: int) -> Dependence:
    """The dependence of ``run``'s outputs on its inputs: by gradients under ``jit``; by
    perturbation in the eager run (gradients would trace ``fn``, and the eager run is
    there to feed it concrete arrays), for token ids, and where jax cannot trace or
    differentiate ``fn``. Raises ``SubjectFailed`` when ``fn`` raises."""
    inputs = sweep.inputs
    rng = np.random.default_rng((seed, run.T, run.index + 1, STREAM))
    moved = _every_token_moved(run, rng, inputs)
    if inputs.tokens:
        return _by_perturbation(run, rng, inputs, moved, "token ids have no gradient")
    if sweep.untraceable is not None:
        why = f"jax cannot trace fn ({sweep.untraceable})"
        return _by_perturbation(run, rng, inputs, moved, why)
    if run.mode.name == "eager":  # concrete inputs, as fn gets them outside jit
        return _by_perturbation(run, rng, inputs, moved, None)
    outputs = probed_positions(run.T)
    grads, why = _output_gradients(fn, run.x, outputs, seed)
    if grads is None:
        why = f"fn is not differentiable with jax ({why})"
        return _by_perturbation(run, rng, inputs, moved, why)
    return _by_gradients(grads, outputs, run.T, moved)
