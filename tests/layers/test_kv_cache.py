"""Decoding with the KV cache of CausalSelfAttention: any chunking of a sequence
through the cache gives the outputs of one causal call on the whole sequence.

Sizes are distinct (B=2, T=11, capacity 13, D=48, N=6, K=2, H=8) so a swapped
axis fails. Every function under test is jitted once per configuration and
reused across examples, so the hypothesis runs stay cheap.
"""

import copy
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _caches import halves, kv_names, slot_mask
from hypothesis import example, given, settings
from hypothesis import strategies as st

from nanoattn import padding_mask
from nanoattn._layers.caches import kv_cache
from nanoattn._layers.caches.full import FullCache
from nanoattn.linen import AttentionConfig, CausalSelfAttention

from _backends import each_backend
from _layer_configs import CONFIGS, LAYER_REFUSALS, D, K, N, random_params
from _reference import randn

B, T, CAP = 2, 11, 13  # D, N and K come with the configurations
WIDTH = 5  # the width of the padded chunks of the jitted step
H = D // N


class Case:
    """A layer, random parameters, an input (B, T, D), its full forward, an empty
    cache of ``capacity`` and a jitted decode step."""

    def __init__(self, batch=B, capacity=CAP, seed=0, **options):
        self.layer = CausalSelfAttention(AttentionConfig(D, N, **options))
        self.x = jnp.asarray(randn(seed, batch, T, D))
        empty = jnp.zeros((batch, capacity, D), self.x.dtype)
        init = functools.partial(self.layer.init, decode=True)
        shapes = jax.eval_shape(init, jax.random.key(0), empty)  # traced, not compiled
        self.params = random_params(shapes["params"], seed + 7)
        # Exactly what init returns (test_init_creates_an_empty_cache checks it): zeros, position 0.
        self.cache = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), shapes["cache"])
        self.full = jax.jit(self.forward)
        self.step = jax.jit(self.decode)

    def forward(self, params, x, mask=None):
        return self.layer.apply({"params": params}, x, True, mask=mask)

    def decode(self, params, cache, chunk, lengths=None, mask=None):
        y, state = self.layer.apply(
            {"params": params, "cache": cache},
            chunk,
            True,
            decode=True,
            lengths=lengths,
            mask=mask,
            mutable=["cache"],
        )
        return y, state["cache"]


@functools.cache
def case(name: str, **overrides) -> Case:
    return Case(**CONFIGS[name], **overrides)


def case_on(implementation: str) -> Case:
    """The layer with every option on the backend ``implementation``; skips the test,
    with the backend's reason, when it does not serve the layer's calls."""
    if reason := LAYER_REFUSALS[implementation]:
        pytest.skip(f"{implementation}: {reason}")
    return case(implementation)


def cut(sizes, total=T):
    """Chunk sizes that add up to ``total``: the prefix of ``sizes`` that fits, then the rest."""
    out = []
    for size in sizes:
        if sum(out) >= total:
            break
        out.append(min(size, total - sum(out)))
    return out


def run_ragged(c: Case, chunkings, widths=None, mask=None):
    """Feeds row b of ``c.x`` through the cache in the chunk sizes ``chunkings[b]``,
    each call a right-padded chunk of ``widths[i]`` tokens (default WIDTH) with
    ``lengths``. Returns each row's outputs at its real tokens, and the last cache."""
    x = np.asarray(c.x)
    cache, done = c.cache, [0] * len(chunkings)
    outs = [[] for _ in chunkings]
    steps = max(map(len, chunkings))
    for step, width in enumerate(widths or [WIDTH] * steps):
        lengths = [sizes[step] if step < len(sizes) else 0 for sizes in chunkings]
        chunk = np.full((len(chunkings), width, D), np.nan, np.float32)  # padding holds NaN
        for b, n in enumerate(lengths):
            chunk[b, :n] = x[b, done[b] : done[b] + n]
        y, cache = c.step(c.params, cache, jnp.asarray(chunk), jnp.asarray(lengths), mask)
        for b, n in enumerate(lengths):
            outs[b].append(np.asarray(y[b, :n], np.float32))
            np.testing.assert_array_equal(y[b, n:], 0)  # padded positions give zeros
            done[b] += n
        np.testing.assert_array_equal(cache["position"], done)  # rows advance by lengths
    return [np.concatenate(o) for o in outs], cache


