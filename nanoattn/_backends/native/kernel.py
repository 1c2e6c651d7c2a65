"""The native kernel as a JAX function: ``ffi_call`` forward and backward under
a ``custom_vjp``.

The C++ side (``attention.cc``) takes q (B, T, N, H), k and v (B, S, K, H), all
float32 or all bfloat16 (one pair of FFI targets per type), or float32 queries over
int8 or float8_e4m3fn keys and values with their float32 scales (B, S, K) (a forward
target of its own: gradients through a quantized cache are refused), per-row ``q_offset``
and ``kv_lengths`` (B,), segment ids
(B, T) and (B, S) (or empty), a ``mask_fn`` as its blocks (or empty; see
:func:`_mask_operands`), and the rules as attributes: ``scale``,
``soft_cap`` (0: none) and the positional band ``left``/``right`` (-1:
unbounded). It returns the output and the per-row log-sum-exp (B, T, N) that the
backward pass recomputes the weights from (``-inf`` for a row that sees no key),
both float32 whatever the inputs' type (the backward pass's row term needs the
unrounded output); the backward pass takes the cotangents of both and returns
gradients in the inputs' type. Under ``vmap`` every operand
gains the mapped axis in front, which the kernel folds into B.
"""

import ctypes
import functools

import jax
import jax.numpy as jnp
import numpy as np

from ..._base.block_mask import CHUNK_CELLS, EMPTY, FULL, PARTIAL, BlockMask, classify
from ..._base.mask_fn import evaluate_mask, grid
from ..._base.paged import split_pool
from ..._base.quantized import NO_QUANTIZED_GRADIENTS
from ..._base.rules import Rules
from ..._base.shard_map import sum_to_varying, varying_like
from ..._base.tree import tree_as_mask
from .build import load
from .tree import dense_tree_rows

_F32 = jnp.dtype(jnp.float32)
# The element types the kernel serves, and the suffix of their FFI targets.
TARGET_SUFFIX = {jnp.dtype(jnp.float32): "", jnp.dtype(jnp.bfloat16): "_bf16"}
# A mask_fn whose kinds are traced (it closes over traced arrays, or the offset is
# traced) has the bits of every block computed at run time, two bits a cell of whole
# blocks (each cell in both layouts): the kernel serves it up to this many bytes of bits
# (a decoding step's, one query block, are 16 * S bytes per row and head) and leaves
# larger ones to 'flash', which needs none.
TRACED_BITS_LIMIT = 16 * 2**20
# With static kinds, the partial blocks' bits are worked out once, when the call is
# traced, and become a constant of the compiled program, up to this many bytes (1,024 a
# block); more are computed at run time, in every call.
CONSTANT_BITS_LIMIT = 8 * 2**20
# A dense call of at most this many queries per row and no segment ids or mask_fn (a
# decoding step over a full cache) is served by the paged pass, each row of the cache a
# page read in place (:func:`_decode`): no key block is packed, and only the keys each
# row may see are read.
DECODE_ROWS = 16


def native_attention(query, key, value, rules: Rules):
    """Attention by the native kernel, with the reference's output contract.

    Args:
      query: (B, T, N, H) float32 or bfloat16; key, value: (B, S, K, H), cast to
        the query's type (products and softmax in float32), or int8 / float8_e4m3fn
        with ``rules.key_scales`` and ``rules.value_scales`` (B, S, K) (dequantized as
        the kernel packs its blocks; the query widened to float32); ``rules`` from
        :meth:`nanoattn._base.rules.Rules.make` that the ``native`` backend
        (:mod:`nanoattn._backends.native`) accepts.

    Returns:
      (out (B, T, N, H), lse (B, T, N)), float32 (the caller rounds ``out`` to its
      dtype), differentiable in both: ``lse``
      is the log-sum-exp of each row's visible logits, ``-inf`` for a row that
      sees no key (the convention of the flash kernel and of ``jax.nn``'s
      residuals). Quantized keys: differentiating raises NO_QUANTIZED_GRADIENTS.
    """
    if decodes_in_place(rules):
        return _decode(query, key, value, rules)
    if rules.key_scales is not None:
        return _attend_quantized(*_quantized_operands(query, key, value, rules))
    return _attend(*_operands(query, key, value, rules))


