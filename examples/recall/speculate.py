"""Greedy generation of one sequence by speculative decoding with token trees: each step
drafts a tree by prompt lookup (lookup.py, no draft model), verifies the newest token
and the whole tree in one call through nanoattn's KV cache (``tree_parents=``), keeps
the longest path greedy decoding confirms (``Decoder.accept``) and gains that path's
drafts and the target's token after it. The tokens are exactly greedy decoding's
(docs/decoding.md, "Speculative trees").
"""

import dataclasses
import functools
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

    The cache holds ``max_len`` tokens (the prompt, the ``n`` new ones and one tree:
    ``len(prompt) + n + nodes + 1`` at most); trees of at most ``nodes`` drafts,
    ``depth`` deep, from the last ``ngram`` tokens' earlier occurrences. A step is ONE
    compiled call, the chunk right-padded to ``nodes + 1``: the tree verified, the path
    greedy decoding confirms found and kept (``Decoder.accept``) on the device, the cache
    donated; the host then reads the path's tokens (it drafts the next tree from them).
    The operands are flat lists of arrays, as the engine's (engine.py)."""

    def __init__(self, model: Decoder, max_len: int, *, nodes: int = 16, depth: int = 4,
                 ngram: int = 3):  # fmt: skip
        model = nnx.clone(model)
        model.eval()
        model.init_cache(1, max_len)
        graphdef, state = nnx.split(model)
        self.empty, state_def = jax.tree.flatten(state)
        self.max_len, self.nodes, self.depth, self.ngram = max_len, nodes, depth, ngram

        def feed(state, tokens, lengths, parents):  # -> the model, greedy tokens (L,)
            model = nnx.merge(graphdef, jax.tree.unflatten(state_def, state))
            logits = model(tokens, decode=True, lengths=lengths, tree_parents=parents)
            return model, jnp.argmax(logits[0], -1).astype(jnp.int32)

        @jax.jit
        def prefill(state, tokens, lengths, parents):
            return jax.tree.leaves(nnx.state(feed(state, tokens, lengths, parents)[0]))

        @functools.partial(jax.jit, donate_argnums=0)  # the cache is updated in place
        def verify(state, tokens, lengths, parents):
            # -> state, the path's tokens after the newest and the greedy one after
            # them (then -1s), and their count
            model, greedy = feed(state, tokens, lengths, parents)
            kept = lookup.accepted_path(tokens[0], parents[0], greedy, lengths[0])
            model.accept(kept[None])
            n = (kept >= 0).sum()
            gained = jnp.where(kept >= 0, tokens[0, jnp.maximum(kept, 0)], -1)
            gained = jnp.roll(gained, -1).at[n - 1].set(greedy[kept[n - 1]])
            return jax.tree.leaves(nnx.state(model)), gained, n

        self.prefill, self.verify = prefill, verify

    def __call__(self, prompt: list, n: int) -> tuple[list, list]:
        if len(prompt) < 2 or len(prompt) + n + self.nodes + 1 > self.max_len:
            raise ValueError(
                f"prompt must hold at least 2 tokens and fit with {n} new ones and a tree "
                f"of {self.nodes} in max_len={self.max_len}, got {len(prompt)} tokens"
            )
        width = self.nodes + 1
        committed = np.asarray([prompt[:-1]], np.int32)  # the cache holds all but the newest
        chain = np.arange(-1, committed.shape[1] - 1, dtype=np.int32)[None]
        state = self.prefill(self.empty, committed, np.array([committed.shape[1]]), chain)
        history, out, accepted = list(prompt), [], []
        while len(out) < n:
            tokens, parents = lookup.draft_tree(history, self.nodes, self.depth, self.ngram)
            chunk = np.zeros((1, width), np.int32)  # the newest token, then the drafts
            chunk[0, : len(tokens) + 1] = [history[-1], *tokens]
            tree = np.full((1, width), -1, np.int32)
            tree[0, : len(tokens) + 1] = lookup.chunk_parents(parents)
            state, gained, kept = self.verify(state, chunk, np.array([len(tokens) + 1]), tree)
            gained, kept = jax.device_get((gained, kept))
            new = gained[:kept].tolist()
            history += new
            out += new
            accepted.append(int(kept) - 1)
        return out[:n], accepted


@dataclasses.dataclass
class Compared:
    """Speculative and plain greedy generation of the same prompts, one at a time.

    Attributes:
      tokens, greedy: per prompt, the n tokens of each.
      accepted: per prompt, the drafts each speculative step accepted.
      seconds, greedy_seconds: each one's time for all the prompts (the last repeat).
    """

    tokens: list
    greedy: list
    accepted: list
    seconds: float
    greedy_seconds: float

    @property
    def equal(self) -> bool:
        return self.tokens == self.greedy

    @property
    def speedup(self) -> float:
        return self.greedy_seconds / self.seconds


def compare(model: Decoder, prompts: list, n: int, *, nodes: int = 16, depth: int = 4,
            repeat: int = 2) -> Compared:  # fmt: skip
    """Generates ``n`` tokens after each prompt by speculative decoding (:class:`Speculative`)
    and by plain greedy decoding through the cache (one token per call), each ``repeat``
    times (the first compiles), timing the last."""
    max_len = max(map(len, prompts)) + n + nodes + 1
    speculative = Speculative(model, max_len, nodes=nodes, depth=depth)
    cached = generate.Cached(model, 1, max_len)
    for _ in range(repeat):
        start = time.perf_counter()
        runs = [speculative(p, n) for p in prompts]
        seconds = time.perf_counter() - start
        start = time.perf_counter()
        greedy = [cached(*generate.right_pad([p], len(p)), n)[0].tolist() for p in prompts]
        greedy_seconds = time.perf_counter() - start
    return Compared([t for t, _ in runs], greedy, [a for _, a in runs], seconds, greedy_seconds)
