"""Small functions the verify tests check, and what several verify test files share:
the model width ``D``, a token embedding (``V`` ids, ``EMBED``), a causal prefix sum
over time (``causal_sum``) and its padding-aware form (``causal_sum_valid``), and
``by_name`` (a report's checks by name); models with a fixed context of ``BLOCK``
tokens, one causal and one that leaks (``nanogpt_like``, ``sliced_from_the_bottom``)."""

import jax
import jax.numpy as jnp
import numpy as np

from nanoattn.verify import CheckResult, Report

D = 16


def by_name(report: Report) -> dict[str, CheckResult]:
    return {c.name: c for c in report.checks}


def causal_sum(x):
    return jnp.cumsum(x, axis=1)


def causal_sum_valid(x, valid):
    return jnp.cumsum(x * valid[..., None], axis=1)


# Token ids: a model from ids (B, T) in [0, V) to outputs, checked without embeddings.
V = 11
EMBED = jnp.asarray(np.random.default_rng(0).standard_normal((V, D)), jnp.float32)


# Models with a fixed context, as nanoGPT's (its block_size): a causal mask precomputed
# for BLOCK tokens and sliced per call. ``seen`` collects every length fn is called (or
# traced) at.
BLOCK = 20
CAUSAL = np.tril(np.ones((BLOCK, BLOCK), bool))


def self_attention(x, mask):
    """Softmax attention of x (B, T, D) over itself under a (T, T) mask, in plain jnp."""
    scores = jnp.einsum("BTD,BSD->BTS", x, x) / np.sqrt(x.shape[-1])
    scores = jnp.where(mask[None], scores, -1e9)
    return jnp.einsum("BTS,BSD->BTD", jax.nn.softmax(scores, axis=-1), x)


def nanogpt_like(seen: list):
    """Causal; past BLOCK it raises as nanoGPT's forward does (an AssertionError)."""

    def fn(x):
        T = x.shape[1]
        seen.append(T)
        if T > BLOCK:
            raise AssertionError(
                f"Cannot forward sequence of length {T}, block size is only {BLOCK}"
            )
        return self_attention(x, CAUSAL[:T, :T])

    return fn


def sliced_from_the_bottom(seen: list):
    """The mask's rows taken from the bottom of the triangle: right only at T = BLOCK, a
    leak at every shorter length; past BLOCK the slice is too small and the mask's shape
    check raises."""

    def fn(x):
        T = x.shape[1]
        seen.append(T)
        return self_attention(x, CAUSAL[max(BLOCK - T, 0) :, :T])

    return fn
