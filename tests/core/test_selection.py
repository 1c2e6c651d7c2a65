"""The selection rule (sparse attention over chosen keys): ``key_indices`` on dense calls,
every backend that serves it, against float64 attention with the selection applied as a
mask (an index selected twice counted once, -1 entries unused); the keys not selected
never read (NaN there changes nothing); gradients; bad indices one line when concrete,
NaN rows under jit; the rules a selection cannot go with refused in one line."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import nanoattn

from _backends import paged_serving, serving
from _reference import np_attention, np_attention_vjp, np_causal, np_lengths, np_window, randn

B, T, S, N, K, H, KSEL = 2, 7, 23, 6, 2, 5, 5  # G = 3
Q_OFFSET = 13  # queries at positions 13..19 of 23 keys


def selection(seed: int) -> np.ndarray:
    """(B, T, k) random positions with -1 padding, a repeated index, keys past the causal
    limit, a row without its diagonal and a row that selects nothing."""
    rng = np.random.default_rng(seed)
    indices = rng.integers(-1, S, size=(B, T, KSEL)).astype(np.int32)
    indices[0, 1, :2] = 4  # twice: counts once
    indices[0, 2, :] = -1  # nothing
    indices[1, 3] = [Q_OFFSET + 3, Q_OFFSET + 5, 0, 1, 2]  # past itself too
    indices[1, 4] = [Q_OFFSET, Q_OFFSET + 1, Q_OFFSET + 2, Q_OFFSET + 3, -1]  # no diagonal
    return indices


def selected_np(indices) -> np.ndarray:
    """(B, 1, T, S): the selection as a mask, written without the library."""
    out = np.zeros((B, 1, T, S), bool)
    for b, t, e in np.ndindex(*indices.shape):
        if indices[b, t, e] >= 0:
            out[b, 0, t, indices[b, t, e]] = True
    return out


CASES = {
    "alone": ({}, lambda: True),
    "causal": (dict(is_causal=True, q_offset=Q_OFFSET), lambda: np_causal(T, S, Q_OFFSET)),
    "window and lengths": (
        dict(window=(4, 0), q_offset=Q_OFFSET, kv_lengths=np.array([17, 23])),
        lambda: np_window(T, S, Q_OFFSET, 4, 0) & np_lengths(np.array([17, 23]), S),
    ),
}


@functools.cache
def _arrays(Hv: int = H):
    return randn(1, B, T, N, H), randn(2, B, S, K, H), randn(3, B, S, K, Hv)


@pytest.mark.parametrize("case", list(CASES))
def test_a_selection_equals_the_float64_mask_on_every_backend(case):
    rules, allowed = CASES[case]
    q, k, v = _arrays()
    indices = selection(5)
    mask = selected_np(indices) & allowed()
    want = np_attention(q, k, v, allowed=mask)
    names = serving(q, k, v, key_indices=indices, **rules)
    assert {"xla", "flash", "native"} <= set(names)
    for name in names:
        out = nanoattn.dot_product_attention(q, k, v, key_indices=indices, **rules,
                                             implementation=name)  # fmt: skip
        np.testing.assert_allclose(np.asarray(out), want, atol=2e-5, rtol=2e-5, err_msg=name)


def test_keys_not_selected_are_never_read_and_values_may_be_wider():
    """NaN in every key and value no query selects, values of their own width (MLA):
    every backend finite and equal to the float64 mask; soft-cap and sinks too."""
    q, k, v = _arrays(Hv=7)
    indices = selection(6)
    mask = selected_np(indices)
    unread = ~mask[:, 0].any(axis=1)  # (B, S)
    k, v = k.copy(), v.copy()
    k[unread], v[unread] = np.nan, np.inf
    sinks = np.linspace(-1, 1, N).astype(np.float32)
    rules = dict(is_causal=True, q_offset=Q_OFFSET, logit_soft_cap=3.0, sinks=sinks)
    want = np_attention(q, np.nan_to_num(k), np.nan_to_num(v), soft_cap=3.0, sinks=sinks,
                        allowed=mask & np_causal(T, S, Q_OFFSET))  # fmt: skip
    for name in serving(q, k, v, key_indices=indices, **rules):
        out = np.asarray(nanoattn.dot_product_attention(q, k, v, key_indices=indices, **rules,
                                                        implementation=name))  # fmt: skip
        np.testing.assert_allclose(out, want, atol=2e-5, rtol=2e-5, err_msg=name)


def test_the_gradients_of_a_selection_equal_float64():
    q, k, v = _arrays()
    indices = selection(7)
    rules = dict(is_causal=True, q_offset=Q_OFFSET)
    mask = selected_np(indices) & np_causal(T, S, Q_OFFSET)
    d_out = randn(9, B, T, N, H)
    _, want = np_attention_vjp(q, k, v, d_out, allowed=mask)
    for name in serving(q, k, v, key_indices=indices, **rules):

        def loss(q, k, v, name=name):
            out = nanoattn.dot_product_attention(q, k, v, key_indices=indices, **rules,
                                                 implementation=name)  # fmt: skip
            return jnp.sum(out * d_out)

        got = jax.grad(loss, argnums=(0, 1, 2))(q, k, v)
        for g, w in zip(got, want[:3]):
            np.testing.assert_allclose(np.asarray(g), w, atol=5e-5, rtol=5e-5, err_msg=name)


def test_a_bad_index_raises_when_concrete_and_poisons_its_row_under_jit():
    q, k, v = _arrays()
    bad = selection(8)
    bad[1, 2, 3] = S
    with pytest.raises(ValueError, match=r"key_indices\[1, 2, 3\]=23: a selected key is a "):
        nanoattn.dot_product_attention(q, k, v, key_indices=bad)
    for name in serving(q, k, v, key_indices=selection(8)):
        call = jax.jit(functools.partial(nanoattn.dot_product_attention, implementation=name))
        out = np.asarray(call(q, k, v, key_indices=bad))
        assert np.isnan(out[1]).all() and np.isfinite(out[0]).all(), name


@pytest.mark.parametrize("other", ["mask_fn", "q_segment_ids", "tree_parents"])
def test_rules_that_are_not_a_band_are_refused_with_a_selection(other):
    q, k, v = _arrays()
    given = {
        "mask_fn": lambda b, n, i, j: i >= j,
        "q_segment_ids": np.zeros((B, T), np.int32),
        "tree_parents": np.full((B, T), -1, np.int32),
    }[other]
    kw = {other: given} | (dict(kv_segment_ids=np.zeros((B, S), np.int32))
                           if other == "q_segment_ids" else {})  # fmt: skip
    with pytest.raises(ValueError, match=f"key_indices cannot be combined with {other}"):
        nanoattn.dot_product_attention(q, k, v, key_indices=selection(1), **kw)


PAGE, POOL, M = 3, 17, 7  # pages of 3 keys, a pool of 17, at most 7 pages a sequence
LENGTHS, Q_LENS = np.array([19, 11]), np.array([4, 1])  # a chunk, a decode row


def _paged_case(seed: int):
    """Two sequences in a shuffled pool: the query tokens (Tq, N, H), pools, page table,
    their lengths and starts, each token's selection (Tq, k) and what it may see as a
    (Tq, M * PAGE) mask over its own sequence's keys, and each sequence's dense keys
    and values (B, M * PAGE, K, H)."""
    rng = np.random.default_rng(seed)
    Tq, S_max = int(Q_LENS.sum()), M * PAGE
    keys, values = randn(seed + 1, 2, S_max, K, H), randn(seed + 2, 2, S_max, K, H)
    table = rng.permutation(POOL)[: 2 * M].reshape(2, M).astype(np.int32)
    key_pages, value_pages = randn(seed + 3, POOL, PAGE, K, H), randn(seed + 4, POOL, PAGE, K, H)
    for b, e in np.ndindex(2, M):
        key_pages[table[b, e]] = keys[b, e * PAGE : (e + 1) * PAGE]
        value_pages[table[b, e]] = values[b, e * PAGE : (e + 1) * PAGE]
    indices = rng.integers(-1, S_max, size=(Tq, KSEL)).astype(np.int32)
    indices[0, :2] = 2  # twice
    sequence = np.repeat([0, 1], Q_LENS)
    position = np.concatenate([np.arange(n) + L - n for n, L in zip(Q_LENS, LENGTHS)])
    allowed = np.zeros((Tq, S_max), bool)
    for t, e in np.ndindex(Tq, KSEL):
        j = indices[t, e]
        allowed[t, j] = j >= 0 and j <= position[t]  # causal: j < length follows
    starts = np.concatenate([[0], np.cumsum(Q_LENS)]).astype(np.int32)
    query = randn(seed + 5, Tq, N, H)
    arrays = (query, key_pages, value_pages, table, LENGTHS.astype(np.int32), starts)
    return arrays, indices, allowed, sequence, keys, values


def _paged_truth(query, allowed, sequence, keys, values):
    """float64 attention of each query token (Tq, N, H) over its own sequence's keys
    and values, ``allowed`` (Tq, S) its mask: (Tq, N, H)."""
    return np.stack([
        np_attention(query[t][None, None], keys[b][None], values[b][None],
                     allowed=allowed[t][None, None, None])[0, 0]
        for t, b in enumerate(sequence)
    ])  # fmt: skip


def test_a_paged_selection_reads_its_own_sequence_on_every_backend():
    """Each query token of a paged call (a chunk and a decode row, pages shuffled in the
    pool) equals float64 attention over its own sequence's keys with its selection as a
    mask; a key of a page no token selects is NaN and never read."""
    arrays, indices, allowed, sequence, keys, values = _paged_case(11)
    want = _paged_truth(arrays[0], allowed, sequence, keys, values)
    key_pages = arrays[1].copy()
    read = {int(arrays[3][b, j // PAGE]) for t, b in enumerate(sequence) for j in indices[t]
            if j >= 0}  # fmt: skip
    key_pages[[p for p in range(POOL) if p not in read]] = np.nan
    arrays = (arrays[0], key_pages, *arrays[2:])
    names = paged_serving(*arrays, key_indices=indices)
    assert {"xla", "flash", "native"} <= set(names)
    for name in names:
        out = nanoattn.paged_attention(*arrays, key_indices=indices, implementation=name)
        np.testing.assert_allclose(np.asarray(out), want, atol=2e-5, rtol=2e-5, err_msg=name)


def test_a_bad_paged_index_raises_when_concrete_and_poisons_its_token_under_jit():
    arrays, indices, *_ = _paged_case(12)
    bad = indices.copy()
    bad[4, 1] = M * PAGE
    with pytest.raises(ValueError, match=r"key_indices\[4, 1\]=21: a selected key is a "):
        nanoattn.paged_attention(*arrays, key_indices=bad)
    for name in paged_serving(*arrays, key_indices=indices):
        call = jax.jit(functools.partial(nanoattn.paged_attention, implementation=name))
        out = np.asarray(call(*arrays, key_indices=bad))
        assert np.isnan(out[4]).all() and np.isfinite(out[:4]).all(), name


@pytest.mark.parametrize("gather", [True, False], ids=["gathered", "one-key pages"])
def test_both_reads_of_a_selection_equal_float64_quantized_and_paged(gather, monkeypatch):
    """A kernel reads a selection gathered into one page per query row (many query
    heads per key, a small selection) or through pages of one key (forced here both
    ways): both equal the float64 mask on flash and native, dense (a window and key
    lengths), with int8 keys and values (their scales gathered with them) and paged."""
    import nanoattn._base.selection as selection_module

    jax.clear_caches()  # the kernels' compiled calls: the read is chosen as they trace
    monkeypatch.setattr(selection_module, "gathers", lambda *args: gather)
    rules, allowed = CASES["window and lengths"]
    q, k, v = _arrays()
    indices = selection(5)
    mask = selected_np(indices) & allowed()
    (kq, ks), (vq, vs) = (nanoattn.quantize_kv(jnp.asarray(x), "int8") for x in (k, v))
    wide = [np.asarray(x, np.float64) * np.asarray(s, np.float64)[..., None]
            for x, s in ((kq, ks), (vq, vs))]  # fmt: skip
    arrays, paged_indices, paged_allowed, sequence, keys, values = _paged_case(13)
    paged_want = _paged_truth(arrays[0], paged_allowed, sequence, keys, values)
    for name in ("flash", "native"):
        out = nanoattn.dot_product_attention(q, k, v, key_indices=indices, **rules,
                                             implementation=name)  # fmt: skip
        np.testing.assert_allclose(np.asarray(out), np_attention(q, k, v, allowed=mask),
                                   atol=2e-5, rtol=2e-5, err_msg=name)  # fmt: skip
        out = nanoattn.dot_product_attention(q, kq, vq, key_scales=ks, value_scales=vs,
                                             key_indices=indices, **rules,
                                             implementation=name)  # fmt: skip
        np.testing.assert_allclose(np.asarray(out), np_attention(q, *wide, allowed=mask),
                                   atol=2e-5, rtol=2e-5, err_msg=f"{name} int8")  # fmt: skip
        out = nanoattn.paged_attention(*arrays, key_indices=paged_indices, implementation=name)
        np.testing.assert_allclose(np.asarray(out), paged_want, atol=2e-5, rtol=2e-5,
                                   err_msg=f"{name} paged")  # fmt: skip


def test_the_gather_is_taken_for_many_query_heads_a_key_and_a_small_selection():
    """DeepSeek-V3.2's MQA decode (G = 128, Hv = 576 on K = 1) gathers its 2048 keys; a
    GQA decode (G = 4 on K = 8, H = 128) reads them in place, and so does a selection
    past GATHER_BYTES."""
    from nanoattn._base.selection import GATHER_BYTES, gathers

    def shapes(N, K, H, Hv):
        return (jax.ShapeDtypeStruct((1, N, H), jnp.float32),
                jax.ShapeDtypeStruct((9, 1, K, H), jnp.float32),
                jax.ShapeDtypeStruct((9, 1, K, Hv), jnp.float32))  # fmt: skip

    assert gathers(*shapes(128, 1, 576, 576), 1, 2048)
    assert not gathers(*shapes(32, 8, 128, 128), 1, 2048)
    rows = GATHER_BYTES // (2048 * 1152 * 4) + 1
    assert not gathers(*shapes(128, 1, 576, 576), rows, 2048)
