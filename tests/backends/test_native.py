"""The native C++ kernel against the float64 reference: the backend test base (every
rule alone and together, masked content, vmap, bfloat16), then lengths across its
blocks, ragged rows, x64, transformations, dispatch, refusals, bfloat16 and its ISA
builds (its block classification: test_native_blocks.py; its build, cache and
fallbacks: test_native_build.py; its mask_fn: test_native_mask_fn.py)."""

import functools
import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import nanoattn
from nanoattn._backends import native as native_kernel

from _backend_base import BackendTestBase
from _cases import jit_vjp
from _reference import np_attention_vjp, np_causal, np_lengths, np_segments, np_window, randn

pytestmark = pytest.mark.skipif(
    native_kernel.load()[0] is None, reason="the native kernel could not be built here"
)


class TestNative(BackendTestBase):
    """The backend test base (tests/_backend_base.py); the calls with a dense mask, a
    bias or score_fn are refused, the rest match float64."""

    implementation = "native"


def np_allowed(kwargs, B, T, S):
    """(B, 1, T, S): what the positional band, key lengths and segments let through."""
    allowed = np.ones((B, 1, T, S), bool)
    offsets = np.broadcast_to(np.asarray(kwargs.get("q_offset", 0)), (B,))
    for b, off in enumerate(offsets):
        if kwargs.get("is_causal"):
            allowed[b, 0] &= np_causal(T, S, int(off))
        if "window" in kwargs:
            w = kwargs["window"]
            left, right = (w, w) if isinstance(w, int) else w
            allowed[b, 0] &= np_window(T, S, int(off), left, right)
    if "kv_lengths" in kwargs:
        allowed &= np_lengths(kwargs["kv_lengths"], S)
    if "q_segment_ids" in kwargs:
        allowed &= np_segments(kwargs["q_segment_ids"], kwargs["kv_segment_ids"])
    return allowed


def run_and_truth(q, k, v, **kwargs):
    """The native kernel's output and (dq, dk, dv) under jit, and the float64 truth."""
    B, T, _, _ = q.shape
    cot = randn(99, *q.shape)

    @jax.jit
    def forward_backward(q, k, v, cot):
        out, vjp = jax.vjp(
            lambda q, k, v: nanoattn.dot_product_attention(
                q, k, v, implementation="native", **kwargs
            ),
            q, k, v,
        )  # fmt: skip
        return out, vjp(cot)

    got = forward_backward(q, k, v, cot)
    allowed = np_allowed(kwargs, B, T, k.shape[1])
    want, (dq, dk, dv, _) = np_attention_vjp(
        q, k, v, cot, allowed, None, kwargs.get("scale"), kwargs.get("logit_soft_cap")
    )
    return got, (want, (dq, dk, dv))


def assert_close(got, truth):
    (out, grads), (want, want_grads) = got, truth
    np.testing.assert_allclose(out, want, atol=1e-5, rtol=1e-5)
    for name, g, w in zip(("dq", "dk", "dv"), grads, want_grads):
        np.testing.assert_allclose(g, w, atol=1e-4, rtol=1e-4, err_msg=name)


@pytest.mark.parametrize("T", [1, 7, 129, 1000])
@pytest.mark.parametrize("is_causal", [True, False])
def test_lengths_across_block_edges(T, is_causal):
    N, K, H = (4, 1, 16) if T == 1000 else (6, 2, 5)
    B = 1 if T == 1000 else 3
    q, k, v = randn(T, B, T, N, H), randn(T + 1, B, T, K, H), randn(T + 2, B, T, K, H)
    assert_close(*run_and_truth(q, k, v, is_causal=is_causal))


