"""Huge pages of memory for the pool (issue #47: "try huge pages for the pool").

XLA's CPU client takes its buffers from glibc's ``malloc``, which maps a large block
with pages of 4 KiB: a token row of a pool at 4 KiB (bfloat16, 8 heads of 128 keys and
values) sits on a page of its own, and every row read misses the TLB. Linux backs
memory with 2 MiB pages where a program asks (transparent huge pages in ``madvise``
mode, the default of most distributions) or everywhere (``always``); glibc 2.35 and
newer asks for every block it maps when started with the tunable
``GLIBC_TUNABLES=glibc.malloc.hugetlb=1``. Nothing in the library changes: a server
sets the variable before Python starts (docs/decoding.md, "Huge pages for the pool"),
and the decode sweep runs the native kernel with and without it, each alone.
"""

import os
import pathlib

THP = pathlib.Path("/sys/kernel/mm/transparent_hugepage/enabled")
TUNABLE = "glibc.malloc.hugetlb=1"
ENV = {"4 KiB pages": {"GLIBC_TUNABLES": ""}, "huge pages": {"GLIBC_TUNABLES": TUNABLE}}


def refusal() -> str | None:
    """Why this machine cannot put glibc's large blocks on huge pages, or None."""
    try:
        mode = THP.read_text()
    except OSError:
        return f"no transparent huge pages here (no {THP})"
    if "[never]" in mode:
        return f"transparent huge pages are off ({THP}: never)"
    version = os.confstr("CS_GNU_LIBC_VERSION") if "CS_GNU_LIBC_VERSION" in os.confstr_names else ""
    number = version.split()[-1] if version.startswith("glibc ") else ""
    if tuple(int(x) for x in number.split(".")[:2] if x.isdigit()) < (2, 35):
        return f"{TUNABLE} needs glibc 2.35 or newer (this is {version or 'not glibc'})"
    return None


def mib() -> int | None:
    """MiB of this process's anonymous memory on huge pages now (None: unknown)."""
    try:
        text = pathlib.Path("/proc/self/smaps_rollup").read_text()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("AnonHugePages:"):
            return int(line.split()[1]) // 1024
    return None
