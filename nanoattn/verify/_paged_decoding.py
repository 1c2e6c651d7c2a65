"""Paged decoders for the decoding check: a decoder whose keys and values live in
pages of a shared pool (a :class:`~nanoattn.PageAllocator`'s), driven as the rows
that :func:`nanoattn.verify.check_decoding` feeds, and the forks check.

A paged decoder is three functions (axis letters: Tq tokens of a step, D model
width, P pages of the pool):

* ``full(x) -> y``: the whole sequences at once, x (B, T, D) float or (B, T) ids;
* ``init(pages) -> state``: a fresh pool of P = ``pages`` pages;
* ``step(state, chunk, batch) -> (state, y)``: one step over many sequences at
  once, their new tokens token-major in chunk (1, Tq, D) or (1, Tq), ``batch`` a
  :class:`~nanoattn.PagedBatch` (whose each token is, where its key goes, the
  copy-on-write copies to make first); y (1, Tq, ...).

:func:`as_rows` makes of it the row protocol of the other checks: each row is a
sequence of the allocator; a call's rows are extended by their real tokens and
concatenated token-major into one step of B * L tokens (the padding past them
holds poison), their outputs split back to (B, L, ...); a rewind is the
allocator's. Before the first call the pool is filled by poison sequences (NaN and
huge inputs, or random token ids), which are then freed: the pages every row gets
hold stale keys, NaN and inf, and are handed out in a shuffled order. Entries of
the page table past the pages a row holds are random pages of the pool: a step
must never read them. A decoder with a ``window`` (a windowed layer's) is driven
through an allocator with that window: every check then runs with the pages its
queries no longer read given back (entries -1), and one with ``prefix_cache``
through an allocator with a prefix cache.
"""

import dataclasses

import numpy as np

from .._base.rules import normalize_window
from .._layers.caches.allocator import PageAllocator
from ._inputs import Inputs, _int_at_least, as_features
from ._leaks import Leaks, per_feature
from ._report import CheckResult

HUGE = 3e38  # a poison input near float32's largest: its keys overflow to inf
FORK_CHILDREN = 2  # the forks check forks the parent into at least this many children
FORK_WIDTH = 4  # the forks check's chunks: right-padded, at most 4 tokens a row (1 unchunked)


