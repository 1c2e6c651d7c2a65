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

Every rule is one entry of :data:`~nanoattn._base.rule_table.TABLE`: its fields here,
its keywords, its check, whether a call uses it, its partition spec and its batched
rank are read from there (docs/architecture.md, "How to add a rule").
"""

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from . import tree
from .paged import check_paged, pool_halves, token_layout
from .rule_checks import check_lengths as check_lengths
from .rule_checks import check_sinks as check_sinks
from .rule_checks import check_sizes, is_shape
from .rule_checks import check_soft_cap as check_soft_cap
from .rule_checks import normalize_window as normalize_window
from .rule_table import FIELDS, KEYWORDS, NAMES, PAGED_KEYWORDS, TABLE, UNSPLIT, Context
from .selection import out_of_range
from .validate import as_array, lengths_outside

# The keyword arguments of a call that Rules.make takes (those of the table).
ARGUMENTS = KEYWORDS
# How an error names each rule of Rules.active.
RULE_NAMES = NAMES
# The call's sizes: static fields of every Rules, before the rules' own.
SIZES = {
    "B": "batch", "T": "query time", "S": "key time", "N": "query heads",
    "K": "key/value heads", "H": "head width (of queries and keys)",
    "Hv": "the head width of values and of the output (H unless the values have a "
          "width of their own, as in multi-head latent attention; docs/latent.md)",
}  # fmt: skip
STATIC = dict(static=True)  # a field of the pytree's metadata (hashable, never traced)
_DEFAULTS = dict(is_causal=False, return_residual=False)


class _Rules:
    """The methods of :class:`Rules` (its fields come from the table)."""

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
        B, T, S, N, K, H, Hv = check_sizes(query, key, value)
        sizes = dict(B=B, T=T, S=S, N=N, K=K, H=H, Hv=Hv)
        key, value = (x if x is None or is_shape(x) else jnp.asarray(x) for x in (key, value))
        given = dict.fromkeys(ARGUMENTS) | _DEFAULTS | arguments
        return cls._checked(Context(sizes, query, key, value, given, {}))

    @classmethod
    def make_paged(cls, query, key_pages, value_pages, page_table, kv_lengths, query_starts,
                   **arguments) -> "Rules":  # fmt: skip
        """Checks a paged call (``nanoattn.paged_attention``) and returns its rules:
        sizes B (sequences), T (query tokens), S (the most keys a sequence holds), N,
        K, H. ``arguments`` are the table's keywords a paged call takes (``is_causal``
        (default True), ``window``, ``logit_soft_cap``, ``scale``, ``sinks``,
        ``mask_fn``, ``score_fn``, ``return_residual``, and ``key_scales`` and
        ``value_scales`` (P, page_size, K) of quantized pages).

        Raises:
          ValueError: a shape problem, or a value of the page table, the lengths or
            the starts that is invalid when concrete, naming the argument and the row.
        """
        unknown = sorted(set(arguments) - set(PAGED_KEYWORDS))
        if unknown:
            raise TypeError(f"unknown arguments of a paged call {unknown}")
        c = check_paged(query, key_pages, value_pages, page_table, kv_lengths, query_starts)
        sizes = dict(B=c.B, T=c.Tq, S=c.M * c.page_size, N=c.N, K=c.K, H=c.H, Hv=c.Hv)
        paged = dict(
            page_table=c.page_table, kv_lengths=c.kv_lengths, query_starts=c.query_starts,
            page_size=c.page_size, pool_pages=c.P,
        )  # fmt: skip
        given = dict.fromkeys(ARGUMENTS) | _DEFAULTS | dict(is_causal=True) | arguments
        pools = pool_halves(c.key_pages, c.value_pages)  # a combined pool's: shapes
        context = Context(sizes, c.query, *pools, given, {}, paged)
        return cls._checked(context)

    @classmethod
    def _checked(cls, context: Context) -> "Rules":
        """Runs every rule's check in the table's order (a paged call's own where it
        has one; a rule a paged call does not take keeps its defaults)."""
        fields = context.fields
        for rule in TABLE:
            if context.paged is None:
                check = rule.check
            else:
                check = rule.paged_check or (rule.check if rule.paged else None)
            if check is not None:
                fields.update(check(context))
        return cls(**context.sizes, **fields)

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
        given = {}
        for rule in TABLE:
            if rule.keyword_of is not None:
                given |= rule.keyword_of(self)
            else:
                given |= {name: getattr(self, name) for name in rule.keywords}
        return given

    def active(self) -> tuple[str, ...]:
        """The names of the rules this call uses (the keys of :data:`RULE_NAMES`): what
        a backend must serve to take the call."""
        return tuple(rule.name for rule in TABLE if rule.used is not None and rule.used(self))

    def broken_rows(self, most: int | None = None):
        """(B,) bool: the batch rows whose ``kv_lengths`` are outside [0, ``most``]
        (default S), which cannot be checked under ``jit`` (a concrete one raised in
        :meth:`make`): their outputs must be NaN (:func:`poison_rows`); None without
        key lengths."""
        if self.paged:  # a paged call's broken rows are query tokens (T,)
            broken = self.layout().broken
        elif self.kv_lengths is None:
            broken = None
        else:
            broken = lengths_outside(self.kv_lengths, self.S if most is None else most)
        for more in (tree.broken_rows(self), self._bad_selection()):  # traced, invalid
            if more is not None:
                broken = more if broken is None else broken | more
        return broken

    def _bad_selection(self):
        """The rows whose ``key_indices`` hold an index out of range (traced), or None."""
        if self.key_indices is None:
            return None
        bad = out_of_range(self.key_indices, self.S)  # (B, T) or (Tq,)
        return bad if self.paged else bad.any(axis=1)

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
        rules with a ``PartitionSpec`` for each array (the table's specs), the in_specs
        ``jax.shard_map`` takes for them.

        Raises:
          ValueError: a dense mask or a bias, which cannot follow keys that move
            between devices (use ``mask_fn`` or ``score_fn``).
        """
        roles = {"sequence": sequence, "heads": heads, None: None}
        specs = {}
        for field in FIELDS:
            if field.static or getattr(self, field.name) is None:
                continue
            if field.spec == UNSPLIT:
                raise ValueError(
                    "a dense mask or a bias cannot be split over the sequence axis; give the "
                    "rule as mask_fn or score_fn"
                )
            specs[field.name] = PartitionSpec(*(roles[role] for role in field.spec))
        return dataclasses.replace(self, **specs)

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


