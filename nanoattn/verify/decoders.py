"""Adapters: a decoding layer as the ``(full, init, step)`` triple that
:func:`nanoattn.verify.check_decoding` checks, so that each is one line::

    check_decoding(*decoders.linen(layer, params), d_model=48).raise_if_failed()

:func:`linen` and :func:`nnx` return a :class:`~nanoattn.verify.Decoder`, which
unpacks as that triple and also carries ``rewind`` (and, for a rolling cache,
``capacity`` and ``max_chunk``): ``check_decoding(decoders.linen(layer, params))``
checks those too. For a layer with a paged cache (``config.page_size``) they return a
:class:`~nanoattn.verify.PagedDecoder` instead (``init(pages)``, ``step(state, chunk,
batch)`` with a ``PagedBatch``), which ``check_decoding(decoder)`` runs through a
``PageAllocator``. For a layer with a quantized cache (``config.kv_cache_dtype``) the
decoder also carries ``float_cache``, the same layer and parameters with a float cache
(``kv_cache_dtype=None``), and ``reference``, the layer's full forward in float64 (its
parameters and input cast, computed in float64 under ``jax.enable_x64``), so that
``check_decoding(decoder, atol=...)`` reports the quantization's error next to the
float cache's.

The protocol (B batch, T time, L chunk length, D model width):

* ``full(x) -> y``: the whole sequence at once, x (B, T, D) -> y (B, T, ...);
* ``init(batch, max_len) -> state``: a fresh, empty cache of ``max_len`` slots;
* ``step(state, chunk, lengths) -> (state, y_chunk)``: the next chunk (B, L, D)
  and its outputs (B, L, ...); ``lengths`` is None (all L tokens are real) or
  int (B,), the real tokens of each row of a right-padded chunk.

Every adapter runs its module in evaluation mode (``deterministic=True``) and
compiles each call once per shape, for a short compile (the check runs each
program only a few times). The state is a plain pytree (flax's ``"cache"``
collection, or an NNX graph definition and state), never the caller's module:
the module passed in is not changed.
"""

import dataclasses
import functools
from typing import NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx as _nnx

from .._layers.caches.kinds import policy_of
from ._decoder import Decoder as Decoder
from ._inputs import jit
from ._paged_decoding import PagedDecoder as PagedDecoder


class _Fresh(NamedTuple):
    """The state before the first chunk, for caches whose shape comes from the chunk."""

    batch: int
    max_len: int


def _zeros_like(shapes):
    return jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), shapes)


def _linen_cache(module: nn.Module, **kwargs):
    """A function ``(fresh, chunk) -> cache``: an empty ``"cache"`` collection, as
    ``module.init(key, x, **kwargs)`` creates it (zeros), for an input x (B, max_len,
    ...) of the chunk's dtype; its shapes are traced once per input shape."""

    @functools.cache
    def shapes(x: jax.ShapeDtypeStruct):
        init = functools.partial(module.init, **kwargs)
        return jax.eval_shape(init, jax.random.key(0), x)["cache"]

    def empty(fresh: _Fresh, chunk):
        dtype = jax.dtypes.canonicalize_dtype(chunk.dtype)
        x = jax.ShapeDtypeStruct((fresh.batch, fresh.max_len, *chunk.shape[2:]), dtype)
        return _zeros_like(shapes(x))

    return empty


def _kv_cache_dtype(module) -> str | None:
    """The storage dtype of ``module``'s quantized cache, None for a float cache (or a
    module without nanoattn's config)."""
    return getattr(getattr(module, "config", None), "kv_cache_dtype", None)


def _float_config(module, **changes):
    """``module.config`` without its quantized cache, with ``changes``."""
    return dataclasses.replace(module.config, kv_cache_dtype=None, **changes)


def _wide(tree):
    """``tree`` with every floating array in float64 (call under ``jax.enable_x64``)."""

    def cast(a):
        return a.astype(jnp.float64) if jnp.issubdtype(a.dtype, jnp.floating) else a

    return jax.tree.map(cast, tree)


