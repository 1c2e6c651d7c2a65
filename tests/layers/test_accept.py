"""Keeping the accepted path of a token tree: ``nanoattn.linen.accept`` and NNX's
``module.accept`` on full, rolling, quantized and latent caches, and
``PageAllocator.accept`` with the slot moves the next step carries (pages of 1 and 16
tokens, forks, copy-on-write, a prefix cache, int8 pages). Every path of a random tree
kept in turn, then decoding on, equals the float64 reference of the kept path decoded
alone (tests/_np_layer.py); the moved keys, values and scales equal the tree's; bad
paths and bad moves one line when concrete, a poisoned row or a spoilt sequence under
jit (docs/decoding.md, "Speculative trees"). Sizes D 24, N 6, K 2, H 4."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _caches import halves
from _np_latent import np_latent
from flax import nnx

from nanoattn import PageAllocator
from nanoattn import nnx as nanoattn_nnx
from nanoattn.linen import LatentAttention, LatentConfig, accept

from _layer_configs import random_params
from _np_layer import np_layer
from _reference import randn
from _trees import CONFIG, D, paged_case, paged_step, path, path_outputs, random_tree, slot_case

TREE = random_tree(np.random.default_rng(11), 9, 5, 3)  # 9 tokens, 5 levels


def _kept(rows, width):
    """(B, width) int32: each row's kept indices, then -1s."""
    out = np.full((len(rows), width), -1, np.int32)
    for b, row in enumerate(rows):
        out[b, : len(row)] = row
    return out


def _prompted(step, empty, prompts):
    x = np.zeros((2, 7, D), np.float32)
    for b, p in enumerate(prompts):
        x[b, : len(p)] = p
    return step(empty, x, jnp.array([len(p) for p in prompts]), None)[1]


def test_accepting_every_path_of_a_tree_equals_decoding_it_alone():
    _, params, empty, step = slot_case()
    prompts, trees = [randn(20, 7, D), randn(21, 3, D)], [TREE, list(range(-1, 8))]
    tokens = randn(22, 2, 9, D)
    prompted = _prompted(step, empty, prompts)
    after_tree = step(prompted, tokens, jnp.array([9, 9]), np.array(trees))[1]
    chunk = jax.jit(lambda cache, x: step(cache, x, jnp.array([2, 2]), None))
    for i in range(9):
        kept = [path(trees[0], i), list(range(i % 4))]  # row 1: a chain's prefix, or nothing
        cache = accept(after_tree, _kept(kept, 9))
        np.testing.assert_array_equal(cache["last"], [len(k) for k in kept])
        new = randn(23 + i, 2, 2, D)
        y, _ = chunk(cache, new)
        for b in range(2):
            x = np.concatenate([prompts[b], tokens[b, kept[b]], new[b]])[None]
            want = np_layer(params, x, CONFIG)[0, -2:]
            np.testing.assert_allclose(y[b], want, atol=3e-5, err_msg=f"path {i} row {b}")


def test_an_accepted_quantized_row_holds_the_kept_tokens_with_their_scales():
    cfg = dataclasses.replace(CONFIG, kv_cache_dtype="int8")
    _, _, empty, step = slot_case(cfg)
    prompts, tokens = [randn(30, 7, D), randn(31, 3, D)], randn(32, 2, 9, D)
    prompted = _prompted(step, empty, prompts)
    tree_cache = step(prompted, tokens, jnp.array([9, 9]), np.array([TREE, TREE]))[1]
    kept = path(TREE, 8)
    cache = accept(tree_cache, _kept([kept, kept[:1]], 9))
    for b, start in enumerate((7, 3)):
        keep = kept if b == 0 else kept[:1]
        arrays = [{**c, **halves(c)} for c in (cache, tree_cache, prompted)]
        for name in ("key", "value", "key_scales", "value_scales"):
            got, tree, before = (a[name] for a in arrays)
            moved = np.asarray(got[b, start : start + len(keep)])
            tree_rows = np.asarray(tree[b])[start + np.array(keep)]
            np.testing.assert_array_equal(moved, tree_rows)
            np.testing.assert_array_equal(got[b, :start], before[b, :start])
    np.testing.assert_array_equal(cache["position"], [7 + len(kept), 4])


