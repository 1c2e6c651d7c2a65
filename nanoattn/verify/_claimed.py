"""What a ``mask_fn`` claims about a self-attention layer: for each output (b, t), the
inputs it may depend on and those it must depend on.

``mask_fn(b, n, q_pos, k_pos) -> bool`` is the library's contract (the
``mask_fn`` of ``nanoattn.dot_product_attention``): called with int32 arrays that
broadcast to (B, N, T, S), batch row, query head, the query's position and the key's
position, elementwise, True = may attend. For a self-attention layer the positions are
0 .. T-1 on both sides, and input s is both key s and, for output s, the query.
"""

import dataclasses

import jax.numpy as jnp
import numpy as np


def _mask(mask_fn, B: int, N: int, T: int) -> np.ndarray:
    """``mask_fn`` on every cell (B, N, T, T), as bool; a one-line TypeError when it
    does not return booleans, ValueError when its result does not broadcast."""
    b = jnp.arange(B, dtype=jnp.int32).reshape(B, 1, 1, 1)
    n = jnp.arange(N, dtype=jnp.int32).reshape(1, N, 1, 1)
    q = jnp.arange(T, dtype=jnp.int32).reshape(1, 1, T, 1)
    k = jnp.arange(T, dtype=jnp.int32).reshape(1, 1, 1, T)
    allowed = np.asarray(mask_fn(b, n, q, k))
    if allowed.dtype != np.bool_:
        raise TypeError(
            f"mask_fn must return booleans (True = may attend), got {allowed.dtype} "
            f"(at T={T}); compare instead of returning 0/1"
        )
    try:
        return np.broadcast_to(allowed, (B, N, T, T))
    except ValueError:
        raise ValueError(
            f"mask_fn(b, n, q_pos, k_pos) must broadcast to (B, N, T, S) = {(B, N, T, T)}, "
            f"got shape {allowed.shape}"
        ) from None


@dataclasses.dataclass(frozen=True)
class Claimed:
    """The receptive field ``mask_fn`` claims at one length, per batch row.

    ``keys`` (B, T, T): output t of row b sees key s for some head n. ``may`` (B, T, T):
    what the output may depend on: its keys, and its own input (the query) when it
    sees any key. ``must`` (B, T, T): what it must depend on: its keys, and its own
    input when it sees two keys or more. With a single key the softmax weight is 1
    whatever the query, so the output does not depend on it; with none, the row
    sees nothing (nanoattn gives zeros) and depends on no input, not even its own.
    """

    keys: np.ndarray
    may: np.ndarray
    must: np.ndarray

    @classmethod
    def of(cls, mask_fn, batch: int, n_heads: int, T: int) -> "Claimed":
        keys = _mask(mask_fn, batch, n_heads, T).any(axis=1)  # (B, T, S)
        seen = keys.sum(-1)[..., None]  # (B, T, 1): keys each output sees
        own = np.eye(T, dtype=bool)[None]  # (1, T, T): output t's own input
        return cls(keys, keys | (own & (seen >= 1)), keys | (own & (seen >= 2)))

    @property
    def sees(self) -> np.ndarray:
        """(B, T): the outputs that see some key."""
        return self.keys.any(-1)
