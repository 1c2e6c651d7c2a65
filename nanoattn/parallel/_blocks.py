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
* **Pairs of chunks** (a sliding window). Each (query chunk, key chunk) pair
  of C tokens is a kernel call with the queries at
  ``q_offset = (qc - kc) * C`` relative to the keys, chosen by ``lax.switch``
  among ``skip`` (outside the band), ``full`` (inside it) and ``general``
  (on its edge: a traced offset, masked); a chunk against itself uses
  ``q_offset=0`` statically.

Axis letters (docs/conventions.md): B batch, T this device's query time, S its
key time (T = S), N query heads, K key/value heads, G = N / K, H head width,
C the chunk length.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from .. import _zigzag
from .._flash import BlockInputs, Residuals, backward_block, forward_block
from .._flash_plan import Plans, kernel_plans
from .._merge import merge_attention
from .._shard_map import varying_like
from .._spec import AttentionSpec

PAIR_KINDS = ("skip", "full", "general")


@dataclasses.dataclass(frozen=True)
class StepPlans:
    """Kernel plans, (forward, backward), of every call a ring step can make (hashable).

    Attributes:
      layout, P, C: the layout, the ring size and the chunk length.
      pairs: True for the chunk-pair strategy (a window), else whole shards.
      band: ``(left, right)`` of the positional rule, or None.
      plans: name -> its :class:`~nanoattn._flash_plan.Plans`, as a sorted tuple of pairs.
      kinds: the kinds an off-diagonal chunk pair can take (pairs only).
    """

    layout: str
    P: int
    C: int
    pairs: bool
    band: tuple | None
    plans: tuple
    kinds: tuple[str, ...] = ()

    def __getitem__(self, name: str) -> Plans:
        return dict(self.plans)[name]


def _plans(spec: AttentionSpec, T: int, S: int, tiles, **changes) -> Plans:
    return kernel_plans(dataclasses.replace(spec, T=T, S=S, **changes), *tiles)


def step_plans(spec: AttentionSpec, layout: str, P: int, tiles=(None, None)) -> StepPlans:
    """The plans of a ring call whose per-device call is ``spec`` (T = S = T/P)."""
    n = _zigzag.check_layout(layout)
    T, C = spec.T, spec.T // n
    band = spec.band
    flat = dict(is_causal=False, window=None, q_offset=None)
    if band is None or band == (None, 0):  # whole shards; lengths become a key mask
        whole = dict(kv_lengths=None, mask=True if spec.kv_lengths is not None else None)
        plans = {
            "own": _plans(spec, T, T, tiles, q_offset=0, **whole),
            "full": _plans(spec, T, T, tiles, **flat, **whole),
        }
        if band is not None and layout == "zigzag":
            plans["first_keys"] = _plans(spec, T, C, tiles, **flat, **whole)
            plans["last_queries"] = _plans(spec, C, T, tiles, **flat, **whole)
        return StepPlans(layout, P, C, False, band, tuple(sorted(plans.items())))
    plans = {
        "own": _plans(spec, C, C, tiles, q_offset=0),
        "full": _plans(spec, C, C, tiles, **flat),
        # An offset that is not a Python int stands for the traced one: the kernel masks.
        "general": _plans(spec, C, C, tiles, q_offset=np.int32(0)),
    }
    return StepPlans(layout, P, C, True, band, tuple(sorted(plans.items())), PAIR_KINDS)


def _select(index, branches, operands):
    """The branch ``index`` picks (``lax.switch``), or the only one, applied to ``operands``."""
    if len(branches) == 1:
        return branches[0](*operands)
    return jax.lax.switch(index, branches, *operands)


def _split(x, n: int):
    """(B, n*C, ...) -> n arrays (B, C, ...); None stays None."""
    return [None] * n if x is None else jnp.split(x, n, axis=1)


def _empty(q):
    """The output (B, T, N, H) and log-sum-exp (B, T, N) of rows that see no key."""
    return jnp.zeros(q.shape, q.dtype), jnp.full(q.shape[:3], -jnp.inf, q.dtype)


def merge(a, b):
    """Two partial (output (B, T, N, H), log-sum-exp (B, T, N)) of the same queries
    over disjoint keys, as one, by :func:`nanoattn.merge_attention` (a -inf weighs 0)."""
    return merge_attention([a[0], b[0]], [a[1], b[1]])


def earlier(source, r):
    """Whether device ``source``'s first chunk precedes device ``r``'s (both layouts)."""
    return source < r


