"""``mask_fn`` on the native kernel against the float64 reference: outputs and gradients
in float32 and bfloat16, both forward paths (the transposed one, and the rows of a
decode step, T < 16) and the backward; masks ANDed with the kernel's own rules; a
static BlockMask reused and coarsened; masks of traced arrays (their bits computed at
run time); vmap; masked content never read; what the backend serves and refuses.

The kernel takes a mask_fn as its 64 x 64 blocks' kinds (empty, partial, full) and
the bits of the partial ones (nanoattn/_backends/native/kernel.py). Each mask is written
twice,
as a ``mask_fn`` of jax index arrays and as a numpy literal, so that the library never
checks itself (as tests/core/test_mask_fn.py).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import nanoattn
from nanoattn._backends import native
from nanoattn._backends.dispatch import choose
from nanoattn._backends.native import kernel as native_kernel
from nanoattn._base.rules import Rules

from _cases import jit_vjp as run
from _reference import np_attention_vjp, np_index_grids, randn

pytestmark = pytest.mark.skipif(
    native.load()[0] is None, reason="the native kernel could not be built here"
)

B, N, K, H = 2, 6, 2, 7  # GQA: heads 0-2 share key/value head 0, heads 3-5 head 1
IDS = np.stack([np.repeat(np.arange(8), 41)[:310], np.repeat(np.arange(11), 29)[:310]])
WIDTHS = np.array([0, 3, 17, 64, 90, 400])  # one window per head
KEEP = np.random.default_rng(7).random((B, N, 7, 7)) < 0.4  # blocks of 50: not 64-aligned


def positions(T, S, q_offset=0):
    """Numpy index grids (B, N, T, S) of this file's sizes (``np_index_grids``)."""
    return np_index_grids(B, N, T, S, q_offset)


def documents(b, n, q, k):
    ids = jnp.asarray(IDS)
    return ids[b, q] == ids[b, k]


def prefix_lm(b, n, q, k):  # a prefix of 23 tokens sees itself both ways, then causal
    return (k <= q) | (k < 23)


def per_head_window(b, n, q, k):
    return (k <= q) & (q - k <= jnp.asarray(WIDTHS)[n])


