"""``flax_attention_fn``: nanoattn behind flax's own attention layers (their ``attention_fn``).

Flax's layers call ``attention_fn(query, key, value, mask=..., dropout_rng=...,
...)`` with flax's conventions: any number of leading batch axes, 0/1 float
masks, dropout broadcast over the batch and heads. This module turns such a
call into one call of the functional core (``nanoattn.dot_product_attention``)
on (B, T, N, H) arrays and back, or, when dropout or sown weights need the full
weights, of the reference's ``attend`` with flax's dropout bits. The calls that
nanoattn cannot serve go to flax's own function (:mod:`nanoattn._interop.flax_hand_over`);
``precision`` is applied by :mod:`nanoattn._interop.flax_precision`.

Axis letters (docs/conventions.md): B batch (the leading batch axes
flattened), T query time, S key time, N query heads, K key/value heads,
G = N / K, H head width.
"""

import functools
import math

import jax
import jax.numpy as jnp

from .._backends import registry
from .._backends.xla import reference
from .._base.dropout import check_dropout
from .._base.rules import Rules
from .._base.validate import check_scale
from .._core.api import attend
from .flax_hand_over import hand_over as _hand_over
from .flax_hand_over import unserved
from .flax_precision import matmul_precision, under_precision


def flax_attention_fn(
    query,
    key,
    value,
    bias=None,
    mask=None,
    broadcast_dropout: bool = True,
    dropout_rng=None,
    dropout_rate: float = 0.0,
    deterministic: bool = False,
    dtype=None,
    precision=None,
    module=None,
    force_fp32_for_softmax: bool = False,
    einsum_dot_general=None,
    qk_attn_weights_einsum=None,
    attn_weights_value_einsum=None,
    is_causal: bool = False,
    implementation: registry.Implementation | None = None,
):
    r"""nanoattn with the calling convention of flax's ``dot_product_attention``.

    .. math::

       \mathrm{out}_{\ldots tnh} = \sum_s \tilde P_{\ldots nts} \, V_{\ldots skh}, \qquad
       P_{\ldots nt\cdot} = \mathrm{softmax}_{s \in \mathrm{allowed}}
         \Big(\tfrac{1}{\sqrt H} \sum_h Q_{\ldots tnh} K_{\ldots skh}
              + \mathrm{bias}_{\ldots nts}\Big)

    where ``...`` are the leading batch axes, key/value head ``k = n // G``
    serves query head ``n`` (``G = N / K``), and ``P~ = P * keep / (1 - rate)``
    with dropout (``keep`` a Bernoulli(1 - rate) mask; ``P~ = P`` without).
    Key ``s`` is allowed for query ``t`` when ``mask[..., n, t, s]`` is
    nonzero (a boolean or a flax 0/1 float mask) and, with ``is_causal``,
    when ``s <= t``. Axis letters: T query time, S key time, N query heads,
    K key/value heads, H head width.

    Pass it as the ``attention_fn`` of ``flax.linen.MultiHeadDotProductAttention``
    (and linen's ``MultiHeadAttention``) or ``flax.nnx.MultiHeadAttention``;
    causality without a dense mask is ``layer(x, is_causal=True)`` in NNX and
    ``functools.partial(flax_attention_fn, is_causal=True)`` in linen.
    Dropout draws flax's random bits. The main differences from flax's
    function: a query row that may see no key returns zeros (flax: the mean of
    V); the softmax runs in at least float32 whatever ``dtype``; a single
    causal query (T = 1) sees every key the mask allows; ``precision`` applies
    to every matrix product, forward and backward. Calls that nanoattn cannot
    serve (complex inputs, linen's custom einsums, ...) go to flax's own function.
    docs/flax.md explains these differences, the hand-over rules, dropout,
    ``implementation`` and the memory a causal call saves.

    Args:
      query: [batch..., T, N, H].
      key, value: [batch..., S, K, H], K dividing N.
      bias: optional, broadcastable to [batch..., N, T, S], added to the scaled logits.
      mask: optional, broadcastable to [batch..., N, T, S]; nonzero or True = may attend.
      broadcast_dropout: one dropout mask (T, S) for all batch axes and heads, as flax.
      dropout_rng, dropout_rate: a ``jax.random`` key and the probability of
        dropping a weight, in [0, 1); checked only when ``deterministic`` is False.
      deterministic: no dropout when True.
      dtype: the dtype of the computation; None promotes the inputs (flax's
        ``promote_dtype``).
      precision: a ``lax.Precision``, its name, or a ``lax.DotAlgorithmPreset``.
      module: a linen or NNX module to sow the weights [batch..., N, T, S] into
        (``'intermediates'`` / ``nnx.Intermediate``, name ``attention_weights``),
        before dropout, in ``dtype`` (float32 with ``force_fp32_for_softmax``).
      force_fp32_for_softmax: flax's flag; the weights and the output are then
        float32 (as flax) for a ``dtype`` other than float32.
      einsum_dot_general, qk_attn_weights_einsum, attn_weights_value_einsum:
        linen's overrides; any of them hands the call over.
      is_causal: query t may see key s only when ``s <= t`` (T = 1: every key).
      implementation: ``"xla"``, ``"flash"``, ``"native"``, ``"cudnn"`` or None
        (automatic), as in :func:`nanoattn.dot_product_attention`.

    Returns:
      [batch..., T, N, H], in ``dtype`` (the promoted inputs' dtype when None;
      float32 under ``force_fp32_for_softmax`` for a ``dtype`` below float32).

    Raises:
      ValueError: shapes that do not fit (one line naming them), a
        ``dropout_rate`` outside [0, 1) or above 0 without ``dropout_rng``, an
        unknown ``implementation``, or a named one that cannot serve the call.
      TypeError: a ``dropout_rng`` that is not a ``jax.random`` key.

    Example:
      >>> import functools, jax, jax.numpy as jnp
      >>> from flax import nnx
      >>> import nanoattn
      >>> layer = nnx.MultiHeadAttention(
      ...     num_heads=4, in_features=32, attention_fn=nanoattn.flax_attention_fn,
      ...     decode=False, rngs=nnx.Rngs(0))
      >>> forward = nnx.jit(lambda layer, x: layer(x, is_causal=True))
      >>> forward(layer, jnp.ones((2, 7, 32))).shape
      (2, 7, 32)
      >>> causal = functools.partial(nanoattn.flax_attention_fn, is_causal=True)  # for linen
      >>> q = k = v = jnp.ones((3, 2, 5, 4, 8))  # two batch axes, T = 5, N = 4, H = 8
      >>> jax.jit(causal)(q, k, v).shape
      (3, 2, 5, 4, 8)
    """
    from flax.linen.dtypes import promote_dtype

    registry.check_implementation(implementation)
    flax_args = dict(
        bias=bias, mask=mask, broadcast_dropout=broadcast_dropout, dropout_rng=dropout_rng,
        dropout_rate=dropout_rate, deterministic=deterministic, dtype=dtype,
        precision=precision, module=module, force_fp32_for_softmax=force_fp32_for_softmax,
        einsum_dot_general=einsum_dot_general, qk_attn_weights_einsum=qk_attn_weights_einsum,
        attn_weights_value_einsum=attn_weights_value_einsum,
    )  # fmt: skip
    query, key, value = (jnp.asarray(x) for x in (query, key, value))
    _check_shapes(query, key, value)
    *batch, T, N, H = query.shape
    S = key.shape[-3]
    causal_rule = is_causal and T != 1  # a single query is the newest position (docs/flax.md)

    why_not = unserved(query, key, value, dtype, precision, flax_args)
    if why_not is not None:
        if implementation is not None:
            raise ValueError(f"implementation={implementation!r} cannot serve this call: {why_not}")
        return _hand_over(query, key, value, causal_rule, flax_args)

    query, key, value = promote_dtype(query, key, value, dtype=dtype)
    dtype = query.dtype
    weights_dtype = (
        jnp.dtype(jnp.float32) if force_fp32_for_softmax and dtype != jnp.float32 else dtype
    )
    with jax.numpy_dtype_promotion("standard"):  # flax's rules, whatever the caller's mode
        out_dtype = jnp.promote_types(weights_dtype, dtype)
    dropout = _dropout(implementation, deterministic, dropout_rate, dropout_rng, module)
    q, k, v, rules = _flat_call(query, key, value, mask, bias, causal_rule)
    if dropout or module is not None:
        bits = (dropout_rate, dropout_rng, broadcast_dropout, batch, dtype)
        drop = _flax_dropout(*bits) if dropout else None
        with matmul_precision(precision):
            out, weights = reference.attend(
                q, k, v, rules, dropout_rate=0.0, dropout_rng=None,
                dropout_fn=drop, weights_dtype=weights_dtype,
                out_dtype=out_dtype, return_weights=True,
            )  # fmt: skip
        if module is not None:
            _sow(module, weights.reshape(*batch, N, T, S))
    else:
        call = functools.partial(attend, implementation=implementation)
        out = under_precision(precision, call, q, k, v, rules)
    return out.astype(out_dtype).reshape(*batch, T, N, H)


