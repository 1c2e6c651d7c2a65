"""nanoattn.jax_nn_attention in jax.nn.dot_product_attention's place: jax's own tests of
that function (tests/nn_test.py of jax 0.10.2: grouped heads with and without vmap, the
mask modes, the bias gradient, float64 under debug_infs) rewritten with the adapter as
the function under test and jax.nn's function as the reference, then the edges where
nanoattn's contract differs from jax.nn's (rows that see no key, padded queries, the
residual, top-left causality when T != S), the implementation names and the errors.

Sizes are distinct (B=2, T=13, S=7, N=6 query heads, K=3 key/value heads, H=5), so a
swapped axis fails. Each test forces nanoattn's automatic choice to one backend
(``force``), so every registered backend that serves a call here runs it; "cudnn path"
runs the adapter's ``implementation="cudnn"`` path (no log-sum-exp from the backend) on
the reference, since cuDNN needs a GPU. ``make test`` runs each backend on one
combination of a test's other axes, ``make test-all`` on all of them (``grid``).
Every comparison is one jitted program holding both functions (one compile per
program is much faster than eager dispatch).
"""

import doctest
import functools
import inspect
import itertools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import nanoattn
from nanoattn import jax_nn_attention
from nanoattn._backends import dispatch
from nanoattn._base.rules import Rules
from nanoattn._interop import jax_nn_attention as jax_nn_attention_module
from nanoattn._interop import jax_nn_rows

from _backends import refusal, serving
from _reference import randn

B, T, S, N, K, H = 2, 13, 7, 6, 3, 5
CUDNN_PATH = "cudnn path"  # implementation="cudnn", served by the reference here

# Compile at XLA's lowest level: these tests compile many small programs.
jit = functools.partial(jax.jit, compiler_options={"xla_backend_optimization_level": 0})


def force(monkeypatch, backend: str) -> str | None:
    """Makes nanoattn's automatic choice take ``backend`` (a named backend raises where
    it cannot serve a call, so the test fails rather than falls back). Returns the
    ``implementation`` the adapter is called with: None, or "cudnn" for
    :data:`CUDNN_PATH`, whose backend is then the reference."""
    original = dispatch.choose
    name = "xla" if backend == CUDNN_PATH else backend

    def choose(requested, *args):
        return original(name if requested in (None, "cudnn") else requested, *args)

    monkeypatch.setattr(dispatch, "choose", choose)
    return "cudnn" if backend == CUDNN_PATH else None


def grid(*axes, served=lambda *combo: True, fast=None, cudnn_path=True):
    """pytest params ``(backend, *combination)`` for every registered backend that serves
    a call here (``served_here``), the cuDNN path with ``cudnn_path``, and every
    combination of ``axes`` that is ``served``. ``make test`` runs each backend on one
    combination, the first it serves in the order of ``fast`` (combinations of ``axes``;
    their own order by default); the rest are marked slow (``make test-all`` runs them)."""
    backends = [*served_here(), *([CUDNN_PATH] if cudnn_path else [])]
    combos = [(b, *rest) for b in backends for rest in itertools.product(*axes)
              if served(b, *rest)]  # fmt: skip
    order = list(itertools.product(*axes)) if fast is None else fast
    quick = [next((b, *r) for r in order if (b, *r) in combos) for b in backends
             if any(c[0] == b for c in combos)]  # fmt: skip
    slow = pytest.mark.slow
    return [
        pytest.param(*combo, id="-".join(map(str, combo)), marks=() if combo in quick else slow)
        for combo in combos
    ]


def served_here() -> list[str]:
    """The registered backends that serve a plain float32 call of this file's sizes here."""
    return serving(*qkv(0))


def adapter_rules(arguments: dict) -> dict:
    """The keywords of nanoattn's call that the adapter makes of jax.nn's ``arguments``
    (query_seq_lengths aside: the adapter zeros those queries itself)."""
    window = arguments.get("local_window_size")
    causal = arguments.get("is_causal", False)
    return dict(
        mask=arguments.get("mask"), bias=arguments.get("bias"), is_causal=causal,
        kv_lengths=arguments.get("key_value_seq_lengths"),
        window=(window, window) if isinstance(window, int) else window,
        q_offset=0 if causal or window is not None else None,
    )  # fmt: skip


def serves(backend, arguments=None, T=T, S=S, dtype=np.float32) -> bool:
    """Whether ``backend`` (or the cuDNN path, the reference here) serves the adapter's
    call with jax.nn's ``arguments``."""
    if backend == CUDNN_PATH:
        return True
    rules = adapter_rules(arguments or {})
    return refusal(backend, *qkv(0, T, S), dtype=dtype, **rules, return_residual=True) is None


