"""Greedy generation for a batch of prompts of different lengths: with nanoattn's KV
cache (one ragged prefill call, then one token per row per step, each row at its own
position), and without it (the whole context recomputed for every new token, as the
NanoMoE seed's ``generate`` does). Both are compiled once and timed after a warm-up.
"""

import dataclasses
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from . import data
from .model import Decoder


def right_pad(prompts: list, width: int) -> tuple[np.ndarray, np.ndarray]:
    """Prompts (lists of token ids) as one right-padded int32 array (B, width), and
    their lengths (B,)."""
    lengths = np.array([len(p) for p in prompts], np.int32)
    if lengths.min() < 1 or lengths.max() > width:
        raise ValueError(f"prompt lengths must be in [1, {width}], got {lengths.tolist()}")
    tokens = np.full((len(prompts), width), data.PAD, np.int32)
    for row, prompt in enumerate(prompts):
        tokens[row, : len(prompt)] = prompt
    return tokens, lengths


def flat_decoder(model: Decoder, batch: int, max_len: int):
    """An eval copy of ``model`` with an empty cache of ``max_len`` tokens for ``batch``
    rows, as compiled steps take it: ``(empty, rebuild)``, its state as a flat list of
    arrays and ``rebuild(state) -> Decoder`` (inside a step; the state after it is
    ``jax.tree.leaves(nnx.state(model))``). Flat, as the engine's: flattening nnx's
    nested state in every call costs more than a small model's step."""
    model = nnx.clone(model)
    model.eval()
    model.init_cache(batch, max_len)
    graphdef, state = nnx.split(model)
    empty, state_def = jax.tree.flatten(state)
    return empty, lambda state: nnx.merge(graphdef, jax.tree.unflatten(state_def, state))


class Cached:
    """Greedy generation through the KV cache of capacity ``max_len``: ``self(tokens,
    lengths, n)`` prefills the right-padded prompts (B, L) in one call and generates
    ``n`` tokens per row, returning them (B, n): one call per token (dispatched without
    waiting for the last, as a server steps), or with ``one_call=True`` all ``n - 1``
    after the prefill's in one compiled loop (no host between the steps)."""

    def __init__(self, model: Decoder, batch: int, max_len: int):
        self.empty, rebuild = flat_decoder(model, batch, max_len)

        def run(state, tokens, lengths=None):  # -> the state after the chunk, its logits
            model = rebuild(state)
            logits = model(tokens, decode=True, lengths=lengths)  # (B, L, V)
            return jax.tree.leaves(nnx.state(model)), logits

        @jax.jit
        def prefill(state, tokens, lengths):
            state, logits = run(state, tokens, lengths)
            last = jnp.take_along_axis(logits, (lengths - 1)[:, None, None], axis=1)[:, 0]
            return state, jnp.argmax(last, -1).astype(jnp.int32)  # (B,)

        def advance(state, token):
            state, logits = run(state, token[:, None])  # (B, 1, V)
            return state, jnp.argmax(logits[:, 0], -1).astype(jnp.int32)

        step = functools.partial(jax.jit, donate_argnums=0)(advance)  # the cache in place

        @functools.partial(jax.jit, static_argnums=2)
        def looped(state, token, n: int):  # (B, n - 1): the tokens after ``token``
            def one(carry, _):
                state, token = advance(*carry)
                return (state, token), token

            return jax.lax.scan(one, (state, token), length=n - 1)[1].T

        self.prefill, self.step, self.looped = prefill, step, looped

    def __call__(self, tokens, lengths, n: int, timings: dict | None = None, *,
                 one_call: bool = False):  # fmt: skip
        start = time.perf_counter()
        state, token = self.prefill(self.empty, tokens, lengths)
        token.block_until_ready()
        prefilled = time.perf_counter()
        if one_call:
            rest = self.looped(state, token, n)  # (B, 0) for n = 1
            out = np.concatenate([np.asarray(token)[:, None], np.asarray(rest)], axis=1)
        else:
            out = [token]
            for _ in range(n - 1):
                state, token = self.step(state, token)
                out.append(token)
            out = np.stack(jax.device_get(out), axis=1)
        if timings is not None:
            timings["prefill"] = prefilled - start
            timings["per token"] = (time.perf_counter() - prefilled) / max(n - 1, 1)
        return out


