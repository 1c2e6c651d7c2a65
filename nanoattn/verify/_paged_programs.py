"""The programs check of a paged decoder: seeded random programs of a server's
allocator calls and steps, every token a step feeds checked against the full
forward of its own sequence.

A program is a random sequence of moves over the decoder's allocator
(:class:`~nanoattn.verify.PagedDecoder`'s ``allocator``) and its pool, after poison
sequences filled the pool and were freed: ``allocate``, ``extend``, ``fork``,
``rewind``, ``free`` and ``step``, and the orders a fixed script never tries: forks
before and after the parent's step, chains of forks (fork, extend, rewind, fork,
extend: a copy whose source is another pending copy's target), frees with copies
pending (of the copy's target, or of its source, whose page another copy then
takes). The allocator may refuse a call (a ValueError that changes nothing); no
token may be wrong. A decoder with ``prefix_cache`` gets token ids (a
:class:`~._paged_decoding.Vocabulary`'s) and two more moves: a prompt that shares a
prefix of an earlier one under one of two namespaces (a finished sequence freed first
now and then: its pages stay cached), and a prompt of fresh tokens fed at once
(pressure: cached pages evicted). A step brings every held sequence's unwritten tokens that fit
in :data:`STEP_TOKENS`, in a random order of rows, the padding past them poison.
"""

import collections

import numpy as np

from ._inputs import Inputs, as_features
from ._leaks import Leaks, per_feature
from ._paged_decoding import Vocabulary
from ._report import CheckResult

PROGRAMS = 3  # seeded programs per check
MOVES = 24  # moves per program
ROWS = 4  # the rows of a step
HELD = 7  # sequences held at once
STEP_TOKENS = 8  # the tokens of a step
TRACE = 14  # the last moves a failure's sentence shows
# The orders a check reports it met (counted from the allocator's public views).
ORDERS = ("copies", "chained copies", "copies dropped", "copies into a freed page",
          "copies from a freed page", "refused")  # fmt: skip
PREFIX_ORDERS = ("prefix hits", "evictions")  # with a prefix cache
NAMESPACES = ("tenant-a", "tenant-b")


