"""Rolling KV caches, sink tokens and rewinding (issue #24), on the linen and NNX layers.

Every decoding run is checked against the full windowed forward of the same layer
at every position: a rolling cache of C slots decoded several times past C, in
one-token steps and in every chunking up to the chunk limit C - W - S0 (each row its
own, ragged), with GQA, RoPE, soft-capping, QK norm, sink tokens, logit sinks,
bfloat16 and the flash backend; rewinding by a random amount per row on full and
rolling caches; NaN planted in every slot a row must not read (stale slots after a
wrap or a rewind included) before every call. Sizes are distinct (B 2, D 24, N 4,
K 2, H 6, W 3) so a swapped axis fails; each step is jitted once per configuration.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _caches import halves, kv_names, slot_mask
from flax import linen as nn
from flax import nnx
from hypothesis import example, given, settings
from hypothesis import strategies as st

from nanoattn import nnx as nanoattn_nnx
from nanoattn._layers.caches import rolling
from nanoattn._layers.caches.rolling import RollingCache
from nanoattn.linen import AttentionConfig, CausalSelfAttention, cache_bytes, rewind

from _layer_configs import random_params
from _reference import randn

B, D, N, K, W = 2, 24, 4, 2, 3
H = D // N
T = 29  # tokens per row: several wraps of every capacity below
CONFIGS = {  # name: (options, sink tokens, chunk limit)
    "plain": (dict(), 0, 2),
    "gqa_rope": (dict(n_kv_heads=K, rope_base=100.0), 0, 3),
    "cap_norm": (dict(n_kv_heads=K, logit_soft_cap=1.5, qk_norm=True), 0, 2),
    "sink_tokens": (dict(n_kv_heads=K, rope_base=100.0, sinks=True), 2, 3),
    "one_slot_chunks": (dict(n_kv_heads=1), 1, 1),
    "bfloat16": (dict(n_kv_heads=K, rope_base=100.0, qk_norm=True, dtype=jnp.bfloat16), 1, 2),
    "flash": (dict(n_kv_heads=K, rope_base=100.0, implementation="flash"), 1, 3),
}


def config(name, rolling=True):
    options, sinks, _ = CONFIGS[name]
    return AttentionConfig(D, N, window=(W, 0), sink_tokens=sinks, rolling_cache=rolling, **options)


def capacity(name):
    _, sinks, limit = CONFIGS[name]
    return W + limit + sinks


class Case:
    """A linen layer with random parameters, an input (B, T, D), its full forward,
    an empty cache of ``slots`` and a jitted decode step (lengths per row)."""

    def __init__(self, cfg, slots, seed=0):
        self.cfg, self.slots = cfg, slots
        self.layer = CausalSelfAttention(cfg)
        self.x = jnp.asarray(randn(seed, B, T, D))
        init = functools.partial(self.layer.init, decode=True)
        shapes = jax.eval_shape(init, jax.random.key(0), jnp.zeros((B, slots, D)))
        self.params = random_params(shapes["params"], seed + 7)
        self.cache = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), shapes["cache"])
        self.full = jax.jit(lambda p, x: self.layer.apply({"params": p}, x, True))
        self.step = jax.jit(self.decode)

    def decode(self, params, cache, chunk, lengths):
        y, state = self.layer.apply(
            {"params": params, "cache": cache}, chunk, True, decode=True, lengths=lengths,
            mutable=["cache"],
        )  # fmt: skip
        return y, state["cache"]


@functools.cache
def case(name, rolling=True):
    # A full cache holds every walk below: T tokens, or the rewind test's 24 calls of at
    # most 3 (a row that would overflow it is poisoned, and its rewind refused).
    slots = capacity(name) if rolling else 3 * T
    return Case(config(name, rolling), slots)


def tolerance(cfg):
    return 3e-2 if cfg.dtype == jnp.bfloat16 else 2e-5


def in_view(cache, chunk: int, cfg):
    """(B, S) bool: the slots a row's next call of ``chunk`` tokens may read; every
    other slot is stale or empty (for a full cache, those at and past the position)."""
    position = np.asarray(cache["position"])
    S = cache["key"].shape[1]
    if not cfg.rolling_cache:
        return np.arange(S)[None] < position[:, None]
    held = np.asarray(rolling.slot_positions(np.maximum(position, 0), S, cfg.sink_tokens))
    first = position[:, None]  # the earliest query of the call sees the most
    return (held >= 0) & ((first - held <= W) | (held < cfg.sink_tokens))


def poison(cache, chunk, cfg):
    """NaN in every slot the next call must not read."""
    stale = ~in_view(cache, chunk, cfg)
    planted = {}
    for name in kv_names(cache):  # a combined cache's keys and values in "key"
        a = np.array(cache[name], np.float32)
        a[np.broadcast_to(slot_mask(stale, a), a.shape)] = np.nan
        planted[name] = jnp.asarray(a, cache[name].dtype)
    return {**cache, **planted}


def run(c: Case, chunkings, width, plant=True):
    """Feeds row b of ``c.x`` through the cache in chunk sizes ``chunkings[b]``, in
    right-padded chunks of ``width`` with ``lengths``; NaN in the padding and, with
    ``plant``, in every slot the call must not read. Returns each row's outputs."""
    x = np.asarray(c.x, np.float32)
    cache, done, outs = c.cache, [0] * B, [[] for _ in range(B)]
    for step in range(max(map(len, chunkings))):
        lengths = [sizes[step] if step < len(sizes) else 0 for sizes in chunkings]
        chunk = np.full((B, width, D), np.nan, np.float32)
        for b, n in enumerate(lengths):
            chunk[b, :n] = x[b, done[b] : done[b] + n]
        if plant:
            cache = poison(cache, width, c.cfg)
        y, cache = c.step(c.params, cache, jnp.asarray(chunk, c.x.dtype), jnp.asarray(lengths))
        for b, n in enumerate(lengths):
            outs[b].append(np.asarray(y[b, :n], np.float32))
            done[b] += n
        np.testing.assert_array_equal(cache["position"], done)
        np.testing.assert_array_equal(cache["last"], lengths)
    return [np.concatenate(o) for o in outs], cache


