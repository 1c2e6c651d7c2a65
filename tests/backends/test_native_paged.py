"""The native kernel's paged pass (``paged.h``) where it differs from the other
backends: its vector tails (H not a multiple of the vector width), several tasks per
prefill chunk and several key tiles per task (with a window), bfloat16 widened in
registers, page tables full of stale ids past the pages held, and a decode batch at a
mid size against the paged reference. The behaviours every backend shares (GQA,
windows, soft-cap, sinks, ragged mixes, padding rows, NaN in pages not read, bad
inputs, gradients) are in tests/core/test_paged_attention.py."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import nanoattn
from nanoattn._backends import native as native_kernel

from _reference import np_attention, np_lse, randn

pytestmark = pytest.mark.skipif(
    native_kernel.load()[0] is None, reason="the native kernel could not be built here"
)

N, K, H = 8, 2, 20  # G = 4; H = 20: whole vectors and a tail on AVX2 and AVX-512


def _pool(lengths, q_lens, page_size, seed, M=None, garbage=True, kv_heads=K, n_heads=N):
    """A paged batch of ``kv_heads`` key/value heads: pages in shuffled physical order,
    NaN in every slot no sequence holds, and (``garbage``) stale ids in every entry of
    the table past the held pages (negative, past the pool, and pages of other
    sequences)."""
    rng = np.random.default_rng(seed)
    held = [-(-n // page_size) for n in lengths]
    M = max(held) + 1 if M is None else M
    P = sum(held) + 3
    order = rng.permutation(P)
    table = np.zeros((len(lengths), M), np.int32)
    stale = np.array([-7, P, P + 1000, 2**31 - 1, *order[:2]], np.int32)
    used = 0
    for b, count in enumerate(held):
        table[b, :count] = order[used : used + count]
        table[b, count:] = rng.choice(stale, M - count) if garbage else 0
        used += count
    kp = randn(seed + 1, P, page_size, kv_heads, H)
    vp = randn(seed + 2, P, page_size, kv_heads, H)
    readable = np.zeros((P, page_size), bool)
    for b, n in enumerate(lengths):
        for j in range(held[b]):
            readable[table[b, j], : min(page_size, n - j * page_size)] = True
    kp[~readable], vp[~readable] = np.nan, np.inf
    starts = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    q = randn(seed + 3, int(starts[-1]) + 2, n_heads, H)  # two padding rows
    return q, kp, vp, table, np.asarray(lengths, np.int32), starts


def _truth(arrays, window=None):
    """The float64 output and log-sum-exp of each sequence alone."""
    q, kp, vp, table, lengths, starts = arrays
    page_size, kv_heads = kp.shape[1], kp.shape[2]
    out, lse = np.zeros(q.shape), np.full(q.shape[:2], -np.inf)
    for b, n in enumerate(lengths):
        rows = slice(starts[b], starts[b + 1])
        q_len = starts[b + 1] - starts[b]
        pages = table[b, : -(-n // page_size)]
        keys = kp[pages].reshape(-1, kv_heads, H)[:n][None]
        values = vp[pages].reshape(-1, kv_heads, H)[:n][None]
        positions = n - q_len + np.arange(q_len)[:, None]
        j = np.arange(n)[None]
        allowed = j <= positions
        if window is not None:
            allowed &= j >= positions - window
        out[rows] = np_attention(q[rows][None], keys, values, allowed)[0]
        lse[rows] = np_lse(q[rows][None], keys, allowed)[0]
    return out, lse


def _native(arrays, dtype=jnp.float32, **rules):
    q, kp, vp, *ints = arrays
    q, kp, vp = (jnp.asarray(x, dtype) for x in (q, kp, vp))
    return nanoattn.paged_attention(
        q, kp, vp, *ints, implementation="native", return_residual=True, **rules
    )


def _each_alone_with_and_without_a_window(arrays):
    """Native's outputs and log-sum-exps of the real rows equal each sequence alone in
    float64, without a window and with one of 11 keys; returns both calls' (out, lse)."""
    end = arrays[-1][-1]
    calls = []
    for window in (None, 11):
        out, lse = _native(arrays, window=None if window is None else (window, 0))
        want, want_lse = _truth(arrays, window)
        np.testing.assert_allclose(out, want, atol=2e-5, rtol=2e-5, err_msg=f"{window}")
        np.testing.assert_allclose(lse[:end], want_lse[:end], atol=2e-5, rtol=2e-5)
        calls.append((out, lse))
    return calls


