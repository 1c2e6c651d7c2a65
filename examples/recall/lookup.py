"""Drafts by prompt lookup, as token trees, and the path of them greedy decoding keeps.

Prompt lookup needs no draft model: the tokens around an earlier occurrence of a
sequence's last few tokens, in its own history (its prompt and what it generated), are
a guess at what follows now. Two readings of each occurrence give guesses:

- forward: the tokens that followed an earlier occurrence of the last n tokens (the
  text repeats);
- mirrored: the tokens that came before an earlier occurrence of the last n tokens
  written backwards, read backwards (the text is retraced). The recall model's lookup
  reads the token just *before* the match of the current one (data.py), so its greedy
  continuations walk the pairs of the prompt backwards: forward guesses find its
  answers, mirrored ones its answers and the queries between them.

Several occurrences give several guesses, and the guesses that agree on their first
tokens share them: a trie, the token tree the target verifies in one call
(docs/decoding.md, "Speculative trees").

A tree is two lists of the same length: ``tokens`` (the drafts' ids) and ``parents``
(each draft's parent's index among them, before it, or -1 for a child of the newest
token). :func:`draft_tree` builds it in plain Python on the host (the definition);
:func:`draft_tree_on_device` builds the same tree in jax, inside the compiled step, so
that a step needs nothing from the host. The path kept is found on the device
(:func:`accepted_path`).
"""

import itertools

import jax.numpy as jnp
import numpy as np


def draft_tree(history, nodes: int, depth: int, ngram: int = 3,
               per_match: int = 4) -> tuple[list, list]:  # fmt: skip
    """A tree of at most ``nodes`` drafts, each at most ``depth`` deep, that continues
    ``history`` (int (L,), the sequence's tokens, its newest last) by prompt lookup.

    For n from ``ngram`` down to 1: the ``per_match`` most recent earlier occurrences
    of the last n tokens of ``history`` (forward) and the ``per_match`` most recent of
    those n tokens reversed (mirrored), taken in turns (forward, mirrored, forward,
    ...), each propose ``depth`` tokens (fewer at the ends of the history): forward the
    tokens after the occurrence, mirrored the tokens before it, nearest first. Each
    proposal goes into the trie, its tokens shared with those of earlier proposals where
    they agree, until it holds ``nodes`` drafts. Longer matches come first: they guess
    better.

    Returns:
      (tokens, parents): two lists of the tree's length, parents before children
      (``parents[i]`` in [-1, i)).
    """
    history = np.asarray(history)
    tokens, parents, child = [], [], {}  # child: (parent, token) -> its index
    if nodes < 1 or depth < 1:
        return tokens, parents
    for n in range(min(ngram, len(history) - 1), 0, -1):
        forward = [history[s : s + depth] for s in _occurrences(history, n)[:per_match]]
        mirrored = [history[max(p - depth, 0) : p][::-1]
                    for p in _mirrored(history, n)[:per_match]]  # fmt: skip
        for guess in itertools.chain(*itertools.zip_longest(forward, mirrored)):
            parent = -1
            for token in [] if guess is None else guess.tolist():
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
    return (np.flatnonzero(_windows_equal(history, history[len(history) - n :])) + n)[::-1]


def _mirrored(history: np.ndarray, n: int) -> np.ndarray:
    """Where each earlier occurrence of ``history``'s last ``n`` tokens reversed starts,
    the most recent first: p in [1, L - 1 - n] (a token before it to propose, and the
    occurrence ends before the newest token)."""
    match = _windows_equal(history, history[len(history) - n :][::-1])
    match[:1] = False
    return np.flatnonzero(match)[::-1]


def _windows_equal(history: np.ndarray, pattern: np.ndarray) -> np.ndarray:
    """match (L - n,): ``match[p]`` where ``history[p : p + n]`` equals ``pattern`` (n
    tokens), for the windows that end before the newest token."""
    L, n = len(history), len(pattern)
    match = np.ones(max(L - n, 0), bool)
    for k in range(n):
        match &= history[k : L - n + k] == pattern[k]
    return match


