"""`make mutation`: mutation testing of the files issue #13 names, with mutmut.

Each target (one source file or package) is mutated in its own scratch copy of the
tree under ``.cache/mutation/<target>/`` against the test files that exercise it, so
a surviving mutant reruns a few test files rather than the whole suite. mutmut forks
each mutant's pytest from a server that has imported jax but not started its backend
(XLA's threads do not survive ``fork``).

    python tools/mutation.py                 # every target
    python tools/mutation.py masks flash     # some of them
    python tools/mutation.py --report        # the scores of the last runs, no run
    python tools/mutation.py --sample 40 verify    # a seeded random 40 mutants of each file
    python tools/mutation.py --survivors spec      # rerun the last run's survivors only

A mutant counts as killed when a test fails, times out or crashes; "no tests" and
"survived" count against the score. The score of each mutated file must reach 90%.
With ``--sample`` the score is that of the sample; the report says how many ran and
gives Wilson's 95% lower bound on the whole file's score.
"""

import argparse
import json
import math
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WORK = ROOT / ".cache" / "mutation"
THRESHOLD = 0.90

# target -> (mutated files, relative to the root; the test files that exercise them,
# relative to tests/)
TARGETS = {
    "masks": (
        ["nanoattn/_base/masks.py"],
        ["core/test_masks.py", "core/test_window.py", "core/test_segments.py", "test_bad_input.py"],
    ),
    "reference": (
        ["nanoattn/_backends/xla/reference.py"],
        [
            "core/test_attention.py",
            "core/test_soft_cap.py",
            "core/test_nonfinite.py",
            "core/test_combined.py",  # NaN where nothing may look, once test_nonfinite's
            "backends/test_xla.py",  # the backend test base on the reference
            "core/test_masks.py",
            "test_chapter.py",
            "test_bad_input.py",
        ],
    ),
    "spec": (
        ["nanoattn/_base/rules.py"],
        [
            "core/test_soft_cap.py",
            "core/test_attention.py",
            "backends/test_dispatch.py",
            "core/test_window.py",
            "core/test_segments.py",
            "test_bad_input.py",
        ],
    ),
    "schedule": (
        ["nanoattn/_backends/flash/schedule.py"],
        ["backends/test_schedule.py", "backends/test_flash.py"],
    ),
    "flash": (
        [
            "nanoattn/_backends/flash/kernel.py",
            "nanoattn/_backends/flash/plan.py",
            "nanoattn/_base/shard_map.py",
        ],
        [
            "backends/test_flash.py",
            "backends/test_lse.py",
            "backends/test_schedule.py",
            "core/test_nonfinite.py",
            "core/test_soft_cap.py",
            "core/test_combined.py",
            "core/test_segments.py",
            "core/test_window.py",
            "test_bad_input.py",
        ],
    ),
    "native": (
        ["nanoattn/_backends/native/kernel.py"],
        [
            "backends/test_native.py",
            "backends/test_native_blocks.py",
            "backends/test_native_build.py",
            "backends/test_lse.py",
            "test_bad_input.py",
        ],
    ),
    "verify": (
        ["nanoattn/verify/*"],
        [
            "verify/test_verify_causality.py",
            "verify/test_verify_padding.py",
            "verify/test_verify_row_sums.py",
            "verify/test_verify_shapes.py",
            "verify/test_verify_report.py",
            "verify/test_verify_inputs.py",
            "verify/test_verify_cli.py",
            "verify/test_verify_decoding.py",
            # its audit test with a leaking built-in module, once in test_verify.py
            "cli/test_cli.py",
            "test_bad_input.py",
        ],
    ),
}

# Imported by mutmut's fork server before it forks a mutant: everything heavy except
# nanoattn itself (each mutant imports its own mutated copy) and jax's backend.
# Appended to the scratch copy's tests/conftest.py: a mutant's tests run fastest first
# (by the durations of mutmut's clean run), so with ``-x`` a killed mutant dies early.
ORDER_HOOK = """

def pytest_collection_modifyitems(config, items):  # added by tools/mutation.py
    import json, pathlib

    stats = pathlib.Path("mutmut-stats.json")
    if stats.exists():
        took = json.loads(stats.read_text()).get("duration_by_test", {})
        items.sort(key=lambda item: took.get(item.nodeid, 0.0))


def pytest_runtest_setup(item):  # added by tools/mutation.py
    # mutmut's stats run records the functions each test calls, and runs only those
    # tests against a function's mutants; a program or result cached by an earlier
    # test would hide the calls, so in that run every test starts with empty caches.
    import os, sys

    if os.environ.get("MUTANT_UNDER_TEST") != "stats":
        return
    import jax

    jax.clear_caches()
    for module in list(sys.modules.values()):
        if "/tests/" not in (getattr(module, "__file__", None) or ""):
            continue
        for value in list(vars(module).values()):
            if callable(getattr(value, "cache_clear", None)):
                value.cache_clear()
        programs = getattr(module, "_PROGRAMS", None)
        if isinstance(programs, dict):
            programs.clear()
"""