def _float64(forward, state):
    """``reference(x)``: ``forward(state, x)`` (jitted) with ``state`` and a float ``x``
    in float64, under ``jax.enable_x64`` (token ids stay integers)."""
    forward = jit(forward)

    def reference(x):
        with jax.enable_x64(True):
            x = np.asarray(x)
            if np.issubdtype(x.dtype, np.floating):
                x = x.astype(np.float64)
            return np.asarray(forward(_wide(state), x))

    return reference


def _with_float_cache(decoder, float_cache, reference):
    """``decoder`` (a Decoder or PagedDecoder) carrying ``float_cache`` and
    ``reference``."""
    return dataclasses.replace(decoder, float_cache=float_cache, reference=reference)


def _params(variables) -> dict:
    """``{"params": ...}`` from either the variables or the bare parameters."""
    return {"params": variables["params"] if "params" in variables else variables}


ROLLING_SLACK = 4  # the default rolling capacity C = W + S0 + 4: chunks of up to 4 tokens


def _bounds(module, capacity: int | None) -> dict:
    """``capacity`` and ``max_chunk`` for a :class:`Decoder` of ``module``, from the
    cache policy of ``module.config``: a cache that wraps (a rolling one) is bounded by
    C = ``capacity`` slots (default: the fewest whose chunk limit is ROLLING_SLACK,
    W + S0 + 4 for a rolling cache) and takes at most ``max_chunk``, its chunk limit
    (C - W - S0); any other cache keeps ``capacity`` as given (a full cache: None)
    and has no chunk limit."""
    policy = policy_of(getattr(module, "config", None))
    if not policy.wraps:
        return {"capacity": capacity}
    least = policy.least_capacity
    if capacity is None:
        capacity = least
        while policy.chunk_limit(capacity) < ROLLING_SLACK:
            capacity += 1
    if capacity < least:
        raise ValueError(
            f"a {policy.name} cache needs capacity >= {policy.least_capacity_rule} = {least}, "
            f"got capacity={capacity}"
        )
    return {"capacity": capacity, "max_chunk": policy.chunk_limit(capacity)}


def _no_lengths(name: str, lengths) -> None:
    if lengths is not None:
        raise ValueError(
            f"{name} decodes one token per call with one cache index for the whole batch, "
            "so it takes no lengths (check it with ragged=False)"
        )


