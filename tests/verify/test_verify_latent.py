"""check_decoding on multi-head latent attention: the layer's own decode passes (linen
and NNX, through nanoattn.verify.decoders), and the bugs an absorbed decode ships with
are caught (tests/_verify_decoders.py: ``latent(bug)``); a quantized latent cache passes
within its error, reported next to its float cache's."""

import dataclasses

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

import nanoattn.nnx
from nanoattn.linen import LatentAttention, LatentConfig
from nanoattn.verify import check_decoding, decoders

import _verify_decoders

CONFIG = LatentConfig(d_model=16, n_heads=2, kv_lora_rank=7, qk_nope_head_dim=3,
                      qk_rope_head_dim=4, v_head_dim=5, q_lora_rank=11)  # fmt: skip


def _failed(report) -> set[str]:
    return {check.name for check in report.checks if check.passed is False}


def test_the_latent_layer_decodes_as_its_forward_in_linen_and_nnx():
    layer = LatentAttention(CONFIG)
    params = layer.init(jax.random.key(0), jnp.ones((1, 2, 16)))
    report = check_decoding(decoders.linen(layer, params), d_model=16, seq_len=7)
    assert report.passed, report
    module = nanoattn.nnx.LatentAttention(CONFIG, rngs=nnx.Rngs(0))
    report = check_decoding(decoders.nnx(module), d_model=16, seq_len=7)
    assert report.passed, report


def test_the_hand_written_absorbed_decode_passes():
    report = check_decoding(*_verify_decoders.latent(), d_model=12, seq_len=7)
    assert report.passed, report


@pytest.mark.parametrize("bug", _verify_decoders.LATENT_BUGS)
def test_each_planted_latent_bug_is_caught(bug):
    report = check_decoding(*_verify_decoders.latent(bug), d_model=12, seq_len=7)
    assert "cache equivalence" in _failed(report), report


def test_a_quantized_latent_cache_passes_within_its_error_and_reports_it():
    """An int8 latent cache (paged through linen, full through NNX): with a tolerance
    above its error every check passes, and the quantization check measures that error
    against the same layer's float cache, whose own error against float64 is
    float32's."""
    atol = 0.05  # measured 0.008-0.01 on this layer
    quantized = dataclasses.replace(CONFIG, kv_cache_dtype="int8")
    layer = LatentAttention(dataclasses.replace(quantized, page_size=2))
    params = layer.init(jax.random.key(0), jnp.ones((1, 2, 16)))
    found = [check_decoding(decoders.linen(layer, params), d_model=16, seq_len=7, atol=atol)]
    module = nanoattn.nnx.LatentAttention(quantized, rngs=nnx.Rngs(0))
    found.append(check_decoding(decoders.nnx(module), d_model=16, seq_len=7, atol=atol))
    for report in found:
        assert report.passed, report
        errors = next(c for c in report.checks if c.name == "quantization error").data
        assert 1e-4 < errors["quantized_vs_float"] <= atol and errors["float_vs_reference"] < 1e-5


def test_deepseek_v32_decodes_as_its_forward_with_the_same_selections():
    """DeepSeek-V3.2's indexer (4 heads of width 6 keeping each query's top 3 keys):
    decoding through a paged cache (linen) and a full one (NNX) passes check_decoding,
    each step choosing among the indexer keys its cache holds, as the forward does
    (tests/interop/test_deepseek.py decodes a linen full cache)."""
    v32 = dataclasses.replace(CONFIG, index_n_heads=4, index_head_dim=6, index_topk=3)
    layer = LatentAttention(dataclasses.replace(v32, page_size=2))
    params = layer.init(jax.random.key(0), jnp.ones((1, 2, 16)))
    found = [check_decoding(decoders.linen(layer, params), d_model=16, seq_len=7)]
    module = nanoattn.nnx.LatentAttention(v32, rngs=nnx.Rngs(0))
    found.append(check_decoding(decoders.nnx(module), d_model=16, seq_len=7))
    for report in found:
        assert report.passed, report
