"""Which backend serves a call: the one asked for by name, or the automatic choice.

A backend asked for by name that cannot serve a call raises ValueError saying
why. The automatic choice (``implementation=None``) takes, among the backends
with a priority, the highest-ranked one that pays off at the call's size and can
serve it; the reference (``"xla"``) pays off and serves every call, so the
automatic choice never fails where the reference would succeed. The backends
and their rules are in :mod:`nanoattn._backends`, their names in
:mod:`nanoattn._backends.registry`.
"""

from .._base.autodiff import REVERSE_ONLY, in_forward_mode
from .._base.rules import Rules
from . import registry
from .interface import unserved


def _ranked():
    """The backends the automatic choice may take, highest priority first."""
    backends = [registry.get(name) for name in registry.names()]
    ranked = [b for b in backends if b.priority is not None]
    return sorted(ranked, key=lambda b: -b.priority)


def refusal(backend, rules: Rules, dtype, dropout_rate: float) -> str | None:
    """Why ``backend`` cannot serve the call, or None: its own reasons, then any rule
    it does not serve (which a backend may also check itself, earlier), then a
    forward-mode differentiation it cannot take (:mod:`~nanoattn._base.autodiff`)."""
    reason = backend.unsupported(rules, dtype, dropout_rate) or unserved(backend, rules)
    if reason is None and rules.paged and not callable(getattr(backend, "paged", None)):
        reason = "it lists the page table in serves but has no paged(...) method"
    if reason is None and not getattr(backend, "forward_mode", False) and in_forward_mode():
        return REVERSE_ONLY
    return reason


def choose(requested: str | None, rules: Rules, dtype, dropout_rate: float) -> str:
    """The name of the backend that serves this call.

    Raises:
      ValueError: an unknown name, or a named backend that cannot serve the call.
    """
    if requested is not None:
        reason = refusal(registry.get(requested), rules, dtype, dropout_rate)
        if reason is not None:
            raise ValueError(f"implementation={requested!r} cannot serve this call: {reason}")
        return requested
    for backend in _ranked():
        # Size first: a backend that builds something (the native kernel) builds it
        # only for a call it would be chosen for.
        if backend.pays_off(rules, dtype) and refusal(backend, rules, dtype, dropout_rate) is None:
            return backend.name
    raise AssertionError("unreachable: the reference serves every call")
