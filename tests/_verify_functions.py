"""Small functions the verify tests check, and what several verify test files share:
the model width ``D``, a token embedding (``V`` ids, ``EMBED``), a causal prefix sum
over time (``causal_sum``) and its padding-aware form (``causal_sum_valid``), and
``by_name`` (a report's checks by name)."""

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
