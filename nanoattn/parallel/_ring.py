r"""Sequence-parallel ring attention over a mesh axis (Ring Attention, Liu et al. 2023).

Each of the P devices on ``axis_name`` holds a shard of the sequence: its
queries stay, and the key/value shards travel around the ring with
``lax.ppermute`` (device r sends to r + 1), so after P - 1 hops every device
has seen every key. Each block is the flash kernel at its global positions
(:mod:`nanoattn.parallel._blocks`); the partial outputs merge exactly through
their log-sum-exp (:func:`nanoattn.merge_attention`):

.. math::

   \ell = \log(e^{\ell_1} + e^{\ell_2}), \qquad
   o = e^{\ell_1 - \ell} o_1 + e^{\ell_2 - \ell} o_2 .

The backward pass (a ``jax.custom_vjp``) sends the key/value shards around
again, together with their gradient accumulators, which arrive back at their
owner after P hops; no device ever holds more than two key/value shards, so
memory per device is O(T / P). The next shard's ``ppermute`` is issued before
the current shard's compute, so the transfer can overlap it.

Axis letters (docs/conventions.md): B batch, T query time, S key time, N query
heads, K key/value heads, G = N / K, H head width; C the chunk length.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.sharding import AxisType, NamedSharding, PartitionSpec

from .._core.base import zigzag
from .._core.base.block_mask import BlockMask
from .._core.base.mask_fn import check_mask_fn, check_score_fn, closure_converted
from .._core.base.numerics import softmax_dtype
from .._core.base.rules import attention_spec, check_sinks
from .._core.base.shard_map import sum_to_varying, varying_like
from .._core.base.validate import check_scale, check_tiles, expect_flag, expect_shape
from .._core.merge import add_sinks
from . import _blocks


@dataclasses.dataclass(frozen=True)
class Ring:
    """Everything static about one ring call (hashable: a custom_vjp argument)."""

    axis_name: str
    steps: _blocks.StepPlans

    @property
    def P(self) -> int:
        return self.steps.P

    def shift(self, x):
        """Sends ``x`` (a pytree) one hop along the ring: device r to device r + 1."""
        perm = [(i, (i + 1) % self.P) for i in range(self.P)]
        return jax.tree.map(lambda a: jax.lax.ppermute(a, self.axis_name, perm), x)


def _walk(ring: Ring, state, kv, compute, after=None):
    """Runs ``compute(state, kv, step, first)`` on the key/value shard that is at this
    device after ``step`` hops, for step = 0 .. P-1, with exactly P - 1 hops of
    ``kv``: the next hop is issued before the current compute, so the transfer
    can overlap it. Steps 1 .. P-2 are one ``lax.scan`` (the program's size does
    not grow with P). ``after(state)`` runs after every step (the backward pass
    sends its gradient accumulators on with it)."""
    after = after or (lambda state: state)
    if ring.P == 1:
        return after(compute(state, kv, 0, True))
    arriving = ring.shift(kv)
    state = after(compute(state, kv, 0, True))
    if ring.P > 2:

        def body(carry, step):
            state, kv = carry
            arriving = ring.shift(kv)
            return (after(compute(state, kv, step, False)), arriving), None

        (state, arriving), _ = jax.lax.scan(body, (state, arriving), jnp.arange(1, ring.P - 1))
    return after(compute(state, arriving, ring.P - 1, False))


def _ring_forward(ring: Ring, q, k, v, kv_lengths, q_ids, kv_ids, kinds, consts):
    """(out (B, T, N, H) float32, lse (B, T, N) float32) of this device's queries."""
    r = jax.lax.axis_index(ring.axis_name)
    acc = softmax_dtype(q.dtype, k.dtype, v.dtype)
    q32 = q.astype(acc)
    table = None if kinds is None else kinds[0]
    consts = _per_device(consts, q)

    def compute(state, kv, step, first):
        (k, v), kv_ids = kv
        source = (r - step) % ring.P  # the device whose keys arrived after `step` hops
        block = _blocks.step_forward(
            ring.steps, first, r, source, q32, k.astype(acc), v.astype(acc), kv_lengths,
            q_ids, kv_ids, table, consts,
        )  # fmt: skip
        return block if state is None else _blocks.merge(state, block)

    # keys and values travel as one array: one transfer per hop
    return _walk(ring, None, (jnp.stack([k, v]), kv_ids), compute)


