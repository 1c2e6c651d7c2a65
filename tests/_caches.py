"""A layer cache's keys and values, whatever its layout: two arrays (..., K, H), or one
combined array (..., 2, K, H) with an empty "value" (nanoattn._layers.caches.kv_cache's
``is_combined``: an attention layer's cache where a token's keys and values take at
most 4 KiB)."""

import numpy as np


def halves(cache) -> dict:
    """``{"key": ..., "value": ...}``, each (..., K, H), of a cache (a mapping or a
    KVCache)."""
    key, value = (
        getattr(cache, n) if hasattr(cache, "_fields") else cache[n] for n in ("key", "value")
    )
    if np.ndim(key) == 5:
        return {"key": key[:, :, 0], "value": key[:, :, 1]}
    return {"key": key, "value": value}


def slot_mask(mask, array):
    """A (B, S) mask (or one of a pool's (P, page_size)) shaped to broadcast over
    ``array``'s slots, whatever axes follow them."""
    mask = np.asarray(mask)
    return mask.reshape(mask.shape + (1,) * (np.ndim(array) - mask.ndim))


def kv_names(cache) -> tuple:
    """The names of the arrays that hold keys or values (an empty "value" left out)."""
    return tuple(name for name in ("key", "value") if np.size(cache[name]))
