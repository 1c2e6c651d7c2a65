"""The blockwise kernel: gaps that a mutation audit found, and the work of a window.

(a) A forward pass that accumulated in bfloat16 stayed inside the bfloat16
tolerance of test_flash.py; the mean error and the dtypes of the running
statistics catch it. (b) A static q_offset that is not a multiple of the block
sizes was never exercised, so a block wrongly classified as fully visible
survived; sweeping the offset over two key blocks catches it, on the schedule
alone and end to end. Last, a sliding window makes the kernel's work grow
linearly in T, shown by counting scheduled block pairs (never by timing), and
its compiled memory stays O(T). (c) Inside ``jax.shard_map`` only the ring's
subprocess tests ran the kernel, always with every input varying over the mesh;
one varying input at a time, on a one-device mesh, reaches each input's part.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import nanoattn
from nanoattn._schedule import block_schedules

from _cases import Case, assert_cases_match
from _reference import np_attention, np_causal, np_window, randn


def qkv(T, S, N=4, K=2, H=8, B=2, seed=0, dtype=jnp.float32):
    return (
        jnp.asarray(randn(seed, B, T, N, H), dtype),
        jnp.asarray(randn(seed + 1, B, S, K, H), dtype),
        jnp.asarray(randn(seed + 2, B, S, K, H), dtype),
    )


# (a) bfloat16 accumulation


def test_bfloat16_mean_error_is_at_most_twice_the_references():
    # Both backends get the same bfloat16 inputs; each error is against the float64
    # truth. The reference accumulates in float32 and rounds once, so its mean error
    # is about a quarter of a bfloat16 unit. Key blocks of 2 make the kernel update
    # each row up to 49 times: a running output kept in bfloat16 rounds at every
    # update and lands over 3x the reference's error (2x with blocks of 8).
    T = 97
    q, k, v = qkv(T, T, H=32, seed=10, dtype=jnp.bfloat16)
    truth = np_attention(*(np.asarray(a, np.float64) for a in (q, k, v)), allowed=np_causal(T, T))
    run = jax.jit(
        lambda q, k, v: (
            nanoattn.flash_attention(q, k, v, is_causal=True, forward_tiles=(16, 2, 3)),
            nanoattn.dot_product_attention(q, k, v, is_causal=True, implementation="xla"),
        )
    )
    flash, ref = run(q, k, v)
    assert flash.dtype == ref.dtype == jnp.bfloat16
    flash_err = np.abs(np.asarray(flash, np.float64) - truth).mean()
    ref_err = np.abs(np.asarray(ref, np.float64) - truth).mean()
    assert flash_err <= 2 * ref_err, (flash_err, ref_err)


def _equations(jaxpr):
    """Every equation of a jaxpr, including those of nested jaxprs (scan, custom_vjp)."""
    for eqn in jaxpr.eqns:
        yield eqn
        for param in eqn.params.values():
            for sub in param if isinstance(param, (tuple, list)) else (param,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    yield from _equations(inner)


def test_bfloat16_running_statistics_stay_float32():
    q, k, v = qkv(41, 41, seed=11, dtype=jnp.bfloat16)

    def loss(q, k, v):
        out = nanoattn.flash_attention(
            q, k, v, is_causal=True, forward_tiles=(16, 8, 3), backward_tiles=(8, 8, 2)
        )
        return out.astype(jnp.float32).sum()

    jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v).jaxpr
    eqns = list(_equations(jaxpr))
    exps = [e for e in eqns if e.primitive.name == "exp"]
    assert exps and all(e.outvars[0].aval.dtype == jnp.float32 for e in exps)
    scans = [e for e in eqns if e.primitive.name == "scan"]
    assert scans
    for scan in scans:  # carries: running max, sum and output, or accumulated gradients
        carries = scan.outvars[: scan.params["num_carry"]]
        floating = [c.aval.dtype for c in carries if jnp.issubdtype(c.aval.dtype, jnp.floating)]
        assert floating and all(d == jnp.float32 for d in floating), floating


# (b) static offsets that are not multiples of the block sizes


def expected_items(T, S, bq, bk, q_offset, band):
    """{(i, j): "full" or "masked"} from the literal rule: a block pair is listed iff
    one of its cells is visible, full iff all are and its key block is not padded."""
    left, right = band
    big = S + abs(q_offset) + T
    visible = np_window(
        T, S, q_offset, big if left is None else left, big if right is None else right
    )
    items = {}
    for i in range(-(-T // bq)):
        for j in range(-(-S // bk)):
            cells = visible[i * bq : (i + 1) * bq, j * bk : (j + 1) * bk]
            if cells.any():
                items[i, j] = "full" if cells.all() and cells.shape[1] == bk else "masked"
    return items


def scheduled_items(masked, full):
    items = {}
    for schedule, kind in ((masked, "masked"), (full, "full")):
        for t in range(schedule.steps):
            real = schedule.q_block[t] < schedule.n_q_blocks
            rows = schedule.q_block[t][real]
            assert len(set(rows.tolist())) == len(rows)  # distinct query blocks per step
            for i, j in zip(rows.tolist(), schedule.k_block[t][real].tolist()):
                assert (i, j) not in items, (i, j)  # each block pair once
                items[i, j] = kind
    return items


BANDS = [(None, 0), (3, 0), (0, 0), (2, 2), (0, 5), (7, 1)]  # causal, windows


@pytest.mark.parametrize("T, S", [(7, 19), (20, 13)])
@pytest.mark.parametrize("bq, bk", [(3, 4), (4, 3), (5, 8), (8, 5)])
def test_schedule_classifies_every_block_pair_at_every_offset(T, S, bq, bk):
    for band in BANDS:
        for q_offset in range(-bk, 2 * bk + 1):
            masked, full = block_schedules(T, S, bq, bk, 2, q_offset, False, band)
            got = scheduled_items(masked, full)
            assert got == expected_items(T, S, bq, bk, q_offset, band), (band, q_offset)


FORWARD_TILES, BACKWARD_TILES = (4, 3, 2), (3, 4, 3)
SWEEP_TILES = dict(forward_tiles=FORWARD_TILES, backward_tiles=BACKWARD_TILES)


def offset_sweep(window):
    """Causal attention, with ``window`` if given, at every static offset from 0 to
    2 * block_k of the forward tiles: every residue modulo both passes' blocks."""
    T, S = 7, 19
    cases = []
    for q_offset in range(2 * FORWARD_TILES[1] + 1):
        allowed = np_causal(T, S, q_offset)
        kwargs = dict(is_causal=True, q_offset=q_offset)
        if window is not None:
            allowed = allowed & np_window(T, S, q_offset, *window)
            kwargs["window"] = window
        q, k, v = qkv(T, S, seed=q_offset)
        cases.append(Case(f"q_offset={q_offset}, window={window}", q, k, v, allowed, kwargs=kwargs))
    return cases


