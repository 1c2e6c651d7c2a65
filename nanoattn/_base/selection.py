"""The key-selection rule (sparse attention over chosen keys: DeepSeek-V3.2's top-k
attention, query-aware page selection): each query names the key positions it may read.

``key_indices`` is int (B, T, k) for a dense call, (Tq, k) for a paged one: the
positions, in its row's keys (a paged query's: in its sequence), that each query may
read, -1 for an unused entry. A selected key is seen where the other rules let it be
(causality and a window at the query's position, key lengths); a key not selected is
never seen, nor read. An index selected twice counts once, on every backend. An index
outside [-1, S) (S: a dense call's keys, a paged call's ``M * page_size``) is an error:
one line naming it when concrete, under ``jit`` NaN in its batch row (a paged call: in
its query token's row). Rules that are not
a band (a dense mask, bias, segment ids, ``mask_fn``, ``score_fn``, a token tree) are
refused with it.

Two readings of the rule: :func:`selected` is the reference's (a mask over every key),
and :func:`dense_as_pages` / :func:`paged_as_pages` how a kernel reads only the
selected keys: the call becomes a paged call whose pages hold one key each, every query
row its own sequence, its page table the keys it sees (sorted, each once), with no
positional rule left; :func:`read_selected` may gather those keys into one page a row
first. Axis letters:
B rows, T queries, S keys, k selected entries, Tq a paged call's query tokens.
"""

import jax
import jax.numpy as jnp
import numpy as np

from .paged import returned_entries, safe_page_table
from .validate import as_array, expect_integer, expect_shape

REFUSED_WITH = ("mask", "bias", "q_segment_ids", "mask_fn", "score_fn", "tree_parents")


def check_key_indices(indices, shape: tuple, axes: str, limit: int):
    """``key_indices`` as an int32 array of ``shape`` (its last axis any size), or None;
    when concrete, each entry in [-1, ``limit``)."""
    if indices is None:
        return None
    indices = as_array("key_indices", indices, f"an int array ({axes})")
    expect_integer("key_indices", indices.dtype)
    expect_shape("key_indices", indices.shape, axes, (*shape, None))
    indices = indices.astype(jnp.int32)
    if not isinstance(indices, jax.core.Tracer):
        values = np.asarray(indices)
        bad = np.argwhere((values < -1) | (values >= limit))
        if bad.size:
            where = ", ".join(str(int(i)) for i in bad[0])
            raise ValueError(
                f"key_indices[{where}]={int(values[tuple(bad[0])])}: a selected key is a "
                f"position in [0, {limit}), or -1 for an unused entry"
            )
    return indices


def refuse_combined(given: dict) -> None:
    """Raises ValueError when ``key_indices`` comes with a rule that is not a band."""
    if given.get("key_indices") is None:
        return
    others = [name for name in REFUSED_WITH if given.get(name) is not None]
    if others:
        raise ValueError(
            f"key_indices cannot be combined with {others[0]}: a selection goes with "
            "causality, a window, key lengths, sinks, soft-cap and scale only"
        )


def out_of_range(indices, limit: int):
    """bool (..., T): the queries whose selection holds an index outside [-1, limit)
    (traced: their rows are NaN)."""
    return ((indices < -1) | (indices >= limit)).any(axis=-1)


def selected(indices, S: int):
    """bool (..., T, S): whether each query selected each key (the reference's mask)."""
    keys = jnp.arange(S, dtype=jnp.int32).reshape((1,) * indices.ndim + (S,))
    return (indices[..., None] == keys).any(axis=-2)


def seen_keys(indices, positions, lengths, band):
    """The keys each of R query rows sees, sorted, each once: (keys (R, k) int32, the
    first ``count`` of a row its keys' positions, the rest 0; count (R,) int32). The
    rows' selections ``indices`` (R, k), their ``positions`` (R,), the keys held up to
    ``lengths`` (R,), the ``band`` (left, right) (either None: unbounded) or None."""
    R = indices.shape[0]
    big = jnp.iinfo(jnp.int32).max
    seen = (indices >= 0) & (indices < lengths[:, None])
    if band is not None:
        left, right = band
        if right is not None:
            seen &= indices <= positions[:, None] + right
        if left is not None:
            seen &= indices >= positions[:, None] - left
    ordered = jnp.sort(jnp.where(seen, indices, big), axis=-1)
    first = jnp.concatenate([jnp.ones((R, 1), bool), ordered[:, 1:] != ordered[:, :-1]], axis=1)
    ordered = jnp.sort(jnp.where(first, ordered, big), axis=-1)  # each once, seen first
    count = (ordered != big).sum(axis=-1).astype(jnp.int32)
    return jnp.where(ordered != big, ordered, 0).astype(jnp.int32), count


def dense_as_pages(query, key, value, rules):
    """A dense call with ``key_indices`` as the paged call that reads only the selected
    keys: (query (R, N, H), key pages (B * S, 1, K, H), value pages (B * S, 1, K, Hv),
    the paged call's rules, ``restore``), R = B * T, each query row its own sequence
    whose pages are its seen keys (:func:`seen_keys`), no positional rule left;
    ``restore`` takes the paged result (out (R, N, Hv), lse (R, N)) back to (B, T, N,
    Hv) and (B, T, N) (the out alone unless ``rules.return_residual``)."""
    B, T, S = rules.B, rules.T, rules.S
    offset = jnp.asarray(0 if rules.q_offset is None else rules.q_offset, jnp.int32)
    positions = jnp.broadcast_to(offset, (B,))[:, None] + jnp.arange(T, dtype=jnp.int32)[None]
    lengths = jnp.full((B,), S, jnp.int32) if rules.kv_lengths is None else rules.kv_lengths
    lengths = jnp.repeat(lengths.astype(jnp.int32), T)
    keys, count = seen_keys(rules.key_indices.reshape(B * T, -1), positions.reshape(-1),
                            lengths, rules.band)  # fmt: skip
    table = keys + jnp.repeat(jnp.arange(B, dtype=jnp.int32) * S, T)[:, None]
    paged = _one_key_pages(rules, table, count, B * S)
    pages = (x.reshape(B * S, 1, rules.K, x.shape[-1]) for x in (key, value))

    def restore(result):
        out, lse = result
        out = out.reshape(B, T, rules.N, -1)
        return (out, lse.reshape(B, T, rules.N)) if rules.return_residual else out

    return (query.reshape(B * T, rules.N, rules.H), *pages, paged, restore)


