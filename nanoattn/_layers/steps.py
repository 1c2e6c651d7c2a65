"""The three calls of an attention layer, written once for linen and NNX:
self-attention over a whole sequence, one decoding step through a KV cache,
and cross-attention. The modules own the parameters and the cache and hand
them in (``nanoattn._layers.heads.Parameters``, ``nanoattn._layers.caches.kv_cache.KVCache``).

Axis letters (docs/conventions.md): B batch, T query time, S key time (the
cache capacity when decoding), N query heads, K key/value heads, H head
width, D model width.
"""

import jax.numpy as jnp
import numpy as np

from .._base.masks import padding_mask
from .._base.trace import check_shape
from .._base.validate import expect_bool, expect_floating, expect_integer, expect_shape
from .axes import labels
from .caches import kv_cache
from .caches.kinds import policy_of
from .caches.tree import parents_of
from .config import AttentionConfig
from .heads import (
    Parameters,
    attend,
    compute_dtype,
    core,
    core_options,
    normalize_qk,
    paged_core,
    project_out,
    rotate_qk,
    split_heads,
)
from .positional import and_masks, window_mask
from .sharded import default_positions


def _int_per_token(name: str, value, axes: str, dims) -> jnp.ndarray:
    value = jnp.asarray(value)
    expect_integer(name, value.dtype)
    expect_shape(name, value.shape, axes, dims)
    return value


def _expect_input_dtype(cfg: AttentionConfig, name: str, x) -> None:
    """Without a ``config.dtype`` the input's dtype is the compute dtype: a float one."""
    if cfg.dtype is None:
        expect_floating(name, jnp.result_type(x))


def _project_qkv(params: Parameters, cfg: AttentionConfig, x, dtype):
    """x (B, T, D) -> query heads (B, T, N, H), key and value heads (B, T, K, H)."""
    B, T, _ = x.shape
    N, K, H = cfg.n_heads, cfg.kv_heads, cfg.head_dim
    label = labels(cfg)
    qkv = params.dense("qkv", x, (N + 2 * K) * H, dtype)
    check_shape(
        qkv, "qkv", f"B T {label.qkv}", (B, T, (N + 2 * K) * H), op="project", source="input"
    )
    q, k, v = jnp.split(qkv, [N * H, (N + K) * H], axis=-1)  # [Q (N*H) | K (K*H) | V (K*H)]
    check_shape(q, "q", f"B T {label.q_width}", (B, T, N * H), op="split", source="qkv")
    for name, part in (("k", k), ("v", v)):
        check_shape(part, name, f"B S {label.kv_width}", (B, T, K * H), op="split", source="qkv")
    q = split_heads(q, "q", "B T N H", N, cfg)
    k = split_heads(k, "k", f"B S {label.kv_heads} H", K, cfg)
    v = split_heads(v, "v", f"B S {label.kv_heads} H", K, cfg)
    return (*normalize_qk(params, cfg, q, k, dtype), v)


def check_input(cfg: AttentionConfig, x, *, decode: bool, positions, segment_ids, lengths,
                pages=None, tree_parents=None):  # fmt: skip
    """Validates a self-attention call's input and its arguments for the mode."""
    expect_shape("x", jnp.shape(x), "B T D", (None, None, cfg.d_model))
    _expect_input_dtype(cfg, "x", x)
    check_shape(x, "input", "B T D", x.shape, op="input")
    check_mode(decode, positions=positions, segment_ids=segment_ids, lengths=lengths,
               pages=pages, tree_parents=tree_parents)  # fmt: skip


def check_mode(decode: bool, *, positions, segment_ids, lengths, pages=None,
               tree_parents=None) -> None:  # fmt: skip
    """The arguments of a call that belong to one mode only: ``positions`` and
    ``segment_ids`` to the full-sequence mode, ``lengths``, ``pages`` and
    ``tree_parents`` to decoding (the self-attention and the latent layers alike)."""
    if decode:
        for name, value in (("positions", positions), ("segment_ids", segment_ids)):
            if value is not None:
                raise ValueError(
                    f"{name} is not supported with decode=True: the cache keeps each "
                    f"row's position (use lengths for ragged rows)"
                )
    elif lengths is not None:
        raise ValueError(
            "lengths only applies with decode=True; in full-sequence mode pass a "
            "padding mask or segment_ids"
        )
    elif pages is not None:
        raise ValueError("pages only applies with decode=True and a paged cache (page_size)")
    elif tree_parents is not None:
        raise ValueError(
            "tree_parents only applies with decode=True: a decoding step's token tree "
            "(speculative decoding); a full sequence is a chain"
        )


