"""The cache policy (nanoattn/_layers/caches/policy.py): each kind of KV cache answers
the protocol's questions, asked directly on small cases with literal answers.

Every test runs over KINDS, one entry per kind with its literal answers, so a new kind
(a paged cache) is one more entry. Sizes: B 2 rows, C 8 slots, a window of W 3 keys
before the query, S0 2 sink tokens, chunks of L 4; the rolling ring has C - S0 = 6
slots. The last test plugs a third kind, written here, into the decoding step of the
layer: decode asks the policy and has no branch on the kind.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _caches import halves

import nanoattn
from nanoattn._layers import positional, steps
from nanoattn._layers.caches import kinds, kv_cache
from nanoattn._layers.caches.full import FullCache
from nanoattn._layers.caches.policy import CachePolicy, positions
from nanoattn._layers.caches.rolling import RollingCache
from nanoattn._layers.linen import attention as linen_attention
from nanoattn.linen import AttentionConfig, CausalSelfAttention

from _layer_configs import random_params
from _reference import randn

C, W, S0, L = 8, 3, 2, 4
HINT = "HINT"

# (position, lengths) of one row each, for a chunk of L = 4 tokens.
ROWS = [(0, 4), (5, 3), (6, 3), (2, -1), (2, 5), (-1, 1), (100, 0), (0, 0)]
# The shared parts of the validity rule: the same row refused by every kind.
SHARED = {
    3: r"^lengths must be in \[0, 4\] \(the chunk length\), got lengths\[0\]=-1$",
    4: r"^lengths must be in \[0, 4\] \(the chunk length\), got lengths\[0\]=5$",
    5: r"^row 0 of the KV cache is poisoned \(position -1\) by an invalid call or rewind "
    r"under jit; reset it \(position and last 0\)$",
}
FULL_FIT = {  # the full cache's own rule: past the capacity
    2: r"^the KV cache is full: capacity 8, row 0 is at position 6 and a chunk of length 4 "
    r"brings 3 real tokens; HINT$",
    6: r"^the KV cache is full: capacity 8, row 0 is at position 100 and a chunk of length 4 "
    r"brings 0 real tokens; HINT$",
}
ROLLING_FIT = {  # the rolling cache's own rule: past the chunk limit C - W - S0 = 3
    0: r"^a rolling KV cache of 8 slots takes at most 3 tokens per call \(capacity - window - "
    r"sink_tokens\), row 0 brings 4: they would overwrite keys still in view; split the "
    r"chunk or HINT$",
}

# Writing: rows start at positions 1 and 7, a chunk of 3 tokens of which 2 and 3 are
# real; token t of row b carries the value 10 b + t + 1.
WRITE_START, WRITE_LENGTHS = [1, 7], [2, 3]


@dataclasses.dataclass(frozen=True)
class Kind:
    """A policy and its literal answers."""

    policy: CachePolicy
    wraps: bool
    least_capacity: int
    capacity_error: str | None  # the message of check_capacity(least_capacity - 1)
    chunk_limit: int | None  # at C slots
    refuses: dict  # rows of ROWS the kind's own rule refuses: their messages
    slots: list  # slots(WRITE_START, 3, C)
    written: list  # (B, C): the values in each slot after the write
    read_start: list  # (B,): the queries' first positions, a chunk of 2 each
    held: list  # (B, C): the position each slot holds after read_start + 2 (-1: none)
    reads: list  # (B, 2): the slots each query reads


FULL_WRITTEN = [[0, 1, 2, 0, 0, 0, 0, 0], [0, 0, 0, 0, 0, 0, 0, 11]]  # 8, 9: past C
FULL_HELD = [[0, 1, 2, 3, 4, 5, 6, -1], [0, 1, 2, -1, -1, -1, -1, -1]]  # ends 7 and 3
KINDS = {
    "full": Kind(
        FullCache(window=(W, 0)),
        wraps=False,
        least_capacity=0,
        capacity_error=None,
        chunk_limit=None,
        refuses=FULL_FIT,
        slots=[[1, 2, 3], [7, 8, 9]],
        written=FULL_WRITTEN,
        read_start=[5, 1],
        held=FULL_HELD,
        reads=[[{2, 3, 4, 5}, {3, 4, 5, 6}], [{0, 1}, {0, 1, 2}]],  # positions p - 3 .. p
    ),
    "full_sinks": Kind(
        FullCache(window=(W, 0), sink_tokens=S0),
        wraps=False,
        least_capacity=0,
        capacity_error=None,
        chunk_limit=None,
        refuses=FULL_FIT,
        slots=[[1, 2, 3], [7, 8, 9]],
        written=FULL_WRITTEN,
        read_start=[5, 1],
        held=FULL_HELD,
        reads=[[{0, 1, 2, 3, 4, 5}, {0, 1, 3, 4, 5, 6}], [{0, 1}, {0, 1, 2}]],  # and 0, 1
    ),
    "rolling": Kind(
        RollingCache(W, sink_tokens=S0),
        wraps=True,
        least_capacity=6,
        capacity_error=r"^a rolling KV cache needs at least window \+ 1 \+ sink_tokens = 3 \+ 1 "
        r"\+ 2 = 6 slots, got 5; HINT$",
        chunk_limit=3,
        refuses=ROLLING_FIT,
        slots=[[1, 2, 3], [7, 2, 3]],  # positions 8, 9 wrap to slots 2, 3
        written=[[0, 1, 2, 0, 0, 0, 0, 0], [0, 0, 12, 13, 0, 0, 0, 11]],
        read_start=[11, 1],  # row 0 has wrapped: positions 8 .. 12 in slots 2 .. 6
        held=[[0, 1, 8, 9, 10, 11, 12, 7], [0, 1, 2, -1, -1, -1, -1, -1]],
        reads=[[{0, 1, 2, 3, 4, 5}, {0, 1, 3, 4, 5, 6}], [{0, 1}, {0, 1, 2}]],
    ),
}
NAMES = list(KINDS)


def kind_param(test):
    return pytest.mark.parametrize("name", NAMES)(test)


@kind_param
def test_capacity(name):
    kind = KINDS[name]
    policy = kind.policy
    assert (policy.wraps, policy.least_capacity) == (kind.wraps, kind.least_capacity)
    policy.check_capacity(kind.least_capacity, HINT)  # the fewest slots work
    if kind.capacity_error is None:
        policy.check_capacity(0, HINT)
    else:
        with pytest.raises(ValueError, match=kind.capacity_error):
            policy.check_capacity(kind.least_capacity - 1, HINT)
    cache = policy.empty(2, C, 1, 3, jnp.float32)  # 24 bytes a token: two arrays
    assert policy.capacity(cache) == C and cache.key.shape == cache.value.shape == (2, C, 1, 3)
    combined = policy.empty(2, C, 1, 512, jnp.float32)  # 4 KiB a token: one combined array
    assert policy.capacity(combined) == C and combined.key.shape == (2, C, 2, 1, 512)
    assert (cache.position == 0).all() and (cache.last == 0).all()


@kind_param
def test_chunk_limit(name):
    assert KINDS[name].policy.chunk_limit(C) == KINDS[name].chunk_limit


def _rows(indices):
    position = np.array([ROWS[i][0] for i in indices], np.int32)
    lengths = np.array([ROWS[i][1] for i in indices], np.int32)
    return position, lengths


@kind_param
def test_each_broken_row_raises_its_message_when_concrete(name):
    kind = KINDS[name]
    refused = SHARED | kind.refuses
    for i in range(len(ROWS)):
        position, lengths = _rows([i])
        if i in refused:
            with pytest.raises(ValueError, match=refused[i]):
                kind.policy.broken_rows(position, lengths, L, C, HINT)
        else:
            assert not kind.policy.broken_rows(position, lengths, L, C, HINT).any(), ROWS[i]


@kind_param
def test_the_traced_rule_refuses_exactly_the_rows_that_raise(name):
    kind = KINDS[name]
    refused = SHARED | kind.refuses
    position, lengths = _rows(range(len(ROWS)))
    rule = jax.jit(functools.partial(kind.policy.broken_rows, chunk=L, capacity=C, hint=HINT))
    bad = np.asarray(rule(position, lengths))
    raises = []
    for i in range(len(ROWS)):  # the same rows, one at a time, concrete
        try:
            kind.policy.broken_rows(*_rows([i]), L, C, HINT)
            raises.append(False)
        except ValueError:
            raises.append(True)
    assert bad.tolist() == raises == [i in refused for i in range(len(ROWS))]


@kind_param
def test_a_concrete_batch_raises_the_first_row_of_the_first_part_it_can_check(name):
    policy = KINDS[name].policy
    position, lengths = _rows(range(len(ROWS)))
    with pytest.raises(ValueError, match=r"got lengths\[3\]=-1$"):  # lengths come first
        policy.broken_rows(position, lengths, L, C, HINT)
    # Under jit each part raises when its own inputs are concrete (lengths, or position).
    with pytest.raises(ValueError, match=r"^lengths must be in \[0, 4\].*got lengths\[3\]=-1"):
        jax.jit(lambda p: policy.broken_rows(p, lengths, L, C, HINT))(position)
    with pytest.raises(ValueError, match=r"^row 5 of the KV cache is poisoned \(position -1\)"):
        jax.jit(lambda n: policy.broken_rows(position, n, L, C, HINT))(lengths)


def _cache(position, last):
    cache = KINDS["full"].policy.empty(len(position), C, 1, 1, jnp.float32)
    return cache._replace(position=jnp.asarray(position, jnp.int32), last=jnp.asarray(last))


@kind_param
def test_poison_marks_the_row_minus_one_and_the_rule_refuses_it(name):
    policy = KINDS[name].policy
    poisoned = policy.poison(_cache([3, 5], [2, 1]), jnp.array([False, True]))
    assert poisoned.position.tolist() == [3, kv_cache.POISONED] == [3, -1]
    assert poisoned.last.tolist() == [2, 0]
    lengths = np.array([1, 1], np.int32)
    rule = jax.jit(functools.partial(policy.broken_rows, chunk=L, capacity=C))
    assert np.asarray(rule(poisoned.position, lengths)).tolist() == [False, True]
    with pytest.raises(ValueError, match=r"^row 1 of the KV cache is poisoned \(position -1\)"):
        policy.broken_rows(poisoned.position, lengths, L, C)


@kind_param
def test_slots_and_write(name):
    kind = KINDS[name]
    start = jnp.array(WRITE_START, jnp.int32)
    assert np.asarray(kind.policy.slots(start, 3, C)).tolist() == kind.slots
    new = (10 * jnp.arange(2)[:, None] + jnp.arange(3)[None, :] + 1.0)[..., None, None]
    cache = kind.policy.empty(2, C, 1, 1, jnp.float32)
    written = halves(kind.policy.write(cache, new, -new, start, jnp.array(WRITE_LENGTHS)))
    assert np.asarray(written["key"][..., 0, 0]).tolist() == kind.written
    assert np.asarray(-written["value"][..., 0, 0]).tolist() == kind.written
    assert (
        kind.policy.write(cache, new, -new, start, jnp.array(WRITE_LENGTHS)).position
        == cache.position
    ).all()  # the positions are decode's


def _weights(policy, kind, mask_fn=None, score_fn=None):
    """(B, 2, C): the weights of a chunk of 2 queries at ``kind.read_start`` over the
    slots, with every logit 0 but what ``score_fn`` adds, through the core's rules."""
    start = jnp.array(kind.read_start, jnp.int32)
    rules = policy.read_rules(start + 2, C, mask_fn=mask_fn, score_fn=score_fn)
    q, k = jnp.zeros((2, 2, 1, 1)), jnp.zeros((2, C, 1, 1))  # (B, T, N, H), (B, S, K, H)
    return np.asarray(nanoattn.attention_weights(q, k, q_offset=start, **rules))[:, 0]


