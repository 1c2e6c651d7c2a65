"""The paged KV cache: every layer keeps a pool of fixed-size pages shared by every
sequence it serves, and one page table, kept on the host by a
:class:`~nanoattn._layers.caches.allocator.PageAllocator` and shared by the layers,
says which pages hold which sequence's keys (docs/decoding.md, "Paged caches").

A decoding step brings the tokens of many sequences at once, token-major (x (1,
Tq, D)): prefill chunks, decode tokens and speculative chunks mixed. Its
:class:`PagedBatch` says whose each token is and where its key goes: sequence b's
``q_len`` new tokens are its last positions ``kv_lengths[b] - q_len + i``, written
at slot ``p % page_size`` of page ``page_table[b, p // page_size]``, after the
step's copy-on-write copies (``copies``: a page a fork shares is copied before it is
written). An entry -1 (``RETURNED``) is a page a windowed sequence gave back: this
layer refuses it where its window or sink tokens see it (concrete; its sequence's
rows NaN and unwritten under ``jit``), and no kernel reads it elsewhere. The
attention is ``nanoattn.paged_attention`` over the pool, so a step reads only the
pages each sequence holds. Positions live on the host with the
allocator: the cache itself is the pool (``KVCache.key`` and ``value`` (P,
page_size, K, H); ``position`` and ``last`` are empty), and a rewind is the
allocator's. Axis letters: Tq tokens of a step, B sequences of a step's batch
(its rows), M pages per sequence at most, P pages of the pool, C copies.
"""

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp

from ..._base.paged import (
    check_paged_values,
    check_returned,
    returned_reads,
    safe_page_table,
    token_layout,
)
from ..._base.validate import as_array, expect_integer, expect_shape
from .. import positional
from . import quantized
from .kv_cache import KVCache, is_combined, kv_arrays, values_of
from .moves import no_moves
from .page_selection import empty_bounds, select_pages, update_bounds
from .policy import CachePolicy, StepLayout
from .transfers import COPIES, MOVES
from .tree import paged_rows, tree_returned_reads


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PagedBatch:
    """What a paged decoding step needs of the host's page table (a pytree of int32
    arrays of static shapes, so that admitting and retiring sequences never
    recompiles; ``PageAllocator.batch`` makes it).

    Attributes:
      page_table: (B, M): row b's j-th page.
      kv_lengths: (B,): the keys row b holds after this step (0 for an unused row).
      query_starts: (B + 1,): row b's tokens are rows ``query_starts[b] ..
        query_starts[b + 1] - 1`` of the step's x.
      copies: (C, 2): pages to copy before writing, ``(source, destination)``;
        ``(-1, -1)`` for an unused entry. They are carried out all at once, each
        reading its source as the pool was before the step; no two share a
        destination.
      page_size: the tokens of a page, as the allocator counts them (static): a
        layer whose cache has pages of another size refuses the batch.
      pool_pages: P, the pages of the allocator's pool (static): a layer whose pool
        has another number of pages refuses the batch.
      moves: None (none), or (V, 2): slots to move after the copies and before the
        writes, ``(source, target)`` as flat slot ids ``page * page_size + slot``
        (``PageAllocator.accept``'s, :mod:`.moves`); ``(-1, -1)`` for an unused
        entry. Each reads its source as the pool was before the step; no two share a
        target.
      shared_prefixes: None, or (B,): how many of row b's first pages it shares with
        the other rows of its group (``nanoattn.paged_attention``'s keyword: each
        group's pages are read once for all of its queries; docs/decoding.md, "Shared
        prefixes"). The allocator computes it (``PageAllocator(cascade=True)``).
    """

    page_table: jax.Array
    kv_lengths: jax.Array
    query_starts: jax.Array
    copies: jax.Array
    page_size: int = dataclasses.field(metadata=dict(static=True))
    pool_pages: int = dataclasses.field(metadata=dict(static=True))
    moves: jax.Array | None = None
    shared_prefixes: jax.Array | None = None


