"""apply_rope with the options of today's models (nanoattn/_core/rope.py): scaled
frequency tables (linear, llama3, yarn, dynamic) against transformers' own, computed in
float64 (tests/fixtures/models/rope.npz, made by tools/make_model_fixtures.py), and the
rotation with those tables against a float64 transcription, in both layouts and with
partial rotary. The plain half-split RoPE is tests/core/test_rope.py's."""

import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from nanoattn import apply_rope
from nanoattn._core.rope import frequencies, rope_scaling_of
from nanoattn.linen import AttentionConfig, CausalSelfAttention

from _np_layer import np_rope_table
from _reference import randn

FIXTURE = pathlib.Path(__file__).resolve().parent.parent / "fixtures" / "models" / "rope.npz"
B, L, N = 2, 9, 3
with np.load(FIXTURE) as z:
    TABLES = {k: z[k] for k in z.files}
CASES = {case["name"]: case for case in json.loads(str(TABLES.pop("cases")))}


def options(case: dict) -> dict:
    """apply_rope's arguments for one of transformers' cases: (base, rope_scaling,
    rotary_dim, seq_len)."""
    params = dict(case["parameters"])
    base = params.pop("rope_theta")
    H = case["head_dim"]
    R = int(H * params.pop("partial_rotary_factor", 1.0))
    if params["rope_type"] == "dynamic":  # transformers' max_position_embeddings
        params["original_max_position_embeddings"] = case["max_position_embeddings"]
    return dict(base=base, rope_scaling=params, rotary_dim=None if R == H else R)


@pytest.mark.parametrize("name", list(CASES))
def test_frequency_tables_are_transformers(name):
    case = CASES[name]
    opts = options(case)
    R = opts["rotary_dim"] or case["head_dim"]
    theta, factor = frequencies(R, opts["base"], rope_scaling_of(opts["rope_scaling"]),
                                case["seq_len"])  # fmt: skip
    np.testing.assert_allclose(theta, TABLES[f"{name}.inv_freq"], rtol=1e-12, atol=0)
    assert factor == pytest.approx(float(TABLES[f"{name}.attention_factor"]), rel=1e-12)


def test_the_tables_differ_from_plain_rope_where_the_scaling_says():
    # Each case moves some frequencies and keeps others, so a kind that ignored its
    # parameters could not pass the test above by accident.
    for name, case in CASES.items():
        opts = options(case)
        R = opts["rotary_dim"] or case["head_dim"]
        plain, _ = frequencies(R, opts["base"], None)
        moved = ~np.isclose(TABLES[f"{name}.inv_freq"], plain, rtol=1e-9)
        if name == "dynamic_short":  # 100 positions, below the 256 it was trained on
            assert not moved.any(), name
        else:
            assert moved.any(), name
        if case["parameters"]["rope_type"] in ("llama3", "yarn"):
            assert not moved.all(), name  # the highest frequencies are kept


@pytest.mark.parametrize("layout", ["half", "interleaved"])
@pytest.mark.parametrize("name", ["linear_partial", "llama3", "yarn_mscale", "dynamic_long"])
def test_rotation_with_transformers_tables_matches_a_float64_transcription(name, layout):
    case = CASES[name]
    H = case["head_dim"]
    x = randn(1, B, L, N, H)
    positions = np.array([[0, 1, 2, 3, 4, 5, 6, 7, 8], [999, 3, 0, 40, 21, 63, 2, 8, 500]])
    if case["seq_len"] is not None:  # dynamic: the longest position decides the table
        positions[1, 0] = case["seq_len"] - 1
    opts = options(case)
    got = apply_rope(x, positions, **opts, rope_layout=layout)
    want = np_rope_table(
        x.astype(np.float64), positions, TABLES[f"{name}.inv_freq"], opts["rotary_dim"],
        layout, float(TABLES[f"{name}.attention_factor"]),
    )  # fmt: skip
    assert got.dtype == jnp.float32
    np.testing.assert_allclose(got, want, atol=2e-4, rtol=1e-5)  # angles up to ~1000 rad


