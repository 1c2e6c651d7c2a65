"""``PageAllocator``: the host side of a paged KV cache (plain Python and numpy).

It keeps which pages of the pool each sequence holds, how many tokens it holds and how
many of them a step has written, hands out free pages as sequences grow, takes them back
when a sequence is freed or rewound, lets a sequence fork another (sharing its pages,
with reference counts, and copying a shared page before it is written: copy-on-write),
and makes the arrays a jitted decoding step needs (:meth:`PageAllocator.batch`: a
:class:`~nanoattn._layers.caches.paged.PagedBatch` of static shapes, so that admitting
and retiring sequences never recompiles). One allocator serves every layer of a kind:
their pools have the same pages, and the page table is shared.

A step is two calls around the model's: ``batch = alloc.batch(rows, tokens)``, which
changes nothing (a failed step is retried by calling it again, and any number of models
may run the same batch), then ``alloc.confirm(batch)`` once the step has run: its
tokens are written and its copies done. What may happen between two steps, and why
the rest is refused, is docs/decoding.md's table ("Between two steps").

Two options change what it keeps (docs/decoding.md, "Prefix caching" and "Windowed
layers in a paged pool"):

* ``prefix_cache=True``: a full page a step has written, whose token ids the caller
  gave, is registered under its chained key (:mod:`.prefix_cache`); ``allocate`` with
  the ids of a new sequence shares the registered pages of its longest cached prefix,
  and a freed page that holds one waits in an LRU of reusable pages until the pool
  needs it.
* ``window=(W - 1, 0)`` (and ``sink_tokens``), a windowed layer's: every page wholly
  outside the window of every query the sequence may still make (a rewind's
  included) and past the sink tokens goes back to the pool as the sequence grows,
  its page-table entry :data:`RETURNED` (-1), which the kernels never read.

Speculative decoding with token trees (docs/decoding.md, "Speculative trees"): a step
brings a sequence's tree of drafts as its last extension; :meth:`PageAllocator.accept`
then keeps the accepted path, its tokens' keys moved into place by the next step (slot
moves, :mod:`.moves`, at most ``max_moves`` a step), the rest taken back.
"""

import dataclasses
import numbers

import numpy as np

from ..._base.paged import RETURNED
from ..._base.rules import normalize_window
from ..._base.validate import expect_flag
from .moves import path_positions
from .paged import PagedBatch
from .prefix_cache import ROOT, PrefixIndex, PrefixStats, as_namespace, token_ids
from .shared_prefix import shared_prefixes


class PoolExhausted(ValueError):
    """The pool has too few free pages for what was asked; nothing was changed."""


@dataclasses.dataclass
class _Sequence:
    pages: list[int]  # its page-table entries (RETURNED for a page it gave back)
    length: int  # tokens held
    written: int = 0  # tokens a confirmed step has written (the first `written` held)
    last: int = 0  # tokens the last extension brought (what rewind may take back)
    # With a prefix cache: the ids of its first tokens (all of them while every call
    # gave them), its namespace, and the chained keys of its first full written pages.
    ids: list[int] = dataclasses.field(default_factory=list)
    namespace: bytes = b""
    keys: list[bytes] = dataclasses.field(default_factory=list)
    returned: int = 0  # with a window: its entries before this one past the sinks' are returned


