"""Differential fuzzing: every backend against a float64 reference, over random calls.

Hypothesis draws a whole call: the sizes B, T, S, N, K, H (1, primes, and sizes
just past the native kernel's 64-row blocks and the flash kernel's tiles), the
dtype (float32, bfloat16, float16) and any valid combination of ``is_causal``,
``q_offset`` (a static int, a traced scalar or a traced per-row array),
``window``, segment ids, ``kv_lengths`` (0 and S included), a dense boolean
mask, a bias, ``logit_soft_cap`` and ``scale``; and in half of the programs each: a
``mask_fn`` (documents, prefix-LM, per-head windows, chunked-local or a block-sparse
pattern, with random parameters closed over or passed through jit, sometimes as a
``nanoattn.block_mask``), a ``score_fn`` (ALiBi, a relative-bias table, a tanh
soft-cap), ``sinks`` (every dtype) and
``return_residual``. NaN or inf goes into
every slot that no query may see (keys and values no query of their row sees,
mask_fn's hidden ones included, query rows that see nothing, bias cells that are
blocked wherever they broadcast): the contract says such content is never read.

Every backend that can serve the call (``"xla"``, ``"flash"`` with its default
tiles or with drawn small ones, ``"native"``) must then match the float64
numpy reference of _reference.py on the output and on dq, dk, dv (and dbias, the
log-sum-exp, the gradients to the sinks and to score_fn's slopes or table), given the
mask_fn as a literal numpy mask and the score_fn as a bias or soft cap, with
FlashAttention's criterion: an error at most twice the reference's own
error in that dtype (the same formulas computed in float32 numpy and rounded
to the dtype), plus a floor of a few float32 rounding errors of the largest
true value. The backends must also agree with each other within that bound.
Invalid combinations must raise a one-line ValueError or TypeError. The ring
(``nanoattn.parallel``) is fuzzed in a subprocess on 4 simulated devices
(tests/_fuzz_ring.py). The machinery (drawing a call, running a backend, the
criterion, the campaign's record) is in _fuzz.py.

Budget, from the environment:

* ``NANOATTN_FUZZ_EXAMPLES``: examples of the main test (CI default below),
  and of the invalid-call test times 4, shared among the broken rules (those
  calls compile nothing);
  ``NANOATTN_FUZZ_NATIVE_EXAMPLES`` (default 6 times as many: its programs
  compile in a tenth of the time) of the native-only test and
  ``NANOATTN_FUZZ_RING_EXAMPLES`` (default a twentieth, at least 1) of the ring.
* ``NANOATTN_FUZZ_SEED``: draw from this seed instead of the derandomised
  (fixed) examples.
* ``NANOATTN_FUZZ_KEEP_GOING=1``: record failures and keep drawing (the long
  campaign); the test fails at the end if any was found.
* ``NANOATTN_FUZZ_SUMMARY``: a file to write the campaign's JSON summary to.

``make fuzz`` runs a long campaign and prints the summary (docs/testing.md).
Any failure found becomes a named test with its concrete inputs (``concrete_call``
and ``check`` of _fuzz.py) in the test file of what failed: test_flash.py holds the
flash kernel's.
"""

import collections
import functools
import json
import os
import pathlib
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import nanoattn
from nanoattn._backends import native, registry

from _fuzz import KEEP_GOING, Call, Record, budget, calls, check

EXAMPLES = int(os.environ.get("NANOATTN_FUZZ_EXAMPLES", "6"))
NATIVE_EXAMPLES = int(os.environ.get("NANOATTN_FUZZ_NATIVE_EXAMPLES", 6 * EXAMPLES))
SUMMARY_FILE = os.environ.get("NANOATTN_FUZZ_SUMMARY")


RECORDS = collections.defaultdict(Record)
EXTRA = {}  # the ring's summary, from its process


