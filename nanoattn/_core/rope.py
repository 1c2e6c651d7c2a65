"""Rotary position embeddings (RoPE), the half-split convention."""

import jax.numpy as jnp

from .base.validate import expect_floating, expect_integer, expect_shape, positive_number


def apply_rope(x, positions, *, base: float = 10000.0):
    r"""Rotates each head's features by angles proportional to the token's position.

    .. math::

       y_i = x_i \cos(p \theta_i) - x_{i + H/2} \sin(p \theta_i), \quad
       y_{i + H/2} = x_{i + H/2} \cos(p \theta_i) + x_i \sin(p \theta_i)

    for each token and head, ``i < H/2``, frequencies
    ``theta_i = base ** (-2 i / H)`` and ``p`` the token's integer position.
    So ``<rope(q, m), rope(k, n)>`` depends on the positions only through
    ``m - n``, and position 0 is the identity.

    Convention: **half-split** (feature ``i`` pairs with feature ``i + H/2``),
    as GPT-NeoX, Llama's Hugging Face port, Gemma and equinox. The
    *interleaved* convention of the original RoFormer and Meta's Llama code
    pairs features ``2i`` and ``2i + 1`` instead; to use weights trained with
    it, permute the head features of the q and k projections once:
    ``perm = concat(arange(0, H, 2), arange(1, H, 2))``, i.e. new feature
    ``i`` is old feature ``perm[i]`` (then both conventions give the same
    attention scores).

    The rotation runs in float32 (float64 stays float64) and the result has
    ``x``'s dtype.

    Args:
      x: (B, L, N, H), H even: queries or keys (N heads, or K key/value heads).
      positions: integer (B, L) or (L,): each token's position.
      base: the frequency base (10000 in most models; larger for long context).

    Returns:
      (B, L, N, H), ``x``'s dtype.

    Example:
      >>> import jax.numpy as jnp
      >>> x = jnp.ones((1, 3, 2, 4))
      >>> y = apply_rope(x, jnp.arange(3))
      >>> bool((y[:, 0] == x[:, 0]).all())  # position 0 is the identity
      True
    """
    x = jnp.asarray(x)
    positions = jnp.asarray(positions)
    expect_shape("x", x.shape, "B L N H", (None,) * 4)
    expect_floating("x", x.dtype)
    B, L, _, H = x.shape
    if H % 2:
        raise ValueError(f"apply_rope needs an even head width H, got x of shape {x.shape}")
    base = positive_number("base", base)
    expect_integer("positions", positions.dtype)
    if positions.ndim == 1:
        expect_shape("positions", positions.shape, "L", (L,))
        positions = positions[None]
    else:
        expect_shape("positions", positions.shape, "B L", (B, L))
    dtype = jnp.result_type(x.dtype, jnp.float32)
    freqs = base ** (-jnp.arange(0, H, 2, dtype=dtype) / H)  # (H/2,)
    angles = positions.astype(dtype)[..., None] * freqs[None, None]  # (B|1, L, H/2)
    cos, sin = jnp.cos(angles)[:, :, None], jnp.sin(angles)[:, :, None]  # (B|1, L, 1, H/2)
    first, second = jnp.split(x.astype(dtype), 2, axis=-1)  # 2 x (B, L, N, H/2)
    rotated = jnp.concatenate([first * cos - second * sin, second * cos + first * sin], axis=-1)
    return rotated.astype(x.dtype)
