"""The ring's global positions for mask_fn and score_fn, in process and small: on a
one-device mesh the zigzag layout still cuts the sequence into two chunks, so the
pair (second query chunk, second key chunk) runs the kernel with the key chunk's
shift (``BlockInputs.index_shift``): mask_fn and score_fn must see the keys at their
global positions, not the queries moved by it (tests/_parallel_cases.py runs the same
on 2 to 8 devices in a subprocess)."""

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from nanoattn.parallel import from_zigzag, ring_attention, to_zigzag

from _reference import np_attention, randn

B, T, N, K, H = 1, 22, 2, 1, 8  # chunks of 11, cut by 4 x 4 tiles into several blocks


def test_mask_fn_and_score_fn_see_global_key_positions_on_one_device():
    docs = np.arange(T) // 5  # documents of 5 tokens, crossing the chunk edge at 11
    table = randn(7, N, 2 * T)

    def same_document(b, n, q, k):
        ids = jnp.asarray(docs)
        return ids[q] == ids[k]

    def relative(score, b, n, q, k):
        return score + jnp.asarray(table)[n, q - k + T]

    q, k, v = (jnp.asarray(randn(s, B, T, heads, H)) for s, heads in ((1, N), (2, K), (3, K)))
    mesh = Mesh(np.array(jax.devices()[:1]), ("sp",))

    @jax.jit
    def ring(q, k, v):
        q, k, v = (to_zigzag(x, 1) for x in (q, k, v))
        out = ring_attention(
            q, k, v, axis_name="sp", mesh=mesh, is_causal=True, mask_fn=same_document,
            score_fn=relative, forward_tiles=(4, 4, 1), backward_tiles=(4, 4, 1),
        )  # fmt: skip
        return from_zigzag(out, 1)

    i, j = np.arange(T)[:, None], np.arange(T)[None]
    allowed = (j <= i) & (docs[i] == docs[j])
    bias = np.stack([table[n][i - j + T] for n in range(N)])[None]  # (1, N, T, T)
    np.testing.assert_allclose(ring(q, k, v), np_attention(q, k, v, allowed, bias), atol=2e-5)