def _read(weights):
    return [[set(np.flatnonzero(w).tolist()) for w in row] for row in weights]


@kind_param
def test_each_query_reads_exactly_the_slots_it_may_see(name):
    kind = KINDS[name]
    assert _read(_weights(kind.policy, kind)) == kind.reads


@kind_param
def test_mask_fn_and_score_fn_see_the_position_a_slot_holds(name):
    kind = KINDS[name]
    held = np.array(kind.held)

    def not_one_mod_4(b, n, q_pos, k_pos):  # slot and position differ mod 4 in the ring
        return k_pos % 4 != 1

    got = _read(_weights(kind.policy, kind, mask_fn=not_one_mod_4))
    want = [
        [{s for s in q if held[b, s] % 4 != 1} for q in row] for b, row in enumerate(kind.reads)
    ]
    assert got == want

    def by_position(score, b, n, q_pos, k_pos):
        return score + k_pos.astype(score.dtype)

    weights = _weights(kind.policy, kind, score_fn=by_position)  # softmax of the positions
    for b, row in enumerate(kind.reads):
        for t, slots in enumerate(row):
            s = sorted(slots)
            want = np.exp(held[b, s] - held[b, s].max())
            np.testing.assert_allclose(weights[b, t, s], want / want.sum(), rtol=1e-6)


