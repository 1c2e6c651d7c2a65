"""nanoattn.flax_attention_fn inside flax's own layers: agreement, decoding, dropout, sown
weights, handed-over calls, errors, memory, and flax's own attention tests.

Sizes are distinct (batch axes (2, 3), T=5, S=7, N=11 heads of width H=4, model width
D=13), so that a swapped or wrongly flattened axis changes a value and fails. Unless a
test says otherwise, the adapter must serve the call itself: handing it to flax's own
function fails the test (the ``served`` fixture). Every call is jitted (:func:`jit`): one
compile per program is much faster than eager dispatch, which compiles each operation.
"""

import doctest
import functools
import re
import subprocess
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import nanoattn
from nanoattn import flax_attention_fn
from nanoattn._backends import registry
from nanoattn._interop import flax_attention_fn as flax_attention_fn_module
from nanoattn.bench import _flax_memory

from _backends import serving
from _paths import TESTS
from _reference import np_attention, randn

BATCH, T, S, N, H, D = (2, 3), 5, 7, 11, 4, 13
ATOL = 1e-5
UPSTREAM = TESTS / "interop" / "flax_upstream"  # flax's own tests with the adapter


def _allowing_rank_promotion(function):
    """flax's own function, the reference here, broadcasts ranks implicitly (the suite
    runs with jax_numpy_rank_promotion='raise', tests/conftest.py)."""

    @functools.wraps(function)
    def call(*args, **kwargs):
        with jax.numpy_rank_promotion("allow"):
            return function(*args, **kwargs)

    return call


flax_linen_fn = _allowing_rank_promotion(nn.dot_product_attention)
flax_nnx_fn = _allowing_rank_promotion(nnx.dot_product_attention)


@pytest.fixture
def served(monkeypatch):
    """Fails the test if the adapter hands a call over to flax."""

    def refuse(*args, **kwargs):
        raise AssertionError("the adapter handed this call over to flax")

    monkeypatch.setattr(flax_attention_fn_module, "_hand_over", refuse)


