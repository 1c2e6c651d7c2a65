"""``"native"``: the C++ CPU kernel (:mod:`nanoattn._backends.native`) through XLA's FFI;
float32 or bfloat16, no dense mask, bias, ``score_fn`` or dropout, a Python number for
``scale``; ``mask_fn`` served from its block classification and the bits of its partial
blocks (a traced one while those bits stay small); built on the first call it may serve.
Paged calls (``nanoattn.paged_attention``) by its paged forward pass (:mod:`.paged`),
every rule above but ``mask_fn``. A token tree (``tree_parents``): paged, and dense
where causal without ``mask_fn`` (a verify step over a cache), as each row's position
and ancestry bits read by the paged pass (:mod:`.tree`); other dense ones as a
``mask_fn``. Values of a
width Hv of their own (multi-head latent attention): read as they are by the paged pass;
a dense call pads the narrower width with zeros. Quantized keys and values (int8,
float8_e4m3fn with their scales) dense and paged, read and scaled as the blocks are
packed or loaded (the query widened to float32); no gradients through them."""

import jax
import jax.numpy as jnp

from ..._base.paged import split_pool
from ..._base.selection import dense_as_pages, paged_as_pages, read_selected
from ..._base.tree import tree_as_mask
from ..interface import NO_DROPOUT, unserved
from .build import load
from .kernel import decodes_in_place, mask_fn_unsupported, native_attention, tree_decode
from .paged import native_paged_attention
from .tree import tree_in_place

# Where it can serve the call, from this many score cells per batch row and head
# (T * S): in float32 it beat the reference on forward and forward+backward from
# T = 32 on at B * T = 8192; in bfloat16 from T = 64 on, where it also beats flash
# (docs/performance.md).
CPU_MIN_CELLS = 32 * 32
CPU_MIN_CELLS_BF16 = 64 * 64
# A chunk of queries reading a KV cache (key lengths given, keys at least this many
# times the queries) pays off at any size: the pass reads the cache where it lies, while
# the reference computes every slot's score (float32 and bfloat16, B = 1-16 rows of 1-16
# queries over 100-1000 slots, each backend alone: 1.3x-4.4x faster; docs/performance.md).
CACHE_READ_RATIO = 4
# bfloat16 is widened to float32 as the kernel packs its blocks (docs/performance.md).
SERVED = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))


class Native:
    name = "native"
    priority = 2
    reads_combined = True  # a decode step reads a combined cache or pool in place
    serves = frozenset(
        {"is_causal", "window", "kv_lengths", "segment_ids", "logit_soft_cap", "mask_fn", "sinks",
         "page_table", "kv_scales", "value_width", "tree", "selection"}
    )  # fmt: skip

    def unsupported(self, rules, dtype, dropout_rate: float) -> str | None:
        if jax.default_backend() != "cpu":
            return f"it runs on CPU only, and the default backend is {jax.default_backend()!r}"
        if dropout_rate > 0:
            return NO_DROPOUT
        if jnp.dtype(dtype) not in SERVED:
            return f"it supports float32 and bfloat16 inputs only, got {jnp.dtype(dtype)}"
        if reason := unserved(self, rules):
            return reason
        if rules.paged and rules.mask_fn is not None:
            return "a paged call's mask_fn is served by 'xla' and 'flash' only"
        if not rules.static_scale:
            return "it needs a Python number for scale, not a traced array"
        _, reason = load()  # this builds the kernel on first use
        if reason is not None:
            return f"the kernel is not available: {reason}"
        return mask_fn_unsupported(tree_as_mask(rules))  # last: the built kernel's blocks

    def pays_off(self, rules, dtype) -> bool:
        if jax.default_backend() != "cpu":
            return False
        if rules.paged or rules.key_indices is not None:  # the paged pass: no packing
            return True
        if rules.kv_lengths is not None and CACHE_READ_RATIO * rules.T <= rules.S:
            return True  # a decoding step over a cache, however small
        least = CPU_MIN_CELLS_BF16 if jnp.dtype(dtype) == jnp.dtype(jnp.bfloat16) else CPU_MIN_CELLS
        return rules.T * rules.S >= least

    def __call__(self, query, key, value, rules, *, dropout_rate: float, dropout_rng,
                 tiles=None):  # fmt: skip
        if tree_in_place(rules):  # a token tree over a cache: the paged pass in place
            return _run(tree_decode, query, key, value, rules)
        rules = tree_as_mask(rules)  # a token tree: its positions and ancestry as mask_fn
        if value is None and (rules.key_indices is not None or not decodes_in_place(rules)):
            key, value = split_pool(key)  # a combined cache read in place by decodes only
        if rules.key_indices is not None:  # only the selected keys: pages of one key
            return read_selected(self.paged, dense_as_pages, query, key, value, rules)
        if rules.Hv == rules.H:
            return _run(native_attention, query, key, value, rules)
        # values of a width of their own: the narrower of the two widths padded with
        # zeros (a query and key padded dot the same; a value padded adds zero columns),
        # the output cut back to Hv.
        width = max(rules.H, rules.Hv)
        query, key, value = (_padded(x, width) for x in (query, key, value))
        result = _run(native_attention, query, key, value, rules.replace(H=width, Hv=width))
        if rules.return_residual:
            return result[0][..., : rules.Hv], result[1]
        return result[..., : rules.Hv]

    def paged(self, query, key_pages, value_pages, rules):
        if rules.key_indices is not None:
            key_pages, value_pages = split_pool(key_pages, value_pages)
            return read_selected(self.paged, paged_as_pages, query, key_pages, value_pages,
                                 rules)  # fmt: skip
        return _run(native_paged_attention, query, key_pages, value_pages, rules)


def _padded(x, width: int):
    """``x`` (..., H) with zero columns up to ``width``."""
    pad = width - x.shape[-1]
    return x if pad == 0 else jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, pad)])


def _run(attention, query, key, value, rules):
    """``attention(query, key, value, rules)`` on float32 when the dtypes are mixed
    (quantized keys and values are read as stored), its output in the query's dtype."""
    dtype = query.dtype
    quantized = rules.key_scales is not None  # read as stored (int8, float8)
    values = key if value is None else value  # None: key is a combined pool
    if not quantized and not dtype == key.dtype == values.dtype:  # mixed: all float32
        query, key = query.astype(jnp.float32), key.astype(jnp.float32)
        value = None if value is None else value.astype(jnp.float32)
    out, lse = attention(query, key, value, rules)
    out = out.astype(dtype)
    return (out, lse) if rules.return_residual else out


BACKEND = Native()
