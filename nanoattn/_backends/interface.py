"""The attention backends, one module each, behind one interface.

Every module here defines ``BACKEND``, an object with the :class:`Backend`
interface; :mod:`nanoattn._backends.registry` knows them by name (and imports a module
only when its backend is first asked for), and :mod:`nanoattn._backends.dispatch`
chooses among them. Adding a backend: a module ``<name>.py`` here and its name
in ``nanoattn._backends.registry.Implementation`` (docs/architecture.md).
"""

from typing import Protocol

# Why a backend other than the reference cannot serve a call with dropout.
NO_DROPOUT = "dropout is only implemented by the reference (implementation='xla')"


class Backend(Protocol):
    """What the dispatcher needs of a backend.

    Attributes:
      name: the ``implementation=`` name that selects it.
      priority: its rank in the automatic choice (the highest that can serve a
        call and pays off there is taken), or None: chosen only by name.
      applies_sinks: optional, False when missing: whether it applies
        ``spec.sinks`` itself; otherwise it is called without them and with
        ``return_residual`` set, and the sinks are merged into its output
        through its log-sum-exp (``nanoattn._core.merge.add_sinks``).
    """

    name: str
    priority: int | None

    def unsupported(self, spec, dtype, dropout_rate: float) -> str | None:
        """Why it cannot serve this call (an ``AttentionSpec``, the query's dtype and
        the dropout rate) with the reference's output contract, or None when it can.
        Cheap checks first: a backend that builds something builds it only for a
        call it can serve."""

    def pays_off(self, spec, dtype) -> bool:
        """Whether the automatic choice should take it for a call of this size and
        dtype on the default platform (measured thresholds, docs/performance.md); only asked
        before :meth:`unsupported`, so that a call it would not be chosen for
        never builds it."""

    def __call__(self, query, key, value, spec, *, dropout_rate: float, dropout_rng):
        """Attention output (B, T, N, H) in the query's dtype, for query (B, T, N, H),
        key and value (B, S, K, H) and the validated ``spec``."""
