"""nanoattn.merge_attention: attention over disjoint key sets, merged through their
log-sum-exps, equals one call over their union (docs/conventions.md, "The log-sum-exp").

The keys of one call are split into 2 to 4 disjoint parts, as contiguous chunks (a
long cache attended in pieces) and as interleaved or random subsets (segment ids
that give each key to one part); each part is a ``return_residual=True`` call on
every registered backend that serves it, and the merge must equal the whole call and
the float64 reference; its gradients equal the whole call's (on the reference: each
backend's own gradients of its output and log-sum-exp are in the backend test base,
tests/_backend_base.py). Then the rules of the merge itself, on literal
inputs: rows that no part saw, parts that saw nothing (not read, even when NaN),
visible NaN, dtypes, jit, vmap and unbatched parts. Bad arguments are rows of
tests/test_bad_input.py.
"""

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import nanoattn

from _backends import each_backend, require, serving
from _reference import np_attention, np_causal, np_lengths, np_lse, randn

B, T, S, N, K, H = 2, 13, 31, 6, 2, 8
Q_OFFSET = 15  # query i sits at position 15 + i: the last query sees keys 0 .. 27
LENGTHS = np.array([0, 23])  # row 0 sees no key at all: empty in every part
RULES = dict(is_causal=True, q_offset=Q_OFFSET, kv_lengths=jnp.asarray(LENGTHS))


def _qkv():
    q, k, v = randn(0, B, T, N, H), randn(1, B, S, K, H), randn(2, B, S, K, H)
    return jnp.asarray(q), jnp.asarray(k), jnp.asarray(v)


def _allowed():
    """(B, 1, T, S): what the whole call lets each query see."""
    return np_causal(T, S, Q_OFFSET)[None, None] & np_lengths(LENGTHS, S)


@functools.cache
def _float64():
    """The float64 reference (out, lse) of the whole call, computed once."""
    q, k, v = _qkv()
    return np_attention(q, k, v, allowed=_allowed()), np_lse(q, k, allowed=_allowed())


def _chunks(*bounds):
    """Contiguous chunks [a, b) of the keys, each a call on its slice at shifted
    positions: its queries at q_offset - a, its lengths clipped to the chunk."""

    def parts(q, k, v):
        lengths = RULES["kv_lengths"]
        return [
            (q, k[:, a:b], v[:, a:b],
             dict(RULES, q_offset=Q_OFFSET - a, kv_lengths=jnp.clip(lengths - a, 0, b - a)))
            for a, b in itertools.pairwise(bounds)
        ]  # fmt: skip

    return parts


def _subsets(owner):
    """Part p: every key, but the query sees key j only when ``owner[b, j] == p``
    (segment ids), on top of the whole call's rules."""

    def parts(q, k, v):
        return [
            (q, k, v, dict(RULES, q_segment_ids=jnp.full((B, T), p),
                           kv_segment_ids=jnp.asarray(owner, jnp.int32)))
            for p in range(int(owner.max()) + 1)
        ]  # fmt: skip

    return parts


SPLITS = {
    "halves": _chunks(0, 16, S),
    # chunk [20, 31) is empty for queries 0..4 of row 1, chunk [29, 31) for all of row 1
    "chunks-3": _chunks(0, 8, 20, S),
    "chunks-4": _chunks(0, 1, 20, 29, S),
    "interleaved-2": _subsets(np.broadcast_to(np.arange(S) % 2, (B, S))),
    "random-4": _subsets(np.random.default_rng(4).integers(0, 4, (B, S))),
}


def _merged(split, implementation, q, k, v):
    parts = [
        nanoattn.dot_product_attention(
            *qkv, implementation=implementation, return_residual=True, **rules
        )
        for *qkv, rules in SPLITS[split](q, k, v)
    ]
    return nanoattn.merge_attention([o for o, _ in parts], [lse for _, lse in parts])


