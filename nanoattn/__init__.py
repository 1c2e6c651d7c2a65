"""nanoattn: multi-head causal attention for JAX and Flax, correct, verified and fast.

Conventions (axis letters, mask polarity, positional causality, zero rows) are
in docs/conventions.md.
"""

from . import parallel as parallel
from ._base.block_mask import BlockMask as BlockMask
from ._base.block_mask import block_mask as block_mask
from ._base.masks import causal_mask as causal_mask
from ._base.masks import combine_masks as combine_masks
from ._base.masks import lengths_to_valid as lengths_to_valid
from ._base.masks import padding_mask as padding_mask
from ._base.masks import segment_mask as segment_mask
from ._base.masks import window_mask as window_mask
from ._base.numerics import large_negative as large_negative
from ._core.api import attention_weights as attention_weights
from ._core.api import dot_product_attention as dot_product_attention
from ._core.api import flash_attention as flash_attention
from ._core.merge import merge_attention as merge_attention
from ._core.paged import paged_attention as paged_attention
from ._core.quantize import dequantize_kv as dequantize_kv
from ._core.quantize import quantize_kv as quantize_kv
from ._core.rope import apply_rope as apply_rope
from ._interop.flax_attention_fn import flax_attention_fn as flax_attention_fn
from ._interop.jax_nn_attention import jax_nn_attention as jax_nn_attention
from ._layers.caches.allocator import PageAllocator as PageAllocator
from ._layers.caches.allocator import PoolExhausted as PoolExhausted
from ._layers.caches.paged import PagedBatch as PagedBatch

__version__ = "0.1.0"
