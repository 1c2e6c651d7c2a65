"""Flax linen modules for nanoattn."""

from ._interop.deepseek import from_deepseek as from_deepseek
from ._interop.transformers import from_transformers as from_transformers
from ._interop.transformers import to_transformers as to_transformers
from ._layers.config import AttentionConfig as AttentionConfig
from ._layers.latent_config import LatentConfig as LatentConfig
from ._layers.linen.attention import CausalSelfAttention as CausalSelfAttention
from ._layers.linen.attention import CrossAttention as CrossAttention
from ._layers.linen.attention import MultiHeadAttention as MultiHeadAttention
from ._layers.linen.attention import accept as accept
from ._layers.linen.attention import cache_bytes as cache_bytes
from ._layers.linen.attention import rewind as rewind
from ._layers.linen.latent import LatentAttention as LatentAttention
