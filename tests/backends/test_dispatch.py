"""Backend dispatch: named backends fail loudly, the automatic choice never fails."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings

from nanoattn import dot_product_attention
from nanoattn._backends import dispatch
from nanoattn._base.rules import Rules
from nanoattn.linen import AttentionConfig, CausalSelfAttention

from _backends import serving
from _cases import attention_case
from _reference import randn


def spec_for(T, S=None, **kwargs):
    S = S or T
    return Rules.make(jnp.zeros((1, T, 2, 8)), jnp.zeros((1, S, 2, 8)), **kwargs)


def test_a_spec_without_rules_has_none():
    # No causality, window, lengths, segments, mask or bias unless asked for.
    for spec in (spec_for(4), spec_for(3, 5)):
        assert spec.band is None and spec.q_offset is None and spec.kv_lengths is None
        assert spec.q_segment_ids is None and spec.mask is None and spec.bias is None


def test_unknown_implementation():
    with pytest.raises(
        ValueError,
        match=r"implementation must be one of 'xla', 'flash', "
        r"'native', 'cudnn' or None, got 'triton'",
    ):
        dispatch.choose("triton", spec_for(4), jnp.float32, 0.0)


def test_named_backends_that_cannot_serve_raise():
    with pytest.raises(
        ValueError,
        match=r"implementation='flash' cannot serve this call: "
        r"dropout is only implemented by the reference",
    ):
        dispatch.choose("flash", spec_for(4), jnp.float32, 0.1)
    with pytest.raises(
        ValueError,
        match=r"implementation='cudnn' cannot serve this call: it "
        r"needs an NVIDIA GPU, and the default backend is 'cpu'",
    ):
        dispatch.choose("cudnn", spec_for(4), jnp.bfloat16, 0.0)
    traced_scale = jax.jit(
        lambda s: dispatch.choose("flash", spec_for(4, scale=s), jnp.float32, 0.0) and s
    )
    with pytest.raises(ValueError, match="needs a Python number for scale"):
        traced_scale(0.5)


def test_automatic_choice_on_cpu():
    from nanoattn._backends import native
    from nanoattn._backends.flash import backend as flash
    from nanoattn._backends.native import backend as native_backend

    big = int(np.sqrt(flash.CPU_MIN_CELLS))
    small = int(np.sqrt(native_backend.CPU_MIN_CELLS))
    built = native.load()[0] is not None
    choose = dispatch.choose
    # float32 goes to the native kernel where it was built, from its own threshold on.
    assert choose(None, spec_for(big), jnp.float32, 0.0) == ("native" if built else "flash")
    assert choose(None, spec_for(small), jnp.float32, 0.0) == ("native" if built else "xla")
    assert choose(None, spec_for(small - 1), jnp.float32, 0.0) == "xla"
    # bfloat16 goes to the native kernel from its own, higher threshold; float16 (which
    # it does not serve) to the pure-JAX kernels.
    least = int(np.sqrt(native_backend.CPU_MIN_CELLS_BF16))
    assert choose(None, spec_for(least), jnp.bfloat16, 0.0) == ("native" if built else "flash")
    assert choose(None, spec_for(least - 1), jnp.bfloat16, 0.0) == "xla"
    assert choose(None, spec_for(big), jnp.float16, 0.0) == "flash"
    assert choose(None, spec_for(big - 1), jnp.float16, 0.0) == "xla"
    assert choose(None, spec_for(big), jnp.float32, 0.1) == "xla"  # dropout
    # A decoding step over a small cache (key lengths, keys >= 4x the queries) goes to
    # the native kernel at any size; the same call without lengths, or with as many
    # queries as keys (a padded batch), by the cells.
    ratio = native_backend.CACHE_READ_RATIO
    lengths = dict(kv_lengths=jnp.array([3]))
    for dtype in (jnp.float32, jnp.bfloat16):
        assert choose(None, spec_for(2, 2 * ratio, **lengths), dtype, 0.0) == (
            "native" if built else "xla"
        )
        assert choose(None, spec_for(2, 2 * ratio - 1, **lengths), dtype, 0.0) == "xla"
        assert choose(None, spec_for(2, 2 * ratio), dtype, 0.0) == "xla"


def test_explicit_flash_with_dropout_raises_and_auto_falls_back():
    q, k, v = (jnp.asarray(randn(i, 1, 300, 2, 8)) for i in range(3))
    with pytest.raises(ValueError, match="cannot serve this call: dropout"):
        dot_product_attention(
            q, k, v, dropout_rate=0.1, dropout_rng=jax.random.key(0), implementation="flash"
        )
    auto = dot_product_attention(q, k, v, dropout_rate=0.1, dropout_rng=jax.random.key(0))
    ref = dot_product_attention(
        q, k, v, dropout_rate=0.1, dropout_rng=jax.random.key(0), implementation="xla"
    )
    np.testing.assert_array_equal(auto, ref)


@settings(max_examples=12, deadline=None)
@given(attention_case())
def test_every_backend_and_the_automatic_choice_match_the_reference(case):
    q, k, v, kwargs, _ = case
    run = jax.jit(dot_product_attention, static_argnames=("is_causal", "implementation"))
    ref = run(q, k, v, implementation="xla", **kwargs)
    others = [name for name in serving(q, k, v, **kwargs) if name != "xla"]
    for implementation in (*others, None):
        got = run(q, k, v, implementation=implementation, **kwargs)
        np.testing.assert_allclose(got, ref, atol=2e-5, rtol=2e-5, err_msg=str(implementation))


@pytest.mark.slow
def test_config_implementation():
    with pytest.raises(ValueError, match=r"implementation must be one of .* got 'fast'"):
        AttentionConfig(implementation="fast")
    x = jnp.asarray(randn(0, 2, 40, 32))
    outs = []
    q = jnp.zeros((2, 40, 4, 8))  # the layer's attention call: causal self-attention
    for implementation in (*serving(q, q, q, is_causal=True), None):
        layer = CausalSelfAttention(AttentionConfig(32, 4, implementation=implementation))
        params = layer.init(jax.random.key(0), x, deterministic=True)
        outs.append(layer.apply(params, x, deterministic=True))
    for out in outs[1:]:
        np.testing.assert_allclose(out, outs[0], atol=1e-5)
    training = CausalSelfAttention(AttentionConfig(32, 4, dropout=0.1, implementation="flash"))
    with pytest.raises(ValueError, match="cannot serve this call: dropout"):
        training.apply(params, x, rngs={"dropout": jax.random.key(1)})
