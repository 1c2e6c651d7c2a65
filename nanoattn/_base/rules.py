"""The rules of an attention call, in one object made and validated once.

:meth:`Rules.make` checks the keywords of ``dot_product_attention`` (and of
``attention_weights``, ``flash_attention``, the ring and the adapters, which take the
same ones) and returns a :class:`Rules`: the sizes of the call and every rule that
decides which keys a query sees and how its scores are formed, kept apart (a dense
mask, the causal band with its offset, key lengths, segment ids, ``mask_fn``,
``score_fn``, sinks, the soft-cap, the scale), so a backend can build a dense mask
(the reference) or skip whole blocks (a blockwise kernel) from the same description.

A :class:`Rules` is a pytree: its arrays (mask, bias, a traced offset, key lengths,
segment ids, sinks, a traced scale) are its leaves and everything static (sizes,
causality, window, soft-cap, a Python scale or offset, ``mask_fn``, ``score_fn``) its
metadata, so it crosses ``jit``, ``custom_vjp`` and ``shard_map`` whole and no rule
travels as a loose positional argument.

Adding a rule (docs/architecture.md): a field here, its check in :meth:`Rules.make`
(one helper), its name in :meth:`Rules.active`, and its meaning in the reference
kernel (``nanoattn._backends.xla.reference``); a backend that does not list it in its
``serves`` is refused for calls that use it, with the names of the backends that do.
"""

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

from .block_mask import BlockMask
from .mask_fn import check_mask_fn, check_score_fn
from .paged import check_paged, token_layout
from .quantized import check_kv_scales, is_quantized
from .validate import (
    as_array,
    expect_bool,
    expect_broadcastable,
    expect_flag,
    expect_floating,
    expect_integer,
    expect_shape,
    lengths_outside,
    lengths_within,
    positive_number,
)

SCORE_AXES = "B N T S"
# The keyword arguments of a call that Rules.make takes, in the order of the public
# signatures (dot_product_attention's, after query, key and value).
ARGUMENTS = (
    "mask", "bias", "is_causal", "q_offset", "kv_lengths", "window", "q_segment_ids",
    "kv_segment_ids", "logit_soft_cap", "scale", "mask_fn", "score_fn", "sinks",
    "return_residual", "key_scales", "value_scales",
)  # fmt: skip
# How an error names each rule of Rules.active.
RULE_NAMES = {
    "mask": "a dense mask",
    "bias": "a bias",
    "is_causal": "is_causal",
    "window": "window",
    "kv_lengths": "kv_lengths",
    "segment_ids": "segment ids",
    "logit_soft_cap": "logit_soft_cap",
    "mask_fn": "mask_fn",
    "score_fn": "score_fn",
    "sinks": "sinks",
    "page_table": "a page table (paged_attention)",
    "kv_scales": "a quantized cache (key_scales, value_scales)",
    "value_width": "a value head width Hv other than H",
}


