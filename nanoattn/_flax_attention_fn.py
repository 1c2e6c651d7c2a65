"""``flax_attention_fn``: nanoattn behind flax's own attention layers (their ``attention_fn``).

Flax's layers call ``attention_fn(query, key, value, mask=..., dropout_rng=...,
...)`` with flax's conventions: any number of leading batch axes, 0/1 float
masks, dropout broadcast over the batch and heads. This module turns such a
call into one call of the functional core (``nanoattn.dot_product_attention``)
on (B, T, N, H) arrays and back, and hands to flax's own function the calls
that nanoattn cannot serve.

Axis letters (docs/conventions.md): B batch (the leading batch axes
flattened), T query time, S key time, N query heads, K key/value heads,
G = N / K, H head width.
"""

import contextlib
import math

import jax
import jax.numpy as jnp

from . import _reference, _registry
from ._attention import dot_product_attention
from ._spec import attention_spec

# Matrix-product precisions that jax.default_matmul_precision can express.
_PRECISION_NAMES = frozenset(["default", "high", "highest", "bfloat16", "tensorfloat32", "float32"])


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
    implementation: _registry.Implementation | None = None,
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
    (and linen's ``MultiHeadAttention``) or ``flax.nnx.MultiHeadAttention``.
    Causality without a dense mask: ``layer(x, is_causal=True)`` in NNX (the
    layer passes its own ``is_causal``, which overrides a partial's), and
    ``functools.partial(flax_attention_fn, is_causal=True)`` in linen.
    ``implementation=`` (through a partial) picks a backend as in
    :func:`nanoattn.dot_product_attention` (None: automatic).
    With ``is_causal`` and no dense mask a long sequence runs the blockwise
    kernel in O(T) memory, forward and backward (docs/flax.md measures it).

    Differences from flax's function:

    * a query row that may see no key returns zeros (flax: the mean of V);
    * the softmax runs in at least float32 whatever ``dtype`` (flax: in
      ``dtype`` unless ``force_fp32_for_softmax``); the output and the sown
      weights have flax's dtypes;
    * a single query (T = 1) with ``is_causal`` is the newest position and may
      see every key the mask allows: in NNX decode mode the cache mask then
      decides, where flax's function lets it see key 0 only
      (google/flax#5591). Any other T != S aligns causality top-left, as flax
      (query ``t`` sees keys ``s <= t``);
    * dropout keeps flax's semantics and random bits (the same ``dropout_rng``
      drops the same weights); a ``dropout_rate`` of 1 or more raises
      ValueError (flax divides by zero);
    * ``precision`` applies to every matrix product of the call, forward and
      backward.

    Handed over: these calls go to flax's own function unchanged (except
    ``is_causal``, given to it as a dense mask with the rule above), so a
    model never breaks by switching: complex ``query``/``key``/``value`` or
    ``dtype``; a value head width different from the query's; linen's
    ``qk_attn_weights_einsum``/``attn_weights_value_einsum`` and
    ``einsum_dot_general``; a ``precision`` that is a ``lax.DotAlgorithm`` or
    a pair of different precisions. They go to ``flax.linen``'s function, or
    to ``flax.nnx``'s when K < N. A named ``implementation`` never hands over
    and raises ValueError instead, and so does ``"flash"`` or ``"cudnn"`` when
    dropout or ``module`` (``sow_weights``) needs the full weights, which the
    reference (``"xla"``, chosen automatically) computes.

    Args:
      query: [batch..., T, N, H].
      key: [batch..., S, K, H], K dividing N.
      value: [batch..., S, K, H].
      bias: optional, broadcastable to [batch..., N, T, S], added to the
        scaled logits.
      mask: optional, broadcastable to [batch..., N, T, S]; nonzero or True =
        may attend.
      broadcast_dropout: share one dropout mask (T, S) over the batch axes and
        the heads, as flax.
      dropout_rng: a ``jax.random`` key, needed when dropout is active.
      dropout_rate: the probability of dropping a weight.
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
      implementation: ``"xla"``, ``"flash"``, ``"native"``, ``"cudnn"`` or None (automatic).

    Returns:
      [batch..., T, N, H], in ``dtype`` (the promoted inputs' dtype when None;
      float32 under ``force_fp32_for_softmax`` for a ``dtype`` below float32).

    Raises:
      ValueError: shapes that do not fit (one line naming them), dropout without
        ``dropout_rng`` or with a rate >= 1, an unknown ``implementation``, or a
        named one that cannot serve the call.

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

    _registry.check_implementation(implementation)
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
    S, K = key.shape[-3], key.shape[-2]
    causal_rule = is_causal and T != 1  # a single query is the newest position (see above)

    why_not = _unserved(query, key, value, dtype, precision, flax_args)
    if why_not is not None:
        if implementation is not None:
            raise ValueError(f"implementation={implementation!r} cannot serve this call: {why_not}")
        return _hand_over(query, key, value, causal_rule, flax_args)

    query, key, value = promote_dtype(query, key, value, dtype=dtype)
    dtype = query.dtype
    weights_dtype = (
        jnp.dtype(jnp.float32) if force_fp32_for_softmax and dtype != jnp.float32 else dtype
    )
    out_dtype = jnp.promote_types(weights_dtype, dtype)
    if not deterministic and dropout_rate < 0.0:
        raise ValueError(f"dropout_rate must be in [0, 1), got {dropout_rate}")
    dropout = not deterministic and dropout_rate > 0.0
    if dropout:
        if dropout_rate >= 1.0:
            raise ValueError(
                f"dropout_rate must be below 1 (1 drops every weight), got {dropout_rate}"
            )
        if dropout_rng is None:
            raise ValueError(
                f"dropout_rate={dropout_rate} with deterministic=False needs dropout_rng "
                "(a jax.random key)"
            )
    if (dropout or module is not None) and implementation not in (None, "xla"):
        raise ValueError(
            f"implementation={implementation!r} cannot serve this call: dropout and "
            "sow_weights (module) need the full attention weights, which only 'xla' computes"
        )

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
    causal = dict(is_causal=causal_rule, q_offset=0 if causal_rule and T != S else None)

    if dropout or module is not None:
        with _matmul_precision(precision):
            out, weights = _attend_with_weights(
                q, k, v, bias, mask, causal, dropout and (dropout_rate, dropout_rng),
                broadcast_dropout, dtype, weights_dtype, batch,
            )  # fmt: skip
        if module is not None:
            _sow(module, weights.reshape(*batch, N, T, S))
    else:

        def attend(q, k, v, bias, mask):
            return dot_product_attention(
                q, k, v, bias=bias, mask=mask, implementation=implementation, **causal
            )

        out = _under_precision(precision, attend, q, k, v, bias, mask)
    return out.astype(out_dtype).reshape(*batch, T, N, H)


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


def _unserved(query, key, value, dtype, precision, flax_args) -> str | None:
    """Why nanoattn cannot serve this call (then flax's function does), or None."""
    if any(jnp.iscomplexobj(x) for x in (query, key, value)) or (
        dtype is not None and jnp.issubdtype(dtype, jnp.complexfloating)
    ):
        return "complex inputs"
    if value.shape[-1] != query.shape[-1]:
        return f"a value head width {value.shape[-1]} different from the query's {query.shape[-1]}"
    overrides = ("einsum_dot_general", "qk_attn_weights_einsum", "attn_weights_value_einsum")
    given = [name for name in overrides if flax_args[name] is not None]
    if given:
        return f"linen's custom {', '.join(given)}"
    if precision is not None and _precision_name(precision) is None:
        return f"precision={precision!r} (a DotAlgorithm or a pair of different precisions)"
    return None


def _hand_over(query, key, value, causal_rule: bool, flax_args):
    """Flax's own function on the call, with causality as a dense mask."""
    from flax.linen import attention as linen_attention
    from flax.nnx.nn import attention as nnx_attention

    mask = flax_args["mask"]
    if causal_rule:
        T, S = query.shape[-3], key.shape[-3]
        tril = jnp.tril(jnp.ones((T, S), jnp.bool_))  # (T, S): query t sees keys s <= t
        mask = tril if mask is None else jnp.logical_and(jnp.asarray(mask) != 0, tril)
    args = dict(flax_args, mask=mask)
    if key.shape[-2] == query.shape[-2]:
        return linen_attention.dot_product_attention(query, key, value, **args)
    linen_only = ("force_fp32_for_softmax", "einsum_dot_general", "qk_attn_weights_einsum",
                  "attn_weights_value_einsum")  # fmt: skip
    given = [name for name in linen_only if args.pop(name)]
    if given:
        raise ValueError(
            f"{', '.join(given)} (linen's) cannot combine with K={key.shape[-2]} < "
            f"N={query.shape[-2]} heads in flax's function, and nanoattn cannot serve this call"
        )
    return nnx_attention.dot_product_attention(query, key, value, **args)


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


def _attend_with_weights(
    q, k, v, bias, mask, causal, dropout, broadcast, dtype, weights_dtype, batch
):
    """The reference with the weights kept: output (B, T, N, H) and the weights
    (B, N, T, S) before dropout, in ``weights_dtype``. ``dropout`` is
    ``(rate, rng)`` or False; the mask has flax's shape and random bits."""
    B, T, N, H = q.shape
    S, K = k.shape[1], k.shape[2]
    spec = attention_spec(q, k, v, mask=mask, bias=bias, **causal)
    weights = _reference.weights(q, k, spec).astype(weights_dtype)  # (B, N, T, S)
    probs = weights
    if dropout:
        rate, rng = dropout
        keep_prob = 1.0 - rate
        shape = (1,) * (len(batch) + 1) + (T, S) if broadcast else (*batch, N, T, S)
        keep = jax.random.bernoulli(rng, keep_prob, shape)
        multiplier = keep.astype(dtype) / jnp.asarray(keep_prob, dtype)
        probs = probs * multiplier.reshape(-1, *multiplier.shape[-3:])  # (B|1, N|1, T, S)
    allowed = _reference.allowed_mask(spec)
    if allowed is not None:
        # Values that no query of their row may see are never read (0 * NaN = NaN).
        sees = allowed.any(axis=(1, 2))[:, :, None, None]  # (B|1, S, 1, 1)
        v = jnp.where(sees, v, jnp.zeros((), v.dtype))
    acc = _reference.compute_dtype(probs.dtype, v.dtype)
    p = probs.reshape(B, K, N // K, T, S)  # (B, K, G, T, S)
    out = jnp.einsum("BKGTS,BSKH->BTKGH", p, v, preferred_element_type=acc)
    return out.reshape(B, T, N, H), weights  # (B, T, N, H)


def _sow(module, weights) -> None:
    """Sows the weights as flax does: linen into 'intermediates', NNX as nnx.Intermediate."""
    from flax import nnx

    if isinstance(module, nnx.Module):
        module.sow(nnx.Intermediate, "attention_weights", weights)
    else:
        module.sow("intermediates", "attention_weights", weights)


def _precision_name(precision) -> str | None:
    """``precision`` as a name for ``jax.default_matmul_precision``, or None."""
    if isinstance(precision, (tuple, list)):
        if len(precision) != 2 or precision[0] != precision[1]:
            return None
        precision = precision[0]
    if isinstance(precision, jax.lax.Precision):
        return precision.name.lower()
    if isinstance(precision, jax.lax.DotAlgorithmPreset):
        return precision.name
    if isinstance(precision, str) and (
        precision.lower() in _PRECISION_NAMES or precision in jax.lax.DotAlgorithmPreset.__members__
    ):
        return precision.lower() if precision.lower() in _PRECISION_NAMES else precision
    return None


def _matmul_precision(precision):
    """A context in which matrix products default to ``precision`` (None: unchanged)."""
    if precision is None:
        return contextlib.nullcontext()
    return jax.default_matmul_precision(_precision_name(precision))


def _under_precision(precision, f, *args):
    """``f(*args)`` with every matrix product of the forward and the backward pass at
    ``precision``. The backward pass of a custom gradient (the flash kernel) is
    traced after ``f`` returns, outside any context entered in ``f``, so the
    context is entered again around it."""
    if precision is None:
        return f(*args)

    @jax.custom_vjp
    def run(*args):
        with _matmul_precision(precision):
            return f(*args)

    def forward(*args):
        with _matmul_precision(precision):
            return jax.vjp(f, *args)

    def backward(vjp, d_out):
        with _matmul_precision(precision):
            return vjp(d_out)

    run.defvjp(forward, backward)
    return run(*args)
