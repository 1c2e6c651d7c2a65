"""Multi-device cases of nanoattn.parallel, run in one process on 8 simulated CPU
devices and reported as JSON (tests/parallel/test_parallel.py starts it once).

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python tests/_parallel_cases.py [--slow]

Each case prints one line ``{"case": name, ...measures}``; the test asserts on
them. A case that raises reports ``{"case": name, "error": ...}``. Axis sizes
are distinct (B=2, N=6, K=3, H=8, T a multiple of 2P) so a swapped axis fails.
"""

import json
import os
import re
import sys
import time
import traceback

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding

import nanoattn
from nanoattn._base.zigzag import zigzag_order
from nanoattn.parallel import ring_attention

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _reference import np_attention_vjp, np_lse

B, N, K, H = 2, 6, 3, 8


def mesh_of(P: int, name: str = "sp") -> Mesh:
    return Mesh(np.array(jax.devices()[:P]), (name,))


def inputs(T: int, dtype=jnp.float32, seed: int = 0, value_width: int = H):
    """q (B, T, N, H), k (B, T, K, H), v (B, T, K, Hv) and the probe (d out, (B, T, N,
    Hv)), from numpy (no compile); Hv = ``value_width``."""
    rng = np.random.default_rng(seed)
    q, k = (rng.standard_normal((B, T, heads, H), np.float32) for heads in (N, K))
    v = rng.standard_normal((B, T, K, value_width), np.float32)
    probe = rng.standard_normal((B, T, N, value_width), np.float32)
    return (*(jnp.asarray(x, dtype) for x in (q, k, v)), probe)


