"""`nanoattn audit`: output, JSON, exit statuses, errors, and what a slow stage says on stderr."""

import io
import json
import re
import subprocess
import sys
import threading

import jax
import pytest

from nanoattn._backends.xla import reference
from nanoattn.cli import _stages, main
from nanoattn.verify import CheckResult, Report


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_default_audit_is_the_seed_worked_example(default_audit):
    code, out = default_audit
    assert code == 0
    assert "d_model 128, 4 heads of width 32, batch 2, 5 tokens" in out
    for row in [
        ("qkv", "(2, 5, 384)", "B T 3D", "3,840"),
        ("q heads", "(2, 5, 4, 32)", "B T N H", "1,280"),
        ("scores", "(2, 4, 5, 5)", "B N T S", "200"),
        ("concatenated heads", "(2, 5, 128)", "B T D", "1,280"),
    ]:
        line = next(x for x in out.splitlines() if x.strip().startswith(row[0] + "  "))
        assert line.split()[-1] == "ok"
        for cell in row[1:]:
            assert cell in line
    lines = out.splitlines()
    causal = lines.index("Causal mask")
    assert lines[causal + 1] == "Position:  1   2   3   4   5"
    assert lines[causal + 2] == "Token 1:   ✅  ❌  ❌  ❌  ❌"
    assert lines[causal + 6] == "Token 5:   ✅  ✅  ✅  ✅  ✅"
    combined = lines.index("Causal AND padding, batch row 2")
    assert lines[combined + 5] == "Token 4:   ✅  ✅  ✅  🚫  ❌"
    assert lines[combined + 7].startswith("Row sums:  1.000  1.000  1.000  1.000  1.000")
    assert "Both kinds of blocked cell in the row of token 4" in out
    assert "row sum 0, largest output 0   ok" in out
    verification = lines.index(
        "Verification of the built-in modules at d_model 128, 4 heads (nanoattn.verify)"
    )
    for subject in [
        "CausalSelfAttention causality",
        "CausalSelfAttention row sums",
        "CausalSelfAttention padding",
        "CrossAttention padding",
    ]:
        row = next(x for x in lines[verification:] if x.strip().startswith(subject))
        assert row.strip()[len(subject) :].split()[0] == "PASS"
    assert lines[-1] == "PASS"


def test_json_output(capsys):
    code, out, _ = run(capsys, "audit", "--no-verify", "--json", "--lengths", "5,2")
    report = json.loads(out)
    assert code == 0 and report["passed"] is True
    shapes = {s["stage"]: s for s in report["shapes"]}
    assert shapes["qkv"]["shape"] == [2, 5, 384] and shapes["qkv"]["axes"] == ["B", "T", "3D"]
    assert shapes["weights"]["elements"] == 200
    combined = [m for m in report["masks"] if m["title"] == "causal AND padding"]
    assert combined[1]["cells"][4] == ["allowed", "allowed", "padding", "padding", "padding"]
    assert combined[1]["cells"][1] == ["allowed", "allowed", "future", "future", "future"]


def test_ascii_has_no_emoji(capsys):
    code, out, _ = run(capsys, "audit", "--no-verify", "--ascii")
    assert code == 0 and out.isascii()
    assert "Token 4:   +   +   +   -   x" in out


def test_kv_len_audits_cross_attention(capsys):
    code, out, _ = run(capsys, "audit", "--no-verify", "--kv-len", "7", "--seq-len", "3", "--json")
    report = json.loads(out)
    assert code == 0 and report["module"] == "CrossAttention"
    shapes = {s["stage"]: s["shape"] for s in report["shapes"]}
    assert shapes["scores"] == [2, 4, 3, 7] and shapes["kv"] == [2, 7, 256]
    assert shapes["output"] == [2, 3, 128]
    assert {m["title"] for m in report["masks"]} == {
        "source padding, lengths [7, 5] (no causal triangle)"
    }


def test_other_sizes_change_the_traced_table(capsys):
    argv = "audit --no-verify --d-model 96 --heads 6 --batch 3 --seq-len 7 --json".split()
    code, out, _ = run(capsys, *argv)
    shapes = {s["stage"]: s["shape"] for s in json.loads(out)["shapes"]}
    assert code == 0 and shapes["q heads"] == [3, 7, 6, 16] and shapes["scores"] == [3, 6, 7, 7]


