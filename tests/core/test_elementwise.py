"""mask_fn and score_fn must be elementwise: a kernel calls them on blocks of any shape
and offset, so a function whose value in a block differs from its value beside its
neighbours would give an answer that depends on the backend and the length. Each call
evaluates them on a small grid of its own cells whole and in two blocks
(nanoattn/_base/mask_fn.py, ``check_elementwise``) and refuses such a function in
one line naming it and saying "elementwise": in dot_product_attention, the ring and
verify.check_mask."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

import nanoattn
from nanoattn.parallel import ring_attention
from nanoattn.verify import check_mask

from _reference import randn

NOT_ELEMENTWISE = {
    "score minus its row maximum": dict(score_fn=lambda s, b, n, q, k: s - s.max(-1)[..., None]),
    "log_softmax": dict(score_fn=lambda s, b, n, q, k: jax.nn.log_softmax(s)),
    "row sum": dict(score_fn=lambda s, b, n, q, k: s.sum(-1, keepdims=True)),
    "first key's score": dict(score_fn=lambda s, b, n, q, k: s[..., :1]),
    "below the last key": dict(mask_fn=lambda b, n, q, k: k < k.max()),
    "the grid's length": dict(mask_fn=lambda b, n, q, k: k < q.shape[2] - 2),
}  # fmt: skip
ELEMENTWISE = {
    "ALiBi": dict(score_fn=lambda s, b, n, q, k: s + 0.25 * (k - q)),
    "causal": dict(mask_fn=lambda b, n, q, k: k <= q),
    "a constant": dict(score_fn=lambda s, b, n, q, k: jnp.zeros(())),
}


def _qkv(T=40):
    return (jnp.asarray(randn(s, 2, T, 2, 8)) for s in (1, 2, 3))


def _argument(rules: dict) -> str:
    return next(iter(rules))


@pytest.mark.parametrize("rules", NOT_ELEMENTWISE.values(), ids=NOT_ELEMENTWISE)
def test_a_function_that_is_not_elementwise_is_refused_in_one_line(rules):
    q, k, v = _qkv()
    with pytest.raises(ValueError, match=rf"^{_argument(rules)} must be elementwise") as info:
        nanoattn.dot_product_attention(q, k, v, **rules)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("rules", ELEMENTWISE.values(), ids=ELEMENTWISE)
def test_elementwise_functions_pass_on_every_entry(rules):
    q, k, v = _qkv()
    nanoattn.dot_product_attention(q, k, v, **rules)
    nanoattn.attention_weights(q, k, **rules)


def test_functions_of_traced_arrays_are_not_read_at_trace_time():
    q, k, v = _qkv()

    @jax.jit
    def attend(slope):
        return nanoattn.dot_product_attention(
            q, k, v, score_fn=lambda s, b, n, qp, kp: s + slope * (kp - qp)
        )

    assert np.isfinite(attend(jnp.float32(0.5))).all()


@pytest.mark.parametrize("name", ["row sum", "below the last key"])
def test_the_ring_refuses_them_too(name):
    q, k, v = _qkv(16)
    mesh = Mesh(np.array(jax.devices()[:1]), ("sp",))
    rules = NOT_ELEMENTWISE[name]
    with pytest.raises(ValueError, match=rf"^{_argument(rules)} must be elementwise"):
        ring_attention(q, k, v, axis_name="sp", mesh=mesh, is_causal=True, **rules)


def test_check_mask_refuses_them_too():
    def layer(x):
        return jnp.cumsum(x, axis=1)

    mask_fn = NOT_ELEMENTWISE["below the last key"]["mask_fn"]
    with pytest.raises(ValueError, match=r"^mask_fn must be elementwise"):
        check_mask(layer, mask_fn, d_model=4, seq_lens=(5, 9))