@dataclasses.dataclass(frozen=True)
class PagedDecoder:
    """A decoder whose KV cache is a pool of pages (:func:`check_decoding` runs it
    through a :class:`~nanoattn.PageAllocator`).

    Args:
      full: ``full(x) -> y`` on whole sequences, x (B, T, D) or (B, T), y (B, T, ...).
      init: ``init(pages) -> state``, a fresh pool of ``pages`` pages.
      step: ``step(state, chunk, batch) -> (state, y)``: chunk (1, Tq, D) or (1, Tq),
        the new tokens of the batch's sequences token-major (the rows past
        ``batch.query_starts[-1]`` are padding), ``batch`` a
        :class:`~nanoattn.PagedBatch`, y (1, Tq, ...).
      page_size: the tokens a page holds.
      slack: pages of the pool beyond the B * ceil(max_len / page_size) the rows
        can hold at once (default 3): the pool never has its pages in the rows'
        order.
      seed: the allocator's shuffle of the pages, and the random page ids of the
        page table's unused entries.
      float_cache: None, or for a quantized cache the same model with a float cache (a
        PagedDecoder): ``check_decoding``'s quantization error check.
      reference: None, or the full forward in float64, ``reference(x) -> y``, that
        check's yardstick for the float cache (default: ``full``).
      allocator: the class (or factory with its signature) of the
        :class:`~nanoattn.PageAllocator` the checks drive the decoder through
        (default ``nanoattn.PageAllocator``): a server's own allocator is checked
        with its decoder the same way.
      window, sink_tokens: a windowed decoder's ``window=(W - 1, 0)`` and sink tokens
        (the adapters take them from the layer's config): its allocator gives back
        the pages no query reads any more, and the window pages check runs.
      prefix_cache: drive it through an allocator with a prefix cache
        (``prefix_cache=True``): the prefix cache check runs, and the programs
        allocate prompts that share prefixes.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from nanoattn.linen import AttentionConfig, CausalSelfAttention
      >>> from nanoattn.verify import check_decoding, decoders
      >>> layer = CausalSelfAttention(AttentionConfig(d_model=16, n_heads=2, page_size=4))
      >>> params = layer.init(jax.random.key(0), jnp.ones((1, 2, 16)), deterministic=True)
      >>> decoder = decoders.linen(layer, params)  # a PagedDecoder: the layer is paged
      >>> decoder.page_size, decoder.slack
      (4, 3)
      >>> report = check_decoding(decoder, d_model=16, seq_len=7)
      >>> report.passed, report.checks[-1].name
      (True, 'programs')
    """

    full: object
    init: object
    step: object
    page_size: int
    slack: int = 3
    seed: int = 0
    float_cache: "PagedDecoder | None" = None
    reference: object = None
    allocator: object = PageAllocator
    window: tuple | None = None
    sink_tokens: int = 0
    prefix_cache: bool = False

    def __post_init__(self):
        for name in ("full", "init", "step"):
            if not callable(getattr(self, name)):
                raise ValueError(f"{name} must be a function, got {getattr(self, name)!r}")
        if self.float_cache is not None and not isinstance(self.float_cache, PagedDecoder):
            raise ValueError(
                f"float_cache must be None or a PagedDecoder, got {self.float_cache!r}"
            )
        if not callable(self.allocator):
            raise ValueError(
                f"allocator must be a PageAllocator class or factory, got {self.allocator!r}"
            )
        if self.reference is not None and not callable(self.reference):
            raise ValueError(f"reference must be None or a function x -> y, got {self.reference!r}")
        _int_at_least("page_size", self.page_size, 1)
        _int_at_least("slack", self.slack, 0)
        _int_at_least("seed", self.seed, 0)
        _int_at_least("sink_tokens", self.sink_tokens, 0)
        object.__setattr__(self, "window", normalize_window(self.window))
        if self.sink_tokens and self.window is None:
            raise ValueError(f"sink_tokens={self.sink_tokens} needs a window")
        if not isinstance(self.prefix_cache, bool):
            raise ValueError(f"prefix_cache must be True or False, got {self.prefix_cache!r}")

    def allocator_options(self) -> dict:
        """The keywords its allocator takes beyond the sizes: the window and sink tokens,
        and the prefix cache, where set (an allocator without them still serves a
        decoder that sets none)."""
        options = {}
        if self.window is not None:
            options |= dict(window=self.window, sink_tokens=self.sink_tokens)
        if self.prefix_cache:
            options["prefix_cache"] = True
        return options

    def describe(self) -> str:
        """What the decoding check's detail says of the pool."""
        window = "" if self.window is None else (
            f", the pages outside window={self.window} and past {self.sink_tokens} sink "
            "tokens given back as the rows grow"
        )  # fmt: skip
        cache = ", with a prefix cache" if self.prefix_cache else ""
        return (
            f"through pages of {self.page_size} tokens handed out in a shuffled order, "
            f"reused after poison sequences were freed{window}{cache}"
        )


