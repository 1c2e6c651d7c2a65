"""Shared test helpers: an independent float64 numpy reference and random inputs.

Sizes are distinct primes where possible (B=2, T=5, S=7, N=6, K=2, H=8 and
friends) so that a swapped axis changes a shape or a value and fails.
"""

import jax
import numpy as np
import pytest


def np_attention(q, k, v, allowed=None, bias=None, scale=None, return_weights=False):
    """Attention in float64 numpy, written without the library's code.

    q: (B, T, N, H); k, v: (B, S, K, H); query head n uses key/value head
    n // (N // K). ``allowed``/``bias`` broadcast to (B, N, T, S). A row with no
    allowed key gives zeros.
    """
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    B, T, N, H = q.shape
    S, K = k.shape[1], k.shape[2]
    k = np.repeat(k, N // K, axis=2)  # (B, S, N, H): heads n*G .. n*G+G-1 share one
    v = np.repeat(v, N // K, axis=2)
    scale = 1 / np.sqrt(H) if scale is None else scale
    logits = np.einsum("btnh,bsnh->bnts", q, k) * scale
    if bias is not None:
        logits = logits + np.asarray(bias, np.float64)
    allowed = np.ones((B, N, T, S), bool) if allowed is None else np.asarray(allowed)
    allowed = np.broadcast_to(allowed, (B, N, T, S))
    weights = np.zeros((B, N, T, S))
    for idx in np.ndindex(B, N, T):
        row = allowed[idx]
        if row.any():
            z = logits[idx][row]
            e = np.exp(z - z.max())
            weights[idx][row] = e / e.sum()
    out = np.einsum("bnts,bsnh->btnh", weights, v)
    return weights if return_weights else out


def np_causal(T, S, q_offset=0):
    """Literal positional rule: query i (at q_offset + i) sees key j iff j <= q_offset + i."""
    return np.array([[j <= q_offset + i for j in range(S)] for i in range(T)])


def randn(seed, *shape, dtype=np.float32):
    return np.random.default_rng(seed).standard_normal(shape).astype(dtype)


@pytest.fixture
def x64():
    """Runs the test with 64-bit floats enabled."""
    with jax.enable_x64(True):
        yield


@pytest.fixture(scope="session")
def default_audit():
    """Exit status and stdout of a plain `nanoattn audit`, run once per session."""
    import contextlib
    import io

    from nanoattn.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(["audit"])
    return code, out.getvalue()
