"""nanoattn.verify on our modules, on flax's attention, and on planted bugs."""

import json
import re
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
from nanoattn.verify._causality import DEFAULT_SEQ_LENS, changed_positions, split_points
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
    assert prefix.detail.startswith("first leak: output 0 of row ")
    assert prefix.detail.endswith("when only positions >= 1 changed (T=2, jit)")
    assert set(prefix.where) == {"length", "mode", "split", "position", "batch", "feature"}
    assert prefix.worst > 0.1
    first = prefix.data["first"]
    assert (first["length"], first["split"], first["position"]) == (2, 1, 0)
    field = by_name(report)["receptive field"]
    assert not field.passed
    assert field.detail.startswith("first leak: output 0 of row 0 has gradient")
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
    assert by_name(report)["prefix invariance"].detail.endswith("(T=2, jit)")


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
    first = single.data["first"]
    assert first.pop("deviation") == single.worst and first == single.where  # the only leak
    assert {key: single.where[key] for key in ("length", "mode", "changed", "position")} == {
        "length": 64,
        "mode": "jit",
        "changed": k + 1,
        "position": k,
    }
    field = by_name(report)["receptive field"]
    assert field.where | {"batch": 0} == {"length": 64, "batch": 0, "output": k, "input": k + 1}


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
        "_verify_targets:causal_attention",
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
        "_verify_targets:reversed_time",
        "--d-model",
        "4",
        "--seq-lens",
        "2,3",
        "--json",
    )
    report = json.loads(out)
    assert code == 1 and report["passed"] is False
    assert report["target"] == "_verify_targets:reversed_time"
    assert {c["name"]: c["status"] for c in report["checks"]}["prefix invariance"] == "FAIL"


