"""NaN and inf where nothing may look never reach the output, and huge finite logits
never make NaN.

An unwritten cache slot, padding past ``kv_lengths`` or a key outside every
query's window may hold NaN or inf; a weight of exactly 0 does not protect the
output from it (0 * NaN = NaN), so the backends must never read such content.
"""

import dataclasses
import functools
import os

import jax
import numpy as np
import pytest

import nanoattn
from nanoattn._backends import native

from _cases import BAD, FLASH_CASES, blocked_places, dirty_inputs, full_allowed, run_cases
from _fuzz import check, concrete_call, run_backend
from _reference import (
    np_attention,
    np_causal,
    np_lengths,
    np_segments,
    np_window,
    randn,
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


def assert_same_as_clean(implementation, places, keys_of=None):
    """NaN or inf at ``places`` changes neither the outputs nor any gradient: a
    gradient with respect to content that cannot matter is 0, and finite."""
    cases = FLASH_CASES  # the programs of test_combined.py, compiled once
    clean = run_cases(cases, implementation)
    for name, bad in BAD.items():
        inputs = [
            dirty_inputs(c, places, bad, None if keys_of is None else keys_of(c)) for c in cases
        ]
        dirty = run_cases(cases, implementation, inputs=inputs)
        for case, (out, grads), (ref_out, ref_grads) in zip(cases, dirty, clean):
            where = f"{implementation}, {case.name}, {name} in {places}"
            np.testing.assert_allclose(out, ref_out, atol=1e-6, rtol=1e-6, err_msg=where)
            unseen_keys, blocked_bias, blind_queries = blocked_places(case)
            visible = (~blind_queries, ~unseen_keys, ~unseen_keys, ~blocked_bias)
            names = ("dq", "dk", "dv", "dbias")
            for g_name, g, ref, part in zip(names, grads, ref_grads, visible):
                g, ref = np.asarray(g), np.asarray(ref)
                np.testing.assert_allclose(
                    g[part], ref[part], atol=1e-6, rtol=1e-6, err_msg=f"{where}: {g_name}"
                )
                np.testing.assert_allclose(
                    g, ref, atol=1e-6, rtol=1e-6, err_msg=f"{where}: {g_name}, blocked part"
                )


@pytest.mark.parametrize("implementation", ["xla", "flash"])
@pytest.mark.parametrize(
    "places",
    [("keys",), ("values",), ("bias",), ("queries",), ("keys", "values", "bias", "queries")],
)
def test_masked_content_never_reaches_outputs_or_gradients(implementation, places):
    # NaN or inf in keys and values that one rule hides from the whole row (past
    # kv_lengths, outside every window, a segment no query has, a masked column),
    # in bias at blocked cells, and in queries that see no key.
    for case in FLASH_CASES:
        assert keys_no_rule_lets_through(case).any(), case.name
    assert any(blocked_places(c)[1].any() for c in FLASH_CASES)  # some bias cell is blocked
    assert_same_as_clean(implementation, places, keys_no_rule_lets_through)


@pytest.mark.parametrize("implementation", ["xla", "flash"])
def test_keys_hidden_only_by_a_combination_of_rules(implementation):
    # A key that no query of its row sees, though no single rule hides it: the window
    # lets one query see it and the dense mask blocks that query, say. It is as unseen
    # as padding, so NaN there must not reach the output either.
    def combination_only(case):
        unseen = ~full_allowed(case).any(axis=(1, 2))
        return unseen & ~keys_no_rule_lets_through(case)

    assert any(combination_only(c).any() for c in FLASH_CASES)
    assert_same_as_clean(implementation, ("keys", "values"), combination_only)


def test_padding_past_lengths_with_nan_in_both_backends():
    # The plain case of the issue: NaN in keys and values past kv_lengths.
    B, T, S, N, K, H = 2, 5, 7, 6, 2, 8
    q, k, v = randn(0, B, T, N, H), randn(1, B, S, K, H), randn(2, B, S, K, H)
    lengths = np.array([7, 4], np.int32)
    want = np_attention(q, k, v, allowed=np_lengths(lengths, S) & np_causal(T, S, 2))
    k[1, 4:], v[1, 4:] = np.nan, np.inf
    for implementation in ("xla", "flash"):
        f = jax.jit(
            functools.partial(
                nanoattn.dot_product_attention,
                is_causal=True,
                q_offset=2,
                implementation=implementation,
            )
        )
        np.testing.assert_allclose(
            f(q, k, v, kv_lengths=lengths), want, atol=1e-5, err_msg=implementation
        )


# XLA's default optimisation level and fusion emitters, as users compile (the suite
# compiles at -O0 with the older emitters where its jaxlib has them: conftest.py says
# why).
OPTIMIZED = {"xla_backend_optimization_level": 3}  # XLA's default level
if "xla_cpu_use_fusion_emitters=false" in os.environ.get("XLA_FLAGS", ""):
    OPTIMIZED["xla_cpu_use_fusion_emitters"] = True  # XLA's default emitters

# The regression of the issue: H = 1, T = 1, S = 2, q and k of size about 2e5. Under
# jit, XLA may compute the row maximum from a differently rounded copy of the logits
# (near 1e10 here), so every exp underflowed, the row sum was 0 and the output NaN.
# These seeds gave NaN in both backends before the fix.
HUGE_SEEDS = [3, 4, 5, 9, 10, 14, 18]
HUGE_CALLS = {
    "plain": dict(),
    "kv_lengths": dict(kv_lengths=np.array([2], np.int32)),
    "causal": dict(is_causal=True, q_offset=1),
    "mask": dict(mask=np.ones((1, 2), bool)),
    "bias": dict(bias=np.zeros((1, 1, 1, 2), np.float32)),
}


def huge_inputs(seed):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((1, 1, 1, 1)).astype(np.float32) * 2e5
    k = rng.standard_normal((1, 2, 1, 1)).astype(np.float32) * 2e5
    v = rng.standard_normal((1, 2, 1, 1)).astype(np.float32)
    return q, k, v


@pytest.mark.parametrize("implementation", ["xla", "flash"])
def test_huge_logits_under_jit_are_not_nan(implementation):
    # At XLA's default optimisation level, as users compile (at -O0, XLA's CPU backend
    # gives NaN for the reference's softmax of these logits).
    @functools.partial(jax.jit, compiler_options=OPTIMIZED)
    def run(q, k, v):
        return [
            nanoattn.dot_product_attention(q, k, v, implementation=implementation, **kw)
            for kw in HUGE_CALLS.values()
        ]

    for seed in HUGE_SEEDS:
        q, k, v = huge_inputs(seed)
        # The logits differ by about 1e10: the weights are one-hot on the larger one.
        want = np_attention(q, k, v)
        for name, out in zip(HUGE_CALLS, run(q, k, v)):
            assert np.isfinite(out).all(), (seed, name)
            np.testing.assert_allclose(out, want, atol=1e-6, err_msg=f"seed {seed}, {name}")


@pytest.mark.parametrize("implementation", ["xla", "flash"])
def test_huge_logits_in_many_rows_under_jit_are_each_shifted_by_their_own_maximum(
    implementation,
):
    # The seeds' rows in one batch: each row's second shift must use its own maximum (a
    # maximum over every row would leave the other rows' exponents thousands below 0).
    q, k, v = (np.concatenate(parts) for parts in zip(*map(huge_inputs, HUGE_SEEDS)))
    run = jax.jit(
        functools.partial(nanoattn.dot_product_attention, implementation=implementation),
        compiler_options=OPTIMIZED,
    )
    out = run(q, k, v)
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out, np_attention(q, k, v), atol=1e-6)


