"""Validation of an attention call, shared by every backend.

:func:`attention_spec` checks the arguments of ``dot_product_attention`` and
``attention_weights`` once and returns an :class:`AttentionSpec`: the sizes and
the mask ingredients kept apart (dense mask, causal offset, key lengths), so a
backend can build a dense mask (the reference) or skip whole blocks (a
blockwise kernel) from the same validated description.
"""

import dataclasses
import math
from typing import Any

import jax.numpy as jnp
import numpy as np

from .block_mask import BlockMask
from .mask_fn import check_mask_fn, check_score_fn
from .validate import (
    as_array,
    expect_bool,
    expect_broadcastable,
    expect_flag,
    expect_floating,
    expect_integer,
    expect_shape,
    positive_number,
)

SCORE_AXES = "B N T S"


def normalize_window(window) -> tuple[int, int] | None:
    """A ``window`` argument as ``(left, right)``, or None.

    An int ``w`` means ``(w, w)``; a pair is ``(left, right)``: query at
    position p may see keys at positions ``p - left .. p + right``.

    Raises:
      TypeError: not None, an int or a pair of ints.
      ValueError: a negative side.
    """
    if window is None:
        return None
    pair = (window, window) if isinstance(window, int) and not isinstance(window, bool) else window
    try:
        left, right = pair
    except (TypeError, ValueError):
        raise TypeError(
            f"window must be an int w (meaning (w, w)) or a pair (left, right) of ints, "
            f"got {window!r}"
        ) from None
    for side in (left, right):
        if isinstance(side, bool) or not isinstance(side, (int, np.integer)):
            raise TypeError(
                f"window must be an int w (meaning (w, w)) or a pair (left, right) of ints, "
                f"got {window!r}"
            )
    if left < 0 or right < 0:
        raise ValueError(f"window sides must be >= 0, got (left, right) = ({left}, {right})")
    return int(left), int(right)


def check_soft_cap(cap) -> float | None:
    """A ``logit_soft_cap`` argument as a float > 0, or None (:func:`positive_number`)."""
    return positive_number("logit_soft_cap", cap, optional=True)


@dataclasses.dataclass(frozen=True)
class AttentionSpec:
    """A validated attention call. Shapes use the legend of docs/conventions.md.

    Attributes:
      B, T, S, N, K, H: batch, query time, key time, query heads, key/value
        heads and head width.
      mask: boolean, rank 4, broadcastable to (B, N, T, S), or None.
      bias: floating, rank 4, broadcastable to (B, N, T, S), or None.
      is_causal: whether the positional causal mask applies.
      q_offset: position of the first query (int, or int array () or (B,));
        None unless ``is_causal`` or ``window`` is set.
      kv_lengths: int array (B,) of valid key counts, or None.
      window: ``(left, right)`` of local attention, or None.
      q_segment_ids, kv_segment_ids: int arrays (B, T) and (B, S), or None.
      logit_soft_cap: the cap of ``cap * tanh(logits / cap)``, or None.
      scale: the factor applied to ``q . k``.
      return_residual: whether the call also returns the log-sum-exp (B, T, N).
      mask_fn: ``mask_fn(b, n, q_pos, k_pos) -> bool`` (:mod:`nanoattn._core.base.mask_fn`),
        a :class:`~nanoattn._core.base.block_mask.BlockMask`, or None.
      score_fn: ``score_fn(score, b, n, q_pos, k_pos) -> score``, or None.
      sinks: float (N,), one logit per query head added to each row's softmax
        denominator, or None.
    """

    B: int
    T: int
    S: int
    N: int
    K: int
    H: int
    mask: Any
    bias: Any
    is_causal: bool
    q_offset: Any
    kv_lengths: Any
    scale: float
    window: tuple[int, int] | None = None
    q_segment_ids: Any = None
    kv_segment_ids: Any = None
    logit_soft_cap: float | None = None
    return_residual: bool = False
    mask_fn: Any = None
    score_fn: Any = None
    sinks: Any = None

    @property
    def indexed(self) -> bool:
        """Whether a function of the cells' indices (``mask_fn``, ``score_fn``) applies."""
        return self.mask_fn is not None or self.score_fn is not None

    @property
    def index_offset(self):
        """The position of the first query as ``mask_fn`` and ``score_fn`` see it:
        ``q_offset``, 0 when none is given."""
        return 0 if self.q_offset is None else self.q_offset

    @property
    def positional(self) -> bool:
        """Whether a rule on positions (causality or a window) applies."""
        return self.is_causal or self.window is not None

    @property
    def band(self) -> tuple[int | None, int] | None:
        """The positional rule as ``(left, right)``: query at position p may see
        keys ``p - left .. p + right`` (``left`` None = unbounded); None when no
        positional rule applies. Causality is the band ``(None, 0)``."""
        if not self.positional:
            return None
        left, right = self.window if self.window is not None else (None, None)
        if self.is_causal:
            right = 0 if right is None else min(right, 0)
        return left, right

    @property
    def static_q_offset(self) -> int | None:
        """The offset as a Python int, or None when traced or not positional."""
        return self.q_offset if self.positional and isinstance(self.q_offset, int) else None

    @property
    def static_scale(self) -> bool:
        """Whether ``scale`` is a Python number (not a traced array)."""
        return isinstance(self.scale, (int, float, np.floating, np.integer))

    @property
    def G(self) -> int:
        """Query heads per key/value head."""
        return self.N // self.K

    @property
    def score_shape(self) -> tuple[int, int, int, int]:
        return (self.B, self.N, self.T, self.S)


