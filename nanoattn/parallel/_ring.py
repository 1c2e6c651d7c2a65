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
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import AxisType, NamedSharding, PartitionSpec

from .._backends.flash.kernel import kernel_rules
from .._base import zigzag
from .._base.autodiff import in_forward_mode
from .._base.block_mask import BlockMask
from .._base.mask_fn import check_mask_fn, check_score_fn, closure_converted
from .._base.numerics import softmax_dtype
from .._base.quantized import is_quantized
from .._base.rule_table import ARRAY_KEYWORDS
from .._base.rules import ARGUMENTS, Rules, check_lengths, check_sinks, poison_rows
from .._base.shard_map import sum_to_varying, varying_like
from .._base.validate import check_scale, check_tiles, expect_shape
from .._core.merge import add_sinks
from . import _blocks

# The rule keywords ring_attention takes (those of dot_product_attention's it serves).
RULE_ARGUMENTS = tuple(name for name in ARGUMENTS if name not in ("mask", "bias", "q_offset"))


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


class RingInputs(NamedTuple):
    """The arrays of one ring call on this device (a pytree through the custom_vjp).

    Attributes:
      query: (B, T, N, H); key, value: (B, T, K, H): this device's shards.
      rules: the call's :class:`~nanoattn._base.rules.Rules` on this device (key
        lengths, global and replicated; segment ids of this device's queries and keys;
        :func:`~nanoattn._backends.flash.kernel.kernel_rules`: no functions, no sinks).
      kinds: ``mask_fn``'s block kinds per chunk pair (:func:`_blocks.pair_kinds`), a
        pair of tables (forward, backward), or None.
      consts: the arrays ``score_fn`` closes over, for its forward and its backward
        program (a pair of tuples; they get gradients).
    """

    query: jax.Array
    key: jax.Array
    value: jax.Array
    rules: Rules
    kinds: tuple | None
    consts: tuple


class RingResiduals(NamedTuple):
    """What the ring's backward pass needs: the inputs, and the output and log-sum-exp
    (float32) of this device's queries."""

    inputs: RingInputs
    out: jax.Array
    lse: jax.Array


def _ring_forward(ring: Ring, inputs: RingInputs):
    """(out (B, T, N, Hv) float32, lse (B, T, N) float32) of this device's queries."""
    q, k, v, rules = inputs.query, inputs.key, inputs.value, inputs.rules
    r = jax.lax.axis_index(ring.axis_name)
    acc = softmax_dtype(q.dtype, k.dtype, v.dtype)
    q32 = q.astype(acc)
    table = None if inputs.kinds is None else inputs.kinds[0]
    consts = _per_device(inputs.consts, q)

    def compute(state, kv, step, first):
        kv, kv_ids = kv
        k, v = _unjoined(kv, q.shape[-1])
        source = (r - step) % ring.P  # the device whose keys arrived after `step` hops
        step_rules = rules.replace(kv_segment_ids=kv_ids)  # the arriving keys' ids
        block = _blocks.step_forward(
            ring.steps, first, r, source, q32, k.astype(acc), v.astype(acc), step_rules,
            table, consts,
        )  # fmt: skip
        return block if state is None else _blocks.merge(state, block)

    # keys and values travel as one array: one transfer per hop
    return _walk(ring, None, (_joined(k, v), rules.kv_segment_ids), compute)


def _joined(k, v):
    """Keys (B, T, K, H) and values (B, T, K, Hv) as one array (B, T, K, H + Hv), sent
    around the ring in one transfer per hop (values may be narrower than keys)."""
    return jnp.concatenate([k, v], axis=-1)


def _unjoined(kv, H: int):
    """The keys (B, T, K, H) and values (B, T, K, Hv) of :func:`_joined`."""
    return kv[..., :H], kv[..., H:]