def test_ragged_per_row_offsets_and_lengths():
    # Decoding-style: each row's queries sit at its own position; some rows see nothing.
    B, T, S, N, K, H = 4, 70, 150, 6, 3, 24
    q, k, v = randn(1, B, T, N, H), randn(2, B, S, K, H), randn(3, B, S, K, H)
    offsets = jnp.asarray([80, 0, -75, 140], jnp.int32)
    lengths = jnp.asarray([150, 65, 150, 0], jnp.int32)
    got, truth = run_and_truth(q, k, v, is_causal=True, q_offset=offsets, kv_lengths=lengths)
    assert_close(got, truth)
    assert (np.asarray(got[0][3]) == 0).all()  # a row with no keys gives zeros


def test_under_x64_its_operands_stay_32_bit(x64):
    # With jax_enable_x64 JAX's default ints and floats widen to 64 bits; the kernel's
    # offsets, lengths, empty segment ids, keys and values must still reach it as 32.
    B, T, S, N, K, H = 2, 9, 13, 4, 2, 8
    q, k, v = randn(11, B, T, N, H), randn(12, B, S, K, H), randn(13, B, S, K, H)
    assert_close(*run_and_truth(q, k, v))
    lengths = np.array([13, 6], np.int64)
    assert_close(*run_and_truth(q, k, v, is_causal=True, q_offset=4, kv_lengths=lengths))


def test_vmap_over_an_extra_axis_equals_a_loop():
    q, k, v = randn(1, 3, 2, 40, 4, 8), randn(2, 3, 2, 40, 2, 8), randn(3, 3, 2, 40, 2, 8)

    def attend(q, k, v):
        return nanoattn.dot_product_attention(q, k, v, is_causal=True, implementation="native")

    def loss(q, k, v):
        return jnp.sum(jnp.sin(jax.vmap(attend)(q, k, v)))

    out = jax.jit(jax.vmap(attend))(q, k, v)
    grads = jax.grad(loss, argnums=(0, 1, 2))(q, k, v)
    for i in range(3):
        np.testing.assert_allclose(out[i], attend(q[i], k[i], v[i]), atol=1e-6)
        one = jax.grad(lambda *a: jnp.sum(jnp.sin(attend(*a))), argnums=(0, 1, 2))
        for g, r in zip(grads, one(q[i], k[i], v[i])):
            np.testing.assert_allclose(g[i], r, atol=1e-6)


def test_automatic_choice_takes_it_where_it_serves():
    from nanoattn._backends.dispatch import choose
    from nanoattn._backends.native.backend import CPU_MIN_CELLS
    from nanoattn._base.rules import Rules

    side = int(np.ceil(np.sqrt(CPU_MIN_CELLS)))
    z = jnp.zeros((1, side, 2, 8))
    assert choose(None, Rules.make(z, z, z, is_causal=True), jnp.float32, 0.0) == "native"
    spec = Rules.make(z, z, z, bias=jnp.zeros((1, 1, side, side)))
    assert choose(None, spec, jnp.float32, 0.0) != "native"
    assert choose(None, Rules.make(z, z, z), jnp.bfloat16, 0.0) != "native"  # too short
    assert choose(None, Rules.make(z, z, z), jnp.float16, 0.0) != "native"


BIAS = "a bias is served by 'xla', 'flash' and 'cudnn' only"
MASK = "a dense mask is served by 'xla', 'flash' and 'cudnn' only"


@pytest.mark.parametrize(
    "kwargs, dtype, says",
    [
        (dict(bias=jnp.zeros((1, 1, 9, 9))), jnp.float32, BIAS),
        (dict(mask=jnp.ones((9, 9), bool)), jnp.float32, MASK),
        (
            dict(dropout_rate=0.1, dropout_rng=jax.random.key(0)),
            jnp.float32,
            "dropout is only implemented by the reference (implementation='xla')",
        ),
        ({}, jnp.float16, "it supports float32 and bfloat16 inputs only, got float16"),
    ],
)
def test_a_call_it_cannot_serve_by_name_raises_one_line(kwargs, dtype, says):
    z = jnp.zeros((1, 9, 2, 8), dtype)
    with pytest.raises(ValueError) as info:
        nanoattn.dot_product_attention(z, z, z, implementation="native", **kwargs)
    assert str(info.value) == f"implementation='native' cannot serve this call: {says}"


