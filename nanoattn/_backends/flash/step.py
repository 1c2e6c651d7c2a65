"""One block step of FlashAttention-2, shared by the blockwise kernel (``kernel.py``)
and the paged one (``paged.py``): they differ only in how they fetch a block of keys
(a slice of the keys, or pages read through a page table) and in how their blocks are
laid out, which a :class:`Layout` names.

A step takes a block of queries, pre-scaled, and a block of keys and values, whose
keys no query of the block sees are zeroed
(:func:`~nanoattn._base.numerics.zero_unseen_keys`), and which cells are visible
(``allowed``, broadcastable to the scores; None when every cell is). The forward
pass turns them into logits (:func:`scores`) and folds them into the running
maximum ``m``, sum ``l`` and output ``o`` of the block's rows (:func:`forward_step`),
finishing with :func:`finish` once every key block is in; the backward pass
recomputes the weights from the log-sum-exp and gives the block's gradients
(:func:`backward_step`).
"""

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp

from ..._base.numerics import large_negative


class Layout(NamedTuple):
    """The einsum strings of one kernel's blocks. Queries, their output and its
    cotangent share one layout (``q`` their rows, ``H`` their width), keys and values
    another (``k`` their rows), and the scores a third (ending in ``qk``).

    Attributes:
      scores: (queries, keys) -> scores.
      values: (weights, values) -> output rows.
      d_weights: (d_out, values) -> the weights' cotangent.
      d_queries: (d_scores, keys) -> the queries' cotangent.
      d_keys: (d_scores, queries) -> the keys' cotangent.
      d_values: (weights, d_out) -> the values' cotangent.
    """

    scores: str
    values: str
    d_weights: str
    d_queries: str
    d_keys: str
    d_values: str


class Scores(NamedTuple):
    """A block's logits and what their gradient needs.

    Attributes:
      logits: through ``score_fn`` and the soft-cap, blocked cells at
        :func:`~nanoattn._base.numerics.large_negative`.
      tanh: ``tanh(logits / cap)`` before the cap (0 at blocked cells), or None
        without a soft-cap.
      score_vjp: ``score_fn``'s VJP, mapping a cotangent of its output to those of its
        input and of its arrays, or None (without ``score_fn``, or without
        ``with_vjp``).
    """

    logits: jax.Array
    tanh: jax.Array | None
    score_vjp: Callable | None


class StepGrads(NamedTuple):
    """A block's gradients: of its queries, keys and values (in their layouts, before
    the queries' scale), of its logits before ``score_fn`` (what a bias gets), and of
    ``score_fn``'s arrays (a tuple, empty without ``score_fn``)."""

    query: jax.Array
    key: jax.Array
    value: jax.Array
    logits: jax.Array
    consts: tuple


def scores(layout: Layout, queries, keys, allowed=None, *, bias=None, score=None, consts=(),
           soft_cap=None, with_vjp=False) -> Scores:  # fmt: skip
    """The logits of a block from pre-scaled ``queries``: plus ``bias`` (in the scores'
    layout, or None), through ``score`` (``score_fn`` in the kernel's layout, a function
    of the logits and ``consts``, or None) and the soft-cap ``cap * tanh(s / cap)``
    (``soft_cap``, or None).

    With ``allowed``, blocked cells are set to 0 before ``score`` and before the
    soft-cap (their scores are never looked at, and a NaN there cannot reach a
    gradient through them) and to the large negative at the end."""
    s = jnp.einsum(layout.scores, queries, keys)
    if bias is not None:
        s = s + bias
    score_vjp = None
    if score is not None:
        if allowed is not None:  # a blocked cell's score is never looked at
            s = jnp.where(allowed, s, 0)
        if with_vjp:
            s, score_vjp = jax.vjp(score, s, tuple(consts))
        else:
            s = score(s, tuple(consts))
    tanh = None
    if soft_cap is not None:
        if allowed is not None:
            s = jnp.where(allowed, s, 0)
        tanh = jnp.tanh(s / soft_cap)
        s = soft_cap * tanh
    if allowed is not None:
        s = jnp.where(allowed, s, large_negative(s.dtype))
    return Scores(s, tanh, score_vjp)


