"""Random programs of a paged server, checked against a plain model of what every
sequence holds (docs/decoding.md, "Between two steps").

A program is a random sequence of ``allocate``, ``extend``, ``fork``, ``rewind``,
``free`` and ``step`` over a :class:`~nanoattn.PageAllocator` and a small linen or NNX
layer with a paged cache (pages of 1, 3 and 16 tokens), its pool NaN before the first
step. The model is a dict: each sequence's inputs, and how many of them a step has fed.
Every token a step feeds must give the full forward of its own sequence at its
position; an allocator call may refuse (a ValueError, the allocator unchanged, the
model unchanged), a step may not, and no number may be wrong. Besides single moves,
programs make the moves whose orders a fixed script never tries: a fork before the
parent's tokens are written, chains of copies in one step (fork, extend, rewind, fork,
extend), copies whose target is freed while pending and handed to another copy. The
fast suite's programs must reach each of those orders (:data:`ORDERS`); ``make
test-all`` runs a longer profile.
"""

import collections
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from nanoattn import PageAllocator
from nanoattn import nnx as nanoattn_nnx
from nanoattn.linen import AttentionConfig, CausalSelfAttention

from _layer_configs import random_params

D, N, K = 8, 2, 1
MAX_LIVE = 5  # sequences held at once
ROWS = 4  # sequences a step serves (max_sequences)
TQ = 11  # the tokens of a step
# page size -> (pages of the pool, pages per sequence): sequences of at most 12-16 tokens
POOLS = {1: (26, 12), 3: (11, 4), 16: (5, 1)}
# The orders the fast programs must reach, and a line saying each.
ORDERS = {
    "copy": "a write into a shared partial page (copy-on-write)",
    "chained copy": "a copy whose source is another pending copy's target",
    "dropped copy": "a pending copy whose target was freed before the step",
    "target reused": "a freed pending target handed to another copy before the step",
    "fork refused": "a fork of a parent with tokens no step has written",
    "page reused": "a page freed and handed out again before the next step",
    "refusal": "an allocator call refused, nothing changed",
}
FAST_PROGRAMS, LONG_PROGRAMS, MOVES = 10, 100, 36


@functools.cache
def _layer(page_size: int, framework: str):
    """(step(pool, x, batch) -> (y, pool), full(x) -> y, the pool full of NaN)."""
    pages = POOLS[page_size][0]
    cfg = AttentionConfig(D, N, n_kv_heads=K, rope_base=100.0, page_size=page_size)
    layer = CausalSelfAttention(cfg)
    shapes = jax.eval_shape(
        functools.partial(layer.init, decode=True),
        jax.random.key(0),
        jnp.zeros((1, pages * page_size, D)),
    )
    params = random_params(shapes["params"], 11)
    pool = jax.tree.map(lambda a: jnp.full(a.shape, jnp.nan, a.dtype), shapes["cache"])
    full = jax.jit(lambda x: layer.apply({"params": params}, x, True))
    if framework == "linen":

        @jax.jit
        def step(pool, x, batch):
            y, state = layer.apply(
                {"params": params, "cache": pool}, x, True, decode=True, pages=batch,
                mutable=["cache"],
            )  # fmt: skip
            return y, state["cache"]

        return step, full, pool
    module = nanoattn_nnx.from_linen(cfg, params, rngs=nnx.Rngs(0))
    module.init_cache(1, pages * page_size)
    graphdef, weights, state = nnx.split(module, nnx.Param, ...)

    @jax.jit
    def nnx_step(state, x, batch):
        module = nnx.merge(graphdef, weights, state)
        y = module(x, decode=True, pages=batch, deterministic=True)
        return y, nnx.split(module, nnx.Param, ...)[2]

    def poison(a):
        return jnp.full(a.shape, jnp.nan, a.dtype) if a.dtype == jnp.float32 else a

    return nnx_step, full, jax.tree.map(poison, state)


