"""Masks as functions (issue #23): ``mask_fn``, block sparsity and sinks against the
calls they replace or extend, each pair timed in turn in one process.

Three cases, on each backend of :data:`BACKENDS`, forward and forward+backward, at
B = 1 with 4 heads of width 32 (the seed's shape), float32:

* ``documents``: 8 documents of uneven lengths packed in one row, causal within
  each, through ``mask_fn`` (the ids closed over as a jax array) against the same
  mask through ``is_causal`` with ``q_segment_ids``/``kv_segment_ids``.
  Targets: ``mask_fn`` takes at most 1.2x the time of the segment ids (issue #23), and
  the segment ids at most 1.2x the time of ``mask_fn`` (issue #34: they skip blocks too).
* ``block-sparse``: a ``mask_fn`` keeping 25% of the causal blocks (a fixed
  pseudo-random choice closed over as a jax array, ANDed with causality)
  against full causal attention. Target: at most 35% of the causal time. The
  pattern's blocks are 512 x 512 (:data:`SPARSE_BLOCK`), whole multiples of the
  flash kernel's blocks at this shape (forward 256 x 512, backward 128 x 128): a
  pattern of 64-blocks would leave nearly every 256 x 512 forward block partial,
  with nothing to skip.
* ``sinks``: causal attention with ``sinks`` (a differentiated (N,) argument, as a
  layer's parameter) and ``return_residual=True`` (the log-sum-exp in the loss)
  against the same call without them. Target: at most 5% more time.

Each pair is called once (compiling it, and finding whether the backend serves
it), then timed in turn, subject then baseline, round after round
(:func:`~nanoattn.bench._measure.time_interleaved`), so that load on a shared
machine falls on both alike. A backend that does not serve a call (the native
kernel and ``mask_fn``, until it serves it) gets a row saying so instead of a
number; once ``implementation=...`` accepts the call it is measured, with no
change here. The targets are judged at T = :data:`LENGTH` only.
"""

import jax
import jax.numpy as jnp
import numpy as np

from .._base.validate import describe
from .._core.api import dot_product_attention
from ._cell import inputs
from ._measure import time_interleaved

LENGTH = 8192  # where the targets are judged
QUICK_LENGTH = 1024
BACKENDS = ("flash", "native")
CASES = ("documents", "block-sparse", "sinks")
N, H, B = 4, 32, 1  # the seed's heads, batch 1
DOCUMENTS = 8
SPARSE_BLOCK = 512
KEPT = 0.25  # of the causal blocks, in the block-sparse case
ROUNDS = 5  # the bounds are 5% apart from parity (sinks): 3 rounds left a median 10% off
BOUNDS = {"documents": 1.2, "block-sparse": 0.35, "sinks": 1.05}  # subject / baseline
SEGMENTS_BOUND = 1.2  # documents: segment ids / mask_fn (the baseline over the subject)
SUBJECTS = {  # case: (subject, baseline, what of the subject a backend may not serve)
    "documents": ("mask_fn", "segment ids", "mask_fn"),
    "block-sparse": ("mask_fn, 25% of the blocks", "causal", "mask_fn"),
    "sinks": ("sinks + return_residual", "causal", "sinks or return_residual"),
}
UNSERVED = "cannot serve this call: "  # how the dispatcher refuses a named backend


def document_ids(T: int, documents: int = DOCUMENTS, seed: int = 0) -> np.ndarray:
    """(T,) int32 ids of ``documents`` consecutive documents of pseudo-random, uneven
    lengths (fewer when T < documents), the same for the same arguments."""
    cuts = np.random.default_rng(seed).choice(np.arange(1, T), min(documents, T) - 1, False)
    return np.searchsorted(np.sort(cuts), np.arange(T), side="right").astype(np.int32)


