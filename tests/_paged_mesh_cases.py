"""Paged attention and the paged layers on a mesh, on 8 simulated CPU devices (run by
tests/parallel/test_paged_mesh.py in ONE subprocess with
``XLA_FLAGS=--xla_force_host_platform_device_count=8``): each case prints one JSON line.

A 2 x 4 mesh ("data", "model"): two data-parallel groups, each with its own pool, page
table and sequences (their arrays end to end, docs/parallel.md "Serving on a mesh"),
and the heads split 4 ways. Every case compares with the same work on one device
(float32), and some with the float64 reference of each sequence alone:

* heads-<backend>: ``jax.jit(paged_attention)`` with the query's heads and the pool's
  key/value heads sharded over "model" (an automatic mesh; explicit-<backend>: a mesh
  of Explicit axes), and the collectives of its compiled program;
* call-<split>-<backend>: ``nanoattn.parallel.sharded_paged_attention`` by groups, by
  heads and both; quantized pools (int8, their scales split with their heads);
  ``score_fn`` and sinks seeing every head by its index among all N;
* layer-<split>-<family>: the linen and NNX layers with ``page_size`` and
  ``head_axis``, two steps, by groups (the step under shard_map over "data"), heads
  and both, and the pool collectives of the compiled head-sharded step;
* latent-groups: the latent layer's paged step by groups;
* grad-both-<backend>: the gradients to the queries and pools by groups and heads;
* refusals: K = 2 on the 4-way axis, a latent pool asked to split its one head;
* engine: the recall example's engine on the mesh against one device.
"""

import functools
import json
import re
import sys
import traceback

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import nanoattn
from nanoattn.parallel import cache_shardings, concat_batches, sharded_paged_attention

from _reference import np_attention, randn

COLLECTIVES = ("all-gather", "all-to-all", "collective-permute", "all-reduce", "reduce-scatter")
BACKENDS = ("xla", "flash", "native")
G, M = 2, 4  # groups ("data") and head shards ("model")


def mesh_of(explicit: bool = False):
    types = (AxisType.Explicit if explicit else AxisType.Auto,) * 2
    return jax.make_mesh((G, M), ("data", "model"), axis_types=types)


def collectives(text: str) -> list[str]:
    return [c for c in COLLECTIVES if c in text]


def pool_collectives(text: str, pages: int, page_size: int) -> list[str]:
    """The collective instructions of a compiled program whose result has the leading
    axes of a pool (pages, page_size, ...): keys, values or scales moving."""
    found = []
    for line in text.splitlines():
        if not any(f" {c}(" in line or f" {c}-start(" in line for c in COLLECTIVES):
            continue
        for dims in re.findall(r"\w+\[([\d,]+)\]", line.split("=", 1)[-1]):
            sizes = [int(d) for d in dims.split(",")]
            if len(sizes) >= 3 and sizes[:2] == [pages, page_size]:
                found.append(line.strip()[:160])
    return found


# ---- the functional call --------------------------------------------------------------

N, K, H, PAGES, PS = 16, 8, 8, 40, 4
TABLE = np.array([[3, 1, 4, 0, 9], [5, 2, 6, 7, 8], [11, 12, 13, 14, 15]], np.int32)
LENGTHS = np.array([13, 9, 20], np.int32)
STARTS = np.array([0, 4, 5, 7], np.int32)
TQ = 9  # two padding rows


def group_inputs(g: int, K: int = K, N: int = N):
    """Group g's query (TQ, N, H), pools (PAGES, PS, K, H), page table, lengths, starts:
    the second group's table and lengths are the first's rearranged."""
    q = randn(10 * g + 1, TQ, N, H)
    kp, vp = randn(10 * g + 2, PAGES, PS, K, H), randn(10 * g + 3, PAGES, PS, K, H)
    table, lengths = (TABLE, LENGTHS) if g == 0 else (TABLE[::-1] + 20, LENGTHS[[1, 2, 0]])
    starts = STARTS if g == 0 else np.array([0, 1, 4, 7], np.int32)
    return q, kp, vp, np.ascontiguousarray(table), lengths, starts


def joined(groups):
    """The groups' arrays end to end (the layout of sharded_paged_attention)."""
    return tuple(np.concatenate(parts) for parts in zip(*groups, strict=True))


