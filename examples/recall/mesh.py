"""The engine on a mesh (:class:`MeshEngine`; ``python -m examples.recall serve --mesh
TxD``): continuous batching over a ``jax.sharding.Mesh`` of T x D devices, tensor
parallel by heads over T ("model") and data parallel by groups over D ("data").
docs/parallel.md, "Serving on a mesh", says how each array of a step is laid out.

* Every attention layer splits its heads over "model" (``AttentionConfig(head_axis=
  "model")``): each device holds N/T query heads and K/T key/value heads of every
  page of its group's pool, and its attention reads only those (the pool placed by
  ``nanoattn.parallel.cache_shardings``; XLA partitions the paged call over "model",
  the native kernel's by its partitioning rule); the output projection's rows are
  split by heads too (``nanoattn.parallel.logical_rules``), the rest is replicated.
* The D groups each have a pool of ``config.pages`` pages, a ``PageAllocator`` and the
  requests admitted to it; one step serves every group at once, the model's step under
  ``jax.shard_map`` over "data", each device given its group's tokens, pool and batch
  (``nanoattn.parallel.concat_batches``). A request goes to the group with the fewest
  in flight that has a row and the pages it will need, in arrival order.

Everything on the host is deterministic: every process of a multi-process job runs the
same loop over the same requests (its allocators make the same page tables, and every
process passes the same arrays), which is how the host side stays consistent without
any message between processes. Each request's tokens equal the one-device engine's.
Axis letters: D groups, B rows of a group's step, Tq tokens of a group's step.
"""

import collections
import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from nanoattn.parallel import cache_shardings, concat_batches, logical_rules

from . import data
from .engine import (
    Engine,
    EngineConfig,
    Served,
    recording_backends,
    step_inputs,
    step_sizes,
    workload,
)
from .model import Decoder, ModelConfig


@dataclasses.dataclass(frozen=True)
class HeadParallel(ModelConfig):
    """A ``ModelConfig`` whose attention layers split their heads over ``head_axis``."""

    head_axis: str | None = None

    def attention(self, layer: int, page_size=None, kv_cache_dtype=None, page_selection=None):
        config = super().attention(layer, page_size, kv_cache_dtype, page_selection)
        return dataclasses.replace(config, head_axis=self.head_axis)


def make_mesh(tensor: int, groups: int, devices=None) -> jax.sharding.Mesh:
    """A ("data", "model") mesh of ``groups`` x ``tensor`` devices (the first ones).

    Raises:
      ValueError: fewer devices than that.
    """
    devices = jax.devices() if devices is None else devices
    if tensor * groups > len(devices):
        raise ValueError(
            f"it needs {tensor * groups} devices, jax has {len(devices)} "
            f"(on a CPU: XLA_FLAGS=--xla_force_host_platform_device_count={tensor * groups})"
        )
    chosen = np.asarray(devices[: tensor * groups]).reshape(groups, tensor)
    return jax.sharding.Mesh(chosen, ("data", "model"))


