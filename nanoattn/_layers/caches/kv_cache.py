"""The key/value cache of decoding, independent of the module framework.

A cache is four arrays, ``{"key": (B, S, K, H), "value": (B, S, K, H),
"position": (B,) int32, "last": (B,) int32}``: S is the capacity,
``position[b]`` is the number of tokens row b has taken, i.e. the position of
its next token, and ``last[b]`` how many of them its last call brought (what
:func:`rewind` may take back). A full cache holds position j in slot j, and
slots at and past ``position[b]`` are never read, whatever they hold. A
rolling cache (``AttentionConfig(rolling_cache=True)``, ``nanoattn._layers.caches.rolling``)
holds position j in slot ``rolling.slot_of(j, S, S0)`` and reads only the
slots whose recomputed positions a query may see. A row whose position is
negative is poisoned (an invalid call or rewind under ``jit``): its outputs are
NaN until it is reset. The linen modules keep the cache in the ``"cache"``
collection, the NNX modules in ``nnx.Cache`` variables; both advance it with
:func:`decode` of ``nanoattn._layers.steps``.
"""

from collections.abc import Mapping
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from . import rolling


class KVCache(NamedTuple):
    """key, value: (B, S, K, H); position: (B,) int32, the tokens each row has taken;
    last: (B,) int32, the tokens each row took in its last call."""

    key: jax.Array
    value: jax.Array
    position: jax.Array
    last: jax.Array


def empty(batch: int, capacity: int, kv_heads: int, head_dim: int, dtype) -> KVCache:
    """A cache of capacity S = ``capacity`` with every row at position 0."""
    shape = (batch, capacity, kv_heads, head_dim)  # (B, S, K, H)
    zeros = jnp.zeros(shape, dtype)
    rows = jnp.zeros((batch,), jnp.int32)
    return KVCache(zeros, zeros, rows, rows)


def check_rolling_capacity(capacity: int, window: int, sink_tokens: int, hint: str) -> None:
    """Raises ValueError unless a rolling cache of ``capacity`` slots holds the sink
    tokens, a query's window and at least one new token: C >= W + 1 + S0."""
    need = window + 1 + sink_tokens
    if capacity < need:
        raise ValueError(
            f"a rolling KV cache needs at least window + 1 + sink_tokens = {window} + 1 + "
            f"{sink_tokens} = {need} slots, got {capacity}; {hint}"
        )


def _concrete(x) -> bool:
    return not isinstance(x, jax.core.Tracer)


def check_chunk(
    position, lengths, chunk: int, capacity: int, hint: str, limit: int | None = None
) -> None:
    """Raises ValueError for bad ``lengths``, a poisoned row, or a write past the
    capacity (a full cache) or past the chunk limit ``limit`` (a rolling cache, which
    never fills), when concrete.

    ``hint`` ends the overflow message: how to create a larger cache.

    Under ``jit`` (traced values) nothing can be checked here; the caller
    turns the same rows into NaN instead (:func:`broken_rows`).
    """
    if _concrete(lengths):
        bad = np.flatnonzero((np.asarray(lengths) < 0) | (np.asarray(lengths) > chunk))
        if bad.size:
            b = int(bad[0])
            raise ValueError(
                f"lengths must be in [0, {chunk}] (the chunk length), got lengths[{b}]="
                f"{int(np.asarray(lengths)[b])}"
            )
    if _concrete(position):
        bad = np.flatnonzero(np.asarray(position) < 0)
        if bad.size:
            b = int(bad[0])
            raise ValueError(
                f"row {b} of the KV cache is poisoned (position {int(np.asarray(position)[b])}) "
                f"by an invalid call or rewind under jit; reset it (position and last 0)"
            )
    if limit is not None:
        if _concrete(lengths):
            bad = np.flatnonzero(np.asarray(lengths) > limit)
            if bad.size:
                b = int(bad[0])
                raise ValueError(
                    f"a rolling KV cache of {capacity} slots takes at most {limit} tokens per "
                    f"call (capacity - window - sink_tokens), row {b} brings "
                    f"{int(np.asarray(lengths)[b])}: they would overwrite keys still in view; "
                    f"split the chunk or {hint}"
                )
        return
    if _concrete(position) and _concrete(lengths):
        ends = np.asarray(position) + np.asarray(lengths)
        bad = np.flatnonzero(ends > capacity)
        if bad.size:
            b = int(bad[0])
            raise ValueError(
                f"the KV cache is full: capacity {capacity}, row {b} is at position "
                f"{int(np.asarray(position)[b])} and a chunk of length {chunk} brings "
                f"{int(np.asarray(lengths)[b])} real tokens; {hint}"
            )


