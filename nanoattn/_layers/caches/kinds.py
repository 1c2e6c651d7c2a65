"""The kinds of KV cache, and the one place that picks a layer's: :func:`policy_of`.

Adding a kind: a module with its :class:`~nanoattn._layers.caches.policy.CachePolicy`
and one line here (docs/decoding.md, "The cache policy").
"""

from .full import FullCache
from .paged import PagedCache
from .policy import CachePolicy
from .rolling import RollingCache


def policy_of(config) -> CachePolicy:
    """The cache policy of a layer's config (an ``AttentionConfig``, or any object with
    its fields; None or missing fields: a full cache without window):
    ``rolling_cache`` -> a :class:`RollingCache` with the config's window W and
    ``sink_tokens``; ``page_size`` -> a :class:`PagedCache` of that page size (and
    its ``page_selection``);
    otherwise a :class:`FullCache` with its window and sink tokens."""
    window = getattr(config, "window", None)
    sink_tokens = getattr(config, "sink_tokens", 0)
    if getattr(config, "rolling_cache", False):
        return RollingCache(window[0], sink_tokens)
    if getattr(config, "page_size", None):
        return PagedCache(config.page_size, window, sink_tokens,
                          getattr(config, "page_selection", None))  # fmt: skip
    return FullCache(window, sink_tokens)
