"""Native ops a latent attention layer calls beside its attention (float32, on a CPU):
DeepSeek-V3.2's indexer scores (``indexer.h``) and the absorbed per-head products with
the up-projection (``absorbed.h``), each reading its big operand where it lies where
XLA on a CPU first copies it (docs/latent.md, "Its speed").

Axis letters: T queries, S keys, Hi the indexer's heads, d their width; N heads, R the
latent width, C a head's columns of the up-projection; leading axes are batch axes.
"""

import jax
import jax.numpy as jnp
import numpy as np

from ..._base.shard_map import varying_like
from .build import load

_F32 = jnp.dtype(jnp.float32)


def serves_layer_ops(implementation: str | None) -> bool:
    """Whether these ops serve a layer whose attention is ``implementation`` (None: the
    automatic choice): on a CPU, where the kernel builds."""
    if implementation not in (None, "native") or jax.default_backend() != "cpu":
        return False
    return load()[1] is None


def native_index_scores(q, weights, keys, scale: float):
    """q (..., T, Hi, d), weights (..., T, Hi), keys (..., S, 1, d) (one key a token, as
    a cache holds them) -> (..., T, S) float32:
    ``sum_h weights[..., t, h] * relu(scale * q[..., t, h, :] . keys[..., s, 0, :])``.

    No gradients: the scores only choose keys (their top k), and a choice carries none,
    so the inputs are held constant."""
    _ready()
    q, weights, keys = (jax.lax.stop_gradient(x.astype(_F32)) for x in (q, weights, keys))
    out = jax.ShapeDtypeStruct((*q.shape[:-2], keys.shape[-3]), _F32)
    call = jax.ffi.ffi_call("nanoattn_index_scores", out, vmap_method="broadcast_all")
    # inside shard_map: the result varies as the operands do
    return varying_like(call(q, weights, keys, scale=np.float32(scale)), q, weights, keys)


def native_absorbed(x, w, c0: int, width: int, *, columns: bool):
    """Each head's vectors x (..., N, A) times its columns ``[c0, c0 + width)`` of w
    (R, N, C), float32: with ``columns`` ``einsum("...nr,rnv->...nv")`` (A = R, out
    (..., N, width)), else ``einsum("...nh,rnh->...nr")`` (A = width, out (..., N, R)).
    Forward only (the caller's custom_jvp gives its tangents)."""
    _ready()
    gives = width if columns else w.shape[0]
    out = jax.ShapeDtypeStruct((*x.shape[:-1], gives), _F32)
    name = "nanoattn_absorbed_columns" if columns else "nanoattn_absorbed_rows"
    call = jax.ffi.ffi_call(name, out, vmap_method="sequential")
    return varying_like(call(x, w, c0=np.int64(c0), width=np.int64(width)), x, w)


def _ready() -> None:
    """Builds and registers the kernel (once), or says why it cannot."""
    if (reason := load()[1]) is not None:
        raise RuntimeError(f"nanoattn: the native kernel is not available: {reason}")