@pytest.fixture
def handed_over(monkeypatch):
    """Counts the calls the adapter hands over to flax."""
    calls = []
    original = flax_attention_fn_module._hand_over

    def count(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(flax_attention_fn_module, "_hand_over", count)
    return calls


# These tests compile many small programs. XLA's backend optimisations would double the
# compile time and change nothing they check (the memory test compiles as users do).
jit = functools.partial(jax.jit, compiler_options={"xla_backend_optimization_level": 0})


def close(a, b, atol=ATOL):
    np.testing.assert_allclose(np.asarray(a, np.float64), np.asarray(b, np.float64), atol=atol)


def jitted(function, /, *arrays, **static):
    """``function(*arrays, **static)`` under :func:`jit`, the keyword arguments static."""
    return jit(functools.partial(function, **static))(*arrays)


def float_mask(seed, shape):
    """A flax 0/1 float mask where every query row keeps at least its first key."""
    mask = (np.random.default_rng(seed).random(shape) > 0.4).astype(np.float32)
    mask[..., 0] = 1
    return mask


# --- the functional convention ---------------------------------------------------------


def test_function_matches_flax_and_a_float64_reference(served):
    q, k, v = randn(1, *BATCH, T, N, H), randn(2, *BATCH, S, N, H), randn(3, *BATCH, S, N, H)
    mask = float_mask(4, (1, 3, 1, T, S))  # broadcast over the first batch axis and the heads
    bias = randn(5, N, T, S)  # broadcast over both batch axes
    out = jitted(flax_attention_fn, q, k, v, bias, mask)
    close(out, jitted(flax_linen_fn, q, k, v, bias, mask))
    flat = lambda x: x.reshape(6, *x.shape[2:])  # noqa: E731  (B, ...) with B = 2 * 3
    allowed = np.broadcast_to(mask != 0, (*BATCH, N, T, S)).reshape(6, N, T, S)
    want = np_attention(flat(q), flat(k), flat(v), allowed, bias[None])
    close(out, want.reshape(*BATCH, T, N, H))
    assert out.shape == (*BATCH, T, N, H) and out.dtype == jnp.float32


def test_grouped_heads_and_causality_match_flax_nnx(served):
    q = randn(6, *BATCH, T, 6, H)  # N = 6 query heads, K = 3 key/value heads, G = 2
    k, v = randn(7, *BATCH, T, 3, H), randn(8, *BATCH, T, 3, H)
    mask = float_mask(9, (*BATCH, 1, T, T))

    def outputs(fn):
        fn = jit(fn, static_argnames="is_causal")
        return fn(q, k, v, is_causal=True), fn(q, k, v, mask=mask)

    for ours, theirs in zip(outputs(flax_attention_fn), outputs(flax_nnx_fn)):
        close(ours, theirs)


def test_causal_cross_attention_is_top_left_as_flax(served):
    q, k, v = randn(10, 2, T, N, H), randn(11, 2, S, N, H), randn(12, 2, S, N, H)
    want = np_attention(q, k, v, np.tril(np.ones((T, S), bool)))
    close(jitted(flax_nnx_fn, q, k, v, is_causal=True), want)
    for implementation in serving(q, k, v, is_causal=True, q_offset=0):  # flax's: top-left
        close(jitted(flax_attention_fn, q, k, v, is_causal=True, implementation=implementation),
              want)  # fmt: skip


def test_a_single_causal_query_sees_every_allowed_key(served):
    q, k, v = randn(13, 2, 1, N, H), randn(14, 2, S, N, H), randn(15, 2, S, N, H)
    mask = np.arange(S) <= 3  # NNX's decode mask at cache index 3
    close(jitted(flax_attention_fn, q, k, v, None, mask, is_causal=True),
          np_attention(q, k, v, mask))  # fmt: skip


def test_a_fully_masked_row_gives_zeros_where_flax_gives_the_mean_of_v(served):
    q, k, v = randn(16, 2, T, N, H), randn(17, 2, S, N, H), randn(18, 2, S, N, H)
    mask = np.ones((2, 1, T, S), bool)
    mask[1, 0, 2] = False  # batch row 1, query 2 sees no key
    out = jitted(flax_attention_fn, q, k, v, None, mask)
    theirs = jitted(flax_linen_fn, q, k, v, None, mask)
    np.testing.assert_array_equal(out[1, 2], 0)
    close(theirs[1, 2], np.broadcast_to(v[1].mean(0), (N, H)))
    others = np.ones((2, T), bool)
    others[1, 2] = False
    close(np.asarray(out)[others], np.asarray(theirs)[others])


def test_precision_reaches_every_matrix_product_forward_and_backward(served):
    q, k, v = randn(19, 2, T, N, H), randn(20, 2, T, N, H), randn(21, 2, T, N, H)

    def loss(q, implementation, rate):
        return flax_attention_fn(
            q, k, v, is_causal=True, precision=jax.lax.Precision.HIGHEST,
            implementation=implementation, dropout_rate=rate, dropout_rng=jax.random.key(0),
        ).sum()  # fmt: skip

    highest = (jax.lax.Precision.HIGHEST, jax.lax.Precision.HIGHEST)
    # Every backend that serves the call, and the automatic choice with dropout (the
    # reference's dropout path).
    calls = [(name, 0.0) for name in serving(q, k, v, is_causal=True)] + [(None, 0.5)]
    for implementation, rate in calls:
        jaxpr = jax.make_jaxpr(jax.grad(loss), static_argnums=(1, 2))(q, implementation, rate)
        precisions = [eqn.params["precision"] for eqn in _eqns(jaxpr.jaxpr, "dot_general")]
        if not precisions and _eqns(jaxpr.jaxpr, "ffi_call"):
            continue  # a kernel outside XLA (the native one) has no matrix product here
        assert len(precisions) >= 3, implementation  # one forward, two backward at least
        assert all(p == highest for p in precisions), (implementation, precisions)


def _eqns(jaxpr, primitive):
    """Every equation of ``primitive`` in ``jaxpr`` and its sub-jaxprs."""
    from jax.extend.core import ClosedJaxpr, Jaxpr

    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == primitive:
            found.append(eqn)
        for param in eqn.params.values():
            for sub in param if isinstance(param, (tuple, list)) else (param,):
                if isinstance(sub, ClosedJaxpr):
                    found += _eqns(sub.jaxpr, primitive)
                elif isinstance(sub, Jaxpr):
                    found += _eqns(sub, primitive)
    return found


# --- flax's layers with and without the adapter ----------------------------------------


def linen_layer(attention_fn=flax_linen_fn, **kwargs):
    return nn.MultiHeadDotProductAttention(
        num_heads=N, qkv_features=N * H, attention_fn=attention_fn, **kwargs
    )


def filled(shapes, seed=0):
    """Random values for a pytree of shapes (parameters; a zero count and key(0) for an NNX
    rng stream), made with numpy: initialising flax layers eagerly compiles every
    initializer for every shape, which would dominate these tests."""
    rng = np.random.default_rng(seed)

    def fill(s):
        if jax.dtypes.issubdtype(s.dtype, jax.dtypes.prng_key):
            return jax.random.key(0)
        if not jnp.issubdtype(s.dtype, jnp.floating):
            return jnp.zeros(s.shape, s.dtype)
        return jnp.asarray(rng.standard_normal(s.shape) / np.sqrt(D), s.dtype)

    return jax.tree.map(fill, shapes)


@pytest.fixture(scope="module")
def params():
    """The linen layer's parameters, shared: they depend only on D, N and H (and
    param_dtype), not on the inputs' batch axes, length, dtype or the attention_fn."""
    return filled(jax.eval_shape(linen_layer().init, jax.random.key(0), jnp.ones((T, D))))


def linen_pair(params, *inputs, layer_kwargs=(), **call_kwargs):
    """The linen layer's results with flax's default attention_fn and with the adapter,
    from one jitted program; array inputs (None allowed) are traced, ``call_kwargs``
    fixed."""

    def both(params, *inputs):
        return tuple(
            linen_layer(fn, **dict(layer_kwargs)).apply(params, *inputs, **call_kwargs)
            for fn in (flax_linen_fn, flax_attention_fn)
        )

    return jit(both)(params, *inputs)


LINEN_CASES = {
    "self, two batch axes": ((2, 3), T, None),
    "self, float causal mask": ((2, 3), T, "causal"),
    "cross, float mask broadcast over a batch axis": ((2, 3), S, (1, 3, 1, T, S)),
    "cross, bool mask per head": ((2,), S, (2, N, T, S)),
    "self, no batch axis": ((), T, "causal"),
}


@pytest.mark.parametrize("case", LINEN_CASES)
def test_linen_layer_agrees_with_flax(case, params, served):
    batch, length, mask_kind = LINEN_CASES[case]
    x, y = randn(22, *batch, T, D), randn(23, *batch, length, D)
    if mask_kind == "causal":
        mask = nn.make_causal_mask(jnp.ones((*batch, T)))  # float32, (batch..., 1, T, T)
    elif mask_kind is not None:
        mask = float_mask(24, mask_kind)
        mask = mask.astype(bool) if len(mask_kind) == 4 else mask
    else:
        mask = None
    want, got = linen_pair(params, x, y, mask=mask)
    close(got, want)


def test_linen_partial_is_causal_equals_a_causal_mask(params, served):
    x = randn(25, *BATCH, T, D)
    mask = nn.make_causal_mask(jnp.ones((*BATCH, T)))
    q = jnp.zeros((1, T, N, H))
    names = serving(q, q, q, is_causal=True)  # the automatic choice, then each by name

    @jit
    def outputs(params, x, mask):
        want = linen_layer().apply(params, x, mask=mask)
        return want, *(
            linen_layer(
                functools.partial(flax_attention_fn, is_causal=True, implementation=i)
            ).apply(params, x)
            for i in (None, *names)
        )

    want, *got = outputs(params, x, mask)
    for g in got:
        close(g, want)


def nnx_layer(attention_fn=flax_nnx_fn, **kwargs):
    """An NNX layer with random parameters (see :func:`filled`)."""
    kwargs = dict(num_heads=N, qkv_features=N * H) | kwargs
    graphdef, shapes = nnx.split(
        nnx.eval_shape(
            lambda: nnx.MultiHeadAttention(
                in_features=D, attention_fn=attention_fn, decode=False, rngs=nnx.Rngs(0),
                **kwargs,
            )
        )
    )  # fmt: skip
    return nnx.merge(graphdef, filled(shapes, seed=1))


def nnx_pair(layer, *arrays, capture=False, **static):
    """``layer(*arrays, **static)`` with flax's default attention_fn and with the adapter,
    from one jitted program (arrays traced, None allowed), without keeping changes to
    the layer's state. With ``capture``, the sown intermediates instead."""
    graphdef, state = nnx.split(layer)

    def both(state, *arrays):
        results = []
        for fn in (flax_nnx_fn, flax_attention_fn):
            layer = nnx.merge(graphdef, state, copy=True)
            layer.attention_fn = fn
            call = nnx.capture(layer, nnx.Intermediate) if capture else layer
            results.append(call(*arrays, **static))
        return results

    return jit(both)(state, *arrays)


NNX_CASES = {
    "self, is_causal": (dict(), None, True),
    "cross, float mask": (dict(), float_mask(27, (*BATCH, 1, T, S)), False),
    "grouped heads, is_causal": (dict(num_heads=6, qkv_features=24, num_kv_heads=3), None, True),
}


@pytest.mark.parametrize("case", NNX_CASES)
def test_nnx_layer_agrees_with_flax(case, served):
    layer_kwargs, mask, is_causal = NNX_CASES[case]
    x = randn(28, *BATCH, T, D)
    y = x if mask is None else randn(26, *BATCH, S, D)
    want, got = nnx_pair(nnx_layer(**layer_kwargs), x, y, mask=mask, is_causal=is_causal)
    close(got, want)


# --- decoding with flax's own cache ----------------------------------------------------


def test_linen_decoding_one_token_at_a_time(params, served):
    """Tokens fed one at a time through flax's cache (a scan along T) equal one causal
    call on the whole sequence; with the adapter, and with it and is_causal=True."""
    x = randn(29, *BATCH, S, D)
    fns = (flax_attention_fn, functools.partial(flax_attention_fn, is_causal=True))

    @jit
    def outputs(params, x):
        full = linen_layer().apply(params, x, mask=nn.make_causal_mask(x[..., 0]))
        decoded = []
        for fn in fns:
            layer = linen_layer(fn, decode=True)
            cache = jax.tree.map(
                lambda s: jnp.zeros(s.shape, s.dtype),
                jax.eval_shape(layer.init, jax.random.key(0), x)["cache"],
            )

            def step(cache, token, layer=layer):  # token (2, 3, 1, D)
                y, updates = layer.apply({**params, "cache": cache}, token, mutable=["cache"])
                return updates["cache"], y

            tokens = jnp.moveaxis(x, -2, 0)[..., None, :]  # (S, 2, 3, 1, D)
            _, ys = jax.lax.scan(step, cache, tokens)  # (S, 2, 3, 1, D)
            decoded.append(jnp.moveaxis(ys[..., 0, :], 0, -2))  # (2, 3, S, D)
        return full, decoded

    full, decoded = outputs(params, x)
    for d in decoded:
        close(d, full)


def nnx_decode(attention_fn, x):
    """A full causal forward and the same tokens decoded one at a time with
    ``is_causal=True`` and flax's cache."""

    graphdef, state = nnx.split(nnx_layer(attention_fn))

    @jit
    def outputs(state, x):
        layer = nnx.merge(graphdef, state)
        full = layer(x, is_causal=True)
        layer.init_cache(x.shape)
        steps = [layer(x[:, t : t + 1], decode=True, is_causal=True) for t in range(x.shape[1])]
        return full, jnp.concatenate(steps, axis=1)

    return outputs(state, x)


def test_nnx_is_causal_decoding_is_right_with_the_adapter(served):
    full, decoded = nnx_decode(flax_attention_fn, randn(30, 2, T, D))
    close(decoded, full)


def test_nnx_is_causal_decoding_is_wrong_with_flax_default():
    """google/flax#5591: with is_causal, flax's default lets each decoded token see key 0 only."""
    full, decoded = nnx_decode(flax_nnx_fn, randn(30, 2, T, D))
    if np.allclose(decoded, full, atol=ATOL):
        pytest.skip("flax's default now decodes with is_causal correctly (google/flax#5591 fixed)")
    close(decoded[:, 0], full[:, 0])  # the first token has only key 0 to see anyway
    assert not np.allclose(decoded[:, 1:], full[:, 1:], atol=1e-2)


# --- dropout ---------------------------------------------------------------------------


@functools.partial(jit, static_argnames=("rate", "broadcast", "deterministic"))
def _dropped(rng, rate, broadcast, deterministic):
    T, S, heads = 37, 31, 5
    q, k = jnp.zeros((*BATCH, T, heads, S)), jnp.zeros((*BATCH, S, heads, S))
    v = jnp.broadcast_to(jnp.eye(S)[:, None, :], (*BATCH, S, heads, S))
    out = flax_attention_fn(
        q, k, v, dropout_rate=rate, dropout_rng=rng, broadcast_dropout=broadcast,
        deterministic=deterministic,
    )  # fmt: skip
    return out * S


def dropped(rate=0.3, rng=0, broadcast=False, deterministic=False):
    """``keep / (1 - rate)`` per weight, read from the output: with q = 0 every weight is
    1 / S, and one-hot values make output (b, t, n, s) the weight (b, n, t, s) times S.
    Shape (2, 3, T, N, S) with T = 37, N = 5, S = 31."""
    return np.asarray(_dropped(jax.random.key(rng), rate, broadcast, deterministic))


def test_dropout_keep_rate_and_scaling(served):
    scaled = dropped(rate=0.3)
    kept = scaled != 0
    n = kept.size  # 2 * 3 * 37 * 5 * 31 weights
    assert abs(kept.mean() - 0.7) < 4 * np.sqrt(0.21 / n)
    np.testing.assert_allclose(scaled[kept], 1 / 0.7, rtol=1e-6)


def test_broadcast_dropout_shares_one_mask_over_batch_axes_and_heads(served):
    shared = dropped(rate=0.3, broadcast=True)  # (2, 3, T, N, S)
    pattern = shared[0, 0, :, 0]  # (T, S)
    assert 0 < (pattern != 0).mean() < 1
    np.testing.assert_array_equal(shared, np.broadcast_to(pattern[:, None], shared.shape))
    separate = dropped(rate=0.3, broadcast=False)
    assert not np.array_equal(separate[0, 0], separate[1, 2])
    assert not np.array_equal(separate[0, 0, :, 0], separate[0, 0, :, 1])


def test_dropout_is_determined_by_the_rng_and_off_when_deterministic(served):
    np.testing.assert_array_equal(dropped(rng=7), dropped(rng=7))
    assert not np.array_equal(dropped(rng=7), dropped(rng=8))
    np.testing.assert_allclose(dropped(deterministic=True), 1.0, rtol=1e-6)


def test_dropout_draws_flax_bits_in_the_function_and_the_layers(params, served):
    q, k, v = randn(31, *BATCH, T, N, H), randn(32, *BATCH, S, N, H), randn(33, *BATCH, S, N, H)

    @jit
    def outputs(q, k, v, rng):
        kv_heads = ((k, v, flax_linen_fn), (k[..., :1, :], v[..., :1, :], flax_nnx_fn))  # K = N, 1
        return [
            fn(q, k, v, dropout_rate=0.4, dropout_rng=rng, broadcast_dropout=broadcast)
            for broadcast in (True, False)
            for k, v, flax_fn in kv_heads
            for fn in (flax_fn, flax_attention_fn)
        ]

    results = outputs(q, k, v, jax.random.key(3))
    for want, got in zip(results[::2], results[1::2]):
        close(got, want)
    x = randn(34, *BATCH, T, D)
    want, got = linen_pair(
        params, x, rngs={"dropout": jax.random.key(4)},
        layer_kwargs=dict(dropout_rate=0.5, deterministic=False),
    )  # fmt: skip
    close(got, want)
    want, got = nnx_pair(nnx_layer(dropout_rate=0.5), x, deterministic=False)
    close(got, want)


class _Sower:
    """A stand-in for a linen module: keeps what the adapter sows."""

    def __init__(self):
        self.sown = {}

    def sow(self, collection, name, value):
        self.sown[(collection, name)] = value


@pytest.mark.parametrize("path", ["dropout", "sow_weights", "both"])
def test_the_weights_path_never_reads_keys_and_values_no_query_sees(path, served):
    # docs/conventions.md, "Masked content is never read", on the path that needs the full
    # weights: key 2 is masked for every query, keys 5 and 6 lie past every causal query
    # (T = 5 < S = 7, top-left); NaN, inf and -inf there change no output, weight or
    # gradient.
    q, k, v = randn(51, *BATCH, T, N, H), randn(52, *BATCH, S, N, H), randn(53, *BATCH, S, N, H)
    mask = float_mask(54, (*BATCH, N, T, S))
    mask[..., 2] = 0
    unseen = np.array([s in (2, 5, 6) for s in range(S)])
    dirty_k, dirty_v = k.copy(), v.copy()
    for s, bad in zip((2, 5, 6), (np.nan, np.inf, -np.inf)):
        dirty_k[..., s, :, :] = dirty_v[..., s, :, :] = bad
    cotangent = randn(55, *BATCH, T, N, H)
    dropout = path in ("dropout", "both")
    options = dict(
        mask=mask, is_causal=True, deterministic=not dropout, dropout_rate=0.3,
        dropout_rng=jax.random.key(6), broadcast_dropout=False,
    )  # fmt: skip

    @jit
    def run(q, k, v):
        def loss(q, k, v):
            sower = _Sower() if path != "dropout" else None
            out = flax_attention_fn(q, k, v, module=sower, **options)
            weights = () if sower is None else sower.sown[("intermediates", "attention_weights")]
            return jnp.sum(out * cotangent), (out, weights)

        (_, (out, weights)), grads = jax.value_and_grad(loss, (0, 1, 2), has_aux=True)(q, k, v)
        return out, grads, weights

    clean, dirty = run(q, k, v), run(q, dirty_k, dirty_v)
    assert np.isfinite(np.asarray(clean[0])).all()
    close(dirty[0], clean[0])
    for name, got, want in zip(("dq", "dk", "dv"), dirty[1], clean[1]):
        assert np.isfinite(np.asarray(got)).all(), name
        close(got, want)
    np.testing.assert_array_equal(np.asarray(dirty[1][1])[..., unseen, :, :], 0)
    if path != "dropout":
        assert np.isfinite(np.asarray(dirty[2])).all()
        close(dirty[2], clean[2])


# --- sown weights ----------------------------------------------------------------------


def test_linen_sow_weights_match_flax(params, served):
    x = randn(35, *BATCH, T, D)
    mask = nn.make_causal_mask(jnp.ones((*BATCH, T)))
    theirs, ours = (
        state["intermediates"]["attention_weights"][0]
        for _, state in linen_pair(params, x, mask=mask, sow_weights=True, mutable="intermediates")
    )
    assert ours.shape == (*BATCH, N, T, T) and ours.dtype == jnp.float32
    close(ours, theirs)
    _, state = jit(linen_layer(flax_attention_fn).apply, static_argnames="mutable")(
        params, x, mutable="intermediates"
    )
    assert "intermediates" not in state


def test_weights_are_sown_before_dropout_as_flax(params, served):
    x = randn(47, *BATCH, T, D)
    theirs, ours = (
        state["intermediates"]["attention_weights"][0]
        for _, state in linen_pair(
            params, x, layer_kwargs=dict(dropout_rate=0.5, deterministic=False),
            rngs={"dropout": jax.random.key(5)}, sow_weights=True, mutable="intermediates",
        )
    )  # fmt: skip
    close(ours, theirs)
    close(ours.sum(-1), 1.0)  # before dropout, every row sums to 1


def test_nnx_sow_weights_match_flax(served):
    x = randn(36, *BATCH, T, D)
    theirs, ours = (
        state["attention_weights"][0]
        for _, state in nnx_pair(nnx_layer(), x, capture=True, sow_weights=True, is_causal=True)
    )
    assert ours.shape == (*BATCH, N, T, T)
    close(ours, theirs)
    np.testing.assert_array_equal(np.triu(ours[0, 0, 0], 1), 0)


@pytest.mark.parametrize("force_fp32", [True, False])
def test_mixed_precision_dtypes_match_flax(force_fp32, params, served):
    x = randn(37, 2, T, D)
    kwargs = dict(dtype=jnp.bfloat16, force_fp32_for_softmax=force_fp32)
    results = linen_pair(
        params, x, layer_kwargs=kwargs, sow_weights=True, mutable=["intermediates"]
    )
    (want, theirs), (got, ours) = ((y, s["intermediates"]["attention_weights"][0])
                                   for y, s in results)  # fmt: skip
    assert ours.dtype == theirs.dtype == (jnp.float32 if force_fp32 else jnp.bfloat16)
    assert got.dtype == want.dtype
    close(ours, theirs, atol=1e-2)
    close(got, want, atol=5e-2)
    q = jnp.asarray(randn(38, 2, T, N, H), jnp.bfloat16)
    for fn in (flax_linen_fn, flax_attention_fn):  # the attention output's dtype too
        out = jax.eval_shape(functools.partial(fn, force_fp32_for_softmax=force_fp32), q, q, q)
        assert out.dtype == ours.dtype


# --- calls handed over to flax ---------------------------------------------------------


def test_complex_inputs_are_handed_over(params, handed_over):
    x = jnp.asarray(randn(39, 2, T, D) + 1j * randn(40, 2, T, D), jnp.complex64)
    want, got = linen_pair(params, x)
    assert got.dtype == jnp.complex64 and len(handed_over) == 1
    np.testing.assert_array_equal(got, want)
    q = jnp.asarray(randn(41, 2, T, 6, H), jnp.complex64)
    k = jnp.asarray(randn(42, 2, T, 3, H), jnp.complex64)  # grouped heads: flax.nnx's function
    # (with dropout: without, flax.nnx's function takes jax.nn's path, which drops the
    # imaginary part)
    args = dict(dropout_rate=0.5, dropout_rng=jax.random.key(0), is_causal=True)
    ours, theirs = (jitted(fn, q, k, k, **args) for fn in (flax_attention_fn, flax_nnx_fn))
    assert ours.dtype == jnp.complex64 and len(handed_over) == 2
    np.testing.assert_allclose(ours, theirs, atol=ATOL)
    with pytest.raises(ValueError, match=r"^implementation='xla' cannot serve this call: complex"):
        flax_attention_fn(q, k, k, implementation="xla")


def test_linen_custom_einsums_are_handed_over(params, handed_over):
    calls = []

    def einsum_cls():
        def einsum(*args, **kwargs):
            calls.append(1)
            return jnp.einsum(*args, **kwargs)

        return einsum

    kwargs = dict(qk_attn_weights_einsum_cls=einsum_cls, attn_weights_value_einsum_cls=einsum_cls)
    want, got = linen_pair(params, randn(43, 2, T, D), layer_kwargs=kwargs)
    np.testing.assert_array_equal(got, want)
    assert len(calls) == 4 and len(handed_over) == 1  # two einsums in each of the two layers


def test_other_unserved_calls_are_handed_over(handed_over):
    q, k, v = randn(44, 2, T, N, H), randn(45, 2, S, N, H), randn(46, 2, S, N, H + 3)
    close(jitted(flax_attention_fn, q, k, v), jitted(flax_linen_fn, q, k, v))  # v width 7, q 4
    pair = (jax.lax.Precision.HIGHEST, jax.lax.Precision.DEFAULT)
    close(jitted(flax_attention_fn, q, k, k, precision=pair),
          jitted(flax_linen_fn, q, k, k, precision=pair))  # fmt: skip
    assert len(handed_over) == 2


# --- errors ----------------------------------------------------------------------------

q4, k4 = np.ones((2, T, N, H), np.float32), np.ones((2, S, N, H), np.float32)
ONE_OF = "^implementation must be one of " + re.escape(", ".join(map(repr, registry.names())))
# Any backend but the reference: only the reference computes the weights dropout and
# sow_weights need.
KERNEL = next(name for name in registry.names() if name != "xla")
ERRORS = {
    "rank": (dict(query=q4[0]), r"the same rank, at least 3, is needed; got query \(5, 11, 4\)"),
    "batch": (dict(key=k4[:1], value=k4[:1]), r"the batch axes must match"),
    "key vs value": (dict(value=k4[:, :3]), r"key and value must agree on S and K"),
    "width": (dict(key=k4[..., :3], value=k4[..., :3]), r"query and key must have the same H"),
    "heads": (dict(key=k4[:, :, :2], value=k4[:, :, :2]), r"K=2 must divide N=11"),
    "mask": (dict(mask=np.ones((2, T, T))), r"^mask must be broadcastable to \[batch..., N, T, S\] "
             r"= \(2, 11, 5, 7\), got \(2, 5, 5\)$"),
    "bias": (dict(bias=np.ones((3, 1, 1, 1))), r"^bias must be broadcastable"),
    "no rng": (dict(dropout_rate=0.1), r"^dropout_rate=0.1 needs dropout_rng "),
    "rate": (dict(dropout_rate=1.0, dropout_rng=jax.random.key(0)), r"^dropout_rate must be "),
    "name": (dict(implementation="fast"), ONE_OF),
    "name, dropout": (dict(implementation="fast", dropout_rate=0.1, dropout_rng=jax.random.key(0)),
                      ONE_OF),
    "kernel dropout": (dict(implementation=KERNEL, dropout_rate=0.1,
                            dropout_rng=jax.random.key(0)), rf"^implementation='{KERNEL}' cannot "
                       r"serve this call: dropout and sow_weights"),
    "kernel sow": (dict(implementation=KERNEL, module=object()), rf"^implementation='{KERNEL}' "),
}  # fmt: skip


@pytest.mark.parametrize("case", ERRORS)
def test_bad_input_raises_one_line_value_error(case):
    kwargs, match = ERRORS[case]
    args = dict(query=q4, key=k4, value=k4) | kwargs
    with pytest.raises(ValueError, match=match) as error:
        flax_attention_fn(**args)
    assert "\n" not in str(error.value)


# --- memory, docs, and flax's own tests ------------------------------------------------


def test_nnx_layer_with_the_adapter_needs_a_twentieth_of_the_memory_at_16k():
    """Forward+backward of flax.nnx.MultiHeadAttention at T = 16384, is_causal, compiled
    only: flax's default holds (B, N, T, T) scores, the adapter runs the blockwise kernel."""
    shape = dict(batch=1, heads=2, head_width=16)
    flax_bytes = _flax_memory.nnx_layer_temp_bytes(flax_nnx_fn, 16384, **shape)
    ours = _flax_memory.nnx_layer_temp_bytes(flax_attention_fn, 16384, **shape)
    assert flax_bytes >= 2 * 16384**2 * 4  # at least one float32 (N, T, T) tensor
    assert ours * 20 <= flax_bytes, (ours, flax_bytes)


def test_docstring_example():
    result = doctest.testmod(flax_attention_fn_module, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0 and result.failed == 0


def test_exported():
    assert nanoattn.flax_attention_fn is flax_attention_fn


@pytest.mark.slow
def test_flax_own_attention_tests_pass_with_the_adapter_as_default():
    """flax's tests/linen/linen_attention_test.py and tests/nnx/nn/attention_test.py, from
    the sdist of the installed flax, with the adapter as the layers' default attention_fn
    (tests/interop/flax_upstream/run.py; about 3 minutes on 2 cores)."""
    sys.path.insert(0, str(UPSTREAM))
    try:
        import run
    finally:
        sys.path.pop(0)
    result = subprocess.run(
        [sys.executable, str(UPSTREAM / "run.py")],
        capture_output=True, text=True,
    )  # fmt: skip
    log = result.stdout + result.stderr
    if result.returncode == run.NETWORK_ERROR:
        pytest.skip(f"no network: could not download flax's sdist to get its tests. {log[-500:]}")
    assert result.returncode == 0, log[-5000:]
    assert " passed" in log and " failed" not in log, log[-2000:]
    calls = int(log.split("nanoattn.flax_attention_fn: ")[1].split(" calls")[0])
    assert calls > 100, log[-2000:]