chunkings = st.lists(st.integers(1, WIDTH), min_size=T, max_size=T).map(cut)


@pytest.mark.parametrize("name", list(CONFIGS))
@settings(max_examples=4, deadline=None, derandomize=True)
@given(row0=chunkings, row1=chunkings)
@example(row0=[3, 1, 1, 5, 1], row1=[1] * T)
def test_decoding_in_any_chunking_equals_the_full_forward(name, row0, row1):
    """Each row in its own chunking, at its own position, through one jitted step."""
    c = case(name)
    got, cache = run_ragged(c, [row0, row1])
    want = np.asarray(c.full(c.params, c.x), np.float32)
    tol = 3e-2 if name == "bfloat16" else 1e-5
    for b in range(B):
        np.testing.assert_allclose(got[b], want[b], atol=tol, rtol=tol)
    assert np.isfinite(np.asarray(cache["key"], np.float32)).all()  # padding never stored


@each_backend("name")
def test_unpadded_chunks_of_any_length(name):
    c = case_on(name)
    cache, outs, start = c.cache, [], 0
    for size in [3, 1, 1, 5, 1]:
        y, cache = c.step(c.params, cache, c.x[:, start : start + size])
        outs.append(y)
        start += size
    got = jnp.concatenate(outs, axis=1)
    np.testing.assert_allclose(got, c.full(c.params, c.x), atol=1e-5, rtol=1e-5)
    np.testing.assert_array_equal(cache["position"], [T, T])


def test_init_creates_an_empty_cache_of_the_input_length():
    c = case("bfloat16")
    empty = jnp.zeros((B, CAP, D))
    variables = jax.jit(lambda key: c.layer.init(key, empty, decode=True))(jax.random.key(0))
    assert jax.tree.map(lambda a: (a.shape, a.dtype), variables["cache"]) == {
        "key": ((B, CAP, K, H), jnp.bfloat16),  # the compute dtype
        "value": ((B, CAP, K, H), jnp.bfloat16),
        "position": ((B,), jnp.int32),
        "last": ((B,), jnp.int32),
    }
    for leaf in jax.tree.leaves(variables["cache"]):
        np.testing.assert_array_equal(leaf, 0)
    assert jax.tree.map(jnp.shape, variables["params"]) == jax.tree.map(jnp.shape, c.params)
    y, cache = c.step(c.params, variables["cache"], c.x[:, :WIDTH], jnp.array([2, 5]))
    assert y.dtype == jnp.bfloat16 and cache["key"].dtype == jnp.bfloat16
    np.testing.assert_array_equal(cache["position"], [2, 5])
    assert halves(case("mqa").cache)["key"].shape == (B, CAP, 1, H)
    assert halves(case("mha").cache)["value"].shape == (B, CAP, N, H)


def test_decoding_ands_a_mask_over_the_cache_slots():
    c = case("xla")
    valid = np.ones((B, CAP), bool)
    valid[1, [0, 3]] = False  # row 1 never sees tokens 0 and 3
    got, _ = run_ragged(c, [[4, 1, 5, 1], [2, 5, 4]], mask=padding_mask(valid))
    want = np.asarray(c.full(c.params, c.x, padding_mask(valid[:, :T])))
    for b in range(B):
        np.testing.assert_allclose(got[b], want[b], atol=1e-5, rtol=1e-5)
    assert np.abs(got[1] - c.full(c.params, c.x)[1]).max() > 1e-3  # the mask mattered


@each_backend("name")
def test_ragged_prompts_prefilled_in_one_call_then_decoded_token_by_token(name):
    """Prompts of lengths 5 and 2 in one right-padded chunk of width 7, then one
    token per step, each row at its own position (row 0 skips one step)."""
    c = case_on(name)
    rows = [[5, 1, 1, 0, 1, 1, 1, 1], [2, 1, 1, 1, 1, 1, 1, 1]]
    got, cache = run_ragged(c, rows, widths=[7] + [1] * 7)
    want = np.asarray(c.full(c.params, c.x))
    np.testing.assert_array_equal(cache["position"], [11, 9])
    for b in range(B):
        assert len(got[b]) == sum(rows[b])
        np.testing.assert_allclose(got[b], want[b, : sum(rows[b])], atol=1e-5, rtol=1e-5)