@pytest.mark.parametrize("page_size", [1, 7, 16])
def test_a_prefill_chunk_and_decode_tokens_equal_each_sequence_alone(page_size):
    """A 41-token chunk (three tasks of 16 rows at G = 4) over 70 keys (three tiles),
    decode tokens, a sequence with no query; keys of a window start mid-tile."""
    arrays = _pool([70, 1, 33, 5], [41, 1, 1, 0], page_size, seed=page_size)
    end = arrays[-1][-1]
    for out, lse in _each_alone_with_and_without_a_window(arrays):
        assert (np.asarray(out[end:]) == 0).all() and (np.asarray(lse[end:]) == -np.inf).all()


@pytest.mark.parametrize("n_heads, kv_heads", [(8, 8), (6, 2), (8, 4)])
def test_groups_that_fill_part_of_a_register_tile_equal_each_sequence_alone(n_heads, kv_heads):
    """G = 1, 3 and 2: a decode row's query heads fill part of a register tile of four
    query vectors (computed a vector at a time), chunks of 2 and 3 rows fill some tiles
    whole and one in part; sequences of 70 and 33 keys (tiles, chunks of four keys and a
    tail), a window starting mid-tile."""
    arrays = _pool([70, 33, 5, 19], [1, 3, 1, 2], 16, seed=41, kv_heads=kv_heads,
                   n_heads=n_heads)  # fmt: skip
    _each_alone_with_and_without_a_window(arrays)


def test_stale_ids_past_the_held_pages_of_a_large_table_are_never_read():
    """A table of 300 entries per sequence, all but a few stale: the same result as a
    table of zeros past the held pages, bit for bit."""
    args = dict(lengths=[29, 3, 64], q_lens=[2, 1, 1], page_size=16, seed=5, M=300)
    stale = _pool(**args)
    clean = _pool(**args, garbage=False)
    assert (stale[3] != clean[3]).any()
    for got, want in zip(_native(stale), _native(clean)):
        np.testing.assert_array_equal(got, want)
    np.testing.assert_allclose(_native(stale)[0], _truth(stale)[0], atol=2e-5, rtol=2e-5)


def test_bfloat16_is_within_twice_the_references_error():
    """bfloat16 pools widened in registers: the error to float64 (of the rounded inputs)
    at most twice the reference's in bfloat16, and rounded to bfloat16."""
    arrays = _pool([70, 1, 33], [41, 1, 1], 16, seed=11)
    rounded = [np.asarray(jnp.asarray(x, jnp.bfloat16), np.float32) for x in arrays[:3]]
    want, _ = _truth((*rounded, *arrays[3:]))
    end = arrays[-1][-1]
    got, lse = _native(arrays, jnp.bfloat16)
    assert got.dtype == jnp.bfloat16 and lse.dtype == jnp.float32
    q, kp, vp = (jnp.asarray(x, jnp.bfloat16) for x in arrays[:3])
    ref = nanoattn.paged_attention(q, kp, vp, *arrays[3:], implementation="xla")
    error = np.abs(np.asarray(got, np.float64) - want)[:end].max()
    ref_error = np.abs(np.asarray(ref, np.float64) - want)[:end].max()
    assert 0 < error <= 2 * ref_error, (error, ref_error)