def linen(module: nn.Module, params, *, capacity: int | None = None,
          trees: bool = False) -> Decoder | PagedDecoder:  # fmt: skip
    """nanoattn's linen ``CausalSelfAttention`` (or any linen module or model with its
    decode API) as a :class:`~nanoattn.verify.Decoder` ``(full, init, step)`` with
    ``rewind``.

    ``full(x) = module.apply(params, x, deterministic=True)``; ``init`` returns an
    empty ``"cache"`` collection (zeros, every row at position 0, created at the
    first chunk from its dtype and width); ``step`` is ``module.apply({"params": p,
    "cache": c}, chunk, deterministic=True, decode=True, lengths=lengths,
    mutable=["cache"])``; ``rewind(cache, n)`` is :func:`nanoattn.linen.rewind`
    (every layer of a model's collection alike). With a rolling-cache config
    (``module.config.rolling_cache``, ``window=(W, 0)``, ``sink_tokens`` S0) the
    decoder is bounded: ``capacity`` C slots (default W + S0 + 4) and
    ``max_chunk = C - W - S0``, so the check decodes far past C. With a paged-cache
    config (``module.config.page_size``) it is a :class:`~nanoattn.verify.PagedDecoder`:
    ``init(pages)`` an empty pool of that many pages, ``step`` the same apply with
    ``pages=batch`` in place of ``lengths``, and the config's ``window`` and
    ``sink_tokens`` (its allocator gives back the pages outside them).

    Args:
      module: the linen module.
      params: its variables ``{"params": ...}`` (a ``"cache"`` in them is ignored)
        or the bare parameters.
      capacity: the slots of a rolling cache (default W + S0 + 4), or for another
        module with a bounded cache (e.g. a model of rolling layers) its slots.
      trees: whether the decoder also carries ``tree`` (the same apply with
        ``tree_parents=``) and ``accept`` (:func:`nanoattn.linen.accept` with the
        module's config), so that ``check_decoding`` checks token trees: nanoattn's
        layers with a full or rolling cache.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from nanoattn.linen import AttentionConfig, CausalSelfAttention
      >>> from nanoattn.verify import check_decoding, decoders
      >>> layer = CausalSelfAttention(AttentionConfig(d_model=16, n_heads=2))
      >>> params = layer.init(jax.random.key(0), jnp.ones((1, 2, 16)), deterministic=True)
      >>> check_decoding(*decoders.linen(layer, params), d_model=16, seq_len=5).passed
      True
    """
    variables = _params(params)
    decoder = _linen(module, variables, capacity)
    if trees:
        accept = jit(functools.partial(_linen_accept, config=module.config))
        decoder = _with_trees(decoder, _linen_step(module, variables, "tree_parents"), accept)
    if _kv_cache_dtype(module) is None:
        return decoder
    float_cache = _linen(module.clone(config=_float_config(module)), variables, capacity)
    wide = module.clone(config=_float_config(module, dtype=None))
    reference = _float64(lambda v, x: wide.apply(v, x, deterministic=True), variables)
    return _with_float_cache(decoder, float_cache, reference)


def _linen(module: nn.Module, variables: dict, capacity: int | None):
    """:func:`linen` without the float cache of a quantized layer."""

    @jit
    def full(x):
        return module.apply(variables, x, deterministic=True)

    page_size = _page_size(module, capacity)
    if page_size is not None:
        return _linen_paged(module, variables, full, page_size)

    def init(batch: int, max_len: int):
        return _Fresh(batch, max_len)

    step = _linen_step(module, variables, "lengths")
    rewind = jit(_linen_rewind)
    return Decoder(full, init, step, rewind=rewind, **_bounds(module, capacity))


def _page_size(module, capacity) -> int | None:
    """``module.config.page_size`` (None for a module without a paged cache); a paged
    cache takes no ``capacity``."""
    page_size = getattr(getattr(module, "config", None), "page_size", None)
    if page_size is not None and capacity is not None:
        raise ValueError(
            f"a paged cache takes no capacity (its pool grows with the sequences it holds), "
            f"got capacity={capacity}"
        )
    return page_size


def _linen_paged(module: nn.Module, variables, full, page_size: int) -> PagedDecoder:
    """The :class:`PagedDecoder` of a linen module with a paged cache."""

    def init(pages: int):
        return _Fresh(1, pages * page_size)  # the pool is made at the first chunk

    step = _linen_step(module, variables, "pages")
    return PagedDecoder(full, init, step, page_size=page_size, **_window_of(module))


def _window_of(module) -> dict:
    """A paged layer's ``window`` and ``sink_tokens`` (its config's), which its
    allocator keeps: the pages outside them go back to the pool."""
    config = getattr(module, "config", None)
    window = getattr(config, "window", None)
    if window is None:
        return {}
    return dict(window=window, sink_tokens=getattr(config, "sink_tokens", 0))


def _linen_step(module: nn.Module, variables, argument: str):
    """``step(state, chunk, arg)``: one jitted decoding step of a linen module whose
    ``arg`` is its ``argument=`` (``lengths``, or ``pages`` for a paged cache); a fresh
    state's cache is made at the first chunk."""
    empty = _linen_cache(module, deterministic=True, decode=True)

    @jit
    def decode(cache, chunk, arg):
        y, state = module.apply(
            {**variables, "cache": cache}, chunk, deterministic=True, decode=True,
            mutable=["cache"], **{argument: arg},
        )  # fmt: skip
        return state["cache"], y

    def step(state, chunk, arg):
        if isinstance(state, _Fresh):
            state = empty(state, chunk)
        return decode(state, chunk, arg)

    return step


