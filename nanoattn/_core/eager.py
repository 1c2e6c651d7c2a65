"""Eager calls, compiled once and kept.

Called outside ``jit``, a blockwise kernel would trace and compile its scans anew on
every call (its step functions are made per call), about a second at T = 1024
where the compiled call takes milliseconds. :func:`run` runs an eager call as a
jitted program instead, kept by jax's jit cache for the call's static parts: the
backend, the sizes and flags of its :class:`~.base.rules.Rules`, the shapes and
dtypes of its arrays, and its ``mask_fn`` and ``score_fn``.

A function is part of the program (jit bakes what it closes over in as constants), so
it is kept only by what decides its values: its code, its defaults, and the values it
closes over or reads from its module's globals, recursively (:func:`fingerprint`):
jax arrays by identity (they never change), numpy arrays by their bytes (they may be
written in place), numbers and strings by value, library functions and modules by
name. Each fingerprint has one stand-in (:func:`stand_in`), which the program is
compiled for: two functions with equal fingerprints compute the same thing and share
it, and a function whose fingerprint changed (a table written in place) gets another,
so a stale program is never reused. A function holding
anything else (a list, a dict, an object) cannot be fingerprinted: its call is not
cached and runs as before, compiled on each call, so a value changed in place can
never reach a stale program. Under jax's debug flags every eager call runs as one
program too, whose results alone are checked (``debug.one_program``).
"""

import collections
import dataclasses
import functools
import types

import jax
import numpy as np

from .._base.block_mask import BlockMask
from .._base.rules import Rules

MOST = 128  # the fingerprinted functions kept (the oldest are dropped first)
_stand_ins: collections.OrderedDict = collections.OrderedDict()  # fingerprint -> function
_LIBRARIES = ("jax", "jaxlib", "numpy", "builtins", "math", "operator", "functools", "flax")


class Unkeyable(Exception):
    """A value that :func:`fingerprint` cannot key safely."""


def is_eager(*args) -> bool:
    """Whether no leaf of ``args`` is traced (the call runs outside any transformation)."""
    return not any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(args))


def fingerprint(x, depth: int = 0):
    """A hashable key of ``x`` that changes whenever what ``x`` computes could.

    Raises:
      Unkeyable: ``x`` holds a value whose changes cannot be seen (a mutable container,
        an object), or nests too deep.
    """
    if depth > 12:
        raise Unkeyable("too deep")
    if x is None or isinstance(x, (bool, int, float, complex, str, bytes)):
        return ("value", type(x).__name__, x)
    if isinstance(x, np.generic):
        return ("value", x.dtype.str, x.item())
    if isinstance(x, jax.core.Tracer):
        raise Unkeyable("a traced value")
    if isinstance(x, jax.Array):
        return ("jax array", id(x))  # immutable; the stand-in holds it alive
    if isinstance(x, np.ndarray):
        return ("numpy array", x.dtype.str, x.shape, x.tobytes())
    if isinstance(x, (tuple, frozenset)):
        return (type(x).__name__, tuple(fingerprint(e, depth + 1) for e in x))
    if isinstance(x, types.ModuleType):
        return ("module", x.__name__)
    if isinstance(x, BlockMask):
        return ("block mask", fingerprint(x.mask_fn, depth + 1), x.B, x.N, x.T, x.S,
                fingerprint(x.q_offset, depth + 1), x.block_q, x.block_k,
                fingerprint(x.kinds, depth + 1))  # fmt: skip
    if isinstance(x, functools.partial):
        keywords = tuple(sorted(x.keywords.items()))
        return ("partial", *(fingerprint(e, depth + 1) for e in (x.func, x.args, keywords)))
    module = getattr(x, "__module__", None) or ""
    if callable(x) and module.split(".")[0] in _LIBRARIES:
        return ("library", module, getattr(x, "__qualname__", repr(x)))
    if isinstance(x, types.FunctionType):
        return _function(x, depth)
    raise Unkeyable(type(x).__name__)


def _function(fn: types.FunctionType, depth: int):
    cells = tuple(fingerprint(c.cell_contents, depth + 1) for c in fn.__closure__ or ())
    read = [n for n in _names(fn.__code__) if n in fn.__globals__]
    used = tuple((n, fingerprint(fn.__globals__[n], depth + 1)) for n in read)
    defaults = fingerprint(fn.__defaults__, depth + 1)
    keywords = fingerprint(tuple(sorted((fn.__kwdefaults__ or {}).items())), depth + 1)
    return ("function", fn.__code__, defaults, keywords, cells, used)


def _names(code: types.CodeType) -> set[str]:
    """The global names ``code`` and the code nested in it may read."""
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _names(const)
    return names


class StandIn:
    """A function called in another's place: one per fingerprint, hashed by identity,
    so that jit's cache tells fingerprints apart (``fn`` itself may change values)."""

    __slots__ = ("fn",)

    def __init__(self, fn):
        self.fn = fn

    def __call__(self, *args, **kwargs):
        return self.fn(*args, **kwargs)


def stand_in(fn):
    """The stand-in of ``fn``'s fingerprint (made the first time it is seen), or None
    when ``fn`` cannot be fingerprinted; None for None. A :class:`BlockMask`'s stand-in
    is a BlockMask of its kinds over the stand-in of its function."""
    if fn is None:
        return None
    try:
        key = fingerprint(fn)
    except Unkeyable:
        return None
    kept = _stand_ins.pop(key, None)
    if kept is None:
        if isinstance(fn, BlockMask):
            kept = dataclasses.replace(fn, mask_fn=StandIn(fn.mask_fn))
        else:
            kept = StandIn(fn)
    _stand_ins[key] = kept  # the newest last
    while len(_stand_ins) > MOST:
        _stand_ins.popitem(last=False)
    return kept


def cacheable(rules: Rules) -> Rules | None:
    """``rules`` with its functions replaced by their stand-ins, or None when one of
    them cannot be fingerprinted (the call then runs uncached)."""
    changes = {}
    for name in ("mask_fn", "score_fn"):
        fn = getattr(rules, name)
        if fn is not None:
            changes[name] = stand_in(fn)
            if changes[name] is None:
                return None
    return rules.replace(**changes) if changes else rules
