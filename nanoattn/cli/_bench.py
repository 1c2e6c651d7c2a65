"""``nanoattn bench``: time and memory of nanoattn's backends against the peers."""

import argparse
import pathlib
import sys

from ..bench import (
    FULL_LENGTHS,
    GENERATION_CONTEXTS,
    LATENT_CONTEXT,
    MASKS_LENGTH,
    MASKS_QUICK_LENGTH,
    NATIVE_LENGTHS,
    PEERS,
    QUICK_LENGTHS,
    SHAPES,
    WINDOW,
    WINDOW_LENGTH,
    BenchConfig,
    ItemLines,
    default_implementations,
    run_bench,
    write,
)
from ._common import UsageError, add_command, int_list


def add_parser(commands) -> None:
    add_command(
        commands,
        "bench",
        run,
        (_add_scope, _add_part_sizes, _add_grid, _add_judging_and_output),
        help="benchmark nanoattn against flax, jax.nn, the seed and PyTorch",
        description="Measure causal attention side by side in one process: nanoattn's 'flash' "
        "and 'xla' backends, the seed module's computation, flax, jax.nn and PyTorch SDPA "
        "(when torch is installed). Forward and forward+backward over sequence lengths and "
        "two head shapes, with median and min times, GFLOP/s against the measured matmul "
        "peak, and XLA's compiled temporary memory. Then the performance targets, the "
        "generation benchmark (ms per token of nanoattn's layer with its KV cache, of "
        "recomputing the whole context, and of flax's cached decode step) and the "
        "sliding-window benchmark (causal window=(512, 0) against full causal, fwd+bwd), "
        "the native kernel against torch, and masks as functions (mask_fn against segment "
        "ids and against full causal, sinks and return_residual against the call without "
        "them, on flash and native), serving over a paged cache, the decode sweep against "
        "ONNX Runtime and ejkernel (when installed), multi-head latent attention and the "
        "recall example's serving engine, attention over selected keys, token trees, "
        "shared prefixes and the decode step on a mesh (--only lists the parts). "
        "Writes results.json, results.md and results.png (with matplotlib) to --out. "
        "Progress goes to stderr, a line per measured item: its part, the time elapsed in "
        "that part and an estimate of what is left.",
    )


def _add_scope(bench) -> None:
    """What is measured: a quick run, or only some parts."""
    bench.add_argument(
        "--quick",
        action="store_true",
        help=f"a short run: T in {','.join(map(str, QUICK_LENGTHS))}, the seed's "
        "head shape, generation at context 1024 (reported, not judged), no targets; "
        f"with --only masks, the masks part at T={MASKS_QUICK_LENGTH} (reported, not judged); "
        "with --only serving, decode, engine, selection, tree, cascade or sharded, that part "
        "at small "
        "sizes "
        "(reported, not judged)",
    )
    bench.add_argument(
        "--only",
        type=_parts,
        default=None,
        metavar="PARTS",
        help="measure only these parts, comma-separated, from: "
        + ", ".join(PARTS)
        + " (grid: the implementations table; targets: the flash kernel's targets; "
        "generation: time per token with the KV cache against recomputing and flax, "
        "judged at context 4096; window: window="
        + f"{WINDOW} against full causal at T={WINDOW_LENGTH}, judged; native: the native "
        "kernel against torch SDPA in float32 and bfloat16 over --lengths, judged, when "
        "torch is installed; masks: a document mask through mask_fn against segment ids, "
        "a block-sparse mask_fn against full causal and sinks with return_residual against "
        "the call without them, on flash and native, judged at T="
        + f"{MASKS_LENGTH}; --quick --only masks: at T={MASKS_QUICK_LENGTH}, not judged; "
        "latent: multi-head latent attention's cache bytes at DeepSeek-V3's shape and its "
        f"absorbed decoding step against rebuilding keys and values at context "
        f"{LATENT_CONTEXT}, judged). "
        "serving: decode attention over a paged KV cache, B=16 sequences of 512-8192 keys, "
        "32 query heads on 8 key/value heads of width 128, bfloat16 and float32, on every "
        "implementation that serves a page table, against the memory read bandwidth and a "
        "full cache of 8192; the same step over int8 pages against bfloat16 ones and the "
        "cache's bytes per token per dtype; and one 512-token prefill chunk with 15 decode "
        "tokens against the chunk alone and the decodes alone, judged; --quick --only "
        "serving: small sizes, not judged). "
        "decode: one decoding step over a paged cache, llama.cpp's FLASH_ATTN_EXT grid (keys "
        "4096/8192/16384, widths 64/128, 8 key/value heads, GQA 1 and 4, B=1), the same at "
        "32768 keys and the serving batch, float32/bfloat16/int8, on every implementation "
        "that serves a page table and on ONNX Runtime's GroupQueryAttention and ejkernel's "
        "ragged paged attention when installed, each alone in a process of its own: "
        "microseconds and GB/s against the read bandwidth; split-key decode against "
        "NANOATTN_SPLIT_KEYS=0 on MQA and MLA at 32768 keys, judged. "
        "engine: the recall example's continuous batching against static batching in the "
        "same cache memory, and its prefix cache against none on requests sharing "
        "their prompts, a randomly initialised model, each alone: tokens/s and prompt "
        "tokens computed, judged (needs the repository: run from its root). "
        "selection: one decode token reading 2048 selected keys of 32768 (key_indices) "
        "against a decode over 2048 keys and the dense decode over all, judged; --quick: "
        "256 of 2048, not judged. "
        "tree: a 64-node token tree's verify call over 4096 paged keys against a causal "
        "chunk of 64 tokens, judged; --quick: 16 over 256, not judged. "
        "cascade: 32 sequences sharing a 4096-token prefix (64 tokens more each), one "
        "decode token each, with shared_prefixes against without, judged; --quick: 4 "
        "sharing 256, not judged. "
        "sharded: one decoding step of 16 sequences on one device against sharded by heads "
        "(4 devices) and by 2 groups x heads (8), host devices simulated in a process of "
        "its own, informational. "
        "Example: --only generation,window",
    )


