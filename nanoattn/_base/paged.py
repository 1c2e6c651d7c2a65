"""The rules of a paged call (``nanoattn.paged_attention``): a page table, key lengths
and query starts, checked once, and what they say about each query token.

A paged call attends the queries of B sequences at once, token-major: query
(Tq, N, H) holds sequence b's queries in rows ``query_starts[b] .. query_starts[b+1]
- 1`` (FlashAttention's ``cu_seqlens_q``); rows past ``query_starts[B]`` are padding.
Keys and values sit in a pool of pages, (P, page_size, K, H) each, or in one combined
pool (P, page_size, 2, K, H), each token's values right after its keys (the layout the
native kernel reads fastest: :func:`split_pool`); sequence b's j-th
page is ``page_table[b, j]``, and it holds ``kv_lengths[b]`` keys, this call's
included, so its ``q_len = query_starts[b+1] - query_starts[b]`` queries are its last
positions ``kv_lengths[b] - q_len + i``. Entries of the page table past the pages a
sequence holds are never read, whatever they hold.

An entry :data:`RETURNED` (-1) among the pages a sequence holds is a page it gave back
to the pool (a windowed layer's page that no query of the sequence can read any more,
docs/decoding.md, "Windowed layers in a paged pool"): it is no error, and no kernel
reads a page for it. Its keys and values read as NaN: a query that can see one of its
positions (inside its window, or a sink token) gets NaN, and no other row changes
(:func:`returned_reads` says which rows; the reference and the flash kernel substitute
NaN for its keys, and a row of a band-only call that reaches one gets a NaN query).

What cannot be checked under ``jit`` (a page id outside the pool, lengths outside
[q_len, max_pages * page_size]) makes the rows of the sequences concerned NaN
(:func:`token_layout`'s ``broken``); query starts that are no layout (not from 0,
decreasing, past Tq) make every row NaN; and no page outside the pool is ever read
(:func:`safe_page_table`). Axis letters: B sequences, Tq query
tokens, P pages, M pages per sequence at most, S = M * page_size the most keys a
sequence holds.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from .quantized import is_quantized
from .validate import as_array, expect_floating, expect_integer, expect_shape

RETURNED = -1  # the page-table entry of a page its sequence gave back to the pool


def split_pool(key_pages, value_pages=None):
    """The keys and the values (P, page_size, K, H) of a pool given as two arrays, or
    as one combined pool ``key_pages`` (P, page_size, 2, K, H) with ``value_pages``
    None: its two halves (slices, which XLA copies unless it fuses them into their use).
    A combined pool puts a token's values right after its keys, so that a decode step
    reads one run of memory a token: the native kernel reads it in place (bfloat16, 8
    heads of 128: 1.3x faster than two pools, docs/performance.md); the other kernels
    read its halves."""
    if value_pages is not None:
        return key_pages, value_pages
    return key_pages[:, :, 0], key_pages[:, :, 1]


def pool_halves(key_pages, value_pages):
    """What a check sees of the keys and values (their shapes and dtypes): the two
    pools, or a combined pool's halves as shapes (no slice is taken)."""
    if value_pages is not None:
        return key_pages, value_pages
    half = jax.ShapeDtypeStruct(key_pages.shape[:2] + key_pages.shape[3:], key_pages.dtype)
    return half, half


class PagedCall(NamedTuple):
    """The arrays of a paged call, checked (:func:`check_paged`), and its sizes.

    Attributes:
      query: (Tq, N, H); key_pages (P, page_size, K, H); value_pages (P, page_size,
        K, Hv), or None with key_pages a combined pool (P, page_size, 2, K, H);
        page_table (B, M); kv_lengths (B,); query_starts (B + 1,).
      Tq, N, H, Hv, P, page_size, K, B, M: the sizes.
    """

    query: jax.Array
    key_pages: jax.Array
    value_pages: jax.Array
    page_table: jax.Array
    kv_lengths: jax.Array
    query_starts: jax.Array
    Tq: int
    N: int
    H: int
    Hv: int
    P: int
    page_size: int
    K: int
    B: int
    M: int


