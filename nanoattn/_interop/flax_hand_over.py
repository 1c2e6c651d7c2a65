"""The calls of ``flax_attention_fn`` that nanoattn cannot serve, and how they are handed
to flax's own function (docs/flax.md, "What is handed over").

Axis letters (docs/conventions.md): T query time, S key time, N query heads, K key/value
heads, H head width.
"""

import jax.numpy as jnp

from .flax_precision import precision_name

# linen's overrides of the two einsums and their dot_general; any of them hands over.
EINSUM_OVERRIDES = ("einsum_dot_general", "qk_attn_weights_einsum", "attn_weights_value_einsum")


def unserved(query, key, value, dtype, precision, flax_args) -> str | None:
    """Why nanoattn cannot serve this call (then flax's function does), or None.

    ``query`` [batch..., T, N, H], ``key`` and ``value`` [batch..., S, K, H];
    ``flax_args`` the call's other arguments by name, as flax's function takes them.
    """
    if any(jnp.iscomplexobj(x) for x in (query, key, value)) or (
        dtype is not None and jnp.issubdtype(dtype, jnp.complexfloating)
    ):
        return "complex inputs"
    if value.shape[-1] != query.shape[-1]:
        return f"a value head width {value.shape[-1]} different from the query's {query.shape[-1]}"
    given = [name for name in EINSUM_OVERRIDES if flax_args[name] is not None]
    if given:
        return f"linen's custom {', '.join(given)}"
    if precision is not None and precision_name(precision) is None:
        return f"precision={precision!r} (a DotAlgorithm or a pair of different precisions)"
    return None


def hand_over(query, key, value, causal_rule: bool, flax_args):
    """Flax's own function on the call, with causality (``s <= t``) as a dense mask:
    ``flax.linen``'s when K = N, ``flax.nnx``'s when K < N.

    Raises:
      ValueError: K < N with an argument that only linen's function takes.
    """
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
    linen_only = ("force_fp32_for_softmax", *EINSUM_OVERRIDES)
    given = [name for name in linen_only if args.pop(name)]
    if given:
        raise ValueError(
            f"{', '.join(given)} (linen's) cannot combine with K={key.shape[-2]} < "
            f"N={query.shape[-2]} heads in flax's function, and nanoattn cannot serve this call"
        )
    return nnx_attention.dot_product_attention(query, key, value, **args)