def _ring_backward(ring: Ring, residuals, cotangents):
    q, k, v, kv_lengths, q_ids, kv_ids, kinds, consts, out, lse = residuals
    r = jax.lax.axis_index(ring.axis_name)
    acc = lse.dtype
    d_out, d_lse = (x.astype(acc) for x in cotangents)
    q32 = q.astype(acc)
    table = None if kinds is None else kinds[1]
    primal_consts, consts = consts, _per_device(consts, q)

    def compute(state, kv, step, first):
        dq, d_kv, d_consts = state
        (k, v), kv_ids = kv
        source = (r - step) % ring.P
        dq_s, dk, dv, dc = _blocks.step_backward(
            ring.steps, first, r, source, q32, k.astype(acc), v.astype(acc), kv_lengths,
            q_ids, kv_ids, out, lse, d_out, d_lse, table, consts,
        )  # fmt: skip
        d_consts = tuple(x + y for x, y in zip(d_consts, dc, strict=True))
        return dq + dq_s, d_kv + jnp.stack([dk, dv]), d_consts

    def after(state):  # the accumulators travel with their keys; after P hops they are home
        dq, d_kv, d_consts = state
        return dq, ring.shift(d_kv), d_consts  # score_fn's arrays are this device's own

    kv = jnp.stack([k, v])
    zeros = (jnp.zeros_like(q32), jnp.zeros(kv.shape, acc), tuple(map(jnp.zeros_like, consts[1])))
    state = varying_like(zeros, q, k, v)
    dq, d_kv, d_consts = _walk(ring, state, (kv, kv_ids), compute, after)
    forward, backward = primal_consts  # the forward program's arrays get nothing: one use each
    d_consts = tuple(
        sum_to_varying(g, c).astype(c.dtype) for g, c in zip(d_consts, backward, strict=True)
    )
    grads = (dq.astype(q.dtype), d_kv[0].astype(k.dtype), d_kv[1].astype(v.dtype))
    return (*grads, None, None, None, None, (tuple(map(jnp.zeros_like, forward)), d_consts))


def _per_device(consts, q):
    """score_fn's arrays marked as varying like the queries, once, before the walk:
    a cast inside a step's branch would become, on the way back, a sum over the
    devices that only the devices taking that branch join."""
    return varying_like(consts, q)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _ring_attend(ring, q, k, v, kv_lengths, q_ids, kv_ids, kinds, consts):
    """(out (B, T, N, H), lse (B, T, N)), both float32, differentiable in both."""
    return _ring_forward(ring, q, k, v, kv_lengths, q_ids, kv_ids, kinds, consts)


def _ring_attend_fwd(ring, q, k, v, kv_lengths, q_ids, kv_ids, kinds, consts):
    out, lse = _ring_forward(ring, q, k, v, kv_lengths, q_ids, kv_ids, kinds, consts)
    return (out, lse), (q, k, v, kv_lengths, q_ids, kv_ids, kinds, consts, out, lse)


_ring_attend.defvjp(_ring_attend_fwd, _ring_backward)


