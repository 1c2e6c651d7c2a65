"""Decoders with planted bugs, for check_decoding and `nanoattn verify --decode`.

``tiny(bug)`` is one causal attention layer with a KV cache, written on
nanoattn's functional core: D = 12, N = 3 heads of width H = 4, RoPE, and a
causal window of 5 keys before each query (as the layers of Mistral or Gemma).
Its ``(full, init, step)`` follows the check_decoding protocol; ``bug`` plants
one of the bugs that decoders ship with:

* ``"late_write"``: the cache is written one slot late (at position + 1);
* ``"advance_by_chunk"``: a row's position advances by the chunk length L, not by
  its ``lengths`` (right only when no row is padded);
* ``"rope_at_zero"``: RoPE rotates the chunk from position 0, not from the row's
  position (right only for a chunk that starts the sequence);
* ``"wide_window"``: the window is one key wider while decoding only;
* ``"ignore_cache"``: attention sees the current chunk only, never the cache;
* ``"future_in_chunk"``: no causal rule inside a chunk (each query sees the
  whole chunk, later tokens included), as when a prefill forgets its mask;
* ``"bfloat16_cache"``: keys and values stored rounded to bfloat16 in a float32
  layer: outputs off by about a thousandth, which only the tolerance separates
  from rounding.

``quantized(bug)`` is nanoattn's linen layer with an int8 KV cache and the bugs of
``QUANTIZED_BUGS`` planted in the cache each step hands the next (checked with
``atol=QUANTIZED_ATOL``).

With ``vocab`` it is a language model on token ids (an embedding in front).
The bugs are switched by a traced array, so every variant shares one compiled
step per chunk length.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from _caches import halves

from nanoattn import PageAllocator, apply_rope, dot_product_attention, paged_attention

D, N, H = 12, 3, 4
WINDOW = 5
ROPE_BASE = 100.0
BUGS = (
    "late_write",
    "advance_by_chunk",
    "rope_at_zero",
    "wide_window",
    "ignore_cache",
    "future_in_chunk",
    "bfloat16_cache",
)
FAST_COMPILE = {"xla_backend_optimization_level": 0}

_keys = jax.random.split(jax.random.key(3), 4)
WQ, WK, WV, WO = (np.asarray(jax.random.normal(k, (D, D))) / np.sqrt(D) for k in _keys)


def _project(x, positions):
    """x (B, L, D) -> q, k, v (B, L, N, H); q and k rotated at ``positions`` (B, L) or (L,)."""
    B, L, _ = x.shape
    q, k, v = ((x @ w).reshape(B, L, N, H) for w in (WQ, WK, WV))
    return apply_rope(q, positions, base=ROPE_BASE), apply_rope(k, positions, base=ROPE_BASE), v


def _embedded(x, embed):
    return x if embed is None else embed[x]


@functools.partial(jax.jit, compiler_options=FAST_COMPILE)
def _full(x, embed):
    x = _embedded(x, embed)
    B, T, _ = x.shape
    q, k, v = _project(x, jnp.arange(T))
    y = dot_product_attention(q, k, v, is_causal=True, window=(WINDOW, 0))
    return y.reshape(B, T, D) @ WO


def _write(cache, new, position, lengths):
    """Writes row b's first ``lengths[b]`` of new (B, L, N, H) at ``position[b]`` onwards."""
    B, S = cache.shape[:2]
    steps = jnp.arange(new.shape[1])[None, :]  # (1, L)
    slots = jnp.where(steps < lengths[:, None], position[:, None] + steps, S)  # (B, L)
    return cache.at[jnp.arange(B)[:, None], slots].set(new, mode="drop")


