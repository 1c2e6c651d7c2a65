"""The decoding check: a decoder fed through its KV cache, token by token, in
chunks and in ragged rows, must give what its full forward gives.

The decoder is three functions (see :mod:`nanoattn.verify.decoders` for
adapters to nanoattn's and flax's modules):

* ``full(x) -> y``: the whole sequence at once; x (B, T, D) float or (B, T)
  int token ids, y (B, T, ...);
* ``init(batch, max_len) -> state``: a fresh, empty decoder state (a cache);
* ``step(state, chunk, lengths) -> (state, y_chunk)``: feeds the next chunk
  (B, L, ...) and returns the outputs for those L positions; ``lengths`` is
  None or int (B,), the real tokens of each row of a right-padded chunk.

Optionally (a :class:`Decoder` carries them, or pass them to the check):

* ``rewind(state, n) -> state``: row b drops its last ``n[b]`` tokens, int (B,),
  ``0 <= n[b] <=`` the real tokens of its last call (speculative decoding);
* ``capacity``: the decoder is bounded (a rolling cache): ``init`` is given this
  many slots and the check decodes far past them;
* ``max_chunk``: the most tokens one call may take (a rolling cache's C - W - S0);
* ``float_cache``, for a decoder whose cache is quantized: the same model with a float
  cache (its ``init`` and ``step``), and ``reference``, its full forward in float64:
  the quantization check (:mod:`nanoattn.verify._quantization`) reports the quantized
  decode's error against the float decode next to the float cache's against the
  reference.

Every run starts from a fresh ``init`` and threads the state linearly, so a
decoder that mutates its state in place is checked as well as a pure one.

A decoder with a paged cache is a :class:`~nanoattn.verify.PagedDecoder`
(``init(pages)``, ``step(state, chunk, batch)``), run through this same protocol
by :mod:`nanoattn.verify._paged_decoding`, plus its forks and programs checks.

:func:`check_decoding` reads its arguments into one :class:`~._decoder.Subject` (the
decoder as the checks drive it), decodes every chunking once into a :class:`_Run`,
and runs the table :data:`CHECKS`: one function of the subject and the run per check.
"""

import dataclasses
import functools
import itertools

import numpy as np

from ._decoder import Decoder as Decoder
from ._decoder import Subject, subject
from ._inputs import Inputs, as_features
from ._leaks import Leaks, per_feature, positive_control
from ._paged_decoding import as_rows, check_forks
from ._paged_programs import check_programs
from ._prefix_check import check_prefix_cache
from ._quantization import check_quantization
from ._report import CheckResult, Report
from ._tree_check import MAX_DRAFTS, check_trees
from ._window_check import check_window_pages

DEFAULT_SEQ_LEN = 13
CAPACITY_SLACK = 3  # init(batch, seq_len + 3): unwritten slots that no output may read
CHUNK_CYCLE = (4, 1)  # the uneven chunking: sizes 4, 1, 4, 1, ..., then 1s up to T
RAGGED_WIDTH = 4  # every ragged call is a right-padded chunk of 4 tokens
TOLERANCE = {2: 3e-2, 4: 1e-5, 8: 1e-5}  # by the full forward's bytes per output element
LAPS = 4  # with a capacity C, the default length decodes 4 C + 3 tokens: the ring wraps 4 times


def default_seq_len(capacity: int | None) -> int:
    """The decoded length T when none is given: 13, or 4 C + 3 with a capacity of C
    slots, so that the ring wraps several times."""
    return DEFAULT_SEQ_LEN if capacity is None else LAPS * capacity + CAPACITY_SLACK


