"""Case tables shared by several test files, and the machinery that runs them.

* :class:`Case`: one attention call and its float64 truth (``_reference.py``);
  :func:`run_cases` and :func:`assert_cases_match` run a table of them in one
  compiled program per backend (``compiled_cases``), outputs and gradients.
* ``SMALL_TILES``: flash tiles small enough that short sequences span several blocks.
* ``ENTRY_POINTS``: the three public attention functions, called ``f(q, k, v, **kw)``.
* ``CASES``: every argument at once (window, segment ids, soft-cap, RoPE, causality, a
  dense mask, key lengths, bias, grouped heads), built so that some keys are seen by
  no query of their row, some queries see no key and some bias cells are blocked
  (core/test_combined.py).
* ``BAD``, :func:`blocked_places` and :func:`dirty_inputs`: NaN and inf written where
  nothing may look (core/test_combined.py).
* ``LENGTHS`` and ``PRODUCT_LENGTHS``: sequence lengths at and around powers of two and
  products (core/test_masks.py, test_chapter.py).
* :func:`jit_vjp`: one backend's output and (dq, dk, dv) under jit, the rules closed
  over (backends/test_native.py, backends/test_native_mask_fn.py).
* :func:`attention_case`: a hypothesis strategy of random calls with their literal
  allowed mask (core/test_properties.py, backends/test_dispatch.py).
"""

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import strategies as st

from nanoattn._backends import registry

from _backends import refusal
from _reference import (
    np_attention_vjp,
    np_causal,
    np_lengths,
    np_rope,
    np_segments,
    np_window,
    randn,
    sum_to_shape,
)

# Small explicit tiles, so that a short sequence already spans several query and key
# blocks, a padded last block and several lanes per step.
SMALL_TILES = dict(forward_tiles=(16, 32, 3), backward_tiles=(8, 16, 5))


@dataclasses.dataclass
class Case:
    """One attention call and its float64 truth.

    ``kwargs`` go to the library as they are (static ones like ``window`` and
    ``is_causal``, and arrays like ``kv_lengths``); ``allowed`` is the
    literal (B, N, T, S)-broadcastable mask that they should amount to. With
    ``rope = (q_positions, k_positions, base)``, ``apply_rope`` rotates q and k
    inside the differentiated function.
    """

    name: str
    q: Any
    k: Any
    v: Any
    allowed: Any = None
    bias: Any = None
    kwargs: dict = dataclasses.field(default_factory=dict)
    rope: tuple | None = None

    def truth(self, d_out):
        """Float64 output and (dq, dk, dv, dbias) for the cotangent ``d_out``."""
        q, k = self.q, self.k
        if self.rope is not None:
            q_pos, k_pos, base = self.rope
            q, k = np_rope(q, q_pos, base), np_rope(k, k_pos, base)
        scale, cap = self.kwargs.get("scale"), self.kwargs.get("logit_soft_cap")
        out, (dq, dk, dv, dbias) = np_attention_vjp(
            q, k, self.v, d_out, self.allowed, self.bias, scale, cap
        )
        if self.rope is not None:  # the rotation's transpose is the rotation back
            dq, dk = np_rope(dq, -np.asarray(q_pos), base), np_rope(dk, -np.asarray(k_pos), base)
        dbias = None if self.bias is None else sum_to_shape(dbias, np.shape(self.bias))
        return out, (dq, dk, dv, dbias)

    def cotangent(self):
        return randn(99, *np.shape(self.q))


def attention_fn(implementation, tiles=None):
    """The functional core with one backend; flash with small tiles by default."""
    import nanoattn

    if implementation == "flash":
        return functools.partial(nanoattn.flash_attention, **(tiles or SMALL_TILES))
    return functools.partial(nanoattn.dot_product_attention, implementation=implementation)


def case_function(case: Case, implementation, tiles=None):
    """``f(q, k, v, bias)`` of one case: the attention call, with RoPE first if asked."""
    import nanoattn

    attend = attention_fn(implementation, tiles)

    def f(q, k, v, bias):
        if case.rope is not None:
            q_pos, k_pos, base = case.rope
            q, k = (
                nanoattn.apply_rope(q, q_pos, base=base),
                nanoattn.apply_rope(k, k_pos, base=base),
            )
        return attend(q, k, v, bias=bias, **case.kwargs)

    return f


_PROGRAMS: dict = {}


