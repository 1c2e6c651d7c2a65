"""The functional core (nanoattn/_core/api.py: dot_product_attention, attention_weights)
against an independent float64 numpy reference (_reference.py)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

import nanoattn
from nanoattn import attention_weights, dot_product_attention, padding_mask

from _backends import each_backend, refusal, require
from _reference import np_attention, np_causal, randn

B, T, S, N, K, H = 2, 5, 7, 6, 2, 8  # every axis a different size


def qkv(seed=0, t=T, s=S, n=N, k=K, h=H, b=B, dtype=np.float32):
    return (
        randn(seed, b, t, n, h, dtype=dtype),
        randn(seed + 1, b, s, k, h, dtype=dtype),
        randn(seed + 2, b, s, k, h, dtype=dtype),
    )


def test_matches_reference_no_mask():
    q, k, v = qkv()
    got = dot_product_attention(q, k, v)
    assert got.shape == (B, T, N, H) and got.dtype == jnp.float32
    np.testing.assert_allclose(got, np_attention(q, k, v), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("q_offset", [0, S - T, 1])
def test_causal_rectangular_offsets(q_offset):
    q, k, v = qkv(1)
    got = dot_product_attention(q, k, v, is_causal=True, q_offset=q_offset)
    want = np_attention(q, k, v, allowed=np_causal(T, S, q_offset))
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)


def test_causal_square_defaults_to_offset_zero():
    q, k, v = qkv(2, s=T)
    got = dot_product_attention(q, k, v, is_causal=True)
    np.testing.assert_allclose(got, np_attention(q, k, v, allowed=np_causal(T, T)), atol=1e-5)


def test_batched_q_offset():
    q, k, v = qkv(3)
    off = jnp.array([0, 2])
    got = dot_product_attention(q, k, v, is_causal=True, q_offset=off)
    for b in range(B):
        want = np_attention(
            q[b : b + 1], k[b : b + 1], v[b : b + 1], allowed=np_causal(T, S, int(off[b]))
        )
        np.testing.assert_allclose(got[b : b + 1], want, atol=1e-5)


def test_mask_causal_lengths_and_bias_combine_by_and():
    q, k, v = qkv(4)
    mask = np.random.default_rng(0).random((B, 1, T, S)) > 0.3
    bias = randn(9, 1, N, T, S)
    lengths = np.array([7, 4])
    got = dot_product_attention(
        q, k, v, mask=mask, bias=bias, is_causal=True, q_offset=2, kv_lengths=lengths
    )
    allowed = mask & np_causal(T, S, 2) & (np.arange(S) < lengths[:, None])[:, None, None, :]
    want = np_attention(q, k, v, allowed=allowed, bias=bias)
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)


def test_grouped_query_heads_use_contiguous_groups():
    # Query head n must use key/value head n // (N / K): heads 0-2 use kv head 0.
    q, k, v = qkv(5)
    got = np.asarray(dot_product_attention(q, k, v))
    G = N // K
    for n in range(N):
        one = dot_product_attention(
            q[:, :, n : n + 1], k[:, :, n // G : n // G + 1], v[:, :, n // G : n // G + 1]
        )
        np.testing.assert_allclose(got[:, :, n : n + 1], one, atol=1e-6)


def test_multi_query_attention():
    q, k, v = qkv(6, k=1)
    np.testing.assert_allclose(dot_product_attention(q, k, v), np_attention(q, k, v), atol=1e-5)


def test_scale_argument():
    q, k, v = qkv(7)
    got = dot_product_attention(q, k, v, scale=0.3)
    np.testing.assert_allclose(got, np_attention(q, k, v, scale=0.3), atol=1e-5)


def test_weights_rows_sum_to_one_and_blocked_cells_are_zero():
    q, k, _ = qkv(8)
    w = np.asarray(attention_weights(q, k, is_causal=True, q_offset=0, kv_lengths=np.array([7, 3])))
    assert w.shape == (B, N, T, S)
    allowed = (
        np_causal(T, S, 0)[None, None]
        & (np.arange(S) < np.array([7, 3])[:, None])[:, None, None, :]
    )
    allowed = np.broadcast_to(allowed, w.shape)
    np.testing.assert_allclose(w.sum(-1), 1.0, atol=1e-6)
    assert (w[~allowed] == 0).all()
    np.testing.assert_allclose(
        w, np_attention(q, k, k, allowed=allowed, return_weights=True), atol=1e-6
    )


def test_fully_masked_rows_give_zeros_and_zero_finite_gradients():
    q, k, v = qkv(9)
    mask = np.ones((B, 1, T, S), bool)
    mask[0, 0, 1] = False  # query 1 of batch 0 sees nothing
    lengths = np.array([7, 0])  # every query of batch 1 sees nothing

    def f(q, k, v):
        return dot_product_attention(q, k, v, mask=mask, kv_lengths=lengths)

    out = f(q, k, v)
    assert (out[0, 1] == 0).all() and (out[1] == 0).all()
    w = attention_weights(q, k, mask=mask, kv_lengths=lengths)
    assert (w[0, :, 1] == 0).all() and (w[1] == 0).all()
    np.testing.assert_allclose(out[0, 0], np_attention(q, k, v)[0, 0], atol=1e-5)

    # Gradients of the blocked rows' outputs are exactly zero; all gradients finite.
    grads = jax.grad(lambda *a: f(*a)[0, 1].sum() + f(*a)[1].sum(), argnums=(0, 1, 2))(q, k, v)
    for g in grads:
        assert np.isfinite(g).all()
        assert (np.asarray(g) == 0).all()
    full = jax.grad(lambda *a: (f(*a) ** 2).sum(), argnums=(0, 1, 2))(q, k, v)
    assert all(np.isfinite(g).all() for g in full)
    assert (full[0][1] == 0).all() and (full[0][0, 1] == 0).all()


def test_huge_logits_stay_finite_and_pick_the_max():
    q, k, v = qkv(10)
    q = q * 1e15  # logits around 1e30: still finite in float32
    k = k * 1e15
    out = dot_product_attention(q, k, v, is_causal=True, q_offset=0)
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out, np_attention(q, k, v, allowed=np_causal(T, S)), atol=1e-5)


def test_huge_negative_bias_is_not_a_mask():
    # A finite bias far below the large negative must not revive blocked keys.
    q, k, v = qkv(11)
    bias = np.zeros((1, 1, T, S), np.float32)
    bias[..., 0] = -3e38
    out = dot_product_attention(q, k, v, bias=bias, is_causal=True, q_offset=0)
    assert np.isfinite(out).all()


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_half_precision_inputs(dtype):
    q, k, v = (jnp.asarray(a, dtype) for a in qkv(12))
    out = dot_product_attention(q, k, v, is_causal=True, q_offset=0)
    assert out.dtype == dtype
    want = np_attention(*(np.asarray(a, np.float64) for a in (q, k, v)), allowed=np_causal(T, S))
    err = np.abs(np.asarray(out, np.float64) - want).max()
    # Only the final rounding to the half dtype remains: a few units in the last place.
    eps = float(jnp.finfo(dtype).eps)
    assert err <= 4 * eps * np.abs(want).max(), err


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
def test_softmax_runs_in_float32(dtype):
    q, k, v = (jnp.asarray(a, dtype) for a in qkv(13))
    jaxpr = jax.make_jaxpr(lambda *a: dot_product_attention(*a, is_causal=True, q_offset=0))(
        q, k, v
    )
    exps = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "exp"]
    assert exps and all(e.outvars[0].aval.dtype == jnp.float32 for e in exps)
    # The logits too: q k^T of half-precision operands is accumulated into float32.
    dots = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "dot_general"]
    assert len(dots) == 2 and all(e.outvars[0].aval.dtype == jnp.float32 for e in dots)


def test_float64_stays_float64(x64):
    q, k, v = qkv(14, dtype=np.float64)
    out = dot_product_attention(q, k, v, is_causal=True, q_offset=1)
    assert out.dtype == jnp.float64
    np.testing.assert_allclose(out, np_attention(q, k, v, allowed=np_causal(T, S, 1)), atol=1e-12)


def test_float32_under_x64_never_widens(x64):
    # jax_enable_x64 widens JAX's defaults; float32 operands must still compute in float32
    # (key lengths and segment ids bring in the code that zeroes unseen keys and queries).
    q, k, v = qkv(18)
    ids = np.repeat(np.array([[0, 0, 1, 1, 2, 2, 2]], np.int32), B, 0)
    kwargs = dict(kv_lengths=np.array([S, 3]), q_segment_ids=ids[:, :T], kv_segment_ids=ids)
    kwargs["bias"] = randn(22, B, N, T, S)
    jaxpr = jax.make_jaxpr(lambda *a: dot_product_attention(*a, implementation="xla", **kwargs))
    widened = [
        e.primitive.name
        for e in jaxpr(q, k, v).jaxpr.eqns
        for x in e.outvars
        if getattr(x.aval, "dtype", None) == jnp.float64
    ]
    assert not widened, widened


def test_mixed_float64_operands_compute_in_float64(x64):
    # The compute dtype is the widest of the operands: one float64 operand is enough.
    q, k, v = qkv(19, dtype=np.float64)
    f32 = np.float32
    for args in ((q, k.astype(f32), v.astype(f32)), (q, k, v.astype(f32))):
        want = np_attention(*(np.asarray(a, np.float64) for a in args))
        out = dot_product_attention(*args, implementation="xla")
        np.testing.assert_allclose(out, want, atol=1e-12)

    # A float32 query with a float64 key: weights come back in float32, but the key's
    # gradient is float64 and as exact as with a float64 query.
    def loss(q, k):
        weights = attention_weights(q, k).astype(jnp.float64)
        return jnp.sum(weights * np.arange(S).reshape(1, 1, 1, S))  # exact in f32

    dk = jax.grad(loss, argnums=1)(q.astype(f32), k)
    want = jax.grad(loss, argnums=1)(q.astype(f32).astype(np.float64), k)
    assert dk.dtype == jnp.float64
    np.testing.assert_allclose(dk, want, atol=1e-12)

    # A float64 value with float32 query and key: the weights are float32, and the
    # value's gradient is their exact float64 product with the output's cotangent.
    q32, k32 = q.astype(f32), k.astype(f32)
    cot = np.broadcast_to(np.arange(H, dtype=np.float64), (B, T, N, H))  # exact in f32

    def loss_v(v):
        out = dot_product_attention(q32, k32, v, implementation="xla")
        return jnp.sum(out.astype(jnp.float64) * cot)

    p = np.asarray(attention_weights(q32, k32), np.float64).reshape(B, K, N // K, T, S)
    want_dv = np.einsum("BKGTS,BTKGH->BSKH", p, cot.reshape(B, T, K, N // K, H))
    np.testing.assert_allclose(jax.grad(loss_v)(v), want_dv, atol=1e-12)


@each_backend()
@pytest.mark.parametrize("t, s", [(3, 0), (0, 5), (0, 0)])
def test_no_keys_or_no_queries_give_zeros_on_every_backend(implementation, t, s):
    # No key to see: every row sees nothing, so zeros, and zero gradients (found by
    # mutation testing: the reference raised numpy's "zero-size array", flash divided
    # by zero, native gave zeros).
    q, k, v = qkv(21, t=t, s=s)
    require(implementation, q, k, v)

    def loss(q, k, v):
        return dot_product_attention(q, k, v, implementation=implementation).sum()

    out = dot_product_attention(q, k, v, implementation=implementation)
    assert out.shape == (B, t, N, H) and not np.asarray(out).any()
    for g, x in zip(jax.grad(loss, argnums=(0, 1, 2))(q, k, v), (q, k, v)):
        assert g.shape == x.shape and not np.asarray(g).any()
    assert attention_weights(q, k).shape == (B, N, t, s)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32, jnp.float64])
def test_large_negative_is_finite_with_headroom(dtype):
    # It stands in for -inf at blocked logits: finite in the dtype, and far enough from
    # its edge that subtracting a row maximum or adding a bias cannot overflow it.
    x = np.asarray(nanoattn.large_negative(dtype), dtype)
    edge = float(jnp.finfo(dtype).max)
    assert np.isfinite(x) and -0.8 * edge < float(x) < -0.5 * edge


def test_rows_far_apart_are_each_normalized():
    # A per-row constant added to the logits changes nothing, however large: each row
    # is shifted by its own maximum, never by one shared across rows.
    q, k, v = qkv(20)
    shift = np.where(np.arange(T) % 2 == 0, 150.0, -150.0).astype(np.float32)
    bias = np.broadcast_to(shift[:, None], (B, N, T, S))
    got = dot_product_attention(q, k, v, bias=bias, implementation="xla")
    np.testing.assert_allclose(got, np_attention(q, k, v), atol=1e-5)


@pytest.mark.slow
def test_check_grads_float64(x64):
    q, k, v = qkv(15, dtype=np.float64)
    mask = np.random.default_rng(1).random((B, 1, T, S)) > 0.2
    bias = randn(16, B, N, T, S, dtype=np.float64)

    def f(q, k, v, bias):
        return dot_product_attention(q, k, v, mask=mask, bias=bias, is_causal=True, q_offset=2)

    check_grads(f, (q, k, v, bias), order=2, modes=["rev"], eps=1e-4)
    check_grads(f, (q, k, v, bias), order=1, modes=["fwd"], eps=1e-4)


def test_jit_matches_eager():
    q, k, v = qkv(17)
    f = jax.jit(
        lambda q, k, v, n: dot_product_attention(q, k, v, is_causal=True, q_offset=2, kv_lengths=n)
    )
    n = np.array([6, 3])
    np.testing.assert_allclose(
        f(q, k, v, n),
        dot_product_attention(q, k, v, is_causal=True, q_offset=2, kv_lengths=n),
        atol=1e-6,
    )


def test_traced_q_offset_under_jit():
    q, k, v = qkv(18)
    f = jax.jit(lambda off: dot_product_attention(q, k, v, is_causal=True, q_offset=off))
    np.testing.assert_allclose(
        f(jnp.int32(2)), np_attention(q, k, v, allowed=np_causal(T, S, 2)), atol=1e-5
    )


def test_vmap_over_an_extra_axis():
    qs, ks, vs = (np.stack([a, a * 0.5 + 1]) for a in qkv(19))
    f = jax.vmap(lambda q, k, v: dot_product_attention(q, k, v, is_causal=True, q_offset=0))
    got = f(qs, ks, vs)
    for i in range(2):
        np.testing.assert_allclose(
            got[i], np_attention(qs[i], ks[i], vs[i], allowed=np_causal(T, S)), atol=1e-5
        )


def test_padded_content_changes_nothing():
    q, k, v = qkv(20)
    lengths = np.array([7, 4])
    base = dot_product_attention(q, k, v, kv_lengths=lengths, is_causal=True, q_offset=2)
    k2, v2 = k.copy(), v.copy()
    k2[1, 4:], v2[1, 4:] = 1e30, -1e30
    got = dot_product_attention(q, k2, v2, kv_lengths=lengths, is_causal=True, q_offset=2)
    np.testing.assert_array_equal(got, base)
    valid = np.arange(S) < lengths[:, None]
    got = dot_product_attention(q, k2, v2, mask=padding_mask(valid), is_causal=True, q_offset=2)
    np.testing.assert_array_equal(got, base)


def test_dropout_inverted_scaling_and_rng():
    q, k, v = qkv(21, h=S)  # head width S, so that value can be the identity
    rate = 0.25
    w = attention_weights(q, k)
    v_eye = jnp.broadcast_to(jnp.eye(S)[None, :, None, :], (B, S, K, S))  # out = weights
    run = jax.jit(
        lambda rng: dot_product_attention(q, k, v_eye, dropout_rate=rate, dropout_rng=rng)
    )
    outs = np.stack([run(jax.random.key(i)) for i in range(300)])  # (R, B, T, N, S)
    dropped = np.moveaxis(outs, 3, 2)  # (R, B, N, T, S)
    assert abs((dropped == 0).mean() - rate) < 0.01
    # Unbiased: the mean over R draws is w within 5 standard errors, w * sqrt(rate/(1-rate)/R).
    stderr = np.asarray(w) * np.sqrt(rate / (1 - rate) / len(dropped))
    assert (np.abs(dropped.mean(0) - w) <= 5 * stderr + 1e-6).all()
    kept = dropped != 0
    np.testing.assert_allclose(
        dropped[kept], np.broadcast_to(w, dropped.shape)[kept] / (1 - rate), rtol=1e-5
    )
    same = dot_product_attention(q, k, v, dropout_rate=rate, dropout_rng=jax.random.key(0))
    again = dot_product_attention(q, k, v, dropout_rate=rate, dropout_rng=jax.random.key(0))
    np.testing.assert_array_equal(same, again)
    np.testing.assert_array_equal(
        dot_product_attention(q, k, v, dropout_rate=0.0), dot_product_attention(q, k, v)
    )


@pytest.mark.parametrize(
    "kwargs, error, pattern",
    [
        (
            dict(query=np.ones((2, 5))),
            ValueError,
            r"^query must have shape \(B, T, N, H\) or \(T, N, H\), got \(2, 5\)$",
        ),
        (
            dict(query=np.ones((2, 5, 6))),
            ValueError,
            r"^query \(T, N, H\) = \(2, 5, 6\) is unbatched, so key must be too: \(S, K, H\), "
            r"got \(2, 7, 2, 8\)$",
        ),
        (
            dict(key=np.ones((3, S, K, H))),
            ValueError,
            r"key must have shape \(B, S, K, H\) = \(2, \*, \*, 8\), got \(3, 7, 2, 8\)",
        ),
        (
            dict(key=np.ones((B, S, K, 4))),
            ValueError,
            r"key must have shape \(B, S, K, H\) = \(2, \*, \*, 8\), got \(2, 7, 2, 4\)",
        ),
        (
            dict(value=np.ones((B, 6, K, H))),
            ValueError,
            r"value must have shape \(B, S, K, Hv\) = \(2, 7, 2, \*\), got \(2, 6, 2, 8\)",
        ),
        (
            dict(key=np.ones((B, S, 4, H)), value=np.ones((B, S, 4, H))),
            ValueError,
            r"N=6 must be a multiple of .* K=4",
        ),
        (
            dict(mask=np.ones((T, 8), bool)),
            ValueError,
            r"mask must be broadcastable to \(B, N, T, S\) = \(2, 6, 5, 7\), got \(5, 8\)",
        ),
        (dict(mask=np.ones((1, 1, 1, T, S), bool)), ValueError, "mask must be broadcastable"),
        (dict(mask=np.ones((T, S))), TypeError, "mask must be a boolean array.*float"),
        (
            dict(bias=np.ones((3, 1, T, S))),
            ValueError,
            r"bias must be broadcastable to \(B, N, T, S\)",
        ),
        (
            dict(kv_lengths=np.array([1, 2, 3])),
            ValueError,
            r"kv_lengths must have shape \(B,\) = \(2,\), got \(3,\)",
        ),
        (dict(kv_lengths=np.array([1.0, 2.0])), TypeError, "kv_lengths must be an integer"),
        (dict(is_causal=True), ValueError, r"q_offset=0 aligns .* top-left.*S-T=2.*bottom-right"),
        (dict(q_offset=1), ValueError, "q_offset only applies to causal"),
        (
            dict(is_causal=True, q_offset=np.array([1, 2, 3])),
            ValueError,
            r"q_offset must have shape \(B,\)",
        ),
        (dict(dropout_rate=0.1), ValueError, "needs dropout_rng"),
        (
            dict(dropout_rate=1.0, dropout_rng=jax.random.key(0)),
            ValueError,
            r"dropout_rate must be in \[0, 1\)",
        ),
        (dict(query=np.ones((B, T, N, H), np.int32)), TypeError, "query must be a floating"),
    ],
)
def test_invalid_inputs(kwargs, error, pattern):
    q, k, v = qkv(22)
    args = dict(query=q, key=k, value=v) | kwargs
    with pytest.raises(error, match=pattern):
        dot_product_attention(**args)


def test_attention_weights_validates_too():
    q, k, _ = qkv(23)
    with pytest.raises(ValueError, match="needs q_offset"):
        attention_weights(q, k, is_causal=True)
    with pytest.raises(TypeError, match="boolean"):
        attention_weights(q, k, mask=np.ones((T, S), np.int32))


# Unbatched calls, as jax.nn takes them: query (T, N, H), key and value (S, K, H), a mask
# or bias broadcastable to (N, T, S), a scalar kv_lengths, segment ids (T,) and (S,).
UNBATCHED_RULES = {
    "plain": {},
    "causal-offset": dict(is_causal=True, q_offset=2),
    "window-lengths": dict(window=(2, 1), q_offset=1, kv_lengths=np.int32(5)),
    "segments-cap": dict(
        q_segment_ids=np.array([0, 0, 1, 1, 1]), kv_segment_ids=np.array([0, 0, 0, 1, 1, 1, 1]),
        logit_soft_cap=3.0,
    ),
    "mask-bias": dict(mask=randn(9, N, T, S) > 0, bias=randn(10, N, T, S)),
}  # fmt: skip


def _batched_rules(rules):
    """The same rules for a batch of one."""
    out = dict(rules)
    for name in ("kv_lengths", "q_segment_ids", "kv_segment_ids", "mask", "bias"):
        if name in out:
            out[name] = np.asarray(out[name])[None]
    return out


@each_backend()
def test_unbatched_calls_equal_a_batch_of_one_on_every_backend(implementation):
    q, k, v = (x[0] for x in qkv(30))
    require(implementation, q[None], k[None], v[None])
    rules = {  # the rules the backend serves
        n: r
        for n, r in UNBATCHED_RULES.items()
        if refusal(implementation, q[None], k[None], v[None], **_batched_rules(r)) is None
    }

    @jax.jit
    def run(q, k, v):  # every rule unbatched, and batched with B = 1: one compilation
        def attend(q, k, v, **rules):
            return dot_product_attention(
                q, k, v, implementation=implementation, return_residual=True, **rules
            )

        return {
            name: (attend(q, k, v, **r), attend(q[None], k[None], v[None], **_batched_rules(r)))
            for name, r in rules.items()
        }

    for name, ((out, lse), (want, want_lse)) in run(q, k, v).items():
        assert out.shape == (T, N, H) and lse.shape == (T, N), name
        np.testing.assert_array_equal(out, want[0], err_msg=name)
        np.testing.assert_array_equal(lse, want_lse[0], err_msg=name)
    rules = UNBATCHED_RULES["segments-cap"]
    weights = attention_weights(q, k, **rules)
    assert weights.shape == (N, T, S)
    want = attention_weights(q[None], k[None], **_batched_rules(rules))[0]
    np.testing.assert_array_equal(weights, want)
