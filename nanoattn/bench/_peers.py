"""The implementations `nanoattn bench` compares, each as causal attention on
(B, T, N, H) arrays: nanoattn's backends and the peers users judge us against."""

import dataclasses
from collections.abc import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp

from .._core.api import dot_product_attention


@dataclasses.dataclass(frozen=True)
class Peer:
    """One implementation under test.

    Attributes:
      name: short name used in tables.
      label: what it is, for the report.
      fn: causal attention (B, T, N, H) x3 -> (B, T, N, H), a jax function;
        None for a torch peer (see :mod:`nanoattn.bench._torch`).
      materializes: holds the (B, N, T, T) scores, so its memory is quadratic.
    """

    name: str
    label: str
    fn: Callable | None
    materializes: bool


def seed_attention(q, k, v):
    """The NanoMoE seed module's attention core, as the seed computes it."""
    T, H = q.shape[1], q.shape[3]
    q, k, v = (x.transpose(0, 2, 1, 3) for x in (q, k, v))  # the seed's (B, N, T, H)
    scores = (q @ k.transpose(0, 1, 3, 2)) * H**-0.5
    blocked = jnp.triu(jnp.ones((T, T)), k=1).astype(bool)
    weights = jax.nn.softmax(jnp.where(blocked, -1e9, scores), axis=-1)
    return (weights @ v).transpose(0, 2, 1, 3)


def flax_attention(q, k, v):
    """flax.linen.dot_product_attention with flax's causal mask."""
    mask = nn.make_causal_mask(jnp.ones(q.shape[:2]))
    return nn.dot_product_attention(q, k, v, mask=mask)


def jax_nn_attention(q, k, v):
    return jax.nn.dot_product_attention(q, k, v, is_causal=True)


def nanoattn_backend(implementation: str):
    def attend(q, k, v):
        return dot_product_attention(q, k, v, is_causal=True, implementation=implementation)

    return attend


PEERS = {
    "flash": Peer(
        "flash",
        "nanoattn, implementation='flash' (blockwise kernel)",
        nanoattn_backend("flash"),
        False,
    ),
    "native": Peer(
        "native",
        "nanoattn, implementation='native' (C++ CPU kernel through XLA's FFI)",
        nanoattn_backend("native"),
        False,
    ),
    "xla": Peer("xla", "nanoattn, implementation='xla' (reference)", nanoattn_backend("xla"), True),
    "cudnn": Peer(
        "cudnn", "nanoattn, implementation='cudnn' (GPU only)", nanoattn_backend("cudnn"), False
    ),
    "seed": Peer("seed", "the NanoMoE seed module's attention core", seed_attention, True),
    "flax": Peer(
        "flax", "flax.linen.dot_product_attention + make_causal_mask", flax_attention, True
    ),
    "jax.nn": Peer(
        "jax.nn", "jax.nn.dot_product_attention(is_causal=True)", jax_nn_attention, True
    ),
    "torch": Peer(
        "torch", "torch.nn.functional.scaled_dot_product_attention(is_causal=True)", None, False
    ),
}