def compiled_cases(cases, implementation, tiles=None):
    """A jitted ``run(inputs)``: for each case's ``(q, k, v, bias, cotangent)``, its
    output and (dq, dk, dv, dbias), all cases in one program.

    One program for all cases compiles much faster than one per case, and the
    kernel's compile time dominates these tests. The program is kept for the same
    case objects, so another test can feed it other inputs of the same shapes
    without compiling again.
    """
    key = (tuple(id(c) for c in cases), implementation, repr(tiles))
    if key not in _PROGRAMS:
        fns = [case_function(c, implementation, tiles) for c in cases]

        @jax.jit
        def run(inputs):
            results = []
            for f, (q, k, v, bias, cot) in zip(fns, inputs):
                out, vjp = jax.vjp(f, q, k, v, bias)
                results.append((out, vjp(cot.astype(out.dtype))))
            return results

        _PROGRAMS[key] = (run, list(cases))  # the cases stay alive, so ids stay unique
    return _PROGRAMS[key][0]


def run_cases(cases, implementation, tiles=None, inputs=None):
    """Outputs and (dq, dk, dv, dbias) of every case (see :func:`compiled_cases`);
    ``inputs`` replaces the cases' own ``(q, k, v, bias, cotangent)``."""
    if inputs is None:
        inputs = [(c.q, c.k, c.v, c.bias, c.cotangent()) for c in cases]
    return compiled_cases(cases, implementation, tiles)(inputs)


def serving_cases(cases) -> list[str]:
    """The registered backends that serve every case of the table (tests/_backends.py)."""
    return [
        name
        for name in registry.names()
        if all(refusal(name, c.q, c.k, c.v, bias=c.bias, **c.kwargs) is None for c in cases)
    ]


def assert_cases_match(cases, implementations=None, tiles=None, atol=2e-5, grad_atol=1e-4):
    """Every case's output and gradients, in each backend (by default every registered
    backend that serves the whole table), against its float64 truth.

    Returns ``{implementation: [(out, grads) per case]}`` for further checks.
    """
    if implementations is None:
        implementations = serving_cases(cases)
    truths = [c.truth(c.cotangent()) for c in cases]
    everything = {}
    for implementation in implementations:
        results = everything[implementation] = run_cases(cases, implementation, tiles)
        for case, (out, grads), (want, want_grads) in zip(cases, results, truths):
            where = f"{implementation}, {case.name}"
            np.testing.assert_allclose(out, want, atol=atol, rtol=atol, err_msg=where)
            for name, g, w in zip(("dq", "dk", "dv", "dbias"), grads, want_grads):
                if w is not None:
                    np.testing.assert_allclose(
                        g, w, atol=grad_atol, rtol=grad_atol, err_msg=f"{where}: {name}"
                    )
    return everything


def jit_vjp(implementation, q, k, v, d_out, **rules):
    """Output and (dq, dk, dv) of ``nanoattn.dot_product_attention`` on one backend,
    under jit, the rules closed over (a numpy per-row offset as a concrete jax array:
    converted inside jit it would be traced, and a mask_fn's kinds with it); ``d_out``
    in the query's dtype."""
    import nanoattn

    if isinstance(rules.get("q_offset"), np.ndarray):
        rules["q_offset"] = jnp.asarray(rules["q_offset"])

    @jax.jit
    def forward_backward(q, k, v):
        attend = functools.partial(
            nanoattn.dot_product_attention, implementation=implementation, **rules
        )
        out, vjp = jax.vjp(attend, q, k, v)
        return out, vjp(d_out.astype(q.dtype))

    return forward_backward(q, k, v)


def _weights_of(q, k, v, **kwargs):
    from nanoattn import attention_weights

    return attention_weights(q, k, **kwargs)


def _entry_points():
    from nanoattn import dot_product_attention, flash_attention

    return {
        "dot_product_attention": dot_product_attention,
        "attention_weights": _weights_of,
        "flash_attention": flash_attention,
    }


# The three public attention functions, called as f(q, k, v, **kwargs): the same
# argument checks must hold in each.
ENTRY_POINTS = _entry_points()


# ---------------------------------------------------------------------------------------
# Every argument at once. core/test_combined.py runs these cases against the reference on
# every backend that serves them, then feeds the same compiled programs NaN and inf
# where nothing may look.


