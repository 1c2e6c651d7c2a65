"""What :func:`~nanoattn.verify.check_decoding` checks: a :class:`Decoder` (the triple
``(full, init, step)`` and its optional parts), and the check's arguments read into
one :class:`Subject`, the decoder as the checks drive it.

A :class:`~nanoattn.verify.PagedDecoder` is driven through its row protocol
(:func:`~._paged_decoding.as_rows`), so that every check runs it as it runs a
:class:`Decoder`.
"""

import dataclasses
from collections.abc import Callable

from ._inputs import Inputs
from ._paged_decoding import PagedDecoder, as_rows

OPTIONAL = ("rewind", "capacity", "max_chunk", "float_cache", "reference", "tree", "accept")
BOUNDS = ("capacity", "max_chunk")  # ints >= 1 or None


@dataclasses.dataclass(frozen=True, repr=False)
class Decoder:
    """A decoder for :func:`check_decoding`: the triple ``(full, init, step)`` plus the
    optional ``rewind``, ``capacity``, ``max_chunk``, ``float_cache``, ``reference``,
    ``tree`` and ``accept`` (``check_decoding(decoder)`` checks them too).

    It unpacks as the triple (``full, init, step = decoder``), so
    ``check_decoding(*decoder)`` checks the core protocol alone. It is a frozen
    dataclass, not a tuple: ``dataclasses.replace(decoder, rewind=None)`` changes a part.

    Args:
      full: ``full(x) -> y`` on the whole sequence.
      init: ``init(batch, max_len) -> state``, a fresh cache of ``max_len`` slots.
      step: ``step(state, chunk, lengths) -> (state, y_chunk)``.
      rewind: None, or ``rewind(state, n) -> state``: row b drops its last ``n[b]``
        tokens (int (B,), at most the real tokens of its last call).
      capacity: None (the cache holds the whole sequence), or the slots of a bounded
        (rolling) cache: ``init`` gets them and decoding goes on past them.
      max_chunk: None (any chunk length), or the most tokens one call may take.
      float_cache: None, or for a decoder with a quantized cache the same model with a
        float cache: a :class:`Decoder` or ``(full, init, step)``, whose ``init`` and
        ``step`` the quantization check uses.
      reference: None, or the full forward in higher precision (float64), ``reference(x)
        -> y``, against which the quantization check measures the float cache (default:
        ``full``).
      tree, accept: None, or (both) a decoder that verifies token trees (speculative
        decoding): ``tree(state, chunk, parents) -> (state, y_chunk)``, a chunk (B, L,
        ...) of drafts, ``parents`` int32 (B, L) each draft's parent within its row's
        chunk (-1: the last committed token); ``accept(state, kept) -> state``, row b
        keeping the drafts ``kept[b]`` (int32 (B, A), a root-to-leaf path in order,
        then -1s) of its last call, the rest taken back.
    """

    full: Callable
    init: Callable
    step: Callable
    _: dataclasses.KW_ONLY
    rewind: Callable | None = None
    capacity: int | None = None
    max_chunk: int | None = None
    float_cache: "Decoder | tuple | None" = None
    reference: Callable | None = None
    tree: Callable | None = None
    accept: Callable | None = None

    def __iter__(self):
        """The core triple: ``full, init, step = decoder``."""
        return iter((self.full, self.init, self.step))

    def __repr__(self) -> str:
        extras = "".join(
            f", {n}={getattr(self, n)!r}" for n in OPTIONAL if getattr(self, n) is not None
        )
        return f"Decoder({self.full!r}, {self.init!r}, {self.step!r}{extras})"


def as_decoder(obj) -> Decoder | PagedDecoder | None:
    """``obj`` as a decoder: a :class:`Decoder` or :class:`PagedDecoder` as it is, a
    ``(full, init, step)`` tuple or list of three functions as a :class:`Decoder`;
    None for anything else."""
    if isinstance(obj, Decoder | PagedDecoder):
        return obj
    if isinstance(obj, tuple | list) and len(obj) == 3 and all(map(callable, obj)):
        full, init, step = obj
        return Decoder(full=full, init=init, step=step)
    return None