def _count(name: str, value, least: int) -> int:
    """``value`` as an int >= ``least`` (numpy integers too; never a bool or a float)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < least:
        raise ValueError(f"{name} must be an int >= {least}, got {value!r}")
    return int(value)


class PageAllocator:
    """The pages of a paged KV cache and the sequences that hold them.

    Args:
      pages: P, the pages of the pool (each layer's cache holds P * page_size tokens).
      page_size: the tokens a page holds.
      max_sequences: the rows of a step's batch (B of its page table).
      max_pages: M, the most pages one sequence may hold (the page table's width):
        sequences are at most M * page_size tokens long.
      max_copies: the copy-on-write copies one step may carry (default
        ``max_sequences``); an :meth:`extend` that would need one more is refused
        until a step has carried the pending ones.
      seed: None to hand out pages lowest first; an int to hand them out in a shuffled
        order (what a long-running server's pool looks like: tests and
        ``verify.check_decoding`` use it).
      prefix_cache: share the pages of cached prefixes: :meth:`allocate` with the new
        sequence's token ids returns how many leading tokens are cached already
        (docs/decoding.md, "Prefix caching").
      window: None, or the window of the layers this allocator serves, as their
        ``AttentionConfig(window=)`` (``(W - 1, 0)``: a query sees W keys): pages
        no query of a sequence can read any more go back to the pool, their entries
        :data:`RETURNED` (docs/decoding.md, "Windowed layers in a paged pool").
      sink_tokens: S0, with a window: the first S0 positions stay visible to every
        query, and the pages that hold them stay.
      max_moves: the slot moves one step may carry (default 0): what :meth:`accept`
        leaves for the next step, one per accepted token not already in its place;
        an accept that would need more is refused until a step has carried them.
      cascade: whether each batch says which of its rows begin with the same written
        pages (``PagedBatch.shared_prefixes``, :mod:`.shared_prefix`), so that the
        layers read those pages once for the whole group (docs/decoding.md, "Shared
        prefixes"); False (and any windowed allocator) gives None: every row reads
        its own pages.

    Example:
      >>> alloc = PageAllocator(pages=8, page_size=4, max_sequences=2, max_pages=4)
      >>> alloc.allocate("a", 6)  # a prompt of 6 tokens: 2 pages, none cached
      0
      >>> batch = alloc.batch([("a", 6)], tokens=8)  # the step that writes them
      >>> # ... run the model's step on batch, then:
      >>> alloc.confirm(batch)
      >>> alloc.fork("a", "b")  # b shares a's 6 tokens
      >>> alloc.extend("b", 1)  # b's 7th token goes in a's partial page: copied first
      >>> batch = alloc.batch([("b", 1)], tokens=8)
      >>> batch.kv_lengths.tolist(), batch.query_starts.tolist(), batch.copies[0].tolist()
      ([7, 0], [0, 1, 1], [1, 2])
    """

    def __init__(self, pages: int, page_size: int, *, max_sequences: int, max_pages: int,
                 max_copies: int | None = None, seed: int | None = None,
                 prefix_cache: bool = False, window=None, sink_tokens: int = 0,
                 cascade: bool = True, max_moves: int = 0):  # fmt: skip
        self.pages = _count("pages", pages, 1)
        self.page_size = _count("page_size", page_size, 1)
        self.max_sequences = _count("max_sequences", max_sequences, 1)
        self.max_pages = _count("max_pages", max_pages, 1)
        if max_copies is None:
            max_copies = self.max_sequences
        self.max_copies = _count("max_copies", max_copies, 0)
        self.max_moves = _count("max_moves", max_moves, 0)
        self.window, self.sink_tokens = _window_options(window, sink_tokens, prefix_cache)
        self._cache = PrefixIndex() if prefix_cache else None
        self.cascade = expect_flag("cascade", cascade)
        order = list(range(self.pages))
        if seed is not None:
            seed = _count("seed", seed, 0)
            order = [int(p) for p in np.random.default_rng(seed).permutation(self.pages)]
        self._free = order[::-1]  # a stack: the next page handed out is the last
        self._refs = np.zeros(self.pages, np.int64)
        self._sequences: dict = {}
        # Pending copies (source, target): their sources resolved through the others, so
        # that a step carries them all at once, reading the pool as it was before it.
        self._copies: list[tuple[int, int]] = []
        # Pending slot moves (source, target) as flat slot ids (accept's), and the
        # sequences whose accepted tokens they put in place.
        self._moves: list[tuple[int, int]] = []
        self._moved: set = set()
        self._outstanding = None  # (the batch made and not confirmed, its rows)
        self._parked: list[int] = []  # cached pages released, to be parked (_release_all)

    # --- what the host asks -------------------------------------------------------

    @property
    def prefix_cache(self) -> bool:
        """Whether this allocator caches prefixes."""
        return self._cache is not None

    @property
    def free_pages(self) -> int:
        """The pages no sequence holds (with a prefix cache, the reusable pages that
        hold a cached prefix too: they are handed out when no other page is free)."""
        return len(self._free) + (self._cache.reusable if self._cache else 0)

    def free_page_ids(self) -> list[int]:
        """The pages no sequence holds: the reusable ones (a prefix cache's, the most
        recently freed first) before the free ones, the next one handed out last."""
        return (self._cache.reusable_ids() if self._cache else []) + list(self._free)

    def length(self, seq_id) -> int:
        """The tokens sequence ``seq_id`` holds."""
        return self._get(seq_id).length

    def unwritten(self, seq_id) -> int:
        """The tokens sequence ``seq_id`` holds that no confirmed step has written: the
        ``q_len`` its next step must bring."""
        sequence = self._get(seq_id)
        return sequence.length - sequence.written

    def last_extension(self, seq_id) -> int:
        """The tokens sequence ``seq_id``'s last extension brought and a rewind may
        still take back."""
        return self._get(seq_id).last

    def pages_of(self, seq_id) -> list[int]:
        """The page-table entries of sequence ``seq_id``, in order: one per page of
        tokens it holds, :data:`RETURNED` (-1) for a page a windowed allocator took
        back."""
        return list(self._get(seq_id).pages)

    def sequences(self) -> list:
        """The sequences held, in the order they were allocated or forked."""
        return list(self._sequences)

    def refs(self, page: int) -> int:
        """How many sequences hold ``page`` (an int in [0, pages))."""
        if (
            isinstance(page, bool)
            or not isinstance(page, numbers.Integral)
            or not (0 <= page < self.pages)
        ):
            raise ValueError(f"page must be an int in [0, {self.pages}), got {page!r}")
        return int(self._refs[page])

    def pending_copies(self) -> list[tuple[int, int]]:
        """The copy-on-write copies ``(source, target)`` the next step carries."""
        return list(self._copies)

    def pending_moves(self) -> list[tuple[int, int]]:
        """The slot moves ``(source, target)`` the next step carries (flat slot ids
        ``page * page_size + slot``, :meth:`accept`'s)."""
        return list(self._moves)

    def stats(self) -> PrefixStats:
        """What the prefix cache has done: tokens hit and missed by :meth:`allocate`,
        pages cached (and of those, reusable), evictions (all 0 without one)."""
        return self._cache.stats() if self._cache else PrefixStats()

    def cached_tokens(self, page: int) -> tuple | None:
        """The token ids a registered page holds (a prefix cache's), or None."""
        self.refs(page)  # checks the id
        return self._cache.tokens_of(page) if self._cache else None

    # --- what changes it ----------------------------------------------------------

    def allocate(self, seq_id, n_tokens: int = 0, *, tokens=None, namespace=None) -> int:
        """A new sequence holding its first ``n_tokens`` tokens: returns how many
        leading ones are cached already (0 without a prefix cache or ``tokens``).

        With a prefix cache and ``tokens`` (the n_tokens ids), the sequence shares the
        registered pages of its longest cached prefix under ``namespace`` (whole
        pages, and at least one token is left to compute, so that its step has a
        query): those ``cached`` tokens count as written, and its next step brings
        the other ``n_tokens - cached`` (its ``q_len``; :meth:`unwritten`). New pages
        for the rest; they are unwritten until a step brings them.

        Args:
          seq_id: any hashable id not held yet.
          n_tokens: the tokens it holds.
          tokens: None, or the ids of those tokens (ints): with a prefix cache, what
            its pages are looked up and, once written, registered by.
          namespace: None, a str, bytes or an int: what else changes the keys and
            values a token gives (the model, an adapter, a tenant). Two namespaces
            never share a page.

        Raises:
          ValueError: ``seq_id`` is already held, ``n_tokens`` is negative or more
            than ``max_pages * page_size``, or ``tokens`` are not its n_tokens ids.
          PoolExhausted: too few free pages (nothing is allocated).
        """
        self._idle("allocate")
        if seq_id in self._sequences:
            raise ValueError(f"allocate: sequence {seq_id!r} is already allocated; free it first")
        n_tokens = _count("n_tokens", n_tokens, 0)
        ids = None if tokens is None else token_ids("tokens", tokens, n_tokens)
        space = as_namespace(namespace)
        self._check_length(seq_id, n_tokens)
        pages, keys = [], []
        if self._cache is not None and ids is not None:
            most = max(n_tokens - 1, 0) // self.page_size  # at least one token to compute
            pages, keys = self._cache.match(ids, space, most, self.page_size)
        reused = sum(self._cache.is_reusable(p) for p in pages) if pages else 0
        needed = -(-n_tokens // self.page_size) - len(pages)
        self._check_room(seq_id, needed, self.free_pages - reused)
        for page in pages:  # the cached prefix: shared
            self._cache.unpark(page)
            self._refs[page] += 1
        cached = len(pages) * self.page_size
        sequence = _Sequence(list(pages), cached, cached, namespace=space, keys=keys)
        sequence.ids = [] if self._cache is None or ids is None else list(ids[:cached])
        self._sequences[seq_id] = sequence
        self._grow(sequence, n_tokens - cached, None if ids is None else ids[cached:])
        sequence.last = n_tokens
        if self._cache is not None and ids is not None:
            self._cache.hit_tokens += cached
            self._cache.miss_tokens += n_tokens - cached
        return cached

    def extend(self, seq_id, n_tokens: int, *, tokens=None) -> None:
        """Room for ``n_tokens`` more tokens of sequence ``seq_id`` (it then holds
        them, unwritten: its next step brings them): new pages as needed, and a copy of
        its last page first when that page is shared (a fork, a cached prefix) and the
        new tokens go into it, so that no other sequence's tokens ever change. The copy
        is carried by the next step, before its writes. ``tokens``: the new tokens' ids,
        with a prefix cache what makes its completed pages cacheable (without them, no
        page from here on is registered). With a window, the pages no query of the
        sequence can read any more (a rewind now takes back at most these n tokens) go
        back to the pool first.

        Raises:
          ValueError: ``n_tokens`` negative, past ``max_pages * page_size`` tokens,
            ``tokens`` not its n_tokens ids, or a copy past the ``max_copies`` one step
            carries.
          PoolExhausted: too few free pages (nothing is changed).
        """
        self._idle("extend")
        sequence = self._get(seq_id)
        n_tokens = _count("n_tokens", n_tokens, 0)
        ids = None if tokens is None else token_ids("tokens", tokens, n_tokens)
        ps = self.page_size
        self._check_length(seq_id, sequence.length + n_tokens)
        shared = bool(n_tokens and sequence.length % ps and self._refs[sequence.pages[-1]] > 1)
        if shared and len(self._copies) >= self.max_copies:
            raise ValueError(
                f"extend: sequence {seq_id!r} writes into a page it shares, and the "
                f"{len(self._copies)} copy-on-write copies pending are max_copies="
                f"{self.max_copies}; run a step (it carries them) first"
            )
        gone = self._out_of_window(sequence, min(sequence.written, sequence.length))
        needed = -(-(sequence.length + n_tokens) // ps) - len(sequence.pages) + shared
        freed = sum(self._refs[sequence.pages[j]] == 1 for j in gone)
        self._check_room(seq_id, needed, self.free_pages + freed)
        self._give_back(sequence, gone)
        self._grow(sequence, n_tokens, ids)
        sequence.last = n_tokens

    def fork(self, parent, child) -> None:
        """A new sequence ``child`` holding what ``parent`` holds (its prompt, say),
        sharing its pages: no page is copied until one of them writes into a shared
        page (then :meth:`extend` copies it).

        Raises:
          ValueError: ``child`` is already held, or ``parent`` holds tokens no
            confirmed step has written (their keys are not in its pages yet: run the
            step that writes them, then fork).
        """
        self._idle("fork")
        source = self._get(parent)
        if child in self._sequences:
            raise ValueError(f"fork: sequence {child!r} is already allocated; free it first")
        if source.written < source.length:
            raise ValueError(
                f"fork: sequence {parent!r} has {source.length - source.written} tokens no "
                f"step has written yet; run a step (and confirm it) first"
            )
        if parent in self._moved:
            raise ValueError(
                f"fork: sequence {parent!r} has accepted tokens no step has moved into "
                f"place yet; run a step (and confirm it) first"
            )
        for page in source.pages:
            if page != RETURNED:
                self._refs[page] += 1
        sequence = dataclasses.replace(
            source, pages=list(source.pages), last=0, ids=list(source.ids), keys=list(source.keys)
        )
        self._sequences[child] = sequence
        self._give_back(sequence, self._out_of_window(sequence, sequence.length))

    def rewind(self, seq_id, n: int) -> None:
        """Takes back the last ``n`` tokens of sequence ``seq_id`` (speculative
        decoding): 0 <= n <= what its last extension brought, written or not. Whole
        pages past its new length are returned to the pool; the tokens past it are
        never read, and the next extension writes over them (copying first if the page
        is shared). A windowed allocator never needs a page it gave back: it keeps every
        page the queries after a rewind may read."""
        self._idle("rewind")
        sequence = self._get(seq_id)
        integral = isinstance(n, numbers.Integral) and not isinstance(n, bool)
        if not integral or not 0 <= n <= sequence.last:
            raise ValueError(
                f"rewind: n={n!r} is outside [0, {sequence.last}], the tokens sequence "
                f"{seq_id!r} took in its last extension"
            )
        sequence.length -= int(n)
        sequence.last -= int(n)
        sequence.written = min(sequence.written, sequence.length)
        del sequence.ids[sequence.length :]
        del sequence.keys[len(sequence.ids) // self.page_size :]
        keep = -(-sequence.length // self.page_size)
        self._release_all(sequence.pages[keep:])
        del sequence.pages[keep:]

    def accept(self, seq_id, kept, *, tokens=None) -> None:
        """Keeps the accepted path of sequence ``seq_id``'s last extension (a token tree
        a confirmed step verified): its tokens at the indices ``kept`` (ints, increasing:
        a root-to-leaf path of the tree, or a prefix of one, in order) become the
        positions from ``length - last`` on, and the rest is taken back as
        :meth:`rewind` takes it (the sequence then holds ``length - last + len(kept)``
        tokens, all written; a rewind may take back up to ``len(kept)``).

        The keys and values move by the next step (:attr:`PagedBatch.moves`, after
        its copies and before its writes, every moved slot read as the pool was
        before the step), so the sequence may take part in that step with new tokens
        or not. A page the moves write that another sequence shares (a fork made
        since the tree's step) is copied first. With a prefix cache, the pages that
        held the tree are unregistered (a tree's slots are no sequence); their ids
        were not tracked (extend a tree without ``tokens``), so ``tokens``, the kept
        tokens' ids, lets the pages be registered again once written in order.

        Raises:
          ValueError: ``kept`` not such indices of the last extension, tokens of it
            no confirmed step has written, moves pending for it already (run a step),
            more than ``max_moves`` moves or ``max_copies`` copies pending.
          PoolExhausted: no free page for a copy of a shared page (nothing changes).
        """
        self._idle("accept")
        sequence = self._get(seq_id)
        if sequence.written < sequence.length or seq_id in self._moved:
            raise ValueError(
                f"accept: sequence {seq_id!r} has tokens no step has written or moved into "
                f"place yet; run its tree's step (and confirm it) first, and accept once"
            )
        kept, moves = path_positions(kept, sequence.last, sequence.length)
        ids = None if tokens is None else token_ids("tokens", tokens, len(kept))
        ps, pages = self.page_size, list(sequence.pages)
        shared = sorted({t // ps for _, t in moves if self._refs[pages[t // ps]] > 1})
        if len(self._copies) + len(shared) > self.max_copies:
            raise ValueError(
                f"accept: sequence {seq_id!r} moves tokens into {len(shared)} page(s) it "
                f"shares, and {len(self._copies)} copies are pending of max_copies="
                f"{self.max_copies}; run a step (it carries them) first"
            )
        if len(self._moves) + len(moves) > self.max_moves:
            raise ValueError(
                f"accept: sequence {seq_id!r} needs {len(moves)} slot moves, and "
                f"{len(self._moves)} are pending of max_moves={self.max_moves}; make the "
                f"allocator with a larger max_moves, or run a step first"
            )
        self._check_room(seq_id, len(shared), self.free_pages)
        for j in shared:  # copy-on-write: the moves then fill this sequence's own copy
            target = self._take()
            self._copies.append((self._source(pages[j]), target))
            self._release_all([pages[j]])
            sequence.pages[j] = target
        self._moves += [(pages[s // ps] * ps + s % ps,
                         sequence.pages[t // ps] * ps + t % ps) for s, t in moves]  # fmt: skip
        self._keep_path(sequence, kept, ids)
        if moves:
            self._moved.add(seq_id)

    def _keep_path(self, sequence: _Sequence, kept: list[int], ids) -> None:
        """The bookkeeping of :meth:`accept`: the sequence holds its committed tokens
        and the kept ones, all written; the ids of the kept tokens (those of the tree
        when they were tracked, else ``ids``); the pages that held the tree
        unregistered, those past the new length released."""
        ps, start = self.page_size, sequence.length - sequence.last
        tree_ids = sequence.ids[start : sequence.length]
        tracked = len(tree_ids) == sequence.last
        del sequence.ids[start:]
        if tracked:
            sequence.ids += [tree_ids[k] for k in kept]
        elif ids is not None and len(sequence.ids) == start:
            sequence.ids += ids
        if self._cache is not None:
            for page in sequence.pages[start // ps :]:
                if page != RETURNED:
                    self._cache.forget(page)
        del sequence.keys[start // ps :]
        sequence.length = sequence.written = start + len(kept)
        sequence.last = len(kept)
        keep = -(-sequence.length // ps)
        self._release_all(sequence.pages[keep:])
        del sequence.pages[keep:]

    def free(self, seq_id) -> None:
        """Sequence ``seq_id`` is finished: its pages go back to the pool (a page
        another sequence still shares stays held; with a prefix cache, a page that
        holds a cached prefix stays cached, reusable)."""
        self._idle("free")
        sequence = self._get(seq_id)
        self._release_all(sequence.pages)
        del self._sequences[seq_id]
        self._moved.discard(seq_id)

    # --- what a step takes --------------------------------------------------------

    def batch(self, rows, tokens: int) -> PagedBatch:
        """The arrays of a step, changing nothing: ``rows`` is a list of ``(seq_id,
        q_len)``, the sequences of the step in the order of their tokens in x, each at
        most once, ``q_len`` the tokens it holds that no confirmed step has written
        (:meth:`unwritten`: what :meth:`allocate` and :meth:`extend` gave it since its
        last step, less a cached prefix); ``tokens`` the step's Tq (x (1, Tq, D);
        tokens past the rows' are padding). The step carries every pending
        copy-on-write copy, before its writes. Once the step has run, :meth:`confirm`
        the batch; until then nothing else may change the allocator (a batch made again
        replaces this one: a retried step).

        Raises:
          ValueError: more rows than ``max_sequences``, a sequence twice, a q_len other
            than the sequence's unwritten tokens, or more tokens than ``tokens``.
        """
        tokens = _count("tokens", tokens, 1)
        rows = [tuple(row) for row in rows]
        if len(rows) > self.max_sequences:
            raise ValueError(
                f"batch: a step takes at most max_sequences={self.max_sequences} sequences, "
                f"got {len(rows)}"
            )
        table = np.zeros((self.max_sequences, self.max_pages), np.int32)
        lengths = np.zeros(self.max_sequences, np.int32)
        q_lens = np.zeros(self.max_sequences, np.int32)
        seen, held = set(), []
        for b, row in enumerate(rows):
            if len(row) != 2:
                raise ValueError(f"batch: rows[{b}] must be (seq_id, q_len), got {row!r}")
            seq_id, q_len = row
            sequence = self._get(seq_id)
            if seq_id in seen:
                raise ValueError(
                    f"batch: sequence {seq_id!r} is in rows twice; a step takes each "
                    f"sequence once, with all its new tokens"
                )
            seen.add(seq_id)
            pending = sequence.length - sequence.written
            if (
                isinstance(q_len, bool)
                or not isinstance(q_len, numbers.Integral)
                or (q_len != pending)
            ):
                raise ValueError(
                    f"batch: q_len of sequence {seq_id!r} must be {pending}, the tokens "
                    f"allocate/extend gave it since its last confirmed step, got {q_len!r}"
                )
            table[b, : len(sequence.pages)] = sequence.pages
            lengths[b], q_lens[b] = sequence.length, pending
            held.append((sequence.pages, sequence.written))
        starts = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
        if starts[-1] > tokens:
            raise ValueError(
                f"batch: the step's rows bring {int(starts[-1])} tokens, more than its "
                f"tokens={tokens}"
            )
        copies = np.full((self.max_copies, 2), -1, np.int32)
        if self._copies:
            copies[: len(self._copies)] = self._copies
        moves = np.full((self.max_moves, 2), -1, np.int32)
        if self._moves:
            moves[: len(self._moves)] = self._moves
        shared = None
        if self.cascade and self.window is None:
            shared = shared_prefixes(held, self.page_size, self.max_sequences)
        batch = PagedBatch(table, lengths, starts, copies, self.page_size, self.pages,
                           moves=moves, shared_prefixes=shared)  # fmt: skip
        self._outstanding = (batch, [(seq_id, int(q)) for seq_id, q in rows])
        return batch

    def confirm(self, batch: PagedBatch) -> None:
        """The step of ``batch`` (the last :meth:`batch` made) has run: its rows'
        tokens are written and its copies done. With a prefix cache, the full pages it
        completed whose token ids are known are registered now; with a window, the
        pages its rows' queries left behind go back to the pool.

        Raises:
          ValueError: ``batch`` is not the last one made, or it was confirmed already.
        """
        if self._outstanding is None or not _same(batch, self._outstanding[0]):
            raise ValueError(
                "confirm: this is not the batch the allocator made last (or it was "
                "confirmed already); confirm the batch whose step ran, once"
            )
        for seq_id, _ in self._outstanding[1]:
            sequence = self._sequences[seq_id]
            sequence.written = sequence.length
            self._register(sequence)
            first_query = sequence.length - sequence.last  # the earliest after a rewind
            self._give_back(sequence, self._out_of_window(sequence, first_query))
        self._copies, self._moves = [], []
        for seq_id in self._moved:  # their accepted tokens are in place now
            self._register(self._sequences[seq_id])
        self._moved = set()
        self._outstanding = None

    # --- the pages ----------------------------------------------------------------

    def _idle(self, what: str) -> None:
        """Raises ValueError while a batch waits for :meth:`confirm`."""
        if self._outstanding is not None:
            raise ValueError(
                f"{what}: a step's batch is waiting to be confirmed; run the step, then "
                f"alloc.confirm(batch), before changing the allocator"
            )

    def _get(self, seq_id) -> _Sequence:
        if seq_id not in self._sequences:
            raise KeyError(f"no sequence {seq_id!r} is allocated")
        return self._sequences[seq_id]

    def _check_length(self, seq_id, length: int) -> None:
        ps = self.page_size
        if length > self.max_pages * ps:
            raise ValueError(
                f"extend: sequence {seq_id!r} would hold {length} tokens, more than "
                f"max_pages * page_size = {self.max_pages} * {ps} = {self.max_pages * ps}"
            )

    def _check_room(self, seq_id, needed: int, available: int) -> None:
        if needed > available:
            raise PoolExhausted(
                f"the pool of {self.pages} pages is exhausted: sequence {seq_id!r} needs "
                f"{needed} more page(s) and {available} are free; free finished "
                f"sequences, or make a larger pool"
            )

    def _grow(self, sequence: _Sequence, n_tokens: int, ids) -> None:
        """``n_tokens`` more tokens of ``sequence``, their room checked: the copy of a
        shared partial last page, then new pages; the ids tracked with a prefix cache."""
        ps = self.page_size
        new_length = sequence.length + n_tokens
        if n_tokens and sequence.length % ps:
            page = sequence.pages[-1]
            if self._refs[page] > 1:  # copy-on-write of the shared partial last page
                target = self._take()
                self._copies.append((self._source(page), target))
                self._release_all([page])
                sequence.pages[-1] = target
            elif self._cache is not None:  # written in place: a cached page must agree
                slot, held = sequence.length % ps, self._cache.tokens_of(page)
                same = ids is not None and held is not None
                if not (same and tuple(ids[: ps - slot]) == held[slot : slot + n_tokens]):
                    self._cache.forget(page)
        while len(sequence.pages) < -(-new_length // ps):
            sequence.pages.append(self._take())
        if self._cache is not None and ids is not None and len(sequence.ids) == sequence.length:
            sequence.ids += ids
        sequence.length = new_length

    def _register(self, sequence: _Sequence) -> None:
        """Registers the full pages of ``sequence`` a step has written whose ids are
        known (a prefix cache's): each under the key chained from the one before."""
        if self._cache is None:
            return
        ps = self.page_size
        while len(sequence.keys) < min(sequence.written, len(sequence.ids)) // ps:
            j = len(sequence.keys)
            parent = sequence.keys[-1] if sequence.keys else ROOT
            chunk = tuple(sequence.ids[j * ps : (j + 1) * ps])
            key = self._cache.key(parent, chunk, sequence.namespace)
            sequence.keys.append(key)
            if sequence.pages[j] != RETURNED:
                self._cache.register(sequence.pages[j], key, parent, chunk, sequence.namespace)

    def _out_of_window(self, sequence: _Sequence, first_query: int) -> list[int]:
        """The page-table entries of ``sequence`` (with a window) that no query from
        position ``first_query`` on can read: wholly before ``first_query - left``, past
        the pages of the sink tokens, and not returned yet."""
        if self.window is None:
            return []
        ps, left = self.page_size, self.window[0]
        first = max(sequence.returned, -(-self.sink_tokens // ps))
        end = min(max(0, first_query - left) // ps, len(sequence.pages))
        return list(range(first, end))

    def _give_back(self, sequence: _Sequence, entries: list[int]) -> None:
        """Returns the pages of ``entries`` to the pool, their entries RETURNED."""
        if not entries:
            return
        self._release_all([sequence.pages[j] for j in entries])
        for j in entries:
            sequence.pages[j] = RETURNED
        sequence.returned = entries[-1] + 1

    def _source(self, page: int) -> int:
        """Where ``page``'s content is before the next step: the source of the pending
        copy into it, if any (the step reads every copy's source before writing)."""
        for source, target in self._copies:
            if target == page:
                return source
        return page

    def _take(self) -> int:
        page = self._free.pop() if self._free else self._cache.evict()
        self._refs[page] = 1
        return page

    def _release(self, page: int) -> None:
        """One holder fewer for ``page``; a page nobody holds is free (with a prefix
        cache, one that holds a cached prefix waits in ``self._parked`` to be parked as
        reusable by :meth:`_release_all`), and a pending copy into it is dropped."""
        self._refs[page] -= 1
        if self._refs[page] == 0:
            if self._cache is not None and self._cache.tokens_of(page) is not None:
                self._parked.append(page)
            else:
                self._free.append(page)
            # A copy (or move) into a page nobody holds is dropped: the page may be a new
            # copy's.
            self._copies = [c for c in self._copies if c[1] != page]
            ps = self.page_size
            self._moves = [mv for mv in self._moves if mv[1] // ps != page]

    def _release_all(self, pages: list[int]) -> None:
        """:meth:`_release` of each of a sequence's ``pages`` (entries RETURNED
        skipped); the cached ones are parked last first: the least recently used, so a
        prefix's tail is evicted before its head."""
        self._parked = []
        for page in pages:
            if page != RETURNED:
                self._release(page)
        for page in reversed(self._parked):
            self._cache.park(page)
        self._parked = []


def _window_options(window, sink_tokens, prefix_cache) -> tuple:
    """``(window, sink_tokens)`` checked: a window as the layers' ``(left, right)``."""
    window = normalize_window(window)
    if isinstance(sink_tokens, bool) or not isinstance(sink_tokens, numbers.Integral):
        raise ValueError(f"sink_tokens must be an int >= 0, got {sink_tokens!r}")
    if sink_tokens < 0 or (sink_tokens and window is None):
        raise ValueError(
            f"sink_tokens must be >= 0 and needs a window (the layers' sink tokens), got "
            f"sink_tokens={sink_tokens!r} with window={window}"
        )
    if window is not None and prefix_cache:
        raise ValueError(
            "prefix_cache=True with a window is not served: a windowed allocator gives "
            "back the pages of a prefix as its sequence grows; cache prefixes in the "
            "global layers' allocator"
        )
    return window, int(sink_tokens)


def _same(a: PagedBatch, b: PagedBatch) -> bool:
    """Whether two batches are the same step (their arrays equal)."""
    if not isinstance(a, PagedBatch):
        return False
    fields = ("page_table", "kv_lengths", "query_starts", "copies", "moves")
    return all(_equal(getattr(a, f), getattr(b, f)) for f in fields)


def _equal(a, b) -> bool:
    """Whether two arrays of a batch (or None) are equal."""
    if a is None or b is None:
        return a is None and b is None
    return np.array_equal(np.asarray(a), np.asarray(b))