@functools.partial(jax.jit, compiler_options=FAST_COMPILE)
def _decode(cache, chunk, lengths, embed, bug):
    """One step; ``bug`` (7,) bool switches the planted bugs in the order of BUGS."""
    late, by_chunk, at_zero, wide, no_cache, ahead, rounded = bug
    x = _embedded(chunk, embed)
    B, L, _ = x.shape
    S = cache["key"].shape[1]
    position = cache["position"]
    start = jnp.where(at_zero, 0, position)
    q, k, v = _project(x, start[:, None] + jnp.arange(L)[None, :])
    at = position + late
    k, v = (jnp.where(rounded, a.astype(jnp.bfloat16).astype(a.dtype), a) for a in (k, v))
    keys = _write(cache["key"], k, at, lengths)
    values = _write(cache["value"], v, at, lengths)
    end = position + lengths
    # One attention over the cache slots j, every rule (and bug) in one mask (B, L, S).
    query = (position[:, None] + jnp.arange(L)[None, :])[..., None]  # (B, L, 1) query positions
    j = jnp.arange(S)[None, None, :]
    mask = (j < end[:, None, None]) & (j >= query - WINDOW - wide)
    mask &= ahead | (j <= query)  # causal, unless the bug lets a query see its whole chunk
    mask &= ~no_cache | (j >= position[:, None, None])  # the chunk's own slots only
    y = dot_product_attention(q, keys, values, mask=mask[:, None])
    advanced = jnp.where(by_chunk, position + L, end)
    state = {"key": keys, "value": values, "position": advanced.astype(jnp.int32)}
    return state, y.reshape(B, L, D) @ WO


def tiny(bug: str | None = None, vocab: int | None = None):
    """``(full, init, step)`` of the tiny layer, with ``bug`` planted (None: correct)."""
    if bug not in (None, *BUGS):
        raise ValueError(f"bug must be one of {BUGS}, got {bug!r}")
    switches = jnp.asarray([name == bug for name in BUGS])
    embed = None if vocab is None else jax.random.normal(jax.random.key(vocab), (vocab, D))

    def full(x):
        return _full(x, embed)

    def init(batch, max_len):
        zeros = jnp.zeros((batch, max_len, N, H))
        return {"key": zeros, "value": zeros, "position": jnp.zeros((batch,), jnp.int32)}

    def step(state, chunk, lengths):
        if lengths is None:
            lengths = np.full(chunk.shape[0], chunk.shape[1], np.int32)
        return _decode(state, chunk, jnp.asarray(lengths, jnp.int32), embed, switches)

    return full, init, step


def correct():
    """A zero-argument factory for `nanoattn verify --decode`: the correct layer."""
    return tiny()


def late_write():
    return tiny("late_write")


def language_model():
    """The correct layer behind an embedding of 11 tokens: `--decode --vocab 11`."""
    return tiny(vocab=11)


def not_a_triple():
    return jnp.zeros(3)


# A rolling (ring-buffer) cache with sink tokens and a rewind, for check_decoding's
# capacity, max_chunk and rewind: the layer above with its window of 5 keys and the
# first SINKS positions visible to every later query, decoding into CAPACITY slots.
# Its cache keeps the sinks in slots 0 .. SINKS - 1 and position j >= SINKS in slot
# SINKS + (j - SINKS) mod (CAPACITY - SINKS); a slot's position is recomputed from the
# row's end (nanoattn._layers.caches.rolling), and a write pointer says where the next token goes.
# ``rolling(bug)`` plants one of:
#
# * ``"ring_one_slot_off"``: past the first lap the ring writes one slot further on;
# * ``"stale_after_rewind"``: the rewind moves the positions back but not the write
#   pointer, so a query reads the dropped tokens' slots as its own;
# * ``"sinks_overwritten"``: the ring spans all CAPACITY slots, overwriting the sinks;
# * ``"chunk_limit_plus_one"``: the decoder claims chunks of C - W - S0 + 1 tokens,
#   whose first query has lost its oldest key when the chunk is written.
SINKS, CAPACITY = 2, 10
CHUNK_LIMIT = CAPACITY - WINDOW - SINKS  # 3
ROLLING_BUGS = (
    "ring_one_slot_off",
    "stale_after_rewind",
    "sinks_overwritten",
    "chunk_limit_plus_one",
)


def _sink_window(q_pos, k_pos):
    return (k_pos <= q_pos) & ((q_pos - k_pos <= WINDOW) | (k_pos < SINKS))


@functools.partial(jax.jit, compiler_options=FAST_COMPILE)
def _rolling_full(x):
    B, T, _ = x.shape
    q, k, v = _project(x, jnp.arange(T))
    mask = _sink_window(jnp.arange(T)[:, None], jnp.arange(T)[None, :])  # (T, S)
    y = dot_product_attention(q, k, v, mask=mask)
    return y.reshape(B, T, D) @ WO