def assert_full(c: Case, got, x=None):
    want = np.asarray(c.full(c.params, c.x if x is None else x), np.float32)
    for b in range(B):
        n = len(got[b])
        np.testing.assert_allclose(got[b], want[b, :n], atol=tolerance(c.cfg), rtol=1e-3)


def cut(sizes, total=T):
    out = []
    for size in sizes:
        if sum(out) >= total:
            break
        out.append(min(size, total - sum(out)))
    return out


SLOW_CONFIGS = ("bfloat16", "flash")  # in `make test-all`


@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW_CONFIGS else n for n in CONFIGS]
)
def test_one_token_steps_far_past_the_capacity_equal_the_full_forward(name):
    c = case(name)
    got, cache = run(c, [[1] * T, [1] * (T - 4)], width=1)
    assert T > 3 * c.slots  # several wraps
    assert_full(c, got)
    assert halves(cache)["key"].shape == (B, c.slots, c.cfg.kv_heads, H)


limit_chunks = st.lists(st.integers(1, 3), min_size=T, max_size=T)


@pytest.mark.parametrize("name", ["gqa_rope", "sink_tokens", "bfloat16"])
@settings(max_examples=3, deadline=None, derandomize=True)
@given(row0=limit_chunks, row1=limit_chunks)
@example(row0=[3] * T, row1=[1, 3, 2] * T)
def test_any_chunking_up_to_the_limit_equals_the_full_forward(name, row0, row1):
    """Each row in its own chunking (ragged: different positions, padded chunks)."""
    limit = CONFIGS[name][2]
    c = case(name)
    rows = [cut([min(s, limit) for s in row0]), cut([min(s, limit) for s in row1])]
    got, _ = run(c, rows, width=limit)
    assert_full(c, got)