def _linen_rewind(cache, n):
    from ..linen import rewind

    return rewind(cache, n)


def _linen_accept(cache, kept, config):
    from ..linen import accept

    return accept(cache, kept, config)


def _with_trees(decoder, tree, accept) -> Decoder:
    """``decoder`` (a :class:`Decoder`) carrying ``tree`` and ``accept``; a paged
    decoder's trees are not checked (ValueError)."""
    if not isinstance(decoder, Decoder):
        raise ValueError(
            "trees=True checks a slot cache's token trees (full or rolling); a paged "
            "layer's trees are not checked by check_decoding"
        )
    return dataclasses.replace(decoder, tree=tree, accept=accept)


def nnx(module: _nnx.Module, *, capacity: int | None = None,
        trees: bool = False) -> Decoder | PagedDecoder:  # fmt: skip
    """nanoattn's NNX ``CausalSelfAttention`` (or any NNX module with its decode API:
    ``init_cache(batch, max_len)`` and ``module(chunk, decode=True, lengths=...)``)
    as a :class:`~nanoattn.verify.Decoder` ``(full, init, step)``, with ``rewind``
    when the module has ``rewind(n)``.

    ``full(x) = module(x, deterministic=True)``; ``init`` calls ``init_cache`` on a
    copy of the module and returns the copy's graph definition and state; ``step``
    merges them, calls ``module(chunk, decode=True, lengths=lengths,
    deterministic=True)`` and returns the new state; ``rewind(state, n)`` merges
    them and calls ``module.rewind(n)``. A rolling-cache config is bounded as in
    :func:`linen`: ``capacity`` C (default W + S0 + 4), ``max_chunk = C - W - S0``.
    A paged-cache config (``page_size``) gives a :class:`~nanoattn.verify.PagedDecoder`:
    ``init(pages)`` calls ``init_cache(1, pages * page_size)``, ``step`` calls
    ``module(chunk, decode=True, pages=batch, deterministic=True)``, with the config's
    ``window`` and ``sink_tokens``. ``trees``: the decoder also carries ``tree`` (the
    module called with ``tree_parents=``) and ``accept`` (``module.accept(kept)``), as
    :func:`linen`'s.

    Example:
      >>> from flax import nnx
      >>> from nanoattn.nnx import AttentionConfig, CausalSelfAttention
      >>> from nanoattn.verify import check_decoding, decoders
      >>> layer = CausalSelfAttention(AttentionConfig(d_model=16, n_heads=2), rngs=nnx.Rngs(0))
      >>> check_decoding(*decoders.nnx(layer), d_model=16, seq_len=5).passed
      True
    """
    decoder = _nnx_decoder(module, capacity)
    if trees:
        decoder = _nnx_trees(module, decoder)
    if _kv_cache_dtype(module) is None:
        return decoder
    float_cache = _nnx_decoder(_nnx_with(module, _float_config(module)), capacity)
    graphdef, state = _nnx.split(_nnx_with(module, _float_config(module, dtype=None)))
    reference = _float64(lambda s, x: _nnx.merge(graphdef, s)(x, deterministic=True), state)
    return _with_float_cache(decoder, float_cache, reference)


def _nnx_with(module: _nnx.Module, config) -> _nnx.Module:
    """A copy of nanoattn's NNX ``module`` with ``config`` (which the layer reads at
    each call and ``init_cache``), the same parameters."""
    copy = _nnx.clone(module)
    copy.config = config
    return copy


