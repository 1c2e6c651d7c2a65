"""Differential fuzzing of ``nanoattn.parallel.ring_attention`` on 4 simulated CPU
devices, run in its own process by tests/test_fuzz.py:

    XLA_FLAGS=--xla_force_host_platform_device_count=4 python tests/_fuzz_ring.py N

Hypothesis draws N ring calls (P of 1, 2 or 4 devices, both layouts, T = S a
multiple of the layout's chunks, small tiles, float32/bfloat16/float16,
causality, windows, key lengths, segment ids, soft-cap, scale, mask_fn and
score_fn at global positions, sinks, return_residual), with NaN or inf where no
query may look, and checks the output, the log-sum-exp and the gradients (to q,
k, v, the sinks and score_fn's arrays) against the float64 reference with the
criterion of tests/test_fuzz.py (its machinery is tests/_fuzz.py). It prints one
JSON summary line and exits 1 when a call failed.
"""

import json
import os
import sys
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")

import functools

import jax
import numpy as np
from hypothesis import given
from hypothesis import strategies as st
from jax.sharding import Mesh

from nanoattn._base.zigzag import zigzag_order
from nanoattn.parallel import ring_attention

import _fuzz
from _fuzz import DTYPES, Call, Program, Record, Statics

DEVICES = 4


@st.composite
def ring_programs(draw):
    """(P, layout, Program): a self-attention program the ring can serve."""
    P = draw(st.sampled_from((1, 2, 4)))
    layout = draw(st.sampled_from(("zigzag", "contiguous")))
    chunks = P * (2 if layout == "zigzag" else 1)
    T = chunks * draw(st.sampled_from((1, 2, 3, 5, 9)))
    B, K, G = draw(st.integers(1, 2)), draw(st.integers(1, 3)), draw(st.integers(1, 2))
    N, H = K * G, draw(st.sampled_from((1, 3, 8, 9)))
    dtype = draw(st.sampled_from(tuple(DTYPES)))
    features = [dtype, f"ring-P{P}", f"ring-{layout}"]
    is_causal = draw(st.booleans())
    window = None
    if draw(st.booleans()):
        side = st.one_of(st.sampled_from((0, 1)), st.integers(0, T + 1))
        window = draw(st.one_of(side, st.tuples(side, side)))
        features.append("window")
    features += ["causal"] * is_causal
    lengths, segments = draw(st.booleans()), draw(st.booleans())
    features += ["lengths"] * lengths + ["segments"] * segments
    soft_cap = draw(st.sampled_from(_fuzz.SOFT_CAPS))
    scale = draw(st.sampled_from(_fuzz.SCALES))
    tile = st.tuples(st.sampled_from((1, 3, 8)), st.sampled_from((1, 5, 8)), st.integers(1, 2))
    tiles = draw(st.one_of(st.none(), st.tuples(tile, tile)))
    # mask_fn, score_fn (at global positions), the sinks and the residual, each in about
    # half of the programs
    mask_fn = draw(st.one_of(st.none(), _fuzz.mask_fns(B, N, T, T)))
    score_fn = draw(st.one_of(st.none(), _fuzz.score_fns(soft_cap)))
    sinks, residual = draw(st.booleans()), draw(st.booleans())
    features += [] if mask_fn is None else mask_fn.features()
    features += [] if score_fn is None else [f"score_fn-{score_fn.family}"]
    features += ["sinks"] * sinks + ["residual"] * residual
    statics = Statics(is_causal, "none", None, window, soft_cap, scale, tiles, mask_fn, score_fn,
                      sinks, residual)  # fmt: skip
    program = Program(B, T, T, N, K, H, dtype, statics, None, lengths, segments, None, None,
                      tuple(features))  # fmt: skip
    return P, layout, program


@st.composite
def ring_calls(draw):
    P, layout, program = draw(ring_programs())
    return P, layout, [draw(_fuzz.inputs(program)) for _ in range(_fuzz.VARIANTS)]


