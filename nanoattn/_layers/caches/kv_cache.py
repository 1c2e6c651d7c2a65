"""The state of a key/value cache, independent of the module framework and of the
cache's kind.

A cache is four arrays, ``{"key": (B, S, K, H), "value": (B, S, K, H),
"position": (B,) int32, "last": (B,) int32}``: S is the capacity,
``position[b]`` is the number of tokens row b has taken, i.e. the position of
its next token, and ``last[b]`` how many of them its last call brought (what
:func:`rewind` may take back). Which slot holds which position, which slots a
query may read and how many tokens a call may bring is the cache policy's
(``nanoattn._layers.caches.policy``: a full cache holds position j in slot j, a
rolling one a ring of slots). A quantized cache
(``AttentionConfig(kv_cache_dtype=)``) holds int8 or float8 keys and values and two
more arrays, ``"key_scales"`` and ``"value_scales"`` (B, S, K) float32
(:mod:`.quantized`). A paged cache with page selection keeps one more,
``"key_bounds"`` (P, 2, K, H) float32, each page's box of keys (:mod:`.page_selection`).
An attention layer's cache whose token holds 2-4 KiB of keys and values
(:data:`COMBINED_BYTES`) keeps one combined array instead of two: ``"key"`` (B, S, 2,
K, H) (a pool's (P, page_size, 2, K, H)), each token's keys then its values (the layout the native
kernel's decode reads fastest, ``dot_product_attention`` and ``paged_attention`` with
the values None), and ``"value"`` empty (:func:`kv_arrays`, :func:`is_combined`). A
row whose position is negative (``POISONED``) is poisoned (an invalid call or rewind
under ``jit``): its outputs are NaN until it is reset. The
linen modules keep the cache in the ``"cache"`` collection, the NNX modules in
``nnx.Cache`` variables; both advance it with :func:`decode` of
``nanoattn._layers.steps``.
"""

from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from ..._base.quantized import storage_name

POISONED = -1  # the position of a poisoned row, in every kind of cache


class KVCache(NamedTuple):
    """key: (B, S, K, H); value: (B, S, K, Hv) (Hv = H but in a latent cache);
    position: (B,) int32, the tokens each row has taken; last: (B,) int32, the tokens
    each row took in its last call; key_scales, value_scales: (B, S, K) float32, the
    scales of a quantized cache's keys and values (None for a float cache);
    key_bounds: (P, 2, K, H) float32, a paged cache's per-page minimum and maximum of
    its keys with page selection (None otherwise)."""

    key: jax.Array
    value: jax.Array  # empty where key is a combined pool (is_combined)
    position: jax.Array
    last: jax.Array
    key_scales: Any = None
    value_scales: Any = None
    key_bounds: Any = None


# The fields of a float cache's state, and those a quantized cache adds.
FLOAT_FIELDS = KVCache._fields[:4]
SCALE_FIELDS = ("key_scales", "value_scales")


def fields(quantized: bool, bounded: bool = False) -> tuple[str, ...]:
    """The names of the arrays of a cache's state (a float or a quantized one; with the
    key bounds of page selection when ``bounded``)."""
    return FLOAT_FIELDS + SCALE_FIELDS * quantized + ("key_bounds",) * bounded


def as_mapping(cache: KVCache) -> dict:
    """The state as the ``"cache"`` collection holds it: its arrays by name (a float
    cache without the scale fields)."""
    return {name: x for name, x in cache._asdict().items() if x is not None}


def quantized_zeros(shape, dtype):
    """Keys or values of ``shape`` (..., K, H) and, for a storage ``dtype`` (int8,
    float8_e4m3fn), their scales (..., K) float32; None instead for a float dtype."""
    if storage_name(dtype) is None:
        return jnp.zeros(shape, dtype), None
    return jnp.zeros(shape, dtype), jnp.zeros(shape[:-1], jnp.float32)


