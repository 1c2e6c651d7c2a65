"""``PageAllocator``: the host side of a paged KV cache (plain Python and numpy).

It keeps which pages of the pool each sequence holds and how many tokens, hands out
free pages as sequences grow, takes them back when a sequence is freed or rewound,
lets a sequence fork another (sharing its pages, with reference counts, and copying a
shared page before it is written: copy-on-write), and makes the arrays a jitted
decoding step needs (:meth:`PageAllocator.batch`: a
:class:`~nanoattn._layers.caches.paged.PagedBatch` of static shapes, so that admitting
and retiring sequences never recompiles). One allocator serves every layer of a
model: their pools have the same pages, and the page table is shared.
"""

import dataclasses

import numpy as np

from .paged import PagedBatch


class PoolExhausted(ValueError):
    """The pool has too few free pages for what was asked; nothing was changed."""


@dataclasses.dataclass
class _Sequence:
    pages: list[int]
    length: int  # tokens held
    last: int = 0  # tokens the last extension brought (what rewind may take back)


class PageAllocator:
    """The pages of a paged KV cache and the sequences that hold them.

    Args:
      pages: P, the pages of the pool (each layer's cache holds P * page_size tokens).
      page_size: the tokens a page holds.
      max_sequences: the rows of a step's batch (B of its page table).
      max_pages: M, the most pages one sequence may hold (the page table's width):
        sequences are at most M * page_size tokens long.
      max_copies: the copy-on-write copies one step may carry (default
        ``max_sequences``: one per sequence, the most one step can need).
      seed: None to hand out pages lowest first; an int to hand them out in a shuffled
        order (what a long-running server's pool looks like: tests and
        ``verify.check_decoding`` use it).

    Example:
      >>> alloc = PageAllocator(pages=8, page_size=4, max_sequences=2, max_pages=4)
      >>> alloc.allocate("a", 6)  # a prompt of 6 tokens: 2 pages
      >>> alloc.fork("a", "b")  # b shares a's 6 tokens
      >>> alloc.extend("b", 1)  # b's 7th token goes in a's partial page: copied first
      >>> batch = alloc.batch([("a", 6), ("b", 1)], tokens=8)
      >>> batch.kv_lengths.tolist(), batch.query_starts.tolist(), batch.copies[0].tolist()
      ([6, 7], [0, 6, 7], [1, 2])
    """

    def __init__(self, pages: int, page_size: int, *, max_sequences: int, max_pages: int,
                 max_copies: int | None = None, seed: int | None = None):  # fmt: skip
        sizes = dict(pages=pages, page_size=page_size, max_sequences=max_sequences,
                     max_pages=max_pages)  # fmt: skip
        for name, value in sizes.items():
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        self.pages, self.page_size = pages, page_size
        self.max_sequences, self.max_pages = max_sequences, max_pages
        self.max_copies = max_sequences if max_copies is None else max_copies
        order = list(range(pages))
        if seed is not None:
            order = [int(p) for p in np.random.default_rng(seed).permutation(pages)]
        self._free = order[::-1]  # a stack: the next page handed out is the last
        self._refs = np.zeros(pages, np.int64)
        self._sequences: dict = {}
        self._copies: list[tuple[int, int]] = []

    # --- what the host asks -------------------------------------------------------

    @property
    def free_pages(self) -> int:
        """The pages no sequence holds."""
        return len(self._free)

    def length(self, seq_id) -> int:
        """The tokens sequence ``seq_id`` holds."""
        return self._get(seq_id).length

    def pages_of(self, seq_id) -> list[int]:
        """The pages sequence ``seq_id`` holds, in order."""
        return list(self._get(seq_id).pages)

    def sequences(self) -> list:
        """The sequences held, in the order they were allocated or forked."""
        return list(self._sequences)

    def refs(self, page: int) -> int:
        """How many sequences hold ``page``."""
        return int(self._refs[page])

    # --- what changes it ----------------------------------------------------------

    def allocate(self, seq_id, n_tokens: int = 0) -> None:
        """A new sequence, with room for its first ``n_tokens`` tokens (it then holds
        ``n_tokens``: a step's batch writes them).

        Raises:
          ValueError: ``seq_id`` is already held, or ``n_tokens`` is negative or more
            than ``max_pages * page_size``.
          PoolExhausted: too few free pages (nothing is allocated).
        """
        if seq_id in self._sequences:
            raise ValueError(f"sequence {seq_id!r} is already allocated; free it first")
        self._sequences[seq_id] = _Sequence([], 0)
        try:
            self.extend(seq_id, n_tokens)
        except ValueError:
            del self._sequences[seq_id]
            raise

    def extend(self, seq_id, n_tokens: int) -> None:
        """Room for ``n_tokens`` more tokens of sequence ``seq_id`` (it then holds
        them): new pages as needed, and a copy of its last page first when that page
        is shared (a fork) and the new tokens go into it, so that no other sequence's
        tokens ever change.

        Raises:
          ValueError: ``n_tokens`` negative, or past ``max_pages * page_size`` tokens.
          PoolExhausted: too few free pages (nothing is changed).
        """
        sequence = self._get(seq_id)
        if isinstance(n_tokens, bool) or not isinstance(n_tokens, int) or n_tokens < 0:
            raise ValueError(f"n_tokens must be an int >= 0, got {n_tokens!r}")
        ps = self.page_size
        new_length = sequence.length + n_tokens
        if new_length > self.max_pages * ps:
            raise ValueError(
                f"sequence {seq_id!r} would hold {new_length} tokens, more than max_pages * "
                f"page_size = {self.max_pages} * {ps} = {self.max_pages * ps}"
            )
        shared = n_tokens > 0 and sequence.length % ps and self._refs[sequence.pages[-1]] > 1
        needed = -(-new_length // ps) - len(sequence.pages) + (1 if shared else 0)
        if needed > len(self._free):
            raise PoolExhausted(
                f"the pool of {self.pages} pages is exhausted: sequence {seq_id!r} needs "
                f"{needed} more page(s) and {len(self._free)} are free; free finished "
                f"sequences, or make a larger pool"
            )
        if shared:  # copy-on-write of the shared partial last page
            source = sequence.pages[-1]
            target = self._take()
            self._release(source)
            sequence.pages[-1] = target
            self._copies.append((source, target))
        while len(sequence.pages) < -(-new_length // ps):
            sequence.pages.append(self._take())
        sequence.length, sequence.last = new_length, n_tokens

    def fork(self, parent, child) -> None:
        """A new sequence ``child`` holding what ``parent`` holds (its prompt, say),
        sharing its pages: no page is copied until one of them writes into a shared
        page (then :meth:`extend` copies it)."""
        source = self._get(parent)
        if child in self._sequences:
            raise ValueError(f"sequence {child!r} is already allocated; free it first")
        for page in source.pages:
            self._refs[page] += 1
        self._sequences[child] = _Sequence(list(source.pages), source.length)

    def rewind(self, seq_id, n: int) -> None:
        """Takes back the last ``n`` tokens of sequence ``seq_id`` (speculative
        decoding): 0 <= n <= what its last extension brought. Whole pages past its
        new length are returned to the pool; the tokens past it are never read, and
        the next extension writes over them (copying first if the page is shared)."""
        sequence = self._get(seq_id)
        if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= sequence.last:
            raise ValueError(
                f"rewind: n={n!r} is outside [0, {sequence.last}], the tokens sequence "
                f"{seq_id!r} took in its last extension"
            )
        sequence.length -= n
        sequence.last -= n
        keep = -(-sequence.length // self.page_size)
        for page in sequence.pages[keep:]:
            self._release(page)
        del sequence.pages[keep:]

    def free(self, seq_id) -> None:
        """Sequence ``seq_id`` is finished: its pages go back to the pool (a page
        another sequence still shares stays held)."""
        sequence = self._get(seq_id)
        for page in sequence.pages:
            self._release(page)
        del self._sequences[seq_id]

    # --- what a step takes --------------------------------------------------------

    def batch(self, rows, tokens: int) -> PagedBatch:
        """The arrays of a step: ``rows`` is a list of ``(seq_id, q_len)``, the
        sequences of the step in the order of their tokens in x (each already holds its
        ``q_len`` new tokens: :meth:`allocate` or :meth:`extend`), and ``tokens`` the
        step's Tq (x (1, Tq, D); tokens past the rows' are padding). The copies made
        since the last batch are carried out by this step, before its writes.

        Raises:
          ValueError: more rows than ``max_sequences``, more tokens than ``tokens``, a
            q_len outside [0, the sequence's length], or more copies than ``max_copies``.
        """
        if len(rows) > self.max_sequences:
            raise ValueError(
                f"a step takes at most max_sequences={self.max_sequences} sequences, got "
                f"{len(rows)}"
            )
        table = np.zeros((self.max_sequences, self.max_pages), np.int32)
        lengths = np.zeros(self.max_sequences, np.int32)
        q_lens = np.zeros(self.max_sequences, np.int32)
        for b, (seq_id, q_len) in enumerate(rows):
            sequence = self._get(seq_id)
            if not 0 <= q_len <= sequence.length:
                raise ValueError(
                    f"q_len of sequence {seq_id!r} must be in [0, {sequence.length}], the "
                    f"tokens it holds, got {q_len}"
                )
            table[b, : len(sequence.pages)] = sequence.pages
            lengths[b], q_lens[b] = sequence.length, q_len
        starts = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
        if starts[-1] > tokens:
            raise ValueError(
                f"the step's rows bring {int(starts[-1])} tokens, more than its tokens={tokens}"
            )
        if len(self._copies) > self.max_copies:
            raise ValueError(
                f"{len(self._copies)} copy-on-write copies are pending, more than "
                f"max_copies={self.max_copies}; run a step between forks"
            )
        copies = np.full((self.max_copies, 2), -1, np.int32)
        if self._copies:
            copies[: len(self._copies)] = self._copies
        self._copies = []
        return PagedBatch(table, lengths, starts, copies)

    # --- the pages ----------------------------------------------------------------

    def _get(self, seq_id) -> _Sequence:
        if seq_id not in self._sequences:
            raise KeyError(f"no sequence {seq_id!r} is allocated")
        return self._sequences[seq_id]

    def _take(self) -> int:
        page = self._free.pop()
        self._refs[page] = 1
        return page

    def _release(self, page: int) -> None:
        self._refs[page] -= 1
        if self._refs[page] == 0:
            self._free.append(page)
