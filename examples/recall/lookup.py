"""Drafts by prompt lookup, as token trees, and the path of them greedy decoding keeps.

Prompt lookup needs no draft model: the tokens that followed an earlier occurrence of
a sequence's last few tokens, in its own history (its prompt and what it generated),
are a guess at what follows now. Several earlier occurrences give several guesses, and
the guesses that agree on their first tokens share them: a trie, the token tree the
target verifies in one call (docs/decoding.md, "Speculative trees"). Associative recall
is the task where this shines: a context is a list of pairs and queries that repeat.

A tree is two lists of the same length: ``tokens`` (the drafts' ids) and ``parents``
(each draft's parent's index among them, before it, or -1 for a child of the newest
token). The drafting is plain Python and numpy, on the host; the path kept is found
on the device (:func:`accepted_path`).
"""

import jax.numpy as jnp
import numpy as np


def draft_tree(history, nodes: int, depth: int, ngram: int = 3) -> tuple[list, list]:
    """A tree of at most ``nodes`` drafts, each at most ``depth`` deep, that continues
    ``history`` (int (L,), the sequence's tokens, its newest last) by prompt lookup.

    For n from ``ngram`` down to 1, each earlier occurrence of the last n tokens of
    ``history`` (the most recent first) proposes the ``depth`` tokens that followed it
    (fewer at the end of the history); each proposal goes into the trie, its tokens
    shared with those of earlier proposals where they agree, until it holds ``nodes``
    drafts. Longer matches come first: they guess better.

    Returns:
      (tokens, parents): two lists of the tree's length, parents before children
      (``parents[i]`` in [-1, i)).
    """
    history = np.asarray(history)
    L = len(history)
    tokens, parents, child = [], [], {}  # child: (parent, token) -> its index
    if nodes < 1 or depth < 1:
        return tokens, parents
    for n in range(min(ngram, L - 1), 0, -1):
        for start in _occurrences(history, n):
            parent = -1
            for token in history[start : start + depth].tolist():
                if (parent, token) not in child:
                    if len(tokens) == nodes:
                        return tokens, parents
                    child[parent, token] = len(tokens)
                    tokens.append(token)
                    parents.append(parent)
                parent = child[parent, token]
    return tokens, parents


def _occurrences(history: np.ndarray, n: int) -> np.ndarray:
    """Where the tokens after each earlier occurrence of ``history``'s last ``n``
    tokens start, the most recent first (never the end of the history itself)."""
    L = len(history)
    match = np.ones(L - n, bool)  # match[p]: history[p : p + n] is the last n tokens
    for k in range(n):
        match &= history[k : L - n + k] == history[L - n + k]
    return (np.flatnonzero(match) + n)[::-1]


def chunk_parents(parents) -> list:
    """A verify chunk's parents: the newest token (index 0, its parent the last token
    in the cache: -1) and then the drafts, their indices shifted by one."""
    return [-1, *(p + 1 for p in parents)]


def accepted_path(chunk, parents, greedy, length):
    """The longest root-to-leaf path of a verify chunk that greedy decoding confirms, in
    jax (the verify call finds it on the device, where it keeps it: speculate.py).

    Args:
      chunk: int (L,), the newest token then the drafts (padding past ``length``).
      parents: int (L,), :func:`chunk_parents` (padded with -1).
      greedy: int (L,), the target's greedy token after each chunk token.
      length: the chunk's real tokens.

    Returns:
      int32 (L,): the path's chunk indices in order, 0 (the newest token) first, then
      each draft whose token is the greedy token after its parent, its parent on the
      path; -1 after the path. The token after the path is ``greedy[path[-1]]``.
      (A trie's siblings hold different tokens, so the confirmed drafts are one chain.)
    """
    chunk, parents, greedy = (jnp.asarray(x, jnp.int32) for x in (chunk, parents, greedy))
    L = chunk.shape[0]
    index = jnp.arange(L)
    up = jnp.where(index == 0, 0, jnp.maximum(parents, 0))  # the newest token: its own
    kept = (index < length) & ((index == 0) | (chunk == greedy[up]))
    for _ in range(max(1, (L - 1).bit_length())):  # pointer doubling up the ancestors
        kept &= kept[up]
        up = up[up]
    return jnp.nonzero(kept, size=L, fill_value=-1)[0].astype(jnp.int32)
