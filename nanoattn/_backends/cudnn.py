"""``"cudnn"``: ``jax.nn.dot_product_attention(implementation="cudnn")``, NVIDIA GPUs
only, half precision only, with nanoattn's zeros for rows that see no key."""

import jax
import jax.numpy as jnp

from .interface import NO_DROPOUT
from .xla.reference import allowed_mask


class Cudnn:
    name = "cudnn"
    priority = 3  # where it can serve a call, it is the fastest

    def unsupported(self, spec, dtype, dropout_rate: float) -> str | None:
        if jax.default_backend() != "gpu":
            return f"it needs an NVIDIA GPU, and the default backend is {jax.default_backend()!r}"
        if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
            return f"it supports bfloat16 and float16 inputs only, got {jnp.dtype(dtype)}"
        if dropout_rate > 0:
            return NO_DROPOUT
        if spec.indexed or spec.sinks is not None:
            return "mask_fn, score_fn and sinks are served by 'xla' and 'flash' only"
        if spec.window is not None or spec.q_segment_ids is not None or spec.logit_soft_cap:
            return "window, segment ids and logit_soft_cap are served by 'xla' and 'flash' only"
        if spec.is_causal and spec.static_q_offset != 0:
            return "its causal mask is top-left only: it needs q_offset=0 as a Python int"
        if spec.H % 8 or spec.H > 128:
            return (
                f"it needs a head width H that is a multiple of 8 and at most 128, got H={spec.H}"
            )
        if not spec.static_scale:
            return "it needs a Python number for scale"
        if spec.return_residual:
            return "its log-sum-exp is not checked against nanoattn's contract (return_residual)"
        return None

    def pays_off(self, spec, dtype) -> bool:
        return True

    def __call__(self, query, key, value, spec, *, dropout_rate: float, dropout_rng):
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


BACKEND = Cudnn()