def decodes_in_place(rules: Rules) -> bool:
    """Whether a dense call is served by the paged pass over its cache in place: 1 to
    DECODE_ROWS queries a row, at least one key, no segment ids and no mask_fn."""
    decode = 1 <= rules.T <= DECODE_ROWS and rules.S >= 1
    return decode and rules.q_segment_ids is None and rules.mask_fn is None


def _decode(query, key, value, rules: Rules):
    """A dense decoding call by the paged pass (paged.h): row b of the cache (S, K, H) is
    page b of a pool of B pages of S slots, read in place up to ``kv_lengths[b]`` (or
    S) and within the band of its queries, which sit at ``q_offset`` + t. The gradients
    (float keys and values) are the dense backward pass's, from the same output and
    log-sum-exp."""
    offsets, lengths = _rows(rules)[:2]
    if rules.key_scales is not None:  # no gradients: a combined cache given twice
        operands = (query.astype(_F32), key, key if value is None else value,
                    rules.key_scales.astype(_F32), rules.value_scales.astype(_F32))  # fmt: skip
        return _decode_quantized(operands, offsets, lengths, static_rules(rules))
    (key, value), pool = _in_place(query, key, value)
    rows, attributes = _rows(rules), static_rules(rules)
    return _decoded(query, key, value, (*rows[:2], None), rows, (attributes, attributes), pool)


def _in_place(query, key, value):
    """``((key, value), pool)`` in the query's type: a combined cache (B, S, 2, K, H)
    (``value`` None) as ``pool``, which the forward pass reads in place, and its halves
    for the gradients (never formed without them); or the two arrays and None."""
    if value is None:
        pool = key.astype(query.dtype)
        return split_pool(pool), pool
    return (key.astype(query.dtype), value.astype(query.dtype)), None


def tree_decode(query, key, value, rules: Rules):
    """A dense call with a token tree that the paged pass serves over its cache in place
    (tree.py's ``tree_in_place``: causal, no mask_fn), as :func:`_decode` serves a
    decoding step, each query at its tree position and seeing only its ancestors in its
    chunk (tree.py's ``dense_tree_rows``): no key block packed, no mask bits computed.
    Returns (out (B, T, N, H), lse (B, T, N)), float32. The gradients are the dense
    backward pass's over the tree as a ``mask_fn`` (``tree_as_mask``), whose bits are
    computed only where a gradient is taken (unused otherwise, so compiled away)."""
    masked = tree_as_mask(rules)
    offsets, lengths = _rows(rules)[:2]
    (key, value), pool = _in_place(query, key, value)
    rows = (offsets, lengths, dense_tree_rows(rules))
    attributes = (static_rules(rules), static_rules(masked))
    return _decoded(query, key, value, rows, _rows(masked), attributes, pool)


def _decode_forward(operands, offsets, lengths, attributes, tree=None):
    """(out (B, T, N, Hv), lse (B, T, N)), float32: the paged pass over the dense cache;
    ``operands``: q (B, T, N, H), k, v (B, S, K, H|Hv), and the scales (B, S, K) of
    quantized keys and values; ``tree``: a token tree's rows (B * T, 1 + W) (tree.py's
    ``dense_tree_rows``) or None."""
    q = operands[0]
    B, T, N, _ = q.shape
    table = jnp.arange(B, dtype=jnp.int32)[:, None]  # row b: page b, one page of S slots
    starts = jnp.arange(B + 1, dtype=jnp.int32) * T
    real = jnp.ones((B * T,), jnp.uint8)
    out, lse = paged_forward_call(
        q.reshape(B * T, N, -1), operands[1:], table, lengths, starts, real, offsets,
        attributes, tree=tree,
    )  # fmt: skip
    return out.reshape(B, T, N, -1), lse.reshape(B, T, N)