def test_nan_in_unread_slots_is_what_the_outputs_ignore():
    """Positive control of the planting: NaN in one slot a row may read shows."""
    c = case("sink_tokens")
    _, cache = run(c, [[3] * 5, [2] * 5], width=3)
    for visible_slot in (0, 1):  # the sink slots, always in view
        bad = {**cache, "key": cache["key"].at[1, visible_slot].set(jnp.nan)}
        y, _ = c.step(c.params, bad, c.x[:, 15:18], jnp.array([3, 3]))
        assert np.isfinite(y[0]).all() and np.isnan(y[1]).all()


def test_sink_tokens_in_training_equal_a_dense_mask():
    """The full forward with sink tokens against the same layer without window or sink
    tokens under a literal (T, T) mask: causal, and within W or among the first S0."""
    c = case("sink_tokens")
    S0 = c.cfg.sink_tokens
    i, j = np.arange(T)[:, None], np.arange(T)[None, :]
    allowed = (j <= i) & ((i - j <= W) | (j < S0))
    plain = CausalSelfAttention(AttentionConfig(D, N, **CONFIGS["sink_tokens"][0]))
    want = jax.jit(lambda x: plain.apply({"params": c.params}, x, True, mask=allowed))(c.x)
    got = c.full(c.params, c.x)
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-5)
    windowed = CausalSelfAttention(
        AttentionConfig(D, N, window=(W, 0), **CONFIGS["sink_tokens"][0])
    )
    without = jax.jit(lambda x: windowed.apply({"params": c.params}, x, True))(c.x)
    assert np.abs(without - got).max() > 1e-3  # the sink tokens mattered


def test_sink_tokens_on_a_full_cache_equal_the_full_forward():
    c = case("sink_tokens", rolling=False)
    got, _ = run(c, [cut([3, 1, 5, 2] * 3), [1] * 20], width=5)
    assert_full(c, got)


@pytest.mark.parametrize("rolling", [True, False], ids=["rolling", "full"])
@pytest.mark.parametrize("seed", [0, 1])
def test_rewind_a_random_amount_per_row_then_decode_on(rolling, seed):
    """Speculative decoding's pattern: each call brings up to ``width`` tokens per row,
    a random number of them is rejected (rewound), fresh tokens follow. The outputs
    kept equal the full forward of what each row kept; NaN sits in every slot a call
    must not read, the rewound ones included."""
    name = "sink_tokens"
    c = case(name, rolling)
    width = CONFIGS[name][2]
    rng = np.random.default_rng(seed)
    kept = [[] for _ in range(B)]  # each row's accepted input vectors
    outs = [[] for _ in range(B)]
    cache = c.cache
    for _ in range(24):
        lengths = rng.integers(1, width + 1, B)
        chunk = rng.standard_normal((B, width, D)).astype(np.float32)
        cache = poison(cache, width, c.cfg)
        y, cache = c.step(c.params, cache, jnp.asarray(chunk), jnp.asarray(lengths))
        n = rng.integers(0, lengths + 1)  # 0 <= n[b] <= lengths[b]
        cache = rewind(cache, jnp.asarray(n))
        for b in range(B):
            keep = int(lengths[b] - n[b])
            kept[b].extend(chunk[b, :keep])
            outs[b].append(np.asarray(y[b, :keep]))
        np.testing.assert_array_equal(cache["position"], [len(k) for k in kept])
        np.testing.assert_array_equal(cache["last"], lengths - n)
    longest = max(map(len, kept))
    assert longest > capacity(name) + W  # the ring wrapped
    x = np.zeros((B, longest, D), np.float32)
    for b in range(B):
        x[b, : len(kept[b])] = kept[b]
    assert_full(c, [np.concatenate(o) for o in outs], jnp.asarray(x))


