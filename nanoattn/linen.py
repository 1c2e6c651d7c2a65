"""Flax linen modules for nanoattn."""

from ._interop.transformers import from_transformers as from_transformers
from ._interop.transformers import to_transformers as to_transformers
from ._layers.config import AttentionConfig as AttentionConfig
from ._layers.linen.attention import CausalSelfAttention as CausalSelfAttention
from ._layers.linen.attention import CrossAttention as CrossAttention
from ._layers.linen.attention import MultiHeadAttention as MultiHeadAttention
from ._layers.linen.attention import cache_bytes as cache_bytes
from ._layers.linen.attention import rewind as rewind