def _ring_backward(ring: Ring, residuals: RingResiduals, cotangents):
    inputs, out, lse = residuals.inputs, residuals.out, residuals.lse
    q, k, v, rules, kinds, consts = inputs
    r = jax.lax.axis_index(ring.axis_name)
    acc = lse.dtype
    d_out, d_lse = (x.astype(acc) for x in cotangents)
    q32 = q.astype(acc)
    table = None if kinds is None else kinds[1]
    primal_consts, consts = consts, _per_device(consts, q)

    def compute(state, kv, step, first):
        dq, d_kv, d_consts = state
        kv, kv_ids = kv
        k, v = _unjoined(kv, q.shape[-1])
        source = (r - step) % ring.P
        step_rules = rules.replace(kv_segment_ids=kv_ids)
        dq_s, dk, dv, dc = _blocks.step_backward(
            ring.steps, first, r, source, q32, k.astype(acc), v.astype(acc), step_rules, out,
            lse, d_out, d_lse, table, consts,
        )  # fmt: skip
        d_consts = tuple(x + y for x, y in zip(d_consts, dc, strict=True))
        return dq + dq_s, d_kv + _joined(dk, dv), d_consts

    def after(state):  # the accumulators travel with their keys; after P hops they are home
        dq, d_kv, d_consts = state
        return dq, ring.shift(d_kv), d_consts  # score_fn's arrays are this device's own

    kv = _joined(k, v)
    zeros = (jnp.zeros_like(q32), jnp.zeros(kv.shape, acc), tuple(map(jnp.zeros_like, consts[1])))
    state = varying_like(zeros, q, k, v)
    dq, d_kv, d_consts = _walk(ring, state, (kv, rules.kv_segment_ids), compute, after)
    forward, backward = primal_consts  # the forward program's arrays get nothing: one use each
    d_consts = tuple(
        sum_to_varying(g, c).astype(c.dtype) for g, c in zip(d_consts, backward, strict=True)
    )
    grads = RingInputs(
        query=dq.astype(q.dtype),
        key=_unjoined(d_kv, k.shape[-1])[0].astype(k.dtype),
        value=_unjoined(d_kv, k.shape[-1])[1].astype(v.dtype),
        rules=None,
        kinds=None,
        consts=(tuple(map(jnp.zeros_like, forward)), d_consts),
    )  # no gradient for the rules (lengths and ids) and the kinds
    return (grads,)


def _per_device(consts, q):
    """score_fn's arrays marked as varying like the queries, once, before the walk:
    a cast inside a step's branch would become, on the way back, a sum over the
    devices that only the devices taking that branch join."""
    return varying_like(consts, q)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _ring_attend(ring, inputs: RingInputs):
    """(out (B, T, N, H), lse (B, T, N)), both float32, differentiable in both."""
    return _ring_forward(ring, inputs)


def _ring_attend_fwd(ring, inputs: RingInputs):
    out, lse = _ring_forward(ring, inputs)
    return (out, lse), RingResiduals(inputs, out, lse)


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
      key: (B, T, K, H), K dividing N (grouped-query heads, contiguous groups); value
        (B, T, K, Hv), Hv the values' head width (H, or its own: docs/latent.md).
      axis_name: the mesh axis the sequence is sharded over.
      is_causal: query at global position p sees keys at positions <= p.
      kv_lengths: int (B,): key positions >= kv_lengths[b] are hidden (global,
        replicated on every device).
      q_segment_ids, kv_segment_ids: int (B, T), both or neither. A step skips, at
        run time, the chunk pairs whose query ids and key ids have disjoint ranges
        in every row (packed documents: the pairs between documents).
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
      (B, T, N, Hv) in the query's dtype, sharded like the query; with
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
    given = locals()
    for name in ("key", "value"):  # before Rules, whose message would ask for scales
        if is_quantized(given[name]):
            raise ValueError(
                f"{name} of dtype {jnp.dtype(given[name].dtype)} is quantized: ring_attention "
                "takes float keys and values (nanoattn.dequantize_kv gives them); quantized "
                "caches are read by dot_product_attention and paged_attention"
            )
    arguments = {name: given[name] for name in RULE_ARGUMENTS if name in given}
    placement = dict(layout=layout, forward_tiles=forward_tiles, backward_tiles=backward_tiles)
    if mesh is not None:
        return _on_mesh(mesh, axis_name, query, key, value, arguments, placement)
    return _ring_call(query, key, value, axis_name, arguments, **placement)


