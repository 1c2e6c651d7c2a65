"""One log-sum-exp convention across the kernels that produce one (flash, native,
the ring): lse (B, T, N) float32 is the log of each row's softmax denominator,
log sum_s exp(scale q.k_s) over the visible keys, and ``-inf`` for a row that sees
no key (the convention of jax.nn's residuals and of logsumexp of an empty set).
Here the kernels' own blocks; the public ``return_residual`` of every backend, values
and gradients, is in the backend test base (tests/_backend_base.py)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import nanoattn
from nanoattn._backends import native
from nanoattn._backends.flash.kernel import BlockInputs, forward_block, kernel_rules
from nanoattn._backends.flash.plan import kernel_plans
from nanoattn._base.rules import Rules
from nanoattn.parallel import _blocks, ring_attention

B, T, S, N, K, H = 3, 11, 13, 4, 2, 8


def _inputs(T=T, S=S):
    rng = np.random.default_rng(7)
    q = jnp.asarray(rng.standard_normal((B, T, N, H)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((B, S, K, H)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((B, S, K, H)), jnp.float32)
    return q, k, v


def _truth(q, k, allowed, scale):
    """Float64 log-sum-exp (B, T, N) of the visible logits; -inf where none is."""
    q, k = np.asarray(q, np.float64), np.repeat(np.asarray(k, np.float64), N // K, axis=2)
    logits = np.einsum("btnh,bsnh->btns", q, k) * scale
    allowed = np.broadcast_to(allowed, logits.shape)
    top = np.where(allowed, logits, -np.inf).max(-1, keepdims=True)
    safe = np.where(np.isfinite(top), top, 0)
    total = np.where(allowed, np.exp(logits - safe), 0).sum(-1)
    with np.errstate(divide="ignore"):
        return np.log(total) + safe[..., 0]


# (name, arguments, visible (B|1, T|1, 1, S)): each has whole rows that see no key.
CASES = [
    ("lengths", dict(kv_lengths=jnp.array([0, 5, S])),
     (np.arange(S) < np.array([0, 5, S])[:, None])[:, None, None, :]),
    ("causal-offset", dict(is_causal=True, q_offset=-3),
     (np.arange(S)[None, :] <= np.arange(T)[:, None] - 3)[None, :, None, :]),
    ("segments", dict(q_segment_ids=jnp.full((B, T), 1).at[:, :4].set(2),
                      kv_segment_ids=jnp.ones((B, S), jnp.int32)),
     (np.arange(T) >= 4)[None, :, None, None] & np.ones((1, 1, 1, S), bool)),
]  # fmt: skip


def _check(lse, q, k, visible):
    want = _truth(q, k, visible, 1 / np.sqrt(H))
    lse = np.asarray(lse)
    assert lse.shape == (B, q.shape[1], N) and lse.dtype == np.float32
    blind = ~np.broadcast_to(visible.any(-1), lse.shape)
    assert blind.any() and (~blind).any()
    np.testing.assert_array_equal(lse[blind], -np.inf)
    np.testing.assert_allclose(lse[~blind], want[~blind], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name, kwargs, visible", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("tiles", [None, (4, 8, 2)], ids=["default-tiles", "small-tiles"])
def test_flash_forward_block_lse(name, kwargs, visible, tiles):
    q, k, v = _inputs()
    spec = Rules.make(q, k, v, **kwargs)
    plan = kernel_plans(spec, tiles).forward
    inputs = BlockInputs(query=q, key=k, value=v, rules=kernel_rules(spec))
    _, lse = jax.jit(forward_block, static_argnums=0)(plan, inputs)
    _check(lse, q, k, visible)


@pytest.mark.parametrize("name, kwargs, visible", CASES, ids=[c[0] for c in CASES])
def test_native_forward_lse(name, kwargs, visible):
    if native.load()[0] is None:
        pytest.skip("the native kernel is not available here")
    q, k, v = _inputs()
    spec = Rules.make(q, k, v, **kwargs)
    _, lse = native.native_attention(q, k, v, spec)
    _check(lse, q, k, visible)


def test_ring_merges_lse_exactly_and_keeps_minus_inf_for_empty_rows():
    rng = np.random.default_rng(3)
    outs = jnp.asarray(rng.standard_normal((2, B, T, N, H)), jnp.float32)
    lses = jnp.asarray(rng.standard_normal((2, B, T, N)), jnp.float32)
    lses = lses.at[0, 0].set(-jnp.inf).at[:, 1, :2].set(-jnp.inf)  # empty parts, empty rows
    out, lse = _blocks.merge((outs[0], lses[0]), (outs[1], lses[1]))
    a, b = np.asarray(lses[0], np.float64), np.asarray(lses[1], np.float64)
    np.testing.assert_allclose(lse, np.logaddexp(a, b), rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(lse)[1, :2], -np.inf)
    np.testing.assert_array_equal(np.asarray(out)[1, :2], 0)  # nothing seen: zeros
    np.testing.assert_array_equal(out[0], outs[1, 0])  # an empty part weighs nothing


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
def test_ring_forward_lse_on_one_device(layout):
    q, k, v = _inputs(T=12, S=12)
    lengths = jnp.array([0, 5, 12])
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("sp",))

    def forward(q, k, v, lengths):
        return ring_attention(
            q, k, v, axis_name="sp", mesh=mesh, layout=layout, is_causal=True,
            kv_lengths=lengths, return_residual=True,
        )  # fmt: skip

    _, lse = jax.jit(forward)(q, k, v, lengths)
    causal = np.arange(12)[None, :] <= np.arange(12)[:, None]
    visible = (
        causal[None, :, None, :] & (np.arange(12) < np.asarray(lengths)[:, None])[:, None, None, :]
    )
    _check(lse, q, k, visible)


# return_residual: the public log-sum-exp of dot_product_attention, its values and its
# gradient on every backend and every rule, is held against the float64 truth by the
# backend test base (tests/_backend_base.py); flash_attention returns it too.


def test_flash_attention_returns_the_residual_too():
    q, k, v = _inputs(T=T, S=S)
    rules = dict(is_causal=True, q_offset=0, kv_lengths=jnp.array([0, 7, S]))
    out, lse = nanoattn.flash_attention(
        q, k, v, return_residual=True, forward_tiles=(4, 8, 2), backward_tiles=(4, 4, 3), **rules
    )
    want_out, want_lse = nanoattn.dot_product_attention(
        q, k, v, implementation="xla", return_residual=True, **rules
    )
    np.testing.assert_allclose(out, want_out, atol=1e-5)
    np.testing.assert_allclose(lse, want_lse, atol=1e-5)
    assert nanoattn.flash_attention(q, k, v, **rules).shape == (B, T, N, H)