def draft_tree_on_device(history, length, nodes: int, depth: int, ngram: int = 3,
                         per_match: int = 4):  # fmt: skip
    """:func:`draft_tree` in jax, for a compiled step: the same tree, of the history
    ``history[:length]`` (int (Lmax,), a buffer whose first ``length`` tokens are the
    sequence's; ``length`` may be traced, at least 2).

    The guesses are gathered as a (M, depth) array (M = ``ngram * 2 * per_match``, in
    the order :func:`draft_tree` takes them, invalid tokens marked), each guess's
    prefixes compared with every earlier guess's: a token is a new node where no earlier
    guess has the same prefix, numbered in order and kept while that number is below
    ``nodes``.

    Returns:
      (tokens, parents, count): int32 (nodes,), (nodes,) and a scalar; the first
      ``count`` entries are the tree (zeros and -1s after them).
    """
    h = jnp.asarray(history, jnp.int32)
    L = jnp.asarray(length, jnp.int32)
    Lmax = h.shape[0]
    at = jnp.arange(Lmax, dtype=jnp.int32)
    hits = []  # per n (longest first): forward, then mirrored; each (Lmax,)
    for n in range(ngram, 0, -1):
        k = jnp.arange(n, dtype=jnp.int32)
        last = h[jnp.clip(L - n + k, 0, Lmax - 1)]  # the last n tokens, (n,)
        # forward: the continuation starts at s, history[s - n : s] == last
        window = h[jnp.clip(at[:, None] - n + k[None], 0, Lmax - 1)]  # (Lmax, n)
        hits.append((window == last[None]).all(axis=1) & (at >= n) & (at <= L - 1) & (L - 1 >= n))
        # mirrored: history[p + k] == last reversed, the continuation p - 1, p - 2, ...
        window = h[jnp.clip(at[:, None] + k[None], 0, Lmax - 1)]
        hits.append((window == last[None, ::-1]).all(axis=1) & (at >= 1) & (at <= L - 1 - n))
    starts = _most_recent(jnp.stack(hits), per_match)[..., None]  # (2 * ngram, C, 1)
    d = jnp.arange(depth, dtype=jnp.int32)[None, None]
    forward = (jnp.arange(2 * ngram) % 2 == 0)[:, None, None]
    index = jnp.where(forward, starts + d, starts - 1 - d)  # (2 * ngram, C, depth)
    valid = (starts >= 0) & (index >= 0) & (index < L)
    # in turns within each n: forward 0, mirrored 0, forward 1, ...
    order = (ngram, 2, per_match, depth)
    index, valid = (
        x.reshape(order).transpose(0, 2, 1, 3).reshape(-1, depth) for x in (index, valid)
    )
    guess = h[jnp.clip(index, 0, Lmax - 1)]  # (M, depth)
    valid = jnp.cumprod(valid, axis=1).astype(bool)  # prefixes valid
    M = guess.shape[0]
    # same[c, e, j]: guesses c and e agree on their first j + 1 tokens, all valid
    same = (guess[:, None] == guess[None]) & valid[:, None] & valid[None]
    same = jnp.cumprod(same, axis=2).astype(bool)
    first = jnp.argmax(same, axis=1)  # (M, depth): the first guess with that prefix
    new = valid & (first == jnp.arange(M)[:, None])
    rank = (jnp.cumsum(new.reshape(-1)) - 1).reshape(M, depth)
    node = rank[first, jnp.arange(depth)[None]]  # (M, depth): each prefix's node
    parent = jnp.concatenate([jnp.full((M, 1), -1, rank.dtype), node[:, :-1]], axis=1)
    slot = jnp.where(new & (rank < nodes), rank, nodes).reshape(-1)  # nodes: dropped
    tokens = jnp.zeros(nodes, jnp.int32).at[slot].set(guess.reshape(-1), mode="drop")
    parents = (
        jnp.full(nodes, -1, jnp.int32)
        .at[slot]
        .set(parent.reshape(-1).astype(jnp.int32), mode="drop")
    )
    count = jnp.minimum(new.sum(), nodes).astype(jnp.int32)
    return tokens, parents, count


def _most_recent(hits, C: int):
    """The positions of each row's ``C`` last True entries of ``hits`` (R, Lmax), the
    last first, then -1s: (R, C). (C maxima, each masking the last: ``lax.top_k``
    and a cumulative sum over the history cost more than the rest of a draft on a CPU.)"""
    position = jnp.where(hits, jnp.arange(hits.shape[1], dtype=jnp.int32), -1)
    found = []
    for _ in range(C):
        found.append(position.max(axis=1))
        position = jnp.where(position == found[-1][:, None], -1, position)
    return jnp.stack(found, axis=1)


def chunk_parents(parents):
    """A verify chunk's parents, int32 (1 + len(parents),): the newest token (index 0,
    its parent the last token in the cache: -1) and then the drafts (``parents``, a
    tree's), their indices shifted by one."""
    return jnp.concatenate([jnp.full(1, -1, jnp.int32), jnp.asarray(parents, jnp.int32) + 1])


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
