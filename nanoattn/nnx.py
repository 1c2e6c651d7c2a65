"""Flax NNX modules for nanoattn: the same layers, parameters and cache
semantics as ``nanoattn.linen``, with NNX's state handling."""

from ._layers.config import AttentionConfig as AttentionConfig
from ._layers.latent_config import LatentConfig as LatentConfig
from ._layers.nnx.attention import CausalSelfAttention as CausalSelfAttention
from ._layers.nnx.attention import CrossAttention as CrossAttention
from ._layers.nnx.attention import KVCache as KVCache
from ._layers.nnx.attention import MultiHeadAttention as MultiHeadAttention
from ._layers.nnx.convert import from_linen as from_linen
from ._layers.nnx.convert import to_linen as to_linen
from ._layers.nnx.latent import LatentAttention as LatentAttention
