"""Where things are, for test files in any folder of tests/: ``TESTS`` (this folder:
the shared helpers and the scripts that tests start in a subprocess) and ``ROOT`` (the
repository)."""

from pathlib import Path

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