@functools.partial(jax.jit, compiler_options=FAST_COMPILE)
def _rolling_decode(cache, chunk, lengths, bug):
    from nanoattn._layers.caches.rolling import slot_positions
    from nanoattn._layers.positional import visible

    off, overwrite_sinks = bug
    B, L, _ = chunk.shape
    C, ring = CAPACITY, CAPACITY - SINKS
    position, written = cache["position"], cache["written"]
    steps = jnp.arange(L)[None, :]  # (1, L)
    q, k, v = _project(chunk, position[:, None] + steps)
    w = written[:, None] + steps  # (B, L): the write pointer of each token
    slot = jnp.where(w < SINKS, w, SINKS + (w - SINKS) % ring)
    slot = jnp.where(off & (w >= C), SINKS + (w - SINKS + 1) % ring, slot)
    slot = jnp.where(overwrite_sinks, w % C, slot)
    slot = jnp.where(steps < lengths[:, None], slot, C)  # padded tokens: dropped
    rows = jnp.arange(B)[:, None]
    keys = cache["key"].at[rows, slot].set(k, mode="drop")
    values = cache["value"].at[rows, slot].set(v, mode="drop")
    end = position + lengths
    held = slot_positions(end, C, SINKS)[:, None, :]  # (B, 1, C)
    query = (position[:, None] + steps)[..., None]  # (B, L, 1)
    mask = visible(query, held, WINDOW, SINKS)  # (B, L, C)
    y = dot_product_attention(q, keys, values, mask=mask[:, None])
    state = {"key": keys, "value": values, "position": end, "written": written + lengths}
    return state, y.reshape(B, L, D) @ WO


def rolling(bug: str | None = None):
    """The rolling decoder, ``bug`` planted (None: correct), as a
    :class:`nanoattn.verify.decoders.Decoder` with ``rewind``, ``capacity`` and
    ``max_chunk``."""
    from nanoattn.verify.decoders import Decoder

    if bug not in (None, *ROLLING_BUGS):
        raise ValueError(f"bug must be one of {ROLLING_BUGS}, got {bug!r}")
    switches = jnp.asarray([bug == "ring_one_slot_off", bug == "sinks_overwritten"])

    def init(batch, max_len):
        zeros = jnp.zeros((batch, max_len, N, H))
        start = jnp.zeros((batch,), jnp.int32)
        return {"key": zeros, "value": zeros, "position": start, "written": start}

    def step(state, chunk, lengths):
        if lengths is None:
            lengths = np.full(chunk.shape[0], chunk.shape[1], np.int32)
        return _rolling_decode(state, chunk, jnp.asarray(lengths, jnp.int32), switches)

    def rewind(state, n):
        n = jnp.asarray(n, jnp.int32)
        written = state["written"] if bug == "stale_after_rewind" else state["written"] - n
        return {**state, "position": state["position"] - n, "written": written}

    limit = CHUNK_LIMIT + (bug == "chunk_limit_plus_one")
    return Decoder(
        lambda x: _rolling_full(x), init, step, rewind=rewind, capacity=CAPACITY, max_chunk=limit
    )


def rewind_tiny(state, n):
    """The rewind of ``tiny``'s full cache: each row's position back by n[b]."""
    return {**state, "position": state["position"] - jnp.asarray(n, jnp.int32)}


# --- token trees: the tiny layer verifying a tree of drafts, and keeping a path ------

TREE_BUGS = (
    "sibling_visible",  # a draft sees the drafts before it in the chunk, not its ancestors only
    "rope_by_slot",  # a draft rotated at its slot, not at the row's position plus its depth
    "not_moved",  # accept leaves the kept drafts' keys in their old slots
    "rejected_read",  # accept moves the kept drafts but the row still reads the rejected ones
)