@functools.cache
def _decode_step(implementation, dtype):
    def step(q, kp, vp, table, lengths, starts):
        if dtype == "int8":  # float32 queries over int8 pools and their scales
            (kp, ks), (vp, vs) = nanoattn.quantize_kv(kp), nanoattn.quantize_kv(vp)
            scales = dict(key_scales=ks, value_scales=vs)
        else:
            q, kp, vp, scales = *(x.astype(dtype) for x in (q, kp, vp)), {}
        out, lse = nanoattn.paged_attention(
            q, kp, vp, table, lengths, starts, implementation=implementation,
            return_residual=True, **scales,
        )  # fmt: skip
        return out.astype(jnp.float32), lse

    return jax.jit(step)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, "int8"])
def test_a_decode_batch_equals_the_paged_reference(dtype):
    """41 sequences of 1 to 523 keys, one token each, pages of 16: more tasks than
    threads, each reading both key/value heads of its sequence side by side (up to 10
    threads), float, bfloat16 and int8 pools."""
    lengths = np.random.default_rng(0).integers(1, 524, 41).tolist()
    arrays = [jnp.asarray(x) for x in _pool(lengths, [1] * 41, 16, seed=17)]
    if dtype == "int8":  # quantize_kv makes a NaN row's scale NaN: pages not read are 0
        arrays[1:3] = [jnp.nan_to_num(x, nan=0.0, posinf=0.0) for x in arrays[1:3]]
    out, lse = _decode_step("native", dtype)(*arrays)
    want, want_lse = _decode_step("xla", dtype)(*arrays)
    tolerance = 1e-2 if dtype == jnp.bfloat16 else 2e-5  # the reference's bf16 output rounds
    np.testing.assert_allclose(out, want, atol=tolerance, rtol=tolerance)
    np.testing.assert_allclose(lse, want_lse, atol=2e-5, rtol=2e-5)


def test_a_paged_mask_fn_is_refused_in_one_line_and_served_automatically():
    arrays = [jnp.asarray(x) for x in _pool([9, 4], [2, 1], 4, seed=23)]

    def mask_fn(b, n, q, k):
        return k % 2 == 0

    with pytest.raises(ValueError) as info:
        nanoattn.paged_attention(*arrays, mask_fn=mask_fn, implementation="native")
    assert "\n" not in str(info.value) and "mask_fn is served by 'xla' and 'flash'" in str(
        info.value
    )
    chosen = nanoattn.paged_attention(*arrays, mask_fn=mask_fn)  # by another backend
    want = nanoattn.paged_attention(*arrays, mask_fn=mask_fn, implementation="xla")
    np.testing.assert_allclose(chosen, want, atol=2e-5, rtol=2e-5)


# --- split-key decode: a sequence's keys cut into pieces across threads -------------------

SPLIT_LENGTHS = [1, 512, 513, 2049, 3000]  # one key, one piece, one piece and a key, long


@pytest.mark.parametrize("threads", ["1", "2", "3", "4"])
def test_split_key_decode_equals_float64_on_every_thread_count(threads, monkeypatch):
    """Decode tokens (and a two-token chunk) of sequences of 1, 512, 513, 2049 and 3000
    keys, MQA (K = 1 of N = 8: one task a sequence, nothing to share but its keys), pages
    of 16 holding NaN past each sequence: on 1 to 4 threads (twice the cores), split or
    not, each row equals its sequence alone in float64, with a window ending inside a
    piece too, and runs again bitwise the same on the same thread count."""
    monkeypatch.setenv("NANOATTN_NUM_THREADS", threads)
    arrays = _pool(SPLIT_LENGTHS, [1, 1, 1, 2, 1], 16, seed=29, kv_heads=1)
    end = arrays[-1][-1]
    for window in (None, 700):
        rules = {} if window is None else dict(window=(window, 0))
        out, lse = _native(arrays, **rules)
        want, want_lse = _truth(arrays, window)
        np.testing.assert_allclose(out, want, atol=2e-5, rtol=2e-5, err_msg=f"{window}")
        np.testing.assert_allclose(lse[:end], want_lse[:end], atol=2e-5, rtol=2e-5)
        again = _native(arrays, **rules)
        np.testing.assert_array_equal(out, again[0])


