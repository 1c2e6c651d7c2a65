r"""Attention over a union of disjoint key sets, merged from its parts' log-sum-exps.

The same queries attended over disjoint key sets :math:`S_1, \dots, S_P` (chunks
of a long cache, the shards of a ring, any partition of the keys), each part
returned with its log-sum-exp (``return_residual=True``), give attention over
the union exactly:

.. math::

   \ell = \log \sum_p e^{\ell_p}, \qquad
   o = \sum_p e^{\ell_p - \ell} \, o_p

since part p holds the share :math:`e^{\ell_p - \ell}` of each row's softmax.
A part whose row saw no key has :math:`\ell_p = -\infty` and weighs 0.

Axis letters (docs/conventions.md): B batch, T query time, N query heads, H head width.
"""

import functools

import jax
import jax.numpy as jnp

from .._base.numerics import softmax_dtype
from .._base.validate import as_array, expect_floating, expect_shape

_OUT_SHAPES = {4: "B T N H", 3: "T N H"}


def _parts(name: str, value, what: str) -> list:
    """``value``, a list or tuple of parts, as a list; a one-line TypeError otherwise.

    An array is refused, not read as parts stacked on its leading axis: a lone
    (B, T, N, H) output would then pass as B unbatched parts and merge its batch."""
    if isinstance(value, (list, tuple)):
        return list(value)
    if hasattr(value, "shape") and hasattr(value, "dtype"):
        got = f"an array of shape {tuple(value.shape)}"
        hint = f"; for parts stacked on a leading axis pass list({name})"
    else:
        shown = repr(value)
        got = f"{type(value).__name__} {shown if len(shown) <= 40 else shown[:37] + '...'}"
        hint = ""
    raise TypeError(
        f"{name} must be a list or tuple of arrays {what}, one per part, got {got}{hint}"
    )


def _checked(outputs, lses):
    """The parts as two lists of jax arrays of one shape each, or a one-line error."""
    outputs = _parts("outputs", outputs, "(B, T, N, H)")
    lses = _parts("lses", lses, "(B, T, N)")
    if not outputs:
        raise ValueError("outputs must hold at least one part, got none")
    if len(lses) != len(outputs):
        raise ValueError(
            f"lses must hold one log-sum-exp per output: {len(outputs)} outputs, "
            f"got {len(lses)} lses"
        )
    outputs = [
        as_array(f"outputs[{i}]", o, "an array (B, T, N, H) or (T, N, H)")
        for i, o in enumerate(outputs)
    ]
    lses = [as_array(f"lses[{i}]", x, "an array (B, T, N) or (T, N)") for i, x in enumerate(lses)]
    first = outputs[0]
    if first.ndim not in _OUT_SHAPES:
        raise ValueError(
            f"outputs[0] must have shape (B, T, N, H) or (T, N, H), got {tuple(first.shape)}"
        )
    axes = _OUT_SHAPES[first.ndim]
    for i, (o, lse) in enumerate(zip(outputs, lses)):
        expect_floating(f"outputs[{i}]", o.dtype)
        expect_floating(f"lses[{i}]", lse.dtype)
        expect_shape(f"outputs[{i}]", o.shape, axes, first.shape)
        expect_shape(f"lses[{i}]", lse.shape, axes[:-2], first.shape[:-1])
        if o.dtype != first.dtype:
            raise TypeError(
                f"outputs[{i}] must have the dtype of outputs[0], {first.dtype}, got {o.dtype}"
            )
    return outputs, lses


