"""The data behind ``nanoattn audit``: a traced shape table and worked mask examples.

Nothing here is written by hand: the shape table comes from tracing the real
module under ``jax.eval_shape``, the masks from the library's mask builders and
the row sums from the library's own attention weights.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from ._attention import attention_weights, dot_product_attention
from ._masks import causal_mask, lengths_to_valid, padding_mask
from ._trace import Stage, record_shapes
from .linen import AttentionConfig, CausalSelfAttention, CrossAttention

# Cell kinds of a drawn mask. A cell blocked both by order and by padding is
# drawn as "future": the causal rule blocks it whatever the padding.
ALLOWED, FUTURE, PADDING = "allowed", "future", "padding"


@dataclasses.dataclass(frozen=True)
class StageCheck:
    """A traced stage and what the audit found wrong with it (empty: nothing)."""

    stage: Stage
    problems: tuple[str, ...]

    @property
    def ok(self) -> bool:
        return not self.problems


def axis_sizes(config: AttentionConfig, batch: int, seq_len: int, kv_len: int | None):
    """The size each axis token must have, e.g. ``{"B": 2, "3D": 384, ...}``."""
    D = config.d_model
    return {
        "B": batch,
        "T": seq_len,
        "S": seq_len if kv_len is None else kv_len,
        "N": config.n_heads,
        "H": config.head_dim,
        "D": D,
        "2D": 2 * D,
        "3D": 3 * D,
    }


def trace_stages(config: AttentionConfig, batch: int, seq_len: int, kv_len: int | None = None):
    """Traces one forward pass of the real module and returns its stages.

    ``kv_len=None`` traces :class:`CausalSelfAttention` on (B, T, D);
    otherwise :class:`CrossAttention` with a (B, S, D) context.
    """
    x = jax.ShapeDtypeStruct((batch, seq_len, config.d_model), jnp.float32)
    if kv_len is None:
        module, args = CausalSelfAttention(config), (x,)
    else:
        context = jax.ShapeDtypeStruct((batch, kv_len, config.d_model), jnp.float32)
        module, args = CrossAttention(config), (x, context)

    def forward(*inputs):
        return module.init_with_output(jax.random.key(0), *inputs, deterministic=True)

    with record_shapes() as stages:
        jax.eval_shape(forward, *args)
    return list(stages)


def check_stages(stages, sizes: dict[str, int]) -> list[StageCheck]:
    """Checks each stage: axis sizes as ``sizes`` says, and element counts kept.

    A ``reshape`` must keep its source's element count; the parts of a
    ``split`` must add up to their source's.
    """
    by_name = {s.name: s for s in stages}
    split_totals: dict[str, int] = {}
    for s in stages:
        if s.op == "split":
            split_totals[s.source] = split_totals.get(s.source, 0) + s.elements
    checks = []
    for s in stages:
        problems = []
        if len(s.axes) != len(s.shape):
            problems.append(f"{len(s.axes)} axis names for a rank-{len(s.shape)} shape")
        for axis, size in zip(s.axes, s.shape):
            if sizes.get(axis, size) != size:
                problems.append(f"axis {axis} has size {size}, expected {sizes[axis]}")
        source = by_name.get(s.source)
        if s.op == "reshape" and source is not None and source.elements != s.elements:
            problems.append(f"{s.elements} elements, but {s.source} had {source.elements}")
        if s.op == "split" and source is not None and split_totals[s.source] != source.elements:
            problems.append(
                f"the parts of {s.source} hold {split_totals[s.source]} elements, "
                f"it held {source.elements}"
            )
        checks.append(StageCheck(s, tuple(problems)))
    return checks


@dataclasses.dataclass(frozen=True)
class MaskExample:
    """A drawn mask for one batch row, with the row sums of the real weights.

    Attributes:
      title: what the mask shows.
      batch_index: which batch row is drawn.
      cells: a (T, S) grid of ALLOWED, FUTURE or PADDING.
      row_sums: (T,) sums of the weights over keys, per query (head 0).
      passed: every row with an allowed cell sums to 1, every blocked cell is
        exactly 0 and a row with no allowed cell is all zeros, in every head.
    """

    title: str
    batch_index: int
    cells: tuple[tuple[str, ...], ...]
    row_sums: tuple[float, ...]
    passed: bool


def _grid(causal, valid_row) -> tuple[tuple[str, ...], ...]:
    T, S = causal.shape
    return tuple(
        tuple(
            FUTURE if not causal[i, j] else PADDING if not valid_row[j] else ALLOWED
            for j in range(S)
        )
        for i in range(T)
    )


def _row_sums_ok(weights: np.ndarray, allowed: np.ndarray, atol: float = 1e-5) -> bool:
    sums = weights.sum(-1)
    any_allowed = np.broadcast_to(allowed, weights.shape).any(-1)
    rows_ok = np.where(any_allowed, np.abs(sums - 1) <= atol, sums == 0)
    return bool(rows_ok.all() and (weights[np.broadcast_to(~allowed, weights.shape)] == 0).all())


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
    N, H = config.n_heads, config.head_dim
    kq, kk = jax.random.split(jax.random.key(seed))
    q = jax.random.normal(kq, (B, T, N, H))
    k = jax.random.normal(kk, (B, S, N, H))
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
        passed = _row_sums_ok(weights, allowed)
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
    q = k = v = jax.random.normal(jax.random.key(1), (1, seq_len, N, H))
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
