"""The table of the rules of a call: each rule listed once, with everything the rest
of the package asks of it.

A :class:`Rule` says its name (what ``Rules.active`` and a backend's ``serves``
call it, and how an error names it), the public keywords it takes, the fields of
:class:`~nanoattn._base.rules.Rules` it fills (array leaves or static metadata, each
with its partition spec over a mesh), its check (one helper of :mod:`.rule_checks`),
whether a call uses it, the rank of each keyword's unbatched form, and whether a paged
call (``nanoattn.paged_attention``) takes it. ``Rules.make``, ``Rules.make_paged``,
``Rules.arguments``, ``Rules.active``, ``Rules.partition_specs``, ``batched``, the
ring and the sharded layer all read :data:`TABLE`; adding a rule is one entry here,
its meaning in the reference kernel and its test (docs/architecture.md). The axis
letters are those of :mod:`.rule_checks`.
"""

import dataclasses
from collections.abc import Callable
from typing import Any

from .block_mask import BlockMask
from .mask_fn import check_mask_fn, check_score_fn
from .quantized import check_kv_scales
from .rule_checks import (
    check_lengths,
    check_q_offset,
    check_scores_array,
    check_segments,
    check_sinks,
    check_soft_cap,
    normalize_window,
    split_scale,
)
from .selection import check_key_indices, refuse_combined
from .tree import check_paged_tree, check_tree
from .validate import expect_flag

# Partition specs name the roles of an array's axes: "sequence" for T or S (split over
# the mesh's sequence axis), "heads" for N or K, None for an axis never split.
# REPLICATED is an array every device holds whole; UNSPLIT one that cannot follow keys
# moving between devices (sharding a call that has it raises).
REPLICATED = ()
UNSPLIT = "unsplit"


@dataclasses.dataclass(frozen=True)
class Field:
    """One field of :class:`~nanoattn._base.rules.Rules`.

    Attributes:
      name: the field's name.
      doc: what it holds, for the docstring of Rules.
      static: metadata of the pytree (hashable, never traced) rather than a leaf.
      default: its value when the call does not use the rule.
      spec: for a leaf, its axes' roles (a tuple of "sequence", "heads" or None), or
        :data:`REPLICATED`, or :data:`UNSPLIT`.
    """

    name: str
    doc: str
    static: bool = False
    default: Any = None
    spec: Any = REPLICATED


@dataclasses.dataclass(frozen=True)
class Context:
    """What a rule's check sees: the call's sizes (B, T, S, N, K, H, Hv), its arrays
    (query, key, value: pages for a paged call), every keyword of the table (None
    where not given), the fields checked so far, and a paged call's own arrays (the
    page table, key lengths, query starts, and its page size and pool) or None."""

    sizes: dict
    query: Any
    key: Any
    value: Any
    given: dict
    fields: dict
    paged: dict | None = None


@dataclasses.dataclass(frozen=True)
class Rule:
    """One rule of a call (see the module docstring).

    Attributes:
      name: its name in ``Rules.active`` and a backend's ``serves``, or None for an
        option of the call that no backend refuses (``q_offset``, ``scale``,
        ``return_residual``).
      message: how an error names it ("... is served by 'xla' only").
      keywords: the public keywords it takes, in the order of the signatures.
      fields: the :class:`Field` s of Rules it fills.
      check: ``check(context) -> {field: value}``: validates its keywords (raising
        one line naming the argument) and returns its fields.
      used: ``used(rules) -> bool``, whether a call uses it (None for an option).
      ranks: for a keyword whose unbatched form lacks the batch axis, its rank there.
      paged: whether a paged call takes its keywords.
      paged_check: a paged call's own check, where it differs.
      keyword_of: ``keyword_of(rules) -> {keyword: value}``, the keywords that give
        its fields again (default: each keyword is the field of its name).
    """

    name: str | None
    message: str | None
    keywords: tuple[str, ...]
    fields: tuple[Field, ...]
    check: Callable[[Context], dict]
    used: Callable[[Any], bool] | None = None
    ranks: dict = dataclasses.field(default_factory=dict)
    paged: bool = False
    paged_check: Callable[[Context], dict] | None = None
    keyword_of: Callable[[Any], dict] | None = None


