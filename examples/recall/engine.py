"""Serving the trained decoder: continuous batching over a paged KV cache, and the same
requests through static batches with contiguous caches of the same memory.

A request is a prompt and the number of tokens to generate greedily after it.

* :class:`Engine` (continuous batching): every layer keeps one pool of pages shared by
  the sequences in flight, kept by a ``nanoattn.PageAllocator``. A request is
  admitted as soon as a row of the step and the pages it will need are free (its
  sequence is allocated then), each step extends the sequences it feeds, and a
  finished request frees its pages at once for the next. Each step is ONE jitted
  call (x (1, Tq), Tq the smallest of a few static sizes, :func:`step_sizes`, that
  holds its tokens): the next token of every decoding request and chunks of the
  prompts of newly admitted ones, mixed, through ``pages=``. The host never waits for
  a step: it composes and dispatches the next while the device runs this one, and
  fetches the tokens at the end. With ``EngineConfig(prefix_cache=True)`` a request
  whose prompt starts with pages already in the pool (a prompt its group shares:
  :func:`shared_workload`) shares them and computes only the rest.
* :class:`Static` (static batching): the requests in arrival order, ``batch`` at a
  time, each batch prefilled in one call and decoded until its longest request ends,
  through a full cache of ``capacity`` tokens per row (the longest prompt and the
  most new tokens, as a batch of any of the requests may need):
  ``batch * capacity <= pages * page_size``, the engine's pool.

Both are greedy, so each request's tokens equal its greedy decoding alone
(tests/test_example_recall.py checks it). Both run on the model that
:func:`with_implementation` gives: the trained parameters, attention on the backend
serving asks for (by default nanoattn's automatic choice), not the one the checkpoint
was trained with. Axis letters: Tq tokens of a step, B rows of a step, V vocabulary.
"""

import collections
import contextlib
import dataclasses
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import nanoattn

from . import data, generate
from .model import Decoder

# Issue #33's target: continuous batching at least this many times the tokens/s of
# static batching in the same cache memory (``python -m examples.recall serve`` judges it;
# ``nanoattn bench --only engine`` judges issue #47's, 5x, on a randomly initialised model).
TARGET = 2.0


def with_implementation(model: Decoder, implementation: str | None) -> Decoder:
    """``model``'s parameters in a decoder whose attention runs on nanoattn's backend
    ``implementation`` (None: the automatic choice, call by call), in evaluation mode.

    A checkpoint's ``ModelConfig`` keeps the backend it was trained with (by default
    the reference ``"xla"``, the fastest for training at these sizes on CPU, which
    gathers every sequence's pages in a paged step); serving names its own."""
    return model.rebuilt(dataclasses.replace(model.config, implementation=implementation))


@contextlib.contextmanager
def recording_backends():
    """Yields a list that collects the name of the backend nanoattn takes for every
    attention call traced inside the block (the automatic choice is made as a call is
    traced, per layer and per shape). nanoattn has no public way to say which backend
    served, so this wraps its dispatcher's ``choose`` for the block's duration."""
    from nanoattn._backends import dispatch

    chosen, choose = [], dispatch.choose

    def recording(*args, **kwargs):
        chosen.append(name := choose(*args, **kwargs))
        return name

    dispatch.choose = recording
    try:
        yield chosen
    finally:
        dispatch.choose = choose


@dataclasses.dataclass(frozen=True)
class Request:
    """A prompt (token ids) and the tokens to generate after it (>= 1)."""

    id: int
    prompt: tuple[int, ...]
    new_tokens: int

    @property
    def need(self) -> int:
        """The tokens its cache holds at most: the prompt and every generated token
        but the last (which is never fed back)."""
        return len(self.prompt) + self.new_tokens - 1


