"""Keeping the accepted path of a token tree in a slot cache (speculative decoding,
docs/decoding.md "Speculative trees").

A tree step writes its drafts' keys in the next slots, in the chunk's order; once the
caller knows which drafts to keep (a root-to-leaf path, ``kept``), :func:`accept_path`
moves their keys and values to the slots of the positions they stand for, in order,
and takes the rest back as a rewind does: the row's position becomes ``start + m``
(``start``: where the last call began; m the tokens kept) and ``last`` m. The moves
happen at once (every moved row is read before any is written), with the scales of a
quantized cache; a kind's slots come from its policy (a full cache: slot = position; a
rolling one: its ring). Axis letters: B rows, S slots, T a call's tokens.
"""

import jax.numpy as jnp
import numpy as np

from ..._base.validate import as_array, expect_integer, expect_shape
from . import kv_cache
from .kv_cache import KVCache, Rule

STATE = ("key", "value", "key_scales", "value_scales")  # the arrays with a slot axis


def kept_indices(kept, batch: int):
    """``kept`` as int32 (B, A), checked for its type and shape."""
    kept = as_array("kept", kept, "an int array (B, T): each row's kept indices, then -1s")
    expect_integer("kept", kept.dtype)
    expect_shape("kept", kept.shape, "B T", (batch, None))
    return kept.astype(jnp.int32)


def path_rule(kept, last) -> Rule:
    """The rows whose ``kept`` is no path of their last call's tokens: an index outside
    [0, last[b]) (or below -1), not increasing, or after a -1."""
    earlier = jnp.pad(kept, ((0, 0), (1, 0)), constant_values=-1)[:, :-1]  # kept[b, m - 1]
    first = jnp.arange(kept.shape[1])[None] == 0
    after_gap = (kept >= 0) & (earlier < 0) & ~first
    backwards = (kept >= 0) & (earlier >= 0) & (kept <= earlier)
    bad = (kept < -1) | (kept >= last[:, None]) | after_gap | backwards  # (B, A)

    def message(b: int) -> str:
        m = int(np.flatnonzero(np.asarray(bad[b]))[0])
        n = int(last[b])
        return (
            f"accept: kept[{b}, {m}]={int(kept[b, m])}: a row keeps indices of its last "
            f"call's {n} tokens, in [0, {n}), increasing (a root-to-leaf path, in order), "
            f"then -1s"
        )

    return Rule(bad.any(axis=1), message)


def accept_path(cache: KVCache, kept, slot_at, extra=()) -> KVCache:
    """``cache`` with each row b keeping the tokens ``kept[b, :m]`` (int (B, A), then
    -1s) of its last call, moved into the slots of positions ``start .. start + m -
    1`` (``slot_at(position) -> slot``), the rest taken back.

    Raises ValueError naming the row when ``kept`` is concrete and no path (an index
    outside the last call's tokens, not increasing, after a -1), or an ``extra`` rule
    breaks; under ``jit`` such a row is poisoned (NaN outputs until reset), as a
    poisoned row stays."""
    B = cache.position.shape[0]
    kept = kept_indices(kept, B)
    bad = kv_cache.broken([path_rule(kept, cache.last), *extra]) | (cache.position < 0)
    m = jnp.arange(kept.shape[1], dtype=jnp.int32)[None]  # (1, A)
    count = (kept >= 0).sum(axis=1).astype(jnp.int32)  # (B,)
    start = cache.position - cache.last
    source = slot_at(start[:, None] + jnp.maximum(kept, 0))  # (B, A)
    moved = (m < count[:, None]) & (kept != m) & ~jnp.asarray(bad)[:, None]
    S = cache.key.shape[1]
    target = jnp.where(moved, slot_at(start[:, None] + m), S)  # S: dropped
    rows = jnp.arange(B)[:, None]
    arrays = {}
    for name in STATE:
        x = getattr(cache, name)
        if x is not None and x.ndim > 1:  # every moved row is read before any is written
            # (a combined cache's empty value has no slots)
            arrays[name] = x.at[rows, target].set(x[rows, source], mode="drop")
    accepted = cache._replace(position=(start + count).astype(jnp.int32), last=count, **arrays)
    return kv_cache.poison(accepted, bad)