# A field of the pytree's metadata (hashable, never traced); the others are its leaves.
STATIC = dict(static=True)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Rules:
    """The rules of one attention call. Shapes use the legend of docs/conventions.md.

    Attributes:
      B, T, S, N, K, H: batch, query time, key time, query heads, key/value heads and
        head width (of queries and keys).
      Hv: the head width of values and of the output (H unless the values have a
        width of their own, as in multi-head latent attention; docs/latent.md).
      mask: boolean, rank 4, broadcastable to (B, N, T, S), or None.
      bias: floating, rank 4, broadcastable to (B, N, T, S), or None.
      is_causal: whether the positional causal mask applies.
      static_offset: the position of the first query as a Python int, or None.
      offset: the position of the first query as an int array () or (B,) (traced or
        not), or None; at most one of ``static_offset`` and ``offset`` is set, and
        :attr:`q_offset` reads whichever is.
      kv_lengths: int array (B,) of valid key counts, or None.
      window: ``(left, right)`` of local attention, or None.
      q_segment_ids, kv_segment_ids: int arrays (B, T) and (B, S), or None.
      logit_soft_cap: the cap of ``cap * tanh(logits / cap)``, or None.
      fixed_scale: the factor applied to ``q . k`` as a Python number, or None.
      traced_scale: the factor as a scalar array (a traced one under ``jit``), or
        None; :attr:`scale` reads whichever is set.
      mask_fn: ``mask_fn(b, n, q_pos, k_pos) -> bool`` (:mod:`.mask_fn`), a
        :class:`~nanoattn._base.block_mask.BlockMask`, or None.
      score_fn: ``score_fn(score, b, n, q_pos, k_pos) -> score``, or None.
      sinks: float (N,), one logit per query head added to each row's softmax
        denominator, or None.
      return_residual: whether the call also returns the log-sum-exp (B, T, N).
      page_table, query_starts, page_size, pool_pages: a paged call's
        (:meth:`make_paged`, :mod:`.paged`): the page table (B, M) of B sequences,
        the starts (B + 1,) of their query rows among the T = Tq tokens, the keys per
        page and the pages of the pool (P); S = M * page_size is the most keys a
        sequence holds, and ``kv_lengths`` (B,) the keys each holds. None otherwise.
      key_scales, value_scales: float (B, S, K) (a paged call's (P, page_size, K)),
        the scales of quantized keys and values (:mod:`.quantized`): key token s of
        head k is ``key[b, s, k] * key_scales[b, s, k]``; None for float keys.
    """

    B: int = dataclasses.field(metadata=STATIC)
    T: int = dataclasses.field(metadata=STATIC)
    S: int = dataclasses.field(metadata=STATIC)
    N: int = dataclasses.field(metadata=STATIC)
    K: int = dataclasses.field(metadata=STATIC)
    H: int = dataclasses.field(metadata=STATIC)
    Hv: int = dataclasses.field(metadata=STATIC)
    mask: Any = None
    bias: Any = None
    is_causal: bool = dataclasses.field(default=False, metadata=STATIC)
    static_offset: int | None = dataclasses.field(default=None, metadata=STATIC)
    offset: Any = None
    kv_lengths: Any = None
    window: tuple[int, int] | None = dataclasses.field(default=None, metadata=STATIC)
    q_segment_ids: Any = None
    kv_segment_ids: Any = None
    logit_soft_cap: float | None = dataclasses.field(default=None, metadata=STATIC)
    fixed_scale: float | None = dataclasses.field(default=None, metadata=STATIC)
    traced_scale: Any = None
    mask_fn: Any = dataclasses.field(default=None, metadata=STATIC)
    score_fn: Any = dataclasses.field(default=None, metadata=STATIC)
    sinks: Any = None
    return_residual: bool = dataclasses.field(default=False, metadata=STATIC)
    page_table: Any = None
    query_starts: Any = None
    page_size: int | None = dataclasses.field(default=None, metadata=STATIC)
    pool_pages: int | None = dataclasses.field(default=None, metadata=STATIC)
    key_scales: Any = None
    value_scales: Any = None

    @classmethod
    def make(cls, query, key, value=None, **arguments) -> "Rules":
        """Checks a batched call (:func:`batched` adds the axis to an unbatched one)
        and returns its rules. ``arguments`` are keywords of :data:`ARGUMENTS`.

        Raises:
          ValueError: a shape problem, naming the expected and the actual shape.
          TypeError: a mask that is not boolean, inputs of the wrong dtype kind, or an
            argument that is not an array (a string, None, ...), naming it.
        """
        unknown = sorted(set(arguments) - set(ARGUMENTS))
        if unknown:
            raise TypeError(f"unknown rule arguments {unknown}; the rules are {ARGUMENTS}")
        a = dict.fromkeys(ARGUMENTS) | dict(is_causal=False, return_residual=False) | arguments
        B, T, S, N, K, H, Hv = _sizes(query, key, value)
        scores = (B, N, T, S)
        mask, bias = _check_mask(a["mask"], scores), _check_bias(a["bias"], scores)
        is_causal = expect_flag("is_causal", a["is_causal"])
        return_residual = expect_flag("return_residual", a["return_residual"])
        window = normalize_window(a["window"])
        indexed = a["mask_fn"] is not None or a["score_fn"] is not None
        q_offset = _check_q_offset(a["q_offset"], B, T, S, is_causal, window, indexed)
        mask_fn = check_mask_fn(a["mask_fn"], B, N, T, S, q_offset)
        if isinstance(mask_fn, BlockMask):
            mask_fn.check_fits(B, N, T, S, q_offset)
        score_fn = check_score_fn(a["score_fn"], B, N, T, S, q_offset)
        sinks = check_sinks(a["sinks"], N)
        kv_lengths = check_lengths(a["kv_lengths"], B, S)
        q_ids, kv_ids = _check_segments(a["q_segment_ids"], a["kv_segment_ids"], B, T, S)
        logit_soft_cap = check_soft_cap(a["logit_soft_cap"])
        fixed_scale, traced_scale = _split_scale(a["scale"], H)
        key_scales, value_scales = check_kv_scales(
            jnp.asarray(key), None if value is None else jnp.asarray(value), a["key_scales"],
            a["value_scales"], "B S K",
        )  # fmt: skip
        static = isinstance(q_offset, int)
        return cls(
            B=B, T=T, S=S, N=N, K=K, H=H, Hv=Hv, mask=mask, bias=bias, is_causal=is_causal,
            static_offset=q_offset if static else None, offset=None if static else q_offset,
            kv_lengths=kv_lengths, window=window, q_segment_ids=q_ids, kv_segment_ids=kv_ids,
            logit_soft_cap=logit_soft_cap, fixed_scale=fixed_scale, traced_scale=traced_scale,
            mask_fn=mask_fn, score_fn=score_fn, sinks=sinks, return_residual=return_residual,
            key_scales=key_scales, value_scales=value_scales,
        )  # fmt: skip

    @classmethod
    def make_paged(cls, query, key_pages, value_pages, page_table, kv_lengths, query_starts,
                   **arguments) -> "Rules":  # fmt: skip
        """Checks a paged call (``nanoattn.paged_attention``) and returns its rules:
        sizes B (sequences), T (query tokens), S (the most keys a sequence holds), N,
        K, H. ``arguments`` are ``is_causal``, ``window``, ``logit_soft_cap``,
        ``scale``, ``sinks``, ``mask_fn``, ``score_fn``, ``return_residual``, and
        ``key_scales`` and ``value_scales`` (P, page_size, K) of quantized pages.

        Raises:
          ValueError: a shape problem, or a value of the page table, the lengths or
            the starts that is invalid when concrete, naming the argument and the row.
        """
        allowed = {"is_causal", "window", "logit_soft_cap", "scale", "sinks", "mask_fn",
                   "score_fn", "return_residual", "key_scales", "value_scales"}  # fmt: skip
        unknown = sorted(set(arguments) - allowed)
        if unknown:
            raise TypeError(f"unknown arguments of a paged call {unknown}")
        arrays, sizes = check_paged(
            query, key_pages, value_pages, page_table, kv_lengths, query_starts
        )
        Tq, N, H, Hv, P, page_size, K, B, M = sizes
        S = M * page_size
        a = dict(is_causal=True, return_residual=False) | arguments
        is_causal = expect_flag("is_causal", a["is_causal"])
        window = normalize_window(a.get("window"))
        # mask_fn and score_fn are checked on cells of real positions: queries at the
        # end of a sequence that holds all S keys
        T_probe = max(1, min(Tq, S))
        mask_fn = check_mask_fn(a.get("mask_fn"), B, N, T_probe, S, S - T_probe)
        if isinstance(mask_fn, BlockMask):
            raise TypeError(
                "mask_fn of a paged call must be a function, not a BlockMask (its blocks "
                "are those of one (T, S) grid, not of pages)"
            )
        score_fn = check_score_fn(a.get("score_fn"), B, N, T_probe, S, S - T_probe)
        fixed_scale, traced_scale = _split_scale(a.get("scale"), H)
        key_scales, value_scales = check_kv_scales(
            arrays[1], arrays[2], a.get("key_scales"), a.get("value_scales"), "P page_size K"
        )
        return cls(
            B=B, T=Tq, S=S, N=N, K=K, H=H, Hv=Hv, is_causal=is_causal, kv_lengths=arrays[4],
            window=window, logit_soft_cap=check_soft_cap(a.get("logit_soft_cap")),
            fixed_scale=fixed_scale, traced_scale=traced_scale, mask_fn=mask_fn,
            score_fn=score_fn, sinks=check_sinks(a.get("sinks"), N),
            return_residual=expect_flag("return_residual", a["return_residual"]),
            page_table=arrays[3], query_starts=arrays[5], page_size=page_size, pool_pages=P,
            key_scales=key_scales, value_scales=value_scales,
        )  # fmt: skip

    @property
    def paged(self) -> bool:
        """Whether this is a paged call (``nanoattn.paged_attention``)."""
        return self.page_table is not None

    def layout(self):
        """A paged call's :class:`~nanoattn._base.paged.TokenLayout` (each query
        row's sequence and position, which rows are real and which broken)."""
        return token_layout(
            self.page_table, self.kv_lengths, self.query_starts, self.T, self.pool_pages,
            self.page_size,
        )  # fmt: skip

    def arguments(self) -> dict:
        """The keywords that :meth:`make` turns into these rules (the inverse of make,
        for a call made again on other arrays, such as a shard of these)."""
        return dict(
            mask=self.mask, bias=self.bias, is_causal=self.is_causal, q_offset=self.q_offset,
            kv_lengths=self.kv_lengths, window=self.window, q_segment_ids=self.q_segment_ids,
            kv_segment_ids=self.kv_segment_ids, logit_soft_cap=self.logit_soft_cap,
            scale=self.scale, mask_fn=self.mask_fn, score_fn=self.score_fn, sinks=self.sinks,
            return_residual=self.return_residual, key_scales=self.key_scales,
            value_scales=self.value_scales,
        )  # fmt: skip

    def active(self) -> tuple[str, ...]:
        """The names of the rules this call uses (the keys of :data:`RULE_NAMES`): what
        a backend must serve to take the call."""
        uses = {
            "mask": self.mask is not None,
            "bias": self.bias is not None,
            "is_causal": self.is_causal,
            "window": self.window is not None,
            "kv_lengths": self.kv_lengths is not None,
            "segment_ids": self.q_segment_ids is not None,
            "logit_soft_cap": self.logit_soft_cap is not None,
            "mask_fn": self.mask_fn is not None,
            "score_fn": self.score_fn is not None,
            "sinks": self.sinks is not None,
            "page_table": self.page_table is not None,
            "kv_scales": self.key_scales is not None,
            "value_width": self.Hv != self.H,
        }
        return tuple(name for name, used in uses.items() if used)

    def broken_rows(self, most: int | None = None):
        """(B,) bool: the batch rows whose ``kv_lengths`` are outside [0, ``most``]
        (default S), which cannot be checked under ``jit`` (a concrete one raised in
        :meth:`make`): their outputs must be NaN (:func:`poison_rows`); None without
        key lengths."""
        if self.paged:  # a paged call's broken rows are query tokens (T,)
            return self.layout().broken
        if self.kv_lengths is None:
            return None
        return lengths_outside(self.kv_lengths, self.S if most is None else most)

    def replace(self, **changes) -> "Rules":
        """These rules with ``changes`` (field names, or ``q_offset``: an int, an int
        array or None, stored in the field it belongs to)."""
        if "q_offset" in changes:
            q_offset = changes.pop("q_offset")
            static = isinstance(q_offset, int) and not isinstance(q_offset, bool)
            changes["static_offset"] = q_offset if static else None
            changes["offset"] = None if static else q_offset
        return dataclasses.replace(self, **changes)

    def partition_specs(self, sequence=None, heads=None) -> "Rules":
        """How these rules' arrays are laid out when queries and keys are split over the
        mesh axes ``sequence`` (their T and S, axis 1) and ``heads`` (N and K): these
        rules with a ``PartitionSpec`` for each array, ``jax.shard_map``'s ``in_specs``
        for them. Segment ids follow the sequence, sinks the heads; key lengths (global
        positions), a traced offset and a traced scale are replicated.

        Raises:
          ValueError: a dense mask or a bias, which cannot follow keys that move
            between devices (use ``mask_fn`` or ``score_fn``).
        """
        if self.mask is not None or self.bias is not None:
            raise ValueError(
                "a dense mask or a bias cannot be split over the sequence axis; give the "
                "rule as mask_fn or score_fn"
            )
        specs = dict(
            offset=PartitionSpec(), kv_lengths=PartitionSpec(), traced_scale=PartitionSpec(),
            q_segment_ids=PartitionSpec(None, sequence),
            kv_segment_ids=PartitionSpec(None, sequence), sinks=PartitionSpec(heads),
            key_scales=PartitionSpec(None, sequence, heads),
            value_scales=PartitionSpec(None, sequence, heads),
        )  # fmt: skip
        return dataclasses.replace(
            self, **{name: spec for name, spec in specs.items() if getattr(self, name) is not None}
        )

    @property
    def q_offset(self):
        """The position of the first query: a Python int, an int array () or (B,), or
        None (none was given: 0 where one applies)."""
        return self.static_offset if self.offset is None else self.offset

    @property
    def scale(self):
        """The factor on ``q . k``: a Python number, or a scalar array."""
        return self.fixed_scale if self.traced_scale is None else self.traced_scale

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
        return self.static_offset if self.positional else None

    @property
    def static_scale(self) -> bool:
        """Whether ``scale`` is a Python number (not an array, traced or not)."""
        return self.traced_scale is None

    @property
    def G(self) -> int:
        """Query heads per key/value head."""
        return self.N // self.K

    @property
    def score_shape(self) -> tuple[int, int, int, int]:
        return (self.B, self.N, self.T, self.S)


