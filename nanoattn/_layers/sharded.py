"""Head-parallel and sequence-parallel attention layers: the partitioning metadata
of the parameters, and the attention call of a layer whose config names mesh
axes (``AttentionConfig.head_axis``, ``sequence_axis``).

Logical axis names of the parameters (on linen ``nn.LogicallyPartitioned``
boxes and NNX ``out_sharding`` metadata, attached only when ``head_axis`` is set, so
a default layer's parameters are unchanged)::

    qkv.kernel (D, (N + 2K) H): ("embed", "qkv")      out.kernel (D, D): ("joined_heads", "embed")
    q.kernel   (D, D):          ("embed", "joined_heads")   kv.kernel (D, 2KH): ("embed", "kv")
    biases: the kernel's last name

:func:`logical_rules` maps them to mesh axes: ``joined_heads`` (the N*H rows
of the output projection, the N*H columns of a cross-attention query) to the
head axis, everything else replicated. The fused ``[Q | K | V]`` columns of
``qkv`` (and ``[K | V]`` of ``kv``) cannot be cut into contiguous per-device
blocks of whole heads, so those kernels stay replicated; their products are
still computed per device for its heads only (the layer constrains q, k and
v to be sharded over heads, and each device multiplies by its heads' columns).

Axis letters (docs/conventions.md): B batch, T query time, S key time, N query
heads, K key/value heads, H head width, D model width.
"""

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from .._base.mask_fn import global_heads
from .._base.rule_table import ARRAY_KEYWORDS
from .._base.rules import Rules
from .._base.zigzag import to_zigzag
from .._core.api import dot_product_attention

PARAMETER_AXES = {
    "qkv": ("embed", "qkv"),
    "q": ("embed", "joined_heads"),
    "kv": ("embed", "kv"),
    "out": ("joined_heads", "embed"),
}


def logical_rules(head_axis: str = "model") -> tuple[tuple[str, str | None], ...]:
    """The default rules from the parameters' logical axes to mesh axes, for
    ``flax.linen.logical_axis_rules`` / ``nn.logical_to_mesh_sharding``: the heads
    of the output (and cross-attention query) projection over ``head_axis``."""
    if not isinstance(head_axis, str) or not head_axis:
        error = ValueError if isinstance(head_axis, str) else TypeError
        raise error(f"head_axis must be a mesh axis name (a non-empty str), got {head_axis!r}")
    return (("embed", None), ("joined_heads", head_axis), ("qkv", None), ("kv", None))


def parameter_axes(name: str):
    """(kernel axes, bias axes) of the projection ``name``."""
    kernel = PARAMETER_AXES[name]
    return kernel, kernel[-1:]


def has_mesh() -> bool:
    """Whether a mesh is set (``jax.set_mesh``). Without one, a layer whose config
    names mesh axes computes as if they were unset (one device; e.g. ``init``)."""
    return not jax.sharding.get_abstract_mesh().empty


def _axis_size(axis: str, what: str) -> int:
    mesh = jax.sharding.get_abstract_mesh()
    if axis not in mesh.shape:
        raise ValueError(f"{what}={axis!r} is not an axis of the mesh, whose axes are {mesh.shape}")
    return mesh.shape[axis]


def default_positions(cfg, T: int):
    """RoPE positions (T,) of the tokens in the layer's sequence order: with a
    zigzag ``sequence_axis`` the sequence arrives permuted (``to_zigzag``)."""
    positions = jnp.arange(T)
    if cfg.sequence_axis is None or cfg.sequence_layout != "zigzag" or not has_mesh():
        return positions
    P = _axis_size(cfg.sequence_axis, "sequence_axis")
    return to_zigzag(positions, P, axis=0)


def _check_heads(cfg):
    if cfg.head_axis is None:
        return
    M = _axis_size(cfg.head_axis, "head_axis")
    if cfg.kv_heads % M:
        raise ValueError(
            f"head_axis={cfg.head_axis!r} has {M} devices, which must divide the key/value "
            f"heads K={cfg.kv_heads} (and N={cfg.n_heads})"
        )


def attend_sharded(cfg, q, k, v, *, dropout_rate: float, dropout_rng, **mask_args):
    """The attention of a layer whose config names mesh axes: q (B, T, N, H) and
    k, v (B, S, K, H) sharded over heads (``head_axis``) and, with
    ``sequence_axis``, ring attention over the sequence. Returns (B, T, N, H)."""
    dropout = dict(dropout_rate=dropout_rate, dropout_rng=dropout_rng)
    implementation = cfg.implementation
    if not has_mesh():
        return dot_product_attention(q, k, v, implementation=implementation, **dropout, **mask_args)
    _check_heads(cfg)
    heads = PartitionSpec(None, None, cfg.head_axis, None)
    if cfg.sequence_axis is None:
        q, k, v = (jax.lax.with_sharding_constraint(x, heads) for x in (q, k, v))
        out = dot_product_attention(q, k, v, implementation=implementation, **dropout, **mask_args)
        return jax.lax.with_sharding_constraint(out, heads)
    unsupported = [
        name
        for name in ("mask", "q_offset", "kv_lengths", "bias")
        if mask_args.get(name) is not None
    ]
    if unsupported or dropout_rate > 0 or not mask_args.get("is_causal"):
        raise ValueError(
            f"sequence_axis={cfg.sequence_axis!r} runs causal self-attention over the whole "
            f"sequence without dropout, a dense mask, a bias or a KV cache; got "
            f"{', '.join(unsupported) or ('dropout' if dropout_rate > 0 else 'is_causal=False')}"
        )
    _axis_size(cfg.sequence_axis, "sequence_axis")
    seq = PartitionSpec(None, cfg.sequence_axis, cfg.head_axis, None)
    array_names = [name for name in ARRAY_KEYWORDS if mask_args.get(name) is not None]
    arrays = Rules.make(q, k, v, **{name: mask_args.get(name) for name in array_names})
    specs = arrays.partition_specs(sequence=cfg.sequence_axis, heads=cfg.head_axis)

    # From the public package, at call time: nanoattn.parallel re-exports this module's
    # logical_rules, so an import at load time would be a cycle.
    from ..parallel import ring_attention

    def ring(q, k, v, arrays: Rules):
        mask_fn, score_fn = mask_args.get("mask_fn"), mask_args.get("score_fn")
        mask_fn, score_fn = global_heads(mask_fn, score_fn, cfg.head_axis, q.shape[2])
        given = {name: getattr(arrays, name) for name in array_names}
        return ring_attention(
            q, k, v, axis_name=cfg.sequence_axis, is_causal=True,
            window=mask_args.get("window"), logit_soft_cap=mask_args.get("logit_soft_cap"),
            scale=mask_args.get("scale"), layout=cfg.sequence_layout, mask_fn=mask_fn,
            score_fn=score_fn, **given,
        )  # fmt: skip

    in_specs = (seq, seq, seq, specs)
    return jax.shard_map(ring, in_specs=in_specs, out_specs=seq)(q, k, v, arrays)
