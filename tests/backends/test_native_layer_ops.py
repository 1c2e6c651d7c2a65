"""The native ops a latent attention layer calls beside its attention
(nanoattn/_backends/native/layer_ops.py): DeepSeek-V3.2's indexer scores and the absorbed
per-head products, against float64 numpy, at prime sizes (tails of every register tile
and task), with a NaN kept where it lands, under vmap, and the products' gradients (their
custom_jvp) against XLA's per-head loop. The layers' own tests (tests/layers/test_latent.py,
tests/verify/test_verify_latent.py) run them inside whole decoding steps."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from nanoattn._backends.native import build
from nanoattn._backends.native.layer_ops import native_index_scores
from nanoattn._layers import absorbed

pytestmark = pytest.mark.skipif(build.load()[1] is not None, reason="no native kernel")


def np_index_scores(q, w, keys, scale):
    """sum_h w[t, h] relu(scale q[t, h] . k[s]) in float64: q (B, T, Hi, d), w (B, T, Hi),
    keys (B, S, 1, d) -> (B, T, S)."""
    q, w, keys = (np.asarray(x, np.float64) for x in (q, w, keys))
    s = np.maximum(scale * np.einsum("bthd,bsd->bths", q, keys[:, :, 0]), 0)
    return np.einsum("bth,bths->bts", w, s)


def test_index_scores_match_float64_and_keep_a_nan_on_its_key():
    # Hi = 19 pads to a whole register tile of heads, S = 1031 leaves a key tile's and
    # a task's tail, B T = 2 x 3 rows
    B, T, Hi, d, S = 2, 3, 19, 29, 1031
    k = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(k[0], (B, T, Hi, d))
    w = jax.random.normal(k[1], (B, T, Hi))
    keys = jax.random.normal(k[2], (B, S, 1, d))
    got = native_index_scores(q, w, keys, d**-0.5)
    assert got.shape == (B, T, S) and got.dtype == jnp.float32
    np.testing.assert_allclose(got, np_index_scores(q, w, keys, d**-0.5), rtol=1e-5, atol=1e-4)
    # vmapped over the batch: the same rows
    vmapped = jax.vmap(lambda q, w, k: native_index_scores(q, w, k, d**-0.5))(q, w, keys)
    np.testing.assert_allclose(vmapped, got, rtol=1e-6, atol=1e-6)
    # a NaN in one key of row 1 (the last key, in the tail) reaches that key's scores only
    poisoned = np.asarray(native_index_scores(q, w, keys.at[1, S - 1, 0, 5].set(jnp.nan), 0.5))
    assert np.isnan(poisoned[1, :, S - 1]).all()
    assert np.isnan(poisoned).sum() == T


@pytest.mark.parametrize("columns", [False, True], ids=["rows", "columns"])
def test_absorbed_products_match_float64_and_their_gradients_xlas(columns):
    # r = 43 leaves a task's and a four- or eight-row block's tail, widths 23 and 17 a
    # vector's tail, the columns at an offset in each head's
    r, N, Hn, Hv = 43, 3, 23, 17
    k = jax.random.split(jax.random.key(1), 3)
    w = jax.random.normal(k[0], (r, N, Hn + Hv))
    c0, width = (Hn, Hv) if columns else (0, Hn)
    x = jax.random.normal(k[1], (2, 3, N, r if columns else Hn))
    got = absorbed._native(x, w, (c0, width, columns))
    w64, x64 = np.asarray(w, np.float64)[..., c0 : c0 + width], np.asarray(x, np.float64)
    want = np.einsum("btnr,rnv->btnv" if columns else "btnh,rnh->btnr", x64, w64)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)

    spec = absorbed.COLUMNS if columns else absorbed.ROWS
    cot = jax.random.normal(k[2], got.shape)

    def loss(f):
        return jax.grad(lambda x, w: (f(x, w) * cot).sum(), (0, 1))(x, w)

    native = loss(lambda x, w: absorbed._native(x, w, (c0, width, columns)))
    xla = loss(lambda x, w: absorbed.per_head(spec, x, w, slice(c0, c0 + width)))
    for a, b in zip(native, xla, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
