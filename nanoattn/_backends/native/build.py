"""Building and loading the native kernel: one compiler call, cached on disk.

The kernel (``attention.cc`` beside this file, the FFI handlers, with the headers
beside it that it includes: ``forward.h``, ``backward.h`` and ``paged.h``, the passes,
and their pieces) is compiled on first
use, with the machine's own instruction set (``-march=native``), against the FFI
headers of the installed jaxlib, into ``$NANOATTN_CACHE_DIR`` (default
``~/.cache/nanoattn``). The file name carries a hash of every input of the
build (:func:`build_key`): every source file (:func:`sources`: ``attention.cc`` and
each header in its folder), the flags, the compiler, what the flags make
of this machine (``-march=native`` names no instruction set; the compiler's
predefined macros do) and the jaxlib version, so a change to any of them builds
anew, and a cache shared by machines of different instruction sets never hands
one the other's library; a file lock keeps parallel processes (pytest-xdist
workers) from building it twice. Where no C++ compiler is found, or the build
fails (the compiler exits non-zero, or writes no library), nanoattn says so
once and the dispatcher serves every call with the pure-JAX kernels.

Environment:
  CXX: the compiler (default: ``c++``, then ``g++``, then ``clang++`` on PATH).
  NANOATTN_CACHE_DIR: where the built library goes.
  NANOATTN_NATIVE=0: do not build or use the native kernel.
  NANOATTN_NATIVE_CFLAGS: extra compiler flags, space-separated (for example
    ``-DNANOATTN_BQ=128 -DNANOATTN_BK=64`` to try other block sizes).
  NANOATTN_NATIVE_SANITIZE: e.g. ``address,undefined``: build with those
    sanitizers (the process must preload their runtimes; see docs/testing.md).
  NANOATTN_AMX=0: keep the paged pass off AMX tiles (:func:`amx`), read at each call.
"""

import ctypes
import fcntl
import functools
import hashlib
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time
import warnings

import jax
import jaxlib
import numpy as np

SOURCE = pathlib.Path(__file__).with_name("attention.cc")  # the one file compiled
FLAGS = (
    "-O3",
    "-std=c++17",
    "-ffp-contract=fast",  # fused multiply-adds in the block products
    "-fno-math-errno",
    "-fPIC",
    "-shared",
    "-pthread",
)
SANITIZE_FLAGS = ("-O1", "-g", "-fno-omit-frame-pointer", "-fno-sanitize-recover=all")
TARGETS = {
    "nanoattn_forward": "NanoattnForward",
    "nanoattn_backward": "NanoattnBackward",
    "nanoattn_forward_bf16": "NanoattnForwardBf16",
    "nanoattn_backward_bf16": "NanoattnBackwardBf16",
    "nanoattn_paged_forward": "NanoattnPagedForward",
    "nanoattn_paged_forward_bf16": "NanoattnPagedForwardBf16",
    "nanoattn_forward_quantized": "NanoattnForwardQuantized",
    "nanoattn_paged_forward_quantized": "NanoattnPagedForwardQuantized",
    "nanoattn_index_scores": "NanoattnIndexScores",
    "nanoattn_absorbed_rows": "NanoattnAbsorbedRows",
    "nanoattn_absorbed_columns": "NanoattnAbsorbedColumns",
}


def compiler() -> str | None:
    """The C++ compiler to use, or None."""
    if os.environ.get("CXX"):
        return shutil.which(os.environ["CXX"])
    return next(filter(None, map(shutil.which, ("c++", "g++", "clang++"))), None)


