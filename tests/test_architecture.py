"""The layering of the package, read from its source (docs/architecture.md).

Imports flow one way: tools (verify, the audit, bench, cli) -> layers (configs,
layer steps, modules, flax's adapter) -> core (the public functions, dispatch,
the ring) -> kernels (the backends and what they compute with) -> rules (specs,
masks, schedules) -> base (validation, names, small helpers); never back, and no
module imports another package's private function. These are read with ``ast``
from every module, imports inside functions included, so a lazy import cannot
hide a back edge. Package ``__init__`` files only re-export and are not layered.
"""

import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "nanoattn"

# Lowest first; a module may import modules of its own layer and the layers below.
LAYERS = {
    "base": [
        "_validate", "_trace", "_norm", "_axes", "_dropout", "_zigzag", "_shard_map",
        "_registry", "_backends",
    ],
    "rules": ["_spec", "_masks", "_mask_fn", "_block_mask", "_rolling", "_rope", "_schedule"],
    "kernels": [
        "_reference", "_flash_plan", "_flash", "_native", "_native._build",
        "_native._kernel", "_backends.*",
    ],
    "core": ["_dispatch", "_attention", "_merge", "parallel._ring", "parallel._blocks"],
    "layers": [
        "_config", "_kv_cache", "_heads", "_layer", "parallel._layers", "linen.*", "nnx.*",
        "_flax*", "_jax_nn*",
    ],
    "tools": ["verify.*", "_audit", "bench.*", "cli.*", "__main__"],
}  # fmt: skip
# What an AttentionConfig may load: no kernel, no dispatch.
KERNELS = ("_reference", "_flash", "_flash_plan", "_native", "_dispatch", "_attention")


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


def _layer(name: str) -> int:
    for rank, patterns in enumerate(LAYERS.values()):
        for pattern in patterns:
            if name == pattern or (
                pattern.endswith("*") and name.startswith(pattern[:-1]) and name != pattern[:-2]
            ):
                return rank
    raise AssertionError(f"nanoattn.{name} is in no layer of tests/test_architecture.py")


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


@pytest.mark.parametrize("name", [m for m in MODULES if m and not _is_package(m)])
def test_imports_flow_down_the_layers(name):
    rank = _layer(name)
    up = [
        f"line {line}: nanoattn.{source} ({list(LAYERS)[_layer(source)]})"
        for source, _, line in _imports(name)
        if source and not _is_package(source) and _layer(source) > rank
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
    loaded = _closure("_config")
    kernels = sorted(m for m in loaded if m.split(".")[0] in KERNELS or m.startswith("_backends."))
    assert not kernels, f"nanoattn._config loads {kernels}"
    assert {"_registry", "_spec", "_zigzag"} <= loaded  # the rules it checks, from one place


def test_the_layer_table_names_only_real_modules():
    listed = [p for patterns in LAYERS.values() for p in patterns]
    for pattern in listed:
        if pattern.endswith("*"):
            assert any(m.startswith(pattern[:-1]) for m in MODULES), pattern
        else:
            assert pattern in MODULES, pattern
