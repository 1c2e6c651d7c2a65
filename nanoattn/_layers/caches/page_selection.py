"""Query-aware page selection on a paged cache (Quest, ICML 2024; docs/decoding.md,
"Page selection"): the pool keeps, per page and key/value head, the elementwise
minimum and maximum of the keys written in it, and a decode query reads only the
pages whose keys can score highest, plus its sequence's last page.

For a query q and a page whose keys lie in the box [lo, hi], every key k in the page
has ``q . k <= sum_h max(q_h lo_h, q_h hi_h)``: the page's bound. A decode row (a
sequence that brings one token) with more than ``k + 1`` pages reads the ``k`` pages
of highest bound (the maximum over its query heads) among all but its last, and its
last page (a page whose box holds a NaN ranks first: a NaN key stays
visible); its page table becomes those pages in position order and its length their
keys, so its query, at the last position, sees each of them. That changes the answer
(the keys of the pages left out are not seen); rows of more than one token (prefill
chunks, token trees) and rows of at most ``k + 1`` pages are served as without
selection.

The bounds are kept as the pool is written: a page written (or moved into) at its
first slot starts afresh, every key written or moved into a page widens its box, and
a copied page takes its source's box. A rewind or a rejected draft leaves its keys in
the box: the box stays a bound, only looser. Axis letters: P pages of the pool, K
key/value heads, G query heads per key/value head, H head width, B a step's sequences,
M pages per sequence, Tq a step's tokens.
"""

import jax
import jax.numpy as jnp


def empty_bounds(pages: int, kv_heads: int, head_dim: int) -> jax.Array:
    """The bounds of a fresh pool: float32 (P, 2, K, H), ``[:, 0]`` the minimum and
    ``[:, 1]`` the maximum of each page's keys (zeros: a page no sequence holds)."""
    return jnp.zeros((pages, 2, kv_heads, head_dim), jnp.float32)


def update_bounds(bounds, *, copy_source, copy_target, moved, moved_page, moved_slot,
                  new, page, slot):  # fmt: skip
    """The bounds after a step wrote the pool: copies (``copy_target`` (C,) takes
    ``copy_source``'s box; P: no copy), then the moved keys ``moved`` (V, K, H) into
    ``moved_page`` at ``moved_slot`` (V,) (P: no move), then the new keys ``new`` (Tq,
    K, H) into ``page`` at ``slot`` (Tq,) (P: not written). A page written or moved
    into at slot 0 starts afresh."""
    P = bounds.shape[0]
    bounds = bounds.at[copy_target].set(bounds[jnp.minimum(copy_source, P - 1)], mode="drop")
    first = jnp.zeros(P, bool)
    first = first.at[jnp.where(moved_slot == 0, moved_page, P)].set(True, mode="drop")
    first = first.at[jnp.where(slot == 0, page, P)].set(True, mode="drop")
    fresh = jnp.stack([jnp.full(bounds.shape[2:], jnp.inf), jnp.full(bounds.shape[2:], -jnp.inf)])
    bounds = jnp.where(first[:, None, None, None], fresh, bounds)
    for target, keys in ((moved_page, moved), (page, new)):
        keys = keys.astype(jnp.float32)
        bounds = bounds.at[target, 0].min(keys, mode="drop")
        bounds = bounds.at[target, 1].max(keys, mode="drop")
    return bounds


def page_bounds(q, bounds, page_table):
    """Each sequence's pages' upper bound of its first query's logits (up to the
    scale): q (B, N, H), bounds (P, 2, K, H), page_table (B, M) of pages in the pool ->
    float32 (B, M), the maximum over the query heads of ``sum_h max(q_h lo_h, q_h
    hi_h)`` = ``min(q, 0) . lo + max(q, 0) . hi``.

    One matrix product per sequence: its pages' boxes as rows (M, 2 K H), against the
    query heads' negative and positive parts laid block-diagonally by key/value head
    (2 K H, N): K times the products a per-head contraction needs, but one GEMM (a
    contraction batched over the heads ran ten times slower on a CPU)."""
    B, N, H = q.shape
    K = bounds.shape[2]
    M = page_table.shape[1]
    box = bounds[page_table].reshape(B, M, 2 * K * H)  # [lo | hi] of each page
    q = q.astype(jnp.float32).reshape(B, K, N // K, H)  # GQA: contiguous groups
    eye = jnp.eye(K, dtype=jnp.float32)
    parts = [
        jnp.einsum("bkgh,kj->bkhjg", part, eye).reshape(B, K * H, N)  # block-diagonal
        for part in (jnp.minimum(q, 0), jnp.maximum(q, 0))
    ]
    weights = jnp.concatenate(parts, axis=1)  # (B, 2 K H, N)
    upper = jnp.einsum("bmc,bcn->bmn", box, weights, precision="highest")  # (B, M, N)
    return upper.max(axis=2)


def select_pages(q, bounds, page_table, kv_lengths, query_starts, k: int, page_size: int):
    """The page table and lengths a step's attention reads with page selection:
    (page_table (B, M), kv_lengths (B,)), each decode row of more than ``k + 1`` pages
    reduced to its ``k`` pages of highest :func:`page_bounds` among all but its last,
    in position order, then its last page (the rest of the row: that page repeated,
    never read); other rows as they are. q (Tq, N, H) are the step's queries as the
    attention takes them, bounds (P, 2, K, H) the pool's."""
    B, M = page_table.shape
    P = bounds.shape[0]
    Tq = q.shape[0]
    starts = query_starts[:-1]
    decode = query_starts[1:] - starts == 1  # (B,)
    held = (kv_lengths + page_size - 1) // page_size  # (B,): the pages each row holds
    safe = jnp.clip(page_table, 0, P - 1)
    score = page_bounds(q[jnp.clip(starts, 0, Tq - 1)], bounds, safe)  # (B, M)
    score = jnp.where(jnp.isnan(score), jnp.inf, score)  # a NaN key's page: always read
    k = min(k, M)
    candidate = jnp.arange(M)[None] < (held - 1)[:, None]
    _, best = jax.lax.top_k(jnp.where(candidate, score, -jnp.inf), k)  # (B, k)
    best = jnp.sort(best, axis=1)
    last = jnp.maximum(held - 1, 0)
    rows = jnp.arange(B)[:, None]
    chosen = jnp.concatenate(
        [page_table[rows, best], jnp.repeat(page_table[rows[:, 0], last][:, None], M - k, 1)],
        axis=1,
    )[:, :M]  # (B, M)
    reduced = decode & (held - 1 > k)
    length = k * page_size + kv_lengths - (held - 1) * page_size
    table = jnp.where(reduced[:, None], chosen, page_table)
    return table, jnp.where(reduced, length, kv_lengths).astype(jnp.int32)