def test_static_offsets_sweep_causal_window():
    # A causal window has both edges: the causal one on the right, the window's on
    # the left. Each compiled offset costs seconds, so plain causality is swept in the
    # slow test below (and its schedule, at every offset, in the test above).
    assert_cases_match(offset_sweep((3, 0)), implementations=["flash"], tiles=SWEEP_TILES)


@pytest.mark.slow
def test_static_offsets_sweep_causal():
    assert_cases_match(offset_sweep(None), implementations=["flash"], tiles=SWEEP_TILES)


# Window work and memory grow linearly in T


def scheduled_pairs(T, band, tiles=(256, 512, 4)):
    masked, full = block_schedules(T, T, tiles[0], tiles[1], tiles[2], 0, False, band)
    return masked.items + full.items


def test_window_block_pairs_grow_linearly():
    # With blocks of 256 queries and 512 keys: 62 and 126 pairs for window (512, 0)
    # at T = 8192 and 16384, against 272 and 1056 for full causal attention.
    window = [scheduled_pairs(T, (512, 0)) for T in (8192, 16384)]
    causal = [scheduled_pairs(T, (None, 0)) for T in (8192, 16384)]
    assert window[1] <= 2.1 * window[0], window  # linear: twice the length, twice the pairs
    assert causal[1] >= 3.8 * causal[0], causal  # quadratic
    assert window[1] * 6 <= causal[1], (window, causal)


def fwd_bwd_temp_bytes(T, **kwargs):
    shape = jax.ShapeDtypeStruct((1, T, 4, 32), jnp.float32)

    def loss(q, k, v):
        return nanoattn.flash_attention(q, k, v, is_causal=True, **kwargs).sum()

    compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(shape, shape, shape).compile()
    return compiled.memory_analysis().temp_size_in_bytes


def test_window_memory_is_at_most_linear_in_sequence_length():
    # Compile only. The kernel's memory is O(T) with or without a window (about 40 MiB
    # here, mostly the per-step buffers); a window rule built as a dense (T, S) mask
    # anywhere on the way would add 256 MiB at T = 16384, the reference's scores 1 GiB.
    at_8k = fwd_bwd_temp_bytes(8192, window=(512, 0))
    at_16k = fwd_bwd_temp_bytes(16384, window=(512, 0))
    assert at_16k <= 2.5 * at_8k, (at_8k, at_16k)
    assert at_16k <= 64 * 2**20, at_16k / 2**20


# (c) inside jax.shard_map, inputs that vary over the mesh and inputs that do not