@pytest.mark.parametrize(
    "argv, message",
    [
        (["nope_module:fn", "--d-model", "4"], "cannot import nope_module: ModuleNotFoundError"),
        (["_verify_targets:missing", "--d-model", "4"], "has no attribute 'missing'"),
        (["_verify_targets", "--d-model", "4"], "target must look like MODULE:OBJECT"),
        (["_verify_targets:not_callable", "--d-model", "4"], "is a int, not a callable"),
        (
            ["_verify_targets:failing_factory", "--d-model", "4"],
            "calling the factory _verify_targets:failing_factory() failed: ValueError: no weights",
        ),
        (
            ["_verify_targets:broken", "--d-model", "4"],
            "calling _verify_targets:broken failed: RuntimeError: boom",
        ),
        (
            ["_verify_targets:wrong_shape", "--d-model", "4", "--seq-lens", "3"],
            "fn must map an input of shape",
        ),
        (["_verify_targets:broken"], "give --d-model D for float inputs or --vocab V"),
        (
            ["_verify_targets:broken", "--d-model", "4", "--seq-lens", "0,2"],
            "--seq-lens must be lengths >= 1",
        ),
        (["_verify_targets:broken", "--d-model", "4", "--atol", "-1"], "--atol must be >= 0"),
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
            "_verify_targets:reversed_time",
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
    assert not field.passed and "from other batch rows (T=3)" in field.detail
    # The sentence and the worst give the leak's size.
    assert re.search(
        r"output \d of row \d has gradient [0-9.]+ from other batch rows", field.detail
    )
    assert f"{field.worst:.3g}" == re.search(r"has gradient ([0-9.]+) from", field.detail)[1]


# The bug classes the default sweep must catch: one head of many, one length past a
# block size, one mode (jit or eager), one batch row; and the pinned leak tolerance.


def prefix_mean(x):
    """A causal numpy function: the mean of the tokens so far, scale about 1."""
    x = np.asarray(x, np.float64)
    return np.cumsum(x, 1) / np.arange(1, x.shape[1] + 1)[:, None]


def test_a_leak_in_one_head_of_many_counts_at_its_full_size():
    # Six heads of width 3; head 4 (features 12..14) sees the next token a little. A numpy
    # function: no jit, no gradient, only the feature-by-feature comparison can see it.
    def one_head_leaks(x):
        y = prefix_mean(x)
        y[:, :-1, 12:15] += 1.5e-5 * np.asarray(x)[:, 1:, 12:15]
        return y

    report = check_causality(one_head_leaks, d_model=18, seq_lens=(2, 5))
    single = by_name(report)["future perturbation"]
    assert not single.passed and 12 <= single.data["first"]["feature"] < 15
    # Averaged over the 18 features, even three features at the worst would pass 1e-5.
    assert single.worst * 3 / 18 < 1e-5 < single.worst


def test_a_leak_past_128_tokens_is_caught_at_bounded_cost():
    def blockwise(T):  # past one tile of 128, the last query of a 32-key block sees the next
        m = np.tril(np.ones((T, T), bool))
        if T > 128:
            m[31, 32] = True
        return m

    buggy = heads_attention(blockwise)
    assert {129, 257, 513} <= set(DEFAULT_SEQ_LENS)
    report = check_causality(buggy, d_model=D, seq_lens=(64, 129))
    first = by_name(report)["future perturbation"].data["first"]  # none at 64, the old longest
    assert (first["length"], first["changed"], first["position"]) == (129, 32, 31)
    prefix = by_name(report)["prefix invariance"].data["first"]  # split at a block's first key
    assert (prefix["length"], prefix["split"], prefix["position"]) == (129, 32, 31)
    for T in (129, 257, 513, 4097):  # calls per length grow with log2(T), not T
        assert len(changed_positions(T)) <= 3 * np.log2(T) and len(split_points(T)) <= np.log2(T)


def causal_sum(x):
    return jnp.cumsum(x, axis=1)


def next_token_sum(x):  # position t also sees t + 1
    return jnp.cumsum(x, axis=1) + jnp.roll(x, -1, axis=1)


def test_a_leak_only_under_jit_is_caught():
    def leaks_when_traced(x):
        return (next_token_sum if isinstance(x, jax.core.Tracer) else causal_sum)(x)

    report = check_causality(leaks_when_traced, d_model=4, seq_lens=(5,))
    prefix = by_name(report)["prefix invariance"]
    assert not prefix.passed and prefix.data["first"]["mode"] == "jit"


def test_a_leak_only_outside_jit_is_caught_even_in_a_jitted_function():
    @jax.jit
    def leaks_when_eager(x):  # as a function with a numpy fallback for concrete inputs
        return (causal_sum if isinstance(x, jax.core.Tracer) else next_token_sum)(x)

    report = check_causality(leaks_when_eager, d_model=4, seq_lens=(2, 5))
    prefix = by_name(report)["prefix invariance"]
    assert not prefix.passed
    assert prefix.detail.endswith("(T=5, eager)") and prefix.data["first"]["mode"] == "eager"
    assert by_name(report)["receptive field"].passed  # traced, it is causal


def test_a_leak_in_the_second_batch_row_only_is_caught_exactly():
    def row_1_leaks(x):  # row 1 sees its next token, by far less than the tolerance
        return jnp.cumsum(x, axis=1) + 1e-7 * jnp.zeros_like(x).at[1, :-1].set(x[1, 1:])

    report = check_causality(row_1_leaks, d_model=4, seq_lens=(3,))
    assert by_name(report)["prefix invariance"].passed  # too small to change an output
    field = by_name(report)["receptive field"]
    assert not field.passed and field.where["batch"] == 1
    assert field.detail.startswith("first leak: output 0 of row 1 has gradient")


def test_a_leak_of_a_thousandth_of_the_output_is_caught():
    # Pins the leak tolerance: loosened a thousandfold (to 1e-2) it would pass this.
    def leaks_a_thousandth(x):
        y = prefix_mean(x)
        y[:, :-1] += 1e-3 * np.asarray(x)[:, 1:]
        return y

    report = check_causality(leaks_a_thousandth, d_model=D, seq_lens=(2, 9))
    assert by_name(report)["receptive field"].skipped  # numpy: no gradient
    single = by_name(report)["future perturbation"]
    assert not single.passed and single.worst < 1e-2
    assert single.data["first"]["deviation"] > 1e-5


# Token ids: a model from ids (B, T) in [0, V) to outputs, checked without embeddings.
V = 11
EMBED = jnp.asarray(np.random.default_rng(0).standard_normal((V, D)), jnp.float32)


def token_model(mask_for_length):
    attend = heads_attention(mask_for_length)
    return lambda ids: attend(EMBED[ids])


def test_token_id_model_passes_with_an_exact_receptive_field():
    causal = token_model(lambda T: np.tril(np.ones((T, T), bool)))
    report = check_causality(causal, vocab=V, seq_lens=(1, 2, 5))
    assert report.passed, report
    field = by_name(report)["receptive field"]
    assert field.detail.startswith("token ids have no gradient, so exactly, by perturbation")


def test_token_id_model_leaks_are_caught():
    def mask(T):
        m = np.tril(np.ones((T, T), bool))
        m[2, 3] = True
        return m

    report = check_causality(token_model(mask), vocab=V, seq_lens=(5,))
    single, field = by_name(report)["future perturbation"], by_name(report)["receptive field"]
    assert single.data["first"]["changed"] == 3 and single.data["first"]["position"] == 2
    assert not field.passed and field.data["first"]["position"] == 2


def test_token_id_model_mixing_rows_or_ignoring_its_input_fails_the_receptive_field():
    def mixes_rows(ids):
        return jnp.cumsum(EMBED[ids], 1) + jnp.cumsum(EMBED[ids[::-1]], 1)

    field = by_name(check_causality(mixes_rows, vocab=V, seq_lens=(3,)))["receptive field"]
    assert not field.passed and "when only the other rows changed (T=3)" in field.detail

    def forgets_position_1(ids):
        return jnp.cumsum(EMBED[ids], 1).at[:, 1].set(0.0)

    field = by_name(check_causality(forgets_position_1, vocab=V, seq_lens=(3,)))["receptive field"]
    assert (
        not field.passed
        and "unchanged when every token changed for output 1 of row 0" in field.detail
    )


def test_padding_on_token_ids():
    def masked_mean(ids, valid):
        w = valid[:, :, None]
        mean = (EMBED[ids] * w).sum(1, keepdims=True) / w.sum(1, keepdims=True)
        return jnp.broadcast_to(mean, (*ids.shape, D))

    assert check_padding(masked_mean, vocab=V).passed

    def ignores_valid(ids, valid):
        return jnp.broadcast_to(EMBED[ids].mean(1, keepdims=True), (*ids.shape, D))

    report = check_padding(ignores_valid, vocab=V)
    assert not by_name(report)["padded content is ignored (right padding)"].passed
    assert (
        "other token ids"
        in by_name(check_padding(masked_mean, vocab=V))
        .get("padded content is ignored (left padding)")
        .detail
    )


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(d_model=4, vocab=5), "pass d_model for float inputs (B, T, D) or vocab"),
        (dict(), "exactly one of them; got d_model=None, vocab=None"),
        (dict(vocab=1), "vocab must be an int >= 2, got vocab=1"),
        (dict(d_model=0), "d_model must be an int >= 1, got d_model=0"),
        (dict(d_model=4, batch=0), "batch must be an int >= 1, got batch=0"),
    ],
)
def test_input_kind_errors(kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        check_causality(lambda x: x, **kwargs)


# Details a mutation audit found unpinned: report text, boundaries, non-finite outputs


def test_report_table_exactly():
    report = Report("demo", [CheckResult("a", True, "fine", 0.0), CheckResult("bb", False)])
    assert str(report) == (
        "demo: FAIL\n"
        "  check  result  worst  where  detail\n"
        "  a      PASS    0             fine\n"
        "  bb     FAIL"
    )
    assert list(report.to_dict()) == ["title", "passed", "checks"]
    assert report.to_dict()["title"] == "demo"


def test_padding_report_exactly():
    # x * valid is exact: no rounding in the numbers, so the whole table is pinned.
    report = check_padding(lambda x, valid: x * valid[..., None], d_model=4)
    assert report.to_dict()["title"] == "padding"
    moved = by_name(report)["positive control"].worst
    assert str(report) == "\n".join(
        [
            "padding: PASS",
            "  check                                      result  worst  where  detail",
            *[
                f"  {f'padded content is ignored ({side} padding)':<41}  PASS    0             "
                "content at 3 padded positions set to +-1e+06, 15 valid outputs compared, "
                "tolerance 1e-05"
                for side in ("right", "left")
            ],
            f"  positive control                           PASS    {moved:.3g}          "
            f"changing the first token moved valid outputs by at least {moved:.3g} (must "
            "exceed 0.0001)",
        ]
    )
    right = by_name(report)["padded content is ignored (right padding)"]
    assert right.where is None and right.worst == 0.0


def test_padding_failure_names_the_row_and_its_huge_content():
    def sums_everything(x, valid):
        return jnp.broadcast_to((x * x).sum(1, keepdims=True), x.shape)

    check = by_name(check_padding(sums_everything, d_model=4))[
        "padded content is ignored (right padding)"
    ]
    assert check.where == {"batch": 1, "position": 0}
    assert check.detail == (
        f"output at valid position 0 of batch row 1 changed by {check.worst:.3g} when only "
        "padded content changed"
    )


def test_padding_non_finite_output_is_an_infinite_change():
    # +-1e30 overflows x * x: the output turns NaN, which must fail as an inf change.
    def nan_when_padding_is_huge(x, valid):
        return x + 0 * (x * x).sum(1, keepdims=True)

    report = check_padding(nan_when_padding_is_huge, d_model=4, huge=1e30)
    check = by_name(report)["padded content is ignored (right padding)"]
    assert not check.passed and check.worst == np.inf
    assert (
        "set to +-1e+30"
        in by_name(check_padding(causal_sum_valid, d_model=4, huge=1e30))[
            "padded content is ignored (right padding)"
        ].detail
    )


def causal_sum_valid(x, valid):
    return jnp.cumsum(x * valid[..., None], axis=1)


def test_padding_positive_control_failure_names_the_valid_outputs():
    control = by_name(check_padding(lambda x, v: jnp.zeros_like(x), d_model=4))["positive control"]
    assert control.detail.startswith(
        "insensitive: changing the first token moved valid outputs by only 0 "
    )


def test_causality_nan_output_is_an_infinite_leak():
    def nan_first(x):
        return jnp.cumsum(x, axis=1).at[:, 0].set(jnp.nan)

    report = check_causality(nan_first, d_model=D, seq_lens=(5,))
    check = by_name(report)["prefix invariance"]
    assert check.passed is False and check.worst == np.inf
    assert check.data["first"]["position"] == 0


def test_positive_control_must_exceed_its_threshold_strictly():
    from nanoattn.verify._leaks import SENSITIVITY, positive_control

    assert not positive_control(SENSITIVITY * 1e-5, 1e-5, "outputs").passed
    assert positive_control(SENSITIVITY * 1e-5 * 1.01, 1e-5, "outputs").passed
    assert not positive_control(0.0, 0.0, "outputs").passed


def test_smallest_valid_arguments_are_accepted():
    # vocab 2, batch 1, one feature: the bounds of the argument checks are inclusive.
    def causal_ids(ids):
        return jnp.cumsum(ids, axis=1).astype(jnp.float32)[..., None]

    assert check_causality(causal_ids, vocab=2, seq_lens=(3,), batch=1).passed
    assert check_causality(causal_sum, d_model=1, seq_lens=(3,), batch=1).passed
    assert check_padding(causal_sum_valid, d_model=1, batch=1).passed


def test_token_output_of_the_wrong_length_names_both_shapes():
    message = "fn must map an input of shape (B, T) = (2, 3) to (B, T, ...), got (2, 1)"
    with pytest.raises(ValueError, match=re.escape(message) + "$"):
        check_causality(lambda ids: ids[:, :1], vocab=5, seq_lens=(3,))


def test_long_sequences_are_probed_around_each_power_of_two():
    marks = {31, 32, 33, 63, 64, 65, 127, 128, 129}
    assert changed_positions(200) == sorted({1, 2, 100, 198, 199} | marks)
    assert split_points(200) == [1, 32, 64, 100, 128, 199]


def test_row_sums_details_and_five_axis_weights():
    allowed = np.array([[True, True, False], [False, False, False]])
    report = check_row_sums(np.array([[0.25, 0.75, 0.0], [0.0, 0.0, 0.0]]), allowed)
    assert [c.detail for c in report.checks] == [
        "1 rows with a permitted cell, tolerance 1e-05",
        "4 blocked cells, must be exactly 0",
        "1 rows with no permitted cell, must be all zeros",
    ]
    message = "allowed must be broadcastable to (..., T, S) = (1, 1, 1, 2, 3), got (3, 3)"
    with pytest.raises(ValueError, match=re.escape(message)):
        check_row_sums(np.zeros((1, 1, 1, 2, 3)), np.ones((3, 3), bool))


def test_check_shapes_knows_every_axis_it_traces_and_runs_with_dropout():
    from nanoattn.verify._shapes import axis_sizes, trace_stages

    every = set()
    for config, kv_len in [
        (AttentionConfig(48, 6, n_kv_heads=2), None),
        (AttentionConfig(64, 4), None),
        (AttentionConfig(48, 6, n_kv_heads=2), 7),
        (AttentionConfig(64, 4), 7),
    ]:
        sizes = axis_sizes(config, 2, 5, kv_len)
        used = {axis for stage in trace_stages(config, 2, 5, kv_len) for axis in stage.axes}
        assert used <= set(sizes), used - set(sizes)  # an unknown name would go unchecked
        every |= used
    assert {"H", "3D", "2KH"} <= every
    assert check_shapes(AttentionConfig(64, 4, dropout=0.1), batch=2, seq_len=5).passed


# A second mutation sample of nanoattn/verify (40 per file, seed 2) found these unpinned.


def test_check_details_name_what_was_counted():
    report = by_name(check_causality(causal_sum, d_model=4, seq_lens=(3,)))
    assert report["prefix invariance"].detail.startswith("shared-prefix pairs: ")
    assert report["future perturbation"].detail.startswith("single-token changes: ")
    causal = token_model(lambda T: np.tril(np.ones((T, T), bool)))
    field = by_name(check_causality(causal, vocab=V, seq_lens=(3,)))["receptive field"]
    assert field.detail.endswith("; every output changes when every token does")


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(d_model=4.0), "d_model must be an int >= 1, got d_model=4.0"),
        (dict(d_model=True), "d_model must be an int >= 1, got d_model=True"),
        (dict(vocab=5.0), "vocab must be an int >= 2, got vocab=5.0"),
    ],
)
def test_sizes_must_be_ints_not_floats_or_bools(kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message) + "$"):
        check_causality(lambda x: x, **kwargs)


