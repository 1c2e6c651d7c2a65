"""The README, the guides and the docstring examples stay true to the code.

Every ```python block of README.md, docs/*.md and examples/*/README.md runs, each in
a fresh namespace (tests/_docs_blocks.py finds them and says how): in this process,
or, for the blocks that ask for simulated devices, in one subprocess per device count
with that XLA flag. A block is skipped only after a ``<!-- not run: REASON -->``
comment, and those are listed here. Code written as a ```text or an indented block
fails the test: no test would run it.
"""

import doctest
import importlib
import json
import os
import re
import subprocess
import sys
import tomllib

import pytest
from _docs_blocks import (
    ROOT,
    blocks,
    indented_code,
    looks_like_python,
    markdown_files,
    not_run_markers,
    run,
)

from nanoattn.cli import main

README = (ROOT / "README.md").read_text()
ALL = [block for path in markdown_files() for block in blocks(path)]
PYTHON = [block for block in ALL if block.lang == "python"]
IN_PROCESS = [b for b in PYTHON if b.not_run is None and b.devices is None]
MULTI_DEVICE = [b for b in PYTHON if b.not_run is None and b.devices is not None]
NOT_RUN = [b for b in PYTHON if b.not_run is not None]
# The only blocks left unrun, each with its reason in the markdown; keep this short.
EXPECTED_NOT_RUN = [("docs/parallel.md", "needs two processes joined through a coordinator")]


@pytest.mark.parametrize("block", IN_PROCESS, ids=[b.where for b in IN_PROCESS])
def test_python_block_runs(block):
    try:
        run(block)
    except Exception as e:
        raise AssertionError(
            f"the python block at {block.where} fails: {type(e).__name__}: {e}"
        ) from e


@pytest.mark.slow  # a subprocess with 8 devices, 20 s; in `make test-all`
def test_multi_device_blocks_run_in_a_subprocess():
    by_devices = {}
    for block in MULTI_DEVICE:
        by_devices.setdefault(block.devices, []).append(block.where)
    assert by_devices, "no multi-device block found (docs/parallel.md has two)"
    failures = []
    for devices, wheres in sorted(by_devices.items()):
        # those devices, on top of the suite's own XLA flags (conftest.py's level)
        flags = os.environ.get("XLA_FLAGS", "")
        flags += f" --xla_force_host_platform_device_count={devices}"
        done = subprocess.run(
            [sys.executable, str(ROOT / "tests" / "_docs_blocks.py"), str(devices), *wheres],
            env={**os.environ, "XLA_FLAGS": flags.strip()},
            capture_output=True,
            text=True,
            timeout=600,
        )
        results = {}
        for line in done.stdout.splitlines():
            if line.startswith("{"):
                result = json.loads(line)
                results[result["block"]] = result["error"]
        for where in wheres:
            if where not in results:
                failures.append(f"{where}: not run (exit {done.returncode}): {done.stderr[-2000:]}")
            elif results[where] is not None:
                failures.append(f"the python block at {where} fails:\n{results[where][-3000:]}")
    assert not failures, "\n\n".join(failures)


@pytest.mark.parametrize("block", NOT_RUN, ids=[b.where for b in NOT_RUN])
def test_block_marked_not_run(block):
    pytest.skip(f"{block.where} not run: {block.not_run}")


def test_few_blocks_are_marked_not_run_and_each_marker_precedes_a_python_block():
    found = [(b.path, b.not_run) for b in NOT_RUN]
    assert [(path, reason.split(" (")[0]) for path, reason in found] == EXPECTED_NOT_RUN, found
    markers = sum(len(not_run_markers(path)) for path in markdown_files())
    assert markers == len(NOT_RUN), "a not-run marker that is not right before a python block"


def test_every_block_of_code_is_a_python_block():
    assert {b.lang for b in ALL} <= {"python", "sh", "text"}, sorted({b.lang for b in ALL})
    code_as_text = [b.where for b in ALL if b.lang != "python" and looks_like_python(b.code)]
    assert not code_as_text, f"python code in a non-python block, never run: {code_as_text}"
    indented = [f"{path}:{n}" for path in markdown_files() for n in indented_code(path)]
    assert not indented, f"indented code blocks, never run (fence them): {indented}"


def test_readme_says_where_the_commands_live_after_make_run():
    # After `make run` nothing is on PATH: the README's next commands need the venv.
    start = README.index("## The two commands")
    section = README[start : README.index("\n## ", start + 1)]
    assert "source .venv/bin/activate" in section and ".venv/bin/nanoattn" in section
    assert "pip install -e '.[examples]'" in section
    for command in ("nanoattn audit", "python -m examples.recall train"):
        assert command in section, command


def test_install_hints_name_extras_that_hold_the_package():
    """Every "X is not installed (... pip install 'nanoattn[E]' ...)" hint in the
    package names an extra E that holds X, and the torch hint names torch itself
    (an optional peer, in no extra)."""
    from nanoattn.bench import _torch

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    held = {name: {re.split(r"[<>=\[ ;]", r)[0] for r in reqs} for name, reqs in extras.items()}
    hints = []
    for path in (ROOT / "nanoattn").rglob("*.py"):
        text = re.sub(r'"\s*\n\s*"', "", path.read_text())  # join implicit concatenations
        hints += re.findall(r"(\w+) is not installed \(([^)]*)\)", text)
    assert hints, "no install hint found"
    for package, hint in hints:
        for extra in re.findall(r"nanoattn\[(\w+)\]", hint):
            assert package in held.get(extra, set()), (package, hint, extra, held.get(extra))
    torch_hint = dict(hints)["torch"]
    assert "pip install torch==" in torch_hint and not any("torch" in h for h in held.values())
    saved = sys.modules.get("torch", None)
    sys.modules["torch"] = None  # import torch now raises ImportError
    try:
        message = _torch.available()
    finally:
        if saved is None:
            del sys.modules["torch"]
        else:
            sys.modules["torch"] = saved
    assert message is not None and "pip install torch==" in message, message
    assert "nanoattn[" not in message, message


def test_verify_guide_examples_exit_as_shown(monkeypatch, capsys):
    monkeypatch.chdir(ROOT)
    guide = (ROOT / "docs/verify.md").read_text()
    for target, status in [("flax_causal", 0), ("flax_no_mask", 1)]:
        assert (
            main(
                [
                    "verify",
                    f"examples.verify_demo:{target}",
                    "--d-model",
                    "64",
                    "--seq-lens",
                    "1,2,5",
                ]
            )
            == status
        )
        assert f"verify_demo:{target} --d-model 64\n" in guide
    assert main(["verify", "examples.verify_demo:nothing", "--d-model", "64"]) == 2
    assert "examples.verify_demo has no attribute 'nothing'" in capsys.readouterr().err


def test_readme_shows_the_real_audit_output(default_audit):
    code, out = default_audit
    assert code == 0 and out.strip() in README


@pytest.mark.parametrize(
    "module",
    [
        "nanoattn._core.api",
        "nanoattn._base.masks",
        "nanoattn._core.merge",
        "nanoattn._core.rope",
        "nanoattn._layers.linen.attention",
        "nanoattn._layers.config",
        "nanoattn._interop.transformers",
    ],
)
def test_docstring_examples(module):
    mod = importlib.import_module(module)
    result = doctest.testmod(mod, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0 and result.failed == 0