def _scores(c: Context):
    s = c.sizes
    return (s["B"], s["N"], s["T"], s["S"])


def _indexed(c: Context) -> bool:
    return c.given["mask_fn"] is not None or c.given["score_fn"] is not None


def _q_offset(c: Context) -> dict:
    s = c.sizes
    window = c.fields["window"]
    q_offset = check_q_offset(c.given["q_offset"], s["B"], s["T"], s["S"],
                              c.fields["is_causal"], window, _indexed(c))  # fmt: skip
    static = isinstance(q_offset, int)
    return dict(static_offset=q_offset if static else None, offset=None if static else q_offset)


def _offset_of(c: Context):
    return c.fields["static_offset"] if c.fields["offset"] is None else c.fields["offset"]


def _mask_fn(c: Context) -> dict:
    s, q_offset = c.sizes, _offset_of(c)
    mask_fn = check_mask_fn(c.given["mask_fn"], s["B"], s["N"], s["T"], s["S"], q_offset)
    if isinstance(mask_fn, BlockMask):
        mask_fn.check_fits(s["B"], s["N"], s["T"], s["S"], q_offset)
    return dict(mask_fn=mask_fn)


def _probe(c: Context) -> tuple[int, int]:
    """A paged call's functions are checked on cells of real positions: (T, q_offset)
    of queries at the end of a sequence that holds all S keys."""
    T = max(1, min(c.sizes["T"], c.sizes["S"]))
    return T, c.sizes["S"] - T


def _paged_mask_fn(c: Context) -> dict:
    s, (T, offset) = c.sizes, _probe(c)
    mask_fn = check_mask_fn(c.given["mask_fn"], s["B"], s["N"], T, s["S"], offset)
    if isinstance(mask_fn, BlockMask):
        raise TypeError(
            "mask_fn of a paged call must be a function, not a BlockMask (its blocks are "
            "those of one (T, S) grid, not of pages)"
        )
    return dict(mask_fn=mask_fn)


def _score_fn(c: Context) -> dict:
    s = c.sizes
    if c.paged is not None:
        T, offset = _probe(c)
    else:
        T, offset = s["T"], _offset_of(c)
    return dict(score_fn=check_score_fn(c.given["score_fn"], s["B"], s["N"], T, s["S"], offset))


def _kv_scales(c: Context) -> dict:
    axes = "B S K" if c.paged is None else "P page_size K"
    key_scales, value_scales = check_kv_scales(
        c.key, c.value, c.given["key_scales"], c.given["value_scales"], axes
    )
    return dict(key_scales=key_scales, value_scales=value_scales)


def _scale(c: Context) -> dict:
    fixed, traced = split_scale(c.given["scale"], c.sizes["H"])
    return dict(fixed_scale=fixed, traced_scale=traced)


def _paged_tree(c: Context) -> dict:
    parents = check_tree(c.given["tree_parents"], (c.sizes["T"],), "Tq")
    check_paged_tree(parents, c.paged["query_starts"])
    return dict(tree_parents=parents)


def _key_indices(c: Context) -> dict:
    s = c.sizes
    refuse_combined(c.given)
    if c.paged is None:
        return dict(key_indices=check_key_indices(c.given["key_indices"], (s["B"], s["T"]),
                                                  "B T k", s["S"]))  # fmt: skip
    return dict(key_indices=check_key_indices(c.given["key_indices"], (s["T"],), "Tq k", s["S"]))


def _paged_arrays(c: Context) -> dict:
    if c.paged is None:
        return dict(page_table=None, query_starts=None, page_size=None, pool_pages=None)
    p = c.paged
    return dict(page_table=p["page_table"], query_starts=p["query_starts"],
                page_size=p["page_size"], pool_pages=p["pool_pages"])  # fmt: skip


def _flag(name: str) -> Callable[[Context], dict]:
    return lambda c: {name: expect_flag(name, c.given[name])}


def _one(name: str, check: Callable) -> Callable[[Context], dict]:
    """A check of one keyword that fills the field of its name."""
    return lambda c: {name: check(c.given[name], c)}