def _as_rank4(x):
    return jnp.reshape(x, (1,) * (4 - x.ndim) + x.shape)


def attention_spec(
    query,
    key,
    value=None,
    *,
    mask=None,
    bias=None,
    is_causal=False,
    q_offset=None,
    kv_lengths=None,
    window=None,
    q_segment_ids=None,
    kv_segment_ids=None,
    logit_soft_cap=None,
    scale=None,
    return_residual=False,
    mask_fn=None,
    score_fn=None,
    sinks=None,
) -> AttentionSpec:
    """Checks an attention call (batched: :func:`batched` adds the axis to an
    unbatched one) and returns its :class:`AttentionSpec`.

    Raises:
      ValueError: a shape problem, naming the expected and the actual shape.
      TypeError: a mask that is not boolean, inputs of the wrong dtype kind, or an
        argument that is not an array (a string, None, ...), naming it.
    """
    query = as_array("query", query, "an array (B, T, N, H)")
    key = as_array("key", key, "an array (B, S, K, H)")
    expect_shape("query", query.shape, "B T N H", (None,) * 4)
    B, T, N, H = query.shape
    expect_shape("key", key.shape, "B S K H", (B, None, None, H))
    _, S, K, _ = key.shape
    if value is not None:
        value = as_array("value", value, "an array (B, S, K, H)")
        expect_shape("value", value.shape, "B S K H", (B, S, K, H))
    if K == 0 or N % K != 0:
        raise ValueError(
            f"the number of query heads N={N} must be a multiple of the number of key/value "
            f"heads K={K} (query shape (B, T, N, H) = {query.shape}, key shape "
            f"(B, S, K, H) = {key.shape})"
        )
    for name, x in (("query", query), ("key", key), ("value", value)):
        if x is not None:
            expect_floating(name, jnp.result_type(x))

    scores = (B, N, T, S)
    if mask is not None:
        mask = as_array("mask", mask, "a boolean array broadcastable to (B, N, T, S)")
        expect_bool("mask", mask.dtype)
        expect_broadcastable("mask", mask.shape, SCORE_AXES, scores)
        mask = _as_rank4(mask)
    if bias is not None:
        bias = as_array("bias", bias, "a float array broadcastable to (B, N, T, S)")
        expect_floating("bias", bias.dtype)
        expect_broadcastable("bias", bias.shape, SCORE_AXES, scores)
        bias = _as_rank4(bias)

    is_causal = expect_flag("is_causal", is_causal)
    return_residual = expect_flag("return_residual", return_residual)
    window = normalize_window(window)
    indexed = mask_fn is not None or score_fn is not None
    if not is_causal and window is None and not indexed and q_offset is not None:
        raise ValueError(
            "q_offset only applies to causal or windowed attention, or to the positions "
            "mask_fn and score_fn see; pass is_causal=True, a window, mask_fn or score_fn"
        )
    if is_causal or window is not None:
        what = "is_causal=True" if is_causal else f"window={window}"
        q_offset = _check_q_offset(q_offset, B, T, S, what)
    elif q_offset is not None:  # positions for mask_fn and score_fn only: 0 by default
        q_offset = _check_q_offset(q_offset, B, T, S, "mask_fn or score_fn")
    mask_fn = check_mask_fn(mask_fn, B, N, T, S, q_offset)
    if isinstance(mask_fn, BlockMask):
        mask_fn.check_fits(B, N, T, S, q_offset)
    score_fn = check_score_fn(score_fn, B, N, T, S, q_offset)
    sinks = check_sinks(sinks, N)
    if kv_lengths is not None:
        kv_lengths = as_array("kv_lengths", kv_lengths, "an int array (B,)")
        expect_integer("kv_lengths", kv_lengths.dtype)
        expect_shape("kv_lengths", kv_lengths.shape, "B", (B,))
    if (q_segment_ids is None) != (kv_segment_ids is None):
        raise ValueError(
            "q_segment_ids and kv_segment_ids go together: pass both (for self-attention "
            "over packed sequences, the same ids twice) or neither"
        )
    if q_segment_ids is not None:
        q_segment_ids = as_array("q_segment_ids", q_segment_ids, "an int array (B, T)")
        kv_segment_ids = as_array("kv_segment_ids", kv_segment_ids, "an int array (B, S)")
        expect_integer("q_segment_ids", q_segment_ids.dtype)
        expect_integer("kv_segment_ids", kv_segment_ids.dtype)
        expect_shape("q_segment_ids", q_segment_ids.shape, "B T", (B, T))
        expect_shape("kv_segment_ids", kv_segment_ids.shape, "B S", (B, S))
    logit_soft_cap = check_soft_cap(logit_soft_cap)
    if scale is None:
        scale = 1.0 / math.sqrt(H)
    return AttentionSpec(
        B, T, S, N, K, H, mask, bias, is_causal, q_offset, kv_lengths, scale, window,
        q_segment_ids, kv_segment_ids, logit_soft_cap, return_residual, mask_fn, score_fn,
        sinks,
    )  # fmt: skip