def _ancestry(parents: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(ancestors (B, L, L) bool: draft j is draft i or an ancestor of it, depth (B, L))
    of a tree's ``parents`` (B, L), each parent earlier."""
    B, L = parents.shape
    ancestors, depth = np.zeros((B, L, L), bool), np.zeros((B, L), np.int32)
    for b in range(B):
        for i in range(L):
            p = parents[b, i]
            ancestors[b, i, i] = True
            if p >= 0:
                ancestors[b, i] |= ancestors[b, p]
                depth[b, i] = depth[b, p] + 1
    return ancestors, depth


@functools.partial(jax.jit, compiler_options=FAST_COMPILE)
def _tree_decode(cache, chunk, ancestors, depth, bug):
    """A tree step of the tiny layer: draft i at position + depth(i) (its slot with
    ``rope_by_slot``), its key in slot position + i, seeing the cache before the chunk
    and its ancestors (every earlier draft with ``sibling_visible``) in the window."""
    sibling, by_slot = bug[0], bug[1]
    B, L, _ = chunk.shape
    S = cache["key"].shape[1]
    position = cache["position"]
    slot = position[:, None] + jnp.arange(L)[None, :]  # (B, L)
    at = jnp.where(by_slot, slot, position[:, None] + depth)  # (B, L)
    q, k, v = _project(chunk, at)
    full_chunk = jnp.full((B,), L, jnp.int32)
    keys = _write(cache["key"], k, position, full_chunk)
    values = _write(cache["value"], v, position, full_chunk)
    j = jnp.arange(S)[None, None, :] - position[:, None, None]  # (B, 1, S): index in the chunk
    inside = (j >= 0) & (j < L)
    jj = jnp.clip(j, 0, L - 1)
    rows = jnp.arange(B)[:, None, None]
    seen = ancestors[rows, jnp.arange(L)[None, :, None], jj]  # (B, L, S)
    seen |= sibling & (jj <= jnp.arange(L)[None, :, None])
    base = position[:, None, None]
    k_pos = jnp.where(inside, base + depth[rows, jj], base + j)  # (B, 1, S)
    mask = jnp.where(inside, seen, j < 0) & (k_pos >= at[..., None] - WINDOW)
    y = dot_product_attention(q, keys, values, mask=mask[:, None])
    state = {"key": keys, "value": values, "position": position + L,
             "last": jnp.full((B,), L, jnp.int32)}  # fmt: skip
    return state, y.reshape(B, L, D) @ WO


def _accept_tiny(state, kept, bug: str | None):
    """Row b keeps the drafts ``kept[b]`` of its last call: moved to the slots after
    the tokens before it, the rest taken back (with ``bug``, one of the accept bugs)."""
    keys, values = np.array(state["key"]), np.array(state["value"])
    start = np.asarray(state["position"]) - np.asarray(state["last"])
    count = (np.asarray(kept) >= 0).sum(axis=1)
    for b, row in enumerate(np.asarray(kept)):
        path = [int(k) for k in row if k >= 0]
        if bug != "not_moved":
            for a in (keys, values):
                a[b, start[b] : start[b] + len(path)] = a[b, start[b] + np.array(path, int)]
    end = np.asarray(state["position"]) if bug == "rejected_read" else start + count
    return {"key": jnp.asarray(keys), "value": jnp.asarray(values),
            "position": jnp.asarray(end, jnp.int32)}  # fmt: skip


def tiny_trees(bug: str | None = None):
    """The tiny layer as a :class:`nanoattn.verify.Decoder` with ``tree`` and
    ``accept`` (and ``rewind``), with one of :data:`TREE_BUGS` planted (None: correct)."""
    from nanoattn.verify.decoders import Decoder

    if bug not in (None, *TREE_BUGS):
        raise ValueError(f"bug must be one of {TREE_BUGS}, got {bug!r}")
    full, init, step = tiny()
    switches = jnp.asarray([name == bug for name in TREE_BUGS[:2]])

    def tree(state, chunk, parents):
        ancestors, depth = _ancestry(np.asarray(parents))
        state = {name: state[name] for name in ("key", "value", "position")}
        return _tree_decode(state, chunk, ancestors, depth, switches)

    def accept(state, kept):
        return _accept_tiny(state, kept, bug)

    return Decoder(full, init, step, rewind=rewind_tiny, tree=tree, accept=accept)


# --- multi-head latent attention: an absorbed decode written here, with bugs ---------

LATENT_BUGS = (
    "rope_key_at_chunk_start",  # the shared RoPE key rotated from position 0 in each chunk
    "latent_without_norm",  # the cache holds the latent before its RMSNorm
)


def latent(bug: str | None = None):
    """``(full, init, step)`` of a small ``nanoattn.linen.LatentAttention`` (D = 12, N = 3,
    r = 7, Hn = 3, Hr = 4, Hv = 5): ``full`` the layer's forward; ``step`` an absorbed
    decode over a cache of latents and RoPE keys (B, C, r + Hr) written here on the core,
    with ``bug`` planted (None: correct)."""
    from nanoattn._layers import absorbed
    from nanoattn._layers import latent as mla
    from nanoattn.linen import LatentAttention, LatentConfig

    if bug not in (None, *LATENT_BUGS):
        raise ValueError(f"bug must be one of {LATENT_BUGS}, got {bug!r}")
    cfg = LatentConfig(d_model=D, n_heads=N, kv_lora_rank=7, qk_nope_head_dim=3,
                       qk_rope_head_dim=4, v_head_dim=5, q_lora_rank=None)  # fmt: skip
    layer = LatentAttention(cfg)
    variables = layer.init(jax.random.key(5), jnp.ones((1, 2, D)))
    # norm scales away from 1, so that a forgotten norm shows
    p = jax.tree.map(lambda a: a, variables["params"])
    p["kv_a_norm"]["scale"] = 0.5 + jax.random.uniform(jax.random.key(6), (7,))
    variables = {"params": p}
    r = cfg.kv_lora_rank

    class Params:
        def dense(self, name, x, features, dtype):
            return x @ p[name]["kernel"]

        def norm(self, name, x, dtype):
            scale = p[name]["scale"]
            inv = jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + cfg.norm_eps)
            return x * inv * scale.reshape((1,) * (x.ndim - 1) + (-1,))

        def kernel(self, name):
            return p[name]["kernel"]

    params = Params()

    @jax.jit
    def full(x):
        return layer.apply(variables, x)

    def init(batch, max_len):
        return {"latent": jnp.zeros((batch, max_len, 1, cfg.cache_width)),
                "position": jnp.zeros((batch,), jnp.int32)}  # fmt: skip

    @jax.jit
    def _step(state, chunk, lengths):
        B, L, _ = chunk.shape
        start = state["position"]
        positions = start[:, None] + jnp.arange(L)[None]  # (B, L)
        c, k_rope = mla.latent(params, cfg, chunk, chunk.dtype)
        if bug == "latent_without_norm":
            c = chunk @ p["kv_a"]["kernel"][:, :r]
        key_positions = positions
        if bug == "rope_key_at_chunk_start":
            key_positions = positions - start[:, None]
        entry = jnp.concatenate([c[:, :, None], mla.rotate(cfg, k_rope, key_positions)], -1)
        C = state["latent"].shape[1]
        slots = jnp.where(jnp.arange(L)[None] < lengths[:, None], positions, C)  # C: dropped
        cache = state["latent"].at[jnp.arange(B)[:, None], slots].set(entry, mode="drop")
        q_nope, q_rope, _ = mla.query(params, cfg, chunk, chunk.dtype)
        w = absorbed.up_projections(params, cfg, chunk.dtype)
        w_uk, w_uv = w[..., : cfg.qk_nope_head_dim], w[..., cfg.qk_nope_head_dim :]
        q = jnp.concatenate(
            [jnp.einsum("BLNh,rNh->BLNr", q_nope, w_uk), mla.rotate(cfg, q_rope, positions)], -1
        )
        o = dot_product_attention(q, cache, cache[..., :r], is_causal=True, q_offset=start,
                                  kv_lengths=start + lengths, scale=cfg.scale)  # fmt: skip
        y = jnp.einsum("BLNr,rNv->BLNv", o, w_uv).reshape(B, L, -1) @ p["out"]["kernel"]
        y = jnp.where((jnp.arange(L)[None] < lengths[:, None])[..., None], y, 0)
        return {"latent": cache, "position": start + lengths}, y

    def step(state, chunk, lengths):
        if lengths is None:
            lengths = np.full(chunk.shape[0], chunk.shape[1], np.int32)
        return _step(state, chunk, jnp.asarray(lengths, jnp.int32))

    return full, init, step