def paged_forward_call(q, pools, table, lengths, starts, real, offsets, attributes,
                       tree=None):  # fmt: skip
    """The paged pass (paged.h) by FFI: q (Tq, N, H) float32 or bfloat16 (float32 over
    quantized pools), ``pools`` (key pages (P, page_size, K, H), value pages (P,
    page_size, K, Hv), or a combined pool (P, page_size, 2, K, H) given twice, and for
    quantized pools their scales (P, page_size, K)), the page
    table (B, M), key lengths (B,), query starts (B + 1,), real rows (Tq,), first query
    positions (B,) or (0,), the static rules, and a token tree's rows (Tq, 1 + W) int32
    (:func:`~nanoattn._backends.native.tree.tree_rows`) or None. Returns (out (Tq, N,
    Hv), lse (Tq, N)), float32.

    Partitioned over heads by XLA (``custom_partitioning``): with the query's heads and
    the pools' key/value heads split over a mesh axis, each device runs the pass on its
    own heads (page table, lengths and starts replicated) and no key or value moves
    between devices; an axis whose size does not divide K is refused in one line. Inside
    ``jax.shard_map`` the results vary over the manual axes its operands vary over."""
    quantized = len(pools) == 4
    combined = pools[0].ndim == 5
    tree = jnp.zeros((0, 1), jnp.int32) if tree is None else tree
    table, lengths, starts, offsets, tree = (
        x.astype(jnp.int32) for x in (table, lengths, starts, offsets, tree)
    )
    N, K = q.shape[1], pools[0].shape[-2]
    call = _batchable(quantized, combined, N // K if K > 1 else 0, attributes)
    operands = (q, *pools, table, lengths, starts, real.astype(jnp.uint8), offsets, tree)
    # Inside shard_map the FFI call's results vary over no axis by their type: marked as
    # their operands do, or a gradient through them would be summed over the devices.
    return varying_like(call(*operands), *operands)


@functools.cache
def _batchable(quantized: bool, combined: bool, G: int, attributes):
    """:func:`_partitioned` under ``vmap`` too: a batch of calls runs one after another
    (``custom_partitioning`` has no batching rule of its own)."""
    from jax.custom_batching import custom_vmap

    partitioned = _partitioned(quantized, combined, G, attributes)
    local = functools.partial(_local_call, quantized, attributes)

    @custom_vmap
    def call(*operands):
        return partitioned(*operands)

    @call.def_vmap
    def rule(axis_size, in_batched, *operands):
        operands = [
            x if batched else jnp.broadcast_to(x, (axis_size, *x.shape))
            for x, batched in zip(operands, in_batched, strict=True)
        ]
        return jax.lax.map(lambda ops: local(*ops), operands), (True, True)

    return call


def _local_call(quantized: bool, attributes, q, *operands):
    """The FFI call on the arrays as they are (one device's, when partitioned)."""
    target = "nanoattn_paged_forward" + ("_quantized" if quantized else TARGET_SUFFIX[q.dtype])
    Tq, N, _ = q.shape
    Hv = operands[1].shape[-1]
    call = jax.ffi.ffi_call(
        target,
        (jax.ShapeDtypeStruct((Tq, N, Hv), _F32), jax.ShapeDtypeStruct((Tq, N), _F32)),
        vmap_method="sequential",
    )
    return call(q, *operands, **_attributes(attributes))


@functools.cache
def _partitioned(quantized: bool, combined: bool, G: int, attributes):
    """:func:`_local_call` under ``custom_partitioning``: the query's heads (K groups of
    G) and the pools' K split alike; every other operand replicated. ``G`` 0: a pool of
    one head (K = 1), which the query's heads may split without (a compound factor of
    size 1 is no sharding rule). ``combined``: one pool (P, page_size, 2, K, H) given
    twice (its keys and its values)."""
    from jax.experimental.custom_partitioning import custom_partitioning

    local = functools.partial(_local_call, quantized, attributes)
    fn = custom_partitioning(local)
    pools = "p s c k h, p s c k h" if combined else "p s k h, p s k v"
    pools += ", p s k, p s k" if quantized else ""
    heads = {0: "n", 1: "k"}.get(G, "(k g)")
    rule = f"t {heads} h, {pools}, b m, b, c, t, o, r w -> t {heads} v, t {heads}"

    def partition(mesh, arg_shapes, result_shape):
        shardings = tuple(a.sharding for a in arg_shapes)
        _check_heads(mesh, shardings[1], arg_shapes[1].shape[-2], arg_shapes[1].ndim - 2)
        return mesh, local, tuple(r.sharding for r in result_shape), shardings

    fn.def_partition(partition=partition, sharding_rule=rule, **({"g": G} if G > 1 else {}))
    return fn


def _check_heads(mesh, pool_sharding, K: int, axis: int = 2) -> None:
    """Raises ValueError when the pool's key/value heads (its axis ``axis``) are split
    over mesh axes whose size does not divide K."""
    spec = getattr(pool_sharding, "spec", None)
    axes = spec[axis] if spec is not None and len(spec) > axis else None
    if axes is None:
        return
    axes = axes if isinstance(axes, tuple) else (axes,)
    size = int(np.prod([mesh.shape[a] for a in axes]))
    if K % size:
        name = axes[0] if len(axes) == 1 else axes
        raise ValueError(
            f"the pool's K={K} key/value heads cannot be split over the mesh axis {name!r} "
            f"of size {size}; shard the heads over an axis whose size divides K"
        )


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _decoded(q, k, v, rows, dense_rows, attributes, pool):
    """The paged pass over a dense cache: ``rows`` (offsets, lengths, a tree's rows or
    None) with ``attributes[0]``, over ``pool`` (a combined cache, given twice) where
    there is one, else k and v; its gradients the dense backward pass's over k and v
    and ``dense_rows`` (:func:`_rows`) with ``attributes[1]``."""
    return _decoded_fwd(q, k, v, rows, dense_rows, attributes, pool)[0]


def _decoded_fwd(q, k, v, rows, dense_rows, attributes, pool):
    pools = (k, v) if pool is None else (pool, pool)
    out, lse = _decode_forward((q, *pools), *rows[:2], attributes[0], tree=rows[2])
    return (out, lse), (q, k, v, out, lse, dense_rows, rows)


def _decoded_bwd(attributes, residuals, cotangents):
    *dense, rows = residuals  # a combined cache's gradient reaches it through k and v
    grads = _attend_bwd(attributes[1], tuple(dense), cotangents)
    return (*grads[:3], (None,) * len(rows), grads[3:], None)


_decoded.defvjp(_decoded_fwd, _decoded_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _decode_quantized(operands, offsets, lengths, attributes):
    return _decode_forward(operands, offsets, lengths, attributes)


def _decode_quantized_fwd(operands, offsets, lengths, attributes):
    return _decode_quantized(operands, offsets, lengths, attributes), None


def _decode_quantized_bwd(attributes, residuals, cotangents):
    raise ValueError(NO_QUANTIZED_GRADIENTS)


_decode_quantized.defvjp(_decode_quantized_fwd, _decode_quantized_bwd)


@functools.cache
def block_sizes() -> tuple[int, int]:
    """(BQ, BK): the query and key blocks of every pass of the built kernel (64 and 64
    unless ``NANOATTN_NATIVE_CFLAGS`` defines others)."""
    library, reason = load()
    if library is None:
        raise RuntimeError(f"the native kernel is not available: {reason}")
    library.NanoattnBlockQ.restype = library.NanoattnBlockK.restype = ctypes.c_int
    return library.NanoattnBlockQ(), library.NanoattnBlockK()


def mask_fn_unsupported(rules: Rules) -> str | None:
    """Why the kernel cannot serve ``rules.mask_fn`` (one sentence), or None: a mask
    whose kinds are traced is served while the bits of all its blocks stay within
    :data:`TRACED_BITS_LIMIT`."""
    if rules.mask_fn is None or rules.T * rules.S == 0:
        return None
    static, xB, xN = _probe(rules)
    if static:
        return None
    bq, bk = block_sizes()
    size = xB * xN * -(-rules.T // bq) * -(-rules.S // bk) * 2 * bq * bk // 8
    if size <= TRACED_BITS_LIMIT:
        return None
    return (
        f"mask_fn depends on traced values, so the kernel would need the bits of all its "
        f"blocks at run time, {size / 2**20:.0f} MiB here (at most "
        f"{TRACED_BITS_LIMIT // 2**20} MiB); 'flash' serves it without them"
    )


def _probe(rules: Rules) -> tuple[bool, int, int]:
    """(static, xB, xN): whether ``mask_fn``'s kinds are found at trace time, and how
    many batch rows and heads it tells apart (1 on an axis it does not depend on); from
    one cell per row and head."""
    mask = rules.mask_fn
    if isinstance(mask, BlockMask):
        return mask.static, *mask.kinds.shape[:2]
    with jax.ensure_compile_time_eval():
        cells = evaluate_mask(mask, *grid(rules.B, rules.N, 1, 1, rules.q_offset))
    return not isinstance(cells, jax.core.Tracer), cells.shape[0], cells.shape[1]


def _mask_operands(rules: Rules):
    """``mask_fn`` as the kernel takes it, at its blocks (BQ, BK):

    - kinds, int8 (xB, xN, nQ, nK): EMPTY, PARTIAL or FULL per block (xB 1 or B, xN 1
      or N: an axis the mask does not depend on is 1);
    - slots, int32 (xB, xN, nQ, nK): a partial block's row in the bits, -1 elsewhere;
    - bits, uint8 (P, 2 * BQ * BK / 8): each partial block's cells, the (BQ, BK) rows
      of queries packed along the keys, then the (BK, BQ) rows of keys packed along the
      queries (bit c of a row in byte c // 8, little-endian), cells past T or S 0.

    With static kinds P is the number of partial blocks, and mask_fn is evaluated on
    those blocks only (O(P * BQ * BK) memory, never (T, S)). With traced kinds every
    block's bits are computed at run time, in chunks of query blocks, and the kinds
    derived from them (P = xB * xN * nQ * nK). Without mask_fn all three are empty.
    """
    if rules.mask_fn is None or rules.T * rules.S == 0:
        return jnp.zeros((0,), jnp.int8), jnp.zeros((0,), jnp.int32), jnp.zeros((0,), jnp.uint8)
    bq, bk = block_sizes()
    static, xB, xN = _probe(rules)
    kinds = _static_kinds(rules, bq, bk) if static else None
    if not isinstance(kinds, np.ndarray):
        return _traced_operands(rules, xB, xN, bq, bk)
    partial = np.argwhere(kinds == PARTIAL)  # (P, 4): b, n, query block, key block
    slots = np.full(kinds.shape, -1, np.int32)
    slots[tuple(partial.T)] = np.arange(len(partial), dtype=np.int32)
    return jnp.asarray(kinds), jnp.asarray(slots), _partial_bits(rules, partial, bq, bk)


def _mask_fn_of(rules: Rules):
    mask = rules.mask_fn
    return mask.mask_fn if isinstance(mask, BlockMask) else mask


def _static_kinds(rules: Rules, bq: int, bk: int):
    """The kinds (xB, xN, nQ, nK) at the kernel's blocks, per batch row and head: a
    static BlockMask's coarsened where the kernel's blocks are multiples of its own (as
    ``BlockMask.kinds_at``, without reducing over B and N), classified afresh otherwise."""
    mask, T, S = rules.mask_fn, rules.T, rules.S
    if isinstance(mask, BlockMask):
        if (bq % mask.block_q == 0 or bq >= T) and (bk % mask.block_k == 0 or bk >= S):
            fq = -(-T // mask.block_q) if bq >= T else bq // mask.block_q
            fk = -(-S // mask.block_k) if bk >= S else bk // mask.block_k
            return _coarsen_each(mask.kinds, fq, fk)
    return classify(_mask_fn_of(rules), rules.B, rules.N, T, S, rules.q_offset, bq, bk)


def _coarsen_each(kinds: np.ndarray, fq: int, fk: int) -> np.ndarray:
    """Kinds (xB, xN, nQ, nK) merged over ``fq`` x ``fk`` blocks in each row and head:
    empty when every part is, full when every part is."""
    if fq == fk == 1:
        return kinds.astype(np.int8)
    xB, xN, nq, nk = kinds.shape
    cq, ck = -(-nq // fq), -(-nk // fk)
    pads = ((0, 0), (0, 0), (0, cq * fq - nq), (0, ck * fk - nk))
    parts = (xB, xN, cq, fq, ck, fk)
    most = np.pad(kinds, pads, constant_values=EMPTY).reshape(parts).max(axis=(3, 5))
    least = np.pad(kinds, pads, constant_values=FULL).reshape(parts).min(axis=(3, 5))
    return np.where(least == FULL, FULL, np.where(most == EMPTY, EMPTY, PARTIAL)).astype(np.int8)


def _packed(cells):
    """Cells (..., BQ, BK) as (..., 2 * BQ * BK / 8) bytes: rows along the keys, then
    rows along the queries."""
    rows = jnp.packbits(cells, axis=-1, bitorder="little")  # (..., BQ, BK / 8)
    cols = jnp.packbits(jnp.swapaxes(cells, -1, -2), axis=-1, bitorder="little")
    lead = cells.shape[:-2]
    return jnp.concatenate([rows.reshape(*lead, -1), cols.reshape(*lead, -1)], axis=-1)


def _partial_bits(rules: Rules, partial: np.ndarray, bq: int, bk: int):
    """The bits (P, 2 * BQ * BK / 8) of the partial blocks (b, n, query block, key block):
    ``mask_fn`` on a (P, BQ, BK) stack of cells, CHUNK_CELLS at a time; found when the
    call is traced (a constant, not work in every call) where ``mask_fn`` gives concrete
    cells and the bits take at most CONSTANT_BITS_LIMIT bytes."""
    size = 2 * bq * bk // 8
    if len(partial) == 0:
        return jnp.zeros((0, size), jnp.uint8)
    if len(partial) * size <= CONSTANT_BITS_LIMIT:
        with jax.ensure_compile_time_eval():
            bits = _evaluated_bits(rules, partial, bq, bk)
        return bits if isinstance(bits, jax.core.Tracer) else np.asarray(bits)
    return _evaluated_bits(rules, partial, bq, bk)


def _evaluated_bits(rules: Rules, partial: np.ndarray, bq: int, bk: int):
    """:func:`_partial_bits`'s evaluation of ``mask_fn`` on the (non-empty) partial
    blocks."""
    size = 2 * bq * bk // 8
    mask_fn, T, S = _mask_fn_of(rules), rules.T, rules.S
    offset = jnp.reshape(jnp.asarray(rules.index_offset, jnp.int32), (-1,))  # (1 or B,)
    r, c = jnp.arange(bq, dtype=jnp.int32), jnp.arange(bk, dtype=jnp.int32)

    def one(b, n, i0, j0):  # one block: the cells of queries i0 + r and keys j0 + c
        q = offset[jnp.minimum(b, offset.shape[0] - 1)] + i0 + r
        cells = evaluate_mask(
            mask_fn, b.reshape(1, 1, 1, 1), n.reshape(1, 1, 1, 1), q.reshape(1, 1, bq, 1),
            (j0 + c).reshape(1, 1, 1, bk),
        )  # fmt: skip
        real = ((i0 + r) < T)[:, None] & ((j0 + c) < S)[None, :]
        return _packed(jnp.broadcast_to(cells, (1, 1, bq, bk))[0, 0] & real)

    P, chunk = len(partial), max(1, CHUNK_CELLS // (bq * bk))
    if P > chunk:  # whole chunks: the last padded with copies of the first block
        partial = np.concatenate([partial, np.repeat(partial[:1], -P % chunk, axis=0)])
    b, n, i0, j0 = (jnp.asarray(x, jnp.int32) for x in (partial * [1, 1, bq, bk]).T)
    if P <= chunk:
        return jax.vmap(one)(b, n, i0, j0)
    lanes = [x.reshape(-1, chunk) for x in (b, n, i0, j0)]
    bits = jax.lax.map(lambda a: jax.vmap(one)(*a), lanes)  # (chunks, chunk, size)
    return bits.reshape(-1, size)[:P]


def _traced_operands(rules: Rules, xB: int, xN: int, bq: int, bk: int):
    """Kinds, slots and bits of every block, at run time: ``mask_fn`` on as many query
    blocks at a time as CHUNK_CELLS allows (as ``_block_mask.classify``)."""
    mask_fn, B, N, T, S = _mask_fn_of(rules), rules.B, rules.N, rules.T, rules.S
    nq, nk = -(-T // bq), -(-S // bk)
    chunk = max(1, min(nq, CHUNK_CELLS // (xB * xN * bq * nk * bk)))
    n_chunks = -(-nq // chunk)
    cols_real = jnp.arange(nk * bk) < S

    def of(first):  # query blocks [first, first + chunk)
        b, n, q, k = grid(B, N, chunk * bq, nk * bk, rules.index_offset)
        cells = evaluate_mask(mask_fn, b, n, q + first * bq, k)
        cells = jnp.broadcast_to(cells, (xB, xN, chunk * bq, nk * bk))
        real = ((first * bq + jnp.arange(chunk * bq)) < T)[:, None] & cols_real[None]
        blocks = (cells & real[None, None]).reshape(xB, xN, chunk, bq, nk, bk).swapaxes(3, 4)
        real = real.reshape(1, 1, chunk, bq, nk, bk).swapaxes(3, 4)  # (1, 1, c, nK, bq, bk)
        some, every = blocks.any(axis=(4, 5)), (blocks | ~real).all(axis=(4, 5))
        kinds = jnp.where(every, FULL, jnp.where(some, PARTIAL, EMPTY)).astype(jnp.int8)
        return kinds, _packed(blocks)  # (xB, xN, c, nK), (xB, xN, c, nK, bytes)

    kinds, bits = jax.lax.map(of, jnp.arange(n_chunks, dtype=jnp.int32) * chunk)
    kinds = jnp.moveaxis(kinds, 0, 2).reshape(xB, xN, n_chunks * chunk, nk)[:, :, :nq]
    bits = jnp.moveaxis(bits, 0, 2).reshape(xB, xN, n_chunks * chunk, nk, -1)[:, :, :nq]
    every = jnp.arange(xB * xN * nq * nk, dtype=jnp.int32).reshape(kinds.shape)
    slots = jnp.where(kinds == PARTIAL, every, -1)
    return kinds, slots, bits.reshape(xB * xN * nq * nk, -1)


def static_rules(rules: Rules) -> tuple:
    """The static rules as the kernels take them: (scale, soft_cap (0: none), left,
    right (-1: unbounded)); the dense and the paged forward's."""
    left, right = rules.band if rules.band is not None else (None, None)
    return (
        float(rules.scale),
        float(rules.logit_soft_cap or 0.0),
        -1 if left is None else int(left),
        -1 if right is None else int(right),
    )


def _rows(rules: Rules) -> tuple:
    """The kernel's per-row operands: offsets and lengths (B,), segment ids (B, T) and
    (B, S) (empty without them), mask_fn's kinds, slots and bits (empty without it)."""
    B, S = rules.B, rules.S
    offset = rules.q_offset if rules.band is not None else 0
    offsets = jnp.broadcast_to(jnp.asarray(offset, jnp.int32), (B,))
    lengths = jnp.full((B,), S) if rules.kv_lengths is None else rules.kv_lengths
    if rules.q_segment_ids is None:
        q_seg = kv_seg = jnp.zeros((B, 0))  # empty: no segment rule
    else:
        q_seg, kv_seg = rules.q_segment_ids, rules.kv_segment_ids
    ints = (offsets, lengths.astype(jnp.int32), q_seg.astype(jnp.int32), kv_seg.astype(jnp.int32))
    return (*ints, *_mask_operands(rules))


def _operands(query, key, value, rules: Rules):
    """The kernel's operands: q, k, v in the query's type, the rows (:func:`_rows`) and
    the static rules."""
    key, value = key.astype(query.dtype), value.astype(query.dtype)
    return (query, key, value, *_rows(rules), static_rules(rules))


def _quantized_operands(query, key, value, rules: Rules):
    """The operands of a call over quantized keys: q in float32, k and v as stored,
    their scales (B, S, K) in float32, the rows and the static rules."""
    scales = (rules.key_scales.astype(_F32), rules.value_scales.astype(_F32))
    return (query.astype(_F32), key, value, *scales, *_rows(rules), static_rules(rules))


def _attributes(attributes):
    """The static rules as the FFI's attributes: (scale, soft_cap, left, right)."""
    scale, soft_cap, left, right = attributes
    return dict(
        scale=np.float32(scale), soft_cap=np.float32(soft_cap),
        left=np.int64(left), right=np.int64(right),
    )  # fmt: skip


def _forward(q, k, v, *rows, attributes):
    """``rows``: offsets, lengths, q_seg, kv_seg, mask_fn's kinds, slots and bits."""
    B, T, N, _ = q.shape
    call = jax.ffi.ffi_call(
        "nanoattn_forward" + TARGET_SUFFIX[q.dtype],
        (jax.ShapeDtypeStruct(q.shape, _F32), jax.ShapeDtypeStruct((B, T, N), _F32)),
        vmap_method="broadcast_all",
    )
    # inside shard_map: the results vary as the operands do (an FFI result's type varies
    # over no axis)
    return varying_like(call(q, k, v, *rows, **_attributes(attributes)), q, k, v, *rows)


@functools.partial(jax.custom_vjp, nondiff_argnums=(10,))
def _attend(q, k, v, offsets, lengths, q_seg, kv_seg, kinds, slots, bits, attributes):
    rows = (offsets, lengths, q_seg, kv_seg, kinds, slots, bits)
    return _forward(q, k, v, *rows, attributes=attributes)


def _attend_fwd(q, k, v, offsets, lengths, q_seg, kv_seg, kinds, slots, bits, attributes):
    rows = (offsets, lengths, q_seg, kv_seg, kinds, slots, bits)
    out, lse = _forward(q, k, v, *rows, attributes=attributes)
    return (out, lse), (q, k, v, out, lse, rows)


def _attend_bwd(attributes, residuals, cotangents):
    q, k, v, out, lse, rows = residuals
    dout, dlse = cotangents
    call = jax.ffi.ffi_call(
        "nanoattn_backward" + TARGET_SUFFIX[q.dtype],
        tuple(jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (q, k, v)),
        vmap_method="broadcast_all",
    )
    dq, dk, dv = call(
        q,
        k,
        v,
        out,
        lse,
        dout.astype(q.dtype),
        dlse.astype(_F32),
        *rows,
        **_attributes(attributes),
    )
    # inside shard_map: each device's part, summed over the axes an input does not vary
    # over (keys and values every device holds whole)
    grads = varying_like((dq, dk, dv), q, k, v, out, lse, dout, dlse, *rows)
    dq, dk, dv = (sum_to_varying(g, x) for g, x in zip(grads, (q, k, v), strict=True))
    return (dq, dk, dv) + (None,) * len(rows)


_attend.defvjp(_attend_fwd, _attend_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(12,))
def _attend_quantized(q, k, v, key_scales, value_scales, offsets, lengths, q_seg, kv_seg, kinds,
                      slots, bits, attributes):  # fmt: skip
    """(out, lse) over quantized keys and values with their scales."""
    call = jax.ffi.ffi_call(
        "nanoattn_forward_quantized",
        (jax.ShapeDtypeStruct(q.shape, _F32), jax.ShapeDtypeStruct(q.shape[:-1], _F32)),
        vmap_method="broadcast_all",
    )
    rows = (offsets, lengths, q_seg, kv_seg, kinds, slots, bits)
    operands = (q, k, v, key_scales, value_scales, *rows)
    return varying_like(call(*operands, **_attributes(attributes)), *operands)  # shard_map


def _attend_quantized_fwd(*operands):
    return _attend_quantized(*operands), None


def _attend_quantized_bwd(attributes, residuals, cotangents):
    raise ValueError(NO_QUANTIZED_GRADIENTS)


_attend_quantized.defvjp(_attend_quantized_fwd, _attend_quantized_bwd)
