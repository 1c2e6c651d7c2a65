"""The reference ("xla") attention: plain einsums over the full score tensor.

It defines the output contract that every other backend is tested against.
"""

import jax
import jax.numpy as jnp

from ..._base.mask_fn import evaluate_mask, evaluate_score, grid
from ..._base.masks import band_mask, combine_masks, lengths_to_valid, segment_mask
from ..._base.numerics import masked_softmax, soft_cap, softmax_dtype, zero_unseen_keys
from ..._base.paged import returned_entries, safe_page_table
from ..._base.rules import Rules
from ..._base.selection import selected
from ..._base.trace import record


def allowed_mask(rules: Rules):
    """ANDs the call's dense mask, positional band (causality, window), key lengths,
    segments, ``mask_fn`` and the selected keys on every cell: bool, rank 4, or None."""
    band = lengths = segments = by_fn = chosen = None
    if rules.band is not None:
        # (T, S) or (B, T, S)
        band = band_mask(rules.T, rules.S, *rules.band, q_offset=rules.q_offset)
        band = band[None, None] if band.ndim == 2 else band[:, None]
    if rules.kv_lengths is not None:
        lengths = lengths_to_valid(rules.kv_lengths, rules.S)[:, None, None, :]  # (B, 1, 1, S)
    if rules.q_segment_ids is not None:
        segments = segment_mask(rules.q_segment_ids, rules.kv_segment_ids)  # (B, 1, T, S)
    if rules.mask_fn is not None:
        cells = grid(rules.B, rules.N, rules.T, rules.S, rules.index_offset)
        by_fn = evaluate_mask(rules.mask_fn, *cells)  # (B|1, N|1, T|1, S|1)
    if rules.key_indices is not None:
        chosen = selected(rules.key_indices, rules.S)[:, None]  # (B, 1, T, S)
    return combine_masks(rules.mask, band, lengths, segments, by_fn, chosen)


def weights(query, key, rules: Rules):
    """Normalised attention weights (B, N, T, S) in the compute dtype."""
    return _weights(query, key, rules, allowed_mask(rules))[0]


def _weights(query, key, rules: Rules, allowed):
    """The weights (B, N, T, S) and the log-sum-exp (B, N, T), in the compute dtype."""
    acc = softmax_dtype(query.dtype, key.dtype)
    if allowed is not None:
        # A query that sees no key is never read, so NaN there cannot reach a gradient.
        sees = jnp.moveaxis(allowed.any(-1), 1, 2)[..., None]  # (B|1, T, N|1, 1)
        query = jnp.where(sees, query, jnp.zeros((), query.dtype))
        key = zero_unseen_keys(key, allowed, (1, 2))  # allowed (B|1, N|1, T|1, S)
    q = query.reshape(rules.B, rules.T, rules.K, rules.G, rules.H)  # (B, T, K, G, H)
    logits = jnp.einsum("BTKGH,BSKH->BKGTS", q, key, preferred_element_type=acc)
    logits = logits.reshape(rules.score_shape) * jnp.asarray(rules.scale, acc)  # (B, N, T, S)
    if rules.bias is not None:
        logits = logits + rules.bias.astype(acc)
    if rules.score_fn is not None:
        if allowed is not None:  # a blocked cell's score is never looked at
            logits = jnp.where(allowed, logits, 0)
        cells = grid(rules.B, rules.N, rules.T, rules.S, rules.index_offset)
        logits = evaluate_score(rules.score_fn, logits, *cells)
    logits = soft_cap(logits, rules.logit_soft_cap, allowed)
    record(logits, "scores", "B N T S", op="einsum")
    sinks = None if rules.sinks is None else rules.sinks.astype(acc)[None, :, None]  # (1, N, 1)
    probs, lse = masked_softmax(logits, allowed, return_lse=True, sinks=sinks)
    record(probs, "weights", "B N T S", op="softmax")
    return probs, lse


