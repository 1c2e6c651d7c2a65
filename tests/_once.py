"""A result computed once per test run and shared by the xdist workers: the first
worker that asks computes it and leaves it, as JSON, in the run's temporary folder
(shared by the workers of one run); the others wait on a lock meanwhile and read it.
Without xdist, it is computed in the process that asks."""

import fcntl
import json
import os


def once_per_run(tmp_path_factory, name: str, produce):
    """``produce()`` (a JSON value), computed once in this run under ``name``."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):  # one process: nothing to share
        return produce()
    shared = tmp_path_factory.getbasetemp().parent
    done = shared / f"{name}.json"
    with open(shared / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not done.exists():
            done.write_text(json.dumps(produce()))
        return json.loads(done.read_text())