class _Rows:
    """The state of the row protocol: the allocator of a fresh pool, the decoder's
    state, and the row sequences (allocated at the first call, after the poison)."""

    def __init__(self, decoder: PagedDecoder, inputs: Inputs, batch: int, max_len: int):
        ps = decoder.page_size
        self.decoder, self.inputs, self.batch = decoder, inputs, batch
        self.max_pages = -(-max_len // ps)  # M
        self.pages = batch * self.max_pages + decoder.slack  # P
        self.alloc = decoder.allocator(
            self.pages, ps, max_sequences=batch, max_pages=self.max_pages, seed=decoder.seed,
            **decoder.allocator_options(),
        )  # fmt: skip
        self.state = decoder.init(self.pages)
        self.rng = np.random.default_rng(decoder.seed)
        self.ids: list | None = None

    def poison(self, n: int) -> np.ndarray:
        """n poison tokens: NaN, +-3e38 and normal inputs mixed (random ids for tokens)."""
        x = self.inputs.random(self.rng, 1, n)[0]
        if not self.inputs.tokens:
            kind = self.rng.integers(0, 3, n)
            sign = self.rng.choice([-1.0, 1.0], x.shape)
            x = np.where((kind == 0)[:, None], np.nan, x)
            x = np.where((kind == 1)[:, None], sign * HUGE, x).astype(np.float32)
        return x

    def run(self, rows, tokens: int, x: list) -> np.ndarray:
        """One step of the decoder: ``rows`` ``[(seq_id, q_len)]`` whose new tokens are
        the arrays ``x`` (each already extended in the allocator), padded with poison
        to ``tokens``; returns the outputs (Tq, F) as float64."""
        chunk = np.concatenate([*x, self.poison(tokens - sum(len(a) for a in x))])[None]
        batch = original = self.alloc.batch(rows, tokens)
        held = -(-batch.kv_lengths // self.alloc.page_size)  # (B,)
        table = batch.page_table.copy()
        unused = np.arange(table.shape[1])[None, :] >= held[:, None]
        table[unused] = self.rng.integers(0, self.pages, int(unused.sum()))  # never read
        batch = dataclasses.replace(batch, page_table=table)
        self.state, y = self.decoder.step(self.state, chunk, batch)
        self.alloc.confirm(original)
        return as_features(y, chunk.shape, "step")[0]

    def start(self, tokens: int) -> None:
        """:meth:`fill`, then allocates the rows, empty."""
        self.fill(tokens)
        self.ids = [("row", b) for b in range(self.batch)]
        for seq in self.ids:
            self.alloc.allocate(seq, 0)

    def fill(self, tokens: int) -> None:
        """Fills the pool with poison sequences in steps of ``tokens``, then frees them."""
        ps, alloc, k = self.alloc.page_size, self.alloc, 0
        while alloc.free_pages:
            seq = ("poison", k)
            alloc.allocate(seq, 0)
            k += 1
            while True:
                length = alloc.length(seq)
                room = min(self.max_pages * ps - length, alloc.free_pages * ps + (-length) % ps)
                n = min(tokens, room)
                if n == 0:
                    break
                alloc.extend(seq, n)
                self.run([(seq, n)], tokens, [self.poison(n)])
        for j in range(k):
            alloc.free(("poison", j))

    def fork(self, parent: int, child: int) -> None:
        """Row ``child`` (empty) becomes a fork of row ``parent``: it shares its pages."""
        if self.alloc.length(self.ids[child]):
            raise ValueError(f"row {child} holds tokens: only an empty row is forked")
        self.alloc.free(self.ids[child])
        self.alloc.fork(self.ids[parent], self.ids[child])


def as_rows(decoder: PagedDecoder, inputs: Inputs):
    """The row protocol of ``decoder``: ``(init, step, rewind)`` as
    :func:`check_decoding` calls them (``init(batch, max_len)``, ``step(state, chunk,
    lengths)`` with chunk (B, L, ...), ``rewind(state, n)``)."""

    def init(batch: int, max_len: int) -> _Rows:
        return _Rows(decoder, inputs, batch, max_len)

    def step(rows: _Rows, chunk, lengths):
        chunk = np.asarray(chunk)
        B, L = chunk.shape[:2]
        lengths = np.full(B, L) if lengths is None else np.asarray(lengths)
        if rows.ids is None:
            rows.start(B * L)
        for seq, n in zip(rows.ids, lengths):
            rows.alloc.extend(seq, int(n))
        x = [chunk[b, :n] for b, n in enumerate(lengths)]
        y = rows.run(list(zip(rows.ids, map(int, lengths))), B * L, x)
        out = np.zeros((B, L, y.shape[-1]))
        starts = np.concatenate([[0], np.cumsum(lengths)])
        for b, n in enumerate(lengths):
            out[b, :n] = y[starts[b] : starts[b] + n]
        return rows, out

    def rewind(rows: _Rows, n):
        for seq, k in zip(rows.ids, np.asarray(n)):
            rows.alloc.rewind(seq, int(k))
        return rows

    return init, step, rewind


def fork_point(T: int, page_size: int) -> int:
    """The parent's prefix length p for a decoded length T: about T / 2, never a whole
    number of pages (its last page is partial and shared) unless pages hold one token."""
    p = max(1, T // 2)
    if page_size > 1 and p % page_size == 0:
        p -= 1
    return p


def fork_schedule(R: int, T: int, p: int, width: int):
    """The calls of the forks check: ``(calls, forked_at)``, each call the real tokens
    per row (R,). Row 0 takes its prefix of p tokens in chunks of ``width``; the fork
    happens before call ``forked_at``; then row b brings ``1 + (k + b) % width`` tokens
    at call k (cut at T): prefill chunks and decode tokens mixed, the parent bringing
    none at the first (its children write into the shared page first)."""
    calls = [np.array([min(width, p - t)] + [0] * (R - 1)) for t in range(0, p, width)]
    forked_at, done, k = len(calls), np.full(R, p), 0
    while (done < T).any():
        lengths = np.minimum([1 + (k + b) % width for b in range(R)], T - done)
        if k == 0:
            lengths[0] = 0
        calls.append(lengths)
        done += lengths
        k += 1
    return calls, forked_at


def check_forks(decoder: PagedDecoder, inputs: Inputs, T: int, batch: int, tol: float,
                width: int = FORK_WIDTH) -> CheckResult:  # fmt: skip
    """Row 0 (the parent) takes a prefix of p tokens (:func:`fork_point`, a partial
    last page), R = max(batch, 3) - 1 >= 2 children fork it, and every row goes on
    with tokens of its own in right-padded chunks of up to ``width`` (4; 1 for a
    decoder checked one token per call) (:func:`fork_schedule`): each row must give
    the full forward of its own sequence, the parent at all T positions, the
    children from p on."""
    rng = np.random.default_rng(4)
    R = max(batch, FORK_CHILDREN + 1)
    p = fork_point(T, decoder.page_size)
    x = inputs.random(rng, R, T)
    x[1:, :p] = x[0, :p]  # the children's prefix is the parent's
    init, step, _ = as_rows(decoder, inputs)
    rows, done = init(R, T + 3), np.zeros(R, int)
    calls, forked_at = fork_schedule(R, T, p, width)
    outs = [[] for _ in range(R)]
    for c, lengths in enumerate(calls):
        if c == forked_at:
            for child in range(1, R):
                rows.fork(0, child)
            done[1:] = p
        chunk = inputs.random(rng, R, width)
        for b, n in enumerate(lengths):
            chunk[b, :n] = x[b, done[b] : done[b] + n]
        rows, y = step(rows, chunk, lengths.astype(np.int32))
        for b, n in enumerate(lengths):
            outs[b].append(y[b, :n])
            done[b] += n
    want = as_features(decoder.full(x), x.shape, "full")
    deviation = np.zeros(want.shape)  # the children's prefix is the parent's: not theirs
    deviation[:1] = per_feature(np.concatenate(outs[0])[None], want[:1])
    children = np.stack([np.concatenate(o) for o in outs[1:]])  # (R - 1, T - p, F)
    deviation[1:, p:] = per_feature(children, want[1:, p:])
    schedule = "; ".join(
        f"row {b}: " + ",".join(str(c[b]) for c in calls[forked_at:]) for b in range(R)
    )
    leaks = Leaks(tol)
    leaks.add(
        deviation,
        {"prefix": p},
        (),
        "position {position} of row {batch} (feature {feature}) differs from the full "
        f"forward of its own sequence by {{deviation:.3g}}; row 0 took a prefix of {p} "
        f"tokens (pages of {decoder.page_size}), forked into rows 1-{R - 1}, then tokens "
        f"per call {schedule}",
    )
    return leaks.result(
        "forks",
        f"a parent's prefix of {p} tokens (pages of {decoder.page_size}, the last one "
        f"partial) forked into {R - 1} children, each row going on with tokens of its own "
        f"(per call {schedule}), reproduce the full forward of each row's {T} tokens",
        first="first divergence",
    )


VOCAB = 31  # the distinct tokens of the prefix cache's programs and check


class Vocabulary:
    """Token ids and the inputs they stand for (``VOCAB`` random inputs drawn once, or
    random token ids for a decoder on tokens): the same ids are the same inputs, which
    is what a prefix cache keys its pages by."""

    def __init__(self, inputs: Inputs, rng):
        self.rows, self.rng = inputs.random(rng, 1, VOCAB)[0], rng

    def draw(self, n: int) -> list[int]:
        """n random token ids."""
        return [int(t) for t in self.rng.integers(0, VOCAB, n)]

    def __call__(self, ids) -> np.ndarray:
        """The inputs of ``ids``: (n, D) or (n,)."""
        return self.rows[np.asarray(ids, int)]
