"""Automatic prefix caching: which pages of a :class:`PageAllocator`'s pool hold a full
page of a known prefix of token ids, so that a new sequence that starts with that
prefix shares those pages instead of computing them again (vLLM's automatic prefix
caching, SGLang's radix cache). Host side, plain Python.

A full page is keyed by a chain: ``key_j = blake2b(namespace, key_{j-1}, the page's
token ids)`` (``key_{-1}`` is 32 zero bytes), so a key names the page's tokens and
every token before them, under the namespace the caller gives (the model, an adapter,
a tenant: whatever changes the keys and values a token gives). The key is a
cryptographic hash, never Python's ``hash``: a predictable key lets one user make
another's prompt hit a page they wrote (vLLM's CVE-2025-25183). A hit also compares
the page's stored token ids, its parent's key and its namespace with the asked ones,
so even a collision of the hash (none is known for blake2b-256; a test forces one)
is a miss, never a page of other tokens.

The index keeps, for each registered page, its key and what it was made of; the pages
no sequence holds that are still registered wait in an LRU of reusable pages, handed
out again (evicted: their prefix forgotten) only when no page is free, the least
recently freed first among those whose key no other registered page chains from
(leaves first: a page whose successor is still cached is worth more).
"""

import collections
import dataclasses
import hashlib
import numbers
from typing import NamedTuple

import numpy as np

ROOT = bytes(32)  # the parent key of a sequence's first page
_PERSON = b"nanoattn.prefix"  # blake2b's personalisation: these keys and no other


def page_key(parent: bytes, tokens, namespace: bytes) -> bytes:
    """The key of a full page: blake2b-256 of the namespace (its length first), the
    previous page's key (:data:`ROOT` for the first page) and the page's token ids
    (int64, little-endian): a page's key depends on every token before it."""
    h = hashlib.blake2b(digest_size=32, person=_PERSON)
    h.update(len(namespace).to_bytes(8, "little"))
    h.update(namespace)
    h.update(parent)
    h.update(np.asarray(tokens, "<i8").tobytes())
    return h.digest()


def as_namespace(namespace) -> bytes:
    """A namespace as the bytes its keys hash: None, a str, bytes or an int, each kind
    tagged so that ``"1"``, ``b"1"`` and ``1`` are three namespaces.

    Raises:
      TypeError: anything else.
    """
    if namespace is None:
        return b""
    if isinstance(namespace, str):
        return b"str:" + namespace.encode()
    if isinstance(namespace, bytes):
        return b"bytes:" + namespace
    if isinstance(namespace, numbers.Integral) and not isinstance(namespace, bool):
        return b"int:" + str(int(namespace)).encode()
    raise TypeError(f"namespace must be None, a str, bytes or an int, got {namespace!r}")


def token_ids(name: str, tokens, n: int) -> tuple[int, ...]:
    """``tokens`` as n int token ids (a list, tuple or 1-D integer array of length n).

    Raises:
      ValueError: not n integers, or one outside int64.
    """
    ids = np.asarray(tokens)
    if ids.ndim != 1 or len(ids) != n or not (n == 0 or np.issubdtype(ids.dtype, np.integer)):
        raise ValueError(
            f"{name} must be the {n} token ids of the new tokens (ints), got "
            f"{tokens if ids.size <= 8 else f'an array of shape {ids.shape}'!r}"
        )
    if ids.dtype == np.uint64 and n and ids.max() > np.iinfo(np.int64).max:
        raise ValueError(f"{name}: token ids must fit in int64, got {int(ids.max())}")
    return tuple(int(t) for t in ids)


@dataclasses.dataclass(frozen=True)
class PrefixStats:
    """What a prefix cache has done (:meth:`PageAllocator.stats`).

    Attributes:
      hit_tokens: the tokens ``allocate`` found cached (the steps did not compute them).
      miss_tokens: the tokens ``allocate`` was given the ids of and had to compute.
      cached_pages: the pages registered now (a full, written page of a known prefix).
      reusable_pages: those no sequence holds (counted in ``free_pages``).
      evictions: registered pages handed out again, their prefix forgotten.
    """

    hit_tokens: int = 0
    miss_tokens: int = 0
    cached_pages: int = 0
    reusable_pages: int = 0
    evictions: int = 0

    @property
    def hit_rate(self) -> float:
        """hit_tokens / (hit_tokens + miss_tokens), 0 before any lookup."""
        asked = self.hit_tokens + self.miss_tokens
        return self.hit_tokens / asked if asked else 0.0