def _whole(implementation, q, k, v):
    return nanoattn.dot_product_attention(
        q, k, v, implementation=implementation, return_residual=True, **RULES
    )


@pytest.mark.parametrize("split", SPLITS)
@each_backend()
def test_merged_parts_equal_the_whole_call_and_the_float64_reference(implementation, split):
    q, k, v = _qkv()
    for *part, rules in SPLITS[split](q, k, v):
        require(implementation, *part, return_residual=True, **rules)
    out, lse = jax.jit(functools.partial(_merged, split, implementation))(q, k, v)
    whole_out, whole_lse = jax.jit(functools.partial(_whole, implementation))(q, k, v)
    assert out.shape == (B, T, N, H) and out.dtype == jnp.float32
    assert lse.shape == (B, T, N) and lse.dtype == jnp.float32
    want_out, want_lse = _float64()
    empty = np.isneginf(want_lse)
    assert empty[0].all() and not empty[1].any()  # row 0 sees nothing, row 1 something
    np.testing.assert_array_equal(np.isneginf(lse), empty)
    np.testing.assert_array_equal(np.asarray(out)[0], 0)
    np.testing.assert_allclose(out, want_out, atol=2e-6, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(lse)[~empty], want_lse[~empty], atol=2e-6, rtol=1e-6)
    np.testing.assert_allclose(out, whole_out, atol=2e-6, rtol=1e-5)
    np.testing.assert_allclose(lse, whole_lse, atol=2e-6, rtol=1e-6)


def _vjp(fn, q, k, v, seed):
    """dq, dk, dv of ``fn``'s (out, lse) for random cotangents on both, everywhere
    but the lse of rows that see nothing (where lse is -inf, not differentiable)."""
    (out, lse), pullback = jax.vjp(fn, q, k, v)
    d_out = jnp.asarray(randn(seed, *out.shape))
    d_lse = jnp.where(jnp.isfinite(lse), jnp.asarray(randn(seed + 1, *lse.shape)), 0)
    return pullback((d_out, d_lse))


@pytest.mark.parametrize("split", ["random-4", "chunks-3", "chunks-4", "interleaved-2"])
def test_gradients_through_the_merge_equal_the_whole_calls(split):
    # On the reference: what each backend adds, the gradients of its output and its
    # log-sum-exp, is held against float64 by the backend test base on every backend.
    q, k, v = _qkv()
    merged = jax.jit(functools.partial(_merged, split, "xla"))
    whole = jax.jit(functools.partial(_whole, "xla"))
    for got, want, name in zip(_vjp(merged, q, k, v, 5), _vjp(whole, q, k, v, 5), "qkv"):
        assert np.isfinite(got).all(), f"d{name}"
        np.testing.assert_array_equal(np.asarray(got)[0], 0, err_msg=f"d{name} of the empty row")
        np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-4, err_msg=f"d{name}")


def test_parts_with_values_of_their_own_width_merge_to_the_float64_reference():
    """Values (B, S, K, Hv) narrower than the keys (multi-head latent attention): the
    parts' outputs (B, T, N, Hv) merge like any others, on every backend serving them."""
    q, k, _ = _qkv()
    v = jnp.asarray(randn(3, B, S, K, 5))  # Hv = 5
    names = serving(q, k, v, return_residual=True, **RULES)
    assert len(names) >= 2  # the reference and a kernel at least
    for implementation in names:
        out, lse = jax.jit(functools.partial(_merged, "chunks-3", implementation))(q, k, v)
        assert out.shape == (B, T, N, 5)
        want = np_attention(q, k, v, allowed=_allowed())
        np.testing.assert_allclose(out, want, atol=2e-6, rtol=1e-5, err_msg=implementation)
        np.testing.assert_allclose(lse, _float64()[1], atol=2e-6, rtol=1e-6)


