"""``"native"``: the C++ CPU kernel (:mod:`nanoattn._native`) through XLA's FFI;
float32, no dense mask, bias or dropout, a Python number for ``scale``; built on
the first call it may serve."""

import jax
import jax.numpy as jnp

from .. import _native
from . import NO_DROPOUT

# Where it can serve the call, from this many score cells per batch row and head
# (T * S): it beat the reference on forward and forward+backward from T = 32 on at
# B * T = 8192 (docs/performance.md).
CPU_MIN_CELLS = 32 * 32


class Native:
    name = "native"
    priority = 2

    def unsupported(self, spec, dtype, dropout_rate: float) -> str | None:
        if jax.default_backend() != "cpu":
            return f"it runs on CPU only, and the default backend is {jax.default_backend()!r}"
        if dropout_rate > 0:
            return NO_DROPOUT
        if jnp.dtype(dtype) != jnp.dtype(jnp.float32):
            return f"it supports float32 inputs only, got {jnp.dtype(dtype)}"
        if spec.mask is not None or spec.bias is not None:
            return "a dense mask or a bias is served by 'xla' and 'flash' only"
        if not spec.static_scale:
            return "it needs a Python number for scale, not a traced array"
        _, reason = _native.load()  # last: this builds the kernel on first use
        if reason is not None:
            return f"the kernel is not available: {reason}"
        return None

    def pays_off(self, spec) -> bool:
        return jax.default_backend() == "cpu" and spec.T * spec.S >= CPU_MIN_CELLS

    def __call__(self, query, key, value, spec, *, dropout_rate: float, dropout_rng):
        out, lse = _native.native_attention(query, key, value, spec)
        out = out.astype(query.dtype)
        return (out, lse) if spec.return_residual else out


BACKEND = Native()
