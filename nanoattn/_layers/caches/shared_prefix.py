"""Which sequences of a step begin with the same pages: the ``shared_prefixes`` of a
:class:`~nanoattn._layers.caches.paged.PagedBatch` (host side, plain Python and numpy),
which ``nanoattn.paged_attention`` reads once for every query of a group (cascade
attention, docs/decoding.md, "Shared prefixes").

A row may share only the pages written whole before its first query: its first
``written // page_size`` entries, up to its first page given back (-1). Forks and
prefix-cache hits of one prompt make those pages the same ids. The rows are grouped on
the trie of their page lists: at each node (a prefix held by some rows) the rows under
it either form one group sharing that prefix, or each branch below is grouped on its
own, whichever reads fewer pages; a group of n rows sharing m pages saves ``(n - 1) * m``
page reads. Rows in no group share nothing (0). Each group is named, as
``paged_attention`` finds it, by its count m and its page at entry m - 1 (unique in a
pool where a page sits at one place of one prefix; a group whose name another took
is dropped, never merged).
"""

import numpy as np

from ..._base.paged import RETURNED


def shared_prefixes(rows: list[tuple[list[int], int]], page_size: int, size: int) -> np.ndarray:
    """int32 (size,): for each row ``(pages, written)`` of a step (its page-table
    entries and the tokens written before the step), how many of its first pages it
    shares with the other rows of its group (0: none; rows past ``len(rows)``: 0).

    Example:
      >>> shared_prefixes([([4, 5, 6], 9), ([4, 5, 7], 8), ([8], 2)], page_size=4, size=4)
      array([2, 2, 0, 0], dtype=int32)
    """
    out = np.zeros(size, np.int32)
    settled = [_settled(pages, written // page_size) for pages, written in rows]
    buckets: dict = {}
    for b, pages in enumerate(settled):
        if pages:
            buckets.setdefault(pages[0], []).append(b)
    names = set()
    for members in buckets.values():
        if len(members) < 2:
            continue
        for group, m in _best(settled, members, 1)[1]:
            name = (m, settled[group[0]][m - 1])
            if name not in names:  # never two groups under one name
                names.add(name)
                out[group] = m
    return out


def _settled(pages: list[int], whole: int) -> list[int]:
    """The first ``whole`` entries, up to the first page given back."""
    head = list(pages[:whole])
    return head[: head.index(RETURNED)] if RETURNED in head else head


def _best(settled: list, members: list[int], depth: int) -> tuple[int, list]:
    """``(pages saved, [(rows, m), ...])``: the best grouping of ``members``, which all
    begin with the same ``depth`` pages (at least 2 of them)."""
    depth = _common(settled, members, depth)
    here = (len(members) - 1) * depth
    branches: dict = {}
    for b in members:
        if len(settled[b]) > depth:
            branches.setdefault(settled[b][depth], []).append(b)
    saved, groups = 0, []
    for branch in branches.values():
        if len(branch) >= 2:
            value, found = _best(settled, branch, depth + 1)
            saved, groups = saved + value, groups + found
    if here >= saved:
        return here, [(members, depth)]
    return saved, groups


def _common(settled: list, members: list[int], depth: int) -> int:
    """How many first pages ``members`` all hold alike (at least ``depth``)."""
    limit = min(len(settled[b]) for b in members)
    if limit <= depth:
        return limit
    block = np.array([settled[b][depth:limit] for b in members])  # (n, limit - depth)
    agree = (block == block[0]).all(axis=0)
    return depth + (int(np.argmin(agree)) if not agree.all() else agree.size)