def _nnx_decoder(module: _nnx.Module, capacity: int | None) -> Decoder | PagedDecoder:
    """:func:`nnx` without the float cache of a quantized layer."""
    graphdef, state = _nnx.split(module)

    @jit
    def forward(state, x):
        return _nnx.merge(graphdef, state)(x, deterministic=True)

    def full(x):
        return forward(state, x)

    page_size = _page_size(module, capacity)
    if page_size is not None:
        return _nnx_paged(graphdef, state, full, page_size, _window_of(module))
    init, step = _nnx_steps(graphdef, state, "lengths")
    rewind = _nnx_cache_call("rewind")
    has_rewind = callable(getattr(module, "rewind", None))
    return Decoder(
        full, init, step, rewind=rewind if has_rewind else None, **_bounds(module, capacity)
    )


def _nnx_trees(module: _nnx.Module, decoder) -> Decoder:
    """``decoder`` with the token-tree parts of an NNX ``module``: a tree step
    (``tree_parents=``) and ``accept`` (``module.accept(kept)``)."""
    graphdef, state = _nnx.split(module)
    tree = _nnx_steps(graphdef, state, "tree_parents")[1]
    return _with_trees(decoder, tree, _nnx_cache_call("accept"))


def _nnx_cache_call(method: str):
    """``(decoder_state, arg) -> decoder_state``: the NNX module's ``method(arg)``
    (``rewind(n)``, ``accept(kept)``) on a copy of the decoder's state, jitted."""

    @functools.partial(jit, static_argnums=0)
    def call(graph, cache_state, arg):
        copy = _nnx.merge(graph, cache_state)
        getattr(copy, method)(arg)
        return _nnx.split(copy)[1]

    def apply(decoder_state, arg):
        graph, cache_state = decoder_state
        return graph, call(graph, cache_state, arg)

    return apply


def _nnx_paged(graphdef, state, full, page_size: int, window: dict) -> PagedDecoder:
    """The :class:`PagedDecoder` of an NNX module with a paged cache (``window``: its
    window and sink tokens, :func:`_window_of`)."""
    init, step = _nnx_steps(graphdef, state, "pages")
    return PagedDecoder(
        full, lambda pages: init(1, pages * page_size), step, page_size=page_size, **window
    )


def _nnx_steps(graphdef, state, argument: str):
    """``(init(batch, capacity), step(decoder_state, chunk, arg))`` of an NNX module: a
    copy of it with a fresh cache of ``capacity`` slots, and one jitted decoding step
    whose ``arg`` is the module's ``argument=`` (``lengths``, or ``pages`` for a paged
    cache)."""

    def init(batch: int, capacity: int):
        copy = _nnx.merge(graphdef, state)
        copy.init_cache(batch, capacity)
        return _nnx.split(copy)

    @functools.partial(jit, static_argnums=0)
    def decode(graph, cache_state, chunk, arg):
        copy = _nnx.merge(graph, cache_state)
        y = copy(chunk, decode=True, deterministic=True, **{argument: arg})
        return _nnx.split(copy)[1], y

    def step(decoder_state, chunk, arg):
        graph, cache_state = decoder_state
        cache_state, y = decode(graph, cache_state, chunk, arg)
        return (graph, cache_state), y

    return init, step


