"""Shared test helpers: an independent float64 numpy reference and random inputs.

Sizes are distinct primes where possible (B=2, T=5, S=7, N=6, K=2, H=8 and
friends) so that a swapped axis changes a shape or a value and fails.

Hypothesis runs under the profile named by the HYPOTHESIS_PROFILE environment
variable: "ci" (the default) is derandomised, so every run draws the same
examples and a red property test is a real regression, never bad luck; "dev"
(`HYPOTHESIS_PROFILE=dev make test`) draws fresh examples on each run and
prints a blob to replay any failure it finds, to hunt for new bugs locally.
"""

import dataclasses
import functools
import os
from typing import Any

import jax
import numpy as np
import pytest
from hypothesis import settings

settings.register_profile("ci", derandomize=True, database=None)
settings.register_profile("dev", derandomize=False, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

# The suite compiles at XLA's lowest backend optimisation level: compiling, not
# running, dominates its time, and -O0 took the whole run from 17.4 to 11.2
# CPU-minutes on a 2-core AMD EPYC (AVX2). Optimisation should change how fast the
# programs run, not what they compute; the one place where the suite saw otherwise
# (huge logits under jit, test_nonfinite.py) compiles at XLA's default level,
# OPTIMIZED. Set before any test initialises the backend; a caller's own
# XLA_FLAGS setting of the level is kept.
OPTIMIZED = {"xla_backend_optimization_level": 3}  # XLA's default level
if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0"
    ).strip()


