"""The causality check for any attention function or decoder, on float inputs
or token ids, at many lengths, under ``jax.jit`` and eagerly.

The check is black-box: it calls ``fn`` on random inputs that differ in a
controlled way and compares the outputs feature by feature. A negative control
(changing the future must change nothing) is always paired with a positive
control (changing a visible token must change something), so a constant or
broken function can never pass.

The sweep (lengths, modes, inputs: ``_sweep.py``) is made once; each probe
(``_probes.py``, ``_receptive_field.py``) reads it and returns its own check.
"""

from ._bounds import SubjectFailed, runs_check, skipped, within
from ._inputs import Inputs
from ._probes import SingleChanges, first_token_control, future_perturbation, prefix_invariance
from ._receptive_field import receptive_field
from ._report import Report
from ._sweep import DEFAULT_SEQ_LENS as DEFAULT_SEQ_LENS
from ._sweep import Sweep
from ._sweep import changed_positions as changed_positions
from ._sweep import split_points as split_points

CHECKS = ("prefix invariance", "future perturbation", "positive control", "receptive field")


def _lengths(seq_lens, batch, atol: float) -> list[int]:
    """``seq_lens`` as ints, after checking it and ``batch`` and ``atol``."""
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise ValueError(f"batch must be an int >= 1, got batch={batch!r}")
    if not atol >= 0:
        raise ValueError(f"atol must be >= 0, got {atol}")
    seq_lens = [int(T) for T in seq_lens]
    if not seq_lens or min(seq_lens) < 1:
        raise ValueError(f"seq_lens must be non-empty lengths >= 1, got {seq_lens}")
    return seq_lens


def check_causality(
    fn,
    *,
    d_model: int | None = None,
    vocab: int | None = None,
    seq_lens=DEFAULT_SEQ_LENS,
    max_len: int | None = None,
    batch: int = 2,
    seed: int = 0,
    atol: float = 1e-5,
) -> Report:
    """Proves that ``fn`` hides the future, at many lengths, jitted and eagerly.

    ``fn`` maps a float32 array (B, T, D) (pass ``d_model``) or int32 token
    ids (B, T) in [0, V) (pass ``vocab``) to (B, T, ...) in evaluation mode:
    an attention layer, or a whole decoder. It may be a jax function or return
    anything numpy can read. Outputs are compared feature by feature (the
    largest change of any one output feature of any row), so a leak in one
    head of many counts at its full size. At every length T:

    * prefix invariance: two inputs that share ``x[:, :p]`` and have
      independent random futures give outputs equal within ``atol`` on
      ``[:, :p]``, for split points p = 1, T//2, T-1 and the powers of two
      from 32 below T (every p when T <= 17);
    * future perturbation: changing the single token s (in every batch row)
      changes no output before s, for every s when T <= 64; past 64, for
      s = 1, 2, T//2, T-2, T-1 and b-1, b, b+1 around every power of two b
      from 32 (where blockwise kernels switch blocks), a bounded number of calls;
    * positive control: changing the first token changes some later output
      by more than ``10 * atol`` (the only output when T = 1); otherwise the
      function is insensitive and the check fails;
    * receptive field: for float inputs and a ``fn`` differentiable with jax,
      at every length up to 64, the gradient of every output t of every batch
      row is exactly zero from every input s > t and from every other row,
      and not all zero over s <= t (each output's features weighted by one
      random probe); for token ids, which have no gradient, the same exactly,
      by perturbation, at every length: outputs bit-for-bit unchanged by the
      single-token changes above and when every other row changes, and every
      output changes when every token does. Skipped, and said so, for a
      numpy function on floats.

    The sweep runs at every length under ``jax.jit`` (compiled by the check,
    so also when ``fn`` is not jitted) and once more eagerly, under
    ``jax.disable_jit``, at the longest requested length up to 17: a function
    that leaks only when traced, or only when not, fails. A function that jax
    cannot trace runs as given at every length.

    A model with a fixed context (nanoGPT's ``block_size``, a precomputed mask)
    is checked up to it with ``max_len``: lengths above it are not tried. A
    length where ``fn`` raises is left out and the others are still checked: the
    report starts with a failed check ``"fn runs"`` naming the lengths and the
    first error (every one in ``data["failed"]``); when ``fn`` raises at every
    length, the other checks are skipped. No exception of ``fn`` escapes; bad
    arguments of the check, and an output that is not (B, T, ...), raise.

    Args:
      max_len: None, or the longest length to try (an int >= 1); a ValueError
        when it is below every length of ``seq_lens``.

    Returns:
      A :class:`Report`. A failed leak check names the first leak: length,
      mode, position, batch row and output feature (``where``).

    Example:
      >>> import jax.numpy as jnp
      >>> prefix_mean = lambda x: jnp.cumsum(x, axis=1) / jnp.arange(1, x.shape[1] + 1)[:, None]
      >>> check_causality(prefix_mean, d_model=4, seq_lens=(1, 5)).passed
      True
      >>> check_causality(lambda x: x[:, ::-1], d_model=4, seq_lens=(1, 5)).passed
      False
      >>> embed = jnp.arange(30.0).reshape(10, 3)  # a model on token ids: embed, then prefix sums
      >>> check_causality(lambda ids: jnp.cumsum(embed[ids], 1), vocab=10, seq_lens=(4,)).passed
      True
      >>> mask = jnp.tril(jnp.ones((4, 4)))  # a fixed context of 4: fails past it
      >>> bounded = lambda x: jnp.einsum("TS,BSD->BTD", mask[: x.shape[1], : x.shape[1]], x)
      >>> check_causality(bounded, d_model=4, seq_lens=(1, 3, 5), max_len=4).passed
      True
      >>> report = check_causality(bounded, d_model=4, seq_lens=(1, 3, 5))
      >>> report.passed, report.checks[0].name, report.checks[0].where
      (False, 'fn runs', {'length': 5, 'mode': 'jit'})
    """
    inputs = Inputs.of(d_model, vocab)
    lengths = within(_lengths(seq_lens, batch, atol), max_len, "seq_lens")
    sweep = Sweep.of(fn, inputs, lengths, batch, seed)
    while True:  # each failure leaves a run out, so this ends
        try:
            return _report(fn, sweep, atol, seed, max_len is None)
        except SubjectFailed as failure:  # fn raised in a probe: check without that run
            sweep = sweep.without(failure)


def _report(fn, sweep: Sweep, atol: float, seed: int, hint: bool) -> Report:
    """Every probe over ``sweep``, after the lengths where ``fn`` raised, if any
    (``hint``: say that ``max_len`` leaves lengths out)."""
    ran = runs_check(list(sweep.failures), list(sweep.lengths), hint)
    if not sweep.main_runs:
        return Report("causality", [ran, *map(skipped, CHECKS)])
    changes = SingleChanges.of(sweep, atol)  # read by two probes: fn runs once per change
    checks = [
        prefix_invariance(sweep, atol),
        future_perturbation(sweep, changes),
        first_token_control(sweep, atol),
        receptive_field(fn, sweep, changes, seed),
    ]
    return Report("causality", checks if ran is None else [ran, *checks])
