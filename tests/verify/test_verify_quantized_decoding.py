"""check_decoding on a quantized cache (AttentionConfig(kv_cache_dtype="int8")): with a
tolerance above the int8 cache's own error against the float forward, the correct
decoder passes every check and reports that error; each planted bug of the quantized
corpus (tests/_verify_decoders.py: a dropped value scale, scales on the wrong token,
old tokens requantized on each call) fails."""

import pytest

from nanoattn.verify import check_decoding

import _verify_decoders as planted


def _check(bug):
    return check_decoding(planted.quantized(bug), d_model=planted.D,
                          atol=planted.QUANTIZED_ATOL)  # fmt: skip


def test_the_int8_cache_passes_and_reports_its_error_against_the_float_forward():
    report = _check(None)
    assert report.passed, report
    equivalence = next(c for c in report.checks if c.name == "cache equivalence")
    assert 1e-4 < equivalence.worst <= planted.QUANTIZED_ATOL  # the quantization's error


@pytest.mark.parametrize("bug", planted.QUANTIZED_BUGS)
def test_each_planted_quantized_cache_bug_is_caught(bug):
    report = _check(bug)
    failed = [c.name for c in report.checks if c.status == "FAIL"]
    assert "cache equivalence" in failed, report
