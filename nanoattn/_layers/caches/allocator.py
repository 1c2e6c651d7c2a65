"""``PageAllocator``: the host side of a paged KV cache (plain Python and numpy).

It keeps which pages of the pool each sequence holds, how many tokens it holds and how
many of them a step has written, hands out free pages as sequences grow, takes them back
when a sequence is freed or rewound, lets a sequence fork another (sharing its pages,
with reference counts, and copying a shared page before it is written: copy-on-write),
and makes the arrays a jitted decoding step needs (:meth:`PageAllocator.batch`: a
:class:`~nanoattn._layers.caches.paged.PagedBatch` of static shapes, so that admitting
and retiring sequences never recompiles). One allocator serves every layer of a
model: their pools have the same pages, and the page table is shared.

A step is two calls around the model's: ``batch = alloc.batch(rows, tokens)``, which
changes nothing (a failed step is retried by calling it again, and any number of models
may run the same batch), then ``alloc.confirm(batch)`` once the step has run: its
tokens are written and its copies done. What may happen between two steps, and why
the rest is refused, is docs/decoding.md's table ("Between two steps").
"""

import dataclasses
import numbers

import numpy as np

from .paged import PagedBatch


class PoolExhausted(ValueError):
    """The pool has too few free pages for what was asked; nothing was changed."""


