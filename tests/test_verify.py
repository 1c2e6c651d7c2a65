"""nanoattn.verify on our modules, on flax's attention, and on planted bugs."""

import json
import subprocess
import sys
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from nanoattn import attention_weights, dot_product_attention, padding_mask
from nanoattn._trace import Stage
from nanoattn.cli import main
from nanoattn.linen import AttentionConfig, CausalSelfAttention, CrossAttention
from nanoattn.verify import (
    CheckResult,
    Report,
    check_causality,
    check_padding,
    check_row_sums,
    check_shapes,
)
from nanoattn.verify._shapes import shape_report

D = 16
LENS = (1, 2, 5, 17)


def by_name(report: Report) -> dict[str, CheckResult]:
    return {c.name: c for c in report.checks}


def heads_attention(mask_for_length):
    """A tiny attention over x itself, 2 heads, with a (T, T) mask from a function."""

    def fn(x):
        B, T, _ = x.shape
        q = x.reshape(B, T, 2, D // 2)  # (B, T, N, H)
        return dot_product_attention(q, q, q, mask=mask_for_length(T)).reshape(B, T, D)

    return fn


def flax_attention(with_mask: bool):
    mha = nn.MultiHeadDotProductAttention(num_heads=2, qkv_features=D)
    params = mha.init(jax.random.key(0), jnp.ones((1, 3, D)))

    def fn(x):
        mask = nn.make_causal_mask(x[..., 0]) if with_mask else None
        return mha.apply(params, x, mask=mask)

    return jax.jit(fn)


def test_flax_attention_with_causal_mask_passes():
    report = check_causality(flax_attention(with_mask=True), d_model=D, seq_lens=LENS)
    assert report.passed, report
    assert set(by_name(report)) == {
        "prefix invariance",
        "future perturbation",
        "positive control",
        "receptive field",
    }
    assert not by_name(report)["receptive field"].skipped


def test_flax_attention_without_mask_fails_and_names_the_first_leak():
    report = check_causality(flax_attention(with_mask=False), d_model=D, seq_lens=LENS)
    assert not report.passed
    prefix = by_name(report)["prefix invariance"]
    assert not prefix.passed
    assert prefix.detail.startswith("first leak: output 0 changed by")
    assert prefix.detail.endswith("when only positions >= 1 changed (T=2)")
    assert set(prefix.where) == {"length", "split", "position"} and prefix.worst > 0.1
    field = by_name(report)["receptive field"]
    assert not field.passed
    assert field.detail.startswith("first leak: output 0 has gradient")
    assert field.detail.endswith("from the later input 1 (T=2)")
    assert "first leak" in str(report)


@pytest.mark.slow
def test_our_modules_pass():
    layer = CausalSelfAttention(AttentionConfig(D, 2))
    params = layer.init(jax.random.key(0), jnp.ones((1, 2, D)), deterministic=True)
    causal = jax.jit(lambda x: layer.apply(params, x, deterministic=True))
    check_causality(causal, d_model=D).raise_if_failed()  # the default lengths, up to 64
    padded = jax.jit(lambda x, v: layer.apply(params, x, deterministic=True, mask=padding_mask(v)))
    check_padding(padded, d_model=D).raise_if_failed()
    cross = CrossAttention(AttentionConfig(D, 2))
    cparams = cross.init(
        jax.random.key(0), jnp.ones((1, 2, D)), jnp.ones((1, 3, D)), deterministic=True
    )
    cross_fn = jax.jit(lambda x, v: cross.apply(cparams, x, x, deterministic=True, context_mask=v))
    check_padding(cross_fn, d_model=D, lengths=[4, 9], batch=2).raise_if_failed()


MAX = 64
TRIANGLE = np.tril(np.ones((MAX, MAX), bool))


@pytest.mark.slow
def test_mask_sliced_wrongly_from_a_precomputed_maximum_is_caught():
    # Right only at T = MAX: rows taken from the bottom of the triangle see the future.
    buggy = heads_attention(lambda T: TRIANGLE[MAX - T :, :T])
    assert check_causality(buggy, d_model=D, seq_lens=(MAX,)).passed  # fine at one length
    report = check_causality(buggy, d_model=D, seq_lens=(1, 2, 5, MAX))
    assert not report.passed
    assert by_name(report)["prefix invariance"].detail.endswith("(T=2)")


def test_mask_sliced_too_tight_is_caught_by_the_receptive_field():
    # Sliced from the right: rows see too little (nothing at all for early rows).
    buggy = heads_attention(lambda T: TRIANGLE[:T, MAX - T :])
    report = check_causality(buggy, d_model=D, seq_lens=(2, 5))
    field = by_name(report)["receptive field"]
    assert not field.passed and "no gradient from any visible input" in field.detail


@pytest.mark.parametrize("k", [0, 40, 62])
def test_single_off_by_one_leak_in_64_tokens_is_caught(k):
    def mask(T):
        m = np.tril(np.ones((T, T), bool))
        if k + 1 < T:
            m[k, k + 1] = True  # position k sees position k + 1
        return m

    report = check_causality(heads_attention(mask), d_model=D, seq_lens=(64,))
    assert not report.passed
    single = by_name(report)["future perturbation"]
    assert single.where == {"length": 64, "changed": k + 1, "position": k}
    field = by_name(report)["receptive field"]
    assert field.where == {"length": 64, "output": k, "input": k + 1}


def test_leak_caught_without_jax_gradients():
    # A numpy function: the receptive field is skipped, the perturbation sweep still finds it.
    def numpy_leak(x):
        x = np.asarray(x)
        y = np.cumsum(x, axis=1)
        y[:, 40] += x[:, 41]
        return y

    report = check_causality(numpy_leak, d_model=D, seq_lens=(64,))
    assert by_name(report)["receptive field"].skipped
    assert by_name(report)["future perturbation"].where["position"] == 40
    assert not report.passed


def test_constant_function_is_insensitive():
    report = check_causality(lambda x: jnp.zeros_like(x), d_model=D, seq_lens=LENS)
    control = by_name(report)["positive control"]
    assert not report.passed and not control.passed
    assert control.detail.startswith("insensitive")
    # The leak checks alone would have passed: the control is what fails it.
    assert by_name(report)["prefix invariance"].passed


def test_position_wise_function_is_insensitive():
    report = check_causality(lambda x: 2 * x, d_model=D, seq_lens=LENS)
    assert not by_name(report)["positive control"].passed


def test_padding_function_that_ignores_its_mask_fails():
    layer = CausalSelfAttention(AttentionConfig(D, 2))
    params = layer.init(jax.random.key(0), jnp.ones((1, 2, D)), deterministic=True)
    ignores = jax.jit(lambda x, v: layer.apply(params, x, deterministic=True))
    report = check_padding(ignores, d_model=D)
    checks = by_name(report)
    # Causal attention never sees right padding, so only the left layout exposes it.
    assert checks["padded content is ignored (right padding)"].passed
    left = checks["padded content is ignored (left padding)"]
    assert not left.passed and not report.passed
    assert "changed by" in left.detail and left.where["batch"] == 1
    # A non-causal function that ignores the mask fails both layouts.
    mean = check_padding(
        lambda x, v: jnp.broadcast_to(x.mean(1, keepdims=True), x.shape), d_model=D
    )
    assert not by_name(mean)["padded content is ignored (right padding)"].passed


def test_padding_constant_function_is_insensitive():
    report = check_padding(lambda x, v: jnp.zeros_like(x), d_model=D)
    assert not by_name(report)["positive control"].passed


def test_row_sums():
    allowed = np.array([[True, True, False], [False, False, False]])
    good = np.array([[0.25, 0.75, 0.0], [0.0, 0.0, 0.0]])
    assert check_row_sums(good, allowed).passed
    bad_sum = by_name(check_row_sums(good * 0.9, allowed))["permitted rows sum to 1"]
    assert not bad_sum.passed and bad_sum.where == {"query": 0}
    assert bad_sum.worst == pytest.approx(0.1)
    leak = np.array([[0.2, 0.7, 0.1], [0, 0, 0]])
    cells = by_name(check_row_sums(leak, allowed))["blocked cells are 0"]
    assert not cells.passed and cells.where == {"query": 0, "key": 2}
    blocked = good + np.array([[0, 0, 0], [0.5, 0.5, 0]])
    rows = by_name(check_row_sums(blocked, allowed))["fully blocked rows are 0"]
    assert not rows.passed and rows.where == {"query": 1}


def test_row_sums_broadcast_against_the_library_weights():
    q = jax.random.normal(jax.random.key(0), (2, 5, 3, 4))
    w = attention_weights(q, q, is_causal=True)
    report = check_row_sums(w, np.tril(np.ones((5, 5), bool)))
    assert report.passed and by_name(report)["permitted rows sum to 1"].worst < 1e-5
    wrong = check_row_sums(w, np.eye(5, dtype=bool))  # the weights leak beyond this mask
    worst = by_name(wrong)["blocked cells are 0"]
    assert not worst.passed and set(worst.where) == {"batch", "head", "query", "key"}


def test_row_sums_input_errors():
    with pytest.raises(TypeError, match="allowed must be a boolean"):
        check_row_sums(np.ones((2, 2)), np.ones((2, 2)))
    with pytest.raises(ValueError, match=r"allowed must be broadcastable to \(T, S\) = \(2, 2\)"):
        check_row_sums(np.ones((2, 2)), np.ones((3, 2), bool))


def test_check_shapes_records_every_stage():
    report = check_shapes(AttentionConfig(128, 4), batch=2, seq_len=5)
    assert report.passed
    records = {c.name: c.data for c in report.checks}
    assert list(records)[:3] == ["input", "qkv", "q"]
    assert records["qkv"] == {
        "shape": [2, 5, 384],
        "axes": ["B", "T", "3D"],
        "elements": 3840,
        "op": "project",
        "source": "input",
    }
    cross = check_shapes(AttentionConfig(64, 4), batch=2, seq_len=3, kv_len=7)
    assert {c.name: c.data["shape"] for c in cross.checks}["scores"] == [2, 4, 3, 7]


def test_check_shapes_knows_the_grouped_query_axes():
    from nanoattn.verify._shapes import axis_sizes, trace_stages

    config = AttentionConfig(48, 6, n_kv_heads=2)  # H = 8, (N + 2K) H = 80, K H = 16
    report = check_shapes(config, batch=2, seq_len=5)
    assert report.passed, report
    shapes = {c.name: (c.data["shape"], c.data["axes"]) for c in report.checks}
    assert shapes["qkv"] == ([2, 5, 80], ["B", "T", "(N+2K)H"])
    assert shapes["k heads"] == ([2, 5, 2, 8], ["B", "S", "K", "H"])
    # Every one of those axis names is checked: the same trace judged against K = 3 fails.
    stages = trace_stages(config, 2, 5, None)
    wrong = axis_sizes(AttentionConfig(48, 6, n_kv_heads=3), 2, 5, None)
    failed = {c.name for c in shape_report(stages, wrong, "planted").checks if not c.passed}
    assert {"qkv", "k", "v", "k heads", "v heads"} <= failed


def test_shape_report_catches_lost_elements_and_wrong_axis_sizes():
    sizes = {"B": 2, "T": 5, "D": 8, "N": 2, "H": 4, "3D": 24}
    stages = [
        Stage("q", (2, 5, 8), ("B", "T", "D"), "input"),
        Stage("q heads", (2, 5, 2, 3), ("B", "T", "N", "H"), "reshape", "q"),
        Stage("qkv", (2, 5, 24), ("B", "T", "3D"), "project"),
        Stage("k", (2, 5, 8), ("B", "T", "D"), "split", "qkv"),
        Stage("v", (2, 5, 8), ("B", "T", "D"), "split", "qkv"),
    ]
    checks = by_name(shape_report(stages, sizes, "planted"))
    assert checks["q"].passed and not checks["q heads"].passed
    assert "axis H has size 3, expected 4" in checks["q heads"].detail
    assert "60 elements, but q had 80" in checks["q heads"].detail
    assert "the parts of qkv hold 160 elements, it held 240" in checks["k"].detail


def test_report_table_json_and_raise():
    report = Report(
        "demo",
        [
            CheckResult("a", True, "fine", 0.0),
            CheckResult("b", False, "broken", 0.5, {"length": 3}),
        ],
    )
    text = str(report)
    assert text.splitlines()[0] == "demo: FAIL"
    assert "b      FAIL    0.5    length 3  broken" in text
    with pytest.raises(AssertionError, match=r"(?s)verification failed.*broken"):
        report.raise_if_failed()
    data = json.loads(json.dumps(report.to_dict()))
    assert data["passed"] is False and data["checks"][1]["where"] == {"length": 3}
    ok = Report("ok", [CheckResult("a", True)])
    assert ok.raise_if_failed() is ok


def test_argument_errors():
    with pytest.raises(ValueError, match="seq_lens must be non-empty"):
        check_causality(lambda x: x, d_model=4, seq_lens=())
    with pytest.raises(ValueError, match=r"lengths must have shape \(B,\) = \(2,\)"):
        check_padding(lambda x, v: x, d_model=4, lengths=[3])
    with pytest.raises(ValueError, match=r"fn must map an input of shape \(B, T, D\)"):
        check_causality(lambda x: x[:, :1], d_model=4, seq_lens=(3,))


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_verify_passing_target(capsys):
    code, out, err = run(
        capsys,
        "verify",
        "verify_targets:causal_attention",
        "--d-model",
        "16",
        "--seq-lens",
        "1,2,5,9",
    )
    assert code == 0 and err == ""
    assert "causality: PASS" in out and "receptive field" in out


def test_cli_verify_failing_target_json(capsys):
    code, out, _ = run(
        capsys,
        "verify",
        "verify_targets:reversed_time",
        "--d-model",
        "4",
        "--seq-lens",
        "2,3",
        "--json",
    )
    report = json.loads(out)
    assert code == 1 and report["passed"] is False
    assert report["target"] == "verify_targets:reversed_time"
    assert {c["name"]: c["status"] for c in report["checks"]}["prefix invariance"] == "FAIL"


@pytest.mark.parametrize(
    "argv, message",
    [
        (["nope_module:fn", "--d-model", "4"], "cannot import nope_module: ModuleNotFoundError"),
        (["verify_targets:missing", "--d-model", "4"], "has no attribute 'missing'"),
        (["verify_targets", "--d-model", "4"], "target must look like MODULE:OBJECT"),
        (["verify_targets:not_callable", "--d-model", "4"], "is a int, not a callable"),
        (
            ["verify_targets:failing_factory", "--d-model", "4"],
            "calling the factory verify_targets:failing_factory() failed: ValueError: no weights",
        ),
        (
            ["verify_targets:broken", "--d-model", "4"],
            "calling verify_targets:broken failed: RuntimeError: boom",
        ),
        (
            ["verify_targets:wrong_shape", "--d-model", "4", "--seq-lens", "3"],
            "fn must map an input of shape",
        ),
        (["verify_targets:broken"], "the following arguments are required: --d-model"),
        (
            ["verify_targets:broken", "--d-model", "4", "--seq-lens", "0,2"],
            "--seq-lens must be lengths >= 1",
        ),
        (["verify_targets:broken", "--d-model", "4", "--atol", "-1"], "--atol must be >= 0"),
    ],
)
def test_cli_verify_errors_exit_2(capsys, argv, message):
    code, out, err = run(capsys, "verify", *argv)
    assert code == 2 and out == ""
    assert len(err.strip().splitlines()) == 1 and message in err and "Traceback" not in err


def test_cli_verify_subprocess_from_the_target_directory():
    tests = Path(__file__).parent
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "nanoattn",
            "verify",
            "verify_targets:reversed_time",
            "--d-model",
            "4",
            "--seq-lens",
            "2",
        ],
        capture_output=True,
        text=True,
        cwd=tests,
    )
    assert done.returncode == 1 and "causality: FAIL" in done.stdout


@pytest.mark.slow
def test_audit_exits_1_when_a_builtin_module_leaks(capsys, monkeypatch):
    import nanoattn._reference as reference

    real = reference.band_mask  # the reference's positional (causal) mask, shifted one key late
    monkeypatch.setattr(
        reference,
        "band_mask",
        lambda T, S, left, right, *, q_offset=0: real(T, S, left, right, q_offset=q_offset + 1),
    )
    code, out, _ = run(capsys, "audit", "--d-model", "16", "--heads", "2")
    assert code == 1
    row = next(x for x in out.splitlines() if x.strip().startswith("CausalSelfAttention causality"))
    assert "FAIL" in row and "first leak" in row


def test_gradient_across_batch_rows_is_caught():
    # Causal in time, but every row also reads the other rows' prefixes.
    def mixes_batch(x):
        return jnp.cumsum(x, axis=1) + jnp.cumsum(x[::-1], axis=1)

    report = check_causality(mixes_batch, d_model=4, seq_lens=(3,))
    field = by_name(report)["receptive field"]
    assert by_name(report)["prefix invariance"].passed
    assert not field.passed and "reaches other batch rows" in field.detail
