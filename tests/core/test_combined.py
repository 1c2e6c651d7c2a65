"""Every new argument at once: window, segment ids, soft-cap and RoPE together with
causality, a dense mask, key lengths, bias and grouped-query heads, against the
float64 reference on outputs and gradients, in both backends.

The cases (CASES and FLASH_CASES of _cases.py) are built so that some keys are seen by
no query of their row, some queries see no key and some bias cells are blocked:
test_nonfinite.py feeds the same compiled programs NaN and inf there.
"""

import numpy as np

from _cases import CASES, FLASH_CASES, assert_cases_match


def test_everything_at_once_matches_reference():
    # FLASH_CASES form one program per backend, which test_nonfinite.py reuses.
    assert_cases_match(FLASH_CASES)
    assert_cases_match(CASES[len(FLASH_CASES) :], implementations=["xla"])


def test_the_cases_exercise_what_they_claim():
    # Guards the case construction that test_nonfinite.py relies on.
    for case in CASES:
        B, T, N, _ = case.q.shape
        allowed = np.broadcast_to(case.allowed, (B, N, T, case.k.shape[1]))
        assert allowed.any(-1).any() and allowed.mean() < 0.5, case.name
    for case in FLASH_CASES:
        B, T, N, _ = case.q.shape
        allowed = np.broadcast_to(case.allowed, (B, N, T, case.k.shape[1]))
        assert (~allowed.any(axis=(1, 2))).any(), f"{case.name}: no key unseen by all"
        assert (~allowed.any(-1)).any(), f"{case.name}: no query that sees nothing"