def test_a_split_piece_that_sees_nan_makes_its_row_nan_and_no_other(monkeypatch):
    """NaN in one key of a long sequence, read by the later of its pieces: its row's
    output is NaN on two threads (the pieces merged), the other sequences' rows are not."""
    monkeypatch.setenv("NANOATTN_NUM_THREADS", "2")
    arrays = list(_pool([3000, 700], [1, 1], 16, seed=31, kv_heads=1))
    q, kp, vp, table, lengths, starts = arrays
    kp = kp.copy()
    page, slot = table[0, 2500 // 16], 2500 % 16
    kp[page, slot] = np.nan
    out, _ = _native((q, kp, vp, table, lengths, starts))
    assert np.isnan(np.asarray(out[0])).all()
    assert np.isfinite(np.asarray(out[1])).all()


def test_a_full_cache_decodes_in_place_as_the_pages_do():
    """A dense decoding step (T = 2 at per-row offsets, key lengths) on native reads the
    cache in place by the paged pass: equal to float64, to the same keys as pages, and
    its gradients to the reference's; NaN past each row's length never read."""
    from nanoattn._backends.native.kernel import decodes_in_place

    B, T, S = 3, 2, 600
    lengths = np.array([7, 600, 431])
    q, k, v = randn(41, B, T, N, H), randn(42, B, S, K, H), randn(43, B, S, K, H)
    for b, n in enumerate(lengths):
        k[b, n:], v[b, n:] = np.nan, np.inf
    rules = dict(is_causal=True, q_offset=lengths - T, kv_lengths=lengths)
    spec = nanoattn._base.rules.Rules.make(q, k, v, **rules)
    assert decodes_in_place(spec)

    def call(impl, q, k, v):
        return nanoattn.dot_product_attention(q, k, v, implementation=impl, **rules)

    out = call("native", q, k, v)
    for b, n in enumerate(lengths):
        allowed = np.arange(n)[None] <= (n - T + np.arange(T))[:, None]
        want = np_attention(q[b : b + 1], k[b : b + 1, :n], v[b : b + 1, :n], allowed)[0]
        np.testing.assert_allclose(out[b], want, atol=2e-5, rtol=2e-5)
    pages = _native(
        (
            q.reshape(B * T, N, H),
            k,
            v,
            np.arange(B, dtype=np.int32)[:, None],
            lengths.astype(np.int32),
            np.arange(B + 1, dtype=np.int32) * T,
        )
    )[0]
    np.testing.assert_array_equal(out.reshape(B * T, N, H), pages[: B * T])
    clean = [np.nan_to_num(x, nan=0.0, posinf=0.0) for x in (k, v)]
    # queries at offsets of their own, not at the end of their keys: causality alone
    # (no key lengths) bounds what each row reads
    offsets = dict(is_causal=True, q_offset=np.array([3, 100, 250]))
    got = nanoattn.dot_product_attention(q, *clean, implementation="native", **offsets)
    want = nanoattn.dot_product_attention(q, *clean, implementation="xla", **offsets)
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=2e-5)
    grads = [jax.grad(lambda *a, i=impl: (call(i, *a) ** 2).sum(), argnums=(0, 1, 2))(
        jnp.asarray(q), *map(jnp.asarray, clean)) for impl in ("native", "xla")]  # fmt: skip
    for got, want in zip(*grads):
        np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4)