VARYING = ["q", "k", "v", "bias", "q_ids", "kv_ids", "kv_lengths", "q_offset", "d_out"]


@pytest.mark.parametrize("which", VARYING)
def test_under_shard_map_any_one_varying_input(which):
    # On a one-device mesh, so in-process: shard_map types each value as varying
    # over the mesh axis or not. The kernel's scan carries start as zeros and must be
    # typed like the inputs (or the scan refuses its carry), and the gradient of an
    # input that does not vary is summed over the axis (or the custom VJP refuses
    # it; tests/parallel_cases.py checks that sum on two devices). Outputs and
    # gradients must equal those outside shard_map.
    from jax.sharding import AxisType
    from jax.sharding import PartitionSpec as Spec

    mesh = jax.make_mesh((1,), ("x",), axis_types=(AxisType.Auto,))
    q, k, v = qkv(9, 9, N=4, K=2, H=8, seed=7)
    args = dict(
        q=q, k=k, v=v,
        bias=jnp.asarray(randn(8, 2, 4, 9, 9)),
        q_ids=jnp.asarray([[0] * 5 + [1] * 4, [0] * 9], jnp.int32),
        kv_ids=jnp.asarray([[0] * 5 + [1] * 4, [0] * 9], jnp.int32),
        kv_lengths=jnp.asarray([9, 6], jnp.int32),
        q_offset=jnp.asarray([0, 2], jnp.int32),
        d_out=jnp.asarray(randn(9, 2, 9, 4, 8)),
    )  # fmt: skip

    def run(q, k, v, bias, q_ids, kv_ids, kv_lengths, q_offset, d_out):
        def attend(q, k, v, bias):
            return nanoattn.flash_attention(
                q, k, v, bias=bias, is_causal=True, q_offset=q_offset,
                q_segment_ids=q_ids, kv_segment_ids=kv_ids, kv_lengths=kv_lengths,
                forward_tiles=(4, 4, 2), backward_tiles=(4, 4, 2),
            )  # fmt: skip

        def loss(q, k, v, bias):
            return jnp.sum(attend(q, k, v, bias) * d_out)

        return attend(q, k, v, bias), jax.grad(loss, argnums=(0, 1, 2, 3))(q, k, v, bias)

    specs = tuple(Spec("x") if name == which else Spec() for name in VARYING)
    outside = jax.jit(run)(**args)
    out_specs = (Spec("x"), (Spec("x"),) * 4)
    inside = jax.jit(jax.shard_map(run, mesh=mesh, in_specs=specs, out_specs=out_specs))
    inside = inside(*args.values())
    for got, want in zip(jax.tree.leaves(inside), jax.tree.leaves(outside)):
        np.testing.assert_allclose(got, want, atol=1e-6, rtol=1e-6)


# (d) dtypes, plans and tiles that the cases above do not pin


def test_float32_under_x64_computes_in_float32_only(x64):
    # Under jax_enable_x64 a missing dtype means float64: every intermediate of the
    # forward and backward pass must stay float32 for float32 inputs, gradients too.
    q, k, v = qkv(11, 11, seed=21)
    bias = jnp.asarray(randn(24, 1, 4, 11, 11))
    mask = jnp.asarray(np.random.default_rng(25).random((2, 1, 11, 11)) > 0.2)

    def loss(q, k, v, bias):
        out = nanoattn.flash_attention(
            q, k, v, bias=bias, mask=mask, is_causal=True, logit_soft_cap=3.0,
            forward_tiles=(4, 4, 2), backward_tiles=(4, 4, 2),
        )  # fmt: skip
        return out.sum()

    closed = jax.make_jaxpr(jax.value_and_grad(loss, argnums=(0, 1, 2, 3)))(q, k, v, bias)
    floats = {
        var.aval.dtype
        for eqn in _equations(closed.jaxpr)
        for var in eqn.outvars
        if jnp.issubdtype(var.aval.dtype, jnp.floating)
    }
    assert floats == {jnp.dtype(jnp.float32)}, floats
    assert all(leaf.dtype == jnp.float32 for leaf in jax.tree.leaves(closed.out_avals))


def test_kernel_plans_are_forward_then_backward():
    from nanoattn._flash import BACKWARD_TILES, FORWARD_TILES, kernel_plans
    from nanoattn._spec import attention_spec

    q, k, v = qkv(300, 200)
    spec = attention_spec(q, k, v, is_causal=True, q_offset=0)
    forward, backward = kernel_plans(spec, (16, 32, 3), (8, 16, 5))
    assert (forward.block_q, forward.block_k, forward.lanes) == (16, 32, 3)
    assert (backward.block_q, backward.block_k, backward.lanes) == (8, 16, 5)
    forward, backward = kernel_plans(spec)  # fitted from each pass's own defaults
    assert FORWARD_TILES != BACKWARD_TILES
    assert forward.block_q == min(FORWARD_TILES[0], 300)
    assert backward.block_q == min(BACKWARD_TILES[0], 300)
    # The public functions check tiles first; kernel_plans still refuses empty ones.
    for tiles in [((0, 32, 1), None), (None, (8, 16, 0))]:
        with pytest.raises(ValueError, match=r"^block sizes and lanes must be >= 1, got \("):
            kernel_plans(spec, *tiles)


