"""Row-sum checks on attention weights."""

import numpy as np

from .._validate import expect_bool, expect_broadcastable
from ._report import CheckResult, Report


def _at(index: tuple[int, ...], names: tuple[str, ...] | None) -> dict:
    if names is None:
        return {"index": [int(i) for i in index]}
    return dict(zip(names, (int(i) for i in index)))


def check_row_sums(weights, allowed, *, atol: float = 1e-5) -> Report:
    """Checks normalised attention weights against the mask that produced them.

    Three checks: every row with a permitted cell sums to 1 (within ``atol``);
    every blocked cell is exactly 0; every row with no permitted cell is all
    zeros (nanoattn's convention, docs/conventions.md).

    Args:
      weights: (..., T, S), e.g. (B, N, T, S).
      allowed: boolean, True = permitted, broadcastable to ``weights``, e.g.
        (T, S).

    Returns:
      A :class:`Report`; ``where`` names the (batch, head, query, key) index of
      the worst deviation.

    Example:
      >>> import numpy as np
      >>> w = np.array([[1.0, 0.0], [0.5, 0.5]])
      >>> check_row_sums(w, np.tril(np.ones((2, 2), bool))).passed
      True
    """
    w = np.asarray(weights, np.float64)
    allowed = np.asarray(allowed)
    expect_bool("allowed", allowed.dtype)
    axes = " ".join("B N T S".split()[-w.ndim :]) if w.ndim <= 4 else "... T S"
    expect_broadcastable("allowed", allowed.shape, axes, w.shape)
    allowed = np.broadcast_to(allowed, w.shape)
    cell_names = ("batch", "head", "query", "key")[-w.ndim :] if w.ndim <= 4 else None
    row_names = cell_names and cell_names[:-1]
    has_key = allowed.any(-1)

    checks = []
    sums = w.sum(-1)
    dev = np.where(has_key, np.abs(sums - 1), 0.0)
    worst = np.unravel_index(np.argmax(dev), dev.shape) if dev.size else ()
    worst_dev = float(dev[worst]) if dev.size else 0.0
    checks.append(
        CheckResult(
            "permitted rows sum to 1",
            worst_dev <= atol,
            f"{int(has_key.sum())} rows with a permitted cell, tolerance {atol:g}",
            worst_dev,
            _at(worst, row_names) if worst_dev > 0 else None,
        )
    )

    blocked = np.where(allowed, 0.0, np.abs(w))
    worst = np.unravel_index(np.argmax(blocked), blocked.shape) if blocked.size else ()
    worst_dev = float(blocked[worst]) if blocked.size else 0.0
    checks.append(
        CheckResult(
            "blocked cells are 0",
            worst_dev == 0.0,
            f"{int((~allowed).sum())} blocked cells, must be exactly 0",
            worst_dev,
            _at(worst, cell_names) if worst_dev > 0 else None,
        )
    )

    empty = np.where(has_key[..., None], 0.0, np.abs(w)).max(-1) if w.size else np.zeros(())
    worst = np.unravel_index(np.argmax(empty), empty.shape) if empty.size else ()
    worst_dev = float(empty[worst]) if empty.size else 0.0
    checks.append(
        CheckResult(
            "fully blocked rows are 0",
            worst_dev == 0.0,
            f"{int((~has_key).sum())} rows with no permitted cell, must be all zeros",
            worst_dev,
            _at(worst, row_names) if worst_dev > 0 else None,
        )
    )
    return Report("row sums", checks)
