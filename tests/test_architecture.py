"""The layering of the package, read from its source (docs/architecture.md).

Each folder is a layer, and imports flow one way, down this list, never back:
tools (``verify/``, ``bench/``, ``cli/``) -> interop (``_interop/``: the flax and
jax.nn adapters) -> layers (``_layers/``: the config, the shared steps, the caches,
linen, NNX) -> core (``_core/``: the public functions, merge, RoPE; ``parallel/``:
the ring) -> kernels (``_backends/``: the registry, the dispatch, one module or folder
per backend) -> base (``_base/``: the rules of a call, validation, masks, the
shared numerics). A module belongs to the deepest folder the table names. The imports
are read with ``ast`` from every module, those inside functions included, so a lazy
import cannot hide a back edge. Package ``__init__`` files and the public faces at the
root (``linen.py``, ``nnx.py``) only re-export and are not layered.

Nothing private crosses a package. A package here is one folder of ``nanoattn/``
(``bench/``, ``_backends/flash/``; the root's own modules are one): a module belongs to
the folder that holds it, a package's ``__init__`` to that package. A private module is
a file whose name starts with ``_`` (``bench/_run.py``; not ``__init__.py``), a private
name one that starts with ``_`` (``_weights``). Either is imported only by modules of
its own package: never ``from ..bench._run import SHAPES``, ``from ..verify import
_audit`` or ``from ..xla.reference import _weights`` from another, and never reached
as an attribute (``reference._weights``). A package lends names to another by
re-exporting them from its ``__init__`` or from a public module beside it
(``bench/__init__.py``, ``verify/command_line.py``). A private folder (``_base/``,
``_core/``) only keeps its modules out of the public API: its modules whose names do
not start with ``_`` (``_base/rules.py``) and their public names are shared internals,
for every package above them. The few imports that break the rule today are listed,
each with its reason, in ``CROSSING_ALLOWED``.

No function is longer than ``MOST_CODE_LINES`` code lines (its signature and body, not
blank lines, comments or its docstring): a longer one is split by what it does.
"""

import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "nanoattn"

# Lowest first: folders (dotted, relative to the package); a module may import modules
# of its own layer and the layers below.
LAYERS = {
    "base": ["_base"],
    "kernels": ["_backends"],
    "core": ["_core", "parallel"],
    "layers": ["_layers"],
    "interop": ["_interop"],
    "tools": ["verify", "bench", "cli", "__main__"],
}
# The public faces at the root: re-exports only, like a package's __init__.
FACES = ("", "linen", "nnx")
# At most this many modules at the package root (the rest live in folders).
MOST_ROOT_MODULES = 6
# The most code lines of one function (blank lines, comments and the docstring not counted).
MOST_CODE_LINES = 80
# Imports of a private module or name from another package that stay for now: (importer,
# module read from) -> why, and who removes it. Each must still be found (a stale entry
# fails), so that the list only shrinks.
CROSSING_ALLOWED: dict = {}
# What an AttentionConfig may load: no kernel, no dispatch, no public function.
KERNELS = ("_backends.xla", "_backends.flash", "_backends.native", "_backends.cudnn",
           "_backends.dispatch", "_core.api")  # fmt: skip


def _modules() -> dict[str, pathlib.Path]:
    """Dotted names relative to the package ('_flash', 'parallel._ring') -> files."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


MODULES = _modules()


def _is_package(name: str) -> bool:
    return MODULES[name].name == "__init__.py"


def _is_face(name: str) -> bool:
    """A package's __init__ or a public face at the root: re-exports, not layered."""
    return name in FACES or _is_package(name)


def _layer(name: str) -> int:
    """The rank of the deepest folder of LAYERS that holds ``name``."""
    best = None
    for rank, folders in enumerate(LAYERS.values()):
        for folder in folders:
            if name == folder or name.startswith(folder + "."):
                depth = folder.count(".") + 1
                if best is None or depth > best[0]:
                    best = (depth, rank)
    if best is None:
        raise AssertionError(f"nanoattn.{name} is in no folder of tests/test_architecture.py")
    return best[1]