def forward_step(layout: Layout, state, logits, values, allowed=None, value_weights=None):
    """One key block folded into the online softmax of its query rows.

    Args:
      state: ``(m, l, o)``: the rows' running maximum and sum of ``exp(logit - m)``
        (the scores' layout without ``k``) and the running weighted sum of values (the
        queries' layout), in the softmax's dtype; ``m`` starts at the large negative.
      logits: the block's, from :func:`scores`.
      values: the block's values, unseen ones zeroed.
      allowed: which cells are visible (None: all): blocked cells get weights of
        exactly 0, also in a row that sees nothing.
      value_weights: a function of the weights giving those the values are summed
        with (a paged pool's value scales folded in), or None.

    Returns:
      the new ``(m, l, o)``.
    """
    m_old, l_old, o_old = state
    neg = large_negative(m_old.dtype)
    # The block's own softmax, shifted twice: by its row maximum, then by the maximum
    # of the very values that are exponentiated (XLA may compute the first from a
    # differently rounded copy of s; see numerics.masked_softmax). Both maxima are at
    # least `neg`, so a row whose logits are all -inf (a bias or score_fn of -inf) gets
    # weights exp(-inf) = 0, never -inf - -inf: it counts as a row that sees nothing,
    # as in the reference.
    top = jnp.maximum(logits.max(-1), neg)
    shifted = logits - top[..., None]
    peak = jnp.maximum(shifted.max(-1), neg)
    p = jnp.exp(jnp.minimum(shifted - peak[..., None], 0))
    if allowed is not None:
        p = jnp.where(allowed, p, 0)
    m_block = top + peak
    m_new = jnp.maximum(m_old, m_block)
    rescale, weight = jnp.exp(m_old - m_new), jnp.exp(m_block - m_new)
    l_new = l_old * rescale + p.sum(-1) * weight
    pv = jnp.einsum(layout.values, p if value_weights is None else value_weights(p), values)
    o_new = o_old * rescale[..., None] + pv * weight[..., None]
    return m_new, l_new, o_new


def finish(m, l, seen):
    """The denominators and the log-sum-exps of rows whose online softmax is done:
    ``l`` where ``seen``, 1 elsewhere (so that an unseen row's output stays 0), and
    ``m + log l`` where ``seen``, 0 elsewhere (the caller marks those -inf once padding
    is cut off). A row that sees a key has ``l >= 1``; ``l == 0`` only for one that sees
    none. A NaN or inf among a row's visible content makes ``l`` NaN: such a row is
    seen, and its NaN carries on into the output and the log-sum-exp."""
    denominator = jnp.where(seen, l, 1)
    return denominator, jnp.where(seen, m + jnp.log(denominator), 0)


def backward_step(layout: Layout, block: Scores, lse, delta, queries, keys, values, d_out,
                  allowed=None) -> StepGrads:  # fmt: skip
    """A block's gradients, its weights recomputed from the rows' log-sum-exps ``lse``
    (0 for a row that sees nothing) and ``block`` (:func:`scores` with ``with_vjp``):
    dS = P (dP - delta) through the soft-cap and ``score_fn``, where ``delta`` is the
    row term ``rowsum(dO * O)`` (less the log-sum-exp's own cotangent); ``queries``
    pre-scaled, ``keys`` and ``values`` with unseen ones zeroed, ``d_out`` the output's
    cotangent (zero rows where nothing may be added)."""
    # p <= 1 exactly; the clamp keeps a differently rounded s from overflowing.
    p = jnp.exp(jnp.minimum(block.logits - lse[..., None], 0))
    if allowed is not None:
        p = jnp.where(allowed, p, 0)
    dp = jnp.einsum(layout.d_weights, d_out, values)
    ds = p * (dp - delta[..., None])
    if block.tanh is not None:
        ds = ds * (1 - block.tanh * block.tanh)  # through cap * tanh(s / cap)
    d_consts = ()
    if block.score_vjp is not None:  # through score_fn, to its input and its arrays
        ds, d_consts = block.score_vjp(ds)
    return StepGrads(
        query=jnp.einsum(layout.d_queries, ds, keys),
        key=jnp.einsum(layout.d_keys, ds, queries),
        value=jnp.einsum(layout.d_values, p, d_out),
        logits=ds,
        consts=d_consts,
    )