def paged_as_pages(query, key_pages, value_pages, rules):
    """:func:`dense_as_pages` for a paged call with ``key_indices`` (Tq, k): its pool
    seen as pages of one key (P * page_size of them), each query token its own
    sequence. A token that sees a key of a page its sequence gave back (``RETURNED``)
    gets a NaN query: its row is NaN, as the reference's."""
    ps, layout = rules.page_size, rules.layout()
    lengths = jnp.where(layout.real, rules.kv_lengths[layout.sequence], 0).astype(jnp.int32)
    keys, count = seen_keys(rules.key_indices, layout.position, lengths, rules.band)
    safe = safe_page_table(rules.page_table, rules.kv_lengths, ps, rules.pool_pages)
    rows, entries = layout.sequence[:, None], keys // ps
    table = safe[rows, entries] * ps + keys % ps
    used = jnp.arange(keys.shape[1])[None] < count[:, None]
    gone = returned_entries(rules.page_table, rules.kv_lengths, ps)[rows, entries] & used
    query = jnp.where(gone.any(axis=1)[:, None, None], jnp.nan, query)
    P = rules.pool_pages * ps
    paged = _one_key_pages(rules, table, count, P)
    pages = (x.reshape(P, 1, rules.K, x.shape[-1]) for x in (key_pages, value_pages))

    def restore(result):
        return result if rules.return_residual else result[0]

    return (query, *pages, paged, restore)


def _one_key_pages(rules, table, count, pool_keys: int):
    """The rules of R query rows, each its own sequence of one query over the ``count``
    (R,) keys its ``table`` (R, k) row lists, pages of one key from a pool of
    ``pool_keys``: the other rules as they were, no positional rule, the log-sum-exp
    returned."""
    R, k = table.shape
    scales = {}
    if rules.key_scales is not None:  # (B, S, K) or (P, page_size, K): one key a page
        scales = {name: getattr(rules, name).reshape(pool_keys, 1, rules.K)
                  for name in ("key_scales", "value_scales")}  # fmt: skip
    return rules.replace(
        B=R, T=R, S=k, page_table=table.astype(jnp.int32), kv_lengths=count,
        query_starts=jnp.arange(R + 1, dtype=jnp.int32), page_size=1, pool_pages=pool_keys,
        is_causal=False, window=None, q_offset=None, key_indices=None, return_residual=True,
        **scales,
    )  # fmt: skip


# A selection whose keys and values, gathered, take at most this many bytes may be read
# as one page of gathered keys per query row (a decode step's); a larger one (a long
# prefill's) is read as pages of one key in place.
GATHER_BYTES = 64 * 2**20


def gathers(query, key_pages, value_pages, R: int, k: int) -> bool:
    """Whether :func:`read_selected` gathers the selection of R query rows (R, N, H) of
    k keys each from pools of one key (P, 1, K, H) and (P, 1, K, Hv)."""
    K, H, Hv = key_pages.shape[2], key_pages.shape[3], value_pages.shape[3]
    G = query.shape[-2] // K
    row_bytes = k * K * (H * key_pages.dtype.itemsize + Hv * value_pages.dtype.itemsize)
    return G * Hv > K * (H + Hv) and R * row_bytes <= GATHER_BYTES


def read_selected(paged, convert, query, key, value, rules):
    """A call with ``key_indices`` by a kernel's paged pass ``paged(query, key_pages,
    value_pages, rules) -> (out, lse)``, through ``convert`` (:func:`dense_as_pages` or
    :func:`paged_as_pages`): only the selected keys are read, through the pool's
    pages of one key, or gathered first (each query row's into one page of k keys)
    when that is cheaper and the R rows' keys and values fit in :data:`GATHER_BYTES`.
    A pass over pages of one key rescales a row's accumulator (G query heads x Hv) at
    every key; a gather copies K (H + Hv) numbers a key: the gather is taken when it
    copies less than the rescales touch (DeepSeek-V3.2's MQA, G = 128 and Hv = 576 on
    K = 1: 29 ms over pages of one key, 5 gathered; a GQA decode of G = 4 stays in
    place)."""
    query, key_pages, value_pages, paged_rules, restore = convert(query, key, value, rules)
    R, k = paged_rules.page_table.shape
    if not gathers(query, key_pages, value_pages, R, k):
        return restore(paged(query, key_pages, value_pages, paged_rules))
    ids = paged_rules.page_table  # (R, k): each row's seen keys, then key 0 (past count)
    gathered = {}
    if paged_rules.key_scales is not None:  # (pool keys, 1, K) -> (R, k, K)
        gathered = {name: getattr(paged_rules, name)[ids, 0]
                    for name in ("key_scales", "value_scales")}  # fmt: skip
    one_page = paged_rules.replace(
        page_table=jnp.arange(R, dtype=jnp.int32)[:, None], page_size=k, pool_pages=R,
        **gathered,
    )  # fmt: skip
    return restore(paged(query, key_pages[ids, 0], value_pages[ids, 0], one_page))
