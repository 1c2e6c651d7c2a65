"""nanoattn.verify.check_row_sums (verify/_weights.py): permitted rows sum to 1, blocked
cells and fully blocked rows are 0, against the library's weights and planted ones, at
2 to 5 axes, with the details and places it reports."""

import re

import jax
import numpy as np
import pytest

from nanoattn import attention_weights
from nanoattn.verify import check_row_sums

from _verify_functions import by_name


def test_row_sums():
    allowed = np.array([[True, True, False], [False, False, False]])
    good = np.array([[0.25, 0.75, 0.0], [0.0, 0.0, 0.0]])
    assert check_row_sums(good, allowed).passed
    bad_sum = by_name(check_row_sums(good * 0.9, allowed))["permitted rows sum to 1"]
    assert not bad_sum.passed and bad_sum.where == {"query": 0}
    assert bad_sum.worst == pytest.approx(0.1)
    leak = np.array([[0.2, 0.7, 0.1], [0, 0, 0]])
    cells = by_name(check_row_sums(leak, allowed))["blocked cells are 0"]
    assert not cells.passed and cells.where == {"query": 0, "key": 2}
    blocked = good + np.array([[0, 0, 0], [0.5, 0.5, 0]])
    rows = by_name(check_row_sums(blocked, allowed))["fully blocked rows are 0"]
    assert not rows.passed and rows.where == {"query": 1}


def test_row_sums_broadcast_against_the_library_weights():
    q = jax.random.normal(jax.random.key(0), (2, 5, 3, 4))
    w = attention_weights(q, q, is_causal=True)
    report = check_row_sums(w, np.tril(np.ones((5, 5), bool)))
    assert report.passed and by_name(report)["permitted rows sum to 1"].worst < 1e-5
    wrong = check_row_sums(w, np.eye(5, dtype=bool))  # the weights leak beyond this mask
    worst = by_name(wrong)["blocked cells are 0"]
    assert not worst.passed and set(worst.where) == {"batch", "head", "query", "key"}


def test_row_sums_input_errors():
    with pytest.raises(TypeError, match="allowed must be a boolean"):
        check_row_sums(np.ones((2, 2)), np.ones((2, 2)))
    with pytest.raises(ValueError, match=r"allowed must be broadcastable to \(T, S\) = \(2, 2\)"):
        check_row_sums(np.ones((2, 2)), np.ones((3, 2), bool))


# Details a mutation audit found unpinned: report text, boundaries, non-finite outputs


def test_row_sums_details_and_five_axis_weights():
    allowed = np.array([[True, True, False], [False, False, False]])
    report = check_row_sums(np.array([[0.25, 0.75, 0.0], [0.0, 0.0, 0.0]]), allowed)
    assert [c.detail for c in report.checks] == [
        "1 rows with a permitted cell, tolerance 1e-05",
        "4 blocked cells, must be exactly 0",
        "1 rows with no permitted cell, must be all zeros",
    ]
    message = "allowed must be broadcastable to (..., T, S) = (1, 1, 1, 2, 3), got (3, 3)"
    with pytest.raises(ValueError, match=re.escape(message)):
        check_row_sums(np.zeros((1, 1, 1, 2, 3)), np.ones((3, 3), bool))


# A second mutation sample of nanoattn/verify (40 per file, seed 2) found these unpinned.


def test_row_sums_counts_places_and_empty_weights():
    # 3 rows: 1 with permitted cells, 2 without, so the counts cannot be swapped.
    allowed = np.array([[True, True, False], [False] * 3, [False] * 3])
    w = np.array([[0.25, 0.75, 0.0], [0.0] * 3, [0.0] * 3])
    report = check_row_sums(w, allowed)
    assert report.passed
    assert [c.detail for c in report.checks] == [
        "1 rows with a permitted cell, tolerance 1e-05",
        "7 blocked cells, must be exactly 0",
        "2 rows with no permitted cell, must be all zeros",
    ]
    assert all(c.where is None and c.worst == 0.0 for c in report.checks)  # nothing to point at
    empty = check_row_sums(np.zeros((0, 3)), np.ones((0, 3), bool))  # T = 0: no rows at all
    assert empty.passed and all(c.worst == 0.0 for c in empty.checks)
    message = "allowed must be broadcastable to (B, N, T, S) = (1, 2, 2, 3), got (3, 3)"
    with pytest.raises(ValueError, match=re.escape(message)):
        check_row_sums(np.zeros((1, 2, 2, 3)), np.ones((3, 3), bool))


# A third sample (60 per file, seed 3), run after the tests above, found these unpinned.


def test_row_sums_title_float64_sums_and_higher_ranks():
    report = check_row_sums(np.array([[1.0, 1e-8]], np.float32), np.ones((1, 2), bool))
    assert report.title == "row sums"
    assert by_name(report)["permitted rows sum to 1"].worst == pytest.approx(1e-8, rel=1e-2)
    # Five axes: no names, the index of the worst cell.
    w = np.zeros((1, 1, 2, 2, 3))
    w[0, 0, 1, 1, 2] = 0.5
    cells = by_name(check_row_sums(w, np.zeros((2, 3), bool)))["blocked cells are 0"]
    assert cells.where == {"index": [0, 0, 1, 1, 2]}
    # Three axes (N, T, S): a fully blocked row of head 1, query 0 that is not zero.
    allowed = np.array([[False, False, False], [True, True, True]])
    w = np.zeros((2, 2, 3))
    w[:, 1] = 1 / 3
    w[1, 0, 2] = 0.25
    rows = by_name(check_row_sums(w, allowed))["fully blocked rows are 0"]
    assert rows.where == {"head": 1, "query": 0} and rows.worst == 0.25
    # No keys at all (S = 0): every row has no permitted cell, and is (vacuously) zero.
    empty = check_row_sums(np.zeros((2, 0)), np.zeros((2, 0), bool))
    assert empty.passed and empty.checks[2].detail.startswith("2 rows with no permitted cell")
