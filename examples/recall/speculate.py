"""Greedy generation of one sequence by speculative decoding with token trees: each step
drafts a tree by prompt lookup (lookup.py, no draft model), verifies the newest token
and the whole tree in one call through nanoattn's KV cache (``tree_parents=``), keeps
the longest path greedy decoding confirms (``Decoder.accept``) and gains that path's
drafts and the target's token after it. The tokens are exactly greedy decoding's
(docs/decoding.md, "Speculative trees").

A step is one compiled call that needs nothing from the host: it drafts from the
sequence's tokens, which it keeps on the device with the cache. So the host dispatches
the next step without waiting for the last, as plain greedy decoding does, and only
reads how far the sequence has come, one step behind, to know when to stop.
"""

import dataclasses
import functools
import itertools
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from . import generate, lookup
from .model import Decoder


class Speculative:
    """``self(prompt, n) -> (tokens, accepted)``: the ``n`` greedy tokens after
    ``prompt`` (a list of at least 2 token ids), and the drafts each step accepted.

    Trees of at most ``nodes`` drafts, ``depth`` deep, from the ``per_match`` most recent
    earlier occurrences of the last ``ngram`` (down to 1) tokens, forward and mirrored
    (:func:`lookup.draft_tree`). The cache holds ``max_len`` tokens: the prompt, the
    ``n`` new ones and two trees (``len(prompt) + n + 2 * (nodes + 1)`` at most; the
    host may dispatch one step past the ``n`` tokens before it sees them). A step is
    ONE compiled call, the chunk right-padded to ``nodes + 1``: the tree drafted on the
    device (:func:`lookup.draft_tree_on_device`), verified, the path greedy decoding
    confirms found and kept (``Decoder.accept``) and its tokens appended to the
    sequence's, the cache donated. With ``one_call=True`` every step runs in one
    compiled loop until the ``n`` tokens are there (and ``accepted`` is empty: the
    loop keeps no count per step)."""

    def __init__(self, model: Decoder, max_len: int, *, nodes: int = 16, depth: int = 8,
                 ngram: int = 3, per_match: int = 4):  # fmt: skip
        self.empty, rebuild = generate.flat_decoder(model, 1, max_len)
        self.max_len, self.nodes = max_len, nodes
        width = nodes + 1  # the newest token, then the drafts

        def feed(state, tokens, lengths, parents):  # -> the model, greedy tokens (L,)
            model = rebuild(state)
            logits = model(tokens, decode=True, lengths=lengths, tree_parents=parents)
            return model, jnp.argmax(logits[0], -1).astype(jnp.int32)

        @jax.jit
        def prefill(state, tokens, lengths, parents):
            return jax.tree.leaves(nnx.state(feed(state, tokens, lengths, parents)[0]))

        def advance(carry):  # one step: (cache, tokens (H,), length) -> the same after it
            state, history, length = carry
            drafts, parents, count = lookup.draft_tree_on_device(
                history, length, nodes, depth, ngram, per_match
            )
            chunk = jnp.concatenate([history[length - 1][None], drafts])
            tree = lookup.chunk_parents(parents)
            model, greedy = feed(state, chunk[None], (count + 1)[None], tree[None])
            kept = lookup.accepted_path(chunk, tree, greedy, count + 1)
            model.accept(kept[None])
            n = (kept >= 0).sum().astype(jnp.int32)
            gained = jnp.where(kept >= 0, chunk[jnp.maximum(kept, 0)], -1)
            gained = jnp.roll(gained, -1).at[n - 1].set(greedy[kept[n - 1]])
            history = jax.lax.dynamic_update_slice(history, gained, (length,))
            return jax.tree.leaves(nnx.state(model)), history, length + n

        @functools.partial(jax.jit, donate_argnums=(0, 1))  # the cache updated in place
        def step(state, history, length):
            return advance((state, history, length))

        @functools.partial(jax.jit, donate_argnums=0)
        def looped(carry, end):  # steps until the sequence holds ``end`` tokens
            def more(carry):
                return carry[2] < end

            return jax.lax.while_loop(more, advance, carry)

        self.prefill, self.step, self.looped, self.width = prefill, step, looped, width

    def __call__(self, prompt: list, n: int, *, one_call: bool = False) -> tuple[list, list]:
        L0 = len(prompt)
        if L0 < 2 or L0 + n + 2 * self.width > self.max_len:
            raise ValueError(
                f"prompt must hold at least 2 tokens and fit with {n} new ones and two "
                f"trees of {self.nodes} in max_len={self.max_len}, got {L0} tokens"
            )
        committed = np.asarray([prompt[:-1]], np.int32)  # the cache holds all but the newest
        chain = np.arange(-1, L0 - 2, dtype=np.int32)[None]
        state = self.prefill(self.empty, committed, np.array([L0 - 1]), chain)
        history = np.zeros(self.max_len + self.width, np.int32)  # room for a step's tokens
        history[:L0] = prompt
        carry = (state, jnp.asarray(history), jnp.int32(L0))
        if one_call:
            _, history, _ = self.looped(carry, L0 + n)
            return np.asarray(history)[L0 : L0 + n].tolist(), []
        lengths = []  # each step's length, read one step behind the dispatch
        while len(lengths) < 2 or int(lengths[-2]) < L0 + n:
            carry = self.step(*carry)
            lengths.append(carry[2])
        lengths = [L0, *(int(x) for x in jax.device_get(lengths))]
        steps = next(i for i, x in enumerate(lengths) if x >= L0 + n)  # one more ran
        accepted = [b - a - 1 for a, b in itertools.pairwise(lengths[: steps + 1])]
        return np.asarray(carry[1])[L0 : L0 + n].tolist(), accepted


