"""One measured cell of the benchmark: an implementation at one size and pass, and
the random inputs every measurement uses."""

import jax
import jax.numpy as jnp

from .._base.validate import describe
from . import _torch
from ._measure import causal_flops, jax_pass, temp_bytes, time_runs
from ._peers import PEERS


def inputs(B: int, T: int, N: int, H: int, dtype: str):
    keys = jax.random.split(jax.random.key(0), 3)
    return [jax.random.normal(key, (B, T, N, H), jnp.dtype(dtype)) for key in keys]


def measure_cell(
    name: str,
    B: int,
    T: int,
    N: int,
    H: int,
    backward: bool,
    dtype: str,
    peak: float,
    max_score_gib: float = float("inf"),
) -> dict:
    """One implementation at one size and pass: times, throughput and memory."""
    cell = {
        "impl": name,
        "shape": f"{N}x{H}",
        "B": B,
        "T": T,
        "N": N,
        "H": H,
        "pass": "fwd+bwd" if backward else "fwd",
        "dtype": dtype,
    }
    peer = PEERS[name]
    score_gib = B * N * T * T * 4 / 2**30
    if peer.materializes and score_gib > max_score_gib:
        return cell | {"status": f"skipped: its scores need {score_gib:.1f} GiB"}
    try:
        q, k, v = inputs(B, T, N, H, dtype)
        if peer.fn is None:
            reason = _torch.available()
            if reason:
                return cell | {"status": f"skipped: {reason}"}
            run = _torch.make_run(q, k, v, backward, dtype)
            memory = None
        else:
            fn = jax_pass(peer.fn, backward)
            memory = temp_bytes(fn, q, k, v)

            def run():
                jax.block_until_ready(fn(q, k, v))

        median, best = time_runs(run)
    except Exception as e:  # an implementation that cannot run a size is reported, not fatal
        return cell | {"status": f"error: {describe(e)[:200]}"}
    gflops = causal_flops(B, T, N, H, backward) / median / 1e9
    return cell | {
        "status": "ok",
        "median_ms": median * 1e3,
        "min_ms": best * 1e3,
        "gflops": gflops,
        "pct_peak": 100 * gflops / peak,
        "temp_bytes": memory,
    }