def _np_weights(q, k, allowed, bias, scale, soft_cap):
    """Float64 logits (before the cap) and weights (B, N, T, S), and k repeated per head."""
    B, T, N, H = q.shape
    S, K = k.shape[1], k.shape[2]
    k = np.repeat(k, N // K, axis=2)  # (B, S, N, H): heads n*G .. n*G+G-1 share one
    scale = 1 / np.sqrt(H) if scale is None else scale
    logits = np.einsum("btnh,bsnh->bnts", q, k) * scale
    if bias is not None:
        logits = logits + np.asarray(bias, np.float64)
    capped = logits if soft_cap is None else soft_cap * np.tanh(logits / soft_cap)
    allowed = np.ones((B, N, T, S), bool) if allowed is None else np.asarray(allowed)
    allowed = np.broadcast_to(allowed, (B, N, T, S))
    weights = np.zeros((B, N, T, S))
    for idx in np.ndindex(B, N, T):
        row = allowed[idx]
        if row.any():
            z = capped[idx][row]
            e = np.exp(z - z.max())
            weights[idx][row] = e / e.sum()
    return logits, weights, k


def np_attention(q, k, v, allowed=None, bias=None, scale=None, return_weights=False, soft_cap=None):
    """Attention in float64 numpy, written without the library's code.

    q: (B, T, N, H); k, v: (B, S, K, H); query head n uses key/value head
    n // (N // K). ``allowed``/``bias`` broadcast to (B, N, T, S). A row with no
    allowed key gives zeros. ``soft_cap`` c turns the logits s into
    c * tanh(s / c) before the softmax.
    """
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    _, weights, _ = _np_weights(q, k, allowed, bias, scale, soft_cap)
    v = np.repeat(v, q.shape[2] // v.shape[2], axis=2)
    out = np.einsum("bnts,bsnh->btnh", weights, v)
    return weights if return_weights else out


def np_attention_vjp(q, k, v, d_out, allowed=None, bias=None, scale=None, soft_cap=None):
    """The output of :func:`np_attention` and its gradients, derived by hand in float64.

    Returns ``out, (dq, dk, dv, dbias)`` for the cotangent ``d_out`` (B, T, N, H);
    ``dbias`` has the full shape (B, N, T, S) (sum it to the bias's shape with
    :func:`sum_to_shape`). With P the weights, dP = dO V^T, the softmax gives
    dZ = P * (dP - rowsum(P * dP)); the cap multiplies it by 1 - tanh^2(s / c);
    then dq = scale * dS K, dk = scale * dS^T Q, dv = P^T dO, each key/value
    head summing over its G query heads.
    """
    q, k, v, d_out = (np.asarray(a, np.float64) for a in (q, k, v, d_out))
    B, _, N, H = q.shape
    S, K = k.shape[1], k.shape[2]
    scale = 1 / np.sqrt(H) if scale is None else scale
    logits, w, k_rep = _np_weights(q, k, allowed, bias, scale, soft_cap)
    v_rep = np.repeat(v, N // K, axis=2)  # (B, S, N, H)
    out = np.einsum("bnts,bsnh->btnh", w, v_rep)
    dw = np.einsum("btnh,bsnh->bnts", d_out, v_rep)
    ds = w * (dw - (w * dw).sum(-1, keepdims=True))
    if soft_cap is not None:
        ds = ds * (1 - np.tanh(logits / soft_cap) ** 2)
    dq = scale * np.einsum("bnts,bsnh->btnh", ds, k_rep)
    dk = scale * np.einsum("bnts,btnh->bsnh", ds, q).reshape(B, S, K, N // K, H).sum(3)
    dv = np.einsum("bnts,btnh->bsnh", w, d_out).reshape(B, S, K, N // K, H).sum(3)
    return out, (dq, dk, dv, ds)


def sum_to_shape(x, shape):
    """Sums ``x`` over the axes where ``shape`` (same rank, or lower) broadcasts."""
    x = np.asarray(x)
    shape = (1,) * (x.ndim - len(shape)) + tuple(shape)
    axes = tuple(i for i, (a, b) in enumerate(zip(x.shape, shape)) if b == 1 and a != 1)
    return x.sum(axis=axes, keepdims=True).reshape(shape)


def np_causal(T, S, q_offset=0):
    """Literal positional rule: query i (at q_offset + i) sees key j iff j <= q_offset + i."""
    return np.array([[j <= q_offset + i for j in range(S)] for i in range(T)])


def np_window(T, S, q_offset, left, right):
    """Literal window rule: query i (at p = q_offset + i) sees key j iff
    p - left <= j <= p + right. An int offset gives (T, S); a (B,) offset gives
    (B, 1, T, S)."""
    offsets = np.asarray(q_offset)
    if offsets.ndim == 1:
        return np.stack([np_window(T, S, int(o), left, right) for o in offsets])[:, None]
    p = int(q_offset)
    return np.array([[p + i - left <= j <= p + i + right for j in range(S)] for i in range(T)])


def np_segments(q_ids, kv_ids):
    """Packed sequences: (B, 1, T, S), query i sees key j iff their ids are equal."""
    q_ids, kv_ids = np.asarray(q_ids), np.asarray(kv_ids)
    return (q_ids[:, :, None] == kv_ids[:, None, :])[:, None]


def np_lengths(lengths, S):
    """(B, 1, 1, S): key j of row b is valid iff j < lengths[b]."""
    return (np.arange(S) < np.asarray(lengths)[:, None])[:, None, None, :]


def np_rope(x, positions, base=10000.0):
    """Rotary embedding in float64, half-split: feature i pairs with feature i + H/2
    and turns by the angle position * base ** (-2 i / H). Negative positions undo it."""
    x = np.asarray(x, np.float64)
    H = x.shape[-1]
    positions = np.broadcast_to(np.asarray(positions, np.float64), x.shape[:2])  # (B, L)
    out = np.empty_like(x)
    for i in range(H // 2):
        angle = positions * base ** (-2 * i / H)  # (B, L)
        c, s = np.cos(angle)[..., None], np.sin(angle)[..., None]  # (B, L, 1)
        a, b = x[..., i], x[..., i + H // 2]  # (B, L, N)
        out[..., i] = a * c - b * s
        out[..., i + H // 2] = b * c + a * s
    return out


def randn(seed, *shape, dtype=np.float32):
    return np.random.default_rng(seed).standard_normal(shape).astype(dtype)


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
    """The functional core with one backend: ``"xla"`` or ``"flash"`` (small tiles by default)."""
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


def assert_cases_match(
    cases, implementations=("xla", "flash"), tiles=None, atol=2e-5, grad_atol=1e-4
):
    """Every case's output and gradients, in each backend, against its float64 truth.

    Returns ``{implementation: [(out, grads) per case]}`` for further checks.
    """
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


@pytest.fixture
def x64():
    """Runs the test with 64-bit floats enabled."""
    with jax.enable_x64(True):
        yield


@pytest.fixture(scope="session")
def default_audit():
    """Exit status and stdout of a plain `nanoattn audit`, run once per session."""
    import contextlib
    import io

    from nanoattn.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(["audit"])
    return code, out.getvalue()


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
