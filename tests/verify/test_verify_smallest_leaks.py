"""The smallest leak each verify check must report, pinned.

check_mask and check_causality measure dependence by gradients (under jit, float
inputs, lengths up to 64), which are exactly zero where nothing leaks: any leak whose
gradient is a nonzero float32 is reported, down to a coefficient of 1e-30 of the last
token. check_padding compares outputs within ``atol`` after setting padded content to
``+-huge``: a leak of coefficient c per padded token moves an output by about
``c * huge``, so at the defaults (atol 1e-5, huge 1e6) c = 1e-11 is reported and
c = 1e-12 is not (docs/verify.md)."""

import jax.numpy as jnp
import pytest

from nanoattn.verify import check_causality, check_mask, check_padding

LENGTHS = (1, 5, 17)


def running_mean(x):
    return jnp.cumsum(x, axis=1) / jnp.arange(1, x.shape[1] + 1)[None, :, None]


def with_the_last_token(c):
    """The causal running mean plus ``c`` times the last token, at every position."""

    def fn(x):
        return running_mean(x) + c * x[:, -1:, :]

    return fn


def causal(b, n, q, k):
    return k <= q


@pytest.mark.parametrize("c", [1e-8, 1e-30])
def test_check_mask_reports_any_dependence_outside_the_mask(c):
    failed = [r.name for r in check_mask(with_the_last_token(c), mask_fn=causal, d_model=4,
                                          seq_lens=LENGTHS).checks if not r.passed]  # fmt: skip
    assert failed == ["outside the mask"]


@pytest.mark.parametrize("c", [1e-8, 1e-30])
def test_check_causality_reports_any_dependence_on_the_future(c):
    report = check_causality(with_the_last_token(c), d_model=4, seq_lens=LENGTHS)
    assert [r.name for r in report.checks if not r.passed] == ["receptive field"]


def test_the_controls_pass_without_a_leak():
    assert check_mask(with_the_last_token(0.0), mask_fn=causal, d_model=4, seq_lens=LENGTHS).passed
    assert check_causality(with_the_last_token(0.0), d_model=4, seq_lens=LENGTHS).passed


def masked_mean_with(c):
    """The mean over valid tokens plus ``c`` times the sum of the padded ones."""

    def fn(x, valid):
        w = valid[:, :, None]
        mean = (x * w).sum(1, keepdims=True) / w.sum(1, keepdims=True)
        return jnp.broadcast_to(mean + c * (x * ~w).sum(1, keepdims=True), x.shape)

    return fn


@pytest.mark.parametrize("c, reported", [(0.0, False), (1e-11, True), (1e-12, False)])
def test_check_padding_reports_a_leak_above_atol_over_huge(c, reported):
    report = check_padding(masked_mean_with(c), d_model=4)
    failed = {r.name for r in report.checks if not r.passed}
    if reported:
        assert failed == {
            "padded content is ignored (right padding)",
            "padded content is ignored (left padding)",
        }
    else:
        assert report.passed
