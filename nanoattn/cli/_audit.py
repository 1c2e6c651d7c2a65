"""``nanoattn audit``: the shape audit, the worked mask examples and the
verification of the built-in modules, for one configuration."""

import json
import unicodedata

from ..linen import AttentionConfig, LatentConfig
from ..verify import check_shapes
from ..verify.command_line import (
    ALLOWED,
    FUTURE,
    PADDING,
    blocked_row_example,
    latent_shapes,
    mask_examples,
    verify_modules,
)
from . import _stages
from ._common import UsageError, add_command, int_list

# --latent's widths: flag, default, meaning (--d-model and --heads give D and N).
_LATENT_FLAGS = (
    ("--kv-lora-rank", 64, "the latent width r (default 64)"),
    ("--qk-nope-dim", 32, "the per-head key width without RoPE Hn (default 32)"),
    ("--qk-rope-dim", 16, "the shared RoPE key width Hr (default 16)"),
    ("--v-dim", 32, "the value width Hv (default 32)"),
    ("--q-lora-rank", None, "the query's low rank rq (default: none, one projection)"),
)
SYMBOLS = {
    "emoji": {ALLOWED: "✅", FUTURE: "❌", PADDING: "🚫"},
    "ascii": {ALLOWED: "+", FUTURE: "x", PADDING: "-"},
}


def add_parser(commands) -> None:
    add_command(
        commands,
        "audit",
        run,
        (_add_sizes, _add_latent, _add_output),
        help="audit shapes and masks of the attention module",
        description="Trace one forward pass of the attention module and audit every shape, "
        "draw the causal and padding masks with the row sums of the real weights, and verify "
        "the built-in modules. Defaults: the NanoMoE seed (d_model 128, 4 heads, batch 2, "
        "5 tokens). On a terminal, a stage still running after about 2 s says on stderr what "
        "it is doing (nothing with --json). Exit status 0 when every check passes, 1 when one "
        "fails, 2 for bad input.",
    )


def _add_sizes(audit) -> None:
    """The layer audited and its inputs."""
    audit.add_argument("--d-model", type=int, default=128, help="model width D (default 128)")
    audit.add_argument("--heads", type=int, default=4, help="number of heads N (default 4)")
    audit.add_argument(
        "--kv-heads",
        type=int,
        default=None,
        help="number of key/value heads K, dividing --heads: grouped-query attention "
        "(default: as many as --heads)",
    )
    audit.add_argument("--batch", type=int, default=2, help="batch size B (default 2)")
    audit.add_argument("--seq-len", type=int, default=5, help="query length T (default 5)")
    audit.add_argument(
        "--kv-len",
        type=int,
        default=None,
        help="audit CrossAttention with S context tokens instead",
    )
    audit.add_argument(
        "--lengths",
        type=int_list,
        default=None,
        help="valid tokens per batch row for the padding example "
        "(default 5,3 for the seed: the full length, then 2 fewer)",
    )


def _add_latent(audit) -> None:
    """A multi-head latent attention layer's shapes instead."""
    audit.add_argument(
        "--latent",
        action="store_true",
        help="print the shapes of a multi-head latent attention layer (DeepSeek's MLA, "
        "docs/latent.md) of --d-model and --heads with the widths below, and exit",
    )
    for flag, default, what in _LATENT_FLAGS:
        audit.add_argument(flag, type=int, default=default, help=f"with --latent: {what}")


def _add_output(audit) -> None:
    """What is printed, and what is left out."""
    audit.add_argument("--json", action="store_true", help="print machine-readable JSON")
    audit.add_argument("--ascii", action="store_true", help="draw masks without emoji")
    audit.add_argument(
        "--no-verify",
        action="store_true",
        help="skip the verification of the built-in modules: about 15 s of the default "
        "audit's 23 s on a 2-core Intel Xeon CPU",
    )