# fmt: off
TABLE: tuple[Rule, ...] = (
    Rule(
        "mask", "a dense mask", ("mask",),
        (Field("mask", "boolean, rank 4, broadcastable to (B, N, T, S), or None.", spec=UNSPLIT),),
        _one("mask", lambda x, c: check_scores_array("mask", x, _scores(c))),
        used=lambda r: r.mask is not None,
    ),
    Rule(
        "bias", "a bias", ("bias",),
        (Field("bias", "floating, rank 4, broadcastable to (B, N, T, S), or None.",
               spec=UNSPLIT),),
        _one("bias", lambda x, c: check_scores_array("bias", x, _scores(c))),
        used=lambda r: r.bias is not None,
    ),
    Rule(
        "is_causal", "is_causal", ("is_causal",),
        (Field("is_causal", "whether the positional causal mask applies.", static=True,
               default=False),),
        _flag("is_causal"), used=lambda r: r.is_causal, paged=True,
    ),
    Rule(
        "window", "window", ("window",),
        (Field("window", "``(left, right)`` of local attention, or None.", static=True),),
        _one("window", lambda x, c: normalize_window(x)),
        used=lambda r: r.window is not None, paged=True,
    ),
    Rule(
        None, None, ("q_offset",),
        (
            Field("static_offset", "the position of the first query as a Python int, or None.",
                  static=True),
            Field("offset", "the position of the first query as an int array () or (B,) "
                  "(traced or not), or None; at most one of ``static_offset`` and "
                  "``offset`` is set, and ``q_offset`` reads whichever is."),
        ),
        _q_offset, keyword_of=lambda r: dict(q_offset=r.q_offset),
    ),
    Rule(
        "kv_lengths", "kv_lengths", ("kv_lengths",),
        (Field("kv_lengths", "int array (B,) of valid key counts, or None."),),
        _one("kv_lengths", lambda x, c: check_lengths(x, c.sizes["B"], c.sizes["S"])),
        used=lambda r: r.kv_lengths is not None, ranks=dict(kv_lengths=0),
        paged_check=lambda c: dict(kv_lengths=c.paged["kv_lengths"]),
    ),
    Rule(
        "segment_ids", "segment ids", ("q_segment_ids", "kv_segment_ids"),
        (
            Field("q_segment_ids", "int array (B, T), or None.", spec=(None, "sequence")),
            Field("kv_segment_ids", "int array (B, S), or None.", spec=(None, "sequence")),
        ),
        lambda c: dict(zip(("q_segment_ids", "kv_segment_ids"), check_segments(
            c.given["q_segment_ids"], c.given["kv_segment_ids"], c.sizes["B"], c.sizes["T"],
            c.sizes["S"]))),
        used=lambda r: r.q_segment_ids is not None,
        ranks=dict(q_segment_ids=1, kv_segment_ids=1),
    ),
    Rule(
        "logit_soft_cap", "logit_soft_cap", ("logit_soft_cap",),
        (Field("logit_soft_cap", "the cap of ``cap * tanh(logits / cap)``, or None.",
               static=True),),
        _one("logit_soft_cap", lambda x, c: check_soft_cap(x)),
        used=lambda r: r.logit_soft_cap is not None, paged=True,
    ),
    Rule(
        None, None, ("scale",),
        (
            Field("fixed_scale", "the factor applied to ``q . k`` as a Python number, or "
                  "None.", static=True),
            Field("traced_scale", "the factor as a scalar array (a traced one under "
                  "``jit``), or None; ``scale`` reads whichever is set."),
        ),
        _scale, paged=True, keyword_of=lambda r: dict(scale=r.scale),
    ),
    Rule(
        "mask_fn", "mask_fn", ("mask_fn",),
        (Field("mask_fn", "``mask_fn(b, n, q_pos, k_pos) -> bool`` (:mod:`.mask_fn`), a "
               ":class:`~nanoattn._base.block_mask.BlockMask`, or None.", static=True),),
        _mask_fn, used=lambda r: r.mask_fn is not None, paged=True, paged_check=_paged_mask_fn,
    ),
    Rule(
        "score_fn", "score_fn", ("score_fn",),
        (Field("score_fn", "``score_fn(score, b, n, q_pos, k_pos) -> score``, or None.",
               static=True),),
        _score_fn, used=lambda r: r.score_fn is not None, paged=True,
    ),
    Rule(
        "sinks", "sinks", ("sinks",),
        (Field("sinks", "float (N,), one logit per query head added to each row's "
               "softmax denominator, or None.", spec=("heads",)),),
        _one("sinks", lambda x, c: check_sinks(x, c.sizes["N"])),
        used=lambda r: r.sinks is not None, paged=True,
    ),
    Rule(
        None, None, ("return_residual",),
        (Field("return_residual", "whether the call also returns the log-sum-exp (B, T, N).",
               static=True, default=False),),
        _flag("return_residual"), paged=True,
    ),
    Rule(
        "page_table", "a page table (paged_attention)", (),
        (
            Field("page_table", "a paged call's page table (B, M) of its B sequences, or "
                  "None (:mod:`.paged`)."),
            Field("query_starts", "a paged call's starts (B + 1,) of its sequences' query "
                  "rows among the T = Tq tokens, or None."),
            Field("page_size", "a paged call's keys per page, or None; S = M * page_size "
                  "is the most keys a sequence holds.", static=True),
            Field("pool_pages", "a paged call's pages of the pool (P), or None.", static=True),
        ),
        _paged_arrays, used=lambda r: r.page_table is not None, paged=True,
    ),
    Rule(
        "kv_scales", "a quantized cache (key_scales, value_scales)", ("key_scales", "value_scales"),
        (
            Field("key_scales", "float (B, S, K) (a paged call's (P, page_size, K)), the "
                  "scales of quantized keys: key token s of head k is ``key[b, s, k] * "
                  "key_scales[b, s, k]``; None for float keys.",
                  spec=(None, "sequence", "heads")),
            Field("value_scales", "float, as ``key_scales``, for the values; None for float "
                  "values.", spec=(None, "sequence", "heads")),
        ),
        _kv_scales, used=lambda r: r.key_scales is not None, paged=True,
        ranks=dict(key_scales=2, value_scales=2),
    ),
    Rule(
        "tree", "tree_parents", ("tree_parents",),
        (Field("tree_parents", "int32 (B, T) (a paged call's (Tq,)): each query token's parent "
               "within its chunk, -1 for a root (:mod:`.tree`), or None.", spec=UNSPLIT),),
        lambda c: dict(tree_parents=check_tree(c.given["tree_parents"], (c.sizes["B"],
                       c.sizes["T"]), "B T")),
        used=lambda r: r.tree_parents is not None, ranks=dict(tree_parents=1), paged=True,
        paged_check=_paged_tree,
    ),
    Rule(
        "selection", "key_indices", ("key_indices",),
        (Field("key_indices", "int32 (B, T, k) (a paged call's (Tq, k)): the key positions "
               "each query may read, -1 for an unused entry (:mod:`.selection`), or None.",
               spec=UNSPLIT),),
        _key_indices, used=lambda r: r.key_indices is not None, ranks=dict(key_indices=2),
        paged=True,
    ),
    Rule(
        "value_width", "a value head width Hv other than H", (), (),
        lambda c: {}, used=lambda r: r.Hv != r.H,
    ),
)
# fmt: on

# The keywords the table takes, in its order; those a paged call takes; the rules'
# names and messages (the keys of Rules.active and a backend's serves).
KEYWORDS = tuple(k for rule in TABLE for k in rule.keywords)
PAGED_KEYWORDS = tuple(k for rule in TABLE if rule.paged for k in rule.keywords)
NAMES = {rule.name: rule.message for rule in TABLE if rule.name is not None}
FIELDS = tuple(f for rule in TABLE for f in rule.fields)
# The keywords that are arrays of the call (each the field of its name, a leaf with a
# partition spec): what crosses shard_map as leaves in the ring and the sharded layer.
ARRAY_KEYWORDS = tuple(
    f.name for rule in TABLE for f in rule.fields
    if f.name in rule.keywords and not f.static and f.spec != UNSPLIT
)  # fmt: skip
