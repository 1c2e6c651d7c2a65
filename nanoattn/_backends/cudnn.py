"""``"cudnn"``: ``jax.nn.dot_product_attention(implementation="cudnn")``, NVIDIA GPUs
only, half precision only, with nanoattn's zeros for rows that see no key."""

import jax
import jax.numpy as jnp

from .interface import NO_DROPOUT, unserved
from .xla.reference import allowed_mask


class Cudnn:
    name = "cudnn"
    priority = 3  # where it can serve a call, it is the fastest
    serves = frozenset({"mask", "bias", "is_causal", "kv_lengths"})

    def unsupported(self, rules, dtype, dropout_rate: float) -> str | None:
        if jax.default_backend() != "gpu":
            return f"it needs an NVIDIA GPU, and the default backend is {jax.default_backend()!r}"
        if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
            return f"it supports bfloat16 and float16 inputs only, got {jnp.dtype(dtype)}"
        if dropout_rate > 0:
            return NO_DROPOUT
        if reason := unserved(self, rules):
            return reason
        if rules.is_causal and rules.static_q_offset != 0:
            return "its causal mask is top-left only: it needs q_offset=0 as a Python int"
        if rules.H % 8 or rules.H > 128:
            return (
                f"it needs a head width H that is a multiple of 8 and at most 128, got H={rules.H}"
            )
        if not rules.static_scale:
            return "it needs a Python number for scale"
        if rules.return_residual:
            return "its log-sum-exp is not checked against nanoattn's contract (return_residual)"
        return None

    def pays_off(self, rules, dtype) -> bool:
        return True

    def __call__(self, query, key, value, rules, *, dropout_rate: float, dropout_rng,
                 tiles=None):  # fmt: skip
        out = jax.nn.dot_product_attention(
            query,
            key,
            value,
            bias=rules.bias,
            mask=rules.mask,
            scale=float(rules.scale),
            is_causal=rules.is_causal,
            key_value_seq_lengths=rules.kv_lengths,
            implementation="cudnn",
        )
        # cuDNN's value for a row with no visible key is not nanoattn's contract: zero it.
        if rules.mask is not None:
            sees = jnp.moveaxis(allowed_mask(rules).any(-1), 1, 2)[..., None]  # (B|1, T, N|1, 1)
        elif rules.kv_lengths is not None:
            sees = (rules.kv_lengths > 0)[:, None, None, None]  # causal or not, key 0 is visible
        else:
            return out
        return jnp.where(sees, out, 0).astype(out.dtype)


BACKEND = Cudnn()
