"""Pieces shared by the subcommands: one-line usage errors and list parsing."""

import argparse


class UsageError(Exception):
    """Bad command-line input: reported in one line with exit status 2."""

    def __init__(self, message: str, prog: str | None = None):
        super().__init__(message)
        self.prog = prog


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line, raised as UsageError."""

    def error(self, message):
        raise UsageError(message, self.prog)


def int_list(text: str) -> list[int]:
    """Parses ``"1,2,8"``."""
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, got {text!r}"
        ) from None
