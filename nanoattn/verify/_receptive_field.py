"""The causality check's receptive-field probe: every output depends on no later
input and no other batch row, and on something visible.

Float inputs: exactly, by gradients of every output (lengths up to 64). Token ids
have no gradient: exactly, by perturbation, reusing the single-token changes and
changing every other row, then every token.
"""

import dataclasses
import weakref

import jax
import jax.numpy as jnp
import numpy as np

from .._base.validate import describe
from ._inputs import jit
from ._leaks import Leaks, per_feature
from ._probes import SingleChanges
from ._report import CheckResult
from ._sweep import EVERY_POSITION_UP_TO, Run, Sweep

NAME = "receptive field"


# The differentiated programs, per fn (by identity, held weakly: a dropped fn drops
# its programs) and per (B, outputs, seed): a check that measures a fn measured
# before (check_mask after check_causality, the same lengths again) traces and
# compiles nothing new, as ``jax.jit`` of one fn compiles it once per input shape.
# id(fn) -> (a weak reference to fn, {(B, outputs, seed): the jitted gradients}).
_PROGRAMS: dict[int, tuple[weakref.ref, dict]] = {}


def _programs_of(fn) -> tuple[weakref.ref, dict] | None:
    """``fn``'s entry of :data:`_PROGRAMS`, made when missing; None when ``fn`` cannot
    be referenced weakly (a builtin, say), which is then never cached."""
    entry = _PROGRAMS.get(id(fn))
    if entry is not None and entry[0]() is fn:
        return entry
    key = id(fn)
    try:
        ref = weakref.ref(fn, lambda _: _PROGRAMS.pop(key, None))
    except TypeError:
        return None
    entry = _PROGRAMS[key] = (ref, {})
    return entry


def _gradient_program(fn, B: int, outputs: tuple[int, ...], seed: int):
    """The jitted x (B, T, D) -> (R, B, T, D) of :func:`_output_gradients`, made once
    per fn, B, outputs and seed (jax compiles it once per shape and dtype of x). It
    holds ``fn`` weakly when cached, so the cache keeps no fn alive."""
    entry = _programs_of(fn)
    if entry is not None and (B, outputs, seed) in entry[1]:
        return entry[1][B, outputs, seed]
    rows_b = np.repeat(np.arange(B), len(outputs))
    rows_t = np.tile(np.asarray(outputs), B)
    R = len(rows_b)
    get_fn = (lambda: fn) if entry is None else entry[0]  # alive while the caller traces

    @jit
    def gradients(x):
        y, vjp = jax.vjp(lambda a: jnp.asarray(get_fn()(a)), x)
        probe = jax.random.normal(jax.random.key(seed), y.shape[2:], y.dtype)
        cotangents = jnp.zeros((R, *y.shape), y.dtype).at[jnp.arange(R), rows_b, rows_t].set(probe)
        return jax.vmap(vjp)(cotangents)[0]

    if entry is not None:
        entry[1][B, outputs, seed] = gradients
    return gradients


def _output_gradients(fn, x: np.ndarray, outputs: list[int], seed: int):
    """|d output (b, t) / d input (b', s)| for every row b and t in ``outputs``, the
    largest over input features: (R, B, T) with R = B * len(outputs) in the order
    (b, t). Each output's features are weighted by one random probe, so no feature's
    gradient can be averaged away. None when ``fn`` cannot be differentiated with
    jax (the reason is returned instead). The program is made once per fn, batch,
    outputs and seed (:func:`_gradient_program`)."""
    B, T = x.shape[:2]
    R = B * len(outputs)
    gradients = _gradient_program(fn, B, tuple(int(t) for t in outputs), seed)
    try:
        grads = gradients(jnp.asarray(x))  # (R, B, T, D)
    except Exception as e:  # any failure to trace means: not differentiable with jax
        return None, describe(e)
    grads = np.abs(np.asarray(grads, np.float64))
    return grads.reshape(R, B, T, -1).max(-1), None


