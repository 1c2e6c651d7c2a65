"""check_decoding on multi-head latent attention: the layer's own decode passes (linen
and NNX, through nanoattn.verify.decoders), and the bugs an absorbed decode ships with
are caught (tests/_verify_decoders.py: ``latent(bug)``)."""

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