def workload(
    seed: int, task: data.TaskConfig, n: int, prompt_lengths=(8, 256), new_tokens=(1, 64)
) -> list[Request]:
    """``n`` requests, a pure function of the arguments: prompts of held-out recall
    sequences laid end to end (``generate.long_prompts``), their lengths and the tokens
    to generate drawn uniformly from the inclusive ranges ``prompt_lengths`` and
    ``new_tokens``."""
    (lo, hi), (new_lo, new_hi) = prompt_lengths, new_tokens
    if not 1 <= lo <= hi or not 1 <= new_lo <= new_hi:
        raise ValueError(
            f"prompt_lengths={prompt_lengths} and new_tokens={new_tokens} must be ranges "
            "(low, high) with 1 <= low <= high"
        )
    rng = np.random.default_rng([seed, 3, n])
    lengths = rng.integers(lo, hi + 1, size=n)
    outputs = rng.integers(new_lo, new_hi + 1, size=n)
    prompts = generate.long_prompts(seed, task, lengths.tolist())
    return [Request(i, tuple(p), int(m)) for i, (p, m) in enumerate(zip(prompts, outputs))]


def shared_workload(
    seed: int, task: data.TaskConfig, n: int, groups: int, shared_length: int,
    suffix_lengths=(1, 32), new_tokens=(1, 64),
) -> list[Request]:  # fmt: skip
    """``n`` requests in ``groups`` groups that share a prompt (a system prompt, a
    document asked several questions, several samples of one prompt), a pure function
    of the arguments: each group's ``shared_length`` tokens, then each request's own
    suffix, its length and the tokens to generate drawn uniformly from the inclusive
    ranges ``suffix_lengths`` (low >= 0) and ``new_tokens``; the groups' requests
    arrive interleaved, in a random order. The tokens are held-out recall sequences
    laid end to end (``generate.long_prompts``)."""
    (lo, hi), (new_lo, new_hi) = suffix_lengths, new_tokens
    if not 0 <= lo <= hi or not 1 <= new_lo <= new_hi or not 1 <= groups <= n:
        raise ValueError(
            f"suffix_lengths={suffix_lengths} (0 <= low <= high), new_tokens={new_tokens} "
            f"(1 <= low <= high) and groups={groups} (1 <= groups <= n={n}) are out of range"
        )
    if shared_length < 1:
        raise ValueError(f"shared_length={shared_length} must be >= 1")
    rng = np.random.default_rng([seed, 4, n, groups])
    group_of = rng.permutation(np.arange(n) % groups)  # (n,): each request's group
    suffixes = rng.integers(lo, hi + 1, size=n)
    outputs = rng.integers(new_lo, new_hi + 1, size=n)
    rows = generate.long_prompts(seed, task, [shared_length + hi] * (groups + n))
    return [
        Request(i, tuple(rows[g][:shared_length] + rows[groups + i][:s]), int(m))
        for i, (g, s, m) in enumerate(zip(group_of, suffixes, outputs))
    ]


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """The engine's sizes.

    Attributes:
      pages: P, the pages of each layer's pool.
      page_size: the tokens of a page.
      max_sequences: B, the requests in flight at most (the rows of a step).
      step_tokens: Tq, the tokens of a step (decode tokens and prompt chunks); at
        least ``max_sequences``, so that every decoding request advances each step.
      prefix_cache: share the pages of prompt prefixes already in the pool
        (``PageAllocator(prefix_cache=True)``): a request computes only the part of
        its prompt past its longest cached prefix.
    """

    pages: int = 256
    page_size: int = 16
    max_sequences: int = 16
    step_tokens: int = 64
    prefix_cache: bool = False

    def __post_init__(self):
        for name in ("pages", "page_size", "max_sequences", "step_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        if self.step_tokens < self.max_sequences:
            raise ValueError(
                f"step_tokens={self.step_tokens} must be >= max_sequences="
                f"{self.max_sequences}: one decode token per request in flight"
            )

    @property
    def cache_tokens(self) -> int:
        """The tokens the pool of a layer holds: ``pages * page_size``."""
        return self.pages * self.page_size

    def pages_for(self, tokens: int) -> int:
        return -(-tokens // self.page_size)


# What ``python -m examples.recall serve`` serves by default, and ``nanoattn bench
# --only engine`` too: the engine's sizes, and the workload's (``workload(seed, task,
# requests, prompt_lengths, new_tokens)``).
SERVE = EngineConfig(pages=512, page_size=16, max_sequences=32, step_tokens=128)
WORKLOAD = dict(seed=0, requests=96, prompt_lengths=(16, 384), new_tokens=(1, 128))
# ``serve --shared`` and the bench's prefix-cache comparison (issue #48): 64 requests in
# 8 groups sharing 512-token prompts (``shared_workload``), served in ``SERVE``'s pool
# with the prefix cache and without; its targets: the steps compute at most
# PREFILL_TARGET x the prompt tokens, and make at least PREFIX_TARGET x the tokens/s.
SHARED = dict(seed=0, requests=64, groups=8, shared_length=512, suffix_lengths=(1, 32),
              new_tokens=(1, 64))  # fmt: skip
PREFILL_TARGET = 0.2
PREFIX_TARGET = 2.0


@dataclasses.dataclass
class Served:
    """What a run produced: each request's tokens, by id, and how long it took."""

    outputs: dict
    seconds: float
    steps: int
    mixed_steps: int = 0  # steps that carried prompt chunks and decode tokens together
    # The engine's: prompt tokens its steps computed, and those a prefix cache held
    # (never computed; in cached_pages pages shared instead of allocated and written),
    # the cached pages handed out again, the pool's pages held at most at once.
    prefill_tokens: int = 0
    cached_tokens: int = 0
    cached_pages: int = 0
    evictions: int = 0
    peak_pages: int = 0

    @property
    def tokens(self) -> int:
        return sum(len(t) for t in self.outputs.values())

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds


@dataclasses.dataclass
class _Live:
    """A request in flight: the tokens its cache holds, how many it has generated, and
    its row in the last step that took it (where that step's token for it is)."""

    request: Request
    held: int = 0
    generated: int = 0
    row: int = -1

    @property
    def prefilling(self) -> bool:
        return self.held < len(self.request.prompt)


def step_sizes(config: EngineConfig, least: int = 8, most: int = 4) -> tuple[int, ...]:
    """The token counts Tq the engine compiles its step for, smallest first:
    ``step_tokens`` halved up to ``most - 1`` times while at least ``least``. A step
    runs at the smallest that holds its tokens, so that a step of a few decode tokens
    does not compute a full step of padding."""
    sizes = {config.step_tokens}
    for k in range(1, most):
        size = -(-config.step_tokens // 2**k)
        if size >= least:
            sizes.add(size)
    return tuple(sorted(sizes))


class Engine:
    """Continuous batching of ``model`` (the trained decoder) over a paged KV cache of
    ``config``'s pool; ``self.run(requests)`` serves them (see the module).

    The host never waits for a step: a decoding request's next input is the token the
    step before made for it, which stays on the device (the step gathers it by row), so
    the host composes and dispatches step after step while the device runs them, and
    fetches every generated token once, at the end (as :class:`Static` does).

    With a prefix cache, admission allocates a request's whole prompt with its token
    ids (the allocator shares the pages of its longest cached prefix) and takes back
    the rest at once (``rewind``: the prompt comes in chunks, each extended with its
    ids so that its full pages are cached once written); a request whose first page is
    that of a prompt still being prefilled waits for it, so that a group's requests
    arriving together compute their shared prompt once. What
    the host does per step is the allocator's bookkeeping and a few small arrays; the
    step's operands are flat lists of arrays (rebuilding the model's state as nnx
    pytrees at every call cost more host time than that), the parameters not donated
    and the cache donated."""

    def __init__(self, model: Decoder, config: EngineConfig, max_len: int):
        self.config = config
        self.max_pages = config.pages_for(max_len)  # the page table's width M
        self.sizes = step_sizes(config)
        paged = model.rebuilt(page_size=config.page_size)
        paged.init_cache(1, config.cache_tokens)
        graphdef, params, cache = nnx.split(paged, nnx.Param, ...)
        params, params_def = jax.tree.flatten(params)
        cache, cache_def = jax.tree.flatten(cache)
        # On the device the step's outputs are on (else the second call compiles again);
        # the cache a buffer of its own for every leaf, as the step donates it (updating
        # the pools in place).
        device = jax.devices()[0]
        self.params = [jax.device_put(a, device) for a in params]
        self.cache = [jax.device_put(jnp.copy(a), device) for a in cache]
        self._none = jax.device_put(np.zeros(config.max_sequences, np.int32), device)

        @functools.partial(jax.jit, donate_argnums=1)
        def step(params, cache, previous, tokens, source, pages, last):
            # tokens, source (Tq,): a token, or (source >= 0) the token `previous` (B,)
            # holds at that row; last (B,): each row's last token in x
            x = jnp.where(source >= 0, previous[jnp.maximum(source, 0)], tokens)  # (Tq,)
            model = nnx.merge(graphdef, jax.tree.unflatten(params_def, params),
                              jax.tree.unflatten(cache_def, cache))  # fmt: skip
            logits = model(x[None], decode=True, pages=pages)  # (1, Tq, V)
            _, _, cache = nnx.split(model, nnx.Param, ...)
            return jax.tree.leaves(cache), jnp.argmax(logits[0, last], -1).astype(jnp.int32)

        self.step = step

    def _allocator(self) -> nanoattn.PageAllocator:
        c = self.config
        return nanoattn.PageAllocator(
            c.pages, c.page_size, max_sequences=c.max_sequences, max_pages=self.max_pages,
            prefix_cache=c.prefix_cache,
        )  # fmt: skip

    def warm_up(self) -> tuple[str, ...]:
        """Compiles the step at each of its sizes (calls with no tokens: nothing is
        written). Returns the backends nanoattn took for its attention calls, distinct,
        in order of use."""
        c, alloc = self.config, self._allocator()
        with recording_backends() as chosen:
            for size in self.sizes:
                batch = alloc.batch([], tokens=size)
                tokens = np.full(size, data.PAD, np.int32)
                self.cache, out = self.step(
                    self.params, self.cache, self._none, tokens, np.full(size, -1, np.int32),
                    batch, np.zeros(c.max_sequences, np.int32),
                )  # fmt: skip
                alloc.confirm(batch)
        out.block_until_ready()
        return tuple(dict.fromkeys(chosen))

    def compiled(self) -> int:
        """The programs the step has compiled: one per step size after
        :meth:`warm_up`, and no more after any run."""
        return self.step._cache_size()

    def run(self, requests, progress=None) -> Served:
        """Serves ``requests`` in order of arrival; ``progress(n)`` is called with the
        tokens each step generates, as the step is dispatched."""
        c = self.config
        for r in requests:
            if c.pages_for(r.need) > min(c.pages, self.max_pages):
                raise ValueError(
                    f"request {r.id} needs {r.need} tokens of cache: more than the pool "
                    f"({c.pages} pages) or the engine's max_len ({self.max_pages} pages) hold"
                )
        self.allocator = alloc = self._allocator()  # every page free again at the end
        waiting, running = collections.deque(requests), {}
        made = []  # each step's tokens (B,), on the device, and who took which
        previous, served = self._none, Served({}, 0.0, 0)
        start = time.perf_counter()
        while waiting or running:
            self._admit(alloc, waiting, running, served)
            rows, fed = self._compose(running)
            served.mixed_steps += 0 < sum(not live.prefilling for live in rows) < len(rows)
            for live, tokens in zip(rows, fed):
                brought = 1 if tokens is None else len(tokens)
                alloc.extend(live.request.id, brought, tokens=tokens)  # ids: cacheable
                live.held += brought
                served.prefill_tokens += 0 if tokens is None else brought
            served.peak_pages = max(served.peak_pages, c.pages - alloc.free_pages)
            previous = self._step(alloc, rows, fed, previous)
            served.steps += 1
            takers = self._retire(alloc, rows, running)
            made.append((previous, takers))
            if progress:
                progress(len(takers))
        served.outputs = self._outputs(requests, made)
        served.seconds = time.perf_counter() - start
        served.evictions = alloc.stats().evictions
        return served

    def _admit(self, alloc, waiting, running, served) -> None:
        """Admission: the next requests in the queue while a row and every page each
        will still need are free (reserved: the pool never runs out mid-sequence). With
        a prefix cache a request shares the pages of its prompt's longest cached prefix
        (its ``held`` tokens start there), and one whose first page is that of a prompt
        still being prefilled waits until that prompt is in (then shares its pages),
        letting the requests behind it pass."""
        writing = {self._first_page(live.request) for live in running.values() if live.prefilling}
        passed = []
        while waiting and len(running) < self.config.max_sequences:
            request = waiting.popleft()
            first = self._first_page(request)
            if first is not None and first in writing:
                passed.append(request)
                continue
            live = self._place(alloc, request, running)
            if live is None:
                waiting.appendleft(request)
                break
            running[request.id] = live
            writing.add(first)
            served.cached_tokens += live.held
            served.cached_pages += live.held // self.config.page_size
        waiting.extendleft(reversed(passed))

    def _first_page(self, request: Request) -> tuple | None:
        """With a prefix cache, the tokens of the first page of ``request``'s prompt
        when it has more than a page (a prefix another prompt may share); else None."""
        ps = self.config.page_size
        if not self.config.prefix_cache or len(request.prompt) <= ps:
            return None
        return request.prompt[:ps]

    def _place(self, alloc, request: Request, running) -> _Live | None:
        """Allocates ``request``'s sequence when every page it will need fits beside the
        running requests' (reserved): its :class:`_Live`, holding the prompt tokens a
        prefix cache had; else None, nothing allocated."""
        prompt = request.prompt
        if self.config.prefix_cache:
            try:
                cached = alloc.allocate(request.id, len(prompt), tokens=prompt)
            except nanoattn.PoolExhausted:
                return None
            alloc.rewind(request.id, len(prompt) - cached)  # its chunks come step by step
        else:
            cached = alloc.allocate(request.id, 0)
        live = _Live(request, held=cached)
        if self._committed(alloc, [*running.values(), live]) > self.config.pages:
            alloc.free(request.id)
            return None
        return live

    def _committed(self, alloc, lives) -> int:
        """The pages ``lives`` hold (shared ones once) and will still take: what the
        pool must keep for them."""
        c = self.config
        held = c.pages - alloc.free_pages
        ahead = [c.pages_for(live.request.need) - len(alloc.pages_of(live.request.id))
                 for live in lives]  # fmt: skip
        return held + sum(ahead)

    def _compose(self, running) -> tuple[list, list]:
        """One mixed step's rows and the tokens each brings: every decoding request
        first (None: its one token is the one the step before made for it), then chunks
        of the prompts being prefilled, up to ``step_tokens`` tokens in all."""
        budget, rows, fed = self.config.step_tokens, [], []
        for live in running.values():
            if not live.prefilling:
                rows.append(live)
                fed.append(None)
                budget -= 1
        for live in running.values():
            if live.prefilling and budget:
                chunk = live.request.prompt[live.held : live.held + budget]
                rows.append(live)
                fed.append(chunk)
                budget -= len(chunk)
        return rows, fed

    def _step(self, alloc, rows, fed, previous) -> jax.Array:
        """Dispatches the jitted call on the rows' tokens, token-major and padded to the
        smallest step size that holds them; returns its (B,) greedy tokens, the one
        after each row's last token (on the device, not waited for)."""
        c = self.config
        brought = [1 if tokens is None else len(tokens) for tokens in fed]
        size = next(s for s in self.sizes if s >= sum(brought))
        batch = alloc.batch([(live.request.id, n) for live, n in zip(rows, brought)], tokens=size)
        tokens, source, last = step_inputs(rows, fed, size, c.max_sequences)
        self.cache, next_tokens = self.step(self.params, self.cache, previous, tokens, source,
                                            batch, last)  # fmt: skip
        alloc.confirm(batch)
        return next_tokens

    def _retire(self, alloc, rows, running) -> list:
        """Each row whose prompt is all in takes a token (this step's at its row); a
        request with all its tokens frees its pages. Returns (request id, row) of each
        row that took one."""
        takers = []
        for b, live in enumerate(rows):
            if live.prefilling:
                continue  # its prompt is not all in yet: this logit predicts nothing new
            takers.append((live.request.id, b))
            live.generated += 1
            if live.generated == live.request.new_tokens:
                alloc.free(live.request.id)
                del running[live.request.id]
        return takers

    @staticmethod
    def _outputs(requests, made) -> dict:
        """Every request's tokens, by id, from each step's tokens (fetched at once:
        the host waits for the device here only) and who took which."""
        outputs = {r.id: [] for r in requests}
        values = jax.device_get([tokens for tokens, _ in made])
        for row_tokens, (_, takers) in zip(values, made):
            for request_id, b in takers:
                outputs[request_id].append(int(row_tokens[b]))
        return outputs


def step_inputs(rows, fed, size: int, max_sequences: int):
    """A step's tokens (size,), their sources (size,) (>= 0: the row of the step
    before's tokens to take, for a row decoding; -1: the token given) and each row's
    last token (B,), the rows' chunks (a list of ids, or None: decode) laid end to end;
    each row's ``live.row`` becomes its index."""
    tokens = np.full(size, data.PAD, np.int32)
    source = np.full(size, -1, np.int32)
    last = np.zeros(max_sequences, np.int32)
    at = 0
    for b, (live, chunk) in enumerate(zip(rows, fed)):
        if chunk is None:
            source[at] = live.row
            at += 1
        else:
            tokens[at : at + len(chunk)] = chunk
            at += len(chunk)
        last[b], live.row = at - 1, b
    return tokens, source, last


class Static:
    """Static batching of ``model``: ``batch`` requests at a time through
    ``generate.Cached`` (a full KV cache of ``capacity`` tokens per row), each batch
    prefilled in one call (prompts right-padded to ``width``) and decoded until its
    longest request ends; the last batch is filled with copies of its first request."""

    def __init__(self, model: Decoder, batch: int, capacity: int, width: int):
        self.batch, self.width = batch, width
        self.generate = generate.Cached(model, batch, capacity)

    def _group(self, group):
        rows = list(group) + [group[0]] * (self.batch - len(group))
        tokens, lengths = generate.right_pad([r.prompt for r in rows], self.width)
        return tokens, lengths, max(r.new_tokens for r in group)

    def warm_up(self, requests) -> tuple[str, ...]:
        """Compiles the prefill and the step. Returns the backends nanoattn took for
        their attention calls, distinct, in order of use."""
        tokens, lengths, _ = self._group(requests[: self.batch])
        with recording_backends() as chosen:
            self.generate(tokens, lengths, 2)
        return tuple(dict.fromkeys(chosen))

    def run(self, requests, progress=None) -> Served:
        outputs, steps = {}, 0
        start = time.perf_counter()
        for i in range(0, len(requests), self.batch):
            group = requests[i : i + self.batch]
            tokens, lengths, n = self._group(group)
            out = self.generate(tokens, lengths, n)  # (batch, n)
            steps += n
            for row, r in enumerate(group):
                outputs[r.id] = out[row, : r.new_tokens].tolist()
            if progress:
                progress(sum(r.new_tokens for r in group))
        return Served(outputs, time.perf_counter() - start, steps)


def static_capacity(requests) -> int:
    """The tokens a row of a static batch must hold: the longest prompt and the most
    tokens generated, less one (the rows of a batch all run as many steps as its
    longest request, so any row may meet any length)."""
    return max(len(r.prompt) for r in requests) + max(r.new_tokens for r in requests) - 1


def static_for(model: Decoder, config: EngineConfig, requests) -> Static:
    """Static batching in the engine's cache memory: rows of :func:`static_capacity`,
    as many as ``pages * page_size`` tokens hold (``batch * capacity <= pages *
    page_size``).

    Raises:
      ValueError: one row does not fit in the pool.
    """
    capacity = static_capacity(requests)
    batch = config.cache_tokens // capacity
    if batch < 1:
        raise ValueError(
            f"a static batch's row needs {capacity} tokens of cache, more than the pool's "
            f"{config.cache_tokens} (pages * page_size)"
        )
    return Static(model, batch, capacity, max(len(r.prompt) for r in requests))


def alone(model: Decoder, requests) -> dict:
    """Each request's greedy decoding alone, by id: a batch of one through a full cache
    (one compiled program for all: prompts right-padded to the longest, never read)."""
    width = max(len(r.prompt) for r in requests)
    cached = generate.Cached(model, 1, width + max(r.new_tokens for r in requests) - 1)
    outputs = {}
    for r in requests:
        tokens, lengths = generate.right_pad([r.prompt], width)
        outputs[r.id] = cached(tokens, lengths, r.new_tokens)[0].tolist()
    return outputs
