"""The cache policy: the small set of questions every kind of KV cache answers, so
that the decoding step (``nanoattn._layers.steps.decode``), the modules and
``nanoattn.verify.decoders`` ask the policy and never branch on the kind.

The state is the same pytree for every kind (``kv_cache.KVCache``); the policy says
what it means:

* capacity: ``capacity(cache)``, ``least_capacity`` (and in words,
  ``least_capacity_rule``), ``check_capacity(capacity, hint)``, and ``wraps``:
  whether decoding goes on past the capacity (a ring);
* ``chunk_limit(capacity)``: the most real tokens one call may bring per row, or
  None when only the capacity bounds them;
* ``broken_rows(position, lengths, chunk, capacity, hint)``: the one validity rule
  of a call (lengths in [0, L], the row not poisoned, and the kind's own
  ``fit_rule``), computed once: raised as a one-line ValueError naming the row when
  its inputs are concrete, returned as (B,) bool rows to poison under ``jit``;
* ``write(cache, k, v, start, lengths)``: the chunk into the slots of ``slots``;
* ``read(cache, end, mask_fn=, score_fn=)``: the keys, values and core rules
  (``read_rules``) that let a query read only the slots it may see, with the
  user's ``mask_fn`` and ``score_fn`` seeing key positions, not slots;
* ``poison(cache, bad)`` and ``rewind(cache, n)``: one marker for every kind
  (position ``kv_cache.POISONED``, -1), one rewind;
* ``empty(batch, capacity, kv_heads, head_dim, dtype)``: a fresh cache (quantized
  for a storage dtype: the writes quantize the new tokens and the reads hand the
  kernel their scales, :mod:`.quantized`).

A decoding step (``steps.decode``) asks four questions of every kind and nothing
else: ``prepare`` (where the chunk's tokens sit, which are real, which the call
cannot serve: a :class:`StepLayout`), ``write_step``, ``attention`` (the core call
that reads only what each query may see) and ``advance``.

The kinds: ``full.FullCache`` (position j in slot j) and ``rolling.RollingCache``
(a ring of slots that keeps the sink tokens), both :class:`SlotCache` (a row of
slots per batch row); ``paged.PagedCache`` (a pool of pages shared by every
sequence, read through a page table kept on the host by a ``PageAllocator``);
``kinds.policy_of(config)`` picks a layer's. Axis letters (docs/conventions.md):
B batch, L chunk length, S capacity, K key/value heads, H head width.
"""

import abc
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from ..._base.validate import expect_shape
from . import kv_cache, quantized
from .accept import accept_path
from .kv_cache import KVCache, Rule
from .tree import slot_tree


class StepLayout(NamedTuple):
    """Where a decoding step's tokens sit, as its cache policy says (:meth:`prepare`).

    Attributes:
      positions: int32 (B, L): each token's position (what RoPE rotates by).
      real: bool (B, L): the tokens that are written, whose outputs are kept (the
        others' are zeros).
      broken: bool (B, L): the tokens of rows the call cannot serve (only under
        ``jit``, where that cannot raise): their outputs are NaN.
      start, lengths: int32 (B,) each, a slot cache's: the first position of each
        row's chunk and its real tokens; None for a paged cache.
      pages: a paged cache's :class:`~nanoattn._layers.caches.paged.PagedBatch`;
        None otherwise.
      tree: None, or the step's token tree (:mod:`.tree`): a slot cache's
        :class:`~.tree.ChunkTree`, a paged cache's :class:`~.tree.PagedTree`; then
        ``positions`` are the tokens' tree positions (committed + depth).
    """

    positions: jax.Array
    real: jax.Array
    broken: jax.Array
    start: jax.Array | None = None
    lengths: jax.Array | None = None
    pages: Any = None  # a PagedBatch (paged.py, which builds on this module)
    tree: Any = None  # a ChunkTree or a PagedTree