def np_paged(q, kp, vp, table, lengths, starts):
    """The float64 reference: each sequence's queries over its keys, gathered, causal
    at its last positions; padding rows zero."""
    out = np.zeros(q.shape[:2] + vp.shape[-1:])
    for b in range(len(lengths)):
        n, rows = int(lengths[b]), slice(starts[b], starts[b + 1])
        keys = kp[table[b]].reshape(-1, *kp.shape[2:])[:n][None]
        values = vp[table[b]].reshape(-1, *vp.shape[2:])[:n][None]
        q_len = starts[b + 1] - starts[b]
        allowed = np.arange(n)[None] <= (n - q_len + np.arange(q_len))[:, None]
        out[rows] = np_attention(q[rows][None], keys, values, allowed)[0]
    return out


def heads_split(implementation: str, explicit: bool = False, quantized: bool = False,
                combined: bool = False) -> dict:  # fmt: skip
    """jax.jit(paged_attention) on inputs whose heads are sharded over "model" (int8
    pools: their scales (P, PS, K) too; ``combined``: one pool (P, PS, 2, K, H), value_pages
    None, its K sharded)."""
    mesh = mesh_of(explicit)
    group = group_inputs(0)
    q, kp, vp, table, lengths, starts, *scales = _quantized(group) if quantized else group

    def call(q, kp, vp, *scales):
        given = dict(key_scales=scales[0], value_scales=scales[1]) if scales else {}
        return nanoattn.paged_attention(q, kp, vp, table, lengths, starts,
                                        implementation=implementation, **given)  # fmt: skip

    one = np.asarray(jax.jit(call)(q, kp, vp, *scales))
    heads, pool = NamedSharding(mesh, P(None, "model")), NamedSharding(mesh, P(None, None, "model"))
    pools = [jax.device_put(x, pool) for x in (kp, vp, *scales)]
    if combined:
        split_k = NamedSharding(mesh, P(None, None, None, "model"))
        pools = [jax.device_put(jnp.stack([kp, vp], 2), split_k), None]
    with jax.set_mesh(mesh):
        args = [jax.device_put(q, heads), *pools]
        out = jax.jit(call)(*args)
        text = jax.jit(call).lower(*args).compile().as_text()
    name = (
        f"{'explicit' if explicit else 'heads'}-{implementation}"
        + ("-int8" if quantized else "")
        + ("-combined" if combined else "")
    )
    case = {
        "case": name,
        "error": float(np.abs(np.asarray(out) - one).max()),
        "spec": str(out.sharding.spec),
        "collectives": collectives(text),
    }
    if not quantized:
        case["reference"] = float(np.abs(np.asarray(out) - np_paged(*group)).max())
    return case


SPLITS = {"groups": ("data", None), "heads": (None, "model"), "both": ("data", "model")}


def sharded_call(split: str, implementation: str, quantized: bool = False, **rules) -> dict:
    """sharded_paged_attention against paged_attention of each group on one device."""
    data_axis, head_axis = SPLITS[split]
    groups = [group_inputs(g) for g in range(G if data_axis else 1)]
    if quantized:  # int8 pools with their scales (P, PS, K)
        groups = [_quantized(group) for group in groups]

    def one(*a):
        scales = dict(key_scales=a[6], value_scales=a[7]) if quantized else {}
        return nanoattn.paged_attention(*a[:6], implementation=implementation, **scales, **rules)

    want = np.concatenate([np.asarray(jax.jit(one)(*group)) for group in groups])
    mesh = mesh_of()

    def call(*a):
        scales = dict(key_scales=a[6], value_scales=a[7]) if quantized else {}
        return sharded_paged_attention(
            *a[:6], data_axis=data_axis, head_axis=head_axis, implementation=implementation,
            **scales, **rules,
        )  # fmt: skip

    arrays = joined(groups)
    with jax.set_mesh(mesh):
        out = jax.jit(call)(*arrays)
        text = jax.jit(call).lower(*arrays).compile().as_text()
    case = {
        "case": f"call-{split}-{implementation}" + ("-int8" if quantized else ""),
        "error": float(np.abs(np.asarray(out) - want).max()),
        "spec": str(out.sharding.spec),
        "collectives": collectives(text),
    }
    if not quantized and not rules:
        reference = np.concatenate([np_paged(*group) for group in groups])
        case["reference"] = float(np.abs(np.asarray(out) - reference).max())
    return case


