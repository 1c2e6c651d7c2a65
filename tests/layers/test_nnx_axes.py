"""The NNX layers' logical axis names (head_axis set) through flax's current metadata,
``out_sharding``: no deprecation warning (flax deprecates ``sharding_names``), and the
names nnx.get_partition_spec reads are the layers' (nanoattn/_layers/sharded.py)."""

import warnings

from flax import nnx
from jax.sharding import PartitionSpec as P

from nanoattn import nnx as nanoattn_nnx


def test_head_axis_names_the_parameters_without_a_deprecation_warning():
    config = nanoattn_nnx.AttentionConfig(d_model=16, n_heads=2, head_axis="model")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        module = nanoattn_nnx.CausalSelfAttention(config, rngs=nnx.Rngs(0))
        specs = nnx.to_pure_dict(nnx.get_partition_spec(nnx.state(module, nnx.Param)))
    assert specs["qkv"]["kernel"] == P("embed", "qkv")
    assert specs["out"]["kernel"] == P("joined_heads", "embed")
    assert specs["qkv"]["bias"] == P("qkv")