class _Entry(NamedTuple):
    """A registered page: its key, and what the key was made of (compared on a hit)."""

    key: bytes
    parent: bytes
    tokens: tuple
    namespace: bytes


class PrefixIndex:
    """The registered pages of a pool (key to page and back), their chains, and the LRU
    of reusable ones; the allocator owns the pages and asks this index."""

    def __init__(self):
        self._page_of: dict[bytes, int] = {}
        self._entry: dict[int, _Entry] = {}
        self._children = collections.Counter()  # key -> registered pages chained from it
        self._reusable: collections.OrderedDict = collections.OrderedDict()  # LRU first
        self.hit_tokens = self.miss_tokens = self.evictions = 0

    @property
    def reusable(self) -> int:
        """The registered pages no sequence holds."""
        return len(self._reusable)

    def reusable_ids(self) -> list[int]:
        """Those pages, the most recently freed first."""
        return list(reversed(self._reusable))

    def is_reusable(self, page: int) -> bool:
        return page in self._reusable

    def tokens_of(self, page: int) -> tuple | None:
        """The token ids a registered page holds, or None for a page not registered."""
        entry = self._entry.get(page)
        return None if entry is None else entry.tokens

    def key(self, parent: bytes, tokens, namespace: bytes) -> bytes:
        """:func:`page_key` (looked up at each call: a test may force a collision)."""
        return page_key(parent, tokens, namespace)

    def match(self, ids: tuple, namespace: bytes, most: int, page_size: int):
        """The longest registered prefix of ``ids``, at most ``most`` pages: ``(pages,
        keys)``. Each hit is checked against the page's stored tokens, parent and
        namespace: a key that matches but was made of anything else ends the prefix."""
        pages, keys, parent = [], [], ROOT
        for j in range(most):
            chunk = ids[j * page_size : (j + 1) * page_size]
            key = page_key(parent, chunk, namespace)
            page = self._page_of.get(key)
            if page is None or self._entry[page] != _Entry(key, parent, chunk, namespace):
                break
            pages.append(page)
            keys.append(key)
            parent = key
        return pages, keys

    def register(self, page: int, key: bytes, parent: bytes, tokens: tuple,
                 namespace: bytes) -> bool:  # fmt: skip
        """Registers a full page a step has written; False (nothing changes) if the page
        is registered already or another page holds the key (the first one stays)."""
        if key in self._page_of or page in self._entry:
            return False
        self._page_of[key] = page
        self._entry[page] = _Entry(key, parent, tuple(tokens), namespace)
        self._children[parent] += 1
        return True

    def forget(self, page: int) -> None:
        """Unregisters ``page`` (its content is about to change, or it is handed out)."""
        entry = self._entry.pop(page, None)
        if entry is None:
            return
        del self._page_of[entry.key]
        self._children[entry.parent] -= 1
        if not self._children[entry.parent]:
            del self._children[entry.parent]
        self._reusable.pop(page, None)

    def park(self, page: int) -> bool:
        """A page no sequence holds any more: True (kept, the most recently freed) if it
        is registered, else False (the allocator frees it)."""
        if page not in self._entry:
            return False
        self._reusable[page] = None
        return True

    def unpark(self, page: int) -> None:
        """A reusable page a hit shares again."""
        self._reusable.pop(page, None)

    def evict(self) -> int:
        """The reusable page to hand out (unregistered): the least recently freed among
        those no registered page chains from, else the least recently freed."""
        victim = next(iter(self._reusable))
        for page in self._reusable:
            if not self._children[self._entry[page].key]:
                victim = page
                break
        self.forget(victim)
        self.evictions += 1
        return victim

    def stats(self) -> PrefixStats:
        return PrefixStats(
            self.hit_tokens, self.miss_tokens, len(self._entry), len(self._reusable),
            self.evictions,
        )  # fmt: skip
