"""Flax linen modules for nanoattn."""

from .._config import AttentionConfig as AttentionConfig
from ._attention import CausalSelfAttention as CausalSelfAttention
from ._attention import CrossAttention as CrossAttention
from ._attention import MultiHeadAttention as MultiHeadAttention
from ._attention import cache_bytes as cache_bytes
from ._attention import rewind as rewind
