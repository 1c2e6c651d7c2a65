"""The native kernel's build (nanoattn/_backends/native/build.py): the cache and the fallbacks.

Pinned: the cached library's name covers every input of the build (every source file:
attention.cc and each header beside it; the flags: sanitizers, ``-D`` defines,
``-march``; the compiler, what ``-march=native`` makes of the machine, the jaxlib
version), so a build with other inputs never reuses a library compiled from different
ones, and one with the same inputs reuses it without compiling; and where the kernel
cannot be had (no compiler, a compile that fails, a compiler that exits 0 but writes no
library) nanoattn warns once and the automatic choice serves every call with the
pure-JAX kernels. Fake compilers (shell scripts in tmp_path) stand in for the real one:
nothing here compiles the kernel but the one test that asks that, with a compiler on
the machine, the real kernel builds (the native tests skip where it does not).
"""

import json
import os
import pathlib
import re
import stat
import subprocess
import sys

import numpy as np
import pytest

from nanoattn._backends.dispatch import choose
from nanoattn._backends.native import build as native_build
from nanoattn._base.rules import Rules

from _reference import np_attention, np_causal, randn

# A stand-in compiler: answers --version and the predefined-macro query from the
# environment (FAKE_VERSION, FAKE_ISA: another compiler, another machine), logs each
# compile to FAKE_LOG and writes its arguments where -o says.
FAKE_CXX = r"""#!/bin/sh
case "$*" in
  *--version*) echo "fake c++ ${FAKE_VERSION:-1.0}"; exit 0 ;;
  *-dM*) echo "#define __FAKE_ISA__ ${FAKE_ISA:-avx2}"; exit 0 ;;
esac
args="$*"
while [ $# -gt 0 ]; do
  if [ "$1" = -o ]; then out="$2"; fi
  shift
done
echo "$args" >> "$FAKE_LOG"
echo "$args" > "$out"
"""


def script(path: pathlib.Path, text: str) -> pathlib.Path:
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


