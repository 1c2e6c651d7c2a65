"""The selection check: a self-attention layer with sparse attention over chosen keys
(``key_indices``) depends on exactly the keys each query selected (and causality let it
see), in both directions, with every other batch row left out and a positive control.

It is :func:`check_mask` with the mask a selection draws: one table of choices per
batch row and query over the longest length, each length's ``key_indices`` the entries
of that table below its T (the rest -1), so that the claim at every length is the same
``mask_fn`` (a lookup in the table).
"""

import dataclasses

import jax.numpy as jnp
import numpy as np

from ._inputs import _int_at_least
from ._mask import DEFAULT_SEQ_LENS, check_mask
from ._report import Report


@dataclasses.dataclass(frozen=True)
class _Choices:
    """Each query's chosen keys over the longest length ``T``: ``indices`` int32 (B, T,
    k) (-1 unused; some repeated), ``chosen`` bool (B, T, T) the same as a table."""

    indices: np.ndarray
    chosen: np.ndarray

    @classmethod
    def draw(cls, batch: int, T: int, k: int, seed: int) -> "_Choices":
        rng = np.random.default_rng(seed)
        indices = rng.integers(-1, T, size=(batch, T, k)).astype(np.int32)
        indices[:, :, -1] = indices[:, :, 0]  # a key chosen twice counts once
        chosen = np.zeros((batch, T, T), bool)
        for b, t, e in np.ndindex(*indices.shape):
            chosen[b, t, indices[b, t, e]] |= indices[b, t, e] >= 0
        return cls(indices, chosen)

    def at(self, T: int) -> np.ndarray:
        """``key_indices`` (B, T, k) of a length T: the entries below T, the rest -1."""
        part = self.indices[:, :T]
        return np.where(part < T, part, -1).astype(np.int32)


def check_selection(
    fn,
    *,
    d_model: int | None = None,
    vocab: int | None = None,
    k: int = 5,
    causal: bool = True,
    seq_lens=DEFAULT_SEQ_LENS,
    max_len: int | None = None,
    batch: int = 2,
    seed: int = 0,
    atol: float = 1e-5,
) -> Report:
    """Proves that ``fn(x, key_indices)`` reads exactly the keys each query selected.

    ``key_indices`` int32 (B, T, k), as nanoattn's argument: the key positions each
    query may read, -1 for an unused entry, one entry of each query's repeating
    another. Output t of row b must depend on input s exactly when s is one of its
    selected keys (and, with ``causal``, ``s <= t``), or s = t (its query) when it
    sees some key: :func:`check_mask`'s four checks (outside the mask, inside the
    mask, other rows, positive control) at every length, the selections drawn once
    from ``seed`` over the longest length and cut to each.

    Args:
      fn: ``fn(x, key_indices) -> (B, T, ...)``, one self-attention layer in evaluation
        mode over float32 (B, T, D) (pass ``d_model``) or token ids (B, T) (``vocab``).
      k: the entries per query. causal: whether the layer also masks causally.
      seq_lens, max_len, batch, seed, atol: as :func:`check_mask`'s.

    Returns:
      A :class:`Report` titled ``"selection"``, with :func:`check_mask`'s checks.

    Example:
      >>> import jax, jax.numpy as jnp, nanoattn
      >>> def layer(x, key_indices):  # x as queries, keys and values of one head
      ...     h = x[:, :, None]
      ...     return nanoattn.dot_product_attention(h, h, h, is_causal=True,
      ...                                           key_indices=key_indices)[:, :, 0]
      >>> check_selection(layer, d_model=4, seq_lens=(1, 7)).passed
      True
    """
    k = _int_at_least("k", k, 1)
    longest = max(seq_lens) if max_len is None else min(max(seq_lens), max_len)
    choices = _Choices.draw(_int_at_least("batch", batch, 1), longest, k, seed)
    table = jnp.asarray(choices.chosen)

    def selected(x):
        return fn(x, jnp.asarray(choices.at(x.shape[1])))

    def mask_fn(b, n, q_pos, k_pos):
        seen = table[b, q_pos, k_pos]
        return seen & (k_pos <= q_pos) if causal else seen

    report = check_mask(selected, mask_fn, d_model=d_model, vocab=vocab, seq_lens=seq_lens,
                        max_len=max_len, batch=batch, seed=seed, atol=atol)  # fmt: skip
    return dataclasses.replace(report, title="selection")
