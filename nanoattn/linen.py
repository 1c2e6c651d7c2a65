"""Flax linen modules for nanoattn."""

from ._layers.config import AttentionConfig as AttentionConfig
from ._layers.linen.attention import CausalSelfAttention as CausalSelfAttention
from ._layers.linen.attention import CrossAttention as CrossAttention
from ._layers.linen.attention import MultiHeadAttention as MultiHeadAttention
from ._layers.linen.attention import cache_bytes as cache_bytes
from ._layers.linen.attention import rewind as rewind
