"""One test base for every backend: the same calls, each against its float64 truth.

:class:`BackendTestBase` is subclassed once per backend (``implementation = "<name>"``),
as tokamax's ``AttentionTestBase`` is: each test file of a backend holds a subclass,
and a backend registered at run time (tests/backends/test_registry.py's toy) runs the same
tests by subclassing it too, with no other change. A call the backend does not serve
(``dispatch.refusal``) is skipped with its reason, and every rule it does not list in
its ``serves`` must be refused in one line.

The calls (:data:`CALLS`) are one per behaviour, at distinct prime sizes (B=2, T=19,
S=23, N=6, K=2, H=8; K=1 for MQA, Hv=5 for values of their own width) so a swapped
axis fails: every rule of ``dot_product_attention`` alone, then together, rows that
see no key, and keys no query sees. Each backend runs every call it serves in ONE compiled program
(the output, the log-sum-exp and the gradients of both, since the log-sum-exp is
differentiable), whose inputs are then swapped for NaN and inf where nothing may
look; and a call mapped over the batch with vmap, forward and backward, and one in
bfloat16.
"""

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import nanoattn
from nanoattn._backends import dispatch, registry
from nanoattn._backends.interface import unserved
from nanoattn._base.rules import RULE_NAMES, Rules

from _reference import (
    np_attention_vjp,
    np_causal,
    np_lengths,
    np_lse,
    np_segments,
    np_window,
    randn,
    sum_to_shape,
)

B, T, S, N, K, H = 2, 19, 23, 6, 2, 8
HV = 5  # the values' own head width (Hv != H)
OFFSET = S - T  # bottom-right: the last query sits at the last key


@dataclasses.dataclass(frozen=True, eq=False)
class Call:
    """One call and its float64 truth.

    Attributes:
      name: what it tests.
      rules: keywords of ``dot_product_attention`` (numpy arrays where arrays).
      allowed: the literal (B|1, N|1, T, S) mask they amount to.
      bias: a differentiated bias (B|1, N|1, T|1, S|1), or None.
      score_bias: what ``rules["score_fn"]`` adds to the scores, for the truth, or None.
      sinks: differentiated sinks (N,), or None.
      heads: K, the key/value heads.
      value_width: Hv, the values' (and the output's) head width.
    """

    name: str
    rules: dict
    allowed: Any
    bias: Any = None
    score_bias: Any = None
    sinks: Any = None
    heads: int = K
    value_width: int = H

    def inputs(self):
        """(q, k, v, bias, sinks, d_out, d_lse), float32 numpy: the cotangents of the
        output and of the log-sum-exp, which is 0 in rows that see no key."""
        q = randn(1, B, T, N, H) * 2
        Hv = self.value_width
        k, v = randn(2, B, S, self.heads, H), randn(3, B, S, self.heads, Hv)
        seen = np.broadcast_to(True if self.allowed is None else self.allowed, (B, N, T, S))
        d_lse = randn(8, B, T, N) * np.moveaxis(seen.any(-1), 1, 2)
        return q, k, v, self.bias, self.sinks, randn(4, B, T, N, Hv), d_lse

    def truth(self, q, k, v, bias, sinks, d_out, d_lse):
        """Float64 (out, lse, (dq, dk, dv, dbias, dsinks)) for these inputs."""
        total = None
        for part in (bias, self.score_bias):
            if part is not None:
                total = part if total is None else total + part
        cap, scale = self.rules.get("logit_soft_cap"), self.rules.get("scale")
        out, grads = np_attention_vjp(q, k, v, d_out, self.allowed, total, scale, cap, sinks, d_lse)
        dq, dk, dv, dbias = grads[:4]
        dbias = None if bias is None else sum_to_shape(dbias, np.shape(bias))
        dsinks = grads[4] if sinks is not None else None
        lse = np_lse(q, k, self.allowed, total, scale, cap, sinks)
        return out, lse, (dq, dk, dv, dbias, dsinks)

    def arrays(self) -> dict:
        """The rules with numpy arrays made jax arrays (concrete: closed over, not
        traced, as a decoding loop's per-row offsets would be)."""
        return {
            name: jnp.asarray(x) if isinstance(x, np.ndarray) else x
            for name, x in self.rules.items()
        }