def check_sinks(sinks, N: int):
    """``sinks`` as a float array (N,), one logit per query head, or None."""
    if sinks is None:
        return None
    sinks = as_array("sinks", sinks, "a float array (N,), one logit per query head")
    expect_floating("sinks", sinks.dtype)
    expect_shape("sinks", sinks.shape, "N", (N,))
    return sinks


def _check_q_offset(q_offset, B: int, T: int, S: int, what: str):
    if q_offset is None:
        if T != S:
            raise ValueError(
                f"{what} with T={T} queries and S={S} keys needs q_offset, the "
                f"position of the first query: q_offset=0 aligns the queries top-left "
                f"(query i sits at key position i, as jax.nn and PyTorch's is_causal), "
                f"q_offset=S-T={S - T} aligns them bottom-right (the last query sits at the "
                f"last key, as FlashAttention and decoding with a KV cache)"
            )
        return 0
    what = "an int or an int array"
    if isinstance(q_offset, bool):
        raise TypeError(f"q_offset must be {what}, got bool {q_offset!r}")
    if isinstance(q_offset, int):
        return q_offset
    q_offset = as_array("q_offset", q_offset, what)
    expect_integer("q_offset", q_offset.dtype)
    if q_offset.ndim != 0:
        expect_shape("q_offset", q_offset.shape, "B", (B,))
    return q_offset


def batched(query, key, value, **rules):
    """An unbatched call made batched, as ``jax.nn.dot_product_attention`` takes it:
    query (T, N, H) with key and value (S, K, H) become (1, T, N, H) and (1, S, K, H),
    ``kv_lengths`` () becomes (1,), segment ids (T,) and (S,) become (1, T) and
    (1, S); a mask or bias broadcastable to (N, T, S) needs nothing. A batched
    call (query of any other rank) is returned as it is.

    Returns:
      ``(query, key, value, rules, unbatched)``; with ``unbatched``, the output
      (B, T, N, H), the log-sum-exp (B, T, N) and the weights (B, N, T, S) have
      the axis taken off again by the caller (``x[0]``).
    """
    query = as_array("query", query, "an array (B, T, N, H) or (T, N, H)")
    if query.ndim not in (3, 4):
        raise ValueError(f"query must have shape (B, T, N, H) or (T, N, H), got {query.shape}")
    if query.ndim == 4:
        return query, key, value, rules, False
    shapes = {"key": key, "value": value}
    for name, x in shapes.items():
        if x is not None:
            x = as_array(name, x, "an array (S, K, H)")
            if x.ndim != 3:
                raise ValueError(
                    f"query (T, N, H) = {query.shape} is unbatched, so {name} must be too: "
                    f"(S, K, H), got {x.shape}"
                )
            shapes[name] = x[None]
    rules = dict(rules)
    for name, rank in (("kv_lengths", 0), ("q_segment_ids", 1), ("kv_segment_ids", 1)):
        if rules.get(name) is not None:
            x = as_array(name, rules[name], "an int array")
            rules[name] = x[None] if x.ndim == rank else x
    return query[None], shapes["key"], shapes["value"], rules, True
