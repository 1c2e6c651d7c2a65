"""The machinery of the differential fuzzing (test_fuzz.py says what it draws and why).

A drawn call (:class:`Statics`, :class:`Call`, :class:`Program`, and the hypothesis
strategies :func:`programs`, :func:`inputs`, :func:`calls`), running a backend on it
(:func:`run_backend`), the float64 truth and the reference's own error in the call's
dtype (:func:`truth`, :func:`low_precision_reference`), FlashAttention's criterion
(:func:`check`, giving a :class:`Verdict`), a campaign's :class:`Record`, the
hypothesis settings of a budget (:func:`budget`) and a seeded call for regression
tests (:func:`concrete_call`). Shared by test_fuzz.py, the ring's script
_fuzz_ring.py and the regression tests of test_flash.py.
"""

import collections
import dataclasses
import functools
import itertools
import os

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import HealthCheck, settings
from hypothesis import seed as hypothesis_seed
from hypothesis import strategies as st

import nanoattn
from nanoattn import _native

from _reference import np_attention_vjp, np_causal, np_lengths, np_segments, np_window, sum_to_shape

SEED = os.environ.get("NANOATTN_FUZZ_SEED")
KEEP_GOING = os.environ.get("NANOATTN_FUZZ_KEEP_GOING") == "1"

DTYPES = {"float32": np.float32, "bfloat16": jnp.bfloat16, "float16": np.float16}
# Times: 1, small primes, and one past the native kernel's 64 and 2 * 64 (flash's
# default tiles cap at T and S, so small drawn tiles put those boundaries lower).
TIMES = (1, 2, 3, 5, 7, 13, 17, 31, 64, 65, 129)
WIDTHS = (1, 2, 3, 5, 8, 9, 16, 17)  # H: 8 and 16 are the native kernel's vector widths
SCALES = (None, 0.125, 0.5, 1.0, 1.7)
SOFT_CAPS = (None, 0.5, 5.0, 30.0)
MASK_SHAPES = ("T S", "B 1 T S", "1 N 1 S", "B N T S", "1 1 T 1", "B 1 1 S")
BIAS_SHAPES = ("T S", "1 N T S", "B 1 T S", "B N T S", "1 1 1 S")
BAD = {"nan": np.nan, "inf": np.inf, "-inf": -np.inf}
# The floor under the 2x criterion: this many float32 rounding errors of the largest
# sum of absolute terms in each output or gradient (weights scaled by 1 + their row's
# largest |logit|), so that float32 noise alone, where the reference happens to be
# exact, is not a failure.
FLOOR_ULPS = 8
EPS32 = float(np.finfo(np.float32).eps)
VARIANTS = 3  # calls (values) per drawn program (static arguments and shapes)


# ---------------------------------------------------------------------------------------
# One call: what is static (compiled into the program) and what is data.


@dataclasses.dataclass(frozen=True)
class Statics:
    """The arguments compiled into the program (hashable: a static argument of jit);
    the shapes come with the arrays."""

    is_causal: bool = False
    offset: str = "none"  # "none", "static" (a Python int), "traced" (an array ()), "rows" (B,)
    static_offset: int | None = None
    window: int | tuple[int, int] | None = None
    soft_cap: float | None = None
    scale: float | None = None
    tiles: tuple | None = None  # flash only: (forward_tiles, backward_tiles), or the defaults