def self_attention(
    params: Parameters,
    cfg: AttentionConfig,
    x,
    *,
    deterministic: bool,
    mask=None,
    positions=None,
    segment_ids=None,
    mask_fn=None,
    score_fn=None,
):
    """Causal self-attention over the whole of x (B, T, D) -> (B, T, D).

    ``positions`` (B, T) or (T,) int (default ``arange(T)``) are what RoPE
    rotates by; ``segment_ids`` (B, T) int restrict attention to equal ids.
    ``mask_fn`` and ``score_fn`` see query and key positions ``0 .. T - 1``
    (``q_offset`` 0: the index in the sequence, not ``positions``).
    """
    B, T, _ = x.shape
    dtype = compute_dtype(cfg, x)
    options = core_options(cfg, positional=True)
    mask_fn = and_masks(window_mask(cfg.window, cfg.sink_tokens), mask_fn)
    if positions is None:  # numpy: concrete under jit too, as dynamic RoPE scaling needs
        positions = np.arange(T) if cfg.sequence_axis is None else default_positions(cfg, T)
    elif jnp.ndim(positions) == 1:
        positions = _int_per_token("positions", positions, "T", (T,))
    else:
        positions = _int_per_token("positions", positions, "B T", (B, T))
    if segment_ids is not None:
        segment_ids = _int_per_token("segment_ids", segment_ids, "B T", (B, T))
        options |= {"q_segment_ids": segment_ids, "kv_segment_ids": segment_ids}
    q, k, v = _project_qkv(params, cfg, x, dtype)
    q, k = rotate_qk(cfg, q, k, positions)
    return attend(
        params, q, k, v, cfg, deterministic, dtype, mask=mask, is_causal=True, mask_fn=mask_fn,
        score_fn=score_fn, **options,
    )  # fmt: skip


def decode(
    params: Parameters,
    cfg: AttentionConfig,
    x,
    cache: kv_cache.KVCache,
    *,
    deterministic: bool,
    mask=None,
    lengths=None,
    pages=None,
    mask_fn=None,
    score_fn=None,
    tree_parents=None,
    hint: str,
):
    """One decoding step: writes the chunk x (B, T, D) into the cache and attends.

    Row b's tokens sit at positions ``cache.position[b] + t``; only the first
    ``lengths[b]`` (default T) are real: they are written and the row advances
    by ``lengths[b]``, and outputs at padded tokens are zeros. Each query
    attends causally over the keys written so far and within the layer's window.
    ``mask_fn`` and ``score_fn`` see each query at its position in the row
    (``q_offset = cache.position``, per row) and each key at its position, so
    decoding equals the full forward with the same functions.

    The cache's policy (``policy_of(cfg)``, ``nanoattn._layers.caches.policy``: a full
    cache, or with ``cfg.rolling_cache`` a ring of slots) says where the chunk is
    written, which slots each query may read, and which rows the call may not serve:
    ``lengths`` outside [0, T], a poisoned row, or tokens that do not fit (past the
    capacity of a full cache, past the chunk limit ``S - W - sink_tokens`` of a
    rolling one). Such a call raises ValueError naming the row (a message about the
    capacity ends with ``hint``) when its inputs are concrete; under ``jit``, where
    they cannot be checked, those rows write nothing, their outputs are NaN, and they
    are poisoned (position -1): NaN in every later call until reset. ``last``
    records each row's real tokens for ``rewind``.

    With a paged cache (``cfg.page_size``), x is (1, Tq, D): the tokens of many
    sequences, token-major, and ``pages`` (a ``PagedBatch`` from a ``PageAllocator``)
    says whose they are and where their keys go; the cache is the layer's pool of
    pages, and positions live on the host with the allocator.

    With ``tree_parents`` (int (B, T), x's leading axes: (1, Tq) for a paged step) the
    chunk is a token tree (speculative decoding, ``nanoattn._layers.caches.tree``):
    each token's parent within its row's chunk (a paged step: within its sequence's
    tokens), -1 for the last committed token. Token i is rotated at ``position +
    depth(i)``, its key written in the next slot as a chain's token i would be, and it
    sees its ancestors and itself inside the chunk: its output is what decoding its
    root-to-leaf path alone gives. The row still advances by all its real tokens;
    keep the accepted path with the policy's ``accept`` (a paged cache: the
    allocator's). A bad tree raises naming ``tree_parents`` when concrete; under
    ``jit`` its row (sequence) is broken as above.

    Returns:
      (y (B, T, D), the advanced cache).
    """
    B = x.shape[0]
    dtype = compute_dtype(cfg, x)
    if lengths is not None:
        lengths = _int_per_token("lengths", lengths, "B", (B,))
    policy = policy_of(cfg)
    tree_parents = parents_of(tree_parents, x.shape[:2])
    layout = policy.prepare(cache, x.shape, lengths=lengths, pages=pages, hint=hint,
                            tree_parents=tree_parents)  # fmt: skip
    q, k, v = _project_qkv(params, cfg, x, dtype)
    q, k = rotate_qk(cfg, q, k, layout.positions)  # (B, T) positions (a tree's: by depth)
    cache = policy.write_step(cache, k, v, layout)
    options = core_options(cfg, positional=False)  # the window is the policy's

    def dense(q, keys, values, **rules):
        return core(params, q, keys, values, cfg, deterministic, **rules, **options)

    def paged(q, key_pages, value_pages, batch, **rules):
        return paged_core(params, cfg, q, key_pages, value_pages, batch, **rules)

    out = policy.attention(
        cache, layout, q, dense=dense, paged=paged, mask=mask, mask_fn=mask_fn, score_fn=score_fn
    )
    y = project_out(params, cfg, out, dtype)
    y = jnp.where(layout.real[..., None], y, 0)
    y = jnp.where(layout.broken[..., None], jnp.nan, y).astype(y.dtype)  # only under jit
    return y, policy.advance(cache, layout)