@pytest.fixture
def fake_cxx(tmp_path, monkeypatch):
    """A fake compiler and an empty cache; returns (compiler, number of compiles so far)."""
    log = tmp_path / "compiles.log"
    log.touch()
    for name in ("NANOATTN_NATIVE_SANITIZE", "NANOATTN_NATIVE_CFLAGS", "FAKE_VERSION", "FAKE_ISA"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("FAKE_LOG", str(log))
    monkeypatch.setenv("NANOATTN_CACHE_DIR", str(tmp_path / "cache"))
    cxx = str(script(tmp_path / "fake-c++", FAKE_CXX))
    return cxx, lambda: len(log.read_text().splitlines())


def test_a_build_with_other_inputs_never_reuses_a_library(fake_cxx, tmp_path, monkeypatch):
    cxx, compiles = fake_cxx

    def edited(name):
        """The kernel's sources copied to a scratch folder, the file `name` (None: none)
        with a comment appended; returns the copy of attention.cc."""
        folder = tmp_path / f"sources-{name}"
        folder.mkdir()
        for path in native_build.sources():
            comment = b"// edited\n" if path.name == name else b""
            (folder / path.name).write_bytes(path.read_bytes() + comment)
        return folder / native_build.SOURCE.name

    built = {"default": native_build._build(cxx)}
    assert compiles() == 1 and "-march=native" in built["default"].read_text()
    args = built["default"].read_text().split()  # attention.cc compiled; headers by its folder
    assert str(native_build.SOURCE) in args and not [a for a in args if a.endswith(".h")]
    assert (
        native_build._build(cxx) == built["default"] and compiles() == 1
    )  # the same inputs: reused
    with monkeypatch.context() as m:  # the same files in another folder: the same build
        m.setattr(native_build, "SOURCE", edited(None))
        assert native_build._build(cxx) == built["default"] and compiles() == 1

    def variant(name, env=None, change=None):
        """Builds with one input changed, twice: a new library, then that one reused."""
        with monkeypatch.context() as m:
            for var, value in (env or {}).items():
                m.setenv(var, value)
            if change:
                change(m)
            built[name] = native_build._build(cxx)
            assert native_build._build(cxx) == built[name], name
        assert compiles() == len(built), (name, compiles(), len(built))

    variant("asan", {"NANOATTN_NATIVE_SANITIZE": "address"})
    variant("asan+ubsan", {"NANOATTN_NATIVE_SANITIZE": "address,undefined"})
    variant("blocks 128x64", {"NANOATTN_NATIVE_CFLAGS": "-DNANOATTN_BQ=128 -DNANOATTN_BK=64"})
    variant("blocks 32x64", {"NANOATTN_NATIVE_CFLAGS": "-DNANOATTN_BQ=32 -DNANOATTN_BK=64"})
    variant("no AVX-512", {"NANOATTN_NATIVE_CFLAGS": "-mno-avx512f"})
    variant("-march=x86-64-v3", {"NANOATTN_NATIVE_CFLAGS": "-march=x86-64-v3"})
    variant(
        "-O2", change=lambda m: m.setattr(native_build, "FLAGS", ("-O2", *native_build.FLAGS[1:]))
    )
    variant("another compiler", {"FAKE_VERSION": "2.0"})
    # The same flags, -march=native, on a machine of another instruction set sharing
    # the cache: the compiler's predefined macros differ, so must the library.
    variant("another machine", {"FAKE_ISA": "avx512"})
    variant("source", change=lambda m: m.setattr(native_build, "SOURCE", edited("attention.cc")))
    headers = [path.name for path in native_build.sources() if path.suffix == ".h"]
    assert len(headers) >= 4, headers  # simd.h, gemm.h, threads.h, visibility.h
    for header in headers:  # an edited header builds anew, as an edited attention.cc does
        variant(header, change=lambda m, h=header: m.setattr(native_build, "SOURCE", edited(h)))
    variant("jaxlib", change=lambda m: m.setattr(native_build.jaxlib, "__version__", "0.0.1"))
    assert len(set(built.values())) == len(built), built
    assert "-fsanitize=address " in built["asan"].read_text()
    assert "-DNANOATTN_BQ=32" in built["blocks 32x64"].read_text()
    assert native_build._build(cxx) == built["default"]  # every input as at first: reused
    assert compiles() == len(built)


def test_the_build_key_is_stable_and_keeps_the_flags_apart(fake_cxx):
    cxx, compiles = fake_cxx
    flags = native_build.flags()
    assert native_build.build_key(cxx, flags) == native_build.build_key(cxx, list(flags))
    # Flags that only ran together differently are other flags.
    assert native_build.build_key(cxx, ["-DA", "-DB"]) != native_build.build_key(cxx, ["-DA -DB"])
    assert compiles() == 0


FAILING_CXX = "#!/bin/sh\nprintf 'attention.cc:1: error: \\377 not UTF-8\\n' >&2\nexit 1\n"
SILENT_CXX = "#!/bin/sh\nexit 0\n"  # exits 0, writes nothing
# name: (the compiler script or None for none at all, why the kernel is not available)
WITHOUT_THE_KERNEL = {
    "without_a_compiler": (None, "no C++ compiler was found (set CXX, or install g++ or clang++)"),
    "compile_fails": (FAILING_CXX, "building it failed: {cxx} failed: attention.cc:1: error: "
                      "\ufffd not UTF-8"),
    "compile_writes_no_library": (SILENT_CXX, "building it failed: {cxx} exited 0 but wrote "
                                  "no library"),
}  # fmt: skip

# In one process, for each compiler in turn as on a first use (the build's answer is
# cached per process: cleared between them): the automatic choice for a long call,
# then a call the native kernel would serve (float32, no mask, enough cells) under
# jit, saved for the float64 reference; then the same call asked of "native" by name,
# which must say why not; and the warnings of all three.
FALLBACK_SCRIPT = """
import json, os, sys, warnings, jax, jax.numpy as jnp, numpy as np, nanoattn
from nanoattn._backends.dispatch import choose
from nanoattn._backends.native import build as native_build
from nanoattn._base.rules import Rules
compilers, folder = json.loads(sys.argv[1]), sys.argv[2]
z = jnp.ones((1, 300, 2, 8))
q, k, v = (np.load(os.path.join(folder, 'qkv.npz'))[x] for x in 'qkv')
said = {}
for name, cxx in compilers.items():
    os.environ['CXX'] = cxx
    native_build.load.cache_clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('always')
        choice = choose(None, Rules.make(z, z, z, is_causal=True), z.dtype, 0.0)
        attend = jax.jit(lambda q, k, v: nanoattn.dot_product_attention(q, k, v, is_causal=True))
        np.save(os.path.join(folder, name + '.npy'), attend(q, k, v))
        try:
            nanoattn.dot_product_attention(q, k, v, is_causal=True, implementation='native')
            by_name = 'served'
        except ValueError as error:
            by_name = str(error)
    said[name] = [choice, [str(w.message) for w in caught], by_name]
print(json.dumps(said))
"""
B, T, N, K, H = 2, 37, 6, 2, 8  # T * T cells: enough for the native kernel to pay off


def test_the_kernel_builds_wherever_a_compiler_is():
    """Where a C++ compiler is found and the kernel is not turned off, it builds and
    loads: the native tests skip where it is not available, so a compile error on this
    machine's instruction set (a kernel that no longer builds) must fail here instead
    of turning them into skips."""
    if native_build.compiler() is None:
        pytest.skip("no C++ compiler: the kernel's absence is the expected state here")
    if os.environ.get("NANOATTN_NATIVE", "1") == "0":
        pytest.skip("NANOATTN_NATIVE=0 turns the kernel off")
    library, reason = native_build.load()
    assert library is not None, reason


def test_without_the_kernel_it_says_so_once_and_the_pure_jax_kernels_serve(tmp_path):
    compilers = {}
    for name, (text, _) in WITHOUT_THE_KERNEL.items():
        cxx = tmp_path / name / "c++"
        cxx.parent.mkdir()
        if text is not None:
            script(cxx, text)
        compilers[name] = str(cxx)
    q, k, v = randn(1, B, T, N, H), randn(2, B, T, K, H), randn(3, B, T, K, H)
    if native_build.load()[0] is not None:  # here, with the kernel, the automatic choice takes it
        assert choose(None, Rules.make(q, k, v, is_causal=True), q.dtype, 0.0) == "native"
    np.savez(tmp_path / "qkv.npz", q=q, k=k, v=v)
    env = dict(os.environ, NANOATTN_CACHE_DIR=str(tmp_path / "cache"))
    env.pop("NANOATTN_NATIVE", None)
    done = subprocess.run(
        [sys.executable, "-c", FALLBACK_SCRIPT, json.dumps(compilers), str(tmp_path)],
        env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    said = json.loads(done.stdout.strip().splitlines()[-1])
    want = np_attention(q, k, v, np_causal(T, T))
    for name, (_, says) in WITHOUT_THE_KERNEL.items():
        says = says.format(cxx=compilers[name])
        choice, warnings, by_name = said[name]
        assert choice == "flash", name
        assert warnings == [
            f"nanoattn: the native CPU kernel is not available ({says}); "
            "the pure-JAX kernels serve every call"
        ], name
        assert by_name == (
            f"implementation='native' cannot serve this call: the kernel is not available: {says}"
        ), name
        out = np.load(tmp_path / f"{name}.npy")
        np.testing.assert_allclose(out, want, atol=1e-5, rtol=1e-5, err_msg=name)
    assert not list((tmp_path / "cache").glob("**/*.so"))


def test_the_first_build_says_so_and_how_long_it_took(fake_cxx, capsys):
    cxx, compiles = fake_cxx
    native_build._build(cxx)
    lines = capsys.readouterr().err.splitlines()
    assert compiles() == 1 and len(lines) == 2, lines
    assert lines[0].startswith("nanoattn: building the native CPU kernel for this machine (once)")
    assert re.fullmatch(r"nanoattn: built the native CPU kernel in \d+\.\d s", lines[1])
    native_build._build(cxx)  # in the cache: nothing to say
    assert compiles() == 1 and capsys.readouterr().err == ""


# Every C++ function of the kernel, at namespace or class scope, fits in this many code
# lines (from its template or type to its closing brace, neither blank nor only a
# comment, as tests/test_architecture.py counts Python's): a longer one is split into
# named steps (docs/architecture.md, the native rows).
LONGEST_FUNCTION = 80
NATIVE = pathlib.Path(native_build.__file__).parent


def blank_comments(text: str) -> str:
    """`text` with its comments and string and character literals blanked, lines kept."""
    out, i = [], 0
    while i < len(text):
        if text.startswith("//", i):
            end = text.find("\n", i)
            end = len(text) if end < 0 else end
        elif text.startswith("/*", i):
            end = text.find("*/", i + 2) + 2
        elif text[i] in "\"'":
            end = i + 1
            while text[end] != text[i]:
                end += 2 if text[end] == "\\" else 1
            end += 1
        else:
            out.append(text[i])
            i += 1
            continue
        out.append(re.sub(r"[^\n]", " ", text[i:end]))
        i = end
    return "".join(out)


def function_lengths(text: str) -> dict[str, int]:
    """Each function's name (at namespace or class scope, with its first line) and its
    code lines, from that line to its closing brace. A brace after ``namespace``,
    ``struct``, ``class``, ``enum`` or ``extern`` opens a scope searched further; one
    after ``)`` (then ``const`` and the like, or a constructor's initializers) a
    function's body; any other (an initializer) is skipped. Preprocessor lines take no
    part in the braces."""
    code = blank_comments(text)
    lines = code.split("\n")
    flat, continued = [], False
    for line in lines:
        directive = continued or line.lstrip().startswith("#")
        continued = directive and line.rstrip().endswith("\\")
        flat.append(" " * len(line) if directive else line)
    flat = "\n".join(flat)

    def closing(at: int) -> int:
        depth = 0
        for j in range(at, len(flat)):
            depth += {"{": 1, "}": -1}.get(flat[j], 0)
            if depth == 0:
                return j
        raise AssertionError(f"unbalanced braces from offset {at}")

    lengths, head, i = {}, 0, 0
    while i < len(flat):
        if flat[i] in ";}":
            head = i + 1
        elif flat[i] == "{":
            words = " ".join(flat[head:i].split())
            if re.search(r"\b(namespace|struct|class|union|enum|extern)\b[^()]*$", words):
                head = i + 1  # a scope: its declarations in turn
            else:
                end = closing(i)
                if re.search(r"\)(\s*(const|noexcept|override|final))*$|\)\s*:.*\)$", words):
                    name = re.findall(r"[~\w<>]+(?=\s*\()", words)[0]
                    lead = len(flat[head:i]) - len(flat[head:i].lstrip())
                    first = flat.count("\n", 0, head + lead)  # its template or type
                    last = flat.count("\n", 0, end)
                    code = [line for line in lines[first : last + 1] if line.strip()]
                    lengths[f"{name} (line {first + 1})"] = len(code)
                i = head = end + 1
                continue
        i += 1
    return lengths


def test_the_scanner_finds_functions_and_counts_their_code_lines():
    text = """namespace {
struct Box {
  int at(int i) const { return i; }  // one line: 0 between the braces
  Box(int n) : n(n), m(n) {
    n += 1;
  }
  int n, m;
};
int table[] = {1, 2, 3};
template <class T>
T f(T x,
    T y) {
  // a comment, then a blank line

  const char* s = "{ not a brace";
  if (x) {
    y = '}';
  }
#if defined(A)
  return x;
#else
  return y;
#endif
}
}  // namespace
"""
    # f: its template and directives are code lines, its comment and blank line are not
    assert function_lengths(text) == {"at (line 3)": 1, "Box (line 4)": 3, "f (line 10)": 13}


def test_no_native_function_is_longer_than_a_screen():
    sources = sorted([*NATIVE.glob("*.h"), *NATIVE.glob("*.cc")])
    assert native_build.SOURCE in sources and len(sources) > 5, sources
    lengths = {
        f"{path.name}: {name}": n
        for path in sources
        for name, n in function_lengths(path.read_text()).items()
    }
    assert len(lengths) > 50, sorted(lengths)  # the scanner found the functions
    longer = {name: n for name, n in lengths.items() if n > LONGEST_FUNCTION}
    assert not longer, f"over {LONGEST_FUNCTION} code lines: {longer}"
