"""Which backends a test runs on, asked of the registry: every registered backend that
serves the call, never a literal list of names, so a backend added to the registry is
run by every test that uses these.

* :func:`each_backend`: parametrizes a test over every registered backend's name; the
  test passes its call to :func:`require`, which skips it with the backend's own
  reason (``dispatch.refusal``) where the backend does not serve the call.
* :func:`serving`: the names of the backends that serve a call, for a test that runs
  several backends in one body.
* :func:`refusal`: why one backend does not serve a call, or None.
* :func:`paged_refusal`, :func:`paged_serving`, :func:`require_paged`: the same for a
  ``paged_attention`` call (its six arrays and its rule keywords).

A test skips only on the backend's refusal, asked before the call: never on an
exception the call raises, which would hide a backend that accepts a call it then
fails on.

The calls are described as ``dot_product_attention``'s (``q, k, v`` batched and its rule
keywords); the backends are asked about the call's rules, dtype and dropout rate, as
the dispatcher asks them. A test about one backend (its own file, a kernel-specific
behaviour) names it instead; so do tests that hold a backend against the reference
(``"xla"``, which defines the output contract).
"""

import jax.numpy as jnp
import pytest

from nanoattn._backends import dispatch, registry
from nanoattn._base.rules import Rules


def refusal(
    implementation: str, q, k, v=None, *, dtype=None, dropout_rate=0.0, **rules
) -> str | None:
    """Why the backend ``implementation`` does not serve this call, or None. ``dtype``:
    the dtype it is asked about, the query's by default (give it where the arrays
    cannot hold it, float64 without x64)."""
    spec = Rules.make(jnp.asarray(q), jnp.asarray(k), None if v is None else jnp.asarray(v),
                      **rules)  # fmt: skip
    dtype = jnp.asarray(q).dtype if dtype is None else dtype
    return dispatch.refusal(registry.get(implementation), spec, dtype, dropout_rate)


def serving(q, k, v=None, *, dtype=None, dropout_rate=0.0, **rules) -> list[str]:
    """The names of the registered backends that serve this call, in the registry's order
    (the reference, which serves every call, first)."""
    return [
        name
        for name in registry.names()
        if refusal(name, q, k, v, dtype=dtype, dropout_rate=dropout_rate, **rules) is None
    ]


def require(implementation: str, q, k, v=None, *, dtype=None, dropout_rate=0.0, **rules) -> None:
    """Skips the test, with the backend's reason, unless it serves this call."""
    if reason := refusal(implementation, q, k, v, dtype=dtype, dropout_rate=dropout_rate,
                         **rules):  # fmt: skip
        pytest.skip(f"{implementation}: {reason}")


def skip_refusal(error: ValueError, implementation: str):
    """Skips the test when ``error`` is the dispatcher's refusal of ``implementation``
    (it cannot serve this call); re-raises any other error: a backend that took the call
    and then failed is a failure, never a skip."""
    if str(error).startswith(f"implementation={implementation!r} cannot serve this call"):
        pytest.skip(str(error))
    raise error


def each_backend(argname: str = "implementation"):
    """Parametrizes ``argname`` over every registered backend's name (built-in ones, and
    those registered when the test module is collected)."""
    return pytest.mark.parametrize(argname, registry.names())


def paged_refusal(implementation: str, query, key_pages, value_pages, page_table, kv_lengths,
                  query_starts, **rules) -> str | None:  # fmt: skip
    """Why the backend ``implementation`` does not serve this ``paged_attention`` call
    (its arrays, concrete and valid, and its rule keywords), or None."""
    arrays = (query, key_pages, value_pages, page_table, kv_lengths, query_starts)
    spec = Rules.make_paged(*(x if x is None else jnp.asarray(x) for x in arrays), **rules)
    dtype = jnp.asarray(query).dtype
    return dispatch.refusal(registry.get(implementation), spec, dtype, 0.0)


def paged_serving(*arrays, **rules) -> list[str]:
    """The names of the registered backends that serve this ``paged_attention`` call, in
    the registry's order (the reference first)."""
    return [name for name in registry.names() if paged_refusal(name, *arrays, **rules) is None]


def require_paged(implementation: str, *arrays, **rules) -> None:
    """Skips the test, with the backend's reason, unless it serves this
    ``paged_attention`` call."""
    if reason := paged_refusal(implementation, *arrays, **rules):
        pytest.skip(f"{implementation}: {reason}")
