"""Paged attention and the paged layers on a 2 x 4 mesh of 8 simulated devices
(tests/_paged_mesh_cases.py in one subprocess per group of cases): data-parallel groups
(each its own pool and page table), heads split, both; each equal to the same work on
one device (float32, 1e-6; the layers' output projection sums its heads' parts in
another order: 1e-6 of the output's size) and to the float64 reference, and the compiled
programs move no key or value between devices (docs/parallel.md, "Serving on a mesh")."""

import json
import os
import subprocess
import sys

import pytest

from _once import once_per_run
from _paths import ROOT, TESTS


def _run(which: str) -> dict:
    flags = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))  # examples
    done = subprocess.run(
        [sys.executable, str(TESTS / "_paged_mesh_cases.py"), which],
        env={**os.environ, "XLA_FLAGS": flags.strip(), "PYTHONPATH": path},
        capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [json.loads(x) for x in done.stdout.splitlines() if x.startswith("{")]
    raised = [line for line in lines if "raised" in line]
    assert not raised, (raised, done.stderr[-3000:])
    return {line["case"]: line for line in lines}


@pytest.fixture(scope="module")
def fast(tmp_path_factory):
    return once_per_run(tmp_path_factory, "paged_mesh_fast", lambda: _run("fast"))


@pytest.fixture(scope="module")
def slow():
    return _run("slow")


CALLS = ["heads-flash", "heads-native", "explicit-flash", "explicit-native", "call-both-xla",
         "call-both-flash", "call-both-native", "call-groups-xla", "call-heads-xla",
         "call-both-native-int8", "call-both-flash-per-head", "call-both-xla-shared",
         "heads-native-int8", "heads-native-combined", "call-both-native-selected"]  # fmt: skip
SLOW_CALLS = ["heads-xla", "explicit-xla", "call-groups-flash", "call-groups-native",
              "call-heads-flash", "call-heads-native", "call-both-xla-int8",
              "call-both-flash-int8", "call-both-xla-per-head"]  # fmt: skip


def _check_call(case: dict) -> None:
    """The one-device result, the float64 reference (where computed), the output laid
    out as the query, and no collective in the compiled program."""
    assert case["error"] <= 1e-6, case
    assert case.get("reference", 0.0) <= 1e-5, case
    split = case["case"].split("-")[1]
    axes = {"groups": ["'data'"], "heads": ["'model'"], "both": ["'data'", "'model'"]}
    assert all(axis in case["spec"] for axis in axes.get(split, ["'model'"])), case
    assert case["collectives"] == [], case


@pytest.mark.parametrize("name", CALLS)
def test_paged_calls_on_the_mesh_equal_one_device_and_move_nothing(fast, name):
    """jax.jit(paged_attention) on head-sharded inputs (an automatic mesh and one of
    Explicit axes: flash's loops and native's partitioning rule run with the axes Auto),
    and nanoattn.parallel.sharded_paged_attention by groups, heads and both, int8 pools
    with their scales split by heads, score_fn and sinks seeing every head's own index."""
    _check_call(fast[name])


@pytest.mark.slow
@pytest.mark.parametrize("name", SLOW_CALLS)
def test_paged_calls_on_the_mesh_on_every_backend(slow, name):
    _check_call(slow[name])


def test_gradients_through_the_sharded_call_equal_one_device(fast):
    """The gradients to the queries and both pools by groups and heads (flash's paged
    backward inside shard_map, its carries varying over the manual axes)."""
    case = fast["grad-both-flash"]
    assert case["error"] <= 1e-6 * case["real"], case


@pytest.mark.slow
@pytest.mark.parametrize("implementation", ["xla", "native"])
def test_gradients_through_the_sharded_call_on_every_backend(slow, implementation):
    case = slow[f"grad-both-{implementation}"]
    assert case["error"] <= 1e-6 * case["real"], case


def test_heads_that_the_axis_cannot_split_are_refused_in_one_line(fast):
    """K = 2 on the 4-way head axis (the call, a paged layer, a cache's shardings), and a
    latent pool (K = 1) asked to split its heads."""
    case = fast["refusals"]
    for name in ("call", "layer", "cache", "latent"):
        message = case[name]
        assert message is not None and "\n" not in message, (name, message)
        assert "head_axis='model'" in message and "4 devices" in message, (name, message)
    for name in ("call", "layer", "cache"):
        assert "K=2" in case[name], case
    assert "K=1" in case["latent"] and "latent" in case["latent"], case


# The pools' partition specs after the steps, by split (cache_shardings placed them).
POOLS = {"groups": "P('data',)", "heads": "P(None, None, 'model')",
         "both": "P('data', None, 'model')"}  # fmt: skip


def _check_layer(case: dict) -> None:
    """The one-device result, the pools still split as placed, no page moved."""
    assert case["error"] <= 1e-6 * max(1.0, case.get("real", 1.0)), case
    split = case["case"].split("-")[1]
    assert case["pools"] and set(case["pools"]) == {POOLS[split]}, case
    assert case["pool_collectives"] == [], case


@pytest.mark.parametrize("split", ["groups", "heads", "both"])
def test_the_paged_linen_layer_on_the_mesh_equals_one_device(fast, split):
    """Two steps (prompts, then a decode token, a chunk and another prompt) of each
    group, its own allocator and pool; the compiled step moves no page (by groups:
    nothing at all; by heads: the new tokens' q, k, v from the fused projection and
    one all-reduce of the output projection)."""
    case = fast[f"layer-{split}-linen"]
    _check_layer(case)
    if split == "groups":
        assert case["collectives"] == [], case


def test_page_selection_on_the_mesh_ranks_over_every_head_as_one_device(fast):
    """A layer selecting one page and the last at a decode token, its heads and groups
    split: each group's decode token reads the pages one device's layer reads (the
    ranking takes the maximum over all query heads, across the "model" axis), and that
    selection does change its output (the control: reading every page differs)."""
    case = fast["layer-both-linen-selection"]
    _check_layer(case)
    assert case["selection_changed"] > 1e-3, case


def test_the_latent_layers_pool_shards_by_groups(fast):
    _check_layer(fast["latent-groups"])


@pytest.mark.slow
def test_the_paged_nnx_layer_on_the_mesh_equals_one_device(slow):
    _check_layer(slow["layer-both-nnx"])


@pytest.mark.slow
def test_the_recall_engine_on_the_mesh_gives_every_request_the_one_device_tokens(slow):
    """examples/recall/mesh.py on a 2 x 4 mesh (heads split 2 ways, 4 groups) against
    the one-device engine: a random decoder, 12 requests."""
    case = slow["engine"]
    assert case["differ"] == [] and case["tokens"] > 0, case
    assert case["compiled"] == 2, case  # one program per step size, none again


@pytest.mark.slow
def test_the_recall_engine_across_two_processes_gives_the_one_device_tokens(tmp_path):
    """Two processes of 4 CPU devices joined on 127.0.0.1 (tests/_paged_multiprocess.py,
    a free port, bounded time), each running the same host loop with its own copies of
    the groups' allocators: every request's tokens equal the one-device engine's."""
    from _paged_multiprocess import parts
    from _two_processes import run_pair

    from examples.recall.engine import Engine

    out = tmp_path / "out.json"
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    run_pair(TESTS / "_paged_multiprocess.py", out, env={**os.environ, "PYTHONPATH": path})
    model, requests, config = parts()
    one = Engine(model, config, max(r.need for r in requests)).run(requests)
    got = json.loads(out.read_text())
    assert got["steps"] >= 2, got
    assert {int(k): v for k, v in got["outputs"].items()} == one.outputs, (got, one.outputs)


def test_cache_shardings_split_a_combined_pool_by_heads_not_by_its_pair_axis():
    """cache_shardings on a combined pool (G P, page_size, 2, K, H): groups on its first
    axis, heads on K (its axis 3), the axis of keys and values whole; the empty value
    replicated (the specs, on a 1 x 1 mesh of this process's device)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec

    from nanoattn.parallel import cache_shardings

    mesh = jax.make_mesh((1, 1), ("data", "model"), devices=jax.devices()[:1])
    cache = {"key": jnp.zeros((4, 2, 2, 2, 8)), "value": jnp.zeros((0,))}
    shardings = cache_shardings(cache, mesh, head_axis="model", data_axis="data")
    specs = {name: s.spec for name, s in shardings.items()}
    assert specs == {"key": PartitionSpec("data", None, None, "model", None),
                     "value": PartitionSpec()}  # fmt: skip