# NaN or inf in content some query does see is real input: it must show in that
# query's output (and gradients) on every backend as on the reference, never be
# hidden (docs/conventions.md, "Non-finite input"). The fuzz draws these at random
# (tests/test_fuzz.py); here are the cases written out, each through _fuzz.check,
# which also holds everything the poison cannot reach to the clean float64 truth.
POISONED = [
    # (array, index, kind, rules): the case first
    ("key", (0, 10, 0, 0), "nan", dict(is_causal=True)),
    ("key", (1, 3, 1, 2), "inf", dict(is_causal=True, window=(4, 0))),
    ("key", (0, 0, 0, 5), "-inf", dict(is_causal=True)),
    ("query", (1, 40, 1, 7), "nan", dict(is_causal=True)),
    ("query", (0, 5, 0, 0), "inf", {}),
    ("value", (0, 20, 1, 3), "nan", dict(is_causal=True, window=(8, 2))),
    ("value", (1, 63, 0, 9), "-inf", dict(is_causal=True)),
]


@pytest.mark.parametrize("array, index, kind, rules", POISONED, ids=lambda x: str(x))
def test_visible_nan_or_inf_shows_on_every_backend(array, index, kind, rules):
    call = concrete_call(2, 64, 64, 4, 2, 16, "float32", 5, **rules)
    call = dataclasses.replace(call, poison=(array, index, kind))
    assert len(call.backends()) == 3 or native.load()[0] is None
    verdict = check(call)
    assert not verdict.failures, verdict.failures
    out = run_backend("native" if "native" in call.backends() else "flash", call)[0]
    if kind == "nan":  # a NaN always shows: in the row that holds or sees it
        b = index[0]
        assert np.isnan(out[b]).any()