def close(ours, theirs, atol=1e-5, rtol=1e-5):
    assert ours.shape == theirs.shape and ours.dtype == theirs.dtype, (
        ours.shape, ours.dtype, theirs.shape, theirs.dtype,
    )  # fmt: skip
    np.testing.assert_allclose(
        np.asarray(ours, np.float64), np.asarray(theirs, np.float64), atol=atol, rtol=rtol
    )


def qkv(seed, T=T, S=S, N=N, K=K, dtype=np.float32):
    return (
        jnp.asarray(randn(seed, B, T, N, H), dtype),
        jnp.asarray(randn(seed + 1, B, S, K, H), dtype),
        jnp.asarray(randn(seed + 2, B, S, K, H), dtype),
    )


# --- jax's testDotProductAttentionMask: every mask mode, outputs and gradients ----------

Q_LENGTHS = np.array([9, 13], np.int32)  # row 0: queries 9.. are padding
KV_LENGTHS = np.array([5, 0], np.int32)  # row 1 sees no key at all


def _random_mask(T, S):
    mask = np.random.default_rng(8).random((B, 1, T, S)) > 0.4
    mask[0, 0, 3] = False  # a row that sees no key
    return mask


# name: (T, S, arguments); the numpy arrays among them are traced, the rest static.
MASK_CASES = {
    "bias": (T, S, lambda T, S: dict(bias=randn(4, 1, N, T, S))),
    "causal": (T, T, lambda T, S: dict(is_causal=True)),
    "causal, T > S": (T, S, lambda T, S: dict(is_causal=True)),
    "causal, T < S": (S, T, lambda T, S: dict(is_causal=True)),
    "padding": (T, S, lambda T, S: dict(
        query_seq_lengths=Q_LENGTHS, key_value_seq_lengths=KV_LENGTHS)),
    "custom": (T, S, lambda T, S: dict(mask=np.tril(np.ones((T, S), bool))[None, None])),
    "custom, rows that see no key": (T, S, lambda T, S: dict(mask=_random_mask(T, S))),
    "causal, padding": (T, T, lambda T, S: dict(
        is_causal=True, query_seq_lengths=Q_LENGTHS, key_value_seq_lengths=KV_LENGTHS)),
    "custom, padding": (T, S, lambda T, S: dict(
        mask=np.tril(np.ones((T, S), bool)), query_seq_lengths=Q_LENGTHS,
        key_value_seq_lengths=KV_LENGTHS)),
    "bias, causal": (T, T, lambda T, S: dict(bias=randn(5, N, T, T), is_causal=True)),
    "causal, sliding window": (T, T, lambda T, S: dict(is_causal=True, local_window_size=(3, 2))),
    "sliding window": (T, T, lambda T, S: dict(local_window_size=(3, 0))),
    "sliding window of an int, T > S": (T, S, lambda T, S: dict(local_window_size=1)),
    "everything": (T, S, lambda T, S: dict(
        bias=randn(6, B, 1, T, S), mask=_random_mask(T, S), is_causal=True,
        local_window_size=(4, 1), query_seq_lengths=Q_LENGTHS,
        key_value_seq_lengths=np.array([6, 3], np.int32))),
}  # fmt: skip
# The cases with rows that see no key or are padding, where the two contracts differ.
EDGE_CASES = ("padding", "custom, rows that see no key", "causal, padding", "custom, padding",
              "sliding window of an int, T > S", "everything")  # fmt: skip
# In `make test` each backend runs the first of these it serves: every rule at once, or
# the edge cases.
FAST_MASK_CASES = [("everything",), *((case,) for case in EDGE_CASES)]


def mask_case_results(fn, case, residual=True):
    """``fn`` on a case of :data:`MASK_CASES`, in one jitted program: its output, the
    gradients of ``<out, g>`` w.r.t. q, k, v and the bias for a random ``g``, and
    with ``residual`` the output and the residual of a ``return_residual`` call."""
    T, S, make = MASK_CASES[case]
    arguments = make(T, S)
    arrays = {n: a for n, a in arguments.items() if isinstance(a, np.ndarray)}
    static = {n: a for n, a in arguments.items() if n not in arrays}
    q, k, v = qkv(1, T, S)
    g_out = jnp.asarray(randn(9, *q.shape))

    @jit
    def run(q, k, v, arrays):
        arrays = dict(arrays)
        bias = arrays.pop("bias", None)
        call = functools.partial(fn, **arrays, **static)
        out, vjp = jax.vjp(lambda q, k, v, bias: call(q, k, v, bias), q, k, v, bias)
        found = {"out": out, "grads": vjp(g_out)}
        if residual:
            found["out with lse"], found["lse"] = call(q, k, v, bias, return_residual=True)
        return found

    return run(q, k, v, arrays)