def dropout(probs, rate: float, rng):
    """Inverted dropout on the weights: kept cells are scaled by 1 / (1 - rate)."""
    keep = jax.random.bernoulli(rng, 1.0 - rate, probs.shape)
    return jnp.where(keep, probs / (1.0 - rate), 0)


def attend(
    query,
    key,
    value,
    rules: Rules,
    *,
    dropout_rate,
    dropout_rng,
    dropout_fn=None,
    weights_dtype=None,
    out_dtype=None,
    return_weights: bool = False,
    return_residual: bool = False,
):
    r"""Attention output (B, T, N, Hv) in the query's dtype.

    .. math::

       \mathrm{out}_{btnh} = \sum_s \tilde P_{bnts} \, V_{bskh}, \qquad
       P_{bnt\cdot} = \mathrm{softmax}_{s \in \mathrm{allowed}}
         \Big(\mathrm{scale} \sum_h Q_{btnh} K_{bskh} + \mathrm{bias}_{bnts}\Big)

    where key/value head ``k = n // G`` serves query head ``n``, the logits are
    soft-capped when ``rules`` says so, and ``P~`` is ``P`` after dropout (``P``
    without). The softmax runs in :func:`~nanoattn._base.numerics.softmax_dtype`.

    Args:
      query: (B, T, N, H); key (B, S, K, H); value (B, S, K, Hv); ``rules`` their
        :class:`Rules`.
      dropout_rate, dropout_rng: :func:`dropout` on the weights when the rate is
        above 0 and ``dropout_fn`` is None.
      dropout_fn: a function of the weights (B, N, T, S) giving the dropped
        weights, used instead of :func:`dropout` (flax's random bits).
      weights_dtype: the weights are cast to it before dropout (None: the
        compute dtype).
      out_dtype: the output's dtype (None: the query's).
      return_weights: also return the weights (B, N, T, S), before dropout.
      return_residual: also return the log-sum-exp (B, T, N) of each row's logits,
        in the compute dtype; ``-inf`` for a row that sees no key.

    Returns:
      the output (B, T, N, Hv), followed by the weights (``return_weights``) and
      the log-sum-exp (``return_residual``) when asked for.
    """
    allowed = allowed_mask(rules)
    weights, lse = _weights(query, key, rules, allowed)
    if weights_dtype is not None:
        weights = weights.astype(weights_dtype)
    value = zero_unseen_keys(value, allowed, (1, 2))
    probs = weights
    if dropout_fn is not None:
        probs = dropout_fn(probs)
    elif dropout_rate > 0:
        probs = dropout(probs, dropout_rate, dropout_rng)
    acc = softmax_dtype(probs.dtype, value.dtype)
    p = probs.reshape(rules.B, rules.K, rules.G, rules.T, rules.S)  # (B, K, G, T, S)
    out = jnp.einsum("BKGTS,BSKH->BTKGH", p, value, preferred_element_type=acc)
    out = out.reshape(rules.B, rules.T, rules.N, rules.Hv)  # (B, T, N, Hv)
    record(out, "per-head output", "B T N H", op="einsum")  # H: the values' width here
    out = out.astype(query.dtype if out_dtype is None else out_dtype)
    extras = [weights] if return_weights else []
    if return_residual:
        extras.append(jnp.moveaxis(lse, 1, 2))  # (B, T, N)
    return (out, *extras) if extras else out


# The reference's paged call works through its query rows in chunks whose gathered keys
# and values take at most about this many bytes.
PAGED_CHUNK_BYTES = 64 * 2**20


