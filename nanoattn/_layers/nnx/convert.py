"""Parameters between the linen and NNX modules: same names, same shapes.

The linen ``params`` of ``nanoattn.linen.CausalSelfAttention`` are
``{"qkv": {"kernel", "bias"}, "out": {...}, "q_norm": {"scale"}, ...}``; the
NNX module holds the same arrays as ``nnx.Param`` attributes of the same
names, so conversion is a check of names and shapes and a copy.
"""

from collections.abc import Mapping

import jax
import jax.numpy as jnp
from flax import nnx

from .attention import CausalSelfAttention, CrossAttention


def _path(keys) -> str:
    return "/".join(str(k) for k in keys)


def _leaves(tree) -> dict:
    flat, _ = jax.tree_util.tree_flatten_with_path(tree)
    return {_path(getattr(k, "key", k) for k in path): leaf for path, leaf in flat}


def to_linen(module: CausalSelfAttention | CrossAttention) -> dict:
    """The module's parameters as the linen module's ``params`` dict.

    ``linen_layer.apply({"params": to_linen(module)}, x, deterministic=True)``
    gives the NNX module's output.
    """
    if not isinstance(module, CausalSelfAttention | CrossAttention):
        raise TypeError(
            "module must be a nanoattn.nnx CausalSelfAttention or CrossAttention, "
            f"got {type(module).__name__}"
        )
    return nnx.to_pure_dict(nnx.state(module, nnx.Param))


def from_linen(config, linen_params, *, rngs: nnx.Rngs, **kwargs):
    """An NNX module holding the weights of a linen module.

    Args:
      config: the linen module's config.
      linen_params: its ``params`` dict (or the variables ``{"params": ...}``);
        ``qkv`` makes a :class:`CausalSelfAttention`, ``q`` and ``kv`` a
        :class:`CrossAttention`.
      rngs: ``nnx.Rngs`` for the dropout stream (the weights are replaced).
      **kwargs: other constructor arguments (``sow_weights``, ``deterministic``).

    Raises:
      ValueError: a missing, extra or differently shaped or typed parameter.
    """
    if not isinstance(linen_params, Mapping):
        raise TypeError(
            f"linen_params must be a dict of parameters, got {type(linen_params).__name__}"
        )
    params = dict(linen_params)
    if set(params) == {"params"}:
        params = dict(params["params"])
    if "qkv" in params:
        cls = CausalSelfAttention
    elif "q" in params and "kv" in params:
        cls = CrossAttention
    else:
        raise ValueError(
            f"linen_params must hold a self-attention ('qkv', 'out') or a cross-attention "
            f"('q', 'kv', 'out'), got keys {sorted(params)}"
        )
    module = cls(config, rngs=rngs, **kwargs)
    state = nnx.state(module, nnx.Param)
    want, got = _leaves(nnx.to_pure_dict(state)), _leaves(params)
    for name in sorted(set(want) | set(got)):
        if name not in got:
            raise ValueError(f"linen_params lacks {name} {tuple(want[name].shape)} of the config")
        if name not in want:
            raise ValueError(f"linen_params has {name}, which the config does not use")
        w, g = want[name], jnp.asarray(got[name])
        if g.shape != w.shape or g.dtype != w.dtype:
            raise ValueError(
                f"linen_params {name} is {g.dtype.name}{list(g.shape)}; the config "
                f"expects {w.dtype.name}{list(w.shape)}"
            )
    nnx.replace_by_pure_dict(state, params)
    nnx.update(module, state)
    return module