def empty(batch: int, capacity: int, kv_heads: int, head_dim: int, dtype,
          value_dim: int | None = None) -> KVCache:  # fmt: skip
    """A cache of capacity S = ``capacity`` with every row at position 0: keys (B, S, K,
    H) and values (B, S, K, Hv), Hv = ``value_dim`` (None: H; 0 for a latent cache,
    whose values are a slice of its keys, docs/latent.md), or one combined array (B, S,
    2, K, H) (:func:`kv_arrays`); quantized when ``dtype`` is a storage dtype (int8,
    float8_e4m3fn): zero scales too. Every array a buffer of its own, so that a step
    may donate the cache."""
    keys, values, key_scales, value_scales = kv_arrays((batch, capacity), kv_heads, head_dim,
                                                       dtype, value_dim)  # fmt: skip
    position, last = jnp.zeros((batch,), jnp.int32), jnp.zeros((batch,), jnp.int32)
    return KVCache(keys, values, position, last, key_scales, value_scales)


def kv_arrays(lead, kv_heads: int, head_dim: int, dtype, value_dim: int | None = None):
    """``(keys, values, key_scales, value_scales)`` of an empty cache whose slots have
    the leading axes ``lead`` ((B, S), or a pool's (P, page_size)): keys (*lead, K, H)
    and values (*lead, K, Hv), Hv = ``value_dim`` (None: H); or, for an attention
    layer's cache (``value_dim`` None) that :func:`combines`, one combined array
    (*lead, 2, K, H) and an empty ``values``; the scales of a storage ``dtype``
    (*lead, K) each (None for a float dtype). Every array a buffer of its own."""
    Hv = head_dim if value_dim is None else value_dim
    if value_dim is None and combines(kv_heads, head_dim, dtype):
        keys, _ = quantized_zeros((*lead, 2, kv_heads, head_dim), dtype)
        _, key_scales = quantized_zeros((*lead, kv_heads, 0), dtype)  # (*lead, K) or None
        _, value_scales = quantized_zeros((*lead, kv_heads, 0), dtype)
        return keys, jnp.zeros((0,), keys.dtype), key_scales, value_scales
    keys, key_scales = quantized_zeros((*lead, kv_heads, head_dim), dtype)
    values, value_scales = quantized_zeros((*lead, kv_heads, Hv), dtype)
    return keys, values, key_scales, value_scales


# The bytes of keys and values a token holds, (least, most), for an attention layer's
# cache to be one combined array (its values right after its keys: one run of memory a
# token), as measured on one machine: 2-core AMD EPYC Zen 4, the native B = 16 decode
# (512-8192 keys, pages of 16, shuffled), combined against two pools: 1.23x faster in
# bfloat16 at K = 8, H = 128 (4 KiB a token; 1.24x built for AVX2), 1.25x in float32
# at K = 4 (4 KiB), 1.05x-1.09x at 2 KiB; but 1.1x-1.2x slower at 8 KiB (float32 at K =
# 8, bfloat16 at K = 16, in blocks of heads too), 1.1x slower at 1 KiB (float32 at K =
# 1), the same at 512 B, and the recall example's engine (256 B a token) 10-25% slower.
COMBINED_BYTES = (2048, 4096)


def combines(kv_heads: int, head_dim: int, dtype) -> bool:
    """Whether an attention layer's cache of K = ``kv_heads`` heads of width H =
    ``head_dim`` stored in ``dtype`` is one combined array: a token's keys and values,
    2 K H elements, take from ``COMBINED_BYTES[0]`` to ``COMBINED_BYTES[1]`` bytes."""
    least, most = COMBINED_BYTES
    return least <= 2 * kv_heads * head_dim * jnp.dtype(dtype).itemsize <= most


def values_of(cache: KVCache):
    """What a step's attention call takes as its values: the cache's, or None where
    ``key`` is a combined array (:func:`is_combined`) that holds them."""
    return None if is_combined(cache) else cache.value


def is_combined(cache: KVCache) -> bool:
    """Whether ``cache`` keeps one combined array (``key`` (B, S, 2, K, H), or a pool's
    (P, page_size, 2, K, H), each token's keys then its values; ``value`` empty)."""
    return cache.key.ndim == 5


def is_concrete(x) -> bool:
    """Whether ``x`` has a value now (not a tracer of ``jit``): then a rule can raise."""
    return not isinstance(x, jax.core.Tracer)


