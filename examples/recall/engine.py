"""Serving the trained decoder: continuous batching over a paged KV cache, and the same
requests through static batches with contiguous caches of the same memory.

A request is a prompt and the number of tokens to generate greedily after it.

* :class:`Engine` (continuous batching): every layer keeps one pool of pages shared by
  the sequences in flight, kept by a ``nanoattn.PageAllocator``. A request is
  admitted as soon as a row of the step and the pages it will need are free (its
  sequence is allocated then), each step extends the sequences it feeds, and a
  finished request frees its pages at once for the next. Each step is ONE jitted
  call of static shape (x (1, Tq)): the next token of every decoding request and
  chunks of the prompts of newly admitted ones, mixed, through ``pages=``.
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
# static batching in the same cache memory (``python -m examples.recall serve`` judges it).
TARGET = 2.0


def with_implementation(model: Decoder, implementation: str | None) -> Decoder:
    """``model``'s parameters in a decoder whose attention runs on nanoattn's backend
    ``implementation`` (None: the automatic choice, call by call), in evaluation mode.

    A checkpoint's ``ModelConfig`` keeps the backend it was trained with (by default
    the reference ``"xla"``, the fastest for training at these sizes on CPU, which
    gathers every sequence's pages in a paged step); serving names its own."""
    config = dataclasses.replace(model.config, implementation=implementation)
    other = Decoder(config, rngs=nnx.Rngs(0))
    nnx.update(other, nnx.state(model, nnx.Param))
    other.eval()
    return other


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


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """The engine's sizes.

    Attributes:
      pages: P, the pages of each layer's pool.
      page_size: the tokens of a page.
      max_sequences: B, the requests in flight at most (the rows of a step).
      step_tokens: Tq, the tokens of a step (decode tokens and prompt chunks); at
        least ``max_sequences``, so that every decoding request advances each step.
    """

    pages: int = 256
    page_size: int = 16
    max_sequences: int = 16
    step_tokens: int = 64

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


@dataclasses.dataclass
class Served:
    """What a run produced: each request's tokens, by id, and how long it took."""

    outputs: dict
    seconds: float
    steps: int
    mixed_steps: int = 0  # steps that carried prompt chunks and decode tokens together

    @property
    def tokens(self) -> int:
        return sum(len(t) for t in self.outputs.values())

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds


@dataclasses.dataclass
class _Live:
    """A request in flight: the tokens its cache holds and those generated so far."""

    request: Request
    held: int = 0
    generated: list = dataclasses.field(default_factory=list)

    @property
    def prefilling(self) -> bool:
        return self.held < len(self.request.prompt)