@dataclasses.dataclass(frozen=True)
class Subject:
    """The decoder as the checks drive it, its parts merged with the arguments of
    :func:`check_decoding` (an argument given there wins) and checked.

    Attributes:
      full, init, step, rewind: the row protocol (a PagedDecoder's through its
        allocator, which rewinds).
      capacity, max_chunk: None or an int >= 1.
      float_cache: None, or the float cache's ``(init, step)``.
      reference: None, or ``reference(x) -> y``.
      paged: the :class:`PagedDecoder` checked, or None.
      tree, accept: None, or a decoder's token-tree step and accept (both or none).
    """

    full: Callable
    init: Callable
    step: Callable
    rewind: Callable | None = None
    capacity: int | None = None
    max_chunk: int | None = None
    float_cache: tuple[Callable, Callable] | None = None
    reference: Callable | None = None
    paged: PagedDecoder | None = None
    tree: Callable | None = None
    accept: Callable | None = None


def subject(full, init, step, inputs: Inputs, **given) -> Subject:
    """The arguments of :func:`check_decoding` (``given``: the :data:`OPTIONAL` parts)
    as one :class:`Subject`; a one-line ValueError for a bad one."""
    if isinstance(full, PagedDecoder):
        return _paged(full, init, step, inputs, **given)
    if isinstance(full, Decoder):
        if init is not None or step is not None:
            raise ValueError("pass a Decoder alone, or the functions full, init and step")
        parts = {name: getattr(full, name) if given[name] is None else given[name]
                 for name in OPTIONAL}  # fmt: skip
        return Subject(full.full, full.init, full.step, **_unpaged(**parts))
    if init is None or step is None:
        raise ValueError("pass the decoder's full, init and step, or a Decoder")
    return Subject(full, init, step, **_unpaged(**given))


def _paged(decoder: PagedDecoder, init, step, inputs: Inputs, **given) -> Subject:
    """A :class:`PagedDecoder`'s :class:`Subject`: no rewind, capacity or max_chunk
    (its allocator rewinds and has no chunk limit), a PagedDecoder as its float cache."""
    if init is not None or step is not None:
        raise ValueError("pass a PagedDecoder alone, without init and step")
    for name in ("rewind", *BOUNDS):
        if given[name] is not None:
            raise ValueError(
                f"a PagedDecoder takes no {name}: its pages come from a PageAllocator, "
                f"which rewinds and has no chunk limit; got {name}={given[name]!r}"
            )
    for name in ("tree", "accept"):
        if given[name] is not None:
            raise ValueError(
                f"a PagedDecoder takes no {name}: the token-tree check drives a Decoder "
                f"(a slot cache) only; got {name}={given[name]!r}"
            )
    float_cache = decoder.float_cache if given["float_cache"] is None else given["float_cache"]
    if float_cache is not None:
        if not isinstance(float_cache, PagedDecoder):
            raise ValueError(
                f"float_cache of a PagedDecoder must be a PagedDecoder, got {float_cache!r}"
            )
        float_cache = as_rows(float_cache, inputs)[:2]
    init, step, rewind = as_rows(decoder, inputs)
    reference = decoder.reference if given["reference"] is None else given["reference"]
    _check_reference(reference)
    return Subject(decoder.full, init, step, rewind, None, None, float_cache, reference, decoder)


def _unpaged(rewind, capacity, max_chunk, float_cache, reference, tree, accept) -> dict:
    """A :class:`Decoder`'s optional parts, checked: the fields of its :class:`Subject`."""
    if rewind is not None and not callable(rewind):
        raise ValueError(f"rewind must be None or a function (state, n) -> state, got {rewind!r}")
    _check_tree(tree, accept)
    if float_cache is not None:
        decoder = as_decoder(float_cache)
        if not isinstance(decoder, Decoder):
            raise ValueError(
                f"float_cache must be None, a Decoder or (full, init, step), got {float_cache!r}"
            )
        float_cache = (decoder.init, decoder.step)
    _check_reference(reference)
    for name, value in (("capacity", capacity), ("max_chunk", max_chunk)):
        if value is not None and (
            isinstance(value, bool) or not isinstance(value, int) or value < 1
        ):
            raise ValueError(f"{name} must be None or an int >= 1, got {name}={value!r}")
    return dict(rewind=rewind, capacity=capacity, max_chunk=max_chunk, float_cache=float_cache,
                reference=reference, tree=tree, accept=accept)  # fmt: skip


def _check_reference(reference) -> None:
    if reference is not None and not callable(reference):
        raise ValueError(f"reference must be None or a function x -> y, got {reference!r}")


def _check_tree(tree, accept) -> None:
    """``tree`` and ``accept`` both functions, or both None."""
    for name, value in (("tree", tree), ("accept", accept)):
        if value is not None and not callable(value):
            raise ValueError(f"{name} must be None or a function, got {name}={value!r}")
    if (tree is None) != (accept is None):
        raise ValueError(
            "tree and accept go together: pass both (a decoder that verifies token trees) "
            "or neither"
        )
