"""ejkernel's ragged paged attention (``ejkernel.modules.ragged_page_attention_v2``, its
XLA path) as a peer of the decode sweep, when ejkernel is importable.

ejkernel is in no extra of nanoattn: it pins jax to its own minor version (``pip
install ejkernel`` where that keeps your jax; check with ``pip install --dry-run``
first). Its pages hold keys and values interleaved along the heads (P, page_size, 2K,
H: key head k at 2k, value head k at 2k + 1): built from the case's pages, the same
numbers, outside the timed call. Its defaults differ from nanoattn's: it computes in
bfloat16 unless told (``compute_dtype=float32`` here) and the scale is passed
(H^-1/2). Its XLA path reads the page table 64 pages at a time (a dynamic slice that
would clamp at the end of a narrower table and read the wrong pages), so the table is
padded to a multiple of 64 with page 0 (past each sequence's length: never read into
the output). Float32 only.
"""

import numpy as np

from ._optional import float32_and_one_width, installed, missing

INSTALL = "pip install ejkernel, where pip install --dry-run ejkernel keeps your jax"
TABLE_BLOCK = 64  # pages its XLA path reads per block of the page table


def available() -> str | None:
    """None when ejkernel can be used, else why not."""
    why = f"ejkernel is not installed (an optional peer, in no extra of nanoattn: {INSTALL})"
    return missing(("ejkernel.modules:ragged_page_attention_v2",), why)


def version() -> str | None:
    module = installed("ejkernel")
    return None if module is None else getattr(module, "__version__", "unknown")


def unsupported(case, dtype: str) -> str | None:
    """Why the peer does not run ``case`` in ``dtype`` here, or None."""
    return float32_and_one_width(case, dtype, "ejkernel's ragged paged attention")


def make_run(inputs):
    """``(run, output)``: ``run()`` one decoding step of ``inputs`` (an
    :class:`~._decode_cases.Inputs`, float32) through ejkernel's XLA path, jitted;
    ``output()`` the step's output (B, N, H) float32."""
    import jax
    import jax.numpy as jnp
    from ejkernel.modules import ragged_page_attention_v2

    B, _, H = inputs.query.shape
    P, page_size, K, _ = inputs.key_pages.shape
    pages = jnp.stack([inputs.key_pages, inputs.value_pages], axis=3)  # (P, ps, K, 2, H)
    pages = pages.reshape(P, page_size, 2 * K, H)  # k0 v0 k1 v1 ...
    table = inputs.page_table
    wide = -(-table.shape[1] // TABLE_BLOCK) * TABLE_BLOCK
    table = np.pad(table, [(0, 0), (0, wide - table.shape[1])])
    starts = np.arange(B + 1, dtype=np.int32)  # one query each

    @jax.jit
    def step(query, pages, lengths, table, starts):
        return ragged_page_attention_v2(query, pages, lengths, table, starts, B,
                                        softmax_scale=H**-0.5, compute_dtype=jnp.float32,
                                        platform="xla")  # fmt: skip

    operands = (inputs.query, pages, jnp.asarray(inputs.lengths), jnp.asarray(table),
                jnp.asarray(starts))  # fmt: skip

    def run():
        return jax.block_until_ready(step(*operands))

    def output():
        return np.asarray(run(), np.float32)

    return run, output