@pytest.mark.parametrize("batch", [2.0, True])
def test_padding_batch_must_be_an_int(batch):
    message = f"batch must be an int >= 1, got batch={batch!r}"
    with pytest.raises(ValueError, match=re.escape(message) + "$"):
        check_padding(causal_sum_valid, d_model=4, batch=batch)


def test_padding_is_reproducible_from_its_seed():
    def sums_everything(x, valid):
        return jnp.broadcast_to((x * x).sum(1, keepdims=True), x.shape)

    runs = [check_padding(sums_everything, d_model=4, seed=s).to_dict() for s in (3, 3, 4)]
    assert runs[0] == runs[1] and runs[0] != runs[2]


def test_inputs_cover_the_vocabulary_and_keep_their_dtypes():
    from nanoattn.verify._inputs import Inputs, as_features

    rng = np.random.default_rng(0)
    ids = Inputs.of(None, 2).random(rng, 4, 64)
    assert ids.dtype == np.int32 and set(np.unique(ids)) == {0, 1}
    tokens = Inputs.of(None, 1000)
    x = tokens.random(rng, 4, 64)
    other = tokens.changed(rng, x)
    assert other.dtype == np.int32 and (other != x).all()
    assert len(np.unique((other - x) % 1000)) > 100  # each token moved independently
    floats = Inputs.of(3, None)
    assert floats.random(rng, 2, 5).dtype == np.float32
    assert floats.changed(rng, np.zeros((2, 5, 3), np.float32)).dtype == np.float32
    features = as_features(np.ones((2, 5, 3, 4), np.float32), (2, 5, 7))
    assert features.dtype == np.float64 and features.shape == (2, 5, 12)


