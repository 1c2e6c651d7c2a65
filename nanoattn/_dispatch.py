"""The closed set of attention backends and the automatic choice between them.

* ``"xla"``: the reference (:mod:`nanoattn._reference`), always available; it
  defines the output contract.
* ``"flash"``: the blockwise kernel (:mod:`nanoattn._flash`), pure JAX, O(T)
  memory, any platform.
* ``"native"``: the C++ CPU kernel (:mod:`nanoattn._native`), called through
  XLA's FFI; float32, no dense mask or bias, built on first use.
* ``"cudnn"``: ``jax.nn.dot_product_attention(implementation="cudnn")``,
  NVIDIA GPUs only, half precision only.

A backend asked for by name that cannot serve a call raises ValueError saying
why; the automatic choice (``implementation=None``) only picks a backend that
can serve the call, so it never fails where the reference would succeed.
"""

from typing import Literal

import jax
import jax.numpy as jnp

from . import _flash, _native
from ._reference import allowed_mask
from ._spec import AttentionSpec

Implementation = Literal["xla", "flash", "native", "cudnn"]
IMPLEMENTATIONS: tuple[str, ...] = ("xla", "flash", "native", "cudnn")

# On CPU the kernel beats the reference from about this many score cells per
# batch row and head (T * S); measured with `nanoattn bench` (docs/performance.md).
CPU_FLASH_MIN_CELLS = 256 * 256
# The native kernel, where it can serve the call, from this many: it beat the reference
# on forward and forward+backward from T = 32 on at B * T = 8192 (docs/performance.md).
CPU_NATIVE_MIN_CELLS = 32 * 32
# Off CPU (unmeasured here): above this many bytes of scores the kernel's
# O(T) memory wins when cuDNN cannot serve the call.
ACCELERATOR_FLASH_MIN_SCORE_BYTES = 2**30


def cudnn_unsupported(spec: AttentionSpec, dtype, dropout_rate: float) -> str | None:
    """Why cuDNN cannot serve this call with nanoattn's semantics, or None."""
    if jax.default_backend() != "gpu":
        return f"it needs an NVIDIA GPU, and the default backend is {jax.default_backend()!r}"
    if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        return f"it supports bfloat16 and float16 inputs only, got {jnp.dtype(dtype)}"
    if dropout_rate > 0:
        return "dropout is only implemented by the reference (implementation='xla')"
    if spec.window is not None or spec.q_segment_ids is not None or spec.logit_soft_cap:
        return "window, segment ids and logit_soft_cap are served by 'xla' and 'flash' only"
    if spec.is_causal and spec.static_q_offset != 0:
        return "its causal mask is top-left only: it needs q_offset=0 as a Python int"
    if spec.H % 8 or spec.H > 128:
        return f"it needs a head width H that is a multiple of 8 and at most 128, got H={spec.H}"
    if not spec.static_scale:
        return "it needs a Python number for scale"
    return None


def unsupported(name: str, spec: AttentionSpec, dtype, dropout_rate: float) -> str | None:
    """Why backend ``name`` cannot serve this call, or None when it can."""
    match name:
        case "flash":
            return _flash.unsupported(spec, dropout_rate)
        case "native":
            return _native.unsupported(spec, dtype, dropout_rate)
        case "cudnn":
            return cudnn_unsupported(spec, dtype, dropout_rate)
        case _:
            return None


def choose(requested: str | None, spec: AttentionSpec, dtype, dropout_rate: float) -> str:
    """The backend that serves this call.

    Raises:
      ValueError: an unknown name, or a named backend that cannot serve the call.
    """
    if requested is not None and requested not in IMPLEMENTATIONS:
        raise ValueError(
            f"implementation must be one of {', '.join(map(repr, IMPLEMENTATIONS))} or None, "
            f"got {requested!r}"
        )
    if requested is not None:
        reason = unsupported(requested, spec, dtype, dropout_rate)
        if reason is not None:
            raise ValueError(f"implementation={requested!r} cannot serve this call: {reason}")
        return requested
    if unsupported("cudnn", spec, dtype, dropout_rate) is None:
        return "cudnn"
    cells = spec.T * spec.S
    if jax.default_backend() == "cpu":
        # Sizes first: the native kernel is built on the first call it may serve.
        for name, min_cells in (("native", CPU_NATIVE_MIN_CELLS), ("flash", CPU_FLASH_MIN_CELLS)):
            if cells >= min_cells and unsupported(name, spec, dtype, dropout_rate) is None:
                return name
    elif spec.B * spec.N * cells * 4 >= ACCELERATOR_FLASH_MIN_SCORE_BYTES:
        if unsupported("flash", spec, dtype, dropout_rate) is None:
            return "flash"
    return "xla"


def cudnn_attention(query, key, value, spec: AttentionSpec):
    """cuDNN through jax.nn, with nanoattn's zeros for rows that see no key."""
    out = jax.nn.dot_product_attention(
        query,
        key,
        value,
        bias=spec.bias,
        mask=spec.mask,
        scale=float(spec.scale),
        is_causal=spec.is_causal,
        key_value_seq_lengths=spec.kv_lengths,
        implementation="cudnn",
    )
    # cuDNN's value for a row with no visible key is not nanoattn's contract: zero it.
    if spec.mask is not None:
        sees = jnp.moveaxis(allowed_mask(spec).any(-1), 1, 2)[..., None]  # (B|1, T, N|1, 1)
    elif spec.kv_lengths is not None:
        sees = (spec.kv_lengths > 0)[:, None, None, None]  # causal or not, key 0 is visible
    else:
        return out
    return jnp.where(sees, out, 0).astype(out.dtype)