def _ring_call(query, key, value, axis_name, arguments: dict, *, layout, forward_tiles,
               backward_tiles):  # fmt: skip
    """The per-device call (inside shard_map): validation into one
    :class:`~nanoattn._base.rules.Rules`, then the ring."""
    if in_forward_mode(query, key, value):
        raise ValueError(
            "ring_attention's gradient is reverse-mode only (a custom_vjp), and jax "
            "differentiates this call in forward mode (jax.jvp, jax.jacfwd, jax.hessian)"
        )
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
    tiles = (
        check_tiles("forward_tiles", forward_tiles),
        check_tiles("backward_tiles", backward_tiles),
    )
    # mask_fn, score_fn and sinks are checked on the whole sequence (global positions)
    # mask_fn, score_fn, sinks and key lengths are global: checked on the whole sequence
    whole = ("mask_fn", "score_fn", "sinks", "kv_lengths")
    local = {name: value for name, value in arguments.items() if name not in whole}
    scale = check_scale(local.pop("scale"))
    rules = Rules.make(query, key, value, scale=scale, **local)
    if not rules.static_scale:
        raise ValueError(f"ring_attention needs a Python number for scale, got {type(scale)}")
    N = rules.N
    mask_fn, score_fn = _global_fns(arguments["mask_fn"], arguments["score_fn"], B, N, T * P)
    rules = rules.replace(
        mask_fn=mask_fn, score_fn=score_fn, sinks=check_sinks(arguments["sinks"], N),
        kv_lengths=check_lengths(arguments["kv_lengths"], B, T * P),
    )  # fmt: skip
    converted, consts = None, ((), ())
    acc = softmax_dtype(query.dtype, key.dtype, value.dtype)
    C = T // zigzag.check_layout(layout)
    if score_fn is not None:  # its arrays cross the ring's custom_vjp and get gradients
        blocks = _blocks.score_blocks(rules, layout, tiles)
        pairs = [closure_converted(score_fn, B, N, *b, None, acc) for b in blocks]
        converted = tuple(fn for fn, _ in pairs)
        consts = tuple(tuple(arrays) for _, arrays in pairs)
    all_rows = mask_fn is None or _blocks.is_static(mask_fn, B, N, C)
    steps = _blocks.step_plans(rules, layout, P, tiles, converted, all_rows)
    ring = Ring(axis_name, steps)
    kinds = _blocks.pair_kinds(steps, jax.lax.axis_index(axis_name), B, N)
    inputs = RingInputs(query, key, value, kernel_rules(rules), kinds, consts)
    out, lse = _ring_attend(ring, inputs)
    if rules.sinks is not None:
        out, lse = add_sinks(out, lse, rules.sinks.astype(acc))
    out = out.astype(query.dtype)
    result = (out, lse) if rules.return_residual else out
    return poison_rows(result, rules.broken_rows(most=T * P))


def _global_fns(mask_fn, score_fn, B: int, N: int, T: int):
    """``mask_fn`` and ``score_fn`` checked on the whole sequence's (B, N, T, T) (a
    BlockMask for those sizes gives its function)."""
    mask_fn = check_mask_fn(mask_fn, B, N, T, T, None)
    if isinstance(mask_fn, BlockMask):
        mask_fn.check_fits(B, N, T, T, None)
        mask_fn = mask_fn.mask_fn
    return mask_fn, check_score_fn(score_fn, B, N, T, T, None)


def _on_mesh(mesh, axis_name, query, key, value, arguments: dict, placement: dict):
    """``ring_attention`` wrapped in ``jax.shard_map`` over ``mesh``: the sequence
    axis sharded over ``axis_name``, the rules' arrays as
    :meth:`~nanoattn._base.rules.Rules.partition_specs` says."""
    if not isinstance(mesh, jax.sharding.Mesh | jax.sharding.AbstractMesh):
        raise TypeError(f"mesh must be a jax.sharding.Mesh or None, got {mesh!r}")
    if axis_name not in mesh.shape:
        raise ValueError(
            f"axis_name={axis_name!r} is not an axis of the mesh, whose axes are "
            f"{tuple(mesh.shape)}"
        )
    P = mesh.shape[axis_name]
    expect_shape("query", jnp.shape(query), "B T N H", (None,) * 4)
    zigzag.check_divisible(jnp.shape(query)[1], P, placement["layout"])
    seq = PartitionSpec(None, axis_name)
    array_names = [name for name in ARRAY_KEYWORDS if arguments.get(name) is not None]
    arrays = Rules.make(query, key, value, **{name: arguments[name] for name in array_names})
    # mask_fn and score_fn checked here, outside shard_map, where they can be evaluated
    # (elementwise); inside it, under its trace, values made at trace time are traced.
    _global_fns(arguments["mask_fn"], arguments["score_fn"], arrays.B, arrays.N, arrays.T)
    others = {name: value for name, value in arguments.items() if name not in array_names}

    def call(q, k, v, arrays: Rules):
        given = {name: getattr(arrays, name) for name in array_names}
        return _ring_call(q, k, v, axis_name, others | given, **placement)

    specs = (seq, seq, seq, arrays.partition_specs(sequence=axis_name))
    args = [_place(x, mesh, spec) for x, spec in zip((query, key, value), specs, strict=False)]
    args.append(jax.tree.map(lambda x, spec: _place(x, mesh, spec), arrays, specs[3]))
    out_specs = (seq, seq) if arguments["return_residual"] else seq
    return jax.shard_map(call, mesh=mesh, in_specs=specs, out_specs=out_specs)(*args)


def _place(x, mesh, spec):
    """``x`` resharded to ``spec`` on a mesh with explicit axes (where shard_map
    does not reshard by itself); unchanged on an automatic mesh."""
    if x is None or AxisType.Explicit not in mesh.axis_types:
        return x
    return jax.reshard(x, NamedSharding(mesh, spec))
