"""check_decoding's token-tree check (a Decoder's ``tree`` and ``accept``;
nanoattn/verify/_tree_check.py): the tiny layer of tests/_verify_decoders.py passes it,
each planted tree bug (a sibling visible, RoPE by slot instead of depth, accepted
drafts left in their old slots, a rejected branch still read) fails it and nothing
else; nanoattn's linen layer passes it on a full and a wrapped rolling cache
(``decoders.linen(..., trees=True)``), the NNX self-attention and latent layers too
(``decoders.nnx(..., trees=True)``); bad arguments one line each."""

import functools

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from nanoattn import nnx as nanoattn_nnx
from nanoattn.linen import AttentionConfig, CausalSelfAttention, LatentConfig
from nanoattn.verify import Report, check_decoding, decoders

import _verify_decoders


def failed(report: Report) -> set[str]:
    return {c.name for c in report.checks if not c.passed}


@functools.cache
def tiny_report(bug) -> Report:
    return check_decoding(_verify_decoders.tiny_trees(bug), d_model=_verify_decoders.D)


def test_the_tiny_tree_decoder_passes_and_the_check_ran():
    report = tiny_report(None)
    assert not failed(report), report
    check = {c.name: c for c in report.checks}["token trees"]
    assert "a tree of 8 drafts each" in check.detail
    assert "every draft equal to the full forward of its own path" in check.detail


@pytest.mark.parametrize("bug", _verify_decoders.TREE_BUGS)
def test_each_planted_tree_bug_fails_the_tree_check_alone(bug):
    assert failed(tiny_report(bug)) == {"token trees"}


def test_the_linen_layer_passes_on_a_full_and_a_wrapped_rolling_cache():
    for options in (dict(), dict(window=(3, 0), rolling_cache=True)):
        cfg = AttentionConfig(16, 2, rope_base=100.0, **options)
        layer = CausalSelfAttention(cfg)
        params = layer.init(jax.random.key(0), jnp.ones((1, 2, 16)), deterministic=True)
        decoder = decoders.linen(layer, params, trees=True)
        report = check_decoding(decoder, d_model=16, ragged=False)
        assert not failed(report), report
        assert "token trees" in {c.name for c in report.checks}


def test_the_nnx_layers_pass():
    cfg = AttentionConfig(16, 2, n_kv_heads=1, rope_base=100.0)
    layer = nanoattn_nnx.CausalSelfAttention(cfg, rngs=nnx.Rngs(0))
    latent = nanoattn_nnx.LatentAttention(
        LatentConfig(d_model=16, n_heads=2, kv_lora_rank=7, qk_nope_head_dim=3,
                     qk_rope_head_dim=2, v_head_dim=5, rope_base=100.0),
        rngs=nnx.Rngs(1),
    )  # fmt: skip
    for module in (layer, latent):
        report = check_decoding(decoders.nnx(module, trees=True), d_model=16, ragged=False)
        assert not failed(report), report
        assert "token trees" in {c.name for c in report.checks}


def test_bad_tree_arguments_are_one_line():
    full, init, step = _verify_decoders.tiny()
    with pytest.raises(ValueError, match=r"^tree and accept go together: pass both"):
        check_decoding(full, init, step, tree=lambda s, c, p: (s, c), d_model=12)
    with pytest.raises(ValueError, match=r"^accept must be None or a function, got accept=3$"):
        check_decoding(full, init, step, tree=lambda s, c, p: (s, c), accept=3, d_model=12)
    paged = CausalSelfAttention(AttentionConfig(16, 2, page_size=4))
    params = paged.init(jax.random.key(0), jnp.ones((1, 8, 16)), deterministic=True)
    with pytest.raises(ValueError, match=r"^trees=True checks a slot cache's token trees"):
        decoders.linen(paged, params, trees=True)
    with pytest.raises(ValueError, match=r"^a PagedDecoder takes no tree: "):
        check_decoding(decoders.linen(paged, params), tree=step, accept=step, d_model=16)
