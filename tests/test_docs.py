"""The README and the docstring examples stay true to the code."""

import doctest
import importlib
import pathlib
import re

import pytest

from nanoattn.cli import main

ROOT = pathlib.Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()


@pytest.mark.parametrize("block", re.findall(r"```python\n(.*?)```", README, re.S))
def test_readme_python_blocks_run(block):
    exec(compile(block, "README.md", "exec"), {})


def test_readme_shows_the_real_audit_output(capsys):
    assert main(["audit"]) == 0
    real = capsys.readouterr().out.strip()
    assert real in README


@pytest.mark.parametrize(
    "module",
    [
        "nanoattn._attention",
        "nanoattn._masks",
        "nanoattn.linen._attention",
        "nanoattn.linen._config",
    ],
)
def test_docstring_examples(module):
    mod = importlib.import_module(module)
    result = doctest.testmod(mod, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0 and result.failed == 0
