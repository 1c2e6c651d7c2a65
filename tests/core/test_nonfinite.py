"""Non-finite numbers: huge finite logits never make NaN, and NaN or inf that some query
does see shows in its results on every backend (docs/conventions.md).

NaN and inf where nothing may look (an unwritten cache slot, padding past
``kv_lengths``, a key outside every query's window), which must never reach a result,
are put there by the backend test base on each of its calls (tests/_backend_base.py)
and by tests/core/test_combined.py on its cases with every rule at once.
"""

import dataclasses
import functools
import os

import jax
import numpy as np
import pytest

import nanoattn

from _backends import each_backend, refusal, require
from _fuzz import check, concrete_call, run_backend
from _reference import np_attention

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


@each_backend()
def test_huge_logits_under_jit_are_not_nan(implementation):
    # At XLA's default optimisation level, as users compile (at -O0, XLA's CPU backend
    # gives NaN for the reference's softmax of these logits).
    q, k, v = huge_inputs(HUGE_SEEDS[0])
    require(implementation, q, k, v)
    calls = {
        n: kw for n, kw in HUGE_CALLS.items() if refusal(implementation, q, k, v, **kw) is None
    }

    @functools.partial(jax.jit, compiler_options=OPTIMIZED)
    def run(q, k, v):
        return [
            nanoattn.dot_product_attention(q, k, v, implementation=implementation, **kw)
            for kw in calls.values()
        ]

    for seed in HUGE_SEEDS:
        q, k, v = huge_inputs(seed)
        # The logits differ by about 1e10: the weights are one-hot on the larger one.
        want = np_attention(q, k, v)
        for name, out in zip(calls, run(q, k, v)):
            assert np.isfinite(out).all(), (seed, name)
            np.testing.assert_allclose(out, want, atol=1e-6, err_msg=f"seed {seed}, {name}")


@each_backend()
def test_huge_logits_in_many_rows_under_jit_are_each_shifted_by_their_own_maximum(
    implementation,
):
    # The seeds' rows in one batch: each row's second shift must use its own maximum (a
    # maximum over every row would leave the other rows' exponents thousands below 0).
    q, k, v = (np.concatenate(parts) for parts in zip(*map(huge_inputs, HUGE_SEEDS)))
    require(implementation, q, k, v)
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
    results = {name: run_backend(name, call) for name in call.backends()}
    assert len(results) >= 2  # the reference and a kernel at least
    verdict = check(call, results=results)
    assert not verdict.failures, verdict.failures
    if kind == "nan":  # a NaN always shows: in the row that holds or sees it
        for name, (out, *_) in results.items():
            assert np.isnan(out[index[0]]).any(), name
