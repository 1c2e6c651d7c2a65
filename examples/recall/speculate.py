"""Greedy generation of one sequence by speculative decoding with token trees: each step
drafts a tree by prompt lookup (lookup.py, no draft model), verifies the newest token
and the whole tree in one call through nanoattn's KV cache (``tree_parents=``), keeps
the longest path greedy decoding confirms (``Decoder.accept``) and gains that path's
drafts and the target's token after it. The tokens are exactly greedy decoding's
(docs/decoding.md, "Speculative trees").
"""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from . import lookup
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
