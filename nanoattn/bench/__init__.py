"""`nanoattn bench`: nanoattn's backends against the attention users compare us with."""

from ._report import markdown as markdown
from ._report import write as write
from ._run import BenchConfig as BenchConfig
from ._run import run_bench as run_bench