def keyword_call(implementation: str, groups, keyword: str, values, case: str):
    """sharded_paged_attention by groups and heads with ``keyword`` (``values``: each
    group's, joined as the groups are) against each group's paged_attention on one
    device: (the output, its case row: error, spec, collectives)."""
    rules = dict(implementation=implementation)
    want = np.concatenate([
        np.asarray(nanoattn.paged_attention(*group, **{keyword: value}, **rules))
        for group, value in zip(groups, values, strict=True)
    ])  # fmt: skip

    def call(*arrays, value):
        return sharded_paged_attention(*arrays, data_axis="data", head_axis="model",
                                       **{keyword: value}, **rules)  # fmt: skip

    arrays, value = joined(groups), np.concatenate(values)
    with jax.set_mesh(mesh_of()):
        out = jax.jit(call)(*arrays, value=value)
        text = jax.jit(call).lower(*arrays, value=value).compile().as_text()
    return out, {
        "case": case,
        "error": float(np.abs(np.asarray(out) - want).max()),
        "spec": str(out.sharding.spec),
        "collectives": collectives(text),
    }


def shared_prefix_call(implementation: str) -> dict:
    """shared_prefixes (cascade attention) split with the page table, by groups and
    heads: each group's first two sequences share their first page."""
    groups, shared = [], []
    for g in range(G):
        q, kp, vp, table, lengths, starts = group_inputs(g)
        table = table.copy()
        table[1, 0] = table[0, 0]
        groups.append((q, kp, vp, table, lengths, starts))
        shared.append(np.array([1, 1, 0], np.int32))
    out, row = keyword_call(implementation, groups, "shared_prefixes", shared,
                            f"call-both-{implementation}-shared")  # fmt: skip
    reference = np.concatenate([np_paged(*group) for group in groups])
    return row | {"reference": float(np.abs(np.asarray(out) - reference).max())}


def selection_call(implementation: str) -> dict:
    """key_indices (sparse attention over chosen keys) split with the queries by groups,
    the heads split too: each group's tokens select keys of their own sequences."""
    groups = [group_inputs(g) for g in range(G)]
    rng = np.random.default_rng(7)
    chosen = [rng.integers(-1, int(group[4].max()), size=(TQ, 5)).astype(np.int32)
              for group in groups]  # fmt: skip
    return keyword_call(implementation, groups, "key_indices", chosen,
                        f"call-both-{implementation}-selected")[1]  # fmt: skip


def sharded_gradients(implementation: str) -> dict:
    """The gradients to the queries and the pools of sharded_paged_attention by groups
    and heads against each group's on one device (flash's paged backward inside
    shard_map)."""
    groups = [group_inputs(g) for g in range(G)]
    weights = randn(7, G * TQ, N, H)

    def loss(call, q, kp, vp, *rest):
        return (call(q, kp, vp, *rest, implementation=implementation) * weights).sum()

    def one(q, kp, vp, table, lengths, starts, g):
        w = weights[g * TQ : (g + 1) * TQ]
        out = nanoattn.paged_attention(q, kp, vp, table, lengths, starts,
                                       implementation=implementation)  # fmt: skip
        return (out * w).sum()

    grad = jax.grad(one, argnums=(0, 1, 2))
    want = [np.concatenate(parts) for parts in zip(*(grad(*x, g) for g, x in enumerate(groups)))]
    sharded = functools.partial(sharded_paged_attention, data_axis="data", head_axis="model")
    with jax.set_mesh(mesh_of()):
        got = jax.jit(jax.grad(functools.partial(loss, sharded), argnums=(0, 1, 2)))(
            *joined(groups)
        )
    error = max(float(np.abs(np.asarray(a) - b).max()) for a, b in zip(got, want, strict=True))
    return {"case": f"grad-both-{implementation}", "error": error,
            "real": max(float(np.abs(b).max()) for b in want)}  # fmt: skip


def _int8(x):
    """x (P, PS, K, H) as int8 and its scales (P, PS, K)."""
    values, scales = nanoattn.quantize_kv(jnp.asarray(x), "int8")
    return np.asarray(values), np.asarray(scales)


def per_head_rules(implementation: str) -> dict:
    """score_fn (a slope per head) and sinks split over the heads: each device's
    heads seen by their index among all N."""
    slopes = jnp.linspace(0.1, 0.9, N)

    def alibi(s, b, n, q, k):
        return s - slopes[n] * (q - k)

    sinks = jnp.asarray(randn(5, N))
    case = sharded_call("both", implementation, score_fn=alibi, sinks=sinks)
    return case | {"case": f"call-both-{implementation}-per-head"}


