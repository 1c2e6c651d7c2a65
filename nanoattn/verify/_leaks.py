"""Collecting deviations where there must be none, and the positive control.

A deviation is compared feature by feature: the largest absolute change of any
single output feature of any batch row, never a mean or a norm over features,
so a leak confined to one head of many (a few features of the output) counts
at its full size.
"""

import dataclasses

import numpy as np

from ._report import CheckResult

SENSITIVITY = 10.0  # a positive control must move an output by more than SENSITIVITY * atol


def per_feature(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """|a - b| for outputs (B, P, F), NaN wherever either is not finite (NaN counts as bad)."""
    dev = np.abs(a - b)
    return np.where(np.isfinite(a) & np.isfinite(b), dev, np.nan)


@dataclasses.dataclass
class Leaks:
    """Deviations where there must be none: the worst one, and the first above ``atol``.

    ``add`` takes a deviation (B, P, F): per batch row, position along ``axis``
    and output feature. The first leak is the smallest sort key ``(*key, p)``;
    its sentence names the position, row and feature.
    """

    atol: float
    worst: float = 0.0
    worst_at: dict | None = None
    first: tuple | None = None  # (sort key, deviation, where, sentence)
    trials: int = 0

    def add(
        self,
        deviation: np.ndarray,
        where: dict,
        key: tuple,
        sentence: str,
        axis: str = "position",
        named: tuple[str, str] | tuple = ("batch", "feature"),
    ) -> None:
        """``named``: the keys ``where`` gets for the row and feature (none: ``()``)."""
        self.trials += 1
        if deviation.size == 0:
            return
        deviation = np.where(np.isnan(deviation), np.inf, deviation)
        B, _, F = deviation.shape
        b, p, f = np.unravel_index(np.argmax(deviation), deviation.shape)
        if deviation[b, p, f] > self.worst:
            self.worst = float(deviation[b, p, f])
            self.worst_at = where | {axis: int(p)} | dict(zip(named, (int(b), int(f))))
        bad = np.flatnonzero((deviation > self.atol).any(axis=(0, 2)))
        if bad.size:
            p = int(bad[0])
            b, f = np.unravel_index(np.argmax(deviation[:, p]), (B, F))
            size = float(deviation[b, p, f])
            candidate = (
                (*key, p),
                size,
                where | {axis: p} | dict(zip(named, (int(b), int(f)))),
                sentence.format(position=p, deviation=size, batch=int(b), feature=int(f)),
            )
            if self.first is None or candidate[0] < self.first[0]:
                self.first = candidate

    def result(self, name: str, what: str, first: str = "first leak") -> CheckResult:
        """Passed: ``"{what}, tolerance ..."`` and the worst deviation (rounding: no
        ``where``); failed: ``"{first}: {sentence}"``, the first leak's ``where`` and size in
        ``data["first"]``, and the worst deviation and its ``where``."""
        if self.first is None:
            return CheckResult(name, True, f"{what}, tolerance {self.atol:.3g}", self.worst)
        _, size, where, sentence = self.first
        data = {"first": where | {"deviation": size}}
        return CheckResult(
            name, False, f"{first}: {sentence}", self.worst, self.worst_at, data=data
        )


def positive_control(moved: float, atol: float, outputs: str, where=None, suffix=""):
    """Changing the first token must move ``outputs`` by more than SENSITIVITY * atol."""
    threshold = SENSITIVITY * atol
    if moved > threshold:
        detail = (
            f"changing the first token moved {outputs} by at least {moved:.3g} "
            f"(must exceed {threshold:.3g}){suffix}"
        )
    else:
        detail = (
            f"insensitive: changing the first token moved {outputs} by only {moved:.3g} "
            f"(must exceed {threshold:.3g}); a constant or broken function cannot pass"
        )
    return CheckResult("positive control", bool(moved > threshold), detail, moved, where)