class Uncached:
    """Greedy generation without a cache: every new token runs the model on the whole
    context, a right-padded buffer (B, max_len) (causal, so a row's tokens never see
    the padding after them); ``self(tokens, lengths, n)`` returns (B, n)."""

    def __init__(self, model: Decoder, max_len: int):
        model = nnx.clone(model)
        model.eval()
        graphdef, params = nnx.split(model)
        self.max_len = max_len

        @jax.jit
        def step(buffer, ends):  # ends (B,): each row's tokens so far
            logits = nnx.merge(graphdef, params)(buffer)  # (B, max_len, V): all of it
            last = jnp.take_along_axis(logits, (ends - 1)[:, None, None], axis=1)[:, 0]
            token = jnp.argmax(last, -1).astype(jnp.int32)
            rows = jnp.arange(buffer.shape[0])
            return buffer.at[rows, ends].set(token, mode="drop"), ends + 1, token

        self.step = step

    def __call__(self, tokens, lengths, n: int, timings: dict | None = None):
        if lengths.max() + n - 1 > self.max_len:
            raise ValueError(f"prompt + {n} tokens do not fit in {self.max_len}")
        buffer = np.full((tokens.shape[0], self.max_len), data.PAD, np.int32)
        buffer[:, : tokens.shape[1]] = tokens
        start = time.perf_counter()
        buffer, ends, out = jnp.asarray(buffer), jnp.asarray(lengths), []
        for _ in range(n):
            buffer, ends, token = self.step(buffer, ends)
            out.append(token)
        out = np.stack(jax.device_get(out), axis=1)
        if timings is not None:
            timings["per token"] = (time.perf_counter() - start) / n
        return out


@dataclasses.dataclass
class Comparison:
    """Both generations of one batch: tokens (B, n) each and their timings."""

    cached: np.ndarray | None
    uncached: np.ndarray | None
    cached_time: dict
    uncached_time: dict

    @property
    def equal(self) -> bool:
        return self.cached is not None and np.array_equal(self.cached, self.uncached)

    @property
    def speedup(self) -> float:
        return self.uncached_time["per token"] / self.cached_time["per token"]


def compare(
    model: Decoder, prompts: list, n: int, max_len: int, *, cache=True, no_cache=True, repeat=2
) -> Comparison:
    """Generates ``n`` tokens after each prompt with and/or without the cache, each
    ``repeat`` times (the first compiles), timing the last."""
    tokens, lengths = right_pad(prompts, max(len(p) for p in prompts))
    result = Comparison(None, None, {}, {})
    if cache:
        generate = Cached(model, len(prompts), max_len)
        for _ in range(repeat):
            result.cached = generate(tokens, lengths, n, result.cached_time)
    if no_cache:
        generate = Uncached(model, max_len)
        for _ in range(repeat):
            result.uncached = generate(tokens, lengths, n, result.uncached_time)
    return result


def task_prompts(seed: int, task: data.TaskConfig, copy_lengths, recall_cuts):
    """Held-out prompts: copy prompts ``COPY s1..sn COPY`` of the given lengths, and
    recall sequences cut right after their query number ``cut`` (0-based), with what
    should follow each (the copy and its closing COPY; the query's answer)."""
    held = data.held_out(seed, task, len(recall_cuts), len(copy_lengths))
    rng = np.random.default_rng([seed, 2, 0])
    copies, _ = data.copy(rng, task, len(copy_lengths), copy_lengths)
    prompts, expected = [], []
    for row, n in enumerate(copy_lengths):
        prompts.append(copies[row, : n + 2].tolist())
        expected.append(copies[row, n + 2 : 2 * n + 3].tolist())
    recall_tokens = held["recall"][0]
    for row, cut in enumerate(recall_cuts):
        end = 2 + 2 * task.pairs + 2 * cut + 1  # through query `cut`
        prompts.append(recall_tokens[row, :end].tolist())
        expected.append([int(recall_tokens[row, end])])
    return prompts, expected


def long_prompts(seed: int, task: data.TaskConfig, lengths) -> list:
    """Prompts of the given lengths made of held-out recall sequences laid end to end
    (longer than anything trained on: for timing, not for sense)."""
    need = -(-max(lengths) // task.seq_len)
    tokens, _ = data.held_out(seed, task, need * len(lengths), 1)["recall"]
    rows = tokens.reshape(len(lengths), -1)
    return [rows[b, :n].tolist() for b, n in enumerate(lengths)]