class MeshEngine(Engine):
    """:class:`~examples.recall.engine.Engine` on ``mesh`` (axes "data" and "model"):
    ``mesh.shape["data"]`` groups, each with its own pool of ``config.pages`` pages, and
    the heads split over "model" (see the module). ``self.run(requests)`` serves them."""

    def __init__(self, model: Decoder, config: EngineConfig, max_len: int, mesh):
        if config.prefix_cache:
            raise ValueError("the engine on a mesh serves without a prefix cache for now")
        self.config, self.mesh = config, mesh
        self.groups = mesh.shape["data"]
        self.max_pages = config.pages_for(max_len)
        self.sizes = step_sizes(config)
        heads = HeadParallel(**dataclasses.asdict(model.config), head_axis="model")
        paged = model.rebuilt(heads, page_size=config.page_size)
        paged.init_cache(1, self.groups * config.cache_tokens)  # the groups' pools end to end
        graphdef, params, cache = nnx.split(paged, nnx.Param, ...)
        # from the host's copies: every process puts its own devices' parts (and the
        # cache gets buffers of its own, as the step donates it)
        params, cache = jax.tree.map(_on_host, (params, cache))
        self.params = jax.device_put(params, _parameter_shardings(params, mesh))
        self.cache = jax.device_put(cache, cache_shardings(cache, mesh, head_axis="model",
                                                          data_axis="data"))  # fmt: skip
        rows = NamedSharding(mesh, P("data"))
        self._none = jax.device_put(np.zeros(self.groups * config.max_sequences, np.int32), rows)
        self.step = _sharded_step(graphdef, self.cache, mesh)

    def warm_up(self) -> tuple[str, ...]:
        """Compiles the step at each of its sizes (no tokens: nothing is written).
        Returns the backends nanoattn took for its attention calls."""
        allocs = [self._allocator() for _ in range(self.groups)]
        with recording_backends() as chosen:
            for size in self.sizes:
                out = self._dispatch(allocs, [[]] * self.groups, [[]] * self.groups, size,
                                     self._none)  # fmt: skip
        out.block_until_ready()
        return tuple(dict.fromkeys(chosen))

    def run(self, requests, progress=None) -> Served:
        """Serves ``requests`` in order of arrival over the groups."""
        c = self.config
        for r in requests:
            if c.pages_for(r.need) > min(c.pages, self.max_pages):
                raise ValueError(
                    f"request {r.id} needs {r.need} tokens of cache: more than a group's pool "
                    f"({c.pages} pages) or the engine's max_len ({self.max_pages} pages) hold"
                )
        allocs = [self._allocator() for _ in range(self.groups)]
        waiting, running = collections.deque(requests), [{} for _ in range(self.groups)]
        made, previous, served = [], self._none, Served({}, 0.0, 0)
        start = time.perf_counter()
        while waiting or any(running):
            self._admit_groups(allocs, waiting, running)
            composed = [self._compose(group) for group in running]
            for alloc, (rows, fed) in zip(allocs, composed):
                for live, tokens in zip(rows, fed):
                    brought = 1 if tokens is None else len(tokens)
                    alloc.extend(live.request.id, brought)
                    live.held += brought
            brought = max(sum(1 if t is None else len(t) for t in fed) for _, fed in composed)
            size = next(s for s in self.sizes if s >= brought)
            rows, fed = zip(*composed)
            previous = self._dispatch(allocs, rows, fed, size, previous)
            served.steps += 1
            takers = []
            for g, (alloc, group_rows) in enumerate(zip(allocs, rows)):
                retired = self._retire(alloc, list(group_rows), running[g])
                takers += [(r, g * c.max_sequences + b) for r, b in retired]
            made.append((previous, takers))
            if progress:
                progress(len(takers))
        served.outputs = self._outputs(requests, made)
        served.seconds = time.perf_counter() - start
        return served

    def _admit_groups(self, allocs, waiting, running) -> None:
        """Admission in arrival order: each request to the group with the fewest in
        flight that has a row and every page it will need (:meth:`Engine._place`)."""
        while waiting:
            order = sorted(range(self.groups), key=lambda g: (len(running[g]), g))
            for g in order:
                if len(running[g]) < self.config.max_sequences:
                    live = self._place(allocs[g], waiting[0], running[g])
                    if live is not None:
                        running[g][waiting.popleft().id] = live
                        break
            else:
                return

    def _dispatch(self, allocs, rows, fed, size, previous):
        """The step over every group's rows (each group's tokens padded to ``size``):
        its (D B,) greedy tokens, on the devices, not waited for."""
        batches, columns = [], []
        for alloc, group_rows, group_fed in zip(allocs, rows, fed):
            brought = [1 if t is None else len(t) for t in group_fed]
            pairs = [(live.request.id, n) for live, n in zip(group_rows, brought)]
            batches.append(alloc.batch(pairs, tokens=size))
            columns.append(step_inputs(group_rows, group_fed, size, self.config.max_sequences))
        tokens, source, last = (np.concatenate(parts) for parts in zip(*columns))
        with jax.set_mesh(self.mesh):
            self.cache, next_tokens = self.step(self.params, self.cache, previous, tokens,
                                                source, concat_batches(batches), last)  # fmt: skip
        for alloc, batch in zip(allocs, batches):
            alloc.confirm(batch)
        return next_tokens

    @staticmethod
    def _outputs(requests, made) -> dict:
        """Every request's tokens from each step's (D B,) tokens, gathered from every
        process's devices."""
        from jax.experimental import multihost_utils

        outputs = {r.id: [] for r in requests}
        values = [multihost_utils.process_allgather(t, tiled=True) for t, _ in made]
        for row_tokens, (_, takers) in zip(values, made):
            for request_id, b in takers:
                outputs[request_id].append(int(row_tokens[b]))
        return outputs


