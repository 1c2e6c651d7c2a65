"""Logits of -inf (from a bias or score_fn) and sinks of +inf have one answer on every
backend (docs/conventions.md): a key whose logit is -inf weighs exactly 0, as a masked
key, so a row whose every visible logit is -inf is a row that sees no key (zeros,
log-sum-exp -inf, zero gradients); a sink of +inf takes the whole row (zeros,
log-sum-exp +inf), wherever the row falls among a kernel's blocks."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import nanoattn
from nanoattn._backends import registry

from _backends import skip_refusal
from _reference import np_attention, randn

B, T, N, K, H = 1, 150, 2, 1, 8  # 150 rows: several blocks of the small flash tiles
TILES = dict(forward_tiles=(32, 32, 2), backward_tiles=(16, 32, 2))
BLIND = np.arange(T) >= 70  # rows 70.. have every visible logit at -inf


def _qkv():
    return (jnp.asarray(randn(s, B, T, n, H)) for s, n in ((1, N), (2, K), (3, K)))


def _attend(name, q, k, v, **rules):
    if name == "flash":
        return nanoattn.flash_attention(q, k, v, return_residual=True, **TILES, **rules)
    return nanoattn.dot_product_attention(
        q, k, v, return_residual=True, implementation=name, **rules
    )


def _served(name, **rules):
    q, k, v = _qkv()
    try:
        return jax.jit(functools.partial(_attend, name, **rules))(q, k, v)
    except ValueError as error:
        skip_refusal(error, name)


def _check_blind_rows(out, lse, q, k, v, allowed):
    out, lse = np.asarray(out), np.asarray(lse)
    assert (out[:, BLIND] == 0).all() and (lse[:, BLIND] == -np.inf).all()
    want = np_attention(q, k, v, allowed)
    np.testing.assert_allclose(out[:, ~BLIND], want[:, ~BLIND], atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("name", registry.names())
def test_a_row_of_minus_inf_bias_is_a_row_that_sees_nothing(name):
    q, k, v = _qkv()
    causal = np.tril(np.ones((T, T), bool))
    bias = jnp.where(jnp.asarray(BLIND)[:, None], -jnp.inf, 0.0)[None, None]  # (1, 1, T, 1)
    bias = jnp.broadcast_to(bias, (1, 1, T, T))
    out, lse = _served(name, bias=bias, is_causal=True)
    _check_blind_rows(out, lse, q, k, v, causal)
    grad = jax.jit(jax.grad(lambda q: _attend(name, q, k, v, bias=bias, is_causal=True)[0].sum()))
    dq = np.asarray(grad(q))
    assert np.isfinite(dq).all() and (dq[:, BLIND] == 0).all()


@pytest.mark.parametrize("name", registry.names())
def test_a_score_fn_of_minus_inf_is_a_row_that_sees_nothing(name):
    q, k, v = _qkv()

    def blind(s, b, n, q_pos, k_pos):
        return jnp.where(q_pos >= 70, -jnp.inf, s)

    out, lse = _served(name, score_fn=blind, is_causal=True)
    _check_blind_rows(out, lse, q, k, v, np.tril(np.ones((T, T), bool)))


@pytest.mark.parametrize("name", registry.names())
def test_a_sink_of_plus_inf_takes_the_whole_row(name):
    q, k, v = _qkv()
    sinks = jnp.asarray([jnp.inf, 0.5])
    out, lse = _served(name, sinks=sinks, is_causal=True)
    out, lse = np.asarray(out), np.asarray(lse)
    assert (out[:, :, 0] == 0).all() and (lse[:, :, 0] == np.inf).all()
    want = nanoattn.dot_product_attention(
        q, k, v, sinks=jnp.asarray([0.0, 0.5]), is_causal=True, implementation="xla"
    )
    np.testing.assert_allclose(out[:, :, 1], want[:, :, 1], atol=2e-5, rtol=2e-5)

    def loss(q, sinks):
        return _attend(name, q, k, v, sinks=sinks, is_causal=True)[0].sum()

    dq, dsinks = jax.jit(jax.grad(loss, argnums=(0, 1)))(q, sinks)
    assert np.isfinite(dq).all() and np.isfinite(dsinks).all()
    assert (np.asarray(dq)[:, :, 0] == 0).all() and dsinks[0] == 0


def test_merge_attention_gives_a_part_of_plus_inf_the_whole_row():
    out = jnp.asarray(randn(1, B, 3, N, H))
    lse = jnp.asarray([[[0.0, np.inf], [1.0, 2.0], [-np.inf, -np.inf]]])  # (B, 3, N)
    zero = jnp.zeros_like(out)
    merged, merged_lse = nanoattn.merge_attention([out, zero], [lse, jnp.full_like(lse, 0.5)])
    np.testing.assert_array_equal(merged[:, 0, 1], out[:, 0, 1])  # the +inf part's output
    assert merged_lse[0, 0, 1] == np.inf and np.isfinite(merged_lse[0, 1:]).all()
    assert np.isfinite(merged).all()