class TokenLayout(NamedTuple):
    """What the paged rules say about each query token (Tq,), traced or not.

    Attributes:
      sequence: int32, the sequence of each row (0 for a padding or broken row, which
        reads nothing).
      position: int32, each row's position in its sequence (0 where not ``real``).
      real: bool, the rows that belong to one sequence and are not broken.
      broken: bool, the rows of sequences whose page table, lengths or starts are
        invalid (their outputs are NaN).
      sequence_broken: bool (B,), the sequences those rows belong to.
    """

    sequence: jax.Array
    position: jax.Array
    real: jax.Array
    broken: jax.Array
    sequence_broken: jax.Array


def check_paged(query, key_pages, value_pages, page_table, kv_lengths, query_starts):
    """The arrays of a paged call, checked: shapes, dtypes, and, when concrete, the
    values of the page table (held pages inside the pool), the lengths (in [q_len,
    M * page_size]) and the starts (non-decreasing, from 0, at most Tq).

    Returns:
      a :class:`PagedCall`: the arrays as jax arrays, and the sizes (Hv: the values'
      head width).

    Raises:
      ValueError: a shape problem, or an invalid value naming the argument and the row.
      TypeError: a dtype of the wrong kind.
    """
    query = as_array("query", query, "an array (Tq, N, H)")
    expect_shape("query", query.shape, "Tq N H", (None,) * 3)
    Tq, N, H = query.shape
    if value_pages is None:  # one combined pool
        key_pages = as_array("key_pages", key_pages, "an array (P, page_size, 2, K, H)")
        if key_pages.ndim != 5 or key_pages.shape[2] != 2:
            raise ValueError(
                f"value_pages is None, so key_pages must be one combined pool (P, page_size, "
                f"2, K, H), each token's keys then its values; got shape {key_pages.shape}"
            )
        expect_shape("key_pages", key_pages.shape, "P page_size 2 K H", (None, None, 2, None, H))
    else:
        key_pages = as_array("key_pages", key_pages, "an array (P, page_size, K, H)")
        value_pages = as_array("value_pages", value_pages, "an array (P, page_size, K, Hv)")
        expect_shape("key_pages", key_pages.shape, "P page_size K H", (None, None, None, H))
    keys, values = pool_halves(key_pages, value_pages)
    P, page_size, K, _ = keys.shape
    expect_shape("value_pages", values.shape, "P page_size K Hv", (P, page_size, K, None))
    if K == 0 or N % K != 0:
        raise ValueError(
            f"the number of query heads N={N} must be a multiple of the number of key/value "
            f"heads K={K} (query (Tq, N, H) = {query.shape}, key_pages (P, page_size, K, H) "
            f"= {key_pages.shape})"
        )
    if page_size == 0 or P == 0:
        raise ValueError(
            f"key_pages must hold at least one page of at least one key (P, page_size >= 1), "
            f"got {key_pages.shape}"
        )
    for name, x in (("query", query), ("key_pages", keys), ("value_pages", values)):
        if not (name != "query" and is_quantized(x)):  # their scales: check_kv_scales
            expect_floating(name, x.dtype)
    page_table = as_array("page_table", page_table, "an int array (B, max_pages)")
    expect_integer("page_table", page_table.dtype)
    expect_shape("page_table", page_table.shape, "B max_pages", (None, None))
    B, M = page_table.shape
    if B == 0 or M == 0:
        raise ValueError(
            f"page_table must have at least one sequence and one page per sequence (B, "
            f"max_pages >= 1), got {page_table.shape}"
        )
    kv_lengths = as_array("kv_lengths", kv_lengths, "an int array (B,)")
    expect_integer("kv_lengths", kv_lengths.dtype)
    expect_shape("kv_lengths", kv_lengths.shape, "B", (B,))
    query_starts = as_array("query_starts", query_starts, "an int array (B + 1,)")
    expect_integer("query_starts", query_starts.dtype)
    expect_shape("query_starts", query_starts.shape, "B+1", (B + 1,))
    check_paged_values(page_table, kv_lengths, query_starts, Tq, P, page_size)
    return PagedCall(query, key_pages, value_pages, page_table, kv_lengths, query_starts,
                     Tq=Tq, N=N, H=H, Hv=values.shape[3], P=P, page_size=page_size, K=K,
                     B=B, M=M)  # fmt: skip


