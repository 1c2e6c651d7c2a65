"""Sparse attention over chosen keys (``key_indices``, docs/conventions.md "Selected
keys"): one decode token reading k selected keys of a long cache, against a decode over
a cache of only k keys (what reading only the selection should cost) and against the
dense decode over every key (what the selection saves). Beside them, query-aware page
selection (docs/decoding.md "Page selection") over the same cache as a pool of pages of
16: the pages ranked by their key bounds, then the paged call over the k / 16 chosen
(the last among them), as a layer with ``page_selection`` decodes. And DeepSeek-V3.2's
layer decode, its indexer's top keys against its dense MLA decode (:mod:`._v32`).

The three calls run on one backend (by default the automatic choice: native on a CPU),
in one process, timed in turn (one kernel, no peer's thread pool to spin). Issue 51's
targets, at the full shape (32768 keys, 2048 selected, N = 32 on K = 8, H = 128): the
selection at most 1.3x the decode over k keys and at least 8x faster than the dense one.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from .._core.api import dot_product_attention
from .._core.paged import paged_attention
from .._layers.caches.page_selection import select_pages
from ._markdown import timed_calls
from ._measure import Heads, ratio_target, timed_row
from ._v32 import QUICK_V32, V32, measure_v32, v32_markdown, v32_target

PAGE_SIZE = 16


@dataclasses.dataclass(frozen=True)
class SelectionShape(Heads):
    """One decode token (B = 1) over ``S`` cached keys, ``k`` of them selected."""

    S: int
    k: int
    v32: dict | None = None  # DeepSeek-V3.2's layer sizes at context S (None: not timed)


FULL = SelectionShape(S=32768, k=2048, v32=V32, rounds=21)  # its calls are short: a steadier median
QUICK = SelectionShape(S=2048, k=256, N=8, K=2, H=64, rounds=3, v32=QUICK_V32)
TARGET_SMALL = 1.3  # selected <= 1.3x the decode over a cache of k keys
TARGET_DENSE = 8.0  # the dense decode over all S keys >= 8x the selected one


def _calls(shape: SelectionShape, implementation):
    """The three jitted calls and their arguments: {name: (fn, args)}."""
    s = shape
    keys = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(keys[0], (1, 1, s.N, s.H), jnp.float32)
    k = jax.random.normal(keys[1], (1, s.S, s.K, s.H), jnp.float32)
    v = jax.random.normal(keys[2], (1, s.S, s.K, s.H), jnp.float32)
    chosen = np.random.default_rng(0).choice(s.S, size=s.k, replace=False)
    indices = jnp.asarray(chosen.astype(np.int32).reshape(1, 1, s.k))
    options = dict(implementation=implementation)

    def attend(q, k, v, key_indices=None):
        return dot_product_attention(q, k, v, key_indices=key_indices, **options)

    call = jax.jit(attend)
    return {
        "selected": (call, (q, k, v, indices)),
        "small": (call, (q, k[:, : s.k], v[:, : s.k])),
        "dense": (call, (q, k, v)),
        "pages": _page_selection(shape, implementation, q, k, v),
    }


def _page_selection(shape: SelectionShape, implementation, q, k, v):
    """The page-selecting decode: (fn, args) over the cache as pages of 16 with each
    page's key bounds (computed once, as the layer keeps them)."""
    s, ps = shape, PAGE_SIZE
    P = s.S // ps
    key_pages, value_pages = (x[0].reshape(P, ps, s.K, s.H) for x in (k, v))
    bounds = jnp.stack([key_pages.min(axis=1), key_pages.max(axis=1)], axis=1)  # (P, 2, K, H)
    table = jnp.arange(P, dtype=jnp.int32)[None]
    lengths, starts = jnp.array([s.S], jnp.int32), jnp.array([0, 1], jnp.int32)

    def attend(q, key_pages, value_pages, bounds):
        chosen, kept = select_pages(q[0], bounds, table, lengths, starts, s.k // ps - 1, ps)
        return paged_attention(q[0], key_pages, value_pages, chosen, kept, starts,
                               implementation=implementation)  # fmt: skip

    return jax.jit(attend), (q, key_pages, value_pages, bounds)


def measure_selection(shape: SelectionShape, progress=None, implementation=None) -> dict:
    """Median and min ms of each call, and the two ratios; ``progress(i, n, label)``
    before the measurement."""
    label = f"selection: {shape.k} of {shape.S} keys"
    ratios = {
        "selected_vs_small": ("selected", "small"),
        "dense_vs_selected": ("dense", "selected"),
        "dense_vs_pages": ("dense", "pages"),
    }
    row = timed_row(shape, _calls(shape, implementation), implementation, progress, label,
                    ratios=ratios, omit=("v32",))  # fmt: skip
    if shape.v32 is not None:
        if progress:
            progress(0, 1, f"selection: DeepSeek-V3.2 decode at {shape.S} keys")
        row["v32"] = measure_v32(shape.S, shape.v32, rounds=min(shape.rounds, 5))
    return row


def selection_targets(row: dict | None, judged: bool) -> list[dict]:
    """Issue 51's targets (the key selection's two, DeepSeek-V3.2's decode when timed),
    judged at the full shape only."""
    if row is None or not judged:
        return []
    v32 = [v32_target(row["v32"])] if "v32" in row else []
    small = f"selected decode <= {TARGET_SMALL}x a decode over {row['k']} keys"
    dense = f"dense decode over {row['S']} keys >= {TARGET_DENSE}x the selected one"
    return [
        ratio_target(small, row["selected_vs_small"], TARGET_SMALL, at_most=True),
        ratio_target(dense, row["dense_vs_selected"], TARGET_DENSE, at_most=False),
        *v32,
    ]


def selection_markdown(row: dict | None) -> list[str]:
    """The part's table: each call's median (min) ms and the ratios."""
    if row is None:
        return []
    shape = f"B=1, one query, N={row['N']} on K={row['K']}, H={row['H']}, float32"
    held = f"{row['k'] // PAGE_SIZE} of {row['S'] // PAGE_SIZE}"
    pages = f"page selection: {held} pages of {PAGE_SIZE}"
    calls = [(f"{row['k']} selected of {row['S']}", "selected"),
             (f"dense over {row['k']} keys", "small"), (f"dense over {row['S']} keys", "dense"),
             (pages, "pages")]  # fmt: skip
    return [
        *timed_calls(row, f"Selected keys: {row['k']} of {row['S']} ({shape})", calls),
        "", f"selected / dense over {row['k']}: {row['selected_vs_small']:.2f}x; dense over "
        f"{row['S']} / selected: {row['dense_vs_selected']:.2f}x; dense / page selection: "
        f"{row['dense_vs_pages']:.2f}x",
    ] + (v32_markdown(row["v32"]) if "v32" in row else [])  # fmt: skip
