"""Multi-head latent attention's absorbed products (docs/latent.md): a decoding step's
query moved into latent space by each head's W_uk, and its latent output out of it by
each head's W_uv, both slices of ``kv_b``'s kernel (r, N, Hn + Hv).

Axis letters: B batch, T queries, N heads, r the latent width, Hn, Hv the key part's and
the value part's widths of a head's columns.
"""

import functools
import math

import jax
import jax.numpy as jnp

from .._backends.native.layer_ops import native_absorbed, serves_layer_ops
from .latent_config import LatentConfig

ROWS, COLUMNS = "BTh,rh->BTr", "BTr,rv->BTv"  # q_n W_uk^T, o W_uv per head
# The most rows (B * T) the native products serve, the key product's and the value
# product's: a decoding step's few, whose cost is reading the kernel; with more, XLA's
# matrix products per head win (at DeepSeek's widths on a 2-core AMD EPYC Zen 4, the
# native key product 1.3 against 4.2 ms at 1 row, 7.0 against 12.3 at 32; the value
# product 2.2 against 4.1 at 1 row, even at 4, 1.5x slower at 16).
NATIVE_MOST_ROWS = {"key": 32, "value": 2}


def up_projections(params, cfg: LatentConfig, dtype):
    """``kv_b``'s kernel (r, N (Hn + Hv)) as (r, N, Hn + Hv): each head's columns are
    its key part W_uk (``[..., :Hn]``) then its value part W_uv (``[..., Hn:]``), not
    sliced here (a slice is a copy of the kernel; :func:`per_head` takes each head's)."""
    r, N, Hn = cfg.kv_lora_rank, cfg.n_heads, cfg.qk_nope_head_dim
    return params.kernel("kv_b").astype(dtype).reshape(r, N, Hn + cfg.v_head_dim)


def per_head(spec: str, x, w, columns: slice):
    """``einsum(spec, x[..., n, :], w[:, n, columns])`` for every head n, stacked on x's
    head axis: x (B, T, N, a), w (r, N, Hn + Hv) (``kv_b``'s kernel, whole). One product
    per head in a loop (``lax.map``), each taking its head's columns of w as it goes: an
    einsum batched over the heads has XLA transpose W_uk and W_uv (in the middle of the
    kernel's layout), and slicing them first copies them, on every call (on a CPU about
    60 of the 170 ms of a DeepSeek-size decoding step at 32768 keys)."""
    heads = jnp.moveaxis(x, -2, 0)  # (N, B, T, a)

    def head(args):
        n, xn = args
        wn = jax.lax.dynamic_index_in_dim(w, n, 1, keepdims=False)[:, columns]  # (r, c)
        return jnp.einsum(spec, xn, wn)

    out = jax.lax.map(head, (jnp.arange(x.shape[-2]), heads))  # (N, B, T, c)
    return jnp.moveaxis(out, 0, -2)


def key_absorbed(cfg: LatentConfig, q_nope, w):
    """``q_n W_uk^T`` per head: q_nope (B, T, N, Hn), w (r, N, Hn + Hv) -> (B, T, N, r)."""
    return _product(cfg, q_nope, w, 0, cfg.qk_nope_head_dim, columns=False)


def values_projected(cfg: LatentConfig, o_lat, w):
    """``o W_uv`` per head: o_lat (B, T, N, r), w (r, N, Hn + Hv) -> (B, T, N, Hv)."""
    return _product(cfg, o_lat, w, cfg.qk_nope_head_dim, cfg.v_head_dim, columns=True)


def _product(cfg: LatentConfig, x, w, c0: int, width: int, *, columns: bool):
    """Each head's x times its columns ``[c0, c0 + width)`` of w: by the native kernel
    (reading w in place) for a decoding step's few float32 rows on a CPU, else by
    :func:`per_head`."""
    few = math.prod(x.shape[:-2]) <= NATIVE_MOST_ROWS["value" if columns else "key"]
    if few and x.dtype == w.dtype == jnp.float32 and serves_layer_ops(cfg.implementation):
        return _native(x, w, (c0, width, columns))
    return per_head(COLUMNS if columns else ROWS, x, w, slice(c0, c0 + width))


@functools.partial(jax.custom_jvp, nondiff_argnums=(2,))
def _native(x, w, how):
    c0, width, columns = how
    return native_absorbed(x, w, c0, width, columns=columns)


@_native.defjvp
def _native_jvp(how, primals, tangents):
    """The product is bilinear: its tangent is the product of each tangent with the
    other input, by :func:`per_head` (which XLA can transpose for gradients)."""
    (x, w), (dx, dw) = primals, tangents
    c0, width, columns = how
    spec, taken = (COLUMNS if columns else ROWS), slice(c0, c0 + width)
    return _native(x, w, how), per_head(spec, dx, w, taken) + per_head(spec, x, dw, taken)
