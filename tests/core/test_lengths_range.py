"""Key lengths outside [0, S] are never clamped silently: a concrete one raises a
one-line ValueError naming the argument and the row; under jit, where it cannot be
checked, that row is NaN (output and log-sum-exp; the weights of attention_weights)
and no other row changes, on every backend that serves the call, in the ring, and in
jax_nn_attention (key_value_seq_lengths and query_seq_lengths)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

import nanoattn
from nanoattn._backends import registry
from nanoattn.parallel import ring_attention

from _backends import skip_refusal
from _reference import randn

B, T, S, N, K, H = 2, 5, 7, 4, 2, 8
BAD = [([-3, 5], 0, -3), ([5, S + 1], 1, S + 1)]


def _qkv():
    return (jnp.asarray(randn(s, B, n, h, H)) for s, n, h in ((1, T, N), (2, S, K), (3, S, K)))


@pytest.mark.parametrize("lengths, row, value", BAD)
@pytest.mark.parametrize(
    "entry",
    [
        lambda q, k, v, **kw: nanoattn.dot_product_attention(q, k, v, **kw),
        lambda q, k, v, **kw: nanoattn.attention_weights(q, k, **kw),
        lambda q, k, v, **kw: nanoattn.flash_attention(q, k, v, **kw),
    ],
    ids=["dot_product_attention", "attention_weights", "flash_attention"],
)
def test_concrete_lengths_out_of_range_raise_naming_the_row(entry, lengths, row, value):
    q, k, v = _qkv()
    message = rf"^kv_lengths must be in \[0, {S}\], got kv_lengths\[{row}\]={value}$"
    with pytest.raises(ValueError, match=message):
        entry(q, k, v, kv_lengths=jnp.asarray(lengths))


@pytest.mark.parametrize("name", registry.names())
@pytest.mark.parametrize("lengths, row, value", BAD)
def test_traced_lengths_out_of_range_make_their_row_nan(name, lengths, row, value):
    q, k, v = _qkv()
    good = np.array(lengths)
    good[row] = S  # the same call with the bad row made valid

    def attend(lengths):
        return nanoattn.dot_product_attention(
            q, k, v, kv_lengths=lengths, is_causal=True, q_offset=S - T,
            return_residual=True, implementation=name,
        )  # fmt: skip

    try:
        out, lse = jax.jit(attend)(jnp.asarray(lengths))
    except ValueError as error:
        skip_refusal(error, name)
    want, want_lse = jax.jit(attend)(jnp.asarray(good))
    other = 1 - row
    assert np.isnan(out[row]).all() and np.isnan(lse[row]).all()
    np.testing.assert_array_equal(out[other], want[other])
    np.testing.assert_array_equal(lse[other], want_lse[other])
    grads = jax.jit(jax.grad(lambda q, lengths: jnp.nansum(attend(lengths)[0])))(q, lengths)
    assert np.isfinite(grads).all()


def test_traced_lengths_out_of_range_make_their_weights_nan():
    q, k, _ = _qkv()
    weights = jax.jit(lambda l: nanoattn.attention_weights(q, k, kv_lengths=l))(jnp.array([3, 9]))
    assert np.isnan(weights[1]).all() and np.isfinite(weights[0]).all()


def test_the_ring_checks_lengths_against_the_whole_sequence():
    mesh = Mesh(np.array(jax.devices()[:1]), ("sp",))
    q, k, v = (jnp.asarray(randn(s, B, 8, 2, H)) for s in (1, 2, 3))

    def ring(lengths):
        return ring_attention(q, k, v, axis_name="sp", mesh=mesh, is_causal=True,
                              kv_lengths=lengths)  # fmt: skip

    with pytest.raises(ValueError, match=r"^kv_lengths must be in \[0, 8\], got kv_lengths\[1\]=9"):
        ring(jnp.array([8, 9]))
    out = jax.jit(ring)(jnp.array([8, 9]))
    assert np.isnan(out[1]).all() and np.isfinite(out[0]).all()


@pytest.mark.parametrize("argument, most", [("key_value_seq_lengths", S), ("query_seq_lengths", T)])
def test_jax_nn_attention_checks_both_lengths(argument, most):
    q, k, v = _qkv()
    lengths = jnp.array([most, most + 1], jnp.int32)
    message = rf"^{argument} must be in \[0, {most}\], got {argument}\[1\]={most + 1}$"
    with pytest.raises(ValueError, match=message):
        nanoattn.jax_nn_attention(q, k, v, **{argument: lengths})
    out = jax.jit(lambda l: nanoattn.jax_nn_attention(q, k, v, **{argument: l}))(lengths)
    assert np.isnan(out[1]).all() and np.isfinite(out[0]).all()
