r"""The slot arithmetic of a rolling (ring-buffer) KV cache with sink tokens.

A rolling cache of C slots keeps, for a windowed layer (``window=(W, 0)``), only
the keys still in view: the first ``sink_tokens`` positions (S0) in slots
0 .. S0 - 1 for good, and every later position j in slot
``S0 + (j - S0) mod (C - S0)``, overwriting the position ``C - S0`` before it.
After a row has taken positions 0 .. end - 1, slot s holds the newest position
that maps to it, or nothing:

.. math::

   \mathrm{pos}(s) = \begin{cases}
     s & s < S_0,\ s < \mathrm{end} \\
     j_s + (C - S_0) \left\lfloor \frac{\mathrm{end} - 1 - j_s}{C - S_0} \right\rfloor
       & s \ge S_0,\ j_s = s < \mathrm{end} \\
     -1 & \text{otherwise.}
   \end{cases}

A query at position p sees slot s iff ``0 <= pos(s) <= p`` and either
``p - pos(s) <= W`` or ``pos(s) < S0``. A chunk of L new tokens at positions
``end - L .. end - 1`` overwrites positions at most ``end - 1 - (C - S0)``, which
no query of the chunk may see when ``L <= C - W - S0`` (:func:`chunk_limit`); so
with chunks within that limit the cache loses nothing still in view, and a rewind
(``end`` moved back by at most the last chunk's length) leaves only slots whose
recomputed positions lie outside every later window.

:class:`RollingCache` is the cache policy (``nanoattn._layers.caches.policy``) built
on this arithmetic.
"""

import dataclasses
from typing import ClassVar

import jax.numpy as jnp

from .. import positional
from .kv_cache import Rule
from .policy import SlotCache
from .tree import chunk_view


def chunk_limit(capacity: int, window: int, sink_tokens: int) -> int:
    """The most tokens one call may write into a rolling cache: C - W - S0."""
    return capacity - window - sink_tokens


def slot_of(position, capacity: int, sink_tokens: int):
    """The slot (int32, the shape of ``position``) that holds ``position``."""
    position = jnp.asarray(position, jnp.int32)
    ring = capacity - sink_tokens
    return jnp.where(
        position < sink_tokens, position, sink_tokens + (position - sink_tokens) % ring
    )


def slot_positions(end, capacity: int, sink_tokens: int):
    """(B, C) int32: the position each slot holds after positions 0 .. end[b] - 1 were
    written, -1 for a slot never written. ``end``: (B,) int."""
    end = jnp.asarray(end, jnp.int32)[:, None]  # (B, 1)
    s = jnp.arange(capacity, dtype=jnp.int32)[None]  # (1, C)
    ring = capacity - sink_tokens
    laps = jnp.maximum(end - 1 - s, 0) // ring
    rolled = s + ring * laps
    held = jnp.where(s < sink_tokens, s, rolled)
    return jnp.where(s < end, held, -1)


@dataclasses.dataclass(frozen=True)
class RollingCache(SlotCache):
    """The policy of a rolling cache for a layer with ``window=(W, 0)`` and
    ``sink_tokens`` S0: a ring of C >= W + 1 + S0 slots, chunks of at most
    C - W - S0 tokens, and every rule of a query in one mask_fn over the positions
    the slots hold (recomputed from the row's end, :func:`slot_positions`)."""

    window: int
    sink_tokens: int = 0

    name: ClassVar[str] = "rolling"
    wraps: ClassVar[bool] = True
    least_capacity_rule: ClassVar[str] = "window + 1 + sink_tokens"

    @property
    def least_capacity(self) -> int:
        """W + 1 + S0: the sink tokens, a query's window and one new token."""
        return self.window + 1 + self.sink_tokens

    def check_capacity(self, capacity: int, hint: str) -> None:
        """Raises ValueError unless ``capacity`` >= W + 1 + S0."""
        need = self.least_capacity
        if capacity < need:
            raise ValueError(
                f"a rolling KV cache needs at least {self.least_capacity_rule} = {self.window} "
                f"+ 1 + {self.sink_tokens} = {need} slots, got {capacity}; {hint}"
            )

    def chunk_limit(self, capacity: int) -> int:
        """C - W - S0 (:func:`chunk_limit`): no query of the chunk loses a key it sees."""
        return chunk_limit(capacity, self.window, self.sink_tokens)

    def fit_rule(self, position, lengths, chunk: int, capacity: int, hint: str) -> Rule:
        """A row fits while ``lengths[b]`` is within the chunk limit; the ring never
        fills, so the position does not matter."""
        limit = self.chunk_limit(capacity)
        return Rule(
            lengths > limit,
            lambda b: (
                f"a rolling KV cache of {capacity} slots takes at most {limit} tokens per "
                f"call (capacity - window - sink_tokens), row {b} brings {int(lengths[b])}: they "
                f"would overwrite keys still in view; split the chunk or {hint}"
            ),
        )

    def slot_at(self, position, capacity: int):
        """The ring slot of :func:`slot_of`."""
        return slot_of(position, capacity, self.sink_tokens)

    def read_rules(self, end, capacity: int, *, mask_fn, score_fn, tree=None,
                   start=None) -> dict:  # fmt: skip
        """One mask_fn holds every rule: a query at p sees a slot iff the position it
        holds is causal and within the window, or a sink token
        (:func:`nanoattn._layers.positional.visible`), and the user's ``mask_fn``
        allows that position; ``score_fn`` sees it too. No core ``window``, which would
        read slot indices as positions; ``kv_lengths`` is ``min(end, C)``, the slots
        written so far (until the ring wraps, position j sits in slot j), so a step of
        a row that has not filled its ring reads only the blocks it holds. A token tree
        (:func:`tree_rules`) joins the same mask_fn: the ring's slots are no chunk the
        core's tree rule could find."""
        W, S0 = self.window, self.sink_tokens
        held = slot_positions(end, capacity, S0)  # (B, S), -1: never written
        if tree is not None:
            return tree_rules(held, tree, start, end, (W, S0, capacity), mask_fn, score_fn)

        def in_view(b, n, q_pos, k):
            return positional.visible(q_pos, held[b, k], W, S0)

        at_positions = positional.at_positions
        return dict(
            kv_lengths=jnp.minimum(end, capacity),
            mask_fn=positional.and_masks(in_view, at_positions(mask_fn, held, False)),
            score_fn=at_positions(score_fn, held, True),
        )


def tree_rules(held, tree, start, end, sizes: tuple, mask_fn, score_fn) -> dict:
    """A rolling cache's read rules for a step that brings a token tree: one mask_fn
    that reads each slot's position (``held`` (B, S)), places the chunk's tokens at
    their tree positions (:func:`~.tree.chunk_view`), lets a query see its ancestors
    only inside the chunk, and measures causality, the window, the sink tokens and the
    user's functions on tree positions. ``sizes``: the window W, the sink tokens S0
    and the capacity C."""
    window, sink_tokens, capacity = sizes
    view = chunk_view(tree, start)

    def in_view(b, n, q, k):
        q_pos, k_pos, _, seen = view(b, q, held[b, k])
        allowed = seen & positional.visible(q_pos, k_pos, window, sink_tokens)
        return allowed if mask_fn is None else allowed & mask_fn(b, n, q_pos, k_pos)

    def scores(score, b, n, q, k):
        q_pos, k_pos, _, _ = view(b, q, held[b, k])
        return score_fn(score, b, n, q_pos, k_pos)

    return dict(kv_lengths=jnp.minimum(end, capacity), mask_fn=in_view,
                score_fn=None if score_fn is None else scores)  # fmt: skip