class CachePolicy(abc.ABC):
    """What a kind of KV cache answers; see the module docstring."""

    name: str  # "full", "rolling", "paged": for messages
    wraps: bool  # decoding goes on past the capacity: a row's position may exceed it
    least_capacity: int  # the fewest slots the cache works with
    least_capacity_rule: str  # what least_capacity is made of, in words, for messages

    def capacity(self, cache: KVCache) -> int:
        """The capacity of ``cache``: its slots per row, S."""
        return cache.key.shape[1]

    @abc.abstractmethod
    def check_capacity(self, capacity: int, hint: str) -> None:
        """Raises ValueError unless a cache of ``capacity`` works; ``hint`` ends the
        message (how to create a larger cache)."""

    @abc.abstractmethod
    def chunk_limit(self, capacity: int) -> int | None:
        """The most real tokens one call may bring per row, or None when only the
        capacity bounds them (``fit_rule``)."""

    @abc.abstractmethod
    def prepare(self, cache: KVCache, shape, *, lengths, pages, hint: str,
                tree_parents=None) -> StepLayout:  # fmt: skip
        """The :class:`StepLayout` of a step of a chunk of ``shape`` (B, L, D), after
        checking the call: ``lengths`` (B,) of a slot cache, or ``pages`` of a paged
        one, and ``tree_parents`` (B, L) int32 or None, a token tree (:mod:`.tree`).
        Raises ValueError naming the row when the call is invalid and concrete."""

    @abc.abstractmethod
    def write_step(self, cache: KVCache, k, v, layout: StepLayout) -> KVCache:
        """``cache`` with the real tokens' keys and values (B, L, K, H) written."""

    @abc.abstractmethod
    def attention(self, cache: KVCache, layout: StepLayout, q, *, dense, paged, mask,
                  mask_fn, score_fn):  # fmt: skip
        """The per-head output (B, L, N, H) of the queries q (B, L, N, H) over what the
        cache holds, each reading only what it may see: through ``dense(q, keys,
        values, **rules)`` (the core's ``dot_product_attention``) or ``paged(q,
        key_pages, value_pages, pages, **rules)`` (``paged_attention``), whichever the
        kind's state needs; ``mask_fn`` and ``score_fn`` see positions."""

    @abc.abstractmethod
    def advance(self, cache: KVCache, layout: StepLayout) -> KVCache:
        """``cache`` after the step: each row's position moved on by its real tokens,
        the rows that could not be served poisoned (a kind whose positions are kept on
        the host returns it as it is)."""

    def poison(self, cache: KVCache, bad) -> KVCache:
        """The rows ``bad`` poisoned: position -1 and last 0 (``kv_cache.poison``)."""
        return kv_cache.poison(cache, bad)

    def rewind(self, cache: KVCache, n) -> KVCache:
        """Each row b moved back by ``n[b]`` tokens (``kv_cache.rewind``)."""
        return kv_cache.rewind(cache, n)

    @abc.abstractmethod
    def accept(self, cache: KVCache, kept) -> KVCache:
        """Each row keeps its last call's tokens at the indices ``kept[b]`` (int (B, A),
        a root-to-leaf path of its tree in order, then -1s), their keys and values
        moved into the slots of positions ``start .. start + m - 1``; the rest taken
        back as :meth:`rewind` does (:mod:`.accept`)."""

    def empty(self, batch: int, capacity: int, kv_heads: int, head_dim: int, dtype,
              value_dim: int | None = None) -> KVCache:  # fmt: skip
        """A fresh cache of ``capacity`` slots, every row at position 0; values of width
        ``value_dim`` (None: ``head_dim``)."""
        return kv_cache.empty(batch, capacity, kv_heads, head_dim, dtype, value_dim)


