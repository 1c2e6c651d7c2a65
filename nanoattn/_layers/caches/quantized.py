"""Quantized KV caches (``AttentionConfig(kv_cache_dtype="int8" | "float8_e4m3fn")``):
what every kind of cache does differently when it stores its keys and values quantized.

The state says it: a quantized :class:`~.kv_cache.KVCache` holds keys and values of a
storage dtype and their scales, ``key_scales`` and ``value_scales``, shaped like the
keys without their last axis ((B, S, K) for a slot cache, (P, page_size, K) for a paged
pool); a float cache has None there. A step quantizes only its new tokens
(:func:`store`: each token's scale is written beside it, and no token already cached is
ever quantized again), and the attention reads the stored values with their scales
(:func:`read`), so the kernel dequantizes per block and no float copy of the cache is
made. Rewind moves positions only, so it works alike. A latent cache
(``LatentConfig(kv_cache_dtype=)``) goes through the same two functions: its values of
width 0 quantize to scale 0, and its attention reads the values, a slice of the keys,
with the keys' scales (``nanoattn._layers.latent``).
"""

import jax.numpy as jnp

from ..._base.quantized import storage_name
from ..._core.quantize import quantize_kv
from .kv_cache import KVCache, is_combined


def store(cache: KVCache, k, v, write) -> KVCache:
    """``cache`` with the new keys and values ``k``, ``v`` (..., L, K, H) written by
    ``write(array, new)`` (a kind's scatter into one array of the state, which takes
    keys (..., L, K, H), a combined pool's pairs (..., L, 2, K, H) and scales (..., L,
    K) alike); quantized first when the cache is, each token with its own scale."""
    if cache.key_scales is not None:
        dtype = storage_name(cache.key.dtype)
        (k, ks), (v, vs) = quantize_kv(k, dtype), quantize_kv(v, dtype)
        cache = cache._replace(key_scales=write(cache.key_scales, ks),
                               value_scales=write(cache.value_scales, vs))  # fmt: skip
    if is_combined(cache):  # each token's keys and values side by side
        return cache._replace(key=write(cache.key, jnp.stack([k, v], axis=-3)))
    return cache._replace(key=write(cache.key, k), value=write(cache.value, v))


def read(cache: KVCache, keys, values, dtype):
    """What a step's attention call reads of ``keys`` and ``values`` (the cache's, or a
    kind's view of them; a combined pool: ``keys`` the pool, ``values`` None):
    ``(keys, values, scales)``, with ``scales`` the keywords ``key_scales`` and
    ``value_scales`` of a quantized cache (the stored values as they are) or ``{}`` for
    a float cache (then keys and values in ``dtype``)."""
    if cache.key_scales is None:
        return keys.astype(dtype), None if values is None else values.astype(dtype), {}
    return keys, values, dict(key_scales=cache.key_scales, value_scales=cache.value_scales)