@kind_param
def test_rewind(name):
    policy = KINDS[name].policy
    cache = _cache([5, 3], [3, 1])
    back = policy.rewind(cache, jnp.array([2, 1]))
    assert (back.position.tolist(), back.last.tolist()) == ([3, 2], [1, 0])
    message = r"^rewind: n\[0\]=4 is outside \[0, 3\], the tokens row 0 took in its last call$"
    with pytest.raises(ValueError, match=message):
        policy.rewind(cache, jnp.array([4, 0]))
    bad = jax.jit(policy.rewind)(cache, jnp.array([4, 0]))  # poisoned, as a broken call
    assert (bad.position.tolist(), bad.last.tolist()) == ([-1, 3], [0, 1])
    again = jax.jit(policy.rewind)(bad, jnp.array([0, 0]))  # and stays so
    assert again.position.tolist() == [-1, 3]
    marked = jax.jit(policy.rewind)(_cache([-1, 3], [2, 1]), jnp.array([1, 0]))
    assert (marked.position.tolist(), marked.last.tolist()) == ([-1, 3], [0, 1])  # one marker


def test_policy_of_a_config():
    assert kinds.policy_of(AttentionConfig(16, 2)) == FullCache()
    windowed = AttentionConfig(16, 2, window=(W, 0), sink_tokens=S0)
    assert kinds.policy_of(windowed) == FullCache((W, 0), S0)
    rolling = AttentionConfig(16, 2, window=(W, 0), sink_tokens=S0, rolling_cache=True)
    assert kinds.policy_of(rolling) == RollingCache(W, S0)
    assert kinds.policy_of(None) == FullCache()  # a module without a config


