"""Decoding steps that bring a token tree (``tree_parents``, speculative decoding): on a
full cache, a rolling one past its wrap, and a paged pool (pages of 1 and 16 tokens, a
tree mixed with plain decode tokens and prefill chunks in one step; the latent layer in
tests/layers/test_accept.py), every draft's output equals its root-to-leaf path decoded
alone by the float64 reference (tests/_np_layer.py). Random trees of depths 1 to 16 and
branching 1 to 8; bad trees one line when concrete, a NaN row that writes nothing under
jit (docs/decoding.md, "Speculative trees"). The layers are tests/_trees.py's."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from nanoattn import PageAllocator
from nanoattn import nnx as nanoattn_nnx
from nanoattn.linen import CausalSelfAttention

from _np_layer import np_layer
from _reference import randn
from _trees import (
    CONFIG,
    PAGES_OF,
    D,
    padded,
    paged_case,
    paged_step,
    path_outputs,
    random_tree,
    slot_case,
)

L = 17  # a tree step's chunk: trees of up to 17 tokens
TREES = [(16, 16, 1), (17, 2, 8), (17, 5, 3), (9, 4, 2)]  # (size, depth, branching)


def _trees(seed, shapes):
    rng = np.random.default_rng(seed)
    return [random_tree(rng, *shape) for shape in shapes]


def test_random_trees_on_a_full_cache_equal_each_path_decoded_alone():
    _, params, empty, step = slot_case()
    prompts = [randn(1, 7, D), randn(2, 3, D)]
    x = np.zeros((2, 7, D), np.float32)
    x[0], x[1, :3] = prompts
    _, prompted = step(empty, x, jnp.array([7, 3]), None)
    for k in range(0, len(TREES), 2):
        trees = _trees(k, TREES[k : k + 2])
        tokens = [randn(10 + k + b, len(t), D) for b, t in enumerate(trees)]
        x = np.zeros((2, L, D), np.float32)
        for b, t in enumerate(tokens):
            x[b, : len(t)] = t
        lengths = jnp.array([len(t) for t in trees])
        y, cache = step(prompted, x, lengths, padded(trees, L))
        np.testing.assert_array_equal(cache["position"], np.array([7, 3]) + lengths)
        for b in range(2):
            want = path_outputs(lambda z: np_layer(params, z, CONFIG), prompts[b], tokens[b],
                                trees[b])  # fmt: skip
            np.testing.assert_allclose(y[b, : len(trees[b])], want, atol=3e-5, err_msg=f"{k} {b}")
            assert (y[b, len(trees[b]) :] == 0).all()


def test_a_tree_on_a_wrapped_rolling_cache_equals_each_path_decoded_alone():
    W, C = 3, 13  # chunks of up to C - W = 10 tokens
    cfg = dataclasses.replace(CONFIG, window=(W, 0), rolling_cache=True)
    module = nanoattn_nnx.CausalSelfAttention(cfg, rngs=nnx.Rngs(0))
    module.init_cache(2, C)
    step = nnx.jit(lambda m, x, parents: m(x, decode=True, tree_parents=parents))
    prompt = randn(3, 2, 16, D)  # fed in chunks of 8: the ring wraps
    for lo in (0, 8):
        step(module, prompt[:, lo : lo + 8], np.arange(-1, 7)[None].repeat(2, 0))  # chains
    trees = _trees(4, [(10, 4, 3), (10, 10, 1)])
    tokens = randn(5, 2, 10, D)
    y = step(module, tokens, np.array(trees))
    params = {"params": nnx.to_pure_dict(nnx.state(module, nnx.Param))}
    for b in range(2):
        want = path_outputs(lambda z: np_layer(params, z, cfg), prompt[b], tokens[b], trees[b])
        np.testing.assert_allclose(y[b], want, atol=3e-5, err_msg=str(b))


TQ = 32  # a paged step's tokens


@pytest.mark.parametrize("page_size", [1, 16])
def test_a_paged_step_of_trees_decode_tokens_and_prefill_chunks(page_size):
    params, pool, step = paged_case(page_size)
    alloc = PageAllocator(PAGES_OF[page_size], page_size, max_sequences=4,
                          max_pages=32 // page_size, seed=page_size)  # fmt: skip
    prompts = {"tree": randn(7, 6, D), "decode": randn(8, 4, D)}
    for seq, x in prompts.items():
        alloc.allocate(seq, len(x))
    _, pool = paged_step(step, pool, alloc, [(s, x, np.arange(-1, len(x) - 1))
                                             for s, x in prompts.items()], TQ)  # fmt: skip
    tree, bare = _trees(page_size, [(11, 6, 3), (4, 2, 3)])
    rows = [("tree", randn(9, 11, D), tree), ("decode", randn(10, 1, D), [-1]),
            ("prefill", randn(11, 5, D), list(range(-1, 4))),
            ("bare", randn(12, 4, D), bare)]  # fmt: skip
    for seq, x, _ in rows:
        alloc.extend(seq, len(x)) if seq in prompts else alloc.allocate(seq, len(x))
    outs, _ = paged_step(step, pool, alloc, rows, TQ)
    for (seq, x, parents), got in zip(rows, outs):
        prefix = prompts.get(seq, np.zeros((0, D), np.float32))
        want = path_outputs(lambda z: np_layer(params, z, CONFIG), prefix, x, parents)
        np.testing.assert_allclose(got, want, atol=3e-5, err_msg=seq)


def test_a_bad_tree_raises_one_line_when_concrete():
    layer, params, empty, _ = slot_case()
    x = jnp.asarray(randn(15, 2, 5, D))

    def call(parents, **options):
        return layer.apply({**params, "cache": empty}, x, True, decode=True,
                           tree_parents=parents, mutable=["cache"], **options)  # fmt: skip

    good = np.array([[-1, 0, 0, 1, 2]] * 2)
    bad = good.copy()
    bad[1, 3] = 3
    with pytest.raises(ValueError, match=r"^tree_parents\[1, 3\]=3: a token's parent is -1 \(the "
                       r"last committed token\) or an earlier token of its own chunk, in "
                       r"\[-1, 3\) for token 3"):  # fmt: skip
        call(bad)
    call(bad, lengths=np.array([5, 3]))  # the bad parent is a padded token's: not read
    with pytest.raises(ValueError, match=r"tree_parents must have shape \(B, T\) = \(2, 5\)"):
        call(good[:, :4])
    with pytest.raises(ValueError, match="tree_parents only applies with decode=True"):
        layer.apply(params, x, True, tree_parents=good)


def test_a_bad_tree_under_jit_poisons_its_row_alone():
    _, _, empty, step = slot_case()
    x = randn(16, 2, L, D)
    good = np.tile(np.arange(-1, L - 1), (2, 1))
    bad = good.copy()
    bad[0, 4] = 6  # a parent after its child
    y, cache = step(empty, x, jnp.array([L, L]), bad)
    want, _ = step(empty, x, jnp.array([L, L]), good)
    assert np.isnan(y[0]).all()
    np.testing.assert_allclose(y[1], want[1], atol=1e-6)
    np.testing.assert_array_equal(cache["position"], [-1, L])  # poisoned, and written nothing
    np.testing.assert_array_equal(cache["key"][0], empty["key"][0])


def test_a_bad_paged_tree_names_its_row_or_spoils_its_sequence_alone():
    params, pool, step = paged_case(16)
    alloc = PageAllocator(PAGES_OF[16], 16, max_sequences=4, max_pages=2)
    for seq in ("a", "b"):
        alloc.allocate(seq, 3)
    rows = [("a", randn(17, 3, D), [-1, 0, 0]), ("b", randn(18, 3, D), [-1, 0, 2])]
    with pytest.raises(ValueError, match=r"^tree_parents\[0, 5\]=2: .* in \[-1, 2\) for token 2 "
                       r"of its sequence \(row 5\)"):  # fmt: skip
        layer = CausalSelfAttention(dataclasses.replace(CONFIG, page_size=16))
        batch = alloc.batch([("a", 3), ("b", 3)], 8)
        x = np.concatenate([rows[0][1], rows[1][1], np.zeros((2, D), np.float32)])[None]
        parents = np.array([[-1, 0, 0, -1, 0, 2, -1, -1]])
        layer.apply({**params, "cache": pool}, x, True, decode=True, pages=batch,
                    tree_parents=parents, mutable=["cache"])  # fmt: skip
    pool = jax.tree.map(jnp.zeros_like, pool)
    outs, written = paged_step(step, pool, alloc, rows, 8)  # under jit
    assert np.isfinite(outs[0]).all() and np.isnan(outs[1]).all()
    page_b = alloc.pages_of("b")[0]
    assert (np.asarray(written["key"][page_b]) == 0).all()  # never written