class Server:
    """The allocator and the layer's pool, and the model: each sequence's inputs and
    how many a step has fed. Counts the orders it meets (:data:`ORDERS`)."""

    def __init__(self, page_size: int, framework: str, seed: int):
        pages, max_pages = POOLS[page_size]
        self.step_fn, self.full, self.pool = _layer(page_size, framework)
        self.page_size, self.length = page_size, max_pages * page_size
        self.alloc = PageAllocator(pages, page_size, max_sequences=ROWS, max_pages=max_pages,
                                   max_copies=ROWS, seed=seed)  # fmt: skip
        self.rng = np.random.default_rng(seed)
        self.inputs: dict = {}  # seq -> list of (D,) inputs it holds
        self.fed: dict = {}  # seq -> how many of them a step has fed
        self.last: dict = {}  # seq -> the inputs its last extension brought
        self.orders = collections.Counter()
        self.freed_since_step: set = set()
        self.dropped_targets: set = set()
        self.names = 0

    # --- the allocator's calls, each against the model -----------------------------

    def _view(self):
        """What the allocator says, to check that a refusal changed nothing."""
        a = self.alloc
        held = {s: (a.length(s), a.unwritten(s), a.pages_of(s)) for s in a.sequences()}
        return held, a.free_page_ids(), a.pending_copies()

    def _call(self, method, *args) -> bool:
        before = self._view()
        copies = set(self.alloc.pending_copies())
        free = set(self.alloc.free_page_ids())
        try:
            getattr(self.alloc, method)(*args)
        except ValueError as e:
            assert self._view() == before, f"{method}{args} refused ({e}) but changed the allocator"
            self.orders["refusal"] += 1
            if method == "fork" and "no step has written" in str(e):
                self.orders["fork refused"] += 1
            return False
        after = set(self.alloc.pending_copies())
        for _, target in after - copies:
            self.orders["copy"] += 1
            if target in self.dropped_targets:
                self.orders["target reused"] += 1
        for _, target in copies - after:
            self.orders["dropped copy"] += 1
            self.dropped_targets.add(target)
        released = set(self.alloc.free_page_ids()) - free
        taken = free - set(self.alloc.free_page_ids())
        if taken & self.freed_since_step:
            self.orders["page reused"] += 1
        self.freed_since_step |= released
        return True

    def _new(self) -> str:
        self.names += 1
        return f"s{self.names}"

    def _tokens(self, n: int) -> list:
        return list(self.rng.standard_normal((n, D)).astype(np.float32))

    def allocate(self, n: int):
        if len(self.inputs) >= MAX_LIVE:
            return None
        seq = self._new()
        if self._call("allocate", seq, n):
            self.inputs[seq], self.fed[seq], self.last[seq] = self._tokens(n), 0, n
            return seq
        return None

    def extend(self, seq, n: int) -> bool:
        pages_before = self.alloc.pages_of(seq)
        copies_before = set(self.alloc.pending_copies())
        if not self._call("extend", seq, n):
            return False
        for source, _ in set(self.alloc.pending_copies()) - copies_before:
            if source != pages_before[-1]:  # resolved through a pending copy
                self.orders["chained copy"] += 1
        self.inputs[seq] += self._tokens(n)
        self.last[seq] = n
        return True

    def fork(self, parent):
        if len(self.inputs) >= MAX_LIVE:
            return None
        child = self._new()
        if self._call("fork", parent, child):
            self.inputs[child] = list(self.inputs[parent])
            self.fed[child], self.last[child] = len(self.inputs[parent]), 0
            return child
        return None

    def rewind(self, seq, n: int) -> bool:
        if not self._call("rewind", seq, n):
            return False
        del self.inputs[seq][len(self.inputs[seq]) - n :]
        self.fed[seq] = min(self.fed[seq], len(self.inputs[seq]))
        self.last[seq] -= n
        return True

    def free(self, seq) -> None:
        if self._call("free", seq):
            for table in (self.inputs, self.fed, self.last):
                del table[seq]

    # --- a step, and its check ------------------------------------------------------

    def step(self) -> None:
        """Feeds every sequence's unfed inputs that fit in one step, in a random order
        of rows, and checks each output against its sequence's full forward."""
        order = list(self.rng.permutation(list(self.inputs)))
        rows, budget = [], TQ
        for seq in order:
            n = len(self.inputs[seq]) - self.fed[seq]
            if n <= budget and len(rows) < ROWS and (n or self.rng.random() < 0.3):
                rows.append((seq, n))
                budget -= n
        for seq in self.inputs:
            assert self.alloc.length(seq) == len(self.inputs[seq]), seq
            assert self.alloc.unwritten(seq) == len(self.inputs[seq]) - self.fed[seq], seq
        batch = self.alloc.batch(rows, TQ)
        x = [self.inputs[s][self.fed[s] :] for s, _ in rows]
        x = np.stack([t for part in x for t in part] + self._tokens(budget))[None]
        y, self.pool = self.step_fn(self.pool, jnp.asarray(x), batch)
        self.alloc.confirm(batch)
        y, at = np.asarray(y[0]), 0
        for seq, n in rows:
            held = np.stack(self.inputs[seq] + self._tokens(self.length - len(self.inputs[seq])))
            want = np.asarray(self.full(jnp.asarray(held)[None]))[0]
            got, start = y[at : at + n], self.fed[seq]
            np.testing.assert_allclose(
                got, want[start : start + n], atol=3e-5, rtol=3e-5,
                err_msg=f"sequence {seq}, positions {start}..{start + n - 1}",
            )  # fmt: skip
            at += n
            self.fed[seq] += n
        assert (y[at:] == 0).all(), "padding rows must be zeros"
        self.freed_since_step, self.dropped_targets = set(), set()

    # --- the moves of a program -----------------------------------------------------

    def some(self, written=False):
        pool = [s for s in self.inputs if not written or self.fed[s] == len(self.inputs[s])]
        return self.rng.choice(pool) if pool else None

    def move(self) -> None:
        r, kind = self.rng, self.rng.choice(
            ["allocate", "extend", "fork", "rewind", "free", "step", "chain", "early fork",
             "reuse"],
            p=[0.12, 0.14, 0.1, 0.08, 0.06, 0.24, 0.1, 0.08, 0.08],
        )  # fmt: skip
        seq = self.some()
        if kind == "allocate" or seq is None:
            self.allocate(int(r.integers(0, 7)))
        elif kind == "extend":
            self.extend(seq, int(r.integers(0, 5)))
        elif kind == "fork":
            self.fork(self.some(written=True) or seq)
        elif kind == "rewind":  # sometimes more than the last extension: refused
            self.rewind(seq, int(r.integers(0, self.last[seq] + 2)))
        elif kind == "free":
            self.free(seq)
        elif kind == "step":
            self.step()
        elif kind == "chain":  # fork, extend, rewind, fork, extend: copies in a chain
            parent = self.some(written=True)
            child = parent and self.fork(parent)
            if child and self.extend(child, 1) and self.rewind(child, 1):
                grandchild = self.fork(child)
                if grandchild:
                    self.extend(grandchild, int(r.integers(1, 3)))
        elif kind == "early fork":  # a parent that has unwritten tokens
            parent = self.allocate(int(r.integers(1, 6)))
            if parent:
                child = self.fork(parent)
                if child:
                    self.extend(child, 1)
        else:  # a pending copy's target freed, then another copy in the same window
            parent = self.some(written=True)
            child = parent and self.fork(parent)
            if child and self.extend(child, 1):
                self.free(child)
                other = self.fork(parent)
                if other:
                    self.extend(other, int(r.integers(1, 3)))


def _run(page_size: int, framework: str, programs: int, first_seed: int = 0):
    orders = collections.Counter()
    for seed in range(first_seed, first_seed + programs):
        server = Server(page_size, framework, seed)
        for _ in range(MOVES):
            server.move()
        server.step()  # every unfed token checked
        orders += server.orders
    return orders


@pytest.mark.parametrize("framework", ["linen", "nnx"])
@pytest.mark.parametrize("page_size", sorted(POOLS))
def test_random_programs_give_each_sequence_its_full_forward(page_size, framework):
    orders = _run(page_size, framework, FAST_PROGRAMS)
    if page_size > 1:  # pages of one token are never partial: nothing is ever copied
        missed = [ORDERS[o] for o in ORDERS if not orders[o]]
        assert not missed, f"the programs never reached: {missed} ({dict(orders)})"


@pytest.mark.slow  # the same programs, ten times as many: the fast test above covers each order
@pytest.mark.parametrize("page_size", sorted(POOLS))
def test_a_long_profile_of_random_programs(page_size):
    _run(page_size, "linen", LONG_PROGRAMS, first_seed=FAST_PROGRAMS)
