"""The ``nanoattn`` command line. It parses, calls the library, and prints.

Exit statuses: 0 every check passed, 1 a check failed, 2 bad input (one line
on stderr, no traceback).
"""

import argparse
import json
import sys
import unicodedata

from . import _audit
from .linen import AttentionConfig

SYMBOLS = {
    "emoji": {_audit.ALLOWED: "✅", _audit.FUTURE: "❌", _audit.PADDING: "🚫"},
    "ascii": {_audit.ALLOWED: "+", _audit.FUTURE: "x", _audit.PADDING: "-"},
}


class UsageError(Exception):
    """Bad command-line input: reported in one line with exit status 2."""

    def __init__(self, message: str, prog: str | None = None):
        super().__init__(message)
        self.prog = prog


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, no usage dump
        raise UsageError(message, self.prog)


def _int_list(text: str) -> list[int]:
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, got {text!r}"
        ) from None


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="nanoattn", description="Multi-head causal attention for JAX/Flax.")
    commands = parser.add_subparsers(dest="command", required=True)
    audit = commands.add_parser(
        "audit",
        help="audit shapes and masks of the attention module",
        description="Trace one forward pass of the attention module and audit every shape, "
        "then draw the causal and padding masks with the row sums of the real weights. "
        "Defaults: the NanoMoE seed (d_model 128, 4 heads, batch 2, 5 tokens).",
    )
    audit.add_argument("--d-model", type=int, default=128, help="model width D (default 128)")
    audit.add_argument("--heads", type=int, default=4, help="number of heads N (default 4)")
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
        type=_int_list,
        default=None,
        help="valid tokens per batch row for the padding example "
        "(default 5,3 for the seed: the full length, then 2 fewer)",
    )
    audit.add_argument("--json", action="store_true", help="print machine-readable JSON")
    audit.add_argument("--ascii", action="store_true", help="draw masks without emoji")
    audit.set_defaults(run=_run_audit)
    return parser


def _audit_inputs(args) -> tuple[AttentionConfig, list[int]]:
    for name in ("batch", "seq_len"):
        if getattr(args, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.kv_len is not None and args.kv_len < 1:
        raise UsageError(f"--kv-len must be >= 1, got {args.kv_len}")
    try:
        config = AttentionConfig(d_model=args.d_model, n_heads=args.heads)
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


def _run_audit(args) -> int:
    config, lengths = _audit_inputs(args)
    stages = _audit.trace_stages(config, args.batch, args.seq_len, args.kv_len)
    checks = _audit.check_stages(
        stages, _audit.axis_sizes(config, args.batch, args.seq_len, args.kv_len)
    )
    examples = _audit.mask_examples(config, lengths, args.seq_len, args.kv_len)
    blocked = _audit.blocked_row_example(config, args.seq_len)
    passed = all(c.ok for c in checks) and all(e.passed for e in examples) and blocked["passed"]
    module = "CausalSelfAttention" if args.kv_len is None else "CrossAttention"
    if args.json:
        print(
            json.dumps(
                _audit_json(module, config, args, checks, examples, blocked, passed), indent=2
            )
        )
    else:
        symbols = SYMBOLS["ascii" if args.ascii else "emoji"]
        print(_audit_text(module, config, args, checks, examples, blocked, symbols))
    return 0 if passed else 1


def _audit_json(module, config, args, checks, examples, blocked, passed) -> dict:
    return {
        "module": module,
        "config": {
            "d_model": config.d_model,
            "n_heads": config.n_heads,
            "head_dim": config.head_dim,
            "batch": args.batch,
            "seq_len": args.seq_len,
            "kv_len": args.kv_len,
        },
        "shapes": [
            {
                "stage": c.stage.name,
                "shape": list(c.stage.shape),
                "axes": list(c.stage.axes),
                "elements": c.stage.elements,
                "op": c.stage.op,
                "source": c.stage.source,
                "ok": c.ok,
                "problems": list(c.problems),
            }
            for c in checks
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
        "passed": passed,
    }


def _audit_text(module, config, args, checks, examples, blocked, symbols) -> str:
    kv = "" if args.kv_len is None else f", {args.kv_len} context tokens"
    lines = [
        f"nanoattn audit: {module}, d_model {config.d_model}, {config.n_heads} heads of "
        f"width {config.head_dim}, batch {args.batch}, {args.seq_len} tokens{kv}",
        "",
        "Shapes of one forward pass (traced from the module under jax.eval_shape)",
    ]
    rows = [("stage", "shape", "axes", "elements", "op", "check")]
    for c in checks:
        s = c.stage
        rows.append(
            (
                s.name,
                str(s.shape),
                " ".join(s.axes),
                f"{s.elements:,}",
                s.op,
                "ok" if c.ok else "FAIL: " + "; ".join(c.problems),
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(5)]
    for r in rows:
        lines.append("  " + "  ".join(r[i].ljust(widths[i]) for i in range(5)) + "  " + r[5])
    kept = all(c.ok for c in checks)
    lines.append(
        f"Every reshape and split keeps its element count and axis sizes: {'yes' if kept else 'NO'}"
    )

    lines += [
        "",
        f"Masks (rows = query tokens, columns = key positions; "
        f"{symbols[_audit.ALLOWED]} permitted, {symbols[_audit.FUTURE]} future, "
        f"{symbols[_audit.PADDING]} padding)",
    ]
    for e in _examples_to_draw(examples):
        row = "" if e.title == "causal mask" else f", batch row {e.batch_index + 1}"
        lines += ["", f"{e.title[0].upper()}{e.title[1:]}{row}"]
        lines += _draw(e.cells, symbols)
        sums = "  ".join(f"{x:.3f}" for x in e.row_sums)
        lines.append(f"Row sums:  {sums}   {'ok' if e.passed else 'FAIL'}")
        both = [
            str(i + 1) for i, r in enumerate(e.cells) if _audit.FUTURE in r and _audit.PADDING in r
        ]
        if both:
            lines.append(
                f"Both kinds of blocked cell in the row of token {', '.join(both)}; "
                "its permitted weights still sum to 1"
            )
    lines += [
        "",
        f"A query that sees no key (kv_lengths = 0): row sum {blocked['row_sum']:g}, "
        f"largest output {blocked['output_max_abs']:g}   {'ok' if blocked['passed'] else 'FAIL'}",
        "",
        "PASS"
        if all(c.ok for c in checks) and all(e.passed for e in examples) and blocked["passed"]
        else "FAIL",
    ]
    return "\n".join(lines)


def _examples_to_draw(examples):
    """One drawing per mask that is the same in every batch row, else the padded rows."""
    drawn = []
    for title in dict.fromkeys(e.title for e in examples):
        group = [e for e in examples if e.title == title]
        distinct = [e for e in group if e.cells != group[0].cells or e is group[0]]
        padded = [e for e in group if any(_audit.PADDING in row for row in e.cells)]
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


def main(argv=None) -> int:
    """Runs the command line; returns the exit status."""
    args = None
    try:
        args = build_parser().parse_args(argv)
        return args.run(args)
    except UsageError as e:
        prog = e.prog or f"nanoattn {args.command}"
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2


def _entry() -> None:
    sys.exit(main())