def flax_linen(module: nn.Module, variables):
    """flax linen's ``MultiHeadDotProductAttention`` with ``decode=True`` as
    ``(full, init, step)``.

    ``full(x)`` applies the module (cloned with ``decode=False``) with
    ``mask=nn.make_causal_mask(x[..., 0])``; ``init`` returns an empty ``"cache"``
    collection (zeros, ``cache_index`` 0); flax decodes one token per call, with
    one ``cache_index`` for the whole batch, so ``step`` feeds a chunk's tokens one
    call each (module cloned with ``decode=True``) and takes no ``lengths``
    (ValueError).

    Example:
      >>> import flax.linen as nn, jax, jax.numpy as jnp
      >>> from nanoattn.verify import check_decoding, decoders
      >>> mha = nn.MultiHeadDotProductAttention(num_heads=2, qkv_features=16, decode=True)
      >>> variables = mha.init(jax.random.key(0), jnp.ones((1, 2, 16)))
      >>> check_decoding(*decoders.flax_linen(mha, variables), d_model=16, seq_len=5).passed
      True
    """
    params = _params(variables)
    whole, one_token = module.clone(decode=False), module.clone(decode=True)

    @jit
    def full(x):
        return whole.apply(params, x, mask=nn.make_causal_mask(x[..., 0]), deterministic=True)

    def init(batch: int, max_len: int):
        return _Fresh(batch, max_len)

    @jit
    def decode(cache, token):
        y, state = one_token.apply(
            {**params, "cache": cache}, token, deterministic=True, mutable=["cache"]
        )
        return state["cache"], y

    empty = _linen_cache(one_token)

    def step(state, chunk, lengths):
        _no_lengths("flax linen's MultiHeadDotProductAttention", lengths)
        if isinstance(state, _Fresh):
            state = empty(state, chunk)
        ys = []
        for t in range(chunk.shape[1]):
            state, y = decode(state, chunk[:, t : t + 1])
            ys.append(y)
        return state, jnp.concatenate(ys, axis=1)

    return full, init, step


def flax_nnx(module: _nnx.Module, **call_kwargs):
    """flax NNX's ``MultiHeadAttention`` decoding through ``init_cache`` as
    ``(full, init, step)``; ``call_kwargs`` go to every call (e.g. ``is_causal=True``).

    ``full(x) = module(x, decode=False, deterministic=True, **call_kwargs)``;
    ``init`` calls ``init_cache((batch, max_len, D))`` on a copy of the module at
    the first chunk (the chunk's width; the module's ``dtype``, else the dtype flax
    computes in: the chunk's promoted with the parameters'); flax
    decodes one token per call, with one ``cache_index`` for the whole batch, so
    ``step`` feeds a chunk's tokens one call each (``decode=True``) and takes no
    ``lengths`` (ValueError).

    Example:
      >>> from flax import nnx
      >>> from nanoattn.verify import check_decoding, decoders
      >>> mha = nnx.MultiHeadAttention(num_heads=2, in_features=16, rngs=nnx.Rngs(0))
      >>> report = check_decoding(*decoders.flax_nnx(mha, is_causal=True), d_model=16, seq_len=5)
      >>> report.passed  # google/flax#5591: decoding with is_causal sees only the first key
      False
    """
    graphdef, state = _nnx.split(module)

    @jit
    def forward(state, x):
        copy = _nnx.merge(graphdef, state)
        return copy(x, decode=False, deterministic=True, **call_kwargs)

    def full(x):
        return forward(state, x)

    def init(batch: int, max_len: int):
        return _Fresh(batch, max_len)

    @functools.partial(jit, static_argnums=0)
    def decode(graph, cache_state, token):
        copy = _nnx.merge(graph, cache_state)
        y = copy(token, decode=True, deterministic=True, **call_kwargs)
        return _nnx.split(copy)[1], y

    def step(decoder_state, chunk, lengths):
        _no_lengths("flax NNX's MultiHeadAttention", lengths)
        if isinstance(decoder_state, _Fresh):
            copy = _nnx.merge(graphdef, state)
            # flax computes in the module's dtype, else in the inputs' and parameters'
            params = jax.tree.leaves(_nnx.state(copy, _nnx.Param))
            dtype = module.dtype or jnp.result_type(chunk.dtype, *params)
            copy.init_cache((*decoder_state, chunk.shape[-1]), dtype)
            decoder_state = _nnx.split(copy)
        graph, cache_state = decoder_state
        ys = []
        for t in range(chunk.shape[1]):
            cache_state, y = decode(graph, cache_state, chunk[:, t : t + 1])
            ys.append(y)
        return (graph, cache_state), jnp.concatenate(ys, axis=1)

    return full, init, step