def _concrete(*xs) -> bool:
    return not any(isinstance(x, jax.core.Tracer) for x in xs)


def check_paged_values(page_table, kv_lengths, query_starts, Tq: int, P: int, page_size: int):
    """The concrete checks of :func:`check_paged`, on the page table, lengths and starts
    (a traced argument is left to :func:`token_layout`, which makes the rows concerned
    NaN); the paged cache's steps check their batches with it too."""
    M = page_table.shape[1]
    if _concrete(query_starts):
        starts = np.asarray(query_starts)
        if starts[0] != 0:
            raise ValueError(f"query_starts[0] must be 0, got {int(starts[0])}")
        drops = np.flatnonzero(np.diff(starts) < 0)
        if drops.size:
            b = int(drops[0]) + 1
            raise ValueError(
                f"query_starts must be non-decreasing, got query_starts[{b}]="
                f"{int(starts[b])} < query_starts[{b - 1}]={int(starts[b - 1])}"
            )
        if starts[-1] > Tq:
            raise ValueError(
                f"query_starts[{len(starts) - 1}]={int(starts[-1])} is past the query's "
                f"Tq={Tq} rows"
            )
    if _concrete(kv_lengths, query_starts):
        lengths, q_lens = np.asarray(kv_lengths), np.diff(np.asarray(query_starts))
        bad = np.flatnonzero((lengths < q_lens) | (lengths > M * page_size))
        if bad.size:
            b = int(bad[0])
            raise ValueError(
                f"kv_lengths must be in [q_len, max_pages * page_size] = [{int(q_lens[b])}, "
                f"{M * page_size}] for each sequence (its queries are its last positions), "
                f"got kv_lengths[{b}]={int(lengths[b])}"
            )
    if _concrete(page_table, kv_lengths):
        table, lengths = np.asarray(page_table), np.asarray(kv_lengths)
        held = np.arange(M)[None] < -(-lengths[:, None] // page_size)  # (B, M)
        bad = np.argwhere(held & ((table < 0) | (table >= P)) & (table != RETURNED))
        if bad.size:
            b, j = (int(i) for i in bad[0])
            raise ValueError(
                f"page_table[{b}, {j}]={int(table[b, j])} is not a page of the pool "
                f"(P={P}) nor {RETURNED} (a page given back); sequence {b} holds "
                f"{int(lengths[b])} keys, so its first {-(-int(lengths[b]) // page_size)} "
                f"entries are read"
            )


def held_pages(kv_lengths, page_size: int, M: int):
    """(B, M) bool: the entries of the page table each sequence holds."""
    pages = (kv_lengths + page_size - 1) // page_size  # (B,)
    return jnp.arange(M)[None] < pages[:, None]


def safe_page_table(page_table, kv_lengths, page_size: int, P: int):
    """The page table with every entry a sequence does not hold, and every id outside
    [0, P) (:data:`RETURNED` included), replaced by page 0: what a kernel may read
    without ever leaving the pool (the rows that would read a bad page are NaN,
    :func:`token_layout`; those that would read a returned one, :func:`returned_reads`)."""
    held = held_pages(kv_lengths, page_size, page_table.shape[1])
    inside = (page_table >= 0) & (page_table < P)
    return jnp.where(held & inside, page_table, 0).astype(jnp.int32)


def token_layout(page_table, kv_lengths, query_starts, Tq: int, P: int, page_size: int):
    """The :class:`TokenLayout` of a paged call's Tq query rows (traced or not).

    A sequence is broken when its lengths are outside [q_len, M * page_size] or a page
    it holds is outside the pool (not :data:`RETURNED`); every row it covers is then
    broken. Query starts that
    are not a layout (not starting at 0, decreasing, or past Tq) break every row of the
    call: no row's sequence can be told from them. Rows at or past ``query_starts[B]``
    are padding."""
    M = page_table.shape[1]
    starts = query_starts.astype(jnp.int32)
    q_lens = starts[1:] - starts[:-1]  # (B,)
    held = held_pages(kv_lengths, page_size, M)
    outside = (page_table < 0) | (page_table >= P)
    bad_page = (held & outside & (page_table != RETURNED)).any(axis=1)
    bad_length = (kv_lengths < q_lens) | (kv_lengths > M * page_size)
    bad_starts = (starts[0] != 0) | (q_lens < 0).any() | (starts[-1] > Tq)  # ()
    sequence_broken = bad_length | bad_page | bad_starts  # (B,)
    t = jnp.arange(Tq, dtype=jnp.int32)[:, None]  # (Tq, 1)
    member = (starts[None, :-1] <= t) & (t < starts[None, 1:])  # (Tq, B)
    count = member.sum(axis=1)
    sequence = jnp.argmax(member, axis=1).astype(jnp.int32)  # the first; 0 where none
    broken = (member & sequence_broken[None]).any(axis=1) | bad_starts
    real = (count == 1) & ~broken
    i = t[:, 0] - starts[sequence]  # the row's index among its sequence's queries
    position = kv_lengths[sequence] - q_lens[sequence] + i
    position = jnp.where(real, position, 0).astype(jnp.int32)
    sequence = jnp.where(real, sequence, 0)
    return TokenLayout(sequence, position, real, broken, sequence_broken)


def returned_entries(page_table, kv_lengths, page_size: int):
    """(B, M) bool: the entries a sequence holds that are :data:`RETURNED`."""
    return held_pages(kv_lengths, page_size, page_table.shape[1]) & (page_table == RETURNED)


def returned_reads(page_table, kv_lengths, layout: TokenLayout, page_size: int, band,
                   sink_tokens: int = 0):  # fmt: skip
    """(Tq, M) bool, traced or not: whether query row t can see a key of its sequence's
    entry j, and that entry is :data:`RETURNED`. A row sees the keys its sequence holds
    inside its ``band`` ``(left, right)`` (either None: unbounded; a causal call's
    right is 0; None: every key) and, with ``sink_tokens`` S0, the first S0 positions
    up to its right bound. Exact for a call whose rules are a band (and sink tokens);
    a ``mask_fn`` may hide more."""
    M = page_table.shape[1]
    returned = returned_entries(page_table, kv_lengths, page_size)[layout.sequence]  # (Tq, M)
    first = (jnp.arange(M) * page_size)[None]  # (1, M): each entry's first position
    q = layout.position[:, None]  # (Tq, 1)
    seen = first < kv_lengths[layout.sequence][:, None]
    left, right = (None, None) if band is None else band
    if right is not None:
        seen = seen & (first <= q + right)
    if left is not None:
        seen = seen & ((first + page_size - 1 >= q - left) | (first < sink_tokens))
    return layout.real[:, None] & returned & seen


def check_returned(page_table, kv_lengths, query_starts, Tq: int, P: int, page_size: int,
                   band, sink_tokens: int, hint: str) -> None:  # fmt: skip
    """Raises ValueError, when concrete, for a :data:`RETURNED` entry some query of the
    call can see (:func:`returned_reads`), naming the entry, the query and ``hint``."""
    if not _concrete(page_table, kv_lengths, query_starts):
        return
    layout = token_layout(page_table, kv_lengths, query_starts, Tq, P, page_size)
    cells = np.asarray(returned_reads(page_table, kv_lengths, layout, page_size, band,
                                      sink_tokens))  # fmt: skip
    if cells.any():
        t, j = (int(i) for i in np.argwhere(cells)[0])
        b, q = int(layout.sequence[t]), int(layout.position[t])
        raise ValueError(
            f"page_table[{b}, {j}]={RETURNED} is a page sequence {b} gave back, but its "
            f"query at position {q} sees its keys {j * page_size}..{(j + 1) * page_size - 1} "
            f"(window {band}, {sink_tokens} sink tokens); {hint}"
        )
