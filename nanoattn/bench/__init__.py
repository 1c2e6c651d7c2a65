"""`nanoattn bench`: nanoattn's backends against the attention users compare us with.

The names below are what the command line (nanoattn/cli/_bench.py) takes from here:
the run, its report, the progress lines, the implementations and each part's defaults.
"""

from ._generation import CONTEXTS as GENERATION_CONTEXTS
from ._latent import CONTEXT as LATENT_CONTEXT
from ._masks import LENGTH as MASKS_LENGTH
from ._masks import QUICK_LENGTH as MASKS_QUICK_LENGTH
from ._native import LENGTHS as NATIVE_LENGTHS
from ._peers import PEERS
from ._progress import ItemLines
from ._report import markdown, write
from ._run import (
    FULL_LENGTHS,
    QUICK_LENGTHS,
    SHAPES,
    BenchConfig,
    default_implementations,
    run_bench,
)
from ._window import LENGTH as WINDOW_LENGTH
from ._window import WINDOW

__all__ = [
    "FULL_LENGTHS",
    "GENERATION_CONTEXTS",
    "LATENT_CONTEXT",
    "MASKS_LENGTH",
    "MASKS_QUICK_LENGTH",
    "NATIVE_LENGTHS",
    "PEERS",
    "QUICK_LENGTHS",
    "SHAPES",
    "WINDOW",
    "WINDOW_LENGTH",
    "BenchConfig",
    "ItemLines",
    "default_implementations",
    "markdown",
    "run_bench",
    "write",
]