@dataclasses.dataclass(frozen=True)
class PagedCache(CachePolicy):
    """The policy of a paged cache of pages of ``page_size`` tokens, for a layer with
    ``window`` (None or ``(left, right)``) and ``sink_tokens``; with ``page_selection``
    k, a decode row reads its k pages of highest key bound and its last one
    (:mod:`.page_selection`)."""

    page_size: int
    window: tuple[int, int] | None = None
    sink_tokens: int = 0
    page_selection: int | None = None

    name: ClassVar[str] = "paged"
    wraps: ClassVar[bool] = False

    @property
    def least_capacity(self) -> int:
        """One page."""
        return self.page_size

    least_capacity_rule: ClassVar[str] = "page_size"

    def capacity(self, cache: KVCache) -> int:
        """The pool's tokens: P * page_size."""
        return cache.key.shape[0] * cache.key.shape[1]

    def check_capacity(self, capacity: int, hint: str) -> None:
        """Raises ValueError unless the pool is whole pages, at least one."""
        if capacity < self.page_size or capacity % self.page_size:
            raise ValueError(
                f"a paged KV cache holds whole pages of page_size={self.page_size} tokens: its "
                f"capacity must be a positive multiple of it, got {capacity}; {hint}"
            )

    def chunk_limit(self, capacity: int) -> None:
        """None: a step may bring any number of tokens of a sequence that its pages hold."""
        return None

    def empty(self, batch: int, capacity: int, kv_heads: int, head_dim: int, dtype,
              value_dim: int | None = None) -> KVCache:  # fmt: skip
        """A pool of ``capacity / page_size`` pages (``batch`` is not the pool's: any
        number of sequences share it), with no row state: keys (P, page_size, K, H) and
        values (P, page_size, K, Hv), Hv = ``value_dim`` (None: H), or, for an attention
        layer's (``value_dim`` None) whose token holds 2-4 KiB
        (:data:`~.kv_cache.COMBINED_BYTES`) of keys and values, one combined pool (P,
        page_size, 2, K, H), each token's values right after its keys
        (:func:`~.kv_cache.combines`)."""
        self.check_capacity(capacity, "init with a length that is a multiple of page_size")
        pages = (capacity // self.page_size, self.page_size, kv_heads)
        # Buffers of their own, so that a step may donate the cache.
        key, value, key_scales, value_scales = kv_arrays(pages[:2], kv_heads, head_dim, dtype,
                                                         value_dim)  # fmt: skip
        rows = (jnp.zeros((0,), jnp.int32), jnp.zeros((0,), jnp.int32))
        bounds = None
        if self.page_selection is not None:
            bounds = empty_bounds(pages[0], kv_heads, head_dim)
        return KVCache(key, value, *rows, key_scales, value_scales, bounds)

    def prepare(self, cache: KVCache, shape, *, lengths, pages, hint: str,
                tree_parents=None) -> StepLayout:  # fmt: skip
        """The tokens' sequences and positions from ``pages`` (invalid page tables,
        lengths, starts, copies, moves and trees raise when concrete; under ``jit``
        their tokens are broken: NaN outputs, and they are never written); with
        ``tree_parents`` (1, Tq) the positions are the tree's (:mod:`.tree`)."""
        if lengths is not None:
            raise ValueError(
                "lengths= is for a slot cache; a paged step's tokens and their sequences "
                "come from pages= (a PagedBatch from PageAllocator.batch)"
            )
        if pages is None:
            raise ValueError(
                "a paged KV cache (page_size) decodes with pages=, a PagedBatch from "
                "PageAllocator.batch: whose each token is and where its key goes"
            )
        if not isinstance(pages, PagedBatch):
            raise TypeError(f"pages must be a PagedBatch (PageAllocator.batch), got {pages!r}")
        if shape[0] != 1:
            raise ValueError(
                f"x of a paged step must be (1, Tq, D), every sequence's tokens token-major, "
                f"got {tuple(shape)}"
            )
        Tq, P = shape[1], cache.key.shape[0]
        if pages.page_size != self.page_size:
            raise ValueError(
                f"pages: the batch is for pages of {pages.page_size} tokens (its "
                f"PageAllocator's page_size), but this layer's cache has page_size="
                f"{self.page_size}; make the allocator with page_size={self.page_size}"
            )
        if pages.pool_pages != P:
            raise ValueError(
                f"pages: the batch's PageAllocator has {pages.pool_pages} pages, but this "
                f"layer's pool has P={P}; make the allocator with pages={P}"
            )
        table = _ints("page_table", pages.page_table, "B M", (None, None))
        B = table.shape[0]
        lengths = _ints("kv_lengths", pages.kv_lengths, "B", (B,))
        starts = _ints("query_starts", pages.query_starts, "B+1", (B + 1,))
        copies = _ints("copies", pages.copies, "C 2", (None, 2))
        moves = no_moves() if pages.moves is None else _ints("moves", pages.moves, "V 2",
                                                                (None, 2))  # fmt: skip
        check_paged_values(table, lengths, starts, Tq, P, self.page_size)
        COPIES.check(copies, P)
        MOVES.check(moves, P * self.page_size)
        band, sinks, ps = self.band, self.sink_tokens, self.page_size
        check_returned(table, lengths, starts, Tq, P, ps, band, sinks, _RETURNED_HINT)
        layout = token_layout(table, lengths, starts, Tq, P, ps)
        # A sequence holding a page that a bad copy or move was to fill, or one whose
        # queries see a page it gave back (only under jit): NaN, and never written.
        spoilt = COPIES.spoils(copies, table, lengths, P, ps) | MOVES.spoils(
            moves, table, lengths, P, ps
        )  # fmt: skip
        reads = returned_reads(table, lengths, layout, ps, band, sinks).any(axis=1)
        tree, positions = None, layout.position
        if tree_parents is not None:
            tree = paged_rows(tree_parents, starts, layout)
            positions = tree.positions
            reads |= tree.broken | tree_returned_reads(
                table, lengths, layout, tree, ps, band, sinks, _RETURNED_HINT
            )  # fmt: skip
        spoilt = spoilt | jnp.zeros(B, bool).at[layout.sequence].max(reads)
        spoilt = spoilt[layout.sequence] & layout.real
        shared = pages.shared_prefixes
        if shared is not None:
            shared = _ints("shared_prefixes", shared, "B", (B,))
        pages = PagedBatch(table, lengths, starts, copies, ps, P, moves, shared_prefixes=shared)
        return StepLayout(
            positions[None], (layout.real & ~spoilt)[None], (layout.broken | spoilt)[None],
            pages=pages, tree=tree,
        )  # fmt: skip

    def write_step(self, cache: KVCache, k, v, layout: StepLayout) -> KVCache:
        """The step's copies first (copy-on-write of shared pages), then its slot moves
        (an accepted path's), both reading the pool as it was before the step, then
        each real token's key and value at its slot of its sequence's page (the slot
        order: a tree's token i at ``committed + i``); other tokens are never written."""
        pages = layout.pages
        P, ps = cache.key.shape[:2]
        copies = pages.copies
        source, target = COPIES.sound(copies, P)  # P: dropped
        moved_from, moved_to = MOVES.sound(pages.moves, P * ps)  # P * ps: dropped
        tokens = token_layout(
            pages.page_table, pages.kv_lengths, pages.query_starts, k.shape[1], P, ps
        )  # fmt: skip
        table = safe_page_table(pages.page_table, pages.kv_lengths, ps, P)
        position = tokens.position  # the slot order, whatever RoPE's positions
        page = table[tokens.sequence, position // ps]
        # padding and broken tokens (a token whose own page was given back among them:
        # its query sees it) are dropped
        page = jnp.where(layout.real[0], page, P)
        slot = position % ps

        def write(pool, new):
            flat = pool.reshape(P * ps, *pool.shape[2:])  # (P page_size, ...)
            moved, copied = flat[moved_from], pool[source]  # before the step
            pool = pool.at[target].set(copied, mode="drop")
            flat = pool.reshape(flat.shape).at[moved_to].set(moved, mode="drop")
            pool = flat.reshape(pool.shape)
            return pool.at[page, slot].set(new[0].astype(pool.dtype), mode="drop")

        written = quantized.store(cache, k, v, write)
        if cache.key_bounds is None:
            return written
        keys = cache.key[:, :, 0] if is_combined(cache) else cache.key
        moved = keys.reshape(P * ps, *keys.shape[2:])[moved_from]  # before the step
        moved = moved.astype(jnp.float32)  # (V, K, H)
        if cache.key_scales is not None:
            moved = moved * cache.key_scales.reshape(P * ps, -1)[moved_from][..., None]
        bounds = update_bounds(
            cache.key_bounds, copy_source=source, copy_target=target, moved=moved,
            moved_page=moved_to // ps, moved_slot=moved_to % ps, new=k[0], page=page, slot=slot,
        )  # fmt: skip
        return written._replace(key_bounds=bounds)

    def attention(self, cache: KVCache, layout: StepLayout, q, *, dense, paged, mask,
                  mask_fn, score_fn):  # fmt: skip
        """``paged`` over the pool: causal, the window (or, with sink tokens, a mask_fn
        that keeps them) and the user's functions at the sequence's positions; with page
        selection, each decode row over its selected pages."""
        if mask is not None:
            raise ValueError(
                "mask is not served by a paged KV cache (its keys are no (B, S) row); "
                "give the rule as mask_fn, which sees each key's position"
            )
        pages = layout.pages
        if self.page_selection is not None:
            for name, given in (("mask_fn", mask_fn), ("score_fn", score_fn)):
                if given is not None:
                    raise ValueError(
                        f"{name} is not served with page_selection: a decode row reads its "
                        f"selected pages as one run of keys, so their positions are not "
                        f"the sequence's"
                    )
            table, lengths = select_pages(
                q[0], cache.key_bounds, pages.page_table, pages.kv_lengths, pages.query_starts,
                self.page_selection, self.page_size,
            )  # fmt: skip
            # each row over its own pages: no shared pass
            pages = dataclasses.replace(pages, page_table=table, kv_lengths=lengths,
                                        shared_prefixes=None)  # fmt: skip
        window_or_sink = positional.window_mask(self.window, self.sink_tokens)
        rules = dict(
            is_causal=True, mask_fn=positional.and_masks(window_or_sink, mask_fn),
            score_fn=score_fn,
        )  # fmt: skip
        if not self.sink_tokens:
            rules["window"] = self.window
        if layout.tree is not None:
            rules["tree_parents"] = layout.tree.parents  # (Tq,)
        if pages.shared_prefixes is not None:  # each group's pages read once
            rules["shared_prefixes"] = pages.shared_prefixes
        keys, values, scales = quantized.read(cache, cache.key, values_of(cache), q.dtype)
        return paged(q, keys, values, pages, **rules, **scales)

    @property
    def band(self) -> tuple:
        """The keys a query at position q may see, ``(left, right)`` from q: causal, and
        the window's left side (None without a window); the sink tokens besides."""
        return (None if self.window is None else self.window[0], 0)

    def advance(self, cache: KVCache, layout: StepLayout) -> KVCache:
        """The pool as written: positions live on the host (the allocator)."""
        return cache

    def rewind(self, cache: KVCache, n) -> KVCache:
        """Raises ValueError: a paged cache rewinds on the host."""
        raise ValueError(
            "a paged KV cache rewinds through its PageAllocator (allocator.rewind(seq_id, "
            "n)): the positions live on the host, not in the cache"
        )

    def poison(self, cache: KVCache, bad) -> KVCache:
        """The pool as it is: a paged step's broken tokens are never written."""
        return cache

    def accept(self, cache: KVCache, kept) -> KVCache:
        """Raises ValueError: a paged cache keeps an accepted path on the host."""
        raise ValueError(
            "a paged KV cache keeps an accepted path through its PageAllocator "
            "(allocator.accept(seq_id, kept)): the next step moves the keys"
        )


_RETURNED_HINT = (
    "a layer reads every page in its window and its sink tokens: give it the batch of a "
    "PageAllocator made with its window and sink_tokens (a global layer: one without "
    "a window)"
)


def _ints(name: str, x, axes: str, dims):
    x = as_array(name, x, f"an int32 array ({', '.join(axes.split())})")
    expect_integer(name, x.dtype)
    expect_shape(name, x.shape, axes, dims)
    return x.astype(jnp.int32)