# A third kind, written against the protocol alone: position j in slot C - 1 - j (a
# full cache filled backwards). Plugged into the layer, it decodes as the full cache.


@dataclasses.dataclass(frozen=True)
class BackwardCache(FullCache):
    def slots(self, start, chunk, capacity):
        return capacity - 1 - positions(start, chunk)

    def read_rules(self, end, capacity, *, mask_fn, score_fn):
        slot = jnp.arange(capacity)[None, :]  # (1, S)
        held = jnp.where(capacity - 1 - slot < end[:, None], capacity - 1 - slot, -1)  # (B, S)

        def written_and_causal(b, n, q_pos, k):
            return (held[b, k] >= 0) & (held[b, k] <= q_pos)

        return dict(
            mask_fn=positional.and_masks(
                written_and_causal, positional.at_positions(mask_fn, held, False)
            ),
            score_fn=positional.at_positions(score_fn, held, True),
        )


def test_a_third_kind_decodes_through_the_same_step(monkeypatch):
    B, T, D = 2, 7, 16
    layer = CausalSelfAttention(AttentionConfig(D, 2))
    x = jnp.asarray(randn(0, B, T, D))
    variables = layer.init(jax.random.key(0), jnp.zeros((B, C, D)), decode=True)
    params = {"params": random_params(variables["params"], 3)}

    def alibi(score, b, n, q_pos, k_pos):
        return score - 0.3 * (q_pos - k_pos)

    full = layer.apply(params, x, True, score_fn=alibi)

    def decode(cache):
        outs = []
        for lo, hi in ((0, 3), (3, 4), (4, 6), (6, 7)):
            y, state = layer.apply(
                {**params, "cache": cache}, x[:, lo:hi], True, decode=True, score_fn=alibi,
                mutable=["cache"],
            )  # fmt: skip
            outs.append(y)
            cache = state["cache"]
        return jnp.concatenate(outs, axis=1), cache

    forward, filled = decode(variables["cache"])
    for module in (steps, linen_attention):
        monkeypatch.setattr(module, "policy_of", lambda config: BackwardCache())
    backward, reversed_cache = decode(variables["cache"])
    np.testing.assert_allclose(forward, full, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(backward, full, atol=1e-5, rtol=1e-5)
    key = np.asarray(reversed_cache["key"])
    np.testing.assert_array_equal(key[:, ::-1][:, :T], np.asarray(filled["key"])[:, :T])