def paged_attend(query, key_pages, value_pages, rules: Rules, *, return_residual: bool = False):
    """A paged call (``nanoattn.paged_attention``) by the reference: each sequence's
    pages are gathered once into keys and values (B, S, K, H), then the query rows, a
    chunk at a time, attend as batch rows of one query at their positions over their
    sequences' keys, so every rule means what it means in :func:`attend` (``mask_fn`` and
    ``score_fn`` see the row's sequence as ``b``). A page the sequence gave back (an
    entry ``RETURNED``) gathers as NaN keys and values: a row that sees one of its
    positions is NaN, and a row that does not never reads them. Memory: the gathered
    sequences and one chunk's rows (:data:`PAGED_CHUNK_BYTES`), never a copy of a
    sequence's keys per query row.

    Args:
      query: (T, N, H), token-major; key_pages (P, page_size, K, H), value_pages
        (P, page_size, K, Hv);
        ``rules`` from :meth:`Rules.make_paged`.

    Returns:
      (T, N, Hv) in the query's dtype (zeros for padding rows), and with
      ``return_residual`` the log-sum-exp (T, N).
    """
    B, T, S = rules.B, rules.T, rules.S
    layout = rules.layout()
    table = safe_page_table(rules.page_table, rules.kv_lengths, rules.page_size, rules.pool_pages)
    keys = key_pages[table].reshape(B, S, rules.K, rules.H)  # each sequence's, once
    values = value_pages[table].reshape(B, S, rules.K, rules.Hv)
    returned = returned_entries(rules.page_table, rules.kv_lengths, rules.page_size)
    returned = jnp.repeat(returned, rules.page_size, axis=1)[..., None, None]  # (B, S, 1, 1)
    keys, values = (jnp.where(returned, jnp.nan, x) for x in (keys, values))
    lengths = jnp.where(layout.real, rules.kv_lengths[layout.sequence], 0)  # padding: no key
    row_bytes = S * rules.K * (rules.H + rules.Hv) * keys.dtype.itemsize
    C = max(1, min(T, PAGED_CHUNK_BYTES // max(row_bytes, 1)))  # rows a chunk
    n_chunks = -(-T // C)
    pad = n_chunks * C - T

    def padded(x, fill):
        return jnp.pad(x, [(0, pad)] + [(0, 0)] * (x.ndim - 1), constant_values=fill)

    rows = dict(
        query=padded(query, 0), sequence=padded(layout.sequence, 0),
        position=padded(layout.position, 0), lengths=padded(lengths, 0),
    )  # fmt: skip
    if rules.key_indices is not None:  # each row's selection, as a batch row's
        rows["selection"] = padded(rules.key_indices, -1)
    chunks = {name: x.reshape(n_chunks, C, *x.shape[1:]) for name, x in rows.items()}

    def chunk(part):
        sequence = part["sequence"]
        row_rules = _row_rules(rules, C, sequence, part["position"], part["lengths"])
        if "selection" in part:
            row_rules = row_rules.replace(key_indices=part["selection"][:, None])
        return attend(
            part["query"][:, None], keys[sequence], values[sequence], row_rules,
            dropout_rate=0.0, dropout_rng=None, return_residual=return_residual,
        )  # fmt: skip

    result = jax.lax.map(chunk, chunks)  # (n_chunks, C, 1, ...)
    result = jax.tree.map(lambda x: x.reshape(n_chunks * C, *x.shape[3:])[:T], result)
    return result


def _row_rules(rules: Rules, C: int, sequence, position, lengths) -> Rules:
    """The rules of C query rows as batch rows of one query each, at ``position`` over
    the keys of their sequences ``sequence`` (held up to ``lengths``): ``mask_fn`` and
    ``score_fn`` see each row's sequence as its ``b``."""
    mask_fn = score_fn = None
    if rules.mask_fn is not None:

        def mask_fn(b, n, q, k):
            return rules.mask_fn(sequence[b], n, q, k)

    if rules.score_fn is not None:

        def score_fn(s, b, n, q, k):
            return rules.score_fn(s, sequence[b], n, q, k)

    return rules.replace(
        B=C, T=1, page_table=None, query_starts=None, page_size=None, pool_pages=None,
        q_offset=position, kv_lengths=lengths, mask_fn=mask_fn, score_fn=score_fn,
    )  # fmt: skip