def test_rewind_twice_within_one_call_and_over_a_whole_collection():
    c = case("gqa_rope")
    _, cache = c.step(c.params, c.cache, c.x[:, :3], jnp.array([3, 2]))
    once = rewind(cache, jnp.array([1, 1]))
    twice = rewind(once, jnp.array([2, 1]))
    np.testing.assert_array_equal(twice["position"], [0, 0])
    with pytest.raises(ValueError, match=r"n\[0\]=1 is outside \[0, 0\]"):
        rewind(twice, 1)
    model = rewind({"layer_0": cache, "layer_1": {"attn": cache}}, 2)  # a model's collection
    np.testing.assert_array_equal(model["layer_1"]["attn"]["position"], [1, 0])
    np.testing.assert_array_equal(model["layer_0"]["last"], [1, 0])


def test_rewind_errors_when_concrete_and_poisoned_rows_under_jit():
    c = case("gqa_rope")
    _, cache = c.step(c.params, c.cache, c.x[:, :3], jnp.array([3, 2]))
    cases = [
        (jnp.array([1, 3]), ValueError, r"^rewind: n\[1\]=3 is outside \[0, 2\], the tokens "
         r"row 1 took in its last call$"),
        (jnp.array([-1, 0]), ValueError, r"^rewind: n\[0\]=-1 is outside \[0, 3\]"),
        (jnp.array([1, 1, 1]), ValueError, r"n must have shape \(B,\) = \(2,\), got \(3,\)"),
        (jnp.array([1.0, 1.0]), TypeError, "n must be an integer array"),
    ]  # fmt: skip
    for n, error, message in cases:
        with pytest.raises(error, match=message):
            rewind(cache, n)
    after = jax.jit(rewind)(cache, jnp.array([1, 3]))  # row 1 cannot go back 3
    np.testing.assert_array_equal(after["position"], [2, -1])
    y, later = c.step(c.params, after, c.x[:, 3:5], jnp.array([2, 2]))
    assert np.isfinite(y[0]).all() and np.isnan(y[1]).all()
    np.testing.assert_array_equal(later["position"], [4, -1])  # stays poisoned
    with pytest.raises(ValueError, match=r"^row 1 of the KV cache is poisoned \(position -1\)"):
        c.decode(c.params, later, c.x[:, 3:5], jnp.array([1, 1]))


def test_the_chunk_limit_raises_when_concrete_and_poisons_the_row_under_jit():
    c = case("sink_tokens")  # C = 8 slots, W = 3, S0 = 2: at most 3 tokens per call
    chunk = c.x[:, :4]
    with pytest.raises(
        ValueError,
        match=r"^a rolling KV cache of 8 slots takes at most 3 tokens per call \(capacity - "
        r"window - sink_tokens\), row 1 brings 4: they would overwrite keys still in view",
    ):
        c.decode(c.params, c.cache, chunk, jnp.array([3, 4]))
    policy = RollingCache(W, sink_tokens=2)
    check = functools.partial(policy.broken_rows, chunk=4, capacity=8)
    assert not check(np.array([0, 0]), np.array([3, 3])).any()  # a wider padded chunk is fine
    y, cache = c.step(c.params, c.cache, chunk, jnp.array([3, 4]))
    assert np.isfinite(y[0]).all() and np.isnan(y[1]).all()
    np.testing.assert_array_equal(cache["position"], [3, -1])
    y, _ = c.step(c.params, cache, chunk, jnp.array([1, 1]))
    assert np.isfinite(y[0]).all() and np.isnan(y[1]).all()
    assert not check(np.array([1000, 7]), np.array([3, 1])).any()  # decoding goes on forever


