"""The key/value cache of decoding, independent of the module framework.

A cache is three arrays, ``{"key": (B, S, K, H), "value": (B, S, K, H),
"position": (B,) int32}``: S is the capacity, and ``position[b]`` is the
number of tokens row b holds, i.e. the position of its next token. Slots at
and past ``position[b]`` are never read, whatever they hold. The linen modules
keep it in the ``"cache"`` collection, the NNX modules in ``nnx.Cache``
variables; both advance it with :func:`decode` of ``nanoattn._layer``.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np


class KVCache(NamedTuple):
    """key, value: (B, S, K, H); position: (B,) int32, the tokens each row holds."""

    key: jax.Array
    value: jax.Array
    position: jax.Array


def empty(batch: int, capacity: int, kv_heads: int, head_dim: int, dtype) -> KVCache:
    """A cache of capacity S = ``capacity`` with every row at position 0."""
    shape = (batch, capacity, kv_heads, head_dim)  # (B, S, K, H)
    zeros = jnp.zeros(shape, dtype)
    return KVCache(zeros, zeros, jnp.zeros((batch,), jnp.int32))


def _concrete(x) -> bool:
    return not isinstance(x, jax.core.Tracer)


def check_chunk(position, lengths, chunk: int, capacity: int, hint: str) -> None:
    """Raises ValueError for bad ``lengths`` or a write past the capacity, when concrete.

    ``hint`` ends the overflow message: how to create a larger cache.

    Under ``jit`` (traced values) nothing can be checked here; the caller
    turns overflowing rows into NaN instead.
    """
    if _concrete(lengths):
        bad = np.flatnonzero((np.asarray(lengths) < 0) | (np.asarray(lengths) > chunk))
        if bad.size:
            b = int(bad[0])
            raise ValueError(
                f"lengths must be in [0, {chunk}] (the chunk length), got lengths[{b}]="
                f"{int(np.asarray(lengths)[b])}"
            )
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


def write(cache, new, position, lengths):
    """Writes the first ``lengths[b]`` rows of ``new[b]`` at ``position[b]`` onwards.

    cache: (B, S, K, H); new: (B, L, K, H); position, lengths: (B,) int.
    A scatter that drops out-of-range writes: padded tokens (index >=
    ``lengths[b]``) and tokens past the capacity are never written. (A
    ``dynamic_update_slice`` would clamp the start index and silently
    overwrite the last slots instead.)
    """
    B, S = cache.shape[:2]
    L = new.shape[1]
    steps = jnp.arange(L)[None, :]  # (1, L)
    slots = jnp.where(steps < lengths[:, None], position[:, None] + steps, S)  # (B, L)
    rows = jnp.arange(B)[:, None]  # (B, 1)
    return cache.at[rows, slots].set(new.astype(cache.dtype), mode="drop")