def prefilled(c: Case, lengths):
    """The cache after one right-padded chunk of WIDTH tokens with ``lengths``."""
    _, cache = c.step(c.params, c.cache, c.x[:, :WIDTH], jnp.asarray(lengths))
    return cache


def test_a_jitted_one_token_step_compiles_once():
    c = case("rope")
    traces = []

    @jax.jit
    def step(params, cache, token):
        traces.append(1)
        return c.decode(params, cache, token)

    y, cache = c.step(c.params, c.cache, c.x[:, :WIDTH], jnp.array([4, 4]))  # prefill
    outs = [y[:, :4]]
    for t in range(4, T):
        y, cache = step(c.params, cache, c.x[:, t : t + 1])
        outs.append(y)
    assert len(traces) == 1
    np.testing.assert_allclose(
        jnp.concatenate(outs, 1), c.full(c.params, c.x), atol=1e-5, rtol=1e-5
    )
    step(c.params, c.cache, c.x[:, :2])  # positive control: a new chunk length traces again
    assert len(traces) == 2


def test_dropout_in_decode_mode_follows_deterministic():
    c = case("gqa")
    layer = CausalSelfAttention(AttentionConfig(D, N, dropout=0.5, **CONFIGS["gqa"]))

    @jax.jit
    def train_step(params, cache, chunk, rng):  # deterministic=False: dropout on
        y, _ = layer.apply(
            {"params": params, "cache": cache}, chunk, decode=True, mutable=["cache"],
            rngs={"dropout": rng},
        )  # fmt: skip
        return y

    chunk, lengths = c.x[:, :WIDTH], jnp.array([WIDTH, WIDTH])
    plain, _ = c.step(c.params, c.cache, chunk, lengths)  # deterministic=True
    a = train_step(c.params, c.cache, chunk, jax.random.key(3))
    b = train_step(c.params, c.cache, chunk, jax.random.key(4))
    assert np.abs(a - plain).max() > 1e-2 and np.abs(a - b).max() > 1e-2
    np.testing.assert_array_equal(a, train_step(c.params, c.cache, chunk, jax.random.key(3)))


def test_a_write_past_the_capacity_raises_when_the_position_is_concrete():
    c = case("gqa", capacity=6)
    cache = prefilled(c, [4, 5])
    with pytest.raises(
        ValueError,
        match=r"^the KV cache is full: capacity 6, row 0 is at position 4 and a chunk of "
        r"length 3 brings 3 real tokens; create the cache with a longer input",
    ):
        c.decode(c.params, cache, c.x[:, :3])
    with pytest.raises(
        ValueError, match="capacity 6, row 1 is at position 5 and a chunk of length 2"
    ):
        c.decode(c.params, cache, c.x[:, :2], jnp.array([2, 2]))
    with pytest.raises(
        ValueError, match=r"capacity 13, row 0 is at position 0 and a chunk of length 14"
    ):
        c.decode(c.params, case("gqa").cache, jnp.ones((B, 14, D)))
    # Exactly full is fine (the same check, without running the layer eagerly).
    full = FullCache()
    assert not full.broken_rows(np.array([4, 5]), np.array([2, 1]), 2, 6).any()


def test_a_write_past_the_capacity_under_jit_gives_nan_in_that_row_only():
    c = case("gqa", capacity=6)
    cache = prefilled(c, [4, 5])
    y, after = c.step(c.params, cache, c.x[:, 4:9], jnp.array([2, 2]))  # row 1 overflows
    assert np.isnan(y[1]).all()
    np.testing.assert_allclose(y[0, :2], c.full(c.params, c.x)[0, 4:6], atol=1e-5, rtol=1e-5)
    np.testing.assert_array_equal(y[0, 2:], 0)
    np.testing.assert_array_equal(after["position"], [6, -1])  # row 1 is poisoned
    y, _ = c.step(c.params, after, c.x[:, 6:11], jnp.array([0, 1]))  # and stays so
    assert np.isnan(y[1]).all() and (np.asarray(y[0]) == 0).all()


