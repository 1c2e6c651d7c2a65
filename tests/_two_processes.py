"""Two processes of 4 CPU devices joined into one jax job on 127.0.0.1: the launcher a
test calls (:func:`run_pair`) and the join each worker script makes (:func:`join`)."""

import os
import socket
import subprocess
import sys


def run_pair(worker, out, env=None, timeout: int = 300) -> None:
    """Runs ``python worker PORT PROCESS_ID OUT`` twice (process ids 0 and 1, a free port
    for the coordinator), waits at most ``timeout`` seconds for both and kills them
    then; raises AssertionError with their stderr's tails unless both exit 0."""
    with socket.socket() as s:  # a free port for the coordinator
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [
        subprocess.Popen(
            [sys.executable, str(worker), str(port), str(i), str(out)],
            env=dict(os.environ) if env is None else env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(2)
    ]
    try:
        logs = [p.communicate(timeout=timeout) for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert all(p.returncode == 0 for p in procs), [log[1][-2000:] for log in logs]


def join(port: str, process_id: str) -> None:
    """In a worker (its XLA_FLAGS giving it 4 host devices before jax is imported): joins
    the job of 2 processes at 127.0.0.1:``port`` with gloo CPU collectives, 8 devices."""
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=f"127.0.0.1:{port}",
        num_processes=2,
        process_id=int(process_id),
        initialization_timeout=60,
    )
    assert jax.device_count() == 8 and jax.local_device_count() == 4
