"""The result of a verification: named checks, each passed or failed, with the evidence."""

import dataclasses
from typing import Any


@dataclasses.dataclass(frozen=True)
class CheckResult:
    """One named check.

    Attributes:
      name: what was checked, e.g. ``"prefix invariance"``.
      passed: whether it held (a skipped check counts as passed).
      detail: a sentence of evidence: what was tried, or what went wrong.
      worst: the worst deviation seen (None where no number applies).
      where: where it was seen, e.g. ``{"length": 8, "split": 4, "position": 3}``.
      skipped: the check could not run (say why in ``detail``).
      data: extra facts, e.g. a traced stage's shape.
    """

    name: str
    passed: bool
    detail: str = ""
    worst: float | None = None
    where: dict[str, Any] | None = None
    skipped: bool = False
    data: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def status(self) -> str:
        return "SKIP" if self.skipped else "PASS" if self.passed else "FAIL"

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self) | {"status": self.status}


def _fmt_worst(x: float | None) -> str:
    return "" if x is None else f"{x:.3g}"


def _fmt_where(where: dict[str, Any] | None) -> str:
    return "" if not where else ", ".join(f"{k} {v}" for k, v in where.items())


@dataclasses.dataclass(frozen=True)
class Report:
    """A list of checks about one subject; it passes when every check passes.

    ``str(report)`` is a readable table; :meth:`raise_if_failed` raises
    ``AssertionError`` with that table, for use in a pytest suite::

        check_causality(my_layer, d_model=64).raise_if_failed()
    """

    title: str
    checks: list[CheckResult]

    @property
    def passed(self) -> bool:
        return all(c.passed for c in self.checks)

    def raise_if_failed(self) -> "Report":
        if not self.passed:
            raise AssertionError(f"verification failed\n{self}")
        return self

    def to_dict(self) -> dict[str, Any]:
        return {
            "title": self.title,
            "passed": self.passed,
            "checks": [c.to_dict() for c in self.checks],
        }

    def __str__(self) -> str:
        rows = [("check", "result", "worst", "where", "detail")]
        rows += [
            (c.name, c.status, _fmt_worst(c.worst), _fmt_where(c.where), c.detail)
            for c in self.checks
        ]
        widths = [max(len(r[i]) for r in rows) for i in range(4)]
        lines = [f"{self.title}: {'PASS' if self.passed else 'FAIL'}"]
        for r in rows:
            lines.append("  " + "  ".join(r[i].ljust(widths[i]) for i in range(4)) + "  " + r[4])
        return "\n".join(line.rstrip() for line in lines)