def _inputs(args) -> tuple[AttentionConfig, list[int]]:
    for name in ("batch", "seq_len"):
        if getattr(args, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.kv_len is not None and args.kv_len < 1:
        raise UsageError(f"--kv-len must be >= 1, got {args.kv_len}")
    try:
        config = AttentionConfig(d_model=args.d_model, n_heads=args.heads, n_kv_heads=args.kv_heads)
    except ValueError as e:
        raise UsageError(str(e)) from None
    key_len = args.seq_len if args.kv_len is None else args.kv_len
    lengths = args.lengths
    if lengths is None:
        lengths = [key_len] + [max(1, key_len - 2)] * (args.batch - 1)
    if len(lengths) != args.batch:
        raise UsageError(f"--lengths gives {len(lengths)} lengths for --batch {args.batch}")
    for n in lengths:
        if not 0 <= n <= key_len:
            raise UsageError(f"--lengths: each length must be in [0, {key_len}], got {n}")
    return config, lengths


def run(args) -> int:
    if args.latent:
        return _latent(args)
    config, lengths = _inputs(args)
    stage = _stages.on_stderr("nanoattn audit", quiet=args.json)
    with stage("tracing the shapes of one forward pass"):
        shapes = check_shapes(config, batch=args.batch, seq_len=args.seq_len, kv_len=args.kv_len)
    with stage("computing the weights of the mask examples"):
        examples = mask_examples(config, lengths, args.seq_len, args.kv_len)
    with stage("checking a query that sees no key"):
        blocked = blocked_row_example(config, args.seq_len)
    verified = [] if args.no_verify else verify_modules(config, stage=stage)
    passed = (
        shapes.passed
        and all(e.passed for e in examples)
        and blocked["passed"]
        and all(r.passed for _, r in verified)
    )
    module = "CausalSelfAttention" if args.kv_len is None else "CrossAttention"
    if args.json:
        report = _json(module, config, args, shapes, examples, blocked, verified, passed)
        print(json.dumps(report, indent=2))
    else:
        symbols = SYMBOLS["ascii" if args.ascii else "emoji"]
        print(_text(module, config, args, shapes, examples, blocked, verified, passed, symbols))
    return 0 if passed else 1


def _latent(args) -> int:
    try:
        config = LatentConfig(
            d_model=args.d_model, n_heads=args.heads, kv_lora_rank=args.kv_lora_rank,
            qk_nope_head_dim=args.qk_nope_dim, qk_rope_head_dim=args.qk_rope_dim,
            v_head_dim=args.v_dim, q_lora_rank=args.q_lora_rank,
        )  # fmt: skip
    except ValueError as e:
        raise UsageError(str(e)) from None
    rows = latent_shapes(config, args.batch, args.seq_len)
    if args.json:
        print(json.dumps([dict(name=n, shape=s, what=w) for n, s, w in rows], indent=2))
    else:
        print("\n".join(["LatentAttention shapes", *_table(rows)]))
    return 0


def _json(module, config, args, shapes, examples, blocked, verified, passed) -> dict:
    return {
        "module": module,
        "config": {
            "d_model": config.d_model,
            "n_heads": config.n_heads,
            "n_kv_heads": config.kv_heads,
            "head_dim": config.head_dim,
            "batch": args.batch,
            "seq_len": args.seq_len,
            "kv_len": args.kv_len,
        },
        "shapes": [
            {
                "stage": c.name,
                **c.data,
                "ok": c.passed,
                "problems": [] if c.passed else c.detail.split("; "),
            }
            for c in shapes.checks
        ],
        "masks": [
            {
                "title": e.title,
                "batch_index": e.batch_index,
                "cells": [list(row) for row in e.cells],
                "row_sums": list(e.row_sums),
                "passed": e.passed,
            }
            for e in examples
        ],
        "blocked_row": blocked,
        "verification": [{"subject": name, **report.to_dict()} for name, report in verified],
        "passed": passed,
    }


def _text(module, config, args, shapes, examples, blocked, verified, passed, symbols) -> str:
    kv = "" if args.kv_len is None else f", {args.kv_len} context tokens"
    # Only named when given, so the default audit reads exactly as before.
    kv_heads = ""
    if args.kv_heads is not None:
        kv_heads = f", {config.kv_heads} key/value head{'' if config.kv_heads == 1 else 's'}"
    lines = [
        f"nanoattn audit: {module}, d_model {config.d_model}, {config.n_heads} heads of "
        f"width {config.head_dim}{kv_heads}, batch {args.batch}, {args.seq_len} tokens{kv}",
        "",
        "Shapes of one forward pass (traced from the module under jax.eval_shape)",
    ]
    lines += _table(
        [("stage", "shape", "axes", "elements", "op", "check")]
        + [
            (
                c.name,
                str(tuple(c.data["shape"])),
                " ".join(c.data["axes"]),
                f"{c.data['elements']:,}",
                c.data["op"],
                "ok" if c.passed else "FAIL: " + c.detail,
            )
            for c in shapes.checks
        ]
    )
    lines.append(
        f"Every reshape and split keeps its element count and axis sizes: "
        f"{'yes' if shapes.passed else 'NO'}"
    )

    lines += [
        "",
        f"Masks (rows = query tokens, columns = key positions; "
        f"{symbols[ALLOWED]} permitted, {symbols[FUTURE]} future, "
        f"{symbols[PADDING]} padding)",
    ]
    for e in _examples_to_draw(examples):
        row = "" if e.title == "causal mask" else f", batch row {e.batch_index + 1}"
        lines += ["", f"{e.title[0].upper()}{e.title[1:]}{row}"]
        lines += _draw(e.cells, symbols)
        sums = "  ".join(f"{x:.3f}" for x in e.row_sums)
        lines.append(f"Row sums:  {sums}   {'ok' if e.passed else 'FAIL'}")
        both = [str(i + 1) for i, r in enumerate(e.cells) if FUTURE in r and PADDING in r]
        if both:
            lines.append(
                f"Both kinds of blocked cell in the row of token {', '.join(both)}; "
                "its permitted weights still sum to 1"
            )
    lines += [
        "",
        f"A query that sees no key (kv_lengths = 0): row sum {blocked['row_sum']:g}, "
        f"largest output {blocked['output_max_abs']:g}   {'ok' if blocked['passed'] else 'FAIL'}",
    ]
    if verified:
        lines += [
            "",
            f"Verification of the built-in modules at d_model {config.d_model}, "
            f"{config.n_heads} heads{kv_heads} (nanoattn.verify)",
        ]
        rows = [("subject", "result", "checks")]
        for name, report in verified:
            failed = [f"{c.name}: {c.detail}" for c in report.checks if not c.passed]
            rows.append(
                (
                    name,
                    "PASS" if report.passed else "FAIL",
                    "; ".join(failed) or ", ".join(c.name for c in report.checks),
                )
            )
        lines += _table(rows)
    lines += ["", "PASS" if passed else "FAIL"]
    return "\n".join(lines)


def _table(rows) -> list[str]:
    """Left-aligned columns; the last column is not padded."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    return [
        ("  " + "  ".join(c.ljust(w) for c, w in zip(r, widths)) + "  " + r[-1]).rstrip()
        for r in rows
    ]


def _examples_to_draw(examples):
    """One drawing per mask that is the same in every batch row, else the padded rows."""
    drawn = []
    for title in dict.fromkeys(e.title for e in examples):
        group = [e for e in examples if e.title == title]
        distinct = [e for e in group if e.cells != group[0].cells or e is group[0]]
        padded = [e for e in group if any(PADDING in row for row in e.cells)]
        drawn += distinct if len(distinct) == 1 else padded or group[:1]
    return drawn


def _cell(symbol: str) -> str:
    """A 4-column cell: emoji are two columns wide, ASCII one."""
    wide = unicodedata.east_asian_width(symbol) in "WF"
    return symbol + " " * (2 if wide else 3)


def _draw(cells, symbols) -> list[str]:
    label = max(len(f"Token {len(cells)}:"), len("Position:"))
    width = len(cells[0]) if cells else 0
    lines = ["Position:".ljust(label) + "  " + "".join(f"{j + 1:<4}" for j in range(width))]
    for i, row in enumerate(cells):
        cells_text = "".join(_cell(symbols[c]) for c in row)
        lines.append(f"Token {i + 1}:".ljust(label) + "  " + cells_text)
    return [line.rstrip() for line in lines]
