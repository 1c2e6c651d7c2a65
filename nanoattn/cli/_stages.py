"""What ``nanoattn audit`` and ``nanoattn verify`` say on stderr while they work: a
stage still running after ``AFTER_S`` seconds announces itself, then says how long
it took; a quicker stage says nothing. Only on a terminal, as git reports
progress, so logs and captured output stay as they were; never with ``--json``.
"""

import contextlib
import sys
import threading
import time

AFTER_S = 2.0  # a stage running longer than this announces itself


class Stages:
    """Announces on ``stream`` each stage still running after ``after`` seconds.

    ``with stages("verifying X"):`` runs the body; if it is still running after
    ``after`` seconds (``AFTER_S`` when None), a timer thread writes
    ``"{prog}: verifying X ..."``, and when the body ends ``"{prog}: verifying X:
    done in 9.8 s"`` follows (``clock``: seconds, by default ``time.monotonic``).
    With ``after <= 0`` every stage announces itself as it starts, with no thread,
    so a test sees the lines deterministically. A stage that raises adds no "done"
    line (the error says what happened). ``stream=None``: silent.
    """

    def __init__(self, prog: str, stream, *, after: float | None = None, clock=None):
        self.prog, self.stream, self.clock = prog, stream, clock or time.monotonic
        self.after = AFTER_S if after is None else after

    def _write(self, text: str) -> None:
        self.stream.write(f"{self.prog}: {text}\n")
        self.stream.flush()

    @contextlib.contextmanager
    def __call__(self, what: str):
        if self.stream is None:
            yield
            return
        lock, state = threading.Lock(), {"announced": False, "over": False}

        def announce():
            with lock:
                if not state["over"]:
                    self._write(f"{what} ...")
                    state["announced"] = True

        start = self.clock()
        timer = None
        if self.after <= 0:
            announce()
        else:
            timer = threading.Timer(self.after, announce)
            timer.daemon = True
            timer.start()
        try:
            yield
        finally:
            if timer is not None:
                timer.cancel()
            with lock:  # an announcement being written finishes before the verdict
                state["over"] = True
                announced = state["announced"]
        if announced:
            self._write(f"{what}: done in {self.clock() - start:.1f} s")


def on_stderr(prog: str, quiet: bool) -> Stages:
    """The stages of command ``prog``: on stderr when it is a terminal, silent when it is
    not or when ``quiet`` (``--json``)."""
    return Stages(prog, None if quiet or not sys.stderr.isatty() else sys.stderr)