# The merge itself, on literal parts: 2 rows of 3 queries, N = 2 heads of width H = 3.
def _parts(seed, P, shape=(2, 3, 2, 3)):
    outs = [jnp.asarray(randn(seed + p, *shape)) for p in range(P)]
    lses = [jnp.asarray(randn(seed + 10 + p, *shape[:-1])) for p in range(P)]
    return outs, lses


def test_merge_by_hand():
    # Part 1 holds e^0 = 1 of the row's softmax denominator, part 2 holds e^log3 = 3.
    ones = jnp.ones((1, 1, 1, 2))
    out, lse = nanoattn.merge_attention(
        [ones, 5 * ones], [jnp.zeros((1, 1, 1)), jnp.full((1, 1, 1), np.log(3.0))]
    )
    np.testing.assert_allclose(out, np.full((1, 1, 1, 2), (1 + 3 * 5) / 4), rtol=1e-6)
    np.testing.assert_allclose(lse, np.full((1, 1, 1), np.log(4.0)), rtol=1e-6)


def test_merge_matches_float64_for_any_number_of_parts():
    for P in (1, 2, 3, 7):
        outs, lses = _parts(20, P)
        lses = [30 * x for x in lses]  # spread widely: exp(lse) alone would overflow float32
        out, lse = nanoattn.merge_attention(outs, tuple(lses))
        o64, l64 = np.asarray(outs, np.float64), np.asarray(lses, np.float64)
        want_lse = np.logaddexp.reduce(l64, axis=0)
        want = (np.exp(l64 - want_lse)[..., None] * o64).sum(0)
        np.testing.assert_allclose(lse, want_lse, rtol=1e-6, err_msg=f"P={P}")
        np.testing.assert_allclose(out, want, atol=1e-6, rtol=1e-5, err_msg=f"P={P}")
    one, one_lse = nanoattn.merge_attention(outs[:1], lses[:1])
    np.testing.assert_array_equal(one, outs[0])  # one part is itself, exactly
    np.testing.assert_array_equal(one_lse, lses[0])


def test_rows_no_part_saw_are_zero_with_minus_inf_and_zero_finite_gradients():
    outs, lses = _parts(30, 3)
    blind = (slice(None), 1)  # query 1 of every row: no part saw a key
    lses = [x.at[blind].set(-jnp.inf) for x in lses]
    outs[0] = outs[0].at[blind].set(jnp.nan)  # never read: every part's lse is -inf there

    def merge(outs, lses):
        return nanoattn.merge_attention(outs, lses)

    (out, lse), pullback = jax.vjp(merge, outs, lses)
    np.testing.assert_array_equal(np.asarray(out)[blind], 0)
    np.testing.assert_array_equal(np.asarray(lse)[blind], -np.inf)
    assert np.isfinite(out).all() and np.isfinite(np.asarray(lse)[:, [0, 2]]).all()
    # Cotangents everywhere, the blind rows' lse included: their gradients are zero.
    d_outs, d_lses = pullback((jnp.ones_like(out), jnp.ones_like(lse)))
    for g in [*d_outs, *d_lses]:
        assert np.isfinite(g).all()
        np.testing.assert_array_equal(np.asarray(g)[blind], 0)
    assert np.abs(np.asarray(d_lses[0])[:, 0]).min() > 0  # the others do flow


def test_a_part_that_saw_nothing_weighs_nothing_and_is_not_read():
    outs, lses = _parts(40, 3)
    row = (0, 2)  # query 2 of batch row 0: parts 0 and 2 saw nothing, part 1 did
    for p in (0, 2):
        lses[p] = lses[p].at[row].set(-jnp.inf)
        outs[p] = outs[p].at[row].set(jnp.nan)
    (out, lse), pullback = jax.vjp(nanoattn.merge_attention, outs, lses)
    np.testing.assert_array_equal(out[row], outs[1][row])  # exactly part 1's row
    np.testing.assert_array_equal(lse[row], lses[1][row])
    assert np.isfinite(out).all() and np.isfinite(lse).all()
    d_outs, d_lses = pullback((jnp.ones_like(out), jnp.ones_like(lse)))
    for p in (0, 2):
        assert np.isfinite(d_outs[p]).all() and np.isfinite(d_lses[p]).all()
        np.testing.assert_array_equal(d_outs[p][row], 0)
        np.testing.assert_array_equal(d_lses[p][row], 0)
    np.testing.assert_array_equal(d_outs[1][row], 1)  # all of the row comes from part 1