def test_check_shapes_titles_and_cross_attention_axes():
    self_report = check_shapes(AttentionConfig(64, 4), batch=2, seq_len=5)
    assert self_report.title == "shapes of CausalSelfAttention"
    cross = check_shapes(AttentionConfig(64, 4), batch=2, seq_len=3, kv_len=7)
    assert cross.title == "shapes of CrossAttention"
    assert cross.passed, cross  # the kv projection is (B, S, 2D) when K = N
    assert {c.name: c.data["axes"] for c in cross.checks}["kv"] == ["B", "S", "2D"]


def test_row_sums_counts_places_and_empty_weights():
    # 3 rows: 1 with permitted cells, 2 without, so the counts cannot be swapped.
    allowed = np.array([[True, True, False], [False] * 3, [False] * 3])
    w = np.array([[0.25, 0.75, 0.0], [0.0] * 3, [0.0] * 3])
    report = check_row_sums(w, allowed)
    assert report.passed
    assert [c.detail for c in report.checks] == [
        "1 rows with a permitted cell, tolerance 1e-05",
        "7 blocked cells, must be exactly 0",
        "2 rows with no permitted cell, must be all zeros",
    ]
    assert all(c.where is None and c.worst == 0.0 for c in report.checks)  # nothing to point at
    empty = check_row_sums(np.zeros((0, 3)), np.ones((0, 3), bool))  # T = 0: no rows at all
    assert empty.passed and all(c.worst == 0.0 for c in empty.checks)
    message = "allowed must be broadcastable to (B, N, T, S) = (1, 2, 2, 3), got (3, 3)"
    with pytest.raises(ValueError, match=re.escape(message)):
        check_row_sums(np.zeros((1, 2, 2, 3)), np.ones((3, 3), bool))


