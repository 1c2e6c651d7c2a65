"""Pieces shared by the subcommands: one-line usage errors, a subcommand's parser and
list parsing."""

import argparse
import re


class UsageError(Exception):
    """Bad command-line input: reported in one line with exit status 2."""

    def __init__(self, message: str, prog: str | None = None):
        super().__init__(message)
        self.prog = prog


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line, raised as UsageError."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # argparse takes a word that starts with a dash for an option unless it is a plain
        # negative number ("-1", "-.5"), so `--lengths -1,5` and `--atol -1e-3` said
        # "expected one argument" instead of what is wrong with the value. No option here
        # starts with a dash and a digit, so such a word is always a value.
        self._negative_number_matcher = re.compile(r"^-\.?\d")

    def error(self, message):
        raise UsageError(message, self.prog)


def add_command(commands, name: str, run, groups=(), **texts) -> argparse.ArgumentParser:
    """The subcommand ``name`` of ``commands`` (``help`` and ``description`` in
    ``texts``), each of ``groups`` adding its options to it, run by ``run(args)``."""
    parser = commands.add_parser(name, **texts)
    for add in groups:
        add(parser)
    parser.set_defaults(run=run)
    return parser


def int_list(text: str) -> list[int]:
    """Parses ``"1,2,8"``."""
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, got {text!r}"
        ) from None