def refusals() -> dict:
    """One-line errors: K = 2 on the 4-way head axis (the call, the layer, the cache's
    shardings), a latent pool (one head) asked to split its heads."""
    mesh, found = mesh_of(), {}
    group = group_inputs(0, K=2)
    q, kp, vp, table, lengths, starts = group
    with jax.set_mesh(mesh):
        latent = (q, kp[:, :, :1], vp[:, :, :1], table, lengths, starts)
        for name, attempt in {
            "call": lambda: sharded_paged_attention(*group, head_axis="model"),
            "latent": lambda: sharded_paged_attention(*latent, head_axis="model"),
            "cache": lambda: cache_shardings({"key": kp}, mesh, head_axis="model"),
            "layer": lambda: layer_steps("linen", "heads", kv_heads=2),
        }.items():
            try:
                attempt()
                found[name] = None
            except ValueError as e:
                found[name] = str(e)
    return {"case": "refusals", **found}


def _quantized(group):
    """A group's inputs with int8 pools: (q, key pages, value pages, table, lengths,
    starts, key scales, value scales)."""
    q, kp, vp, *rest = group
    (kq, ks), (vq, vs) = _int8(kp), _int8(vp)
    return (q, kq, vq, *rest, ks, vs)


# ---- the layers -----------------------------------------------------------------------

D, LN, LK = 32, 8, 4  # a layer of N = 8 query heads and K = 4 key/value heads of width 4
LPS, LPAGES, LSEQS, LMAX, LTQ = 5, 13, 3, 5, 24  # a group's pool, rows and step


def group_steps(g: int):
    """Group g's two steps, x (1, LTQ, D) and its batch, from an allocator of its own:
    two prompts, then a decode token (its sequence's 22nd: five pages, so that a layer
    selecting one page and the last ranks four), a chunk and a third prompt."""
    alloc = nanoattn.PageAllocator(LPAGES, LPS, max_sequences=LSEQS, max_pages=LMAX, seed=g)
    steps = []
    for s, rows in enumerate(([("a", 21), ("b", 3)], [("a", 1), ("b", 2), ("c", 4 + g)])):
        for seq, n in rows:
            (alloc.extend if seq in alloc.sequences() else alloc.allocate)(seq, n)
        batch = alloc.batch(rows, tokens=LTQ)
        alloc.confirm(batch)
        steps.append((randn(100 * g + s, 1, LTQ, D), batch))
    return steps


def layer_parts(family: str, head_axis, pages: int, kv_heads: int = LK, mesh=None,
                page_selection=None):  # fmt: skip
    """(step(params, cache, x, pages) -> (y, cache), params, an empty cache of ``pages``
    pages) of a paged layer (selecting ``page_selection`` pages at a decode token, or
    not): the same random parameters for every family and head_axis, placed by their
    logical axes (``nanoattn.parallel.logical_rules``) on ``mesh``."""
    from flax import linen as nn
    from flax import nnx

    from nanoattn import linen as nl
    from nanoattn import nnx as nanonnx
    from nanoattn.parallel import logical_rules

    from _layer_configs import random_params

    def config(axis):
        return nl.AttentionConfig(D, LN, n_kv_heads=kv_heads, rope_base=100.0, page_size=LPS,
                                  head_axis=axis, page_selection=page_selection)  # fmt: skip

    plain, layer = nl.CausalSelfAttention(config(None)), nl.CausalSelfAttention(config(head_axis))
    init = functools.partial(plain.init, decode=True)
    shapes = jax.eval_shape(init, jax.random.key(0), jnp.zeros((1, pages * LPS, D)))
    params = random_params(shapes["params"], 3)
    if family == "linen":
        cache = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), shapes["cache"])
        if head_axis is not None:  # out.kernel's rows over "model"
            boxed = jax.eval_shape(functools.partial(layer.init, decode=True),
                                   jax.random.key(0), jnp.zeros((1, pages * LPS, D)))  # fmt: skip
            specs = nn.get_partition_spec(boxed["params"])
            params = jax.device_put(params, nn.logical_to_mesh_sharding(
                specs, mesh, logical_rules(head_axis)))  # fmt: skip

        def step(params, cache, x, batch):
            y, state = layer.apply({"params": params, "cache": cache}, x, True, decode=True,
                                   pages=batch, mutable=["cache"])  # fmt: skip
            return y, state["cache"]

        return step, params, cache
    model = nanonnx.from_linen(config(head_axis), params, rngs=nnx.Rngs(0))
    model.init_cache(1, pages * LPS)
    graphdef, state, cache = nnx.split(model, nnx.Param, nnx.Cache)
    if head_axis is not None:

        def is_spec(s):
            return isinstance(s, P)

        logical = nnx.get_partition_spec(state)
        state = jax.device_put(state, jax.tree.map(
            lambda s: nn.logical_to_mesh_sharding(s, mesh, logical_rules(head_axis)),
            logical, is_leaf=is_spec))  # fmt: skip

    def nnx_step(state, cache, x, batch):
        model = nnx.merge(graphdef, state, cache)
        return model(x, decode=True, pages=batch), nnx.state(model, nnx.Cache)

    return nnx_step, state, cache


