"""Shape checks that double as a trace of the forward pass.

The Flax modules call :func:`check_shape` after every projection, split,
reshape and attention step. At trace time (free under ``jit``) it raises if an
axis has the wrong size, so a refactor that swaps time and head axes fails
loudly. Inside :func:`record_shapes` it also appends a :class:`Stage` to a list:
``nanoattn audit`` builds its shape table from that list by tracing the real
module under ``jax.eval_shape``, never from a table written by hand.
"""

import contextlib
import contextvars
import dataclasses
import math
from collections.abc import Iterator, Sequence

_RECORDER: contextvars.ContextVar[list | None] = contextvars.ContextVar(
    "nanoattn_shape_recorder", default=None
)


@dataclasses.dataclass(frozen=True)
class Stage:
    """One step of a forward pass, as seen at trace time.

    Attributes:
      name: what the tensor is, e.g. ``"q heads"``.
      shape: its shape.
      axes: one legend letter (or a multiple such as ``"3D"``) per axis.
      op: how it was made: ``"input"``, ``"project"``, ``"split"``,
        ``"reshape"``, ``"einsum"`` or ``"softmax"``.
      source: the stage it was made from, for ``split`` and ``reshape``.
    """

    name: str
    shape: tuple[int, ...]
    axes: tuple[str, ...]
    op: str
    source: str | None = None

    @property
    def elements(self) -> int:
        return math.prod(self.shape)


@contextlib.contextmanager
def record_shapes() -> Iterator[list[Stage]]:
    """Collects every :class:`Stage` checked while the block runs."""
    stages: list[Stage] = []
    token = _RECORDER.set(stages)
    try:
        yield stages
    finally:
        _RECORDER.reset(token)


def record(x, name: str, axes: str, *, op: str, source: str | None = None) -> None:
    """Appends ``x``'s shape to the active recorder, if there is one."""
    stages = _RECORDER.get()
    if stages is not None:
        stages.append(Stage(name, tuple(x.shape), tuple(axes.split()), op, source))


def check_shape(
    x, name: str, axes: str, dims: Sequence[int], *, op: str, source: str | None = None
):
    """Raises ValueError unless ``x.shape == dims``; records the stage; returns ``x``."""
    letters = axes.split()
    if tuple(x.shape) != tuple(dims):
        named = ", ".join(f"{a}={d}" for a, d in zip(letters, dims))
        raise ValueError(
            f"{name}: expected shape ({', '.join(letters)}) with {named}, got {tuple(x.shape)}; "
            "an axis was swapped or mis-sized in a reshape"
        )
    record(x, name, axes, op=op, source=source)
    return x