def test_a_traced_scale_goes_elsewhere_and_by_name_says_why():
    z = jnp.zeros((1, 9, 2, 8), jnp.float32)
    with pytest.raises(ValueError) as info:
        jax.jit(
            lambda s: nanoattn.dot_product_attention(z, z, z, scale=s, implementation="native")
        )(0.5)
    says = "it needs a Python number for scale, not a traced array"
    assert str(info.value) == f"implementation='native' cannot serve this call: {says}"
    automatic = jax.jit(lambda s: nanoattn.dot_product_attention(z, z, z, scale=s))(0.5)
    np.testing.assert_allclose(automatic, nanoattn.dot_product_attention(z, z, z, scale=0.5))


@pytest.mark.parametrize(
    "T, S, kwargs",
    [
        (1, 150, dict(is_causal=True, q_offset=149)),  # a decode step
        (70, 70, dict(is_causal=True)),
        (129, 67, dict(window=(20, 3), q_offset=jnp.asarray([0, 40], jnp.int32))),
        (65, 65, dict(is_causal=True, logit_soft_cap=5.0, kv_lengths=jnp.asarray([65, 30]))),
    ],
)
def test_bfloat16_is_as_close_to_the_truth_as_the_reference_in_bfloat16(T, S, kwargs):
    # bfloat16 in and out, float32 inside: the native kernel's error against the float64
    # truth (on the same bfloat16-rounded inputs) is at most twice the reference's own
    # bfloat16 error, plus a floor of a few bfloat16 roundings of the largest value.
    B, N, K, H = 2, 6, 2, 24
    q, k, v = (randn(s, B, L, h, H).astype(jnp.bfloat16)
               for s, L, h in ((1, T, N), (2, S, K), (3, S, K)))  # fmt: skip
    cot = randn(4, B, T, N, H)
    native = jit_vjp("native", q, k, v, cot, **kwargs)
    assert native[0].dtype == jnp.bfloat16 and all(g.dtype == jnp.bfloat16 for g in native[1])
    reference = jit_vjp("xla", q, k, v, cot, **kwargs)
    allowed = np_allowed(kwargs, B, T, S)
    as64 = [np.asarray(x, np.float64) for x in (q, k, v, jnp.asarray(cot, jnp.bfloat16))]
    want, (dq, dk, dv, _) = np_attention_vjp(*as64, allowed, None, None,
                                             kwargs.get("logit_soft_cap"))  # fmt: skip
    for name, got, ref, truth in zip(
        ("out", "dq", "dk", "dv"), (native[0], *native[1]), (reference[0], *reference[1]),
        (want, dq, dk, dv),
    ):  # fmt: skip
        error = np.abs(np.asarray(got, np.float64) - truth).max()
        own = np.abs(np.asarray(ref, np.float64) - truth).max()
        floor = 4 * 2.0**-8 * np.abs(truth).max()
        assert error <= 2 * own + floor, (name, error, own, floor)
    # Where the kernel widens bfloat16 (no AVX512_BF16, or a decode step), inside it is
    # float32: the forward pass equals the float32 kernel's on the widened inputs,
    # rounded once to nearest (ties to even) as jnp's cast rounds. With AVX512_BF16's
    # pairs the scores are summed in another order: one bfloat16 unit apart at most.
    wide = [x.astype(jnp.float32) for x in (q, k, v)]
    fn = functools.partial(nanoattn.dot_product_attention, implementation="native",
                           return_residual=True, **kwargs)  # fmt: skip
    out16, lse16 = jax.jit(fn)(q, k, v)
    out32, lse32 = jax.jit(fn)(*wide)
    rounded = np.asarray(out32.astype(jnp.bfloat16), np.float32)
    if "AVX512_BF16" in native_kernel.isa() and T >= 16:
        ulp = 2.0 ** (np.floor(np.log2(np.maximum(np.abs(rounded), 1e-30))) - 7)
        assert (np.abs(np.asarray(out16, np.float32) - rounded) <= ulp).all()
        np.testing.assert_allclose(lse16, lse32, rtol=1e-5, atol=1e-5)
    else:
        np.testing.assert_array_equal(np.asarray(out16, np.float32), rounded)
        np.testing.assert_array_equal(lse16, lse32)