def ring_attention(
    query,
    key,
    value,
    *,
    axis_name,
    is_causal=False,
    kv_lengths=None,
    q_segment_ids=None,
    kv_segment_ids=None,
    window=None,
    logit_soft_cap=None,
    scale=None,
    layout="zigzag",
    mesh=None,
    forward_tiles=None,
    backward_tiles=None,
    mask_fn=None,
    score_fn=None,
    sinks=None,
    return_residual=False,
):
    r"""Self-attention over a sequence sharded on the mesh axis ``axis_name``.

    .. math::

       \mathrm{out}_{tn} = \sum_{s \in \mathrm{allowed}(t)}
           \mathrm{softmax}_s(\mathrm{scale}\; q_{tn} \cdot k_{s,n/G})\, v_{s,n/G}

    exactly as ``nanoattn.dot_product_attention`` on the whole sequence (same
    masks, zero rows, float32 statistics; docs/conventions.md), computed with
    the sequence split over the P devices of ``axis_name``: queries stay,
    key/value shards go around the ring (P - 1 hops forward; the backward pass
    sends them and their gradients around again). Memory per device is
    O(T / P); the sequence is never gathered.

    Call it inside ``jax.shard_map`` with the sequence axis (axis 1) of q, k,
    v and the segment ids sharded over ``axis_name``, and ``kv_lengths``
    replicated; or pass ``mesh=`` to have it wrap itself in ``shard_map``
    with exactly those specs. Positions are global: with
    ``layout="contiguous"`` device r holds tokens ``r T/P .. (r+1) T/P - 1``;
    with ``layout="zigzag"`` (the default; see :func:`to_zigzag`) it holds
    chunks r and 2P-1-r of 2P, so causal work is balanced. The arrays are
    then in zigzag order along T, inputs and output alike.

    Args:
      query: (B, T, N, H) (per device: (B, T/P, N, H)).
      key, value: (B, T, K, H), K dividing N (grouped-query heads, contiguous groups).
      axis_name: the mesh axis the sequence is sharded over.
      is_causal: query at global position p sees keys at positions <= p.
      kv_lengths: int (B,): key positions >= kv_lengths[b] are hidden (global,
        replicated on every device).
      q_segment_ids, kv_segment_ids: int (B, T), both or neither.
      window: int w or (left, right): position p sees keys p-left .. p+right.
      logit_soft_cap: c > 0: logits become c tanh(logits / c).
      scale: a Python float; default 1 / sqrt(H).
      layout: "zigzag" or "contiguous".
      mesh: a ``jax.sharding.Mesh``: wrap in ``jax.shard_map`` over it
        (arguments are then the global arrays).
      forward_tiles, backward_tiles: the kernel's ``(block_q, block_k, lanes)``
        per pass (default: sized per chunk, as ``nanoattn.flash_attention``).
      mask_fn: ``mask_fn(b, n, q_pos, k_pos) -> bool``, as in
        ``nanoattn.dot_product_attention``, called with **global** positions
        (the token's place in the whole sequence, in either layout): what it
        closes over must be indexed by global position (e.g. document ids
        (B, T) of the whole sequence, replicated). Its blocks are classified
        per chunk pair once per call (at trace time when it depends on static
        things only, else at run time for this device's queries); pairs it
        hides wholly are skipped, their empty blocks too. A
        ``nanoattn.BlockMask`` built for (B, N, T, T) is accepted; its
        function is classified afresh at the ring's chunk pairs.
      score_fn: ``score_fn(score, b, n, q_pos, k_pos) -> score`` at global
        positions; gradients flow to the arrays it closes over.
      sinks: (N,) logits, one per query head, in every row's softmax
        denominator (replicated; gradients flow to them).
      return_residual: also return the log-sum-exp (B, T, N) float32 (sinks
        included; ``-inf`` for a row with nothing), sharded like the query.

    Returns:
      (B, T, N, H) in the query's dtype, sharded like the query; with
      ``return_residual``, ``(out, lse)``.

    Raises:
      ValueError: T not divisible into the layout's chunks (2P for zigzag,
        P for contiguous), shapes that disagree, a traced scale.

    Example (8 devices; ``XLA_FLAGS=--xla_force_host_platform_device_count=8``)::

        mesh = jax.make_mesh((8,), ("sp",))
        q, k, v = (to_zigzag(x, 8) for x in (q, k, v))  # (B, T, ., H), T % 16 == 0
        out = ring_attention(q, k, v, axis_name="sp", is_causal=True, mesh=mesh)
        out = from_zigzag(out, 8)  # == nanoattn.dot_product_attention(..., is_causal=True)
    """
    options = dict(
        is_causal=is_causal, window=window, logit_soft_cap=logit_soft_cap, scale=scale,
        layout=layout, forward_tiles=forward_tiles, backward_tiles=backward_tiles,
        mask_fn=mask_fn, score_fn=score_fn, return_residual=return_residual,
    )  # fmt: skip
    if mesh is not None:
        return _on_mesh(
            mesh, axis_name, query, key, value, kv_lengths, q_segment_ids, kv_segment_ids, sinks,
            options,
        )  # fmt: skip
    return _ring_call(
        query, key, value, kv_lengths, q_segment_ids, kv_segment_ids, sinks, axis_name, **options
    )