def test_visible_nan_stays_visible():
    outs, lses = _parts(50, 2)
    outs[0] = outs[0].at[0, 0, 1, 2].set(jnp.nan)  # in an output whose lse is finite
    lses[1] = lses[1].at[1, 2, 0].set(jnp.nan)  # a NaN lse
    # A part whose weight underflows to 0 still shows its NaN: 0 * NaN is NaN.
    lses[0] = lses[0].at[1, 0, 0].set(-200.0)
    lses[1] = lses[1].at[1, 0, 0].set(0.0)
    outs[0] = outs[0].at[1, 0, 0, 0].set(jnp.nan)
    out, lse = nanoattn.merge_attention(outs, lses)
    nan_out = np.zeros(out.shape, bool)
    nan_out[0, 0, 1, 2] = nan_out[1, 0, 0, 0] = True
    nan_out[1, 2, 0, :] = True
    nan_lse = np.zeros(lse.shape, bool)
    nan_lse[1, 2, 0] = True
    np.testing.assert_array_equal(np.isnan(out), nan_out)
    np.testing.assert_array_equal(np.isnan(lse), nan_lse)


def test_dtypes_half_precision_upcast_and_strict_promotion():
    outs, lses = _parts(60, 3)
    want, want_lse = nanoattn.merge_attention(outs, lses)
    with jax.numpy_dtype_promotion("strict"):
        out, lse = nanoattn.merge_attention([o.astype(jnp.bfloat16) for o in outs], lses)
    assert out.dtype == jnp.bfloat16 and lse.dtype == jnp.float32
    np.testing.assert_allclose(out.astype(jnp.float32), want, atol=2e-2, rtol=2e-2)
    np.testing.assert_allclose(lse, want_lse, rtol=1e-6)


def test_float64_stays_float64(x64):
    outs, lses = _parts(70, 3)
    outs, lses = [o.astype(jnp.float64) for o in outs], [x.astype(jnp.float64) for x in lses]
    out, lse = nanoattn.merge_attention(outs, lses)
    assert out.dtype == jnp.float64 and lse.dtype == jnp.float64
    l64 = np.asarray(lses)
    want_lse = np.logaddexp.reduce(l64, axis=0)
    want = (np.exp(l64 - want_lse)[..., None] * np.asarray(outs)).sum(0)
    np.testing.assert_allclose(lse, want_lse, rtol=1e-13)
    np.testing.assert_allclose(out, want, rtol=1e-12, atol=1e-13)


def test_jit_vmap_and_unbatched_parts_agree():
    outs, lses = _parts(80, 3)
    lses[2] = lses[2].at[:, 0].set(-jnp.inf)
    want, want_lse = nanoattn.merge_attention(outs, lses)
    for got, got_lse in [
        jax.jit(nanoattn.merge_attention)(outs, lses),
        jax.vmap(nanoattn.merge_attention)(outs, lses),  # each batch row on its own
    ]:
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
        np.testing.assert_allclose(got_lse, want_lse, rtol=1e-6)
    one, one_lse = nanoattn.merge_attention([o[1] for o in outs], [x[1] for x in lses])
    assert one.shape == (3, 2, 3) and one_lse.shape == (3, 2)  # (T, N, H), (T, N)
    np.testing.assert_array_equal(one, want[1])
    np.testing.assert_array_equal(one_lse, want_lse[1])