@pytest.fixture(scope="module", autouse=True)
def _print_summary():
    yield
    summary = {name: r.summary() for name, r in RECORDS.items()}
    if INVALID_COUNTS:
        summary["invalid calls (each raised a one-line error)"] = dict(
            sorted(INVALID_COUNTS.items())
        )
    summary.update(EXTRA)
    if not summary:
        return
    text = json.dumps(summary, indent=1)
    if SUMMARY_FILE:
        pathlib.Path(SUMMARY_FILE).write_text(text + "\n")
    print("\nnanoattn differential fuzzing summary:\n" + text)


def fuzz_program(calls: list[Call], test: str, backends=None):
    """Checks the calls of one program; raises on the first failure unless keep-going."""
    start = time.perf_counter()
    verdicts = [check(call, backends) for call in calls]
    record = RECORDS[test]
    record.add_program(time.perf_counter() - start)
    for call, verdict in zip(calls, verdicts):
        record.add(call, verdict, test)
        if verdict.failures and not KEEP_GOING:
            found = "found at program {}, after {:.1f} s of checking".format(*record.first_failure)
            raise AssertionError(f"{call.describe()} ({found})\n" + "\n".join(verdict.failures))


def assert_no_recorded_failures(test: str):
    found = RECORDS[test].failures if test in RECORDS else []
    assert not found, json.dumps(found[:5], indent=1)


# ---------------------------------------------------------------------------------------
# The tests.


@budget(EXAMPLES)
@given(calls())
def test_every_backend_agrees_with_the_float64_reference(calls):
    fuzz_program(calls, "every_backend")


def test_every_backend_campaign_found_nothing():
    assert_no_recorded_failures("every_backend")


@pytest.mark.skipif(native.load()[0] is None, reason="the native kernel could not be built")
@budget(NATIVE_EXAMPLES)
@given(calls(native_only=True))
def test_native_kernel_agrees_with_the_float64_reference(calls):
    # Only calls the native kernel serves: under `make sanitize` this is the fuzz budget
    # that runs the kernel built with AddressSanitizer and UBSan.
    fuzz_program(calls, "native", backends=("native",))


def test_native_campaign_found_nothing():
    assert_no_recorded_failures("native")


# ---------------------------------------------------------------------------------------
# Invalid calls: a valid call with one rule broken must raise a one-line ValueError or
# TypeError, from every entry point and backend, and never return.