# Read by tests (docs' examples, the verify demo's decoders).
ALSO_COPY = ["docs", "examples"]

PRELOAD = ["numpy", "jax", "jax.numpy", "flax", "flax.linen", "flax.nnx", "hypothesis", "pytest"]

# mutmut's exit codes (mutmut/stats.py) that mean a test noticed the mutant.
KILLED = {1: "killed", 3: "killed", -11: "segfault", -9: "segfault"}
KILLED |= {code: "timeout" for code in (36, -24, 24, 152, 255)}
NOT_KILLED = {0: "survived", 33: "no tests", 5: "no tests"}


def _setup_cfg(files: list[str], tests: list[str]) -> str:
    lines = [
        "[mutmut]",
        "source_paths = nanoattn/",
        "only_mutate =",
        *[f"    {f}" for f in files],
        "pytest_add_cli_args =",
        "    -p",
        "    no:xdist",
        "    -p",
        "    no:cacheprovider",
        "pytest_add_cli_args_test_selection =",
        *[f"    tests/{t}" for t in tests],
        "process_isolation = forkserver",
        "forkserver_warmup = import",
        "preload_modules_file = preload.txt",
        "timeout_multiplier = 4.0",
        "timeout_constant = 30.0",
        "use_git_change_detection = false",
        "also_copy =",
        *[f"    {d}/" for d in ALSO_COPY],
    ]
    return "\n".join(lines) + "\n"


def _copy(folder: str, work: Path) -> None:
    """``folder`` of the tree copied afresh into ``work``."""
    shutil.rmtree(work / folder, ignore_errors=True)
    shutil.copytree(ROOT / folder, work / folder, ignore=shutil.ignore_patterns("__pycache__"))


def _copy_also(work: Path) -> None:
    for folder in ALSO_COPY:
        _copy(folder, work)


def _copy_tests(work: Path) -> None:
    _copy("tests", work)
    with open(work / "tests" / "conftest.py", "a") as conftest:
        conftest.write(ORDER_HOOK)


def _prepare(name: str) -> Path:
    files, tests = TARGETS[name]
    work = WORK / name
    _copy("nanoattn", work)
    _copy_tests(work)
    shutil.copy(ROOT / "pyproject.toml", work / "pyproject.toml")
    _copy_also(work)
    (work / "setup.cfg").write_text(_setup_cfg(files, tests))
    (work / "preload.txt").write_text("\n".join(PRELOAD) + "\n")
    shutil.rmtree(work / "mutants", ignore_errors=True)
    return work


# Generates the mutants without running anything (mutmut's own first steps), so that a
# sample of their names can be passed to `mutmut run`.
GENERATE = """
from mutmut.__main__ import create_mutants
from mutmut.mutation.trampoline import set_mutant_under_test
from mutmut.utils.file_utils import copy_also_copy_files, copy_src_dir, setup_source_paths
set_mutant_under_test("mutant_generation")
copy_src_dir(); copy_also_copy_files(); setup_source_paths(); create_mutants(2)
"""


def _exit_codes(name: str) -> dict[str, dict]:
    """Each mutated file's mutants and their exit codes (None: not run)."""
    work = WORK / name / "mutants"
    return {
        str(meta.relative_to(work)).removesuffix(".meta"): json.loads(meta.read_text())[
            "exit_code_by_key"
        ]
        for meta in sorted(work.rglob("*.meta"))
    }


def _sample(name: str, size: int, seed: int) -> list[str]:
    """A seeded random `size` mutants of each mutated file (all of a smaller file)."""
    work = WORK / name
    subprocess.run([sys.executable, "-c", GENERATE], cwd=work, check=True, capture_output=True)
    chosen = []
    for codes in _exit_codes(name).values():
        names = sorted(codes)
        chosen += random.Random(seed).sample(names, size) if size < len(names) else names
    return sorted(chosen)


def _survivors(name: str) -> tuple[Path, list[str]]:
    """The last run's survivors, with the work copy's tests refreshed."""
    work = WORK / name
    for pattern in TARGETS[name][0]:
        for source in ROOT.glob(pattern):
            copy = work / source.relative_to(ROOT)
            if not copy.exists() or copy.read_bytes() != source.read_bytes():
                raise SystemExit(
                    f"{source.relative_to(ROOT)} changed since the last run of "
                    f"{name}: run the whole target"
                )
    if (work / "setup.cfg").read_text() != _setup_cfg(*TARGETS[name]):
        # mutmut drops every verdict when the test selection changes
        raise SystemExit(f"the test files of {name} changed since its last run: run it whole")
    _copy_tests(work)
    _copy_also(work)
    return work, sorted(
        m for codes in _exit_codes(name).values() for m in _results(codes)["survivors"]
    )