# A third sample (60 per file, seed 3), run after the tests above, found these unpinned.


def test_causality_details_exactly():
    report = by_name(check_causality(causal_sum, d_model=4, seq_lens=(3,)))
    assert report["prefix invariance"].detail == (
        "shared-prefix pairs: 2 under jit and 2 eagerly (length 3), tolerance 1e-05"
    )
    assert (
        report["future perturbation"].detail == "single-token changes: 2 under jit, tolerance 1e-05"
    )
    assert report["positive control"].detail.endswith(" (must exceed 0.0001) in each of 2 runs")
    assert report["receptive field"].detail == (
        "gradients of 6 outputs (every batch row): exactly 0 from every later input and "
        "other row, non-zero from earlier inputs"
    )


def test_a_function_jax_cannot_trace_is_noted_once_and_skips_gradients():
    def numpy_prefix_sum(x):
        return np.cumsum(np.asarray(x, np.float64), 1)

    report = by_name(check_causality(numpy_prefix_sum, d_model=4, seq_lens=(3,)))
    assert report["prefix invariance"].detail.startswith(
        "shared-prefix pairs: 2 (fn run as given), tolerance 1e-05; not under jit, jax "
        "cannot trace fn (TracerArrayConversionError: "
    )
    assert report["future perturbation"].detail == (
        "single-token changes: 2 (fn run as given), tolerance 1e-05"
    )
    field = report["receptive field"]
    assert field.skipped and field.detail.startswith(
        "skipped, fn is not differentiable with jax (TracerArrayConversionError: "
    )