def per_group(step):
    """A step of G groups: ``step`` under shard_map over "data", each device its
    group's tokens (x's axis 1), pool (the cache's axis 0) and batch; the parameters
    and the heads ("model") left to the step."""
    data = P("data")
    return jax.shard_map(step, in_specs=(P(), data, P(None, "data"), data),
                         out_specs=(P(None, "data"), data), axis_names={"data"})  # fmt: skip


def run(step, params, cache, steps):
    """The outputs (1, Tq, D) of ``steps``, the compiled program's text and the
    partition specs of the cache's pools (arrays of rank 4 with elements) as placed and
    after the last step."""
    jitted, ys = jax.jit(step), []
    text = jitted.lower(params, cache, *steps[0]).compile().as_text()
    pools = pool_specs(cache)
    for x, batch in steps:
        y, cache = jitted(params, cache, x, batch)
        ys.append(np.asarray(y))
    return ys, text, pools + pool_specs(cache)


def pool_specs(cache) -> list[str]:
    """Each pool's partition spec, its trailing None left out ("" off a mesh); a
    combined pool's (P, PS, 2, K, H) without its axis of keys and values, which must
    stay whole."""
    specs = []
    for a in jax.tree.leaves(cache):
        if np.ndim(a) in (4, 5) and np.size(a):
            spec = list(getattr(a.sharding, "spec", ()))
            if np.ndim(a) == 5:
                spec += [None] * (5 - len(spec))
                if spec.pop(2) is not None:
                    specs.append("the axis of keys and values split")
            while spec and spec[-1] is None:
                spec.pop()
            specs.append(str(P(*spec)))
    return specs


@functools.cache
def one_device(family: str, page_selection=None):
    """Each group's outputs of its two steps on one device, its own pool."""
    step, params, cache = layer_parts(family, None, LPAGES, page_selection=page_selection)
    return [run(step, params, cache, group_steps(g))[0] for g in range(G)]


def layer_steps(family: str, split: str, kv_heads: int = LK, page_selection=None) -> dict:
    """The paged layer's two steps on the mesh against one device, per group; with
    ``page_selection``, also how far the one-device steps are from reading every page
    (a positive control: the decode token's selection changes its output)."""
    data_axis, head_axis = SPLITS[split]
    groups = G if data_axis else 1
    wanted = one_device(family, page_selection) if kv_heads == LK else None
    mesh = mesh_of()
    with jax.set_mesh(mesh):
        step, params, cache = layer_parts(family, head_axis, groups * LPAGES, kv_heads, mesh,
                                          page_selection)  # fmt: skip
        cache = jax.device_put(cache, cache_shardings(cache, mesh, head_axis=head_axis,
                                                      data_axis=data_axis))  # fmt: skip
        by_group = [group_steps(g) for g in range(groups)]
        steps = [
            (np.concatenate([s[i][0] for s in by_group], axis=1),
             concat_batches([s[i][1] for s in by_group]))
            for i in range(2)
        ]  # fmt: skip
        ys, text, pools = run(per_group(step) if data_axis else step, params, cache, steps)
    got = [np.split(y, groups, axis=1) for y in ys]  # [step][group]
    error = max(
        float(np.abs(got[i][g] - wanted[g][i]).max()) for i in range(2) for g in range(groups)
    )
    selected = {}
    if page_selection is not None:
        plain = one_device(family)
        selected["selection_changed"] = max(
            float(np.abs(wanted[g][1] - plain[g][1]).max()) for g in range(groups)
        )  # fmt: skip
    return selected | {
        "case": f"layer-{split}-{family}" + ("-selection" if page_selection else ""),
        "error": error,
        "real": float(np.abs(wanted[0][1]).max()),
        "collectives": collectives(text),
        "pool_collectives": pool_collectives(text, LPAGES, LPS)
        + pool_collectives(text, G * LPAGES, LPS),
        "pools": pools,
    }