def test_interleaved_is_the_half_layout_with_features_permuted():
    # The docstring's conversion: half-layout feature i is interleaved feature perm[i].
    H, R = 10, 8
    x = randn(2, B, L, N, H)
    perm = np.concatenate([np.arange(0, R, 2), np.arange(1, R, 2), np.arange(R, H)])
    scaling = dict(rope_type="linear", factor=3.0)
    inter = apply_rope(x, np.arange(L) * 5, rotary_dim=R, rope_layout="interleaved",
                       rope_scaling=scaling)  # fmt: skip
    half = apply_rope(x[..., perm], np.arange(L) * 5, rotary_dim=R, rope_scaling=scaling)
    np.testing.assert_allclose(np.asarray(inter)[..., perm], half, atol=1e-6)
    assert (
        np.abs(
            np.asarray(inter)
            - np.asarray(apply_rope(x, np.arange(L) * 5, rotary_dim=R, rope_scaling=scaling))
        ).max()
        > 0.1
    )


def test_partial_rotary_rotates_the_first_features_as_a_whole_head_of_that_width():
    H, R = 10, 4
    x = randn(3, B, L, N, H)
    positions = np.arange(L) + 3
    got = np.asarray(apply_rope(x, positions, base=77.0, rotary_dim=R))
    np.testing.assert_array_equal(got[..., R:], x[..., R:])
    np.testing.assert_array_equal(got[..., :R], apply_rope(x[..., :R], positions, base=77.0))
    # An odd head width rotates fine when the rotated part is even.
    odd = apply_rope(randn(4, B, L, N, 7), positions, rotary_dim=6)
    assert odd.shape == (B, L, N, 7)


def test_yarn_multiplies_the_rotated_features_by_its_attention_factor():
    x = randn(5, B, L, N, 8)
    yarn = dict(rope_type="yarn", factor=16.0, original_max_position_embeddings=32)
    at_zero = np.asarray(apply_rope(x, np.zeros(L, np.int32), rope_scaling=yarn, rotary_dim=6))
    factor = 0.1 * np.log(16.0) + 1
    np.testing.assert_allclose(at_zero[..., :6], factor * x[..., :6], rtol=1e-6)
    np.testing.assert_array_equal(at_zero[..., 6:], x[..., 6:])


@pytest.mark.parametrize("scaling", [
    dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
         original_max_position_embeddings=8),
    dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=8, beta_fast=4.0),
])  # fmt: skip
def test_scaled_scores_still_depend_only_on_the_relative_position(scaling):
    H, M = 12, 20
    q, k = randn(6, 1, 1, 1, H), randn(7, 1, 1, 1, H)
    pos = np.arange(M)

    def rotate(a, layout):
        a = np.broadcast_to(a, (1, M, 1, H))
        rotated = apply_rope(a, pos, base=50.0, rope_scaling=scaling, rope_layout=layout)
        return np.asarray(rotated)[0, :, 0]

    for layout in ("half", "interleaved"):
        scores = rotate(q, layout).astype(np.float64) @ rotate(k, layout).T.astype(np.float64)
        for d in range(-M + 1, M):
            diag = np.diagonal(scores, offset=d)
            np.testing.assert_allclose(diag, diag[0], atol=1e-4, err_msg=f"{layout} {d}")


def test_dynamic_scaling_needs_concrete_positions():
    dynamic = dict(rope_type="dynamic", factor=2.0, original_max_position_embeddings=6)
    x = randn(8, 1, L, N, 8)
    short = apply_rope(x[:, :5], np.arange(5), rope_scaling=dynamic)
    np.testing.assert_array_equal(short, apply_rope(x[:, :5], np.arange(5)))  # no growth yet
    longer = apply_rope(x, np.arange(L), rope_scaling=dynamic)
    theta, _ = frequencies(8, 10000.0, rope_scaling_of(dynamic), seq_len=L)
    want = np_rope_table(x.astype(np.float64), np.arange(L)[None], theta)
    np.testing.assert_allclose(longer, want, atol=2e-5)
    assert np.abs(np.asarray(longer) - np.asarray(apply_rope(x, np.arange(L)))).max() > 1e-3
    # Under jit: numpy positions are concrete; traced ones are refused in one line.
    np.testing.assert_allclose(
        jax.jit(lambda x: apply_rope(x, np.arange(L), rope_scaling=dynamic))(x), longer, atol=1e-6
    )
    with pytest.raises(ValueError, match=r"^rope_scaling rope_type 'dynamic' needs concrete "
                       r"positions \(its base grows with the longest one\): call it outside "
                       r"jit, or pass positions as a numpy array"):  # fmt: skip
        jax.jit(lambda x, p: apply_rope(x, p, rope_scaling=dynamic))(x, np.arange(L))


