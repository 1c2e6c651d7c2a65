"""Causality and padding checks for any attention function or decoder.

The checks are black-box: they call ``fn`` on random inputs that differ in a
controlled way and compare the outputs. A negative control (changing the
future, or padded content, must change nothing) is always paired with a
positive control (changing a visible token must change something), so a
constant or broken function can never pass.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from .._validate import describe
from ._report import CheckResult, Report

DEFAULT_SEQ_LENS = (1, 2, 3, 5, 8, 16, 17, 33, 64)
EVERY_SPLIT_UP_TO = 17  # sequences this short are split at every position
SENSITIVITY = 10.0  # a positive control must move an output by more than SENSITIVITY * atol


def _call(fn, x, *args) -> np.ndarray:
    """Calls ``fn`` and returns its output as float64 (B, T, F)."""
    y = np.asarray(fn(x, *args))
    if y.ndim < 2 or y.shape[:2] != x.shape[:2]:
        raise ValueError(
            f"fn must map an input of shape (B, T, D) = {x.shape} to (B, T, ...), got {y.shape}"
        )
    return y.reshape(y.shape[0], y.shape[1], -1).astype(np.float64)


def _split_points(T: int) -> list[int]:
    if T <= EVERY_SPLIT_UP_TO:
        return list(range(1, T))
    return sorted({1, T // 2, T - 1})


@dataclasses.dataclass
class _Leaks:
    """Deviations where there must be none: the worst one, and the first above atol."""

    atol: float
    worst: float = 0.0
    worst_at: dict | None = None
    first: tuple | None = None  # (sort key, deviation, where, sentence)
    trials: int = 0

    def add(
        self, deviation: np.ndarray, where: dict, key: tuple, sentence: str, axis="position"
    ) -> None:
        """``deviation``: (P,) per position along ``axis``, checked in order."""
        self.trials += 1
        if deviation.size == 0:
            return
        pos = int(np.argmax(deviation))
        if deviation[pos] > self.worst or not np.isfinite(deviation[pos]):
            self.worst, self.worst_at = float(deviation[pos]), where | {axis: pos}
        bad = np.flatnonzero(~(deviation <= self.atol))  # NaN counts as bad
        if bad.size:
            p = int(bad[0])
            candidate = (
                (*key, p),
                float(deviation[p]),
                where | {axis: p},
                sentence.format(position=p, deviation=float(deviation[p])),
            )
            if self.first is None or candidate[0] < self.first[0]:
                self.first = candidate

    def result(self, name: str, what: str) -> CheckResult:
        if self.first is None:
            return CheckResult(
                name,
                True,
                f"{self.trials} {what}, tolerance {self.atol:g}",
                self.worst,
                self.worst_at,
            )
        sentence = self.first[3]
        return CheckResult(name, False, f"first leak: {sentence}", self.worst, self.worst_at)


def _positive_control(moved: float, atol: float, outputs: str, where=None, suffix=""):
    """Changing the first token must move ``outputs`` by more than SENSITIVITY * atol."""
    threshold = SENSITIVITY * atol
    if moved > threshold:
        detail = (
            f"changing the first token moved {outputs} by at least {moved:.3g} "
            f"(must exceed {threshold:g}){suffix}"
        )
    else:
        detail = (
            f"insensitive: changing the first token moved {outputs} by only {moved:.3g} "
            f"(must exceed {threshold:g}); a constant or broken function cannot pass"
        )
    return CheckResult("positive control", bool(moved > threshold), detail, moved, where)


def _check_args(d_model: int, batch: int, atol: float) -> None:
    if d_model < 1 or batch < 1:
        raise ValueError(f"d_model and batch must be >= 1, got d_model={d_model}, batch={batch}")
    if not atol >= 0:
        raise ValueError(f"atol must be >= 0, got {atol}")


def _receptive_field(fn, x: np.ndarray, seed: int):
    """|d output t / d input s| for batch row 0, as (T, T), and the largest
    gradient reaching other batch rows; None when ``fn`` cannot be
    differentiated with jax (the reason is returned instead)."""
    T = x.shape[1]

    @jax.jit  # one compiled program per length instead of one per operation
    def output_gradients(x):
        y, vjp = jax.vjp(lambda a: jnp.asarray(fn(a)), x)
        probe = jax.random.normal(jax.random.key(seed), y.shape[2:], y.dtype)
        cotangents = jnp.zeros((T, *y.shape), y.dtype)
        cotangents = cotangents.at[jnp.arange(T), 0, jnp.arange(T)].set(probe)
        return jax.vmap(vjp)(cotangents)[0]  # (T out, B, T in, D)

    try:
        grads = output_gradients(jnp.asarray(x))
    except Exception as e:  # any failure to trace means: not differentiable with jax
        return None, describe(e)
    grads = np.abs(np.asarray(grads, np.float64))
    jac = grads[:, 0].reshape(T, T, -1).max(-1)  # (T out, T in)
    other_rows = float(grads[:, 1:].max()) if grads.shape[1] > 1 else 0.0
    return (jac, other_rows), None


def check_causality(
    fn,
    *,
    d_model: int,
    seq_lens=DEFAULT_SEQ_LENS,
    batch: int = 2,
    seed: int = 0,
    atol: float = 1e-5,
) -> Report:
    """Proves that ``fn`` hides the future, at many lengths.

    ``fn`` maps a float32 array (B, T, D) to (B, T, ...) in evaluation mode:
    an attention layer, or a whole decoder on embeddings. It may be a jax
    function or return anything numpy can read. Checks, at every length T:

    * prefix invariance: two inputs that share ``x[:, :p]`` and have
      independent random futures give outputs equal within ``atol`` on
      ``[:, :p]``, for split points p = 1, T//2, T-1 (every p when
      T <= 17);
    * future perturbation: changing the single token s changes no output
      before s, for every s (this finds one position that sees the next
      anywhere in the sequence);
    * positive control: changing the first token changes some later output
      by more than ``10 * atol`` (the only output when T = 1); otherwise the
      function is insensitive and the check fails;
    * receptive field, when ``fn`` is differentiable with jax: the gradient
      of output t with respect to input s is exactly zero for s > t, not all
      zero over s <= t, and zero for other batch rows.

    Returns:
      A :class:`Report`. A failed leak check names the first leaking output
      position (``where``: length, split or changed position, position).

    Example:
      >>> import jax.numpy as jnp
      >>> prefix_mean = lambda x: jnp.cumsum(x, axis=1) / jnp.arange(1, x.shape[1] + 1)[:, None]
      >>> check_causality(prefix_mean, d_model=4, seq_lens=(1, 5)).passed
      True
      >>> check_causality(lambda x: x[:, ::-1], d_model=4, seq_lens=(1, 5)).passed
      False
    """
    _check_args(d_model, batch, atol)
    seq_lens = [int(T) for T in seq_lens]
    if not seq_lens or min(seq_lens) < 1:
        raise ValueError(f"seq_lens must be non-empty lengths >= 1, got {seq_lens}")
    rng = np.random.default_rng(seed)
    prefix, single = _Leaks(atol), _Leaks(atol)
    future = _Leaks(0.0)
    weakest, weakest_at, control_trials = np.inf, None, 0
    dead: list[str] = []
    batch_leak, skipped_reason = 0.0, None

    def noise(*shape):
        return rng.standard_normal(shape).astype(np.float32)

    for T in seq_lens:
        x = noise(batch, T, d_model)
        y = _call(fn, x)
        for p in _split_points(T):
            other = x.copy()
            other[:, p:] = noise(batch, T - p, d_model)
            dev = np.abs(_call(fn, other)[:, :p] - y[:, :p]).max(axis=(0, 2))
            prefix.add(
                dev,
                {"length": T, "split": p},
                (T,),
                f"output {{position}} changed by {{deviation:.3g}} when only positions "
                f">= {p} changed (T={T})",
            )
        for s in range(1, T):
            other = x.copy()
            other[:, s] = noise(batch, d_model)
            dev = np.abs(_call(fn, other)[:, :s] - y[:, :s]).max(axis=(0, 2))
            single.add(
                dev,
                {"length": T, "changed": s},
                (T,),
                f"output {{position}} changed by {{deviation:.3g}} when only position "
                f"{s} changed (T={T})",
            )

        changed = x.copy()
        changed[:, 0] = noise(batch, d_model) * 2
        later = slice(1, None) if T > 1 else slice(0, 1)
        moved = float(np.abs(_call(fn, changed)[:, later] - y[:, later]).max())
        control_trials += 1
        if not moved > weakest:
            weakest, weakest_at = moved, {"length": T}

        if skipped_reason is None:
            field, skipped_reason = _receptive_field(fn, x, seed)
            if field is not None:
                jac, other_rows = field
                batch_leak = max(batch_leak, other_rows)
                later = np.triu(np.ones((T, T), bool), 1)  # later[t, s]: s > t
                for t in range(T):
                    future.add(
                        np.where(later[t], jac[t], 0.0),
                        {"length": T, "output": t},
                        (T, t),
                        f"output {t} has gradient {{deviation:.3g}} from the "
                        f"later input {{position}} (T={T})",
                        axis="input",
                    )
                    if not jac[t, : t + 1].any() and len(dead) < 3:
                        dead.append(f"output {t} (T={T})")

    checks = [
        prefix.result("prefix invariance", "shared-prefix pairs with random futures"),
        single.result("future perturbation", "single-token changes"),
    ]
    checks.append(
        _positive_control(
            weakest, atol, "later outputs", weakest_at, f" at each of {control_trials} lengths"
        )
    )
    if skipped_reason is not None:
        checks.append(
            CheckResult(
                "receptive field",
                True,
                f"skipped, fn is not differentiable with jax ({skipped_reason})",
                skipped=True,
            )
        )
    else:
        result = future.result("receptive field", "")
        problems = [] if result.passed else [result.detail]
        if dead:
            problems.append(f"no gradient from any visible input for {', '.join(dead)}")
        if batch_leak > 0:
            problems.append(f"gradient {batch_leak:.3g} reaches other batch rows")
        detail = "; ".join(problems) or (
            f"gradients of {future.trials} outputs: exactly 0 from every later input and "
            "other batch row, non-zero from earlier inputs"
        )
        checks.append(dataclasses.replace(result, passed=not problems, detail=detail))
    return Report("causality", checks)


def check_padding(
    fn,
    *,
    d_model: int,
    lengths=None,
    batch: int = 2,
    seq_len: int = 9,
    seed: int = 0,
    atol: float = 1e-5,
    huge: float = 1e6,
) -> Report:
    """Proves that ``fn`` ignores the content of padded positions.

    ``fn(x, kv_valid)`` takes x float32 (B, T, D) and ``kv_valid`` boolean
    (B, T), True at real tokens, and returns (B, T, ...). Setting the content
    at invalid positions to ``+-huge`` must leave every output at a valid
    position unchanged (within ``atol``) and finite, with the placeholders
    after the real tokens (right padding) and before them (left padding): a
    causal function that ignores ``kv_valid`` passes the first but not the
    second. Positive control:
    changing the first (valid) token must change some valid output by more
    than ``10 * atol``, so a function that ignores its input cannot pass.

    Args:
      lengths: valid tokens per batch row, (B,); by default the first row is
        full and later rows are shorter.

    Example:
      >>> import jax.numpy as jnp
      >>> def masked_mean(x, valid):
      ...     w = valid[:, :, None]
      ...     mean = (x * w).sum(1, keepdims=True) / w.sum(1, keepdims=True)
      ...     return jnp.broadcast_to(mean, x.shape)
      >>> check_padding(masked_mean, d_model=4).passed
      True
      >>> check_padding(lambda x, valid: jnp.broadcast_to(x.mean(1, keepdims=True), x.shape),
      ...               d_model=4).passed
      False
    """
    _check_args(d_model, batch, atol)
    if seq_len < 1:
        raise ValueError(f"seq_len must be >= 1, got {seq_len}")
    if lengths is None:
        lengths = [max(1, seq_len - (b * seq_len) // (batch + 1)) for b in range(batch)]
    lengths = np.asarray(lengths)
    if lengths.shape != (batch,) or (lengths < 0).any() or (lengths > seq_len).any():
        raise ValueError(
            f"lengths must have shape (B,) = ({batch},) with values in [0, {seq_len}], "
            f"got {lengths.tolist()}"
        )
    rng = np.random.default_rng(seed)
    right = np.arange(seq_len) < lengths[:, None]  # (B, T): real tokens first
    layouts = {"right": right, "left": right[:, ::-1].copy()}  # placeholders first
    x = rng.standard_normal((batch, seq_len, d_model)).astype(np.float32)
    checks, base = [], {}
    for layout, valid in layouts.items():
        y = base[layout] = _call(fn, x, valid)
        noisy = np.where(valid[..., None], x, huge * np.sign(rng.standard_normal(x.shape)))
        y_noisy = _call(fn, noisy.astype(np.float32), valid)
        dev = np.where(valid, np.abs(y_noisy - y).max(-1), 0.0)  # (B, T)
        dev = np.where(np.isfinite(dev), dev, np.inf)
        b, t = np.unravel_index(np.argmax(dev), dev.shape)
        worst = float(dev[b, t])
        ok = worst <= atol
        checks.append(
            CheckResult(
                f"padded content is ignored ({layout} padding)",
                ok,
                f"content at {int((~valid).sum())} padded positions set to +-{huge:g}, "
                f"{int(valid.sum())} valid outputs compared, tolerance {atol:g}"
                if ok
                else f"output at valid position {t} of batch row {b} changed by {worst:.3g} "
                "when only padded content changed",
                worst,
                {"batch": int(b), "position": int(t)} if worst > 0 else None,
            )
        )

    valid, y = right, base["right"]
    changed = x.copy()
    changed[:, 0] = 2 * rng.standard_normal((batch, d_model))
    moved = float(np.where(valid, np.abs(_call(fn, changed, valid) - y).max(-1), 0.0).max())
    checks.append(_positive_control(moved, atol, "valid outputs"))
    return Report("padding", checks)
