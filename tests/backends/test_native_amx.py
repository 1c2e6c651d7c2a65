"""The native paged pass on AMX tiles (``paged_amx.h``, ``amx.h``): tasks of many query
vectors over bfloat16 pools (prefill chunks, the group pass of shared prefixes), and
decode rows of 16 or more query heads a key/value head over bfloat16 or int8 pools
(``paged_amx_decode.h``), whose scores and outputs are tile products. Their float32
outputs (before the caller rounds them to bfloat16) and log-sum-exps equal float64 on the
rounded inputs to float32's precision: the weights (and float32 queries) enter the
products as three bfloat16 pieces. Run only where the
kernel has the tiles (``native.amx()``); ``NANOATTN_AMX=0`` is the same call without
them. The behaviours every paged backend shares are in tests/core/test_paged_attention.py,
the native pass's own in test_native_paged.py."""

import jax.numpy as jnp
import numpy as np
import pytest

import nanoattn
from nanoattn._backends import native as native_kernel
from nanoattn._backends.native.paged import native_paged_attention
from nanoattn._base.rules import Rules

from _reference import np_attention, np_lse, randn

pytestmark = pytest.mark.skipif(
    native_kernel.load()[0] is None or not native_kernel.amx(),
    reason="the native kernel has no AMX tiles here",
)

N, K, H, HV = 8, 2, 64, 96  # G = 4; two 32-wide slices of keys, values of their own width
# float32's precision: 1.3e-7 measured on the chunk below (weights as two bfloat16 pieces
# instead of three: 1.5e-6; as one: about 1e-3); scores of up to 40 (the spread below)
# round to about 3e-6 in float32 on any backend
TIGHT = dict(atol=5e-7, rtol=5e-7)
WIDE = dict(atol=8e-6, rtol=8e-6)


def _rounded(x):
    return np.asarray(jnp.asarray(x, jnp.bfloat16), np.float64)