def test_configuration_and_capacity_errors():
    for options, message in [
        (dict(rolling_cache=True), r"^rolling_cache=True needs window=\(W, 0\) \(no look-ahead\), "
         r"got window=None$"),
        (dict(rolling_cache=True, window=(3, 2)), r"got window=\(3, 2\)$"),
        (dict(sink_tokens=2), r"^sink_tokens=2 needs a window"),
        (dict(sink_tokens=-1, window=(3, 0)), r"^sink_tokens must be >= 0, got sink_tokens=-1$"),
    ]:  # fmt: skip
        with pytest.raises(ValueError, match=message):
            AttentionConfig(D, N, **options)
    with pytest.raises(TypeError, match=r"^sink_tokens must be an int >= 0, got sink_tokens=1.0"):
        AttentionConfig(D, N, window=(3, 0), sink_tokens=1.0)
    cfg = AttentionConfig(D, N, window=(3, 0), sink_tokens=2, rolling_cache=True)
    small = r"needs at least window \+ 1 \+ sink_tokens = 3 \+ 1 \+ 2 = 6 slots, got 5"
    with pytest.raises(ValueError, match="^a rolling KV cache " + small):
        CausalSelfAttention(cfg).init(jax.random.key(0), jnp.zeros((B, 5, D)), decode=True)
    module = nanoattn_nnx.CausalSelfAttention(cfg, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=small + r"; create the cache with module.init_cache"):
        module.init_cache(B, 5)
    module.init_cache(B, 6)  # exactly enough: one token per call


def test_nnx_rolling_cache_and_rewind_equal_the_full_forward():
    cfg = config("sink_tokens")
    module = nanoattn_nnx.CausalSelfAttention(cfg, deterministic=True, rngs=nnx.Rngs(3))
    x = jnp.asarray(randn(5, B, T, D))
    full = np.asarray(module(x))
    module.init_cache(B, capacity("sink_tokens"))
    step = nnx.jit(lambda m, chunk, n: m(chunk, decode=True, lengths=n))
    back = nnx.jit(lambda m, n: m.rewind(n))
    outs, done = [[] for _ in range(B)], [0, 0]
    for sizes in [(3, 1), (1, 3), (2, 2)] * 4:
        chunk = np.zeros((B, 3, D), np.float32)
        for b, n in enumerate(sizes):
            chunk[b, :n] = x[b, done[b] : done[b] + n]
        y = step(module, jnp.asarray(chunk), jnp.asarray(sizes))
        for b, n in enumerate(sizes):  # keep all but the last token, then rewind it
            outs[b].append(np.asarray(y[b, : n - 1]))
            done[b] += n - 1
        back(module, jnp.ones(B, jnp.int32))
        np.testing.assert_array_equal(module.cache.position[...], done)
    for b in range(B):
        np.testing.assert_allclose(np.concatenate(outs[b]), full[b, : done[b]], atol=2e-5)
    module.rewind(jnp.array([1, 0]))  # the last call's second token of row 0
    np.testing.assert_array_equal(module.cache.position[...], [done[0] - 1, done[1]])
    with pytest.raises(ValueError, match=r"rewind: n\[0\]=1 is outside \[0, 0\]"):
        module.rewind(1)


def test_cache_memory_is_o_of_capacity_whatever_the_decoded_length():
    """The cache pytree's bytes are 2 B C K H itemsize + 8 B and do not change as
    decoding goes on; one compiled step serves every position, and its compiled
    memory grows with C, not with the tokens decoded."""
    c = case("gqa_rope")
    C, itemsize = c.slots, 4
    want = 2 * B * C * K * H * itemsize + 8 * B
    assert cache_bytes(c.cache) == {"": want}
    traces = []

    @jax.jit
    def step(params, cache, token):
        traces.append(1)
        return c.decode(params, cache, token, None)

    cache = c.cache
    for t in range(10 * C):
        _, cache = step(c.params, cache, c.x[:, t % T : t % T + 1])
    assert len(traces) == 1 and cache_bytes(cache) == {"": want}
    np.testing.assert_array_equal(cache["position"], [10 * C] * 2)

    def compiled_bytes(slots):
        cache = jax.tree.map(
            lambda a: jnp.zeros((B, slots, *a.shape[2:]), a.dtype) if a.ndim >= 4 else a,
            c.cache,
        )
        m = step.lower(c.params, cache, c.x[:, :1]).compile().memory_analysis()
        return m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes

    small, large = compiled_bytes(C), compiled_bytes(4 * C)
    grows = large - small
    assert 3 * 2 * (want - 8 * B) <= grows <= 3 * 6 * (want - 8 * B), (small, large)