def segments(T: int):
    """Two packed documents per row, split at different places, crossing shards."""
    cut = np.array([[T // 3], [T - 5]])
    return jnp.asarray((np.arange(T)[None] >= cut).astype(np.int32))


def chunk_documents(T: int, C: int):
    """Packed documents (B, T) whose edges fall on the edges of C-token chunks: row 0
    in documents of 2, 3, 1, 2, 3, 1, ... chunks, row 1 of 1, 4, 3, 1, 4, 3, ...;
    a chunk pair between two documents in both rows sees nothing."""
    rows = [(2, 3, 1), (1, 4, 3)]
    ids = [np.repeat(np.arange(T), np.resize(sizes, T) * C)[:T] for sizes in rows]
    return jnp.asarray(np.stack(ids), jnp.int32)


def _permute(x, P: int, order):
    x = np.asarray(x)
    chunks = x.reshape(x.shape[0], 2 * P, -1, *x.shape[2:])  # (B, 2P, C, ...)
    return np.take(chunks, order, axis=1).reshape(x.shape)


def to_layout(x, P: int, layout: str):
    """A natural-order (B, T, ...) array in the layout's order, permuted on the host
    with numpy (as a data loader would; ``to_zigzag`` is tested in-process), so
    the compiled program holds only the ring."""
    if x is None or layout == "contiguous":
        return x
    return _permute(x, P, zigzag_order(P))


def from_layout(x, P: int, layout: str):
    return x if layout == "contiguous" else _permute(x, P, np.argsort(zigzag_order(P)))


def ring_vjp(P, layout, mesh, **options):
    """Jitted (out, gradients of sum(out * probe)) of the ring: one program."""

    def run(q, k, v, probe, kv_lengths, ids):
        def fn(q, k, v):
            return ring_attention(
                q, k, v, axis_name="sp", mesh=mesh, layout=layout, kv_lengths=kv_lengths,
                q_segment_ids=ids, kv_segment_ids=ids, **options,
            )  # fmt: skip

        out, vjp = jax.vjp(fn, q, k, v)
        return out, vjp(probe.astype(out.dtype))

    return jax.jit(run)


def reference(q, k, v, probe, kv_lengths=None, ids=None, *, is_causal=False, window=None,
              logit_soft_cap=None):  # fmt: skip
    """An independent float64 numpy reference: the output and the gradients of
    sum(out * probe), by hand. Query i sees key j iff every rule allows it
    (docs/conventions.md); a row that sees nothing is zero, with zero gradients."""
    q, k, v, probe = (np.asarray(x, np.float64) for x in (q, k, v, probe))
    T, S, G = q.shape[1], k.shape[1], q.shape[2] // k.shape[2]
    k, v = np.repeat(k, G, axis=2), np.repeat(v, G, axis=2)  # head n uses kv head n // G
    i, j = np.arange(T)[:, None], np.arange(S)[None, :]
    allowed = np.ones((B, 1, T, S), bool)
    if is_causal:
        allowed &= j <= i
    if window is not None:
        left, right = window
        allowed &= (j >= i - left) & (j <= i + right)
    if kv_lengths is not None:
        allowed &= j < np.asarray(kv_lengths)[:, None, None, None]
    if ids is not None:
        ids = np.asarray(ids)
        allowed &= (ids[:, :, None] == ids[:, None, :])[:, None]
    scale = 1 / np.sqrt(q.shape[-1])
    raw = np.einsum("BTNH,BSNH->BNTS", q, k) * scale
    logits = raw if logit_soft_cap is None else logit_soft_cap * np.tanh(raw / logit_soft_cap)
    logits = np.where(allowed, logits, -np.inf)
    top = np.max(logits, -1, keepdims=True)
    e = np.where(allowed, np.exp(logits - np.where(np.isfinite(top), top, 0)), 0)
    total = e.sum(-1, keepdims=True)
    p = np.where(total > 0, e / np.where(total > 0, total, 1), 0)  # (B, N, T, S)
    out = np.einsum("BNTS,BSNH->BTNH", p, v)
    dv = np.einsum("BNTS,BTNH->BSNH", p, probe)
    dp = np.einsum("BTNH,BSNH->BNTS", probe, v)
    ds = p * (dp - (dp * p).sum(-1, keepdims=True))
    if logit_soft_cap is not None:
        ds = ds * (1 - np.tanh(raw / logit_soft_cap) ** 2)
    dq = np.einsum("BNTS,BSNH->BTNH", ds, k) * scale
    dk = np.einsum("BNTS,BTNH->BSNH", ds, q) * scale

    def per_kv_head(x):  # (B, S, N, H) -> (B, S, K, H): sum each group
        return x.reshape(x.shape[0], x.shape[1], -1, G, x.shape[3]).sum(3)

    return out, (dq, per_kv_head(dk), per_kv_head(dv))


def compare(name, P, layout, *, T=None, dtype=jnp.float32, lengths=False, ids=False,
            value_width=H, **options):  # fmt: skip
    T = T or 4 * P
    q, k, v, probe = inputs(T, dtype, value_width=value_width)
    kv_lengths = jnp.array([T - 3, T // 2 + 1], jnp.int32) if lengths else None
    C = T // (2 * P if layout == "zigzag" else P)
    ids = chunk_documents(T, C) if ids == "chunks" else segments(T) if ids else None
    start = time.perf_counter()
    placed = [to_layout(x, P, layout) for x in (q, k, v, probe, ids)]
    out, grads = ring_vjp(P, layout, mesh_of(P), **options)(*placed[:4], kv_lengths, placed[4])
    out, grads = from_layout(out, P, layout), [from_layout(g, P, layout) for g in grads]
    seconds = time.perf_counter() - start
    ref_out, ref_grads = reference(q, k, v, probe, kv_lengths, ids, **options)

    def err(a, b):
        return float(np.max(np.abs(np.asarray(a, np.float32) - np.asarray(b, np.float32))))

    return {
        "case": name, "P": P, "layout": layout, "dtype": jnp.dtype(dtype).name, "T": T,
        "window": options.get("window"), "is_causal": options.get("is_causal", False),
        "out_err": err(out, ref_out), "grad_err": max(map(err, grads, ref_grads)),
        "out_scale": float(np.max(np.abs(ref_out))),
        "seconds": seconds,
    }  # fmt: skip


def _documents(T: int):
    """Document ids (B, T): row 0 in documents of 7 tokens, row 1 of 11 (both cross
    chunk and shard edges)."""
    return np.stack([np.arange(T) // 7, np.arange(T) // 11]).astype(np.int32)


def _np_mask(kind: str, T: int, ids, hidden):
    """The numpy literal (B, 1, T, T) of a mask family (no library code)."""
    i, j = np.arange(T)[:, None], np.arange(T)[None, :]
    if kind == "documents":
        allowed = (ids[:, :, None] == ids[:, None, :])[:, None] & (j <= i)
    elif kind == "prefix":  # bidirectional over the first 5 tokens, then causal
        allowed = np.broadcast_to((j < 5) | (j <= i), (B, 1, T, T))
    else:  # "stripes": blocks of 8 positions see blocks of the same parity, causally
        allowed = np.broadcast_to(((i // 8) % 2 == (j // 8) % 2) & (j <= i), (B, 1, T, T))
    if hidden is not None:
        allowed = allowed & ~((j >= hidden[0]) & (j < hidden[1]))
    return allowed


def _mask_fn(kind: str, ids, hidden):
    """The same family as ``mask_fn`` of jax index arrays (global positions); ``ids``
    numpy (static) or a traced jax array."""

    def mask_fn(b, n, q, k):
        if kind == "documents":  # numpy ids: static (classified at trace time)
            seen = (jnp.asarray(ids)[b, q] == jnp.asarray(ids)[b, k]) & (k <= q)
        elif kind == "prefix":
            seen = (k < 5) | (k <= q)
        else:
            seen = ((q // 8) % 2 == (k // 8) % 2) & (k <= q)
        if hidden is not None:
            seen = seen & ~((k >= hidden[0]) & (k < hidden[1]))
        return seen

    return mask_fn


RADIUS = 3  # the relative bias's table: distances -3 .. 3, clipped


def _score_fn(score: str, params):
    """ALiBi (slopes (N,)) or a relative bias (a table (N, 2 RADIUS + 1)) as score_fn."""

    def alibi(s, b, n, q, k):
        return s - params[n] * jnp.abs(q - k).astype(s.dtype)

    def relative(s, b, n, q, k):
        return s + params[n, jnp.clip(q - k, -RADIUS, RADIUS) + RADIUS]

    return {"alibi": alibi, "relative": relative, None: None}[score]


def _np_score(score: str, params, T: int):
    """The bias (1, N, T, T) that score_fn adds, and the gradient to its parameters from
    the bias's gradient (B, N, T, T), in float64 numpy."""
    i, j = np.arange(T)[:, None], np.arange(T)[None, :]
    params = np.asarray(params, np.float64)
    if score == "alibi":
        distance = np.abs(i - j).astype(np.float64)
        return -params[None, :, None, None] * distance, lambda d: -(d * distance).sum((0, 2, 3))
    index = np.clip(i - j, -RADIUS, RADIUS) + RADIUS  # (T, T)

    def grad(d):
        out = np.zeros_like(params)
        for n in range(params.shape[0]):
            np.add.at(out[n], index, d[:, n].sum(0))
        return out

    return params[:, index][None], grad


def masked(name, P, layout, kind, *, T, traced=False, score=None, sinks=False, hidden=None,
           window=None, tiles=None):  # fmt: skip
    """The ring with ``mask_fn`` (a family of :func:`_np_mask`), optionally ALiBi or a
    relative bias through ``score_fn`` (its parameters differentiated), ``sinks`` and a
    key range no query sees holding NaN, against the float64 reference: output,
    log-sum-exp and the gradients to q, k, v, score_fn's parameters and the sinks.
    ``traced``: the document ids are a jit argument, so the classification runs at run
    time."""
    q, k, v, probe = inputs(T)
    ids = _documents(T)
    rng = np.random.default_rng(7)
    shape = (N,) if score == "alibi" else (N, 2 * RADIUS + 1)
    slopes = jnp.asarray(rng.uniform(0.1, 0.6, shape), jnp.float32)
    sink = jnp.asarray(rng.standard_normal(N), jnp.float32)
    k_in, v_in = np.array(k), np.array(v)
    if hidden is not None:  # content no query may read
        k_in[:, hidden[0] : hidden[1]] = np.nan
        v_in[:, hidden[0] : hidden[1], 0] = np.inf
    mesh = mesh_of(P)

    def run(q, k, v, probe, ids, slopes, sink):
        def fn(q, k, v, slopes, sink):
            return ring_attention(
                q, k, v, axis_name="sp", mesh=mesh, layout=layout, is_causal=kind != "prefix",
                window=window, mask_fn=_mask_fn(kind, ids if traced else _documents(T), hidden),
                score_fn=_score_fn(score, slopes), sinks=sink if sinks else None,
                return_residual=True, forward_tiles=tiles, backward_tiles=tiles,
            )  # fmt: skip

        (out, lse), vjp = jax.vjp(fn, q, k, v, slopes, sink)
        return out, lse, vjp((probe, jnp.zeros_like(lse)))

    placed = [to_layout(x, P, layout) for x in (q, k_in, v_in, probe)]
    out, lse, grads = jax.jit(run)(*placed, jnp.asarray(ids), slopes, sink)
    out, lse = from_layout(out, P, layout), from_layout(lse, P, layout)
    grads = [from_layout(g, P, layout) for g in grads[:3]] + list(grads[3:])

    allowed = _np_mask(kind, T, ids, hidden)
    i, j = np.arange(T)[:, None], np.arange(T)[None, :]
    if window is not None:
        allowed = allowed & (j >= i - window[0]) & (j <= i + window[1])
    bias, score_grad = _np_score(score, slopes, T) if score else (None, None)
    ref_sinks = np.asarray(sink) if sinks else None
    ref_out, ref = np_attention_vjp(q, k, v, probe, allowed, bias, sinks=ref_sinks)
    ref_lse = np_lse(q, k, allowed, bias, sinks=ref_sinks)
    dslopes = score_grad(ref[3]) if score else np.zeros(slopes.shape)
    dsink = ref[4] if sinks else np.zeros(N)
    wanted = [ref[0], ref[1], ref[2], dslopes, dsink]

    def rel(a, b):  # error relative to the reference's largest magnitude
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))

    finite_lse = np.isfinite(ref_lse)
    return {
        "case": name, "P": P, "layout": layout, "T": T, "kind": kind,
        "out_err": rel(out, ref_out),
        "lse_err": float(np.max(np.abs(np.asarray(lse)[finite_lse] - ref_lse[finite_lse]))),
        "lse_empty_match": bool(np.all(np.isneginf(np.asarray(lse)) == ~finite_lse)),
        "grad_errs": [rel(g, w) for g, w in zip(grads, wanted)],
        "finite": bool(all(np.isfinite(np.asarray(x)).all() for x in [out, *grads])),
        "empty_rows": int((~allowed.any(-1)).sum()),  # rows that see no key
        "out_scale": float(np.max(np.abs(ref_out))),
    }  # fmt: skip


def masked_layer(name, P: int = 2):
    """The causal linen layer with sinks, a document mask_fn and ALiBi through
    score_fn, with ``sequence_axis`` (zigzag) and ``head_axis`` over a (P, 2) mesh,
    against the same layer on one device: outputs and parameter gradients."""
    from jax.sharding import AxisType

    from nanoattn.linen import AttentionConfig, CausalSelfAttention

    T, D, heads = 8 * P, 32, 4
    ids = jnp.asarray(np.arange(T)[None].repeat(2, 0) // 5)  # documents of 5 tokens
    slopes = jnp.linspace(0.1, 0.4, heads)

    def mask_fn(b, n, q, k):  # per-head: head 0 sees only its document's last 2 tokens
        return (ids[b, q] == ids[b, k]) & ((n > 0) | (q - k <= 1))

    def score_fn(s, b, n, q, k):
        return s - slopes[n] * jnp.abs(q - k).astype(s.dtype)

    def make(**axes):
        cfg = AttentionConfig(d_model=D, n_heads=heads, n_kv_heads=2, sinks=True, **axes)
        return CausalSelfAttention(cfg)

    x = jnp.asarray(np.random.default_rng(3).standard_normal((2, T, D)), jnp.float32)
    one = make()
    params = one.init(jax.random.key(0), x)
    params = jax.tree.map(lambda p: p + 0.1, params)  # sinks away from zero

    def loss(module, params, x):
        out = module.apply(params, x, mask_fn=mask_fn, score_fn=score_fn)
        return jnp.sum(jnp.sin(out)), out

    want, want_grads = jax.value_and_grad(lambda p: loss(one, p, x), has_aux=True)(params)
    mesh = jax.make_mesh((P, 2), ("sp", "model"), axis_types=(AxisType.Auto,) * 2,
                         devices=jax.devices()[: 2 * P])  # fmt: skip
    sharded = make(sequence_axis="sp", head_axis="model")
    zig = jnp.asarray(to_layout(x, P, "zigzag"))
    order = np.asarray(to_layout(np.arange(T)[None], P, "zigzag"))[0]

    def zigzag_loss(p):  # the same loss, the sequence in zigzag order (a row's sum)
        out = sharded.apply(p, zig, mask_fn=zig_mask, score_fn=zig_score)
        return jnp.sum(jnp.sin(out)), out

    # mask_fn and score_fn see global positions either way: the same functions
    zig_mask, zig_score = mask_fn, score_fn
    with jax.set_mesh(mesh):
        got, got_grads = jax.jit(jax.value_and_grad(zigzag_loss, has_aux=True))(params)
    out_err = float(np.max(np.abs(np.asarray(got[1]) - np.asarray(want[1])[:, order])))
    errs = jax.tree.leaves(jax.tree.map(lambda a, b: float(np.max(np.abs(a - b))), got_grads,
                                        want_grads))  # fmt: skip
    scales = [float(np.max(np.abs(np.asarray(g)))) for g in jax.tree.leaves(want_grads)]
    return {"case": name, "out_err": out_err, "grad_err": max(errs), "grad_scale": min(scales),
            "out_scale": float(np.max(np.abs(np.asarray(want[1]))))}  # fmt: skip


def hlo_counts(name, P, layout, **options):
    """Collective-permutes the compiled forward pass executes (each op times the
    trip count of the loop it sits in) and all-gathers anywhere."""
    q, k, v, _ = inputs(4 * P)
    mesh = mesh_of(P)

    def fn(q, k, v):
        return ring_attention(q, k, v, axis_name="sp", mesh=mesh, layout=layout, **options)

    text = jax.jit(fn).lower(q, k, v).compile().as_text()
    return {
        "case": name, "P": P,
        "permutes": executed(text, "collective-permute("),
        "all_gathers": text.count("all-gather("),
    }  # fmt: skip


CALLEE = r"(?:body|to_apply|calls|branch_computations)=\{?%?([\w.\-]+)"


def executed(text: str, op: str) -> int:
    """How often ``op`` runs: its count in each computation, times the known trip
    count of the while loops that call that computation (nested loops multiply)."""
    comps, name = {}, None
    for line in text.splitlines():
        if line and not line.startswith(" ") and "{" in line and "(" in line:
            name = line.split()[1] if line.startswith("ENTRY") else line.split()[0]
            name = name.lstrip("%")
            comps[name] = []
        elif name is not None:
            comps[name].append(line)

    def runs(comp: str, seen=()) -> int:
        total = 0
        for line in comps.get(comp, []):
            total += line.count(op)
            for callee in re.findall(
                r"(?:body|to_apply|calls|branch_computations)=\{?%?([\w.\-]+)", line
            ):
                if callee in seen:
                    continue
                trips = 1
                if " while(" in line and "known_trip_count" in line:
                    trips = int(re.search(r'"known_trip_count":\{"n":"(\d+)"', line).group(1))
                total += trips * runs(callee, (*seen, comp))
        return total

    entry = next(n for n in comps if n.startswith("main") or "ENTRY" in n) if comps else None
    for line in text.splitlines():
        if line.startswith("ENTRY"):
            entry = line.split()[1].lstrip("%")
    return runs(entry)


def memory(name, P: int, T: int, layout: str = "zigzag", heads=(4, 2), H: int = 64):
    """Per-device temporary bytes of the compiled forward+backward (compiled, not
    run): the ring on P devices against the one-device flash kernel, causal."""
    N_, K_ = heads
    q = jax.ShapeDtypeStruct((1, T, N_, H), jnp.float32)
    k = jax.ShapeDtypeStruct((1, T, K_, H), jnp.float32)

    def grads(attend):
        def loss(q, k, v):
            return jnp.sum(attend(q, k, v) ** 2)

        return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))

    mesh = mesh_of(P)
    ring = grads(lambda q, k, v: ring_attention(
        q, k, v, axis_name="sp", mesh=mesh, layout=layout, is_causal=True))  # fmt: skip
    flash = grads(lambda q, k, v: nanoattn.flash_attention(q, k, v, is_causal=True))
    sizes = {}
    for label, fn in (("ring", ring), ("flash", flash)):
        analysis = fn.lower(q, k, k).compile().memory_analysis()
        sizes[label] = int(analysis.temp_size_in_bytes)
        sizes[label + "_args"] = int(analysis.argument_size_in_bytes)
    return {"case": name, "P": P, "T": T, **sizes}


def leak(name, P: int = 4, planted: bool = False):
    """nanoattn.verify.check_causality on the ring (zigzag, causal) as a layer of
    x (B, T, D): queries, keys and values are slices of x, permuted to the zigzag
    layout on the host. ``planted`` makes every other device's keys count as
    earlier, a leak across shard boundaries. Also counts, in the compiled
    program, the collective-permutes its forward pass executes and its
    all-gathers."""
    from nanoattn.parallel import _blocks
    from nanoattn.verify import check_causality

    mesh = mesh_of(P)
    T, D = 4 * P, (N + 2 * K) * H

    def layer(x):  # x (B, T, D) in zigzag order
        q, k, v = jnp.split(x, [N * H, (N + K) * H], axis=-1)
        q, k, v = (a.reshape(B, T, -1, H) for a in (q, k, v))
        out = ring_attention(q, k, v, axis_name="sp", mesh=mesh, is_causal=True)
        return out.reshape(B, T, N * H)

    honest = _blocks.earlier
    if planted:
        _blocks.earlier = lambda source, r: source != r
    try:
        compiled = jax.jit(layer).lower(jax.ShapeDtypeStruct((B, T, D), jnp.float32)).compile()
    finally:
        _blocks.earlier = honest
    # Returned as numpy: the check calls the compiled ring as given (once per probe)
    # and skips its gradient and eager sweeps, which would compile the ring again.
    report = check_causality(
        lambda x: from_layout(compiled(to_layout(x, P, "zigzag")), P, "zigzag"),
        d_model=D,
        seq_lens=(T,),
        batch=B,
    )
    text = compiled.as_text()
    return {
        "case": name, "P": P, "passed": bool(report.passed), "report": str(report)[-600:],
        "permutes": executed(text, "collective-permute("), "all_gathers": text.count("all-gather("),
    }  # fmt: skip


def layer_case(name, shape, names, framework="linen", **axes):
    """A layer whose config names mesh axes, on a mesh of ``shape``, against the
    same layer and parameters on one device; its compiled program's all-gathers
    and all-reduces. With ``sequence_axis`` the input is in zigzag order."""
    import flax.linen as nn
    from flax import nnx
    from jax.sharding import AxisType

    from nanoattn import linen as nl
    from nanoattn import nnx as nanonnx
    from nanoattn.parallel import logical_rules

    sizes = dict(d_model=48, n_heads=6, n_kv_heads=2, rope_base=10000.0)
    x = jnp.asarray(np.random.default_rng(1).standard_normal((B, 16, 48), np.float32))
    plain = nl.CausalSelfAttention(nl.AttentionConfig(**sizes))
    params = jax.jit(lambda key: plain.init(key, x, deterministic=True))(jax.random.key(0))
    expected = jax.jit(lambda p, x: plain.apply(p, x, deterministic=True))(params, x)
    devices = jax.devices()[: int(np.prod(shape))]
    mesh = jax.make_mesh(shape, names, axis_types=(AxisType.Auto,) * len(shape), devices=devices)
    cfg = nl.AttentionConfig(**sizes, **axes)
    P = mesh.shape.get(axes.get("sequence_axis"), 1)
    x_in = to_layout(x, P, "zigzag") if "sequence_axis" in axes else x
    with jax.set_mesh(mesh):
        if framework == "linen":
            layer = nl.CausalSelfAttention(cfg)
            boxed = jax.eval_shape(lambda: layer.init(jax.random.key(0), x, deterministic=True))
            specs = nn.get_partition_spec(boxed)
            shardings = nn.logical_to_mesh_sharding(specs, mesh, logical_rules("model"))
            placed = jax.device_put(params, shardings)

            def apply(p, x):
                return layer.apply(p, x, deterministic=True)
        else:
            model = nanonnx.from_linen(cfg, params, rngs=nnx.Rngs(0))
            graph, state = nnx.split(model)
            logical = nnx.get_partition_spec(state)  # the parameters' logical names

            def is_spec(s):
                return isinstance(s, jax.sharding.PartitionSpec)

            specs = jax.tree.map(
                lambda s: nn.logical_to_mesh_axes(tuple(s), logical_rules("model")),
                logical,
                is_leaf=is_spec,
            )
            shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=is_spec)
            placed = jax.device_put(state, shardings)

            def apply(state, x):
                return nnx.merge(graph, state)(x, deterministic=True)

        compiled = jax.jit(apply).lower(placed, x_in).compile()
        y = np.asarray(compiled(placed, x_in))
    if "sequence_axis" in axes:
        y = from_layout(y, P, "zigzag")
    text = compiled.as_text()
    return {
        "case": name, "err": float(np.max(np.abs(y - np.asarray(expected)))),
        "all_gathers": text.count("all-gather("), "all_reduces": text.count("all-reduce("),
        "out_kernel": str(jax.tree.leaves(
            specs, is_leaf=lambda s: isinstance(s, jax.sharding.PartitionSpec))[1]),
    }  # fmt: skip


def rope_layer(name, P: int = 2, layout: str = "zigzag"):
    """The causal layer with RoPE and ``sequence_axis`` over P devices, its input in
    ``layout`` order, against the same layer and parameters on one device. Every
    token must be rotated by its true position, not by its slot in the layout's
    order (T = 20 over P = 2: the zigzag order is 0-4, 15-19, 5-9, 10-14). Outputs
    only: the rotation's gradient is its transpose at the same positions, and the
    ring's gradients inside shard_map are the ring cases' (a backward pass would
    double the compile time)."""
    from jax.sharding import AxisType

    from nanoattn import linen as nl

    T, D = 20, 48
    sizes = dict(d_model=D, n_heads=6, n_kv_heads=2, rope_base=100.0)
    x = jnp.asarray(np.random.default_rng(5).standard_normal((B, T, D), np.float32))
    plain = nl.CausalSelfAttention(nl.AttentionConfig(**sizes))
    params = jax.jit(lambda key: plain.init(key, x, deterministic=True))(jax.random.key(0))
    expected = jax.jit(lambda p, x: plain.apply(p, x, deterministic=True))(params, x)
    cfg = nl.AttentionConfig(**sizes, sequence_axis="sp", sequence_layout=layout)
    layer = nl.CausalSelfAttention(cfg)
    mesh = jax.make_mesh((P,), ("sp",), axis_types=(AxisType.Auto,), devices=jax.devices()[:P])
    with jax.set_mesh(mesh):
        y = jax.jit(lambda p, x: layer.apply(p, x, deterministic=True))(
            params, to_layout(x, P, layout)
        )
    y = from_layout(y, P, layout)
    return {
        "case": name, "P": P, "layout": layout,
        "err": float(np.max(np.abs(np.asarray(y) - np.asarray(expected)))),
        "out_scale": float(np.max(np.abs(np.asarray(expected)))),
    }  # fmt: skip


def replicated_kv(name, P: int = 2, implementation: str = "flash"):
    """The kernel (not the ring) inside shard_map over P devices: queries split over
    the batch, keys, values and a bias replicated (no bias for native, which does not
    serve one). Their gradients must be the sum of every device's part (the transpose
    of the implicit broadcast), as jax's own autodiff of the reference gives."""
    from jax.sharding import AxisType
    from jax.sharding import PartitionSpec as Spec

    mesh = jax.make_mesh((P,), ("x",), axis_types=(AxisType.Auto,), devices=jax.devices()[:P])
    rng = np.random.default_rng(3)
    q = rng.standard_normal((2 * P, 9, N, H), np.float32)
    k, v = (rng.standard_normal((2, 9, K, H), np.float32) for _ in range(2))
    bias = rng.standard_normal((1, N, 9, 9), np.float32)
    with_bias = implementation != "native"  # both calls alike

    def grads(implementation):
        def loss(q, k, v, bias):
            given = dict(bias=bias) if with_bias else {}
            out = nanoattn.dot_product_attention(
                q, k, v, is_causal=True, implementation=implementation, **given
            )
            return jnp.sum(out * out)

        def per_device(q, k, v, bias):
            return jax.grad(loss, argnums=(0, 1, 2, 3))(q, k, v, bias)

        specs = (Spec("x"), Spec(), Spec(), Spec())
        return jax.jit(jax.shard_map(per_device, mesh=mesh, in_specs=specs, out_specs=specs))(
            q, k, v, bias
        )

    kernel, xla = grads(implementation), grads("xla")
    if implementation == "native":  # no bias: q, k, v only
        kernel, xla = kernel[:3], xla[:3]
    errs = [float(np.max(np.abs(np.asarray(a) - np.asarray(b)))) for a, b in zip(kernel, xla)]
    return {"case": name, "P": P, "grad_errs": errs,
            "grad_scales": [float(np.max(np.abs(np.asarray(b)))) for b in xla]}  # fmt: skip


CASES = [
    lambda: compare("p8-zigzag-causal-lengths-segments", 8, "zigzag", is_causal=True,
                    lengths=True, ids=True),
    lambda: compare("p4-contiguous-full-lengths-segments", 4, "contiguous", lengths=True,
                    ids=True),
    # documents on chunk edges: the ring skips the pairs between them, and the chunk
    # the lengths leave empty (tests/parallel/test_ring_segments.py counts the skips)
    lambda: compare("p4-contiguous-causal-window-chunk-documents", 4, "contiguous", T=12,
                    is_causal=True, window=(4, 0), lengths=True, ids="chunks"),
    lambda: compare("p2-zigzag-causal-value-width", 2, "zigzag", is_causal=True, lengths=True,
                    value_width=5),  # values narrower than keys (docs/latent.md)
    # Windows whose edges fall inside chunk pairs, C = 3 (test_parallel.py checks that
    # each reaches wholly visible pairs, pairs on an edge, one with a single visible
    # cell, and skipped pairs).
    lambda: compare("p8-contiguous-window-edges", 8, "contiguous", T=24, window=(7, 4)),
    lambda: compare("p2-zigzag-causal-window-edges", 2, "zigzag", T=12, is_causal=True,
                    window=(7, 0)),
    lambda: rope_layer("layer-sequence-rope-linen"),
    lambda: leak("leak-honest"),
    lambda: leak("leak-planted", planted=True),
    lambda: layer_case("layer-heads-linen", (2,), ("model",), head_axis="model"),
    lambda: replicated_kv("flash-replicated-kv"),
    lambda: replicated_kv("native-replicated-kv", implementation="native"),
    # blocks of 8 in chunks of 12: several (padded) blocks per chunk pair, each with its
    # kind, and score_fn traced at the blocks, not the chunks (a bug the fuzz found)
    lambda: masked("mask-p2-zigzag-documents-relative-sinks", 2, "zigzag", "documents", T=48,
                   score="relative", sinks=True, hidden=(21, 28), tiles=(8, 8, 2)),
]  # fmt: skip


def _grid_case(P: int, layout: str, causal: bool):
    name = f"grid-p{P}-{layout}-{'causal' if causal else 'full'}"
    return lambda: compare(name, P, layout, is_causal=causal)


SLOW_CASES = (
    [
        lambda: compare("p4-zigzag-causal-bf16", 4, "zigzag", dtype=jnp.bfloat16, is_causal=True),
        lambda: hlo_counts("hlo-p8-zigzag-causal", 8, "zigzag", is_causal=True),
        lambda: memory("memory-p8-t65536", 8, 65536),
        lambda: layer_case(
            "layer-2d-linen", (2, 2), ("sp", "model"), head_axis="model", sequence_axis="sp"
        ),
        lambda: layer_case("layer-heads-nnx", (2,), ("model",), "nnx", head_axis="model"),
    ]
    + [
        _grid_case(P, layout, causal)
        for P in (2, 4, 8)
        for layout in ("zigzag", "contiguous")
        for causal in (True, False)
    ]
    + [
        lambda: compare("p2-zigzag-window-two-sided", 2, "zigzag", T=16, window=(3, 6)),
        # a causal window on 2 contiguous chunks (fast: on 4 with documents, test_parallel)
        lambda: compare(
            "p2-contiguous-causal-window", 2, "contiguous", T=16, is_causal=True, window=(5, 0)
        ),
        lambda: compare(
            "p4-zigzag-causal-window-edges",
            4,
            "zigzag",
            T=24,
            is_causal=True,
            window=(7, 0),
            lengths=True,
            ids=True,
        ),
        # the ring's programs with mask_fn are large (a switch over five pair kinds per
        # chunk pair): beyond CASES' static P = 2 case, these run with make test-all
        lambda: masked(
            "mask-p2-contiguous-prefix-traced-nan",
            2,
            "contiguous",
            "prefix",
            T=36,
            traced=True,
            hidden=(24, 30),
        ),
        lambda: masked_layer("mask-layer-sequence-heads"),
        lambda: masked(
            "mask-p4-zigzag-documents-alibi-sinks",
            4,
            "zigzag",
            "documents",
            T=72,
            score="alibi",
            sinks=True,
            hidden=(21, 28),
        ),
        lambda: masked(
            "mask-p4-zigzag-stripes-window-traced",
            4,
            "zigzag",
            "stripes",
            T=56,
            traced=True,
            window=(13, 0),
            sinks=True,
        ),
        lambda: compare(
            "p4-zigzag-causal-window-chunk-documents",
            4,
            "zigzag",
            T=24,
            is_causal=True,
            window=(10, 0),
            lengths=True,
            ids="chunks",
        ),
        lambda: compare(
            "p4-zigzag-soft-cap-lengths",
            4,
            "zigzag",
            is_causal=True,
            logit_soft_cap=2.0,
            lengths=True,
        ),
    ]
)


def main(argv):
    cases = SLOW_CASES if "--slow" in argv else CASES
    only = [a for a in argv if not a.startswith("--")]
    for case in cases:
        start = time.perf_counter()
        try:
            result = case()
            result["wall"] = round(time.perf_counter() - start, 2)
        except Exception:
            result = {"case": "?", "error": traceback.format_exc()}
        if only and result["case"] not in only:
            continue
        print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
