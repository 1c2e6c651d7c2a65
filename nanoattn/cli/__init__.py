"""The ``nanoattn`` command line. It parses, calls the library, and prints.

Exit statuses: 0 every check passed, 1 a check failed, 2 bad input (one line
on stderr, no traceback).
"""

import sys

from . import _audit, _bench, _verify
from ._common import Parser, UsageError


def build_parser() -> Parser:
    parser = Parser(prog="nanoattn", description="Multi-head causal attention for JAX/Flax.")
    commands = parser.add_subparsers(dest="command", required=True)
    _audit.add_parser(commands)
    _verify.add_parser(commands)
    _bench.add_parser(commands)
    return parser


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
