"""Flax NNX modules for nanoattn: the same layers, parameters and cache
semantics as ``nanoattn.linen``, with NNX's state handling."""

from .._config import AttentionConfig as AttentionConfig
from ._attention import CausalSelfAttention as CausalSelfAttention
from ._attention import CrossAttention as CrossAttention
from ._attention import KVCache as KVCache
from ._attention import MultiHeadAttention as MultiHeadAttention
from ._convert import from_linen as from_linen
from ._convert import to_linen as to_linen