def merge_attention(outputs, lses):
    r"""Attention over the union of disjoint key sets, from the attention over each.

    .. math::

       \mathrm{lse}_{btn} = \log \sum_p e^{\mathrm{lse}^{(p)}_{btn}}, \qquad
       \mathrm{out}_{btnh} = \sum_p e^{\mathrm{lse}^{(p)}_{btn} - \mathrm{lse}_{btn}}
         \, \mathrm{out}^{(p)}_{btnh}

    where part p is one call's ``(out, lse)`` over its own keys
    (``dot_product_attention(..., return_residual=True)``), the same queries in
    every part and no key in two parts. The result equals one call over all the
    keys, up to rounding: a long KV cache can be attended in chunks (split-KV
    decoding) or on several devices and merged. ``nanoattn.parallel.ring_attention``
    merges its steps with it.

    The log-sum-exp follows docs/conventions.md: a part whose row saw no key has
    ``lse = -inf`` and weighs exactly 0, and its output is never read (it may be
    anything, NaN included). A row that no part saw gives a zero output and
    ``lse = -inf``, with zero, finite gradients. A NaN that a part saw (a NaN
    output where its lse is finite, or a NaN lse) stays visible in the result.

    Args:
      outputs: a list or tuple of P >= 1 outputs (B, T, N, H), or unbatched
        (T, N, H), of one floating dtype. An array is not taken as parts stacked
        on a leading axis (a lone output would pass for B unbatched parts); for
        parts stacked as (P, B, T, N, H), as ``jax.vmap`` over the parts returns
        them, pass ``list(outputs)``.
      lses: the P log-sum-exps (B, T, N), or (T, N), in the same order; float32,
        or float64 with float64 outputs.

    Returns:
      ``(out, lse)``: out (B, T, N, H) in the outputs' dtype, computed in at
      least float32; lse (B, T, N) in that compute dtype. Both are
      differentiable in every part's output and lse, under ``jit`` and ``vmap``.

    Raises:
      TypeError: ``outputs`` or ``lses`` is not a list or tuple, a part is not a
        floating-point array, or the outputs' dtypes differ.
      ValueError: no part, different numbers of outputs and lses, or a shape
        that differs from the first output's (its (B, T, N) for the lses).

    Example (two halves of the keys, merged, equal the call over all of them):

    >>> import jax, jax.numpy as jnp, nanoattn
    >>> q = jax.random.normal(jax.random.key(0), (1, 3, 2, 4))  # (B, T, N, H)
    >>> kv = jax.random.normal(jax.random.key(1), (1, 10, 2, 4))  # (B, S, K, H)
    >>> parts = [nanoattn.dot_product_attention(q, kv[:, s], kv[:, s], return_residual=True)
    ...          for s in (slice(0, 6), slice(6, 10))]
    >>> out, lse = nanoattn.merge_attention(*zip(*parts))
    >>> whole, whole_lse = nanoattn.dot_product_attention(q, kv, kv, return_residual=True)
    >>> bool(jnp.allclose(out, whole, atol=1e-6) and jnp.allclose(lse, whole_lse, atol=1e-6))
    True
    """
    return merge(*_checked(outputs, lses))


def merge(outputs, lses):
    """:func:`merge_attention` on parts already checked: lists of jax arrays."""
    dtype = outputs[0].dtype
    acc = softmax_dtype(dtype, *(lse.dtype for lse in lses))
    lses = [lse.astype(acc) for lse in lses]
    top = functools.reduce(jnp.maximum, lses)  # (B, T, N); NaN if a part's lse is NaN
    nothing = top == -jnp.inf  # the rows no part saw
    # A part whose lse is +inf (a sink of +inf) takes the whole row: weight 1 (shared
    # with any other part at +inf), the others 0, and the row's lse is +inf.
    infinite = top == jnp.inf
    # Shifted by the largest lse so that exp stays in range; the result does not depend
    # on the shift, so no gradient flows through it (nor through the max's ties).
    shift = jax.lax.stop_gradient(jnp.where(jnp.isfinite(top), top, 0))
    weights = [
        # exactly 0 where lse = -inf; exp is taken of -inf in an infinite row, so that no
        # inf meets a zero cotangent in the gradient of the branch not taken
        jnp.where(
            infinite, (lse == jnp.inf).astype(acc),
            jnp.exp(jnp.where(infinite, -jnp.inf, lse - shift)),
        )
        for lse in lses
    ]  # fmt: skip
    # 1 for the rows no part saw (every weight 0), so that neither log nor the division
    # meets a zero, in the forward pass or the backward: their gradients stay finite.
    total = jnp.where(nothing, 1, functools.reduce(jnp.add, weights))
    lse = jnp.where(nothing, -jnp.inf, shift + jnp.log(total))
    lse = jnp.where(infinite, jnp.inf, lse)
    out = jnp.zeros(outputs[0].shape, acc)
    for o, lse_p, w in zip(outputs, lses, weights):
        # A part that saw nothing is not read: weight 0 times a NaN would be NaN.
        unseen = (lse_p == -jnp.inf)[..., None]  # (B, T, N, 1)
        out = out + (w / total)[..., None] * jnp.where(unseen, 0, o.astype(acc))
    return out.astype(dtype), lse


def add_sinks(out, lse, sinks):
    """Attention (B, T, N, H) with log-sum-exp (B, T, N) over the keys, made attention
    over the keys and one sink per head (``sinks`` (N,)): a part whose log-sum-exp is the
    sink's logit and whose output is 0 (the sink attends no value), merged in. A row
    with no visible key stays zeros and gets the sink's log-sum-exp; gradients reach
    ``sinks`` through the merge."""
    sink_lse = jnp.broadcast_to(sinks.astype(lse.dtype), lse.shape)  # (B, T, N)
    return merge([out, jnp.zeros_like(out)], [lse, sink_lse])
