"""The blockwise kernel over a paged KV cache (``nanoattn.paged_attention``), pure JAX.

The work is a list of (sequence, query block) pairs, made at run time from the
query starts: sequence b's queries, rows ``query_starts[b] ..``, in blocks of
``block_q``. For each pair the kernel walks only the key blocks the pair can see
(``pages_per_block`` pages of the sequence, read through its page table: no page
past those the sequence holds, nor any page the causal band or the window hides
from the whole block), keeping the online softmax (FlashAttention-2) of the pair's
rows, and writes the pair's rows of the output and the log-sum-exp. The loops have
dynamic lengths (``lax.while_loop``), so a step's work follows the tokens each
sequence holds, not the capacity of the page table. The backward pass (a
``jax.custom_vjp``) walks the same pairs and blocks, recomputing the weights from
the log-sum-exp, and adds each key block's gradients to the pages it came from
(pages shared by several sequences receive each one's).

Axis letters: Tq query tokens, B sequences, P pages, M pages per sequence at most,
K key/value heads, G query heads per key/value head, H head width; a pair's block:
q its ``block_q`` rows, k its ``pages_per_block * page_size`` keys.
"""

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from ..._base.mask_fn import closure_converted, evaluate_mask, evaluate_score
from ..._base.numerics import large_negative, softmax_dtype, zero_unseen_keys
from ..._base.paged import returned_entries, returned_reads, safe_page_table
from ..._base.quantized import NO_QUANTIZED_GRADIENTS, dequantize
from ..._base.rules import Rules
from ..._base.shard_map import insertion_index, varying_like
from .step import Layout, Scores, backward_step, finish, forward_step, scores

BLOCK_Q = 16  # query rows per block: a decode token's block wastes few
BLOCK_KEYS = 128  # keys per key block (whole pages; at least one)
# A pair's blocks: queries (and the output and its cotangent) (q, K, G, H), keys and
# values (k, K, H), scores (K, G, q, k).
_LAYOUT = Layout(
    scores="qKGH,kKH->KGqk",
    values="KGqk,kKH->KGqH",
    d_weights="qKGH,kKH->KGqk",
    d_queries="KGqk,kKH->qKGH",
    d_keys="KGqk,qKGH->kKH",
    d_values="KGqk,qKGH->kKH",
)


