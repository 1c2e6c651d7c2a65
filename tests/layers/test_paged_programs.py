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
extend), copies whose target is freed while pending and handed to another copy; and
token trees (a step that brings one, each draft against its own path's forward), their
accepted paths (``accept``, the slot moves the next step carries, copied first where a
fork shares the page, dropped when the sequence is freed). The fast suite's programs
must reach each of those orders (:data:`ORDERS`); ``make test-all`` runs a longer
profile.

Two more kinds of server (:data:`KINDS`; a sequence's inputs are token ids, each
token's input ``EMBED[id]``). A prefix cache (``prefix_cache=True``): moves allocate
prompts that share a prefix with an earlier prompt under one of two namespaces, free
them, hit them again and evict them under pressure; each hit must be whole pages, leave
a token to compute and be a prefix some step wrote under its namespace, and the
tokens after it give the full forward. A windowed layer with a sink token and its
windowed allocator: after every call each sequence's entries are -1 exactly where no
query it may still make reads (the model's ``min(fed, length - last extension)``),
and pages given back are taken by other sequences while their owner goes on. Their
orders are :data:`KIND_ORDERS`.
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
from _trees import path, random_tree

D, N, K = 8, 2, 1
MAX_LIVE = 5  # sequences held at once
ROWS = 4  # sequences a step serves (max_sequences)
TQ = 11  # the tokens of a step
# page size -> (pages of the pool, pages per sequence): sequences of at most 12-16 tokens
POOLS = {1: (26, 12), 3: (11, 4), 16: (5, 1)}
# a windowed layer's: sequences of up to 24 tokens in fewer pages than they span
WINDOW_POOLS = {1: (22, 24), 3: (9, 8)}
# The orders the fast programs must reach, and a line saying each.
ORDERS = {
    "copy": "a write into a shared partial page (copy-on-write)",
    "chained copy": "a copy whose source is another pending copy's target",
    "dropped copy": "a pending copy whose target was freed before the step",
    "target reused": "a freed pending target handed to another copy before the step",
    "fork refused": "a fork of a parent with tokens no step has written",
    "page reused": "a page freed and handed out again before the next step",
    "refusal": "an allocator call refused, nothing changed",
    "tree": "a step that brings a token tree, each draft against its own path",
    "accept": "an accepted path whose tokens the next step moves into place",
    "accept copy": "an accept into a page a fork shares (copied, then the moves)",
    "dropped move": "a pending move whose target page was freed before the step",
}
FAST_PROGRAMS, LONG_PROGRAMS, MOVES = 10, 100, 36
V = 23  # token ids
EMBED = np.random.default_rng(5).standard_normal((V, D)).astype(np.float32)
LEFT, SINKS = 3, 1  # the windowed kind's window=(LEFT, 0) (W = 4) and sink tokens
WINDOWED = dict(window=(LEFT, 0), sink_tokens=SINKS)
# kind -> (the layer's options, the allocator's)
KINDS = {"plain": ({}, {}), "prefix": ({}, dict(prefix_cache=True)), "window": (WINDOWED, WINDOWED)}
NAMESPACES = ("tenant-a", "tenant-b")
KIND_ORDERS = {
    "prefix": {
        "hit": "an allocate that found its prompt's first pages cached",
        "reusable hit": "a hit on a cached page no sequence held (a freed prompt's)",
        "eviction": "a cached page handed out again under pressure",
        "namespace miss": "a prompt written only under the other namespace: no hit",
        "rewritten": "a cached page rewound into and written again, then its old prompt",
    },
    "window": {
        "given back": "a page no query of its sequence reads any more given back (-1)",
        "given back reused": "a page given back taken by another sequence, its owner alive",
    },
}


@functools.cache
def _layer(page_size: int, framework: str, kind: str = "plain"):
    """(step(pool, x, batch) -> (y, pool), full(x) -> y, the pool full of NaN)."""
    pages = (WINDOW_POOLS if kind == "window" else POOLS)[page_size][0]
    cfg = AttentionConfig(D, N, n_kv_heads=K, rope_base=100.0, page_size=page_size,
                          **KINDS[kind][0])  # fmt: skip
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
        def step(pool, x, batch, parents=None):
            y, state = layer.apply(
                {"params": params, "cache": pool}, x, True, decode=True, pages=batch,
                tree_parents=parents, mutable=["cache"],
            )  # fmt: skip
            return y, state["cache"]

        return step, full, pool
    module = nanoattn_nnx.from_linen(cfg, params, rngs=nnx.Rngs(0))
    module.init_cache(1, pages * page_size)
    graphdef, weights, state = nnx.split(module, nnx.Param, ...)

    @jax.jit
    def nnx_step(state, x, batch, parents=None):
        module = nnx.merge(graphdef, weights, state)
        y = module(x, decode=True, pages=batch, tree_parents=parents, deterministic=True)
        return y, nnx.split(module, nnx.Param, ...)[2]

    def poison(a):
        return jnp.full(a.shape, jnp.nan, a.dtype) if a.dtype == jnp.float32 else a

    return nnx_step, full, jax.tree.map(poison, state)


class Server:
    """The allocator and the layer's pool, and the model: each sequence's token ids
    and how many a step has fed. Counts the orders it meets (:data:`ORDERS`,
    :data:`KIND_ORDERS`)."""

    def __init__(self, page_size: int, framework: str, seed: int, kind: str = "plain"):
        pages, max_pages = (WINDOW_POOLS if kind == "window" else POOLS)[page_size]
        self.step_fn, self.full, self.pool = _layer(page_size, framework, kind)
        self.page_size, self.length, self.kind = page_size, max_pages * page_size, kind
        self.alloc = PageAllocator(pages, page_size, max_sequences=ROWS, max_pages=max_pages,
                                   max_copies=ROWS, max_moves=TQ, seed=seed,
                                   **KINDS[kind][1])  # fmt: skip
        self.rng = np.random.default_rng(seed)
        self.inputs: dict = {}  # seq -> the token ids it holds
        self.fed: dict = {}  # seq -> how many of them a step has fed (or a hit cached)
        self.last: dict = {}  # seq -> the inputs its last extension brought
        self.space: dict = {}  # seq -> its namespace
        self.prompts: list = []  # each sequence allocated (its ids as they grow): shared
        self.written: set = set()  # (namespace, ids of a page-aligned prefix a step wrote)
        self.entries: dict = {}  # seq -> its page-table entries after the last call
        self.given_back: dict = {}  # page -> (its owner, the sequences holding it then)
        self.orders = collections.Counter()
        self.freed_since_step: set = set()
        self.dropped_targets: set = set()
        self.names = 0
        self.result = None

    # --- the allocator's calls, each against the model -----------------------------

    def _view(self):
        """What the allocator says, to check that a refusal changed nothing."""
        a = self.alloc
        held = {s: (a.length(s), a.unwritten(s), a.pages_of(s)) for s in a.sequences()}
        return held, a.free_page_ids(), a.pending_copies(), a.pending_moves(), a.stats()

    def _call(self, method, *args, **options) -> bool:
        before = self._view()
        copies = set(self.alloc.pending_copies())
        moves = set(self.alloc.pending_moves())
        free = set(self.alloc.free_page_ids())
        evictions = self.alloc.stats().evictions
        try:
            self.result = getattr(self.alloc, method)(*args, **options)
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
        self.orders["dropped move"] += bool(moves - set(self.alloc.pending_moves()))
        released = set(self.alloc.free_page_ids()) - free
        taken = free - set(self.alloc.free_page_ids())
        if taken & self.freed_since_step:
            self.orders["page reused"] += 1
        self.freed_since_step |= released
        self.orders["eviction"] += self.alloc.stats().evictions > evictions
        self.reusable_before = free
        return True

    def _new(self) -> str:
        self.names += 1
        return f"s{self.names}"

    def _ids(self, n: int) -> list:
        return [int(t) for t in self.rng.integers(0, V, n)]

    def allocate(self, n: int, ids=None, space=None):
        if len(self.inputs) >= MAX_LIVE:
            return None
        seq, ids = self._new(), self._ids(n) if ids is None else list(ids)
        space = space or NAMESPACES[int(self.rng.integers(0, 2))]
        if not self._call("allocate", seq, len(ids), tokens=ids, namespace=space):
            return None
        cached = self.result
        self.inputs[seq], self.fed[seq], self.last[seq], self.space[seq] = (
            ids,
            cached,
            len(ids),
            space,
        )
        self.prompts.append((space, ids))
        if self.kind == "prefix":
            self._check_hit(seq, cached)
        else:
            assert cached == 0, f"{seq}: a hit without a prefix cache"
        return seq

    def _check_hit(self, seq, cached: int) -> None:
        """A hit is whole pages, leaves a token to compute, and is a prefix a step wrote
        under the sequence's namespace; a longer prefix written under the other one only
        is a namespace miss."""
        ps, ids, space = self.page_size, self.inputs[seq], self.space[seq]
        assert cached % ps == 0 and cached <= max(len(ids) - 1, 0), (seq, cached)
        assert cached == 0 or (space, tuple(ids[:cached])) in self.written, (seq, cached)
        self.orders["hit"] += cached > 0
        reusable = set(self.alloc.pages_of(seq)[: cached // ps]) & self.reusable_before
        self.orders["reusable hit"] += bool(reusable)
        other = NAMESPACES[1 - NAMESPACES.index(space)]
        self.orders["namespace miss"] += cached == 0 and (other, tuple(ids[:ps])) in self.written

    def extend(self, seq, n: int) -> bool:
        pages_before = self.alloc.pages_of(seq)
        copies_before = set(self.alloc.pending_copies())
        ids = self._ids(n)
        if not self._call("extend", seq, n, tokens=ids):
            return False
        for source, _ in set(self.alloc.pending_copies()) - copies_before:
            if source != pages_before[-1]:  # resolved through a pending copy
                self.orders["chained copy"] += 1
        self.inputs[seq] += ids
        self.last[seq] = n
        return True

    def fork(self, parent):
        if len(self.inputs) >= MAX_LIVE:
            return None
        child = self._new()
        if self._call("fork", parent, child):
            self.inputs[child] = list(self.inputs[parent])
            self.fed[child], self.last[child] = len(self.inputs[parent]), 0
            self.space[child] = self.space[parent]
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
            for table in (self.inputs, self.fed, self.last, self.space):
                del table[seq]

    def check_window(self) -> None:
        """With a window, after every call: each sequence's entries are -1 exactly where
        no query it may still make reads, past the sink token's page; a page given back
        and then held by a sequence that did not hold it then is counted."""
        if self.kind != "window":
            return
        ps = self.page_size
        for seq in self.inputs:
            first = min(self.fed[seq], len(self.inputs[seq]) - self.last[seq])
            entries = self.alloc.pages_of(seq)
            want = [j for j in range(len(entries)) if j >= -(-SINKS // ps)
                    and (j + 1) * ps <= first - LEFT]  # fmt: skip
            assert [j for j, p in enumerate(entries) if p == -1] == want, (seq, entries, first)
            for j, page in enumerate(self.entries.get(seq, [])[: len(entries)]):
                if page != -1 and entries[j] == -1:
                    holders = {s for s in self.inputs if page in self.alloc.pages_of(s)}
                    self.given_back[page] = (seq, holders)
                    self.orders["given back"] += 1
            self.entries[seq] = entries
        for page, (owner, holders) in list(self.given_back.items()):
            takers = {s for s in self.inputs if page in self.alloc.pages_of(s)} - holders
            if owner not in self.inputs or takers:
                self.orders["given back reused"] += bool(takers and owner in self.inputs)
                del self.given_back[page]

    # --- a step, and its check ------------------------------------------------------

    def step(self, first=None, tree=None) -> None:
        """Feeds every sequence's unfed inputs that fit in one step, in a random order
        of rows (``first``'s first), and checks each output against its sequence's full
        forward; ``tree``: ``first``'s unfed inputs are a token tree of these parents
        (the step then brings ``tree_parents``, every other row a chain), each draft
        checked against its own path's forward."""
        order = list(self.rng.permutation(list(self.inputs)))
        if first in self.inputs:
            order = [first] + [s for s in order if s != first]
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
        x = EMBED[[t for part in x for t in part] + self._ids(budget)][None]
        options = {}
        if tree is not None:  # the tree row's parents, a chain for every other row
            parents = [tree if s == first else list(range(-1, n - 1)) for s, n in rows]
            parents = np.array([[p for part in parents for p in part] + [-1] * budget])
            options = dict(parents=jnp.asarray(parents, jnp.int32))
            self.orders["tree"] += 1
        y, self.pool = self.step_fn(self.pool, jnp.asarray(x), batch, **options)
        self.alloc.confirm(batch)
        y, at = np.asarray(y[0]), 0
        for seq, n in rows:
            got, start = y[at : at + n], self.fed[seq]
            want = self._expected(seq, start, n, tree if seq == first else None)
            np.testing.assert_allclose(
                got, want, atol=3e-5, rtol=3e-5,
                err_msg=f"sequence {seq}, positions {start}..{start + n - 1}",
            )  # fmt: skip
            at += n
            self.fed[seq] += n
            ids, ps = self.inputs[seq], self.page_size
            for p in range(ps, self.fed[seq] + 1, ps):
                self.written.add((self.space[seq], tuple(ids[:p])))
        assert (y[at:] == 0).all(), "padding rows must be zeros"
        self.freed_since_step, self.dropped_targets = set(), set()
        self.check_window()

    def _expected(self, seq, start: int, n: int, tree) -> np.ndarray:
        """(n, D): the full forward of ``seq``'s inputs at positions ``start ..``, or
        with ``tree`` (the parents of those n inputs) each one's at the end of its own
        root-to-leaf path after the inputs before ``start``."""
        ids, pad = self.inputs[seq], self.length - len(self.inputs[seq])
        if tree is None:
            held = EMBED[ids + self._ids(pad)]
            return np.asarray(self.full(jnp.asarray(held)[None]))[0, start : start + n]
        want = np.zeros((n, D), np.float32)
        for i in range(n):
            kept = path(tree, i)
            held = EMBED[ids[:start] + [ids[start + k] for k in kept] + self._ids(pad)]
            want[i] = np.asarray(self.full(jnp.asarray(held)[None]))[0, start + len(kept) - 1]
        return want

    def tree(self, seq) -> None:
        """``seq`` brings a random token tree in a step (its first row), then keeps a
        random path of it, or a prefix of one (:meth:`PageAllocator.accept`), sometimes
        with a fork made after the tree's step holding its pages (the accept copies
        them first; the fork, which holds the tree's drafts, is freed), then sometimes
        freed with its moves pending (they are dropped), often decoding on at once; a
        refused accept takes the whole tree back."""
        r, n = self.rng, int(self.rng.integers(2, 7))
        parents = random_tree(r, n, int(r.integers(1, 4)), int(r.integers(2, 4)))
        committed = len(self.inputs[seq])
        if not self.extend(seq, len(parents)):
            return
        self.step(first=seq, tree=parents)
        fork = self.fork(seq) if r.random() < 0.4 else None
        kept = path(parents, int(r.integers(0, len(parents))))
        if r.random() < 0.3:
            kept = kept[: int(r.integers(0, len(kept) + 1))]
        copies = len(self.alloc.pending_copies())
        if self._call("accept", seq, kept):
            self.orders["accept"] += bool(self.alloc.pending_moves())
            self.orders["accept copy"] += len(self.alloc.pending_copies()) > copies
            drafts = self.inputs[seq][committed:]
            self.inputs[seq][committed:] = [drafts[k] for k in kept]
            self.fed[seq], self.last[seq] = len(self.inputs[seq]), len(kept)
            if r.random() < 0.3:
                self.free(seq)
            elif r.random() < 0.6 and self.extend(seq, int(r.integers(1, 3))):
                self.step(first=seq)  # the kept path read, in place
        else:
            self.rewind(seq, len(parents))
        if fork:
            self.free(fork)

    # --- the moves of a program -----------------------------------------------------

    def some(self, written=False):
        pool = [s for s in self.inputs if not written or self.fed[s] == len(self.inputs[s])]
        return self.rng.choice(pool) if pool else None

    def move(self) -> None:
        kinds = ["allocate", "extend", "fork", "rewind", "free", "step", "chain", "early fork",
                 "reuse"]  # fmt: skip
        p = [0.12, 0.14, 0.1, 0.08, 0.06, 0.24, 0.1, 0.08, 0.08]
        if self.kind == "plain":  # token trees, and the accepted path
            kinds, p = [*kinds, "tree"], [x * 0.85 for x in p] + [0.15]
        if self.kind == "prefix":  # prompts that share prefixes, and pressure
            kinds = [*kinds, "shared prompt", "pressure", "rewrite"]
            p = [x * 0.6 for x in p] + [0.2, 0.1, 0.1]
        if self.kind == "window":  # sequences that grow past the window
            kinds, p = [*kinds, "grow"], [x * 0.75 for x in p] + [0.25]
        kind = self.rng.choice(kinds, p=p)
        self._move(kind)
        self.check_window()

    def _move(self, kind) -> None:
        r, seq = self.rng, self.some()
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
        elif kind == "shared prompt":  # an earlier prompt's prefix, then ids of its own
            space, ids = self.prompts[int(r.integers(0, len(self.prompts)))]
            ids = ids[: int(r.integers(0, len(ids) + 1))] + self._ids(int(r.integers(0, 4)))
            if r.random() < 0.5:  # a finished one makes room, its pages cached
                self.free(seq)
            self.allocate(len(ids), ids, space if r.random() < 0.8 else None)
        elif kind == "grow":  # a few steps of one or two tokens: past the window
            for _ in range(3):
                if seq not in self.inputs or not self.extend(seq, int(r.integers(1, 3))):
                    break
                self.step()
        elif kind == "rewrite":  # a cached page rewound into, written again, its old prompt
            ps = self.page_size
            into = [s for s in self.inputs if self.fed[s] == len(self.inputs[s])
                    and (len(self.inputs[s]) - self.last[s]) // ps < len(self.inputs[s]) // ps
                    and (len(self.inputs[s]) - self.last[s]) % ps]  # fmt: skip
            if not into:
                return
            seq = into[int(r.integers(0, len(into)))]
            old, space, back = list(self.inputs[seq]), self.space[seq], self.last[seq]
            if self.rewind(seq, back) and self.extend(seq, back):
                self.step(first=seq)
                self.free(seq)  # makes room; its pages stay cached
                again = self.allocate(len(old) + 1, [*old, 0], space)
                self.orders["rewritten"] += again is not None
        elif kind == "pressure":  # a long prompt, written (evictions), then an old one
            self.step(first=self.allocate(int(r.integers(TQ // 2, TQ + 1))))
            self._move("shared prompt")
        elif kind == "tree":
            written = self.some(written=True)
            if written is not None:
                self.tree(written)
        else:  # a pending copy's target freed, then another copy in the same window
            parent = self.some(written=True)
            child = parent and self.fork(parent)
            if child and self.extend(child, 1):
                self.free(child)
                other = self.fork(parent)
                if other:
                    self.extend(other, int(r.integers(1, 3)))


def _run(page_size: int, framework: str, programs: int, first_seed: int = 0, kind="plain"):
    orders = collections.Counter()
    for seed in range(first_seed, first_seed + programs):
        server = Server(page_size, framework, seed, kind)
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


@pytest.mark.parametrize("kind", ["prefix", "window"])
@pytest.mark.parametrize("page_size", [1, 3])
def test_random_programs_of_a_prefix_cache_and_a_windowed_layer(kind, page_size):
    """The same programs with prompts that share prefixes (hits, reusable hits,
    evictions, namespaces), or over a windowed layer and allocator (pages given back
    and reused): every token against its full forward, every hit and every entry -1
    against the model."""
    orders = _run(page_size, "linen", FAST_PROGRAMS, kind=kind)
    if page_size == 1:  # a page of one token: a rewind never lands inside one
        orders["rewritten"] += 1
    missed = [KIND_ORDERS[kind][o] for o in KIND_ORDERS[kind] if not orders[o]]
    assert not missed, f"the programs never reached: {missed} ({dict(orders)})"


@pytest.mark.slow  # the same programs, ten times as many: the fast test above covers each order
@pytest.mark.parametrize(
    "page_size, kind", [(ps, k) for k in sorted(KINDS) for ps in sorted(POOLS)
                        if k != "window" or ps in WINDOW_POOLS]
)  # fmt: skip
def test_a_long_profile_of_random_programs(page_size, kind):
    _run(page_size, "linen", LONG_PROGRAMS, first_seed=FAST_PROGRAMS, kind=kind)
