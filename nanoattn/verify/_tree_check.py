"""The token-tree check of :func:`~nanoattn.verify.check_decoding` (speculative decoding
with token trees, docs/decoding.md "Speculative trees"): a decoder's ``tree`` and
``accept`` against its own full forward.

A decoder that verifies trees brings ``tree(state, chunk, parents) -> (state, y)``, a
chunk (B, L, ...) of drafts whose int32 ``parents`` (B, L) name each draft's parent
within its row's chunk (-1: the last committed token), and ``accept(state, kept) ->
state``, each row keeping the drafts ``kept[b]`` (int32 (B, A), a root-to-leaf path in
order, then -1s), the rest taken back. Each row decodes a prefix, brings a random tree
of its own (siblings and depths unlike the indices), keeps one of its paths (row 0 the
path of its last draft, the deepest reordering; the others a random path or a prefix of
one, row 1 nothing when there are three rows or more), then decodes on. Every draft's
output must equal the full forward of the prefix and its own root-to-leaf path, and
every later output the full forward of the prefix, the kept path and the new tokens.
Axis letters: B rows, L drafts, F output features.
"""

import numpy as np

from ._inputs import as_features
from ._leaks import Leaks, per_feature
from ._report import CheckResult

MAX_DRAFTS = 8  # the drafts of one tree (fewer with a chunk limit)
NEW = 3  # the tokens decoded after the accept (fewer with a chunk limit)


def random_parents(rng: np.random.Generator, L: int) -> list[int]:
    """A random tree of L drafts: token i's parent uniform in [-1, i), and token 1 a
    sibling of token 0 (both roots), so that a tree always branches."""
    parents = [-1] + [int(rng.integers(-1, i)) for i in range(1, L)]
    if L > 1:
        parents[1] = -1
    return parents


def root_path(parents, i: int) -> list[int]:
    """The indices of draft i's root-to-leaf path, root first."""
    path = []
    while i >= 0:
        path.append(i)
        i = parents[i]
    return path[::-1]


def _sizes(T: int, width: int) -> tuple[int, int, int]:
    """(prefix P, drafts L, new tokens R) with P + L + R = T: L and R at most ``width``
    (:data:`MAX_DRAFTS`, or the decoder's chunk limit), P at least 1."""
    L = min(MAX_DRAFTS, width, T - 2)
    R = min(NEW, width, T - L - 1)
    return T - L - R, L, R


def _feed(step, state, x, width: int):
    """Feeds x (B, P, ...) in chunks of at most ``width``: the state."""
    for lo in range(0, x.shape[1], width):
        state, _ = step(state, x[:, lo : lo + width], None)
    return state


def _expected(full, rows: list[np.ndarray], pad: np.ndarray, at: list[list[int]]):
    """(B, len(at[0]), F): ``full`` of each row's tokens ``rows[b]`` (then ``pad`` up to
    its length) at the positions ``at[b]``."""
    x = np.stack([np.concatenate([r, pad[b, len(r) :]]) for b, r in enumerate(rows)])
    y = as_features(full(x), x.shape, "full")
    return np.stack([y[b, positions] for b, positions in enumerate(at)])


def _kept(rng, parents: list[list[int]]) -> list[list[int]]:
    """Each row's kept path: row 0 its last draft's, row 1 none with three rows or
    more, the others a random draft's path or a prefix of it."""
    kept = []
    for b, tree in enumerate(parents):
        path = root_path(tree, len(tree) - 1 if b == 0 else int(rng.integers(0, len(tree))))
        if b > 0:
            path = path[: int(rng.integers(0, len(path) + 1))]
        kept.append([] if b == 1 and len(parents) > 2 else path)
    return kept


def check_trees(full, init, step, tree, accept, inputs, batch: int, T: int, width: int,
                tol: float, max_len: int) -> CheckResult:  # fmt: skip
    """Decode a prefix (in chunks of ``width``), a random tree per row, accept a path,
    decode on: every output against the full forward of its own path (the module's
    docstring); ``width``: the widest chunk, of :data:`MAX_DRAFTS` at most."""
    rng = np.random.default_rng(4)
    P, L, R = _sizes(T, width)
    prefix, drafts, new = (inputs.random(rng, batch, n) for n in (P, L, R))
    pad = inputs.random(rng, batch, T)
    parents = [random_parents(rng, L) for _ in range(batch)]
    state = _feed(step, init(batch, max_len), prefix, width)
    state, y = tree(state, drafts, np.asarray(parents, np.int32))
    got = as_features(y, drafts.shape, "tree")
    want = np.zeros_like(got)
    for i in range(L):
        paths = [root_path(p, i) for p in parents]
        rows = [np.concatenate([prefix[b], drafts[b, path]]) for b, path in enumerate(paths)]
        want[:, i : i + 1] = _expected(full, rows, pad, [[len(r) - 1] for r in rows])
    kept = _kept(rng, parents)
    table = np.full((batch, L), -1, np.int32)
    for b, path in enumerate(kept):
        table[b, : len(path)] = path
    state, y_new = step(accept(state, table), new, None)
    rows = [np.concatenate([prefix[b], drafts[b, path], new[b]]) for b, path in enumerate(kept)]
    after = _expected(full, rows, pad, [list(range(len(r) - R, len(r))) for r in rows])
    text = "; ".join(
        f"row {b}: parents {p}, kept {k}" for b, (p, k) in enumerate(zip(parents, kept))
    )
    leaks = Leaks(tol)
    leaks.add(
        per_feature(got, want), {"part": "drafts"}, (0,),
        "draft {position} of row {batch} (feature {feature}) differs from the full forward "
        "of its root-to-leaf path by {deviation:.3g} (" + text + ")",
        axis="draft",
    )  # fmt: skip
    leaks.add(
        per_feature(as_features(y_new, new.shape, "step"), after), {"part": "after accept"},
        (1,), "new token {position} of row {batch} (feature {feature}) after the accept "
        "differs from the full forward of the kept path by {deviation:.3g} (" + text + ")",
    )  # fmt: skip
    return leaks.result(
        "token trees",
        f"{batch} rows after {P} tokens: a tree of {L} drafts each ({text}), every draft "
        f"equal to the full forward of its own path, and after the accept {R} new tokens "
        f"equal to the full forward of the kept path",
        first="first divergence",
    )
