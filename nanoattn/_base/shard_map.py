"""Helpers for code that runs inside ``jax.shard_map``: marking fresh arrays as
varying over the manual mesh axes, and summing gradients of replicated inputs.

Outside ``shard_map`` both are the identity. The flash kernel uses them so that
it can be called per device (the ring of :mod:`nanoattn.parallel`, or a user's
own ``shard_map``).
"""

import jax
import jax.numpy as jnp
from jax.extend import core as jex


def varying_axes(x) -> set:
    """The manual mesh axes ``x`` varies over inside ``jax.shard_map`` (none outside)."""
    aval = jax.typeof(x)
    manual = getattr(aval, "manual_axis_type", None)  # jax >= 0.9; older: aval.vma
    return set(manual.varying) if manual is not None else set(getattr(aval, "vma", ()))


def varying_like(tree, *inputs):
    """``tree`` (fresh zeros) marked as varying over the manual mesh axes any of
    ``inputs`` varies over, as a scan carry inside ``jax.shard_map`` must be
    (the ring of :mod:`nanoattn.parallel`); unchanged outside shard_map."""
    axes = set()
    for x in jax.tree.leaves(inputs):
        axes |= varying_axes(x)
    if not axes:
        return tree
    return jax.tree.map(lambda x: _vary_over(x, axes), tree)


def insertion_index(ends, values):
    """``jnp.searchsorted(ends, values, side="right")`` (int32) for a sorted 1-D
    ``ends``, by counting (``jnp.searchsorted`` fails inside ``jax.shard_map`` in jax
    0.10 when its inputs vary over a manual axis); ``values`` of any shape."""
    values = jnp.asarray(values)
    ends = jnp.reshape(ends, (1,) * values.ndim + jnp.shape(ends))  # (..., B)
    return jnp.sum(ends <= values[..., None], axis=-1).astype(jnp.int32)


def sum_to_varying(grad, primal):
    """``grad`` summed over the manual mesh axes it varies over and ``primal`` does
    not: inside ``jax.shard_map``, a replicated input used by per-device work gets
    the sum of every device's gradient (the transpose of its implicit broadcast)."""
    extra = tuple(sorted(varying_axes(grad) - varying_axes(primal)))
    return jax.lax.psum(grad, extra) if extra else grad


def eval_alike(jaxpr, consts, *args) -> list:
    """Evaluates ``jaxpr`` (a ``jax.extend.core.Jaxpr``) on ``args`` as tracing its
    function anew would. Outside ``jax.shard_map`` (no input varies) each equation is
    bound as it is, as ``core.eval_jaxpr`` does. Inside it, an equation's inputs are
    first marked as varying over the mesh axes any of them varies over, as jax.numpy
    does (``core.eval_jaxpr`` binds them as they come, and a program traced with other
    arguments fails there): its calls to inner programs (jit, custom derivatives) are
    inlined (the inner programs have the traced arguments' types; a custom derivative
    rule is then replaced by the derivative of its function) and its ``pvary`` casts
    become these casts. Returns the outputs (a list)."""
    env = {}

    def read(var):
        return var.val if isinstance(var, jex.Literal) else env[var]

    for var, x in zip(jaxpr.constvars, consts, strict=True):
        env[var] = x
    for var, x in zip(jaxpr.invars, args, strict=True):
        env[var] = x
    for eqn in jaxpr.eqns:
        ins = [read(var) for var in eqn.invars]
        inner = _inner_jaxpr(eqn)
        if not any(varying_axes(x) for x in ins) and eqn.primitive.name != "pvary":
            outs = _bind(eqn, ins)
        elif eqn.primitive.name == "pvary":
            outs = [_vary_over(x, set(eqn.params["axes"])) for x in ins]
        elif inner is not None:
            outs = eval_alike(inner.jaxpr, inner.consts, *varying_like(ins, *ins))
        else:
            outs = _bind(eqn, varying_like(ins, *ins))
        for var, x in zip(eqn.outvars, outs, strict=True):
            if not isinstance(var, jex.DropVar):
                env[var] = x
    return [read(var) for var in jaxpr.outvars]


def _bind(eqn, ins) -> list:
    """The equation's primitive bound to ``ins``, as ``core.eval_jaxpr`` binds it."""
    outs = eqn.primitive.bind(*ins, **eqn.primitive.get_bind_params(eqn.params))
    return outs if eqn.primitive.multiple_results else [outs]


def _vary_over(x, axes: set):
    """``x`` marked as varying over ``axes`` too (unchanged where it already does)."""
    missing = tuple(sorted(axes - varying_axes(x)))
    return jax.lax.pcast(x, missing, to="varying") if missing else x


_INLINED = ("jit", "pjit", "closed_call", "custom_jvp_call", "custom_vjp_call")


def _inner_jaxpr(eqn):
    """The ClosedJaxpr an equation calls, when it is a call to inline; else None."""
    if eqn.primitive.name not in _INLINED:
        return None
    inner = eqn.params.get("jaxpr", eqn.params.get("call_jaxpr"))
    return inner if isinstance(inner, jex.ClosedJaxpr) else None
