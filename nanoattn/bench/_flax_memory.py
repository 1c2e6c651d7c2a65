"""Temporary memory of flax's NNX attention layer with and without nanoattn's adapter.

XLA's compiled memory analysis of one training step's attention: forward and
backward (gradients of the parameters and the input) of
``flax.nnx.MultiHeadAttention`` called with ``is_causal=True``, once with
flax's default ``attention_fn`` and once with ``nanoattn.flax_attention_fn``.
Compiled only, never run, so it is deterministic and needs no large memory.
docs/flax.md shows the table; rerun it with

    python -m nanoattn.bench._flax_memory
"""

import jax
import jax.numpy as jnp

from .._interop.flax_attention_fn import flax_attention_fn
from ._measure import temp_bytes

# The shape of the docs' table: batch, heads, head width (model width = heads * head width).
BATCH, HEADS, HEAD_WIDTH = 1, 8, 64
LENGTHS = (4096, 16384)


def nnx_layer_temp_bytes(
    attention_fn, T: int, *, batch=BATCH, heads=HEADS, head_width=HEAD_WIDTH, dtype=jnp.float32
) -> int:
    """Compiled temporary bytes of forward+backward of ``flax.nnx.MultiHeadAttention``
    with ``attention_fn`` on (batch, T, heads * head_width) inputs, ``is_causal=True``."""
    from flax import nnx

    D = heads * head_width
    layer = nnx.eval_shape(  # shapes only: compiling needs no parameter values
        lambda: nnx.MultiHeadAttention(
            num_heads=heads, in_features=D, attention_fn=attention_fn, dtype=dtype,
            param_dtype=dtype, decode=False, rngs=nnx.Rngs(0),
        )
    )  # fmt: skip
    graphdef, params = nnx.split(layer)

    def loss(params, x):
        return nnx.merge(graphdef, params)(x, is_causal=True).astype(jnp.float32).sum()

    step = jax.jit(jax.grad(loss, argnums=(0, 1)))
    return temp_bytes(step, params, jax.ShapeDtypeStruct((batch, T, D), dtype))


def flax_default():
    """Flax NNX's own default ``attention_fn``."""
    from flax import nnx

    return nnx.dot_product_attention


def table(lengths=LENGTHS) -> str:
    """The markdown table of docs/flax.md."""
    rows = [
        "| T | flax's default | nanoattn.flax_attention_fn | ratio |",
        "| --- | --- | --- | --- |",
    ]
    for T in lengths:
        before = nnx_layer_temp_bytes(flax_default(), T)
        after = nnx_layer_temp_bytes(flax_attention_fn, T)
        rows.append(f"| {T} | {_mib(before)} | {_mib(after)} | {before / after:.0f}x |")
    return "\n".join(rows)


def _mib(n: int) -> str:
    return f"{n / 2**20:,.0f} MiB" if n >= 2**20 else f"{n / 2**20:.2f} MiB"


if __name__ == "__main__":
    print(
        f"flax.nnx.MultiHeadAttention, forward+backward, is_causal=True: batch {BATCH}, "
        f"{HEADS} heads of width {HEAD_WIDTH}, float32, on {jax.default_backend()}"
    )
    print(table())
