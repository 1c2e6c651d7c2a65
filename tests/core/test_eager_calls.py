"""Eager calls are compiled once for their static parts (nanoattn/_core/eager.py): a
second call with the same backend, sizes, flags, shapes and functions compiles nothing,
counted by jit's own cache (never timed). A function is kept by what decides its
values, so whatever it reads that changes (a numpy array written in place, a rebound
global or closure variable, a new jax array) gives a new program, never a stale one; a
function holding something that cannot be fingerprinted runs uncached, still right."""

import jax
import jax.numpy as jnp
import numpy as np

import nanoattn
from nanoattn._core import api

from _reference import randn

T = 300  # flash serves score_fn: the kernel whose eager call compiled every time
Q, K, V = (jnp.asarray(randn(s, 1, T, 2, 8)) for s in (1, 2, 3))
TABLE = np.zeros((2, 2 * T), np.float32)


def _want(table):
    table = jnp.asarray(table)
    return jax.jit(
        lambda q, k, v: nanoattn.dot_product_attention(
            q,
            k,
            v,
            is_causal=True,
            implementation="xla",
            score_fn=lambda s, b, n, qp, kp: s + table[n, qp - kp + T],
        )
    )(Q, K, V)


def _call(score_fn):
    return nanoattn.dot_product_attention(Q, K, V, is_causal=True, score_fn=score_fn)


def _compiles(run) -> int:
    before = api._compiled._cache_size()
    run()
    return api._compiled._cache_size() - before


def test_a_repeated_eager_call_compiles_once():
    table = jnp.asarray(randn(4, 2, 2 * T))

    def relative(s, b, n, qp, kp):
        return s + table[n, qp - kp + T]

    assert _compiles(lambda: _call(relative)) == 1
    assert _compiles(lambda: _call(relative)) == 0
    same = lambda s, b, n, qp, kp: s + table[n, qp - kp + T]  # noqa: E731 (another object)
    assert _compiles(lambda: _call(same)) == 1  # other code: another program
    assert _compiles(lambda: _call(same)) == 0
    np.testing.assert_allclose(_call(relative), _want(table), atol=2e-5)


def test_a_numpy_array_written_in_place_gives_a_new_program():
    table = np.zeros((2, 2 * T), np.float32)

    def relative(s, b, n, qp, kp):
        return s + jnp.asarray(table)[n, qp - kp + T]

    np.testing.assert_allclose(_call(relative), _want(table), atol=2e-5)
    table[:] = randn(5, 2, 2 * T)
    np.testing.assert_allclose(_call(relative), _want(table), atol=2e-5)


def test_a_rebound_global_or_closure_variable_gives_a_new_program():
    global TABLE

    def relative(s, b, n, qp, kp):
        return s + jnp.asarray(TABLE)[n, qp - kp + T]

    first = np.asarray(_call(relative))
    TABLE = randn(6, 2, 2 * T)
    np.testing.assert_allclose(_call(relative), _want(TABLE), atol=2e-5)
    assert not np.allclose(first, _call(relative))

    slope = 0.0

    def alibi(s, b, n, qp, kp):
        return s + slope * (kp - qp)

    flat = np.asarray(_call(alibi))
    slope = 0.5
    tilted = np.asarray(_call(alibi))
    # the same scores as a table: entry qp - kp + T holds 0.5 (kp - qp)
    want = _want(np.broadcast_to(-0.5 * (np.arange(2 * T) - T), (2, 2 * T)))
    assert not np.allclose(flat, tilted)
    np.testing.assert_allclose(tilted, want, atol=2e-5)


def test_a_function_holding_a_mutable_container_runs_uncached_and_right():
    tables = {"relative": np.zeros((2, 2 * T), np.float32)}

    def relative(s, b, n, qp, kp):
        return s + jnp.asarray(tables["relative"])[n, qp - kp + T]

    assert _compiles(lambda: _call(relative)) == 0  # not kept: compiled on each call
    tables["relative"] = randn(7, 2, 2 * T)
    np.testing.assert_allclose(_call(relative), _want(tables["relative"]), atol=2e-5)
