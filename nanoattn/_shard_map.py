"""Helpers for code that runs inside ``jax.shard_map``: marking fresh arrays as
varying over the manual mesh axes, and summing gradients of replicated inputs.

Outside ``shard_map`` both are the identity. The flash kernel uses them so that
it can be called per device (the ring of :mod:`nanoattn.parallel`, or a user's
own ``shard_map``).
"""

import jax
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
    axes = tuple(sorted(axes))

    def cast(x):
        missing = tuple(a for a in axes if a not in varying_axes(x))
        return jax.lax.pcast(x, missing, to="varying") if missing else x

    return jax.tree.map(cast, tree)


def sum_to_varying(grad, primal):
    """``grad`` summed over the manual mesh axes it varies over and ``primal`` does
    not: inside ``jax.shard_map``, a replicated input used by per-device work gets
    the sum of every device's gradient (the transpose of its implicit broadcast)."""
    extra = tuple(sorted(varying_axes(grad) - varying_axes(primal)))
    return jax.lax.psum(grad, extra) if extra else grad


def eval_alike(jaxpr, consts, *args) -> list:
    """Evaluates ``jaxpr`` (a ``jax.extend.core.Jaxpr``) on ``args`` as tracing its
    function anew would: each equation's inputs first marked as varying over the
    mesh axes any of them varies over, as jax.numpy does (``core.eval_jaxpr`` binds
    them as they come, and a program traced outside ``jax.shard_map``, or with other
    arguments, fails inside it). Calls to inner programs (jit, custom derivatives)
    are inlined; ``pvary`` casts become these casts. Returns the outputs (a list)."""
    env = {}

    def read(var):
        return var.val if isinstance(var, jex.Literal) else env[var]

    for var, x in zip(jaxpr.constvars, consts, strict=True):
        env[var] = x
    for var, x in zip(jaxpr.invars, args, strict=True):
        env[var] = x
    for eqn in jaxpr.eqns:
        ins = [read(var) for var in eqn.invars]
        ins = varying_like(ins, *ins)
        inner = _inner_jaxpr(eqn)
        if eqn.primitive.name == "pvary":
            outs = ins
        elif inner is not None:
            outs = eval_alike(inner.jaxpr, inner.consts, *ins)
        else:
            outs = eqn.primitive.bind(*ins, **eqn.params)
            outs = outs if eqn.primitive.multiple_results else [outs]
        for var, x in zip(eqn.outvars, outs, strict=True):
            if not isinstance(var, jex.DropVar):
                env[var] = x
    return [read(var) for var in jaxpr.outvars]


_INLINED = ("jit", "pjit", "closed_call", "custom_jvp_call", "custom_vjp_call")


def _inner_jaxpr(eqn):
    """The ClosedJaxpr an equation calls, when it is a call to inline; else None."""
    if eqn.primitive.name not in _INLINED:
        return None
    inner = eqn.params.get("jaxpr", eqn.params.get("call_jaxpr"))
    return inner if isinstance(inner, jex.ClosedJaxpr) else None