def _rules_class():
    """:class:`Rules`: the sizes and every field of the table, leaves and metadata, as
    a frozen dataclass registered as a pytree; its docstring lists them."""
    sizes = [(name, int, dataclasses.field(metadata=STATIC)) for name in SIZES]
    fields = [
        (f.name, object, dataclasses.field(default=f.default, metadata=STATIC if f.static else {}))
        for f in FIELDS
    ]
    lines = [f"      {name}: {doc}." for name, doc in SIZES.items()]
    lines += [f"      {f.name}: {f.doc}" for f in FIELDS]
    doc = (
        "The rules of one attention call (fields from the table of rules, "
        ":mod:`nanoattn._base.rule_table`). Shapes use the legend of docs/conventions.md."
        "\n\n    Attributes:\n" + "\n".join(lines) + "\n    "
    )
    cls = dataclasses.make_dataclass(
        "Rules", sizes + fields, bases=(_Rules,), frozen=True, namespace={"__doc__": doc}
    )
    cls.__module__ = __name__
    return jax.tree_util.register_dataclass(cls)


Rules = _rules_class()


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


class Batched(NamedTuple):
    """A call made batched (:func:`batched`): its arrays and rule keywords, and whether
    it came unbatched (then the results lose the batch axis again)."""

    query: Any
    key: Any
    value: Any
    rules: dict
    unbatched: bool


def combined_cache(query, key):
    """A dense call's combined cache ``key`` (B, S, 2, K, H), each slot's keys then its
    values (``value`` None), as an array, and the shape of either half (B, S, K, H) for
    the checks of :meth:`Rules.make`.

    Raises:
      ValueError: a query that is not batched (B, T, N, H), or a key of another shape,
        naming them.
    """
    query = as_array("query", query, "an array (B, T, N, H)")
    key = as_array("key", key, "an array (B, S, 2, K, H)")
    if query.ndim != 4 or key.ndim != 5 or key.shape[2] != 2:
        raise ValueError(
            f"value is None, so key must be one combined cache (B, S, 2, K, H), each slot's "
            f"keys then its values, with a query (B, T, N, H); got key {key.shape} and "
            f"query {query.shape}"
        )
    return key, pool_halves(key, None)[0]


def batched(query, key, value, **rules) -> Batched:
    """An unbatched call made batched, as ``jax.nn.dot_product_attention`` takes it:
    query (T, N, H) with key and value (S, K, H) become (1, T, N, H) and (1, S, K, H),
    ``kv_lengths`` () becomes (1,), segment ids (T,) and (S,) become (1, T) and
    (1, S), key and value scales (S, K) become (1, S, K); a mask or bias broadcastable to
    (N, T, S) needs nothing. A batched call (query of any other rank) is returned as it is.

    Returns:
      a :class:`Batched`; with ``unbatched``, the output (B, T, N, H), the
      log-sum-exp (B, T, N) and the weights (B, N, T, S) have the axis taken off
      again by the caller (``x[0]``).
    """
    query = as_array("query", query, "an array (B, T, N, H) or (T, N, H)")
    if query.ndim not in (3, 4):
        raise ValueError(f"query must have shape (B, T, N, H) or (T, N, H), got {query.shape}")
    if query.ndim == 4:
        return Batched(query, key, value, rules, False)
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
    ranks = [(name, rank) for rule in TABLE for name, rank in rule.ranks.items()]
    for name, rank in ranks:
        if rules.get(name) is not None:
            x = as_array(name, rules[name], "an array")
            rules[name] = x[None] if x.ndim == rank else x
    return Batched(query[None], shapes["key"], shapes["value"], rules, True)