def _key_mask(kv_lengths, positions):
    """Key lengths (B,) as a key mask (B, 1, 1, S) at global ``positions`` (S,)."""
    if kv_lengths is None:
        return None
    return (positions[None, :] < kv_lengths[:, None])[:, None, None, :]


def _positions(plans: StepPlans, device):
    """The global positions (S,) of the keys device ``device`` holds."""
    C = plans.C
    chunks = _zigzag.chunk_ids(plans.layout, plans.P, device)
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


def _pair_calls(plans: StepPlans, first: bool, r, source):
    """The chunk-pair calls: [(query chunk, key chunk, qc, kc, diagonal)]."""
    n = 2 if plans.layout == "zigzag" else 1
    q_chunks = _zigzag.chunk_ids(plans.layout, plans.P, r)
    k_chunks = _zigzag.chunk_ids(plans.layout, plans.P, source)
    return [(a, c, q_chunks[a], k_chunks[c], first and a == c) for a in range(n) for c in range(n)]


def _pair_kind(plans: StepPlans, rel):
    """The index in ``PAIR_KINDS`` of a pair whose queries sit at ``rel`` (traced)
    relative to its keys, both chunks C long."""
    left, right = plans.band
    C = plans.C
    visible = rel + C - 1 + right >= 0 if right is not None else True
    whole = rel + right >= C - 1 if right is not None else True
    if left is not None:
        visible = jnp.logical_and(visible, rel - left <= C - 1)
        whole = jnp.logical_and(whole, rel + C - 1 - left <= 0)
    return jnp.where(whole, 1, jnp.where(visible, 2, 0))


def _slice(x, at):
    """``x[:, at]``, or None for None."""
    return None if x is None else x[:, at]


def _whole_inputs(q, k, v, mask, q_ids, kv_ids, rows, cols) -> BlockInputs:
    """The inputs of one whole-shard call: queries ``rows`` against keys ``cols``."""
    return BlockInputs(
        query=q[:, rows], key=k[:, cols], value=v[:, cols],
        mask=None if mask is None else mask[..., cols],
        q_segment_ids=_slice(q_ids, rows), kv_segment_ids=_slice(kv_ids, cols),
    )  # fmt: skip


def _chunks(plans: StepPlans, q, k, v, q_ids, kv_ids):
    """q, k, v and the segment ids cut into the layout's chunks (lists of n)."""
    n = 2 if plans.layout == "zigzag" else 1
    return [_split(x, n) for x in (q, k, v, q_ids, kv_ids)]


def _pair_inputs(plans: StepPlans, chunks, a: int, c: int, kc, kv_lengths) -> BlockInputs:
    """The inputs of query chunk ``a`` against key chunk ``c`` (global chunk ``kc``):
    the key lengths shifted to the chunk's own positions."""
    qs, ks, vs, q_ids, kv_ids = chunks
    lengths = None if kv_lengths is None else jnp.clip(kv_lengths - kc * plans.C, 0, plans.C)
    return BlockInputs(
        query=qs[a], key=ks[c], value=vs[c], kv_lengths=lengths,
        q_segment_ids=q_ids[a], kv_segment_ids=kv_ids[c],
    )  # fmt: skip


def _pair_forward(plans: StepPlans, kind: str):
    """The forward branch of an off-diagonal chunk pair of ``kind`` (:data:`PAIR_KINDS`),
    for ``lax.switch``: (offset, inputs) -> (output, log-sum-exp)."""

    def branch(offset, inputs: BlockInputs):
        if kind == "skip":
            result = _empty(inputs.query)
        else:
            inputs = dataclasses.replace(inputs, q_offset=offset if kind == "general" else None)
            result = forward_block(plans[kind].forward, inputs)
        return varying_like(result, offset, inputs)

    return branch


def _grads(plans: Plans, inputs: BlockInputs, out, lse, d_out):
    """dq, dk, dv of one kernel call of a step, from the queries' final ``out`` and ``lse``."""
    block = backward_block(plans.backward, Residuals(inputs, out, lse), d_out)
    return block.query, block.key, block.value


def _pair_backward(plans: StepPlans, kind: str):
    """The backward branch of an off-diagonal chunk pair of ``kind``, for ``lax.switch``:
    (offset, inputs, (out, lse, d_out)) -> (dq, dk, dv)."""

    def branch(offset, inputs: BlockInputs, rows):
        if kind == "skip":
            result = tuple(jnp.zeros_like(x) for x in (inputs.query, inputs.key, inputs.value))
        else:
            inputs = dataclasses.replace(inputs, q_offset=offset if kind == "general" else None)
            result = _grads(plans[kind], inputs, *rows)
        return varying_like(result, offset, inputs, rows)

    return branch