def _results(codes: dict) -> dict:
    """One file's tally: how many mutants ran, were killed, and which survived."""
    counts: dict[str, int] = {}
    survivors = []
    for mutant, code in codes.items():
        if code is None:
            continue  # not run (outside the sample)
        if code in KILLED:
            kind = KILLED[code]
        elif code in NOT_KILLED:
            kind = NOT_KILLED[code]
            survivors.append(mutant)
        else:
            kind = f"exit {code}"  # unknown: counts against the score
            survivors.append(mutant)
        counts[kind] = counts.get(kind, 0) + 1
    total = sum(counts.values())
    killed = sum(v for k, v in counts.items() if k in KILLED.values())
    return dict(total=total, of=len(codes), killed=killed, counts=counts, survivors=survivors)


def _lower_bound(killed: int, total: int, z: float = 1.96) -> float:
    """Wilson's 95% lower bound on the whole file's score, given a sample's."""
    p = killed / total
    centre = p + z * z / (2 * total)
    spread = z * math.sqrt(p * (1 - p) / total + z * z / (4 * total * total))
    return (centre - spread) / (1 + z * z / total)


def _diff(name: str, mutant: str) -> str:
    run = subprocess.run(
        [str(Path(sys.executable).parent / "mutmut"), "show", mutant],
        cwd=WORK / name,
        capture_output=True,
        text=True,
    )
    return run.stdout.strip()


def _report(names: list[str]) -> bool:
    """Print the score of each mutated file; True when every one reaches the bar.

    A sampled file passes when its sample's score does; the report adds the 95% lower
    bound on the whole file's score, to show how far a sample can be trusted.
    """
    ok = True
    print(f"{'file':<34} {'mutants':>8} {'killed':>7} {'score':>7}  other")
    survivors = []
    for name in names:
        files = _exit_codes(name)
        if not files:
            print(f"{name:<34} (not run)")
            ok = False
        for file, codes in files.items():
            r = _results(codes)
            if not r["of"]:
                continue  # a file with nothing to mutate (an __init__)
            if not r["total"]:
                print(f"{file:<34} (not run, {r['of']} mutants)")
                ok = False
                continue
            score = r["killed"] / r["total"]
            ok &= score >= THRESHOLD
            other = ", ".join(f"{k} {v}" for k, v in sorted(r["counts"].items()) if k != "killed")
            if r["total"] < r["of"]:
                bound = _lower_bound(r["killed"], r["total"])
                other += f"  (sample of {r['total']} of {r['of']}; whole file >= {bound:.1%})"
            print(f"{file:<34} {r['total']:>8} {r['killed']:>7} {score:>7.1%}  {other}")
            survivors += [(name, mutant) for mutant in r["survivors"]]
    for name, mutant in survivors:
        print(f"\n--- {mutant}\n{_diff(name, mutant)}")
    return ok


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    # [] among the choices: argparse before 3.12 checks the empty default against them
    parser.add_argument("targets", nargs="*", choices=[[], *TARGETS], default=[])
    parser.add_argument("--report", action="store_true", help="print the last runs' scores")
    parser.add_argument("--max-children", type=int, default=os.cpu_count() or 2)
    parser.add_argument(
        "--sample", type=int, help="run a seeded random this many mutants of each file"
    )
    parser.add_argument("--seed", type=int, default=0, help="the sample's seed")
    parser.add_argument(
        "--survivors",
        action="store_true",
        help="rerun only the last run's survivors against the current tests (the source "
        "must be unchanged since that run)",
    )
    args = parser.parse_args()
    names = args.targets or list(TARGETS)
    if not args.report:
        for name in names:
            if args.survivors:
                work, chosen = _survivors(name)
                if not chosen:
                    continue
            else:
                work = _prepare(name)
                chosen = _sample(name, args.sample, args.seed) if args.sample else []
            print(f"== {name}: mutmut run in {work.relative_to(ROOT)}", flush=True)
            mutmut = str(Path(sys.executable).parent / "mutmut")
            # Mutants that leave a program unchanged reuse its compiled form from the
            # persistent cache (keyed by the program and XLA's flags, so never stale).
            env = dict(
                os.environ,
                JAX_COMPILATION_CACHE_DIR=str(WORK / "jax-cache"),
                JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
            )
            with open(work / "mutmut.log", "w") as log:
                subprocess.run(
                    [mutmut, "run", "--max-children", str(args.max_children), *chosen],
                    cwd=work,
                    env=env,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    check=False,
                )
    return 0 if _report(names) else 1


if __name__ == "__main__":
    sys.exit(main())
