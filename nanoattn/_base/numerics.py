"""The numerics every kernel shares: the finite stand-in for -inf, the softmax dtype,
the masked softmax with its log-sum-exp, the logit soft-cap, and the zeroing of keys no
query sees (docs/conventions.md)."""

import jax
import jax.numpy as jnp

from .quantized import storage_name
from .validate import float_dtype


def large_negative(dtype) -> float:
    """The finite value that stands in for -inf at blocked logits.

    It stays finite on purpose: with -inf, a row whose every key is blocked
    would compute ``-inf - (-inf) = NaN`` in the softmax and in its gradient.
    0.7 of the largest float leaves headroom, so subtracting a row maximum or
    adding a bias cannot overflow it into -inf either.
    """
    return -0.7 * float(jnp.finfo(float_dtype("dtype", dtype)).max)


def softmax_dtype(*dtypes):
    """The softmax dtype: at least float32 (bfloat16/float16 upcast, float64 kept).

    A rule of nanoattn's, not a promotion of the caller's arrays: it holds under
    ``jax_numpy_dtype_promotion='strict'`` too, where bfloat16 and float32 have no
    implicit common type."""
    # quantized keys and values (int8, float8) are read in float32 at least
    dtypes = [jnp.float32 if storage_name(d) else d for d in dtypes]
    with jax.numpy_dtype_promotion("standard"):
        return jnp.result_type(*dtypes, jnp.float32)


def masked_softmax(logits, allowed, return_lse: bool = False, sinks=None):
    """Softmax over the last axis that gives exactly 0 at blocked cells, and with
    ``return_lse`` the log of each row's denominator, ``-inf`` for a row with no
    allowed cell (docs/conventions.md), whose gradient is the softmax itself.

    With ``sinks`` (broadcastable to the logits without their last axis: one logit
    per head) every row's denominator gains ``exp(sink)``, a cell that is always
    allowed and attends no value; a row with no allowed cell still gives zeros, and
    its log-sum-exp is the sink's.

    A row with no allowed cell gives all zeros, with zero, finite gradients.
    The exponent is shifted twice: by the row maximum, then by the maximum of
    the shifted values themselves. Under ``jit`` XLA may compute the row
    maximum from a differently rounded copy of the logits (for example with a
    fused multiply-add), and with logits near 1e10 that copy can be off by
    thousands, so every ``exp`` would underflow (a row sum of 0, then NaN).
    The second maximum is taken of the very values that are exponentiated,
    so the largest exponent is 0 and the row sum is at least 1.
    """
    neg = large_negative(logits.dtype)
    if allowed is not None:
        logits = jnp.where(allowed, logits, neg)
    takes_all = None
    if sinks is not None:
        # A sink of +inf takes every weight: the row's probabilities are 0 and its
        # log-sum-exp +inf. It is computed with a finite sink, then replaced, so that no
        # inf - inf (NaN) reaches the row or its gradient.
        takes_all = sinks.astype(logits.dtype) == jnp.inf
        sinks = jnp.where(takes_all, 0, sinks)
    # The softmax is invariant to the subtracted maxima, so no gradient flows through them.
    top = jax.lax.stop_gradient(jnp.max(logits, axis=-1, keepdims=True, initial=neg))
    if sinks is not None:
        sinks = sinks.astype(logits.dtype)[..., None]
        top = jnp.maximum(top, jax.lax.stop_gradient(sinks))
    shifted = logits - top
    peak = jax.lax.stop_gradient(jnp.max(shifted, axis=-1, keepdims=True, initial=neg))
    if sinks is not None:
        peak = jnp.maximum(peak, jax.lax.stop_gradient(sinks - top))
    shifted = shifted - peak
    unnormalized = jnp.exp(shifted)
    if allowed is not None:
        unnormalized = jnp.where(allowed, unnormalized, 0)
    total = jnp.sum(unnormalized, axis=-1, keepdims=True)
    if sinks is not None:
        total = total + jnp.exp(sinks - top - peak)
    probs = unnormalized / jnp.where(total == 0, 1, total)
    if takes_all is not None:
        probs = jnp.where(takes_all[..., None], 0, probs)
    if not return_lse:
        return probs
    # log sum exp(logits) = top + peak + log(total): the maxima carry no gradient,
    # log(total) carries the softmax's.
    empty = total == 0  # NaN content makes a NaN total: that row is not empty
    lse = jnp.where(empty, -jnp.inf, top + peak + jnp.log(jnp.where(empty, 1, total)))
    if takes_all is not None:
        lse = jnp.where(takes_all[..., None], jnp.inf, lse)
    return probs, lse[..., 0]


def soft_cap(logits, cap, allowed=None):
    """``cap * tanh(logits / cap)``; blocked cells are set to 0 first, so that a NaN
    or inf there cannot reach the gradient through ``tanh``."""
    if cap is None:
        return logits
    if allowed is not None:
        logits = jnp.where(allowed, logits, 0)
    return cap * jnp.tanh(logits / cap)


def zero_unseen_keys(x, allowed, query_axes):
    """Keys or values ``x`` with those that no query may see zeroed.

    A blocked weight of exactly 0 does not protect the output from a NaN or inf there
    (``0 * NaN = NaN`` in the sum over values and in the gradients), and a block may
    hold keys that are not the call's (a paged sequence's stale pages).

    Args:
      x: keys or values, their width H last.
      allowed: which query may see which key, bool; once reduced over ``query_axes``,
        its axes are ``x``'s leading ones (each the same size or 1). None: every key is
        seen, and ``x`` is returned as it is.
      query_axes: the axes of ``allowed`` that tell the queries apart.

    Example: keys (B, S, K, H) under a mask (B, N, T, S) are
    ``zero_unseen_keys(keys, mask, (1, 2))``.
    """
    if allowed is None:
        return x
    sees = allowed.any(axis=query_axes)
    sees = sees.reshape(sees.shape + (1,) * (x.ndim - sees.ndim))
    return jnp.where(sees, x, jnp.zeros((), x.dtype))
