"""The key/value cache of decoding: three arrays in the ``"cache"`` collection.

``{"key": (B, S, K, H), "value": (B, S, K, H), "position": (B,) int32}``: S is
the capacity (the length of the input the cache was created with), and
``position[b]`` is the number of tokens row b holds, i.e. the position of its
next token. Slots at and past ``position[b]`` are never read, whatever they
hold.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

COLLECTION = "cache"


def cache_variables(
    module: nn.Module, batch: int, capacity: int, kv_heads: int, head_dim: int, dtype
):
    """Declares the cache of ``module``: (key, value, position) variables and ``fresh``.

    ``fresh`` is True when this call created the cache (``init``): it then
    holds zeros at position 0 and has capacity ``capacity``; otherwise the
    existing cache is returned and the sizes are ignored.
    """
    fresh = not module.has_variable(COLLECTION, "key")
    shape = (batch, capacity, kv_heads, head_dim)  # (B, S, K, H)
    key = module.variable(COLLECTION, "key", jnp.zeros, shape, dtype)
    value = module.variable(COLLECTION, "value", jnp.zeros, shape, dtype)
    position = module.variable(COLLECTION, "position", jnp.zeros, (batch,), jnp.int32)
    return key, value, position, fresh


def _concrete(x) -> bool:
    return not isinstance(x, jax.core.Tracer)


def check_chunk(position, lengths, chunk: int, capacity: int) -> None:
    """Raises ValueError for bad ``lengths`` or a write past the capacity, when concrete.

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
                f"{int(np.asarray(lengths)[b])} real tokens; create the cache with a longer "
                f"input (init with jnp.zeros((B, max_len, D)), decode=True)"
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
    steps = jnp.arange(L)
    slots = jnp.where(steps < lengths[:, None], position[:, None] + steps, S)  # (B, L)
    rows = jnp.arange(B)[:, None]  # (B, 1)
    return cache.at[rows, slots].set(new.astype(cache.dtype), mode="drop")
