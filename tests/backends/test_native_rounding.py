"""bfloat16 rounding of the native kernel's results: round to nearest, ties to even,
as ``jnp.astype`` rounds (pack.h widens bfloat16 to float32 as it packs and
narrows each result once, simd.h's ``narrow``).

One query row per cotangent sees one key (q = 0, so each weight is 1): dv is the sum
of the two cotangents, exactly the float32 value that is then rounded to bfloat16."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import nanoattn
from nanoattn._backends import native as native_kernel

pytestmark = pytest.mark.skipif(
    native_kernel.load()[0] is None, reason="the native kernel could not be built here"
)


@pytest.mark.parametrize(
    "first, second, want",
    [
        (1 + 2**-7, 2**-8, 1 + 2**-6),  # halfway, odd below: up to the even neighbour
        (1.0, 2**-8, 1.0),  # halfway, even below: stays (rounding half up would not)
        (1 + 2**-7, 2**-9, 1 + 2**-7),  # below halfway: down
        (1 + 2**-7, 2**-8 + 2**-12, 1 + 2**-6),  # above halfway: up
    ],
)
def test_gradients_round_to_nearest_even_as_astype(first, second, want):
    bf = jnp.bfloat16
    q, k, v = jnp.zeros((1, 2, 1, 8), bf), jnp.zeros((1, 1, 1, 8), bf), jnp.ones((1, 1, 1, 8), bf)
    d_out = jnp.asarray([first, second], jnp.float32).astype(bf)
    d_out = jnp.broadcast_to(d_out[None, :, None, None], (1, 2, 1, 8))
    exact = np.float32(np.float32(first) + np.float32(second))
    assert jnp.asarray(exact).astype(bf) == want  # what jnp.astype gives

    def attend(q, k, v):
        return nanoattn.dot_product_attention(q, k, v, implementation="native")

    _, vjp = jax.vjp(attend, q, k, v)
    dv = vjp(d_out)[2]
    assert dv.dtype == bf
    np.testing.assert_array_equal(np.asarray(dv, np.float32), np.float32(want))
