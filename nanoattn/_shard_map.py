"""Helpers for code that runs inside ``jax.shard_map``: marking fresh arrays as
varying over the manual mesh axes, and summing gradients of replicated inputs.

Outside ``shard_map`` both are the identity. The flash kernel uses them so that
it can be called per device (the ring of :mod:`nanoattn.parallel`, or a user's
own ``shard_map``).
"""

import jax


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