class Engine:
    """Continuous batching of ``model`` (the trained decoder) over a paged KV cache of
    ``config``'s pool; ``self.run(requests)`` serves them (see the module)."""

    def __init__(self, model: Decoder, config: EngineConfig, max_len: int):
        self.config = config
        self.max_pages = config.pages_for(max_len)  # the page table's width M
        paged = Decoder(model.config, page_size=config.page_size, rngs=nnx.Rngs(0))
        nnx.update(paged, nnx.state(model, nnx.Param))
        paged.eval()
        paged.init_cache(1, config.cache_tokens)
        graphdef, state = nnx.split(paged)
        # A buffer of its own for every leaf (the parameters are the model's own arrays,
        # and the step donates the state, updating the pools in place), on the device the
        # step's outputs are on (else the second call compiles again).
        device = jax.devices()[0]
        self.state = jax.tree.map(lambda a: jax.device_put(jnp.copy(a), device), state)

        @functools.partial(jax.jit, donate_argnums=0)
        def step(state, tokens, pages, last):  # tokens (Tq,), last (B,)
            model = nnx.merge(graphdef, state)
            logits = model(tokens[None], decode=True, pages=pages)  # (1, Tq, V)
            return nnx.state(model), jnp.argmax(logits[0, last], -1).astype(jnp.int32)  # (B,)

        self.step = step

    def _allocator(self) -> nanoattn.PageAllocator:
        c = self.config
        return nanoattn.PageAllocator(
            c.pages, c.page_size, max_sequences=c.max_sequences, max_pages=self.max_pages
        )

    def warm_up(self) -> tuple[str, ...]:
        """Compiles the step (one call with no tokens: nothing is written). Returns the
        backends nanoattn took for its attention calls, distinct, in order of use."""
        c = self.config
        batch = self._allocator().batch([], tokens=c.step_tokens)
        tokens = np.full(c.step_tokens, data.PAD, np.int32)
        with recording_backends() as chosen:
            self.state, out = self.step(
                self.state, tokens, batch, np.zeros(c.max_sequences, np.int32)
            )
        out.block_until_ready()
        return tuple(dict.fromkeys(chosen))

    def run(self, requests, progress=None) -> Served:
        """Serves ``requests`` in order of arrival; ``progress(n)`` is called with the
        tokens each step generated."""
        c = self.config
        for r in requests:
            if c.pages_for(r.need) > min(c.pages, self.max_pages):
                raise ValueError(
                    f"request {r.id} needs {r.need} tokens of cache: more than the pool "
                    f"({c.pages} pages) or the engine's max_len ({self.max_pages} pages) hold"
                )
        self.allocator = alloc = self._allocator()  # every page free again at the end
        waiting, running, outputs = collections.deque(requests), {}, {}
        steps = mixed = 0
        start = time.perf_counter()
        while waiting or running:
            self._admit(alloc, waiting, running)
            rows, fed = self._compose(running)
            mixed += 0 < sum(not live.prefilling for live in rows) < len(rows)
            for live, tokens in zip(rows, fed):
                alloc.extend(live.request.id, len(tokens))
                live.held += len(tokens)
            next_tokens = self._step(alloc, rows, fed)
            steps += 1
            made = self._retire(alloc, rows, next_tokens, running, outputs)
            if progress:
                progress(made)
        return Served(outputs, time.perf_counter() - start, steps, mixed)

    def _admit(self, alloc, waiting, running) -> None:
        """Admission: the next requests in the queue while a row and every page each
        will need are free (their whole need is reserved: the pool never runs out)."""
        c = self.config
        reserved = sum(c.pages_for(live.request.need) for live in running.values())
        while waiting and len(running) < c.max_sequences:
            need = c.pages_for(waiting[0].need)
            if reserved + need > c.pages:
                return
            request = waiting.popleft()
            alloc.allocate(request.id, 0)
            running[request.id] = _Live(request)
            reserved += need

    def _compose(self, running) -> tuple[list, list]:
        """One mixed step's rows and their tokens: the next token of every decoding
        request, then chunks of the prompts being prefilled, up to ``step_tokens``."""
        budget, rows, fed = self.config.step_tokens, [], []
        for live in running.values():
            if not live.prefilling:
                rows.append(live)
                fed.append([live.generated[-1]])
                budget -= 1
        for live in running.values():
            if live.prefilling and budget:
                chunk = live.request.prompt[live.held : live.held + budget]
                rows.append(live)
                fed.append(list(chunk))
                budget -= len(chunk)
        return rows, fed

    def _step(self, alloc, rows, fed) -> np.ndarray:
        """The jitted call on the rows' tokens, token-major and padded: (B,) the greedy
        token after each row's last one."""
        c = self.config
        batch = alloc.batch(
            [(live.request.id, len(t)) for live, t in zip(rows, fed)], tokens=c.step_tokens
        )
        x = np.full(c.step_tokens, data.PAD, np.int32)
        flat = [t for tokens in fed for t in tokens]
        x[: len(flat)] = flat
        last = np.zeros(c.max_sequences, np.int32)
        last[: len(rows)] = np.asarray(batch.query_starts[1 : len(rows) + 1]) - 1
        self.state, next_tokens = self.step(self.state, x, batch, last)
        alloc.confirm(batch)
        return np.asarray(next_tokens)

    def _retire(self, alloc, rows, next_tokens, running, outputs) -> int:
        """Each row whose prompt is all in takes its token; a request with all its
        tokens frees its pages. Returns the tokens generated."""
        made = 0
        for b, live in enumerate(rows):
            if live.prefilling:
                continue  # its prompt is not all in yet: this logit predicts nothing new
            live.generated.append(int(next_tokens[b]))
            made += 1
            if len(live.generated) == live.request.new_tokens:
                alloc.free(live.request.id)
                outputs[live.request.id] = live.generated
                del running[live.request.id]
        return made


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
