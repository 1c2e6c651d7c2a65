"""The names of the attention backends, and the backend behind each name.

The built-in backends are one module or folder each in :mod:`nanoattn._backends`,
named after the backend, each defining (or re-exporting) ``BACKEND``; one is
imported only when its backend is first asked for, so checking a name (an
``AttentionConfig``, say) imports no kernel. :func:`register` adds a backend at run
time (an experiment, a test). Adding a built-in backend is a module
``nanoattn/_backends/<name>.py`` (or a folder with an ``__init__.py``) plus its name
in :data:`Implementation` (docs/architecture.md).
"""

import importlib
import typing
from typing import Literal

Implementation = Literal["xla", "flash", "native", "cudnn"]
BUILT_IN: tuple[str, ...] = typing.get_args(Implementation)

_registered: dict = {}  # name -> backend, added by register()


def names() -> tuple[str, ...]:
    """Every backend's name: the built-in ones, then the registered ones."""
    return (*BUILT_IN, *_registered)


def check_implementation(name) -> None:
    """Raises ValueError unless ``name`` is None or a backend's name."""
    if name is not None and not (isinstance(name, str) and name in names()):
        raise ValueError(
            f"implementation must be one of {', '.join(map(repr, names()))} or None, got {name!r}"
        )


def get(name: str):
    """The backend called ``name`` (a :class:`nanoattn._backends.Backend`).

    Raises:
      ValueError: no backend has that name.
    """
    check_implementation(name)
    if name in _registered:
        return _registered[name]
    return importlib.import_module(f"nanoattn._backends.{name}").BACKEND


def register(backend) -> None:
    """Adds ``backend`` (a :class:`nanoattn._backends.Backend`) under ``backend.name``.

    Raises:
      ValueError: the name is taken.
    """
    if backend.name in names():
        raise ValueError(f"a backend called {backend.name!r} is already registered")
    _registered[backend.name] = backend


def unregister(name: str) -> None:
    """Removes a backend added by :func:`register`."""
    del _registered[name]