def _dropout(implementation, deterministic: bool, rate: float, rng, module) -> bool:
    """Whether the call drops weights (its dropout arguments checked, as flax, only when
    not ``deterministic``); a ValueError when dropout or sown weights need the full
    weights and a backend other than the reference was asked for."""
    if not deterministic:  # flax checks nothing when deterministic
        check_dropout(rate, rng)
    dropout = not deterministic and rate > 0.0
    if (dropout or module is not None) and implementation not in (None, "xla"):
        raise ValueError(
            f"implementation={implementation!r} cannot serve this call: dropout and "
            "sow_weights (module) need the full attention weights, which only 'xla' computes"
        )
    return dropout


def _flat_call(query, key, value, mask, bias, causal: bool):
    """The call on (B, T, N, H) and (B, S, K, H) arrays, the batch axes flattened into
    B: ``(q, k, v, rules)``, the mask and bias flattened alike (a 0/1 float mask read
    as nonzero = may attend)."""
    *batch, T, N, H = query.shape
    S, K = key.shape[-3], key.shape[-2]
    B = math.prod(batch)
    q = query.reshape(B, T, N, H)  # (B, T, N, H)
    k = key.reshape(B, S, K, H)  # (B, S, K, H)
    v = value.reshape(B, S, K, H)  # (B, S, K, H)
    if mask is not None:
        mask = _flatten_scores("mask", jnp.asarray(mask), batch, N, T, S)
        mask = mask if mask.dtype == jnp.bool_ else mask != 0
    if bias is not None:
        bias = jnp.asarray(bias)
        if not jnp.issubdtype(bias.dtype, jnp.floating):
            bias = bias.astype(jnp.float32)
        bias = _flatten_scores("bias", bias, batch, N, T, S)
    rules = Rules.make(
        q, k, v, mask=mask, bias=bias, scale=check_scale(None), is_causal=causal,
        q_offset=0 if causal and T != S else None,
    )  # fmt: skip
    return q, k, v, rules