def _resolve(name: str, node: ast.ImportFrom) -> str:
    """The package-relative module an ``ImportFrom`` in module ``name`` reads from."""
    if node.level == 0:
        return node.module.removeprefix("nanoattn").lstrip(".")
    here = name.split(".") if _is_package(name) else name.split(".")[:-1]
    base = here[: len(here) - (node.level - 1)] if node.level > 1 else here
    return ".".join([*base, *([node.module] if node.module else [])]).strip(".")


def _imports(name: str, module_level: bool = False) -> list[tuple[str, str | None, int]]:
    """(module, imported name or None, line) for every nanoattn import of module
    ``name``: those inside functions too, unless ``module_level``."""
    tree = ast.parse(MODULES[name].read_text())
    found = []
    for node in tree.body if module_level else ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (
            node.level or (node.module or "").startswith("nanoattn")
        ):
            source = _resolve(name, node)
            for alias in node.names:
                sub = f"{source}.{alias.name}".strip(".")
                if sub in MODULES:  # `from . import _flash`: the module itself
                    found.append((sub, None, node.lineno))
                else:
                    found.append((source, alias.name, node.lineno))
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("nanoattn"):
                    module = alias.name.removeprefix("nanoattn").lstrip(".")
                    found.append((module, None, node.lineno))
    return found


def _package_of(name: str) -> str:
    return name if _is_package(name) else name.rpartition(".")[0]


@pytest.mark.parametrize("name", [m for m in MODULES if not _is_face(m)])
def test_imports_flow_down_the_layers(name):
    rank = _layer(name)
    up = [
        f"line {line}: nanoattn.{source} ({list(LAYERS)[_layer(source)]})"
        for source, _, line in _imports(name)
        if not _is_face(source) and _layer(source) > rank
    ]
    assert not up, f"nanoattn.{name} ({list(LAYERS)[rank]}) imports up: {'; '.join(up)}"


def _is_private_module(name: str) -> bool:
    """A file whose name starts with ``_``, other than ``__init__.py`` and ``__main__.py``."""
    file = MODULES[name].name
    return file.startswith("_") and not file.startswith("__")


def _crossings(name: str) -> list[tuple[str, str, int]]:
    """(module read from, what is private, line) for each import of module ``name`` that
    takes a private module, or a private name, of another package."""
    found = []
    for source, imported, line in _imports(name):
        if source not in MODULES or _package_of(source) == _package_of(name):
            continue
        if _is_private_module(source):
            found.append((source, f"the private module nanoattn.{source}", line))
        elif imported is not None and imported.startswith("_"):
            found.append((source, f"the private name {imported} of nanoattn.{source}", line))
    return found


@pytest.mark.parametrize("name", list(MODULES))
def test_nothing_private_crosses_a_package(name):
    crossing = [
        f"line {line}: {what}"
        for source, what, line in _crossings(name)
        if (name, source) not in CROSSING_ALLOWED
    ]
    assert not crossing, f"nanoattn.{name} imports from another package {'; '.join(crossing)}"


def test_the_allowed_crossings_still_exist():
    for (name, source), why in CROSSING_ALLOWED.items():
        found = [s for s, _, _ in _crossings(name)] if name in MODULES else []
        assert source in found, f"{name} -> {source} ({why}) is gone: remove it from the list"


DECODERS = "nanoattn.verify.decoders"


@pytest.mark.parametrize(
    "code, crossing",
    [
        ("from ..bench._run import SHAPES", "the private module nanoattn.bench._run"),
        ("from ..verify import _audit", "the private module nanoattn.verify._audit"),
        ("import nanoattn.verify._bounds", "the private module nanoattn.verify._bounds"),
        ("from ..bench._run import _Relay", "the private module nanoattn.bench._run"),
        ("from ..verify.decoders import _Fresh", "the private name _Fresh of " + DECODERS),
        ("from .._base.rules import Rules", None),  # a private folder's public module
        ("from ..bench import PEERS", None),  # a package's re-export
        ("from ._common import UsageError", None),  # its own package's private module
    ],
)
def test_a_private_import_from_another_package_is_found(monkeypatch, tmp_path, code, crossing):
    probe = tmp_path / "probe.py"
    probe.write_text(f"def f():\n    {code}\n")  # inside a function: found all the same
    monkeypatch.setitem(MODULES, "cli.probe", probe)
    found = [what for _, what, _ in _crossings("cli.probe")]
    assert found == ([] if crossing is None else [crossing])


