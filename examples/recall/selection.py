"""The trained model with query-aware page selection (nanoattn's
``AttentionConfig(page_selection=k)``, docs/decoding.md "Page selection"): how often
does reading only k pages of the paged cache (and the last) change the token the model
decodes greedily, and how much time does a decode step save?

Held-out recall sequences are decoded through a paged cache as the engine holds them:
every sequence a sequence of the pool, one step of all their prompts (``RECALL v1 k1
... vP kP SEP``), then one step per position of one token each, the sequences' own
tokens fed (teacher forcing, as quantized.py does). With selection, the global
blocks' decode steps read the k pages whose keys bound the query's logits highest and
the last page; the local block reads its window as always. The greedy token of every
step is compared with the same decoding without selection, and with the answer. A
recall sequence is short (64 tokens: 16 pages of 4), so the pages are small here; the
selection is the same at any length.
"""

import dataclasses
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import nanoattn

from . import data
from .model import Decoder
from .quantized import Agreement

PAGE_SIZE = 4
SELECTIONS = (1, 2, 4, 8)
PREFILL_TOKENS = 1 << 16


def with_selection(model: Decoder, page_size: int, page_selection: int | None,
                   implementation: str | None = "xla") -> Decoder:  # fmt: skip
    """``model``'s parameters in a decoder with a paged cache of ``page_size`` tokens a
    page and ``page_selection`` (None: every page read) in its global blocks, its
    attention on nanoattn's backend ``implementation`` (None: the automatic choice)."""
    config = dataclasses.replace(model.config, implementation=implementation)
    return model.rebuilt(config, page_size=page_size, page_selection=page_selection)


def paged_greedy(model: Decoder, tokens, prefix: int) -> tuple[np.ndarray, float]:
    """Teacher-forced greedy decoding of ``tokens`` (B, T) through ``model``'s paged
    cache (module doc): the greedy token of every step (B, T - prefix), step i
    predicting token ``prefix + i``, and the seconds of a one-token step (the mean over
    the steps after the first, which compiles). The prompts (``prefix`` tokens) are
    prefilled in calls of at most ``PREFILL_TOKENS`` tokens (one prompt at least)."""
    tokens = np.asarray(tokens, np.int32)
    B, T = tokens.shape
    page_size = model.blocks[0].attn.config.page_size
    per_sequence = -(-T // page_size)
    model = nnx.clone(model)
    model.init_cache(1, B * per_sequence * page_size)
    alloc = nanoattn.PageAllocator(B * per_sequence, page_size, max_sequences=B,
                                   max_pages=per_sequence)  # fmt: skip
    graphdef, state = nnx.split(model)
    state = jax.tree.map(jnp.copy, state)  # donated to the steps: the caller's stay whole
    rows = max(1, min(B, PREFILL_TOKENS // prefix))  # prompts a prefill call
    first = []
    for start in range(0, B, rows):
        group = range(start, min(start + rows, B))
        for b in group:
            alloc.allocate(b, prefix)
        batch = alloc.batch([(b, prefix) for b in group], tokens=rows * prefix)
        x = np.zeros((rows, prefix), np.int32)  # a short last group is padded
        x[: len(group)] = tokens[group.start : group.stop, :prefix]
        state, greedy = _step(graphdef, state, x.reshape(1, -1), batch)
        alloc.confirm(batch)
        first.append(np.asarray(greedy)[prefix - 1 :: prefix][: len(group)])
    out = [np.concatenate(first)]  # each prompt's last token's
    start = None
    for t in range(prefix, T - 1):
        for b in range(B):
            alloc.extend(b, 1)
        batch = alloc.batch([(b, 1) for b in range(B)], tokens=B)
        state, greedy = _step(graphdef, state, tokens[None, :, t], batch)
        alloc.confirm(batch)
        out.append(np.asarray(greedy))  # waits: the next step's inputs are known, not this
        if start is None:
            start = time.perf_counter()
    seconds = (time.perf_counter() - start) / max(T - prefix - 2, 1)
    return np.stack(out, axis=1), seconds


@functools.partial(jax.jit, static_argnums=0, donate_argnums=1)
def _step(graphdef, state, x, pages):
    """One paged step of the decoder: (new state, the greedy token after each of x's);
    the state is donated (the pool is written in place, not copied a step)."""
    model = nnx.merge(graphdef, state)
    logits = model(jnp.asarray(x), decode=True, pages=pages)  # (1, Tq, V)
    return nnx.state(model), jnp.argmax(logits[0], -1).astype(jnp.int32)


@dataclasses.dataclass(frozen=True)
class Selected:
    """One selection's decoding: k (None: every page), its agreement with the decoding
    without selection, and the seconds of a decode step."""

    pages: int | None
    agreement: Agreement
    seconds: float


def measure(model: Decoder, task: data.TaskConfig, seed: int, sequences: int,
            page_size: int = PAGE_SIZE, selections=SELECTIONS, progress=None, *,
            length: int | None = None, decoded: int | None = None,
            implementation: str | None = "xla") -> list:  # fmt: skip
    """:class:`Selected` for every page read (None first, then each k of ``selections``)
    on ``sequences`` held-out recall sequences of the run's stream; ``progress(k)`` is
    called as each decoding begins.

    ``length``: the sequences' tokens (None: the task's ``seq_len``; longer ones ask
    more queries of the same pairs). ``decoded``: decode only the last this many
    tokens a step each, the rest prefilled (None: every token after the pairs and
    SEP). ``implementation``: nanoattn's backend of every decoding (the reference
    ``"xla"`` gathers each sequence's pages: None, the automatic choice, for long
    sequences)."""
    if length is not None:
        task = dataclasses.replace(task, seq_len=length)
    tokens, answers = data.held_out(seed, task, sequences, 1)["recall"]
    prefix = 2 + 2 * task.pairs  # RECALL, the pairs, SEP
    if decoded is not None:
        if not 2 <= decoded <= task.seq_len - prefix:
            raise ValueError(
                f"decoded={decoded} must be in [2, {task.seq_len - prefix}] (the tokens "
                f"after the pairs and SEP of {task.seq_len})"
            )
        prefix = task.seq_len - decoded
    graded = np.asarray(answers)[:, prefix:]
    truth = np.asarray(tokens)[:, prefix:]
    found, reference = [], None
    for k in (None, *selections):
        if progress:
            progress(k)
        decoder = with_selection(model, page_size, k, implementation)
        greedy, seconds = paged_greedy(decoder, tokens, prefix)
        reference = greedy if k is None else reference
        found.append(Selected(k, Agreement.of(greedy, reference, truth, graded), seconds))
    return found