def cache_dir() -> pathlib.Path:
    if os.environ.get("NANOATTN_CACHE_DIR"):
        return pathlib.Path(os.environ["NANOATTN_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or pathlib.Path.home() / ".cache"
    return pathlib.Path(base) / "nanoattn"


def flags() -> list[str]:
    """The compiler flags of this build (machine, sanitizers and headers included)."""
    sanitize = os.environ.get("NANOATTN_NATIVE_SANITIZE", "")
    extra = [f"-fsanitize={sanitize}", *SANITIZE_FLAGS] if sanitize else ["-march=native"]
    extra += os.environ.get("NANOATTN_NATIVE_CFLAGS", "").split()
    return [*FLAGS, *extra, "-isystem", jax.ffi.include_dir()]


def sources() -> list[pathlib.Path]:
    """Every file the kernel is compiled from: ``SOURCE``, then the headers beside it by name."""
    return [SOURCE, *sorted(SOURCE.parent.glob("*.h"))]


def _run(command: list[str]) -> subprocess.CompletedProcess:
    # A compiler's messages need not be UTF-8 (a localised one, a path): replace, never raise.
    return subprocess.run(command, capture_output=True, text=True, errors="replace")


def build_key(cxx: str, build_flags: list[str]) -> str:
    """The name of one build: a hash of every input that can change the library.

    Every source file (:func:`sources`, each by its name and its bytes: an edited
    header builds anew as an edited ``attention.cc`` does), the flags (sanitizers, ``-D``
    defines, ``-march``), the compiler's ``--version``, its predefined macros under these
    flags (what ``-march=native`` resolves to on this machine: ``__AVX512F__``,
    ``__AVX2__``, the tuning; the sanitizers' and defines' macros too) and the jaxlib
    version, whose headers the kernel is built against. Each part is hashed with its
    length, so that no two different sets of inputs run together into one.
    """
    version = _run([cxx, "--version"]).stdout
    macros = _run([cxx, *build_flags, "-E", "-dM", "-x", "c++", os.devnull]).stdout
    files = [part for path in sources() for part in (path.name.encode(), path.read_bytes())]
    digest = hashlib.sha256()
    for part in (*files, "\0".join(build_flags).encode(), version.encode(), macros.encode(),
                 jaxlib.__version__.encode()):  # fmt: skip
        digest.update(len(part).to_bytes(8, "little"))
        digest.update(part)
    return digest.hexdigest()[:16]


def _build(cxx: str) -> pathlib.Path:
    """Compiles the kernel unless the cache already has this exact build."""
    build_flags = flags()
    folder = cache_dir()
    folder.mkdir(parents=True, exist_ok=True)
    target = folder / f"attention-{build_key(cxx, build_flags)}.so"
    with open(folder / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be building it now
        if not target.exists():
            # The first call waits for this (about 20 s on a 2-core machine): say so.
            _say(f"nanoattn: building the native CPU kernel for this machine (once) in {folder}")
            started = time.perf_counter()
            with tempfile.TemporaryDirectory(dir=folder) as tmp:
                out = pathlib.Path(tmp) / target.name
                done = _run([cxx, *build_flags, str(SOURCE), "-o", str(out)])
                if done.returncode:
                    raise RuntimeError(f"{cxx} failed: {done.stderr.strip()[-2000:]}")
                if not out.is_file():
                    raise RuntimeError(f"{cxx} exited 0 but wrote no library")
                os.replace(out, target)
            _say(f"nanoattn: built the native CPU kernel in {time.perf_counter() - started:.1f} s")
    return target


def _say(line: str) -> None:
    """One line on stderr, where a program's own output is not."""
    print(line, file=sys.stderr, flush=True)


def isa() -> str | None:
    """The instruction set the built kernel was compiled for (its vector width and
    register tiles), or None when it is not available."""
    library, _ = load()
    if library is None:
        return None
    library.NanoattnIsa.restype = ctypes.c_char_p
    return library.NanoattnIsa().decode()


def amx() -> bool:
    """Whether the paged pass's tasks of many query vectors over bfloat16 pools (prefill
    chunks, the group pass of shared prefixes) run on AMX tiles in this process: the
    kernel built for them (``-march=native`` on a CPU with AMX-BF16), Linux granting
    their state, and ``NANOATTN_AMX`` not ``0`` (read at each call)."""
    library, _ = load()
    return library is not None and bool(library.NanoattnAmx())


def read_walk(data: np.ndarray, chunk_floats: int, order: np.ndarray, threads: int) -> float | None:
    """The sum of the float32 chunks ``data[order[i] * chunk_floats:][:chunk_floats]``,
    read by ``threads`` native threads (``NanoattnReadWalk``: the bench's page walk),
    or None when the kernel is not available. ``data`` float32 and ``order`` int64,
    both contiguous; ids are not checked (the caller's permutation of the chunks)."""
    library, _ = load()
    if library is None:
        return None
    walk = library.NanoattnReadWalk
    walk.restype = ctypes.c_double
    walk.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
                     ctypes.c_int]  # fmt: skip
    if not (data.dtype == np.float32 and data.flags.c_contiguous):
        raise ValueError(f"data: contiguous float32 wanted, got {data.dtype}")
    if not (order.dtype == np.int64 and order.flags.c_contiguous):
        raise ValueError(f"order: contiguous int64 wanted, got {order.dtype}")
    return walk(data.ctypes.data, len(order), chunk_floats, order.ctypes.data, threads)


@functools.cache
def load() -> tuple[ctypes.CDLL | None, str | None]:
    """Builds (once per machine) and registers the kernel with XLA.

    Returns:
      ``(library, None)``, or ``(None, why)`` when the kernel is not available;
      the first such answer is also a warning, so that it is said once.
    """
    if os.environ.get("NANOATTN_NATIVE", "1") == "0":
        return None, "NANOATTN_NATIVE=0 turns it off"
    cxx = compiler()
    if cxx is None:
        reason = "no C++ compiler was found (set CXX, or install g++ or clang++)"
    else:
        try:
            library = ctypes.cdll.LoadLibrary(str(_build(cxx)))
        except (OSError, RuntimeError) as error:
            reason = f"building it failed: {error}"
        else:
            for name, symbol in TARGETS.items():
                capsule = jax.ffi.pycapsule(getattr(library, symbol))
                jax.ffi.register_ffi_target(name, capsule, platform="cpu")
            return library, None
    warnings.warn(
        f"nanoattn: the native CPU kernel is not available ({reason}); "
        "the pure-JAX kernels serve every call",
        RuntimeWarning,
        stacklevel=2,
    )
    return None, reason
