"""The mask check: a self-attention layer depends on exactly the inputs its ``mask_fn``
claims, in both directions, with every other batch row left out and a positive
control. The causality check's receptive field is the special case
``mask_fn = lambda b, n, q, k: k <= q``; this one takes windows, documents,
prefix-LM and tree masks.

The lengths, modes and inputs are the causality check's sweep (``_sweep.py``), the
claim is ``_claimed.py``'s, the measurement ``_dependence.py``'s; this module compares
them and writes the report.
"""

import dataclasses

import numpy as np

from .._base.mask_fn import check_elementwise
from ._bounds import SubjectFailed, runs_check, skipped, within
from ._causality import _lengths
from ._claimed import Claimed
from ._dependence import GRADIENTS, Dependence, measure
from ._inputs import Inputs, _int_at_least
from ._leaks import SENSITIVITY
from ._report import CheckResult, Report
from ._sweep import Run, Sweep

# Every output and input up to 64 (one block of the blockwise kernels), and one
# length past two such blocks, where a mask built per block goes wrong, sampled.
DEFAULT_SEQ_LENS = (1, 2, 7, 17, 64, 129)
CHECKS = ("outside the mask", "inside the mask", "other rows", "positive control")


def _measure_name(dep: Dependence) -> str:
    return "gradient" if dep.method == GRADIENTS else "change"


@dataclasses.dataclass
class _Pairs:
    """One direction over every run: the (output, input) pairs of a row checked, those
    that fail, the first failure (shortest length, then output, row, input) and the
    extreme value seen (``largest``: the worst leak; else the weakest dependence)."""

    largest: bool
    checked: int = 0
    failed: int = 0
    first: tuple | None = None  # (sort key, where, value, sentence)
    extreme: float | None = None
    extreme_at: dict | None = None

    def add(self, run: Run, dep: Dependence, cells, bad, sentence) -> None:
        """``cells`` (B, T, T) the pairs checked, ``bad`` those failing;
        ``sentence(b, t, s, value)`` says what a failing pair shows."""
        self.checked += int(cells.sum())
        self.failed += int(bad.sum())
        if cells.any():
            sign = 1.0 if self.largest else -1.0  # the extreme is the largest signed value
            b, t, s = np.unravel_index(
                np.argmax(np.where(cells, sign * dep.effect, -np.inf)), cells.shape
            )
            value = float(dep.effect[b, t, s])
            if self.extreme is None or sign * value > sign * self.extreme:
                self.extreme = value
                self.extreme_at = run.tag | {"batch": int(b), "output": int(t), "input": int(s)}
        if bad.any():
            t, b, s = (int(i) for i in np.argwhere(bad.transpose(1, 0, 2))[0])
            key = (run.T, run.index, t, b, s)
            if self.first is None or key < self.first[0]:
                value = float(dep.effect[b, t, s])
                where = run.tag | {"batch": b, "output": t, "input": s}
                self.first = (key, where, value, sentence(b, t, s, value))


def _mode_phrase(sweep: Sweep, mode: str) -> str:
    if mode == "jit":
        return "under jit"
    return "(fn run as given)" if sweep.untraceable else "eagerly"


def _how(sweep: Sweep, deps: list[Dependence], why: bool = True) -> str:
    """``"by gradients at lengths 1, 13 under jit, by perturbation at lengths 13 eagerly"``:
    each method, why it was taken when not by choice (when ``why``), and the lengths
    of each mode."""
    groups = {}  # method -> mode -> lengths
    for run, dep in zip(sweep.runs, deps):
        groups.setdefault(dep.method, {}).setdefault(run.mode.name, []).append(str(run.T))
    parts = []
    for method, by_mode in groups.items():
        reason = next((dep.why for dep in deps if dep.method == method and dep.why), None)
        modes = [f"{', '.join(lengths)} {_mode_phrase(sweep, m)}" for m, lengths in by_mode.items()]
        label = f"by {method}" + (f" ({reason})" if reason and why else "")
        parts.append(f"{label} at lengths {' and '.join(modes)}")
    return ", ".join(parts)


