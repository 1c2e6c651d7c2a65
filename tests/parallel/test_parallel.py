"""nanoattn.parallel: ring attention on 8 simulated CPU devices.

The multi-device cases run in ONE subprocess (tests/_parallel_cases.py) with
``XLA_FLAGS=--xla_force_host_platform_device_count=8``, so the rest of the
suite keeps one device and the cases share one process start; each test here
asserts on one case's JSON line. One-device checks (the zigzag permutation,
the error messages) run in-process.
"""

import dataclasses
import functools
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from nanoattn.parallel import from_zigzag, ring_attention, to_zigzag

from _once import once_per_run
from _paths import TESTS

SCRIPT = TESTS / "_parallel_cases.py"


def _run_cases(*args, timeout=900):
    # 8 simulated devices, on top of the suite's own XLA flags (conftest.py's level)
    flags = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    env = {**os.environ, "XLA_FLAGS": flags.strip()}
    done = subprocess.run(
        [sys.executable, str(SCRIPT), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    results = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    errors = [r["error"] for r in results if "error" in r]
    assert not errors, errors[0]
    return {r["case"]: r for r in results}


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    return once_per_run(tmp_path_factory, "ring_cases", _run_cases)


RING_CASES = [
    "p8-zigzag-causal-lengths-segments",
    "p4-contiguous-full-lengths-segments",
    "p4-contiguous-causal-window-chunk-documents",
    "p2-zigzag-causal-value-width",
    "p8-contiguous-window-edges",
    "p2-zigzag-causal-window-edges",
]
WINDOW_EDGE_CASES = ["p8-contiguous-window-edges", "p2-zigzag-causal-window-edges"]


@pytest.mark.parametrize("name", RING_CASES)
def test_ring_equals_the_one_device_reference(cases, name):
    case = cases[name]
    assert case["out_err"] <= 1e-5 and case["grad_err"] <= 1e-4, case
    assert case["out_scale"] > 0.5  # a real output, not zeros everywhere


def _cells(rel: int, C: int, band) -> np.ndarray:
    """Which (query, key) cells of a pair of C-token chunks, the queries ``rel``
    positions after the keys, lie in ``band`` = (left, right): (C, C) bool."""
    left, right = band
    d = rel + np.arange(C)[:, None] - np.arange(C)[None, :]  # query position - key position
    return (d >= -right) & (d <= left)


def _kind(cells: np.ndarray) -> str:
    return "skip" if not cells.any() else "full" if cells.all() else "general"


def _ring_pairs(P: int, layout: str, T: int, band):
    """The visible cells of every off-diagonal chunk pair the ring computes, by brute
    force: device r's query chunks against the key chunks of every device."""
    n = 2 if layout == "zigzag" else 1
    C = T // (n * P)

    def chunks(r):
        return (r, 2 * P - 1 - r) if layout == "zigzag" else (r,)

    return [
        _cells((qc - kc) * C, C, band)
        for r in range(P)
        for source in range(P)
        for qc in chunks(r)
        for kc in chunks(source)
        if qc != kc
    ]


@pytest.mark.parametrize("name", WINDOW_EDGE_CASES)
def test_window_edge_cases_reach_every_kind_of_chunk_pair(cases, name):
    """The sizes of the window cases are chosen so that the ring meets every kind of
    chunk pair: wholly visible, wholly hidden, on the band's edge, and on an edge
    with a single visible cell (only one corner inside the band)."""
    case = cases[name]
    left, right = case["window"]
    band = (left, min(right, 0) if case["is_causal"] else right)
    pairs = _ring_pairs(case["P"], case["layout"], case["T"], band)
    assert {_kind(cells) for cells in pairs} == {"skip", "full", "general"}, case
    assert any(cells.sum() == 1 for cells in pairs), case


def test_a_chunk_pair_is_full_only_when_every_cell_is_in_the_band():
    """The ring's classification of a chunk pair (skip / full / general) against
    every cell of the pair, for many chunk lengths, bands and relative offsets;
    a pair counted full with a corner outside the band would skip its mask."""
    from nanoattn.parallel import _blocks

    for C in (1, 2, 3, 5):
        rels = np.arange(-4 * C - 1, 4 * C + 2)
        for band in [(0, 0), (1, 0), (4, 0), (7, 0), (0, 5), (3, 6), (7, 4), (11, 2)]:
            plans = _blocks.StepPlans("contiguous", 4, C, True, band, (), _blocks.PAIR_KINDS)
            got = np.asarray(_blocks._pair_kind(plans, jnp.asarray(rels)))
            want = [_kind(_cells(int(rel), C, band)) for rel in rels]
            assert [_blocks.PAIR_KINDS[g] for g in got] == want, (C, band)


MASK_CASES = ["mask-p2-zigzag-documents-relative-sinks"]
SLOW_MASK_CASES = [  # run-time classification (traced ids), no band, 4 devices
    "mask-p2-contiguous-prefix-traced-nan",
    "mask-p4-zigzag-documents-alibi-sinks",
    "mask-p4-zigzag-stripes-window-traced",
]


@pytest.mark.parametrize("name", MASK_CASES)
def test_ring_with_mask_fn_score_fn_and_sinks_equals_the_float64_reference(cases, name):
    _check_masked_case(cases[name])


@pytest.mark.slow
@pytest.mark.parametrize("name", SLOW_MASK_CASES)
def test_ring_with_mask_fn_on_4_devices_equals_the_float64_reference(slow_cases, name):
    _check_masked_case(slow_cases[name])


def _check_masked_case(case):
    """mask_fn at global positions (static and traced), ALiBi through score_fn, sinks
    and return_residual on the ring: the output, the log-sum-exp (-inf exactly where
    a row sees nothing) and the gradients to q, k, v, the slopes score_fn closes over
    and the sinks, relative to the reference's largest value; NaN and inf in keys and
    values no query sees reach nothing."""
    assert case["out_err"] <= 1e-5 and case["lse_err"] <= 1e-5, case
    assert case["lse_empty_match"] and case["finite"], case
    assert max(case["grad_errs"]) <= 2e-5, case
    assert case["out_scale"] > 0.5, case
    if case["kind"] == "documents":  # a hidden document: rows that see no key
        assert case["empty_rows"] > 0, case


@pytest.mark.slow
def test_sequence_and_head_parallel_layer_with_masks_and_sinks_equals_one_device(slow_cases):
    """The linen layer with sinks, a per-head document mask_fn and ALiBi on a (2, 2)
    mesh (zigzag sequence x heads): each device's heads see their global index."""
    case = slow_cases["mask-layer-sequence-heads"]
    assert case["out_err"] <= 1e-6 * case["out_scale"], case
    assert case["grad_err"] <= 1e-5 * max(case["grad_scale"], 1.0) + 2e-5, case


@pytest.mark.parametrize("layout, P", [("zigzag", 4), ("contiguous", 8)])
def test_ring_skips_every_chunk_pair_mask_fn_hides_and_unmasks_the_full_ones(layout, P):
    """The kind the ring picks for every chunk pair it computes under mask_fn, causality
    and a window, against the pair's cells by brute force: skipped when the window or
    mask_fn hides every cell, run without mask_fn when mask_fn shows every cell, with
    it (and its block kinds) otherwise; the sweep reaches every kind."""
    from nanoattn._base.rules import Rules
    from nanoattn.parallel import _blocks

    T, left = 192, 60  # chunks of C = 24: adjacent pairs wholly in the window, others not
    n = 2 if layout == "zigzag" else 1
    C = T // (n * P)
    ids = (np.arange(T) + 12) // 72  # documents of 72 tokens, their edges inside chunks

    def mask_fn(b, n, q, k):  # the first 72 queries see every document
        return (jnp.asarray(ids)[q] == jnp.asarray(ids)[k]) | (q < 72)

    i, j = np.arange(T)[:, None], np.arange(T)[None, :]
    by_fn = (ids[i] == ids[j]) | (i < 72)
    by_band = (j <= i) & (i - j <= left)
    x = jnp.zeros((1, T // P, 2, 4))
    spec = Rules.make(x, x, x, is_causal=True, window=(left, 0))
    tiles = ((8, 8, 1), (8, 8, 1))  # 3 x 3 blocks per pair: the pair's kind sums its blocks'
    plans = _blocks.step_plans(spec.replace(mask_fn=mask_fn), layout, P, tiles)
    forward, _ = _blocks.pair_kinds(plans, None, 1, 2)
    assert forward.shape[2:] == (3, 3)
    assert plans.all_rows and plans.kinds == _blocks.MASKED_PAIR_KINDS

    def kind(cells):
        return "empty" if not cells.any() else "all" if cells.all() else "some"

    seen = set()
    for r in range(P):
        for step in range(P):
            for a, _, qc, kc, diagonal in _blocks._pair_calls(plans, step == 0, r, (r - step) % P):
                rows, cols = slice(qc * C, (qc + 1) * C), slice(kc * C, (kc + 1) * C)
                fn, band = kind(by_fn[rows, cols]), kind(by_band[rows, cols])
                kinds = _blocks._kinds_of(plans, forward, a, qc, kc)
                index = int(_blocks._kind_index(plans, (qc - kc) * C, kinds, diagonal))
                got = (plans.diagonal_kinds if diagonal else plans.kinds)[index]
                if diagonal:
                    want = {"empty": "skip", "all": "own", "some": "own_masked"}[fn]
                elif "empty" in (fn, band):
                    want = "skip"
                else:
                    want = ("full" if band == "all" else "general") + ("_masked" * (fn == "some"))
                assert got == want, (layout, r, step, qc, kc, fn, band)
                seen.add(got)
    assert seen == {"skip", "own", "own_masked", "full", "general", "full_masked",
                    "general_masked"}, seen  # fmt: skip


def test_sequence_parallel_layer_rotates_each_token_by_its_global_position(cases):
    """The causal layer with RoPE on 2 devices, zigzag input, against the same layer
    and parameters on one device (rotating by the slot in the zigzag order, or by
    the index within a device's shard, is off by about 1.5)."""
    case = cases["layer-sequence-rope-linen"]
    assert case["err"] <= 1e-5, case
    assert case["out_scale"] > 0.5, case


def test_forward_sends_p_minus_1_hops_and_gathers_nothing(cases):
    case = cases["leak-honest"]  # the compiled program the causality check runs
    assert case["permutes"] == case["P"] - 1, case
    assert case["all_gathers"] == 0, case


def test_check_causality_passes_the_ring_and_catches_a_planted_leak(cases):
    assert cases["leak-honest"]["passed"], cases["leak-honest"]["report"]
    assert not cases["leak-planted"]["passed"], cases["leak-planted"]["report"]


def test_flash_inside_shard_map_sums_gradients_of_replicated_inputs(cases):
    # dk, dv and dbias of inputs every device holds whole: the sum over devices
    case = cases["flash-replicated-kv"]
    assert max(case["grad_errs"]) <= 1e-4, case
    assert min(case["grad_scales"]) > 0.1, case


def test_native_inside_shard_map_sums_gradients_of_replicated_inputs(cases):
    # its FFI results typed as varying like their operands; dk, dv summed over devices
    case = cases["native-replicated-kv"]
    assert max(case["grad_errs"]) <= 1e-4, case
    assert min(case["grad_scales"]) > 0.1, case


def test_head_parallel_layer_equals_one_device_and_gathers_nothing(cases):
    case = cases["layer-heads-linen"]
    assert case["err"] <= 1e-5, case
    # q, k, v stay sharded over heads; the output projection reduces once
    assert case["all_gathers"] == 0 and case["all_reduces"] == 1, case
    assert case["out_kernel"] == "P('joined_heads', 'embed')", case


@pytest.fixture(scope="module")
def slow_cases():
    return _run_cases("--slow")


SLOW_RING_CASES = [
    f"grid-p{P}-{layout}-{causal}"
    for P in (2, 4, 8)
    for layout in ("zigzag", "contiguous")
    for causal in ("causal", "full")
] + [
    "p2-zigzag-window-two-sided",
    "p2-contiguous-causal-window",
    "p4-zigzag-soft-cap-lengths",
    "p4-zigzag-causal-window-edges",
    "p4-zigzag-causal-window-chunk-documents",
]


@pytest.mark.slow
@pytest.mark.parametrize("name", SLOW_RING_CASES)
def test_ring_grid_equals_the_reference(slow_cases, name):
    """P = 2, 4, 8 x zigzag/contiguous x causal/not, a two-sided window on the
    zigzag chunk pairs, soft-capping with lengths, a causal window with edges inside
    the chunk pairs of 4 devices (with lengths and segments), and with documents on
    chunk edges whose pairs between documents the ring skips."""
    case = slow_cases[name]
    assert case["out_err"] <= 1e-5 and case["grad_err"] <= 1e-4, case


@pytest.mark.slow
@pytest.mark.parametrize("name", ["layer-2d-linen", "layer-heads-nnx"])
def test_2d_and_nnx_layers_equal_one_device_and_gather_nothing(slow_cases, name):
    case = slow_cases[name]
    assert case["err"] <= 1e-5, case
    assert case["all_gathers"] == 0 and case["all_reduces"] == 1, case


@pytest.mark.slow
def test_ring_in_bfloat16_within_bfloat16_rounding(slow_cases):
    case = slow_cases["p4-zigzag-causal-bf16"]
    # the reference in bfloat16 rounds its output too: a few ulps of 2**-8 at |out| ~ 2
    assert case["out_err"] <= 2 * 2**-8 * case["out_scale"], case
    assert case["grad_err"] <= 5e-2, case


@pytest.mark.slow
def test_forward_on_8_devices_sends_7_hops_and_gathers_nothing(slow_cases):
    case = slow_cases["hlo-p8-zigzag-causal"]
    assert case["permutes"] == 7 and case["all_gathers"] == 0, case


@pytest.mark.slow
def test_ring_memory_per_device_is_at_most_a_quarter_of_one_device_flash(slow_cases):
    """Compiled (not run) forward+backward at T = 65536: temporaries per device of
    the ring on 8 devices against the one-device flash kernel."""
    case = slow_cases["memory-p8-t65536"]
    assert case["ring"] * 4 <= case["flash"], case
    assert case["ring_args"] * case["P"] == case["flash_args"], case  # T/P of q, k, v each


def test_zigzag_round_trip_and_chunk_order():
    x = jnp.arange(2 * 24).reshape(2, 24)
    z = to_zigzag(x, 3)
    chunks = np.asarray(z[0]).reshape(6, 4)[:, 0] // 4  # which chunk sits where
    assert chunks.tolist() == [0, 5, 1, 4, 2, 3]
    assert (from_zigzag(z, 3) == x).all()
    y = jnp.arange(2 * 8 * 3).reshape(2, 8, 3)
    assert (from_zigzag(to_zigzag(y, 2, axis=1), 2, axis=1) == y).all()


def test_zigzag_needs_t_divisible_by_2p():
    with pytest.raises(ValueError, match=r"P=4 devices .* 8 equal chunks, but T=20 is not"):
        to_zigzag(jnp.zeros((1, 20)), 4)


def _mesh1():
    return jax.sharding.Mesh(np.array(jax.devices()[:1]), ("sp",))


def test_ring_errors_name_the_sizes():
    q = jnp.zeros((1, 6, 2, 4))
    with pytest.raises(ValueError, match=r"layout must be one of 'zigzag', 'contiguous'"):
        ring_attention(q, q, q, axis_name="sp", mesh=_mesh1(), layout="ring")
    with pytest.raises(ValueError, match=r"axis_name='model' is not an axis of the mesh"):
        ring_attention(q, q, q, axis_name="model", mesh=_mesh1())
    odd = jnp.zeros((1, 5, 2, 4))
    with pytest.raises(ValueError, match=r"2 equal chunks, but T=5 is not a multiple of 2"):
        ring_attention(odd, odd, odd, axis_name="sp", mesh=_mesh1())
    with pytest.raises(ValueError, match=r"key must have shape \(B, S, K, H\)"):
        ring_attention(q, q[:, :4], q[:, :4], axis_name="sp", mesh=_mesh1(), layout="contiguous")
    ring = functools.partial(ring_attention, q, q, q, axis_name="sp", mesh=_mesh1())
    with pytest.raises(TypeError, match=r"^mask_fn must return a boolean array"):
        ring(mask_fn=lambda b, n, qp, kp: qp - kp)
    with pytest.raises(ValueError, match=r"^mask_fn's result .* \(B, N, T, S\) = \(1, 2, 6, 6\)"):
        ring(mask_fn=lambda b, n, qp, kp: jnp.ones((3, 1, 1, 1), bool))
    with pytest.raises(TypeError, match=r"^score_fn must be a function"):
        ring(score_fn="alibi")
    with pytest.raises(ValueError, match=r"^sinks must have shape \(N,\) = \(2,\), got \(3,\)"):
        ring(sinks=jnp.zeros(3))
    with pytest.raises(TypeError, match=r"^return_residual must be True or False"):
        ring(return_residual="yes")
    quantized = jnp.zeros((1, 6, 2, 4), jnp.int8)
    with pytest.raises(ValueError, match=r"^key of dtype int8 is quantized: ring_attention takes"):
        ring_attention(q, quantized, quantized, axis_name="sp", mesh=_mesh1())


def test_config_mesh_axes_are_checked_and_default_to_none():
    from nanoattn.linen import AttentionConfig

    cfg = AttentionConfig()
    assert (cfg.head_axis, cfg.sequence_axis, cfg.sequence_layout) == (None, None, "zigzag")
    with pytest.raises(ValueError, match=r"different mesh axes, got 'x' for both"):
        AttentionConfig(head_axis="x", sequence_axis="x")
    with pytest.raises(ValueError, match=r"sequence_layout must be one of 'zigzag', 'contiguous'"):
        AttentionConfig(sequence_layout="ring")
    with pytest.raises(TypeError, match=r"head_axis must be a mesh axis name"):
        AttentionConfig(head_axis=2)


def test_layer_without_a_mesh_computes_as_one_device():
    from nanoattn.linen import AttentionConfig, CausalSelfAttention

    x = jax.random.normal(jax.random.key(1), (2, 8, 32))
    plain = CausalSelfAttention(AttentionConfig(d_model=32, n_heads=4))
    params = plain.init(jax.random.key(0), x, deterministic=True)
    sharded = CausalSelfAttention(AttentionConfig(d_model=32, n_heads=4, head_axis="model"))
    boxed = sharded.init(jax.random.key(0), x, deterministic=True)
    import flax.linen as nn

    assert nn.get_partition_spec(boxed)["params"]["out"]["kernel"] == jax.sharding.PartitionSpec(
        "joined_heads", "embed"
    )
    y = sharded.apply(params, x, deterministic=True)
    assert jnp.array_equal(y, plain.apply(params, x, deterministic=True))


@pytest.mark.parametrize("framework", ["linen", "nnx"])
def test_head_parallel_layer_sows_weights_while_training_with_dropout(framework):
    # The sharded path once added dropout_rng to the mask arguments that the sown
    # weights are computed from, so sow_weights + head_axis + dropout raised TypeError.
    from flax import nnx

    from nanoattn import linen
    from nanoattn import nnx as nanoattn_nnx

    x = jax.random.normal(jax.random.key(1), (2, 8, 32))
    config = linen.AttentionConfig(d_model=32, n_heads=4, head_axis="model", dropout=0.5)
    plain = linen.AttentionConfig(d_model=32, n_heads=4, dropout=0.5)
    if framework == "linen":
        params = linen.CausalSelfAttention(plain).init(jax.random.key(0), x, deterministic=True)

        def train(cfg):
            layer = linen.CausalSelfAttention(cfg, sow_weights=True)
            rngs = {"dropout": jax.random.key(2)}
            y, state = layer.apply(params, x, False, rngs=rngs, mutable=["intermediates"])
            return y, state["intermediates"]["attention_weights"][0]
    else:

        def train(cfg):
            layer = nanoattn_nnx.CausalSelfAttention(cfg, sow_weights=True, rngs=nnx.Rngs(0))
            y, sown = nnx.capture(layer, nnx.Intermediate)(x, deterministic=False)
            return y, sown["attention_weights"][0]

    y, weights = train(config)
    want_y, want_weights = train(plain)  # the same layer, unsharded: the same dropout bits
    assert weights.shape == (2, 4, 8, 8)
    np.testing.assert_array_equal(weights, want_weights)
    np.testing.assert_array_equal(y, want_y)
    assert not jnp.array_equal(y, train(dataclasses.replace(plain, dropout=0.0))[0])


@pytest.mark.slow
def test_ring_across_two_processes_equals_one_process(tmp_path):
    """Two processes on 127.0.0.1 (jax.distributed, gloo), 4 CPU devices each:
    the ring over the 8 global devices equals the one-device reference."""
    from _two_processes import run_pair

    import nanoattn

    from _parallel_multiprocess import inputs

    out = tmp_path / "out.npy"
    run_pair(TESTS / "_parallel_multiprocess.py", out)  # the worker adds its 4 devices
    q, k, v = inputs()
    expected = nanoattn.dot_product_attention(q, k, v, is_causal=True, implementation="xla")
    got = from_zigzag(np.load(out), 8)
    assert float(jnp.max(jnp.abs(got - expected))) <= 1e-5