def static_offset_gqa():
    """T < S, causal sliding window at a static offset, GQA (N=6, K=2), RoPE."""
    B, T, S, N, K, H, off = 2, 23, 41, 6, 2, 8, 18
    rng = np.random.default_rng(100)
    kv_ids = np.stack([[0] * 20 + [1] * 21, [0] * 10 + [1] * 31]).astype(np.int32)
    q_ids = kv_ids[:, off:].copy()
    q_ids[0, -3:] = 5  # three queries of row 0 match no key: they see nothing
    lengths = np.array([41, 33], np.int32)  # keys 33.. of row 1 are padding
    mask = rng.random((B, 1, T, S)) > 0.15
    mask[0, :, :, 25] = False  # key 25 of row 0 is masked for every query
    allowed = (
        mask
        & np_causal(T, S, off)
        & np_window(T, S, off, 9, 0)  # keys 0..8 are left of every query's window
        & np_lengths(lengths, S)
        & np_segments(q_ids, kv_ids)
    )
    return Case(
        "static offset, GQA, RoPE, everything",
        randn(101, B, T, N, H) * 2,
        randn(102, B, S, K, H),
        randn(103, B, S, K, H),
        allowed=allowed,
        bias=randn(104, B, 1, T, S),
        kwargs=dict(
            mask=mask,
            is_causal=True,
            q_offset=off,
            window=(9, 0),
            kv_lengths=lengths,
            q_segment_ids=q_ids,
            kv_segment_ids=kv_ids,
            logit_soft_cap=3.0,
        ),
        rope=(off + np.arange(T), np.arange(S), 100.0),
    )


def traced_offsets_mqa():
    """Per-row traced offsets, a two-sided window without causality, MQA (K=1)."""
    B, T, S, N, K, H = 2, 29, 31, 5, 1, 8
    offsets = np.array([6, 0], np.int32)  # row 0: keys 0..2 are left of every window
    kv_ids = np.stack([[0] * 15 + [1] * 16, [0] * 5 + [4] * 3 + [0] * 23]).astype(np.int32)
    q_ids = np.stack([kv_ids[0, np.minimum(offsets[0] + np.arange(T), S - 1)], np.zeros(T)])
    q_ids = q_ids.astype(np.int32)
    q_ids[0, [10, 11]] = 9  # match no key
    lengths = np.array([31, 24], np.int32)  # row 1: queries 27, 28 see no valid key
    allowed = np_window(T, S, offsets, 3, 2) & np_lengths(lengths, S) & np_segments(q_ids, kv_ids)
    return Case(
        "traced per-row offsets, MQA, two-sided window",
        randn(111, B, T, N, H) * 2,
        randn(112, B, S, K, H),
        randn(113, B, S, K, H),
        allowed=allowed,
        bias=randn(114, 1, 1, 1, S),
        kwargs=dict(
            q_offset=offsets,
            window=(3, 2),
            kv_lengths=lengths,
            q_segment_ids=q_ids,
            kv_segment_ids=kv_ids,
            logit_soft_cap=1.5,
        ),
        rope=(offsets[:, None] + np.arange(T), np.arange(S), 10000.0),
    )


def square_gqa3():
    """T == S, default offset, causal + symmetric int window, K=3, full bias."""
    B, T, N, K, H = 2, 37, 6, 3, 8
    ids = np.stack([[0] * 10 + [1] * 20 + [2] * 7, [3] * 37]).astype(np.int32)
    mask = np.random.default_rng(120).random((T, T)) > 0.1
    allowed = mask & np_causal(T, T) & np_window(T, T, 0, 6, 6) & np_segments(ids, ids)
    return Case(
        "square, K=3, causal + window 6",
        randn(121, B, T, N, H) * 2,
        randn(122, B, T, K, H),
        randn(123, B, T, K, H),
        allowed=allowed,
        bias=randn(124, B, N, T, T),
        kwargs=dict(
            mask=mask,
            is_causal=True,
            window=6,
            q_segment_ids=ids,
            kv_segment_ids=ids,
            logit_soft_cap=5.0,
        ),
    )


CASES = [static_offset_gqa(), traced_offsets_mqa(), square_gqa3()]


# ---------------------------------------------------------------------------------------
# NaN and inf where nothing may look.

BAD = {"nan": np.nan, "inf": np.inf, "-inf": -np.inf}


def full_allowed(case):
    B, T, N, _ = case.q.shape
    return np.broadcast_to(case.allowed, (B, N, T, case.k.shape[1]))


