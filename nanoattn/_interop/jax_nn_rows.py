"""jax.nn's values for the rows where nanoattn's contract differs from it, for
:func:`nanoattn.jax_nn_attention`: a query row that sees no key, and a padded query
row (past ``query_seq_lengths``).

jax.nn sets every blocked logit to one large negative number and takes the softmax
over all S keys, so a row that sees no key weighs every key 1 / S: its output is the
mean of the values, and its log-sum-exp that number (plus log S, which it absorbs in
float32). A padded query row is that row with its output multiplied by 0.
nanoattn gives zeros and ``-inf`` for both (docs/conventions.md), and knows no
padded queries. docs/jax_nn.md tells the differences.

Axis letters (docs/conventions.md): B batch, T query time, S key time, N query heads,
K key/value heads, H head width.
"""

import jax
import jax.numpy as jnp
import numpy as np

from .._backends.xla.reference import allowed_mask
from .._base.masks import lengths_to_valid
from .._base.numerics import softmax_dtype
from .._base.rules import Rules

# jax.nn's value for each blocked logit, -0.7 times float32's largest (it caps it at
# float32's range whatever the dtype, jax's _get_large_negative), rounded to float32
# as jax.nn's softmax is.
LARGE_NEGATIVE = np.float32(-0.7 * np.finfo(np.float32).max)


def unseen_lse(S: int) -> np.float32:
    """jax.nn's log-sum-exp (float32) of a row that sees none of its S keys: the
    log-sum-exp of S copies of :data:`LARGE_NEGATIVE`, which ``+ log S`` does not
    change in float32; ``-inf`` (an empty sum) when S = 0."""
    if S == 0:
        return np.float32(-np.inf)
    return LARGE_NEGATIVE + np.float32(np.log(S))


def query_valid(q_lengths, T: int):
    """(B, T) bool: query t of row b is within its length (``t < q_lengths[b]``)."""
    return lengths_to_valid(q_lengths, T)


def sees_a_key(rules: Rules):
    """(B|1, T, N|1) bool: whether each query row sees a key under ``rules`` (the
    dense mask, band and key lengths, ANDed as the reference does; (B|1, N|1, T, S)
    cells on the way). For the backends that give no log-sum-exp, whose ``-inf``
    tells the same rows."""
    allowed = allowed_mask(rules)
    if allowed is None:
        return jnp.full((1, rules.T, 1), rules.S > 0)
    return jnp.moveaxis(allowed.any(-1), 1, 2)  # (B|1, T, N|1)


def mean_of_values(value, N: int):
    """jax.nn's output for a row that sees no key: (B, 1, N, H), the mean over all S
    keys of the values of query head n's key/value head ``n // G``; zeros when S = 0
    (an empty sum, as jax.nn's)."""
    B, S, K, H = value.shape
    if S == 0:
        return jnp.zeros((B, 1, N, H), value.dtype)
    mean = jnp.mean(value.astype(softmax_dtype(value.dtype)), axis=1)  # (B, K, H)
    return jnp.repeat(mean, N // K, axis=1)[:, None].astype(value.dtype)  # (B, 1, N, H)


def as_jax_nn(out, lse, value, sees, q_valid):
    """nanoattn's results made jax.nn's.

    Args:
      out: (B, T, N, H), zeros where a row sees no key.
      lse: nanoattn's log-sum-exp (B, T, N), or None.
      value: (B, S, K, H), the call's values.
      sees: (B|1, T, N|1) bool, whether each row sees a key (where nanoattn's
        log-sum-exp is not ``-inf``, or :func:`sees_a_key`).
      q_valid: (B, T) bool from :func:`query_valid`, or None (no padded queries).

    Returns:
      ``(out, residual)``: the output (B, T, N, H), and jax.nn's residual (B, T, N)
      in the values' dtype, without gradient as jax.nn's (None without ``lse``).
    """
    N, S = out.shape[2], value.shape[1]
    out = jnp.where(sees[..., None], out, mean_of_values(value, N))
    valid = sees
    if q_valid is not None:
        out = jnp.where(q_valid[:, :, None, None], out, jnp.zeros((), out.dtype))
        valid = jnp.logical_and(sees, q_valid[:, :, None])
    if lse is None:
        return out, None
    lse = jnp.where(valid, lse, jnp.asarray(unseen_lse(S), lse.dtype))
    return out, jax.lax.stop_gradient(lse.astype(value.dtype))