def _broken(name: str, B, T, S, N, K, H):
    """(query, key, value, kwargs, entry) of a call broken by rule ``name``; ``entry``
    None means every backend of dot_product_attention (and attention_weights)."""
    f32 = np.float32
    q, k, v = (np.ones(shape, f32) for shape in ((B, T, N, H), (B, S, K, H), (B, S, K, H)))
    ids_q, ids_k = np.zeros((B, T), np.int32), np.zeros((B, S), np.int32)
    match name:
        case "causal T != S without q_offset":
            k = v = np.ones((B, T + 1, K, H), f32)
            return q, k, v, dict(is_causal=True)
        case "window T != S without q_offset":
            k = v = np.ones((B, T + 2, K, H), f32)
            return q, k, v, dict(window=(1, 1))
        case "q_offset without causal or window":
            return q, k, v, dict(q_offset=0)
        case "q segment ids only":
            return q, k, v, dict(q_segment_ids=ids_q)
        case "kv segment ids only":
            return q, k, v, dict(kv_segment_ids=ids_k)
        case "float mask":
            return q, k, v, dict(mask=np.ones((T, S), f32))
        case "integer mask":
            return q, k, v, dict(mask=np.ones((T, S), np.int32))
        case "mask not broadcastable":
            return q, k, v, dict(mask=np.ones((T + 1, S), bool))
        case "N not a multiple of K":
            k = v = np.ones((B, S, K + 1, H), f32)
            q = np.ones((B, T, 2 * K + 1, H), f32)
            return q, k, v, {}
        case "negative window":
            return q, k, v, dict(window=(-1, 2), q_offset=0)
        case "window not ints":
            return q, k, v, dict(window=(1.5, 2), q_offset=0)
        case "window of three":
            return q, k, v, dict(window=(1, 2, 3), q_offset=0)
        case "soft cap zero":
            return q, k, v, dict(logit_soft_cap=0.0)
        case "soft cap negative":
            return q, k, v, dict(logit_soft_cap=-1.0)
        case "soft cap nan":
            return q, k, v, dict(logit_soft_cap=float("nan"))
        case "soft cap inf":
            return q, k, v, dict(logit_soft_cap=float("inf"))
        case "soft cap a string":
            return q, k, v, dict(logit_soft_cap="1")
        case "bias not broadcastable":
            return q, k, v, dict(bias=np.ones((B, N + 1, T, S), f32))
        case "integer bias":
            return q, k, v, dict(bias=np.ones((T, S), np.int32))
        case "float kv_lengths":
            return q, k, v, dict(kv_lengths=np.full((B,), S, f32))
        case "kv_lengths of the wrong batch":
            return q, k, v, dict(kv_lengths=np.full((B + 1,), S, np.int32))
        case "boolean q_offset":
            return q, k, v, dict(is_causal=True, q_offset=True)
        case "float q_offset":
            return q, k, v, dict(is_causal=True, q_offset=np.float32(0))
        case "q_offset of the wrong batch":
            return q, k, v, dict(is_causal=True, q_offset=np.zeros((B + 1,), np.int32))
        case "float segment ids":
            return q, k, v, dict(q_segment_ids=ids_q.astype(f32), kv_segment_ids=ids_k)
        case "segment ids of the wrong length":
            return q, k, v, dict(q_segment_ids=ids_q, kv_segment_ids=ids_k[:, :-1])
        case "query of rank 3":
            return q[0], k, v, {}
        case "key of another head width":
            return q, np.ones((B, S, K, H + 1), f32), v, {}
        case "value of another length":
            return q, k, np.ones((B, S + 1, K, H), f32), {}
        case "key of another batch":
            return q, np.ones((B + 1, S, K, H), f32), v, {}
        case "integer query":
            return q.astype(np.int32), k, v, {}
        case "unknown implementation":
            return q, k, v, dict(implementation="triton")
        case "dropout rate 1":
            return q, k, v, dict(dropout_rate=1.0)
        case "dropout without a key":
            return q, k, v, dict(dropout_rate=0.5)
        case "dropout on flash":
            return q, k, v, dict(dropout_rate=0.5, dropout_rng=jax.random.key(0),
                                 implementation="flash")  # fmt: skip
        case "native with float16":
            cast = (x.astype(jnp.float16) for x in (q, k, v))
            return *cast, dict(implementation="native")
        case "native with a mask":
            return q, k, v, dict(mask=np.ones((T, S), bool), implementation="native")
        case "native with a bias":
            return q, k, v, dict(bias=np.ones((T, S), f32), implementation="native")
        case "flash tiles of 0":
            return q, k, v, dict(forward_tiles=(0, 16, 1))
        case "mask_fn not a function":
            return q, k, v, dict(mask_fn=np.ones((T, S), bool))
        case "mask_fn not boolean":
            return q, k, v, dict(mask_fn=lambda b, n, qp, kp: (kp <= qp).astype(np.int32))
        case "mask_fn not broadcastable":
            return q, k, v, dict(mask_fn=lambda b, n, qp, kp: jnp.ones((B, N + 1, 1, 1), bool))
        case "score_fn of ints":
            return q, k, v, dict(score_fn=lambda s, b, n, qp, kp: qp - kp)
        case "sinks of the wrong shape":
            return q, k, v, dict(sinks=np.zeros((N + 1,), f32))
        case "integer sinks":
            return q, k, v, dict(sinks=np.zeros((N,), np.int32))
        case "native with score_fn":
            return q, k, v, dict(score_fn=lambda s, b, n, qp, kp: s, implementation="native")
    raise AssertionError(name)