class Rule(NamedTuple):
    """One validity rule of a call over the rows of a cache: ``bad`` (B,) bool, the
    rows that break it (numpy or jax, traced or concrete), and ``message(b)``, the
    one-line error naming row b, asked for only when ``bad`` is concrete."""

    bad: Any
    message: Callable[[int], str]


def broken(rules) -> Any:
    """Raises ValueError with the message of the first row that breaks the first rule
    whose ``bad`` is concrete; otherwise returns (B,) bool, the rows that break any
    rule (traced under ``jit``, all False when every rule is concrete). So one rule is
    written once and serves both: raised when it can be checked, poisoned when not."""
    rows = False
    for rule in rules:
        if is_concrete(rule.bad):
            found = np.flatnonzero(np.asarray(rule.bad))
            if found.size:
                raise ValueError(rule.message(int(found[0])))
        rows = rows | rule.bad
    return rows


def scatter(cache, new, slots, lengths):
    """Writes ``new[b, t]`` at ``slots[b, t]`` for the first ``lengths[b]`` tokens.

    cache: (B, S, K, H); new: (B, L, K, H); slots: (B, L) int; lengths: (B,) int.
    A scatter that drops out-of-range writes: padded tokens (index >= ``lengths[b]``)
    and slots past the capacity are never written. (A ``dynamic_update_slice`` would
    clamp the start index and silently overwrite the last slots instead.)
    """
    B, S = cache.shape[:2]
    L = new.shape[1]
    steps = jnp.arange(L)[None, :]  # (1, L)
    slots = jnp.where(steps < lengths[:, None], slots, S)  # (B, L); S: dropped
    rows = jnp.arange(B)[:, None]  # (B, 1)
    return cache.at[rows, slots].set(new.astype(cache.dtype), mode="drop")


def poison(cache: KVCache, bad) -> KVCache:
    """Marks the rows ``bad`` (B,) bool as poisoned: position ``POISONED`` (-1) and
    last 0. Every later call of such a row is NaN (or raises, when concrete) until the
    row is reset (position and last 0)."""
    position = jnp.where(bad, POISONED, cache.position).astype(jnp.int32)
    last = jnp.where(bad, 0, cache.last).astype(jnp.int32)
    return cache._replace(position=position, last=last)


def rewind(cache: KVCache, n) -> KVCache:
    """Moves each row b back by ``n[b]`` tokens, 0 <= n[b] <= ``cache.last[b]``.

    ``n``: an int or (B,) int. Raises ValueError when ``n`` is concrete and out of
    range; under ``jit`` such a row is poisoned instead (:func:`poison`: NaN outputs
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
    rule = Rule(
        (n < 0) | (n > cache.last),
        lambda b: (
            f"rewind: n[{b}]={int(n[b])} is outside [0, {int(cache.last[b])}], the "
            f"tokens row {b} took in its last call"
        ),
    )
    bad = broken([rule]) | (cache.position < 0)  # a poisoned row stays poisoned
    back = n.astype(jnp.int32)
    return poison(cache._replace(position=cache.position - back, last=cache.last - back), bad)


def is_cache(tree) -> bool:
    """Whether ``tree`` is one layer's cache: a mapping of exactly the fields of a
    float or of a quantized KVCache (with the key bounds of page selection or not)."""
    kinds = [set(fields(q, b)) for q in (False, True) for b in (False, True)]
    return isinstance(tree, Mapping) and set(tree) in kinds


def cache_bytes(tree) -> dict[str, int]:
    """The bytes of each layer's cache in a ``"cache"`` collection (nested mappings).

    Returns ``{"path/to/layer": bytes}`` (the path joined with ``/``; ``""`` for a
    lone layer's cache): every array of the layer's cache, i.e.
    ``2 * B * S * K * H * itemsize`` for keys and values plus ``8 * B`` for
    ``position`` and ``last``, and for a quantized cache ``2 * B * S * K * 4`` for
    the scales (and ``P * 2 * K * H * 4`` for a page-selecting pool's key bounds).
    Works on shapes too (``jax.eval_shape``'s output).
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