@dataclasses.dataclass(frozen=True)
class PagedPlan:
    """Everything static about one paged call (hashable: a custom_vjp argument)."""

    Tq: int
    B: int
    M: int
    P: int
    page_size: int
    K: int
    G: int
    H: int
    Hv: int  # the values' (and the output's) head width
    block_q: int
    pages_per_block: int
    scale: float
    band: tuple | None  # (left, right) of the positional rule, or None
    soft_cap: float | None
    mask_fn: Callable | None
    score_fn: Callable | None  # closure-converted: its arrays are inputs

    @property
    def N(self) -> int:
        return self.K * self.G

    @property
    def block_k(self) -> int:
        return self.pages_per_block * self.page_size

    @property
    def n_key_blocks(self) -> int:
        return -(-self.M // self.pages_per_block)

    @property
    def most_pairs(self) -> int:
        """A bound on the (sequence, query block) pairs: each block either lies inside
        one sequence's rows or holds that sequence's last rows."""
        return -(-self.Tq // self.block_q) + self.B


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PagedInputs:
    """The arrays of a paged call (a pytree): query (Tq, N, H), the pools (P,
    page_size, K, H), the safe page table (B, M'), the key lengths (B,), the query
    starts (B + 1,), the rows that are real (Tq,), score_fn's arrays, the
    scales (P, page_size, K) of quantized pools (None for float ones), and the entries
    (B, M') a sequence gave back (``RETURNED``, page 0 in the safe table; None in
    gradients)."""

    query: jax.Array
    key_pages: jax.Array
    value_pages: jax.Array
    table: jax.Array
    kv_lengths: jax.Array
    starts: jax.Array
    real: jax.Array
    consts: tuple = ()
    key_scales: jax.Array | None = None
    value_scales: jax.Array | None = None
    returned: jax.Array | None = None


def plan_of(rules: Rules, key_pages, dtype) -> tuple[PagedPlan, tuple]:
    """The plan of a paged call and ``score_fn``'s arrays (hoisted, as the blockwise
    kernel does, so that they cross the custom_vjp and get gradients)."""
    per_block = max(1, BLOCK_KEYS // rules.page_size)
    M = rules.S // rules.page_size
    plan = PagedPlan(
        Tq=rules.T, B=rules.B, M=M, P=rules.pool_pages, page_size=rules.page_size, K=rules.K,
        G=rules.G, H=rules.H, Hv=rules.Hv, block_q=max(1, min(BLOCK_Q, rules.T)),
        pages_per_block=min(per_block, M), scale=float(rules.scale), band=rules.band,
        soft_cap=rules.logit_soft_cap, mask_fn=rules.mask_fn, score_fn=None,
    )  # fmt: skip
    consts = ()
    if rules.score_fn is not None:
        fn, arrays = closure_converted(
            rules.score_fn, 1, plan.N, plan.block_q, plan.block_k, None, dtype
        )
        plan = dataclasses.replace(plan, score_fn=fn)
        consts = tuple(arrays)
    return plan, consts


def paged_inputs(query, key_pages, value_pages, rules: Rules) -> tuple[PagedPlan, PagedInputs]:
    """The plan and the inputs of a paged call: the page table made safe (every id in
    the pool, page 0 where a sequence holds nothing or gave a page back) and padded to
    whole key blocks (page 0 past M), the entries given back, the rows that are real,
    score_fn's arrays. The native kernel's forward pass takes them too, and its
    backward pass is :func:`paged_gradients`. A call without ``mask_fn`` (its rules a
    band: what native serves) gets a NaN query in each row whose band reaches a page
    given back, which no kernel reads: the row is NaN, as the reference's."""
    acc = softmax_dtype(query.dtype, key_pages.dtype, value_pages.dtype)
    plan, consts = plan_of(rules, key_pages, acc)
    table = safe_page_table(rules.page_table, rules.kv_lengths, rules.page_size, rules.pool_pages)
    width = plan.n_key_blocks * plan.pages_per_block
    table = jnp.pad(table, ((0, 0), (0, width - plan.M)))  # whole key blocks: page 0 past M
    returned = returned_entries(rules.page_table, rules.kv_lengths, rules.page_size)
    returned = jnp.pad(returned, ((0, 0), (0, width - plan.M)))
    layout = rules.layout()
    if rules.mask_fn is None:
        reads = returned_reads(rules.page_table, rules.kv_lengths, layout, rules.page_size,
                               rules.band).any(axis=1)  # fmt: skip
        query = jnp.where(reads[:, None, None], jnp.nan, query)
    inputs = PagedInputs(
        query, key_pages, value_pages, table, rules.kv_lengths.astype(jnp.int32),
        rules.query_starts.astype(jnp.int32), layout.real, consts,
        rules.key_scales, rules.value_scales, returned,
    )  # fmt: skip
    return plan, inputs


def paged_flash_attention(query, key_pages, value_pages, rules: Rules):
    """A paged call by the blockwise kernel: (Tq, N, H) in the query's dtype, and with
    ``rules.return_residual`` the log-sum-exp (Tq, N)."""
    if rules.T == 0:  # no query: nothing to walk
        out = jnp.zeros(query.shape, query.dtype)
        lse = jnp.zeros((0, rules.N), softmax_dtype(query.dtype))
        return (out, lse) if rules.return_residual else out
    plan, inputs = paged_inputs(query, key_pages, value_pages, rules)
    out, lse = on_auto_axes(functools.partial(_attend, plan), inputs.query, inputs)
    return (out, lse) if rules.return_residual else out


def on_auto_axes(kernel, query, *arrays):
    """``kernel(*arrays)`` -> (out (Tq, N, Hv), lse (Tq, N)) of a paged call whose query
    (Tq, N, H) is ``query``. On a mesh with Explicit axes
    (``jax.sharding.AxisType.Explicit``), where the kernel's loop carries would have to
    carry the inputs' shardings in their types, it runs with those axes Auto
    (``jax.sharding.auto_axes``): XLA partitions it as on an automatic mesh (each
    device its own heads when the query's N and the pools' K are split: the native
    call by its partitioning rule), the outputs laid out as the query's Tq and N."""
    sharding = getattr(jax.typeof(query), "sharding", None)
    mesh = getattr(sharding, "mesh", None)
    if mesh is None or mesh.empty or jax.sharding.AxisType.Explicit not in mesh.axis_types:
        return kernel(*arrays)
    rows = (*sharding.spec, None, None)[:2]
    layout = (PartitionSpec(*rows, None), PartitionSpec(*rows))
    return jax.sharding.auto_axes(kernel, out_sharding=layout)(*arrays)


def _pairs(plan: PagedPlan, starts):
    """The (sequence, query block) pairs: their number, and for pair u < that number
    its sequence and first row. Pairs are sequence-major, so that a pair's rows past
    its sequence are written before the next sequence's pairs write them again."""
    q_lens = jnp.maximum(starts[1:] - starts[:-1], 0)  # (B,)
    blocks = -(-q_lens // plan.block_q)  # (B,)
    ends = jnp.cumsum(blocks)  # (B,)
    count = ends[-1] if plan.B else jnp.int32(0)

    def pair(u):
        b = insertion_index(ends, u)
        b = jnp.minimum(b, plan.B - 1)
        i = u - (ends[b] - blocks[b])
        return b, starts[b] + i * plan.block_q

    return count, pair


def _rows(plan: PagedPlan, inputs: PagedInputs, b, first):
    """A pair's rows: their positions (q,) in the sequence and which are real."""
    rows = first + jnp.arange(plan.block_q, dtype=jnp.int32)
    starts, lengths = inputs.starts, inputs.kv_lengths
    q_len = starts[b + 1] - starts[b]
    positions = lengths[b] - q_len + (rows - starts[b])
    real = (rows < starts[b + 1]) & jnp.take(inputs.real, rows, mode="fill", fill_value=False)
    return positions, real


def _key_blocks(plan: PagedPlan, positions, real, length):
    """The key blocks [first, last) a pair can see: only those the sequence holds,
    and, under a positional rule, only those the band reaches from some real row."""
    top = jnp.max(jnp.where(real, positions, -1))
    bottom = jnp.min(jnp.where(real, positions, jnp.iinfo(jnp.int32).max))
    end = length  # keys 0 .. length - 1 are held
    start = jnp.int32(0)
    if plan.band is not None:
        left, right = plan.band
        if right is not None:
            end = jnp.minimum(end, top + right + 1)
        if left is not None:
            start = jnp.maximum(bottom - left, 0)
    any_real = real.any()
    last = jnp.where(any_real, -(-end // plan.block_k), 0)
    first = jnp.where(any_real, start // plan.block_k, 0)
    return first, jnp.maximum(last, first)


def _block(plan: PagedPlan, inputs: PagedInputs, b, j, acc):
    """Key block j of sequence b: keys (k, K, H) in ``acc`` (dequantized), values
    (k, K, Hv) in ``acc`` as stored (not scaled: :func:`_value_weights` folds their
    scales into the weights), NaN for a page the sequence gave back, their positions
    (k,), and the pages they came from (pages_per_block,)."""
    first = j * plan.pages_per_block
    pages = jax.lax.dynamic_slice_in_dim(inputs.table[b], first, plan.pages_per_block)
    keys = _read_pages(
        inputs.key_pages, inputs.key_scales, pages, (plan.block_k, plan.K, plan.H), acc
    )
    values = inputs.value_pages[pages].reshape(plan.block_k, plan.K, plan.Hv).astype(acc)
    returned = jax.lax.dynamic_slice_in_dim(inputs.returned[b], first, plan.pages_per_block)
    returned = jnp.repeat(returned, plan.page_size)[:, None, None]  # (k, 1, 1)
    keys, values = jnp.where(returned, jnp.nan, keys), jnp.where(returned, jnp.nan, values)
    positions = j * plan.block_k + jnp.arange(plan.block_k, dtype=jnp.int32)
    return keys, values, positions, pages


def _value_weights(plan: PagedPlan, inputs: PagedInputs, p, *, pages, acc):
    """The weights p (K, G, q, k) with the scales of quantized values folded in: a
    weight of 0 never reads its value's scale, so a NaN scale reaches only the rows
    that see its token (``0 * NaN`` would spread it to the whole head group)."""
    if inputs.value_scales is None:
        return p
    scales = inputs.value_scales[pages].reshape(plan.block_k, plan.K).astype(acc)  # (k, K)
    return jnp.where(p != 0, p * jnp.einsum("kK->Kk", scales)[:, None, None, :], 0)


def _read_pages(pool, scales, pages, shape, acc):
    """The pages ``pages`` of a pool as one key block ``shape`` (k, K, H) in ``acc``,
    dequantized with their scales (P, page_size, K) when the pool is quantized."""
    block = pool[pages].reshape(shape)
    if scales is None:
        return block.astype(acc)
    return dequantize(block, scales[pages].reshape(shape[:-1]), acc)


def _allowed(plan: PagedPlan, b, q_pos, real, k_pos, length):
    """Which cells of a pair's block are visible: bool (K or 1, G or 1, q, k)."""
    seen = real[:, None] & (k_pos[None, :] < length)  # (q, k)
    if plan.band is not None:
        left, right = plan.band
        if right is not None:
            seen = seen & (k_pos[None, :] <= q_pos[:, None] + right)
        if left is not None:
            seen = seen & (k_pos[None, :] >= q_pos[:, None] - left)
    seen = seen[None]  # (1, q, k)
    if plan.mask_fn is not None:
        n = jnp.arange(plan.N, dtype=jnp.int32).reshape(1, plan.N, 1, 1)
        cells = evaluate_mask(plan.mask_fn, b.reshape(1, 1, 1, 1), n, q_pos.reshape(1, 1, -1, 1),
                              k_pos.reshape(1, 1, 1, -1))  # fmt: skip
        seen = seen & cells[0]  # (N or 1, q, k)
    return seen.reshape(plan.K, plan.G, *seen.shape[1:]) if seen.shape[0] > 1 else seen[None]


def _unseen_zeroed(keys, values, allowed):
    """Keys and values (k, K, H) that no query of the block's key/value head group sees,
    zeroed (:func:`~nanoattn._base.numerics.zero_unseen_keys`; a sequence's block may
    also hold pages it does not: stale content of a freed page)."""
    by_key = jnp.moveaxis(allowed, -1, 0)  # (k, K or 1, G or 1, q)
    return zero_unseen_keys(keys, by_key, (2, 3)), zero_unseen_keys(values, by_key, (2, 3))


def _scores(plan: PagedPlan, qs, keys, b, q_pos, k_pos, allowed, consts, with_vjp=False) -> Scores:
    """:func:`~nanoattn._backends.flash.step.scores` of a pair's block (K, G, q, k) from
    pre-scaled queries (q, K, G, H), ``score_fn`` seeing sequence ``b``'s positions."""
    score = None
    if plan.score_fn is not None:
        n = jnp.arange(plan.N, dtype=jnp.int32).reshape(1, plan.N, 1, 1)
        cells = (b.reshape(1, 1, 1, 1), n, q_pos.reshape(1, 1, -1, 1), k_pos.reshape(1, 1, 1, -1))

        def score(s, consts):
            flat = s.reshape(1, plan.N, *s.shape[2:])
            out = evaluate_score(lambda *a: plan.score_fn(*a, *consts), flat, *cells)
            return out.reshape(s.shape)

    return scores(
        _LAYOUT, qs, keys, allowed, score=score, consts=consts, soft_cap=plan.soft_cap,
        with_vjp=with_vjp,
    )  # fmt: skip


def _forward(plan: PagedPlan, inputs: PagedInputs):
    """(out (Tq, N, Hv), lse (Tq, N)) in the softmax's dtype."""
    q, acc = inputs.query, softmax_dtype(inputs.query.dtype, inputs.key_pages.dtype)
    neg = large_negative(acc)
    rows = plan.Tq + plan.block_q  # padded, so that no block's slice is clamped
    qb = jnp.pad(q.astype(acc), ((0, plan.block_q), (0, 0), (0, 0))) * jnp.asarray(plan.scale, acc)
    qb = qb.reshape(rows, plan.K, plan.G, plan.H)
    out = jnp.zeros((rows, plan.K, plan.G, plan.Hv), acc)
    lse = jnp.full((rows, plan.K, plan.G), 0, acc)  # set to -inf where unseen at the end
    seen_heads = jnp.zeros((rows, plan.K, plan.G), bool)
    out, lse, seen_heads = varying_like((out, lse, seen_heads), inputs)  # inside shard_map
    count, pair = _pairs(plan, inputs.starts)

    def one_pair(u, carry):
        out, lse, seen_heads = carry
        b, first = pair(u)
        q_pos, real = _rows(plan, inputs, b, first)
        length = inputs.kv_lengths[b]
        lo, hi = _key_blocks(plan, q_pos, real, length)
        qs = jax.lax.dynamic_slice_in_dim(qb, first, plan.block_q)  # (q, K, G, H)
        qs = jnp.where(real[:, None, None, None], qs, 0)  # another sequence's rows: unread
        state = (
            jnp.full((plan.K, plan.G, plan.block_q), neg, acc),  # running maximum
            jnp.zeros((plan.K, plan.G, plan.block_q), acc),  # running sum
            jnp.zeros((plan.K, plan.G, plan.block_q, plan.Hv), acc),  # running output
        )
        state = varying_like(state, inputs)

        def one_block(j, state):
            keys, values, k_pos, pages = _block(plan, inputs, b, j, acc)
            allowed = _allowed(plan, b, q_pos, real, k_pos, length)
            keys, values = _unseen_zeroed(keys, values, allowed)
            s = _scores(plan, qs, keys, b, q_pos, k_pos, allowed, inputs.consts).logits
            weights = functools.partial(_value_weights, plan, inputs, pages=pages, acc=acc)
            return forward_step(_LAYOUT, state, s, values, allowed, value_weights=weights)

        m, l, o = jax.lax.fori_loop(lo, hi, one_block, state)
        seen = (l != 0) & real[None, None]  # (K, G, q): NaN content counts as seen
        denominator, block_lse = finish(m, l, seen)
        o = o / denominator[..., None]
        o = jnp.einsum("KGqH->qKGH", jnp.where(seen[..., None], o, 0))
        block_lse, seen = jnp.einsum("KGq->qKG", block_lse), jnp.einsum("KGq->qKG", seen)
        keep = real[:, None, None, None]  # only the pair's own rows are written
        old = jax.lax.dynamic_slice_in_dim(out, first, plan.block_q)
        out = jax.lax.dynamic_update_slice_in_dim(out, jnp.where(keep, o, old), first, 0)
        old = jax.lax.dynamic_slice_in_dim(lse, first, plan.block_q)
        lse = jax.lax.dynamic_update_slice_in_dim(
            lse, jnp.where(keep[..., 0], block_lse, old), first, 0
        )
        old = jax.lax.dynamic_slice_in_dim(seen_heads, first, plan.block_q)
        new = jnp.where(keep[..., 0], seen, old)
        seen_heads = jax.lax.dynamic_update_slice_in_dim(seen_heads, new, first, 0)
        return out, lse, seen_heads

    out, lse, seen_heads = jax.lax.fori_loop(0, count, one_pair, (out, lse, seen_heads))
    out = out[: plan.Tq].reshape(plan.Tq, plan.N, plan.Hv)
    lse = lse[: plan.Tq].reshape(plan.Tq, plan.N)
    seen_heads = seen_heads[: plan.Tq].reshape(plan.Tq, plan.N)
    # -inf marks a row that sees no key (padding rows too), set once the padding is cut
    return out, jnp.where(seen_heads, lse, -jnp.inf)


def _backward(plan: PagedPlan, inputs: PagedInputs, out, lse, d_out, d_lse):
    """Gradients of the query, the pools and score_fn's arrays."""
    acc = lse.dtype
    rows = plan.Tq + plan.block_q
    seen = lse != -jnp.inf  # (Tq, N): rows that see a key (NaN included)

    def padded(x, fill=0):
        return jnp.pad(x, ((0, plan.block_q),) + ((0, 0),) * (x.ndim - 1), constant_values=fill)

    qb = padded(jnp.where(seen[..., None], inputs.query.astype(acc), 0)) * jnp.asarray(
        plan.scale, acc
    )
    qb = qb.reshape(rows, plan.K, plan.G, plan.H)
    dob = padded(d_out.astype(acc)).reshape(rows, plan.K, plan.G, plan.Hv)
    delta = (d_out.astype(acc) * out.astype(acc)).sum(-1) - d_lse.astype(acc)  # (Tq, N)
    delta = padded(delta).reshape(rows, plan.K, plan.G)
    lse_b = padded(jnp.where(seen, lse, 0)).reshape(rows, plan.K, plan.G)
    grads = (
        jnp.zeros((rows, plan.K, plan.G, plan.H), acc),  # dq
        jnp.zeros(inputs.key_pages.shape, acc),
        jnp.zeros(inputs.value_pages.shape, acc),
        tuple(jnp.zeros_like(c) for c in inputs.consts),
    )
    grads = varying_like(grads, inputs, out, lse, d_out, d_lse)  # inside shard_map
    count, pair = _pairs(plan, inputs.starts)

    def one_pair(u, grads):
        dq, dk_pool, dv_pool, d_consts = grads
        b, first = pair(u)
        q_pos, real = _rows(plan, inputs, b, first)
        length = inputs.kv_lengths[b]
        lo, hi = _key_blocks(plan, q_pos, real, length)
        take = functools.partial(jax.lax.dynamic_slice_in_dim, start_index=first,
                                 slice_size=plan.block_q)  # fmt: skip
        qs = jnp.where(real[:, None, None, None], take(qb), 0)  # another sequence's: unread
        dos = take(dob) * real[:, None, None, None]
        delta_i = jnp.einsum("qKG->KGq", take(delta) * real[:, None, None])
        lse_i = jnp.einsum("qKG->KGq", take(lse_b))

        def one_block(j, grads):
            dq_i, dk_pool, dv_pool, d_consts = grads
            keys, values, k_pos, pages = _block(plan, inputs, b, j, acc)
            allowed = _allowed(plan, b, q_pos, real, k_pos, length)
            keys, values = _unseen_zeroed(keys, values, allowed)
            block = _scores(plan, qs, keys, b, q_pos, k_pos, allowed, inputs.consts, True)
            g = backward_step(_LAYOUT, block, lse_i, delta_i, qs, keys, values, dos, allowed)
            dq_i = dq_i + g.query
            shape = (plan.pages_per_block, plan.page_size, plan.K)
            dk_pool = dk_pool.at[pages].add(g.key.reshape(*shape, plan.H))
            dv_pool = dv_pool.at[pages].add(g.value.reshape(*shape, plan.Hv))
            d_consts = tuple(x + y for x, y in zip(d_consts, g.consts, strict=True))
            return dq_i, dk_pool, dv_pool, d_consts

        zero = varying_like(jnp.zeros((plan.block_q, plan.K, plan.G, plan.H), acc), dq)
        dq_i, dk_pool, dv_pool, d_consts = jax.lax.fori_loop(
            lo, hi, one_block, (zero, dk_pool, dv_pool, d_consts)
        )
        old = jax.lax.dynamic_slice_in_dim(dq, first, plan.block_q)
        new = jnp.where(real[:, None, None, None], old + dq_i, old)
        return jax.lax.dynamic_update_slice_in_dim(dq, new, first, 0), dk_pool, dv_pool, d_consts

    dq, dk_pool, dv_pool, d_consts = jax.lax.fori_loop(0, count, one_pair, grads)
    dq = (dq[: plan.Tq] * jnp.asarray(plan.scale, acc)).reshape(inputs.query.shape)
    return dq, dk_pool, dv_pool, d_consts


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attend(plan: PagedPlan, inputs: PagedInputs):
    out, lse = _forward(plan, inputs)
    return out.astype(inputs.query.dtype), lse


def _attend_fwd(plan: PagedPlan, inputs: PagedInputs):
    out, lse = _forward(plan, inputs)
    return (out.astype(inputs.query.dtype), lse), (inputs, out, lse)


def paged_gradients(plan: PagedPlan, inputs: PagedInputs, out, lse, d_out, d_lse) -> PagedInputs:
    """The backward pass of a paged call, given its forward pass's output ``out`` (Tq,
    N, H) and log-sum-exp ``lse`` (Tq, N) in the softmax's dtype (-inf where a row sees
    no key) and their cotangents: the gradients of ``inputs`` (None for the integer
    arrays), each in its input's dtype. The flash kernel's and the native kernel's."""
    if inputs.key_scales is not None:
        raise ValueError(NO_QUANTIZED_GRADIENTS)
    dq, dk, dv, d_consts = _backward(plan, inputs, out, lse, d_out, d_lse)
    return PagedInputs(
        query=dq.astype(inputs.query.dtype), key_pages=dk.astype(inputs.key_pages.dtype),
        value_pages=dv.astype(inputs.value_pages.dtype), table=None, kv_lengths=None,
        starts=None, real=None,
        consts=tuple(g.astype(c.dtype) for g, c in zip(d_consts, inputs.consts, strict=True)),
    )  # fmt: skip


def _attend_bwd(plan: PagedPlan, residuals, cotangents):
    inputs, out, lse = residuals
    return (paged_gradients(plan, inputs, out, lse, *cotangents),)


_attend.defvjp(_attend_fwd, _attend_bwd)