def test_values_of_their_own_width_are_read_in_place():
    """Value pages of width Hv = 11 (H = 20): native's paged pass reads them as they are,
    and a dense call pads the narrower width; both equal the reference."""
    arrays = _pool([70, 1, 33], [41, 1, 1], 16, seed=37)
    q, kp, _, table, lengths, starts = arrays
    vp = randn(38, kp.shape[0], 16, K, 11)
    want = nanoattn.paged_attention(q, kp, vp, table, lengths, starts, implementation="xla")
    got = nanoattn.paged_attention(
        *(jnp.asarray(x) for x in (q, kp, vp)), table, lengths, starts, implementation="native"
    )
    end = starts[-1]
    np.testing.assert_allclose(got[:end], want[:end], atol=2e-5, rtol=2e-5)
    qd, kd, vd = randn(39, 2, 3, N, H), randn(40, 2, 9, K, H), randn(41, 2, 9, K, 11)
    for T in (3, 20):  # a decoding step read in place, and the dense pass
        qd = randn(39, 2, T, N, H)
        want = nanoattn.dot_product_attention(qd, kd, vd, implementation="xla")
        got = nanoattn.dot_product_attention(qd, kd, vd, implementation="native")
        np.testing.assert_allclose(got, want, atol=2e-5, rtol=2e-5)


# --- token trees: each row's position and its ancestors as bits -----------------------------


def _random_parents(rng, size: int, branching: int) -> list[int]:
    """A random tree of ``size`` tokens, each with at most ``branching`` children."""
    children, parents = {}, []
    for i in range(size):
        p = int(rng.choice([p for p in range(-1, i) if children.get(p, 0) < branching]))
        children[p] = children.get(p, 0) + 1
        parents.append(p)
    return parents


@functools.cache
def _tree_case():
    """A tree of 41 tokens (two words of ancestry bits, two row sets of a task) over 1100
    committed keys (many tiles, cut into pieces on two threads), a 3-token chain (a
    prefill chunk) and one decode token; pages of 16 with NaN past each sequence."""
    rng = np.random.default_rng(37)
    trees = [_random_parents(rng, 41, 3), [-1, 0, 1], [-1]]
    arrays = _pool([1141, 20, 600], [len(t) for t in trees], 16, seed=41)
    parents = np.array([p for t in trees for p in t] + [-1, -1], np.int32)  # 2 padding rows
    return arrays, parents


@pytest.mark.parametrize("threads", ["1", "2"])
def test_a_long_tree_on_native_equals_the_reference(threads, monkeypatch):
    """The native paged pass with a tree (tiles before the chunk by the band, tiles of the
    chunk by ancestry bits), whole or cut into pieces, with no window, a window reaching
    before the chunk and a window shorter than the tree's depth, and pages a windowed
    sequence gave back: equal to the reference, and its gradients to the reference's."""
    monkeypatch.setenv("NANOATTN_NUM_THREADS", threads)
    arrays, parents = _tree_case()
    q, kp, vp, table, lengths, starts = arrays
    for window in (None, (1050, 0), (5, 0)):
        call = functools.partial(nanoattn.paged_attention, tree_parents=parents, window=window)
        got = np.asarray(call(*arrays, implementation="native"))
        want = np.asarray(call(*arrays, implementation="xla"))
        np.testing.assert_allclose(got, want, atol=2e-5, rtol=2e-5, err_msg=f"{window}")
    returned = table.copy()
    returned[0, :10] = -1  # RETURNED: pages given back
    for window, poisoned in (((700, 0), False), ((1000, 0), True)):
        call = functools.partial(nanoattn.paged_attention, q, kp, vp, returned, lengths, starts,
                                 tree_parents=parents, window=window)  # fmt: skip
        got, want = (np.asarray(call(implementation=i)) for i in ("native", "xla"))
        np.testing.assert_allclose(got, want, atol=2e-5, rtol=2e-5, err_msg=f"{window}")
        assert np.isnan(got[: starts[1]]).any() == poisoned, window

    def loss(implementation, q, kp, vp):
        out = nanoattn.paged_attention(q, kp, vp, table, lengths, starts, tree_parents=parents,
                                       implementation=implementation)  # fmt: skip
        return jnp.sum(jnp.where(jnp.isfinite(out), out, 0) ** 2)

    clean = [np.nan_to_num(x, nan=0.0, posinf=0.0) for x in (q, kp, vp)]
    got, want = (jax.grad(functools.partial(loss, i), argnums=(0, 1, 2))(*clean)
                 for i in ("native", "xla"))  # fmt: skip
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, atol=1e-4, rtol=1e-4)