def _add_part_sizes(bench) -> None:
    """The sizes of the generation, window and masks parts."""
    bench.add_argument(
        "--contexts",
        type=int_list,
        default=None,
        help="context lengths of the generation benchmark (default "
        + ",".join(map(str, GENERATION_CONTEXTS))
        + "; with --quick 1024)",
    )
    bench.add_argument(
        "--window-length",
        type=int,
        default=WINDOW_LENGTH,
        help=f"T of the sliding-window benchmark (default {WINDOW_LENGTH}; judged only at "
        f"{WINDOW_LENGTH})",
    )
    bench.add_argument(
        "--masks-length",
        type=int,
        default=None,
        help=f"T of the masks benchmark (default {MASKS_LENGTH}, with --quick "
        f"{MASKS_QUICK_LENGTH}; judged only at {MASKS_LENGTH})",
    )


def _add_grid(bench) -> None:
    """The grid: lengths, head shapes, batch, dtype, implementations."""
    bench.add_argument(
        "--lengths",
        type=int_list,
        default=None,
        help=f"sequence lengths (default {','.join(map(str, FULL_LENGTHS))})",
    )
    bench.add_argument(
        "--shapes", default=None, help="head shapes as NxH, comma-separated (default 4x32,12x64)"
    )
    bench.add_argument(
        "--tokens", type=int, default=8192, help="B*T, kept constant across lengths (default 8192)"
    )
    bench.add_argument(
        "--dtype",
        choices=("float32", "bfloat16"),
        default="float32",
        help="input dtype (default float32; targets are measured in float32)",
    )
    bench.add_argument(
        "--impls", default=None, help="implementations, comma-separated, from: " + ", ".join(PEERS)
    )
    bench.add_argument(
        "--max-score-gib",
        type=float,
        default=2.0,
        help="skip implementations that materialise more GiB of scores (default 2)",
    )


def _add_judging_and_output(bench) -> None:
    """Whether the judged parts run, and where the results go."""
    bench.add_argument(
        "--no-targets",
        action="store_true",
        help="skip the judged parts: the kernel's targets (T=65536 takes about a minute), "
        "the generation and the window benchmarks (as does a --dtype other than float32, "
        "unless --only names them)",
    )
    bench.add_argument(
        "--out",
        type=pathlib.Path,
        default=pathlib.Path("bench-results"),
        help="output folder (default bench-results)",
    )


