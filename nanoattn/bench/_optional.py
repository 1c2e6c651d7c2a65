"""Optional peers (torch, onnxruntime, ejkernel): whether they import here, and their
modules for a version, without making any of them a dependency."""

import importlib


def missing(names: tuple[str, ...], why: str) -> str | None:
    """None when every one of ``names`` imports (``"module"``, or ``"module:attribute"``
    for a name the module must have), else ``why``."""
    for name in names:
        module, _, attribute = name.partition(":")
        try:
            imported = importlib.import_module(module)
        except ImportError:
            return why
        if attribute and not hasattr(imported, attribute):
            return why
    return None


def installed(name: str):
    """The module ``name``, imported, or None when it is not installed."""
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


def float32_and_one_width(case, dtype: str, who: str, kernels: str = "") -> str | None:
    """Why peer ``who`` does not run ``case`` in ``dtype``: it runs float32 only here
    (``kernels``: what its kernel takes, said after), with values of the keys' width;
    or None."""
    if dtype != "float32":
        return f"{who} runs here in float32 only{kernels}"
    if case.hv != case.head_dim:
        return f"{who} takes values of the keys' width only"
    return None