@dataclasses.dataclass
class _Field:
    """The receptive field: leaks from later inputs, from other batch rows, dead outputs."""

    future: Leaks = dataclasses.field(default_factory=lambda: Leaks(0.0))
    batch_leak: float = 0.0
    batch_sentence: str = ""
    dead: list = dataclasses.field(default_factory=list)
    outputs: int = 0

    def rows(self, leak: float, sentence: str) -> None:
        """``sentence`` says where ``leak`` (>= 0) crossed rows; ``{size}`` is its size."""
        if leak > self.batch_leak:
            self.batch_leak, self.batch_sentence = leak, sentence.format(size=f"{leak:.3g}")

    def dead_output(self, t: int, b: int, T: int) -> None:
        """Output t of row b depends on no visible input (the first 3 are named)."""
        if len(self.dead) < 3:
            self.dead.append(f"output {t} of row {b} (T={T})")

    def result(self, what: str, dead: str) -> CheckResult:
        """``what``: the detail when it passes; ``dead``: how a dead output shows."""
        result = self.future.result(NAME, "")
        problems = [] if result.passed else [result.detail]
        if self.dead:
            problems.append(f"{dead} for {', '.join(self.dead)}")
        if self.batch_leak > 0:
            problems.append(self.batch_sentence)
        return dataclasses.replace(
            result,
            passed=not problems,
            detail="; ".join(problems) or what,
            worst=max(result.worst, self.batch_leak),  # a leak across rows counts too
        )


def _add_gradients(field: _Field, grads: np.ndarray, outputs: list[int], T: int) -> None:
    """``grads`` (R, B, T) from :func:`_output_gradients`: no later input, no other row,
    some visible input."""
    later = np.arange(T)
    for r, (b, t) in enumerate((b, t) for b in range(grads.shape[1]) for t in outputs):
        g = grads[r]
        field.outputs += 1
        field.future.add(
            np.where(later > t, g[b], 0.0)[None, :, None],
            {"length": T, "batch": b, "output": t},
            (T, t, b),
            f"output {t} of row {b} has gradient {{deviation:.3g}} from the later "
            f"input {{position}} (T={T})",
            axis="input",
            named=(),
        )
        others = np.delete(g, b, axis=0)
        if others.size:
            field.rows(
                float(others.max()),
                f"output {t} of row {b} has gradient {{size}} from other batch rows (T={T})",
            )
        if not g[b, : t + 1].any():
            field.dead_output(t, b, T)


def _by_gradients(fn, sweep: Sweep, seed: int) -> CheckResult:
    """Float inputs: every output's gradient at every length up to 64 (one
    differentiated call each), or skipped when jax cannot differentiate ``fn``."""
    field = _Field()
    for run in sweep.main_runs:
        if run.T > EVERY_POSITION_UP_TO:
            continue
        outputs = list(range(run.T))
        grads, why = _output_gradients(fn, run.x, outputs, seed)
        if grads is None:
            detail = f"skipped, fn is not differentiable with jax ({why})"
            return CheckResult(NAME, True, detail, skipped=True)
        _add_gradients(field, grads, outputs, run.T)
    return field.result(
        f"gradients of {field.outputs} outputs (every batch row): exactly 0 from "
        "every later input and other row, non-zero from earlier inputs",
        "no gradient from any visible input",
    )


def _add_exact_rows(field: _Field, run: Run) -> None:
    """Token ids: changing every other row leaves a row bit-for-bit unchanged; changing
    every token changes every output (none depends on nothing visible). One call of
    ``fn`` per batch row (when B > 1), and one more."""
    x, y = run.x, run.y
    for b, changed in enumerate(run.draws.rows):
        other = changed.copy()
        other[b] = x[b]
        field.outputs += 1
        dev = np.nan_to_num(per_feature(run.outputs(other)[b], y[b]), nan=np.inf)
        field.rows(
            float(dev.max()),
            f"row {b} changed by {{size}} when only the other rows changed (T={run.T})",
        )
    moved = np.abs(run.outputs(run.draws.every) - y).max(-1)  # (B, T)
    for b, t in zip(*np.nonzero(~(moved > 0))):
        field.dead_output(t, b, run.T)


def _by_perturbation(sweep: Sweep, changes: SingleChanges) -> CheckResult:
    """Token ids: the single-token changes compared exactly, and every run in the main
    mode with every other row changed, then every token."""
    field = _Field(future=changes.exact)
    for run in sweep.main_runs:
        _add_exact_rows(field, run)
    return field.result(
        f"token ids have no gradient, so exactly, by perturbation: outputs "
        f"bit-for-bit unchanged by {field.future.trials} later-token changes and "
        f"{field.outputs} changes of every other row; every output changes when "
        "every token does",
        "unchanged when every token changed",
    )


def receptive_field(fn, sweep: Sweep, changes: SingleChanges, seed: int) -> CheckResult:
    """Every output t of every row b depends exactly on no input s > t and no other
    row, and on some input s <= t: by gradients for floats, by perturbation for ids."""
    if sweep.inputs.tokens:
        return _by_perturbation(sweep, changes)
    return _by_gradients(fn, sweep, seed)