def _pool(lengths, q_lens, page_size, seed, spread=None):
    """bfloat16 pools of pages in shuffled order, NaN in every slot no sequence holds;
    ``spread`` (S,) scales key j of every sequence (scores that grow or fall along the
    keys)."""
    rng = np.random.default_rng(seed)
    held = [-(-n // page_size) for n in lengths]
    P = sum(held) + 2
    order = rng.permutation(P)
    table = np.zeros((len(lengths), max(held)), np.int32)
    readable = np.zeros((P, page_size), bool)
    used = 0
    for b, count in enumerate(held):
        table[b, :count] = order[used : used + count]
        used += count
        for j in range(count):
            readable[table[b, j], : min(page_size, lengths[b] - j * page_size)] = True
    kp = randn(seed + 1, P, page_size, K, H)
    vp = randn(seed + 2, P, page_size, K, HV)
    if spread is not None:
        for b, n in enumerate(lengths):
            for j in range(n):
                kp[table[b, j // page_size], j % page_size] *= spread[j]
    kp, vp = _rounded(kp), _rounded(vp)
    kp[~readable], vp[~readable] = np.nan, np.nan
    starts = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    q = _rounded(randn(seed + 3, int(starts[-1]), N, H))
    return q, kp, vp, table, np.asarray(lengths, np.int32), starts


def _truth(arrays, window=None, soft_cap=None):
    """Each sequence alone in float64: output (Tq, N, HV) and log-sum-exp (Tq, N)."""
    q, kp, vp, table, lengths, starts = arrays
    page_size = kp.shape[1]
    out, lse = np.zeros((q.shape[0], N, HV)), np.zeros(q.shape[:2])
    for b, n in enumerate(lengths):
        rows = slice(starts[b], starts[b + 1])
        pages = table[b, : -(-n // page_size)]
        keys = kp[pages].reshape(-1, K, H)[:n][None]
        values = vp[pages].reshape(-1, K, HV)[:n][None]
        positions = n - (starts[b + 1] - starts[b]) + np.arange(starts[b + 1] - starts[b])
        j = np.arange(n)[None]
        allowed = j <= positions[:, None]
        if window is not None:
            allowed &= j >= positions[:, None] - window
        out[rows] = np_attention(q[rows][None], keys, values, allowed, soft_cap=soft_cap)[0]
        lse[rows] = np_lse(q[rows][None], keys, allowed, soft_cap=soft_cap)[0]
    return out, lse


def _native(arrays, **rules):
    """Native's float32 (out, lse), the output before the caller rounds it."""
    q, kp, vp, *ints = (jnp.asarray(x) for x in arrays)
    q, kp, vp = (x.astype(jnp.bfloat16) for x in (q, kp, vp))
    spec = Rules.make_paged(q, kp, vp, *ints, return_residual=True, **rules)
    out, lse = native_paged_attention(q, kp, vp, spec)
    assert out.dtype == jnp.float32
    return np.asarray(out), np.asarray(lse)


# A 37-row chunk at G = 4 (a task of 128 query vectors and one of 20, padded to 32) over
# 300 keys (two steps of 128 and one of 44: keys past the sequence packed as zeros, its
# NaN slots never read), pages of 7 that cut across the steps, and a decode token.
CHUNK = dict(lengths=[300, 40], q_lens=[37, 1], page_size=7)


@pytest.mark.parametrize("window, soft_cap", [(None, None), (150, None), (None, 3.0)])
def test_a_chunk_on_tiles_equals_float64_to_float32_precision(window, soft_cap, monkeypatch):
    """Causal, with a window that starts inside a step (rows whose band cuts a step, and
    steps wholly inside it), and with a soft cap; the same call off the tiles agrees."""
    arrays = _pool(**CHUNK, seed=3)
    rules = dict(window=None if window is None else (window, 0), logit_soft_cap=soft_cap)
    out, lse = _native(arrays, **rules)
    want, want_lse = _truth(arrays, window, soft_cap)
    np.testing.assert_allclose(out, want, **TIGHT)
    np.testing.assert_allclose(lse, want_lse, **TIGHT)
    monkeypatch.setenv("NANOATTN_AMX", "0")
    assert not native_kernel.amx()
    off, off_lse = _native(arrays, **rules)
    np.testing.assert_allclose(out, off, atol=2e-5, rtol=2e-5)
    np.testing.assert_allclose(lse, off_lse, atol=2e-5, rtol=2e-5)


SPREADS = {
    "grow": np.geomspace(1, 12, 700),
    "fall": np.geomspace(12, 1, 700),
    "leap": np.where(np.arange(700) < 128, 1.0, 100.0),
}


@pytest.mark.parametrize("spread", SPREADS)
def test_scores_that_grow_or_fall_along_the_keys_keep_float32_precision(spread):
    """Keys scaled from 1 to 12 (or 12 to 1) along 700 keys: each row's maximum moves by
    far more than the lazy threshold from step to step (the sums and outputs rescaled),
    or never after the first step (every later weight tiny); and a leap after the first
    step of 128 keys past 2^128 (weights against the first step's maximum overflow
    float32 unless the maximum moves)."""
    leap, spread = spread == "leap", SPREADS[spread]
    arrays = _pool([700], [33], 16, seed=5, spread=spread)
    out, lse = _native(arrays, is_causal=False)
    q, kp, vp, table = arrays[:4]
    keys = kp[table[0]].reshape(-1, K, H)[:700][None]
    values = vp[table[0]].reshape(-1, K, HV)[:700][None]
    want = np_attention(q[None], keys, values)[0]
    want_lse = np_lse(q[None], keys)[0]
    scores = np.einsum("tgh,sh->tgs", q.reshape(33, K, N // K, H)[:, 0], keys[0, :, 0]) / 8
    jump = np.abs(scores[..., -128:].max(-1) - scores[..., :128].max(-1))
    # every row's maximum moves past the threshold (past float32's range for the leap)
    assert jump.min() > (128 if leap else 12) * np.log(2)
    # logits of a few hundred keep a few hundred times float32's rounding (2^-24)
    tolerance = dict(atol=1e-4, rtol=1e-4) if leap else WIDE
    np.testing.assert_allclose(out, want, **tolerance)
    np.testing.assert_allclose(lse, want_lse, **tolerance)


def test_nan_in_a_key_a_row_sees_makes_that_row_nan_and_no_other():
    """NaN in key 280 of the chunk's sequence: its rows at positions from 280 on are NaN
    (out and log-sum-exp), the rows before it and the other sequence's are not."""
    arrays = list(_pool(**CHUNK, seed=7))
    q, kp, vp, table, lengths, starts = arrays
    kp = kp.copy()
    kp[table[0, 280 // 7], 280 % 7, 1] = np.nan  # key/value head 1: query heads 4 .. 7
    out, lse = _native((q, kp, vp, table, lengths, starts))
    positions = 300 - 37 + np.arange(37)
    sees = positions >= 280
    assert np.isnan(out[:37][sees][:, 4:]).all() and np.isnan(lse[:37][sees][:, 4:]).all()
    assert np.isfinite(out[:37][:, :4]).all() and np.isfinite(out[:37][~sees]).all()
    assert np.isfinite(out[37:]).all()


def test_shared_prefixes_on_tiles_equal_the_unshared_call():
    """The cascade's group pass (the decode rows of 12 sequences sharing 20 pages, 240
    query vectors over 320 keys) on tiles: the shared call equals the unshared one, in
    bfloat16 as returned, and its log-sum-exps to float32's precision."""
    ps, shared, B = 16, 20, 12
    rng = np.random.default_rng(11)
    own = rng.permutation(np.arange(shared, shared + 2 * B)).reshape(B, 2).astype(np.int32)
    table = np.concatenate([np.broadcast_to(np.arange(shared, dtype=np.int32), (B, shared)),
                            own], axis=1)  # fmt: skip
    lengths = np.full(B, shared * ps + 17, np.int32)
    P = shared + 2 * B
    kp, vp = (jnp.asarray(randn(s, P, ps, K, w), jnp.bfloat16) for s, w in ((1, H), (2, HV)))
    q = jnp.asarray(randn(3, B, N, H), jnp.bfloat16)
    starts = np.arange(B + 1, dtype=np.int32)

    def call(**shared_prefixes):
        return nanoattn.paged_attention(q, kp, vp, table, lengths, starts, implementation="native",
                                        return_residual=True, **shared_prefixes)  # fmt: skip

    out, lse = call(shared_prefixes=np.full(B, shared, np.int32))
    plain, plain_lse = call()
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(plain, np.float32),
                               atol=8e-3, rtol=8e-3)  # fmt: skip
    np.testing.assert_allclose(lse, plain_lse, **WIDE)


def test_one_combined_pool_is_read_in_place_as_two_pools_are():
    """A pool of (P, page_size, 2, K, H) whose token rows hold their keys then their
    values (values as wide as keys): the tiles read it in place, bit for bit as the two
    pools holding the same numbers."""
    q, kp, _, table, lengths, starts = _pool(**CHUNK, seed=13)
    vp = _rounded(randn(14, *kp.shape))
    vp[np.isnan(kp)] = np.nan
    pool = jnp.asarray(np.stack([kp, vp], axis=2), jnp.bfloat16)
    args = (jnp.asarray(q, jnp.bfloat16), pool, None, table, lengths, starts)
    combined = nanoattn.paged_attention(*args, implementation="native", return_residual=True)
    pools = (jnp.asarray(kp, jnp.bfloat16), jnp.asarray(vp, jnp.bfloat16))
    apart = nanoattn.paged_attention(args[0], *pools, *args[3:], implementation="native",
                                     return_residual=True)  # fmt: skip
    for got, want in zip(combined, apart):
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
    assert np.isfinite(np.asarray(combined[0], np.float32)).all()


# Decode rows at G = 16 (N = 32 on K = 2): lengths of one key, of exactly one page of 16,
# of a page and a key, of many tiles of keys (the last one cut short) and more; 12
# sequences, so that a task takes both key/value heads (paged_tasks) on up to 3 threads.
DECODE = dict(N=32, K=2, H=64, HV=96, lengths=[1, 16, 17, 300, 5, 33, 64, 129, 2, 47, 90, 31])
DECODE_CASES = {
    "bfloat16, pages of 16 read in place": ("bfloat16", 16, {}),
    "bfloat16, pages of 7 copied, a window": ("bfloat16", 7, dict(window=(40, 0))),
    "int8 float32 queries, pages of 16, soft cap": ("int8", 16, dict(logit_soft_cap=3.0)),
    "int8 float32 queries, pages of 5": ("int8", 5, {}),
}


def _decode_inputs(dtype, page_size, seed):
    """Queries (B, N, H), pools in shuffled pages (int8: with their scales), the table and
    lengths, and the float64 keys and values each sequence holds (as stored, scaled)."""
    rng = np.random.default_rng(seed)
    n_heads, kv_heads, width, value_width = (DECODE[k] for k in ("N", "K", "H", "HV"))
    lengths = np.asarray(DECODE["lengths"], np.int32)
    held = -(-lengths // page_size)
    P = int(held.sum()) + 2
    order = rng.permutation(P).astype(np.int32)
    table = np.zeros((len(lengths), held.max()), np.int32)
    table[np.arange(held.max()) < held[:, None]] = order[: held.sum()]
    kp = jnp.asarray(rng.standard_normal((P, page_size, kv_heads, width)), jnp.bfloat16)
    vp = jnp.asarray(rng.standard_normal((P, page_size, kv_heads, value_width)), jnp.bfloat16)
    scales = {}
    if dtype == "int8":
        (kp, ks), (vp, vs) = (nanoattn.quantize_kv(x, "int8") for x in (kp, vp))
        scales = dict(key_scales=ks, value_scales=vs)
        q = jnp.asarray(rng.standard_normal((len(lengths), n_heads, width)), jnp.float32)
    else:
        q = jnp.asarray(rng.standard_normal((len(lengths), n_heads, width)), jnp.bfloat16)
    held_keys = []
    for pages, scale in ((kp, scales.get("key_scales")), (vp, scales.get("value_scales"))):
        x = np.asarray(pages, np.float64)
        held_keys.append(x if scale is None else x * np.asarray(scale, np.float64)[..., None])
    return q, kp, vp, table, lengths, scales, held_keys


@pytest.mark.parametrize("case", DECODE_CASES)
def test_decode_rows_on_tiles_equal_float64_to_float32_precision(case, monkeypatch):
    """Each decode row's float32 output and log-sum-exp against float64 on the inputs as
    stored, every query head alone; the same call off the tiles agrees."""
    dtype, page_size, rules = DECODE_CASES[case]
    q, kp, vp, table, lengths, scales, (keys, values) = _decode_inputs(dtype, page_size, 17)
    starts = np.arange(len(lengths) + 1, dtype=np.int32)

    def call():
        spec = Rules.make_paged(q, kp, vp, table, lengths, starts, return_residual=True,
                                **scales, **rules)  # fmt: skip
        out, lse = native_paged_attention(q, kp, vp, spec)
        return np.asarray(out), np.asarray(lse)

    out, lse = call()
    window, cap = rules.get("window", (None,))[0], rules.get("logit_soft_cap")
    for b, n in enumerate(lengths):
        pages = table[b, : -(-n // page_size)]
        k = keys[pages].reshape(-1, DECODE["K"], DECODE["H"])[None, :n]
        v = values[pages].reshape(-1, DECODE["K"], DECODE["HV"])[None, :n]
        allowed = np.arange(n)[None] >= (n - 1 - window if window is not None else 0)
        qb = np.asarray(q, np.float64)[b][None, None]
        want = np_attention(qb, k, v, allowed, soft_cap=cap)[0, 0]
        np.testing.assert_allclose(out[b], want, **TIGHT)
        np.testing.assert_allclose(lse[b], np_lse(qb, k, allowed, soft_cap=cap)[0, 0], **TIGHT)
    monkeypatch.setenv("NANOATTN_AMX", "0")
    off, off_lse = call()
    np.testing.assert_allclose(out, off, atol=2e-6, rtol=2e-6)
    np.testing.assert_allclose(lse, off_lse, atol=2e-6, rtol=2e-6)


def test_nan_in_a_decode_key_makes_only_its_rows_nan():
    """NaN in a key of sequence 3 (key/value head 1): that sequence's query heads 16 .. 31
    are NaN, its heads 0 .. 15 and the other sequences finite."""
    q, kp, vp, table, lengths, _, _ = _decode_inputs("bfloat16", 16, 19)
    kp = kp.at[table[3, 5], 3, 1, 7].set(jnp.nan)  # key 83 of sequence 3
    starts = np.arange(len(lengths) + 1, dtype=np.int32)
    spec = Rules.make_paged(q, kp, vp, table, lengths, starts, return_residual=True)
    out, lse = (np.asarray(x) for x in native_paged_attention(q, kp, vp, spec))
    assert np.isnan(out[3, 16:]).all() and np.isnan(lse[3, 16:]).all()
    assert np.isfinite(out[3, :16]).all() and np.isfinite(np.delete(out, 3, axis=0)).all()


def test_a_token_tree_over_int8_pages_on_the_decode_tiles():
    """Tree chunks over an int8 pool at G = 16 (several rows a task: the decode tiles,
    which the many-vector tiles leave to int8): each draft sees the committed keys, its
    ancestors and itself, against float64."""
    rng = np.random.default_rng(23)
    n_heads, kv_heads, width, ps = 32, 2, 64, 16
    committed, parents = [40, 100], [[-1, 0, 0, 1, 2], [-1, 0, 1]]
    lengths = np.asarray([c + len(t) for c, t in zip(committed, parents)], np.int32)
    held = -(-lengths // ps)
    table = np.zeros((2, held.max()), np.int32)
    table[np.arange(held.max()) < held[:, None]] = rng.permutation(int(held.sum()))
    pools = [jnp.asarray(rng.standard_normal((int(held.sum()), ps, kv_heads, width)), jnp.bfloat16)
             for _ in range(2)]  # fmt: skip
    (kp, ks), (vp, vs) = (nanoattn.quantize_kv(x, "int8") for x in pools)
    starts = np.asarray([0, 5, 8], np.int32)
    q = jnp.asarray(rng.standard_normal((8, n_heads, width)), jnp.float32)
    tree = np.concatenate([np.asarray(t, np.int32) for t in parents])
    spec = Rules.make_paged(q, kp, vp, table, lengths, starts, key_scales=ks, value_scales=vs,
                            tree_parents=tree, return_residual=True)  # fmt: skip
    out, lse = (np.asarray(x) for x in native_paged_attention(q, kp, vp, spec))
    for b, (c, tokens) in enumerate(zip(committed, parents)):
        pages = table[b, : held[b]]
        k, v = (
            (np.asarray(x, np.float64) * np.asarray(s, np.float64)[..., None])[pages].reshape(
                -1, kv_heads, width
            )[None, : lengths[b]]
            for x, s in ((kp, ks), (vp, vs))
        )
        for i in range(len(tokens)):
            seen, a = {i}, tokens[i]
            while a >= 0:
                seen.add(a)
                a = tokens[a]
            allowed = np.asarray([j < c or j - c in seen for j in range(lengths[b])])[None]
            qi = np.asarray(q, np.float64)[starts[b] + i][None, None]
            np.testing.assert_allclose(
                out[starts[b] + i], np_attention(qi, k, v, allowed)[0, 0], **TIGHT
            )
            np.testing.assert_allclose(lse[starts[b] + i], np_lse(qi, k, allowed)[0, 0], **TIGHT)
