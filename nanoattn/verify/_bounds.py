"""Subjects with a fixed context: the lengths a check may try (``max_len``), and what
a check does when the subject raises at one length (nanoGPT's ``block_size``, a
precomputed mask sliced past its size): that length fails, named with the error,
and the other lengths are still checked. No exception of the subject escapes.

Errors in the arguments of the check itself still raise before any work, and so
does an output of the wrong shape (the subject does not follow the protocol).
"""

import numbers

import numpy as np

from .._base.validate import describe
from ._report import CheckResult

NAME = "fn runs"


def check_max_len(max_len) -> int | None:
    """``max_len`` as an int, or None; a one-line ValueError otherwise."""
    if max_len is None:
        return None
    if isinstance(max_len, bool) or not isinstance(max_len, numbers.Integral) or max_len < 1:
        raise ValueError(f"max_len must be None or an int >= 1, got max_len={max_len!r}")
    return int(max_len)


def within(lengths: list[int], max_len, name: str) -> list[int]:
    """The ``lengths`` (argument ``name``) up to ``max_len``, in order; a ValueError
    naming both when none is left (``max_len`` is checked first)."""
    max_len = check_max_len(max_len)
    if max_len is None:
        return list(lengths)
    kept = [T for T in lengths if T <= max_len]
    if not kept:
        raise ValueError(
            f"every length in {name}={lengths} exceeds max_len={max_len}: nothing to check"
        )
    return kept


class SubjectFailed(Exception):
    """The subject raised at one length: carries the length out of a probe, with how
    the subject was called there (``mode``) and the error in one line."""

    def __init__(self, length: int, mode: str, error: str):
        super().__init__(f"fn raised at length {length} ({mode}): {error}")
        self.length, self.mode, self.error = length, mode, error


def call(fn, length: int, mode: str, *args):
    """``fn(*args)``, read as an array; any exception becomes :class:`SubjectFailed`."""
    try:
        return np.asarray(fn(*args))
    except Exception as e:  # whatever the subject raises: this length fails, not the check
        raise SubjectFailed(length, mode, describe(e)) from e


def runs_check(
    failures: list[SubjectFailed], lengths: list[int], hint: bool = False
) -> CheckResult | None:
    """The failed check naming where the subject raised (the first error in the detail,
    every one in ``data["failed"]``), or None when it raised nowhere. ``lengths``: the
    lengths tried; ``hint``: say that ``max_len`` leaves lengths out."""
    if not failures:
        return None
    failures = sorted(failures, key=lambda f: lengths.index(f.length))
    first = failures[0]
    failed = list(dict.fromkeys(f.length for f in failures))  # a length once, in order
    named, tried = ", ".join(map(str, failed)), len(set(lengths))
    if len(failed) == tried:
        which = f"at every length ({named}), so nothing was checked"
    else:
        which = f"at {len(failed)} of {tried} lengths ({named}), checked at the others"
    if hint:
        which += " (max_len leaves out the lengths past a fixed context)"
    return CheckResult(
        NAME,
        False,
        f"fn raised {which}; at length {first.length} ({first.mode}): {first.error}",
        where={"length": first.length, "mode": first.mode},
        data={
            "failed": [{"length": f.length, "mode": f.mode, "error": f.error} for f in failures],
            "lengths": list(lengths),
        },
    )


def skipped(name: str) -> CheckResult:
    """A check that could not run because the subject raised at every length."""
    return CheckResult(name, True, "skipped, fn raised at every length", skipped=True)


def raised_everywhere(report) -> str | None:
    """The first error when the subject raised at every length the report tried, else None."""
    for check in report.checks:
        if check.name == NAME and not check.passed:
            failed, lengths = check.data["failed"], check.data["lengths"]
            if len({f["length"] for f in failed}) == len(set(lengths)):
                return failed[0]["error"]
    return None
