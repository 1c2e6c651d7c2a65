"""Parallel attention on a ``jax.sharding.Mesh``: sequence-parallel ring attention
(:func:`ring_attention`) and the layouts of its shards (:func:`to_zigzag`,
:func:`from_zigzag`), the default rules from the layers' logical parameter
axes to mesh axes (:func:`logical_rules`), and serving on a mesh: paged attention of
data-parallel groups with the heads split (:func:`sharded_paged_attention`), the
groups' batches end to end (:func:`concat_batches`) and the layout of a KV cache
(:func:`cache_shardings`). docs/parallel.md shows the mesh setup and what the tests
prove."""

from .._base.zigzag import from_zigzag as from_zigzag
from .._base.zigzag import to_zigzag as to_zigzag
from .._layers.sharded import logical_rules as logical_rules
from ._groups import cache_shardings as cache_shardings
from ._groups import concat_batches as concat_batches
from ._paged import sharded_paged_attention as sharded_paged_attention
from ._ring import ring_attention as ring_attention