@pytest.mark.slow  # a second build of the kernel (about a minute); on an AVX2 machine every
# native test of the fast suite runs this build, and `make test-all` runs this one here
def test_the_avx2_build_serves_too_on_an_avx512_machine(tmp_path):
    # The kernel is built for the machine's ISA (-march=native). A narrower one is built
    # and tested here by turning AVX-512 off: its tiles and vector width differ.
    flags = subprocess.run(["grep", "-m1", "-o", "avx512f", "/proc/cpuinfo"],
                           capture_output=True, text=True).stdout  # fmt: skip
    if "avx512f" not in flags:
        pytest.skip("this machine has no AVX-512: the default build is the AVX2 one")
    if os.environ.get("NANOATTN_NATIVE_SANITIZE"):
        pytest.skip("the sanitizer build is generic (no -march=native) and so has no ISA variant")
    env = dict(os.environ, NANOATTN_NATIVE_CFLAGS="-mno-avx512f",
               NANOATTN_CACHE_DIR=str(tmp_path))  # fmt: skip
    tests = pathlib.Path(__file__)
    # the base's cases native serves ("values of their own width": Hv != H, it refuses),
    # every test of the paged pass, native's over quantized keys and the layer ops: one
    # build for all
    served = "match_float64 and not dense and not bias and not score_fn and not own"
    selection = (
        f"lengths_across or ragged or short_calls or groups_or_alone or bfloat16 or ({served}) or "
        "(test_native_paged and not avx2) or (test_quantized_attention and native) or "
        "test_native_layer_ops"
    )
    files = [
        tests,
        tests.with_name("test_native_paged.py"),
        tests.with_name("test_native_layer_ops.py"),
        tests.parent.parent / "core" / "test_quantized_attention.py",
    ]
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
         *map(str, files), "-k", selection],
        env=env, capture_output=True, text=True, timeout=400, cwd=tests.parent,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert " passed" in done.stdout and "skipped" not in done.stdout.splitlines()[-1]
    built = list(tmp_path.glob("attention-*.so"))
    assert len(built) == 1
    symbols = subprocess.run(["objdump", "-d", str(built[0])], capture_output=True,
                             text=True).stdout  # fmt: skip
    assert "%ymm" in symbols and "%zmm" not in symbols
    isa = subprocess.run(
        [sys.executable, "-c", "from nanoattn._backends import native; print(native.isa())"],
        env=env, capture_output=True, text=True, timeout=120,
    ).stdout.strip()  # fmt: skip
    assert isa.startswith("AVX2 ") and native_kernel.isa().startswith("AVX-512 "), isa


def fwd_bwd_temp_bytes(T):
    shape = jax.ShapeDtypeStruct((1, T, 4, 32), jnp.float32)

    def loss(q, k, v):
        out = nanoattn.dot_product_attention(q, k, v, is_causal=True, implementation="native")
        return jnp.sum(out)

    compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(shape, shape, shape).compile()
    return compiled.memory_analysis().temp_size_in_bytes


def test_memory_is_linear_in_sequence_length():
    # XLA's buffers around the kernel (the kernel's own scratch, by construction in
    # pack.h, is O(T + S) too: the packed keys and values, or queries and output
    # cotangents, one per call, per-block buffers, and one dq accumulator per worker).
    at_8k, at_16k = fwd_bwd_temp_bytes(8192), fwd_bwd_temp_bytes(16384)
    assert at_16k <= 32 * 2**20, at_16k
    assert at_16k / at_8k <= 2.1, (at_8k, at_16k)


