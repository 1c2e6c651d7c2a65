"""The padding check for any attention function or decoder, on float inputs or token ids."""

import numpy as np

from ._bounds import SubjectFailed, call, check_max_len, runs_check, skipped
from ._inputs import Inputs, as_features
from ._leaks import positive_control
from ._report import CheckResult, Report

DEFAULT_SEQ_LEN = 9
CHECKS = (
    "padded content is ignored (right padding)",
    "padded content is ignored (left padding)",
    "positive control",
)


def check_padding(
    fn,
    *,
    d_model: int | None = None,
    vocab: int | None = None,
    lengths=None,
    batch: int = 2,
    seq_len: int | None = None,
    max_len: int | None = None,
    seed: int = 0,
    atol: float = 1e-5,
    huge: float = 1e6,
) -> Report:
    """Proves that ``fn`` ignores the content of padded positions.

    ``fn(x, kv_valid)`` takes x, float32 (B, T, D) (pass ``d_model``) or int32
    token ids (B, T) in [0, V) (pass ``vocab``), and ``kv_valid`` boolean
    (B, T), True at real tokens, and returns (B, T, ...). Changing the content
    at invalid positions (floats: to ``+-huge``; token ids: to other ids) must
    leave every output at a valid position unchanged (within ``atol``, feature
    by feature) and finite, with the placeholders after the real tokens (right
    padding) and before them (left padding): a causal function that ignores
    ``kv_valid`` passes the first but not the second. Positive control:
    changing the first (valid) token must change some valid output by more
    than ``10 * atol``, so a function that ignores its input cannot pass.

    Args:
      lengths: valid tokens per batch row, (B,); by default the first row is
        full and later rows are shorter.
      seq_len: T; by default 9, or ``max_len`` when that is shorter.
      max_len: None, or the longest length ``fn`` takes (a fixed context); a
        ValueError when ``seq_len`` exceeds it.

    When ``fn`` raises, the report has a failed check ``"fn runs"`` naming
    the length and the error, and the other checks are skipped: no exception
    of ``fn`` escapes (bad arguments of the check, and an output that is not
    (B, T, ...), raise).

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
    inputs = Inputs.of(d_model, vocab)
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise ValueError(f"batch must be an int >= 1, got batch={batch!r}")
    if not atol >= 0:
        raise ValueError(f"atol must be >= 0, got {atol}")
    max_len = check_max_len(max_len)
    if seq_len is None:
        seq_len = DEFAULT_SEQ_LEN if max_len is None else min(DEFAULT_SEQ_LEN, max_len)
    if seq_len < 1:
        raise ValueError(f"seq_len must be >= 1, got {seq_len}")
    if max_len is not None and seq_len > max_len:
        raise ValueError(f"seq_len={seq_len} exceeds max_len={max_len}: nothing to check")
    if lengths is None:
        lengths = [max(1, seq_len - (b * seq_len) // (batch + 1)) for b in range(batch)]
    lengths = np.asarray(lengths)
    if lengths.shape != (batch,) or (lengths < 0).any() or (lengths > seq_len).any():
        raise ValueError(
            f"lengths must have shape (B,) = ({batch},) with values in [0, {seq_len}], "
            f"got {lengths.tolist()}"
        )
    try:
        checks = _checks(fn, inputs, lengths, batch, seq_len, seed, atol, huge)
    except SubjectFailed as failure:
        ran = runs_check([failure], [seq_len], hint=max_len is None)
        checks = [ran, *map(skipped, CHECKS)]
    return Report("padding", checks)


def _checks(fn, inputs: Inputs, lengths, batch, seq_len, seed, atol, huge) -> list[CheckResult]:
    """Both layouts and the positive control; :class:`SubjectFailed` when ``fn`` raises."""

    def run(x, valid, layout):
        return as_features(call(fn, seq_len, f"{layout} padding", x, valid), x.shape)

    rng = np.random.default_rng(seed)
    right = np.arange(seq_len) < lengths[:, None]  # (B, T): real tokens first
    layouts = {"right": right, "left": right[:, ::-1].copy()}  # placeholders first
    x = inputs.random(rng, batch, seq_len)
    checks, base = [], {}
    for layout, valid in layouts.items():
        y = base[layout] = run(x, valid, layout)
        if inputs.tokens:
            noisy = np.where(valid, x, inputs.changed(rng, x))
            content = "other token ids"
        else:
            signs = np.sign(rng.standard_normal(x.shape))
            noisy = np.where(valid[..., None], x, huge * signs).astype(np.float32)
            content = f"+-{huge:g}"
        dev = np.where(valid, np.abs(run(noisy, valid, layout) - y).max(-1), 0.0)  # (B, T)
        dev = np.where(np.isfinite(dev), dev, np.inf)
        b, t = np.unravel_index(np.argmax(dev), dev.shape)
        worst = float(dev[b, t])
        ok = worst <= atol
        checks.append(
            CheckResult(
                f"padded content is ignored ({layout} padding)",
                ok,
                f"content at {int((~valid).sum())} padded positions set to {content}, "
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
    changed[:, 0] = inputs.changed(rng, x[:, 0])
    moved = float(np.where(valid, np.abs(run(changed, valid, "right") - y).max(-1), 0.0).max())
    checks.append(positive_control(moved, atol, "valid outputs"))
    return checks
