"""Shared prefixes read once (cascade attention, docs/decoding.md "Shared prefixes"):
one decode token for each of B sequences whose page tables start with the same pages (a
shared prompt, forks, prefix-cache hits), each with its own suffix, through
``paged_attention`` with ``shared_prefixes`` against the same call without it.

Both calls run on one backend (by default the automatic choice: native on a CPU), in
one process, timed in turn, in float32 and then in bfloat16 (queries and pages; where the
native kernel has AMX tiles, the group pass of bfloat16 runs on them: the row's
``amx``). Issue 48's target, at the full shape (32 sequences sharing a 4096-token
prefix, each with its own 64-token suffix, N = 32 on K = 8, H = 128, pages of 16): the
shared call at least 4x faster than the unshared one, judged in each type.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from .._backends import native
from ._markdown import timed_calls
from ._measure import Heads, ratio_target, timed_row
from ._paged_pair import with_and_without


@dataclasses.dataclass(frozen=True)
class CascadeShape(Heads):
    """``B`` sequences sharing ``prefix`` tokens, each with ``suffix`` more and one
    decode token, in pages of ``page_size``."""

    B: int
    prefix: int
    suffix: int
    page_size: int = 16


FULL = CascadeShape(B=32, prefix=4096, suffix=64, rounds=15)  # about 1 s a type
QUICK = CascadeShape(B=4, prefix=256, suffix=16, N=8, K=2, H=64, rounds=3)
TARGET = 4.0  # the unshared call >= 4x the shared one's time
DTYPES = {"": jnp.float32, "_bf16": jnp.bfloat16}  # the calls' suffix: their type


def layout(shape: CascadeShape):
    """(page table (B, M), kv_lengths (B,), shared_prefixes (B,), pool pages): the
    shared pages first in the pool, each sequence's own after them, shuffled."""
    s = shape
    shared = s.prefix // s.page_size
    length = s.prefix + s.suffix + 1
    own = -(-length // s.page_size) - shared
    pool = shared + s.B * own
    order = np.random.default_rng(0).permutation(pool).astype(np.int32)
    table = np.concatenate([np.broadcast_to(order[:shared], (s.B, shared)),
                            order[shared:].reshape(s.B, own)], axis=1)  # fmt: skip
    lengths = np.full(s.B, length, np.int32)
    return table, lengths, np.full(s.B, shared, np.int32), pool


def _calls(shape: CascadeShape, implementation, dtype=jnp.float32, suffix=""):
    """The two jitted calls and their arguments in ``dtype``: {"shared" + suffix: (fn,
    args), "unshared" + suffix: ...}."""
    s = shape
    table, lengths, shared, pool = (jnp.asarray(x) for x in layout(s))
    keys = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(keys[0], (s.B, s.N, s.H), jnp.float32).astype(dtype)
    k, v = (jax.random.normal(key, (int(pool), s.page_size, s.K, s.H), jnp.float32).astype(dtype)
            for key in keys[1:])  # fmt: skip
    starts = jnp.arange(s.B + 1, dtype=jnp.int32)
    names = ("shared" + suffix, "unshared" + suffix)
    return with_and_without("shared_prefixes", shared, names, (q, k, v, table, lengths, starts),
                            implementation)  # fmt: skip


def measure_cascade(shape: CascadeShape, progress=None, implementation=None) -> dict:
    """Median and min ms of the shared and the unshared call in each type, their ratios
    (``speedup``, ``speedup_bf16``), and ``amx``: whether the native kernel served the
    calls (named, or the automatic choice on a CPU) with its AMX tiles."""
    label = f"cascade: {shape.B} sequences sharing {shape.prefix} tokens"
    row = {}
    for suffix, dtype in DTYPES.items():  # each type's pair timed in turn, apart
        ratios = {"speedup" + suffix: ("unshared" + suffix, "shared" + suffix)}
        calls = _calls(shape, implementation, dtype, suffix)
        row |= timed_row(shape, calls, implementation, progress, label, ratios=ratios)
    on_native = implementation == "native" or (implementation is None and
                                               jax.default_backend() == "cpu")  # fmt: skip
    return row | {"amx": on_native and native.amx()}


def cascade_targets(row: dict | None, judged: bool) -> list[dict]:
    """Issue 48's target, judged at the full shape only."""
    if row is None or not judged:
        return []
    targets = []
    for suffix, dtype in DTYPES.items():
        target = (f"{row['B']} sequences sharing {row['prefix']} tokens, {jnp.dtype(dtype).name}: "
                  f"the shared call >= {TARGET}x faster than the unshared one")  # fmt: skip
        targets.append(ratio_target(target, row["speedup" + suffix], TARGET, at_most=False))
    return targets


def cascade_markdown(row: dict | None) -> list[str]:
    """The part's table: each call's median (min) ms and the speed-up."""
    if row is None:
        return []
    shape = f"N={row['N']} on K={row['K']}, H={row['H']}, pages of {row['page_size']}"
    title = (f"Shared prefixes: {row['B']} sequences sharing {row['prefix']} tokens, "
             f"{row['suffix']} more each, one decode token each ({shape})")  # fmt: skip
    pair = (("shared_prefixes (cascade)", "shared"), ("unshared", "unshared"))
    calls = [(f"{label}, {jnp.dtype(dtype).name}", name + suffix)
             for suffix, dtype in DTYPES.items() for label, name in pair]  # fmt: skip
    tiles = "on AMX tiles" if row.get("amx") else "no AMX tiles"
    return [
        *timed_calls(row, title, calls), "",
        f"unshared / shared: {row['speedup']:.2f}x in float32, {row['speedup_bf16']:.2f}x in "
        f"bfloat16 (its group pass {tiles})",
    ]  # fmt: skip
