"""What a backend is: the one interface every backend has, and the refusal of a call
that uses a rule the backend does not serve.

Every backend (``xla/``, ``flash/``, ``native/``, ``cudnn.py`` here) defines
``BACKEND``, an object with the :class:`Backend` interface;
:mod:`nanoattn._backends.registry` knows them by name (and imports one only when it
is first asked for), and :mod:`nanoattn._backends.dispatch` chooses among them.
Adding a backend: docs/architecture.md.
"""

from typing import Protocol

from .._base.rules import RULE_NAMES, Rules
from . import registry

# Why a backend other than the reference cannot serve a call with dropout.
NO_DROPOUT = "dropout is only implemented by the reference (implementation='xla')"
# Every rule of Rules.active: what the reference serves (the other backends list theirs
# by name, so a rule added later is refused by each until it lists it).
EVERY_RULE = frozenset(RULE_NAMES)


class Backend(Protocol):
    """What the dispatcher needs of a backend.

    Attributes:
      name: the ``implementation=`` name that selects it.
      priority: its rank in the automatic choice (the highest that can serve a
        call and pays off there is taken), or None: chosen only by name.
      serves: the rules (names of ``Rules.active``) it implements; a call using any
        other is refused (:func:`unserved`), so a new rule is refused by every backend
        until it lists it.
      forward_mode: optional, False when missing: whether jax can differentiate it in
        forward mode (``jax.jvp``, ``jax.jacfwd``); a backend with a ``custom_vjp``
        cannot, and the automatic choice leaves it out of such calls.
      reads_combined: optional, False when missing: whether its ``__call__`` and
        ``paged`` take a combined cache or pool (key (B, S, 2, K, H) or (P,
        page_size, 2, K, H) and value None) as it is; the others get its two halves
        (``nanoattn._base.paged.split_pool``).
      applies_sinks: optional, False when missing: whether it applies
        ``rules.sinks`` itself; otherwise it is called without them and with
        ``return_residual`` set, and the sinks are merged into its output
        through its log-sum-exp (``nanoattn._core.merge.add_sinks``).
    """

    name: str
    priority: int | None
    serves: frozenset[str]

    def unsupported(self, rules: Rules, dtype, dropout_rate: float) -> str | None:
        """Why it cannot serve this call (its :class:`Rules`, the query's dtype and the
        dropout rate) with the reference's output contract, or None when it can.
        Cheap checks first (:func:`unserved` among them): a backend that builds
        something builds it only for a call it can serve."""

    def pays_off(self, rules: Rules, dtype) -> bool:
        """Whether the automatic choice should take it for a call of this size and
        dtype on the default platform (measured thresholds, docs/performance.md); only
        asked before :meth:`unsupported`, so that a call it would not be chosen for
        never builds it."""

    def __call__(self, query, key, value, rules: Rules, *, dropout_rate: float, dropout_rng,
                 tiles=None):  # fmt: skip
        """A dense call: the attention output (B, T, N, Hv) in the query's dtype, for
        query (B, T, N, H), key (B, S, K, H), value (B, S, K, Hv) and the call's
        ``rules`` (never paged); with ``rules.return_residual`` also the log-sum-exp
        (B, T, N). ``tiles``: None, or a blockwise kernel's ``(forward_tiles,
        backward_tiles)`` (``nanoattn.flash_attention``); a backend without tiles
        ignores it."""

    def paged(self, query, key_pages, value_pages, rules: Rules):
        """A paged call (``nanoattn.paged_attention``; ``rules.paged``): the output
        (Tq, N, Hv) in the query's dtype for query (Tq, N, H) and the pool's pages
        (P, page_size, K, H) and (P, page_size, K, Hv), or one combined pool (P,
        page_size, 2, K, H) and None (``nanoattn._base.paged.split_pool`` gives its
        halves), the page table, key lengths and query starts in ``rules``; with
        ``rules.return_residual`` also the log-sum-exp (Tq, N). Optional: a backend
        without it must not list ``"page_table"`` in ``serves`` (it then refuses paged
        calls)."""


def unserved(backend: Backend, rules: Rules) -> str | None:
    """Why ``backend`` cannot serve the rules ``rules`` uses (one sentence naming them
    and the backends that serve them all), or None when it serves every one."""
    missing = [rule for rule in rules.active() if rule not in backend.serves]
    if not missing:
        return None
    serving = [name for name in registry.names() if set(missing) <= _serves(name)]
    verb = "is" if len(missing) == 1 else "are"
    by = _listing([repr(name) for name in serving]) if serving else "no backend"
    return f"{_listing([RULE_NAMES[rule] for rule in missing])} {verb} served by {by} only"


def _serves(name: str) -> frozenset[str]:
    return frozenset(getattr(registry.get(name), "serves", ()))


def _listing(items: list[str]) -> str:
    """``a``, ``a and b``, ``a, b and c``."""
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]