def test_a_rolling_cache_accepts_past_its_wrap_through_its_ring():
    W, C = 3, 13
    cfg = dataclasses.replace(CONFIG, window=(W, 0), rolling_cache=True)
    module = nanoattn_nnx.CausalSelfAttention(cfg, rngs=nnx.Rngs(1))
    module.init_cache(1, C)
    step = nnx.jit(lambda m, x, parents: m(x, decode=True, tree_parents=parents))
    prompt, tokens, new = randn(40, 1, 16, D), randn(41, 1, 9, D), randn(42, 1, 8, D)
    for lo in (0, 8):
        step(module, prompt[:, lo : lo + 8], np.arange(-1, 7)[None])  # the ring wraps
    step(module, tokens, np.array([TREE]))
    kept = path(TREE, 8)
    module.accept(_kept([kept], 9))
    y = step(module, new, np.arange(-1, 7)[None])
    params = {"params": nnx.to_pure_dict(nnx.state(module, nnx.Param))}
    x = np.concatenate([prompt[0], tokens[0, kept], new[0]])[None]
    np.testing.assert_allclose(y[0], np_layer(params, x, cfg)[0, -8:], atol=3e-5)
    with pytest.raises(ValueError, match=r"^accept: row 0 is at position 29, past the cache's "
                       r"13 slots: a rolling cache; pass the layer's config$"):  # fmt: skip
        accept(module.cache.get()._asdict(), _kept([[0]], 1))


def test_the_latent_layer_decodes_a_tree_and_accepts_a_path():
    cfg = LatentConfig(d_model=D, n_heads=3, kv_lora_rank=13, qk_nope_head_dim=7,
                       qk_rope_head_dim=4, v_head_dim=5, rope_base=100.0)  # fmt: skip
    layer = LatentAttention(cfg)
    variables = layer.init(jax.random.key(1), jnp.zeros((1, 29, D)), decode=True)
    params = {"params": random_params(variables["params"], 8)}

    @jax.jit
    def step(cache, x, parents):
        y, state = layer.apply({**params, "cache": cache}, x[None], decode=True,
                               tree_parents=parents[None], mutable=["cache"])  # fmt: skip
        return y[0], state["cache"]

    prompt, tokens, new = randn(50, 9, D), randn(51, 9, D), randn(52, 9, D)
    _, cache = step(variables["cache"], prompt, np.arange(-1, 8))
    y, cache = step(cache, tokens, np.array(TREE))
    reference = functools.partial(np_latent, params, cfg=cfg)
    np.testing.assert_allclose(y, path_outputs(reference, prompt, tokens, TREE), atol=3e-5)
    kept = path(TREE, 7)
    y, _ = step(accept(cache, _kept([kept], 5), cfg), new, np.arange(-1, 8))
    want = reference(np.concatenate([prompt, tokens[kept], new])[None])[0, -9:]
    np.testing.assert_allclose(y, want, atol=3e-5)


@pytest.mark.parametrize(
    "kept, message",
    [
        ([[0, 2, 2], [0, -1, -1]], r"kept\[0, 2\]=2: a row keeps indices of its last call's 9 "
         r"tokens, in \[0, 9\), increasing \(a root-to-leaf path, in order\), then -1s$"),
        ([[0, 2, 9], [0, -1, -1]], r"kept\[0, 2\]=9"),
        ([[0, 2, 3], [-1, 1, -1]], r"kept\[1, 1\]=1"),
        ([[0, 2, 3], [-2, -1, -1]], r"kept\[1, 0\]=-2"),
    ],
)  # fmt: skip
def test_a_kept_list_that_is_no_path_raises_one_line(kept, message):
    _, _, empty, step = slot_case()
    cache = step(empty, randn(60, 2, 9, D), jnp.array([9, 9]), np.array([TREE, TREE]))[1]
    with pytest.raises(ValueError, match="^accept: " + message):
        accept(cache, np.array(kept))