def _on_host(x):
    """``x`` as a numpy array (a random key, as a dropout layer's, as it is)."""
    return x if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key) else np.asarray(x)


def _parameter_shardings(params, mesh):
    """The parameters placed by their logical axes (``logical_rules("model")``: the
    output projection's rows split by heads), the others replicated."""
    from flax import linen as nn

    def is_spec(s):
        return isinstance(s, P)

    specs = nnx.get_partition_spec(params)
    return jax.tree.map(
        lambda s: NamedSharding(mesh, nn.logical_to_mesh_axes(tuple(s), logical_rules("model"))),
        specs, is_leaf=is_spec,
    )  # fmt: skip


def _sharded_step(graphdef, cache, mesh):
    """The engine's step of every group at once: the one-group step under shard_map
    over "data" (each device its group's pool, previous tokens, tokens, sources, batch
    and rows' last tokens; the parameters whole on "data"), jitted, the cache donated
    and given back as it came (``cache``'s shardings: one program per step size)."""

    def step(params, cache, previous, tokens, source, pages, last):
        x = jnp.where(source >= 0, previous[jnp.maximum(source, 0)], tokens)  # (Tq,)
        model = nnx.merge(graphdef, params, cache)
        logits = model(x[None], decode=True, pages=pages)  # (1, Tq, V)
        _, _, cache = nnx.split(model, nnx.Param, ...)
        return cache, jnp.argmax(logits[0, last], -1).astype(jnp.int32)

    group = P("data")
    cache_specs = jax.tree.map(lambda a: group if a.ndim >= 3 else P(), cache)
    sharded = jax.shard_map(
        step, mesh=mesh, in_specs=(P(), cache_specs, group, group, group, group, group),
        out_specs=(cache_specs, group), axis_names={"data"},
    )  # fmt: skip
    layout = (jax.tree.map(lambda a: a.sharding, cache), NamedSharding(mesh, group))
    return jax.jit(sharded, donate_argnums=1, out_shardings=layout)


def compare_with_one_device(seed: int = 0, tensor: int = 2, groups: int = 4) -> dict:
    """A random decoder (N = 4, K = 2) served by the one-device engine and by the engine
    on a ``tensor`` x ``groups`` mesh, on the same small workload: whether every
    request's tokens are equal (tests/parallel/test_paged_mesh.py)."""
    task = data.TaskConfig()
    model = Decoder(ModelConfig(vocab=task.vocab, implementation=None), rngs=nnx.Rngs(seed))
    model.eval()
    requests = workload(seed, task, 12, prompt_lengths=(3, 30), new_tokens=(1, 9))
    config = EngineConfig(pages=12, page_size=5, max_sequences=3, step_tokens=16)
    longest = max(r.need for r in requests)
    one = Engine(model, config, longest).run(requests)
    server = MeshEngine(model, config, longest, make_mesh(tensor, groups))
    on_mesh = server.run(requests)
    differ = [r.id for r in requests if one.outputs[r.id] != on_mesh.outputs[r.id]]
    return {
        "requests": len(requests), "tokens": one.tokens, "differ": differ,
        "steps": [one.steps, on_mesh.steps], "compiled": server.compiled(),
    }  # fmt: skip