@functools.cache
def jax_nn_mask_case_results(case):
    return mask_case_results(jax.nn.dot_product_attention, case)


def _serves_case(name, case):
    T, S, make = MASK_CASES[case]
    return serves(name, make(T, S), T, S)


@pytest.mark.parametrize("name, case", grid(MASK_CASES, served=_serves_case, fast=FAST_MASK_CASES))
def test_mask_modes_match_jax_nn(name, case, monkeypatch):
    implementation = force(monkeypatch, name)
    ours = functools.partial(jax_nn_attention, implementation=implementation)
    ours = mask_case_results(ours, case, residual=implementation != "cudnn")
    theirs = jax_nn_mask_case_results(case)
    for what in ours:
        if what == "grads":
            for mine, want in zip(ours[what], theirs[what]):
                if want is not None:
                    close(mine, want, atol=1e-4, rtol=1e-4)
        else:
            close(ours[what], theirs[what])
    blocked = np.asarray(theirs["lse"]) < -1e30  # a row that sees no key, or padding
    assert blocked.any() == (case in EDGE_CASES)
    if "lse" in ours:  # jax.nn's large negative there, exactly
        np.testing.assert_array_equal(np.asarray(ours["lse"])[blocked], theirs["lse"][blocked])


# --- jax's testDotProductAttention: grouped heads, half precision, vmap ------------------

# dtype: (the dtype, the tolerance of outputs and gradients; jax's own test takes 0.01)
DTYPES = {
    "float32": (np.float32, 1e-5),
    "bfloat16": (jnp.bfloat16, 2e-2),
    "float16": (np.float16, 1e-2),
}
FAST_GROUPED = [("bfloat16", "batched"), ("float32", "vmap")]  # each backend's first served