def latent_groups() -> dict:
    """The latent layer's paged step (a pool of one head: it shards by groups only) by
    groups, its cache split on its pages, against each group on one device."""
    from nanoattn.linen import LatentAttention, LatentConfig

    sizes = dict(d_model=D, n_heads=3, kv_lora_rank=13, qk_nope_head_dim=7, qk_rope_head_dim=4,
                 v_head_dim=5, page_size=LPS)  # fmt: skip
    layer = LatentAttention(LatentConfig(**sizes))

    def parts(pages):
        init = functools.partial(layer.init, decode=True)
        shapes = jax.eval_shape(init, jax.random.key(0), jnp.zeros((1, pages * LPS, D)))
        return jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), shapes["cache"])

    from _layer_configs import random_params

    shapes = jax.eval_shape(functools.partial(layer.init, decode=True), jax.random.key(0),
                            jnp.zeros((1, LPAGES * LPS, D)))  # fmt: skip
    params = random_params(shapes["params"], 5)

    def step(params, cache, x, batch):
        y, state = layer.apply({"params": params, "cache": cache}, x, decode=True, pages=batch,
                               mutable=["cache"])  # fmt: skip
        return y, state["cache"]

    wanted = [run(step, params, parts(LPAGES), group_steps(g))[0] for g in range(G)]
    mesh = mesh_of()
    with jax.set_mesh(mesh):
        cache = parts(G * LPAGES)
        cache = jax.device_put(cache, cache_shardings(cache, mesh, data_axis="data"))
        by_group = [group_steps(g) for g in range(G)]
        steps = [
            (np.concatenate([s[i][0] for s in by_group], axis=1),
             concat_batches([s[i][1] for s in by_group]))
            for i in range(2)
        ]  # fmt: skip
        ys, text, pools = run(per_group(step), params, cache, steps)
    error = max(
        float(np.abs(np.split(ys[i], G, axis=1)[g] - wanted[g][i]).max())
        for i in range(2) for g in range(G)
    )  # fmt: skip
    return {"case": "latent-groups", "error": error, "pools": pools,
            "pool_collectives": pool_collectives(text, LPAGES, LPS)}  # fmt: skip


def engine() -> dict:
    """The recall example's engine on the 2 x 4 mesh (examples/recall/mesh.py) against
    the one-device engine: every request's tokens."""
    from examples.recall import mesh as recall_mesh

    return {"case": "engine", **recall_mesh.compare_with_one_device(seed=0)}


def cases(which: str):
    """The cases of a group, as functions of no argument: "fast" (one case of each
    behaviour, the suite's) and "slow" (the other backends and splits, the NNX layer,
    the engine: ``make test-all``)."""
    calls = functools.partial
    if which == "fast":
        yield from (calls(heads_split, b) for b in ("flash", "native"))
        yield from (calls(heads_split, b, True) for b in ("flash", "native"))
        yield calls(heads_split, "native", False, True)
        yield calls(heads_split, "native", combined=True)
        yield from (calls(sharded_call, "both", b) for b in BACKENDS)
        yield from (calls(sharded_call, split, "xla") for split in ("groups", "heads"))
        yield calls(sharded_call, "both", "native", True)
        yield calls(per_head_rules, "flash")
        yield calls(shared_prefix_call, "xla")
        yield calls(selection_call, "native")
        yield calls(sharded_gradients, "flash")
        yield refusals
        yield from (calls(layer_steps, "linen", split) for split in SPLITS)
        yield calls(layer_steps, "linen", "both", page_selection=1)
        yield latent_groups
    elif which == "slow":
        yield from (calls(heads_split, "xla", explicit) for explicit in (False, True))
        for split in ("groups", "heads"):
            yield from (calls(sharded_call, split, b) for b in ("flash", "native"))
        yield from (calls(sharded_call, "both", b, True) for b in ("xla", "flash"))
        yield calls(per_head_rules, "xla")
        yield from (calls(sharded_gradients, b) for b in ("xla", "native"))
        yield calls(layer_steps, "nnx", "both")
        yield engine


if __name__ == "__main__":
    for which in sys.argv[1:] or ["fast", "slow"]:
        for case in cases(which):
            name = getattr(case, "func", case).__name__
            try:
                print(json.dumps(case()), flush=True)
            except Exception as e:
                traceback.print_exc()
                args = getattr(case, "args", ())
                print(json.dumps({"case": f"{name}{args}", "raised": f"{type(e).__name__}: {e}"}),
                      flush=True)  # fmt: skip
