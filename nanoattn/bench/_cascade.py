"""Shared prefixes read once (cascade attention, docs/decoding.md "Shared prefixes"):
one decode token for each of B sequences whose page tables start with the same pages (a
shared prompt, forks, prefix-cache hits), each with its own suffix, through
``paged_attention`` with ``shared_prefixes`` against the same call without it.

Both calls run on one backend (by default the automatic choice: native on a CPU), in
one process, timed in turn. Issue 48's target, at the full shape (32 sequences sharing a
4096-token prefix, each with its own 64-token suffix, N = 32 on K = 8, H = 128, pages of
16): the shared call at least 4x faster than the unshared one.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

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


FULL = CascadeShape(B=32, prefix=4096, suffix=64)
QUICK = CascadeShape(B=4, prefix=256, suffix=16, N=8, K=2, H=64, rounds=3)
TARGET = 4.0  # the unshared call >= 4x the shared one's time


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


def _calls(shape: CascadeShape, implementation):
    """The two jitted calls and their arguments: {name: (fn, args)}."""
    s = shape
    table, lengths, shared, pool = (jnp.asarray(x) for x in layout(s))
    keys = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(keys[0], (s.B, s.N, s.H), jnp.float32)
    k, v = (jax.random.normal(key, (int(pool), s.page_size, s.K, s.H), jnp.float32)
            for key in keys[1:])  # fmt: skip
    starts = jnp.arange(s.B + 1, dtype=jnp.int32)
    return with_and_without("shared_prefixes", shared, ("shared", "unshared"),
                            (q, k, v, table, lengths, starts), implementation)  # fmt: skip


def measure_cascade(shape: CascadeShape, progress=None, implementation=None) -> dict:
    """Median and min ms of the shared and the unshared call, and their ratio."""
    label = f"cascade: {shape.B} sequences sharing {shape.prefix} tokens"
    ratios = {"speedup": ("unshared", "shared")}
    return timed_row(shape, _calls(shape, implementation), implementation, progress, label,
                     ratios=ratios)  # fmt: skip


def cascade_targets(row: dict | None, judged: bool) -> list[dict]:
    """Issue 48's target, judged at the full shape only."""
    if row is None or not judged:
        return []
    target = (f"{row['B']} sequences sharing {row['prefix']} tokens: the shared call >= "
              f"{TARGET}x faster than the unshared one")  # fmt: skip
    return [ratio_target(target, row["speedup"], TARGET, at_most=False)]


def cascade_markdown(row: dict | None) -> list[str]:
    """The part's table: each call's median (min) ms and the speed-up."""
    if row is None:
        return []
    shape = f"N={row['N']} on K={row['K']}, H={row['H']}, pages of {row['page_size']}, float32"
    title = (f"Shared prefixes: {row['B']} sequences sharing {row['prefix']} tokens, "
             f"{row['suffix']} more each, one decode token each ({shape})")  # fmt: skip
    calls = [("shared_prefixes (cascade)", "shared"), ("unshared", "unshared")]
    return [
        *timed_calls(row, title, calls),
        "", f"unshared / shared: {row['speedup']:.2f}x",
    ]  # fmt: skip