def step_forward(plans: StepPlans, first: bool, r, source, q, k, v, kv_lengths, q_ids, kv_ids):
    """(output (B, T, N, H), log-sum-exp (B, T, N)) of this device's queries over
    the keys from ``source``; float32 ``q`` (B, T, N, H), ``k``, ``v`` (B, S, K, H)."""
    operands = (r, source, q, k, v, kv_lengths, q_ids, kv_ids)
    if not plans.pairs:
        index, alternatives = _whole_calls(plans, first, r, source)

        def run(calls):
            def branch(*operands):
                _, source, q, k, v, kv_lengths, q_ids, kv_ids = operands
                mask = _key_mask(kv_lengths, _positions(plans, source))
                result = _empty(q)
                for name, rows, cols in calls:
                    inputs = _whole_inputs(q, k, v, mask, q_ids, kv_ids, rows, cols)
                    o, lse = forward_block(plans[name].forward, inputs)
                    result = (result[0].at[:, rows].set(o), result[1].at[:, rows].set(lse))
                return varying_like(result, *operands)  # every branch alike

            return branch

        return _select(index, [run(calls) for calls in alternatives], operands)

    chunks = _chunks(plans, q, k, v, q_ids, kv_ids)
    parts = [_empty(x) for x in chunks[0]]
    for a, c, qc, kc, diagonal in _pair_calls(plans, first, r, source):
        pair = _pair_inputs(plans, chunks, a, c, kc, kv_lengths)
        if diagonal:
            block = forward_block(plans["own"].forward, pair)
        else:
            rel = (qc - kc) * plans.C
            branches = [_pair_forward(plans, kind) for kind in PAIR_KINDS]
            block = jax.lax.switch(_pair_kind(plans, rel), branches, rel, pair)
        parts[a] = merge(parts[a], block)
    return tuple(jnp.concatenate(x, axis=1) for x in zip(*parts, strict=True))


def step_backward(
    plans: StepPlans, first: bool, r, source, q, k, v, kv_lengths, q_ids, kv_ids, out, lse, d_out
):
    """(dq (B, T, N, H), dk, dv (B, S, K, H)), float32, of the step's share: the
    kernel's backward pass with the final ``out`` and ``lse`` of the queries, so
    it recomputes exactly this step's part of the softmax."""
    operands = (r, source, q, k, v, kv_lengths, q_ids, kv_ids, out, lse, d_out)

    if not plans.pairs:
        index, alternatives = _whole_calls(plans, first, r, source)

        def run(calls):
            def branch(*operands):
                _, source, q, k, v, kv_lengths, q_ids, kv_ids, out, lse, d_out = operands
                mask = _key_mask(kv_lengths, _positions(plans, source))
                dq, dk, dv = jnp.zeros_like(q), jnp.zeros_like(k), jnp.zeros_like(v)
                for name, rows, cols in calls:
                    inputs = _whole_inputs(q, k, v, mask, q_ids, kv_ids, rows, cols)
                    dq_, dk_, dv_ = _grads(
                        plans[name], inputs, out[:, rows], lse[:, rows], d_out[:, rows]
                    )
                    dq = dq.at[:, rows].add(dq_)
                    dk, dv = dk.at[:, cols].add(dk_), dv.at[:, cols].add(dv_)
                return varying_like((dq, dk, dv), *operands)

            return branch

        return _select(index, [run(calls) for calls in alternatives], operands)

    chunks = _chunks(plans, q, k, v, q_ids, kv_ids)
    n = len(chunks[0])
    outs, lses, d_outs = _split(out, n), _split(lse, n), _split(d_out, n)
    dq = [jnp.zeros_like(x) for x in chunks[0]]
    dk, dv = [jnp.zeros_like(x) for x in chunks[1]], [jnp.zeros_like(x) for x in chunks[2]]
    for a, c, qc, kc, diagonal in _pair_calls(plans, first, r, source):
        pair = _pair_inputs(plans, chunks, a, c, kc, kv_lengths)
        rows = (outs[a], lses[a], d_outs[a])
        if diagonal:
            dq_a, dk_c, dv_c = _grads(plans["own"], pair, *rows)
        else:
            rel = (qc - kc) * plans.C
            branches = [_pair_backward(plans, kind) for kind in PAIR_KINDS]
            dq_a, dk_c, dv_c = jax.lax.switch(_pair_kind(plans, rel), branches, rel, pair, rows)
        dq[a], dk[c], dv[c] = dq[a] + dq_a, dk[c] + dk_c, dv[c] + dv_c
    return tuple(jnp.concatenate(x, axis=1) for x in (dq, dk, dv))
