"""Row-sum checks on attention weights."""

import numpy as np

from .._base.validate import expect_bool, expect_broadcastable
from ._report import CheckResult, Report


def _at(index: tuple[int, ...], names: tuple[str, ...] | None) -> dict:
    if names is None:
        return {"index": [int(i) for i in index]}
    return dict(zip(names, (int(i) for i in index)))


def _worst(name: str, deviation: np.ndarray, names, tolerance: float, detail: str):
    """A check that passes when every deviation is at most ``tolerance``."""
    index = np.unravel_index(np.argmax(deviation), deviation.shape) if deviation.size else ()
    worst = float(deviation[index]) if deviation.size else 0.0
    where = _at(index, names) if worst > 0 else None
    return CheckResult(name, worst <= tolerance, detail, worst, where)


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
    if not atol >= 0:
        raise ValueError(f"atol must be >= 0, got {atol}")
    w = np.asarray(weights, np.float64)
    allowed = np.asarray(allowed)
    expect_bool("allowed", allowed.dtype)
    axes = " ".join("B N T S".split()[-w.ndim :]) if w.ndim <= 4 else "... T S"
    expect_broadcastable("allowed", allowed.shape, axes, w.shape)
    allowed = np.broadcast_to(allowed, w.shape)
    cell_names = ("batch", "head", "query", "key")[-w.ndim :] if w.ndim <= 4 else None
    row_names = cell_names and cell_names[:-1]
    has_key = allowed.any(-1)

    row_dev = np.where(has_key, np.abs(w.sum(-1) - 1), 0.0)
    cell_dev = np.where(allowed, 0.0, np.abs(w))
    empty_dev = np.where(has_key[..., None], 0.0, np.abs(w)).max(-1, initial=0.0)
    checks = [
        _worst(
            "permitted rows sum to 1",
            row_dev,
            row_names,
            atol,
            f"{int(has_key.sum())} rows with a permitted cell, tolerance {atol:g}",
        ),
        _worst(
            "blocked cells are 0",
            cell_dev,
            cell_names,
            0.0,
            f"{int((~allowed).sum())} blocked cells, must be exactly 0",
        ),
        _worst(
            "fully blocked rows are 0",
            empty_dev,
            row_names,
            0.0,
            f"{int((~has_key).sum())} rows with no permitted cell, must be all zeros",
        ),
    ]
    return Report("row sums", checks)
