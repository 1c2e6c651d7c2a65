"""The README and the docstring examples stay true to the code."""

import doctest
import importlib
import pathlib
import re

import pytest

from nanoattn.cli import main

ROOT = pathlib.Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
GUIDES = ["README.md", "docs/verify.md", "docs/decoding.md", "docs/flax.md"]
BLOCKS = [
    pytest.param(block, id=f"{name}-{i}")
    for name in GUIDES
    for i, block in enumerate(re.findall(r"```python\n(.*?)```", (ROOT / name).read_text(), re.S))
]


@pytest.mark.parametrize("block", BLOCKS)
def test_python_blocks_in_the_docs_run(block):
    exec(compile(block, "docs", "exec"), {})


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
        "nanoattn._attention",
        "nanoattn._masks",
        "nanoattn._rope",
        "nanoattn.linen._attention",
        "nanoattn._config",
    ],
)
def test_docstring_examples(module):
    mod = importlib.import_module(module)
    result = doctest.testmod(mod, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0 and result.failed == 0
