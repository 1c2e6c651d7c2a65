"""The tests' independent float64 numpy reference, written without the library's code.

Attention and its hand-derived gradients (``np_attention``, ``np_attention_vjp``,
``sum_to_shape``), each row's log-sum-exp (``np_lse``), the literal positional rules
(``np_causal``, ``np_window``), packed sequences (``np_segments``), key lengths
(``np_lengths``), rotary embedding (``np_rope``), and seeded random inputs (``randn``).

Sizes in the tests are distinct primes where possible (B=2, T=5, S=7, N=6, K=2, H=8
and friends) so that a swapped axis changes a shape or a value and fails.
"""

import numpy as np


def _np_weights(q, k, allowed, bias, scale, soft_cap, sinks=None):
    """Float64 logits (before the cap) and weights (B, N, T, S), and k repeated per head.
    With ``sinks`` (N,), each row's denominator also holds ``exp(sinks[n])``."""
    B, T, N, H = q.shape
    S, K = k.shape[1], k.shape[2]
    k = np.repeat(k, N // K, axis=2)  # (B, S, N, H): heads n*G .. n*G+G-1 share one
    scale = 1 / np.sqrt(H) if scale is None else scale
    logits = np.einsum("btnh,bsnh->bnts", q, k) * scale
    if bias is not None:
        logits = logits + np.asarray(bias, np.float64)
    capped = logits if soft_cap is None else soft_cap * np.tanh(logits / soft_cap)
    allowed = np.ones((B, N, T, S), bool) if allowed is None else np.asarray(allowed)
    allowed = np.broadcast_to(allowed, (B, N, T, S))
    weights = np.zeros((B, N, T, S))
    for idx in np.ndindex(B, N, T):
        row = allowed[idx]
        if row.any():
            z = capped[idx][row]
            top = z.max() if sinks is None else max(z.max(), float(sinks[idx[1]]))
            e = np.exp(z - top)
            extra = 0.0 if sinks is None else np.exp(float(sinks[idx[1]]) - top)
            weights[idx][row] = e / (e.sum() + extra)
    return logits, weights, k


def np_attention(
    q, k, v, allowed=None, bias=None, scale=None, return_weights=False, soft_cap=None, sinks=None
):
    """Attention in float64 numpy, written without the library's code.

    q: (B, T, N, H); k, v: (B, S, K, H); query head n uses key/value head
    n // (N // K). ``allowed``/``bias`` broadcast to (B, N, T, S). A row with no
    allowed key gives zeros. ``soft_cap`` c turns the logits s into
    c * tanh(s / c) before the softmax. ``sinks`` (N,): one more logit per head in
    every row's denominator, attending no value.
    """
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    sinks = None if sinks is None else np.asarray(sinks, np.float64)
    _, weights, _ = _np_weights(q, k, allowed, bias, scale, soft_cap, sinks)
    v = np.repeat(v, q.shape[2] // v.shape[2], axis=2)
    out = np.einsum("bnts,bsnh->btnh", weights, v)
    return weights if return_weights else out


def np_lse(q, k, allowed=None, bias=None, scale=None, soft_cap=None, sinks=None):
    """The float64 log-sum-exp (B, T, N) of each row's logits over its allowed keys,
    ``log sum_s exp(z_s)`` with z the scaled, biased, capped logits; ``-inf`` for a
    row with no allowed key (the log-sum-exp of an empty set). With ``sinks`` (N,),
    ``exp(sinks[n])`` is in every row's sum."""
    q, k = (np.asarray(a, np.float64) for a in (q, k))
    H, N = q.shape[3], q.shape[2]
    k = np.repeat(k, N // k.shape[2], axis=2)  # (B, S, N, H)
    z = np.einsum("btnh,bsnh->bnts", q, k) * (1 / np.sqrt(H) if scale is None else scale)
    if bias is not None:
        z = z + np.asarray(bias, np.float64)
    if soft_cap is not None:
        z = soft_cap * np.tanh(z / soft_cap)
    allowed = np.broadcast_to(True if allowed is None else np.asarray(allowed), z.shape)
    top = np.where(allowed, z, -np.inf).max(-1, keepdims=True)
    safe = np.where(np.isfinite(top), top, 0)
    with np.errstate(divide="ignore"):
        lse = np.log(np.where(allowed, np.exp(z - safe), 0).sum(-1)) + safe[..., 0]
    if sinks is not None:
        sink = np.asarray(sinks, np.float64)[None, :, None]  # (1, N, 1)
        lse = np.logaddexp(lse, sink)
    return np.moveaxis(lse, 1, 2)  # (B, N, T) -> (B, T, N)


def np_attention_vjp(
    q, k, v, d_out, allowed=None, bias=None, scale=None, soft_cap=None, sinks=None, d_lse=None
):
    """The output of :func:`np_attention` and its gradients, derived by hand in float64.

    Returns ``out, (dq, dk, dv, dbias)`` for the cotangent ``d_out`` (B, T, N, H)
    (and ``d_lse`` (B, T, N) of the log-sum-exp, :func:`np_lse`, when given),
    and ``dsinks`` (N,) fifth with ``sinks`` (a sink attends no value, so its weight
    w gets dZ = -w * rowsum(P * dP), plus w * d_lse);
    ``dbias`` has the full shape (B, N, T, S) (sum it to the bias's shape with
    :func:`sum_to_shape`). With P the weights, dP = dO V^T, the softmax gives
    dZ = P * (dP - rowsum(P * dP)), and the log-sum-exp adds P * d_lse (its
    derivative is the softmax); the cap multiplies it by 1 - tanh^2(s / c);
    then dq = scale * dS K, dk = scale * dS^T Q, dv = P^T dO, each key/value
    head summing over its G query heads.
    """
    q, k, v, d_out = (np.asarray(a, np.float64) for a in (q, k, v, d_out))
    B, _, N, H = q.shape
    S, K = k.shape[1], k.shape[2]
    scale = 1 / np.sqrt(H) if scale is None else scale
    sinks = None if sinks is None else np.asarray(sinks, np.float64)
    logits, w, k_rep = _np_weights(q, k, allowed, bias, scale, soft_cap, sinks)
    v_rep = np.repeat(v, N // K, axis=2)  # (B, S, N, Hv)
    out = np.einsum("bnts,bsnh->btnh", w, v_rep)
    dw = np.einsum("btnh,bsnh->bnts", d_out, v_rep)
    row_term = (w * dw).sum(-1, keepdims=True)  # (B, N, T, 1)
    lse_term = 0 if d_lse is None else np.moveaxis(np.asarray(d_lse, np.float64), 1, 2)[..., None]
    ds = w * (dw - row_term + lse_term)
    if soft_cap is not None:
        ds = ds * (1 - np.tanh(logits / soft_cap) ** 2)
    dq = scale * np.einsum("bnts,bsnh->btnh", ds, k_rep)
    dk = scale * np.einsum("bnts,btnh->bsnh", ds, q).reshape(B, S, K, N // K, H).sum(3)
    Hv = v.shape[3]  # the values' own width (H, or another: docs/latent.md)
    dv = np.einsum("bnts,btnh->bsnh", w, d_out).reshape(B, S, K, N // K, Hv).sum(3)
    if sinks is None:
        return out, (dq, dk, dv, ds)
    seen = w.sum(-1, keepdims=True) > 0  # a row with no allowed key gives zeros: no gradient
    w_sink = np.where(seen, 1 - w.sum(-1, keepdims=True), 0)  # the sink's weight
    dsinks = (w_sink * (lse_term - row_term)).sum(axis=(0, 2, 3))
    return out, (dq, dk, dv, ds, dsinks)


def sum_to_shape(x, shape):
    """Sums ``x`` over the axes where ``shape`` (same rank, or lower) broadcasts."""
    x = np.asarray(x)
    shape = (1,) * (x.ndim - len(shape)) + tuple(shape)
    axes = tuple(i for i, (a, b) in enumerate(zip(x.shape, shape)) if b == 1 and a != 1)
    return x.sum(axis=axes, keepdims=True).reshape(shape)


def np_index_grids(B, N, T, S, q_offset=0):
    """The four index arrays of the cells (B, N, T, S), broadcast to it, as a literal
    mask written in numpy sees them: b, n, q_pos (``q_offset + i``, per row with a (B,)
    offset) and k_pos."""
    off = np.broadcast_to(np.asarray(q_offset), (B,))
    b = np.arange(B)[:, None, None, None]
    n = np.arange(N)[None, :, None, None]
    q = (off[:, None] + np.arange(T))[:, None, :, None]
    k = np.arange(S)[None, None, None, :]
    return np.broadcast_arrays(b, n, q, k)


def np_causal(T, S, q_offset=0):
    """Literal positional rule: query i (at q_offset + i) sees key j iff j <= q_offset + i."""
    return np.array([[j <= q_offset + i for j in range(S)] for i in range(T)])


def np_window(T, S, q_offset, left, right):
    """Literal window rule: query i (at p = q_offset + i) sees key j iff
    p - left <= j <= p + right. An int offset gives (T, S); a (B,) offset gives
    (B, 1, T, S)."""
    offsets = np.asarray(q_offset)
    if offsets.ndim == 1:
        return np.stack([np_window(T, S, int(o), left, right) for o in offsets])[:, None]
    p = int(q_offset)
    return np.array([[p + i - left <= j <= p + i + right for j in range(S)] for i in range(T)])


def np_segments(q_ids, kv_ids):
    """Packed sequences: (B, 1, T, S), query i sees key j iff their ids are equal."""
    q_ids, kv_ids = np.asarray(q_ids), np.asarray(kv_ids)
    return (q_ids[:, :, None] == kv_ids[:, None, :])[:, None]


def np_lengths(lengths, S):
    """(B, 1, 1, S): key j of row b is valid iff j < lengths[b]."""
    return (np.arange(S) < np.asarray(lengths)[:, None])[:, None, None, :]


def np_rope(x, positions, base=10000.0):
    """Rotary embedding in float64, half-split: feature i pairs with feature i + H/2
    and turns by the angle position * base ** (-2 i / H). Negative positions undo it."""
    x = np.asarray(x, np.float64)
    H = x.shape[-1]
    positions = np.broadcast_to(np.asarray(positions, np.float64), x.shape[:2])  # (B, L)
    out = np.empty_like(x)
    for i in range(H // 2):
        angle = positions * base ** (-2 * i / H)  # (B, L)
        c, s = np.cos(angle)[..., None], np.sin(angle)[..., None]  # (B, L, 1)
        a, b = x[..., i], x[..., i + H // 2]  # (B, L, N)
        out[..., i] = a * c - b * s
        out[..., i + H // 2] = b * c + a * s
    return out


def randn(seed, *shape, dtype=np.float32):
    return np.random.default_rng(seed).standard_normal(shape).astype(dtype)
