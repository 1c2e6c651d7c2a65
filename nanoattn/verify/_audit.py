"""The data behind ``nanoattn audit``: worked mask examples and the verification
of the built-in modules. The shape table is :func:`nanoattn.verify.check_shapes`.

Nothing here is written by hand: masks come from the library's mask builders,
row sums from its own attention weights, and verdicts from ``nanoattn.verify``.
"""

import contextlib
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from .._base.masks import causal_mask, lengths_to_valid, padding_mask
from .._core.api import attention_weights, dot_product_attention
from ..linen import AttentionConfig, CausalSelfAttention, CrossAttention
from . import Report, check_causality, check_padding, check_row_sums

# Cell kinds of a drawn mask. A cell blocked both by order and by padding is
# drawn as "future": the causal rule blocks it whatever the padding.
ALLOWED, FUTURE, PADDING = "allowed", "future", "padding"


@dataclasses.dataclass(frozen=True)
class MaskExample:
    """A drawn mask for one batch row, with the row sums of the real weights.

    Attributes:
      title: what the mask shows.
      batch_index: which batch row is drawn.
      cells: a (T, S) grid of ALLOWED, FUTURE or PADDING.
      row_sums: (T,) sums of the weights over keys, per query (head 0).
      passed: :func:`check_row_sums` passed on the weights of every batch
        row and head.
    """

    title: str
    batch_index: int
    cells: tuple[tuple[str, ...], ...]
    row_sums: tuple[float, ...]
    passed: bool


def _grid(order, valid_row) -> tuple[tuple[str, ...], ...]:
    T, S = order.shape
    return tuple(
        tuple(
            FUTURE if not order[i, j] else PADDING if not valid_row[j] else ALLOWED
            for j in range(S)
        )
        for i in range(T)
    )


def mask_examples(
    config: AttentionConfig, lengths, seq_len: int, kv_len: int | None = None, seed: int = 0
) -> list[MaskExample]:
    """The worked mask examples, one per batch row each.

    Self-attention (``kv_len=None``): the causal mask, key padding at
    ``lengths``, and their combination. Cross-attention: the source padding
    mask alone (no decoder triangle).
    """
    lengths = np.asarray(lengths, dtype=np.int32)
    B, T = len(lengths), seq_len
    S = seq_len if kv_len is None else kv_len
    N, K, H = config.n_heads, config.kv_heads, config.head_dim
    kq, kk = jax.random.split(jax.random.key(seed))
    q = jax.random.normal(kq, (B, T, N, H))
    k = jax.random.normal(kk, (B, S, K, H))  # K key heads: grouped-query when K < N
    valid = np.asarray(lengths_to_valid(lengths, S))  # (B, S)
    pad = np.asarray(padding_mask(valid))  # (B, 1, 1, S)
    no_order = np.ones((T, S), bool)

    if kv_len is None:
        causal = np.asarray(causal_mask(T))
        cases = [
            ("causal mask", causal, np.ones_like(valid), dict(is_causal=True)),
            (f"padding mask, lengths {lengths.tolist()}", no_order, valid, dict(mask=pad)),
            ("causal AND padding", causal, valid, dict(is_causal=True, mask=pad)),
        ]
    else:
        cases = [
            (
                f"source padding, lengths {lengths.tolist()} (no causal triangle)",
                no_order,
                valid,
                dict(mask=pad),
            )
        ]

    examples = []
    for title, order, kv_valid, mask_args in cases:
        weights = np.asarray(attention_weights(q, k, **mask_args))  # (B, N, T, S)
        allowed = order[None, None] & kv_valid[:, None, None, :]
        passed = check_row_sums(weights, allowed).passed
        for b in range(B):
            examples.append(
                MaskExample(
                    title,
                    b,
                    _grid(order, kv_valid[b]),
                    tuple(weights[b, 0].sum(-1).tolist()),
                    passed,
                )
            )
    return examples


def blocked_row_example(config: AttentionConfig, seq_len: int) -> dict:
    """A query that may see no key: its weights and its output must be all zeros."""
    N, H = config.n_heads, config.head_dim
    q = jax.random.normal(jax.random.key(1), (1, seq_len, N, H))
    k = v = q[:, :, : config.kv_heads]  # (1, S, K, H)
    lengths = jnp.zeros((1,), jnp.int32)
    weights = attention_weights(q, k, is_causal=True, kv_lengths=lengths)
    out = dot_product_attention(q, k, v, is_causal=True, kv_lengths=lengths)
    row_sum = float(jnp.abs(weights).sum(-1).max())
    out_max = float(jnp.abs(out).max())
    finite = bool(jnp.isfinite(out).all())
    return {
        "row_sum": row_sum,
        "output_max_abs": out_max,
        "passed": row_sum == 0.0 and out_max == 0.0 and finite,
    }


def verify_modules(config: AttentionConfig, seed: int = 0, stage=None) -> list[tuple[str, Report]]:
    """Runs ``nanoattn.verify`` on the built-in modules at ``config``'s sizes.

    ``stage(what)``, when given, is a context manager around each stage of the work
    (building the modules, then each check): ``nanoattn audit`` passes one that says
    on stderr what a slow stage is doing.
    """
    stage = stage or (lambda what: contextlib.nullcontext())
    D = config.d_model
    T, lengths = 9, np.array([9, 5])
    with stage("building CausalSelfAttention and CrossAttention and their weights"):
        x = jnp.ones((1, 3, D))
        self_attn = CausalSelfAttention(config, sow_weights=True)
        params = self_attn.init(jax.random.key(seed), x, deterministic=True)
        cross = CrossAttention(config)
        cross_params = cross.init(jax.random.key(seed), x, x, deterministic=True)
        valid = np.asarray(lengths_to_valid(lengths, T))
        xs = jax.random.normal(jax.random.key(seed + 1), (2, T, D))
        _, state = self_attn.apply(
            params, xs, deterministic=True, mask=padding_mask(valid), mutable="intermediates"
        )
        (weights,) = state["intermediates"]["attention_weights"]
        allowed = np.tril(np.ones((T, T), bool))[None, None] & valid[:, None, None, :]

    @jax.jit
    def causal(x):
        return self_attn.apply(params, x, deterministic=True)

    @jax.jit
    def padded(x, valid):
        return self_attn.apply(params, x, deterministic=True, mask=padding_mask(valid))

    @jax.jit
    def cross_padded(x, valid):
        return cross.apply(cross_params, x, x, deterministic=True, context_mask=valid)

    checks = [
        ("CausalSelfAttention causality", lambda: check_causality(causal, d_model=D, seed=seed)),
        ("CausalSelfAttention row sums", lambda: check_row_sums(weights, allowed)),
        ("CausalSelfAttention padding", lambda: check_padding(padded, d_model=D, seed=seed)),
        ("CrossAttention padding", lambda: check_padding(cross_padded, d_model=D, seed=seed)),
    ]
    reports = []
    for name, check in checks:
        with stage(f"verifying {name}"):
            reports.append((name, check()))
    return reports
