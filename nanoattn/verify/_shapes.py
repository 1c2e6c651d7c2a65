"""The shape audit: trace the real module and check every stage of its forward pass."""

import jax
import jax.numpy as jnp

from .._base.trace import Stage, record_shapes
from .._layers.axes import axis_sizes
from ..linen import AttentionConfig, CausalSelfAttention, CrossAttention
from ._inputs import _int_at_least
from ._report import CheckResult, Report


def trace_stages(config: AttentionConfig, batch: int, seq_len: int, kv_len: int | None = None):
    """Traces one forward pass of the real module and returns its stages.

    ``kv_len=None`` traces :class:`CausalSelfAttention` on (B, T, D);
    otherwise :class:`CrossAttention` with a (B, S, D) context. Nothing is
    computed: the module runs under ``jax.eval_shape``.
    """
    x = jax.ShapeDtypeStruct((batch, seq_len, config.d_model), jnp.float32)
    if kv_len is None:
        module, args = CausalSelfAttention(config), (x,)
    else:
        context = jax.ShapeDtypeStruct((batch, kv_len, config.d_model), jnp.float32)
        module, args = CrossAttention(config), (x, context)

    def forward(*inputs):
        return module.init_with_output(jax.random.key(0), *inputs, deterministic=True)

    with record_shapes() as stages:
        jax.eval_shape(forward, *args)
    return list(stages)


def stage_problems(stages: list[Stage], sizes: dict[str, int]) -> list[list[str]]:
    """What is wrong with each stage: axis sizes other than ``sizes``, lost elements.

    A ``reshape`` must keep its source's element count; the parts of a
    ``split`` must add up to their source's.
    """
    by_name = {s.name: s for s in stages}
    split_totals: dict[str, int] = {}
    for s in stages:
        if s.op == "split":
            split_totals[s.source] = split_totals.get(s.source, 0) + s.elements
    found = []
    for s in stages:
        problems = []
        if len(s.axes) != len(s.shape):
            problems.append(f"{len(s.axes)} axis names for a rank-{len(s.shape)} shape")
        for axis, size in zip(s.axes, s.shape):
            if sizes.get(axis, size) != size:
                problems.append(f"axis {axis} has size {size}, expected {sizes[axis]}")
        source = by_name.get(s.source)
        if s.op == "reshape" and source is not None and source.elements != s.elements:
            problems.append(f"{s.elements} elements, but {s.source} had {source.elements}")
        if s.op == "split" and source is not None and split_totals[s.source] != source.elements:
            problems.append(
                f"the parts of {s.source} hold {split_totals[s.source]} elements, "
                f"it held {source.elements}"
            )
        found.append(problems)
    return found


def shape_report(stages: list[Stage], sizes: dict[str, int], title: str) -> Report:
    """One check per stage, with its shape, axes and element count as data."""
    checks = []
    for s, problems in zip(stages, stage_problems(stages, sizes)):
        data = {
            "shape": list(s.shape),
            "axes": list(s.axes),
            "elements": s.elements,
            "op": s.op,
            "source": s.source,
        }
        detail = "; ".join(problems) or f"{s.shape} {' '.join(s.axes)}, {s.elements:,} elements"
        checks.append(CheckResult(s.name, not problems, detail, data=data))
    return Report(title, checks)


def check_shapes(
    config: AttentionConfig, *, batch: int, seq_len: int, kv_len: int | None = None
) -> Report:
    """The shape audit of one forward pass, as data.

    Traces :class:`CausalSelfAttention` (or :class:`CrossAttention` when
    ``kv_len`` is given) and returns one check per stage (input, combined
    projection, split, heads, scores, weights, per-head output, concatenated
    heads, output). A stage fails when an axis has the wrong size for
    ``config`` or a reshape or split changes the element count.

    Example:
      >>> from nanoattn.linen import AttentionConfig
      >>> report = check_shapes(AttentionConfig(128, 4), batch=2, seq_len=5)
      >>> report.passed, report.checks[1].name, report.checks[1].data["shape"]
      (True, 'qkv', [2, 5, 384])
    """
    config = AttentionConfig.from_config(config)
    _int_at_least("batch", batch, 1)
    _int_at_least("seq_len", seq_len, 1)
    if kv_len is not None:
        _int_at_least("kv_len", kv_len, 1)
    stages = trace_stages(config, batch, seq_len, kv_len)
    module = "CausalSelfAttention" if kv_len is None else "CrossAttention"
    return shape_report(stages, axis_sizes(config, batch, seq_len, kv_len), f"shapes of {module}")
