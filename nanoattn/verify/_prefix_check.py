"""The prefix cache check of a paged decoder with ``prefix_cache=True``
(:class:`~nanoattn.verify.PagedDecoder`): its allocator's hits, namespaces and
evictions, and the decoder's outputs through them, each sequence against its own full
forward.

Over a pool filled with poison and freed (pages of ``page_size`` tokens, a prompt of two
pages and a token), the check feeds: a prompt A under namespace ``tenant-a`` (nothing
cached: a fresh pool; a prompt that shares A's pages, allocated before A's step, finds
nothing cached either); a prompt B that shares A's two pages, which must hit them (2
pages' tokens cached: its step brings only the rest); A's prompt and one token more
under ``tenant-b``, which must not hit (two namespaces never share); then, A, B and
the other freed (their pages cached, reusable), prompts of fresh tokens, each fed and
freed in turn, until the pool evicts cached pages and writes into them; then A's prompt
again: whatever is still cached, every token computed must equal the full forward (a
page reused after its eviction must never be served as A's).
"""

import dataclasses

import numpy as np

from ._inputs import Inputs, as_features
from ._leaks import Leaks, per_feature
from ._paged_decoding import PagedDecoder, Vocabulary
from ._report import CheckResult

NAMESPACES = ("tenant-a", "tenant-b")


class _Run:
    """The check's sequences over one pool: each fed in one step of its uncached tokens
    (``Tq`` rows, the rest poison), its outputs compared with its full forward."""

    def __init__(self, decoder: PagedDecoder, inputs: Inputs, tol: float, make_rows):
        ps = decoder.page_size
        self.rows = make_rows(3, 3 * ps + 2)  # M pages a sequence, P = 3 M + slack
        self.alloc, self.decoder = self.rows.alloc, decoder
        self.tq = self.rows.max_pages * ps
        self.rows.fill(self.tq)
        self.vocab = Vocabulary(inputs, np.random.default_rng(decoder.seed + 5))
        self.inputs, self.leaks, self.fed = inputs, Leaks(tol), 0

    def feed(self, seq, ids: list, namespace: str, before_step=None) -> int:
        """Allocates ``seq`` with ``ids`` under ``namespace`` (then calls
        ``before_step``), steps its uncached tokens, compares them with its full forward;
        returns how many were cached."""
        cached = self.alloc.allocate(seq, len(ids), tokens=ids, namespace=namespace)
        if before_step is not None:
            before_step()
        x = self.vocab(ids)
        y = self.rows.run([(seq, len(ids) - cached)], self.tq, [x[cached:]])
        want = as_features(self.decoder.full(x[None]), x[None].shape, "full")[0]
        got = y[: len(ids) - cached]
        self.leaks.add(
            per_feature(got[None], want[None, cached:]), {"sequence": str(seq)}, (self.fed,),
            f"position {cached} + {{position}} of sequence {seq!r} ({len(ids)} tokens, "
            f"{cached} of them cached, under namespace {namespace!r}; feature {{feature}}) "
            f"differs from its full forward by {{deviation:.3g}}",
            axis="offset", named=(),
        )  # fmt: skip
        self.fed += 1
        return cached

    def probe(self, ids: list, namespace: str) -> int:
        """The tokens a prompt would find cached now (allocated and freed at once)."""
        cached = self.alloc.allocate("probe", len(ids), tokens=ids, namespace=namespace)
        self.alloc.free("probe")
        return cached

    def pressure(self, namespace: str) -> tuple[int, int, str | None]:
        """Prompts of fresh tokens, each fed and freed (its pages cached in turn), until a
        cached page is evicted: ``(evictions, cached pages written again after their
        eviction, the allocator's refusal or None)``."""
        reusable = set(self.alloc.free_page_ids()) - set(self._free_only())
        before, taken = self.alloc.stats().evictions, set()
        for k in range(self.alloc.pages):
            if self.alloc.stats().evictions > before:
                break
            try:
                self.feed(("pressure", k), self.vocab.draw(self.tq - 1), namespace)
            except ValueError as error:  # PoolExhausted with cached pages left: a bug
                return 0, 0, str(error).split(";")[0]
            taken |= set(self.alloc.pages_of(("pressure", k)))
            self.alloc.free(("pressure", k))
        return self.alloc.stats().evictions - before, len(reusable & taken), None

    def _free_only(self) -> list:
        """The free pages that hold no cached prefix."""
        return [p for p in self.alloc.free_page_ids() if self.alloc.cached_tokens(p) is None]


def check_prefix_cache(decoder: PagedDecoder, inputs: Inputs, tol: float,
                       make_rows) -> CheckResult:  # fmt: skip
    """Hits of whole written pages, two namespaces that never share, evictions under
    pressure and a prompt fed again after them, every computed token against its
    sequence's full forward (``make_rows(batch, max_len)``: the decoder's rows over a
    fresh pool, with a prefix cache)."""
    run, ps = _Run(decoder, inputs, tol, make_rows), decoder.page_size
    a = run.vocab.draw(2 * ps + 1)
    b = a[: 2 * ps] + run.vocab.draw(ps)
    problems, early = [], []
    first = run.feed("A", a, NAMESPACES[0], lambda: early.append(run.probe(b, NAMESPACES[0])))
    hit = run.feed("B", b, NAMESPACES[0])
    if early[0]:
        problems.append(
            f"a prompt allocated before the step that writes its prefix hit {early[0]} "
            f"cached tokens: a page is cached only once a step has written it"
        )
    other = run.feed("A under tenant-b", [*a, 0], NAMESPACES[1])
    if first:
        problems.append(f"a prompt in a fresh pool hit {first} cached tokens")
    if hit != 2 * ps:
        problems.append(
            f"a prompt sharing the first {2 * ps} tokens (2 pages) of a written one hit "
            f"{hit} cached tokens, expected {2 * ps}"
        )
    if other:
        problems.append(
            f"namespace {NAMESPACES[1]!r} was served {other} tokens cached under "
            f"{NAMESPACES[0]!r}: two namespaces must never share a page"
        )
    for seq in ("A", "B", "A under tenant-b"):
        run.alloc.free(seq)
    evictions, reused, refusal = run.pressure(NAMESPACES[1])
    if refusal is not None or not evictions:
        problems.append(
            f"prompts of fresh tokens were refused ({refusal}) with cached pages reusable"
            if refusal else "no cached page was evicted when the pool ran out of free pages"
        )  # fmt: skip
    try:
        again = run.feed("A again", [*a, 1], NAMESPACES[0])
    except ValueError as error:  # the pool, out of free pages, kept its cached ones
        again = f"refused: {str(error).split(';')[0]}"
    what = (
        f"over a pool of {run.alloc.pages} pages of {ps}: a prompt of {len(a)} tokens, one "
        f"sharing its first 2 pages ({hit} tokens cached), the first under another namespace "
        f"({other} cached), {evictions} cached pages evicted under pressure and {reused} "
        f"written again, then the first prompt again ({again} cached): every computed token "
        f"reproduces its sequence's full forward"
    )
    result = run.leaks.result("prefix cache", what, first="first divergence")
    result.data.update(hit=hit, other_namespace=other, evictions=evictions, reused=reused)
    if problems and result.passed:
        return dataclasses.replace(result, passed=False, detail="; ".join(problems))
    return result