def test_a_small_batch_leak_and_a_dead_output_fail_the_receptive_field():
    def mixes_batch_slightly(x):
        return jnp.cumsum(x, axis=1) + 1e-3 * jnp.cumsum(x[::-1], axis=1)

    field = by_name(check_causality(mixes_batch_slightly, d_model=4, seq_lens=(3,)))[
        "receptive field"
    ]
    assert not field.passed and "from other batch rows (T=3)" in field.detail

    def forgets_position_1(x):
        return jnp.cumsum(x, axis=1).at[:, 1].set(0.0)

    field = by_name(check_causality(forgets_position_1, d_model=4, seq_lens=(3,)))[
        "receptive field"
    ]
    assert not field.passed
    assert "no gradient from any visible input for output 1 of row 0 (T=3)" in field.detail


def test_the_input_kind_message_whole_and_outputs_of_rank_two():
    from nanoattn.verify._inputs import as_features

    with pytest.raises(ValueError) as error:
        check_causality(causal_sum, d_model=4, vocab=5)
    assert str(error.value) == (
        "pass d_model for float inputs (B, T, D) or vocab for token ids (B, T), exactly one "
        "of them; got d_model=4, vocab=5"
    )
    assert as_features(np.ones((2, 5)), (2, 5, 3)).shape == (2, 5, 1)  # one number per token