def _outside(sweep: Sweep, claims: dict, deps: list[Dependence], how: str) -> CheckResult:
    """No output depends on an input of its row that ``mask_fn`` hides from it."""
    pairs = _Pairs(largest=True)
    for run, dep in zip(sweep.runs, deps):
        cells = dep.measured[None] & ~claims[run.T].may

        def sentence(b, t, s, value, run=run, dep=dep):
            return (
                f"output {t} of row {b} depends on input {s}, which mask_fn hides from it "
                f"({_measure_name(dep)} {value:.3g}, T={run.T}, {run.mode.name})"
            )

        pairs.add(run, dep, cells, cells & (dep.effect > 0), sentence)
    name, worst = CHECKS[0], pairs.extreme or 0.0
    if pairs.first is None:
        hidden = (
            f"every output exactly independent of each input of its row that mask_fn hides "
            f"from it ({pairs.checked} pairs)"
            if pairs.checked
            else "mask_fn hides no input of its row from any output"
        )
        return CheckResult(name, True, f"{how}: {hidden}", worst)
    _, where, value, sentence = pairs.first
    detail = f"first leak: {sentence}; {pairs.failed} of {pairs.checked} hidden pairs leak"
    data = {"first": where | {"deviation": value}, "failed": pairs.failed}
    return CheckResult(name, False, detail, worst, pairs.extreme_at, data=data)


def _inside(sweep: Sweep, claims: dict, deps: list[Dependence], how: str) -> CheckResult:
    """Every output depends on every input of its row that ``mask_fn`` lets it see."""
    pairs = _Pairs(largest=False)
    for run, dep in zip(sweep.runs, deps):
        claim = claims[run.T]
        cells = dep.measured[None] & claim.must

        def sentence(b, t, s, value, run=run, claim=claim):
            through = ""
            if s == t and not claim.keys[b, t, t]:
                seen = int(claim.keys[b, t].sum())
                through = f" through its query (it sees {seen} keys)"
            return (
                f"output {t} of row {b} does not depend on input {s}, which mask_fn lets it "
                f"see{through} (T={run.T}, {run.mode.name})"
            )

        pairs.add(run, dep, cells, cells & ~(dep.effect > 0), sentence)
    name = CHECKS[1]
    if pairs.checked == 0:
        return CheckResult(name, True, "skipped, mask_fn lets no output see any key", skipped=True)
    if pairs.first is None:
        detail = (
            f"{how}: every output depends on each input of its row that "
            f"mask_fn lets it see ({pairs.checked} pairs, the weakest {pairs.extreme:.3g})"
        )
        return CheckResult(name, True, detail, pairs.extreme, pairs.extreme_at)
    _, where, value, sentence = pairs.first
    detail = (
        f"first missing: {sentence}: mask_fn claims more than fn sees; {pairs.failed} of "
        f"{pairs.checked} visible pairs have no effect"
    )
    data = {"first": where | {"deviation": value}, "failed": pairs.failed}
    return CheckResult(name, False, detail, pairs.extreme, where, data=data)


def _other_rows(sweep: Sweep, deps: list[Dependence], how: str, batch: int) -> CheckResult:
    """No output depends on another batch row, exactly."""
    name = CHECKS[2]
    if batch == 1:
        return CheckResult(name, True, "skipped, batch=1 has no other row", skipped=True)
    checked, failed, first, worst, worst_at = 0, 0, None, 0.0, None
    for run, dep in zip(sweep.runs, deps):
        measured = ~np.isnan(dep.other_rows)
        leak = np.where(measured, dep.other_rows, 0.0)
        checked += int(measured.sum())
        failed += int((leak > 0).sum())
        b, t = np.unravel_index(np.argmax(leak), leak.shape)
        if leak[b, t] > worst:
            worst, worst_at = float(leak[b, t]), run.tag | {"batch": int(b), "output": int(t)}
        if (leak > 0).any():
            t, b = (int(i) for i in np.argwhere((leak > 0).T)[0])
            key = (run.T, run.index, t, b)
            if first is None or key < first[0]:
                value = float(leak[b, t])
                first = (
                    key,
                    run.tag | {"batch": b, "output": t, "deviation": value},
                    f"output {t} of row {b} depends on other batch rows ({_measure_name(dep)} "
                    f"{value:.3g}, T={run.T}, {run.mode.name})",
                )
    if first is None:
        detail = f"{how}: {checked} outputs exactly independent of every other row"
        return CheckResult(name, True, detail, worst)
    detail = f"first leak: {first[2]}; {failed} of {checked} outputs depend on other rows"
    return CheckResult(name, False, detail, worst, worst_at, data={"first": first[1]})


