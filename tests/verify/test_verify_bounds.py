"""Subjects with a fixed context (verify/_bounds.py): ``max_len`` keeps the checks to
the lengths a model takes, and a length where the subject raises fails the check,
named with its error, while every other length is still checked, in check_causality,
check_padding and `nanoattn verify --max-len`. The models are nanoGPT-like, with a
mask precomputed for BLOCK = 20 tokens (tests/_verify_functions.py)."""

import json

import jax.numpy as jnp
import numpy as np
import pytest

from nanoattn.cli import main
from nanoattn.verify import check_causality, check_padding
from nanoattn.verify._causality import DEFAULT_SEQ_LENS

from _verify_functions import BLOCK, D, by_name, causal_sum, nanogpt_like, sliced_from_the_bottom

PROBES = ["prefix invariance", "future perturbation", "positive control", "receptive field"]


def test_max_len_checks_a_bounded_model_on_the_default_lengths_and_tries_no_longer():
    seen = []
    report = check_causality(nanogpt_like(seen), d_model=D, max_len=BLOCK)
    assert report.passed, report
    assert [c.name for c in report.checks] == PROBES  # the table of a model without bounds
    assert max(seen) == 17 and set(seen) == {T for T in DEFAULT_SEQ_LENS if T <= BLOCK}
    assert "in each of 8 runs" in by_name(report)["positive control"].detail


def test_without_max_len_the_lengths_it_raises_at_fail_and_the_others_are_checked():
    seen = []
    bounded = check_causality(nanogpt_like(seen), d_model=D, seq_lens=(1, 2, 5, 33, 64))
    assert not bounded.passed and bounded.checks[0].name == "fn runs"
    ran = bounded.checks[0]
    assert not ran.passed and ran.where == {"length": 33, "mode": "jit"}
    assert ran.detail == (
        "fn raised at 2 of 5 lengths (33, 64), checked at the others (max_len leaves out "
        "the lengths past a fixed context); at length 33 (jit): AssertionError: Cannot "
        "forward sequence of length 33, block size is only 20"
    )
    assert [(f["length"], f["mode"]) for f in ran.data["failed"]] == [(33, "jit"), (64, "jit")]
    assert ran.data["failed"][1]["error"].endswith("of length 64, block size is only 20")
    assert seen.count(33) == 1 and seen.count(64) == 1  # tried once each, then left out
    # The lengths it takes give exactly the results they give alone.
    alone = check_causality(nanogpt_like([]), d_model=D, seq_lens=(1, 2, 5))
    assert alone.passed and bounded.checks[1:] == alone.checks


def test_a_leak_at_short_lengths_is_still_a_leak_with_and_without_max_len():
    seen = []
    lens = (1, 2, 5, 33)
    within = check_causality(sliced_from_the_bottom(seen), d_model=D, seq_lens=lens, max_len=20)
    assert max(seen) == 5 and "fn runs" not in by_name(within)
    prefix = by_name(within)["prefix invariance"]
    assert not prefix.passed and prefix.detail.endswith(
        "when only positions >= 1 changed (T=2, jit)"
    )
    report = check_causality(sliced_from_the_bottom([]), d_model=D, seq_lens=lens)
    ran = by_name(report)["fn runs"]
    assert ran.detail.startswith("fn raised at 1 of 4 lengths (33), checked at the others")
    assert "; at length 33 (jit): ValueError: " in ran.detail  # from the too-small mask
    assert report.checks[1:] == within.checks  # the leak, found exactly as within max_len
    assert not by_name(report)["receptive field"].passed


def test_a_subject_that_raises_at_every_length_is_a_failed_report_not_an_exception():
    def broken(x):
        raise RuntimeError("no weights loaded")

    report = check_causality(broken, d_model=4, seq_lens=(2, 3))
    assert not report.passed
    ran, *probes = report.checks
    assert ran.detail == (
        "fn raised at every length (2, 3), so nothing was checked (max_len leaves out the "
        "lengths past a fixed context); at length 2 (jit): RuntimeError: no weights loaded"
    )
    assert [c.name for c in probes] == PROBES
    assert all(c.skipped and c.detail == "skipped, fn raised at every length" for c in probes)
    assert json.loads(json.dumps(report.to_dict()))["checks"][0]["status"] == "FAIL"


