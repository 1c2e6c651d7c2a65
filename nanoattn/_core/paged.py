"""``paged_attention``: attention of many sequences at once over a pool of key/value
pages, each sequence a mix of any number of new queries (a prefill chunk, one decode
token, a speculative chunk), in one call (docs/decoding.md, "Paged caches")."""

import jax.numpy as jnp

from .._base.rule_table import PAGED_KEYWORDS
from .._base.rules import Rules
from .._base.validate import check_scale
from .api import attend
from .cascade import cascade_attention, check_shared_prefixes


def paged_attention(
    query,
    key_pages,
    value_pages,
    page_table,
    kv_lengths,
    query_starts,
    *,
    scale=None,
    is_causal: bool = True,
    window=None,
    logit_soft_cap: float | None = None,
    sinks=None,
    mask_fn=None,
    score_fn=None,
    return_residual: bool = False,
    key_scales=None,
    value_scales=None,
    tree_parents=None,
    key_indices=None,
    shared_prefixes=None,
    implementation=None,
):
    r"""Attention of B sequences over a paged KV cache, their queries token-major.

    .. math::

       \mathrm{out}_{tnh} = \sum_{j \in \mathrm{allowed}(t)}
         \mathrm{softmax}_j(\mathrm{scale}\; q_{tn} \cdot k^{(b)}_{j, n/G})\, v^{(b)}_{j, n/G}

    where row t belongs to sequence b (``query_starts[b] <= t < query_starts[b+1]``),
    and sequence b's key j sits in slot ``j % page_size`` of page
    ``page_table[b, j // page_size]``. Sequence b holds ``kv_lengths[b]`` keys, this
    call's included: its ``q_len = query_starts[b+1] - query_starts[b]`` queries are its
    last positions ``kv_lengths[b] - q_len + i``, and causality, windows, the soft-cap,
    sinks, ``mask_fn`` and ``score_fn`` mean exactly what they mean in
    :func:`nanoattn.dot_product_attention` at those positions (``mask_fn(b, n, q_pos,
    k_pos)`` sees the sequence b, the head, the query's position and the key's
    position, never a page or a slot). One call takes any mix: a 512-token prefill
    chunk of one sequence, one decode token of seven others, a speculative chunk of
    another. Axis letters: Tq query tokens of all sequences, B sequences, P pages,
    M pages per sequence at most, N query heads, K key/value heads (dividing N), H
    head width.

    Args:
      query: (Tq, N, H); rows past ``query_starts[B]`` are padding (static shapes
        under ``jit``): their outputs are zeros.
      key_pages, value_pages: (P, page_size, K, H), the pool; or ``key_pages`` one
        combined pool (P, page_size, 2, K, H), each token's keys then its values, and
        ``value_pages`` None: the layout ``"native"`` reads fastest (a token's keys and
        values one run of memory; bfloat16 decode 1.3x faster, docs/performance.md),
        read in place there; the other backends read its two halves.
      page_table: int (B, M): sequence b's j-th page. Entries past the
        ``ceil(kv_lengths[b] / page_size)`` a sequence holds are never read,
        whatever they hold. An entry -1 among them is a page the sequence gave
        back (a windowed layer's, docs/decoding.md): no page is read for it, and
        its keys and values read as NaN, so a query that sees one of its
        positions is NaN and a query that sees none is exactly as if the
        sequence held the page (docs/conventions.md, "Paged attention").
      kv_lengths: int (B,): the keys sequence b holds, this call's included.
      query_starts: int (B + 1,), non-decreasing from 0 (FlashAttention's
        ``cu_seqlens_q``).
      scale: factor on ``q . k``; default ``1 / sqrt(H)``.
      is_causal: a query at position p sees keys at positions <= p (default True:
        decoding); False lets every query see every key its sequence holds.
      window, logit_soft_cap, sinks, mask_fn, score_fn, return_residual: as in
        :func:`nanoattn.dot_product_attention`.
      key_scales, value_scales: float (P, page_size, K), the scales of quantized
        pages (int8 or float8_e4m3fn; :func:`nanoattn.quantize_kv`), both or neither;
        served by ``"xla"``, ``"flash"`` (dequantized per page block) and
        ``"native"`` (widened in registers).
      tree_parents: optional int (Tq,): a token tree per sequence (speculative
        decoding): each row's parent as an index within its own sequence's rows (-1:
        the sequence's last committed token). Row i of sequence b sits at position
        ``kv_lengths[b] - q_len + depth(i)`` (its key in its slot); inside its chunk it
        sees exactly its ancestors and itself (docs/conventions.md, "Token trees").
        Served by every backend.
      key_indices: optional int (Tq, k): sparse attention over chosen keys: the
        positions in its own sequence (below ``M * page_size``) that each query token
        may read, -1 for an unused entry; a selected key is seen where causality, the
        window and ``kv_lengths`` let it be, an index selected twice counts once
        (docs/conventions.md, "Selected keys"). ``"flash"`` and ``"native"`` read only
        the selected keys. An index outside [-1, M * page_size) raises ValueError when
        concrete; under ``jit`` that row is NaN. Not with ``mask_fn``, ``score_fn`` or
        ``tree_parents``; with ``shared_prefixes``, the plain call.
      shared_prefixes: optional int (B,): sequence b's first ``shared_prefixes[b]``
        page-table entries are pages it shares with other sequences of the call
        (forks, prefix-cache hits; ``PagedBatch.shared_prefixes``). The sequences that
        give the same count m > 0 and the same page at entry m - 1 form a group: they
        must hold the same first m pages, wholly before their first query
        (``m * page_size <= kv_lengths[b] - q_len``). Each group's pages are then read
        once for all of its queries (one pass, no causality needed: every shared key
        lies before them), the rest of each sequence's pages by itself, and the two
        merged exactly by their log-sum-exps, the sinks added once: the results are
        the call's without it, up to rounding. Served by every backend that serves the
        call; ignored (the plain call) with ``mask_fn`` or ``score_fn``, or a window
        whose left side is shorter than ``M * page_size - 1`` (docs/decoding.md,
        "Shared prefixes").
      implementation: ``"xla"`` (gathers each sequence's pages once: the reference),
        ``"flash"`` (blockwise over the pages each sequence holds), ``"native"``
        (the C++ CPU kernel, reading the pool through the page table), or None for
        the fastest that can serve the call.

    Returns:
      (Tq, N, H) in the query's dtype; with ``return_residual`` also the
      log-sum-exp (Tq, N), ``-inf`` for a row that sees no key (padding rows).

    Raises:
      ValueError: a shape problem; and, when concrete, a page id outside [0, P)
        and other than -1 among the pages a sequence holds, ``kv_lengths[b]``
        above ``M * page_size`` or below sequence b's q_len, or ``query_starts``
        that do not start at 0, decrease or pass Tq, naming the argument and the
        row; a ``shared_prefixes`` entry outside [0, M], reaching past the first
        query, or whose pages are not its group's, naming ``shared_prefixes[b]``.
        Under ``jit``, where
        they cannot be checked, a bad page id or length makes the rows of its
        sequence NaN and no other row changes, and query starts that are no layout
        make every row NaN (a bad ``shared_prefixes`` entry: its sequence's rows);
        no page outside the pool is ever read.

    Example:
      >>> import jax.numpy as jnp, nanoattn
      >>> pages = jnp.ones((6, 4, 2, 8))  # (P, page_size, K, H)
      >>> table = jnp.array([[3, 1], [5, 0]])  # sequence 0: pages 3, 1; sequence 1: 5, 0
      >>> q = jnp.ones((4, 2, 8))  # a chunk of 3 queries of sequence 0, one of sequence 1
      >>> out = nanoattn.paged_attention(q, pages, pages, table, jnp.array([7, 5]),
      ...                                jnp.array([0, 3, 4]))
      >>> out.shape
      (4, 2, 8)
    """
    given = locals()
    rules = {name: given[name] for name in PAGED_KEYWORDS} | dict(scale=check_scale(scale))
    rules = Rules.make_paged(
        query, key_pages, value_pages, page_table, kv_lengths, query_starts, **rules
    )
    query, key_pages = jnp.asarray(query), jnp.asarray(key_pages)
    value_pages = None if value_pages is None else jnp.asarray(value_pages)  # None: combined
    if shared_prefixes is not None:
        shared = check_shared_prefixes(shared_prefixes, rules)
        return cascade_attention(query, key_pages, value_pages, rules, shared, implementation)
    return attend(query, key_pages, value_pages, rules, implementation=implementation)
