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
"""

import dataclasses
import functools
import itertools

import numpy as np

from ._inputs import Inputs, as_features
from ._leaks import Leaks, per_feature, positive_control
from ._paged_decoding import PagedDecoder, as_rows, check_forks
from ._paged_programs import check_programs
from ._quantization import check_quantization
from ._report import CheckResult, Report

DEFAULT_SEQ_LEN = 13
CAPACITY_SLACK = 3  # init(batch, seq_len + 3): unwritten slots that no output may read
CHUNK_CYCLE = (4, 1)  # the uneven chunking: sizes 4, 1, 4, 1, ..., then 1s up to T
RAGGED_WIDTH = 4  # every ragged call is a right-padded chunk of 4 tokens
TOLERANCE = {2: 3e-2, 4: 1e-5, 8: 1e-5}  # by the full forward's bytes per output element
LAPS = 4  # with a capacity C, the default length decodes 4 C + 3 tokens: the ring wraps 4 times
OPTIONAL = ("rewind", "capacity", "max_chunk", "float_cache", "reference")  # of a Decoder


class Decoder(tuple):
    """A decoder for :func:`check_decoding`: the triple ``(full, init, step)`` (it
    unpacks as one, so ``check_decoding(*decoder)`` checks the core protocol) plus the
    optional ``rewind``, ``capacity``, ``max_chunk``, ``float_cache`` and ``reference``
    (``check_decoding(decoder)`` checks them too).

    Args:
      full: ``full(x) -> y`` on the whole sequence.
      init: ``init(batch, max_len) -> state``, a fresh cache of ``max_len`` slots.
      step: ``step(state, chunk, lengths) -> (state, y_chunk)``.
      rewind: None, or ``rewind(state, n) -> state``: row b drops its last ``n[b]``
        tokens (int (B,), at most the real tokens of its last call).
      capacity: None (the cache holds the whole sequence), or the slots of a bounded
        (rolling) cache: ``init`` gets them and decoding goes on past them.
      max_chunk: None (any chunk length), or the most tokens one call may take.
      float_cache: None, or for a decoder with a quantized cache the same model with a
        float cache: a :class:`Decoder` or ``(full, init, step)``, whose ``init`` and
        ``step`` the quantization check uses.
      reference: None, or the full forward in higher precision (float64), ``reference(x)
        -> y``, against which the quantization check measures the float cache (default:
        ``full``).
    """

    def __new__(
        cls, full, init, step, *, rewind=None, capacity=None, max_chunk=None, float_cache=None,
        reference=None,
    ):  # fmt: skip
        self = super().__new__(cls, (full, init, step))
        given = dict(rewind=rewind, capacity=capacity, max_chunk=max_chunk,
                     float_cache=float_cache, reference=reference)  # fmt: skip
        for name in OPTIONAL:
            object.__setattr__(self, name, given[name])
        return self

    def __setattr__(self, name, value):
        raise AttributeError("a Decoder is immutable")

    full = property(lambda self: self[0])
    init = property(lambda self: self[1])
    step = property(lambda self: self[2])

    def __repr__(self) -> str:
        extras = "".join(
            f", {n}={getattr(self, n)!r}" for n in OPTIONAL if getattr(self, n) is not None
        )
        return f"Decoder({self[0]!r}, {self[1]!r}, {self[2]!r}{extras})"


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
    paged = full if isinstance(full, PagedDecoder) else None
    if paged is not None or isinstance(full, Decoder):
        float_cache = full.float_cache if float_cache is None else float_cache
        reference = full.reference if reference is None else reference
    if paged is not None:
        if init is not None or step is not None:
            raise ValueError("pass a PagedDecoder alone, without init and step")
        given = {"rewind": rewind, "capacity": capacity, "max_chunk": max_chunk}
        for name, value in given.items():
            if value is not None:
                raise ValueError(
                    f"a PagedDecoder takes no {name}: its pages come from a PageAllocator, "
                    f"which rewinds and has no chunk limit; got {name}={value!r}"
                )
        full, (init, step, rewind) = paged.full, as_rows(paged, inputs)
        if float_cache is not None:
            if not isinstance(float_cache, PagedDecoder):
                raise ValueError(
                    f"float_cache of a PagedDecoder must be a PagedDecoder, got {float_cache!r}"
                )
            float_cache = as_rows(float_cache, inputs)[:2]
    elif isinstance(full, Decoder):
        if init is not None or step is not None:
            raise ValueError("pass a Decoder alone, or the functions full, init and step")
        full, init, step, rewind, capacity, max_chunk = (
            full.full,
            full.init,
            full.step,
            full.rewind if rewind is None else rewind,
            full.capacity if capacity is None else capacity,
            full.max_chunk if max_chunk is None else max_chunk,
        )
    elif init is None or step is None:
        raise ValueError("pass the decoder's full, init and step, or a Decoder")
    if rewind is not None and not callable(rewind):
        raise ValueError(f"rewind must be None or a function (state, n) -> state, got {rewind!r}")
    if paged is None and float_cache is not None:
        if not (isinstance(float_cache, tuple) and len(float_cache) == 3 and
                all(map(callable, float_cache))):  # fmt: skip
            raise ValueError(
                f"float_cache must be None, a Decoder or (full, init, step), got {float_cache!r}"
            )
        float_cache = float_cache[1:]  # its init and step
    if reference is not None and not callable(reference):
        raise ValueError(f"reference must be None or a function x -> y, got {reference!r}")
    for name, value, least in (("capacity", capacity, 1), ("max_chunk", max_chunk, 1)):
        if value is not None and (
            isinstance(value, bool) or not isinstance(value, int) or value < least
        ):
            raise ValueError(f"{name} must be None or an int >= {least}, got {name}={value!r}")
    if seq_len is None:
        seq_len = DEFAULT_SEQ_LEN if capacity is None else LAPS * capacity + CAPACITY_SLACK
    for name, value, least in (("seq_len", seq_len, 2), ("batch", batch, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise ValueError(f"{name} must be an int >= {least}, got {name}={value!r}")
    if ragged not in (None, True, False):
        raise ValueError(f"ragged must be None, True or False, got ragged={ragged!r}")
    T = seq_len
    max_len = seq_len + CAPACITY_SLACK if capacity is None else capacity
    rng = np.random.default_rng(0)
    x = inputs.random(rng, batch, T)
    y_raw = full(x)
    y = as_features(y_raw, x.shape, "full")
    tol = _tolerance(atol, y, np.asarray(y_raw).dtype.itemsize)

    runs = _chunkings(T, chunked, max_chunk)
    equivalence, decoded, diverged = Leaks(tol), {}, []
    for name, sizes in runs.items():
        decoded[name] = _decode(init, step, x, sizes, max_len)
        deviation = per_feature(decoded[name], y)
        equivalence.add(
            deviation,
            {"chunking": name},
            (),
            f"position {{position}} of row {{batch}} (feature {{feature}}) differs from the "
            f"full forward by {{deviation:.3g}}, decoding {name}",
        )
        if not (np.nan_to_num(deviation, nan=np.inf) <= tol).all():
            diverged.append(name)
    names = "; ".join(runs)
    result = equivalence.result(
        "cache equivalence",
        f"{len(runs)} chunking{'s' if len(runs) > 1 else ''} ({names}) reproduce"
        f"{'' if len(runs) > 1 else 's'} the full forward at all {T} positions "
        f"of {batch} rows"
        + ("" if capacity is None else f" through a cache of {capacity} slots")
        + ("" if paged is None else f" {paged.describe()}"),
        first="first divergence",
    )
    if not result.passed:
        matches = [n for n in runs if n not in diverged]
        detail = f"{result.detail}; diverges: {', '.join(diverged)}"
        if matches:
            detail += f"; matches: {', '.join(matches)}"
        result = dataclasses.replace(result, detail=detail)
    checks = [result]
    if float_cache is not None:
        float_tol = _tolerance(None, y, np.asarray(y_raw).dtype.itemsize)
        decode = functools.partial(_decode, max_len=max_len)
        quantization = check_quantization(
            decode, *float_cache, reference, x, y, decoded, runs, tol, float_tol
        )
        checks.append(quantization)

    width = RAGGED_WIDTH if chunked else 1
    width = width if max_chunk is None else min(width, max_chunk)
    checks.append(_ragged(init, step, inputs, x, y, tol, ragged, width, max_len))

    future = Leaks(tol)
    for name, sizes in runs.items():
        for p in sorted({1, T // 2, T - 1}):
            other = x.copy()
            other[:, p:] = inputs.changed(rng, x[:, p:])
            future.add(
                per_feature(
                    _decode(init, step, other, sizes, max_len)[:, :p], decoded[name][:, :p]
                ),
                {"chunking": name, "split": p},
                (p,),
                f"output {{position}} of row {{batch}} (feature {{feature}}) changed by "
                f"{{deviation:.3g}} when only tokens >= {p} changed, decoding {name}",
            )
    checks.append(
        future.result(
            "no future in the cache",
            f"{future.trials} decodings whose tokens differ only from p = "
            f"{', '.join(map(str, sorted({1, T // 2, T - 1})))} on",
        )
    )

    changed = x.copy()
    changed[:, 0] = inputs.changed(rng, x[:, 0])
    one = "1 token per call"
    later = _decode(init, step, changed, runs[one], max_len)[:, 1:] - decoded[one][:, 1:]
    moved = float(np.abs(later).max())
    checks.append(
        positive_control(
            moved, tol, "the later outputs decoded one token per call", {"chunking": one}
        )
    )
    if rewind is not None:
        checks.append(_rewinding(full, init, step, rewind, inputs, batch, T, width, tol, max_len))
    if paged is not None:
        checks.append(check_forks(paged, inputs, T, batch, tol, width))
        make_rows = as_rows(paged, inputs)[0]
        checks.append(check_programs(paged, inputs, T, tol, make_rows))
    return Report("decoding", checks)


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