def _check_shapes(query, key, value) -> None:
    """Raises a one-line ValueError unless the shapes fit flax's layout."""
    shapes = f"query {query.shape}, key {key.shape}, value {value.shape}"
    layout = "query [batch..., T, N, H], key and value [batch..., S, K, H]"
    if not query.ndim == key.ndim == value.ndim or query.ndim < 3:
        raise ValueError(f"{layout}: the same rank, at least 3, is needed; got {shapes}")
    if not query.shape[:-3] == key.shape[:-3] == value.shape[:-3]:
        raise ValueError(f"{layout}: the batch axes must match; got {shapes}")
    if key.shape[-3:-1] != value.shape[-3:-1]:
        raise ValueError(f"{layout}: key and value must agree on S and K; got {shapes}")
    if query.shape[-1] != key.shape[-1]:
        raise ValueError(f"{layout}: query and key must have the same H; got {shapes}")
    N, K = query.shape[-2], key.shape[-2]
    if K == 0 or N % K:
        raise ValueError(f"{layout}: K={K} must divide N={N}; got {shapes}")


def _flatten_scores(name, x, batch, N, T, S):
    """``x`` broadcastable to [batch..., N, T, S], as a rank-4 array broadcastable to
    (B, N, T, S)."""
    full = (*batch, N, T, S)
    if x.ndim > len(full) or any(
        s not in (1, d) for s, d in zip(reversed(x.shape), reversed(full))
    ):
        raise ValueError(
            f"{name} must be broadcastable to [batch..., N, T, S] = {full}, got {x.shape}"
        )
    x = x.reshape((1,) * (len(full) - x.ndim) + x.shape)
    lead, rest = x.shape[: len(batch)], x.shape[len(batch) :]
    if all(d == 1 for d in lead):
        return x.reshape(1, *rest)  # (1, N|1, T|1, S|1)
    return jnp.broadcast_to(x, (*batch, *rest)).reshape(-1, *rest)  # (B, N|1, T|1, S|1)


def _flax_dropout(rate, rng, broadcast: bool, batch, dtype):
    """Flax's dropout on the weights (B, N, T, S), as a function for the reference's
    ``attend``: flax's random bits (``jax.random.bernoulli`` of shape (1, ..., 1, T, S)
    with ``broadcast``, else [batch..., N, T, S]) and its multiplier in ``dtype``."""

    def drop(probs):
        N, T, S = probs.shape[1:]
        keep_prob = 1.0 - rate
        shape = (1,) * (len(batch) + 1) + (T, S) if broadcast else (*batch, N, T, S)
        keep = jax.random.bernoulli(rng, keep_prob, shape)
        multiplier = keep.astype(dtype) / jnp.asarray(keep_prob, dtype)
        multiplier = multiplier.reshape(-1, *multiplier.shape[-3:])  # (B|1, N|1, T, S)
        with jax.numpy_dtype_promotion("standard"):  # flax multiplies in the promoted dtype
            return probs * multiplier

    return drop


def _sow(module, weights) -> None:
    """Sows the weights as flax does: linen into 'intermediates', NNX as nnx.Intermediate."""
    from flax import nnx

    if isinstance(module, nnx.Module):
        module.sow(nnx.Intermediate, "attention_weights", weights)
    else:
        module.sow("intermediates", "attention_weights", weights)