@each_backend()
@pytest.mark.parametrize("garbage", [np.nan, np.inf, -np.inf, 1e30])
def test_unused_cache_slots_never_change_the_outputs(implementation, garbage):
    c = case_on(implementation)
    cache = prefilled(c, [3, 5])
    chunk, lengths = c.x[:, 5:10], jnp.array([2, 3])
    clean, _ = c.step(c.params, cache, chunk, lengths)
    unused = np.arange(CAP)[None, :] >= np.asarray(cache["position"])[:, None]  # (B, S)
    dirty = {
        name: jnp.where(slot_mask(unused, cache[name]), garbage, cache[name]).astype(
            cache[name].dtype
        )
        for name in kv_names(cache)
    }
    got, _ = c.step(c.params, {**cache, **dirty}, chunk, lengths)
    np.testing.assert_array_equal(got, clean)


def test_decode_argument_errors():
    c = case("gqa")
    chunk = c.x[:, :3]
    in_range = r"lengths must be in \[0, 3\] \(the chunk length\), got lengths"
    cases = [
        ([1, 4], ValueError, in_range + r"\[1\]=4"),
        ([-1, 1], ValueError, in_range + r"\[0\]=-1"),
        ([1, 2, 3], ValueError, r"lengths must have shape \(B,\) = \(2,\), got \(3,\)"),
        ([1.0, 2.0], TypeError, "lengths must be an integer array"),
    ]
    for lengths, error, message in cases:
        with pytest.raises(error, match=message):
            c.decode(c.params, c.cache, chunk, jnp.array(lengths))
    for name in ("positions", "segment_ids"):
        with pytest.raises(ValueError, match=f"^{name} is not supported with decode=True"):
            c.layer.apply(
                {"params": c.params, "cache": c.cache},
                chunk,
                True,
                decode=True,
                mutable=["cache"],
                **{name: jnp.zeros((B, 3), jnp.int32)},
            )
    with pytest.raises(ValueError, match=r"^lengths only applies with decode=True"):
        c.layer.apply({"params": c.params}, chunk, True, lengths=jnp.array([3, 3]))
    with pytest.raises(
        ValueError, match=r"x must have shape \(B, T, D\) = \(2, \*, 48\), got \(1, 3, 48\)"
    ):
        c.decode(c.params, c.cache, chunk[:1])


# Every misuse of decoding, eager and under jit. A misuse that jit cannot check (the
# values of lengths and positions) raises eagerly and poisons the rows it concerns
# under jit: their outputs are NaN in this call and in every later one; the other
# rows are untouched. The rest (shapes, dtypes, a missing cache) raise either way.
# (id, position per row before the call, chunk width, lengths, eager error, bad rows)
TRACED_MISUSE = [
    ("lengths-negative", [2, 3], 4, [-1, 2], r"lengths must be in \[0, 4\].*lengths\[0\]=-1", [0]),
    ("lengths-past-chunk", [2, 3], 4, [2, 7], r"lengths must be in \[0, 4\].*lengths\[1\]=7", [1]),
    ("overflow", [2, 11], 4, [2, 3], r"the KV cache is full: capacity 13, row 1 is at", [1]),
    ("both", [12, 3], 4, [-2, 2], r"lengths must be in \[0, 4\]", [0]),
]  # fmt: skip


@pytest.mark.parametrize(
    "name, position, width, lengths, message, bad", TRACED_MISUSE, ids=[m[0] for m in TRACED_MISUSE]
)
def test_decode_misuse_raises_eagerly_and_poisons_its_rows_under_jit(
    name, position, width, lengths, message, bad
):
    c = case("gqa")
    cache = {**c.cache, "position": jnp.asarray(position, jnp.int32)}
    chunk, lengths = c.x[:, :width], jnp.asarray(lengths)
    with pytest.raises(ValueError, match=message):
        c.decode(c.params, cache, chunk, lengths)
    y, after = c.step(c.params, cache, chunk, lengths)
    good = [b for b in range(B) if b not in bad]
    assert np.isnan(np.asarray(y)[bad]).all()
    assert np.isfinite(np.asarray(y)[good]).all()
    # A poisoned row stays poisoned: the next (valid) call of it is NaN too.
    y, _ = c.step(c.params, after, c.x[:, :1], jnp.ones(B, jnp.int32))
    assert np.isnan(np.asarray(y)[bad]).all()
    for b in good:  # the others decode on as if nothing happened
        assert np.isfinite(np.asarray(y)[b]).all()


