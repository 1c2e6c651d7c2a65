"""The native kernel as a JAX function: ``ffi_call`` forward and backward under
a ``custom_vjp``.

The C++ side (``attention.cc``) takes q (B, T, N, H), k and v (B, S, K, H), all
float32 or all bfloat16 (one pair of FFI targets per type), per-row ``q_offset``
and ``kv_lengths`` (B,), segment ids
(B, T) and (B, S) (or empty), and the rules as attributes: ``scale``,
``soft_cap`` (0: none) and the positional band ``left``/``right`` (-1:
unbounded). It returns the output and the per-row log-sum-exp (B, T, N) that the
backward pass recomputes the weights from (``-inf`` for a row that sees no key),
both float32 whatever the inputs' type (the backward pass's row term needs the
unrounded output); the backward pass takes the cotangents of both and returns
gradients in the inputs' type. Under ``vmap`` every operand
gains the mapped axis in front, which the kernel folds into B.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np

from .._spec import AttentionSpec

_F32 = jnp.dtype(jnp.float32)
# The element types the kernel serves, and the suffix of their FFI targets.
TARGET_SUFFIX = {jnp.dtype(jnp.float32): "", jnp.dtype(jnp.bfloat16): "_bf16"}


def native_attention(query, key, value, spec: AttentionSpec):
    """Attention by the native kernel, with the reference's output contract.

    Args:
      query: (B, T, N, H) float32 or bfloat16; key, value: (B, S, K, H), cast to
        the query's type (products and softmax in float32); ``spec`` from
        :func:`nanoattn._spec.attention_spec` that the ``native`` backend
        (:mod:`nanoattn._backends.native`) accepts.

    Returns:
      (out (B, T, N, H), lse (B, T, N)), float32 (the caller rounds ``out`` to its
      dtype), differentiable in both: ``lse``
      is the log-sum-exp of each row's visible logits, ``-inf`` for a row that
      sees no key (the convention of the flash kernel and of ``jax.nn``'s
      residuals).
    """
    return _attend(*_operands(query, key, value, spec))


def _operands(query, key, value, spec: AttentionSpec):
    """The kernel's operands: q, k, v in the query's type, per-row offsets and lengths (B,),
    segment ids (B, T) and (B, S) (empty without them), and the static rules."""
    B, S = spec.B, spec.S
    left, right = spec.band if spec.band is not None else (None, None)
    rules = (
        float(spec.scale),
        float(spec.logit_soft_cap or 0.0),
        -1 if left is None else int(left),
        -1 if right is None else int(right),
    )
    offset = spec.q_offset if spec.band is not None else 0
    offsets = jnp.broadcast_to(jnp.asarray(offset, jnp.int32), (B,))
    lengths = jnp.full((B,), S) if spec.kv_lengths is None else spec.kv_lengths
    if spec.q_segment_ids is None:
        q_seg = kv_seg = jnp.zeros((B, 0))  # empty: no segment rule
    else:
        q_seg, kv_seg = spec.q_segment_ids, spec.kv_segment_ids
    ints = (offsets, lengths.astype(jnp.int32), q_seg.astype(jnp.int32), kv_seg.astype(jnp.int32))
    key, value = key.astype(query.dtype), value.astype(query.dtype)
    return (query, key, value, *ints, rules)


def _attributes(rules):
    scale, soft_cap, left, right = rules
    return dict(
        scale=np.float32(scale), soft_cap=np.float32(soft_cap),
        left=np.int64(left), right=np.int64(right),
    )  # fmt: skip


def _forward(q, k, v, offsets, lengths, q_seg, kv_seg, rules):
    B, T, N, _ = q.shape
    call = jax.ffi.ffi_call(
        "nanoattn_forward" + TARGET_SUFFIX[q.dtype],
        (jax.ShapeDtypeStruct(q.shape, _F32), jax.ShapeDtypeStruct((B, T, N), _F32)),
        vmap_method="broadcast_all",
    )
    return call(q, k, v, offsets, lengths, q_seg, kv_seg, **_attributes(rules))


@functools.partial(jax.custom_vjp, nondiff_argnums=(7,))
def _attend(q, k, v, offsets, lengths, q_seg, kv_seg, rules):
    return _forward(q, k, v, offsets, lengths, q_seg, kv_seg, rules)


def _attend_fwd(q, k, v, offsets, lengths, q_seg, kv_seg, rules):
    out, lse = _forward(q, k, v, offsets, lengths, q_seg, kv_seg, rules)
    return (out, lse), (q, k, v, out, lse, offsets, lengths, q_seg, kv_seg)


def _attend_bwd(rules, residuals, cotangents):
    q, k, v, out, lse, offsets, lengths, q_seg, kv_seg = residuals
    dout, dlse = cotangents
    call = jax.ffi.ffi_call(
        "nanoattn_backward" + TARGET_SUFFIX[q.dtype],
        tuple(jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (q, k, v)),
        vmap_method="broadcast_all",
    )
    dq, dk, dv = call(
        q, k, v, out, lse, dout.astype(q.dtype), dlse.astype(_F32), offsets, lengths, q_seg,
        kv_seg, **_attributes(rules),
    )  # fmt: skip
    return dq, dk, dv, None, None, None, None


_attend.defvjp(_attend_fwd, _attend_bwd)