def test_no_attribute_reaches_a_private_function_of_another_module():
    # `_flash._forward(...)`: a module imported whole, then a private function of it.
    reaching = []
    for name in MODULES:
        aliases = {}
        for source, imported, _ in _imports(name):
            if imported is None and source:
                aliases[source.rpartition(".")[2]] = source
        for node in ast.walk(ast.parse(MODULES[name].read_text())):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id in aliases
                and node.attr.startswith("_")
                and not node.attr.startswith("__")
            ):
                reaching.append(f"nanoattn.{name} line {node.lineno}: {node.value.id}.{node.attr}")
    assert not reaching, reaching


def _code_lines(path: pathlib.Path) -> dict[str, int]:
    """``"name (line N)"`` -> code lines of each function in ``path``: the lines from its
    first decorator to its end that are neither blank, nor only a comment, nor part of
    its docstring (a nested function counts in the function that holds it, too)."""
    text = path.read_text()
    stripped = [line.strip() for line in text.splitlines()]
    code = [i for i, line in enumerate(stripped, 1) if line and not line.startswith("#")]
    found = {}
    for node in ast.walk(ast.parse(text)):
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        start = min([node.lineno, *(d.lineno for d in node.decorator_list)])
        first = node.body[0]
        docstring = set()
        if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
            if isinstance(first.value.value, str):
                docstring = set(range(first.lineno, first.end_lineno + 1))
        count = sum(start <= i <= node.end_lineno and i not in docstring for i in code)
        found[f"{node.name} (line {node.lineno})"] = count
    return found


@pytest.mark.parametrize("name", list(MODULES))
def test_no_function_is_longer_than_the_limit(name):
    long = {f: n for f, n in _code_lines(MODULES[name]).items() if n > MOST_CODE_LINES}
    assert not long, f"nanoattn.{name}: code lines above {MOST_CODE_LINES}: {long}"


def test_code_lines_leave_out_blanks_comments_and_the_docstring(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text(
        "@decorated\n"
        "def f(\n"
        "    x,\n"
        "):\n"
        '    """The docstring,\n'
        '    on two lines."""\n'
        "\n"
        "    # a comment\n"
        "    def g():\n"
        "        return x  # a comment after code\n"
        '    text = """not a docstring\n'
        '    """\n'
        "    return g\n"
    )
    assert _code_lines(probe) == {"f (line 2)": 9, "g (line 9)": 2}


def _closure(name: str) -> set[str]:
    """Every module that loading ``name`` loads: its module-level imports and the
    packages they live in, except the top package's __init__ (which loads all)."""
    seen, todo = set(), [name]
    while todo:
        current = todo.pop()
        if current in seen or not current:
            continue
        seen.add(current)
        parts = current.split(".")
        todo += [".".join(parts[:i]) for i in range(1, len(parts))]  # parent packages
        todo += [source for source, _, _ in _imports(current, module_level=True)]
    return seen


def test_an_attention_config_loads_no_kernel():
    loaded = _closure("_layers.config")
    kernels = sorted(m for m in loaded if any(m == k or m.startswith(k + ".") for k in KERNELS))
    assert not kernels, f"nanoattn._layers.config loads {kernels}"
    # the rules it checks, from one place each
    assert {"_backends.registry", "_base.rules", "_base.zigzag"} <= loaded


def test_every_module_is_in_a_folder_of_the_table():
    for name in MODULES:
        if not _is_face(name):
            _layer(name)  # raises for a module in no listed folder


def test_the_table_names_only_real_folders():
    for folders in LAYERS.values():
        for folder in folders:
            assert folder in MODULES, folder


def test_the_package_root_holds_few_modules():
    root = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(root) <= MOST_ROOT_MODULES, root