class _Program:
    """One program: the decoder's rows protocol (``rows``, a ``_Rows``), the model of
    what each sequence holds (its inputs, how many a step has fed, its last
    extension), the deviations found and the moves made so far."""

    def __init__(self, rows, inputs: Inputs, seed: int, leaks: Leaks, index: int):
        self.rows, self.inputs, self.leaks, self.index = rows, inputs, leaks, index
        self.alloc = rows.alloc
        self.rng = np.random.default_rng([seed, index])
        self.held: dict = {}  # seq -> list of its inputs
        self.fed: dict = {}  # seq -> how many a step has fed
        self.last: dict = {}  # seq -> its last extension
        self.moves: list[str] = []
        self.steps = self.tokens = 0
        self.orders = collections.Counter()  # the orders met (ORDERS)
        self.unheld = set(self.alloc.free_page_ids())  # the free pages after the last call
        self.freed: set = set()  # pages freed since the last step
        self.names = 0
        self.width = rows.max_pages * self.alloc.page_size  # the full forward's length
        self.prefix = rows.decoder.prefix_cache
        self.vocab = Vocabulary(inputs, self.rng) if self.prefix else None
        self.ids: dict = {}  # seq -> its token ids (with a prefix cache)
        self.space: dict = {}  # seq -> its namespace (with a prefix cache)
        self.prompts: list = []  # (namespace, ids) of each prompt allocated
        self.result = None

    def _tokens(self, n: int) -> list:
        return list(self.inputs.random(self.rng, 1, n)[0])

    def _draw(self, n: int, ids=None):
        """n new inputs and their token ids (None without a prefix cache)."""
        if not self.prefix:
            return self._tokens(n), None
        ids = self.vocab.draw(n) if ids is None else list(ids)
        return list(self.vocab(ids)), ids

    def _call(self, text: str, method: str, *args, **options) -> bool:
        copies = self.alloc.pending_copies()
        last = {s: self.alloc.pages_of(s)[-1:] for s in self.alloc.sequences()}
        evictions = self.alloc.stats().evictions if self.prefix else 0
        try:
            self.result = getattr(self.alloc, method)(*args, **options)
        except ValueError as error:  # refused: the allocator is unchanged
            self.moves.append(f"{text} (refused: {str(error).split(';')[0]})")
            self.orders["refused"] += 1
            return False
        self.moves.append(text)
        after = self.alloc.pending_copies()
        for source, target in set(after) - set(copies):
            self.orders["copies"] += 1
            self.orders["chained copies"] += [source] != last.get(args[0], [source])
            self.orders["copies into a freed page"] += target in self.freed
        self.orders["copies dropped"] += len(set(copies) - set(after))
        freed = set(self.alloc.free_page_ids()) - self.unheld
        self.orders["copies from a freed page"] += bool(freed & {s for s, _ in after})
        self.freed |= freed
        self.unheld = set(self.alloc.free_page_ids())
        if self.prefix:
            self.orders["evictions"] += self.alloc.stats().evictions - evictions
        return True

    def allocate(self, n: int, ids=None, space=None):
        if len(self.held) >= HELD:
            return None
        self.names += 1
        seq = f"s{self.names}"
        tokens, ids = self._draw(n, ids)
        options = {}
        if self.prefix:
            space = space or NAMESPACES[int(self.rng.integers(0, 2))]
            options = dict(tokens=ids, namespace=space)
        if self._call(f"allocate {seq} {n}", "allocate", seq, n, **options):
            cached = self.result or 0  # a prefix cache's hit: those count as fed
            self.held[seq], self.fed[seq], self.last[seq] = tokens, cached, n
            if self.prefix:
                self.ids[seq], self.space[seq] = ids, space
                self.prompts.append((space, ids))
                self.orders["prefix hits"] += cached > 0
                self.moves[-1] += f" ({cached} cached)"
            return seq
        return None

    def extend(self, seq, n: int) -> bool:
        tokens, ids = self._draw(n)
        options = {} if ids is None else dict(tokens=ids)
        if self._call(f"extend {seq} {n}", "extend", seq, n, **options):
            self.held[seq] += tokens
            self.last[seq] = n
            if ids is not None:
                self.ids[seq] += ids
            return True
        return False

    def fork(self, parent):
        if parent is None:
            return None
        if len(self.held) >= HELD:  # a finished sequence makes room
            done = [s for s in self.held if s != parent and self.fed[s] == len(self.held[s])]
            self.free(self.rng.choice(done or [s for s in self.held if s != parent]).item())
        self.names += 1
        child = f"s{self.names}"
        if self._call(f"fork {parent} {child}", "fork", parent, child):
            self.held[child] = list(self.held[parent])
            self.fed[child], self.last[child] = len(self.held[parent]), 0
            if self.prefix:
                self.ids[child], self.space[child] = list(self.ids[parent]), self.space[parent]
            return child
        return None

    def rewind(self, seq, n: int) -> bool:
        if self._call(f"rewind {seq} {n}", "rewind", seq, n):
            del self.held[seq][len(self.held[seq]) - n :]
            if self.prefix:
                del self.ids[seq][len(self.held[seq]) :]
            self.fed[seq] = min(self.fed[seq], len(self.held[seq]))
            self.last[seq] -= n
            return True
        return False

    def free(self, seq) -> None:
        if seq is not None and self._call(f"free {seq}", "free", seq):
            for table in (self.held, self.fed, self.last, self.ids, self.space):
                table.pop(seq, None)

    def step(self) -> None:
        """One step of the decoder over the sequences whose unwritten tokens fit, each
        output checked against its sequence's full forward."""
        rows, budget = [], STEP_TOKENS
        for seq in self.rng.permutation(list(self.held)).tolist():
            n = len(self.held[seq]) - self.fed[seq]
            if n <= budget and len(rows) < ROWS and (n or self.rng.random() < 0.3):
                rows.append((seq, n))
                budget -= n
        x = [np.stack(self.held[s][self.fed[s] :]) for s, n in rows if n]
        y = self.rows.run(rows, STEP_TOKENS, x)
        self.freed, self.unheld = set(), set(self.alloc.free_page_ids())
        self.moves.append("step " + ",".join(f"{s}:{n}" for s, n in rows))
        self.steps += 1
        if not rows:
            return
        whole = [self.held[s] + self._tokens(self.width - len(self.held[s])) for s, _ in rows]
        pad = [whole[0]] * (ROWS - len(whole))  # one shape for every call of full
        batch = np.stack([np.stack(row) for row in whole + pad])
        want = as_features(self.rows.decoder.full(batch), batch.shape, "full")
        at = 0
        for r, (seq, n) in enumerate(rows):
            start = self.fed[seq]
            got = y[at : at + n][None]
            self._compare(got, want[r : r + 1, start : start + n], seq, start)
            at += n
            self.fed[seq] += n
            self.tokens += n

    def _compare(self, got, want, seq, start: int) -> None:
        trace = "; ".join(self.moves[-TRACE:])
        self.leaks.add(
            per_feature(got, want),
            {"program": self.index, "step": self.steps, "sequence": seq},
            (self.index, self.steps),
            f"program {self.index}, step {self.steps}: position {start} + {{position}} of "
            f"sequence {seq} (feature {{feature}}) differs from the full forward of its own "
            f"sequence by {{deviation:.3g}}; the last moves: {trace}",
            axis="offset",
            named=(),
        )

    def some(self, written: bool = False):
        """A random sequence held; with ``written`` one whose tokens a step has all fed
        (a step first, if there is none), one with a partial last page if there is."""
        if written and self.held and all(self.fed[s] < len(self.held[s]) for s in self.held):
            self.step()
        pool = [s for s in self.held if not written or self.fed[s] == len(self.held[s])]
        partial = [s for s in pool if len(self.held[s]) % self.alloc.page_size]
        pool = partial if written and partial else pool
        return self.rng.choice(pool).item() if pool else None

    def _make_room(self) -> None:
        """Frees sequences (those a step has fed first: their pages stay cached) until
        two more may be held."""
        while len(self.held) > HELD - 2:
            done = [s for s in self.held if self.fed[s] == len(self.held[s])]
            self.free(self.rng.choice(done or list(self.held)).item())

    def move(self) -> None:
        r = self.rng
        kinds = ["allocate", "extend", "fork", "rewind", "free", "step", "chain", "early fork",
                 "free target", "free source"]  # fmt: skip
        p = [0.12, 0.14, 0.08, 0.06, 0.04, 0.2, 0.1, 0.08, 0.09, 0.09]
        if self.prefix:  # prompts that share prefixes, and pressure
            kinds, p = [*kinds, "shared prompt", "pressure"], [x * 0.7 for x in p] + [0.2, 0.1]
        kind = r.choice(kinds, p=p)
        seq = self.some()
        if kind == "shared prompt" and self.prompts:  # an earlier prompt's prefix, then its own
            space, ids = self.prompts[int(r.integers(0, len(self.prompts)))]
            ids = ids[: int(r.integers(0, len(ids) + 1))] + self.vocab.draw(int(r.integers(0, 3)))
            self._make_room()
            if len(ids) <= self.width - 3:
                self.allocate(len(ids), ids, space if r.random() < 0.8 else None)
        elif kind == "pressure":  # a long prompt of fresh tokens, fed: cached pages evicted
            self._make_room()
            grown = self.allocate(STEP_TOKENS - 1)
            self.step()
            if grown in self.held and self.extend(grown, min(STEP_TOKENS, self.width - 10)):
                self.step()
        elif kind == "allocate" or seq is None:
            self.allocate(int(r.integers(0, 8)))
        elif kind == "extend":
            self.extend(seq, int(r.integers(0, 5)))
        elif kind == "fork":
            self.fork(self.some(written=True) or seq)
        elif kind == "rewind":
            self.rewind(seq, int(r.integers(0, self.last[seq] + 1)))
        elif kind == "free":
            self.free(seq)
        elif kind == "step":
            self.step()
        elif kind == "chain":  # fork, extend, rewind, fork, extend
            child = self.fork(self.some(written=True))
            if child and self.extend(child, 1) and self.rewind(child, 1):
                grandchild = self.fork(child)
                if grandchild:
                    self.extend(grandchild, int(r.integers(1, 3)))
            if r.random() < 0.5:
                self.step()
        elif kind == "early fork":  # a parent whose tokens no step has written yet
            parent = self.allocate(int(r.integers(1, 6)))
            child = parent and self.fork(parent)
            if child:
                self.extend(child, 1)
            self.step()
        else:  # fork, extend (a copy), free its target or its source, fork, extend
            parent = self.some(written=True)
            child = self.fork(parent)
            if child and self.extend(child, 1):
                self.free(child if kind == "free target" else parent)
                other = self.fork(parent if kind == "free target" else self.some(written=True))
                if other:
                    self.extend(other, int(r.integers(1, 3)))
            if r.random() < 0.5:
                self.step()


