"""Token trees for the layers' tree tests (layers/test_tree_decode.py,
layers/test_accept.py): random trees of a given depth and branching, root-to-leaf paths,
each token's expected output (its path decoded alone through a float64 reference,
tests/_np_layer.py, tests/_np_latent.py), and the layers those tests decode with: a
linen layer over a slot cache and over a paged pool, each step compiled once. Sizes D
24, N 6, K 2, H 4."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from nanoattn.linen import AttentionConfig, CausalSelfAttention

from _layer_configs import random_params

D, N, K = 24, 6, 2
CONFIG = AttentionConfig(D, N, n_kv_heads=K, rope_base=100.0)
GARBAGE = 99  # a padded token's parent: never read


def random_tree(rng, size: int, depth: int, branching: int) -> list[int]:
    """Parents of a random tree of ``size`` tokens in chunk order (each parent earlier,
    -1 for a root): at most ``depth`` levels, at most ``branching`` children per token
    (and roots); with as many levels as that allows for the first ones (a spine), so
    that its depth is ``min(depth, size)``; fewer tokens where no token may take one
    more child."""
    parents, levels, children = [], [], {}
    for i in range(size):
        if i < depth:  # the spine: depth levels first
            p = i - 1
        else:
            choices = [p for p in range(-1, i) if children.get(p, 0) < branching
                       and (p < 0 or levels[p] + 1 < depth)]  # fmt: skip
            if not choices:
                break
            p = int(rng.choice(choices))
        children[p] = children.get(p, 0) + 1
        parents.append(p)
        levels.append(0 if p < 0 else levels[p] + 1)
    return parents


def path(parents, i: int) -> list[int]:
    """The indices of token i's root-to-leaf path, root first."""
    out = []
    while i >= 0:
        out.append(i)
        i = int(parents[i])
    return out[::-1]


def leaves(parents) -> list[int]:
    """The tokens no other token names as its parent."""
    named = {int(p) for p in parents}
    return [i for i in range(len(parents)) if i not in named]


def path_outputs(reference, prefix, tokens, parents):
    """Each token's expected output (T, F): ``reference(x (1, L, D)) -> (1, L, F)`` of
    the committed ``prefix`` (P, D) then its path's ``tokens`` (T, D), the output at
    its own place, one reference call per leaf."""
    out = np.zeros((len(parents), 0))
    for leaf in leaves(parents):
        kept = path(parents, leaf)
        y = np.asarray(reference(np.concatenate([prefix, tokens[kept]])[None]))[0]
        if out.shape[1] == 0:
            out = np.full((len(parents), y.shape[-1]), np.nan)
        out[kept] = y[len(prefix) :]
    return out


def padded(trees, width):
    """(B, width) parents, the padded tokens' GARBAGE."""
    out = np.full((len(trees), width), GARBAGE, np.int32)
    for b, tree in enumerate(trees):
        out[b, : len(tree)] = tree
    return out


@functools.cache
def slot_case(cfg=CONFIG, capacity=29):
    """A linen layer, random parameters, an empty cache of ``capacity`` slots and a
    jitted step (cache, x, lengths, tree_parents or None)."""
    layer = CausalSelfAttention(cfg)
    shapes = jax.eval_shape(functools.partial(layer.init, decode=True), jax.random.key(0),
                            jnp.zeros((2, capacity, D)))  # fmt: skip
    params = {"params": random_params(shapes["params"], 5)}
    empty = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), shapes["cache"])

    @jax.jit
    def step(cache, x, lengths, parents):
        y, state = layer.apply({**params, "cache": cache}, x, True, decode=True,
                               lengths=lengths, tree_parents=parents,
                               mutable=["cache"])  # fmt: skip
        return y, state["cache"]

    return layer, params, empty, step


PAGES_OF = {1: 64, 16: 9}  # page size: pool pages (the tree step's tokens and slack)


@functools.cache
def paged_case(page_size):
    """Random parameters, a pool of ``PAGES_OF[page_size]`` pages of NaN and a jitted
    paged step (pool, x (1, Tq, D), pages, tree_parents (1, Tq))."""
    cfg = dataclasses.replace(CONFIG, page_size=page_size)
    layer = CausalSelfAttention(cfg)
    P = PAGES_OF[page_size]
    shapes = jax.eval_shape(functools.partial(layer.init, decode=True), jax.random.key(0),
                            jnp.zeros((1, P * page_size, D)))  # fmt: skip
    params = {"params": random_params(shapes["params"], 6)}
    pool = jax.tree.map(lambda a: jnp.full(a.shape, jnp.nan, a.dtype), shapes["cache"])

    @jax.jit
    def step(cache, x, pages, parents):
        y, state = layer.apply({**params, "cache": cache}, x, True, decode=True, pages=pages,
                               tree_parents=parents, mutable=["cache"])  # fmt: skip
        return y, state["cache"]

    return params, pool, step


def paged_step(step, pool, alloc, rows, tokens: int):
    """One paged step of ``rows`` ``[(seq_id, x (q_len, D), parents)]`` (each extended
    already): returns the outputs per row and the pool."""
    batch = alloc.batch([(s, len(x)) for s, x, _ in rows], tokens)
    x = np.zeros((1, tokens, D), np.float32)
    parents = np.full((1, tokens), GARBAGE, np.int32)  # padding rows: never read
    t = 0
    for _, xs, p in rows:
        x[0, t : t + len(xs)], parents[0, t : t + len(xs)] = xs, p
        t += len(xs)
    y, pool = step(pool, x, batch, parents)
    alloc.confirm(batch)
    starts = np.asarray(batch.query_starts)
    return [np.asarray(y[0, starts[b] : starts[b + 1]]) for b in range(len(rows))], pool
