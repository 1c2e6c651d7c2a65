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

from .. import _flash
from .._spec import AttentionSpec
from . import _zigzag

PAIR_KINDS = ("skip", "full", "general")


@dataclasses.dataclass(frozen=True)
class StepPlans:
    """Kernel plans, (forward, backward), of every call a ring step can make (hashable).

    Attributes:
      layout, P, C: the layout, the ring size and the chunk length.
      pairs: True for the chunk-pair strategy (a window), else whole shards.
      band: ``(left, right)`` of the positional rule, or None.
      plans: name -> (forward plan, backward plan), as a sorted tuple of pairs.
      kinds: the kinds an off-diagonal chunk pair can take (pairs only).
    """

    layout: str
    P: int
    C: int
    pairs: bool
    band: tuple | None
    plans: tuple
    kinds: tuple[str, ...] = ()

    def __getitem__(self, name: str):
        return dict(self.plans)[name]


def _plans(spec: AttentionSpec, T: int, S: int, tiles, **changes):
    return _flash.kernel_plans(dataclasses.replace(spec, T=T, S=S, **changes), *tiles)


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


def _empty(q, K: int):
    """The output (B, T, N, H) and log-sum-exp (B, T, K, G) of rows that see no key."""
    B, T, N, H = q.shape
    return jnp.zeros((B, T, N, H), q.dtype), jnp.full((B, T, K, N // K), -jnp.inf, q.dtype)


def merge(a, b):
    """Two partial (output (B, T, N, H), log-sum-exp (B, T, K, G)) of the same
    queries over disjoint keys, as one: ``lse = log(e^lse1 + e^lse2)``,
    ``out = e^(lse1 - lse) out1 + e^(lse2 - lse) out2``. A -inf (no key) weighs 0."""
    (o1, l1), (o2, l2) = a, b
    lse = jnp.logaddexp(l1, l2)
    safe = jnp.where(jnp.isfinite(lse), lse, 0)
    B, T, K, G = lse.shape

    def weigh(o, lse_part):
        return o * jnp.exp(lse_part - safe).reshape(B, T, K * G, 1)  # query head n = k*G + g

    return weigh(o1, l1) + weigh(o2, l2), lse


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


def step_forward(plans: StepPlans, first: bool, r, source, q, k, v, kv_lengths, q_ids, kv_ids):
    """(output (B, T, N, H), log-sum-exp (B, T, K, G)) of this device's queries over
    the keys from ``source``; float32 ``q`` (B, T, N, H), ``k``, ``v`` (B, S, K, H)."""
    K = k.shape[2]
    operands = (r, source, q, k, v, kv_lengths, q_ids, kv_ids)
    if not plans.pairs:
        index, alternatives = _whole_calls(plans, first, r, source)

        def run(calls):
            def branch(*operands):
                _, source, q, k, v, kv_lengths, q_ids, kv_ids = operands
                mask = _key_mask(kv_lengths, _positions(plans, source))
                result = _empty(q, K)
                for name, rows, cols in calls:
                    o, lse = _flash._forward(
                        plans[name][0], q[:, rows], k[:, cols], v[:, cols], None,
                        None if mask is None else mask[..., cols], None, None,
                        None if q_ids is None else q_ids[:, rows],
                        None if kv_ids is None else kv_ids[:, cols],
                    )  # fmt: skip
                    result = (result[0].at[:, rows].set(o), result[1].at[:, rows].set(lse))
                return _flash.varying_like(result, *operands)  # every branch alike

            return branch

        return _select(index, [run(calls) for calls in alternatives], operands)

    n = 2 if plans.layout == "zigzag" else 1
    qs, ks, vs = _split(q, n), _split(k, n), _split(v, n)
    q_id_chunks, kv_id_chunks = _split(q_ids, n), _split(kv_ids, n)
    parts = [_empty(qs[0], K) for _ in range(n)]
    for a, c, qc, kc, diagonal in _pair_calls(plans, first, r, source):
        lengths = None if kv_lengths is None else jnp.clip(kv_lengths - kc * plans.C, 0, plans.C)
        pair = (qs[a], ks[c], vs[c], lengths, q_id_chunks[a], kv_id_chunks[c])
        if diagonal:
            block = _flash._forward(plans["own"][0], *pair[:3], None, None, None, *pair[3:])
        else:
            rel = (qc - kc) * plans.C

            def run(kind):
                def branch(*operands):
                    offset, q, k, v, lengths, q_ids, kv_ids = operands
                    if kind == "skip":
                        result = _empty(q, K)
                    else:
                        offset = offset if kind == "general" else None
                        result = _flash._forward(
                            plans[kind][0], q, k, v, None, None, offset, lengths, q_ids, kv_ids
                        )
                    return _flash.varying_like(result, *operands)

                return branch

            branches = [run(kind) for kind in PAIR_KINDS]
            block = jax.lax.switch(_pair_kind(plans, rel), branches, rel, *pair)
        parts[a] = merge(parts[a], block)
    return tuple(jnp.concatenate(x, axis=1) for x in zip(*parts, strict=True))


def step_backward(
    plans: StepPlans, first: bool, r, source, q, k, v, kv_lengths, q_ids, kv_ids, out, lse, d_out
):
    """(dq (B, T, N, H), dk, dv (B, S, K, H)), float32, of the step's share: the
    kernel's backward pass with the final ``out`` and ``lse`` of the queries, so
    it recomputes exactly this step's part of the softmax."""
    operands = (r, source, q, k, v, kv_lengths, q_ids, kv_ids, out, lse, d_out)

    def grads(name, offset, q, k, v, mask, lengths, q_ids, kv_ids, out, lse, d_out):
        residuals = (q, k, v, None, mask, offset, lengths, q_ids, kv_ids, out, lse)
        return _flash._backward(plans[name][1], residuals, d_out)[:3]

    if not plans.pairs:
        index, alternatives = _whole_calls(plans, first, r, source)

        def run(calls):
            def branch(*operands):
                _, source, q, k, v, kv_lengths, q_ids, kv_ids, out, lse, d_out = operands
                mask = _key_mask(kv_lengths, _positions(plans, source))
                dq, dk, dv = jnp.zeros_like(q), jnp.zeros_like(k), jnp.zeros_like(v)
                for name, rows, cols in calls:
                    dq_, dk_, dv_ = grads(
                        name, None, q[:, rows], k[:, cols], v[:, cols],
                        None if mask is None else mask[..., cols], None,
                        None if q_ids is None else q_ids[:, rows],
                        None if kv_ids is None else kv_ids[:, cols],
                        out[:, rows], lse[:, rows], d_out[:, rows],
                    )  # fmt: skip
                    dq = dq.at[:, rows].add(dq_)
                    dk, dv = dk.at[:, cols].add(dk_), dv.at[:, cols].add(dv_)
                return _flash.varying_like((dq, dk, dv), *operands)

            return branch

        return _select(index, [run(calls) for calls in alternatives], operands)

    n = 2 if plans.layout == "zigzag" else 1
    qs, ks, vs = _split(q, n), _split(k, n), _split(v, n)
    q_id_chunks, kv_id_chunks = _split(q_ids, n), _split(kv_ids, n)
    outs, lses, d_outs = _split(out, n), _split(lse, n), _split(d_out, n)
    dq = [jnp.zeros_like(x) for x in qs]
    dk, dv = [jnp.zeros_like(x) for x in ks], [jnp.zeros_like(x) for x in vs]
    for a, c, qc, kc, diagonal in _pair_calls(plans, first, r, source):
        lengths = None if kv_lengths is None else jnp.clip(kv_lengths - kc * plans.C, 0, plans.C)
        pair = (qs[a], ks[c], vs[c], None, lengths, q_id_chunks[a], kv_id_chunks[c])
        rows = (outs[a], lses[a], d_outs[a])
        if diagonal:
            dq_a, dk_c, dv_c = grads("own", None, *pair, *rows)
        else:
            rel = (qc - kc) * plans.C

            def run(kind):
                def branch(*operands):
                    if kind == "skip":
                        result = tuple(jnp.zeros_like(x) for x in operands[1:4])
                    else:
                        offset = operands[0] if kind == "general" else None
                        result = grads(kind, offset, *operands[1:])
                    return _flash.varying_like(result, *operands)

                return branch

            branches = [run(kind) for kind in PAIR_KINDS]
            dq_a, dk_c, dv_c = jax.lax.switch(_pair_kind(plans, rel), branches, rel, *pair, *rows)
        dq[a], dk[c], dv[c] = dq[a] + dq_a, dk[c] + dk_c, dv[c] + dv_c
    return tuple(jnp.concatenate(x, axis=1) for x in (dq, dk, dv))