def test_a_dynamic_layer_runs_under_jit_and_decodes_eagerly():
    scaling = dict(rope_type="dynamic", factor=2.0, original_max_position_embeddings=4)
    layer = CausalSelfAttention(AttentionConfig(16, 2, rope_base=100.0, rope_scaling=scaling))
    x = jnp.asarray(randn(9, 1, 6, 16))
    variables = layer.init(jax.random.key(0), x, decode=True)
    params = {"params": variables["params"]}
    full = jax.jit(lambda x: layer.apply(params, x, True))(x)
    np.testing.assert_allclose(full, layer.apply(params, x, True), atol=1e-6)
    # Eagerly the cache's positions are concrete: a one-call prefill equals the forward.
    y, _ = layer.apply({**params, "cache": variables["cache"]}, x, True, decode=True,
                       mutable=["cache"])  # fmt: skip
    np.testing.assert_allclose(y, full, atol=1e-5)

    @jax.jit
    def step(cache, chunk):
        return layer.apply({**params, "cache": cache}, chunk, True, decode=True, mutable=["cache"])

    with pytest.raises(ValueError, match="'dynamic' needs concrete positions"):
        step(variables["cache"], x[:, :1])


@pytest.mark.parametrize("kwargs, error, pattern", [
    (dict(rotary_dim=3), ValueError,
     r"^rotary_dim must be an even int in \[2, H\] \(the rotated features of each head\), "
     r"got rotary_dim=3 with H=8$"),
    (dict(rotary_dim=10), ValueError, r"got rotary_dim=10 with H=8$"),
    (dict(rotary_dim=4.0), TypeError, r"^rotary_dim must be an even int >= 2 or None"),
    (dict(rope_layout="neox"), ValueError,
     r"^rope_layout must be 'half' or 'interleaved', got rope_layout='neox'$"),
    (dict(rope_scaling=dict(rope_type="linear")), ValueError,
     r"^rope_scaling rope_type 'linear' needs factor$"),
    (dict(rope_scaling=dict(rope_type="yarn", factor=2.0, original_max_position_embeddings=0)),
     ValueError, r"^rope_scaling original_max_position_embeddings must be an int >= 1, got 0$"),
    (dict(rope_scaling=dict(rope_type="yarn", factor=2.0, original_max_position_embeddings=8,
                            truncate="no")),
     TypeError, r"^rope_scaling truncate must be True or False, got 'no'$"),
    (dict(rope_scaling=dict(rope_type="linear", factor=2.0, rope_theta=1.0)), ValueError,
     r"^rope_scaling key 'rope_theta' is not a parameter of rope_type 'linear', which takes "
     r"factor; it is rope_base$"),
    (dict(rope_scaling=dict(rope_type="default")), ValueError,
     r"got 'default' \(rope_scaling=None is plain RoPE\)$"),
    (dict(rope_scaling=dict(rope_type="dynamic", factor=2.0, original_max_position_embeddings=4),
          rotary_dim=2),
     ValueError, r"^rope_scaling rope_type 'dynamic' needs rotary_dim > 2, got R=2$"),
])  # fmt: skip
def test_invalid_options(kwargs, error, pattern):
    with pytest.raises(error, match=pattern):
        apply_rope(np.ones((B, L, N, 8), np.float32), np.arange(L), **kwargs)
