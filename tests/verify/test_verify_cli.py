"""`nanoattn verify MODULE:OBJECT` (cli/_verify.py) on the causality check: exit statuses,
JSON, one-line errors, a run from the target's directory (targets in
tests/_verify_targets.py), and what a slow stage says on stderr; `--mask MODULE:MASK_FN`
(check_mask). `--decode` and `--vocab` are in test_verify_decoding.py."""

import json
import re
import subprocess
import sys

import pytest

from nanoattn.cli import _stages, main

from _paths import TESTS


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
        (["_verify_targets:not_callable", "--d-model", "4"], "is an int, not a callable"),
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
        cwd=TESTS,
    )
    assert done.returncode == 1 and "causality: FAIL" in done.stdout


def timeless(err: str) -> list[str]:
    return [re.sub(r": done in \d+\.\d s$", ": done in X s", line) for line in err.splitlines()]


def test_cli_verify_says_what_a_slow_stage_is_doing_on_a_terminal(capsys, monkeypatch):
    monkeypatch.setattr(_stages, "AFTER_S", 0)  # every stage counts as slow
    argv = ["verify", "_verify_targets:reversed_time", "--d-model", "4", "--seq-lens", "2,3"]
    code, plain, err = run(capsys, *argv)
    assert code == 1 and err == ""  # stderr is not a terminal: nothing
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    code, out, err = run(capsys, *argv)
    assert code == 1 and out == plain
    assert timeless(err) == [
        "nanoattn verify: loading _verify_targets:reversed_time ...",
        "nanoattn verify: loading _verify_targets:reversed_time: done in X s",
        "nanoattn verify: checking causality at 2 lengths up to 3 ...",
        "nanoattn verify: checking causality at 2 lengths up to 3: done in X s",
    ]
    code, out, err = run(capsys, *argv, "--json")
    assert code == 1 and err == "" and json.loads(out)["passed"] is False
    code, out, err = run(capsys, "verify", "_verify_targets:broken", "--d-model", "4")
    assert code == 2 and timeless(err) == [  # the error follows its stage's announcement
        "nanoattn verify: loading _verify_targets:broken ...",
        "nanoattn verify: loading _verify_targets:broken: done in X s",
        "nanoattn verify: checking causality at 12 lengths up to 513 ...",
        "nanoattn verify: error: calling _verify_targets:broken failed: RuntimeError: boom",
    ]


MASKS = """
def causal(b, n, q, k):
    return k <= q


def everything(b, n, q, k):  # claims more than a causal layer sees
    return q >= 0


def as_ints(b, n, q, k):
    return (k <= q).astype(int)
"""


def test_cli_verify_mask(capsys, monkeypatch, tmp_path):
    (tmp_path / "cli_masks.py").write_text(MASKS)
    monkeypatch.syspath_prepend(str(tmp_path))
    target = ["verify", "_verify_targets:causal_attention", "--d-model", "16", "--seq-lens", "5"]
    code, out, err = run(capsys, *target, "--mask", "cli_masks:causal")
    assert code == 0 and err == ""
    assert out.startswith(
        "nanoattn verify _verify_targets:causal_attention --mask cli_masks:causal "
        "(d_model 16, batch 2, lengths 5)\nmask: PASS\n"
    )
    code, out, _ = run(
        capsys, *target, "--mask", "cli_masks:everything", "--n-heads", "2", "--json"
    )
    report = json.loads(out)
    assert code == 1 and report["title"] == "mask"
    assert [c["status"] for c in report["checks"]] == ["PASS", "FAIL", "PASS", "PASS"]
    for argv, message in [
        (["--mask", "cli_masks"], "--mask must look like MODULE:MASK_FN, got 'cli_masks'"),
        (["--mask", "cli_masks:causal", "--decode"], "--mask checks one attention layer"),
        (["--n-heads", "2"], "--n-heads only applies with --mask"),
        (
            ["--mask", "cli_masks:as_ints"],
            "checking _verify_targets:causal_attention against cli_masks:as_ints failed: "
            "TypeError: mask_fn must return booleans",
        ),
    ]:
        code, out, err = run(capsys, *target, *argv)
        assert code == 2 and out == "" and message in err and len(err.splitlines()) == 1