def cross_attention(
    params: Parameters,
    cfg: AttentionConfig,
    x,
    context,
    *,
    deterministic: bool,
    context_mask=None,
    mask_fn=None,
    score_fn=None,
):
    """T queries from x (B, T, D) attend to S keys from context (B, S, D) -> (B, T, D).

    ``context_mask``: boolean (B, S), True at real context tokens, or any mask
    broadcastable to (B, N, T, S) of rank other than 2. ``mask_fn`` and
    ``score_fn`` see query positions ``0 .. T - 1`` and key positions ``0 .. S - 1``.
    """
    D, N, K, H = cfg.d_model, cfg.n_heads, cfg.kv_heads, cfg.head_dim
    expect_shape("x", jnp.shape(x), "B T D", (None, None, D))
    B, T, _ = x.shape
    expect_shape("context", jnp.shape(context), "B S D", (B, None, D))
    S = context.shape[1]
    _expect_input_dtype(cfg, "x", x)
    _expect_input_dtype(cfg, "context", context)
    mask = context_mask
    if mask is not None and jnp.ndim(mask) == 2:
        expect_bool("context_mask", jnp.result_type(mask))
        expect_shape("context_mask", jnp.shape(mask), "B S", (B, S))
        mask = padding_mask(mask)  # (B, 1, 1, S)

    dtype = compute_dtype(cfg, x)
    label = labels(cfg)
    check_shape(x, "input", "B T D", (B, T, D), op="input")
    check_shape(context, "context", "B S D", (B, S, D), op="input")
    q = params.dense("q", x, N * H, dtype)
    check_shape(q, "q", f"B T {label.q_width}", (B, T, N * H), op="project", source="input")
    kv = params.dense("kv", context, 2 * K * H, dtype)
    check_shape(kv, "kv", f"B S {label.kv_pair}", (B, S, 2 * K * H), op="project", source="context")
    k, v = jnp.split(kv, 2, axis=-1)  # 2 x (B, S, K*H), in the order [K | V]
    for name, part in (("k", k), ("v", v)):
        check_shape(part, name, f"B S {label.kv_width}", (B, S, K * H), op="split", source="kv")
    q = split_heads(q, "q", "B T N H", N, cfg)
    k = split_heads(k, "k", f"B S {label.kv_heads} H", K, cfg)
    v = split_heads(v, "v", f"B S {label.kv_heads} H", K, cfg)
    q, k = normalize_qk(params, cfg, q, k, dtype)
    options = core_options(cfg, positional=False)
    return attend(
        params, q, k, v, cfg, deterministic, dtype, mask=mask, mask_fn=mask_fn, score_fn=score_fn,
        **options,
    )  # fmt: skip