def broken_rows(position, lengths, chunk: int, capacity: int, limit: int | None = None):
    """(B,) bool, under ``jit`` too: the rows :func:`check_chunk` would refuse (bad
    ``lengths``, poisoned, past the capacity or past the rolling chunk limit)."""
    broken = (lengths < 0) | (lengths > chunk) | (position < 0)
    if limit is None:
        return broken | (position + lengths > capacity)
    return broken | (lengths > limit)


def write(cache, new, position, lengths, sink_tokens: int | None = None):
    """Writes the first ``lengths[b]`` rows of ``new[b]`` at positions ``position[b]``
    onwards: in slots ``position[b] + t`` (a full cache), or in the ring slots of
    ``rolling.slot_of`` when ``sink_tokens`` is given (a rolling cache).

    cache: (B, S, K, H); new: (B, L, K, H); position, lengths: (B,) int.
    A scatter that drops out-of-range writes: padded tokens (index >=
    ``lengths[b]``) and tokens past the capacity are never written. (A
    ``dynamic_update_slice`` would clamp the start index and silently
    overwrite the last slots instead.)
    """
    B, S = cache.shape[:2]
    L = new.shape[1]
    steps = jnp.arange(L)[None, :]  # (1, L)
    slots = position[:, None] + steps  # (B, L)
    if sink_tokens is not None:
        slots = rolling.slot_of(slots, S, sink_tokens)
    slots = jnp.where(steps < lengths[:, None], slots, S)  # (B, L); S: dropped
    rows = jnp.arange(B)[:, None]  # (B, 1)
    return cache.at[rows, slots].set(new.astype(cache.dtype), mode="drop")


def rewind(cache: KVCache, n) -> KVCache:
    """Moves each row b back by ``n[b]`` tokens, 0 <= n[b] <= ``cache.last[b]``.

    ``n``: an int or (B,) int. Raises ValueError when ``n`` is concrete and out of
    range; under ``jit`` such a row is poisoned instead (position -1: NaN outputs
    until it is reset). Nothing is erased: the slots past the new position are never
    read again (a full cache reads slots below the position only; a rolling cache's
    rewound slots recompute to positions outside every later window, because a call
    writes at most C - W - S0 tokens, docs/decoding.md). ``last`` becomes
    ``last - n``, so rewinding again stays within the same call.
    """
    B = cache.position.shape[0]
    n = jnp.asarray(n)
    if not jnp.issubdtype(n.dtype, jnp.integer):
        raise TypeError(f"n must be an integer array, got dtype {n.dtype}")
    if n.ndim == 0:
        n = jnp.broadcast_to(n, (B,))
    if n.shape != (B,):
        raise ValueError(f"n must have shape (B,) = ({B},), got {n.shape}")
    if _concrete(n) and _concrete(cache.last):
        last, m = np.asarray(cache.last), np.asarray(n)
        bad = np.flatnonzero((m < 0) | (m > last))
        if bad.size:
            b = int(bad[0])
            raise ValueError(
                f"rewind: n[{b}]={int(m[b])} is outside [0, {int(last[b])}], the tokens row "
                f"{b} took in its last call"
            )
    n = n.astype(jnp.int32)
    bad = (n < 0) | (n > cache.last) | (cache.position < 0)
    position = jnp.where(bad, -1, cache.position - n)
    last = jnp.where(bad, 0, cache.last - n)
    return KVCache(cache.key, cache.value, position.astype(jnp.int32), last.astype(jnp.int32))


def is_cache(tree) -> bool:
    """Whether ``tree`` is one layer's cache: a mapping of exactly the KVCache fields."""
    return isinstance(tree, Mapping) and set(tree) == set(KVCache._fields)


def cache_bytes(tree) -> dict[str, int]:
    """The bytes of each layer's cache in a ``"cache"`` collection (nested mappings).

    Returns ``{"path/to/layer": bytes}`` (the path joined with ``/``; ``""`` for a
    lone layer's cache): every array of the layer's cache, i.e.
    ``2 * B * S * K * H * itemsize`` for keys and values plus ``8 * B`` for
    ``position`` and ``last``. Works on shapes too (``jax.eval_shape``'s output).
    """
    found = {}

    def visit(node, path):
        if is_cache(node):
            found["/".join(path)] = sum(
                int(np.prod(a.shape)) * jnp.dtype(a.dtype).itemsize for a in node.values()
            )
        elif isinstance(node, Mapping):
            for name, child in node.items():
                visit(child, (*path, str(name)))

    visit(tree, ())
    return found
