"""Bitwise snapshots of a fixed set of public calls, to prove a refactor changes nothing.

    python tools/golden.py record  .cache/golden-before.npz   # before the change
    python tools/golden.py compare .cache/golden-before.npz   # after it: exit 1 on a change

Every call goes through the public API only (``nanoattn``, ``nanoattn.linen``,
``nanoattn.nnx``, ``nanoattn.parallel``), so the same script runs on both sides of a
refactor that moves private code. The set: every backend this machine has, forward
and backward (dq, dk, dv and the gradients of bias, sinks and score_fn's arrays),
over the rules of a call (causality with static and traced offsets, windows, key
lengths, segment ids, a dense mask and bias, soft-cap, mask_fn static and traced,
score_fn, sinks, the log-sum-exp, GQA, unbatched calls); the linen and NNX layers
(training forward, gradients of the parameters, decoding on a full and on a rolling
cache with sink tokens, rewind); paged_attention on every backend (forward and
gradients, quantized pages, values of their own width) and paged linen (float and
int8) and latent layers decoding through a PageAllocator with a fork and a rewind;
the adapters; merge_attention; and the ring on 4 simulated devices (run in a
subprocess with its own ``XLA_FLAGS``).

Documented nondeterminism (docs/conventions.md): the native kernel's dq is summed in
the order its workers finish, so ``native`` dq entries are compared to 1e-6 relative
instead of bitwise, and reported apart.
"""

import os
import subprocess
import sys

import numpy as np

NONDETERMINISTIC = ("/native/", "dq")  # a key holding both is compared with a tolerance


def _arrays(prefix, tree, out):
    import jax

    leaves = jax.tree_util.tree_leaves_with_path(tree)
    for path, leaf in leaves:
        out[prefix + jax.tree_util.keystr(path)] = np.asarray(leaf)


