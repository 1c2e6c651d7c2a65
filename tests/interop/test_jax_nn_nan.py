"""jax_nn_attention keeps a NaN a query sees visible, as jax.nn does: a row with a NaN
query, or that attends a NaN key, is NaN (not the zeros or mean of a row that sees no
key), and exactly the rows jax.nn makes NaN are NaN, on every backend that serves the
call (the automatic choice made to take it)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from nanoattn import jax_nn_attention
from nanoattn._backends import dispatch, registry

from _backends import skip_refusal

B, T, S, N, K, H = 2, 5, 7, 4, 2, 8


def _inputs():
    rng = np.random.default_rng(0)
    q = rng.standard_normal((B, T, N, H)).astype(np.float32)
    k, v = (rng.standard_normal((B, S, K, H)).astype(np.float32) for _ in range(2))
    q[0, 2, 1, 3] = np.nan  # query 2 of row 0, head 1
    k[1, 2, 0, 0] = np.nan  # key 2 of row 1, the key/value head of query heads 0 and 1
    return jnp.asarray(q), jnp.asarray(k), jnp.asarray(v)


@pytest.mark.parametrize("name", registry.names())
@pytest.mark.parametrize(
    "rules",
    [dict(), dict(is_causal=True), dict(key_value_seq_lengths=jnp.array([7, 3]))],
    ids=["all keys", "causal", "key lengths"],
)
def test_a_row_that_sees_a_nan_is_nan_as_in_jax_nn(monkeypatch, name, rules):
    q, k, v = _inputs()
    original = dispatch.choose
    chosen = []

    def choose(requested, rules_, dtype, rate):
        chosen.append(original(name, rules_, dtype, rate))  # raises where it cannot serve
        return chosen[-1]

    monkeypatch.setattr(dispatch, "choose", choose)
    try:
        ours = np.asarray(jax_nn_attention(q, k, v, **rules))
    except ValueError as error:
        skip_refusal(error, name)
    assert chosen == [name]
    theirs = np.asarray(jax.nn.dot_product_attention(q, k, v, **rules))
    nan = np.isnan(theirs)
    assert nan[0, 2, 1].all()  # the NaN query's own row and head
    assert nan.any(axis=-1).sum() > 1
    np.testing.assert_array_equal(np.isnan(ours), nan)
    np.testing.assert_allclose(ours[~nan], theirs[~nan], atol=1e-5, rtol=1e-5)
