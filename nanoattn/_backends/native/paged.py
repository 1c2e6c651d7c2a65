"""The native kernel over a paged KV cache (``nanoattn.paged_attention``): the forward
pass in C++ (``paged.h``: keys and values read from the pool through the page table,
no gathered copy), the backward pass the flash kernel's (:func:`~nanoattn._backends.
flash.paged.paged_gradients`, which walks the same pages) under a ``custom_vjp``.

The C++ side takes the query (Tq, N, H), the pools (P, page_size, K, H) and (P,
page_size, K, Hv) (values of a width of their own: multi-head latent attention), all
float32 or all bfloat16 (one FFI target per type), or a float32 query over int8 or float8_e4m3fn
pools with their float32 scales (P, page_size, K) (a target of its own, read and scaled
in registers), the safe page table (B, M') (every id in the
pool: :func:`~nanoattn._backends.flash.paged.paged_inputs`), the key lengths (B,), the
query starts (B + 1,), the real rows (Tq,) as uint8, each sequence's first query
position (B,) or nothing (its last q_len positions: a paged call's; a dense cache read
in place gives its rows' offsets), a token tree's rows (Tq, 1 + W) or nothing
(:mod:`.tree`: each row's position and its ancestors in its chunk, which the C++ pass
masks column by column; the backward pass is flash's over the tree as a ``mask_fn``),
and the rules as attributes:
``scale``, ``soft_cap`` (0: none) and the band ``left``/``right`` (-1: unbounded). It
returns the output (Tq, N, Hv) and the log-sum-exp (Tq, N), float32 (the backward pass
needs the unrounded output), zeros and ``-inf`` for a row that is not real or sees
no key. Axis letters: Tq query tokens, B sequences, P pages, N query heads, K
key/value heads, H head width.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp

from ..._base.paged import split_pool
from ..._base.rules import Rules
from ..._base.tree import tree_as_mask
from ..flash.paged import PagedInputs, PagedPlan, on_auto_axes, paged_gradients, paged_inputs
from .kernel import paged_forward_call, static_rules
from .tree import tree_returned_reads, tree_rows

_F32 = jnp.dtype(jnp.float32)


def native_paged_attention(query, key_pages, value_pages, rules: Rules):
    """A paged call by the native kernel.

    Args:
      query: (Tq, N, H); key_pages, value_pages: (P, page_size, K, H), or one combined
        pool (P, page_size, 2, K, H) and None (read in place), all float32 or
        all bfloat16, or int8 / float8_e4m3fn pools with ``rules.key_scales`` and
        ``rules.value_scales`` (P, page_size, K); ``rules`` from
        :meth:`Rules.make_paged`, without mask_fn or score_fn
        (:mod:`nanoattn._backends.native.backend` refuses them), a tree
        (``tree_parents``) served.

    Returns:
      (out (Tq, N, H), lse (Tq, N)), float32 (the caller rounds ``out``),
      differentiable in the query and float pools (quantized pools raise the
      flash kernel's NO_QUANTIZED_GRADIENTS).
    """
    pool = None  # a combined pool, which the forward pass reads in place
    if value_pages is None:
        pool, (key_pages, value_pages) = key_pages, split_pool(key_pages)  # for gradients
    positions, tree = tree_rows(rules)
    plan, inputs = paged_inputs(query, key_pages, value_pages, tree_as_mask(rules))
    if tree is not None:  # rows whose band, at their tree positions, reaches a page given back
        reads = tree_returned_reads(rules, positions)
        query = jnp.where(reads[:, None, None], jnp.nan, inputs.query)
        inputs = dataclasses.replace(inputs, query=query)
    call = functools.partial(_attend, plan, static_rules(rules))
    return on_auto_axes(call, inputs.query, inputs, tree, pool)  # a mesh of Explicit axes: Auto


def _forward(attributes, inputs: PagedInputs, tree, pool):
    """(out (Tq, N, Hv), lse (Tq, N)), float32, by the C++ pass: over the combined
    ``pool`` where there is one (given twice: its keys and its values), so that its
    halves in ``inputs`` (the gradients') are never formed in a forward pass."""
    q = inputs.query
    pools = (inputs.key_pages, inputs.value_pages) if pool is None else (pool, pool)
    if inputs.key_scales is not None:  # float32 queries; the pools as stored, their scales
        q = q.astype(_F32)
        pools += (inputs.key_scales.astype(_F32), inputs.value_scales.astype(_F32))
    return paged_forward_call(
        q, pools, inputs.table, inputs.kv_lengths, inputs.starts, inputs.real,
        jnp.zeros((0,), jnp.int32), attributes, tree,
    )  # fmt: skip


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _attend(plan: PagedPlan, attributes, inputs: PagedInputs, tree, pool):
    return _forward(attributes, inputs, tree, pool)


def _attend_fwd(plan: PagedPlan, attributes, inputs: PagedInputs, tree, pool):
    out, lse = _forward(attributes, inputs, tree, pool)
    return (out, lse), (inputs, out, lse)


def _attend_bwd(plan: PagedPlan, attributes, residuals, cotangents):
    # A tree: the plan's mask_fn (tree_as_mask). A combined pool's gradient reaches it
    # through its halves in inputs (the pool itself: none).
    inputs, out, lse = residuals
    return paged_gradients(plan, inputs, out, lse, *cotangents), None, None


_attend.defvjp(_attend_fwd, _attend_bwd)
