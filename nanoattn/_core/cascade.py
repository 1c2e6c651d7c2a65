r"""Shared prefixes read once (cascade attention): a paged call whose sequences begin
with the same pages attends those pages once for all of their queries.

``paged_attention(..., shared_prefixes=m)``, m int (B,): sequence b's first ``m[b]``
page-table entries are pages it shares with the other sequences of its group. The
sequences that give the same count m > 0 and hold the same page at entry m - 1 form a
group (forks and prefix-cache hits of one prompt); each must hold the same first m
pages, and those pages must lie wholly before its first query (``m * page_size <=
kv_lengths[b] - q_len``: written whole by earlier steps, so a page partly written is
never shared). The call is then two paged calls of the same backend, merged exactly:

* the group pass: one "sequence" per group (cut into pieces of at most ``m *
  page_size`` rows, since a paged sequence has at most as many queries as keys), whose
  queries are the rows of every member (gathered, a permutation of the rows) and whose
  keys are the group's shared pages, without causality (every shared key lies before
  every query of the group);
* the rest: every sequence over its own page table past the shared entries, its keys
  counted from there (positions shift by ``m * page_size`` for both queries and keys,
  so causality, the window and a token tree mean the same);

.. math::

   \ell = \log(e^{\ell_g} + e^{\ell_r}), \qquad
   o = e^{\ell_g - \ell}\, o_g + e^{\ell_r - \ell}\, o_r

(g the group pass, r the rest; :func:`~nanoattn._core.merge.merge`), then the sinks,
once. The layout is computed
on the device from the arrays (traced under ``jit``), so a jitted step serves every
grouping without compiling again; under ``jit`` a step where no sequence shares runs
the plain call (``lax.cond``).

Bad groups (a count outside [0, M], shared pages not wholly before the first query,
pages other than the group's) raise one ``ValueError`` line naming
``shared_prefixes[b]`` when concrete; under ``jit`` that sequence's rows are NaN and no
other row changes. Calls whose rules make a shared pass unsound fall back to the plain
call, whatever ``shared_prefixes`` says (:func:`cascade_refusal`): ``mask_fn`` and
``score_fn`` (they see the sequence index and positions, which the group pass does not
keep), any rule not in :data:`SHARED_PASS_RULES`, and a window whose left side could
cut the shared part (``left < M * page_size - 1``). Axis letters: Tq query rows, B
sequences, M pages per sequence at most, N query heads, H head width; Bg the group
pass's sequences, ``B + ceil(Tq / page_size)``.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from .._backends import dispatch
from .._base.rules import RULE_NAMES, Rules, poison_rows
from .._base.shard_map import insertion_index
from .._base.validate import as_array, expect_integer, expect_shape
from .api import attend
from .eager import is_eager
from .merge import add_sinks, merge


class CascadeLayout(NamedTuple):
    """The two calls of a cascade, traced or not.

    Attributes:
      order: int32 (Tq,): the query rows in the group pass's order (each group's
        members' rows, groups in order of their first member, then the others).
      inverse: int32 (Tq,): the inverse permutation (back to the call's rows).
      group_table: int32 (Bg, M): each piece of a group, the group's page table row.
      group_lengths: int32 (Bg,): its keys, the group's ``m * page_size`` (0 unused).
      group_starts: int32 (Bg + 1,): its rows among ``order``.
      rest_table: int32 (B, M): each sequence's page table past its shared entries.
      rest_lengths: int32 (B,): its keys past them.
      faults: bool (B,): the sequences whose ``shared_prefixes`` entry is invalid.
    """

    order: jax.Array
    inverse: jax.Array
    group_table: jax.Array
    group_lengths: jax.Array
    group_starts: jax.Array
    rest_table: jax.Array
    rest_lengths: jax.Array
    faults: jax.Array


# The rules (names of Rules.active) a cascade is exact under: they mean the same over
# the rest with positions shifted, and the group pass needs none of them but the
# soft-cap, the scale and the scales of quantized pages. Any other (mask_fn, score_fn,
# which see the sequence index and positions; a rule added later) gets the plain call.
SHARED_PASS_RULES = frozenset({"is_causal", "window", "kv_lengths", "logit_soft_cap", "sinks",
                               "page_table", "kv_scales", "tree", "value_width"})  # fmt: skip


def cascade_refusal(rules: Rules) -> str | None:
    """Why a call with these rules is served unshared whatever its ``shared_prefixes``
    (static), or None when the cascade is exact for it."""
    other = [name for name in rules.active() if name not in SHARED_PASS_RULES]
    if other:
        return f"{RULE_NAMES[other[0]]} is not served by a shared pass"
    if rules.window is not None and rules.window[0] < rules.S - 1:
        return f"the window {rules.window} may cut the shared keys of a query"
    if rules.T == 0:
        return "no query"
    return None


def check_shared_prefixes(shared_prefixes, rules: Rules):
    """``shared_prefixes`` as an int32 (B,) array: its shape and dtype checked, and when
    it, the page table, the lengths and the starts are concrete, every group (one line
    naming the first bad ``shared_prefixes[b]``)."""
    shared = as_array("shared_prefixes", shared_prefixes, "an int array (B,)")
    expect_integer("shared_prefixes", shared.dtype)
    expect_shape("shared_prefixes", shared.shape, "B", (rules.B,))
    shared = shared.astype(jnp.int32)
    arrays = (shared, rules.page_table, rules.kv_lengths, rules.query_starts)
    if is_eager(*arrays):
        _raise_fault(*(np.asarray(x) for x in arrays), rules.page_size)
    return shared


def _raise_fault(shared, table, lengths, starts, ps: int) -> None:
    """Raises ValueError for the first sequence whose entry is invalid (concrete)."""
    M = table.shape[1]
    _, leader, faults = (np.asarray(x) for x in _faults(shared, table, lengths, starts, ps))
    if not faults.any():
        return
    b = int(np.flatnonzero(faults)[0])
    m, name = int(shared[b]), f"shared_prefixes[{b}]={int(shared[b])}"
    if not 0 <= m <= M:
        raise ValueError(f"{name} must be in [0, M] = [0, {M}] (pages of a page-table row)")
    before = int(lengths[b]) - int(starts[b + 1] - starts[b])
    if m * ps > before:
        raise ValueError(
            f"{name}: a shared prefix must lie wholly before the sequence's first query, "
            f"at position {before} (kv_lengths - q_len), but its {m} pages hold {m * ps} keys"
        )
    r = int(leader[b])
    raise ValueError(
        f"{name}: sequence {b}'s first {m} pages {table[b, :m].tolist()} are not those of "
        f"sequence {r} ({table[r, :m].tolist()}), which gives the same count and page "
        f"{int(table[r, m - 1])} at entry {m - 1}: a group shares the same pages"
    )


def _faults(shared, table, lengths, starts, ps: int):
    """(count, leader, faults), traced or not: each sequence's count clipped into [0,
    M], its group's first member (B for none), and whether its entry is invalid."""
    B, M = table.shape
    count = jnp.clip(shared, 0, M)
    last = jnp.take_along_axis(table, jnp.maximum(count - 1, 0)[:, None], axis=1)[:, 0]
    on = count > 0
    same = (last[:, None] == last[None]) & (count[:, None] == count[None])
    same = same & on[:, None] & on[None]  # (B, B)
    leader = jnp.where(on, jnp.argmax(same, axis=1), B).astype(jnp.int32)
    q_lens = starts[1:] - starts[:-1]
    entries = jnp.arange(M)[None] < count[:, None]  # (B, M)
    differs = (entries & (table != table[jnp.minimum(leader, B - 1)])).any(axis=1)
    outside = (shared < 0) | (shared > M)
    late = count * ps > lengths - q_lens
    return count, leader, outside | (on & (late | differs))