def _control(sweep: Sweep, claims: dict, deps: list[Dependence], atol: float) -> CheckResult:
    """Changing every token moves, in every run, some output that sees a key by more
    than ``SENSITIVITY * atol``; the weakest run is reported."""
    name, threshold = CHECKS[3], SENSITIVITY * atol
    weakest, weakest_at, runs = np.inf, None, 0
    for run, dep in zip(sweep.runs, deps):
        sees = claims[run.T].sees
        if not sees.any():
            continue
        runs += 1
        moved = float(np.where(sees, dep.moved, -np.inf).max())
        if not moved > weakest:  # NaN counts as the weakest
            weakest, weakest_at = moved, run.tag
    if runs == 0:
        return CheckResult(name, True, "skipped, mask_fn lets no output see any key", skipped=True)
    what = "the outputs that mask_fn lets see a key"
    if weakest > threshold:
        detail = (
            f"changing every token moved {what} by at least {weakest:.3g} (must exceed "
            f"{threshold:.3g}) in each of {runs} runs"
        )
    else:
        detail = (
            f"insensitive: changing every token moved {what} by only {weakest:.3g} (must "
            f"exceed {threshold:.3g}); a constant or broken function cannot pass"
        )
    return CheckResult(name, bool(weakest > threshold), detail, weakest, weakest_at)


