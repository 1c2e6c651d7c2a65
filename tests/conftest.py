"""Configuration and fixtures of the test suite (helpers live in tests/_*.py modules).

Hypothesis runs under the profile named by the HYPOTHESIS_PROFILE environment
variable: "ci" (the default) is derandomised, so every run draws the same
examples and a red property test is a real regression, never bad luck; "dev"
(`HYPOTHESIS_PROFILE=dev make test`) draws fresh examples on each run and
prints a blob to replay any failure it finds, to hunt for new bugs locally.
"""

import os
import sys

# The test files live in folders that mirror the package (tests/core/, tests/backends/,
# ...; docs/testing.md) and import the helper modules of tests/ (_reference, _cases, ...)
# by name, so tests/ is on sys.path whichever folder a test file is in and whichever
# import mode pytest runs in (its default puts only a test file's own folder there).
# Scripts that tests start in a subprocess live in tests/ too and find the helpers
# beside them.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

# The suite runs with jax's strict rank promotion, as jax's own test suite and many
# JAX codebases do: an implicit broadcast of arrays of different ranks raises. Set
# before jax is imported, so the subprocesses the tests start inherit it; a caller's
# own setting is kept. tests/test_strict_modes.py runs the core under the other
# strict modes (jax_numpy_dtype_promotion='strict', jax_enable_checks).
os.environ.setdefault("JAX_NUMPY_RANK_PROMOTION", "raise")

import jax
import pytest
from hypothesis import settings

settings.register_profile("ci", derandomize=True, database=None)
settings.register_profile("dev", derandomize=False, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

# The suite compiles at XLA's lowest backend optimisation level: compiling, not
# running, dominates its time, and -O0 took the whole run from 17.4 to 11.2
# CPU-minutes on a 2-core AMD EPYC (AVX2). Optimisation should change how fast the
# programs run, not what they compute; the one place where the suite saw otherwise
# (huge logits under jit, test_nonfinite.py) compiles at XLA's default level, its
# OPTIMIZED. Set before any test initialises the backend; a caller's own
# XLA_FLAGS setting of the level is kept.
if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0"
    ).strip()

# And with XLA's CPU backend emitting its fusions the older way, through LLVM IR
# (xla_cpu_use_fusion_emitters=false), for the same reason: at -O0 it compiles in
# about 40% of the time of the default (MLIR) fusion emitters. On a 2-core Intel Xeon
# (AVX-512, jaxlib 0.10.2) it took `make test` from 20 to 13.3 CPU-minutes and its
# pytest from 10:39 to 7:03, nothing else running (a sample of test_attention,
# test_verify_mask and test_window: 66 s to 43 s in one process), and every test
# passes either way. Both emitters compute the same operations; their float32
# results differ in the last bit or so. test_nonfinite.py's OPTIMIZED compiles with
# XLA's defaults, these emitters too.
#
# And with each program's LLVM module compiled whole, not split into up to 32 parts
# for a thread pool to compile side by side (xla_cpu_parallel_codegen_split_count=1):
# `make test` keeps both cores busy with its two workers, so the parts gain no
# parallelism and their splitting and linking is pure cost. It changes how a program
# is compiled, not the machine code's operations. On the 2-core machine (jaxlib
# 0.10.2) a sample of test_mask_fn, test_tree, test_paged_programs and test_flash
# under -n 2 went from 113 to 102 s.
#
# A jaxlib that no longer knows a flag would abort on it, so each is set only after a
# subprocess has started a CPU client with it (0.4 s, once: the xdist workers inherit
# the result); a caller's own setting of either is kept.
_PROBED = {  # flag: the variable that says this jaxlib refused it (no probe per worker)
    "xla_cpu_use_fusion_emitters=false": "NANOATTN_TEST_NO_EMITTERS_FLAG",
    "xla_cpu_parallel_codegen_split_count=1": "NANOATTN_TEST_NO_SPLIT_FLAG",
}


def _probe(flags: str) -> bool:
    """Whether this jaxlib starts a CPU client with XLA_FLAGS=``flags``."""
    import subprocess

    done = subprocess.run(
        [sys.executable, "-c", "import jaxlib._jax as j; j.get_tfrt_cpu_client()"],
        env={**os.environ, "XLA_FLAGS": flags},
        capture_output=True,
        timeout=120,
    )
    return done.returncode == 0


_wanted = [
    flag
    for flag, refused in _PROBED.items()
    if flag.split("=")[0] not in os.environ.get("XLA_FLAGS", "") and not os.environ.get(refused)
]
if _wanted:

    def _with(*flags):
        return " ".join([os.environ.get("XLA_FLAGS", ""), *(f"--{f}" for f in flags)]).strip()

    if _probe(_with(*_wanted)):  # one probe where this jaxlib takes them all
        os.environ["XLA_FLAGS"] = _with(*_wanted)
    else:
        for _flag in _wanted:
            if _probe(_with(_flag)):
                os.environ["XLA_FLAGS"] = _with(_flag)
            else:  # this jaxlib does not take it: XLA's default, and no probe per worker
                os.environ[_PROBED[_flag]] = "1"


@pytest.fixture
def x64():
    """Runs the test with 64-bit floats enabled."""
    with jax.enable_x64(True):
        yield


def _plain_audit():
    """Exit status and stdout of a plain `nanoattn audit`."""
    import contextlib
    import io

    from nanoattn.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(["audit"])
    return code, out.getvalue()


@pytest.fixture(scope="session")
def default_audit(tmp_path_factory):
    """Exit status and stdout of a plain `nanoattn audit` (about 10 s), run once per
    run (:func:`_once.once_per_run`)."""
    from _once import once_per_run

    return tuple(once_per_run(tmp_path_factory, "default_audit", _plain_audit))