def blocked_places(case):
    """Where content may be anything: keys and values that no query of their row
    sees (B, S), bias cells blocked wherever they broadcast (bias's shape), and
    queries that see no key (B, T, N)."""
    allowed = full_allowed(case)
    unseen_keys = ~allowed.any(axis=(1, 2))  # (B, S)
    blocked_bias = sum_to_shape(allowed.astype(np.float64), np.shape(case.bias)) == 0
    blind_queries = ~np.moveaxis(allowed.any(-1), 1, 2)  # (B, T, N)
    return unseen_keys, blocked_bias, blind_queries


def dirty_inputs(case, places, bad, keys=None):
    """The case's inputs with ``bad`` at the blocked ``places``; ``keys`` (B, S)
    chooses which unseen keys and values (all of them by default)."""
    unseen_keys, blocked_bias, blind_queries = blocked_places(case)
    keys = unseen_keys if keys is None else keys
    assert not (keys & ~unseen_keys).any()
    q, k, v, bias = (np.array(a) for a in (case.q, case.k, case.v, case.bias))
    if "keys" in places:
        k[keys] = bad
    if "values" in places:
        v[keys] = bad
    if "bias" in places:
        bias[blocked_bias] = bad
    if "queries" in places:
        q[blind_queries] = bad
    return q, k, v, bias, case.cotangent()


# ---------------------------------------------------------------------------------------
# Sequence lengths.

# Short, boundary (2^k - 1, 2^k, 2^k + 1) and product (a * b) lengths.
LENGTHS = [1, 2, 3, 7, 8, 9, 15, 16, 17, 31, 32, 33, 64, 65, 127, 128, 129]
PRODUCT_LENGTHS = [6, 10, 12, 21, 24, 35, 48, 96]


# ---------------------------------------------------------------------------------------
# Random calls, drawn by hypothesis.


@st.composite
def attention_case(draw, extended=False):
    """(q, k, v, kwargs, allowed). ``extended`` also draws a window, segment ids and a
    soft-cap (static arguments: ``window`` and ``logit_soft_cap`` under ``jit``)."""
    B, T, S = draw(st.integers(1, 3)), draw(st.integers(1, 9)), draw(st.integers(1, 9))
    K, G, H = draw(st.integers(1, 3)), draw(st.integers(1, 3)), draw(st.integers(1, 6))
    N = K * G
    rng = np.random.default_rng(draw(st.integers(0, 2**31)))
    q = rng.standard_normal((B, T, N, H)).astype(np.float32)
    k = rng.standard_normal((B, S, K, H)).astype(np.float32)
    v = rng.standard_normal((B, S, K, H)).astype(np.float32)
    kwargs = {}
    allowed = np.ones((B, N, T, S), bool)
    mask_shape = draw(st.sampled_from([None, (T, S), (B, 1, T, S), (1, N, 1, S), (B, N, T, S)]))
    if mask_shape is not None:
        kwargs["mask"] = rng.random(mask_shape) > draw(st.floats(0.0, 0.9))
        allowed &= kwargs["mask"]
    if draw(st.booleans()):
        kwargs["is_causal"] = True
    if extended and draw(st.booleans()):
        kwargs["window"] = (draw(st.integers(0, S + 1)), draw(st.integers(0, S + 1)))
    if kwargs.get("is_causal") or "window" in kwargs:
        kwargs["q_offset"] = draw(st.integers(-2, S + 1))
        if kwargs.get("is_causal"):
            allowed &= np_causal(T, S, kwargs["q_offset"])
        if "window" in kwargs:
            allowed &= np_window(T, S, kwargs["q_offset"], *kwargs["window"])
    if draw(st.booleans()):
        kwargs["kv_lengths"] = rng.integers(0, S + 1, size=B).astype(np.int32)
        allowed &= (np.arange(S) < kwargs["kv_lengths"][:, None])[:, None, None, :]
    if extended and draw(st.booleans()):
        ids = draw(st.integers(1, 3))
        kwargs["q_segment_ids"] = rng.integers(0, ids, (B, T)).astype(np.int32)
        kwargs["kv_segment_ids"] = rng.integers(0, ids, (B, S)).astype(np.int32)
        allowed &= np_segments(kwargs["q_segment_ids"], kwargs["kv_segment_ids"])
    if extended and draw(st.booleans()):
        kwargs["logit_soft_cap"] = draw(st.floats(0.25, 30.0))
    if draw(st.booleans()):
        kwargs["bias"] = rng.standard_normal((1, N, T, S)).astype(np.float32)
    return q, k, v, kwargs, allowed