def check_programs(decoder, inputs: Inputs, T: int, tol: float, make_rows,
                   programs: int = PROGRAMS, moves: int = MOVES) -> CheckResult:  # fmt: skip
    """Runs ``programs`` seeded random programs of ``moves`` moves through the paged
    ``decoder`` (``make_rows(batch, max_len)`` gives a fresh ``_Rows`` over a poisoned
    pool whose sequences hold up to about ``T + 3`` tokens); every token each step
    feeds must equal the full forward of its own sequence, within ``tol``."""
    leaks = Leaks(tol)
    tokens = steps = 0
    orders = collections.Counter()
    for index in range(programs):
        rows = make_rows(ROWS, T + 3)
        rows.fill(STEP_TOKENS)
        program = _Program(rows, inputs, decoder.seed, leaks, index)
        for _ in range(moves):
            program.move()
        program.step()
        tokens, steps = tokens + program.tokens, steps + program.steps
        orders += program.orders
    names = ORDERS + (PREFIX_ORDERS if decoder.prefix_cache else ())
    met = ", ".join(f"{orders[o]} {o}" for o in names)
    result = leaks.result(
        "programs",
        f"{programs} random programs of {moves} moves (allocate, extend, forks before and "
        f"after the parent's step, chains of forks, rewinds then forks, frees with copies "
        f"pending) over a poisoned pool: {tokens} tokens in {steps} steps of up to "
        f"{STEP_TOKENS} reproduce the full forward of their own sequences (met: {met})",
        first="first divergence",
    )
    result.data["orders"] = {o: orders[o] for o in names}
    return result
