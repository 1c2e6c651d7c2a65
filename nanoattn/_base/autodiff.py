"""Whether a call is being differentiated in forward mode (``jax.jvp``, ``jax.jacfwd``,
``jax.hessian``, a ``jax.jit`` traced under them).

The blockwise and native kernels define their gradients with ``jax.custom_vjp``,
which jax can differentiate in reverse mode only; the reference is plain jax and
differentiates either way. The dispatcher asks :func:`in_forward_mode` so that the
automatic choice serves such a call with a backend that can (the reference), and a
backend named for it says why it cannot.

A forward-mode transformation shows as a JVP trace among the traces the call is
traced under (the current one and its parents: ``jax.hessian``'s inner reverse pass
runs under its outer forward one, ``jax.jvp(jax.jit(f))`` traces ``f`` under it).
"""

import jax

# Why a backend whose gradient is a custom_vjp cannot serve a forward-mode call.
REVERSE_ONLY = (
    "jax differentiates this call in forward mode (jax.jvp, jax.jacfwd, jax.hessian), and "
    "the kernel's custom gradient is reverse-mode only; the reference 'xla' serves it"
)


def in_forward_mode(*arrays) -> bool:
    """Whether the call is traced for forward-mode differentiation: a JVP trace among
    the current trace and its parents, or (where jax does not expose them) among the
    tracers of ``arrays``."""
    try:
        from jax._src import core

        trace = core.trace_ctx.trace
    except (ImportError, AttributeError):  # no trace context: read the arrays instead
        return any(_is_forward(x) for x in jax.tree.leaves(arrays))
    while trace is not None:
        if type(trace).__name__ == "JVPTrace":
            return True
        trace = getattr(trace, "parent_trace", None)
    return False


def _is_forward(x) -> bool:
    """Whether the tracer ``x`` or a tracer it wraps is a forward-mode (JVP) tracer."""
    seen = 0
    while isinstance(x, jax.core.Tracer) and seen < 64:
        if type(x).__name__ == "JVPTracer":
            return True
        x = getattr(x, "primal", getattr(x, "val", None))
        seen += 1
    return False
