"""Matrix-product precision for ``flax_attention_fn``: its ``precision`` argument as a
name for ``jax.default_matmul_precision``, and a function run with every matrix product
of its forward and backward pass at that precision."""

import contextlib

import jax

# Matrix-product precisions that jax.default_matmul_precision can express.
NAMES = frozenset(["default", "high", "highest", "bfloat16", "tensorfloat32", "float32"])


def precision_name(precision) -> str | None:
    """``precision`` as a name for ``jax.default_matmul_precision``, or None when it has
    none: a ``lax.DotAlgorithm``, a pair of different precisions, anything else."""
    if isinstance(precision, (tuple, list)):
        if len(precision) != 2 or precision[0] != precision[1]:
            return None
        precision = precision[0]
    if isinstance(precision, jax.lax.Precision):
        return precision.name.lower()
    if isinstance(precision, jax.lax.DotAlgorithmPreset):
        return precision.name
    if isinstance(precision, str) and (
        precision.lower() in NAMES or precision in jax.lax.DotAlgorithmPreset.__members__
    ):
        return precision.lower() if precision.lower() in NAMES else precision
    return None


def matmul_precision(precision):
    """A context in which matrix products default to ``precision`` (None: unchanged)."""
    if precision is None:
        return contextlib.nullcontext()
    return jax.default_matmul_precision(precision_name(precision))


def under_precision(precision, f, *args):
    """``f(*args)`` with every matrix product of the forward and the backward pass at
    ``precision``. The backward pass of a custom gradient (the flash kernel) is
    traced after ``f`` returns, outside any context entered in ``f``, so the
    context is entered again around it."""
    if precision is None:
        return f(*args)

    @jax.custom_vjp
    def run(*args):
        with matmul_precision(precision):
            return f(*args)

    def forward(*args):
        with matmul_precision(precision):
            return jax.vjp(f, *args)

    def backward(vjp, d_out):
        with matmul_precision(precision):
            return vjp(d_out)

    run.defvjp(forward, backward)
    return run(*args)