def test_per_layer_capacities_in_one_model():
    """A stack of two local layers with rolling caches of W + chunk + S0 slots and one
    global layer with the whole context: decoded in chunks it equals its full forward,
    and each layer's cache bytes are reported."""
    chunk, S0, context = 3, 1, T
    local = AttentionConfig(
        D, N, n_kv_heads=K, window=(W, 0), sink_tokens=S0, rolling_cache=True, rope_base=100.0
    )
    glob = AttentionConfig(D, N, n_kv_heads=1, rope_base=100.0)
    layers = ((local, W + chunk + S0), (local, W + chunk + S0), (glob, context))

    class Stack(nn.Module):
        @nn.compact
        def __call__(self, x, decode=False, lengths=None):
            for i, (cfg, slots) in enumerate(layers):
                layer = CausalSelfAttention(cfg, name=f"layer_{i}")
                if decode and self.is_initializing():  # each cache its own capacity
                    layer(jnp.zeros((x.shape[0], slots, D)), True, decode=True)
                else:
                    x = x + layer(x, True, decode=decode, lengths=lengths)
            return x

    model = Stack()
    x = jnp.asarray(randn(11, B, context, D))
    variables = jax.jit(lambda k: model.init(k, x[:, :1], decode=True))(jax.random.key(0))
    params = {"params": variables["params"]}
    full = jax.jit(lambda x: model.apply(params, x))(x)
    step = jax.jit(
        lambda cache, x: model.apply({**params, "cache": cache}, x, True, mutable=["cache"])
    )
    cache, outs = variables["cache"], []
    for t in range(0, context, chunk):
        y, state = step(cache, x[:, t : t + chunk])
        cache = state["cache"]
        outs.append(y)
    np.testing.assert_allclose(jnp.concatenate(outs, 1), full, atol=5e-5, rtol=1e-4)
    local_bytes = 2 * B * (W + chunk + S0) * K * H * 4 + 8 * B
    assert cache_bytes(cache) == {
        "layer_0": local_bytes,
        "layer_1": local_bytes,
        "layer_2": 2 * B * context * 1 * H * 4 + 8 * B,
    }


def test_mask_fn_and_score_fn_see_true_key_positions_through_a_rolling_cache():
    """A per-head causal window and ALiBi, as functions of positions: through the ring
    they see each key's position (not its slot), so decoding equals the full forward."""
    c = case("gqa_rope")
    widths = jnp.array([0, 1, 2, 3])

    def fns():
        return dict(
            mask_fn=lambda b, n, q, k: q - k <= widths[n],
            score_fn=lambda s, b, n, q, k: s - 0.5 ** (n + 1) * (q - k),
        )

    full = jax.jit(lambda x: c.layer.apply({"params": c.params}, x, True, **fns()))(c.x)
    step = jax.jit(
        lambda cache, x: c.layer.apply(
            {"params": c.params, "cache": cache}, x, True, decode=True, mutable=["cache"], **fns()
        )
    )
    cache, outs = c.cache, []
    for t in range(0, 27, 3):
        y, state = step(cache, c.x[:, t : t + 3])
        cache = state["cache"]
        outs.append(y)
    np.testing.assert_allclose(jnp.concatenate(outs, 1), full[:, :27], atol=2e-5, rtol=1e-5)
    assert np.abs(full - c.full(c.params, c.x)).max() > 1e-2  # the functions mattered