def block_sparse(b, n, q, k):
    return jnp.asarray(KEEP)[b, n, q // 50, k // 50]


LITERALS = {
    documents: lambda b, n, q, k: IDS[b, q] == IDS[b, k],
    prefix_lm: lambda b, n, q, k: (k <= q) | (k < 23),
    per_head_window: lambda b, n, q, k: (k <= q) & (q - k <= WIDTHS[n]),
    block_sparse: lambda b, n, q, k: KEEP[b, n, q // 50, k // 50],
}


def np_rules(T, S, q_offset=0, is_causal=False, window=None, kv_lengths=None):
    """(B, 1, T, S): what the kernel's own rules let through, from positions alone."""
    _, _, q, k = positions(T, S, q_offset)
    allowed = np.ones((B, 1, T, S), bool)
    if is_causal:
        allowed &= (k <= q)[:, :1]
    if window is not None:
        left, right = window
        allowed &= ((q - left <= k) & (k <= q + right))[:, :1]
    if kv_lengths is not None:
        allowed &= k[:, :1] < np.asarray(kv_lengths)[:, None, None, None]
    return allowed


def inputs(T, S, seed=0):
    return randn(seed, B, T, N, H), randn(seed + 1, B, S, K, H), randn(seed + 2, B, S, K, H)


def assert_matches(got, q, k, v, d_out, allowed, atol=2e-5):
    out, grads = got
    want, want_grads = np_attention_vjp(q, k, v, d_out, allowed=allowed)
    np.testing.assert_allclose(out, want, atol=atol, rtol=1e-5)
    for name, g, w in zip(("dq", "dk", "dv"), grads, want_grads):
        np.testing.assert_allclose(g, w, atol=atol, rtol=1e-5, err_msg=name)


def case(name, T, S, mask_fn, q_offset=0, **rules):
    return pytest.param(T, S, mask_fn, q_offset, rules, id=name)


CASES = [
    case("documents, T = S = 300", 300, 300, documents),
    case("prefix-LM, window (70, 20), lengths, T = S = 131", 131, 131, prefix_lm,
         window=(70, 20), kv_lengths=np.array([131, 77])),
    case("prefix-LM, decode T = 5 at offsets (200, 258)", 5, 263, prefix_lm,
         q_offset=np.array([200, 258])),
    case("per-head window, T = 37, S = 301 at offsets (0, 250), lengths", 37, 301,
         per_head_window, q_offset=np.array([0, 250]), kv_lengths=np.array([301, 211])),
    case("per-head window, decode T = 13, causal", 13, 300, per_head_window, q_offset=287,
         is_causal=True),
    case("block-sparse, causal, T = S = 300", 300, 300, block_sparse, is_causal=True),
    case("block-sparse, T = 1, S = 311", 1, 311, block_sparse, q_offset=5),
]  # fmt: skip


@pytest.mark.parametrize(
    "T, S, mask_fn, q_offset, rules",
    # The others, documents at T = S = 300 and per-head windows at per-row offsets with
    # T = 37, S = 301, are the mask families of tests/core/test_mask_fn.py, which runs
    # them on every backend that serves mask_fn, this kernel included.
    [c for c in CASES if c.id not in (CASES[0].id, CASES[3].id)],
)
def test_masks_match_the_float64_reference_in_float32(T, S, mask_fn, q_offset, rules):
    q, k, v = inputs(T, S)
    d_out = randn(9, B, T, N, H)
    got = run("native", q, k, v, d_out, mask_fn=mask_fn, q_offset=q_offset, **rules)
    allowed = LITERALS[mask_fn](*positions(T, S, q_offset)) & np_rules(T, S, q_offset, **rules)
    assert not allowed.all() and allowed.any()
    assert_matches(got, q, k, v, d_out, allowed)


@pytest.mark.parametrize("T, S, mask_fn, q_offset, rules", [CASES[0], CASES[2]])
def test_bfloat16_is_as_close_to_the_truth_as_the_reference_in_bfloat16(
    T, S, mask_fn, q_offset, rules
):
    # As tests/backends/test_native.py: the kernel's error against the float64 truth on the same
    # bfloat16 inputs is at most twice the reference's own bfloat16 error, plus a floor.
    q, k, v = (x.astype(jnp.bfloat16) for x in map(jnp.asarray, inputs(T, S)))
    d_out = randn(9, B, T, N, H)
    call = dict(mask_fn=mask_fn, q_offset=q_offset, **rules)
    native, reference = run("native", q, k, v, d_out, **call), run("xla", q, k, v, d_out, **call)
    assert native[0].dtype == jnp.bfloat16 and all(g.dtype == jnp.bfloat16 for g in native[1])
    allowed = LITERALS[mask_fn](*positions(T, S, q_offset)) & np_rules(T, S, q_offset, **rules)
    as64 = [np.asarray(x, np.float64) for x in (q, k, v, jnp.asarray(d_out, jnp.bfloat16))]
    want, (dq, dk, dv, _) = np_attention_vjp(*as64, allowed=allowed)
    for name, got, ref, truth in zip(
        ("out", "dq", "dk", "dv"), (native[0], *native[1]), (reference[0], *reference[1]),
        (want, dq, dk, dv),
    ):  # fmt: skip
        error = np.abs(np.asarray(got, np.float64) - truth).max()
        own = np.abs(np.asarray(ref, np.float64) - truth).max()
        floor = 4 * 2.0**-8 * np.abs(truth).max()
        assert error <= 2 * own + floor, (name, error, own, floor)


@pytest.mark.parametrize("block", [32, pytest.param(128, marks=pytest.mark.slow)])
def test_a_static_block_mask_is_reused_and_taken_at_the_kernels_blocks(block, monkeypatch):
    # Built once outside jit and passed to two calls: classified at 32 it is coarsened
    # to the kernel's 64 (per batch row, not reduced over the rows), at 128 classified
    # afresh; either way the kernel's kinds are the literal's at 64. Its 12 partial
    # blocks' bits are computed 5 at a time (the last chunk padded).
    monkeypatch.setattr(native_kernel, "CHUNK_CELLS", 5 * 64 * 64)
    T = S = 131
    mask = nanoattn.block_mask(documents, B, N, T, S, block_q=block, block_k=block)
    assert mask.static
    spec = Rules.make(*map(jnp.asarray, inputs(T, S)[:2]), mask_fn=mask)
    allowed = LITERALS[documents](*positions(T, S))[:, :1]  # (B, 1, T, S): no head depends
    # Kinds of the literal's 64 x 64 blocks, padding cells (2) neither visible nor hidden.
    cells = np.pad(allowed.astype(np.int8), ((0, 0), (0, 0), (0, 61), (0, 61)), constant_values=2)
    cells = cells.reshape(B, 1, 3, 64, 3, 64).swapaxes(3, 4).reshape(B, 1, 3, 3, -1)
    want_kinds = np.where((cells != 0).all(-1), 2, np.where((cells == 1).any(-1), 1, 0))
    np.testing.assert_array_equal(native_kernel._static_kinds(spec, 64, 64), want_kinds)
    assert (want_kinds == 1).sum() == 12
    first, second = inputs(T, S), inputs(T, S, seed=5)
    attend = functools.partial(nanoattn.dot_product_attention, mask_fn=mask,
                               implementation="native")  # fmt: skip
    outs = jax.jit(lambda a, b: (attend(*a), attend(*b)))(first, second)
    for (q, k, v), out in zip((first, second), outs):
        want, _ = np_attention_vjp(q, k, v, np.zeros_like(q), allowed=allowed)
        np.testing.assert_allclose(out, want, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("limit", [None, 0], ids=["a constant", "at run time"])
def test_a_static_masks_bits_are_a_constant_up_to_a_limit(limit, monkeypatch):
    # A mask of concrete arrays has its partial blocks' bits worked out once, when the
    # call is traced (no evaluation of mask_fn left in the program); past
    # CONSTANT_BITS_LIMIT they are computed in the program, every call. Both serve the
    # literal's attention.
    if limit is not None:
        monkeypatch.setattr(native_kernel, "CONSTANT_BITS_LIMIT", limit)
    T = S = 131
    q, k, v = inputs(T, S)
    bits = []

    def attend(q, k, v):
        bits.append(native_kernel._mask_operands(Rules.make(q, k, v, mask_fn=documents))[2])
        return nanoattn.dot_product_attention(q, k, v, mask_fn=documents, implementation="native")

    out = jax.jit(attend)(q, k, v)
    assert bits[0].shape == (12, 1024)  # (2 rows x 3 x 3 blocks, 6 of them partial per row)
    assert isinstance(bits[0], jax.core.Tracer if limit == 0 else np.ndarray)
    want, _ = np_attention_vjp(q, k, v, np.zeros(q.shape), LITERALS[documents](*positions(T, S)))
    np.testing.assert_allclose(out, want, atol=2e-5, rtol=1e-5)


def test_masks_of_traced_arrays_are_served_from_bits_computed_at_run_time(monkeypatch):
    # Ids passed to jit, and per-row offsets traced: the kinds are known at run time
    # only, so every block's bits are computed then (the kinds with them), here one
    # query block at a time.
    monkeypatch.setattr(native_kernel, "CHUNK_CELLS", 5 * 64 * 64)
    T, S = 150, 150
    q, k, v = inputs(T, S)
    d_out = randn(9, B, T, N, H)
    offsets = np.array([113, 40])

    @jax.jit
    def forward_backward(q, k, v, ids, offsets):
        def doc_prefix(b, n, qp, kp):  # a document's first 23 tokens see each other
            return (ids[b, qp] == ids[b, kp]) & ((kp <= qp) | (kp < 23))

        rules = dict(mask_fn=doc_prefix, q_offset=offsets, kv_lengths=jnp.array([150, 140]))
        assert not native_kernel._probe(Rules.make(q, k, v, **rules))[0]
        attend = functools.partial(nanoattn.dot_product_attention, implementation="native",
                                   **rules)  # fmt: skip
        out, vjp = jax.vjp(attend, q, k, v)
        return out, vjp(d_out)

    got = forward_backward(q, k, v, jnp.asarray(IDS), jnp.asarray(offsets))
    _, _, qp, kp = positions(T, S, offsets)
    b = np.arange(B)[:, None, None, None]
    allowed = (IDS[b, qp] == IDS[b, kp]) & ((kp <= qp) | (kp < 23))
    allowed &= kp < np.array([150, 140])[:, None, None, None]
    assert_matches(got, q, k, v, d_out, allowed)


def test_a_traced_mask_whose_bits_would_be_too_large_is_left_to_others(monkeypatch):
    monkeypatch.setattr(native_kernel, "TRACED_BITS_LIMIT", 2**10)
    T = S = 131  # (2 rows, 1 head, 3 x 3 blocks) of 1024 bytes: 18 KiB of bits
    q, k, v = map(jnp.asarray, inputs(T, S))

    def attend(q, k, v, ids, implementation=None):
        def doc(b, n, qp, kp):
            return ids[b, qp] == ids[b, kp]

        spec = Rules.make(q, k, v, mask_fn=doc)
        assert choose(None, spec, jnp.float32, 0.0) != "native"
        return nanoattn.dot_product_attention(q, k, v, mask_fn=doc, implementation=implementation)

    with pytest.raises(ValueError) as info:
        jax.jit(functools.partial(attend, implementation="native"))(q, k, v, jnp.asarray(IDS))
    assert str(info.value) == (
        "implementation='native' cannot serve this call: mask_fn depends on traced values, "
        "so the kernel would need the bits of all its blocks at run time, 0 MiB here (at "
        "most 0 MiB); 'flash' serves it without them"
    )
    out = jax.jit(attend)(q, k, v, jnp.asarray(IDS))
    want, _ = np_attention_vjp(q, k, v, np.zeros(q.shape), LITERALS[documents](*positions(T, S)))
    np.testing.assert_allclose(out, want, atol=2e-5, rtol=1e-5)


def test_vmap_over_an_extra_axis_with_static_and_mapped_masks():
    # Under vmap the kernel folds the mapped axis into B, and the mask's blocks gain it
    # too: the same kinds broadcast to every map index (prefix-LM), or each index's own
    # (ids mapped with the inputs: kinds traced, per index).
    V, T, S = 3, 67, 67
    q, k, v = (randn(s, V, B, T, h, H) for s, h in ((1, N), (2, K), (3, K)))
    d_out = randn(4, V, B, T, N, H)
    ids = np.stack([IDS[:, :T], IDS[:, 3 : T + 3], IDS[::-1, :T]])  # (V, B, T)

    def attend(q, k, v, ids):
        def doc(b, n, qp, kp):
            return ids[b, qp] == ids[b, kp]

        mask_fn = prefix_lm if ids is None else doc
        return nanoattn.dot_product_attention(q, k, v, mask_fn=mask_fn, implementation="native")

    @functools.partial(jax.jit, static_argnums=3)
    def forward_backward(q, k, v, mapped):
        mapped_ids = jnp.asarray(ids) if mapped else None
        axes = (0, 0, 0, 0 if mapped else None)
        out, vjp = jax.vjp(lambda *a: jax.vmap(attend, axes)(*a, mapped_ids), q, k, v)
        return out, vjp(d_out)

    for mapped in (False, True):
        out, grads = forward_backward(q, k, v, mapped)
        for i in range(V):
            if not mapped:
                allowed = LITERALS[prefix_lm](*positions(T, S))
            else:
                b, _, qp, kp = positions(T, S)
                allowed = ids[i][b, qp] == ids[i][b, kp]
            assert_matches((out[i], [g[i] for g in grads]), q[i], k[i], v[i], d_out[i], allowed)


@pytest.mark.parametrize("T, S, q_offset", [(300, 300, 0), (5, 263, 258)])
def test_nan_and_inf_that_only_mask_fn_hides_change_nothing(T, S, q_offset):
    # Keys 200..259 are hidden by mask_fn alone (causality would show them) from the
    # heads of key/value head 0, and the queries at positions 100..109 and 260 see no
    # key: NaN and inf there reach no output and no gradient (transposed forward at
    # T = 300, rows forward at T = 5, and the backward).
    def hides(b, n, qp, kp):
        blind = ((qp >= 100) & (qp < 110)) | (qp == 260)
        return ~(((kp >= 200) & (kp < 260) & (n < N // K)) | blind)

    q, k, v = inputs(T, S)
    d_out = randn(9, B, T, N, H)
    blind = [i for i in range(T) if 100 <= q_offset + i < 110 or q_offset + i == 260]
    dirty_q, dirty_k, dirty_v = q.copy(), k.copy(), v.copy()
    dirty_k[:, 200:230, 0], dirty_v[:, 230:260, 0], dirty_q[:, blind] = np.nan, np.inf, np.nan
    rules = dict(mask_fn=hides, is_causal=True, q_offset=q_offset)
    clean = run("native", q, k, v, d_out, **rules)
    dirty = run("native", dirty_q, dirty_k, dirty_v, d_out, **rules)
    for a, b in zip(jax.tree.leaves(dirty), jax.tree.leaves(clean)):  # dq: summed per worker
        assert np.isfinite(np.asarray(a)).all()
        np.testing.assert_allclose(a, b, atol=1e-6, rtol=1e-6)
    out, (dq, dk, dv) = dirty
    out, dq, dk, dv = map(np.asarray, (out, dq, dk, dv))
    assert blind and (out[:, blind] == 0).all() and (dq[:, blind] == 0).all()
    assert (dk[:, 200:260, 0] == 0).all() and (dv[:, 200:260, 0] == 0).all()
    assert (dv[:, 200:260, 1] != 0).any()  # key/value head 1 sees them


def test_it_serves_mask_fn_and_leaves_score_fn_to_others():
    z = jnp.zeros((1, 40, 2, 8))
    assert choose(None, Rules.make(z, z, z, mask_fn=prefix_lm), jnp.float32, 0.0) == "native"
    score = dict(score_fn=lambda s, b, n, qp, kp: s)
    assert choose(None, Rules.make(z, z, z, **score), jnp.float32, 0.0) != "native"
    with pytest.raises(ValueError) as info:
        nanoattn.dot_product_attention(z, z, z, implementation="native", **score)
    assert str(info.value) == (
        "implementation='native' cannot serve this call: score_fn is served by 'xla' and "
        "'flash' only"
    )
