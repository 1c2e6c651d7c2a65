"""The reference ("xla") attention: plain einsums over the full score tensor.

It defines the output contract that every other backend is tested against.
"""

import jax
import jax.numpy as jnp

from ._masks import causal_mask, combine_masks, lengths_to_valid
from ._spec import AttentionSpec
from ._trace import record


def large_negative(dtype) -> float:
    """The finite value that stands in for -inf at blocked logits.

    It stays finite on purpose: with -inf, a row whose every key is blocked
    would compute ``-inf - (-inf) = NaN`` in the softmax and in its gradient.
    0.7 of the largest float leaves headroom, so subtracting a row maximum or
    adding a bias cannot overflow it into -inf either.
    """
    return -0.7 * float(jnp.finfo(dtype).max)


def compute_dtype(*dtypes):
    """The softmax dtype: at least float32 (bfloat16/float16 upcast, float64 kept)."""
    return jnp.result_type(*dtypes, jnp.float32)


def allowed_mask(spec: AttentionSpec):
    """ANDs the spec's mask, causal triangle and key lengths: bool, rank 4, or None."""
    causal = lengths = None
    if spec.is_causal:
        causal = causal_mask(spec.T, spec.S, q_offset=spec.q_offset)  # (T, S) or (B, T, S)
        causal = causal[None, None] if causal.ndim == 2 else causal[:, None]
    if spec.kv_lengths is not None:
        lengths = lengths_to_valid(spec.kv_lengths, spec.S)[:, None, None, :]  # (B, 1, 1, S)
    return combine_masks(spec.mask, causal, lengths)


def masked_softmax(logits, allowed):
    """Softmax over the last axis that gives exactly 0 at blocked cells.

    A row with no allowed cell gives all zeros, with zero, finite gradients.
    """
    if allowed is None:
        return jax.nn.softmax(logits, axis=-1)
    neg = large_negative(logits.dtype)
    logits = jnp.where(allowed, logits, neg)
    # The softmax is invariant to the subtracted maximum, so no gradient flows through it.
    row_max = jax.lax.stop_gradient(jnp.max(logits, axis=-1, keepdims=True, initial=neg))
    unnormalized = jnp.exp(logits - row_max) * allowed
    total = jnp.sum(unnormalized, axis=-1, keepdims=True)
    return unnormalized / jnp.where(total == 0, 1, total)


def weights(query, key, spec: AttentionSpec):
    """Normalised attention weights (B, N, T, S) in the compute dtype."""
    acc = compute_dtype(query.dtype, key.dtype)
    q = query.reshape(spec.B, spec.T, spec.K, spec.G, spec.H)  # (B, T, K, G, H)
    logits = jnp.einsum("BTKGH,BSKH->BKGTS", q, key, preferred_element_type=acc)
    logits = logits.reshape(spec.score_shape) * jnp.asarray(spec.scale, acc)  # (B, N, T, S)
    if spec.bias is not None:
        logits = logits + spec.bias.astype(acc)
    record(logits, "scores", "B N T S", op="einsum")
    probs = masked_softmax(logits, allowed_mask(spec))
    record(probs, "weights", "B N T S", op="softmax")
    return probs


def dropout(probs, rate: float, rng):
    """Inverted dropout on the weights: kept cells are scaled by 1 / (1 - rate)."""
    keep = jax.random.bernoulli(rng, 1.0 - rate, probs.shape)
    return jnp.where(keep, probs / (1.0 - rate), 0)


def attend(query, key, value, spec: AttentionSpec, *, dropout_rate=0.0, dropout_rng=None):
    """Attention output (B, T, N, H) in the query's dtype."""
    probs = weights(query, key, spec)
    if dropout_rate > 0:
        probs = dropout(probs, dropout_rate, dropout_rng)
    acc = compute_dtype(probs.dtype, value.dtype)
    p = probs.reshape(spec.B, spec.K, spec.G, spec.T, spec.S)  # (B, K, G, T, S)
    out = jnp.einsum("BKGTS,BSKH->BTKGH", p, value, preferred_element_type=acc)
    out = out.reshape(spec.B, spec.T, spec.N, spec.H)  # (B, T, N, H)
    record(out, "per-head output", "B T N H", op="einsum")
    return out.astype(query.dtype)
