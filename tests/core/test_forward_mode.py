"""Forward-mode differentiation (jax.jvp, jax.jacfwd, jax.hessian) through nanoattn,
against jax.nn's own forward-mode results: the kernels' gradients are custom_vjp
(reverse mode only), so the automatic choice serves such a call with the reference,
also when the jvp is taken of a jitted function; a kernel named for it, and the ring,
say why not in one line (nanoattn/_base/autodiff.py)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

import nanoattn
from nanoattn._backends import registry
from nanoattn.linen import AttentionConfig, CausalSelfAttention
from nanoattn.parallel import ring_attention

from _backends import serving
from _reference import randn

B, T, N, K, H = 1, 37, 4, 2, 8  # T * T cells: the automatic choice would take a kernel


def _qkv():
    return (jnp.asarray(randn(s, B, T, n, H)) for s, n in ((1, N), (2, K), (3, K)))


def _ours(k, v):
    return lambda q: nanoattn.dot_product_attention(q, k, v, is_causal=True)


def _adapter(k, v):
    return lambda q: nanoattn.jax_nn_attention(q, k, v, is_causal=True)


def _theirs(k, v):
    return lambda q: jax.nn.dot_product_attention(q, k, v, is_causal=True)


TRANSFORMS = {
    "jvp": lambda f, q, t: jax.jvp(f, (q,), (t,))[1],
    "jvp of jit": lambda f, q, t: jax.jvp(jax.jit(f), (q,), (t,))[1],
    "jit of jvp": lambda f, q, t: jax.jit(lambda q, t: jax.jvp(f, (q,), (t,))[1])(q, t),
    "jacfwd": lambda f, q, t: jax.jacfwd(lambda q: (f(q) * t).sum())(q),
    "hessian": lambda f, q, t: jax.hessian(lambda x: (f(q.at[0, :, 0, 0].set(x)) ** 2).sum())(
        q[0, :, 0, 0]
    ),
}


@pytest.mark.parametrize("transform", TRANSFORMS.values(), ids=TRANSFORMS)
@pytest.mark.parametrize("ours", [_ours, _adapter], ids=["dot_product_attention", "jax_nn"])
def test_forward_mode_equals_jax_nns(ours, transform):
    q, k, v = _qkv()
    tangent = jnp.asarray(randn(4, B, T, N, H))
    got, want = transform(ours(k, v), q, tangent), transform(_theirs(k, v), q, tangent)
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)


def test_a_layer_differentiates_in_forward_mode():
    layer = CausalSelfAttention(AttentionConfig(d_model=16, n_heads=2))
    x = jnp.asarray(randn(5, 1, T, 16))
    params = layer.init(jax.random.key(0), x, True)
    xla = CausalSelfAttention(AttentionConfig(d_model=16, n_heads=2, implementation="xla"))
    dx = jnp.asarray(randn(6, 1, T, 16))
    got = jax.jvp(lambda x: layer.apply(params, x, True), (x,), (dx,))[1]
    want = jax.jvp(lambda x: xla.apply(params, x, True), (x,), (dx,))[1]
    np.testing.assert_array_equal(got, want)


def test_reverse_mode_still_takes_the_kernel():
    from nanoattn._backends import dispatch

    q, k, v = _qkv()
    chosen = []
    original = dispatch.choose

    def spy(*args):
        chosen.append(original(*args))
        return chosen[-1]

    dispatch.choose = spy
    try:
        jax.grad(lambda q: _ours(k, v)(q).sum())(q)
        jax.jvp(_ours(k, v), (q,), (q,))
    finally:
        dispatch.choose = original
    # reverse mode: a kernel with a custom_vjp; forward mode: one that jax differentiates
    forward_mode = [getattr(registry.get(name), "forward_mode", False) for name in chosen]
    assert forward_mode == [False, True], chosen


def test_a_named_kernel_and_the_ring_refuse_forward_mode_in_one_line():
    q, k, v = _qkv()
    kernels = [n for n in serving(q, k, v) if not getattr(registry.get(n), "forward_mode", False)]
    assert kernels
    for name in kernels:
        f = lambda q, name=name: nanoattn.dot_product_attention(q, k, v, implementation=name)  # noqa: E731
        with pytest.raises(ValueError, match=rf"^implementation='{name}' cannot serve this call: "
                           r"jax differentiates this call in forward mode"):  # fmt: skip
            jax.jvp(f, (q,), (q,))
    mesh = Mesh(np.array(jax.devices()[:1]), ("sp",))
    q2, k2, v2 = (x[:, :36] for x in (q, k, v))
    ring = lambda q: ring_attention(q, k2, v2, axis_name="sp", mesh=mesh, is_causal=True)  # noqa: E731
    with pytest.raises(ValueError, match=r"^ring_attention's gradient is reverse-mode only"):
        jax.jvp(ring, (q2,), (q2,))