def _apply(c, variables, chunk, **kwargs):
    return c.layer.apply(variables, chunk, True, decode=True, mutable=["cache"], **kwargs)


# (id, call(c) -> anything, error, message): raised eagerly and under jit alike.
STATIC_MISUSE = [
    ("no-cache", lambda c, x: _apply(c, {"params": c.params}, x), ValueError,
     r"^decode=True needs a cache: create one with variables = layer.init\(key, "
     r"jnp.zeros\(\(B, max_len, D\)\), decode=True\)"),
    ("lengths-shape", lambda c, x: c.decode(c.params, c.cache, x, jnp.array([1, 2, 3])),
     ValueError, r"lengths must have shape \(B,\) = \(2,\), got \(3,\)"),
    ("lengths-dtype", lambda c, x: c.decode(c.params, c.cache, x, jnp.array([1.0, 2.0])),
     TypeError, "lengths must be an integer array"),
    ("batch", lambda c, x: c.decode(c.params, c.cache, x[:1]), ValueError,
     r"x must have shape \(B, T, D\) = \(2, \*, 48\), got \(1, 3, 48\)"),
    ("width", lambda c, x: c.decode(c.params, c.cache, x[..., :40]), ValueError,
     r"x must have shape \(B, T, D\) = \(\*, \*, 48\), got \(2, 3, 40\)"),
    ("positions", lambda c, x: _apply(c, {"params": c.params, "cache": c.cache}, x,
     positions=jnp.zeros((B, 3), jnp.int32)), ValueError,
     "^positions is not supported with decode=True"),
]  # fmt: skip


@pytest.mark.parametrize("jitted", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize(
    "name, call, error, message", STATIC_MISUSE, ids=[m[0] for m in STATIC_MISUSE]
)
def test_decode_misuse_that_jit_can_check_raises_either_way(name, call, error, message, jitted):
    c = case("gqa")
    run = jax.jit(lambda x: call(c, x)) if jitted else (lambda x: call(c, x))
    with pytest.raises(error, match=message):
        run(c.x[:, :3])


def test_nnx_decode_without_a_cache_raises_how_to_make_one():
    from flax import nnx

    from nanoattn import nnx as nanoattn_nnx

    layer = nanoattn_nnx.CausalSelfAttention(AttentionConfig(D, N, n_kv_heads=K), rngs=nnx.Rngs(0))
    x = jnp.ones((B, 3, D))
    eager = functools.partial(layer, x, decode=True)
    jitted = functools.partial(nnx.jit(lambda layer, x: layer(x, decode=True)), layer, x)
    for call in (eager, jitted):
        with pytest.raises(ValueError, match=r"^decode=True needs a cache: call "
                           r"module.init_cache\(batch, max_len\) first"):  # fmt: skip
            call()


@pytest.mark.parametrize("name", ["gqa", "bfloat16"])
def test_a_combined_cache_decodes_as_two_arrays_do(name, monkeypatch):
    """The layer's cache as one combined array (B, S, 2, K, H), as it is kept where a
    token's keys and values take 2-4 KiB (forced here at small sizes): ragged chunks,
    then a rewind and more, give exactly the outputs and the halves of two arrays."""
    c = case(name)
    monkeypatch.setattr(kv_cache, "COMBINED_BYTES", (0, 4096))
    init = jax.jit(lambda key: c.layer.init(key, jnp.zeros((B, CAP, D), c.x.dtype), decode=True))
    combined = copy.copy(c)
    combined.cache = init(jax.random.key(0))["cache"]
    two = halves(c.cache)["key"].shape  # (B, CAP, K, H)
    assert combined.cache["key"].shape == (*two[:2], 2, *two[2:])
    assert combined.cache["value"].size == 0 and c.cache["key"].shape == two
    results = [run_ragged(x, [[3, 1, 5, 2], [4, 4, 1]]) for x in (c, combined)]
    for got, want in zip(results[1][0], results[0][0]):
        np.testing.assert_array_equal(got, want)
    for name_, half in halves(results[1][1]).items():
        np.testing.assert_array_equal(half, halves(results[0][1])[name_])