@dataclasses.dataclass
class Compared:
    """Speculative and plain greedy generation of the same prompts, one at a time, in
    two harnesses: one call per step (``seconds``) and all of a prompt's steps in one
    compiled loop (``looped``).

    Attributes:
      tokens, greedy: per prompt, the n tokens of each (one call per step).
      accepted: per prompt, the drafts each speculative step accepted.
      seconds, greedy_seconds: each one's time for all the prompts, one call a step
        (the best repeat after the first).
      looped_seconds, looped_greedy_seconds: the same, each prompt's steps in one call;
        ``looped_equal``: those tokens equal too.
    """

    tokens: list
    greedy: list
    accepted: list
    seconds: float
    greedy_seconds: float
    looped_seconds: float
    looped_greedy_seconds: float
    looped_equal: bool

    @property
    def equal(self) -> bool:
        return self.tokens == self.greedy and self.looped_equal

    @property
    def speedup(self) -> float:
        return self.greedy_seconds / self.seconds

    @property
    def looped_speedup(self) -> float:
        return self.looped_greedy_seconds / self.looped_seconds


def compare(model: Decoder, prompts: list, n: int, *, nodes: int = 16, depth: int = 8,
            repeat: int = 5) -> Compared:  # fmt: skip
    """Generates ``n`` tokens after each prompt by speculative decoding (:class:`Speculative`)
    and by plain greedy decoding through the cache, one call per step and then each
    prompt in one call, each ``repeat`` times (the first compiles), keeping the best
    time of the others (a run this short, tens of milliseconds, is at the mercy of the
    machine's noise). Each generator runs its prompts alone (no other's call between
    its own)."""
    max_len = max(map(len, prompts)) + n + 2 * (nodes + 1)
    speculative = Speculative(model, max_len, nodes=nodes, depth=depth)
    cached = generate.Cached(model, 1, max_len)
    timed = {}

    def run(name, generate_one):  # the best of the repeats after the first
        for r in range(repeat):
            start = time.perf_counter()
            out = [generate_one(p) for p in prompts]
            seconds = time.perf_counter() - start
            timed[name] = seconds if r < 2 else min(timed[name], seconds)
        return out

    runs = run("speculative", lambda p: speculative(p, n))
    greedy = run("greedy", lambda p: cached(*generate.right_pad([p], len(p)), n)[0].tolist())
    looped = run("looped", lambda p: speculative(p, n, one_call=True)[0])
    looped_greedy = run(
        "looped greedy",
        lambda p: cached(*generate.right_pad([p], len(p)), n, one_call=True)[0].tolist(),
    )
    return Compared(
        [t for t, _ in runs],
        greedy,
        [a for _, a in runs],
        timed["speculative"],
        timed["greedy"],
        timed["looped"],
        timed["looped greedy"],
        looped == greedy and looped_greedy == greedy,
    )