def alike_on_one_and_two_threads(monkeypatch, q, k, v, **rules):
    """The native call on one thread and on two, each close to float64 (outputs and
    gradients), the outputs bitwise equal (the forward's arithmetic per query block does
    not depend on how the work is split)."""
    outputs = []
    for threads in ("1", "2"):
        monkeypatch.setenv("NANOATTN_NUM_THREADS", threads)
        got, truth = run_and_truth(q, k, v, **rules)
        assert_close(got, truth)
        outputs.append(got[0])
    np.testing.assert_array_equal(*outputs)


SHORT_CASES = {  # rules of the short calls below, each against float64
    "causal, ragged rows": dict(
        is_causal=True, q_offset=np.array([40, 0, -30], np.int32),
        kv_lengths=np.array([150, 61, 150], np.int32),
    ),
    "window and segments": dict(
        window=(23, 5), q_offset=80,
        q_segment_ids=np.repeat([[0, 1, 2]], 3, 0).repeat([31, 29, 10], 1).astype(np.int32),
        kv_segment_ids=np.repeat([[0, 1, 2]], 3, 0).repeat([60, 60, 30], 1).astype(np.int32),
    ),
    "soft cap": dict(is_causal=True, q_offset=80, logit_soft_cap=5.0),
}  # fmt: skip


@pytest.mark.parametrize("case", SHORT_CASES)
def test_short_calls_run_by_group_or_by_block_alike(case, monkeypatch):
    # A short call with B x K >= 4 x threads runs one task per (b, key/value head):
    # the group's tiles packed by the task, its dQ summed by it alone (forward.h's
    # forward_run, backward.h's backward_run). B x K = 6: grouped with one thread, by
    # blocks with two.
    # The forward is the same arithmetic both ways (the same bits); the gradients sum
    # dQ in another order, each close to float64.
    B, T, S, N, K, H = 3, 70, 150, 6, 2, 5
    q, k, v = randn(11, B, T, N, H), randn(12, B, S, K, H), randn(13, B, S, K, H)
    alike_on_one_and_two_threads(monkeypatch, q, k, v, **SHORT_CASES[case])


GROUP_CASES = {  # rules under which the query blocks of one task see different key blocks
    "window, ragged": dict(
        window=(150, 0), q_offset=np.array([37], np.int32), kv_lengths=np.array([1100], np.int32)
    ),
    "segments": dict(
        is_causal=True,
        q_offset=60,
        q_segment_ids=np.repeat([[0, 1, 2]], 1, 0).repeat([190, 300, 571], 1).astype(np.int32),
        kv_segment_ids=np.repeat([[0, 1, 2]], 1, 0).repeat([250, 300, 571], 1).astype(np.int32),
    ),
}


@pytest.mark.parametrize("case", GROUP_CASES)
def test_blocks_run_in_groups_or_alone_alike(case, monkeypatch):
    # A forward task runs up to eight query blocks of one (b, n) and reads each key block
    # once for all of them (forward.h); a backward task up to four key
    # blocks of one (b, key/value head), each query block once for all of them. The
    # groups halve until there are eight tasks per thread. 17 query blocks x 3 heads:
    # groups of 8 (8, 8, 1) with one thread (9 tasks), of 2 with two (27); 18 key blocks:
    # 4 and 2. A query block's forward is the same arithmetic in any group (the same
    # bits); the gradients (dQ summed in another order) close to float64. B x K = 3:
    # never the short calls' path.
    B, T, S, N, K, H = 1, 1061, 1121, 3, 3, 7
    q, k, v = randn(21, B, T, N, H), randn(22, B, S, K, H), randn(23, B, S, K, H)
    alike_on_one_and_two_threads(monkeypatch, q, k, v, **GROUP_CASES[case])