def _order(P, layout, T):
    """Natural position of each slot of the layout's order, and its inverse."""
    if layout == "contiguous":
        return np.arange(T), np.arange(T)
    chunks = np.arange(T).reshape(2 * P, -1)[zigzag_order(P)].reshape(-1)
    return chunks, np.argsort(chunks)


@functools.partial(jax.jit, static_argnames=("P", "layout", "statics"))
def _ring_vjp(P, layout, statics, q, k, v, d_out, kv_lengths, q_ids, kv_ids, order,
              mask_params=None, score_params=None, sinks=None, d_lse=None):  # fmt: skip
    mesh = Mesh(np.array(jax.devices()[:P]), ("sp",))
    tiles = statics.tiles or (None, None)
    B, T, N = q.shape[:3]
    mask_fn = None
    if statics.mask_fn is not None:  # positions are global: the natural order's
        mask_fn = statics.mask_fn.build(mask_params, B, N, T, T, None)

    def f(q, k, v, score_params, sinks):
        score_fn = None if statics.score_fn is None else statics.score_fn.build(score_params)
        return ring_attention(
            q, k, v, axis_name="sp", mesh=mesh, layout=layout, is_causal=statics.is_causal,
            window=statics.window, kv_lengths=kv_lengths, q_segment_ids=q_ids,
            kv_segment_ids=kv_ids, logit_soft_cap=statics.soft_cap, scale=statics.scale,
            forward_tiles=tiles[0], backward_tiles=tiles[1], mask_fn=mask_fn,
            score_fn=score_fn, sinks=sinks, return_residual=statics.residual,
        )  # fmt: skip

    out, pull = jax.vjp(f, q, k, v, score_params, sinks)
    return out, pull((d_out, d_lse[:, order]) if statics.residual else d_out)


def run_ring(P, layout, call: Call):
    """(out, dq, dk, dv, dbias, lse, dsinks, dscore) of the ring, as run_backend gives
    them: the inputs in the layout's order, the results back in the natural one."""
    q, k, v, _ = call.dirty()
    order, back = _order(P, layout, q.shape[1])

    def to(x):
        return None if x is None else x[:, order]

    out, (dq, dk, dv, dscore, dsinks) = _ring_vjp(
        P, layout, call.statics, to(q), to(k), to(v), to(call.d_out), call.kv_lengths,
        to(call.q_ids), to(call.kv_ids), order, call.mask_params, call.score_params,
        call.sinks, call.d_lse,
    )  # fmt: skip
    out, lse = out if call.statics.residual else (out, None)

    def natural(x):
        return None if x is None else np.asarray(x, np.float64)[:, back]

    flat = [None if x is None else np.asarray(x, np.float64) for x in (dsinks, dscore)]
    return [natural(x) for x in (out, dq, dk, dv)] + [None, natural(lse), *flat]


FAILED = []
RECORD = None  # set in __main__, once the program cache exists


@_fuzz.budget(int(sys.argv[1]) if len(sys.argv) > 1 else 4)
@given(ring_calls())
def fuzz_ring(case):
    P, layout, calls = case
    start = time.perf_counter()
    verdicts = [_fuzz.check(c, results={"ring": run_ring(P, layout, c)}) for c in calls]
    RECORD.add_program(time.perf_counter() - start)
    for call, verdict in zip(calls, verdicts):
        RECORD.add(call, verdict, "ring")
        if verdict.failures:
            FAILED.append(f"P={P} {layout}; {call.describe()}: {verdict.failures}")
            if not _fuzz.KEEP_GOING:
                raise AssertionError(FAILED[-1])


if __name__ == "__main__":
    assert len(jax.devices()) >= DEVICES, jax.devices()
    RECORD = Record(program_cache=_ring_vjp)
    try:
        fuzz_ring()
    finally:
        print(json.dumps(RECORD.summary()))
    sys.exit(1 if FAILED else 0)
