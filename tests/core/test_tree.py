"""The tree rule (speculative decoding with token trees): ``tree_parents`` on dense and
paged calls, every backend that serves it, against the float64 attention of each
token's root-to-leaf path decoded alone (its committed keys, then its ancestors' and its
own, at positions committed + depth); windows measured on those positions; bad trees
one line when concrete, NaN rows under jit; gradients."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import nanoattn

from _backends import paged_serving, serving
from _reference import randn

N, K, H = 6, 2, 5  # G = 3


def random_tree(rng, size: int, branching: int) -> list[int]:
    """Parents of a random tree of ``size`` tokens: each token's parent an earlier token
    (or -1) with at most ``branching`` children."""
    children, parents = {}, []
    for i in range(size):
        choices = [p for p in range(-1, i) if children.get(p, 0) < branching]
        p = int(rng.choice(choices))
        children[p] = children.get(p, 0) + 1
        parents.append(p)
    return parents


def path_attention(q, keys, values, committed: int, parents, i: int, window=None):
    """Token i's output (N, H) decoded alone: the committed keys, then its ancestors'
    and its own (keys (committed + T, K, H) in slot order), at positions by depth."""
    path, x = [], i
    while x >= 0:
        path.append(x)
        x = parents[x]
    rows = np.concatenate([np.arange(committed), committed + np.array(path[::-1], int)])
    k, v = keys[rows], values[rows]
    position = committed + len(path) - 1
    allowed = np.arange(len(rows)) <= position
    if window is not None:
        allowed &= np.arange(len(rows)) >= position - window
    G = q.shape[0] // k.shape[1]
    out = np.zeros((q.shape[0], v.shape[-1]))
    for n in range(q.shape[0]):
        s = np.where(allowed, k[:, n // G] @ q[n] / np.sqrt(q.shape[-1]), -np.inf)
        w = np.exp(s - s.max())
        out[n] = (w / w.sum()) @ v[:, n // G]
    return out


def test_the_ancestry_of_trees_up_to_a_deep_chain_equals_a_walk_up_the_parents():
    """dense_tree's ancestors and depths against a plain walk from each token to its
    root: random bushy trees, chains of 1 to 70 tokens, and a broken tree (all its
    tokens zero)."""
    from nanoattn._base.tree import dense_tree

    rng = np.random.default_rng(7)
    trees = [random_tree(rng, T, b) for T, b in [(1, 1), (13, 3), (64, 8)]]
    trees += [list(range(-1, T - 1)) for T in (2, 70)]
    for parents in trees:
        tree = dense_tree(jnp.asarray([parents], jnp.int32))
        T = len(parents)
        want = np.zeros((T, T), bool)
        for i in range(T):
            x = i
            while x >= 0:
                want[i, x] = True
                x = parents[x]
        np.testing.assert_array_equal(np.asarray(tree.ancestors[0]), want, err_msg=f"T={T}")
        np.testing.assert_array_equal(np.asarray(tree.depth[0]), want.sum(1) - 1)
        assert not np.asarray(tree.broken).any()
    broken = dense_tree(jnp.asarray([[-1, 0, 2]], jnp.int32))  # a token its own parent
    assert np.asarray(broken.broken).all() and not np.asarray(broken.ancestors).any()


DENSE = [[-1, 0, 0, 1, 1, 2, -1], [-1, 0, 1, 2, 3, 4, 5]]  # a bushy tree, a chain
COMMITTED = np.array([11, 4])


@functools.cache
def _dense_arrays():
    T, S = len(DENSE[0]), 11 + len(DENSE[0])
    return randn(1, 2, T, N, H), randn(2, 2, S, K, H), randn(3, 2, S, K, H)


@pytest.mark.parametrize("window", [None, 3], ids=["causal", "window"])
def test_a_dense_tree_equals_each_path_decoded_alone_on_every_backend(window):
    q, k, v = _dense_arrays()
    parents = np.array(DENSE)
    rules = dict(is_causal=True, q_offset=COMMITTED, tree_parents=parents,
                 window=None if window is None else (window, 0))  # fmt: skip
    names = serving(q, k, v, **rules)
    assert {"xla", "flash"} <= set(names)
    for name in names:
        out = np.asarray(nanoattn.dot_product_attention(q, k, v, **rules, implementation=name))
        for b in range(2):
            for i in range(parents.shape[1]):
                want = path_attention(q[b, i], k[b], v[b], COMMITTED[b], DENSE[b], i, window)
                np.testing.assert_allclose(out[b, i], want, atol=2e-5, err_msg=f"{name} {b} {i}")


def test_the_gradients_of_a_dense_tree_equal_the_reference():
    q, k, v = _dense_arrays()
    rules = dict(is_causal=True, q_offset=COMMITTED, tree_parents=np.array(DENSE))

    def loss(name, q, k, v):
        out = nanoattn.dot_product_attention(q, k, v, **rules, implementation=name)
        return jnp.sum(out * jnp.cos(out))

    want = jax.grad(functools.partial(loss, "xla"), argnums=(0, 1, 2))(q, k, v)
    for name in serving(q, k, v, **rules):
        if name == "xla":
            continue
        got = jax.grad(functools.partial(loss, name), argnums=(0, 1, 2))(q, k, v)
        for g, w in zip(got, want):
            np.testing.assert_allclose(g, w, atol=1e-4, rtol=1e-4, err_msg=name)


def _paged_case(seed: int, page_size: int):
    """Three sequences: a random tree over 13 committed keys, plain decode (one root),
    and a random tree over 2 committed keys; one padding row."""
    rng = np.random.default_rng(seed)
    trees = [random_tree(rng, 9, 3), [-1], random_tree(rng, 6, 2)]
    committed = [13, 5, 2]
    q_lens = [len(t) for t in trees]
    lengths = np.array([c + n for c, n in zip(committed, q_lens)], np.int32)
    M = int(max(-(-lengths // page_size)))
    P = int(sum(-(-lengths // page_size))) + 2
    order = rng.permutation(P)
    table, used = np.zeros((3, M), np.int32), 0
    for b, n in enumerate(lengths):
        m = -(-int(n) // page_size)
        table[b, :m] = order[used : used + m]
        used += m
    starts = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    parents = np.array([p for tree in trees for p in tree] + [-1], np.int32)
    q = randn(seed + 1, int(starts[-1]) + 1, N, H)
    kp, vp = randn(seed + 2, P, page_size, K, H), randn(seed + 3, P, page_size, K, H)
    return trees, committed, (q, kp, vp, table, lengths, starts), parents


@pytest.mark.parametrize("page_size", [1, 4])
def test_a_paged_tree_per_sequence_equals_each_path_decoded_alone(page_size):
    trees, committed, arrays, parents = _paged_case(7 + page_size, page_size)
    q, kp, vp, table, lengths, starts = arrays
    names = paged_serving(*arrays, tree_parents=parents)
    assert {"xla", "flash"} <= set(names)
    for name in names:
        for window in (None, 4):
            rule = None if window is None else (window, 0)
            out = np.asarray(nanoattn.paged_attention(
                *arrays, tree_parents=parents, window=rule, implementation=name))  # fmt: skip
            for b, tree in enumerate(trees):
                pages = table[b, : -(-int(lengths[b]) // page_size)]
                keys = kp[pages].reshape(-1, K, H)[: lengths[b]]
                values = vp[pages].reshape(-1, K, H)[: lengths[b]]
                for i in range(len(tree)):
                    row = starts[b] + i
                    want = path_attention(q[row], keys, values, committed[b], tree, i, window)
                    np.testing.assert_allclose(out[row], want, atol=2e-5,
                                               err_msg=f"{name} {window} {b} {i}")  # fmt: skip
            assert (out[starts[-1] :] == 0).all()


@pytest.mark.parametrize(
    "bad, message",
    [
        ([[-1, 0, 2, 1, 3]], r"tree_parents\[0, 2\]=2: a token's parent is -1"),
        ([[-1, 0, 1, 5, 3]], r"tree_parents\[0, 3\]=5"),
        ([[-2, 0, 1, 2, 3]], r"tree_parents\[0, 0\]=-2"),
    ],
    ids=["itself", "a later token", "below -1"],
)
def test_a_bad_dense_tree_raises_when_concrete_and_poisons_its_row_under_jit(bad, message):
    q, k = randn(4, 2, 5, N, H), randn(5, 2, 9, K, H)
    parents = np.array([*bad, [-1, 0, 1, 1, 0]])
    with pytest.raises(ValueError, match=message):
        nanoattn.dot_product_attention(q, k, k, is_causal=True, q_offset=4,
                                       tree_parents=parents)  # fmt: skip
    for name in serving(
        q, k, k, is_causal=True, q_offset=4, tree_parents=np.array(DENSE[:1] * 2)[:, :5]
    ):
        call = jax.jit(functools.partial(nanoattn.dot_product_attention, is_causal=True,
                                         q_offset=4, implementation=name))  # fmt: skip
        out = np.asarray(call(q, k, k, tree_parents=parents))
        assert np.isnan(out[0]).all() and np.isfinite(out[1]).all(), name


def test_a_bad_paged_tree_poisons_exactly_its_sequence_under_jit():
    _, _, arrays, parents = _paged_case(3, 4)
    starts = arrays[-1]
    bad = parents.copy()
    bad[starts[1]] = 0  # sequence 1's only token names itself
    with pytest.raises(ValueError, match=r"tree_parents\[9\]=0: row 9 is token 0 of its"):
        nanoattn.paged_attention(*arrays, tree_parents=bad)
    for name in paged_serving(*arrays, tree_parents=parents):
        call = jax.jit(functools.partial(nanoattn.paged_attention, implementation=name))
        out, good = (np.asarray(call(*arrays, tree_parents=p)) for p in (bad, parents))
        assert np.isnan(out[starts[1] : starts[2]]).all(), name
        keep = np.ones(out.shape[0], bool)
        keep[starts[1] : starts[2]] = False
        np.testing.assert_array_equal(out[keep], good[keep])
