"""Speculative decoding's verify call (docs/conventions.md, "Token trees"): one
sequence's chunk of T draft tokens forming a tree (``tree_parents``) over a paged cache
of C committed keys, against a plain causal chunk of the same T tokens over the same
keys: the tree should cost no more than the chunk it replaces.

Both are ``paged_attention`` calls on one backend (by default the automatic choice:
native on a CPU), one process, timed in turn. The tree: a root and branching 4, then
chains, T nodes in all (a Medusa/EAGLE-like shape: wide near the root, deep along a
few paths). Issue 49's target, at the full shape (T = 64 over 4096 keys, N = 32 on
K = 8, H = 128): the tree at most 1.2x the chunk.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from ._markdown import timed_calls
from ._measure import Heads, ratio_target, timed_row
from ._paged_pair import with_and_without


@dataclasses.dataclass(frozen=True)
class TreeShape(Heads):
    """A tree of ``T`` drafts over ``C`` committed keys in pages of ``page_size``."""

    T: int
    C: int
    page_size: int = 16


FULL = TreeShape(T=64, C=4096)
QUICK = TreeShape(T=16, C=256, N=8, K=2, H=64, rounds=3)
TARGET = 1.2  # the tree's call <= 1.2x the causal chunk's


def tree_parents(T: int, branching: int = 4) -> np.ndarray:
    """(T,) int32: node 0 the root (-1); nodes 1..branching its children; every later
    node the child of the node ``branching`` before it (chains under each child)."""
    parents = np.arange(T, dtype=np.int32) - branching
    parents[0] = -1
    parents[1 : branching + 1] = 0
    return parents


def _calls(shape: TreeShape, implementation):
    """The two jitted calls and their arguments: {name: (fn, args)}."""
    s = shape
    length = s.C + s.T
    pages = -(-length // s.page_size)
    keys = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(keys[0], (s.T, s.N, s.H), jnp.float32)
    pool = (pages, s.page_size, s.K, s.H)
    k, v = (jax.random.normal(key, pool, jnp.float32) for key in keys[1:])
    table = jnp.asarray(np.random.default_rng(0).permutation(pages)[None].astype(np.int32))
    lengths, starts = jnp.array([length], jnp.int32), jnp.array([0, s.T], jnp.int32)
    parents = jnp.asarray(tree_parents(s.T))
    return with_and_without("tree_parents", parents, ("tree", "chunk"),
                            (q, k, v, table, lengths, starts), implementation)  # fmt: skip


def measure_tree(shape: TreeShape, progress=None, implementation=None) -> dict:
    """Median and min ms of the tree's call and the chunk's, and their ratio."""
    label = f"tree: {shape.T} drafts over {shape.C} keys"
    ratios = {"tree_vs_chunk": ("tree", "chunk")}
    return timed_row(shape, _calls(shape, implementation), implementation, progress, label,
                     ratios=ratios)  # fmt: skip


def tree_targets(row: dict | None, judged: bool) -> list[dict]:
    """Issue 49's target, judged at the full shape only."""
    if row is None or not judged:
        return []
    target = (f"a {row['T']}-node tree's verify call <= {TARGET}x a {row['T']}-token causal "
              f"chunk over {row['C']} keys")  # fmt: skip
    return [ratio_target(target, row["tree_vs_chunk"], TARGET, at_most=True)]


def tree_markdown(row: dict | None) -> list[str]:
    """The part's table: each call's median (min) ms and the ratio."""
    if row is None:
        return []
    shape = f"N={row['N']} on K={row['K']}, H={row['H']}, pages of {row['page_size']}, float32"
    calls = [(f"a tree of {row['T']} (branching 4, then chains)", "tree"),
             (f"a causal chunk of {row['T']}", "chunk")]  # fmt: skip
    return [
        *timed_calls(row, f"Token trees: {row['T']} drafts over {row['C']} keys ({shape})", calls),
        "", f"tree / chunk: {row['tree_vs_chunk']:.2f}x",
    ]  # fmt: skip