def check_mask(
    fn,
    mask_fn,
    *,
    d_model: int | None = None,
    vocab: int | None = None,
    n_heads: int = 1,
    seq_lens=DEFAULT_SEQ_LENS,
    max_len: int | None = None,
    batch: int = 2,
    seed: int = 0,
    atol: float = 1e-5,
) -> Report:
    """Proves that the self-attention layer ``fn`` sees exactly what ``mask_fn`` claims.

    Output t of row b depends on input s iff ``mask_fn(b, n, t, s)`` for some head
    n < ``n_heads``, or s = t (its query) when it sees some key. Both directions are
    checked exactly, at every length:

    * outside the mask: every output has exactly zero dependence on each input of
      its row that ``mask_fn`` hides from it (a leak: ``fn`` sees more than claimed);
    * inside the mask: every output has a non-zero dependence on each input that
      ``mask_fn`` lets it see (``mask_fn`` claims more than ``fn`` sees), and on its
      own input when it sees two keys or more. With one key the softmax weight is 1
      whatever the query, so the query is allowed but not required; an output that
      sees no key (nanoattn returns zeros there) must depend on nothing, not even
      its own input: a layer that gives such a row the mean of its values, as
      ``jax.nn`` and flax do, fails;
    * other rows: every output has exactly zero dependence on every other batch row;
    * positive control: changing every token moves some output that sees a key by
      more than ``10 * atol`` in every run; a constant or vanishing ``fn`` fails.

    Dependence is measured by gradients for float inputs when jax can differentiate
    ``fn`` (the largest |d output / d input| over the input features, each output's
    features weighted by one random probe), else by perturbation (token ids, numpy
    functions): one input position changed in every row at a time, outputs compared
    bit for bit, then every other row changed. Up to 64 tokens every output and input
    is measured; past 64, positions 0, 1, 2, T//2, T-2, T-1 and around every power
    of two from 32. The lengths run under ``jax.jit`` and once more eagerly at the
    longest up to 17, as :func:`check_causality`'s sweep (so a leak only when traced,
    or only when not, fails), with ``max_len`` and a length where ``fn`` raises as
    there (a failed check ``"fn runs"``; no exception of ``fn`` escapes).

    Args:
      fn: a single attention layer in evaluation mode, float32 (B, T, D) (pass
        ``d_model``) or int32 token ids (B, T) (pass ``vocab``) to (B, T, ...). Where
        the layer needs per-row data to realise the mask (segment ids, lengths),
        close ``fn`` and ``mask_fn`` over the same data.
      mask_fn: ``mask_fn(b, n, q_pos, k_pos) -> bool``, the contract of nanoattn's
        ``mask_fn``: called once per length with jax int32 arrays of shapes
        (B, 1, 1, 1), (1, N, 1, 1), (1, 1, T, 1) and (1, 1, 1, T) (positions 0 .. T-1),
        elementwise, True = may attend; its result must be boolean (TypeError) and
        broadcast to (B, N, T, T) (ValueError). It is evaluated at every length
        before ``fn`` is called; its own exceptions propagate.
      n_heads: N, the query heads ``mask_fn`` is asked about; an output sees the union
        of its heads' keys (the output projection mixes the heads).
      seq_lens: the lengths T; by default 1, 2, 7, 17, 64 (every position) and 129
        (sampled, past two blocks of 64).
      max_len: None, or the longest length to try.
      batch: B. seed: the inputs' seed. atol: the positive control's scale (every
        other comparison is exact).

    Returns:
      A :class:`Report` titled ``"mask"``. A failed check names the first failing
      pair (length, mode, batch row, output, input: ``where`` of the check for
      "inside the mask", ``data["first"]`` for each) and counts them all.

    Example:
      >>> import jax.numpy as jnp
      >>> def window_sum(x):  # output t sums inputs t-2 .. t
      ...     return x + jnp.pad(x, ((0, 0), (1, 0), (0, 0)))[:, :-1] + jnp.pad(
      ...         x, ((0, 0), (2, 0), (0, 0)))[:, :-2]
      >>> window = lambda b, n, q, k: (k <= q) & (q - k <= 2)
      >>> check_mask(window_sum, window, d_model=3, seq_lens=(1, 6)).passed
      True
      >>> causal = lambda b, n, q, k: k <= q  # claims more than window_sum sees
      >>> report = check_mask(window_sum, causal, d_model=3, seq_lens=(1, 6))
      >>> [check.status for check in report.checks]
      ['PASS', 'FAIL', 'PASS', 'PASS']
    """
    inputs = Inputs.of(d_model, vocab)
    lengths = within(_lengths(seq_lens, batch, atol), max_len, "seq_lens")
    if not callable(mask_fn):
        raise TypeError(f"mask_fn must be callable as mask_fn(b, n, q_pos, k_pos), got {mask_fn!r}")
    n_heads = _int_at_least("n_heads", n_heads, 1)
    claims = {T: Claimed.of(mask_fn, batch, n_heads, T) for T in dict.fromkeys(lengths)}
    T = max(lengths)  # a kernel evaluates mask_fn on blocks: its claims must not depend on them
    check_elementwise("mask_fn", mask_fn, batch, n_heads, T, T, 0)
    sweep = Sweep.of(fn, inputs, lengths, batch, seed)
    while True:  # each failure leaves a run out, so this ends
        try:
            return _report(fn, sweep, claims, atol, seed, batch, max_len is None)
        except SubjectFailed as failure:  # fn raised in a probe: check without that run
            sweep = sweep.without(failure)


def _report(fn, sweep: Sweep, claims: dict, atol, seed, batch, hint: bool) -> Report:
    """Every check over ``sweep``, after the lengths where ``fn`` raised, if any."""
    ran = runs_check(list(sweep.failures), list(sweep.lengths), hint)
    if not sweep.main_runs:
        return Report("mask", [ran, *map(skipped, CHECKS)])
    deps = [measure(fn, sweep, run, seed) for run in sweep.runs]
    how = _how(sweep, deps, why=False)  # why not gradients: said once, on the first check
    checks = [
        _outside(sweep, claims, deps, _how(sweep, deps)),
        _inside(sweep, claims, deps, how),
        _other_rows(sweep, deps, how, batch),
        _control(sweep, claims, deps, atol),
    ]
    return Report("mask", checks if ran is None else [ran, *checks])
