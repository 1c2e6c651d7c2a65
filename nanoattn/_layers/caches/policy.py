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
* ``empty(batch, capacity, kv_heads, head_dim, dtype)``: a fresh cache.

The kinds: ``full.FullCache`` (position j in slot j) and ``rolling.RollingCache``
(a ring of slots that keeps the sink tokens); ``kinds.policy_of(config)`` picks a
layer's. Axis letters (docs/conventions.md): B batch, L chunk length, S capacity,
K key/value heads, H head width.
"""

import abc

import jax.numpy as jnp

from . import kv_cache
from .kv_cache import KVCache, Rule


class CachePolicy(abc.ABC):
    """What a kind of KV cache answers; see the module docstring. The concrete
    methods are the same for every kind so far; a kind overrides them when its state
    differs (a paged cache writes and reads through its page table)."""

    name: str  # "full", "rolling": for messages
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
    def fit_rule(self, position, lengths, chunk: int, capacity: int, hint: str) -> Rule:
        """The kind's own rule: the rows whose ``lengths[b]`` real tokens do not fit
        (past the capacity, or past the chunk limit), with the message naming one."""

    def broken_rows(self, position, lengths, chunk: int, capacity: int, hint: str = ""):
        """The rows a call may not serve: (B,) bool, computed once from one rule.

        ``position``, ``lengths``: (B,) int, numpy or jax; ``chunk``: L, the chunk
        length. A row is broken when ``lengths[b]`` is outside [0, L], the row is
        poisoned (negative position), or its tokens do not fit (:meth:`fit_rule`).
        Raises ValueError naming the first broken row of the first part of the rule
        whose inputs are concrete; returns the broken rows otherwise (traced under
        ``jit``, where the caller poisons them: NaN now and in every later call).
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
        ]
        return kv_cache.broken(rules)

    @abc.abstractmethod
    def slots(self, start, chunk: int, capacity: int):
        """(B, L) int32: the slots of positions ``start[b] + 0 .. L - 1``."""

    def write(self, cache: KVCache, k, v, start, lengths) -> KVCache:
        """``cache`` with the first ``lengths[b]`` keys and values of ``k``, ``v``
        (B, L, K, H) written at positions ``start[b]`` onwards (:meth:`slots`); padded
        tokens and slots past the capacity are never written."""
        slots = self.slots(start, k.shape[1], self.capacity(cache))
        return cache._replace(
            key=kv_cache.scatter(cache.key, k, slots, lengths),
            value=kv_cache.scatter(cache.value, v, slots, lengths),
        )

    @abc.abstractmethod
    def read_rules(self, end, capacity: int, *, mask_fn, score_fn) -> dict:
        """The core's rules of the call (``is_causal``, ``kv_lengths``, ``window``,
        ``mask_fn``, ``score_fn``) under which a query at position ``q_offset + t``
        reads only the slots it may see, once each row holds positions
        ``0 .. end[b] - 1``: causal, within the layer's window (or a sink token), and
        allowed by the user's ``mask_fn``; ``mask_fn`` and ``score_fn`` are called
        with each key's position, whatever slot holds it."""

    def read(self, cache: KVCache, end, *, mask_fn, score_fn):
        """(keys (B, S, K, H), values (B, S, K, H), the core rules of
        :meth:`read_rules`): what the core attention call of a decoding step reads."""
        rules = self.read_rules(end, self.capacity(cache), mask_fn=mask_fn, score_fn=score_fn)
        return cache.key, cache.value, rules

    def poison(self, cache: KVCache, bad) -> KVCache:
        """The rows ``bad`` poisoned: position -1 and last 0 (``kv_cache.poison``)."""
        return kv_cache.poison(cache, bad)

    def rewind(self, cache: KVCache, n) -> KVCache:
        """Each row b moved back by ``n[b]`` tokens (``kv_cache.rewind``)."""
        return kv_cache.rewind(cache, n)

    def empty(self, batch: int, capacity: int, kv_heads: int, head_dim: int, dtype) -> KVCache:
        """A fresh cache of ``capacity`` slots, every row at position 0."""
        return kv_cache.empty(batch, capacity, kv_heads, head_dim, dtype)


def positions(start, chunk: int):
    """(B, L) int32: the positions ``start[b] + 0 .. L - 1`` of a chunk's tokens."""
    return jnp.asarray(start)[:, None] + jnp.arange(chunk)[None, :]
