"""The causality check for any attention function or decoder, on float inputs
or token ids, at many lengths, under ``jax.jit`` and eagerly.

The check is black-box: it calls ``fn`` on random inputs that differ in a
controlled way and compares the outputs feature by feature. A negative control
(changing the future must change nothing) is always paired with a positive
control (changing a visible token must change something), so a constant or
broken function can never pass.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from .._validate import describe
from ._inputs import Inputs, as_features, jit
from ._leaks import Leaks, per_feature, positive_control
from ._report import CheckResult, Report

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
class _Mode:
    """One way of calling ``fn``: ``"jit"`` (under ``jax.jit``) or ``"eager"``."""

    name: str
    call: object
    lengths: frozenset


def _modes(fn, inputs: Inputs, seq_lens: list[int], batch: int, seed: int):
    """Every length under ``jax.jit``, and one length eagerly (``jax.disable_jit``, so
    a jitted ``fn`` runs op by op too); a function jax cannot trace runs as given at
    every length. Returns the modes and, for such a function, why."""
    x = inputs.random(np.random.default_rng((seed, seq_lens[0])), batch, seq_lens[0])
    short, long = jit(fn), jax.jit(fn)

    def jitted(x):  # past 64 tokens a call costs more than its compile: optimise it
        return (short if x.shape[1] <= EVERY_POSITION_UP_TO else long)(x)

    try:
        jax.block_until_ready(jitted(x))
    except Exception as e:  # any failure to trace means: not a jax function
        return [_Mode("eager", fn, frozenset(seq_lens))], describe(e)

    def eager(x):
        with jax.disable_jit():
            return fn(x)

    up_to = [T for T in seq_lens if T <= EAGER_UP_TO]
    eager_at = max(up_to) if up_to else min(seq_lens)
    return [
        _Mode("jit", jitted, frozenset(seq_lens)),
        _Mode("eager", eager, frozenset({eager_at})),
    ], None


def _output_gradients(fn, x: np.ndarray, outputs: list[int], seed: int):
    """|d output (b, t) / d input (b', s)| for every row b and t in ``outputs``, the
    largest over input features: (R, B, T) with R = B * len(outputs) in the order
    (b, t). Each output's features are weighted by one random probe, so no feature's
    gradient can be averaged away. None when ``fn`` cannot be differentiated with
    jax (the reason is returned instead)."""
    B, T = x.shape[:2]
    rows_b = np.repeat(np.arange(B), len(outputs))
    rows_t = np.tile(np.asarray(outputs), B)
    R = len(rows_b)

    @jit
    def gradients(x):
        y, vjp = jax.vjp(lambda a: jnp.asarray(fn(a)), x)
        probe = jax.random.normal(jax.random.key(seed), y.shape[2:], y.dtype)
        cotangents = jnp.zeros((R, *y.shape), y.dtype).at[jnp.arange(R), rows_b, rows_t].set(probe)
        return jax.vmap(vjp)(cotangents)[0]

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

    def add_gradients(self, grads: np.ndarray, outputs: list[int], T: int) -> None:
        """``grads`` (R, B, T) from :func:`_output_gradients`."""
        B = grads.shape[1]
        later = np.arange(T)
        for r, (b, t) in enumerate((b, t) for b in range(B) for t in outputs):
            g = grads[r]
            self.outputs += 1
            self.future.add(
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
                self.rows(
                    float(others.max()),
                    f"output {t} of row {b} has gradient {{size}} from other batch rows (T={T})",
                )
            if not g[b, : t + 1].any() and len(self.dead) < 3:
                self.dead.append(f"output {t} of row {b} (T={T})")

    def result(self, what: str, dead: str) -> CheckResult:
        """``what``: the detail when it passes; ``dead``: how a dead output shows."""
        result = self.future.result("receptive field", "")
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


def check_causality(
    fn,
    *,
    d_model: int | None = None,
    vocab: int | None = None,
    seq_lens=DEFAULT_SEQ_LENS,
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
    """
    inputs = Inputs.of(d_model, vocab)
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise ValueError(f"batch must be an int >= 1, got batch={batch!r}")
    if not atol >= 0:
        raise ValueError(f"atol must be >= 0, got {atol}")
    seq_lens = [int(T) for T in seq_lens]
    if not seq_lens or min(seq_lens) < 1:
        raise ValueError(f"seq_lens must be non-empty lengths >= 1, got {seq_lens}")
    modes, untraceable = _modes(fn, inputs, seq_lens, batch, seed)
    prefix, single = Leaks(atol), Leaks(atol)
    field, field_skipped = _Field(), None
    trials = {m.name: [0, 0] for m in modes}  # prefix pairs, single changes per mode
    weakest, weakest_at, controls = np.inf, None, 0

    for T in seq_lens:
        x = inputs.random(np.random.default_rng((seed, T)), batch, T)
        for m_index, mode in enumerate(modes):
            if T not in mode.lengths:
                continue
            rng = np.random.default_rng((seed, T, m_index + 1))

            def run(a, mode=mode):
                return as_features(mode.call(a), a.shape)

            y = run(x)
            tag = {"length": T, "mode": mode.name}
            suffix = f"(T={T}, {mode.name})"
            for p in split_points(T):
                other = x.copy()
                other[:, p:] = inputs.random(rng, batch, T - p)
                prefix.add(
                    per_feature(run(other)[:, :p], y[:, :p]),
                    tag | {"split": p},
                    (T, m_index),
                    f"output {{position}} of row {{batch}} (feature {{feature}}) changed by "
                    f"{{deviation:.3g}} when only positions >= {p} changed {suffix}",
                )
                trials[mode.name][0] += 1
            main = m_index == 0  # the eager sweep of a traceable fn (every split) stops here
            exact = inputs.tokens and main
            for s in changed_positions(T) if main else []:
                other = x.copy()
                other[:, s] = inputs.changed(rng, x[:, s])
                dev = per_feature(run(other)[:, :s], y[:, :s])
                sentence = (
                    f"output {{position}} of row {{batch}} (feature {{feature}}) changed by "
                    f"{{deviation:.3g}} when only position {s} changed {suffix}"
                )
                single.add(dev, tag | {"changed": s}, (T, m_index), sentence)
                if exact:  # token ids: the receptive field, exactly, by the same changes
                    field.future.add(dev, tag | {"changed": s}, (T,), sentence)
                trials[mode.name][1] += 1

            changed = x.copy()
            changed[:, 0] = inputs.changed(rng, x[:, 0])
            later = slice(1, None) if T > 1 else slice(0, 1)
            moved = float(np.abs(run(changed)[:, later] - y[:, later]).max())
            controls += 1
            if not moved > weakest:
                weakest, weakest_at = moved, tag

            if exact:
                _exact_rows(field, inputs, rng, run, x, y, T)

        if not inputs.tokens and field_skipped is None and T <= EVERY_POSITION_UP_TO:
            outputs = list(range(T))
            grads, field_skipped = _output_gradients(fn, x, outputs, seed)
            if grads is not None:
                field.add_gradients(grads, outputs, T)

    eager_at = min(modes[-1].lengths)
    checks = [
        prefix.result("prefix invariance", _count(trials, 0, "shared-prefix pairs", eager_at)),
        single.result("future perturbation", _count(trials, 1, "single-token changes", eager_at)),
        positive_control(
            weakest, atol, "later outputs", weakest_at, f" in each of {controls} runs"
        ),
    ]
    if untraceable is not None:
        checks[0] = dataclasses.replace(
            checks[0],
            detail=f"{checks[0].detail}; not under jit, jax cannot trace fn ({untraceable})",
        )
    if inputs.tokens:
        checks.append(
            field.result(
                f"token ids have no gradient, so exactly, by perturbation: outputs "
                f"bit-for-bit unchanged by {field.future.trials} later-token changes and "
                f"{field.outputs} changes of every other row; every output changes when "
                "every token does",
                "unchanged when every token changed",
            )
        )
    elif field_skipped is not None:
        checks.append(
            CheckResult(
                "receptive field",
                True,
                f"skipped, fn is not differentiable with jax ({field_skipped})",
                skipped=True,
            )
        )
    else:
        checks.append(
            field.result(
                f"gradients of {field.outputs} outputs (every batch row): exactly 0 from "
                "every later input and other row, non-zero from earlier inputs",
                "no gradient from any visible input",
            )
        )
    return Report("causality", checks)


def _count(trials: dict, k: int, what: str, eager_at: int | None) -> str:
    """``"single-token changes: 140 under jit and 16 eagerly (length 17)"``."""
    if "jit" not in trials:
        return f"{what}: {trials['eager'][k]} (fn run as given)"
    parts = [f"{trials['jit'][k]} under jit"]
    if trials["eager"][k]:
        parts.append(f"{trials['eager'][k]} eagerly (length {eager_at})")
    return f"{what}: {' and '.join(parts)}"


def _exact_rows(field: _Field, inputs: Inputs, rng, run, x, y, T: int) -> None:
    """Token ids: changing every other row leaves a row bit-for-bit unchanged; changing
    every token changes every output (none depends on nothing visible)."""
    B = x.shape[0]
    for b in range(B if B > 1 else 0):
        other = inputs.changed(rng, x)
        other[b] = x[b]
        field.outputs += 1
        dev = np.nan_to_num(per_feature(run(other)[b], y[b]), nan=np.inf)
        field.rows(
            float(dev.max()),
            f"row {b} changed by {{size}} when only the other rows changed (T={T})",
        )
    moved = np.abs(run(inputs.changed(rng, x)) - y).max(-1)  # (B, T)
    for b, t in zip(*np.nonzero(~(moved > 0))):
        if len(field.dead) < 3:
            field.dead.append(f"output {t} of row {b} (T={T})")