# A paged decoder (nanoattn.verify.PagedDecoder) on nanoattn.paged_attention: the tiny
# layer above (its window of 5 keys, RoPE) keeping its keys and values in pages of
# PAGE_SIZE tokens of a pool, its steps token-major over many sequences at once (a
# PagedBatch says whose each token is). ``paged(bug)`` plants one of:
#
# * ``"one_page_too_far"``: the attention is told each sequence holds page_size more
#   keys than it does, so it reads one page past the sequence's (a stale, random page);
# * ``"fork_writes_shared"``: the step's copy-on-write copies are ignored, so a fork
#   writes into a page it gets without the shared prefix's keys;
# * ``"page_order"``: RoPE rotates a token by its physical slot, page * page_size +
#   slot, not by its position in its sequence (right only when the pages are in order);
# * ``"decode_takes_prefill_positions"``: every sequence's first new token takes the
#   position of the first sequence's (right only when all sequences are at one position);
# * ``"copies_after_writes"``: the step's copies are made after its writes, so a copy
#   overwrites the new tokens a fork writes into its copied page;
# * ``"copies_last_first"``: the copies are made one at a time, the last first, so a copy
#   whose source page another copy of the step fills reads it filled (the step's copies
#   read the pool as it was before the step).
PAGE_SIZE = 3
PAGED_BUGS = (
    "one_page_too_far",
    "fork_writes_shared",
    "page_order",
    "decode_takes_prefill_positions",
    "copies_after_writes",
    "copies_last_first",
)


