"""The full KV cache: position j in slot j, so a cache of S slots holds a row's first
S tokens and a call that would go past them is refused (``fit_rule``). A query
reads the slots below its row's end (``kv_lengths``), causally and within the
layer's window, as the core's own rules: the flash kernel then skips the blocks
outside the band."""

import dataclasses
from typing import ClassVar

import jax.numpy as jnp

from .. import positional
from .kv_cache import Rule
from .policy import SlotCache


@dataclasses.dataclass(frozen=True)
class FullCache(SlotCache):
    """The policy of a full cache for a layer with ``window`` (None or ``(left,
    right)``) and ``sink_tokens`` S0 (the first S0 positions stay visible)."""

    window: tuple[int, int] | None = None
    sink_tokens: int = 0

    name: ClassVar[str] = "full"
    wraps: ClassVar[bool] = False
    least_capacity: ClassVar[int] = 0
    least_capacity_rule: ClassVar[str] = "0"

    def check_capacity(self, capacity: int, hint: str) -> None:
        """Any capacity works: it is the longest sequence a row can take."""

    def chunk_limit(self, capacity: int) -> None:
        """None: a call may bring any number of tokens that fit (``fit_rule``)."""
        return None

    def fit_rule(self, position, lengths, chunk: int, capacity: int, hint: str) -> Rule:
        """A row fits while ``position[b] + lengths[b] <= capacity``."""
        return Rule(
            position + lengths > capacity,
            lambda b: (
                f"the KV cache is full: capacity {capacity}, row {b} is at position "
                f"{int(position[b])} and a chunk of length {chunk} brings {int(lengths[b])} real "
                f"tokens; {hint}"
            ),
        )

    def slot_at(self, position, capacity: int):
        """Slot j holds position j."""
        return jnp.asarray(position, jnp.int32)

    def read_rules(self, end, capacity: int, *, mask_fn, score_fn, tree=None,
                   start=None) -> dict:  # fmt: skip
        """Causal with ``kv_lengths=end`` (the slots at and past a row's end are never
        read), the window as the core's option (or, with sink tokens, as a mask_fn that
        keeps them), and the user's functions as given: a slot is its position. A token
        tree is the core's own rule (``tree_parents``, with ``q_offset`` the chunk's
        start): the chunk's keys sit in the slots after it, as the rule has them."""
        window_or_sink = positional.window_mask(self.window, self.sink_tokens)
        rules = dict(
            is_causal=True,
            kv_lengths=end,
            mask_fn=positional.and_masks(window_or_sink, mask_fn),
            score_fn=score_fn,
        )
        if not self.sink_tokens:
            rules["window"] = self.window
        if tree is not None:
            rules["tree_parents"] = tree.parents
        return rules

    def accept_rules(self, cache) -> tuple:
        """A row past the capacity is a rolling cache's (its ring): refused, since this
        policy reads slots as positions."""
        capacity = self.capacity(cache)
        return (
            Rule(
                cache.position > capacity,
                lambda b: (
                    f"accept: row {b} is at position {int(cache.position[b])}, past the "
                    f"cache's {capacity} slots: a rolling cache; pass the layer's config"
                ),
            ),
        )
