"""Under jax's debug_infs, run eagerly, nanoattn raises only where a result holds an
inf: the -inf it keeps for a row that sees no key, or for a blockwise kernel's padded
query rows, never reaches an operation's output otherwise (padded rows' log-sum-exp is
finite until they are cut off; a call's work runs as one program under the flag,
nanoattn/_base/debug.py). Every backend that serves the call, forward and
gradients; the automatic choice with a bias and a score_fn."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import nanoattn
from nanoattn._backends import registry

from _backends import skip_refusal
from _reference import randn

T = 300  # not a multiple of any kernel block: padded query rows


def _qkv():
    return (jnp.asarray(randn(s, 1, T, 2, 8)) for s in (1, 2, 3))


@pytest.mark.parametrize("name", registry.names())
def test_an_eager_causal_call_and_its_gradient_raise_nothing(name):
    q, k, v = _qkv()

    def attend(q):
        return nanoattn.dot_product_attention(q, k, v, is_causal=True, implementation=name)

    try:
        want = jax.jit(attend)(q)
    except ValueError as error:
        skip_refusal(error, name)
    with jax.debug_infs(True):
        out = attend(q)
        grad = jax.grad(lambda q: attend(q).sum())(q)
    np.testing.assert_array_equal(out, want)
    assert np.isfinite(grad).all()


@pytest.mark.parametrize(
    "rules",
    [
        dict(bias=jnp.zeros((1, 1, T, T)), is_causal=True),
        dict(score_fn=lambda s, b, n, q, k: s + 0.01 * (k - q), is_causal=True),
        dict(mask=jnp.arange(T)[:, None] != 7),  # row 7 sees no key
    ],
    ids=["bias", "score_fn", "a row that sees no key"],
)
def test_the_automatic_choice_raises_nothing(rules):
    q, k, v = _qkv()
    with jax.debug_infs(True):
        out = nanoattn.dot_product_attention(q, k, v, **rules)
    assert np.isfinite(out).all()


def test_a_residual_that_holds_minus_inf_is_caught():
    q, k, v = _qkv()
    mask = jnp.arange(T)[:, None] != 7  # row 7 sees no key: its log-sum-exp is -inf
    with jax.debug_infs(True), pytest.raises(FloatingPointError):
        nanoattn.dot_product_attention(q, k, v, mask=mask, return_residual=True)
