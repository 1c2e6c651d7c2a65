"""paged_attention with ``shared_prefixes`` (cascade attention, nanoattn/_core/cascade.py):
each group's shared pages read once for all of its queries, the rest per sequence,
merged by log-sum-exp, equals the call without sharing (float32 rounding) and the
float64 reference of each sequence alone, on every backend that serves the call.

One layout holds every shape of group: a group of three (one a 4-token chunk), a group
whose rows outnumber its shared keys (its pass cut into pieces) with a member whose
whole table is shared and that brings no query, a group of one, a sequence in no group,
padding rows; pages shuffled in the pool, NaN in every slot no sequence reads. Each
jitted program runs twice: with the groups, and with none (the plain branch of its
``lax.cond``), so one compile gives both calls. Then sinks (added once), soft-cap,
values of their own width, quantized pages, GQA throughout, a window that cannot cut
the shared keys (served) and ones that can, and mask_fn (the plain call, bit for bit),
a token tree, gradients; bad groups: one line when concrete, NaN rows under jit.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import nanoattn
from nanoattn._backends import registry

from _backends import require_paged
from _reference import np_attention, np_lse, randn

N, K, H, PS = 6, 2, 8, 3  # GQA: G = 3; pages of 3 tokens
SHARED = np.array([3, 1, 0, 3, 2, 3, 1], np.int32)  # pages each sequence shares


class Layout:
    """Seven sequences in a shuffled pool of pages of 3 (M = 6 entries, S = 18), the
    groups' rows interleaved (the group pass gathers them):

    * 0, 3, 5 share pages A (9 keys): lengths 11, 15, 11; q_len 1, 4 (a chunk), 2;
    * 1, 6 share page B (3 keys): 1 holds 7 with q_len 4 (rows > shared keys: two
      pieces), 6 holds only B and brings no query (its whole table is shared);
    * 4 alone shares its 2 pages (a group of one): length 8, q_len 1;
    * 2 shares nothing: length 4, q_len 2; then 2 padding rows.
    """

    lengths = np.array([11, 7, 4, 15, 8, 11, 3], np.int32)
    q_lens = np.array([1, 4, 2, 4, 1, 2, 0], np.int32)

    def __init__(self, seed=0, value_width=H):
        rng = np.random.default_rng(seed)
        P = 18
        ids = [int(p) for p in rng.permutation(P)]
        a, b, c, rest = ids[:3], ids[3:4], ids[4:6], iter(ids[6:])
        own = [[next(rest) for _ in range(n)] for n in (1, 2, 2, 2, 1, 1, 0)]
        heads = (a, b, [], a, c, a, b)  # each sequence's shared pages, then its own
        rows = [head + mine for head, mine in zip(heads, own)]
        self.table = np.full((7, 6), 13, np.int32)  # entries past the held: never read
        for s, pages in enumerate(rows):
            self.table[s, : len(pages)] = pages
        self.starts = np.concatenate([[0], np.cumsum(self.q_lens)]).astype(np.int32)
        Tq = int(self.starts[-1]) + 2
        self.q = randn(seed + 1, Tq, N, H)
        self.kp = randn(seed + 2, P, PS, K, H)
        self.vp = randn(seed + 3, P, PS, K, value_width)
        read = np.zeros((P, PS), bool)
        for s, n in enumerate(self.lengths):
            for j in range(n):
                read[self.table[s, j // PS], j % PS] = True
        self.kp[~read], self.vp[~read] = np.nan, np.inf  # stale content nobody reads
        self.d_out = randn(seed + 4, Tq, N, value_width)

    def arrays(self):
        return tuple(jnp.asarray(x) for x in (self.q, self.kp, self.vp, self.table,
                                              self.lengths, self.starts))  # fmt: skip

    def reference(self, kp, vp, causal=True, cap=None, sinks=None, window=None):
        """(out, lse) in float64 of each sequence alone: zeros and -inf elsewhere."""
        Tq, Hv = self.q.shape[0], vp.shape[-1]
        out, lse = np.zeros((Tq, N, Hv)), np.full((Tq, N), -np.inf)
        for s, (n, q_len) in enumerate(zip(self.lengths, self.q_lens)):
            if q_len == 0:
                continue
            pages = self.table[s, : -(-n // PS)]
            k = kp[pages].reshape(-1, K, H)[:n][None]
            v = vp[pages].reshape(-1, K, Hv)[:n][None]
            rows = slice(self.starts[s], self.starts[s + 1])
            p, j = (n - q_len + np.arange(q_len))[:, None], np.arange(n)[None]
            allowed = (j <= p) if causal else np.ones((q_len, n), bool)
            if window is not None:
                allowed &= (j >= p - window[0]) & (j <= p + window[1])
            out[rows] = np_attention(self.q[rows][None], k, v, allowed, soft_cap=cap,
                                     sinks=sinks)[0]  # fmt: skip
            lse[rows] = np_lse(self.q[rows][None], k, allowed, soft_cap=cap, sinks=sinks)[0]
        if sinks is not None:
            lse[self.starts[-1] :] = sinks
        return out, lse


LAYOUT = Layout()


@functools.cache
def _program(implementation: str, rules_key: tuple, gradients: bool):
    """The cascade call jitted once (``shared`` an argument: zeros take the plain
    branch), returning (out, lse) and, with ``gradients``, the VJP's cotangents of the
    query, the pages and the sinks."""
    rules = dict(rules_key)

    def call(q, kp, vp, table, lengths, starts, shared, extra):
        return nanoattn.paged_attention(
            q, kp, vp, table, lengths, starts, return_residual=True, shared_prefixes=shared,
            implementation=implementation, **rules, **extra,
        )  # fmt: skip

    @jax.jit
    def run(q, kp, vp, table, lengths, starts, shared, extra, d_out):
        if not gradients:
            return call(q, kp, vp, table, lengths, starts, shared, extra), None
        result, vjp = jax.vjp(
            lambda q, kp, vp, extra: call(q, kp, vp, table, lengths, starts, shared, extra),
            q, kp, vp, extra,
        )  # fmt: skip
        return result, vjp((d_out, jnp.zeros_like(result[1])))

    return run


def _both(implementation, layout, rules=None, extra=None, gradients=False):
    """The call with the groups and without (one program), after skipping a backend
    that refuses the call."""
    rules, extra = rules or {}, extra or {}
    arrays = layout.arrays()
    if extra.get("key_scales") is not None:  # quantized: the stored pages
        arrays = (arrays[0], extra.pop("key_pages"), extra.pop("value_pages"), *arrays[3:])
    require_paged(implementation, *arrays, **rules, **extra)
    run = _program(implementation, tuple(sorted(rules.items())), gradients)
    d_out = jnp.asarray(layout.d_out)
    shared = run(*arrays, jnp.asarray(SHARED), extra, d_out)
    plain = run(*arrays, jnp.zeros_like(jnp.asarray(SHARED)), extra, d_out)
    return shared, plain


def _close(got, want, atol=2e-5, what=""):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert (np.isinf(got) == np.isinf(want)).all(), what
    finite = np.isfinite(want)
    np.testing.assert_allclose(got[finite], want[finite], atol=atol, rtol=atol, err_msg=what)


@pytest.mark.parametrize("implementation", registry.names())
def test_shared_prefixes_equal_the_unshared_call_with_sinks_and_gradients(implementation):
    """Every group shape at once, sinks (added once), GQA; outputs, log-sum-exp and the
    gradients of the query, the pages and the sinks: the cascade's equal the plain
    call's, and the outputs the float64 reference's."""
    sinks = jnp.asarray(randn(9, N))
    (shared, grads), (plain, plain_grads) = _both(
        implementation, LAYOUT, extra=dict(sinks=sinks), gradients=True
    )
    want = LAYOUT.reference(LAYOUT.kp, LAYOUT.vp, sinks=np.asarray(sinks, np.float64))
    for got, plain_part, ref, name in zip(shared, plain, want, ("out", "lse")):
        _close(got, plain_part, what=f"{implementation} {name} against the plain call")
        _close(got, ref, atol=5e-5, what=f"{implementation} {name} against float64")
    for name, got, base in zip(("dq", "dk", "dv", "sinks"), grads, plain_grads):
        got, base = jax.tree.leaves(got), jax.tree.leaves(base)
        for g, b in zip(got, base):
            readable = np.isfinite(np.asarray(b))  # dk, dv of pages nobody reads: 0
            g, b = np.asarray(g)[readable], np.asarray(b)[readable]
            what = f"{implementation} {name}"
            np.testing.assert_allclose(g, b, atol=1e-4, rtol=1e-4, err_msg=what)


@pytest.mark.parametrize("implementation", registry.names())
def test_soft_cap_and_values_of_their_own_width(implementation):
    layout = Layout(seed=5, value_width=5)
    shared, plain = _both(implementation, layout, rules=dict(logit_soft_cap=1.5))
    shared, plain = shared[0], plain[0]
    want = layout.reference(layout.kp, layout.vp, cap=1.5)
    assert shared[0].shape == (layout.q.shape[0], N, 5)
    for got, plain_part, ref in zip(shared, plain, want):
        _close(got, plain_part, what=implementation)
        _close(got, ref, atol=5e-5, what=implementation)


@pytest.mark.parametrize("implementation", registry.names())
def test_quantized_pages(implementation):
    (kq, ks), (vq, vs) = (nanoattn.quantize_kv(jnp.asarray(x), "int8")
                          for x in (LAYOUT.kp, LAYOUT.vp))  # fmt: skip
    extra = dict(key_pages=kq, value_pages=vq, key_scales=ks, value_scales=vs)
    (shared, _), (plain, _) = _both(implementation, LAYOUT, extra=extra)
    kp, vp = (np.asarray(nanoattn.dequantize_kv(x, s), np.float64) for x, s in ((kq, ks), (vq, vs)))
    want = LAYOUT.reference(kp, vp)
    for got, plain_part, ref in zip(shared, plain, want):
        _close(got, plain_part, what=implementation)
        _close(got, ref, atol=5e-5, what=implementation)


def test_a_window_that_cannot_cut_the_shared_keys_and_bidirectional_rows():
    """window=(S - 1, 0) never hides a shared key: served (the window kept in each
    sequence's rest); is_causal=False too."""
    for rules, reference in ((dict(window=(17, 0)), dict(window=(17, 0))),
                             (dict(is_causal=False), dict(causal=False))):  # fmt: skip
        (shared, _), (plain, _) = _both("xla", LAYOUT, rules=rules)
        want = LAYOUT.reference(LAYOUT.kp, LAYOUT.vp, **reference)
        for got, plain_part, ref in zip(shared, plain, want):
            _close(got, plain_part, what=str(rules))
            _close(got, ref, atol=5e-5, what=str(rules))


@pytest.mark.parametrize(
    "rules",
    [dict(window=(4, 0)), dict(window=(16, 2)), dict(mask_fn=lambda b, n, q, k: (q + k) % 5 != 1)],
    ids=["window", "window one short", "mask_fn"],
)
def test_rules_that_make_sharing_unsound_get_the_plain_call(rules):
    """A window whose left side could cut the shared keys, and mask_fn (it sees the
    sequence and positions): the plain call, bit for bit."""
    arrays = LAYOUT.arrays()
    plain = nanoattn.paged_attention(*arrays, implementation="xla", **rules)
    shared = nanoattn.paged_attention(*arrays, implementation="xla", shared_prefixes=SHARED,
                                      **rules)  # fmt: skip
    np.testing.assert_array_equal(np.asarray(shared), np.asarray(plain))


def test_a_token_tree_in_the_rest():
    """A token tree's positions shift with the shared keys; the group pass has none."""
    parents = np.full(LAYOUT.q.shape[0], -1, np.int32)
    parents[1:5] = [-1, 0, 0, 2]  # sequence 1's chunk: a root, two drafts, one after
    parents[7:11] = [-1, 0, 1, 1]  # sequence 3's chunk
    arrays = LAYOUT.arrays()
    for name in ("xla", "flash"):
        plain = nanoattn.paged_attention(*arrays, implementation=name, tree_parents=parents)
        shared = nanoattn.paged_attention(*arrays, implementation=name, tree_parents=parents,
                                          shared_prefixes=SHARED)  # fmt: skip
        _close(shared, plain, what=name)


def test_an_eager_call_is_the_jitted_one():
    arrays = LAYOUT.arrays()
    eager = nanoattn.paged_attention(*arrays, implementation="xla", shared_prefixes=SHARED)
    (jitted, _), _ = _both("xla", LAYOUT)
    np.testing.assert_allclose(np.asarray(eager), np.asarray(jitted[0]), atol=1e-6)


def _table_with(s, pages):
    table = LAYOUT.table.copy()
    table[s, : len(pages)] = pages
    return table


BAD = {
    "past M": (dict(shared=[3, 1, 7, 3, 2, 3, 1]),
               r"shared_prefixes\[2\]=7 must be in \[0, M\] = \[0, 6\]", [2]),
    "negative": (dict(shared=[3, 1, 0, 3, -1, 3, 1]), r"shared_prefixes\[4\]=-1 must be in", [4]),
    "a page partly written": (
        dict(shared=[3, 1, 0, 3, 2, 4, 1]),
        r"shared_prefixes\[5\]=4: a shared prefix must lie wholly before the sequence's first "
        r"query, at position 9 \(kv_lengths - q_len\), but its 4 pages hold 12 keys", [5],
    ),
    "other pages": (
        dict(table=_table_with(5, [LAYOUT.table[2, 0], LAYOUT.table[0, 1], LAYOUT.table[0, 2]])),
        r"shared_prefixes\[5\]=3: sequence 5's first 3 pages .* are not those of sequence 0 "
        r".*: a group shares the same pages", [5],
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", BAD)
def test_bad_groups_raise_one_line_and_poison_their_rows_under_jit(case):
    changes, message, sequences = BAD[case]
    q, kp, vp, table, lengths, starts = LAYOUT.arrays()
    table = jnp.asarray(changes.get("table", table))
    shared = jnp.asarray(changes.get("shared", SHARED), jnp.int32)
    with pytest.raises(ValueError, match=message):
        nanoattn.paged_attention(q, kp, vp, table, lengths, starts, shared_prefixes=shared)
    run = _program("xla", (), False)
    (bad, _), _ = run(q, kp, vp, table, lengths, starts, shared, {}, None)
    (good, _), _ = run(q, kp, vp, table, lengths, starts, jnp.zeros_like(shared), {}, None)
    hit = np.zeros(q.shape[0], bool)
    for s in sequences:
        hit[LAYOUT.starts[s] : LAYOUT.starts[s + 1]] = True
    bad, good = np.asarray(bad), np.asarray(good)
    assert hit.any() and np.isnan(bad[hit]).all()
    np.testing.assert_allclose(bad[~hit], good[~hit], atol=2e-5)


@pytest.mark.parametrize(
    "value, message",
    [(np.zeros(6, np.int32), r"shared_prefixes must have shape \(B,\) = \(7,\), got \(6,\)"),
     (np.zeros(7, np.float32), r"shared_prefixes must be an integer array")],
)  # fmt: skip
def test_a_bad_shape_or_dtype_raises_one_line(value, message):
    with pytest.raises((ValueError, TypeError), match=message):
        nanoattn.paged_attention(*LAYOUT.arrays(), shared_prefixes=value)
