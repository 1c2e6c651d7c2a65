"""The fenced code blocks of the project's markdown, for tests/test_docs.py, and the
script that runs the multi-device ones in a process of their own.

The markdown is README.md, docs/*.md and examples/*/README.md. Every ```python block
runs, each in a fresh namespace (no block depends on another), with its line numbers
those of the file, so a traceback points into the markdown. Two exceptions, both
visible in the markdown itself:

* a block that asks for simulated CPU devices
  (``--xla_force_host_platform_device_count=N`` in its first lines, set before jax
  starts) runs in a subprocess with that XLA flag, since the test process has one
  device;
* a block right after the comment ``<!-- not run: REASON -->`` is not run (kept
  very few; test_docs.py lists them).

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python tests/_docs_blocks.py 8 FILE:LINE ...

runs the named blocks (FILE relative to the repository root, LINE the line of the
opening fence) one after the other in this process, after checking that it has that
many devices, and prints one JSON line per block: ``{"block": "FILE:LINE", "error":
null}`` or the traceback in ``error``.
"""

import ast
import dataclasses
import json
import re
import sys
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FENCE = re.compile(r"^```(\S*)\s*$")
NOT_RUN = re.compile(r"^<!-- not run: (.+?) -->$")
LIST_ITEM = re.compile(r"\s*([*+-]|\d+\.)\s")
DEVICES = re.compile(r"--xla_force_host_platform_device_count=(\d+)")


def markdown_files() -> list[str]:
    """The markdown whose code blocks are checked, relative to the repository root."""
    files = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    files += sorted((ROOT / "examples").glob("*/README.md"))
    return [str(f.relative_to(ROOT)) for f in files]


@dataclasses.dataclass(frozen=True)
class Block:
    """One fenced block: its file, the line of its opening fence, its language tag
    (``""`` when none), its text, and the reason of a ``not run`` marker, if any."""

    path: str
    line: int
    lang: str
    code: str
    not_run: str | None = None

    @property
    def where(self) -> str:
        return f"{self.path}:{self.line}"

    @property
    def devices(self) -> int | None:
        """The simulated CPU devices the block asks for, or None."""
        match = DEVICES.search(self.code)
        return int(match[1]) if match else None


def blocks(path: str) -> list[Block]:
    """Every fenced block of ``path``; an unclosed fence raises ValueError."""
    lines = (ROOT / path).read_text().splitlines()
    found, i = [], 0
    while i < len(lines):
        match = FENCE.match(lines[i])
        if not match:
            i += 1
            continue
        start = i
        i += 1
        while i < len(lines) and lines[i] != "```":
            i += 1
        if i == len(lines):
            raise ValueError(f"{path}:{start + 1}: the fence is never closed")
        before = next((lines[j] for j in range(start - 1, -1, -1) if lines[j].strip()), "")
        marker = NOT_RUN.match(before.strip())
        code = "\n".join(lines[start + 1 : i]) + "\n"
        found.append(Block(path, start + 1, match[1], code, marker[1] if marker else None))
        i += 1
    return found


def not_run_markers(path: str) -> list[int]:
    """The lines (1-based) of every ``not run`` marker in ``path``."""
    lines = (ROOT / path).read_text().splitlines()
    return [n for n, line in enumerate(lines, 1) if "<!-- not run" in line]


def indented_code(path: str) -> list[int]:
    """The first lines of indented (4-space) code blocks outside lists: code that no
    test runs (write it as a fenced block instead)."""
    lines = (ROOT / path).read_text().splitlines()
    starts, fenced, last = [], False, ""  # last: the last non-blank line outside fences
    for n, line in enumerate(lines, 1):
        if FENCE.match(line):
            fenced, last = not fenced, line
            continue
        if fenced or not line.strip():
            continue
        after_blank = n >= 2 and not lines[n - 2].strip()
        in_list = last.startswith(" ") or LIST_ITEM.match(last)
        if line.startswith("    ") and after_blank and not in_list:
            starts.append(n)
        last = line
    return starts


def looks_like_python(text: str) -> bool:
    """Whether a block's text is Python code (imports, assignments, calls, loops,
    definitions), not output or a formula."""
    if re.search(r"^(import \w|from [\w.]+ import )", text, re.M):
        return True
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return False
    statements = (ast.Import, ast.ImportFrom, ast.Assign, ast.AugAssign, ast.For, ast.With)
    statements += (ast.FunctionDef, ast.ClassDef, ast.If, ast.While)
    for node in tree.body:
        if isinstance(node, statements):
            return True
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Call):
            return True
    return False


def run(block: Block) -> None:
    """Runs ``block`` in a fresh namespace, its line numbers those of its file."""
    source = "\n" * block.line + block.code  # the code's first line is the fence's + 1
    exec(compile(source, str(ROOT / block.path), "exec"), {"__name__": "__docs__"})


def find(where: str) -> Block:
    """The block whose opening fence is at ``where`` (``FILE:LINE``)."""
    path, line = where.rsplit(":", 1)
    (block,) = [b for b in blocks(path) if b.line == int(line)]
    return block


def main(devices: str, *wheres: str) -> None:
    import jax

    if jax.device_count() != int(devices):
        raise SystemExit(f"{jax.device_count()} devices, not {devices}: set XLA_FLAGS")
    for where in wheres:
        try:
            run(find(where))
            error = None
        except Exception:
            error = traceback.format_exc()
        print(json.dumps({"block": where, "error": error}), flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:])