def _ring_call(
    query, key, value, kv_lengths, q_ids, kv_ids, sinks, axis_name, *, is_causal, window,
    logit_soft_cap, scale, layout, forward_tiles, backward_tiles, mask_fn, score_fn,
    return_residual,
):  # fmt: skip
    """The per-device call (inside shard_map): validation, then the ring."""
    zigzag.check_layout(layout)
    try:
        P = jax.lax.axis_size(axis_name)
    except NameError:
        raise ValueError(
            f"axis_name={axis_name!r} is not bound here: call ring_attention inside "
            "jax.shard_map over a mesh with that axis, or pass mesh="
        ) from None
    expect_shape("query", jnp.shape(query), "B T N H", (None,) * 4)
    T = jnp.shape(query)[1]
    B = jnp.shape(query)[0]
    expect_shape("key", jnp.shape(key), "B S K H", (B, T, None, jnp.shape(query)[3]))
    zigzag.check_divisible(T * P, P, layout)  # T here is this device's T / P
    if kv_lengths is not None:
        kv_lengths = jnp.asarray(kv_lengths)
        expect_shape("kv_lengths", kv_lengths.shape, "B", (B,))
    scale = check_scale(scale)
    tiles = (
        check_tiles("forward_tiles", forward_tiles),
        check_tiles("backward_tiles", backward_tiles),
    )
    spec = attention_spec(
        query, key, value, is_causal=is_causal, window=window, logit_soft_cap=logit_soft_cap,
        scale=scale, kv_lengths=kv_lengths, q_segment_ids=q_ids, kv_segment_ids=kv_ids,
    )  # fmt: skip
    if not spec.static_scale:
        raise ValueError(f"ring_attention needs a Python number for scale, got {type(scale)}")
    return_residual = expect_flag("return_residual", return_residual)
    B, N = spec.B, spec.N
    mask_fn, score_fn = _global_fns(mask_fn, score_fn, B, N, T * P)
    sinks = check_sinks(sinks, N)
    converted, consts = None, ((), ())
    acc = softmax_dtype(query.dtype, key.dtype, value.dtype)
    C = T // zigzag.check_layout(layout)
    if score_fn is not None:  # its arrays cross the ring's custom_vjp and get gradients
        blocks = _blocks.score_blocks(spec, layout, tiles)
        pairs = [closure_converted(score_fn, B, N, *b, None, acc) for b in blocks]
        converted = tuple(fn for fn, _ in pairs)
        consts = tuple(tuple(arrays) for _, arrays in pairs)
    all_rows = mask_fn is None or _blocks.is_static(mask_fn, B, N, C)
    steps = _blocks.step_plans(spec, layout, P, tiles, mask_fn, converted, all_rows)
    ring = Ring(axis_name, steps)
    kinds = _blocks.pair_kinds(steps, jax.lax.axis_index(axis_name), B, N)
    out, lse = _ring_attend(ring, query, key, value, spec.kv_lengths, q_ids, kv_ids, kinds, consts)
    if sinks is not None:
        out, lse = add_sinks(out, lse, sinks.astype(acc))
    out = out.astype(query.dtype)
    return (out, lse) if return_residual else out


def _global_fns(mask_fn, score_fn, B: int, N: int, T: int):
    """``mask_fn`` and ``score_fn`` checked on the whole sequence's (B, N, T, T) (a
    BlockMask for those sizes gives its function)."""
    mask_fn = check_mask_fn(mask_fn, B, N, T, T, None)
    if isinstance(mask_fn, BlockMask):
        mask_fn.check_fits(B, N, T, T, None)
        mask_fn = mask_fn.mask_fn
    return mask_fn, check_score_fn(score_fn, B, N, T, T, None)


def _on_mesh(mesh, axis_name, query, key, value, kv_lengths, q_ids, kv_ids, sinks, options):
    """``ring_attention`` wrapped in ``jax.shard_map`` over ``mesh``: the sequence
    axis sharded over ``axis_name``, everything else replicated."""
    if not isinstance(mesh, jax.sharding.Mesh | jax.sharding.AbstractMesh):
        raise TypeError(f"mesh must be a jax.sharding.Mesh or None, got {mesh!r}")
    if axis_name not in mesh.shape:
        raise ValueError(
            f"axis_name={axis_name!r} is not an axis of the mesh, whose axes are "
            f"{tuple(mesh.shape)}"
        )
    P = mesh.shape[axis_name]
    expect_shape("query", jnp.shape(query), "B T N H", (None,) * 4)
    zigzag.check_divisible(jnp.shape(query)[1], P, options["layout"])
    seq = PartitionSpec(None, axis_name)
    ids = None if q_ids is None else seq

    def call(q, k, v, lengths, q_ids, kv_ids, sinks):
        return _ring_call(q, k, v, lengths, q_ids, kv_ids, sinks, axis_name, **options)

    lengths = None if kv_lengths is None else PartitionSpec()
    heads = None if sinks is None else PartitionSpec()
    specs = (seq, seq, seq, lengths, ids, ids, heads)
    inputs = (query, key, value, kv_lengths, q_ids, kv_ids, sinks)
    args = [_place(x, mesh, spec) for x, spec in zip(inputs, specs, strict=True)]
    out_specs = (seq, seq) if options["return_residual"] else seq
    return jax.shard_map(call, mesh=mesh, in_specs=specs, out_specs=out_specs)(*args)


def _place(x, mesh, spec):
    """``x`` resharded to ``spec`` on a mesh with explicit axes (where shard_map
    does not reshard by itself); unchanged on an automatic mesh."""
    if x is None or AxisType.Explicit not in mesh.axis_types:
        return x
    return jax.reshard(x, NamedSharding(mesh, spec))
