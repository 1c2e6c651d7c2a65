"""check_decoding on a quantized cache (AttentionConfig(kv_cache_dtype="int8")): with a
tolerance above the int8 cache's own error against the float forward, the correct
decoder passes every check and reports that error next to the float cache's error
against the float64 forward (the quantization error check, from the float cache and
reference the adapters give a quantized layer); each planted bug of the quantized
corpus (tests/_verify_decoders.py: a dropped value scale, scales on the wrong token,
old tokens requantized on each call) fails, in both checks."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from nanoattn.linen import AttentionConfig, CausalSelfAttention
from nanoattn.nnx import CausalSelfAttention as NNXAttention
from nanoattn.verify import Decoder, PagedDecoder, check_decoding, decoders

import _verify_decoders as planted


def _check(bug, **options):
    return check_decoding(planted.quantized(bug), d_model=planted.D,
                          atol=planted.QUANTIZED_ATOL, **options)  # fmt: skip


def _named(report, name):
    return next(c for c in report.checks if c.name == name)


def test_the_int8_cache_passes_and_reports_its_error_next_to_the_float_caches():
    report = _check(None)
    assert report.passed, report
    equivalence = _named(report, "cache equivalence")
    assert 1e-4 < equivalence.worst <= planted.QUANTIZED_ATOL  # the quantization's error
    quantization = _named(report, "quantization error")
    errors = quantization.data
    # Both are measured: the int8 decode against the float decode of the same layer, and
    # the float decode against the layer's float64 forward (float32 rounding, not 0).
    assert 1e-4 < errors["quantized_vs_float"] == quantization.worst <= planted.QUANTIZED_ATOL
    assert 1e-8 < errors["float_vs_reference"] < 1e-5
    assert errors["reference"] == "float64 reference" and errors["tolerance"] == 0.012
    assert errors["quantized_vs_float"] == pytest.approx(equivalence.worst, rel=0.05)
    assert (
        f"differs from the float cache's of the same model by at most "
        f"{errors['quantized_vs_float']:.3g} (tolerance 0.012); the float cache's from the "
        f"float64 reference by at most {errors['float_vs_reference']:.3g}" in quantization.detail
    )
    # the row the report prints: the check's name, PASS and the quantization's error
    assert f"quantization error      PASS    {quantization.worst:.3g}" in str(report)


def test_a_float_cache_off_the_reference_fails_the_quantization_check():
    """The float cache's error is measured against the reference it is given: one off by
    1e-3 shows in the report and fails (the float tolerance is 1e-5 of the output)."""
    full = planted.quantized(None).full
    report = _check(None, reference=lambda x: np.asarray(full(x)) + 1e-3)
    quantization = _named(report, "quantization error")
    assert quantization.status == "FAIL", report
    assert quantization.data["float_vs_reference"] == pytest.approx(1e-3, rel=1e-2)
    assert "the float cache's decode differs from the float64 reference by 0.001" in (
        quantization.detail
    )
    assert quantization.data["first"]["position"] == 0
    assert _named(report, "cache equivalence").passed  # the quantized decoder is not wrong


@pytest.mark.parametrize("bug", planted.QUANTIZED_BUGS)
def test_each_planted_quantized_cache_bug_is_caught(bug):
    report = _check(bug)
    failed = [c.name for c in report.checks if c.status == "FAIL"]
    assert "cache equivalence" in failed and "quantization error" in failed, report
    assert _named(report, "quantization error").data["float_vs_reference"] < 1e-5


def test_the_adapters_give_a_quantized_layer_its_float_cache_and_float64_forward():
    x = np.asarray(jax.random.normal(jax.random.key(1), (2, 3, 8)), np.float32)
    config = AttentionConfig(8, 2, kv_cache_dtype="int8")
    layer = CausalSelfAttention(config)
    params = layer.init(jax.random.key(0), jnp.zeros((1, 3, 8)), True)
    nnx_layer = NNXAttention(config, rngs=nnx.Rngs(0))
    for decoder in (decoders.linen(layer, params), decoders.nnx(nnx_layer)):
        assert isinstance(decoder, Decoder) and isinstance(decoder.float_cache, Decoder)
        assert decoder.float_cache.float_cache is None and decoder.rewind is not None
        state, y = decoder.float_cache.step(decoder.float_cache.init(2, 5), x, None)
        storage = {a.dtype for a in jax.tree.leaves(state)}
        assert np.dtype("int8") not in storage and np.dtype("float32") in storage
        wide = decoder.reference(x)
        assert wide.dtype == np.float64
        assert 0 < np.abs(wide - np.asarray(decoder.full(x))).max() < 1e-5
        np.testing.assert_allclose(np.asarray(y), wide, atol=1e-5)
    paged = CausalSelfAttention(AttentionConfig(8, 2, kv_cache_dtype="int8", page_size=2))
    decoder = decoders.linen(paged, paged.init(jax.random.key(0), jnp.zeros((1, 2, 8)), True))
    assert isinstance(decoder.float_cache, PagedDecoder) and decoder.reference is not None
    assert decoders.linen(layer.clone(config=AttentionConfig(8, 2)), params).float_cache is None


@pytest.mark.parametrize(
    "options, message",
    [
        ({"float_cache": 3}, "float_cache must be None, a Decoder or (full, init, step), got 3"),
        ({"reference": 3}, "reference must be None or a function x -> y, got 3"),
    ],
)
def test_bad_float_cache_or_reference_is_one_line(options, message):
    with pytest.raises(ValueError) as error:
        _check(None, **options)
    assert str(error.value) == message
    with pytest.raises(ValueError, match="float_cache must be None or a PagedDecoder, got 3"):
        PagedDecoder(abs, abs, abs, page_size=2, float_cache=3)
