"""Every argument at once: window, segment ids, soft-cap and RoPE together with
causality, a dense mask, key lengths, bias and grouped-query heads, against the
float64 reference on outputs and gradients, on every registered backend that serves
them; then the same compiled programs with NaN and inf where nothing may look.

The cases (CASES of _cases.py) are richer than the calls of the backend test base
(tests/_backend_base.py): RoPE inside the differentiated function, and a dense mask and
a bias with every other rule, so that some keys are hidden from their whole row by one
rule and others only by a combination of rules, some queries see no key and some bias
cells are blocked.
"""

import numpy as np
import pytest

from _backends import each_backend, refusal
from _cases import (
    BAD,
    CASES,
    assert_cases_match,
    blocked_places,
    dirty_inputs,
    full_allowed,
    run_cases,
)
from _reference import np_causal, np_lengths, np_segments, np_window


def served_cases(implementation):
    """The cases the backend serves; skips the test, with its reason, when none."""
    reasons = [refusal(implementation, c.q, c.k, c.v, bias=c.bias, **c.kwargs) for c in CASES]
    if all(reasons):
        pytest.skip(f"{implementation}: {reasons[0]}")
    return [c for c, reason in zip(CASES, reasons) if reason is None]


@each_backend()
def test_everything_at_once_matches_reference(implementation):
    assert_cases_match(served_cases(implementation), implementations=[implementation])


@each_backend()
def test_nan_and_inf_where_nothing_may_look_change_no_output_and_no_gradient(implementation):
    # NaN, inf or -inf in the keys and values no query of their row sees (past
    # kv_lengths, outside every window, in a segment no query has, masked, or hidden
    # only by a combination of these), in the bias at blocked cells and in the queries
    # that see no key: a weight of exactly 0 does not protect the output from it
    # (0 * NaN = NaN), so a backend must never read such content. A gradient with
    # respect to content that cannot matter is 0, and finite.
    cases = served_cases(implementation)
    clean = run_cases(cases, implementation)
    places = ("keys", "values", "bias", "queries")
    for name, bad in BAD.items():
        inputs = [dirty_inputs(c, places, bad) for c in cases]
        dirty = run_cases(cases, implementation, inputs=inputs)
        for case, (out, grads), (ref_out, ref_grads) in zip(cases, dirty, clean):
            where = f"{implementation}, {case.name}, {name}"
            np.testing.assert_allclose(out, ref_out, atol=1e-6, rtol=1e-6, err_msg=where)
            for g_name, g, ref in zip(("dq", "dk", "dv", "dbias"), grads, ref_grads):
                np.testing.assert_allclose(
                    g, ref, atol=1e-6, rtol=1e-6, err_msg=f"{where}: {g_name}"
                )


def keys_no_rule_lets_through(case):
    """(B, S): keys that one rule alone hides from every query of their row: past
    ``kv_lengths``, outside every query's window (with causality), in a segment no
    query of the row has, or masked for every query."""
    B, T, N, _ = case.q.shape
    S = case.k.shape[1]
    kw = case.kwargs
    hidden = np.zeros((B, S), bool)
    if "kv_lengths" in kw:
        hidden |= ~np_lengths(kw["kv_lengths"], S)[:, 0, 0]
    if "window" in kw or kw.get("is_causal"):
        offsets = np.broadcast_to(np.asarray(kw.get("q_offset", 0)), (B,))
        window = kw.get("window", S + T)  # no window: wider than everything
        left, right = (window, window) if isinstance(window, int) else window
        for b, off in enumerate(offsets):
            band = np_window(T, S, int(off), left, right)
            if kw.get("is_causal"):
                band &= np_causal(T, S, int(off))
            hidden[b] |= ~band.any(0)
    if "q_segment_ids" in kw:
        hidden |= ~np_segments(kw["q_segment_ids"], kw["kv_segment_ids"])[:, 0].any(1)
    if "mask" in kw:
        mask = np.broadcast_to(kw["mask"], (B, N, T, S))
        hidden |= ~mask.any(axis=(1, 2))
    return hidden


def test_the_cases_exercise_what_they_claim():
    # Guards the case construction that the NaN test relies on.
    for case in CASES:
        allowed = full_allowed(case)
        assert allowed.any(-1).any() and allowed.mean() < 0.5, case.name
    for case in CASES[:2]:
        unseen_keys, _, blind_queries = blocked_places(case)
        assert unseen_keys.any(), f"{case.name}: no key unseen by all"
        assert blind_queries.any(), f"{case.name}: no query that sees nothing"
        assert keys_no_rule_lets_through(case).any(), f"{case.name}: no key one rule hides"
    assert any(blocked_places(c)[1].any() for c in CASES)  # some bias cell is blocked
    # A key no query of its row sees, though no single rule hides it: the window lets
    # one query see it and the dense mask blocks that query, say.
    assert any((blocked_places(c)[0] & ~keys_no_rule_lets_through(c)).any() for c in CASES)