def test_padding_positive_control_reads_only_valid_outputs_and_their_change():
    def only_padded_outputs_move(x, valid):
        return jnp.cumsum(x, axis=1) * (1 - valid[..., None])

    def constant(x, valid):
        return jnp.ones_like(x)

    for fn in (only_padded_outputs_move, constant):
        control = by_name(check_padding(fn, d_model=4))["positive control"]
        assert not control.passed and control.worst == 0.0, fn.__name__


def test_shape_problems_are_each_named_and_joined():
    sizes = {"B": 2, "T": 5, "D": 8}
    stages = [Stage("x", (2, 5), ("B", "T", "D"), "input")]
    check = shape_report(stages, sizes, "planted").checks[0]
    assert not check.passed and check.detail == "3 axis names for a rank-2 shape"
    stages = [
        Stage("q", (2, 5, 8), ("B", "T", "D"), "input"),
        Stage("q heads", (2, 5, 2, 3), ("B", "T", "N", "H"), "reshape", "q"),
    ]
    check = by_name(shape_report(stages, {**sizes, "N": 2, "H": 4}, "planted"))["q heads"]
    assert check.detail.count("; ") == 1 and check.detail.startswith(
        "axis H has size 3, expected 4; "
    )


def test_row_sums_title_float64_sums_and_higher_ranks():
    report = check_row_sums(np.array([[1.0, 1e-8]], np.float32), np.ones((1, 2), bool))
    assert report.title == "row sums"
    assert by_name(report)["permitted rows sum to 1"].worst == pytest.approx(1e-8, rel=1e-2)
    # Five axes: no names, the index of the worst cell.
    w = np.zeros((1, 1, 2, 2, 3))
    w[0, 0, 1, 1, 2] = 0.5
    cells = by_name(check_row_sums(w, np.zeros((2, 3), bool)))["blocked cells are 0"]
    assert cells.where == {"index": [0, 0, 1, 1, 2]}
    # Three axes (N, T, S): a fully blocked row of head 1, query 0 that is not zero.
    allowed = np.array([[False, False, False], [True, True, True]])
    w = np.zeros((2, 2, 3))
    w[:, 1] = 1 / 3
    w[1, 0, 2] = 0.25
    rows = by_name(check_row_sums(w, allowed))["fully blocked rows are 0"]
    assert rows.where == {"head": 1, "query": 0} and rows.worst == 0.25
    # No keys at all (S = 0): every row has no permitted cell, and is (vacuously) zero.
    empty = check_row_sums(np.zeros((2, 0)), np.zeros((2, 0), bool))
    assert empty.passed and empty.checks[2].detail.startswith("2 rows with no permitted cell")
