"""Greedy generation of one sequence by speculative decoding with token trees: each step
drafts a tree by prompt lookup (lookup.py, no draft model), verifies the newest token
and the whole tree in one call through nanoattn's KV cache (``tree_parents=``), keeps
the longest path greedy decoding confirms (``Decoder.accept``) and gains that path's
drafts and the target's token after it. The tokens are exactly greedy decoding's
(docs/decoding.md, "Speculative trees").
"""

import dataclasses
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
    ``depth`` deep, from the last ``ngram`` tokens' earlier occurrences. Every verify
    call is one compiled program: the chunk is right-padded to ``nodes + 1``."""

    def __init__(self, model: Decoder, max_len: int, *, nodes: int = 16, depth: int = 4,
                 ngram: int = 3):  # fmt: skip
        model = nnx.clone(model)
        model.eval()
        model.init_cache(1, max_len)
        graphdef, self.empty = nnx.split(model)
        self.max_len, self.nodes, self.depth, self.ngram = max_len, nodes, depth, ngram

        @jax.jit
        def feed(state, tokens, lengths, parents):
            model = nnx.merge(graphdef, state)
            logits = model(tokens, decode=True, lengths=lengths, tree_parents=parents)
            return nnx.state(model), jnp.argmax(logits[0], -1).astype(jnp.int32)  # (L,)

        @jax.jit
        def accept(state, kept):
            model = nnx.merge(graphdef, state)
            model.accept(kept)
            return nnx.state(model)

        self.feed, self.accept_path = feed, accept

    def __call__(self, prompt: list, n: int) -> tuple[list, list]:
        if len(prompt) < 2 or len(prompt) + n + self.nodes + 1 > self.max_len:
            raise ValueError(
                f"prompt must hold at least 2 tokens and fit with {n} new ones and a tree "
                f"of {self.nodes} in max_len={self.max_len}, got {len(prompt)} tokens"
            )
        width = self.nodes + 1
        committed = np.asarray([prompt[:-1]], np.int32)  # the cache holds all but the newest
        chain = np.arange(-1, committed.shape[1] - 1, dtype=np.int32)[None]
        state, _ = self.feed(self.empty, committed, np.array([committed.shape[1]]), chain)
        history, out, accepted = list(prompt), [], []
        while len(out) < n:
            tokens, parents = lookup.draft_tree(history, self.nodes, self.depth, self.ngram)
            chunk = np.zeros((1, width), np.int32)  # the newest token, then the drafts
            chunk[0, : len(tokens) + 1] = [history[-1], *tokens]
            tree = np.full((1, width), -1, np.int32)
            tree[0, : len(tokens) + 1] = lookup.chunk_parents(parents)
            state, greedy = self.feed(state, chunk, np.array([len(tokens) + 1]), tree)
            path = lookup.accepted_path(tokens, parents, np.asarray(greedy))
            kept = np.full((1, width), -1, np.int32)
            kept[0, : len(path)] = path
            state = self.accept_path(state, kept)
            new = [int(chunk[0, i]) for i in path[1:]] + [int(greedy[path[-1]])]
            history += new
            out += new
            accepted.append(len(path) - 1)
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
