r"""The slot arithmetic of a rolling (ring-buffer) KV cache with sink tokens.

A rolling cache of C slots keeps, for a windowed layer (``window=(W, 0)``), only
the keys still in view: the first ``sink_tokens`` positions (S0) in slots
0 .. S0 - 1 for good, and every later position j in slot
``S0 + (j - S0) mod (C - S0)``, overwriting the position ``C - S0`` before it.
After a row has taken positions 0 .. end - 1, slot s holds the newest position
that maps to it, or nothing:

.. math::

   \mathrm{pos}(s) = \begin{cases}
     s & s < S_0,\ s < \mathrm{end} \\
     j_s + (C - S_0) \left\lfloor \frac{\mathrm{end} - 1 - j_s}{C - S_0} \right\rfloor
       & s \ge S_0,\ j_s = s < \mathrm{end} \\
     -1 & \text{otherwise.}
   \end{cases}

A query at position p sees slot s iff ``0 <= pos(s) <= p`` and either
``p - pos(s) <= W`` or ``pos(s) < S0``. A chunk of L new tokens at positions
``end - L .. end - 1`` overwrites positions at most ``end - 1 - (C - S0)``, which
no query of the chunk may see when ``L <= C - W - S0`` (:func:`chunk_limit`); so
with chunks within that limit the cache loses nothing still in view, and a rewind
(``end`` moved back by at most the last chunk's length) leaves only slots whose
recomputed positions lie outside every later window.
"""

import jax.numpy as jnp


def chunk_limit(capacity: int, window: int, sink_tokens: int) -> int:
    """The most tokens one call may write into a rolling cache: C - W - S0."""
    return capacity - window - sink_tokens


def slot_of(position, capacity: int, sink_tokens: int):
    """The slot (int32, the shape of ``position``) that holds ``position``."""
    position = jnp.asarray(position, jnp.int32)
    ring = capacity - sink_tokens
    return jnp.where(
        position < sink_tokens, position, sink_tokens + (position - sink_tokens) % ring
    )


def slot_positions(end, capacity: int, sink_tokens: int):
    """(B, C) int32: the position each slot holds after positions 0 .. end[b] - 1 were
    written, -1 for a slot never written. ``end``: (B,) int."""
    end = jnp.asarray(end, jnp.int32)[:, None]  # (B, 1)
    s = jnp.arange(capacity, dtype=jnp.int32)[None]  # (1, C)
    ring = capacity - sink_tokens
    laps = jnp.maximum(end - 1 - s, 0) // ring
    rolled = s + ring * laps
    held = jnp.where(s < sink_tokens, s, rolled)
    return jnp.where(s < end, held, -1)