# A tree of the T queries (each row of the batch alike): every token's parent an earlier
# token or -1 (the last committed key, at OFFSET - 1), several children per node.
TREE = np.array([[-1, 0, 0, 1, 1, 2, 3, 3, 4, -1, 9, 9, 10, 11, 12, 5, 6, 7, 8]] * 2, np.int32)


# Each query's chosen keys (sparse attention): 7 entries, -1 padding, a key twice, keys
# past the causal limit and the diagonal left out of some rows.
SELECTED = np.random.default_rng(51).integers(-1, S, size=(B, T, 7)).astype(np.int32)
SELECTED[0, 3, :2] = 5


def _np_selected(indices):
    """Literal selection (B, 1, T, S): each query's chosen keys, each once."""
    allowed = np.zeros((B, 1, T, S), bool)
    for b, t, e in np.ndindex(*indices.shape):
        allowed[b, 0, t, indices[b, t, e]] |= indices[b, t, e] >= 0
    return allowed


def _np_tree(parents):
    """Literal tree rule (B, 1, T, S): the keys before the chunk (slots < OFFSET), and in
    the chunk (slots OFFSET + j) exactly each token's ancestors and itself."""
    allowed = np.zeros((parents.shape[0], 1, T, S), bool)
    allowed[..., :OFFSET] = True
    for b in range(parents.shape[0]):
        for i in range(T):
            j = i
            while j >= 0:
                allowed[b, 0, i, OFFSET + j] = True
                j = parents[b, j]
    return allowed


def _documents():
    ids = np.arange(S) // 7  # documents of 7 tokens, their edges inside blocks

    def same_document(b, n, q, k):
        table = jnp.asarray(ids)
        return table[jnp.clip(q, 0, S - 1)] == table[k]

    i = OFFSET + np.arange(T)[:, None]
    return same_document, ids[np.clip(i, 0, S - 1)] == ids[np.arange(S)[None]]


def _alibi():
    slopes = 2.0 ** -np.arange(1, N + 1)

    def alibi(score, b, n, q, k):
        return score + jnp.asarray(slopes, jnp.float32)[n] * (k - q).astype(jnp.float32)

    q = OFFSET + np.arange(T)[:, None]
    bias = slopes[:, None, None] * (np.arange(S)[None] - q)[None]  # (N, T, S)
    return alibi, bias[None]