def _functional(out):
    import jax
    import jax.numpy as jnp

    import nanoattn

    rng = np.random.default_rng(0)
    B, T, S, N, K, H = 2, 37, 41, 6, 2, 16
    q = jnp.asarray(rng.standard_normal((B, T, N, H)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((B, S, K, H)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((B, S, K, H)), jnp.float32)
    probe = jnp.asarray(rng.standard_normal((B, T, N, H)), jnp.float32)
    bias = jnp.asarray(rng.standard_normal((1, N, T, S)), jnp.float32)
    mask = jnp.asarray(rng.random((B, 1, T, S)) < 0.8)
    lengths = jnp.asarray([29, 41], jnp.int32)
    q_ids = jnp.asarray((np.arange(T)[None] >= np.array([[15], [30]])).astype(np.int32))
    kv_ids = jnp.asarray((np.arange(S)[None] >= np.array([[17], [33]])).astype(np.int32))
    sinks = jnp.asarray(rng.standard_normal((N,)), jnp.float32)
    table = jnp.asarray(rng.standard_normal((N, 2 * S)), jnp.float32)
    docs = jnp.asarray((np.arange(S + 8) // 13).astype(np.int32))

    def doc_mask(b, n, qp, kp):
        return docs[qp] == docs[kp]

    def rel_score(s, b, n, qp, kp):
        return s + table[n, jnp.clip(qp - kp + S, 0, 2 * S - 1)]

    cases = {
        "plain": dict(),
        "causal": dict(is_causal=True, q_offset=S - T),
        "causal_traced_offset": dict(is_causal=True, q_offset="traced"),
        "window": dict(is_causal=True, q_offset=4, window=(7, 0)),
        "window_two_sided": dict(q_offset=2, window=(5, 3)),
        "lengths": dict(is_causal=True, q_offset=S - T, kv_lengths=lengths),
        "segments": dict(q_segment_ids=q_ids, kv_segment_ids=kv_ids),
        "mask_bias": dict(mask=mask, bias="bias"),
        "soft_cap": dict(is_causal=True, q_offset=S - T, logit_soft_cap=5.0),
        "mask_fn": dict(mask_fn=doc_mask, is_causal=True, q_offset=S - T),
        "score_fn": dict(score_fn=rel_score, q_offset=3),
        "sinks": dict(sinks="sinks", is_causal=True, q_offset=S - T),
        "residual": dict(return_residual=True, is_causal=True, q_offset=S - T, window=(9, 0)),
        "everything": dict(
            is_causal=True,
            q_offset=S - T,
            kv_lengths=lengths,
            logit_soft_cap=7.0,
            mask_fn=doc_mask,
            sinks="sinks",
            return_residual=True,
        ),
    }
    backends = ["xla", "flash", "native"]
    for name, rules in cases.items():
        for backend in backends:
            rules = dict(rules)
            traced = rules.get("q_offset") == "traced"
            has_bias, has_sinks = rules.pop("bias", None), rules.pop("sinks", None)

            def loss(
                q, k, v, bias, sinks, offset, rules=rules, backend=backend, traced=traced,
                has_bias=has_bias, has_sinks=has_sinks,
            ):  # fmt: skip
                extra = dict(rules)
                if traced:
                    extra["q_offset"] = offset
                if has_bias:
                    extra["bias"] = bias
                if has_sinks:
                    extra["sinks"] = sinks
                res = nanoattn.dot_product_attention(q, k, v, implementation=backend, **extra)
                out = res[0] if isinstance(res, tuple) else res
                total = jnp.sum(out * probe)
                if isinstance(res, tuple):
                    total = total + jnp.sum(jnp.where(jnp.isfinite(res[1]), res[1], 0))
                return total, res

            args = (q, k, v, bias, sinks, jnp.asarray([S - T, 1], jnp.int32))
            try:
                grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4), has_aux=True))
                grads, res = grad(*args)
            except ValueError as error:  # the backend cannot serve it: record the refusal
                out[f"functional/{backend}/{name}/refused"] = np.asarray(str(error))
                continue
            _arrays(f"functional/{backend}/{name}/out", res, out)
            names = ("dq", "dk", "dv", "dbias", "dsinks")
            for gname, g in zip(names, grads):
                if (gname == "dbias" and not has_bias) or (gname == "dsinks" and not has_sinks):
                    continue
                out[f"functional/{backend}/{name}/{gname}"] = np.asarray(g)
    # score_fn's closed-over array gets a gradient
    for backend in ("xla", "flash"):

        def by_table(table, backend=backend):
            def fn(s, b, n, qp, kp):
                return s + table[n, jnp.clip(qp - kp + S, 0, 2 * S - 1)]

            o = nanoattn.dot_product_attention(
                q, k, v, score_fn=fn, is_causal=True, q_offset=S - T, implementation=backend
            )
            return jnp.sum(o * probe)

        out[f"functional/{backend}/score_table/dtable"] = np.asarray(
            jax.jit(jax.grad(by_table))(table)
        )
    # traced mask_fn (closes over a traced array under jit)
    for backend in backends:

        def traced_docs(docs, backend=backend):
            return nanoattn.dot_product_attention(
                q, k, v, mask_fn=lambda b, n, qp, kp: docs[qp] == docs[kp], is_causal=True,
                q_offset=S - T, implementation=backend,
            )  # fmt: skip

        out[f"functional/{backend}/traced_mask_fn/out"] = np.asarray(jax.jit(traced_docs)(docs))
    # bfloat16, unbatched, weights, flash tiles, merge, adapters
    qb, kb, vb = (x.astype(jnp.bfloat16) for x in (q, k, v))
    for backend in backends:
        o = nanoattn.dot_product_attention(
            qb, kb, vb, is_causal=True, q_offset=S - T, implementation=backend
        )
        out[f"functional/{backend}/bf16/out"] = np.asarray(o.astype(jnp.float32))
        o = nanoattn.dot_product_attention(q[0], k[0], v[0], is_causal=True, q_offset=S - T)
        out[f"functional/{backend}/unbatched/out"] = np.asarray(o)
    out["functional/weights"] = np.asarray(
        nanoattn.attention_weights(q, k, is_causal=True, q_offset=S - T, sinks=sinks)
    )
    out["functional/flash_tiles"] = np.asarray(
        nanoattn.flash_attention(
            q,
            k,
            v,
            is_causal=True,
            q_offset=S - T,
            forward_tiles=(8, 16, 2),
            backward_tiles=(16, 8, 3),
        )
    )
    parts = [
        nanoattn.dot_product_attention(
            q, k[:, a:b], v[:, a:b], return_residual=True, implementation="xla"
        )
        for a, b in ((0, 20), (20, S))
    ]
    _arrays("functional/merge", nanoattn.merge_attention(*zip(*parts)), out)
    out["functional/jax_nn"] = np.asarray(
        nanoattn.jax_nn_attention(q, k, v, is_causal=False, bias=bias)
    )
    flax_out = nanoattn.flax_attention_fn(q[:, :, :K], k, v, mask=mask, deterministic=True)
    out["functional/flax_fn"] = np.asarray(flax_out)


def _layers(out):
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from nanoattn import linen
    from nanoattn import nnx as nanonnx

    rng = np.random.default_rng(1)
    B, T, D, N, KV = 2, 23, 48, 6, 2
    x = jnp.asarray(rng.standard_normal((B, T, D)), jnp.float32)
    configs = {
        "plain": dict(),
        "gqa_rope_norm": dict(n_kv_heads=KV, rope_base=10000.0, qk_norm=True),
        "window_sinks": dict(window=(5, 0), sinks=True, logit_soft_cap=20.0),
        "rolling": dict(window=(5, 0), rolling_cache=True, sink_tokens=2, n_kv_heads=KV),
    }
    for name, options in configs.items():
        cfg = linen.AttentionConfig(D, N, **options)
        layer = linen.CausalSelfAttention(cfg)
        cap = 13 if cfg.rolling_cache else T + 3
        variables = layer.init(jax.random.key(0), jnp.zeros((B, cap, D)), True, decode=True)
        params = jax.tree.map(
            lambda a: jnp.asarray(rng.standard_normal(a.shape) * 0.3, a.dtype),
            variables["params"],
        )
        full = jax.jit(lambda p, x, layer=layer: layer.apply({"params": p}, x, True))(params, x)
        out[f"layers/linen/{name}/forward"] = np.asarray(full)

        def square(p, layer=layer):
            return jnp.sum(layer.apply({"params": p}, x, True) ** 2)

        grads = jax.jit(jax.grad(square))(params)
        _arrays(f"layers/linen/{name}/dparams", grads, out)

        @jax.jit
        def step(params, cache, chunk, lengths, layer=layer):
            y, state = layer.apply(
                {"params": params, "cache": cache}, chunk, True, decode=True, lengths=lengths,
                mutable=["cache"],
            )  # fmt: skip
            return y, state["cache"]

        cache = variables["cache"]
        width = 4
        pos, got = 0, []
        sizes = [3, 4, 1, 2, 4, 4, 1, 4]
        while pos < T:
            n = min(sizes[len(got) % len(sizes)], T - pos)
            chunk = jnp.zeros((B, width, D)).at[:, :n].set(x[:, pos : pos + n])
            y, cache = step(params, cache, chunk, jnp.full((B,), n, jnp.int32))
            got.append(np.asarray(y[:, :n]))
            pos += n
        out[f"layers/linen/{name}/decoded"] = np.concatenate(got, axis=1)
        _arrays(f"layers/linen/{name}/cache", cache, out)
        rewound = linen.rewind({"cache": cache}, 1)
        _arrays(f"layers/linen/{name}/rewound", rewound, out)
        module = nanonnx.from_linen(cfg, {"params": params}, rngs=nnx.Rngs(0))
        out[f"layers/nnx/{name}/forward"] = np.asarray(
            nnx.jit(lambda m, x: m(x, deterministic=True))(module, x)
        )
        module.init_cache(B, cap)

        @nnx.jit
        def nnx_step(module, chunk):
            return module(chunk, decode=True, deterministic=True)

        got = [np.asarray(nnx_step(module, x[:, i : i + 5])) for i in range(0, T, 5)]
        out[f"layers/nnx/{name}/decoded"] = np.concatenate(got, axis=1)
    cross = linen.CrossAttention(linen.AttentionConfig(D, N, n_kv_heads=KV))
    ctx = jnp.asarray(rng.standard_normal((B, 17, D)), jnp.float32)
    variables = cross.init(jax.random.key(1), x, ctx, True)
    out["layers/linen/cross"] = np.asarray(cross.apply(variables, x, ctx, True))


RING_SCRIPT = r"""
import os, sys
import numpy as np
import jax, jax.numpy as jnp
from jax.sharding import Mesh
from nanoattn.parallel import ring_attention, to_zigzag
rng = np.random.default_rng(2)
B, T, N, K, H, P = 2, 32, 6, 3, 8, 4
q, k, v, probe = (jnp.asarray(rng.standard_normal((B, T, h, H)), jnp.float32) for h in (N, K, K, N))
mesh = Mesh(np.array(jax.devices()[:P]), ("sp",))
docs = jnp.asarray((np.arange(T) // 11).astype(np.int32))
table = jnp.asarray(rng.standard_normal((N, 2 * T)), jnp.float32)
sinks = jnp.asarray(rng.standard_normal((N,)), jnp.float32)
cases = {
    "causal": dict(is_causal=True),
    "window": dict(is_causal=True, window=(5, 0), layout="contiguous"),
    "lengths_segments": dict(kv_lengths=jnp.asarray([29, 32]), q_segment_ids=(docs % 2),
                             kv_segment_ids=(docs % 2)),
    "mask_fn_score_sinks": dict(is_causal=True, mask_fn=lambda b, n, qp, kp: docs[qp] == docs[kp],
        score_fn=lambda s, b, n, qp, kp: s + table[n, qp - kp + T], sinks=sinks,
        return_residual=True),
}
out = {}
for name, rules in cases.items():
    rules = dict(rules)
    for ids in ("q_segment_ids", "kv_segment_ids"):
        if ids in rules:
            rules[ids] = jnp.broadcast_to(rules[ids], (B, T))
    def loss(q, k, v, rules=rules):
        res = ring_attention(q, k, v, axis_name="sp", mesh=mesh, forward_tiles=(4, 4, 2),
                             backward_tiles=(4, 4, 2), **rules)
        o = res[0] if isinstance(res, tuple) else res
        return jnp.sum(o * probe), res
    grads, res = jax.jit(jax.grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)
    leaves = res if isinstance(res, tuple) else (res,)
    for i, leaf in enumerate(leaves):
        out[f"ring/{name}/out{i}"] = np.asarray(leaf)
    for gname, g in zip(("dq", "dk", "dv"), grads):
        out[f"ring/{name}/{gname}"] = np.asarray(g)
np.savez(sys.argv[1], **out)
"""


def _ring(out, scratch):
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4")
    os.makedirs(os.path.dirname(scratch) or ".", exist_ok=True)
    path = scratch + ".ring.npz"
    subprocess.run([sys.executable, "-c", RING_SCRIPT, path], check=True, env=env)
    with np.load(path) as ring:
        out.update({k: ring[k] for k in ring.files})
    os.remove(path)


def _paged(out):
    """paged_attention on every backend (forward, and gradients where served) over a
    mixed batch with each rule a paged call takes, quantized pages, values of their own
    width; a paged linen layer (float and int8) and the latent layer's paged cache
    decoding through a PageAllocator with a fork and a rewind."""
    import jax
    import jax.numpy as jnp

    import nanoattn
    from nanoattn.linen import (
        AttentionConfig,
        CausalSelfAttention,
        LatentAttention,
        LatentConfig,
    )

    rng = np.random.default_rng(1)
    P, PS, K, N, H = 13, 5, 2, 6, 8
    lengths = np.array([37, 1, 13, 9], np.int32)
    q_lens = np.array([5, 1, 0, 9], np.int32)
    starts = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    table = np.full((4, 8), -1, np.int32)
    order = rng.permutation(P)
    at = 0
    for b, n in enumerate(lengths):
        m = -(-int(n) // PS)
        table[b, :m] = order[at : at + m] if at + m <= P else order[:m]
        at += m
    Tq = int(starts[-1]) + 2
    q = jnp.asarray(rng.standard_normal((Tq, N, H)), jnp.float32)
    kp = jnp.asarray(rng.standard_normal((P, PS, K, H)), jnp.float32)
    vp = jnp.asarray(rng.standard_normal((P, PS, K, H)), jnp.float32)
    v5 = jnp.asarray(rng.standard_normal((P, PS, K, 5)), jnp.float32)
    sinks = jnp.asarray(rng.standard_normal((N,)), jnp.float32)
    args = (jnp.asarray(table), jnp.asarray(lengths), jnp.asarray(starts))
    kq, ks = nanoattn.quantize_kv(kp, "int8")
    vq, vs = nanoattn.quantize_kv(vp, "int8")
    cases = {
        "causal": dict(),
        "window_cap_sinks": dict(window=(6, 0), logit_soft_cap=3.0, sinks=sinks),
        "bidirectional": dict(is_causal=False, return_residual=True),
        "mask_fn": dict(mask_fn=lambda b, n, qp, kp: (kp + b + n) % 3 != 0),
    }
    for backend in ("xla", "flash", "native"):
        for name, rules in cases.items():

            def loss(q, kp, vp, rules=rules, backend=backend):
                res = nanoattn.paged_attention(q, kp, vp, *args, implementation=backend, **rules)
                o = res[0] if isinstance(res, tuple) else res
                return jnp.sum(o * jnp.cos(o)), res

            try:
                grads, res = jax.jit(jax.grad(loss, argnums=(0, 1, 2), has_aux=True))(q, kp, vp)
            except ValueError as error:
                out[f"paged/{backend}/{name}/refused"] = np.asarray(str(error))
                continue
            _arrays(f"paged/{backend}/{name}/out", res, out)
            for gname, g in zip(("dq", "dk", "dv"), grads):
                out[f"paged/{backend}/{name}/{gname}"] = np.asarray(g)
        for name, extra in (("int8", (kq, vq, dict(key_scales=ks, value_scales=vs))),
                            ("value_width", (kp, v5, {}))):  # fmt: skip
            try:
                o = nanoattn.paged_attention(q, extra[0], extra[1], *args,
                                             implementation=backend, **extra[2])  # fmt: skip
            except ValueError as error:
                out[f"paged/{backend}/{name}/refused"] = np.asarray(str(error))
                continue
            out[f"paged/{backend}/{name}/out"] = np.asarray(o)

    def decode(layer, D, name, pool_pages=9, ps=3):
        x = jnp.asarray(rng.standard_normal((3, 12, D)), jnp.float32)
        variables = layer.init(jax.random.key(2), jnp.zeros((1, pool_pages * ps, D)), decode=True)
        params, pool = {"params": variables["params"]}, variables["cache"]
        pool = jax.tree.map(lambda a: jnp.full(a.shape, jnp.nan, a.dtype)
                            if a.dtype == jnp.float32 else a, pool)  # fmt: skip
        alloc = nanoattn.PageAllocator(pool_pages, ps, max_sequences=3, max_pages=6, seed=3)

        def step(rows, tokens, pool):
            batch = alloc.batch([(s, n) for s, n, _ in rows], tokens)
            chunk = jnp.concatenate([x[s, a : a + n] for s, n, a in rows if n], axis=0)
            chunk = jnp.pad(chunk, ((0, tokens - chunk.shape[0]), (0, 0)))[None]
            y, state = layer.apply({**params, "cache": pool}, chunk, decode=True, pages=batch,
                                   mutable=["cache"])  # fmt: skip
            alloc.confirm(batch)
            return np.asarray(y), state["cache"]

        alloc.allocate(0, 5)
        alloc.allocate(1, 4)
        y1, pool = step([(0, 5, 0), (1, 4, 0)], 10, pool)
        alloc.fork(0, 2)
        alloc.extend(2, 2)
        alloc.extend(0, 1)
        y2, pool = step([(2, 2, 5), (0, 1, 5)], 10, pool)
        alloc.rewind(2, 1)
        alloc.extend(2, 3)
        y3, pool = step([(2, 3, 6)], 10, pool)
        for i, y in enumerate((y1, y2, y3)):
            out[f"paged_layer/{name}/y{i}"] = y

    D = 24
    for dtype in (None, "int8"):
        cfg = AttentionConfig(D, 6, n_kv_heads=2, rope_base=100.0, page_size=3,
                              kv_cache_dtype=dtype)  # fmt: skip
        decode(CausalSelfAttention(cfg), D, f"linen_{dtype}")
    latent = LatentConfig(d_model=16, n_heads=2, kv_lora_rank=7, qk_nope_head_dim=3,
                          qk_rope_head_dim=4, v_head_dim=5, page_size=3)  # fmt: skip
    decode(LatentAttention(latent), 16, "latent")


def snapshot(scratch: str) -> dict:
    out = {}
    _functional(out)
    _layers(out)
    _paged(out)
    _ring(out, scratch)
    return out


def compare(before: dict, after: dict) -> list[str]:
    problems = []
    for key in sorted(set(before) | set(after)):
        if key not in after or key not in before:
            problems.append(f"{key}: only {'before' if key in before else 'after'}")
            continue
        a, b = before[key], after[key]
        if a.shape != b.shape or a.dtype != b.dtype:
            problems.append(f"{key}: {a.dtype}{a.shape} -> {b.dtype}{b.shape}")
        elif a.dtype.kind in "US":
            if not np.array_equal(a, b):
                problems.append(f"{key}: {a} -> {b}")
        elif all(part in key for part in NONDETERMINISTIC):
            if not np.allclose(a, b, rtol=1e-6, atol=1e-7, equal_nan=True):
                problems.append(f"{key}: differs beyond the summation order's rounding")
        elif a.tobytes() != b.tobytes():
            diff = np.nanmax(np.abs(a.astype(np.float64) - b.astype(np.float64)))
            problems.append(f"{key}: not bitwise equal (max |diff| {diff:.3g})")
    return problems


def main(argv):
    if len(argv) != 3 or argv[1] not in ("record", "compare"):
        raise SystemExit(__doc__)
    mode, path = argv[1], argv[2]
    after = snapshot(path)
    if mode == "record":
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        np.savez(path, **after)
        print(f"recorded {len(after)} arrays in {path}")
        return 0
    with np.load(path) as saved:
        before = {k: saved[k] for k in saved.files}
    problems = compare(before, after)
    for line in problems:
        print(line)
    print(f"{len(before)} arrays before, {len(after)} after, {len(problems)} differ")
    return 1 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv))
