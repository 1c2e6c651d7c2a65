"""The layering of the package, read from its source (docs/architecture.md).

Each folder is a layer, and imports flow one way, down this list, never back:
tools (``verify/``, ``bench/``, ``cli/``) -> interop (``_interop/``: the flax and
jax.nn adapters) -> layers (``_layers/``: the config, the shared steps, the caches,
linen, NNX) -> core (``_core/``: the public functions, merge, RoPE; ``parallel/``:
the ring) -> kernels (``_backends/``: the registry, the dispatch, one module or folder
per backend) -> base (``_base/``: the rules of a call, validation, masks, the
shared numerics). A module belongs to the deepest folder the table names. No module
imports another package's private function. The imports are read with ``ast`` from
every module, those inside functions included, so a lazy import cannot hide a back
edge. Package ``__init__`` files and the public faces at the root (``linen.py``,
``nnx.py``) only re-export and are not layered.
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


@pytest.mark.parametrize("name", [m for m in MODULES if m])
def test_no_private_name_crosses_a_package(name):
    crossing = [
        f"line {line}: {imported} from nanoattn.{source}"
        for source, imported, line in _imports(name)
        if imported is not None
        and imported.startswith("_")
        and _package_of(source) != _package_of(name)
    ]
    assert not crossing, f"nanoattn.{name} imports private names: {'; '.join(crossing)}"


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