def cascade_layout(rules: Rules, shared) -> CascadeLayout:
    """The :class:`CascadeLayout` of a paged call and its ``shared_prefixes`` (checked
    by :func:`check_shared_prefixes`), traced or not. A faulty sequence shares nothing
    (its rows are poisoned after); rows that are padding or broken join no group."""
    table, lengths, starts = rules.page_table, rules.kv_lengths, rules.query_starts
    B, M = table.shape
    Tq, ps = rules.T, rules.page_size
    count, leader, faults = _faults(shared, table, lengths.astype(jnp.int32),
                                    starts.astype(jnp.int32), ps)  # fmt: skip
    shift = jnp.where(faults, 0, count)  # (B,): the entries each sequence's rest skips
    layout = rules.layout()
    row_group = jnp.where(layout.real, jnp.where(faults, B, leader)[layout.sequence], B)
    order = jnp.argsort(row_group, stable=True).astype(jnp.int32)  # (Tq,)
    inverse = jnp.zeros(Tq, jnp.int32).at[order].set(jnp.arange(Tq, dtype=jnp.int32))
    rows = jnp.zeros(B + 1, jnp.int32).at[row_group].add(1)[:B]  # each group's rows
    # A group's keys, by its first member (every member gives the same count: its
    # identity; a first member whose own entry is faulty still names the pages).
    keys = count * ps
    pieces = jnp.where(rows > 0, -(-rows // jnp.maximum(keys, 1)), 0)  # (B,)
    ends = jnp.cumsum(pieces)
    slot = jnp.arange(B + -(-Tq // ps), dtype=jnp.int32)  # (Bg,)
    group = insertion_index(ends, slot)  # B: unused
    used, g = group < B, jnp.minimum(group, B - 1)
    first = (slot - (ends[g] - pieces[g])) * keys[g]  # the piece's first row in its group
    q_lens = jnp.where(used, jnp.clip(rows[g] - first, 0, keys[g]), 0)
    group_starts = jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(q_lens)])
    columns = jnp.minimum(jnp.arange(M)[None] + shift[:, None], M - 1)  # (B, M)
    return CascadeLayout(
        order, inverse, table[g].astype(jnp.int32), jnp.where(used, keys[g], 0),
        group_starts.astype(jnp.int32), jnp.take_along_axis(table, columns, axis=1),
        (lengths - shift * ps).astype(jnp.int32), faults,
    )  # fmt: skip


def cascade_attention(query, key_pages, value_pages, rules: Rules, shared, implementation):
    """A paged call with ``shared_prefixes`` (checked), served by the backend
    ``implementation`` would serve it (None: the automatic choice): the group pass and
    the rest, merged, or the plain call where nothing is shared (concrete) or the rules
    refuse it (:func:`cascade_refusal`)."""
    name = dispatch.choose(implementation, rules, query.dtype, 0.0)
    if cascade_refusal(rules) is not None:
        return attend(query, key_pages, value_pages, rules, implementation=name)
    arrays = (query, key_pages, value_pages, rules, shared)
    if is_eager(*arrays):
        if not np.asarray(shared).any():
            return attend(query, key_pages, value_pages, rules, implementation=name)
        return _compiled(name, *arrays)

    def plain():
        return attend(query, key_pages, value_pages, rules, implementation=name)

    return jax.lax.cond((shared > 0).any(), lambda: _cascade(name, *arrays), plain)


def _cascade(name: str, query, key_pages, value_pages, rules: Rules, shared):
    """The group pass and the rest by the backend ``name``, merged through their
    log-sum-exps; the sinks added once; faulty and broken rows NaN."""
    c = cascade_layout(rules, shared)
    Bg = c.group_lengths.shape[0]
    parts = dict(sinks=None, return_residual=True)
    group = rules.replace(
        B=Bg, page_table=c.group_table, kv_lengths=c.group_lengths, query_starts=c.group_starts,
        is_causal=False, window=None, tree_parents=None, **parts,
    )  # fmt: skip
    rest = rules.replace(page_table=c.rest_table, kv_lengths=c.rest_lengths, **parts)
    out_g, lse_g = attend(query[c.order], key_pages, value_pages, group, implementation=name)
    out_r, lse_r = attend(query, key_pages, value_pages, rest, implementation=name)
    wide = jnp.promote_types(query.dtype, jnp.float32)
    outputs = [out_g[c.inverse].astype(wide), out_r.astype(wide)]
    out, lse = merge(outputs, [lse_g[c.inverse], lse_r])
    if rules.sinks is not None:
        out, lse = add_sinks(out, lse, rules.sinks)
    result = (out.astype(query.dtype), lse) if rules.return_residual else out.astype(query.dtype)
    layout = rules.layout()
    broken = layout.broken | (c.faults[layout.sequence] & layout.real)
    return poison_rows(result, broken)


# Eager calls as one jitted program, kept by jit's cache (the backend's name static).
_compiled = jax.jit(_cascade, static_argnums=(0,))