def _calls() -> list[Call]:
    causal = np_causal(T, S, OFFSET)
    lengths = np.array([S, 11], np.int32)
    q_ids = np.stack([np.arange(T) // 6, np.zeros(T)]).astype(np.int32)
    kv_ids = np.stack([(np.arange(S) - OFFSET) // 6, np.arange(S) % 2]).astype(np.int32)
    mask = np.random.default_rng(5).random((B, 1, T, S)) > 0.2
    offsets = np.array([OFFSET, 1], np.int32)
    documents, by_document = _documents()
    alibi, alibi_bias = _alibi()
    sinks = randn(6, N)
    bias = randn(7, 1, N, T, S)
    calls = [
        Call("plain", {}, None),
        Call("causal", dict(is_causal=True, q_offset=OFFSET), causal),
        Call(
            "causal at per-row offsets",
            dict(is_causal=True, q_offset=offsets),
            np.stack([np_causal(T, S, int(o)) for o in offsets])[:, None],
        ),
        Call(
            "causal window",
            dict(is_causal=True, q_offset=OFFSET, window=(5, 0)),
            causal & np_window(T, S, OFFSET, 5, 0),
        ),
        Call("two-sided window", dict(q_offset=2, window=(3, 4)), np_window(T, S, 2, 3, 4)),
        Call(
            "key lengths",
            dict(is_causal=True, q_offset=OFFSET, kv_lengths=lengths),
            causal & np_lengths(lengths, S),
        ),
        Call(
            "segment ids",
            dict(q_segment_ids=q_ids, kv_segment_ids=kv_ids),
            np_segments(q_ids, kv_ids),
        ),
        Call("dense mask", dict(mask=mask), mask),
        Call("bias", {}, None, bias=bias),
        Call(
            "soft-cap",
            dict(is_causal=True, q_offset=OFFSET, logit_soft_cap=2.5),
            causal,
        ),
        Call("scale", dict(scale=0.7), None),
        Call(
            "mask_fn",
            dict(mask_fn=documents, is_causal=True, q_offset=OFFSET),
            causal & by_document,
        ),
        Call(
            "score_fn",
            dict(score_fn=alibi, is_causal=True, q_offset=OFFSET),
            causal,
            score_bias=alibi_bias,
        ),
        Call("sinks", dict(is_causal=True, q_offset=OFFSET), causal, sinks=sinks),
        Call("multi-query", dict(is_causal=True, q_offset=OFFSET), causal, heads=1),
        Call(
            "values of their own width",  # multi-head latent attention's Hv != H
            dict(is_causal=True, q_offset=OFFSET, kv_lengths=lengths),
            causal & np_lengths(lengths, S),
            value_width=HV,
        ),
        Call(
            "a token tree",  # speculative decoding: the T queries a tree of drafts
            dict(is_causal=True, q_offset=OFFSET, tree_parents=TREE),
            _np_tree(TREE),
        ),
        Call(
            "selected keys",  # sparse attention over chosen keys (DeepSeek-V3.2's top-k)
            dict(is_causal=True, q_offset=OFFSET, key_indices=SELECTED),
            causal & _np_selected(SELECTED),
        ),
        Call(
            "rows that see no key",
            dict(is_causal=True, q_offset=-3, kv_lengths=np.array([0, 9], np.int32)),
            np_causal(T, S, -3) & np_lengths(np.array([0, 9]), S),
        ),
        Call(
            "every rule a kernel may serve without a dense mask",
            dict(
                is_causal=True,
                q_offset=OFFSET,
                window=(9, 0),
                kv_lengths=lengths,
                q_segment_ids=q_ids,
                kv_segment_ids=kv_ids,
                logit_soft_cap=4.0,
                mask_fn=documents,
            ),
            causal
            & np_window(T, S, OFFSET, 9, 0)
            & np_lengths(lengths, S)
            & np_segments(q_ids, kv_ids)
            & by_document,
            sinks=sinks,
        ),
    ]
    return calls


CALLS = _calls()
NAMES = [c.name for c in CALLS]
_PROGRAMS: dict = {}


def _function(call: Call, attend):
    """``f(q, k, v, bias, sinks) -> (out, lse)`` of one call."""
    rules = call.arrays()

    def f(q, k, v, bias, sinks):
        extra = dict(rules)
        if bias is not None:
            extra["bias"] = bias
        if sinks is not None:
            extra["sinks"] = sinks
        return attend(q, k, v, return_residual=True, **extra)

    return f


class BackendTestBase:
    """The tests every backend passes; a subclass sets ``implementation``."""

    implementation: str = ""

    def attend(self, q, k, v, **rules):
        """The backend's call (a subclass may add its own arguments, such as tiles)."""
        return nanoattn.dot_product_attention(q, k, v, implementation=self.implementation, **rules)

    def refusal(self, call: Call, dtype=jnp.float32) -> str | None:
        """Why the backend cannot serve ``call``, or None."""
        q, k, v, bias, sinks, *_ = call.inputs()
        rules = Rules.make(q, k, v, **call.arrays(), bias=bias, sinks=sinks)
        return dispatch.refusal(registry.get(self.implementation), rules, dtype, 0.0)

    def served(self) -> list[Call]:
        return [c for c in CALLS if self.refusal(c) is None]

    def program(self):
        """One jitted program: for each served call, (out, lse) and the gradients of
        ``sum(out * d_out) + sum(lse * d_lse)`` for q, k, v, bias, sinks (None where
        absent)."""
        key = (type(self), self.implementation)
        if key not in _PROGRAMS:
            calls = self.served()
            fns = [_function(c, self.attend) for c in calls]

            @jax.jit
            def run(inputs):
                results = []
                for f, (q, k, v, bias, sinks, d_out, d_lse) in zip(fns, inputs, strict=True):
                    (out, lse), vjp = jax.vjp(f, q, k, v, bias, sinks)
                    grads = vjp((d_out.astype(out.dtype), d_lse.astype(lse.dtype)))
                    results.append((out, lse, grads))
                return results

            _PROGRAMS[key] = (run, calls)
        return _PROGRAMS[key]

    def run(self, inputs=None):
        run, calls = self.program()
        if inputs is None:
            inputs = [c.inputs() for c in calls]
        return dict(zip([c.name for c in calls], run(inputs), strict=True))

    @pytest.mark.parametrize("name", NAMES)
    def test_output_lse_and_gradients_match_float64(self, name):
        call = CALLS[NAMES.index(name)]
        if reason := self.refusal(call):
            pytest.skip(reason)
        out, lse, grads = self.run()[name]
        want_out, want_lse, want_grads = call.truth(*call.inputs())
        where = f"{self.implementation}, {name}"
        np.testing.assert_allclose(out, want_out, atol=2e-5, rtol=2e-5, err_msg=where)
        finite = np.isfinite(want_lse)
        np.testing.assert_array_equal(np.isfinite(lse), finite, err_msg=where)
        np.testing.assert_allclose(lse[finite], want_lse[finite], atol=2e-5, rtol=2e-5)
        for label, got, want in zip(("dq", "dk", "dv", "dbias", "dsinks"), grads, want_grads):
            if want is not None:
                np.testing.assert_allclose(
                    got, want, atol=1e-4, rtol=1e-4, err_msg=f"{where}: {label}"
                )

    def test_nan_and_inf_where_nothing_may_look_never_reach_a_result(self):
        """Keys and values no query sees, queries that see no key and bias at blocked
        cells hold NaN, inf or -inf: the results equal the clean ones."""
        if reason := self.refusal(CALLS[0]):
            pytest.skip(reason)
        calls = [c for c in self.program()[1] if c.allowed is not None]
        clean = self.run()
        for bad in (np.nan, np.inf, -np.inf):
            inputs = []
            for call in self.program()[1]:
                q, k, v, bias, sinks, d_out, d_lse = call.inputs()
                if call.allowed is not None:
                    allowed = np.broadcast_to(call.allowed, (B, N, T, S))
                    k, v, q = k.copy(), v.copy(), q.copy()
                    unseen = ~allowed.any(axis=(1, 2))  # (B, S)
                    k[unseen], v[unseen] = bad, bad
                    q[~np.moveaxis(allowed.any(-1), 1, 2)] = bad  # (B, T, N)
                    if bias is not None:
                        blocked = sum_to_shape(allowed.astype(float), bias.shape) == 0
                        bias = np.where(blocked, bad, bias).astype(np.float32)
                inputs.append((q, k, v, bias, sinks, d_out, d_lse))
            dirty = self.run(inputs)
            for call in calls:
                pairs = zip(jax.tree.leaves(dirty[call.name]), jax.tree.leaves(clean[call.name]))
                for got, want in pairs:
                    np.testing.assert_array_equal(got, want, err_msg=f"{call.name}, {bad}")
        assert calls, "no call of the base has content nothing may look at"

    def test_every_rule_it_does_not_serve_is_refused_in_one_line(self):
        backend = registry.get(self.implementation)
        # a page table and quantized keys have calls of their own (tests below)
        unserved_rules = set(RULE_NAMES) - set(backend.serves) - {"page_table", "kv_scales"}
        calls = {rule: _call_using(rule) for rule in unserved_rules}
        for rule, call in calls.items():
            q, k, v, bias, sinks, *_ = call.inputs()
            rules = Rules.make(q, k, v, **call.arrays(), bias=bias, sinks=sinks)
            assert rule in rules.active()
            reason = unserved(backend, rules)
            assert reason is not None and RULE_NAMES[rule] in reason, (rule, reason)
            with pytest.raises(ValueError) as info:
                nanoattn.dot_product_attention(
                    q, k, v, implementation=self.implementation, bias=bias, sinks=sinks,
                    **call.arrays(),
                )  # fmt: skip
            message = str(info.value)
            assert "\n" not in message
            assert message.startswith(f"implementation={self.implementation!r} cannot serve")

    def test_a_page_table_it_does_not_serve_is_refused_in_one_line(self):
        """The page table is paged_attention's rule (dot_product_attention has none):
        a backend that does not serve it refuses a paged call in one line."""
        backend = registry.get(self.implementation)
        if "page_table" in backend.serves:
            pytest.skip(f"{self.implementation!r} serves a page table")
        q = jnp.ones((3, N, H))
        pages = jnp.ones((4, 2, K, H))
        table, lengths, starts = jnp.zeros((1, 2), jnp.int32), jnp.array([3]), jnp.array([0, 3])
        rules = Rules.make_paged(q, pages, pages, table, lengths, starts)
        reason = unserved(backend, rules)
        assert reason is not None and RULE_NAMES["page_table"] in reason, reason
        with pytest.raises(ValueError) as info:
            nanoattn.paged_attention(q, pages, pages, table, lengths, starts,
                                     implementation=self.implementation)  # fmt: skip
        message = str(info.value)
        assert "\n" not in message
        assert message.startswith(f"implementation={self.implementation!r} cannot serve")

    def test_quantized_keys_it_does_not_serve_are_refused_in_one_line(self):
        """Quantized keys and values with their scales (no call of the base has them:
        their gradients are not served): refused in one line by a backend without them."""
        backend = registry.get(self.implementation)
        if "kv_scales" in backend.serves:
            pytest.skip(f"{self.implementation!r} serves quantized keys and values")
        q = jnp.ones((1, 3, N, H))
        k, scales = nanoattn.quantize_kv(jnp.ones((1, 5, K, H)))
        rules = Rules.make(q, k, k, key_scales=scales, value_scales=scales)
        reason = unserved(backend, rules)
        assert reason is not None and RULE_NAMES["kv_scales"] in reason, reason
        with pytest.raises(ValueError) as info:
            nanoattn.dot_product_attention(q, k, k, key_scales=scales, value_scales=scales,
                                           implementation=self.implementation)  # fmt: skip
        message = str(info.value)
        assert "\n" not in message
        assert message.startswith(f"implementation={self.implementation!r} cannot serve")

    def test_vmap_over_the_batch_equals_the_batched_call_forward_and_backward(self):
        """Calls of one row each, mapped over the batch with each row's key length,
        equal the batched call: outputs and the gradients to q, k and v."""
        call = CALLS[NAMES.index("key lengths")]
        if reason := self.refusal(call):
            pytest.skip(reason)
        q, k, v = (jnp.asarray(x) for x in call.inputs()[:3])
        lengths = jnp.asarray(call.rules["kv_lengths"])
        attend = functools.partial(self.attend, is_causal=True, q_offset=OFFSET)

        def mapped(q, k, v):  # each row a call of batch 1 with its own length
            one = lambda q, k, v, n: attend(q[None], k[None], v[None], kv_lengths=n[None])[0]  # noqa: E731
            return jax.vmap(one)(q, k, v, lengths)

        def loss(f):
            return lambda q, k, v: jnp.sum(
                f(q, k, v) * jnp.arange(H, dtype=q.dtype).reshape(1, 1, 1, H)
            )

        @jax.jit
        def both(q, k, v):
            batched = functools.partial(attend, kv_lengths=lengths)
            return [jax.value_and_grad(loss(f), argnums=(0, 1, 2))(q, k, v)
                    for f in (mapped, batched)]  # fmt: skip

        got, want = both(q, k, v)
        for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            np.testing.assert_allclose(g, w, atol=1e-5, rtol=1e-5)

    def test_bfloat16_is_within_twice_the_references_error(self):
        call = CALLS[NAMES.index("causal")]
        if reason := self.refusal(call, jnp.bfloat16):
            pytest.skip(reason)
        q, k, v = (jnp.asarray(x, jnp.bfloat16) for x in call.inputs()[:3])
        truth = call.truth(*(np.asarray(x, np.float64) for x in (q, k, v)), None, None,
                           randn(4, B, T, N, H), None)[0]  # fmt: skip
        rules = dict(is_causal=True, q_offset=OFFSET)
        got = jax.jit(functools.partial(self.attend, **rules))(q, k, v)
        own = nanoattn.dot_product_attention(q, k, v, implementation="xla", **rules)
        assert got.dtype == jnp.bfloat16
        error = np.abs(np.asarray(got, np.float64) - truth).max()
        reference = np.abs(np.asarray(own, np.float64) - truth).max()
        assert error <= 2 * reference + 2**-8, (error, reference)


def _call_using(rule: str) -> Call:
    """A call of :data:`CALLS` that uses ``rule``."""
    for call in CALLS:
        q, k, v, bias, sinks, *_ = call.inputs()
        if rule in Rules.make(q, k, v, **call.arrays(), bias=bias, sinks=sinks).active():
            return call
    raise AssertionError(f"no call of the backend test base uses {rule}")
