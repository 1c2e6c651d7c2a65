"""Sliding-window attention: causal ``window=(512, 0)`` against full causal
attention, forward+backward with the flash kernel, at one long length.

With a Python-int ``q_offset`` (here the default 0) the kernel never lists a
block pair that lies wholly outside the band, so the windowed call's work
grows linearly in T while full causal attention's grows quadratically. The
two are timed in turn, in one process; XLA's compiled temporary memory of
each comes from its memory analysis.
"""

import jax

from .._base.validate import describe
from .._core.api import dot_product_attention
from ._cell import inputs
from ._measure import jax_pass, temp_bytes, time_interleaved

LENGTH = 16384
WINDOW = (512, 0)
TARGET_RATIO = 0.25  # windowed time <= 1/4 of full causal time
ROUNDS = 3


def causal_flash(window):
    """Causal attention on (B, T, N, H) with the flash kernel, windowed or not."""

    def attend(q, k, v):
        return dot_product_attention(q, k, v, is_causal=True, window=window, implementation="flash")

    return attend


def measure_window(
    T: int = LENGTH,
    *,
    window: tuple[int, int] = WINDOW,
    n_heads: int = 4,
    head_dim: int = 32,
    batch: int = 1,
    dtype: str = "float32",
    rounds: int = ROUNDS,
) -> dict:
    """Forward+backward times (median, min) and temporary memory of both calls."""
    row = {
        "T": T,
        "window": list(window),
        "B": batch,
        "N": n_heads,
        "H": head_dim,
        "dtype": dtype,
        "pass": "fwd+bwd",
        "rounds": rounds,
    }
    try:
        q, k, v = inputs(batch, T, n_heads, head_dim, dtype)
        fns = {"full": jax_pass(causal_flash(None), True)}
        fns["windowed"] = jax_pass(causal_flash(tuple(window)), True)
        memory = {name: temp_bytes(fn, q, k, v) for name, fn in fns.items()}
        runs = {
            name: (lambda fn=fn: jax.block_until_ready(fn(q, k, v))) for name, fn in fns.items()
        }
        times = time_interleaved(runs, rounds=rounds)
    except Exception as e:  # reported, not fatal to the rest of the bench
        return row | {"status": f"error: {describe(e)[:200]}"}
    for name, (median, best) in times.items():
        row[f"{name}_median_ms"] = median * 1e3
        row[f"{name}_min_ms"] = best * 1e3
        row[f"{name}_temp_bytes"] = memory[name]
    return row | {
        "status": "ok",
        "windowed_vs_full": row["windowed_median_ms"] / row["full_median_ms"],
    }


def window_targets(row: dict) -> list[dict]:
    """Windowed forward+backward time <= 1/4 of full causal time, at T = 16384."""
    if row["T"] != LENGTH or tuple(row["window"]) != WINDOW:
        return []
    target = f"fwd+bwd T={LENGTH}: window={WINDOW} takes <= 1/4 of full causal time"
    if row["status"] != "ok":
        return [{"target": target, "measured": row["status"], "passed": None}]
    ratio = row["windowed_vs_full"]
    measured = (
        f"full {row['full_median_ms']:.0f} ms, windowed {row['windowed_median_ms']:.0f} ms: "
        f"{ratio:.3f} of the time (1/{1 / ratio:.1f}); temp memory "
        f"{row['full_temp_bytes'] / 2**20:.1f} -> {row['windowed_temp_bytes'] / 2**20:.1f} MiB"
    )
    return [{"target": target, "measured": measured, "passed": ratio <= TARGET_RATIO}]