def _chunkings(T: int, chunked: bool, max_chunk: int | None = None) -> dict[str, list[int]]:
    """The chunk sizes of each decoding run: one token per call, and with ``chunked``
    the whole sequence in one call and the uneven cycle 4, 1, 4, 1, ... (three chunk
    lengths, and the ragged width 4: few programs to compile). With ``max_chunk`` M
    below T, chunks of M (the rest one by one) replace the one call, and the cycle
    is M, 1 when M < 4: the largest chunk the decoder takes is always fed."""
    runs = {"1 token per call": [1] * T}
    if chunked:
        if max_chunk is None or max_chunk >= T:
            runs[f"all {T} in one call"] = [T]
        elif max_chunk > 1:
            runs[f"chunks of {max_chunk}"] = [max_chunk] * (T // max_chunk) + [1] * (T % max_chunk)
        big = CHUNK_CYCLE[0] if max_chunk is None else min(CHUNK_CYCLE[0], max_chunk)
        if big == 1:
            return runs
        sizes = []
        for n in itertools.cycle((big, *CHUNK_CYCLE[1:])):
            if sum(sizes) + n > T:
                break
            sizes.append(n)
        sizes += [1] * (T - sum(sizes))  # the rest one by one: no fourth chunk length
        runs["chunks " + ",".join(map(str, sizes))] = sizes
    return runs


def ragged_schedule(batch: int, T: int, width: int) -> list[np.ndarray]:
    """The real tokens per row of each call, (B,) each: row b's chunk lengths cycle
    through (W, 1, 0, W-1, 2) started at its b-th entry and cut at T, so rows sit at
    different positions, some calls bring a row nothing, and each row totals T."""
    pattern = (width, 1, 0, max(width - 1, 1), min(2, width))
    done, calls, k = np.zeros(batch, int), [], 0
    while (done < T).any():
        want = np.array([pattern[(k + b) % len(pattern)] for b in range(batch)])
        lengths = np.minimum(want, T - done)
        calls.append(lengths)
        done += lengths
        k += 1
    return calls


def _decode(init, step, x: np.ndarray, sizes: list[int], max_len: int) -> np.ndarray:
    """Feeds x (B, T, ...) through a fresh state in chunks of ``sizes``: outputs (B, T, F)."""
    state, outs, t = init(x.shape[0], max_len), [], 0
    for n in sizes:
        chunk = x[:, t : t + n]
        state, y = step(state, chunk, None)
        outs.append(as_features(y, chunk.shape, "step"))
        t += n
    return np.concatenate(outs, axis=1)


def _decode_ragged(init, step, inputs, rng, x, width, max_len, first_call_may_fail):
    """Feeds row b of x through right-padded chunks of ``width`` with the lengths of
    :func:`ragged_schedule`; the padding holds random tokens. Returns the outputs
    (B, T, F) at the real tokens, or the reason the first call raised when
    ``first_call_may_fail``."""
    B, T = x.shape[:2]
    state, done = init(B, max_len), np.zeros(B, int)
    outs = [[] for _ in range(B)]
    for k, lengths in enumerate(ragged_schedule(B, T, width)):
        chunk = inputs.random(rng, B, width)
        for b, n in enumerate(lengths):
            chunk[b, :n] = x[b, done[b] : done[b] + n]
        try:
            state, y = step(state, chunk, lengths.astype(np.int32))
        except Exception as e:
            if k == 0 and first_call_may_fail:
                return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            raise
        y = as_features(y, chunk.shape, "step")
        for b, n in enumerate(lengths):
            outs[b].append(y[b, :n])
            done[b] += n
    return np.stack([np.concatenate(o) for o in outs])


def _tolerance(atol, y: np.ndarray, itemsize: int) -> float:
    if atol is not None:
        if not atol >= 0:
            raise ValueError(f"atol must be >= 0, got {atol}")
        return float(atol)
    scale = float(np.nanmax(np.abs(y), initial=0.0))
    return TOLERANCE.get(itemsize, 1e-5) * max(1.0, scale if np.isfinite(scale) else 1.0)


def check_decoding(
    full,
    init=None,
    step=None,
    *,
    rewind=None,
    capacity: int | None = None,
    max_chunk: int | None = None,
    tree=None,
    accept=None,
    d_model: int | None = None,
    vocab: int | None = None,
    seq_len: int | None = None,
    chunked: bool = True,
    ragged: bool | None = None,
    batch: int = 2,
    atol: float | None = None,
    float_cache=None,
    reference=None,
) -> Report:
    """Proves that a decoder's KV-cache path computes its full forward, hides the
    future and uses its cache.

    The decoder is ``(full, init, step)``: ``full(x) -> y`` on the whole sequence,
    x float32 (B, T, D) (pass ``d_model``) or int32 token ids (B, T) in [0, V)
    (pass ``vocab``), y (B, T, ...); ``init(batch, max_len) -> state``, a fresh,
    empty cache; ``step(state, chunk, lengths) -> (state, y_chunk)``, the next
    chunk (B, L, ...) and its outputs (B, L, ...), ``lengths`` None or int (B,),
    the real tokens per row of a right-padded chunk. :mod:`nanoattn.verify.decoders`
    builds the triple for nanoattn's and flax's modules. ``full`` may instead be a
    :class:`Decoder`, which brings ``init``, ``step`` and its optional ``rewind``,
    ``capacity``, ``max_chunk``, ``float_cache`` and ``reference`` (an argument given
    here wins), or a
    :class:`PagedDecoder` (a paged cache: ``init(pages)``, ``step(state, chunk,
    batch)``), which the checks drive through a ``PageAllocator``: each row a sequence,
    a call's rows one token-major step of B * L tokens (the padding past them poison),
    pages handed out in a shuffled order after poison sequences (NaN and +-3e38
    inputs, or random ids) filled the pool and were freed, the page table's unused
    entries random pages, a rewind the allocator's (so rewinding is always checked),
    and two more checks, forks and programs (below). With T =
    ``seq_len`` (default 13) and a capacity of T + 3 slots, or with ``capacity`` C
    (a bounded, rolling cache) C slots and T = 4 C + 3 by default, so that the ring
    wraps several times, from random x:

    * cache equivalence: decoding one token per call, and with ``chunked`` all T
      in one call and in chunks of 4, 1, 4, 1, ..., gives ``full(x)`` at every
      position of every row, within the tolerance, feature by feature; a
      failure names the first diverging position, its row and the size;
    * ragged rows: rows fed right-padded chunks of 4 with different ``lengths``
      per row (so rows sit at different positions, and some calls bring a row
      nothing; the padding holds random tokens) each give their own row of
      ``full(x)``. ``ragged=None`` checks it when the step takes ``lengths``
      (its first such call does not raise; otherwise SKIP, with the error);
      ``ragged=False`` skips it;
    * no future in the cache: in every chunking, changing the tokens from p on
      (p = 1, T//2, T-1; fed later) changes no decoded output before p;
    * positive control: changing the first token changes some later output
      decoded one token per call (which reaches it only through the cache) by
      more than 10 times the tolerance: a decoder that ignores its cache fails;
    * rewinding, with ``rewind``: rows fed right-padded chunks of up to 4 new
      random tokens, each call followed by ``rewind(state, n)`` with a random
      ``n[b]`` in ``[0, lengths[b]]`` per row (none, part or all of the chunk),
      until every row keeps T tokens: every output at a kept token equals the full
      forward of what its row kept. The tokens after a rewind differ from the
      dropped ones, so a stale slot that stays readable changes the outputs;
    * token trees, with ``tree`` and ``accept`` (speculative decoding,
      :mod:`nanoattn.verify._tree_check`): each row decodes a prefix, then a random
      tree of up to 8 drafts of its own (``tree(state, chunk, parents)``), keeps one
      of its paths (``accept(state, kept)``), and decodes on: every draft equals the
      full forward of the prefix and its own root-to-leaf path, and every later token
      that of the prefix, the kept path and the new tokens (a sibling seen, RoPE by
      slot instead of depth, kept tokens left in their slots or a rejected branch
      still read all fail);
    * forks, for a :class:`PagedDecoder`: a parent row's prefix of about T / 2
      tokens, not a whole number of pages, is forked into max(batch, 3) - 1 children
      (sharing its pages, the partial last one copied on write), and every row goes
      on with tokens of its own in right-padded chunks (the children's first): each
      row equals the full forward of its own sequence;
    * programs, for a :class:`PagedDecoder`: seeded random programs of a server's
      allocator calls (allocate, extend, forks before and after the parent's step,
      chains of forks, rewinds then forks, frees with copies pending) and steps of
      every held sequence's unwritten tokens: each token equals the full forward of
      its own sequence (the allocator may refuse a call; no token may be wrong);
      with ``prefix_cache``, prompts that share prefixes and evictions under pressure;
    * prefix cache, for a :class:`PagedDecoder` with ``prefix_cache``: hits of whole
      written pages (none before the step that writes them), none across two
      namespaces, evictions under pressure and a prompt fed again after them, every
      computed token equal to its sequence's full forward
      (:mod:`nanoattn.verify._prefix_check`);
    * window pages, for a :class:`PagedDecoder` with a ``window``: a sequence that
      gives pages back while poison sequences take them and write NaN into them,
      holding at most ceil((W - 1 + q_len) / page_size) + 1 pages besides its sink
      tokens', equal to its full forward (:mod:`nanoattn.verify._window_check`);
    * quantization error, with ``float_cache`` (a decoder whose cache is quantized:
      int8, float8; :mod:`nanoattn.verify.decoders` gives nanoattn's layers with
      ``kv_cache_dtype`` theirs): every chunking of the cache equivalence check decoded
      through the same model's float cache too; the quantized decode's largest
      deviation from the float decode (within the tolerance, ``atol``) is reported next
      to the float decode's from ``reference(x)`` (the full forward in float64; without
      it ``full(x)``), which must be within the default tolerance of a float decoder.
      The quantized cache's error against ``full(x)`` is what cache equivalence
      measures; this check says how much of it the quantization makes.

    ``max_chunk`` M bounds every chunk: the one-call run becomes chunks of M, and
    the cycle, the ragged and the rewinding chunks are at most M wide; a chunk of
    exactly M is always fed, so a limit claimed one too large is caught.
    A decoder that takes one token per call is checked with ``chunked=False``
    (its ragged rows then get chunks of 1 with lengths 0 or 1).

    Args:
      full: the decoder's ``full``, or a :class:`Decoder` or :class:`PagedDecoder`
        (then no ``init`` and ``step``; a PagedDecoder takes no ``rewind``,
        ``capacity`` or ``max_chunk``).
      rewind: None (not checked) or ``rewind(state, n) -> state``, ``n`` int32 (B,).
      tree, accept: None (not checked), or a decoder's token-tree step and accept, as
        :class:`Decoder` takes them.
      capacity: None, or the slots ``init`` gets for a decoder whose cache is bounded.
      max_chunk: None, or the most tokens one call may take.
      seq_len: the decoded length T >= 2; None: 13, or 4 C + 3 with a capacity C.
      atol: the largest allowed difference of one output feature; None: 1e-5
        (3e-2 for 16-bit outputs) times the largest ``|full(x)|``, at least 1. A
        decoder with a quantized cache needs one above its quantization's error.
      float_cache: None, or for a quantized cache the same model with a float cache (a
        :class:`Decoder` or ``(full, init, step)``; a :class:`PagedDecoder` for a
        PagedDecoder): the quantization error check.
      reference: None, or ``reference(x) -> y``, the full forward in float64, the
        float cache's yardstick in the quantization error check.

    Returns:
      A :class:`Report` titled ``"decoding"``.

    Example:
      >>> import numpy as np
      >>> def full(x):  # a running mean: causal, decodable
      ...     return np.cumsum(x, 1) / np.arange(1, x.shape[1] + 1)[:, None]
      >>> def init(batch, max_len):
      ...     return np.zeros((batch, 1)), np.zeros((batch, 1))  # running sum, count
      >>> def step(state, chunk, lengths):
      ...     total, count = state
      ...     sums = total[:, None] + np.cumsum(chunk, 1)
      ...     y = sums / (count[:, None] + np.arange(1, chunk.shape[1] + 1)[:, None])
      ...     n = chunk.shape[1] if lengths is None else np.asarray(lengths)[:, None]
      ...     idx = np.broadcast_to(np.asarray(n) - 1, (chunk.shape[0], 1))
      ...     last = np.take_along_axis(sums, np.maximum(idx, 0)[..., None], 1)[:, 0]
      ...     total = np.where(idx >= 0, last, total)
      ...     return (total, count + np.where(idx >= 0, idx + 1, 0)), y
      >>> check_decoding(full, init, step, d_model=3).passed
      True
    """
    inputs = Inputs.of(d_model, vocab)
    decoder = subject(
        full, init, step, inputs, rewind=rewind, capacity=capacity, max_chunk=max_chunk,
        float_cache=float_cache, reference=reference, tree=tree, accept=accept,
    )  # fmt: skip
    run = _Run.of(decoder, inputs, seq_len, chunked, ragged, batch, atol)
    checks = (check(decoder, run) for check in CHECKS)
    return Report("decoding", [result for result in checks if result is not None])


@dataclasses.dataclass(frozen=True)
class _Run:
    """What the checks of one call share: the inputs x (B, T, ...), the full forward y
    (B, T, F), the tolerance, the cache's slots, the chunkings and their decodings.

    Attributes:
      rng: the generator that drew x, drawn from again by the no-future check and
        then the positive control: the order of :data:`CHECKS` fixes the draws.
      width: the widest chunk of the ragged and rewinding runs.
      runs: the chunk sizes of each chunking, by name (:func:`_chunkings`).
      decoded: each chunking's outputs (B, T, F), decoded from a fresh state.
    """

    inputs: Inputs
    rng: np.random.Generator
    x: np.ndarray
    y: np.ndarray
    itemsize: int
    tol: float
    max_len: int
    width: int
    ragged: bool | None
    runs: dict
    decoded: dict

    @property
    def T(self) -> int:
        return self.x.shape[1]

    @property
    def batch(self) -> int:
        return self.x.shape[0]

    @classmethod
    def of(cls, decoder: Subject, inputs, seq_len, chunked, ragged, batch, atol) -> "_Run":
        """The run of ``check_decoding``'s remaining arguments, checked; decodes x
        through every chunking."""
        seq_len = default_seq_len(decoder.capacity) if seq_len is None else seq_len
        for name, value, least in (("seq_len", seq_len, 2), ("batch", batch, 1)):
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(f"{name} must be an int >= {least}, got {name}={value!r}")
        if ragged not in (None, True, False):
            raise ValueError(f"ragged must be None, True or False, got ragged={ragged!r}")
        max_len = seq_len + CAPACITY_SLACK if decoder.capacity is None else decoder.capacity
        rng = np.random.default_rng(0)
        x = inputs.random(rng, batch, seq_len)
        y_raw = decoder.full(x)
        y = as_features(y_raw, x.shape, "full")
        itemsize = np.asarray(y_raw).dtype.itemsize
        runs = _chunkings(seq_len, chunked, decoder.max_chunk)
        decoded = {
            name: _decode(decoder.init, decoder.step, x, sizes, max_len)
            for name, sizes in runs.items()
        }
        width = RAGGED_WIDTH if chunked else 1
        width = width if decoder.max_chunk is None else min(width, decoder.max_chunk)
        tol = _tolerance(atol, y, itemsize)
        return cls(inputs, rng, x, y, itemsize, tol, max_len, width, ragged, runs, decoded)


def _equivalence(decoder: Subject, run: _Run) -> CheckResult:
    """Every chunking's decode against the full forward, feature by feature."""
    equivalence, diverged = Leaks(run.tol), []
    for name, decoded in run.decoded.items():
        deviation = per_feature(decoded, run.y)
        equivalence.add(
            deviation,
            {"chunking": name},
            (),
            f"position {{position}} of row {{batch}} (feature {{feature}}) differs from the "
            f"full forward by {{deviation:.3g}}, decoding {name}",
        )
        if not (np.nan_to_num(deviation, nan=np.inf) <= run.tol).all():
            diverged.append(name)
    many = len(run.runs) > 1
    result = equivalence.result(
        "cache equivalence",
        f"{len(run.runs)} chunking{'s' if many else ''} ({'; '.join(run.runs)}) reproduce"
        f"{'' if many else 's'} the full forward at all {run.T} positions of {run.batch} rows"
        + ("" if decoder.capacity is None else f" through a cache of {decoder.capacity} slots")
        + ("" if decoder.paged is None else f" {decoder.paged.describe()}"),
        first="first divergence",
    )
    if result.passed:
        return result
    matches = [n for n in run.runs if n not in diverged]
    detail = f"{result.detail}; diverges: {', '.join(diverged)}"
    if matches:
        detail += f"; matches: {', '.join(matches)}"
    return dataclasses.replace(result, detail=detail)


def _quantization(decoder: Subject, run: _Run) -> CheckResult | None:
    """With a float cache: the quantized decode against the float one (module
    :mod:`._quantization`)."""
    if decoder.float_cache is None:
        return None
    float_tol = _tolerance(None, run.y, run.itemsize)
    decode = functools.partial(_decode, max_len=run.max_len)
    return check_quantization(
        decode, *decoder.float_cache, decoder.reference, run.x, run.y, run.decoded, run.runs,
        run.tol, float_tol,
    )  # fmt: skip


def _ragged_rows(decoder: Subject, run: _Run) -> CheckResult:
    return _ragged(
        decoder.init, decoder.step, run.inputs, run.x, run.y, run.tol, run.ragged, run.width,
        run.max_len,
    )  # fmt: skip


def _no_future(decoder: Subject, run: _Run) -> CheckResult:
    """In every chunking, tokens changed from p on change no decoded output before p."""
    future, splits = Leaks(run.tol), sorted({1, run.T // 2, run.T - 1})
    for name, sizes in run.runs.items():
        for p in splits:
            other = run.x.copy()
            other[:, p:] = run.inputs.changed(run.rng, run.x[:, p:])
            decoded = _decode(decoder.init, decoder.step, other, sizes, run.max_len)
            future.add(
                per_feature(decoded[:, :p], run.decoded[name][:, :p]),
                {"chunking": name, "split": p},
                (p,),
                f"output {{position}} of row {{batch}} (feature {{feature}}) changed by "
                f"{{deviation:.3g}} when only tokens >= {p} changed, decoding {name}",
            )
    return future.result(
        "no future in the cache",
        f"{future.trials} decodings whose tokens differ only from p = "
        f"{', '.join(map(str, splits))} on",
    )


def _positive_control(decoder: Subject, run: _Run) -> CheckResult:
    """A changed first token moves some later output decoded one token per call."""
    changed = run.x.copy()
    changed[:, 0] = run.inputs.changed(run.rng, run.x[:, 0])
    one = "1 token per call"
    decoded = _decode(decoder.init, decoder.step, changed, run.runs[one], run.max_len)
    moved = float(np.abs(decoded[:, 1:] - run.decoded[one][:, 1:]).max())
    return positive_control(
        moved, run.tol, "the later outputs decoded one token per call", {"chunking": one}
    )


def _rewinds(decoder: Subject, run: _Run) -> CheckResult | None:
    if decoder.rewind is None:
        return None
    return _rewinding(
        decoder.full, decoder.init, decoder.step, decoder.rewind, run.inputs, run.batch, run.T,
        run.width, run.tol, run.max_len,
    )  # fmt: skip


def _trees(decoder: Subject, run: _Run) -> CheckResult | None:
    if decoder.tree is None:
        return None
    return check_trees(
        decoder.full, decoder.init, decoder.step, decoder.tree, decoder.accept, run.inputs,
        run.batch, run.T, decoder.max_chunk or MAX_DRAFTS, run.tol, run.max_len,
    )  # fmt: skip


def _forks(decoder: Subject, run: _Run) -> CheckResult | None:
    if decoder.paged is None:
        return None
    return check_forks(decoder.paged, run.inputs, run.T, run.batch, run.tol, run.width)


def _programs(decoder: Subject, run: _Run) -> CheckResult | None:
    if decoder.paged is None:
        return None
    make_rows = as_rows(decoder.paged, run.inputs)[0]
    return check_programs(decoder.paged, run.inputs, run.T, run.tol, make_rows)


def _prefix_cache(decoder: Subject, run: _Run) -> CheckResult | None:
    if decoder.paged is None or not decoder.paged.prefix_cache:
        return None
    make_rows = as_rows(decoder.paged, run.inputs)[0]
    return check_prefix_cache(decoder.paged, run.inputs, run.tol, make_rows)


def _window_pages(decoder: Subject, run: _Run) -> CheckResult | None:
    if decoder.paged is None or decoder.paged.window is None:
        return None
    make_rows = as_rows(decoder.paged, run.inputs)[0]
    return check_window_pages(decoder.paged, run.inputs, run.tol, make_rows)


# The checks, in the order of the report; each returns None where it does not apply.
CHECKS = (
    _equivalence,  # every chunking against the full forward
    _quantization,  # with a float cache
    _ragged_rows,  # right-padded chunks with lengths per row
    _no_future,  # draws from run.rng: before the positive control
    _positive_control,
    _rewinds,  # with a rewind (always for a PagedDecoder)
    _trees,  # with a tree and an accept
    _forks,  # a PagedDecoder's
    _programs,  # a PagedDecoder's
    _prefix_cache,  # a PagedDecoder's with prefix_cache
    _window_pages,  # a PagedDecoder's with a window
)


def rewind_schedule(batch: int, T: int, width: int, seed: int = 2):
    """The calls of the rewinding run: ``[(lengths, n), ...]``, int (B,) each. Row b's
    chunk brings ``min(width, T - kept)`` tokens, 0 once it keeps T, then drops
    ``n[b]`` of them, random in ``[0, lengths[b]]``; the first call drops all of row
    0's chunk and none of row 1's. Every row ends keeping T tokens."""
    rng, kept, calls = np.random.default_rng(seed), np.zeros(batch, int), []
    while (kept < T).any():
        lengths = np.minimum(width, T - kept)
        n = rng.integers(0, lengths + 1)
        if not calls:
            n[0] = lengths[0]
            n[1:2] = 0
        calls.append((lengths, n))
        kept += lengths - n
    return calls


def _rewinding(full, init, step, rewind, inputs, batch, T, width, tol, max_len) -> CheckResult:
    """Decode, rewind a random amount per row, decode on: the kept tokens' outputs
    must be the full forward of what each row kept."""
    rng = np.random.default_rng(3)
    state, kept = init(batch, max_len), [[] for _ in range(batch)]
    outs = [[] for _ in range(batch)]
    calls = rewind_schedule(batch, T, width)
    for lengths, n in calls:
        chunk = inputs.random(rng, batch, width)  # new tokens, unlike the dropped ones
        state, y = step(state, chunk, lengths.astype(np.int32))
        y = as_features(y, chunk.shape, "step")
        state = rewind(state, n.astype(np.int32))
        for b in range(batch):
            keep = lengths[b] - n[b]
            kept[b] += list(chunk[b, :keep])
            outs[b] += list(y[b, :keep])
    x = np.stack([np.stack(row) for row in kept])  # (B, T, ...): what each row kept
    y_full = as_features(full(x), x.shape, "full")
    got = np.stack([np.stack(row) for row in outs])
    dropped = np.stack([n for _, n in calls], axis=1)  # (B, calls)
    text = "; ".join(f"row {b}: " + ",".join(map(str, r.tolist())) for b, r in enumerate(dropped))
    leaks = Leaks(tol)
    leaks.add(
        per_feature(got, y_full),
        {"width": width},
        (),
        "position {position} of row {batch} (feature {feature}) differs from the full "
        "forward of what the row kept by {deviation:.3g}, decoding right-padded chunks of "
        f"{width}, each call followed by a rewind (tokens dropped per call {text})",
    )
    return leaks.result(
        "rewinding",
        f"{batch} rows fed {len(calls)} chunks of up to {width} new tokens, each call "
        f"followed by a rewind (tokens dropped per call {text}), reproduce the full "
        f"forward of the {T} tokens each row kept",
        first="first divergence",
    )


def _ragged(init, step, inputs, x, y, tol, ragged, width, max_len) -> CheckResult:
    name = "ragged rows"
    if ragged is False:
        return CheckResult(name, True, "skipped: ragged=False", skipped=True)
    rng = np.random.default_rng(1)
    got = _decode_ragged(init, step, inputs, rng, x, width, max_len, ragged is None)
    if isinstance(got, str):
        return CheckResult(name, True, f"skipped, the step takes no lengths: {got}", skipped=True)
    B, T = x.shape[:2]
    schedule = np.stack(ragged_schedule(B, T, width), axis=1)  # (B, calls)
    leaks = Leaks(tol)
    leaks.add(
        per_feature(got, y),
        {"width": width},
        (),
        "position {position} of row {batch} (feature {feature}) differs from its full "
        "forward by {deviation:.3g}, rows fed in right-padded chunks of "
        f"{width} with lengths per call " + _lengths_text(schedule),
    )
    return leaks.result(
        name,
        f"{B} rows fed {schedule.shape[1]} right-padded chunks of {width} with lengths "
        f"{_lengths_text(schedule)} (random padding) reproduce their full forward",
        first="first divergence",
    )


def _lengths_text(schedule: np.ndarray) -> str:
    """``"row 0: 4,1,0,3; row 1: 1,0,3,2"``."""
    return "; ".join(
        f"row {b}: " + ",".join(map(str, row.tolist())) for b, row in enumerate(schedule)
    )
