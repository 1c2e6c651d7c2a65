"""Calls under jax's debug flags (``jax_debug_infs``, ``jax_debug_nans``).

Eagerly, those flags check the output of every operation, so a value that nanoattn
keeps inside a call by convention (``-inf``, the log-sum-exp of a row that sees no
key, or of a padded query row of a blockwise kernel) would raise where the call's
results hold none. :func:`one_program` runs such a call's work as one jitted program
instead, whose results alone are checked, as jax.nn's are.
"""

import jax


def one_program(fn, *args):
    """``fn(*args)``; under a debug flag, with concrete arguments, as one jitted
    program (a pytree argument's static parts, such as a ``Rules``' functions, are its
    metadata and stay static)."""
    debug = jax.config.jax_debug_infs or jax.config.jax_debug_nans
    if not debug or any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(args)):
        return fn(*args)
    return jax.jit(fn)(*args)