def test_a_kept_list_that_is_no_path_poisons_its_row_under_jit():
    _, _, empty, step = slot_case()
    cache = step(empty, randn(61, 2, 9, D), jnp.array([9, 9]), np.array([TREE, TREE]))[1]
    accepted = jax.jit(accept)(cache, np.array([[0, 3, 2], [0, 1, -1]]))
    np.testing.assert_array_equal(accepted["position"], [-1, 2])  # row 0 poisoned


# --- the allocator's accept ---------------------------------------------------------


@pytest.mark.parametrize("page_size", [1, 16])
def test_accepting_every_path_through_the_allocator(page_size):
    """A parent's prompt (a partial page), forked into one child per token of a tree;
    every child brings the tree in one step, keeps its own path, then decodes on with
    the parent: each equals its kept sequence decoded alone."""
    tree = [-1, 0, 0, -1, 2]  # two roots; 0 -> {1, 2}, 2 -> 4
    params, pool, step = paged_case(page_size)
    P = {1: 64, 16: 9}[page_size]
    alloc = PageAllocator(P, page_size, max_sequences=6, max_pages=32 // page_size, seed=3,
                          max_moves=9, max_copies=6)  # fmt: skip
    prompt, tokens = randn(70, 5, D), randn(71, 5, D)
    alloc.allocate("parent", 5)
    _, pool = paged_step(step, pool, alloc, [("parent", prompt, np.arange(-1, 4))], 32)
    for c in range(5):
        alloc.fork("parent", c)
        alloc.extend(c, 5)
    _, pool = paged_step(step, pool, alloc, [(c, tokens, tree) for c in range(5)], 32)
    for c in range(5):
        alloc.accept(c, path(tree, c))
    assert len(alloc.pending_moves()) == 4  # [0, 2]: 2 -> 1; [3]: 3 -> 0; [0, 2, 4]: two
    rows = [(c, randn(72 + k, 3, D), [-1, 0, 1]) for k, c in enumerate((*range(5), "parent"))]
    for seq, x, _ in rows:
        alloc.extend(seq, len(x))
    outs, _ = paged_step(step, pool, alloc, rows, 32)
    assert not alloc.pending_moves()
    for (seq, x, _), got in zip(rows, outs):
        kept = [] if seq == "parent" else path(tree, seq)
        want = np_layer(params, np.concatenate([prompt, tokens[kept], x])[None], CONFIG)
        np.testing.assert_allclose(got, want[0, -3:], atol=3e-5, err_msg=str(seq))


def test_a_fork_of_the_tree_keeps_its_pages_when_the_parent_accepts():
    params, pool, step = paged_case(16)
    alloc = PageAllocator(9, 16, max_sequences=2, max_pages=2, max_moves=9)
    prompt, tokens = randn(80, 5, D), randn(81, 9, D)
    alloc.allocate("a", 5)
    _, pool = paged_step(step, pool, alloc, [("a", prompt, np.arange(-1, 4))], 32)
    alloc.extend("a", 9)
    _, pool = paged_step(step, pool, alloc, [("a", tokens, TREE)], 32)
    alloc.fork("a", "b")
    shared = np.asarray(pool["key"][alloc.pages_of("b")[0]])
    kept = path(TREE, 8)
    alloc.accept("a", kept)
    assert alloc.pages_of("a")[0] != alloc.pages_of("b")[0]  # copied before the moves
    new = randn(82, 2, D)
    alloc.extend("a", 2)
    outs, pool = paged_step(step, pool, alloc, [("a", new, [-1, 0])], 32)
    np.testing.assert_array_equal(pool["key"][alloc.pages_of("b")[0]], shared)
    want = np_layer(params, np.concatenate([prompt, tokens[kept], new])[None], CONFIG)
    np.testing.assert_allclose(outs[0], want[0, -2:], atol=3e-5)