@dataclasses.dataclass
class _Sequence:
    pages: list[int]
    length: int  # tokens held
    written: int = 0  # tokens a confirmed step has written (the first `written` held)
    last: int = 0  # tokens the last extension brought (what rewind may take back)


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

    Example:
      >>> alloc = PageAllocator(pages=8, page_size=4, max_sequences=2, max_pages=4)
      >>> alloc.allocate("a", 6)  # a prompt of 6 tokens: 2 pages
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
                 max_copies: int | None = None, seed: int | None = None):  # fmt: skip
        self.pages = _count("pages", pages, 1)
        self.page_size = _count("page_size", page_size, 1)
        self.max_sequences = _count("max_sequences", max_sequences, 1)
        self.max_pages = _count("max_pages", max_pages, 1)
        if max_copies is None:
            max_copies = self.max_sequences
        self.max_copies = _count("max_copies", max_copies, 0)
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
        self._outstanding = None  # (the batch made and not confirmed, its rows)

    # --- what the host asks -------------------------------------------------------

    @property
    def free_pages(self) -> int:
        """The pages no sequence holds."""
        return len(self._free)

    def free_page_ids(self) -> list[int]:
        """The pages no sequence holds, the next one handed out last."""
        return list(self._free)

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
        """The pages sequence ``seq_id`` holds, in order."""
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

    # --- what changes it ----------------------------------------------------------

    def allocate(self, seq_id, n_tokens: int = 0) -> None:
        """A new sequence, with room for its first ``n_tokens`` tokens (it then holds
        ``n_tokens``, unwritten: its next step brings them).

        Raises:
          ValueError: ``seq_id`` is already held, or ``n_tokens`` is negative or more
            than ``max_pages * page_size``.
          PoolExhausted: too few free pages (nothing is allocated).
        """
        self._idle("allocate")
        if seq_id in self._sequences:
            raise ValueError(f"allocate: sequence {seq_id!r} is already allocated; free it first")
        self._sequences[seq_id] = _Sequence([], 0)
        try:
            self.extend(seq_id, n_tokens)
        except ValueError:
            del self._sequences[seq_id]
            raise

    def extend(self, seq_id, n_tokens: int) -> None:
        """Room for ``n_tokens`` more tokens of sequence ``seq_id`` (it then holds
        them, unwritten: its next step brings them): new pages as needed, and a copy of
        its last page first when that page is shared (a fork) and the new tokens go
        into it, so that no other sequence's tokens ever change. The copy is carried by
        the next step, before its writes.

        Raises:
          ValueError: ``n_tokens`` negative, past ``max_pages * page_size`` tokens, or
            a copy past the ``max_copies`` one step carries.
          PoolExhausted: too few free pages (nothing is changed).
        """
        self._idle("extend")
        sequence = self._get(seq_id)
        n_tokens = _count("n_tokens", n_tokens, 0)
        ps = self.page_size
        new_length = sequence.length + n_tokens
        if new_length > self.max_pages * ps:
            raise ValueError(
                f"extend: sequence {seq_id!r} would hold {new_length} tokens, more than "
                f"max_pages * page_size = {self.max_pages} * {ps} = {self.max_pages * ps}"
            )
        shared = bool(n_tokens and sequence.length % ps and self._refs[sequence.pages[-1]] > 1)
        if shared and len(self._copies) >= self.max_copies:
            raise ValueError(
                f"extend: sequence {seq_id!r} writes into a page it shares, and the "
                f"{len(self._copies)} copy-on-write copies pending are max_copies="
                f"{self.max_copies}; run a step (it carries them) first"
            )
        needed = -(-new_length // ps) - len(sequence.pages) + shared
        if needed > len(self._free):
            raise PoolExhausted(
                f"the pool of {self.pages} pages is exhausted: sequence {seq_id!r} needs "
                f"{needed} more page(s) and {len(self._free)} are free; free finished "
                f"sequences, or make a larger pool"
            )
        if shared:  # copy-on-write of the shared partial last page
            source = sequence.pages[-1]
            target = self._take()
            self._copies.append((self._source(source), target))
            self._release(source)
            sequence.pages[-1] = target
        while len(sequence.pages) < -(-new_length // ps):
            sequence.pages.append(self._take())
        sequence.length, sequence.last = new_length, n_tokens

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
        for page in source.pages:
            self._refs[page] += 1
        self._sequences[child] = _Sequence(list(source.pages), source.length, source.length)

    def rewind(self, seq_id, n: int) -> None:
        """Takes back the last ``n`` tokens of sequence ``seq_id`` (speculative
        decoding): 0 <= n <= what its last extension brought, written or not. Whole
        pages past its new length are returned to the pool; the tokens past it are
        never read, and the next extension writes over them (copying first if the page
        is shared)."""
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
        keep = -(-sequence.length // self.page_size)
        for page in sequence.pages[keep:]:
            self._release(page)
        del sequence.pages[keep:]

    def free(self, seq_id) -> None:
        """Sequence ``seq_id`` is finished: its pages go back to the pool (a page
        another sequence still shares stays held)."""
        self._idle("free")
        sequence = self._get(seq_id)
        for page in sequence.pages:
            self._release(page)
        del self._sequences[seq_id]

    # --- what a step takes --------------------------------------------------------

    def batch(self, rows, tokens: int) -> PagedBatch:
        """The arrays of a step, changing nothing: ``rows`` is a list of ``(seq_id,
        q_len)``, the sequences of the step in the order of their tokens in x, each at
        most once, ``q_len`` the tokens it holds that no confirmed step has written
        (:meth:`unwritten`: what :meth:`allocate` and :meth:`extend` gave it since its
        last step); ``tokens`` the step's Tq (x (1, Tq, D); tokens past the rows' are
        padding). The step carries every pending copy-on-write copy, before its writes.
        Once the step has run, :meth:`confirm` the batch; until then nothing else may
        change the allocator (a batch made again replaces this one: a retried step).

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
        seen = set()
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
        starts = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
        if starts[-1] > tokens:
            raise ValueError(
                f"batch: the step's rows bring {int(starts[-1])} tokens, more than its "
                f"tokens={tokens}"
            )
        copies = np.full((self.max_copies, 2), -1, np.int32)
        if self._copies:
            copies[: len(self._copies)] = self._copies
        batch = PagedBatch(table, lengths, starts, copies, self.page_size, self.pages)
        self._outstanding = (batch, [(seq_id, int(q)) for seq_id, q in rows])
        return batch

    def confirm(self, batch: PagedBatch) -> None:
        """The step of ``batch`` (the last :meth:`batch` made) has run: its rows'
        tokens are written and its copies done.

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
        self._copies = []
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

    def _source(self, page: int) -> int:
        """Where ``page``'s content is before the next step: the source of the pending
        copy into it, if any (the step reads every copy's source before writing)."""
        for source, target in self._copies:
            if target == page:
                return source
        return page

    def _take(self) -> int:
        page = self._free.pop()
        self._refs[page] = 1
        return page

    def _release(self, page: int) -> None:
        self._refs[page] -= 1
        if self._refs[page] == 0:
            self._free.append(page)
            # A copy into a page nobody holds is dropped: the page may be a new copy's.
            self._copies = [c for c in self._copies if c[1] != page]


def _same(a: PagedBatch, b: PagedBatch) -> bool:
    """Whether two batches are the same step (their arrays equal)."""
    if not isinstance(a, PagedBatch):
        return False
    fields = ("page_table", "kv_lengths", "query_starts", "copies")
    return all(np.array_equal(np.asarray(getattr(a, f)), np.asarray(getattr(b, f))) for f in fields)
