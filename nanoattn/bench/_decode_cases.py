"""The cases of the decode sweep (:mod:`nanoattn.bench._decode`) and their inputs.

A case is one decoding step: one query token of each of B sequences over their keys
(``lengths``), N query heads on K key/value heads of width H, values of width Hv
(H unless named). Its inputs, in a dtype, are built the same way in every process that
measures it (a fixed seed), so that every implementation and peer reads the same
numbers: each sequence's keys and values in pages of ``page_size`` tokens laid in a
shuffled order in one pool (a page table), random normal in float32 or bfloat16; int8:
the bfloat16 pages quantized by ``nanoattn.quantize_kv`` (their float32 scales beside
them), the queries bfloat16. Multi-head latent attention's absorbed decode (``mla``):
one key/value head of width H = 576 (a latent of 512 and a RoPE key of 64), values the
keys' first 512 columns, held as pages of their own (sliced once, outside the timed
call: the kernels take values as an array of their own).

The bytes a step reads are its keys and values, each read once: the tokens the
sequences hold (not the padding of their last pages) times K (H + Hv) times the
storage's item size, and for int8 their float32 scales.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from .._core.quantize import quantize_kv

DTYPES = ("float32", "bfloat16", "int8")
QUANTIZED = "int8"  # stored as int8 with float32 scales, over bfloat16 queries


@dataclasses.dataclass(frozen=True)
class Case:
    """One decoding step: ``kind`` ("grid", "long", "batch", "mqa" or "mla"), the keys
    of each sequence (B = len(lengths)), N, K, H and Hv (None: H)."""

    kind: str
    lengths: tuple[int, ...]
    n_heads: int
    kv_heads: int
    head_dim: int
    value_dim: int | None = None

    @property
    def batch(self) -> int:
        return len(self.lengths)

    @property
    def hv(self) -> int:
        return self.head_dim if self.value_dim is None else self.value_dim

    @property
    def label(self) -> str:
        """e.g. ``"S=4096 H=128 N=32 K=8"`` or ``"B=16 S=512-8192 H=128 N=32 K=8"``."""
        keys = (f"S={self.lengths[0]}" if self.batch == 1 else
                f"B={self.batch} S={min(self.lengths)}-{max(self.lengths)}")  # fmt: skip
        width = f"H={self.head_dim}" + ("" if self.value_dim is None else f" Hv={self.value_dim}")
        kind = {"mqa": "MQA ", "mla": "MLA absorbed "}.get(self.kind, "")
        return f"{kind}{keys} {width} N={self.n_heads} K={self.kv_heads}"

    def read_bytes(self, dtype: str) -> int:
        """The keys and values the step reads once (and int8's float32 scales)."""
        tokens = sum(self.lengths) * self.kv_heads
        if dtype == QUANTIZED:
            return tokens * (self.head_dim + self.hv) + tokens * 2 * 4
        return tokens * (self.head_dim + self.hv) * jnp.dtype(dtype).itemsize


@dataclasses.dataclass(frozen=True)
class Sweep:
    """The sizes of the decode part: llama.cpp's ``test-backend-ops perf -o
    FLASH_ATTN_EXT`` grid (one query token, B = 1, keys ``lengths``, head widths
    ``widths``, ``kv_heads`` key/value heads, G = N / K in ``groups``), the same heads
    at ``long`` keys, the serving part's batch (B sequences of ``batch`` = (B,
    shortest, longest) keys, N, K, H = ``batch_heads``), MQA (N, H = ``mqa``, K = 1)
    and MLA (N, H, Hv = ``mla``, K = 1) at ``long`` keys; pages of ``page_size``, each
    step timed at least ``rounds`` times, the read bandwidth over ``read_mib`` MiB."""

    lengths: tuple[int, ...] = (4096, 8192, 16384)
    widths: tuple[int, ...] = (64, 128)
    kv_heads: int = 8
    groups: tuple[int, ...] = (1, 4)
    long: int = 32768
    batch: tuple[int, int, int] = (16, 512, 8192)
    batch_heads: tuple[int, int, int] = (32, 8, 128)
    mqa: tuple[int, int] = (8, 128)
    mla: tuple[int, int, int] = (16, 576, 512)
    page_size: int = 16
    dtypes: tuple[str, ...] = DTYPES
    rounds: int = 5
    read_mib: int = 1024

    def cases(self) -> list[Case]:
        """The grid, the long cases and the batch: what every implementation runs."""
        heads = [(H, G) for H in self.widths for G in self.groups]
        K = self.kv_heads
        out = [Case("grid", (S,), K * G, K, H) for S in self.lengths for H, G in heads]
        out += [Case("long", (self.long,), K * G, K, H) for H, G in heads]
        B, shortest, longest = self.batch
        lengths = np.linspace(shortest, longest, B).round().astype(int)
        return [*out, Case("batch", tuple(int(n) for n in lengths), *self.batch_heads)]

    def huge_cases(self) -> list[Case]:
        """The widest long case (G the largest) and the batch: the pool on 2 MiB pages of
        memory against 4 KiB ones."""
        H, G, K = self.widths[-1], self.groups[-1], self.kv_heads
        return [Case("long", (self.long,), K * G, K, H), self.cases()[-1]]

    def split_cases(self) -> list[Case]:
        """MQA and MLA at ``long`` keys: split-key decode against the unsplit kernel."""
        N, H = self.mqa
        M, W, V = self.mla
        return [Case("mqa", (self.long,), N, 1, H), Case("mla", (self.long,), M, 1, W, V)]


FULL = Sweep()
QUICK = Sweep(lengths=(256, 512), widths=(32,), kv_heads=2, long=2048, batch=(4, 64, 512),
              batch_heads=(8, 2, 32), mqa=(4, 32), mla=(4, 80, 64), rounds=3,
              read_mib=64)  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Inputs:
    """One case in one dtype: queries (B, N, H); key pages (P, page_size, K, H) and
    value pages (P, page_size, K, Hv) (int8: with scales (P, page_size, K) each, else
    None); the page table (B, M) and lengths (B,), int32 numpy."""

    query: jax.Array
    key_pages: jax.Array
    value_pages: jax.Array
    key_scales: jax.Array | None
    value_scales: jax.Array | None
    page_table: np.ndarray
    lengths: np.ndarray

    def dense(self, b: int) -> tuple[np.ndarray, np.ndarray]:
        """Sequence ``b``'s keys (L, K, H) and values (L, K, Hv), float32 (int8: scaled
        back), in order: what a dense cache holds."""
        n = int(self.lengths[b])
        pages = self.page_table[b, : -(-n // self.key_pages.shape[1])]
        out = []
        for values, scales in ((self.key_pages, self.key_scales),
                               (self.value_pages, self.value_scales)):  # fmt: skip
            x = np.asarray(values[pages], np.float32)  # (held, page_size, K, H)
            if scales is not None:
                x = x * np.asarray(scales[pages], np.float32)[..., None]
            out.append(x.reshape(-1, *x.shape[2:])[:n])
        return out[0], out[1]


def page_table(lengths: np.ndarray, page_size: int) -> tuple[np.ndarray, int]:
    """The page table (B, M) of sequences of ``lengths`` keys in pages of ``page_size``,
    each sequence's pages drawn in turn from one shuffled pool (a fixed seed), M the
    most pages one holds; and P, the pages held (the pool's size)."""
    held = -(-lengths // page_size)  # (B,) pages each sequence holds
    order = np.random.default_rng(0).permutation(int(held.sum())).astype(np.int32)
    table = np.zeros((len(lengths), int(held.max())), np.int32)
    starts = np.concatenate([[0], np.cumsum(held)])
    for b in range(len(lengths)):
        table[b, : held[b]] = order[starts[b] : starts[b + 1]]
    return table, int(held.sum())


@functools.lru_cache(maxsize=1)  # one case's arrays at a time: hundreds of MiB at full size
def inputs(case: Case, dtype: str, page_size: int) -> Inputs:
    """The inputs of ``case`` in ``dtype`` (see the module), from a fixed seed."""
    lengths = np.asarray(case.lengths, np.int32)
    table, pages = page_table(lengths, page_size)
    keys = jax.random.split(jax.random.key(0), 3)
    stored = jnp.bfloat16 if dtype == QUANTIZED else jnp.dtype(dtype)
    shape = (pages, page_size, case.kv_heads)
    key_pages = jax.random.normal(keys[0], (*shape, case.head_dim), stored)
    if case.value_dim is None:
        value_pages = jax.random.normal(keys[1], (*shape, case.head_dim), stored)
    else:  # the keys' first Hv columns (multi-head latent attention's absorbed values)
        value_pages = jnp.copy(key_pages[..., : case.value_dim])
    query = jax.random.normal(keys[2], (case.batch, case.n_heads, case.head_dim), stored)
    scales = (None, None)
    if dtype == QUANTIZED:
        (key_pages, key_scale), (value_pages, value_scale) = (
            quantize_kv(p, QUANTIZED) for p in (key_pages, value_pages)
        )
        scales = (key_scale, value_scale)
    return Inputs(query, key_pages, value_pages, *scales, table, lengths)
