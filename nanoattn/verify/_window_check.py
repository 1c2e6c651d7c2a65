"""The window pages check of a windowed paged decoder (a
:class:`~nanoattn.verify.PagedDecoder` with ``window=(W - 1, 0)`` and ``sink_tokens``):
the pages its queries no longer read go back to the pool, other sequences take them
and write poison into them, and the sequence goes on equal to its full forward.

Over a pool filled with poison and freed, one sequence of ``W + S0 + 3 page_size + 2``
tokens is fed a prompt of a few tokens, then one token a step, with a speculative
chunk of 3 whose last 2 are rejected (rewound) now and then. Before each step, when
the pool has free pages, a poison sequence takes them (the pages given back are
handed out first), its NaN and huge inputs written into them in the same step as the
sequence's next token, and is freed. After every step the sequence holds at most
``ceil((W - 1 + q_len) / page_size) + 1`` pages besides its sink tokens', and at the
end each of its tokens must equal its full forward.
"""

import dataclasses

import numpy as np

from ._inputs import Inputs, as_features
from ._leaks import Leaks, per_feature
from ._paged_decoding import PagedDecoder
from ._report import CheckResult

STEP_TOKENS = 8  # the tokens of a step: the sequence's and a poison sequence's
SPECULATIVE = 3  # a chunk of 3 tokens, the last 2 rejected, every 4th step


def _schedule(length: int, prompt: int) -> list[int]:
    """The tokens of each step: the prompt, then 1, and every 4th step a speculative
    chunk (``SPECULATIVE``: 1 kept), until ``length`` tokens are kept."""
    sizes, kept = [prompt], prompt
    while kept < length:
        sizes.append(SPECULATIVE if len(sizes) % 4 == 0 and kept + SPECULATIVE <= length else 1)
        kept += 1
    return sizes


def check_window_pages(decoder: PagedDecoder, inputs: Inputs, tol: float,
                       make_rows) -> CheckResult:  # fmt: skip
    """Pages given back, taken by poison sequences and written while the sequence goes
    on (``make_rows(batch, max_len)``: the decoder's rows over a fresh pool, with its
    window)."""
    ps, left, sinks = decoder.page_size, decoder.window[0], decoder.sink_tokens
    length = left + 1 + sinks + 3 * ps + 2
    rows = make_rows(2, length)
    alloc = rows.alloc
    rows.fill(STEP_TOKENS)
    x = inputs.random(np.random.default_rng(decoder.seed + 7), 1, length + SPECULATIVE)[0]
    outputs, kept, most, problems = [], 0, 0, []
    gave_back, reused, entries = set(), set(), []
    for k, n in enumerate(_schedule(length, min(4, length))):
        (alloc.extend if kept else alloc.allocate)("windowed", n)
        entries = _given_back(alloc, entries, gave_back)  # an extension gives pages back
        chunk, step = [x[kept : kept + n]], [("windowed", n)]
        if k and alloc.free_pages:  # a poison sequence on the free pages, returned first
            poison = min(alloc.free_pages * ps, STEP_TOKENS - n)
            alloc.allocate(("poison", k), poison)
            reused |= set(alloc.pages_of(("poison", k))) & gave_back
            step.append((("poison", k), poison))
            chunk.append(rows.poison(poison))
        y = rows.run(step, STEP_TOKENS, chunk)
        outputs.append(y[:1] if n == SPECULATIVE else y[:n])
        for seq, _ in step[1:]:
            alloc.free(seq)
        entries = _given_back(alloc, entries, gave_back)  # and so does the step's confirm
        if n == SPECULATIVE:  # the last 2 drafts rejected
            alloc.rewind("windowed", n - 1)
            entries = alloc.pages_of("windowed")
        kept += 1 if n == SPECULATIVE else n
        held = sum(p != -1 for p in entries)
        bound = -(-(left + n) // ps) + 1 + -(-sinks // ps)
        most = max(most, held)
        if held > bound:
            problems.append(
                f"after a step of {n} tokens at length {kept} the sequence holds {held} "
                f"pages, more than ceil((W - 1 + {n}) / {ps}) + 1 + its sink tokens' = {bound}"
            )
    want = as_features(decoder.full(x[None, :kept]), x[None, :kept].shape, "full")
    leaks = Leaks(tol)
    leaks.add(
        per_feature(np.concatenate(outputs)[None], want), {"window": decoder.window}, (),
        f"position {{position}} of the windowed sequence (feature {{feature}}) differs from "
        f"its full forward by {{deviation:.3g}}; it gave back {len(gave_back)} pages, "
        f"{len(reused)} taken by poison sequences that wrote NaN and huge keys into them",
        named=(),
    )  # fmt: skip
    if not gave_back:
        problems.append(
            f"a sequence of {kept} tokens under window={decoder.window} and {sinks} sink "
            f"tokens gave no page back to the pool (pages of {ps})"
        )
    what = (
        f"a sequence of {kept} tokens under window={decoder.window} and {sinks} sink tokens "
        f"(pages of {ps}, one token a step, speculative chunks rewound) gave back "
        f"{len(gave_back)} pages, holding at most {most}; {len(reused)} were taken by poison "
        f"sequences that wrote NaN and huge keys into them while it went on, and its tokens "
        f"reproduce its full forward"
    )
    result = leaks.result("window pages", what, first="first divergence")
    result.data.update(given_back=len(gave_back), reused=len(reused), most_held=most)
    if problems and result.passed:
        return dataclasses.replace(result, passed=False, detail=problems[0])
    return result


def _given_back(alloc, before: list, given: set) -> list:
    """The windowed sequence's entries now; the pages whose entries became -1 since
    ``before`` join ``given``."""
    entries = alloc.pages_of("windowed")
    given |= {p for p, e in zip(before, entries) if p != -1 and e == -1}
    return entries