def test_int8_pages_move_their_scales_with_their_rows():
    cfg = dataclasses.replace(CONFIG, page_size=4, kv_cache_dtype="int8")
    from nanoattn.linen import CausalSelfAttention

    layer = CausalSelfAttention(cfg)
    variables = layer.init(jax.random.key(0), jnp.zeros((1, 32, D)), decode=True)
    alloc = PageAllocator(8, 4, max_sequences=1, max_pages=8, seed=2, max_moves=9)
    step = jax.jit(functools.partial(_apply, layer, variables["params"]))
    alloc.allocate("a", 3)
    _, pool = paged_step(step, variables["cache"], alloc, [("a", randn(90, 3, D), [-1, 0, 1])], 12)
    alloc.extend("a", 9)
    _, pool = paged_step(step, pool, alloc, [("a", randn(91, 9, D), TREE)], 12)
    flat = {k: np.asarray(v).reshape(32, *v.shape[2:]) for k, v in pool.items() if v.ndim > 1}
    slots = [p * 4 + s for p in alloc.pages_of("a") for s in range(4)]  # by position
    kept = path(TREE, 8)
    alloc.accept("a", kept)
    _, moved = paged_step(step, pool, alloc, [], 12)  # a step of no tokens carries the moves
    for name, before in flat.items():
        after = np.asarray(moved[name]).reshape(before.shape)
        for m, k in enumerate(kept):
            np.testing.assert_array_equal(after[slots[3 + m]], before[slots[3 + k]], err_msg=name)


def _apply(layer, params, cache, x, pages, parents):
    y, state = layer.apply({"params": params, "cache": cache}, x, True, decode=True, pages=pages,
                           tree_parents=parents, mutable=["cache"])  # fmt: skip
    return y, state["cache"]


def test_a_prefix_cache_forgets_a_tree_and_learns_its_kept_path():
    alloc = PageAllocator(9, 4, max_sequences=2, max_pages=8, prefix_cache=True, max_moves=9)
    prompt_ids, tree_ids = [1, 2, 3, 4], [5, 6, 7, 8, 9, 10, 11, 12, 13]
    alloc.allocate("a", 4, tokens=prompt_ids)
    alloc.extend("a", 9, tokens=tree_ids)  # ids given to a tree: its slots are no sequence
    batch = alloc.batch([("a", 13)], 16)
    alloc.confirm(batch)
    assert alloc.stats().cached_pages == 3  # the prompt's page and two of the tree's
    kept = path(TREE, 8)
    alloc.accept("a", kept)
    assert alloc.stats().cached_pages == 1  # the tree's pages forgotten
    alloc.confirm(alloc.batch([], 16))  # the moves carried: the kept path's pages cached
    kept_ids = [tree_ids[k] for k in kept]
    assert alloc.allocate("b", 10, tokens=prompt_ids + kept_ids + [99]) == 4 * (
        (4 + len(kept)) // 4
    )


def test_the_allocator_refuses_an_accept_it_cannot_keep():
    alloc = PageAllocator(8, 4, max_sequences=2, max_pages=4, max_moves=2)
    alloc.allocate("a", 9)
    with pytest.raises(ValueError, match="accept: sequence 'a' has tokens no step has written"):
        alloc.accept("a", [0])
    alloc.confirm(alloc.batch([("a", 9)], 9))
    with pytest.raises(ValueError, match=r"^accept: kept must be increasing indices of the last "
                       r"extension's 9 tokens, in \[0, 9\) \(a root-to-leaf path, in order\), "
                       r"got \[0, 3, 3\]$"):  # fmt: skip
        alloc.accept("a", [0, 3, 3])
    with pytest.raises(ValueError, match="needs 3 slot moves, and 0 are pending of max_moves=2"):
        alloc.accept("a", [0, 2, 4, 8])
    first, second, _ = alloc.pages_of("a")
    alloc.accept("a", [0, 2, 4])  # two moves: positions 2 -> 1 and 4 -> 2
    assert alloc.length("a") == 3 and alloc.last_extension("a") == 3
    assert alloc.pages_of("a") == [first]
    assert alloc.pending_moves() == [(first * 4 + 2, first * 4 + 1), (second * 4, first * 4 + 2)]
    with pytest.raises(ValueError, match="fork: sequence 'a' has accepted tokens no step has"):
        alloc.fork("a", "b")
    with pytest.raises(ValueError, match="has tokens no step has written or moved into place"):
        alloc.accept("a", [0])
    alloc.rewind("a", 3)  # its page given back: the moves into it dropped
    assert alloc.pending_moves() == []