def poison_rows(result, broken):
    """``result`` (an output (B, T, ...) or a tuple of such, the log-sum-exp too) with
    NaN in every batch row where ``broken`` (B,) is True; ``result`` itself when
    ``broken`` is None. A value that cannot be checked under ``jit`` (key lengths out
    of range) shows as NaN in its rows, never as a finite wrong answer; no other row
    changes, and the gradients stay finite."""
    if broken is None:
        return result

    def poison(x):
        where = broken.reshape((-1,) + (1,) * (x.ndim - 1))
        return jnp.where(where, jnp.asarray(jnp.nan, x.dtype), x)

    return jax.tree.map(poison, result)


def normalize_window(window) -> tuple[int, int] | None:
    """A ``window`` argument as ``(left, right)``, or None.

    An int ``w`` means ``(w, w)``; a pair is ``(left, right)``: query at position p may
    see keys at positions ``p - left .. p + right``.

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


def check_sinks(sinks, N: int):
    """``sinks`` as a float array (N,), one logit per query head, or None."""
    if sinks is None:
        return None
    sinks = as_array("sinks", sinks, "a float array (N,), one logit per query head")
    expect_floating("sinks", sinks.dtype)
    expect_shape("sinks", sinks.shape, "N", (N,))
    return sinks


def _sizes(query, key, value) -> tuple[int, ...]:
    """(B, T, S, N, K, H, Hv) of query (B, T, N, H), key (B, S, K, H) and value
    (B, S, K, Hv) (Hv = H without a value)."""
    query = as_array("query", query, "an array (B, T, N, H)")
    key = as_array("key", key, "an array (B, S, K, H)")
    expect_shape("query", query.shape, "B T N H", (None,) * 4)
    B, T, N, H = query.shape
    expect_shape("key", key.shape, "B S K H", (B, None, None, H))
    _, S, K, _ = key.shape
    Hv = H
    if value is not None:
        value = as_array("value", value, "an array (B, S, K, Hv)")
        expect_shape("value", value.shape, "B S K Hv", (B, S, K, None))
        Hv = value.shape[3]
    if K == 0 or N % K != 0:
        raise ValueError(
            f"the number of query heads N={N} must be a multiple of the number of key/value "
            f"heads K={K} (query shape (B, T, N, H) = {query.shape}, key shape "
            f"(B, S, K, H) = {key.shape})"
        )
    for name, x in (("query", query), ("key", key), ("value", value)):
        if x is not None and not (name != "query" and is_quantized(x)):  # scales: make
            expect_floating(name, jnp.result_type(x))
    return B, T, S, N, K, H, Hv


def _as_rank4(x):
    return jnp.reshape(x, (1,) * (4 - x.ndim) + x.shape)


def _check_mask(mask, scores):
    if mask is None:
        return None
    mask = as_array("mask", mask, "a boolean array broadcastable to (B, N, T, S)")
    expect_bool("mask", mask.dtype)
    expect_broadcastable("mask", mask.shape, SCORE_AXES, scores)
    return _as_rank4(mask)


def _check_bias(bias, scores):
    if bias is None:
        return None
    bias = as_array("bias", bias, "a float array broadcastable to (B, N, T, S)")
    expect_floating("bias", bias.dtype)
    expect_broadcastable("bias", bias.shape, SCORE_AXES, scores)
    return _as_rank4(bias)


def check_lengths(kv_lengths, B: int, most: int):
    """``kv_lengths`` as an int array (B,) of values in [0, ``most``] (S, or the whole
    sequence of a ring) when concrete; a traced one's rows outside it are made NaN
    (:meth:`Rules.broken_rows`)."""
    if kv_lengths is None:
        return None
    kv_lengths = as_array("kv_lengths", kv_lengths, "an int array (B,)")
    expect_integer("kv_lengths", kv_lengths.dtype)
    expect_shape("kv_lengths", kv_lengths.shape, "B", (B,))
    lengths_within("kv_lengths", kv_lengths, most)
    return kv_lengths


def _check_segments(q_ids, kv_ids, B: int, T: int, S: int):
    if (q_ids is None) != (kv_ids is None):
        raise ValueError(
            "q_segment_ids and kv_segment_ids go together: pass both (for self-attention "
            "over packed sequences, the same ids twice) or neither"
        )
    if q_ids is None:
        return None, None
    q_ids = as_array("q_segment_ids", q_ids, "an int array (B, T)")
    kv_ids = as_array("kv_segment_ids", kv_ids, "an int array (B, S)")
    expect_integer("q_segment_ids", q_ids.dtype)
    expect_integer("kv_segment_ids", kv_ids.dtype)
    expect_shape("q_segment_ids", q_ids.shape, "B T", (B, T))
    expect_shape("kv_segment_ids", kv_ids.shape, "B S", (B, S))
    return q_ids, kv_ids


def _split_scale(scale, H: int):
    """(fixed, traced): a checked scale (``check_scale`` upstream) as a Python number
    or as an array; the default ``1 / sqrt(H)`` when None."""
    if scale is None:
        if H == 0:
            raise ValueError(
                "the head width H is 0, so the default scale 1 / sqrt(H) does not exist: "
                "pass scale= (or heads of width >= 1)"
            )
        return 1.0 / math.sqrt(H), None
    if isinstance(scale, (int, float, np.floating, np.integer)):
        return scale, None
    return None, scale


def _check_q_offset(q_offset, B: int, T: int, S: int, is_causal: bool, window, indexed: bool):
    """The offset of a call: an int, an int array () or (B,), or None."""
    if not is_causal and window is None and not indexed and q_offset is not None:
        raise ValueError(
            "q_offset only applies to causal or windowed attention, or to the positions "
            "mask_fn and score_fn see; pass is_causal=True, a window, mask_fn or score_fn"
        )
    if is_causal or window is not None:
        what = "is_causal=True" if is_causal else f"window={window}"
    elif q_offset is not None:  # positions for mask_fn and score_fn only: 0 by default
        what = "mask_fn or score_fn"
    else:
        return None
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
    kind = "an int or an int array"
    if isinstance(q_offset, bool):
        raise TypeError(f"q_offset must be {kind}, got bool {q_offset!r}")
    if isinstance(q_offset, int):
        return q_offset
    q_offset = as_array("q_offset", q_offset, kind)
    expect_integer("q_offset", q_offset.dtype)
    if q_offset.ndim != 0:
        expect_shape("q_offset", q_offset.shape, "B", (B,))
    return q_offset


def batched(query, key, value, **rules):
    """An unbatched call made batched, as ``jax.nn.dot_product_attention`` takes it:
    query (T, N, H) with key and value (S, K, H) become (1, T, N, H) and (1, S, K, H),
    ``kv_lengths`` () becomes (1,), segment ids (T,) and (S,) become (1, T) and
    (1, S), key and value scales (S, K) become (1, S, K); a mask or bias broadcastable to
    (N, T, S) needs nothing. A batched call (query of any other rank) is returned as it is.

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
    ranks = (("kv_lengths", 0), ("q_segment_ids", 1), ("kv_segment_ids", 1),
             ("key_scales", 2), ("value_scales", 2))  # fmt: skip
    for name, rank in ranks:
        if rules.get(name) is not None:
            x = as_array(name, rules[name], "an array")
            rules[name] = x[None] if x.ndim == rank else x
    return query[None], shapes["key"], shapes["value"], rules, True
