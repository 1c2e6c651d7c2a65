"""One process of the two-process engine test (tests/parallel/test_paged_mesh.py starts
both).

    python tests/_paged_multiprocess.py PORT PROCESS_ID OUT.json

Each process has 4 CPU devices; ``jax.distributed.initialize`` on 127.0.0.1 joins them
into one job of 8 devices with gloo CPU collectives, and the recall example's engine on
a mesh (examples/recall/mesh.py: heads split 2 ways, 4 data-parallel groups, two in
each process) serves :func:`requests`, every process running the same host loop (its
allocators alike, no message between processes for them). Process 0 writes every
request's tokens and the engine's steps to OUT.json; the test compares the tokens with
the one-device engine's.
"""

import json
import os
import sys


def parts():
    """The decoder (the same random weights in every process: a seed), the requests
    (a pure function of a seed: short prompts, two or three new tokens each, so that
    the engine runs a few steps) and the engine's sizes."""
    from flax import nnx

    from examples.recall import data
    from examples.recall.engine import EngineConfig, workload
    from examples.recall.model import Decoder, ModelConfig

    task = data.TaskConfig()
    model = Decoder(ModelConfig(vocab=task.vocab, implementation=None), rngs=nnx.Rngs(0))
    model.eval()
    requests = workload(1, task, 6, prompt_lengths=(3, 9), new_tokens=(2, 3))
    return model, requests, EngineConfig(pages=6, page_size=5, max_sequences=2, step_tokens=8)


def main(port: str, process_id: str, out_path: str):
    import jax
    from _two_processes import join

    join(port, process_id)
    from examples.recall.mesh import MeshEngine, make_mesh

    model, requests, config = parts()
    longest = max(r.need for r in requests)
    served = MeshEngine(model, config, longest, make_mesh(2, 4)).run(requests)
    if int(process_id) == 0:
        with open(out_path, "w") as f:
            json.dump({"outputs": served.outputs, "steps": served.steps}, f)
    jax.distributed.shutdown()


if __name__ == "__main__":  # the flag set before jax is imported, here only: the test
    # imports parts() without changing its own environment
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
    ).strip()
    main(*sys.argv[1:])