BROKEN = (
    "causal T != S without q_offset", "window T != S without q_offset",
    "q_offset without causal or window", "q segment ids only", "kv segment ids only",
    "float mask", "integer mask", "mask not broadcastable", "N not a multiple of K",
    "negative window", "window not ints", "window of three", "soft cap zero",
    "soft cap negative", "soft cap nan", "soft cap inf", "soft cap a string",
    "bias not broadcastable", "integer bias", "float kv_lengths",
    "kv_lengths of the wrong batch", "boolean q_offset", "float q_offset",
    "q_offset of the wrong batch", "float segment ids", "segment ids of the wrong length",
    "query of rank 3", "key of another head width", "value of another length",
    "key of another batch", "integer query", "unknown implementation", "dropout rate 1",
    "dropout without a key", "dropout on flash", "native with float16",
    "native with a mask", "native with a bias", "flash tiles of 0", "mask_fn not a function",
    "mask_fn not boolean", "mask_fn not broadcastable", "score_fn of ints",
    "sinks of the wrong shape", "integer sinks", "native with score_fn",
)  # fmt: skip
ONLY_DOT_PRODUCT = {"unknown implementation", "dropout rate 1", "dropout without a key",
                    "dropout on flash", "native with float16", "native with a mask",
                    "native with a bias", "native with score_fn"}  # fmt: skip
NO_VALUE = {"value of another length"}  # attention_weights takes no value
INVALID_COUNTS = collections.Counter()


def _entry_calls(name, q, k, v, kwargs):
    """The public calls that receive this broken call: (label, thunk)."""
    if name == "flash tiles of 0":
        return [("flash_attention", lambda: nanoattn.flash_attention(q, k, v, **kwargs))]
    if name in ONLY_DOT_PRODUCT:
        return [
            ("dot_product_attention", lambda: nanoattn.dot_product_attention(q, k, v, **kwargs))
        ]
    calls = [
        (f"dot_product_attention[{impl}]",
         functools.partial(nanoattn.dot_product_attention, q, k, v, implementation=impl,
                           **kwargs))
        for impl in (None, *registry.names())
    ]  # fmt: skip
    calls.append(("flash_attention", functools.partial(nanoattn.flash_attention, q, k, v,
                                                       **kwargs)))  # fmt: skip
    if name not in NO_VALUE:
        calls.append(("attention_weights", functools.partial(nanoattn.attention_weights, q, k,
                                                             **kwargs)))  # fmt: skip
    return calls


@st.composite
def sizes(draw):
    B, T, S = draw(st.integers(1, 3)), draw(st.integers(1, 9)), draw(st.integers(2, 9))
    K, G, H = draw(st.integers(1, 3)), draw(st.integers(1, 3)), draw(st.integers(1, 9))
    return B, T, S, K * G, K, H


# Every rule is broken in every run (a parameter each), at drawn sizes.
@pytest.mark.parametrize("name", BROKEN)
@budget(max(2, 4 * EXAMPLES // len(BROKEN)))
@given(sizes())
def test_invalid_calls_raise_a_one_line_error(name, sizes):
    q, k, v, kwargs = _broken(name, *sizes)
    INVALID_COUNTS[name] += 1
    for label, thunk in _entry_calls(name, q, k, v, kwargs):
        if "native" in label and native.load()[0] is None:
            continue
        with pytest.raises((ValueError, TypeError)) as caught:
            thunk()
        message = str(caught.value)
        assert message and "\n" not in message, f"{name}, {label}: {message!r}"


# ---------------------------------------------------------------------------------------
# The ring, on 4 simulated devices in its own process (the suite keeps one device).

RING_SCRIPT = pathlib.Path(__file__).with_name("_fuzz_ring.py")
RING_EXAMPLES = int(os.environ.get("NANOATTN_FUZZ_RING_EXAMPLES", max(1, EXAMPLES // 20)))


def test_ring_attention_agrees_with_the_float64_reference():
    flags = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
    done = subprocess.run(
        [sys.executable, str(RING_SCRIPT), str(RING_EXAMPLES)],
        env={**os.environ, "XLA_FLAGS": flags.strip()},
        capture_output=True,
        text=True,
        timeout=120 + 120 * RING_EXAMPLES,
    )
    lines = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    if lines:
        EXTRA["ring"] = lines[-1]
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