def sparse_block(T: int) -> int:
    """The block-sparse pattern's block: :data:`SPARSE_BLOCK`, or T / 4 when smaller
    (at least a 4 x 4 grid of blocks)."""
    return max(1, min(SPARSE_BLOCK, T // 4))


def kept_blocks(n_blocks: int, kept: float = KEPT, seed: int = 0) -> np.ndarray:
    """(n_blocks, n_blocks) bool: a fixed pseudo-random ``kept`` share of the causal
    blocks (query block >= key block, the diagonal included), at least one."""
    rows, cols = np.tril_indices(n_blocks)
    count = max(1, round(kept * rows.size))
    chosen = np.random.default_rng(seed).choice(rows.size, count, replace=False)
    keep = np.zeros((n_blocks, n_blocks), bool)
    keep[rows[chosen], cols[chosen]] = True
    return keep


def calls(case: str, T: int, n_heads: int = N) -> tuple[dict, dict, str]:
    """The subject's and the baseline's rules (keyword arguments of
    ``dot_product_attention``) for ``case`` at length T with ``n_heads`` query heads,
    and a line describing it."""
    if case == "documents":
        ids = jnp.asarray(document_ids(T))[None]  # (B, T)

        def same_document(b, n, q_pos, k_pos):
            return (ids[b, q_pos] == ids[b, k_pos]) & (k_pos <= q_pos)

        segments = dict(is_causal=True, q_segment_ids=ids, kv_segment_ids=ids)
        count = int(ids.max()) + 1
        return dict(mask_fn=same_document), segments, f"{count} documents, causal within each"
    if case == "block-sparse":
        size = sparse_block(T)
        keep = kept_blocks(-(-T // size))
        blocks = jnp.asarray(keep)

        def sparse(b, n, q_pos, k_pos):
            return blocks[q_pos // size, k_pos // size] & (k_pos <= q_pos)

        causal = int(np.tril(np.ones_like(keep)).sum())
        line = f"{int(keep.sum())} of {causal} causal blocks of {size} x {size} kept"
        return dict(mask_fn=sparse), dict(is_causal=True), line
    if case == "sinks":
        sinks = jnp.linspace(-1.0, 1.0, n_heads, dtype=jnp.float32)  # (N,)
        line = "causal; sinks (N,) differentiated, the log-sum-exp in the loss"
        return dict(is_causal=True, sinks=sinks, return_residual=True), dict(is_causal=True), line
    raise ValueError(f"case must be one of {', '.join(CASES)}, got {case!r}")


def attention_pass(rules: dict, implementation: str, backward: bool):
    """A jitted function of (q, k, v) and, with ``sinks`` among ``rules``, the sinks
    (an argument, as a layer's parameter, rather than the array in ``rules``): the
    attention's output (and log-sum-exp), or with ``backward`` the gradients of the
    sum of the output (and of the finite log-sum-exps) to every argument."""
    rules = dict(rules)
    has_sinks = rules.pop("sinks", None) is not None

    def attend(q, k, v, *sinks):
        extra = dict(sinks=sinks[0]) if has_sinks else {}
        return dot_product_attention(q, k, v, implementation=implementation, **rules, **extra)

    if not backward:
        return jax.jit(attend)

    def loss(*arrays):
        result = attend(*arrays)
        out, lse = result if isinstance(result, tuple) else (result, None)
        total = out.astype(jnp.float32).sum()
        if lse is not None:
            total = total + jnp.where(jnp.isfinite(lse), lse, 0).sum()
        return total

    return jax.jit(lambda *arrays: jax.grad(loss, tuple(range(len(arrays))))(*arrays))


def _unserved(error: ValueError) -> str | None:
    """The dispatcher's reason when ``error`` is its refusal of a named backend."""
    message = str(error)
    return message.split(UNSERVED, 1)[1].splitlines()[0] if UNSERVED in message else None


def refusal_of_first_call(run) -> str | None:
    """Calls ``run`` once (it compiles): None when it ran, the dispatcher's reason when
    the backend it names refuses the call; any other error propagates."""
    try:
        run()
    except ValueError as error:
        reason = _unserved(error)
        if reason is None:
            raise
        return reason
    return None


def measure_pair(
    case: str,
    backend: str,
    backward: bool,
    T: int = LENGTH,
    *,
    n_heads: int = N,
    head_dim: int = H,
    batch: int = B,
    dtype: str = "float32",
    rounds: int = ROUNDS,
) -> dict:
    """One case on one backend and pass: median and min ms of subject and baseline,
    and their ratio; or a status saying why not."""
    subject, baseline, feature = SUBJECTS[case]
    row = {
        "case": case, "subject": subject, "baseline": baseline, "backend": backend,
        "pass": "fwd+bwd" if backward else "fwd", "B": batch, "T": T, "N": n_heads,
        "H": head_dim, "dtype": dtype, "rounds": rounds, "bound": BOUNDS[case],
    }  # fmt: skip
    try:
        subject_rules, baseline_rules, row["detail"] = calls(case, T, n_heads)
        q, k, v = inputs(batch, T, n_heads, head_dim, dtype)
        runs = {}
        for name, rules, what in (
            ("subject", subject_rules, feature),
            ("baseline", baseline_rules, baseline),
        ):
            fn = attention_pass(rules, backend, backward)
            arrays = (q, k, v, rules["sinks"]) if "sinks" in rules else (q, k, v)
            run = lambda fn=fn, arrays=arrays: jax.block_until_ready(fn(*arrays))  # noqa: E731
            if reason := refusal_of_first_call(run):  # compiles, or the backend refuses
                return row | {"status": f"{backend} does not serve {what}", "reason": reason}
            runs[name] = run
        times = time_interleaved(runs, rounds=rounds, warmup=0)  # the calls above warmed up
    except Exception as e:  # reported in the table, not fatal to the rest of the bench
        return row | {"status": f"error: {describe(e)[:200]}"}
    for name, (median, best) in times.items():
        row[f"{name}_median_ms"] = median * 1e3
        row[f"{name}_min_ms"] = best * 1e3
    return row | {"status": "ok", "ratio": row["subject_median_ms"] / row["baseline_median_ms"]}


def jobs(T: int = LENGTH, backends=BACKENDS, passes=(False, True)) -> list[tuple[str, tuple]]:
    """(progress label, arguments of :func:`measure_pair`) for every case, backend and
    pass (``passes``: False for the forward, True for forward+backward)."""
    return [
        (f"{case} {backend} {'fwd+bwd' if backward else 'fwd'} T={T}", (case, backend, backward, T))
        for case in CASES
        for backend in backends
        for backward in passes
    ]


def measure_masks(
    T: int = LENGTH, *, backends=BACKENDS, passes=(False, True), progress=None, **options
) -> list[dict]:
    """Every row of :func:`jobs`; ``options`` go to :func:`measure_pair`, and
    ``progress(i, n, label)`` is called before each."""
    items = jobs(T, backends, passes)
    rows = []
    for i, (label, args) in enumerate(items):
        if progress:
            progress(i, len(items), label)
        rows.append(measure_pair(*args, **options))
    return rows


def _target(row: dict, segments: bool = False) -> str:
    what = f"masks {row['case']} {row['backend']} {row['pass']} T={row['T']}"
    if segments:
        return f"{what}: segment ids take <= {SEGMENTS_BOUND}x the time of mask_fn"
    if row["case"] == "block-sparse":
        return f"{what}: mask_fn keeping {KEPT:.0%} of the causal blocks takes <= 35% of causal"
    if row["case"] == "sinks":
        return f"{what}: sinks and return_residual cost <= 5% over the call without them"
    return f"{what}: mask_fn takes <= {row['bound']}x the time of segment ids"


def masks_targets(rows: list[dict]) -> list[dict]:
    """The targets, judged from the measured rows (None where a row has no ratio): one
    per row, and a second for a documents row (segment ids against mask_fn)."""
    out = []
    for row in rows:
        ok = row["status"] == "ok"
        measured = row["status"]
        if ok:
            measured = (
                f"{row['subject']} {row['subject_median_ms']:.1f} ms, {row['baseline']} "
                f"{row['baseline_median_ms']:.1f} ms: {row['ratio']:.2f}x"
            )
        passed = row["ratio"] <= row["bound"] if ok else None
        out.append({"target": _target(row), "measured": measured, "passed": passed})
        if row["case"] == "documents":
            passed = 1 / row["ratio"] <= SEGMENTS_BOUND if ok else None
            out.append({"target": _target(row, True), "measured": measured, "passed": passed})
    return out


def masks_markdown(rows: list[dict]) -> list[str]:
    """The table of pairs: median (min) ms of subject and baseline, their ratio and
    the target's bound."""
    if not rows:
        return []
    first = rows[0]
    lines = [
        "",
        f"### Masks as functions: B={first['B']}, T={first['T']}, {first['N']} heads of "
        f"width {first['H']}, {first['dtype']}; median (min) ms, each pair timed in turn",
        "",
    ]
    for case in CASES:
        detail = next((r["detail"] for r in rows if r["case"] == case and "detail" in r), "")
        if detail:
            lines.append(f"- {case}: {detail}")
    lines += [
        "",
        "| case | subject | baseline | backend | pass | subject ms | baseline ms "
        "| subject / baseline | target |",
        "|" + " --- |" * 9,
    ]
    for r in rows:
        head = f"| {r['case']} | {r['subject']} | {r['baseline']} | {r['backend']} | {r['pass']} |"
        bound = f"<= {r['bound']}x"
        if r["status"] != "ok":
            lines.append(f"{head} {r['status']} | | | {bound} |")
            continue
        times = " | ".join(
            f"{r[f'{name}_median_ms']:.1f} ({r[f'{name}_min_ms']:.1f})"
            for name in ("subject", "baseline")
        )
        lines.append(f"{head} {times} | {r['ratio']:.2f}x | {bound} |")
    return lines