class SlotCache(CachePolicy):
    """A cache of one row of S slots per batch row (the full and the rolling kinds):
    a row's position lives in the cache, and its own questions say which slot holds
    which position (:meth:`slots`) and what a query may read (:meth:`read_rules`)."""

    @abc.abstractmethod
    def fit_rule(self, position, lengths, chunk: int, capacity: int, hint: str) -> Rule:
        """The kind's own rule: the rows whose ``lengths[b]`` real tokens do not fit
        (past the capacity, or past the chunk limit), with the message naming one."""

    def broken_rows(self, position, lengths, chunk: int, capacity: int, hint: str = "",
                    extra=()):  # fmt: skip
        """The rows a call may not serve: (B,) bool, computed once from one rule.

        ``position``, ``lengths``: (B,) int, numpy or jax; ``chunk``: L, the chunk
        length. A row is broken when ``lengths[b]`` is outside [0, L], the row is
        poisoned (negative position), or its tokens do not fit (:meth:`fit_rule`).
        Raises ValueError naming the first broken row of the first part of the rule
        whose inputs are concrete; returns the broken rows otherwise (traced under
        ``jit``, where the caller poisons them: NaN now and in every later call).
        ``extra``: more :class:`~.kv_cache.Rule` s (a token tree's), checked last.
        """
        rules = [
            Rule(
                (lengths < 0) | (lengths > chunk),
                lambda b: (
                    f"lengths must be in [0, {chunk}] (the chunk length), got "
                    f"lengths[{b}]={int(lengths[b])}"
                ),
            ),
            Rule(
                position < 0,
                lambda b: (
                    f"row {b} of the KV cache is poisoned (position {int(position[b])}) "
                    f"by an invalid call or rewind under jit; reset it (position and last 0)"
                ),
            ),
            self.fit_rule(position, lengths, chunk, capacity, hint),
            *extra,
        ]
        return kv_cache.broken(rules)

    @abc.abstractmethod
    def slot_at(self, position, capacity: int):
        """The slot (int32, the shape of ``position``) that holds ``position``."""

    def slots(self, start, chunk: int, capacity: int):
        """(B, L) int32: the slots of positions ``start[b] + 0 .. L - 1``."""
        return self.slot_at(positions(start, chunk), capacity)

    def write(self, cache: KVCache, k, v, start, lengths) -> KVCache:
        """``cache`` with the first ``lengths[b]`` keys and values of ``k``, ``v``
        (B, L, K, H) written at positions ``start[b]`` onwards (:meth:`slots`); padded
        tokens and slots past the capacity are never written."""
        slots = self.slots(start, k.shape[1], self.capacity(cache))
        return quantized.store(cache, k, v, lambda x, new: kv_cache.scatter(x, new, slots, lengths))

    @abc.abstractmethod
    def read_rules(self, end, capacity: int, *, mask_fn, score_fn, tree=None,
                   start=None) -> dict:  # fmt: skip
        """The core's rules of the call (``is_causal``, ``kv_lengths``, ``window``,
        ``mask_fn``, ``score_fn``, ``tree_parents``) under which a query at position
        ``q_offset + t`` reads only the slots it may see, once each row holds positions
        ``0 .. end[b] - 1``: causal, within the layer's window (or a sink token), and
        allowed by the user's ``mask_fn``; ``mask_fn`` and ``score_fn`` are called
        with each key's position, whatever slot holds it. With ``tree`` (a
        :class:`~.tree.ChunkTree` of the chunk from ``start`` (B,)), every rule is
        measured on tree positions and a query sees its ancestors only in the chunk."""

    def read(self, cache: KVCache, end, *, mask_fn, score_fn, tree=None, start=None):
        """(keys (B, S, K, H), values (B, S, K, H), the core rules of
        :meth:`read_rules`): what the core attention call of a decoding step reads; a
        combined cache's keys (B, S, 2, K, H) and None."""
        tree = {} if tree is None else dict(tree=tree, start=start)  # a kind without trees
        rules = self.read_rules(end, self.capacity(cache), mask_fn=mask_fn, score_fn=score_fn,
                                **tree)  # fmt: skip
        return cache.key, kv_cache.values_of(cache), rules

    def prepare(self, cache: KVCache, shape, *, lengths, pages, hint: str,
                tree_parents=None) -> StepLayout:  # fmt: skip
        """Rows of B (the cache's), each bringing its first ``lengths[b]`` (default L)
        tokens at its position, or at ``position + depth`` with ``tree_parents``; a
        row the call cannot serve (:meth:`broken_rows`, a bad tree included) writes
        nothing and is broken."""
        B, L, _ = shape
        if pages is not None:
            raise ValueError(
                f"pages= is for a paged KV cache (AttentionConfig(page_size=...)); this "
                f"layer's cache is {self.name}: pass lengths= for ragged rows"
            )
        expect_shape("x", shape, "B T D", (cache.position.shape[0], None, shape[2]))
        capacity = self.capacity(cache)
        self.check_capacity(capacity, hint)
        if lengths is None:
            lengths = jnp.full((B,), L, jnp.int32)
        tree, extra = None, ()
        if tree_parents is not None:
            tree, rule = slot_tree(tree_parents, jnp.arange(L)[None, :] < lengths[:, None])
            extra = (rule,)
        bad = self.broken_rows(cache.position, lengths, L, capacity, hint, extra)  # or raises
        lengths = jnp.where(bad, 0, lengths).astype(jnp.int32)  # a broken row writes nothing
        start = jnp.maximum(cache.position, 0).astype(jnp.int32)
        real = jnp.arange(L)[None, :] < lengths[:, None]  # (B, L)
        broken = jnp.broadcast_to(jnp.asarray(bad)[:, None], (B, L))
        at = positions(start, L) if tree is None else start[:, None] + tree.depth
        return StepLayout(at, real, broken, start, lengths, tree=tree)

    def write_step(self, cache: KVCache, k, v, layout: StepLayout) -> KVCache:
        """:meth:`write` at the rows' starts."""
        return self.write(cache, k, v, layout.start, layout.lengths)

    def attention(self, cache: KVCache, layout: StepLayout, q, *, dense, paged, mask,
                  mask_fn, score_fn):  # fmt: skip
        """``dense`` over the whole row of slots, under :meth:`read_rules`, the queries
        at their rows' positions (``q_offset`` per row)."""
        end = layout.start + layout.lengths
        keys, values, rules = self.read(cache, end, mask_fn=mask_fn, score_fn=score_fn,
                                        tree=layout.tree, start=layout.start)  # fmt: skip
        keys, values, scales = quantized.read(cache, keys, values, q.dtype)
        return dense(q, keys, values, mask=mask, q_offset=layout.start, **rules, **scales)

    def advance(self, cache: KVCache, layout: StepLayout) -> KVCache:
        """Each row at its end, ``last`` its real tokens; the broken rows poisoned."""
        end = layout.start + layout.lengths
        advanced = cache._replace(position=end.astype(jnp.int32), last=layout.lengths)
        return self.poison(advanced, layout.broken[:, 0])

    def accept(self, cache: KVCache, kept) -> KVCache:
        """:func:`.accept.accept_path` through this kind's slots."""
        return accept_path(cache, kept, lambda p: self.slot_at(p, self.capacity(cache)),
                           self.accept_rules(cache))  # fmt: skip

    def accept_rules(self, cache: KVCache) -> tuple:
        """More :class:`~.kv_cache.Rule` s of an accept on this kind (none)."""
        return ()


def positions(start, chunk: int):
    """(B, L) int32: the positions ``start[b] + 0 .. L - 1`` of a chunk's tokens."""
    return jnp.asarray(start)[:, None] + jnp.arange(chunk)[None, :]
