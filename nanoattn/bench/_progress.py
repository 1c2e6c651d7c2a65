"""The progress lines of ``nanoattn bench`` on stderr: one per measured item of each
part, with the time elapsed in that part and an estimate of what is left from the
mean time per item so far (the ``progress`` of :func:`nanoattn.bench.run_bench`).
"""

import time


def clock_text(seconds: float) -> str:
    """``m:ss``, or ``h:mm:ss`` from an hour: 75.4 -> "1:15"."""
    s = round(seconds)
    h, m = divmod(s // 60, 60)
    return f"{h}:{m:02d}:{s % 60:02d}" if h else f"{m}:{s % 60:02d}"


class ItemLines:
    """``progress(part, done, total, label)`` for :func:`nanoattn.bench.run_bench`:
    a line on ``stream`` per measured item of each part.

    Called before each item with ``done`` items of ``total`` finished in that part
    (the first call, ``done == 0``, starts the part's clock), and once more with
    ``done == total`` when the part ends; ``total == 0``: the part has nothing to
    measure and ``label`` says why::

        [grid 3/40] flash fwd 4x32 T=1024  elapsed 0:12, about 3:48 left
        [grid] 40 items in 3:05
        [native] skipped: torch is not installed

    The estimate is the mean time per finished item of the part times the items
    left: neither it nor the elapsed time is shown before the first item is done.
    """

    def __init__(self, stream, clock=None):
        self.stream, self.clock = stream, clock or time.monotonic
        self.started: dict[str, float] = {}

    def __call__(self, part: str, done: int, total: int, label: str) -> None:
        now = self.clock()
        if done == 0 or part not in self.started:
            self.started[part] = now
        elapsed = now - self.started[part]
        if total == 0:  # nothing to measure: the label says why
            line = f"[{part}] {label}"
        elif done >= total:
            line = f"[{part}] {total} item{'' if total == 1 else 's'} in {clock_text(elapsed)}"
        else:
            line = f"[{part} {done + 1}/{total}] {label}"
            if done:
                left = elapsed / done * (total - done)
                line += f"  elapsed {clock_text(elapsed)}, about {clock_text(left)} left"
        self.stream.write(line + "\n")
        self.stream.flush()
