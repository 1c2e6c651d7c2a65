"""Parallel attention on a ``jax.sharding.Mesh``: sequence-parallel ring attention
(:func:`ring_attention`) and the layouts of its shards (:func:`to_zigzag`,
:func:`from_zigzag`), and the default rules from the layers' logical parameter
axes to mesh axes (:func:`logical_rules`). docs/parallel.md shows the mesh setup and what the tests
prove."""

from .._base.zigzag import from_zigzag as from_zigzag
from .._base.zigzag import to_zigzag as to_zigzag
from .._layers.sharded import logical_rules as logical_rules
from ._ring import ring_attention as ring_attention