@pytest.mark.parametrize(
    "bias_shape, heads, tiles",
    [
        ((2, 4, 7, 5), (4, 2), (2, 3, 2)),
        ((1, 1, 7, 1), (4, 2), (2, 3, 2)),
        ((2, 1, 1, 5), (4, 2), (2, 3, 2)),
        ((2, 2, 7, 5), (2, 1), (4, 1, 2)),
    ],
)
def test_bias_gradient_with_small_blocks(bias_shape, heads, tiles):
    # Blocks of 2 query rows (and 3 keys), or 2 query blocks of 4 and keys one by one,
    # with a bias per head of 2 heads sharing one key head: each row, key and head of
    # the bias gets its own gradient, not a block's or a group's sum.
    N, K = heads
    q, k, v = qkv(7, 5, N=N, K=K, seed=26)
    bias = randn(27, *bias_shape)
    case = Case(f"bias {bias_shape}", q, k, v, bias=bias)
    tiles = dict(forward_tiles=tiles, backward_tiles=tiles)
    assert_cases_match([case], implementations=["flash"], tiles=tiles)


# A second sample of _flash.py's mutants (300, seed 4) found these unpinned.


def _scan_lengths(jaxpr) -> list[int]:
    return sorted(e.params["length"] for e in _equations(jaxpr) if e.primitive.name == "scan")


def test_the_tiles_given_are_the_tiles_run():
    # Causal 64 x 64: blocks of 8 give 8 diagonal (masked) steps and 28 full ones forward;
    # blocks of 16 give 4 and 6 backward.
    q, k, v = qkv(64, 64)

    def f(q, k, v):
        return nanoattn.flash_attention(
            q, k, v, is_causal=True, forward_tiles=(8, 8, 1), backward_tiles=(16, 16, 1)
        )

    assert _scan_lengths(jax.make_jaxpr(f)(q, k, v).jaxpr) == [8, 28]
    grad = jax.grad(lambda *a: f(*a).sum(), argnums=(0, 1, 2))
    assert _scan_lengths(jax.make_jaxpr(grad)(q, k, v).jaxpr) == [4, 6, 8, 28]


def test_fit_tiles_shrinks_only_as_far_as_the_budget_needs():
    from nanoattn._flash import FORWARD_STEP_CELLS, FORWARD_TILES, fit_tiles
    from nanoattn._spec import attention_spec

    def fit(B, T, S, N):
        q, kv = jnp.zeros((B, T, N, 8)), jnp.zeros((B, S, N, 8))
        return fit_tiles(FORWARD_TILES, FORWARD_STEP_CELLS, attention_spec(q, kv, kv))

    assert fit(1, 1024, 1024, 16) == (256, 512, 1)  # exactly the budget: nothing halved
    assert fit(1, 1024, 1024, 8) == (256, 512, 2)  # half of it: two lanes
    assert fit(4, 1024, 100, 32) == (128, 100, 1)  # the larger block halved, once
    assert fit(2, 512, 512, 32) == (256, 128, 1)  # keys 512 -> 256, then at a tie keys


def test_a_float64_key_makes_flash_compute_in_float64(x64):
    # The compute dtype is the widest of q, k and v, as in the reference.
    q, k, v = (np.asarray(a) for a in qkv(9, 9))
    jaxpr = jax.make_jaxpr(nanoattn.flash_attention)(q, k.astype(np.float64), v)
    dots = [e for e in _equations(jaxpr.jaxpr) if e.primitive.name == "dot_general"]
    assert dots and all(e.outvars[0].aval.dtype == jnp.float64 for e in dots)


def test_one_key_left_after_underflow_still_gets_its_row_gradients():
    # Logits 200 apart: the smaller key's weight underflows to exactly 0, so the row's
    # sum is exactly 1 and it sees one key. It is still a row that sees keys: dv goes to
    # the larger key only, as in the reference.
    q = np.array([[[[20.0]]]], np.float32)  # (1, 1, 1, 1)
    k = np.array([[[[10.0]], [[0.0]]]], np.float32)  # (1, 2, 1, 1): logits 200 and 0
    v = np.array([[[[1.0]], [[-2.0]]]], np.float32)
    case = Case("one key after underflow", q, k, v)  # H = 1: scale 1
    assert_cases_match([case], implementations=["flash"])
