"""The machinery of the differential fuzzing (test_fuzz.py says what it draws and why).

A drawn call (:class:`Statics`, :class:`Call`, :class:`Program`, and the hypothesis
strategies :func:`programs`, :func:`inputs`, :func:`calls`), running a backend on it
(:func:`run_backend`), the float64 truth and the reference's own error in the call's
dtype (:func:`truth`, :func:`low_precision_reference`), FlashAttention's criterion
(:func:`check`, giving a :class:`Verdict`), a campaign's :class:`Record`, the
hypothesis settings of a budget (:func:`budget`) and a seeded call for regression
tests (:func:`concrete_call`). Shared by test_fuzz.py, the ring's script
_fuzz_ring.py and the regression tests of test_flash.py.

The drawn ``mask_fn`` and ``score_fn`` come from small families with random
parameters (:class:`MaskFn`, :class:`ScoreFn`), each written twice: once as the jax
function the call gets (:func:`mask_fn_of`, :func:`score_fn_of`), once as a literal
numpy mask or bias for the reference (:func:`np_mask_of`, :func:`np_score_bias`).
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
from nanoattn._backends import dispatch, native, registry
from nanoattn._base import rules

from _reference import (
    np_attention,
    np_attention_vjp,
    np_causal,
    np_lengths,
    np_lse,
    np_segments,
    np_window,
    sum_to_shape,
)

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
MASK_FAMILIES = ("documents", "prefix_lm", "head_windows", "chunked", "block_sparse")
SCORE_FAMILIES = ("alibi", "relative", "softcap")
SPARSE_BLOCK = 64  # the block of the block-sparse masks: the block classification's own
SPARSE_BLOCKS = 4  # blocks per side of a block-sparse pattern (positions past it: the last)
# Sinks in every dtype. In bfloat16 and float16 the fuzz found flash and native (which get
# the sinks merged into their output through its log-sum-exp) failing the criterion when
# the merge took their output rounded to the dtype (out up to 3.5x, dv 17x, dsinks 78x the
# reference's error); they now attend in float32 and round once (_attention._with_sinks,
# pinned by tests/core/test_mask_fn.py).
SINK_DTYPES = tuple(DTYPES)


# ---------------------------------------------------------------------------------------
# The families of mask_fn and score_fn, each written twice: the jax function the call
# gets and, independently, the numpy literal the reference gets.


def mask_fn_of(family: str, params):
    """The ``mask_fn(b, n, q_pos, k_pos)`` of ``family``, closing over ``params`` (an
    int32 jax array: concrete, or traced when it is a jit argument)."""
    match family:
        case "documents":  # params: ids (B, L) of positions 0 .. L-1, the ends clamped
            last = params.shape[1] - 1

            def documents(b, n, q, k):
                return params[b, jnp.clip(q, 0, last)] == params[b, jnp.clip(k, 0, last)]

            return documents
        case "prefix_lm":  # params: the prefix (B,) of each row, seen both ways
            return lambda b, n, q, k: (k <= q) | (k < params[b])
        case "head_windows":  # params: (left, right) per head (N, 2)
            return lambda b, n, q, k: (q - params[n, 0] <= k) & (k <= q + params[n, 1])
        case "chunked":  # params: (1,) the chunk; attention within chunks (Llama 4)
            return lambda b, n, q, k: q // params[0] == k // params[0]
        case "block_sparse":  # params: (N, 4, 4) which 64-blocks of positions may attend
            last = params.shape[1] - 1

            def block_sparse(b, n, q, k):
                qb = jnp.clip(q // SPARSE_BLOCK, 0, last)
                kb = jnp.clip(k // SPARSE_BLOCK, 0, last)
                return params[n, qb, kb] != 0

            return block_sparse
    raise AssertionError(family)


def np_mask_of(family: str, params: np.ndarray, b, n, q, k) -> np.ndarray:
    """The literal mask of ``family`` on numpy index grids b (B, 1, 1, 1), n (1, N, 1, 1),
    q (B, 1, T, 1) (each row's own positions) and k (1, 1, 1, S); broadcastable to
    (B, N, T, S)."""
    if family == "documents":
        L = params.shape[1]
        doc_q = np.take_along_axis(params, np.clip(q[:, 0, :, 0], 0, L - 1), axis=1)  # (B, T)
        doc_k = params[:, np.clip(k[0, 0, 0], 0, L - 1)]  # (B, S)
        return (doc_q[:, :, None] == doc_k[:, None, :])[:, None]
    if family == "prefix_lm":
        return (k <= q) | (k < params.reshape(-1, 1, 1, 1))
    if family == "head_windows":
        left, right = params[:, 0].reshape(1, -1, 1, 1), params[:, 1].reshape(1, -1, 1, 1)
        return (q - left <= k) & (k <= q + right)
    if family == "chunked":
        return np.floor_divide(q, params[0]) == np.floor_divide(k, params[0])
    if family == "block_sparse":
        blocks = params.shape[1]
        qb = np.minimum(np.maximum(np.floor_divide(q, SPARSE_BLOCK), 0), blocks - 1)
        kb = np.minimum(np.floor_divide(k, SPARSE_BLOCK), blocks - 1)
        heads = np.arange(params.shape[0]).reshape(1, -1, 1, 1)
        return params[heads, qb, kb] != 0
    raise AssertionError(family)


def mask_params(family: str, rng, B: int, N: int, T: int, S: int) -> np.ndarray:
    """Random int32 parameters of ``family`` for a call of these sizes (their shape
    depends on the sizes only, so that they can be a jit argument)."""
    match family:
        case "documents":  # positions -T-1 .. S+T+1 reach ids of 0 .. S+T+1 clamped
            L = S + T + 2
            if rng.random() < 0.5:  # packed documents: runs of ids
                cuts = np.sort(rng.integers(0, L + 1, size=(B, int(rng.integers(1, 5)))), axis=1)
                ids = (np.arange(L)[None, None] >= cuts[:, :, None]).sum(1)
            else:
                ids = rng.integers(0, 3, (B, L))
        case "prefix_lm":
            ids = rng.integers(0, S + 2, (B,))
        case "head_windows":
            narrow = rng.integers(0, 4, (N, 2))
            ids = np.where(rng.random((N, 2)) < 0.5, narrow, rng.integers(0, S + 2, (N, 2)))
        case "chunked":
            ids = rng.integers(1, S + 3, (1,))
        case "block_sparse":
            density = rng.choice((0.25, 0.5, 0.75))
            ids = rng.random((N, SPARSE_BLOCKS, SPARSE_BLOCKS)) < density
    return np.asarray(ids, np.int32)


def score_fn_of(family: str, params, cap: float | None, radius: int):
    """The ``score_fn(score, b, n, q_pos, k_pos)`` of ``family``: ALiBi with slopes
    ``params`` (N,), a relative bias from the table ``params`` (N, 2 radius + 1)
    indexed by clip(q - k), or a tanh soft-cap at ``cap``."""
    match family:
        case "alibi":
            return lambda s, b, n, q, k: s - params[n] * (q - k).astype(s.dtype)
        case "relative":
            return lambda s, b, n, q, k: s + params[n, jnp.clip(q - k, -radius, radius) + radius]
        case "softcap":
            return lambda s, b, n, q, k: cap * jnp.tanh(s / cap)
    raise AssertionError(family)


def np_score_bias(family: str, params: np.ndarray, radius: int, n, distance):
    """The bias (B, N, T, S) that ``score_fn`` ``family`` adds, written again in numpy in
    the parameters' dtype, from n (1, N, 1, 1) and the positions' difference q - k
    (B, 1, T, S), ints; None for the soft-cap (the reference gets it as ``soft_cap``)."""
    if family == "alibi":
        return -params.reshape(1, -1, 1, 1) * distance.astype(params.dtype)
    if family == "relative":
        return params[n, np.minimum(np.maximum(distance, -radius), radius) + radius]
    return None


def np_score_grad(family: str, params: np.ndarray, radius: int, d_bias, n, distance):
    """The gradient to ``score_fn``'s parameters from the gradient ``d_bias`` (B, N, T, S)
    of the bias it adds: ALiBi's slopes sum d_bias * (-(q - k)) per head; a table entry
    sums d_bias over the cells that read it."""
    if family == "alibi":
        return (d_bias * -distance).sum(axis=(0, 2, 3))
    if family == "relative":
        index = np.broadcast_to(np.clip(distance, -radius, radius) + radius, d_bias.shape)
        grad = np.zeros(params.shape, d_bias.dtype)
        for j in range(2 * radius + 1):
            grad[:, j] = np.where(index == j, d_bias, 0).sum(axis=(0, 2, 3))
        return grad
    return None


def _frozen(x: np.ndarray) -> tuple:
    """An array as a hashable (shape, values), for a static argument."""
    return (x.shape, tuple(x.ravel().tolist()))


def _thawed(x: tuple) -> np.ndarray:
    return np.array(x[1], np.int32).reshape(x[0])


_BLOCK_MASKS = {}  # (MaskFn, B, N, T, S, q_offset) -> the BlockMask of a static mask_fn


@dataclasses.dataclass(frozen=True)
class MaskFn:
    """A drawn ``mask_fn``: its family, and how the call gets it. ``how`` is "closed"
    (it closes over a concrete jax array of ``params``, so flash classifies its blocks
    at trace time) or "traced" (the parameters are a jit argument, :attr:`Call.mask_params`:
    the classification is made at run time); ``block_mask``: the call gets
    ``nanoattn.block_mask(mask_fn, ...)`` of it (:meth:`build` says where it is built)."""

    family: str
    how: str = "closed"
    block_mask: bool = False
    params: tuple | None = None  # "closed": the parameters, as _frozen gives them

    def __repr__(self):
        return f"MaskFn({self.family}, {self.how}{', block_mask' if self.block_mask else ''})"

    def features(self) -> list[str]:
        """The fuzz record's feature names of this draw."""
        return [f"mask_fn-{self.family}", f"mask_fn-{self.how}"] + ["block_mask"] * self.block_mask

    def build(self, traced, B: int, N: int, T: int, S: int, q_offset):
        """The function the call gets (``traced``: the parameters as a jit argument). A
        block_mask of static things is built once, outside jit, and reused by every
        backend and call of the program, as a model reuses one across layers and steps."""
        if self.block_mask and self.how == "closed" and (q_offset is None or type(q_offset) is int):
            key = (self, B, N, T, S, q_offset)
            if key not in _BLOCK_MASKS:
                with jax.ensure_compile_time_eval():
                    _BLOCK_MASKS[key] = self._build(None, B, N, T, S, q_offset)
            return _BLOCK_MASKS[key]
        return self._build(traced, B, N, T, S, q_offset)

    def _build(self, traced, B: int, N: int, T: int, S: int, q_offset):
        if self.how == "closed":
            with jax.ensure_compile_time_eval():  # a concrete array, even under jit
                params = jnp.asarray(_thawed(self.params))
        else:
            params = jnp.asarray(traced)
        fn = mask_fn_of(self.family, params)
        if not self.block_mask:
            return fn
        mask = nanoattn.block_mask(fn, B, N, T, S, q_offset=q_offset)
        # Classified at trace time exactly when nothing it depends on is traced.
        static = not any(isinstance(x, jax.core.Tracer) for x in (params, q_offset))
        assert mask.static == static, (self, mask.static)
        return mask


@dataclasses.dataclass(frozen=True)
class ScoreFn:
    """A drawn ``score_fn``: ALiBi ("alibi", slopes (N,)), a relative bias ("relative", a
    table (N, 2 radius + 1)) or a tanh soft-cap ("softcap" at ``cap``). The slopes and
    the table (:attr:`Call.score_params`) are differentiated: the call's function closes
    over them inside the differentiated function."""

    family: str
    cap: float | None = None
    radius: int = 0

    def build(self, params):
        """The function the call gets, closing over ``params`` (traced when differentiated)."""
        return score_fn_of(self.family, None if params is None else jnp.asarray(params),
                           self.cap, self.radius)  # fmt: skip


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
    mask_fn: MaskFn | None = None
    score_fn: ScoreFn | None = None
    sinks: bool = False  # the call has sinks (N,): Call.sinks
    residual: bool = False  # return_residual=True: (out, lse), with a cotangent for both


_SERVED = {}  # Call.backends' answers, per program


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
    mask_params: np.ndarray | None = None  # a "traced" mask_fn's parameters (int32)
    score_params: np.ndarray | None = None  # score_fn's slopes or table (float32)
    sinks: np.ndarray | None = None  # (N,) float32
    d_lse: np.ndarray | None = None  # the log-sum-exp's cotangent (B, T, N), with residual

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

    def grid(self):
        """Numpy index grids of the cells: b (B, 1, 1, 1), n (1, N, 1, 1), each row's
        query positions q (B, 1, T, 1) and the keys' k (1, 1, 1, S)."""
        B, T, S, N, _, _ = self.sizes
        b = np.arange(B).reshape(B, 1, 1, 1)
        n = np.arange(N).reshape(1, N, 1, 1)
        q = (self.offsets()[:, None] + np.arange(T)).reshape(B, 1, T, 1)
        return b, n, q, np.arange(S).reshape(1, 1, 1, S)

    def mask_values(self) -> np.ndarray | None:
        """The drawn mask_fn's parameters, closed over or traced."""
        m = self.statics.mask_fn
        if m is None:
            return None
        return _thawed(m.params) if m.how == "closed" else self.mask_params

    def score_bias(self, dtype=np.float64):
        """(B, N, T, S): what score_fn adds to the scores (None for none or the soft-cap),
        in ``dtype`` from the float32 parameters."""
        f = self.statics.score_fn
        if f is None or f.family == "softcap":
            return None
        _, n, q, k = self.grid()
        return np_score_bias(f.family, self.score_params.astype(dtype), f.radius, n, q - k)

    def soft_cap(self) -> float | None:
        """The reference's soft cap: the call's, or score_fn's tanh cap."""
        f = self.statics.score_fn
        return f.cap if f is not None and f.family == "softcap" else self.statics.soft_cap

    def allowed(self) -> np.ndarray:
        """(B, N, T, S): which key each query may see, from the literal rules of _reference.py
        and the literal mask of the drawn mask_fn."""
        B, T, S, N, _, _ = self.sizes
        s = self.statics
        allowed = np.ones((B, N, T, S), bool)
        if s.mask_fn is not None:
            allowed &= np_mask_of(s.mask_fn.family, self.mask_values(), *self.grid())
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
        """The registered backends that serve this call: each is asked
        (``dispatch.refusal``, as the dispatcher asks it) about the call's rules, once
        per program (the answer
        depends on shapes, dtypes and static arguments, not on values)."""
        shapes = [None if x is None else np.shape(x) for x in (
            self.bias, self.mask, self.offset, self.kv_lengths, self.q_ids, self.score_params,
            self.sinks)]  # fmt: skip
        key = (self.statics, self.dtype, self.sizes, *shapes)
        if key not in _SERVED:
            _SERVED[key] = self._ask_backends()
        return list(_SERVED[key])

    def _ask_backends(self) -> list[str]:
        q, k, v = (jnp.asarray(x) for x in (self.q, self.k, self.v))
        kwargs = _attention_kwargs(self.statics, self.sizes, self.mask, self.offset,
                                   self.kv_lengths, (self.q_ids, self.kv_ids),
                                   self.mask_values())  # fmt: skip
        if self.statics.score_fn is not None:
            kwargs["score_fn"] = self.statics.score_fn.build(self.score_params)
        spec = rules.Rules.make(q, k, v, bias=self.bias, sinks=self.sinks,
                                    scale=self.statics.scale, **kwargs)  # fmt: skip
        dtype = DTYPES[self.dtype]
        return [name for name in registry.names()
                if dispatch.refusal(registry.get(name), spec, dtype, 0.0) is None]  # fmt: skip

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
        """Per quantity (QUANTITIES), where the poison may reach, broadcast to the
        quantity's shape (None for a quantity the call lacks)."""
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
        lse = np.broadcast_to(rows[..., 0], (B, T, N)) if self.statics.residual else None
        heads = np.repeat(groups.any(0), N // K)  # (N,): the sinks and score_fn's arrays
        dsinks = heads if self.sinks is not None else None
        dscore = None
        if self.score_params is not None:
            shape = self.score_params.shape
            dscore = np.broadcast_to(heads.reshape((N,) + (1,) * (len(shape) - 1)), shape)
        return [out, out, kv, kv, dbias, lse, dsinks, dscore]

    def describe(self) -> str:
        B, T, S, N, K, H = self.sizes
        parts = [f"B={B} T={T} S={S} N={N} K={K} H={H} {self.dtype} seed={self.seed}",
                 repr(self.statics)]  # fmt: skip
        if self.statics.mask_fn is not None:
            parts.append(f"mask_fn params={self.mask_values().tolist()}")
        for name in ("offset", "kv_lengths", "q_ids", "kv_ids", "sinks", "score_params"):
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


@functools.cache
def native_serves(feature: str) -> bool:
    """Whether the native kernel serves a call with ``feature`` ("mask_fn", "score_fn",
    "sinks", "residual"), as its ``unsupported`` says about a small such call."""
    if native.load()[0] is None:
        return False
    q = k = jnp.zeros((1, 3, 1, 8), jnp.float32)
    extra = {
        "mask_fn": dict(mask_fn=lambda b, n, qp, kp: kp <= qp),
        "score_fn": dict(score_fn=lambda s, b, n, qp, kp: s - (qp - kp)),
        "sinks": dict(sinks=jnp.zeros((1,), jnp.float32)),
        "residual": dict(return_residual=True),
    }[feature]
    spec = rules.Rules.make(q, k, k, **extra)
    return registry.get("native").unsupported(spec, jnp.float32, 0.0) is None


@st.composite
def mask_fns(draw, B: int, N: int, T: int, S: int):
    """A :class:`MaskFn` of a family, closed over concrete parameters (twice as often)
    or traced, in a third of the draws wrapped in a ``block_mask``."""
    family = draw(st.sampled_from(MASK_FAMILIES))
    how = draw(st.sampled_from(("closed", "closed", "traced")))
    wrapped = draw(st.integers(0, 2)) == 2
    params = None
    if how == "closed":  # a static argument: the calls of the program share it
        rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
        params = _frozen(mask_params(family, rng, B, N, T, S))
    return MaskFn(family, how, wrapped, params)


@st.composite
def score_fns(draw, soft_cap):
    """A :class:`ScoreFn`; the soft-cap family only without ``soft_cap`` (the reference
    has one cap)."""
    family = draw(st.sampled_from(SCORE_FAMILIES[: 3 if soft_cap is None else 2]))
    cap = draw(st.sampled_from(SOFT_CAPS[1:])) if family == "softcap" else None
    radius = draw(st.integers(0, 8)) if family == "relative" else 0
    return ScoreFn(family, cap, radius)


def _may_draw(feature: str, native_only: bool) -> bool:
    return not native_only or native_serves(feature)


@st.composite
def programs(draw, native_only: bool = False) -> Program:
    """A valid call's static part. ``native_only``: only what the native kernel can
    serve (float32 or bfloat16, no dense mask, no bias, and of mask_fn, score_fn,
    sinks and the residual what it says it serves)."""
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

    # mask_fn, score_fn, the sinks (float32 only) and the residual each in about half of
    # the programs (mask_fn in a sixth for native, whose programs otherwise compile in a
    # tenth of the time); hypothesis shrinks each away (to False, or to 0 below its max).
    def half_or_a_sixth() -> bool:
        return draw(st.integers(0, 5)) == 5 if native_only else draw(st.booleans())

    mask_fn = None
    if _may_draw("mask_fn", native_only) and half_or_a_sixth():
        mask_fn = draw(mask_fns(B, N, T, S))
        features += mask_fn.features()
    soft_cap = draw(st.sampled_from(SOFT_CAPS))
    scale = draw(st.sampled_from(SCALES))
    features += ["soft-cap"] * (soft_cap is not None) + ["scale"] * (scale is not None)
    score_fn = None
    if _may_draw("score_fn", native_only) and draw(st.booleans()):
        score_fn = draw(score_fns(soft_cap))
        features.append(f"score_fn-{score_fn.family}")
    offset_mode, static_offset, values = "none", None, None
    positional = is_causal or window is not None
    if positional or mask_fn is not None or score_fn is not None:
        # Without a positional rule (mask_fn, score_fn only) q_offset defaults to 0.
        modes = ["static", "traced", "rows"] + (["none"] * 2 if T == S or not positional else [])
        offset_mode = draw(st.sampled_from(modes))
        values = st.one_of(st.sampled_from((0, S - T)), st.integers(-T - 1, S + 1))
        if offset_mode == "static":
            static_offset = draw(values)
        features.append(f"offset-{offset_mode}")
    features += ["causal"] * is_causal
    lengths, segments = draw(st.booleans()), draw(st.booleans())
    features += ["lengths"] * lengths + ["segments"] * segments
    sinks = dtype in SINK_DTYPES and _may_draw("sinks", native_only)
    sinks = sinks and draw(st.booleans())
    residual = _may_draw("residual", native_only) and draw(st.booleans())
    features += ["sinks"] * sinks + ["residual"] * residual

    sizes = dict(B=B, T=T, S=S, N=N)
    mask_shape = bias_shape = None
    if not native_only and draw(st.integers(0, 3)) == 0:
        mask_shape = _shape(draw(st.sampled_from(MASK_SHAPES)), sizes)
        features.append("mask")
    if not native_only and draw(st.integers(0, 3)) == 0:
        bias_shape = _shape(draw(st.sampled_from(BIAS_SHAPES)), sizes)
        features.append("bias")

    tiles = None
    if draw(st.booleans()):  # flash with small tiles: several blocks, padded last ones
        tile = st.tuples(st.sampled_from((1, 3, 8, 16, 64)), st.sampled_from((1, 5, 16, 64)),
                         st.integers(1, 3))  # fmt: skip
        tiles = (draw(tile), draw(tile))
        features.append("flash-tiles")
    statics = Statics(is_causal, offset_mode, static_offset, window, soft_cap, scale, tiles,
                      mask_fn, score_fn, sinks, residual)  # fmt: skip
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
    s = p.statics
    traced = None
    if s.mask_fn is not None and s.mask_fn.how == "traced":
        traced = mask_params(s.mask_fn.family, rng, B, N, T, S)
    score = None
    if s.score_fn is not None and s.score_fn.family == "alibi":
        score = rng.uniform(-1, 1, (N,)) * draw(st.sampled_from((0.05, 0.5)))
    elif s.score_fn is not None and s.score_fn.family == "relative":
        table = (N, 2 * s.score_fn.radius + 1)
        score = rng.standard_normal(table) * draw(st.sampled_from((0.5, 3.0)))
    score = None if score is None else score.astype(np.float32)
    sinks = None
    if s.sinks:
        sinks = (rng.standard_normal((N,)) * draw(st.sampled_from((1.0, 4.0)))).astype(np.float32)
    d_lse = rng.standard_normal((B, T, N)).astype(np.float32) if s.residual else None
    call = Call(p.statics, p.dtype, q, k, v, d_out, bias, mask, offset, kv_lengths, q_ids,
                kv_ids, bad, tuple(features), seed, None, traced, score, sinks, d_lse)  # fmt: skip
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


def _attention_kwargs(s: Statics, sizes, mask, offset, lengths, ids, mask_params) -> dict:
    """The keyword arguments of the call but score_fn, sinks and bias (which are
    differentiated): its rules, q_offset (static or ``offset``), the mask_fn."""
    B, T, S, N, _, _ = sizes
    kwargs = dict(
        mask=mask, is_causal=s.is_causal, kv_lengths=lengths, window=s.window,
        q_segment_ids=ids[0], kv_segment_ids=ids[1], logit_soft_cap=s.soft_cap,
    )  # fmt: skip
    q_offset = None
    if s.offset == "static":
        q_offset = s.static_offset
    elif s.offset != "none":
        q_offset = offset
    if q_offset is not None:
        kwargs["q_offset"] = q_offset
    if s.mask_fn is not None:
        kwargs["mask_fn"] = s.mask_fn.build(mask_params, B, N, T, S, q_offset)
    if s.residual:
        kwargs["return_residual"] = True
    return kwargs


@functools.partial(jax.jit, static_argnames=("backend", "statics"))
def _output_and_gradients(backend, statics, q, k, v, bias, d_out, mask, offset, lengths, ids,
                          mask_params=None, score_params=None, sinks=None, d_lse=None):  # fmt: skip
    s = statics
    kwargs = _attention_kwargs(s, (*q.shape[:2], k.shape[1], q.shape[2], *k.shape[2:]), mask,
                               offset, lengths, ids, mask_params)  # fmt: skip
    kwargs["scale"] = s.scale
    if backend == "flash" and s.tiles is not None:
        attend = functools.partial(
            nanoattn.flash_attention, forward_tiles=s.tiles[0], backward_tiles=s.tiles[1]
        )
    else:
        attend = functools.partial(nanoattn.dot_product_attention, implementation=backend)

    def f(q, k, v, bias, score_params, sinks):
        extra = {} if s.score_fn is None else {"score_fn": s.score_fn.build(score_params)}
        return attend(q, k, v, bias=bias, sinks=sinks, **kwargs, **extra)

    out, pull = jax.vjp(f, q, k, v, bias, score_params, sinks)
    return out, pull((d_out, d_lse) if s.residual else d_out)


def run_backend(backend: str, call: Call):
    """(out, dq, dk, dv, dbias, lse, dsinks, dscore) of one backend on the call's dirty
    (and poisoned) inputs, as float64 (None where the call has no such thing)."""
    q, k, v, bias = call.poisoned()
    ids = (call.q_ids, call.kv_ids)
    out, (dq, dk, dv, dbias, dscore, dsinks) = _output_and_gradients(
        backend, call.statics, q, k, v, bias, call.d_out, call.mask, call.offset,
        call.kv_lengths, ids, call.mask_params, call.score_params, call.sinks, call.d_lse,
    )  # fmt: skip
    out, lse = out if call.statics.residual else (out, None)
    found = (out, dq, dk, dv, dbias, lse, dsinks, dscore)
    return [None if x is None else np.asarray(x, np.float64) for x in found]


# ---------------------------------------------------------------------------------------
# The references and the criterion.

# dsinks: the gradient to the sinks (N,); dscore: to the arrays score_fn closes over.
QUANTITIES = ("out", "dq", "dk", "dv", "dbias", "lse", "dsinks", "dscore")
FLOAT32_QUANTITIES = ("lse", "dsinks", "dscore")  # float32 whatever the call's dtype


def _np_f64(x):
    return None if x is None else np.asarray(x, np.float32).astype(np.float64)


def _plus(a, b):
    """a + b where either may be None (broadcast)."""
    return b if a is None else a if b is None else a + b


def truth(call: Call):
    """Float64 (out, dq, dk, dv, dbias, lse, dsinks, dscore) of the clean inputs
    (_reference.py's reference, given score_fn as its bias or soft cap, and mask_fn
    as its literal mask), None where the call has no such thing."""
    q, k, v, d_out, bias = map(_np_f64, (call.q, call.k, call.v, call.d_out, call.bias))
    sinks = _np_f64(call.sinks)
    scale, cap, allowed = call.statics.scale, call.soft_cap(), call.allowed()
    total_bias = _plus(bias, call.score_bias())
    out, grads = np_attention_vjp(q, k, v, d_out, allowed, total_bias, scale, cap, sinks=sinks)
    dq, dk, dv, ds = grads[:4]
    dsinks = grads[4] if sinks is not None else None
    lse = None
    if call.statics.residual:
        lse = np_lse(q, k, allowed, total_bias, scale, cap, sinks)
        dq, dk, ds, dsinks = _lse_cotangent(call, (q, k, v), total_bias, (dq, dk, ds, dsinks))
    dbias = None if bias is None else sum_to_shape(ds, bias.shape).reshape(bias.shape)
    dscore = None
    f = call.statics.score_fn
    if f is not None and f.family != "softcap":
        _, n, qp, kp = call.grid()
        dscore = np_score_grad(f.family, call.score_params, f.radius, ds, n, qp - kp)
    return [out, dq, dk, dv, dbias, lse, dsinks, dscore]


def _lse_cotangent(call: Call, qkv, bias, grads):
    """(dq, dk, dbias (B, N, T, S), dsinks) with the log-sum-exp's cotangent's share
    added: d lse / d logit = the weight P (the reference's, sinks included), times the
    cap's 1 - tanh^2; d lse / d sink = the sink's weight 1 - sum_s P (1 for a row that
    sees no key: its lse is the sink)."""
    q, k, v = qkv
    dq, dk, ds, dsinks = grads
    B, _, S, N, K, H = call.sizes
    scale = 1 / np.sqrt(H) if call.statics.scale is None else call.statics.scale
    cap, sinks = call.soft_cap(), _np_f64(call.sinks)
    w = np_attention(q, k, v, call.allowed(), bias, scale, True, cap, sinks)  # (B, N, T, S)
    d_lse = np.moveaxis(call.d_lse.astype(np.float64), 2, 1)[..., None]  # (B, N, T, 1)
    extra = w * d_lse
    k_rep = np.repeat(k, N // K, axis=2)  # (B, S, N, H)
    if cap is not None:
        logits = np.einsum("btnh,bsnh->bnts", q, k_rep) * scale
        extra = extra * (1 - np.tanh(_plus(logits, bias) / cap) ** 2)
    dq = dq + scale * np.einsum("bnts,bsnh->btnh", extra, k_rep)
    dk = dk + scale * np.einsum("bnts,btnh->bsnh", extra, q).reshape(B, S, K, N // K, H).sum(3)
    if dsinks is not None:
        dsinks = dsinks + ((1 - w.sum(-1, keepdims=True)) * d_lse).sum(axis=(0, 2, 3))
    return dq, dk, ds + extra, dsinks


def low_precision_reference(call: Call):
    """The same formulas in float32 numpy (the softmax precision the contract asks for),
    each result rounded to the call's dtype (the log-sum-exp and the gradients to the
    float32 sinks and score_fn's arrays stay float32): its error is the reference's own
    error in that dtype. Also returns, per quantity, the largest sum of absolute terms
    (the scale of a float32 rounding error there), for the floor under the criterion."""
    f32 = np.float32
    q, k, v, d_out = (np.asarray(x, f32) for x in (call.q, call.k, call.v, call.d_out))
    B, _, S, N, K, H = call.sizes
    G = N // K
    scale = f32(1 / np.sqrt(H) if call.statics.scale is None else call.statics.scale)
    allowed = call.allowed()
    k_rep, v_rep = np.repeat(k, G, axis=2), np.repeat(v, G, axis=2)  # (B, S, N, H)
    logits = np.einsum("btnh,bsnh->bnts", q, k_rep) * scale
    bias = _plus(None if call.bias is None else np.asarray(call.bias, f32), call.score_bias(f32))
    if bias is not None:
        logits = logits + bias
    cap = call.soft_cap()
    capped = logits if cap is None else f32(cap) * np.tanh(logits / f32(cap))
    z = np.where(allowed, capped, -np.inf)
    top = z.max(-1, keepdims=True)  # (B, N, T, 1)
    sink = None if call.sinks is None else np.asarray(call.sinks, f32).reshape(1, N, 1, 1)
    if sink is not None:
        top = np.maximum(top, sink)
    shift = np.where(np.isfinite(top), top, 0)
    e = np.where(allowed, np.exp(z - shift), f32(0))
    total = e.sum(-1, keepdims=True)
    e_sink = f32(0) if sink is None else np.exp(sink - shift)
    denom = total + e_sink
    safe = np.where(denom == 0, 1, denom)
    w = e / safe
    w_sink = e_sink / safe  # the sink's weight: 1 in a row that sees no key
    out = np.einsum("bnts,bsnh->btnh", w, v_rep)
    dw = np.einsum("btnh,bsnh->bnts", d_out, v_rep)
    row_term = (w * dw).sum(-1, keepdims=True)
    d_lse = 0 if call.d_lse is None else np.moveaxis(call.d_lse.astype(f32), 2, 1)[..., None]
    ds = w * (dw - row_term + d_lse)
    if cap is not None:
        ds = ds * (1 - np.tanh(logits / f32(cap)) ** 2)
    dq = scale * np.einsum("bnts,bsnh->btnh", ds, k_rep)
    dk = scale * np.einsum("bnts,btnh->bsnh", ds, q).reshape(B, S, K, G, H).sum(3)
    dv = np.einsum("bnts,btnh->bsnh", w, d_out).reshape(B, S, K, G, H).sum(3)
    bias_shape = None if call.bias is None else call.bias.shape
    dbias = None if bias_shape is None else sum_to_shape(ds, bias_shape).reshape(bias_shape)
    lse = dsinks = dscore = None
    if call.statics.residual:
        with np.errstate(divide="ignore"):
            lse = np.moveaxis((np.log(denom) + shift)[..., 0], 1, 2)  # -inf: nothing seen
    if sink is not None:
        dsinks = (w_sink * (d_lse - row_term)).sum(axis=(0, 2, 3))
    f = call.statics.score_fn
    _, n, qp, kp = call.grid()
    if f is not None and f.family != "softcap":
        dscore = np_score_grad(f.family, call.score_params, f.radius, ds, n, qp - kp)
    dt = DTYPES[call.dtype]
    rounded = [None if x is None else _np_f64(np.asarray(x, f32).astype(dt))
               for x in (out, dq, dk, dv, dbias)]  # fmt: skip
    rounded += [_np_f64(x) for x in (lse, dsinks, dscore)]
    # Sums of absolute terms: a rounding error of a sum scales with them, not with it;
    # and a weight's relative error with its row's largest |logit| (exp turns the
    # logit's absolute rounding error into a relative one).
    a_logits = np.einsum("btnh,bsnh->bnts", np.abs(q), np.abs(k_rep)) * abs(scale)
    if bias is not None:
        a_logits = a_logits + np.abs(bias)
    row = 1 + np.where(allowed, a_logits, 0).max(-1, keepdims=True)  # (B, N, T, 1)
    if sink is not None:
        row = np.maximum(row, 1 + np.abs(sink))
    a_dw = np.einsum("btnh,bsnh->bnts", np.abs(d_out), np.abs(v_rep))
    a_w = w * row
    a_row_term = (w * a_dw).sum(-1, keepdims=True)
    a_ds = a_w * (a_dw + a_row_term + np.abs(d_lse))
    terms = [
        np.einsum("bnts,bsnh->btnh", a_w, np.abs(v_rep)),
        abs(scale) * np.einsum("bnts,bsnh->btnh", a_ds, np.abs(k_rep)),
        abs(scale) * np.einsum("bnts,btnh->bsnh", a_ds, np.abs(q)),
        np.einsum("bnts,btnh->bsnh", a_w, np.abs(d_out)),
        None if bias_shape is None else sum_to_shape(a_ds, bias_shape),
        None if lse is None else row + np.log1p(S),
        None if sink is None else (w_sink * row * (a_row_term + np.abs(d_lse))).sum((0, 2, 3)),
        None if dscore is None else _score_terms(f, call.score_params, a_ds, n, qp - kp),
    ]  # fmt: skip
    sizes = [None if x is None else float(np.abs(x).max(initial=0)) for x in terms]
    return rounded, sizes


def _score_terms(f: ScoreFn, params, a_ds, n, distance):
    """The sums of absolute terms of the gradient to score_fn's parameters."""
    if f.family == "alibi":
        return (a_ds * np.abs(distance)).sum(axis=(0, 2, 3))
    return np_score_grad(f.family, params, f.radius, a_ds, n, distance)


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
        diff = np.where(a == b, 0, np.abs(a - b))  # equal infinities (an empty row's lse) agree
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
    the QUANTITIES in float64, None where absent) and compares each with the truth and
    with the others (FlashAttention's criterion, see the module docstring)."""
    if results is None:
        results = {name: run_backend(name, call) for name in backends or call.backends()}
    # Results of fewer quantities (the ring's: out, dq, dk, dv, dbias) lack the rest.
    results = {n: list(r) + [None] * (len(QUANTITIES) - len(r)) for n, r in results.items()}
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
        dtype = "float32" if quantity in FLOAT32_QUANTITIES else call.dtype
        finite = np.abs(want[i])[np.isfinite(want[i])]
        pair_bound = bound + ulp(dtype, float(finite.max(initial=0)))
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
    at the poison, one by one, and their log-sum-exps, and each gradient somewhere in
    each batch row and key/value head group it reaches. Elsewhere in the reach a
    backend may show it or not (the reference's own spread to rows blocked from it,
    ``0 * NaN``, is not the contract); everything outside the reach :func:`check`
    holds to the clean truth."""
    if "xla" not in results:
        return []
    B, T, _, N, K, H = call.sizes
    G = N // K
    found = []
    grouped = {  # quantity -> (index in QUANTITIES, how its entries map to (B, K) groups)
        "out": (0, lambda x: x.reshape(B, T, N, H).any(-1)),
        "lse": (5, lambda x: x),  # (B, T, N), like the output's rows
        "dq": (1, lambda x: x.reshape(B, T, K, G, H).any(axis=(1, 3, 4))),
        "dk": (2, lambda x: x.any(axis=(1, 3))),
        "dv": (3, lambda x: x.any(axis=(1, 3))),
    }
    seers = call.seers()
    for quantity, (i, group) in grouped.items():
        if results["xla"][i] is None:
            continue
        shows = group(~np.isfinite(results["xla"][i]))
        if quantity in ("out", "lse"):
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


def concrete_call(B, T, S, N, K, H, dtype, seed, bad=None, mask_params=None, score_params=None,
                  sinks=None, **statics) -> Call:  # fmt: skip
    """A call with seeded normal q, k, v and cotangents, the given static arguments
    (``mask_fn=MaskFn(...)``, ``score_fn=ScoreFn(...)``, ``residual=True``, ...) and the
    arrays they need: a traced mask_fn's parameters, score_fn's, the sinks (N,)."""
    rng = np.random.default_rng(seed)
    dt = DTYPES[dtype]
    q, d_out = (rng.standard_normal((B, T, N, H)).astype(dt) for _ in range(2))
    k, v = (rng.standard_normal((B, S, K, H)).astype(dt) for _ in range(2))
    s = Statics(**statics, sinks=sinks is not None)
    d_lse = rng.standard_normal((B, T, N)).astype(np.float32) if s.residual else None
    score_params, sinks = (None if x is None else np.asarray(x, np.float32)
                           for x in (score_params, sinks))  # fmt: skip
    return Call(s, dtype, q, k, v, d_out, bad=bad, seed=seed, mask_params=mask_params,
                score_params=score_params, sinks=sinks, d_lse=d_lse)  # fmt: skip