def _copy(pool, copies, skip, one_by_one):
    """The pool after a step's copies, all at once (each reading the pool as it was), or
    with ``one_by_one`` one at a time, the last first; none with ``skip``."""
    P = pool.shape[0]
    used = (copies[:, 0] >= 0) & ~skip
    source, target = jnp.maximum(copies[:, 0], 0), jnp.where(used, copies[:, 1], P)
    at_once = pool.at[target].set(pool[source], mode="drop")

    def turn(i, x):
        c = copies.shape[0] - 1 - i
        return x.at[target[c]].set(x[source[c]], mode="drop")

    return jnp.where(one_by_one, jax.lax.fori_loop(0, copies.shape[0], turn, pool), at_once)


@functools.partial(jax.jit, compiler_options=FAST_COMPILE)
def _paged_decode(pool, x, batch, embed, bug):
    """One paged step: x (1, Tq, ...) token-major; ``bug`` (6,) bool in PAGED_BUGS's order."""
    too_far, no_copy, physical, from_first, after_writes, last_first = bug
    table, lengths, starts, copies = (
        batch.page_table, batch.kv_lengths, batch.query_starts, batch.copies
    )  # fmt: skip
    P, B, Tq = pool["key"].shape[0], lengths.shape[0], x.shape[1]
    skip = no_copy | after_writes
    keys, values = (_copy(pool[n], copies, skip, last_first) for n in ("key", "value"))
    t = jnp.arange(Tq)
    row = jnp.minimum(jnp.searchsorted(starts[1:], t, side="right"), B - 1)  # (Tq,)
    real = t < starts[B]
    base = lengths - (starts[1:] - starts[:-1])  # (B,): each sequence's first new position
    offset = t - starts[row]
    position = base[row] + offset
    page, slot = table[row, position // PAGE_SIZE], position % PAGE_SIZE
    rotate_at = jnp.where(from_first, base[0] + offset, position)
    rotate_at = jnp.where(physical, page * PAGE_SIZE + slot, rotate_at)
    q, k, v = _project(_embedded(x, embed), rotate_at)  # (1, Tq, N, H)
    page = jnp.where(real, page, P)  # padding: dropped
    keys = keys.at[page, slot].set(k[0], mode="drop")
    values = values.at[page, slot].set(v[0], mode="drop")
    keys, values = (_copy(x, copies, ~after_writes, False) for x in (keys, values))
    held = lengths + too_far * PAGE_SIZE
    y = paged_attention(q[0], keys, values, table, held, starts, window=(WINDOW, 0))
    return {"key": keys, "value": values}, y.reshape(1, Tq, D) @ WO


def paged(bug: str | None = None, vocab: int | None = None):
    """The paged decoder, ``bug`` planted (None: correct), as a
    :class:`nanoattn.verify.PagedDecoder`; with ``vocab`` on token ids."""
    from nanoattn.verify import PagedDecoder

    if bug not in (None, *PAGED_BUGS):
        raise ValueError(f"bug must be one of {PAGED_BUGS}, got {bug!r}")
    switches = jnp.asarray([name == bug for name in PAGED_BUGS])
    embed = None if vocab is None else jax.random.normal(jax.random.key(vocab), (vocab, D))

    def init(pages):
        zeros = jnp.zeros((pages, PAGE_SIZE, N, H))
        return {"key": zeros, "value": zeros}

    def step(state, chunk, batch):
        return _paged_decode(state, jnp.asarray(chunk), batch, embed, switches)

    return PagedDecoder(lambda x: _full(x, embed), init, step, page_size=PAGE_SIZE)


def paged_correct():
    """A zero-argument factory for `nanoattn verify --decode`: the correct paged decoder."""
    return paged()


# The three wrong answers of nanoattn's own paged serving before issue 45, planted back
# into its PageAllocator (a PagedDecoder's ``allocator``), so that check_decoding on
# nanoattn's layers shows it would have caught them. They reach into the allocator's
# private state: that is where the bugs were.
class ForkBeforeWrite(PageAllocator):
    """A fork of a parent whose tokens no step has written is taken: the child's copy of
    the shared partial page is made before the parent's step fills it."""

    def fork(self, parent, child):
        sequence = self._sequences[parent]
        written, sequence.written = sequence.written, sequence.length
        try:
            super().fork(parent, child)
        finally:
            sequence.written = written


class StaleChainedCopy(PageAllocator):
    """A copy whose source is another pending copy's target reads that target as it
    is before the step (not filled yet), not the other copy's source."""

    def _source(self, page):
        return page


class CopyIntoFreedPage(PageAllocator):
    """A pending copy into a page that was freed stays pending: when the page is handed
    to another copy, two copies of one step fill it."""

    def _release(self, page):
        self._refs[page] -= 1
        if self._refs[page] == 0:
            self._free.append(page)


ALLOCATOR_BUGS = {
    "fork_before_write": ForkBeforeWrite,
    "stale_chained_copy": StaleChainedCopy,
    "copy_into_freed_page": CopyIntoFreedPage,
}


# A quantized cache (AttentionConfig(kv_cache_dtype="int8")): nanoattn's linen layer,
# with bugs planted in the cache it hands the next step, as a broken kernel or write
# would leave it:
# * "dropped_value_scale": the cached values are read without their scales (1);
# * "scale_off_by_one": each cached key is read with its neighbour's scale;
# * "requantized": every call quantizes all the cached tokens again, with one scale
#   per row and head (its largest value), as a cache of per-block scales does when a
#   new token raises its block's maximum.
QUANTIZED_BUGS = ("dropped_value_scale", "scale_off_by_one", "requantized")
# Above the correct int8 cache's error against the float forward on this layer
# (measured 0.0085), below every planted bug's (requantized: 0.013 to 0.017).
QUANTIZED_ATOL = 0.012


@functools.cache
def _quantized_layer():
    from nanoattn.linen import AttentionConfig, CausalSelfAttention
    from nanoattn.verify import decoders

    module = CausalSelfAttention(AttentionConfig(D, N, rope_base=ROPE_BASE, kv_cache_dtype="int8"))
    params = module.init(jax.random.key(0), jnp.zeros((1, 4, D)), True)
    return decoders.linen(module, params)


def _requantized(cache):
    keys, stored = {}, halves(cache)
    for name in ("key", "value"):
        x = stored[name].astype(jnp.float32) * cache[f"{name}_scales"][..., None]  # (B, S, K, H)
        scale = jnp.max(jnp.abs(x), axis=(1, 3), keepdims=True) / 127  # (B, 1, K, 1)
        safe = jnp.where(scale > 0, scale, 1)
        keys[name] = jnp.round(x / safe).astype(jnp.int8)
        keys[f"{name}_scales"] = jnp.broadcast_to(scale[..., 0], cache[f"{name}_scales"].shape)
    if cache["key"].ndim == 5:  # a combined cache: its keys and values in "key" again
        keys["key"], keys["value"] = jnp.stack([keys["key"], keys["value"]], 2), cache["value"]
    return dict(cache, **keys)


_QUANTIZED_BUGS = {
    "dropped_value_scale": lambda c: dict(c, value_scales=jnp.ones_like(c["value_scales"])),
    "scale_off_by_one": lambda c: dict(c, key_scales=jnp.roll(c["key_scales"], 1, axis=1)),
    "requantized": _requantized,
}


def quantized(bug: str | None = None):
    """The int8-cache decoder (a ``Decoder`` with its rewind, float cache and float64
    reference), with ``bug`` planted."""
    from nanoattn.verify import Decoder

    decoder = _quantized_layer()
    if bug is None:
        return decoder
    full, init, step = decoder
    spoil = _QUANTIZED_BUGS[bug]

    def buggy(state, chunk, lengths):
        fresh = isinstance(state, tuple)  # before the first chunk: no cache yet
        return step(state if fresh else spoil(state), chunk, lengths)

    return Decoder(full, init, buggy, rewind=decoder.rewind, float_cache=decoder.float_cache,
                   reference=decoder.reference)  # fmt: skip