PARTS = ("grid", "targets", "generation", "window", "native", "masks", "serving", "latent",
         "decode", "engine", "selection", "tree", "cascade", "sharded")  # fmt: skip


def _parts(text: str) -> tuple[str, ...]:
    parts = tuple(p.strip() for p in text.split(",") if p.strip())
    unknown = [p for p in parts if p not in PARTS]
    if unknown or not parts:
        raise argparse.ArgumentTypeError(f"expected parts from {', '.join(PARTS)}, got {text!r}")
    return parts


def _shapes(text: str) -> tuple[tuple[int, int], ...]:
    try:
        shapes = tuple(tuple(int(n) for n in s.lower().split("x")) for s in text.split(","))
    except ValueError:
        raise UsageError(f"--shapes must look like 4x32,12x64, got {text!r}") from None
    if any(len(s) != 2 or min(s) < 1 for s in shapes):
        raise UsageError(f"--shapes must look like 4x32,12x64, got {text!r}")
    return shapes


def config_from_args(args) -> BenchConfig:
    impls = tuple(args.impls.split(",")) if args.impls else default_implementations()
    unknown = [i for i in impls if i not in PEERS]
    if unknown:
        raise UsageError(f"unknown implementation {unknown[0]!r}; choose from " + ", ".join(PEERS))
    lengths = args.lengths or (QUICK_LENGTHS if args.quick else FULL_LENGTHS)
    if min(lengths, default=0) < 1:
        raise UsageError(f"--lengths must be >= 1, got {lengths}")
    if args.tokens < 1:
        raise UsageError(f"--tokens must be >= 1, got {args.tokens}")
    shapes = _shapes(args.shapes) if args.shapes else (SHAPES[:1] if args.quick else SHAPES)
    contexts = args.contexts or ((1024,) if args.quick else GENERATION_CONTEXTS)
    if min(contexts) < 1:
        raise UsageError(f"--contexts must be >= 1, got {contexts}")
    if not args.max_score_gib >= 0:
        raise UsageError(f"--max-score-gib must be >= 0, got {args.max_score_gib}")
    if args.window_length < 1:
        raise UsageError(f"--window-length must be >= 1, got {args.window_length}")
    if args.masks_length is not None and args.masks_length < 1:
        raise UsageError(f"--masks-length must be >= 1, got {args.masks_length}")
    masks_length = args.masks_length or (MASKS_QUICK_LENGTH if args.quick else MASKS_LENGTH)
    parts = args.only or (("grid", "generation") if args.quick else PARTS)
    size = "quick" if args.quick else "full"  # of the parts from serving on
    if args.no_targets or (args.only is None and args.dtype != "float32"):
        parts = tuple(p for p in parts if p == "grid")
    return BenchConfig(
        lengths=tuple(lengths),
        shapes=shapes,
        tokens=args.tokens,
        dtype=args.dtype,
        implementations=impls,
        max_score_gib=args.max_score_gib,
        targets="targets" in parts and args.dtype == "float32",
        grid="grid" in parts,
        generation=tuple(contexts) if "generation" in parts else (),
        window_length=args.window_length if "window" in parts else 0,
        native_lengths=(tuple(args.lengths or NATIVE_LENGTHS) if "native" in parts else ()),
        masks_length=masks_length if "masks" in parts else 0,
        latent_context=LATENT_CONTEXT if "latent" in parts else 0,
        serving=size if "serving" in parts else "",
        decode=size if "decode" in parts else "",
        engine=size if "engine" in parts else "",
        selection=size if "selection" in parts else "",
        tree=size if "tree" in parts else "",
        cascade=size if "cascade" in parts else "",
        sharded=size if "sharded" in parts else "",
    )


def run(args) -> int:
    config = config_from_args(args)
    results = run_bench(config, progress=ItemLines(sys.stderr))
    paths, note = write(results, args.out)
    print((args.out / "results.md").read_text(), end="")
    print("\nwrote " + ", ".join(str(p) for p in paths) + (f"; {note}" if note else ""))
    failed = [t for t in results["targets"] if t["passed"] is False]
    return 1 if failed else 0
