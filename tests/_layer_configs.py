"""The layer configurations of the decoding tests: ``CONFIGS`` maps a name to the
options of ``AttentionConfig(D, N, **options)`` (multi-head, grouped and multi-query
heads, RoPE, a window, soft-capping, QK norm, attention sinks, the options of open
models' checkpoints together (a head width of its own, a scale, RoPE scaling, partial
and interleaved RoPE, the projection QK norm, per-projection biases), and all of them
at once in bfloat16 and on each registered backend that serves the layer's calls, named
after it; ``LAYER_REFUSALS`` says why the others do not). Shared by
layers/test_kv_cache.py, which decodes each through the KV cache, and
verify/test_verify_decoding.py, which runs check_decoding on each; and
``random_params``, the random weights of the decoding tests' layers.
"""

import jax
import jax.numpy as jnp
import numpy as np

from nanoattn._backends import registry

from _backends import refusal
from _reference import randn

D, N, K = 48, 6, 2  # model width, query heads and key/value heads: H = 8
EVERYTHING = dict(n_kv_heads=K, rope_base=100.0, window=(4, 0), logit_soft_cap=2.0, qk_norm=True)
CONFIGS = {
    "mha": dict(),
    "gqa": dict(n_kv_heads=2),
    "mqa": dict(n_kv_heads=1),
    "rope": dict(n_kv_heads=2, rope_base=100.0),
    "window": dict(n_kv_heads=2, window=(4, 0)),
    "soft_cap": dict(n_kv_heads=2, logit_soft_cap=1.5),
    "qk_norm": dict(n_kv_heads=2, qk_norm=True),
    "sinks": dict(n_kv_heads=2, window=(4, 0), sinks=True),
    "bfloat16": dict(EVERYTHING, dtype=jnp.bfloat16),
    # The options of today's open models at once (issue 36): a head width of its own (N H
    # = 60, not D), a scale, YaRN on an interleaved partial rotary, the OLMo 2 norm with
    # Gemma's offset, no output bias.
    "open_models": dict(
        n_kv_heads=K,
        head_dim=10,
        scale=0.2,
        rope_base=100.0,
        rotary_dim=6,
        rope_scaling=dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=4),
        rope_layout="interleaved",
        qk_norm="projection",
        qk_norm_eps=1e-5,
        qk_norm_offset=1.0,
        out_bias=False,
    ),
}


def _layer_refusal(name: str) -> str | None:
    """Why the backend ``name`` does not serve the attention calls of a layer with
    EVERYTHING decoding (a chunk of 5 queries at per-row positions over 13 cache slots,
    with per-row lengths), or None."""
    q, k = np.zeros((2, 5, N, D // N), np.float32), np.zeros((2, 13, K, D // N), np.float32)
    return refusal(name, q, k, k, is_causal=True, q_offset=np.array([0, 4]), window=(4, 0),
                   logit_soft_cap=2.0, kv_lengths=np.array([5, 9]))  # fmt: skip


# Every registered backend: why it does not serve the layer's calls, or None.
LAYER_REFUSALS = {name: _layer_refusal(name) for name in registry.names()}
CONFIGS |= {
    name: dict(EVERYTHING, implementation=name)
    for name, reason in LAYER_REFUSALS.items()
    if reason is None
}


def random_params(shapes, seed=7):
    """Random parameters of the given shapes: kernels scaled by 1/sqrt(fan-in), biases
    and norm scales clearly non-zero, so a misplaced slice or a skipped norm shows."""
    leaves, tree = jax.tree.flatten(shapes)
    values = [
        randn(seed + i, *a.shape) * (a.shape[0] ** -0.5 if len(a.shape) == 2 else 0.5) + 0.1
        for i, a in enumerate(leaves)
    ]
    return jax.tree.unflatten(tree, [jnp.asarray(v, a.dtype) for v, a in zip(values, leaves)])


def paged_step(layer, pool_tokens: int, seed: int):
    """A paged linen ``layer`` (``page_size`` in its config): its random parameters
    (:func:`random_params`), the shapes of its cache (a pool of ``pool_tokens`` tokens)
    and its decoding step ``step(cache, x, pages) -> (y, cache)``, not jitted."""
    import functools

    shapes = jax.eval_shape(functools.partial(layer.init, decode=True), jax.random.key(0),
                            jnp.zeros((1, pool_tokens, layer.config.d_model)))  # fmt: skip
    params = random_params(shapes["params"], seed)

    def step(cache, x, pages):
        y, state = layer.apply({"params": params, "cache": cache}, x, True, decode=True,
                               pages=pages, mutable=["cache"])  # fmt: skip
        return y, state["cache"]

    return params, shapes["cache"], step