def test_kv_heads_audits_grouped_query_shapes(capsys):
    code, out, _ = run(capsys, "audit", "--no-verify", "--kv-heads", "2")
    lines = out.splitlines()
    assert code == 0 and lines[-1] == "PASS"
    assert lines[0] == (
        "nanoattn audit: CausalSelfAttention, d_model 128, 4 heads of width 32, "
        "2 key/value heads, batch 2, 5 tokens"
    )
    for row in [  # (N + 2K) H = (4 + 4) 32 = 256 columns; K = 2 key/value heads of width 32
        "  qkv                 (2, 5, 256)    B T (N+2K)H  2,560     project  ok",
        "  q heads             (2, 5, 4, 32)  B T N H      1,280     reshape  ok",
        "  k                   (2, 5, 64)     B S KH       640       split    ok",
        "  k heads             (2, 5, 2, 32)  B S K H      640       reshape  ok",
        "  v heads             (2, 5, 2, 32)  B S K H      640       reshape  ok",
        "  scores              (2, 4, 5, 5)   B N T S      200       einsum   ok",
    ]:
        assert row in lines


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--d-model", "130", "--heads", "4"], "d_model=130 is not divisible by n_heads=4"),
        (["--heads", "0"], "n_heads must be >= 1"),
        (["--lengths", "5,-1"], r"each length must be in [0, 5], got -1"),
        (["--lengths", "5,6"], r"each length must be in [0, 5], got 6"),
        (["--lengths", "5"], "--lengths gives 1 lengths for --batch 2"),
        (["--lengths", "a,b"], "expected comma-separated integers"),
        (["--seq-len", "0"], "--seq-len must be >= 1, got 0"),
        (["--batch", "-2"], "--batch must be >= 1, got -2"),
        (["--kv-len", "0"], "--kv-len must be >= 1"),
        (["--kv-heads", "3"], "n_kv_heads=3 does not divide n_heads=4"),
        (["--kv-heads", "0"], "n_kv_heads must be an int >= 1 or None, got n_kv_heads=0"),
        (["--d-model", "x"], "invalid int value: 'x'"),
        (["--bogus"], "unrecognized arguments: --bogus"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(capsys, argv, message):
    code, out, err = run(capsys, "audit", *argv)
    assert code == 2 and out == ""
    assert len(err.strip().splitlines()) == 1 and message in err and "Traceback" not in err


def test_audit_fails_with_exit_1_when_masking_is_broken(capsys, monkeypatch):
    # A plain softmax ignores the mask: row sums stay 1 but blocked cells get weight.
    def unmasked_softmax(logits, allowed, return_lse=False, sinks=None):
        probs = jax.nn.softmax(logits, axis=-1)
        return (probs, jax.nn.logsumexp(logits, axis=-1)) if return_lse else probs

    monkeypatch.setattr(reference, "masked_softmax", unmasked_softmax)
    code, out, _ = run(capsys, "audit", "--no-verify")
    assert code == 1 and out.splitlines()[-1] == "FAIL"
    assert "FAIL" in next(x for x in out.splitlines() if x.startswith("Row sums"))


@pytest.mark.slow
def test_console_entry_point_and_module():
    ok = subprocess.run(
        [sys.executable, "-m", "nanoattn", "audit", "--ascii", "--no-verify"],
        capture_output=True,
        text=True,
    )
    assert ok.returncode == 0 and ok.stdout.strip().endswith("PASS")
    bad = subprocess.run(
        [sys.executable, "-m", "nanoattn", "audit", "--d-model", "130"],
        capture_output=True,
        text=True,
    )
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    assert bad.stderr.strip() == (
        "nanoattn audit: error: d_model=130 is not divisible by n_heads=4, so the heads cannot "
        "split it into equal widths; head counts that divide 130: 1, 2, 5, 10, 13, 26, 65, 130"
    )


@pytest.mark.slow
def test_audit_exits_1_when_a_builtin_module_leaks(capsys, monkeypatch):
    import nanoattn._backends.xla.reference as reference

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


def test_stages_announce_only_a_stage_still_running_after_the_threshold():
    stream, written = io.StringIO(), threading.Event()
    stream.flush = written.set  # set once the timer thread has written its line
    stage = _stages.Stages("nanoattn audit", stream, after=0.01, clock=iter([0.0, 2.5]).__next__)
    with stage("verifying X"):
        assert written.wait(timeout=60)  # still running when the timer fires
    assert stream.getvalue().splitlines() == [
        "nanoattn audit: verifying X ...",
        "nanoattn audit: verifying X: done in 2.5 s",
    ]
    stream = io.StringIO()
    with _stages.Stages("nanoattn audit", stream, after=60)("quick"):
        pass
    with pytest.raises(ValueError), _stages.Stages("p", stream, after=0)("failing"):
        raise ValueError
    assert stream.getvalue() == "p: failing ...\n"  # no "done" after an error
    with _stages.Stages("p", None, after=0)("silent"):
        pass


def stage_lines(err: str) -> list[str]:
    return [re.sub(r": done in \d+\.\d s$", ": done in X s", line) for line in err.splitlines()]


def test_audit_says_what_each_stage_is_doing_on_a_terminal(capsys, monkeypatch):
    import nanoattn.verify._audit as audit

    def passed(*args, **kwargs):  # the verification itself is tested elsewhere
        return Report("faked", [CheckResult("faked", True)])

    monkeypatch.setattr(audit, "check_causality", passed)
    monkeypatch.setattr(audit, "check_padding", passed)
    monkeypatch.setattr(_stages, "AFTER_S", 0)  # every stage counts as slow
    argv = ["audit", "--d-model", "16", "--heads", "2"]
    code, plain, err = run(capsys, *argv)
    assert code == 0 and err == ""  # stderr is not a terminal: nothing
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    code, out, err = run(capsys, *argv)
    assert code == 0 and out == plain
    stages = [
        "tracing the shapes of one forward pass",
        "computing the weights of the mask examples",
        "checking a query that sees no key",
        "building CausalSelfAttention and CrossAttention and their weights",
        "verifying CausalSelfAttention causality",
        "verifying CausalSelfAttention row sums",
        "verifying CausalSelfAttention padding",
        "verifying CrossAttention padding",
    ]
    assert stage_lines(err) == [
        f"nanoattn audit: {what}{end}" for what in stages for end in (" ...", ": done in X s")
    ]
    code, out, err = run(capsys, *argv, "--json")
    assert code == 0 and err == "" and json.loads(out)["passed"] is True
