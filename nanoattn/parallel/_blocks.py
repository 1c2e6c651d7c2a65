"""The work of one ring step: this device's queries against the key/value shard
that arrived from device ``source``, with the flash kernel at the right global
positions, skipping what no query can see.

Two strategies, chosen once per call from its positional rule:

* **Whole shards** (no rule, or plain causality). Causality depends only on
  the order of positions, and both layouts keep a device's positions in
  increasing order, so a device's own shard is one causal kernel call with
  ``q_offset=0``. Another device's shard is wholly visible or wholly hidden
  per chunk: with ``layout="contiguous"`` it is all visible when
  ``source < r`` and skipped otherwise; with ``layout="zigzag"`` (chunks
  ``r, 2P-1-r``) either every query sees the first key chunk
  (``source < r``) or the second query chunk sees every key
  (``source > r``), the same work on every device. Key lengths become a key
  mask (B, 1, 1, S) from the keys' global positions.
* **Pairs of chunks** (a sliding window, ``mask_fn`` or ``score_fn``). Each
  (query chunk, key chunk) pair of C tokens is a kernel call with the queries
  at ``q_offset = (qc - kc) * C`` relative to the keys, chosen by
  ``lax.switch`` among ``skip`` (outside the band), ``full`` (inside it) and
  ``general`` (on its edge: a traced offset, masked); a chunk against itself
  uses ``q_offset=0`` statically. ``mask_fn`` and ``score_fn`` see the global
  positions (the kernel's ``index_shift`` is the key chunk's first position).
  With ``mask_fn`` each pair's blocks are classified once per call
  (:func:`pair_kinds`): a pair ``mask_fn`` hides wholly is skipped, one it
  shows wholly runs without it (``full``, ``general``, ``own``), and the
  others (``*_masked``) run the kernel with the pair's kinds, which skips
  their empty blocks as it meets them.

With segment ids, either strategy also skips, at run time, every call whose
query ids and visible key ids have disjoint ranges in every batch row
(:mod:`nanoattn.parallel._segments`): no query there can equal any key's id, so
the call is empty, the same as its kernel would find it. A chunk against itself
then has a ``skip`` kind too. The skip combines with the rules above: a call is
skipped when either says so.

Axis letters (docs/conventions.md): B batch, T this device's query time, S its
key time (T = S), N query heads, K key/value heads, G = N / K, H head width,
C the chunk length.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from .._backends.flash.kernel import (
    BlockInputs,
    Residuals,
    backward_block,
    forward_block,
    kernel_rules,
)
from .._backends.flash.plan import Plan, Plans, kernel_plans
from .._base import zigzag
from .._base.block_mask import EMPTY, FULL, PARTIAL, chunk_pair_kinds
from .._base.masks import lengths_to_valid
from .._base.rules import Rules
from .._base.shard_map import varying_like
from .._core.merge import merge_attention
from ._segments import ids_meet

PAIR_KINDS = ("skip", "full", "general")
MASKED_PAIR_KINDS = (*PAIR_KINDS, "full_masked", "general_masked")
DIAGONAL_KINDS = ("own",)
SEGMENT_DIAGONAL_KINDS = ("skip", "own")  # segment ids may leave a chunk nothing to see
MASKED_DIAGONAL_KINDS = ("skip", "own", "own_masked")


@dataclasses.dataclass(frozen=True)
class StepPlans:
    """Kernel plans, (forward, backward), of every call a ring step can make (hashable).

    Attributes:
      layout, P, C: the layout, the ring size and the chunk length.
      pairs: True for the chunk-pair strategy (a window, mask_fn or score_fn),
        else whole shards.
      band: ``(left, right)`` of the positional rule, or None.
      plans: name -> its :class:`~nanoattn._backends.flash.plan.Plans`, as a sorted tuple of pairs.
      kinds: the kinds an off-diagonal chunk pair can take (pairs only); "skip" first.
      diagonal_kinds: the kinds a chunk against itself can take (pairs only); "skip"
        first where there is one (with ``mask_fn`` or segment ids).
      mask_fn: the call's ``mask_fn`` (pairs only), or None.
      scored: whether the plans carry a (closure-converted) ``score_fn``, whose arrays
        travel as ``score_consts``.
      all_rows: whether :func:`pair_kinds` classified every query chunk (a static
        ``mask_fn``: its tables are indexed by the global chunk) or only this
        device's (indexed by the local one).
    """

    layout: str
    P: int
    C: int
    pairs: bool
    band: tuple | None
    plans: tuple
    kinds: tuple[str, ...] = ()
    diagonal_kinds: tuple[str, ...] = ()
    mask_fn: object = None
    scored: bool = False
    all_rows: bool = True

    @property
    def indexed(self) -> bool:
        """Whether the kernel calls see global positions (``mask_fn`` or ``score_fn``)."""
        return self.mask_fn is not None or self.scored

    def __getitem__(self, name: str) -> Plans:
        return dict(self.plans)[name]


def _plans(rules: Rules, T: int, S: int, tiles, **changes) -> Plans:
    """The kernel's plans of one call of T queries and S keys under ``rules`` (without
    its functions: the step plans add them per kind) with ``changes``."""
    plain = kernel_rules(rules).replace(T=T, S=S, **changes)
    return kernel_plans(plain, *tiles)


def step_plans(
    rules: Rules, layout: str, P: int, tiles=(None, None), score_fn=None, all_rows: bool = True
) -> StepPlans:
    """The plans of a ring call whose per-device call has the ``rules`` (T = S = T/P;
    ``rules.mask_fn`` as the user gave it, at global positions): ``score_fn`` a pair,
    ``rules.score_fn`` closure-converted at the forward and at the backward plans'
    blocks (:func:`score_blocks`; their arrays are the kernel's ``score_consts``),
    ``all_rows`` as :attr:`StepPlans.all_rows`."""
    n = zigzag.check_layout(layout)
    T, C = rules.T, rules.T // n
    band = rules.band
    mask_fn = rules.mask_fn
    indexed = mask_fn is not None or score_fn is not None
    # Without a band a pair that mask_fn or score_fn reads still needs its offset.
    flat = dict(is_causal=False, window=None, q_offset=np.int32(0) if indexed else None)
    if not indexed and (band is None or band == (None, 0)):  # whole shards; lengths: a key mask
        whole = dict(kv_lengths=None, mask=True if rules.kv_lengths is not None else None)
        plans = {
            "own": _plans(rules, T, T, tiles, q_offset=0, **whole),
            "full": _plans(rules, T, T, tiles, **flat, **whole),
        }
        if band is not None and layout == "zigzag":
            plans["first_keys"] = _plans(rules, T, C, tiles, **flat, **whole)
            plans["last_queries"] = _plans(rules, C, T, tiles, **flat, **whole)
        return StepPlans(layout, P, C, False, band, tuple(sorted(plans.items())))
    plans = {
        "own": _plans(rules, C, C, tiles, q_offset=0),
        "full": _plans(rules, C, C, tiles, **flat),
        # An offset that is not a Python int stands for the traced one: the kernel masks.
        "general": _plans(rules, C, C, tiles, q_offset=np.int32(0)),
    }
    if score_fn is not None:
        plans = {name: _per_pass(p, score_fn) for name, p in plans.items()}
    kinds = PAIR_KINDS
    diagonal = DIAGONAL_KINDS if rules.q_segment_ids is None else SEGMENT_DIAGONAL_KINDS
    if mask_fn is not None:
        masked = {name: _with(p, mask_fn=mask_fn, traced_kinds=True) for name, p in plans.items()}
        plans |= {f"{name}_masked": p for name, p in masked.items()}
        kinds, diagonal = MASKED_PAIR_KINDS, MASKED_DIAGONAL_KINDS
    return StepPlans(
        layout, P, C, True, band, tuple(sorted(plans.items())), kinds, diagonal, mask_fn,
        score_fn is not None, all_rows,
    )  # fmt: skip


def _with(plans: Plans, **changes) -> Plans:
    """Both passes' plans with ``changes``."""
    return Plans(*(dataclasses.replace(p, **changes) for p in plans))


def _per_pass(plans: Plans, score_fns) -> Plans:
    """The plans with each pass's own ``score_fn`` (forward, backward)."""
    return Plans(*(dataclasses.replace(p, score_fn=f) for p, f in zip(plans, score_fns)))


def score_blocks(rules: Rules, layout: str, tiles) -> tuple:
    """The score blocks (block_q, block_k) of the forward and the backward pass of a
    ring call's chunk pairs, on which ``score_fn`` is traced (its program has their
    shapes)."""
    C = rules.T // zigzag.check_layout(layout)
    return tuple((p.block_q, p.block_k) for p in _plans(rules, C, C, tiles, q_offset=0))


def pair_kinds(plans: StepPlans, r, B: int, N: int):
    """The block kinds of ``mask_fn`` in every chunk pair this device computes, at the
    forward and at the backward plans' blocks: a pair of int8 tables (query chunks,
    2P or P key chunks, nQ, nK), the query chunks all of them (``plans.all_rows``) or
    this device's (``r``); None without ``mask_fn``."""
    if plans.mask_fn is None:
        return None
    n = 2 if plans.layout == "zigzag" else 1
    k_chunks = np.arange(n * plans.P)
    q_chunks = k_chunks if plans.all_rows else zigzag.chunk_ids(plans.layout, plans.P, r)

    def kinds(plan: Plan):
        fn, C = plans.mask_fn, plans.C
        return chunk_pair_kinds(fn, B, N, C, q_chunks, k_chunks, plan.block_q, plan.block_k)

    return tuple(jnp.asarray(kinds(p)) for p in plans["own"])


def is_static(mask_fn, B: int, N: int, C: int) -> bool:
    """Whether ``mask_fn`` can be classified at trace time (it depends on static things
    only): probed on one chunk pair. A function that closes over a value varying over
    the axes of an enclosing ``jax.shard_map`` (such as a device index) cannot be
    evaluated at trace time, and fails there in jax's own code: it is classified at
    run time (where a real error in it surfaces)."""
    try:
        return isinstance(chunk_pair_kinds(mask_fn, B, N, C, [0], [0], C, C), np.ndarray)
    except Exception:  # see above
        return False


def _select(index, branches, operands):
    """The branch ``index`` picks (``lax.switch``), or the only one, applied to ``operands``."""
    if len(branches) == 1:
        return branches[0](*operands)
    return jax.lax.switch(index, branches, *operands)


def _split(x, n: int):
    """(B, n*C, ...) -> n arrays (B, C, ...); None stays None."""
    return [None] * n if x is None else jnp.split(x, n, axis=1)


def _empty(q, v):
    """The output (B, T, N, Hv) and log-sum-exp (B, T, N) of queries ``q`` (B, T, N, H)
    that see no key; ``v`` (B, S, K, Hv) the values they would see."""
    out = jnp.zeros((*q.shape[:3], v.shape[-1]), q.dtype)
    return out, jnp.full(q.shape[:3], -jnp.inf, q.dtype)


def merge(a, b):
    """Two partial (output (B, T, N, H), log-sum-exp (B, T, N)) of the same queries
    over disjoint keys, as one, by :func:`nanoattn.merge_attention` (a -inf weighs 0)."""
    return merge_attention([a[0], b[0]], [a[1], b[1]])


def earlier(source, r):
    """Whether device ``source``'s first chunk precedes device ``r``'s (both layouts)."""
    return source < r


def _valid_keys(kv_lengths, positions):
    """Key lengths (B,) as the keys they leave visible (B, S) at global ``positions``
    (S,), or None."""
    if kv_lengths is None:
        return None
    return positions[None, :] < kv_lengths[:, None]


def _key_mask(kv_lengths, positions):
    """Key lengths (B,) as a key mask (B, 1, 1, S) at global ``positions`` (S,)."""
    valid = _valid_keys(kv_lengths, positions)
    return None if valid is None else valid[:, None, None, :]


def _positions(plans: StepPlans, device):
    """The global positions (S,) of the keys device ``device`` holds."""
    C = plans.C
    chunks = zigzag.chunk_ids(plans.layout, plans.P, device)
    return jnp.concatenate([c * C + jnp.arange(C) for c in chunks])


def _whole_calls(plans: StepPlans, first: bool, r, source):
    """The whole-shard calls of a step as (index, [(plan name, query slice, key
    slice)]) for ``lax.switch``: a list of alternatives, each one call or none."""
    T = 2 * plans.C if plans.layout == "zigzag" else plans.C
    everything = (slice(0, T), slice(0, T))
    if first:
        return 0, [[("own", *everything)]]
    if plans.band is None:
        return 0, [[("full", *everything)]]
    if plans.layout == "contiguous":
        return jnp.where(earlier(source, r), 1, 0), [[], [("full", *everything)]]
    C = plans.C
    before = [("first_keys", slice(0, T), slice(0, C))]  # every query, the early key chunk
    after = [("last_queries", slice(C, T), slice(0, T))]  # the late query chunk, every key
    return jnp.where(earlier(source, r), 0, 1), [before, after]


def _whole_choice(plans: StepPlans, first: bool, r, source, rules: Rules):
    """:func:`_whole_calls`, and with segment ids the choice of no call where the one
    the positional rule picks meets no key: its query ids and the ids of the keys
    the lengths leave visible have disjoint ranges in every row (:func:`ids_meet`).
    ``rules`` the step's (this device's query ids, the arriving keys' ids)."""
    index, alternatives = _whole_calls(plans, first, r, source)
    q_ids, kv_ids = rules.q_segment_ids, rules.kv_segment_ids
    if q_ids is None:
        return index, alternatives
    valid = _valid_keys(rules.kv_lengths, _positions(plans, source))

    def meets(calls):
        met = [ids_meet(q_ids[:, rows], kv_ids[:, cols], _slice(valid, cols))
               for _, rows, cols in calls]  # fmt: skip
        return jnp.any(jnp.stack(met)) if met else jnp.bool_(False)

    if [] not in alternatives:
        alternatives = [*alternatives, []]
    met = jnp.stack([meets(calls) for calls in alternatives])
    return jnp.where(met[index], index, alternatives.index([])), alternatives


def _pair_calls(plans: StepPlans, first: bool, r, source):
    """The chunk-pair calls: [(query chunk, key chunk, qc, kc, diagonal)]."""
    n = 2 if plans.layout == "zigzag" else 1
    q_chunks = zigzag.chunk_ids(plans.layout, plans.P, r)
    k_chunks = zigzag.chunk_ids(plans.layout, plans.P, source)
    return [(a, c, q_chunks[a], k_chunks[c], first and a == c) for a in range(n) for c in range(n)]


def _pair_kind(plans: StepPlans, rel):
    """The index in ``PAIR_KINDS`` of a pair whose queries sit at ``rel`` (traced)
    relative to its keys, both chunks C long, by the positional rule alone."""
    if plans.band is None:
        return jnp.int32(1)  # every pair is wholly visible
    left, right = plans.band
    C = plans.C
    visible = rel + C - 1 + right >= 0 if right is not None else True
    whole = rel + right >= C - 1 if right is not None else True
    if left is not None:
        visible = jnp.logical_and(visible, rel - left <= C - 1)
        whole = jnp.logical_and(whole, rel + C - 1 - left <= 0)
    return jnp.where(whole, 1, jnp.where(visible, 2, 0))


def _summary(kinds):
    """EMPTY, FULL or PARTIAL for a whole pair from its block kinds (nQ, nK)."""
    full, empty = jnp.all(kinds == FULL), jnp.all(kinds == EMPTY)
    return jnp.where(full, FULL, jnp.where(empty, EMPTY, PARTIAL))


def _kind_index(plans: StepPlans, rel, kinds, diagonal: bool, meets=None):
    """The index of a pair's kind in ``plans.diagonal_kinds`` (a chunk against itself)
    or ``plans.kinds``: the positional rule's kind, then ``mask_fn``'s (``kinds``, the
    pair's block kinds, or None): a pair it hides wholly is skipped, one it shows
    wholly needs no mask_fn, the others run ``*_masked``; then the segment ids'
    (``meets``, a traced bool from :func:`_pair_meets`, or None): a pair whose ids
    cannot meet is skipped, whatever the others say."""
    index = _rule_index(plans, rel, kinds, diagonal)
    if meets is None:
        return index
    names = plans.diagonal_kinds if diagonal else plans.kinds
    return jnp.where(meets, index, names.index("skip"))


def _rule_index(plans: StepPlans, rel, kinds, diagonal: bool):
    """:func:`_kind_index` by the positional rule and ``mask_fn`` alone."""
    if kinds is None:
        return jnp.int32(plans.diagonal_kinds.index("own")) if diagonal else _pair_kind(plans, rel)
    summary = _summary(kinds)
    partial = (summary == PARTIAL).astype(jnp.int32)
    if diagonal:  # ("skip", "own", "own_masked")
        return jnp.where(summary == EMPTY, 0, 1 + partial)
    band = _pair_kind(plans, rel)  # ("skip", "full", "general", "full_masked", "general_masked")
    return jnp.where((band == 0) | (summary == EMPTY), 0, band + 2 * partial)


def _pair_meets(inputs: BlockInputs):
    """Whether a chunk pair's query ids can meet the ids of its keys before the pair's
    own key lengths (:func:`ids_meet`): a traced bool, or None without segment ids."""
    rules = inputs.rules
    if rules.q_segment_ids is None:
        return None
    lengths = rules.kv_lengths
    valid = None if lengths is None else lengths_to_valid(lengths, inputs.key.shape[1])
    return ids_meet(rules.q_segment_ids, rules.kv_segment_ids, valid)


def _slice(x, at):
    """``x[:, at]``, or None for None."""
    return None if x is None else x[:, at]


def _whole_inputs(q, k, v, rules: Rules, mask, rows, cols) -> BlockInputs:
    """The inputs of one whole-shard call: queries ``rows`` against keys ``cols``, the
    key lengths as the key ``mask`` (B, 1, 1, S) (or None)."""
    call = rules.replace(
        mask=None if mask is None else mask[..., cols], kv_lengths=None,
        q_segment_ids=_slice(rules.q_segment_ids, rows),
        kv_segment_ids=_slice(rules.kv_segment_ids, cols),
    )  # fmt: skip
    return BlockInputs(query=q[:, rows], key=k[:, cols], value=v[:, cols], rules=call)


def _chunks(plans: StepPlans, q, k, v, rules: Rules):
    """q, k, v and the segment ids cut into the layout's chunks (lists of n)."""
    n = 2 if plans.layout == "zigzag" else 1
    arrays = (q, k, v, rules.q_segment_ids, rules.kv_segment_ids)
    return [_split(x, n) for x in arrays]


def _pair_inputs(plans: StepPlans, chunks, rules: Rules, a: int, c: int, kc, consts):
    """The inputs of query chunk ``a`` against key chunk ``c`` (global chunk ``kc``):
    the key lengths shifted to the chunk's own positions, and for ``mask_fn`` and
    ``score_fn`` the positions shifted back to global ones."""
    qs, ks, vs, q_ids, kv_ids = chunks
    kv_lengths = rules.kv_lengths
    lengths = None if kv_lengths is None else jnp.clip(kv_lengths - kc * plans.C, 0, plans.C)
    call = rules.replace(kv_lengths=lengths, q_segment_ids=q_ids[a], kv_segment_ids=kv_ids[c])
    return BlockInputs(
        query=qs[a], key=ks[c], value=vs[c], rules=call,
        index_shift=jnp.asarray(kc * plans.C, jnp.int32) if plans.indexed else None,
        score_consts=consts if plans.scored else None,
    )  # fmt: skip


def _kinds_of(plans: StepPlans, table, a: int, qc, kc):
    """The block kinds (nQ, nK) of the pair (query chunk ``qc``, the ``a``-th of this
    device, key chunk ``kc``) from a :func:`pair_kinds` table, or None."""
    if table is None:
        return None
    return table[qc if plans.all_rows else a, kc]


def _for_plan(plan: Plan, inputs: BlockInputs, offset, kinds, field: str) -> BlockInputs:
    """``inputs`` as ``plan`` reads them: the traced offset where the plan has none of
    its own, and the pair's kinds (in ``field``) where it skips by them."""
    rules = inputs.rules.replace(q_offset=offset if plan.index_offset is None else None)
    return dataclasses.replace(inputs, rules=rules, **{field: kinds if plan.traced_kinds else None})


def _pair_forward(plans: StepPlans, kind: str):
    """The forward branch of a chunk pair of ``kind``, for ``lax.switch``:
    (offset, inputs, kinds) -> (output, log-sum-exp)."""

    def branch(offset, inputs: BlockInputs, kinds):
        if kind == "skip":
            result = _empty(inputs.query, inputs.value)
        else:
            plan = plans[kind].forward
            result = forward_block(plan, _for_plan(plan, inputs, offset, kinds, "kinds"))
        return varying_like(result, offset, inputs, kinds)

    return branch


def _grads(plans: Plans, inputs: BlockInputs, out, lse, d_out, d_lse):
    """dq, dk, dv and the gradients of ``score_fn``'s arrays (a tuple, empty without)
    of one kernel call of a step, from the queries' final ``out`` and ``lse``."""
    block = backward_block(plans.backward, Residuals(inputs, out, lse), d_out, d_lse)
    consts = () if block.score_consts is None else tuple(block.score_consts[1])
    return block.query, block.key, block.value, consts


def _pair_backward(plans: StepPlans, kind: str):
    """The backward branch of a chunk pair of ``kind``, for ``lax.switch``:
    (offset, inputs, kinds, (out, lse, d_out, d_lse)) -> (dq, dk, dv, d consts)."""

    def branch(offset, inputs: BlockInputs, kinds, rows):
        if kind == "skip":
            arrays = (inputs.query, inputs.key, inputs.value)
            consts = () if inputs.score_consts is None else inputs.score_consts[1]
            result = jax.tree.map(jnp.zeros_like, (*arrays, tuple(consts)))
        else:
            plan = plans[kind]
            inputs = _for_plan(plan.backward, inputs, offset, kinds, "backward_kinds")
            result = _grads(plan, inputs, *rows)
        return varying_like(result, offset, inputs, kinds, rows)

    return branch


def _pair_call(plans: StepPlans, make_branch, rel, inputs, kinds, diagonal: bool, *rest):
    """One chunk pair through the branch its kind picks (``lax.switch``; a chunk
    against itself without ``mask_fn`` or segment ids is always ``own``)."""
    names = plans.diagonal_kinds if diagonal else plans.kinds
    offset = jnp.int32(0) if diagonal else rel
    index = _kind_index(plans, rel, kinds, diagonal, _pair_meets(inputs))
    branches = [make_branch(plans, name) for name in names]
    return _select(index, branches, (offset, inputs, kinds, *rest))


def step_forward(plans: StepPlans, first: bool, r, source, q, k, v, rules: Rules, kinds=None,
                 consts=((), ())):  # fmt: skip
    """(output (B, T, N, H), log-sum-exp (B, T, N)) of this device's queries over
    the keys from ``source``; float32 ``q`` (B, T, N, H), ``k``, ``v`` (B, S, K, H);
    ``rules`` the step's arrays (key lengths, this device's query segment ids and the
    arriving keys' ids; :func:`~nanoattn._backends.flash.kernel.kernel_rules`);
    ``kinds`` the forward table of :func:`pair_kinds`, ``consts`` score_fn's arrays
    (those of its forward and of its backward program, a pair)."""
    operands = (r, source, q, k, v, rules)
    if not plans.pairs:
        index, alternatives = _whole_choice(plans, first, r, source, rules)

        def run(calls):
            def branch(*operands):
                _, source, q, k, v, rules = operands
                mask = _key_mask(rules.kv_lengths, _positions(plans, source))
                result = _empty(q, v)
                for name, rows, cols in calls:
                    inputs = _whole_inputs(q, k, v, rules, mask, rows, cols)
                    o, lse = forward_block(plans[name].forward, inputs)
                    result = (result[0].at[:, rows].set(o), result[1].at[:, rows].set(lse))
                return varying_like(result, *operands)  # every branch alike

            return branch

        return _select(index, [run(calls) for calls in alternatives], operands)

    chunks = _chunks(plans, q, k, v, rules)
    parts = [_empty(x, v) for x in chunks[0]]
    for a, c, qc, kc, diagonal in _pair_calls(plans, first, r, source):
        pair = _pair_inputs(plans, chunks, rules, a, c, kc, consts)
        rel = (qc - kc) * plans.C
        block = _pair_call(
            plans, _pair_forward, rel, pair, _kinds_of(plans, kinds, a, qc, kc), diagonal
        )
        parts[a] = merge(parts[a], block)
    return tuple(jnp.concatenate(x, axis=1) for x in zip(*parts, strict=True))


def step_backward(
    plans: StepPlans, first: bool, r, source, q, k, v, rules: Rules, out, lse, d_out, d_lse,
    kinds=None, consts=((), ()),
):  # fmt: skip
    """(dq (B, T, N, H), dk, dv (B, S, K, H), d consts), float32, of the step's share:
    the kernel's backward pass with the final ``out`` and ``lse`` of the queries (and
    the cotangents of both), so it recomputes exactly this step's part of the softmax;
    ``rules`` as :func:`step_forward`'s, ``kinds`` the backward table of
    :func:`pair_kinds`."""
    operands = (r, source, q, k, v, rules, out, lse, d_out, d_lse)

    if not plans.pairs:
        index, alternatives = _whole_choice(plans, first, r, source, rules)

        def run(calls):
            def branch(*operands):
                _, source, q, k, v, rules, out, lse, d_out, d_lse = operands
                mask = _key_mask(rules.kv_lengths, _positions(plans, source))
                dq, dk, dv = jnp.zeros_like(q), jnp.zeros_like(k), jnp.zeros_like(v)
                for name, rows, cols in calls:
                    inputs = _whole_inputs(q, k, v, rules, mask, rows, cols)
                    per_row = (out, lse, d_out, d_lse)
                    dq_, dk_, dv_, _ = _grads(plans[name], inputs, *(x[:, rows] for x in per_row))
                    dq = dq.at[:, rows].add(dq_)
                    dk, dv = dk.at[:, cols].add(dk_), dv.at[:, cols].add(dv_)
                return varying_like((dq, dk, dv, ()), *operands)

            return branch

        return _select(index, [run(calls) for calls in alternatives], operands)

    chunks = _chunks(plans, q, k, v, rules)
    n = len(chunks[0])
    per_row = [_split(x, n) for x in (out, lse, d_out, d_lse)]
    dq = [jnp.zeros_like(x) for x in chunks[0]]
    dk, dv = [jnp.zeros_like(x) for x in chunks[1]], [jnp.zeros_like(x) for x in chunks[2]]
    d_consts = tuple(jnp.zeros_like(x) for x in consts[1]) if plans.scored else ()
    for a, c, qc, kc, diagonal in _pair_calls(plans, first, r, source):
        pair = _pair_inputs(plans, chunks, rules, a, c, kc, consts)
        rows = tuple(x[a] for x in per_row)
        rel = (qc - kc) * plans.C
        pair_kinds = _kinds_of(plans, kinds, a, qc, kc)
        dq_a, dk_c, dv_c, dc = _pair_call(
            plans, _pair_backward, rel, pair, pair_kinds, diagonal, rows
        )
        dq[a], dk[c], dv[c] = dq[a] + dq_a, dk[c] + dk_c, dv[c] + dv_c
        d_consts = tuple(x + y for x, y in zip(d_consts, dc, strict=True))
    return (*(jnp.concatenate(x, axis=1) for x in (dq, dk, dv)), d_consts)