@dataclasses.dataclass
class Call:
    """One drawn attention call: inputs in their dtype, the literal allowed mask and
    the float64 truth's ingredients. ``q``, ``k``, ``v`` and ``bias`` are clean;
    :meth:`dirty` writes NaN or inf where nothing may look."""

    statics: Statics
    dtype: str
    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    d_out: np.ndarray
    bias: np.ndarray | None = None
    mask: np.ndarray | None = None
    offset: np.ndarray | None = None  # traced q_offset, () or (B,)
    kv_lengths: np.ndarray | None = None
    q_ids: np.ndarray | None = None
    kv_ids: np.ndarray | None = None
    bad: str | None = None  # "nan", "inf", "-inf" written into unseen content, or None
    features: tuple = ()
    seed: int = 0  # of the random arrays
    # NaN or inf in content some query does see: (array, index, "nan" | "inf" | "-inf"),
    # array one of "query", "key", "value", "bias"; real input, so it must show.
    poison: tuple | None = None

    def __repr__(self):
        return f"Call({self.describe()})"

    @property
    def sizes(self):
        B, T, N, H = self.q.shape
        S, K = self.k.shape[1], self.k.shape[2]
        return B, T, S, N, K, H

    def offsets(self) -> np.ndarray:
        """q_offset per row (B,), as the positional rules read it."""
        B = self.q.shape[0]
        s = self.statics
        if s.offset == "static":
            return np.full(B, s.static_offset)
        if s.offset in ("traced", "rows"):
            return np.broadcast_to(self.offset, (B,)).astype(np.int64)
        return np.zeros(B, np.int64)

    def allowed(self) -> np.ndarray:
        """(B, N, T, S): which key each query may see, from the literal rules of _reference.py."""
        B, T, S, N, _, _ = self.sizes
        s = self.statics
        allowed = np.ones((B, N, T, S), bool)
        for b, off in enumerate(self.offsets()):
            if s.is_causal:
                allowed[b] &= np_causal(T, S, int(off))
            if s.window is not None:
                left, right = (s.window, s.window) if isinstance(s.window, int) else s.window
                allowed[b] &= np_window(T, S, int(off), left, right)
        if self.kv_lengths is not None:
            allowed &= np_lengths(self.kv_lengths, S)
        if self.q_ids is not None:
            allowed &= np_segments(self.q_ids, self.kv_ids)
        if self.mask is not None:
            allowed &= np.broadcast_to(self.mask, (B, N, T, S))
        return allowed

    def backends(self) -> list[str]:
        """The backends that can serve this call (nanoattn/_dispatch.py's rules)."""
        names = ["xla", "flash"]
        if (
            self.dtype in ("float32", "bfloat16")
            and self.mask is None
            and self.bias is None
            and _native.load()[0] is not None
        ):
            names.append("native")
        return names

    def dirty(self):
        """q, k, v, bias with ``bad`` at every place no query may look."""
        q, k, v = (np.array(x) for x in (self.q, self.k, self.v))
        bias = None if self.bias is None else np.array(self.bias)
        if self.bad is None:
            return q, k, v, bias
        allowed = self.allowed()
        value = BAD[self.bad]
        unseen_keys = ~allowed.any(axis=(1, 2))  # (B, S)
        k[unseen_keys] = value
        v[unseen_keys] = value
        q[~np.moveaxis(allowed.any(-1), 1, 2)] = value  # (B, T, N): queries that see nothing
        if bias is not None:
            seen = sum_to_shape(allowed.astype(np.float64), bias.shape).reshape(bias.shape)
            bias[seen == 0] = value
        return q, k, v, bias

    def poisoned(self):
        """:meth:`dirty`'s inputs, and the poison written where some query looks."""
        q, k, v, bias = self.dirty()
        if self.poison is not None:
            array, index, bad = self.poison
            {"query": q, "key": k, "value": v, "bias": bias}[array][index] = BAD[bad]
        return q, k, v, bias

    def reach(self) -> np.ndarray:
        """(B, K): the batch rows and key/value head groups the poison may reach. Within
        them a backend may give NaN or inf anywhere (a NaN among the values of a row
        spreads through its sum over values, 0 * NaN = NaN, and through the gradients);
        outside them everything must be finite and right."""
        B, T, S, N, K, _ = self.sizes
        G = N // K
        touched = np.zeros((B, N), bool)
        if self.poison is not None:
            array, index, _ = self.poison
            allowed = self.allowed()
            if array == "query":
                touched[index[0], index[2]] = True
            elif array in ("key", "value"):
                b, s, k = index[:3]
                touched[b, k * G : (k + 1) * G] = allowed[b, k * G : (k + 1) * G, :, s].any(-1)
            else:  # a bias cell, wherever it broadcasts
                cell = np.zeros(self.bias.shape, bool)
                cell[index] = True
                seen = np.broadcast_to(cell, (B, N, T, S)) & allowed
                touched = seen.any(axis=(2, 3))
        return touched.reshape(B, K, G).any(-1)

    def seers(self) -> np.ndarray:
        """(B, T, N): the query rows that look at the poison itself (a poisoned query
        that sees a key, the queries that see a poisoned key or value or bias cell).
        Their outputs must show it on every backend; other rows of its reach may."""
        B, T, S, N, K, _ = self.sizes
        sees = np.zeros((B, N, T), bool)
        if self.poison is None:
            return sees.transpose(0, 2, 1)
        array, index, _ = self.poison
        allowed = self.allowed()  # (B, N, T, S)
        if array == "query":
            b, t, n = index[:3]
            sees[b, n, t] = allowed[b, n, t].any()
        elif array in ("key", "value"):
            b, s, k = index[:3]
            G = N // K
            sees[b, k * G : (k + 1) * G] = allowed[b, k * G : (k + 1) * G, :, s]
        else:
            cell = np.zeros(self.bias.shape, bool)
            cell[index] = True
            sees = (np.broadcast_to(cell, (B, N, T, S)) & allowed).any(-1)
        return sees.transpose(0, 2, 1)

    def regions(self) -> list:
        """Per quantity (out, dq, dk, dv, dbias), where the poison may reach, broadcast to
        the quantity's shape."""
        B, T, S, N, K, H = self.sizes
        groups = self.reach()  # (B, K)
        rows = np.repeat(groups, N // K, axis=1)[:, None, :, None]  # (B, 1, N, 1)
        keys = groups[:, None, :, None]  # (B, 1, K, 1)
        out = np.broadcast_to(rows, (B, T, N, H))
        kv = np.broadcast_to(keys, (B, S, K, H))
        dbias = None
        if self.bias is not None:
            heads = np.repeat(groups, N // K, axis=1)[:, :, None, None]  # (B, N, 1, 1)
            cells = np.broadcast_to(heads, (B, N, T, S)).astype(np.float64)
            dbias = sum_to_shape(cells, self.bias.shape).reshape(self.bias.shape) > 0
        return [out, out, kv, kv, dbias]

    def describe(self) -> str:
        B, T, S, N, K, H = self.sizes
        parts = [f"B={B} T={T} S={S} N={N} K={K} H={H} {self.dtype} seed={self.seed}",
                 repr(self.statics)]  # fmt: skip
        for name in ("offset", "kv_lengths", "q_ids", "kv_ids"):
            x = getattr(self, name)
            if x is not None:
                parts.append(f"{name}={np.asarray(x).tolist()}")
        if self.mask is not None:
            parts.append(f"mask {self.mask.shape}, {self.mask.mean():.2f} True")
        if self.bias is not None:
            parts.append(f"bias {self.bias.shape}")
        parts.append(f"bad={self.bad}")
        if self.poison is not None:
            parts.append(f"poison={self.poison[2]} in {self.poison[0]}{list(self.poison[1])}")
        return "; ".join(parts)


def _shape(letters: str, sizes: dict) -> tuple:
    return tuple(1 if a == "1" else sizes[a] for a in letters.split())


@dataclasses.dataclass(frozen=True)
class Program:
    """What a call compiles: sizes, dtype, static arguments, and which optional arrays
    it has (with their shapes). Calls of one program differ only in values."""

    B: int
    T: int
    S: int
    N: int
    K: int
    H: int
    dtype: str
    statics: Statics
    offset_values: object  # strategy of q_offset values, or None
    lengths: bool
    segments: bool
    mask_shape: tuple | None
    bias_shape: tuple | None
    features: tuple


@st.composite
def programs(draw, native_only: bool = False) -> Program:
    """A valid call's static part. ``native_only``: only what the native kernel can
    serve (float32 or bfloat16, no dense mask, no bias)."""
    B = draw(st.integers(1, 3))
    T, S = draw(st.sampled_from(TIMES)), draw(st.sampled_from(TIMES))
    K, G = draw(st.integers(1, 3)), draw(st.integers(1, 3))
    N, H = K * G, draw(st.sampled_from(WIDTHS))
    served = ("float32", "bfloat16") if native_only else tuple(DTYPES)
    dtype = draw(st.sampled_from(served))
    features = [dtype]
    if G > 1:
        features.append("gqa" if K > 1 else "mqa")

    is_causal = draw(st.booleans())
    window = None
    if draw(st.booleans()):
        side = st.one_of(st.sampled_from((0, 1)), st.integers(0, S + 1))
        window = draw(st.one_of(side, st.tuples(side, side)))
        features.append("window-int" if isinstance(window, int) else "window-pair")
    offset_mode, static_offset, values = "none", None, None
    if is_causal or window is not None:
        modes = ["static", "traced", "rows"] + (["none"] * 2 if T == S else [])
        offset_mode = draw(st.sampled_from(modes))
        values = st.one_of(st.sampled_from((0, S - T)), st.integers(-T - 1, S + 1))
        if offset_mode == "static":
            static_offset = draw(values)
        features.append(f"offset-{offset_mode}")
    features += ["causal"] * is_causal
    lengths, segments = draw(st.booleans()), draw(st.booleans())
    features += ["lengths"] * lengths + ["segments"] * segments

    sizes = dict(B=B, T=T, S=S, N=N)
    mask_shape = bias_shape = None
    if not native_only and draw(st.integers(0, 3)) == 0:
        mask_shape = _shape(draw(st.sampled_from(MASK_SHAPES)), sizes)
        features.append("mask")
    if not native_only and draw(st.integers(0, 3)) == 0:
        bias_shape = _shape(draw(st.sampled_from(BIAS_SHAPES)), sizes)
        features.append("bias")

    soft_cap = draw(st.sampled_from(SOFT_CAPS))
    scale = draw(st.sampled_from(SCALES))
    features += ["soft-cap"] * (soft_cap is not None) + ["scale"] * (scale is not None)
    tiles = None
    if draw(st.booleans()):  # flash with small tiles: several blocks, padded last ones
        tile = st.tuples(st.sampled_from((1, 3, 8, 16, 64)), st.sampled_from((1, 5, 16, 64)),
                         st.integers(1, 3))  # fmt: skip
        tiles = (draw(tile), draw(tile))
        features.append("flash-tiles")
    statics = Statics(is_causal, offset_mode, static_offset, window, soft_cap, scale, tiles)
    return Program(B, T, S, N, K, H, dtype, statics, values, lengths, segments, mask_shape,
                   bias_shape, tuple(features))  # fmt: skip


@st.composite
def inputs(draw, p: Program, poison: bool = True) -> Call:
    """The values of one call of program ``p``: arrays, traced offsets, key lengths
    (0 and S often), segment ids (packed runs or random), mask, bias, the NaN or inf
    written where nothing may look, and (a third of the calls, with ``poison``) one
    NaN or inf where some query does look."""
    B, T, S, N, K, H = p.B, p.T, p.S, p.N, p.K, p.H
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    features = list(p.features)
    offset = None
    if p.statics.offset == "traced":
        offset = np.asarray(draw(p.offset_values), np.int32)
    elif p.statics.offset == "rows":
        offset = np.asarray(draw(st.lists(p.offset_values, min_size=B, max_size=B)), np.int32)
    kv_lengths = None
    if p.lengths:
        one = st.one_of(st.sampled_from((0, S)), st.integers(0, S))
        kv_lengths = np.asarray(draw(st.lists(one, min_size=B, max_size=B)), np.int32)
        features += ["length-0"] * bool((kv_lengths == 0).any())
        features += ["length-S"] * bool((kv_lengths == S).any())
    q_ids = kv_ids = None
    if p.segments:
        ids = draw(st.integers(1, 3))
        if draw(st.booleans()):  # packed documents: runs of ids, padding -1 at the start

            def runs(L):
                cuts = np.sort(rng.integers(0, L + 1, size=(B, ids)), axis=1)
                return (np.arange(L)[None, None] >= cuts[:, :, None]).sum(1) - 1

            q_ids, kv_ids = runs(T), runs(S)
        else:
            q_ids, kv_ids = rng.integers(0, ids, (B, T)), rng.integers(0, ids, (B, S))
        if T == S and draw(st.booleans()):
            kv_ids = q_ids  # self-attention over packed sequences
        q_ids, kv_ids = q_ids.astype(np.int32), kv_ids.astype(np.int32)
    dt = DTYPES[p.dtype]
    mask = bias = None
    if p.mask_shape is not None:
        mask = rng.random(p.mask_shape) < draw(st.sampled_from((0.1, 0.5, 0.9, 1.0)))
    if p.bias_shape is not None:
        bias = rng.standard_normal(p.bias_shape) * draw(st.sampled_from((0.5, 3.0)))
        bias = bias.astype(dt)
    magnitude = draw(st.sampled_from((1.0, 4.0)))
    q = (rng.standard_normal((B, T, N, H)) * magnitude).astype(dt)
    k = (rng.standard_normal((B, S, K, H)) * magnitude).astype(dt)
    v = rng.standard_normal((B, S, K, H)).astype(dt)
    d_out = rng.standard_normal((B, T, N, H)).astype(dt)
    bad = draw(st.sampled_from((None, "nan", "inf", "-inf")))
    features += [f"bad-{bad}"] if bad else []
    call = Call(p.statics, p.dtype, q, k, v, d_out, bias, mask, offset, kv_lengths, q_ids,
                kv_ids, bad, tuple(features), seed)  # fmt: skip
    if not poison or draw(st.integers(0, 2)):  # a third of the calls
        return call
    places = _seen_places(call)
    if not places:
        return call
    array = draw(st.sampled_from(sorted(places)))
    candidates = places[array]
    index = tuple(int(i) for i in candidates[rng.integers(len(candidates))])
    if array != "bias":
        index += (int(rng.integers(H)),)  # one feature of the head
    kind = draw(st.sampled_from(("nan", "inf", "-inf")))
    features = (*call.features, f"poison-{kind}", f"poison-{array}")
    return dataclasses.replace(call, poison=(array, index, kind), features=features)


def _seen_places(call: Call) -> dict:
    """Where some query looks, per array: query rows (b, t, n) that see a key, keys and
    values (b, s, k) that a query sees, bias cells seen wherever they broadcast."""
    B, T, S, N, K, _ = call.sizes
    allowed = call.allowed()  # (B, N, T, S)
    places = {}
    rows = np.argwhere(np.moveaxis(allowed.any(-1), 1, 2))  # (b, t, n)
    if len(rows):
        places["query"] = rows
    keys = np.argwhere(allowed.reshape(B, K, N // K, T, S).any(axis=(2, 3)).transpose(0, 2, 1))
    if len(keys):  # (b, s, k)
        places["key"] = places["value"] = keys
    if call.bias is not None:
        seen = sum_to_shape(allowed.astype(np.float64), call.bias.shape).reshape(call.bias.shape)
        cells = np.argwhere(seen > 0)
        if len(cells):
            places["bias"] = cells
    return places


@st.composite
def calls(draw, native_only: bool = False) -> list[Call]:
    """VARIANTS calls of one program: they share its compiled code, so the values
    vary at almost no cost (compiling dominates an example's time)."""
    p = draw(programs(native_only))
    # The native-only test runs no reference backend to hold a poisoned call against.
    return [draw(inputs(p, poison=not native_only)) for _ in range(VARIANTS)]


# ---------------------------------------------------------------------------------------
# Running a backend: one jitted program per (backend, statics, shapes), reused by jit.


@functools.partial(jax.jit, static_argnames=("backend", "statics"))
def _output_and_gradients(backend, statics, q, k, v, bias, d_out, mask, offset, lengths, ids):
    s = statics
    kwargs = dict(
        mask=mask, is_causal=s.is_causal, kv_lengths=lengths, window=s.window,
        q_segment_ids=ids[0], kv_segment_ids=ids[1], logit_soft_cap=s.soft_cap, scale=s.scale,
    )  # fmt: skip
    if s.offset == "static":
        kwargs["q_offset"] = s.static_offset
    elif s.offset != "none":
        kwargs["q_offset"] = offset
    if backend == "flash" and s.tiles is not None:
        attend = functools.partial(
            nanoattn.flash_attention, forward_tiles=s.tiles[0], backward_tiles=s.tiles[1]
        )
    else:
        attend = functools.partial(nanoattn.dot_product_attention, implementation=backend)

    def f(q, k, v, bias):
        return attend(q, k, v, bias=bias, **kwargs)

    out, pull = jax.vjp(f, q, k, v, bias)
    return out, pull(d_out)


def run_backend(backend: str, call: Call):
    """(out, dq, dk, dv, dbias) of one backend on the call's dirty (and poisoned)
    inputs, as float64."""
    q, k, v, bias = call.poisoned()
    ids = (call.q_ids, call.kv_ids)
    out, grads = _output_and_gradients(
        backend, call.statics, q, k, v, bias, call.d_out, call.mask, call.offset,
        call.kv_lengths, ids,
    )  # fmt: skip
    return [None if x is None else np.asarray(x, np.float64) for x in (out, *grads)]


# ---------------------------------------------------------------------------------------
# The references and the criterion.

QUANTITIES = ("out", "dq", "dk", "dv", "dbias")


def _np_f64(x):
    return None if x is None else np.asarray(x, np.float32).astype(np.float64)


def truth(call: Call):
    """Float64 (out, dq, dk, dv, dbias) of the clean inputs (_reference.py's reference)."""
    q, k, v, d_out, bias = map(_np_f64, (call.q, call.k, call.v, call.d_out, call.bias))
    out, (dq, dk, dv, dbias) = np_attention_vjp(
        q, k, v, d_out, call.allowed(), bias, call.statics.scale, call.statics.soft_cap
    )
    dbias = None if bias is None else sum_to_shape(dbias, bias.shape).reshape(bias.shape)
    return [out, dq, dk, dv, dbias]


def low_precision_reference(call: Call):
    """The same formulas in float32 numpy (the softmax precision the contract asks for),
    each result rounded to the call's dtype: its error is the reference's own error in
    that dtype. Also returns, per quantity, the largest sum of absolute terms (the
    scale of a float32 rounding error there), for the floor under the criterion."""
    f32 = np.float32
    q, k, v, d_out = (np.asarray(x, f32) for x in (call.q, call.k, call.v, call.d_out))
    B, _, S, N, K, H = call.sizes
    G = N // K
    scale = f32(1 / np.sqrt(H) if call.statics.scale is None else call.statics.scale)
    allowed = call.allowed()
    k_rep, v_rep = np.repeat(k, G, axis=2), np.repeat(v, G, axis=2)  # (B, S, N, H)
    logits = np.einsum("btnh,bsnh->bnts", q, k_rep) * scale
    if call.bias is not None:
        logits = logits + np.asarray(call.bias, f32)
    cap = call.statics.soft_cap
    capped = logits if cap is None else f32(cap) * np.tanh(logits / f32(cap))
    z = np.where(allowed, capped, -np.inf)
    top = z.max(-1, keepdims=True)
    e = np.where(allowed, np.exp(z - np.where(np.isfinite(top), top, 0)), f32(0))
    total = e.sum(-1, keepdims=True)
    w = e / np.where(total == 0, 1, total)
    out = np.einsum("bnts,bsnh->btnh", w, v_rep)
    dw = np.einsum("btnh,bsnh->bnts", d_out, v_rep)
    ds = w * (dw - (w * dw).sum(-1, keepdims=True))
    if cap is not None:
        ds = ds * (1 - np.tanh(logits / f32(cap)) ** 2)
    dq = scale * np.einsum("bnts,bsnh->btnh", ds, k_rep)
    dk = scale * np.einsum("bnts,btnh->bsnh", ds, q).reshape(B, S, K, G, H).sum(3)
    dv = np.einsum("bnts,btnh->bsnh", w, d_out).reshape(B, S, K, G, H).sum(3)
    bias_shape = None if call.bias is None else call.bias.shape
    dbias = None if bias_shape is None else sum_to_shape(ds, bias_shape).reshape(bias_shape)
    dt = DTYPES[call.dtype]
    rounded = [None if x is None else _np_f64(np.asarray(x, f32).astype(dt))
               for x in (out, dq, dk, dv, dbias)]  # fmt: skip
    # Sums of absolute terms: a rounding error of a sum scales with them, not with it;
    # and a weight's relative error with its row's largest |logit| (exp turns the
    # logit's absolute rounding error into a relative one).
    a_logits = np.einsum("btnh,bsnh->bnts", np.abs(q), np.abs(k_rep)) * abs(scale)
    if call.bias is not None:
        a_logits = a_logits + np.abs(np.asarray(call.bias, f32))
    row = 1 + np.where(allowed, a_logits, 0).max(-1, keepdims=True)  # (B, N, T, 1)
    a_dw = np.einsum("btnh,bsnh->bnts", np.abs(d_out), np.abs(v_rep))
    a_w = w * row
    a_ds = a_w * (a_dw + (w * a_dw).sum(-1, keepdims=True))
    terms = [
        np.einsum("bnts,bsnh->btnh", a_w, np.abs(v_rep)),
        abs(scale) * np.einsum("bnts,bsnh->btnh", a_ds, np.abs(k_rep)),
        abs(scale) * np.einsum("bnts,btnh->bsnh", a_ds, np.abs(q)),
        np.einsum("bnts,btnh->bsnh", a_w, np.abs(d_out)),
        None if bias_shape is None else sum_to_shape(a_ds, bias_shape),
    ]
    sizes = [None if x is None else float(x.max(initial=0)) for x in terms]
    return rounded, sizes


def ulp(dtype: str, x: float) -> float:
    """One unit in the last place of ``dtype`` at magnitude ``x`` (0 for x = 0)."""
    if x == 0:
        return 0.0
    return float(jnp.finfo(DTYPES[dtype]).eps) * 2.0 ** np.floor(np.log2(x))


def max_error(a, b) -> float:
    """max |a - b|, inf when either has a NaN or inf where the other does not match."""
    if a.size == 0:
        return 0.0
    with np.errstate(invalid="ignore"):
        diff = np.abs(a - b)
    return float("inf") if not np.isfinite(diff).all() else float(diff.max())


@dataclasses.dataclass
class Verdict:
    """Each backend's error ratio per quantity (error / (reference error + floor / 2);
    the criterion is ratio <= 2), the pairwise ratios, and what failed."""

    ratios: dict
    pair_ratios: dict
    failures: list


def check(call: Call, backends=None, results=None) -> Verdict:
    """Runs every backend that can serve ``call`` (or takes their ``results``: name ->
    (out, dq, dk, dv, dbias) in float64) and compares each with the truth and with
    the others (FlashAttention's criterion, see the module docstring)."""
    if results is None:
        results = {name: run_backend(name, call) for name in backends or call.backends()}
    want = truth(call)
    low, sizes = low_precision_reference(call)
    ratios, pair_ratios, failures = {}, {}, []
    regions = call.regions() if call.poison is not None else [None] * len(QUANTITIES)
    if call.poison is not None:
        failures += _hidden_poison(call, results)
    for i, quantity in enumerate(QUANTITIES):
        if want[i] is None:
            continue
        if regions[i] is not None:  # the poison's reach is held to _hidden_poison's rule
            outside = ~regions[i]
            want, low = _only(want, i, outside), _only(low, i, outside)
            results = {n: _only(r, i, outside) for n, r in results.items()}
        ref_err = max_error(low[i], want[i])
        floor = FLOOR_ULPS * EPS32 * sizes[i]
        unit = ref_err + floor / 2
        bound = 2 * unit
        for name, got in results.items():
            if got[i] is None:
                continue
            err = max_error(got[i], want[i])
            ratios[name, quantity] = err / unit if unit else (0.0 if err == 0 else float("inf"))
            if not err <= bound:
                failures.append(
                    f"{name} {quantity}: error {err:.3g} > 2 x reference error {ref_err:.3g}"
                    f" + floor {floor:.3g}"
                )
        # Two backends: each within the bound of the truth, and within it of each other
        # but for one rounding of the result to the dtype (two correct roundings of
        # nearly equal numbers may differ by one unit in the last place).
        pair_bound = bound + ulp(call.dtype, float(np.abs(want[i]).max(initial=0)))
        names = [n for n in results if results[n][i] is not None]
        for a, b in itertools.combinations(names, 2):
            err = max_error(results[a][i], results[b][i])
            pair_ratios[f"{a}-{b}", quantity] = (
                err / unit if unit else (0.0 if err == 0 else float("inf"))
            )
            if not err <= pair_bound:
                failures.append(f"{a} vs {b} {quantity}: differ by {err:.3g} > {pair_bound:.3g}")
    return Verdict(ratios, pair_ratios, failures)


def _only(values: list, i: int, where) -> list:
    """``values`` with its ``i``-th quantity restricted to the entries ``where``."""
    values = list(values)
    values[i] = None if values[i] is None else values[i][where]
    return values


def _hidden_poison(call: Call, results: dict) -> list[str]:
    """Where the reference (``"xla"``, which defines the contract) makes a NaN or inf
    of the poison visible, every backend must too: the output rows (B, T, N) that look
    at the poison, one by one, and each gradient somewhere in each batch row and
    key/value head group it reaches. Elsewhere in the reach a backend may show it or
    not (the reference's own spread to rows blocked from it, ``0 * NaN``, is not the
    contract); everything outside the reach :func:`check` holds to the clean truth."""
    if "xla" not in results:
        return []
    B, T, _, N, K, H = call.sizes
    G = N // K
    found = []
    grouped = {  # quantity -> (index in QUANTITIES, how its entries map to (B, K) groups)
        "out": (0, lambda x: x.reshape(B, T, N, H).any(-1)),
        "dq": (1, lambda x: x.reshape(B, T, K, G, H).any(axis=(1, 3, 4))),
        "dk": (2, lambda x: x.any(axis=(1, 3))),
        "dv": (3, lambda x: x.any(axis=(1, 3))),
    }
    seers = call.seers()
    for quantity, (i, group) in grouped.items():
        shows = group(~np.isfinite(results["xla"][i]))
        if quantity == "out":
            shows &= seers
        for name, got in results.items():
            hidden = shows & ~group(~np.isfinite(got[i]))
            if hidden.any():
                where = tuple(int(a) for a in np.argwhere(hidden)[0])
                found.append(f"{name} {quantity}: finite at {where}, where the reference "
                             f"shows the poison as NaN or inf")  # fmt: skip
    return found


# ---------------------------------------------------------------------------------------
# The campaign's record, printed (and written to NANOATTN_FUZZ_SUMMARY) at the end.


class Record:
    """What one fuzz test drew and found: programs (examples) and calls, their time,
    counts per backend, dtype and feature, the worst error ratios, the failures."""

    def __init__(self, program_cache=None):
        self.seconds = []  # per program: compiling and checking its calls
        self.calls = 0
        self.backends = collections.Counter()
        self.dtypes = collections.Counter()
        self.features = collections.Counter()
        self.combinations = set()
        self.worst = {}
        self.worst_pairs = {}
        self.failures = []
        self.first_failure = None  # (programs checked, seconds spent checking)
        self.program_cache = program_cache or _output_and_gradients

    def add_program(self, seconds: float):
        self.seconds.append(seconds)

    def add(self, call: Call, verdict: Verdict, test: str):
        self.calls += 1
        self.dtypes[call.dtype] += 1
        self.features.update(call.features)
        self.combinations.add(tuple(sorted(set(call.features))))
        for name in {n for n, _ in verdict.ratios}:
            self.backends[name] += 1
        for (name, quantity), r in verdict.ratios.items():
            key = f"{call.dtype} {name} {quantity}"
            self.worst[key] = max(self.worst.get(key, 0.0), r)
        for (pair, quantity), r in verdict.pair_ratios.items():
            key = f"{call.dtype} {pair} {quantity}"
            self.worst_pairs[key] = max(self.worst_pairs.get(key, 0.0), r)
        if verdict.failures:
            self.failures.append({"test": test, "call": call.describe(),
                                  "failures": verdict.failures})  # fmt: skip
            if self.first_failure is None:  # hypothesis then shrinks it: the first counts
                self.first_failure = (len(self.seconds), float(sum(self.seconds)))

    def summary(self) -> dict:
        s = np.array(self.seconds or [0.0])
        return {
            "examples (programs)": len(self.seconds),
            "calls": self.calls,
            "seconds": round(float(s.sum()), 1),
            "seconds per example": {
                "mean": round(float(s.mean()), 3),
                "median": round(float(np.median(s)), 3),
                "max": round(float(s.max()), 3),
            },
            "compiled programs (all tests)": int(self.program_cache._cache_size()),
            "calls per backend": dict(self.backends),
            "calls per dtype": dict(self.dtypes),
            "calls per feature": dict(sorted(self.features.items())),
            "feature combinations": len(self.combinations),
            "worst error ratio (limit 2)": {k: round(v, 3) for k, v in sorted(self.worst.items())},
            "worst pairwise ratio": {k: round(v, 3) for k, v in sorted(self.worst_pairs.items())},
            "failures": self.failures,
            "first failure (programs, seconds)": self.first_failure,
        }


# ---------------------------------------------------------------------------------------
# Budgets and regressions.


def budget(n: int):
    """Hypothesis settings for ``n`` examples: derandomised unless NANOATTN_FUZZ_SEED
    is set (then seeded by it), no deadline (compiling dominates), no database."""

    def apply(test):
        test = settings(
            max_examples=max(1, n), deadline=None, derandomize=SEED is None, database=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
        )(test)  # fmt: skip
        return test if SEED is None else hypothesis_seed(int(SEED))(test)

    return apply


def concrete_call(B, T, S, N, K, H, dtype, seed, bad=None, **statics) -> Call:
    """A call with seeded normal q, k, v and cotangent, and the given static arguments."""
    rng = np.random.default_rng(seed)
    dt = DTYPES[dtype]
    q, d_out = (rng.standard_normal((B, T, N, H)).astype(dt) for _ in range(2))
    k, v = (rng.standard_normal((B, S, K, H)).astype(dt) for _ in range(2))
    return Call(Statics(**statics), dtype, q, k, v, d_out, bad=bad, seed=seed)