def test_a_subject_that_raises_inside_a_probe_loses_only_that_length():
    # Runs once at every length, then raises on any further call at length 5: the
    # length fails, the others are checked. A numpy function: no jit, no gradients.
    calls = {}

    def flaky_at_5(x):
        T = x.shape[1]
        calls[T] = calls.get(T, 0) + 1
        if T == 5 and calls[T] > 2:
            raise FloatingPointError("overflow in the fifth position")
        return np.cumsum(np.asarray(x, np.float64), 1)

    report = check_causality(flaky_at_5, d_model=4, seq_lens=(3, 5, 8))
    ran = by_name(report)["fn runs"]
    assert ran.where == {"length": 5, "mode": "eager"}
    assert ran.detail.startswith("fn raised at 1 of 3 lengths (5), checked at the others")
    assert ran.detail.endswith("FloatingPointError: overflow in the fifth position")
    alone = check_causality(lambda x: np.cumsum(np.asarray(x, np.float64), 1), d_model=4,
                            seq_lens=(3, 8))  # fmt: skip
    assert report.checks[1:] == alone.checks and alone.passed


def test_max_len_leaves_the_default_padding_length_at_max_len():
    seen = []

    def bounded(x, valid):
        seen.append(x.shape[1])
        if x.shape[1] > 4:
            raise ValueError(f"a context of 4 tokens, got {x.shape[1]}")
        return jnp.cumsum(x * valid[..., None], axis=1)

    assert check_padding(bounded, d_model=4, max_len=4).passed and set(seen) == {4}
    report = check_padding(bounded, d_model=4)  # the default length, 9
    ran, *skipped = report.checks
    assert not report.passed and ran.name == "fn runs"
    assert ran.detail == (
        "fn raised at every length (9), so nothing was checked (max_len leaves out the "
        "lengths past a fixed context); at length 9 (right padding): ValueError: a context "
        "of 4 tokens, got 9"
    )
    assert [c.status for c in skipped] == ["SKIP"] * 3
    assert check_padding(bounded, d_model=4, seq_len=3, max_len=4).passed


CALLED = []


def must_not_run(*args):
    CALLED.append(args)  # the check catches what it raises: the list shows the call
    raise AssertionError("called although max_len is bad")


@pytest.mark.parametrize("max_len", [0, -3, 20.0, True, "20"])
def test_bad_max_len_raises_before_any_call(max_len):
    for check in (check_causality, check_padding):
        with pytest.raises(ValueError) as error:
            check(must_not_run, d_model=4, max_len=max_len)
        assert str(error.value) == f"max_len must be None or an int >= 1, got max_len={max_len!r}"
    assert not CALLED


def test_a_max_len_below_every_length_raises_before_any_call():
    with pytest.raises(ValueError) as error:
        check_causality(must_not_run, d_model=4, seq_lens=(17, 33), max_len=16)
    assert str(error.value) == (
        "every length in seq_lens=[17, 33] exceeds max_len=16: nothing to check"
    )
    with pytest.raises(ValueError) as error:
        check_padding(must_not_run, d_model=4, seq_len=9, max_len=8)
    assert str(error.value) == "seq_len=9 exceeds max_len=8: nothing to check"
    assert not CALLED


def test_max_len_accepts_numpy_ints_and_lengths_up_to_it():
    report = check_causality(causal_sum, d_model=4, seq_lens=(3, 4, 5), max_len=np.int64(4))
    assert report.passed and by_name(report)["prefix invariance"].detail.startswith(
        "shared-prefix pairs: 5 under jit and 3 eagerly (length 4)"
    )


def cli(capsys, *argv):
    code = main(["verify", "_verify_targets:nanogpt_like", "--d-model", str(D), *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_max_len_and_a_target_that_raises_at_some_lengths(capsys):
    code, out, err = cli(capsys, "--seq-lens", "2,5,33")
    assert code == 1 and err == ""
    assert out.splitlines()[1] == "causality: FAIL"
    assert "fn runs              FAIL" in out and "at length 33 (jit): AssertionError" in out
    code, out, err = cli(capsys, "--seq-lens", "2,5,33", "--max-len", "20")
    assert code == 0 and err == ""
    assert out.splitlines()[:2] == [
        f"nanoattn verify _verify_targets:nanogpt_like (d_model {D}, batch 2, lengths 2,5, "
        "max-len 20)",
        "causality: PASS",
    ]
    code, out, _ = cli(capsys, "--seq-lens", "2,33", "--json")
    report = json.loads(out)
    assert code == 1 and report["checks"][0]["data"]["failed"][0]["length"] == 33
    code, out, _ = cli(capsys, "--seq-lens", "2,33", "--max-len", "40")  # 33 is within it
    assert code == 1  # and with --max-len given, the detail does not suggest it
    assert "fn raised at 1 of 2 lengths (33), checked at the others; at length 33 (jit)" in out