def grouped_results(fn, dtype, G, jitted=True):
    """``fn`` with K = N / G key/value heads and ``return_residual``, in one jitted
    program (unless not ``jitted``): output, residual, and the gradients of
    ``<out, g_out> + <lse, g_lse>`` (as jax's test takes them): dQ, and dK, dV summed
    over each group of G heads."""
    q, k, v = qkv(11, T, T, K=N // G, dtype=dtype)
    g_out = jnp.asarray(randn(9, *q.shape), dtype)
    g_lse = jnp.asarray(randn(10, *q.shape[:-1]), dtype)  # reaches nothing, as in jax.nn

    def run(q, k, v):
        (out, lse), vjp = jax.vjp(fn, q, k, v)
        dq, dk, dv = vjp((g_out, g_lse))
        group_sum = lambda x: x.reshape(*x.shape[:2], N // G, -1, H).sum(3)  # noqa: E731
        return out, lse, dq, group_sum(dk), group_sum(dv)

    return (jit(run) if jitted else run)(q, k, v)


@functools.cache
def jax_nn_grouped_results(dtype, G):
    """jax.nn on the key/value heads repeated G times, as jax's test calls its reference;
    eagerly in float16, whose products jax.nn cannot compile under jit on CPU."""

    def repeated(q, k, v):
        repeat = functools.partial(jnp.repeat, repeats=G, axis=2)  # (B, S, N, H)
        return jax.nn.dot_product_attention(q, repeat(k), repeat(v), return_residual=True)

    return grouped_results(repeated, DTYPES[dtype][0], G, jitted=dtype != "float16")


@pytest.mark.parametrize(
    "name, dtype, use_vmap",
    grid(
        DTYPES,
        ["batched", "vmap"],
        served=lambda name, dtype, _: serves(name, dtype=DTYPES[dtype][0]),
        fast=FAST_GROUPED,
        cudnn_path=False,
    ),
)
def test_grouped_heads_match_jax_nn_with_repeated_heads(name, dtype, use_vmap, monkeypatch):
    """G = 2 and 6 (K = 3 and 1, multi-query) against jax.nn on the key/value heads
    repeated G times; the adapter vmapped over the batch (unbatched calls) or not."""
    force(monkeypatch, name)
    ours = functools.partial(jax_nn_attention, return_residual=True)
    ours = jax.vmap(ours) if use_vmap == "vmap" else ours
    tol = DTYPES[dtype][1]
    for G in (2, 6):
        ours_g, theirs_g = (
            grouped_results(ours, DTYPES[dtype][0], G),
            jax_nn_grouped_results(dtype, G),
        )
        for mine, want in zip(ours_g, theirs_g):
            close(mine, want, atol=tol, rtol=tol)


# --- jax's testDotProductAttentionBiasGradient ------------------------------------------

FAST_BIAS = [("vmap", 3)]
BIAS_CALL = dict(bias=np.zeros((1, N, T, T)), mask=np.ones((1, 1, 1, T), bool))


def bias_gradient_results(fn, use_vmap, batch):
    """Self-attention (x as query, key and value) with a (batch, N, T, T) bias and a
    rank-3 (1, 1, T) mask: the output and the gradients w.r.t. x and the bias."""
    x, bias = jnp.asarray(randn(12, batch, T, N, H)), jnp.asarray(randn(13, batch, N, T, T))
    mask = jnp.ones((1, 1, T), bool)

    def attention(x, bias, mask):
        return fn(x, x, x, bias=bias, mask=mask, is_causal=False)

    if use_vmap == "vmap":
        attention = jax.vmap(attention, in_axes=(0, 0, None))

    @jit
    def run(x, bias, mask):
        y, vjp = jax.vjp(attention, x, bias, mask)
        return (y, *vjp(x)[:2])

    return run(x, bias, mask)


@functools.cache
def jax_nn_bias_gradient_results(use_vmap, batch):
    return bias_gradient_results(jax.nn.dot_product_attention, use_vmap, batch)


@pytest.mark.parametrize(
    "name, use_vmap, batch",
    grid(
        ["batched", "vmap"],
        [1, 3],
        served=lambda name, *_: serves(name, BIAS_CALL, T, T),
        fast=FAST_BIAS,
        cudnn_path=False,
    ),
)
def test_bias_gradient_matches_jax_nn(name, use_vmap, batch, monkeypatch):
    force(monkeypatch, name)
    ours = bias_gradient_results(jax_nn_attention, use_vmap, batch)
    for mine, want in zip(ours, jax_nn_bias_gradient_results(use_vmap, batch)):
        close(mine, want, atol=1e-4)


# --- jax's testDotProductAttentionFloat64MaskDebugInfs -----------------------------------


@pytest.mark.parametrize(
    "name",
    grid(
        served=lambda name: serves(name, dict(mask=np.ones(S, bool)), dtype=np.float64),
        cudnn_path=False,
    ),
)
def test_float64_with_a_mask_under_debug_infs(name, x64, monkeypatch):
    """jax issue 37422: float64 inputs with a mask, unbatched, eagerly under debug_infs:
    no inf anywhere, no warning, a float64 output. Then against jax.nn (whose softmax runs
    in float32, hence the tolerance), outputs and gradients."""
    force(monkeypatch, name)
    mask = jnp.arange(S) <= S // 2  # (S,): every query sees keys 0 .. 3
    zeros = (jnp.zeros((T, N, H), jnp.float64), jnp.zeros((S, K, H), jnp.float64))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with jax.debug_infs(True):
            out = jax_nn_attention(zeros[0], zeros[1], zeros[1], mask=mask)
            out.block_until_ready()
    assert out.dtype == jnp.float64 and out.shape == (T, N, H)

    def loss(fn, q, k, v):
        return (fn(q, k, v, mask=mask) ** 2).sum()

    @jit
    def both(q, k, v):
        return [
            jax.value_and_grad(loss, argnums=(1, 2, 3))(fn, q, k, v)
            for fn in (jax_nn_attention, jax.nn.dot_product_attention)
        ]

    ours, theirs = both(*(jnp.asarray(x[0], jnp.float64) for x in qkv(14)))
    for mine, want in zip(jax.tree.leaves(ours), jax.tree.leaves(theirs)):
        close(mine, want, atol=1e-5)


def test_a_row_that_sees_no_key_under_debug_infs():
    """The -inf kept for the row's log-sum-exp is internal (one program under the debug
    flags, nanoattn/_base/debug.py): no inf in the result, so nothing to catch."""
    q, k, v = (x[0] for x in qkv(15))
    mask = np.ones((T, S), bool)
    mask[2] = False
    with jax.debug_infs(True):
        out = jax_nn_attention(q, k, v, mask=mask).block_until_ready()
    want = jax.nn.dot_product_attention(q, k, v, mask=mask)
    np.testing.assert_allclose(out, want, atol=1e-5, rtol=1e-5)


# --- where nanoattn's contract differs: the values the adapter converts ---------------


def backends(arguments=None, cudnn_path=True):
    """Parametrizes ``name`` over every backend that serves the adapter's call with jax.nn's
    ``arguments`` here (and the cuDNN path)."""
    served = lambda name: serves(name, arguments)  # noqa: E731
    return pytest.mark.parametrize("name", grid(served=served, cudnn_path=cudnn_path))


@backends()
def test_a_row_that_sees_no_key_returns_the_mean_of_all_values(name, monkeypatch):
    """jax.nn's softmax of equal large negatives weighs all S keys 1 / S, those past
    key_value_seq_lengths included; the gradient w.r.t. V is the output's over S."""
    implementation = force(monkeypatch, name)
    kv_lengths = jnp.array([3, 0], jnp.int32)  # batch row 1 sees no key

    @jit
    def run(q, k, v):
        call = functools.partial(jax_nn_attention, key_value_seq_lengths=kv_lengths,
                                 implementation=implementation)  # fmt: skip
        out, vjp = jax.vjp(call, q, k, v)
        own = nanoattn.dot_product_attention(q, k, v, kv_lengths=kv_lengths)
        return out, vjp(jnp.ones_like(out)), own

    q, k, v = qkv(16)
    out, (dq, dk, dv), own = run(q, k, v)
    mean = np.repeat(np.asarray(v[1]).mean(0), N // K, axis=0)  # (N, H): head n uses n // G
    np.testing.assert_allclose(out[1], np.broadcast_to(mean, (T, N, H)), atol=1e-6)
    np.testing.assert_allclose(dv[1], np.full((S, K, H), T * (N // K) / S), rtol=1e-6)
    np.testing.assert_array_equal(dq[1], 0)
    np.testing.assert_array_equal(dk[1], 0)
    np.testing.assert_array_equal(own[1], 0)  # nanoattn's own contract: zeros
    close(out[0], own[0])


@backends(dict(query_seq_lengths=Q_LENGTHS))
def test_padded_queries_are_zeros_and_never_read(name, monkeypatch):
    """Rows past query_seq_lengths: zeros and no gradient; NaN there reaches nothing
    (in jax.nn it reaches dK through 0 * NaN)."""
    implementation = force(monkeypatch, name)
    lengths = jnp.asarray(Q_LENGTHS)  # batch row 0 has 9 queries

    @jit
    def run(q, k, v):
        call = functools.partial(jax_nn_attention, query_seq_lengths=lengths,
                                 implementation=implementation)  # fmt: skip
        out, vjp = jax.vjp(call, q, k, v)
        return out, vjp(jnp.ones_like(out))

    q, k, v = qkv(17)
    out, (dq, dk, dv) = run(q.at[0, 9:].set(jnp.nan), k, v)
    np.testing.assert_array_equal(out[0, 9:], 0)
    np.testing.assert_array_equal(dq[0, 9:], 0)
    assert all(np.isfinite(x).all() for x in (out, dq, dk, dv))
    finite, _ = run(q, k, v)
    close(out, finite)


@backends(dict(key_value_seq_lengths=np.array([5, 4])))
def test_masked_values_do_not_reach_the_output(name, monkeypatch):
    """NaN in values past key_value_seq_lengths (an unwritten cache slot): the adapter
    keeps nanoattn's rule and never reads them; jax.nn multiplies them by 0 (NaN)."""
    implementation = force(monkeypatch, name)
    lengths = jnp.array([5, 4], jnp.int32)
    call = functools.partial(jax_nn_attention, key_value_seq_lengths=lengths,
                             implementation=implementation)  # fmt: skip
    q, k, v = qkv(18)
    ours, finite = (jit(call)(q, k, v.at[:, 5:].set(x)) for x in (jnp.nan, 0.0))
    close(ours, finite)
    close(ours, jit(jax.nn.dot_product_attention)(q, k, v, key_value_seq_lengths=lengths))


def test_jax_nn_reads_the_content_the_adapter_never_reads():
    """The other side of the two tests above: in jax.nn, NaN in a padded query reaches dK
    and NaN in a hidden value reaches every output (0 * NaN)."""
    q, k, v = qkv(18)

    @jit
    def run(q, k, v):
        def padded(k):
            nan_q = q.at[0, 9:].set(jnp.nan)
            lengths = jnp.asarray(Q_LENGTHS)
            return jax.nn.dot_product_attention(nan_q, k, v, query_seq_lengths=lengths).sum()

        hidden = jax.nn.dot_product_attention(
            q, k, v.at[:, 5:].set(jnp.nan), key_value_seq_lengths=jnp.array([5, 4], jnp.int32)
        )
        return jax.grad(padded)(k), hidden  # fmt: skip

    dk, hidden = run(q, k, v)
    assert np.isnan(dk).any() and np.isnan(hidden).all()


@backends(dict(is_causal=True), cudnn_path=False)
def test_causality_and_windows_are_top_left_when_t_and_s_differ(name, monkeypatch):
    """With q = 0 every visible key weighs the same, and one-hot values make the output
    the weights: literal expected rows. Query t sees keys s <= t (and t - 1 <= s <= t + 1
    with the window); rows that see nothing weigh all keys 1 / S (jax.nn's value)."""
    force(monkeypatch, name)
    shapes = ((5, 3), (3, 5))
    rules = (dict(is_causal=True), dict(local_window_size=1))

    @jit
    def outputs():
        found = []
        for T_, S_ in shapes:
            q, k = jnp.zeros((T_, 1, S_)), jnp.ones((S_, 1, S_))  # (T, N=1, H=S), (S, K=1, H)
            v = jnp.eye(S_)[:, None, :]  # (S, 1, H): value s is one-hot at s
            for args in rules:
                found.append((jax_nn_attention(q, k, v, **args)[:, 0],
                              jax.nn.dot_product_attention(q, k, v, **args)[:, 0]))  # fmt: skip
        return found

    found = iter(outputs())
    for T_, S_ in shapes:
        band = np.triu(np.tril(np.ones((T_, S_)), 1), -1)  # |t - s| <= 1
        band[band.sum(1) == 0] = 1  # no visible key: all S keys
        for allowed in (np.tril(np.ones((T_, S_))), band):
            ours, theirs = next(found)
            want = allowed / allowed.sum(1, keepdims=True)
            np.testing.assert_allclose(ours, want, atol=1e-6)
            np.testing.assert_allclose(theirs, want, atol=1e-6)


@backends(dict(query_seq_lengths=Q_LENGTHS, key_value_seq_lengths=KV_LENGTHS),
          cudnn_path=False)  # fmt: skip
def test_residual_is_jax_nns(name, monkeypatch):
    """The residual: (B, T, N) or (T, N) in the dtype of the inputs, jax.nn's large
    negative where a row sees nothing or is padding (-inf in float16, as jax.nn's), and
    no gradient. (The cuDNN path gives none: nanoattn's cuDNN backend does not.)"""
    force(monkeypatch, name)
    lengths = dict(query_seq_lengths=jnp.asarray(Q_LENGTHS),
                   key_value_seq_lengths=jnp.asarray(KV_LENGTHS))  # fmt: skip
    dtypes = [d for d in (np.float32, np.float16) if serves(name, lengths, dtype=d)]

    @jit
    def run(q, k, v):
        found = [jax_nn_attention(*(a.astype(d) for a in (q, k, v)), **lengths,
                                  return_residual=True)[1] for d in dtypes]  # fmt: skip
        unbatched = jax_nn_attention(q[0], k[0], v[0], return_residual=True)[1]
        residual = lambda q: jax_nn_attention(q, k, v, return_residual=True)[1].sum()  # noqa: E731
        return found, unbatched, jax.grad(residual)(q)

    q, k, v = qkv(19)
    found, unbatched, grad = run(q, k, v)
    for dtype, ours in zip(dtypes, found):
        # jax.nn's float16 products do not compile on CPU under jit: it runs eagerly here
        x = [a.astype(dtype) for a in (q, k, v)]
        theirs = jax.nn.dot_product_attention(*x, **lengths, return_residual=True)[1]
        close(ours, theirs, rtol=1e-3 if dtype == np.float16 else 1e-5)
        np.testing.assert_array_equal(np.isinf(ours), np.isinf(theirs))
        assert np.isinf(ours).any() == (dtype == np.float16)
    assert unbatched.shape == (T, N)
    np.testing.assert_array_equal(grad, 0)


# --- the rest of jax.nn's calling convention -------------------------------------------


@backends(dict(is_causal=True))
def test_unbatched_calls_and_vmap(name, monkeypatch):
    """Unbatched (T, N, H) calls, with (1,) sequence lengths as jax.nn takes them, and
    vmap over the batch, equal jax.nn's."""
    implementation = force(monkeypatch, name)
    lengths = dict(query_seq_lengths=jnp.array([11], jnp.int32),
                   key_value_seq_lengths=jnp.array([6], jnp.int32))  # fmt: skip

    @jit
    def run(q, k, v):
        ours = functools.partial(jax_nn_attention, implementation=implementation, is_causal=True)
        theirs = functools.partial(jax.nn.dot_product_attention, is_causal=True)
        return [(ours(q[0], k[0], v[0], **lengths), theirs(q[0], k[0], v[0], **lengths)),
                (jax.vmap(ours)(q, k, v), theirs(q, k, v))]  # fmt: skip

    for ours, theirs in run(*qkv(20)):
        close(ours, theirs)


def test_scale_and_non_float_bias_as_jax_nn():
    bias = np.arange(T * S).reshape(T, S) % 3
    cases = (dict(scale=0.3), dict(bias=bias), dict(bias=bias > 0))

    @jit
    def run(q, k, v):
        return [(jax_nn_attention(q, k, v, **args), jax.nn.dot_product_attention(q, k, v, **args))
                for args in cases]  # fmt: skip

    for ours, theirs in run(*qkv(21)):
        close(ours, theirs)


def test_the_rules_tell_the_rows_that_see_no_key_as_the_log_sum_exp_does():
    """The cuDNN path gets no log-sum-exp, so it finds the rows that see no key from the
    call's rules: the same rows as the reference's -inf, on every mask case."""

    def rows(case):
        T_, S_, make = MASK_CASES[case]
        arguments = make(T_, S_)
        window = arguments.get("local_window_size")
        rules = dict(
            mask=arguments.get("mask"), is_causal=arguments.get("is_causal", False),
            kv_lengths=arguments.get("key_value_seq_lengths"),
            window=(window, window) if isinstance(window, int) else window,
        )  # fmt: skip
        if rules["is_causal"] or window is not None:
            rules["q_offset"] = 0
        q, k, v = qkv(22, T_, S_)
        _, lse = nanoattn.dot_product_attention(q, k, v, **rules, return_residual=True,
                                                implementation="xla")  # fmt: skip
        sees = jax_nn_rows.sees_a_key(Rules.make(q, k, v, **rules))
        return jnp.broadcast_to(sees, lse.shape), jnp.isfinite(lse)

    cases = [case for case in MASK_CASES if "bias" not in MASK_CASES[case][2](T, S)]
    found = jit(lambda: [rows(c) for c in cases])()
    for case, (sees, finite) in zip(cases, found):
        np.testing.assert_array_equal(sees, finite, err_msg=case)


def test_no_key_at_all_and_no_query_at_all():
    q, k, v = qkv(23)

    @jit
    def run(q, k, v):
        return [(jax_nn_attention(q_, k_, v_, return_residual=True),
                 jax.nn.dot_product_attention(q_, k_, v_, return_residual=True))
                for q_, k_, v_ in ((q, k[:, :0], v[:, :0]), (q[:, :0], k, v))]  # fmt: skip

    for ours, theirs in run(q, k, v):
        for mine, want in zip(ours, theirs):
            close(mine, want)


# --- implementation ---------------------------------------------------------------------


def test_none_and_xla_take_nanoattns_automatic_choice(monkeypatch):
    """jax.nn's None and 'xla' both take the choice nanoattn's dispatcher makes for the
    adapter's call (on CPU at T = S = 64, float32: the native kernel without a dense
    mask, the reference with one). Traced only: the choice is made while tracing."""
    chosen = []
    original = dispatch.choose

    def spy(requested, *args):
        chosen.append(original(requested, *args))
        return chosen[-1]

    monkeypatch.setattr(dispatch, "choose", spy)
    q = jax.ShapeDtypeStruct((B, 64, N, H), jnp.float32)
    for implementation in (None, "xla"):
        jax.eval_shape(functools.partial(jax_nn_attention, is_causal=True,
                                         implementation=implementation), q, q, q)  # fmt: skip
    mask = np.ones((64, 64), bool)
    jax.eval_shape(functools.partial(jax_nn_attention, mask=mask), q, q, q)
    x = jnp.zeros(q.shape, q.dtype)
    auto, masked = (
        original(None, Rules.make(x, x, x, **adapter_rules(arguments)), q.dtype, 0.0)
        for arguments in (dict(is_causal=True), dict(mask=mask))
    )
    assert chosen == [auto, auto, masked] and auto != masked, chosen


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="cuDNN may serve it on a GPU")
def test_cudnn_raises_where_it_cannot_serve():
    q, k, v = (x.astype(jnp.bfloat16) for x in qkv(25))
    with pytest.raises(ValueError, match=r"^implementation='cudnn' cannot serve this call: it "
                       r"needs an NVIDIA GPU"):  # fmt: skip
        jax_nn_attention(q, k, v, implementation="cudnn")


def test_compiled_memory_is_linear_in_t():
    """Forward and backward at T = S = 4096 (compiled, not run): jax.nn holds (B, N, T, S)
    scores, the adapter's automatic choice (the native kernel; the flash kernel with a
    key-padding mask) does not."""

    def temp_bytes(fn, **args):
        x = jax.ShapeDtypeStruct((1, 4096, 2, 16), jnp.float32)
        loss = jax.grad(lambda q: fn(q, q, q, **args).sum())
        return jax.jit(loss).lower(x).compile().memory_analysis().temp_size_in_bytes

    for args in (dict(is_causal=True), dict(mask=jnp.ones((1, 1, 1, 4096), bool))):
        theirs = temp_bytes(jax.nn.dot_product_attention, **args)
        assert theirs >= 2 * 4096**2 * 4  # at least one float32 (N, T, S) tensor
        assert temp_bytes(jax_nn_attention, **args) * 20 <= theirs


# --- signature, errors, docs ------------------------------------------------------------


def test_signature_is_jax_nns():
    ours = inspect.signature(jax_nn_attention).parameters
    theirs = inspect.signature(jax.nn.dot_product_attention).parameters
    assert list(ours) == list(theirs)
    for name in theirs:
        assert (ours[name].kind, ours[name].default) == (theirs[name].kind, theirs[name].default)


q4, k4 = np.ones((B, T, N, H), np.float32), np.ones((B, S, K, H), np.float32)
ERRORS = {  # case: (arguments, the message)
    "rank": (dict(query=q4[None]), r"^query must be \(B, T, N, H\) or \(T, N, H\), got an "
             r"array of shape \(1, 2, 13, 6, 5\)$"),
    "value": (dict(value=k4[:, :3]), r"^value must have the shape of key, \(B, S, K, H\) = "
              r"\(2, 7, 3, 5\), got \(2, 3, 3, 5\)$"),
    "batch": (dict(query=q4[:1]), r"^query must have shape \(B, T, N, H\) = \(2, \*, \*, 5\) "
              r"to match key \(B, S, K, H\) = \(2, 7, 3, 5\), got \(1, 13, 6, 5\)$"),
    "dtype": (dict(value=k4.astype(np.float16)), r"^query, key and value must have one "
              r"dtype, got float32, float32 and float16$"),
    "heads": (dict(query=q4[:, :, :4]), r"^the number of query heads N=4 must be a multiple "
              r"of the number of key/value heads K=3 \(query shape"),
    "mask dtype": (dict(mask=np.ones((T, S), np.float32)), r"^mask must be boolean \(True = "
                   r"may attend\), got dtype float32; an additive mask goes in bias$"),
    "mask heads": (dict(mask=np.ones((2, T, S), bool)), r"^mask must be broadcastable to "
                   r"\(B, N, T, S\) = \(2, 6, 13, 7\), got \(1, 2, 13, 7\)"),
    "bias": (dict(bias=np.ones((T, T), np.float32)), r"^bias must be broadcastable to "
             r"\(B, N, T, S\) = \(2, 6, 13, 7\), got \(1, 1, 13, 13\)"),
    "q lengths": (dict(query_seq_lengths=np.array([3, 4])), r"^query_seq_lengths must be an "
                  r"int32 array of shape \(B,\) = \(2,\), got int64 of shape \(2,\)$"),
    "kv lengths": (dict(key_value_seq_lengths=np.array([3], np.int32)),
                   r"^key_value_seq_lengths must be an int32 array of shape \(B,\) = \(2,\), "
                   r"got int32 of shape \(1,\)$"),
    "window": (dict(local_window_size=(-1, 2)), r"^local_window_size must be an int w .*, got "
               r"\(-1, 2\): a side below 0 \(a band without the diagonal\) is not served"),
    "window type": (dict(local_window_size=(1.0, 2)), r"^local_window_size must be an int w "
                    r"\(meaning \(w, w\)\) or a pair \(left, right\) of ints >= 0, got "
                    r"\(1.0, 2\)$"),
    "implementation": (dict(implementation="flash"), r"^implementation must be None, 'xla' "
                       r"or 'cudnn', as in jax.nn.dot_product_attention .*, got 'flash'$"),
}  # fmt: skip


@pytest.mark.parametrize("case", ERRORS)
def test_bad_input_raises_one_line_value_error(case):
    kwargs, match = ERRORS[case]
    args = dict(query=q4, key=k4, value=k4) | kwargs
    with jax.enable_x64(case == "q lengths"):  # int64 lengths, which jax.nn refuses too
        with pytest.raises(ValueError, match=match) as error:
            jax_nn_attention(**args)
        if case not in ("window", "window type", "implementation"):
            with pytest.raises((ValueError, TypeError, AssertionError)):  # jax.nn refuses it
                jax.nn.dot_product_attention(**args)
    assert "\n" not in str(error.value)


def test_flags_must_be_bools():
    for name in ("is_causal", "return_residual"):
        with pytest.raises(TypeError, match=rf"^{name} must be True or False, got 'yes'$"):
            jax_nn_attention(q4, k4, k4, **{name: "yes"})


def test_docstring_example():
    result = doctest.testmod(jax_nn_attention_module, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0 and result.failed == 0


def test_exported():
    assert nanoattn.jax_nn_attention is jax_nn_attention
