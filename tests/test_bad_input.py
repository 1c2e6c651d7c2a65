"""Bad input, everywhere public (issue #13).

Every public function, module and CLI command is sent the wrong dtype, rank,
batch, lengths, offsets, windows, segment shapes and head counts, and must
answer with one line: a ValueError or TypeError whose message is non-empty,
has no newline and names what is wrong; the CLI with exit status 2, exactly
one line on stderr and no traceback.

Each row is ``(id, callable, args, kwargs, exception type, substring)``. The
sizes are distinct (B=2, T=3, S=5, N=6, K=2, H=8, D=16) so a message that
names the wrong axis names the wrong number too.

Valid by design, so not rows here: ``kv_lengths`` outside [0, S] (a length
past S shows every key, a negative one none, as the C++ kernel clamps them)
and a ``q_offset`` that is negative or past the keys (positions are
positional, docs/conventions.md; test_properties.py draws both).
"""

import functools
import math
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import nanoattn
from nanoattn import linen, parallel, verify
from nanoattn import nnx as nanoattn_nnx
from nanoattn._backends import registry
from nanoattn.cli import _audit, _bench, _verify, main

B, T, S, N, K, H = 2, 3, 5, 6, 2, 8
D = 16  # model width of the modules: 4 heads of width 4, 2 key/value heads


def f32(*shape):
    return np.zeros(shape, np.float32)


def i32(*shape):
    return np.zeros(shape, np.int32)


Q, KV, KV_T = f32(B, T, N, H), f32(B, S, K, H), f32(B, T, K, H)  # KV_T: S = T
MASK = np.ones((T, S), bool)


# The three attention functions of the functional API, called f(q, k, v, **kwargs).
def weights_of(q, k, v, **kwargs):
    return nanoattn.attention_weights(q, k, **kwargs)


ATTENTION = {
    "dot_product_attention": nanoattn.dot_product_attention,
    "attention_weights": weights_of,
    "flash_attention": nanoattn.flash_attention,
}


class Whole(str):
    """A row's match that must be the whole message, not just a part of it."""


def row(id, fn, *args, raises, match, **kwargs):
    return pytest.param(fn, args, kwargs, raises, match, id=id)


# Rows every attention function must pass: (id, q, k, v, kwargs, raises, match).
SHARED = [
    ("query-rank-2", Q[0, 0], KV, KV, {}, ValueError,
     "query must have shape (B, T, N, H) or (T, N, H)"),
    ("query-unbatched-key-batched", Q[0], KV, KV, {}, ValueError,
     "is unbatched, so key must be too"),
    ("key-rank-5", Q, KV[None], KV, {}, ValueError, "key must have shape (B, S, K, H)"),
    ("key-batch", Q, f32(3, S, K, H), KV, {}, ValueError, "key must have shape (B, S, K, H)"),
    ("key-head-width", Q, f32(B, S, K, 4), KV, {}, ValueError, "got (2, 5, 2, 4)"),
    ("N-not-divisible-by-K", Q, f32(B, S, 4, H), f32(B, S, 4, H), {}, ValueError,
     "N=6 must be a multiple of the number of key/value heads K=4"),
    ("int-query", Q.astype(np.int32), KV, KV, {}, TypeError,
     "query must be a floating-point array, got dtype int32"),
    ("int-key", Q, KV.astype(np.int32), KV, {}, TypeError, "key must be a floating-point"),
    ("float-mask", Q, KV, KV, {"mask": MASK.astype(np.float32)}, TypeError,
     "mask must be a boolean array (True = may attend), got dtype float32"),
    ("int-mask", Q, KV, KV, {"mask": MASK.astype(np.int32)}, TypeError,
     "mask must be a boolean array"),
    ("mask-shape", Q, KV, KV, {"mask": np.ones((S, T), bool)}, ValueError,
     "mask must be broadcastable to (B, N, T, S) = (2, 6, 3, 5), got (5, 3)"),
    ("mask-rank-5", Q, KV, KV, {"mask": np.ones((1, B, N, T, S), bool)}, ValueError,
     "mask must be broadcastable"),
    ("int-bias", Q, KV, KV, {"bias": i32(T, S)}, TypeError, "bias must be a floating-point"),
    ("bias-shape", Q, KV, KV, {"bias": f32(B, 1, S, S)}, ValueError,
     "bias must be broadcastable to (B, N, T, S)"),
    ("causal-T!=S-without-q_offset", Q, KV, KV, {"is_causal": True}, ValueError,
     "is_causal=True with T=3 queries and S=5 keys needs q_offset"),
    ("window-T!=S-without-q_offset", Q, KV, KV, {"window": 1}, ValueError, "needs q_offset"),
    ("q_offset-without-rule", Q, KV, KV, {"q_offset": 2}, ValueError,
     Whole("q_offset only applies to causal or windowed attention, or to the positions "
           "mask_fn and score_fn see; pass is_causal=True, a window, mask_fn or score_fn")),
    ("mask_fn-not-callable", Q, KV, KV, {"mask_fn": MASK}, TypeError,
     "mask_fn must be a function mask_fn(b, n, q_pos, k_pos) -> bool array, got ndarray"),
    ("mask_fn-int-result", Q, KV, KV, {"mask_fn": lambda b, n, q, k: q - k}, TypeError,
     Whole("mask_fn must return a boolean array (True = may attend), got dtype int32")),
    ("mask_fn-shape", Q, KV, KV, {"mask_fn": lambda b, n, q, k: (q >= k)[..., None]},
     ValueError, "mask_fn's result must be broadcastable to (B, N, T, S) = (2, 6, 3, 5), "
     "got (1, 1, 3, 5, 1)"),
    ("mask_fn-two-results", Q, KV, KV, {"mask_fn": lambda b, n, q, k: (q >= k, q < k)},
     TypeError, "mask_fn must return one array"),
    ("mask_fn-fails", Q, KV, KV, {"mask_fn": lambda b, n, q: q >= 0}, ValueError,
     "mask_fn failed on int32 index arrays that broadcast to (B, N, T, S)"),
    ("score_fn-int-result", Q, KV, KV, {"score_fn": lambda s, b, n, q, k: q - k}, TypeError,
     Whole("score_fn must return a floating array, got dtype int32")),
    ("score_fn-shape", Q, KV, KV, {"score_fn": lambda s, b, n, q, k: s[..., :1, :1, None]},
     ValueError, "score_fn's result must be broadcastable to (B, N, T, S)"),
    ("sinks-shape", Q, KV, KV, {"sinks": f32(N, 1)}, ValueError,
     "sinks must have shape (N,) = (6,), got (6, 1)"),
    ("int-sinks", Q, KV, KV, {"sinks": np.zeros(N, np.int32)}, TypeError,
     "sinks must be a floating-point array"),
    ("float-q_offset", Q, KV, KV, {"is_causal": True, "q_offset": np.float32(2)}, TypeError,
     "q_offset must be an integer array, got dtype float32"),
    ("bool-q_offset", Q, KV, KV, {"is_causal": True, "q_offset": True}, TypeError,
     "q_offset must be an int"),
    ("q_offset-batch", Q, KV, KV, {"is_causal": True, "q_offset": i32(3)}, ValueError,
     "q_offset must have shape (B,) = (2,), got (3,)"),
    ("q_offset-rank-2", Q, KV, KV, {"is_causal": True, "q_offset": i32(B, T)}, ValueError,
     "q_offset must have shape (B,)"),
    ("negative-window", Q, KV_T, KV_T, {"window": -1}, ValueError,
     "window sides must be >= 0, got (left, right) = (-1, -1)"),
    ("negative-window-right", Q, KV_T, KV_T, {"window": (2, -1)}, ValueError,
     "window sides must be >= 0, got (left, right) = (2, -1)"),
    ("float-window", Q, KV_T, KV_T, {"window": 1.5}, TypeError, "window must be an int w"),
    ("window-triple", Q, KV_T, KV_T, {"window": (1, 2, 3)}, TypeError, "window must be an int w"),
    ("float-kv_lengths", Q, KV, KV, {"kv_lengths": np.array([1.0, 2.0])}, TypeError,
     "kv_lengths must be an integer array, got dtype float"),
    ("kv_lengths-batch", Q, KV, KV, {"kv_lengths": np.array([1, 2, 3])}, ValueError,
     "kv_lengths must have shape (B,) = (2,), got (3,)"),
    ("kv_lengths-scalar", Q, KV, KV, {"kv_lengths": np.int32(3)}, ValueError,
     "kv_lengths must have shape (B,)"),
    ("q_segment_ids-alone", Q, KV, KV, {"q_segment_ids": i32(B, T)}, ValueError,
     Whole("q_segment_ids and kv_segment_ids go together: pass both (for self-attention "
           "over packed sequences, the same ids twice) or neither")),
    ("float-segment-ids", Q, KV, KV,
     {"q_segment_ids": f32(B, T), "kv_segment_ids": i32(B, S)}, TypeError,
     "q_segment_ids must be an integer array, got dtype float32"),
    ("q_segment_ids-shape", Q, KV, KV,
     {"q_segment_ids": i32(B, S), "kv_segment_ids": i32(B, S)}, ValueError,
     "q_segment_ids must have shape (B, T) = (2, 3), got (2, 5)"),
    ("kv_segment_ids-shape", Q, KV, KV,
     {"q_segment_ids": i32(B, T), "kv_segment_ids": i32(B, T)}, ValueError,
     "kv_segment_ids must have shape (B, S) = (2, 5), got (2, 3)"),
    ("segment-ids-batch", Q, KV, KV,
     {"q_segment_ids": i32(3, T), "kv_segment_ids": i32(3, S)}, ValueError,
     "q_segment_ids must have shape (B, T) = (2, 3), got (3, 3)"),
    ("zero-soft-cap", Q, KV, KV, {"logit_soft_cap": 0.0}, ValueError,
     "logit_soft_cap must be a finite float > 0"),
    ("string-soft-cap", Q, KV, KV, {"logit_soft_cap": "30"}, TypeError,
     "logit_soft_cap must be a float > 0"),
    ("string-scale", Q, KV, KV, {"scale": "x"}, TypeError, "scale must be"),
    ("nan-scale", Q, KV, KV, {"scale": math.nan}, ValueError, "scale must be finite"),
    ("scale-vector", Q, KV, KV, {"scale": np.ones(2, np.float32)}, ValueError,
     "scale must be a scalar"),
    # Arguments of the wrong type: a one-line TypeError naming the argument (issue #21).
    ("string-q_offset", Q, KV, KV, {"is_causal": True, "q_offset": "2"}, TypeError,
     Whole("q_offset must be an int or an int array, got str '2'")),
    ("list-of-strings-q_offset", Q, KV, KV, {"is_causal": True, "q_offset": ["a", "b"]},
     TypeError, Whole("q_offset must be an int or an int array, got list ['a', 'b']")),
    ("string-query", "q", KV, KV, {}, TypeError,
     Whole("query must be an array (B, T, N, H) or (T, N, H), got str 'q'")),
    ("None-query", None, KV, KV, {}, TypeError,
     Whole("query must be an array (B, T, N, H) or (T, N, H), got NoneType None")),
    ("None-key", Q, None, KV, {}, TypeError,
     Whole("key must be an array (B, S, K, H), got NoneType None")),
    ("ragged-list-key", Q, [[1.0], [1.0, 2.0]], KV, {}, TypeError,
     Whole("key must be an array (B, S, K, H), got list [[1.0], [1.0, 2.0]]")),
    ("string-mask", Q, KV, KV, {"mask": "causal"}, TypeError,
     Whole("mask must be a boolean array broadcastable to (B, N, T, S), got str 'causal'")),
    ("object-bias", Q, KV, KV, {"bias": object}, TypeError,
     "bias must be a float array broadcastable to (B, N, T, S), got type"),
    ("string-kv_lengths", Q, KV, KV, {"kv_lengths": "5"}, TypeError,
     Whole("kv_lengths must be an int array (B,), got str '5'")),
    ("string-segment-ids", Q, KV, KV, {"q_segment_ids": "a", "kv_segment_ids": i32(B, S)},
     TypeError, Whole("q_segment_ids must be an int array (B, T), got str 'a'")),
    ("string-is_causal", Q, KV_T, KV_T, {"is_causal": "yes"}, TypeError,
     Whole("is_causal must be True or False, got 'yes'")),
    ("int-is_causal", Q, KV_T, KV_T, {"is_causal": 1}, TypeError,
     Whole("is_causal must be True or False, got 1")),
]  # fmt: skip

ROWS = [
    row(f"{name}-{id}", fn, q, k, v, raises=raises, match=match, **kwargs)
    for name, fn in ATTENTION.items()
    for id, q, k, v, kwargs, raises, match in SHARED
]

dpa, flash = nanoattn.dot_product_attention, nanoattn.flash_attention
ROWS += [
    row(f"{name}-string-return_residual", fn, Q, KV, KV, return_residual="yes",
        raises=TypeError, match=Whole("return_residual must be True or False, got 'yes'"))
    for name, fn in (("dot_product_attention", dpa), ("flash_attention", flash))
]  # fmt: skip
ROWS += [
    row("dot_product_attention-int-value", dpa, Q, KV, KV.astype(np.int32), raises=TypeError,
        match="value must be a floating-point array, got dtype int32"),
    row("dot_product_attention-value-shape", dpa, Q, KV, f32(B, 4, K, H), raises=ValueError,
        match="value must have shape (B, S, K, Hv) = (2, 5, 2, *), got (2, 4, 2, 8)"),
    row("dot_product_attention-dropout-1", dpa, Q, KV, KV, dropout_rate=1.0,
        dropout_rng=jax.random.key(0), raises=ValueError, match="dropout_rate must be in [0, 1)"),
    row("dot_product_attention-dropout-negative", dpa, Q, KV, KV, dropout_rate=-0.1,
        raises=ValueError, match="dropout_rate must be in [0, 1), got dropout_rate=-0.1"),
    row("dot_product_attention-dropout-string", dpa, Q, KV, KV, dropout_rate="0.1",
        raises=TypeError, match="dropout_rate must be a float"),
    row("dot_product_attention-dropout-without-rng", dpa, Q, KV, KV, dropout_rate=0.5,
        raises=ValueError, match="dropout_rate=0.5 needs dropout_rng"),
    row("dot_product_attention-dropout-rng-not-a-key", dpa, Q, KV, KV, dropout_rate=0.5,
        dropout_rng=3, raises=TypeError, match="dropout_rng must be a jax.random key"),
    row("dot_product_attention-unknown-implementation", dpa, Q, KV, KV, implementation="fast",
        raises=ValueError,
        match="implementation must be one of " + ", ".join(map(repr, registry.names()))),
    row("dot_product_attention-native-with-mask", dpa, Q, KV, KV, mask=MASK,
        implementation="native", raises=ValueError,
        match="implementation='native' cannot serve this call"),
    row("dot_product_attention-flash-with-dropout", dpa, Q, KV, KV, dropout_rate=0.5,
        dropout_rng=jax.random.key(0), implementation="flash", raises=ValueError,
        match=Whole("implementation='flash' cannot serve this call: dropout is only "
                    "implemented by the reference (implementation='xla')")),
    row("dot_product_attention-flash-traced-scale", jax.jit(
        lambda q, k, v, s: dpa(q, k, v, scale=s, implementation="flash")), Q, KV, KV, 0.5,
        raises=ValueError, match=Whole("implementation='flash' cannot serve this call: the "
                                       "kernel needs a Python number for scale, not a traced "
                                       "array")),
    row("dot_product_attention-cudnn-on-cpu", dpa, Q, KV, KV, implementation="cudnn",
        raises=ValueError, match="implementation='cudnn' cannot serve this call"),
    row("flash_attention-value-shape", flash, Q, KV, f32(B, 4, K, H), raises=ValueError,
        match="value must have shape (B, S, K, Hv)"),
    row("flash_attention-zero-tile", flash, Q, KV, KV, forward_tiles=(0, 32, 1),
        raises=ValueError, match="forward_tiles must be"),
    row("flash_attention-tile-pair", flash, Q, KV, KV, forward_tiles=(16, 32),
        raises=ValueError, match="forward_tiles must be"),
    row("flash_attention-float-tile", flash, Q, KV, KV, backward_tiles=(16.5, 32, 1),
        raises=TypeError, match="backward_tiles must be"),
    row("flash_attention-string-tiles", flash, Q, KV, KV, backward_tiles="big",
        raises=TypeError, match="backward_tiles must be"),
]  # fmt: skip

# flax_attention_fn: flax's calling convention, [batch..., T, N, H].
faf = nanoattn.flax_attention_fn
ROWS += [
    row("flax_attention_fn-rank-2", faf, Q[0, 0], KV, KV, raises=ValueError,
        match="the same rank, at least 3, is needed"),
    row("flax_attention_fn-batch", faf, Q, f32(3, S, K, H), f32(3, S, K, H), raises=ValueError,
        match="the batch axes must match"),
    row("flax_attention_fn-head-width", faf, Q, f32(B, S, K, 4), f32(B, S, K, 4),
        raises=ValueError, match="query and key must have the same H"),
    row("flax_attention_fn-N-not-divisible-by-K", faf, Q, f32(B, S, 4, H), f32(B, S, 4, H),
        raises=ValueError, match="K=4 must divide N=6"),
    row("flax_attention_fn-value-shape", faf, Q, KV, f32(B, 4, K, H), raises=ValueError,
        match="key and value must agree on S and K"),
    row("flax_attention_fn-mask-shape", faf, Q, KV, KV, mask=np.ones((S, S), bool),
        raises=ValueError, match="mask must be broadcastable to [batch..., N, T, S]"),
    row("flax_attention_fn-bias-shape", faf, Q, KV, KV, bias=f32(S, S), raises=ValueError,
        match="bias must be broadcastable to [batch..., N, T, S]"),
    row("flax_attention_fn-unknown-implementation", faf, Q, KV, KV, implementation="fast",
        raises=ValueError, match="implementation must be one of"),
    row("flax_attention_fn-dropout-1", faf, Q, KV, KV, dropout_rate=1.0,
        dropout_rng=jax.random.key(0), raises=ValueError, match="dropout_rate must be in [0, 1)"),
    row("flax_attention_fn-dropout-negative", faf, Q, KV, KV, dropout_rate=-0.5,
        dropout_rng=jax.random.key(0), raises=ValueError, match="dropout_rate must be"),
    row("flax_attention_fn-dropout-without-rng", faf, Q, KV, KV, dropout_rate=0.5,
        raises=ValueError, match="needs dropout_rng"),
]  # fmt: skip

# Mask builders and helpers.
ROWS += [
    row("causal_mask-negative-length", nanoattn.causal_mask, -1, raises=ValueError,
        match="q_len must be an int >= 0, got q_len=-1"),
    row("causal_mask-negative-kv_len", nanoattn.causal_mask, 3, -2, raises=ValueError,
        match="kv_len must be an int >= 0, got kv_len=-2"),
    row("causal_mask-float-length", nanoattn.causal_mask, 3.5, raises=TypeError,
        match="q_len must be an int"),
    row("causal_mask-string-length", nanoattn.causal_mask, "3", raises=TypeError,
        match="q_len must be an int"),
    row("causal_mask-float-q_offset", nanoattn.causal_mask, 3, q_offset=np.float32(0.5),
        raises=TypeError, match="q_offset must be an integer array"),
    row("causal_mask-q_offset-rank-2", nanoattn.causal_mask, 3, q_offset=i32(B, 2),
        raises=ValueError, match="q_offset must have shape () or (B,)"),
    row("window_mask-negative-window", nanoattn.window_mask, 3, window=-1, raises=ValueError,
        match="window sides must be >= 0"),
    row("window_mask-window-None", nanoattn.window_mask, 3, window=None, raises=TypeError,
        match=Whole("window must be an int w (meaning (w, w)) or a pair (left, right), got None")),
    row("window_mask-negative-kv_len", nanoattn.window_mask, 3, -2, window=1, raises=ValueError,
        match="kv_len must be an int >= 0"),
    row("segment_mask-float-ids", nanoattn.segment_mask, f32(B, T), raises=TypeError,
        match="q_segment_ids must be an integer array, got dtype float32"),
    row("segment_mask-float-kv-ids", nanoattn.segment_mask, i32(B, T), f32(B, S),
        raises=TypeError, match="kv_segment_ids must be an integer array"),
    row("segment_mask-rank-1", nanoattn.segment_mask, i32(T), raises=ValueError,
        match="q_segment_ids must have shape (B, T)"),
    row("segment_mask-batch", nanoattn.segment_mask, i32(B, T), i32(3, S), raises=ValueError,
        match="kv_segment_ids must have shape (B, S) = (2, *), got (3, 5)"),
    row("lengths_to_valid-float", nanoattn.lengths_to_valid, np.array([1.0, 2.0]), S,
        raises=TypeError, match="lengths must be an integer array"),
    row("lengths_to_valid-rank-2", nanoattn.lengths_to_valid, i32(1, B), S, raises=ValueError,
        match="lengths must have shape (B,)"),
    row("lengths_to_valid-negative-max_len", nanoattn.lengths_to_valid, i32(B), -1,
        raises=ValueError, match="max_len must be an int >= 0, got max_len=-1"),
    row("lengths_to_valid-float-max_len", nanoattn.lengths_to_valid, i32(B), 4.5,
        raises=TypeError, match="max_len must be an int"),
    row("padding_mask-float", nanoattn.padding_mask, f32(B, S), raises=TypeError,
        match="kv_valid must be a boolean array"),
    row("padding_mask-rank-1", nanoattn.padding_mask, np.ones(S, bool), raises=ValueError,
        match="kv_valid must have shape (B, S)"),
    row("padding_mask-int-q_valid", nanoattn.padding_mask, np.ones((B, S), bool), i32(B, T),
        raises=TypeError, match="q_valid must be a boolean array"),
    row("padding_mask-q_valid-batch", nanoattn.padding_mask, np.ones((B, S), bool),
        np.ones((3, T), bool), raises=ValueError,
        match="q_valid must have shape (B, T) = (2, *), got (3, 3)"),
    row("combine_masks-float", nanoattn.combine_masks, MASK, MASK.astype(np.float32),
        raises=TypeError, match="mask 1 must be a boolean array"),
    row("combine_masks-shapes", nanoattn.combine_masks, MASK, np.ones((4, S), bool),
        raises=ValueError, match="masks must broadcast together, got shapes (3, 5), (4, 5)"),
    row("large_negative-int-dtype", nanoattn.large_negative, jnp.int32, raises=TypeError,
        match="dtype must be a floating dtype"),
    row("large_negative-None", nanoattn.large_negative, None, raises=TypeError,
        match="dtype must be a floating dtype"),
]  # fmt: skip

# apply_rope: x (B, L, N, H), positions (B, L) or (L,).
rope = nanoattn.apply_rope
ROWS += [
    row("apply_rope-rank-3", rope, Q[0], np.arange(N), raises=ValueError,
        match="x must have shape (B, L, N, H)"),
    row("apply_rope-odd-head-width", rope, f32(B, T, N, 7), np.arange(T), raises=ValueError,
        match="apply_rope needs an even head width H"),
    row("apply_rope-int-x", rope, i32(B, T, N, H), np.arange(T), raises=TypeError,
        match="x must be a floating-point array, got dtype int32"),
    row("apply_rope-float-positions", rope, Q, np.arange(T, dtype=np.float32), raises=TypeError,
        match="positions must be an integer array"),
    row("apply_rope-positions-length", rope, Q, np.arange(T + 1), raises=ValueError,
        match="positions must have shape (L,) = (3,), got (4,)"),
    row("apply_rope-positions-batch", rope, Q, i32(3, T), raises=ValueError,
        match="positions must have shape (B, L) = (2, 3), got (3, 3)"),
    row("apply_rope-zero-base", rope, Q, np.arange(T), base=0.0, raises=ValueError,
        match="base must be"),
    row("apply_rope-string-base", rope, Q, np.arange(T), base="1e4", raises=TypeError,
        match="base must be a float"),
    row("apply_rope-odd-rotary-dim", rope, Q, np.arange(T), rotary_dim=5, raises=ValueError,
        match="rotary_dim must be an even int in [2, H] (the rotated features of each head), "
              "got rotary_dim=5 with H=8"),
    row("apply_rope-rotary-dim-past-H", rope, Q, np.arange(T), rotary_dim=10, raises=ValueError,
        match="got rotary_dim=10 with H=8"),
    row("apply_rope-unknown-layout", rope, Q, np.arange(T), rope_layout="gptj", raises=ValueError,
        match="rope_layout must be 'half' or 'interleaved', got rope_layout='gptj'"),
    row("apply_rope-unknown-scaling", rope, Q, np.arange(T), rope_scaling={"rope_type": "ntk"},
        raises=ValueError, match="rope_scaling rope_type must be one of"),
    row("apply_rope-scaling-missing-key", rope, Q, np.arange(T),
        rope_scaling={"rope_type": "llama3", "factor": 8.0}, raises=ValueError,
        match="rope_scaling rope_type 'llama3' needs low_freq_factor"),
    row("apply_rope-scaling-string", rope, Q, np.arange(T), rope_scaling="yarn",
        raises=TypeError, match="rope_scaling must be None or a mapping with a rope_type"),
    row("apply_rope-dynamic-traced-positions",
        jax.jit(lambda q, p: rope(q, p, rope_scaling={"rope_type": "dynamic", "factor": 2.0,
                                                      "original_max_position_embeddings": 2})),
        Q, np.arange(T), raises=ValueError,
        match="rope_scaling rope_type 'dynamic' needs concrete positions"),
]  # fmt: skip


# merge_attention: lists of part outputs (B, T, N, H) and their log-sum-exps (B, T, N).
merge, O, L = nanoattn.merge_attention, f32(B, T, N, H), f32(B, T, N)
ROWS += [
    row("merge_attention-no-parts", merge, [], [], raises=ValueError,
        match=Whole("outputs must hold at least one part, got none")),
    row("merge_attention-part-counts", merge, [O, O], [L], raises=ValueError,
        match=Whole("lses must hold one log-sum-exp per output: 2 outputs, got 1 lses")),
    row("merge_attention-stacked-array", merge, np.stack([O, O]), [L, L], raises=TypeError,
        match=Whole("outputs must be a list or tuple of arrays (B, T, N, H), one per part, "
                    "got an array of shape (2, 2, 3, 6, 8); for parts stacked on a leading "
                    "axis pass list(outputs)")),
    row("merge_attention-lses-None", merge, [O], None, raises=TypeError,
        match=Whole("lses must be a list or tuple of arrays (B, T, N), one per part, "
                    "got NoneType None")),
    row("merge_attention-string-part", merge, [O, "o"], [L, L], raises=TypeError,
        match=Whole("outputs[1] must be an array (B, T, N, H) or (T, N, H), got str 'o'")),
    row("merge_attention-rank-2", merge, [O[0, 0]], [L[0, 0]], raises=ValueError,
        match=Whole("outputs[0] must have shape (B, T, N, H) or (T, N, H), got (6, 8)")),
    row("merge_attention-output-shape", merge, [O, f32(B, T, N, 4)], [L, L], raises=ValueError,
        match=Whole("outputs[1] must have shape (B, T, N, H) = (2, 3, 6, 8), got (2, 3, 6, 4)")),
    row("merge_attention-lse-shape", merge, [O, O], [L, f32(B, N, T)], raises=ValueError,
        match=Whole("lses[1] must have shape (B, T, N) = (2, 3, 6), got (2, 6, 3)")),
    row("merge_attention-unbatched-lse-shape", merge, [O[0]], [L], raises=ValueError,
        match=Whole("lses[0] must have shape (T, N) = (3, 6), got (2, 3, 6)")),
    row("merge_attention-int-output", merge, [O, i32(B, T, N, H)], [L, L], raises=TypeError,
        match=Whole("outputs[1] must be a floating-point array, got dtype int32")),
    row("merge_attention-int-lse", merge, [O], [i32(B, T, N)], raises=TypeError,
        match=Whole("lses[0] must be a floating-point array, got dtype int32")),
    row("merge_attention-mixed-dtypes", merge, [O, O.astype(np.float16)], [L, L],
        raises=TypeError,
        match=Whole("outputs[1] must have the dtype of outputs[0], float32, got float16")),
]  # fmt: skip


# Parallel: the zigzag layout, the logical rules and the ring on a one-device mesh.
@functools.cache
def one_device_mesh():
    return jax.make_mesh((1,), ("sp",))


def ring(q, k, v, **kwargs):
    kwargs.setdefault("mesh", one_device_mesh())
    return parallel.ring_attention(q, k, v, axis_name=kwargs.pop("axis_name", "sp"), **kwargs)


QR, KR = f32(B, 4, N, H), f32(B, 4, K, H)  # the ring: T = S = 4, two zigzag chunks
ROWS += [
    row("to_zigzag-zero-devices", parallel.to_zigzag, np.arange(8), 0, axis=0,
        raises=ValueError, match="P must be an int >= 1 (the devices on the ring), got P=0"),
    row("to_zigzag-negative-devices", parallel.to_zigzag, np.arange(8), -1, axis=0,
        raises=ValueError, match="P must be an int >= 1"),
    row("to_zigzag-float-devices", parallel.to_zigzag, np.arange(8), 2.0, axis=0,
        raises=TypeError, match="P must be an int"),
    row("to_zigzag-not-divisible", parallel.to_zigzag, np.arange(6), 2, axis=0,
        raises=ValueError, match="T=6 is not a multiple of 4"),
    row("to_zigzag-axis-out-of-range", parallel.to_zigzag, np.arange(8), 2, axis=3,
        raises=ValueError, match="axis=3 is out of range"),
    row("to_zigzag-scalar", parallel.to_zigzag, np.float32(1), 1, axis=0, raises=ValueError,
        match="axis=0 is out of range"),
    row("from_zigzag-not-divisible", parallel.from_zigzag, f32(B, 6), 2, raises=ValueError,
        match="T=6 is not a multiple of 4"),
    row("logical_rules-int-axis", parallel.logical_rules, 3, raises=TypeError,
        match="head_axis must be a mesh axis name"),
    row("logical_rules-empty-axis", parallel.logical_rules, "", raises=ValueError,
        match="head_axis must be a mesh axis name"),
    row("ring_attention-unknown-axis", ring, QR, KR, KR, axis_name="tp", raises=ValueError,
        match="axis_name='tp' is not an axis of the mesh"),
    row("ring_attention-no-mesh", ring, QR, KR, KR, mesh=None, raises=ValueError,
        match="axis_name='sp'"),
    row("ring_attention-mesh-not-a-mesh", ring, QR, KR, KR, mesh="sp", raises=TypeError,
        match="mesh must be a jax.sharding.Mesh"),
    row("ring_attention-unknown-layout", ring, QR, KR, KR, layout="spiral", raises=ValueError,
        match="layout must be one of 'zigzag', 'contiguous'"),
    row("ring_attention-T-not-divisible", ring, Q, KV_T, KV_T, raises=ValueError,
        match="T=3 is not a multiple of 2"),
    row("ring_attention-rank-3", ring, QR[0], KR, KR, raises=ValueError,
        match="query must have shape (B, T, N, H)"),
    row("ring_attention-S!=T", ring, QR, f32(B, 6, K, H), f32(B, 6, K, H), raises=ValueError,
        match="key must have shape (B, S, K, H) = (2, 4, *, 8), got (2, 6, 2, 8)"),
    row("ring_attention-batch", ring, QR, f32(3, 4, K, H), f32(3, 4, K, H), raises=ValueError,
        match="key must have shape (B, S, K, H)"),
    row("ring_attention-head-width", ring, QR, f32(B, 4, K, 4), f32(B, 4, K, 4),
        raises=ValueError, match="got (2, 4, 2, 4)"),
    row("ring_attention-value-shape", ring, QR, KR, f32(B, 4, 3, H), raises=ValueError,
        match="value must have shape (B, S, K, Hv)"),
    row("ring_attention-N-not-divisible-by-K", ring, QR, f32(B, 4, 4, H), f32(B, 4, 4, H),
        raises=ValueError, match="N=6 must be a multiple of the number of key/value heads K=4"),
    row("ring_attention-int-query", ring, QR.astype(np.int32), KR, KR, raises=TypeError,
        match="query must be a floating-point array"),
    row("ring_attention-float-kv_lengths", ring, QR, KR, KR, kv_lengths=np.array([1.0, 2.0]),
        raises=TypeError, match="kv_lengths must be an integer array"),
    row("ring_attention-kv_lengths-batch", ring, QR, KR, KR, kv_lengths=np.array([1, 2, 3]),
        raises=ValueError, match="kv_lengths must have shape (B,) = (2,), got (3,)"),
    row("ring_attention-float-segment-ids", ring, QR, KR, KR, q_segment_ids=f32(B, 4),
        kv_segment_ids=f32(B, 4), raises=TypeError,
        match="q_segment_ids must be an integer array"),
    row("ring_attention-segment-ids-alone", ring, QR, KR, KR, q_segment_ids=i32(B, 4),
        raises=ValueError, match="q_segment_ids and kv_segment_ids go together"),
    row("ring_attention-segment-ids-shape", ring, QR, KR, KR, q_segment_ids=i32(B, 6),
        kv_segment_ids=i32(B, 6), raises=ValueError, match="q_segment_ids must have shape"),
    row("ring_attention-negative-window", ring, QR, KR, KR, window=(1, -1), raises=ValueError,
        match="window sides must be >= 0"),
    row("ring_attention-zero-soft-cap", ring, QR, KR, KR, logit_soft_cap=0.0,
        raises=ValueError, match="logit_soft_cap must be a finite float > 0"),
    row("ring_attention-string-scale", ring, QR, KR, KR, scale="x", raises=TypeError,
        match="scale must be"),
    row("ring_attention-zero-tile", ring, QR, KR, KR, forward_tiles=(0, 2, 1),
        raises=ValueError, match="forward_tiles must be"),
]  # fmt: skip

# AttentionConfig (the same class in linen and nnx).
Config = linen.AttentionConfig
ROWS += [
    row("AttentionConfig-zero-d_model", Config, d_model=0, n_heads=1, raises=ValueError,
        match="d_model must be >= 1, got d_model=0"),
    row("AttentionConfig-float-d_model", Config, d_model=16.0, n_heads=4, raises=TypeError,
        match="d_model must be an int"),
    row("AttentionConfig-zero-heads", Config, d_model=D, n_heads=0, raises=ValueError,
        match="n_heads must be >= 1, got n_heads=0"),
    row("AttentionConfig-string-heads", Config, d_model=D, n_heads="4", raises=TypeError,
        match="n_heads must be an int"),
    row("AttentionConfig-heads-not-dividing-d_model", Config, d_model=D, n_heads=3,
        raises=ValueError, match="d_model=16 is not divisible by n_heads=3"),
    row("AttentionConfig-N-not-divisible-by-K", Config, d_model=D, n_heads=4, n_kv_heads=3,
        raises=ValueError, match="n_kv_heads=3 does not divide n_heads=4"),
    row("AttentionConfig-zero-kv-heads", Config, d_model=D, n_heads=4, n_kv_heads=0,
        raises=ValueError, match="n_kv_heads must be an int >= 1 or None"),
    row("AttentionConfig-float-kv-heads", Config, d_model=D, n_heads=4, n_kv_heads=2.0,
        raises=TypeError, match="n_kv_heads must be an int >= 1 or None"),
    row("AttentionConfig-dropout-1", Config, d_model=D, n_heads=4, dropout=1.0,
        raises=ValueError, match="dropout must be in [0, 1), got dropout=1.0"),
    row("AttentionConfig-negative-dropout", Config, d_model=D, n_heads=4, dropout=-0.1,
        raises=ValueError, match="dropout must be in [0, 1)"),
    row("AttentionConfig-string-dropout", Config, d_model=D, n_heads=4, dropout="0.1",
        raises=TypeError, match="dropout must be a float"),
    row("AttentionConfig-unknown-implementation", Config, d_model=D, n_heads=4,
        implementation="fast", raises=ValueError, match="implementation must be one of"),
    row("AttentionConfig-negative-window", Config, d_model=D, n_heads=4, window=-2,
        raises=ValueError, match="window sides must be >= 0"),
    row("AttentionConfig-zero-soft-cap", Config, d_model=D, n_heads=4, logit_soft_cap=0.0,
        raises=ValueError, match="logit_soft_cap must be a finite float > 0"),
    row("AttentionConfig-rope-odd-head-width", Config, d_model=12, n_heads=4, rope_base=1e4,
        raises=ValueError, match="rope_base needs an even head width H, got H=3"),
    row("AttentionConfig-int-dtype", Config, d_model=D, n_heads=4, dtype=jnp.int32,
        raises=TypeError, match="dtype must be a floating dtype"),
    row("AttentionConfig-unknown-layout", Config, d_model=D, n_heads=4,
        sequence_layout="spiral", raises=ValueError, match="sequence_layout must be"),
    row("AttentionConfig-from-other-object", Config.from_config, object(), raises=TypeError,
        match="config must be an AttentionConfig or have d_model and n_heads"),
    row("AttentionConfig-zero-head-dim", Config, d_model=D, n_heads=4, head_dim=0,
        raises=ValueError, match="head_dim must be an int >= 1 or None, got head_dim=0"),
    row("AttentionConfig-float-head-dim", Config, d_model=D, n_heads=4, head_dim=8.0,
        raises=TypeError, match="head_dim must be an int >= 1 or None, got head_dim=8.0"),
    row("AttentionConfig-negative-scale", Config, d_model=D, n_heads=4, scale=-0.5,
        raises=ValueError, match="scale must be a finite float > 0, got scale=-0.5"),
    row("AttentionConfig-rope-scaling-without-rope", Config, d_model=D, n_heads=4,
        rope_scaling={"rope_type": "linear", "factor": 2.0}, raises=ValueError,
        match="needs rope_base: without it no RoPE is applied"),
    row("AttentionConfig-rope-scaling-unknown-key", Config, d_model=D, n_heads=4, rope_base=1e4,
        rope_scaling={"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 8,
                      "low_freq_factor": 1.0},
        raises=ValueError, match="rope_scaling key 'low_freq_factor' is not a parameter of "
                                 "rope_type 'yarn'"),
    row("AttentionConfig-odd-rotary-dim", Config, d_model=D, n_heads=4, rope_base=1e4,
        rotary_dim=3, raises=ValueError, match="got rotary_dim=3 with H=4"),
    row("AttentionConfig-odd-head-dim-rope", Config, d_model=D, n_heads=4, head_dim=7,
        rope_base=1e4, raises=ValueError,
        match="rope_base needs an even head width H, got head_dim=7"),
    row("AttentionConfig-unknown-rope-layout", Config, d_model=D, n_heads=4, rope_base=1e4,
        rope_layout="neox", raises=ValueError, match="rope_layout must be 'half' or 'interleaved'"),
    row("AttentionConfig-unknown-qk-norm", Config, d_model=D, n_heads=4, qk_norm="layer",
        raises=ValueError, match="qk_norm must be 'head', 'projection', True or False"),
    row("AttentionConfig-qk-norm-eps-without-norm", Config, d_model=D, n_heads=4,
        qk_norm_eps=1e-5, raises=ValueError, match="qk_norm_eps=1e-05 needs qk_norm"),
    row("AttentionConfig-zero-qk-norm-eps", Config, d_model=D, n_heads=4, qk_norm="head",
        qk_norm_eps=0.0, raises=ValueError, match="qk_norm_eps must be a finite float > 0"),
    row("AttentionConfig-string-qk-norm-offset", Config, d_model=D, n_heads=4, qk_norm="head",
        qk_norm_offset="1", raises=TypeError, match="qk_norm_offset must be a finite float"),
    row("AttentionConfig-int-out-bias", Config, d_model=D, n_heads=4, out_bias=0,
        raises=TypeError, match="out_bias must be True or False, got 0"),
    row("AttentionConfig-string-qkv-bias", Config, d_model=D, n_heads=4, qkv_bias="yes",
        raises=TypeError, match="qkv_bias must be True or False, got 'yes'"),
]  # fmt: skip

# from_transformers(config, state_dict, layer) and to_transformers(config, params, layer).
LLAMA = {
    "model_type": "llama",
    "hidden_size": D,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 2,
    "rope_theta": 1e4,
}
LLAMA_STATE = {
    f"model.layers.0.self_attn.{p}_proj.weight": f32(*shape)
    for p, shape in (("q", (D, D)), ("k", (D // 2, D)), ("v", (D // 2, D)), ("o", (D, D)))
}
ROWS += [
    row("from_transformers-unknown-family", linen.from_transformers,
        dict(LLAMA, model_type="falcon"), LLAMA_STATE, 0, raises=ValueError,
        match="config model_type 'falcon' is not supported; supported: llama, mistral"),
    row("from_transformers-config-not-a-dict", linen.from_transformers, "llama", LLAMA_STATE,
        0, raises=TypeError, match="config must be the model's configuration as a dict"),
    row("from_transformers-layer-out-of-range", linen.from_transformers, LLAMA, LLAMA_STATE, 2,
        raises=ValueError, match="layer must be in [0, 2) (num_hidden_layers), got layer=2"),
    row("from_transformers-negative-layer", linen.from_transformers, LLAMA, LLAMA_STATE, -1,
        raises=ValueError, match="layer must be in [0, 2)"),
    row("from_transformers-layer-missing", linen.from_transformers, LLAMA, LLAMA_STATE, 1,
        raises=ValueError, match="state_dict has no model.layers.1.self_attn.q_proj.weight"),
    row("from_transformers-wrong-shape", linen.from_transformers, LLAMA,
        LLAMA_STATE | {"model.layers.0.self_attn.k_proj.weight": f32(D, D)}, 0,
        raises=ValueError, match="state_dict model.layers.0.self_attn.k_proj.weight has shape "
                                 "(16, 16); the config gives (8, 16)"),
    row("from_transformers-unknown-rope", linen.from_transformers,
        LLAMA | {"rope_scaling": {"rope_type": "longrope"}}, LLAMA_STATE, 0, raises=ValueError,
        match="config rope_type 'longrope' is not supported"),
    row("to_transformers-wrong-shape", linen.to_transformers, LLAMA,
        {"qkv": {"kernel": f32(D, D)}, "out": {"kernel": f32(D, D)}}, raises=ValueError,
        match="params qkv/kernel has shape (16, 16); the config gives (16, 32)"),
    row("to_transformers-not-a-dict", linen.to_transformers, LLAMA, [1], raises=TypeError,
        match="params must be a dict of parameters, got list"),
]  # fmt: skip


# The modules. D = 16, N = 4 heads of width 4, K = 2 key/value heads; capacity 4 when decoding.
CONFIG = Config(d_model=D, n_heads=4, n_kv_heads=2)
DROPOUT = Config(d_model=D, n_heads=4, n_kv_heads=2, dropout=0.5)
X, CONTEXT = f32(B, T, D), f32(B, S, D)


@functools.cache
def linen_variables(kind: str):
    """The linen modules' variables, from the NNX twins (same parameters; no linen init to
    trace); with ``kind="decode"`` also an empty cache of capacity 4."""
    layer = nanoattn_nnx.CrossAttention if kind == "cross" else nanoattn_nnx.CausalSelfAttention
    variables = {"params": nanoattn_nnx.to_linen(layer(CONFIG, rngs=nnx.Rngs(0)))}
    if kind == "decode":
        kv = jnp.zeros((B, 4, 2, 4))  # (B, S, K, H): capacity 4, K = 2 heads of width 4
        variables["cache"] = {"key": kv, "value": kv, "position": jnp.zeros(B, jnp.int32)}
    return variables


def linen_self(x, config=CONFIG, deterministic=True, **kwargs):
    layer = linen.CausalSelfAttention(config)
    return layer.apply(linen_variables("self"), x, deterministic, **kwargs)


def linen_decode(x, **kwargs):
    layer = linen.CausalSelfAttention(CONFIG)
    return layer.apply(linen_variables("decode"), x, True, decode=True, mutable=["cache"], **kwargs)


def linen_cross(x, context, **kwargs):
    return linen.CrossAttention(CONFIG).apply(linen_variables("cross"), x, context, True, **kwargs)


def nnx_self(x, **kwargs):
    return nanoattn_nnx.CausalSelfAttention(CONFIG, rngs=nnx.Rngs(0))(x, **kwargs)


def nnx_decode(x, **kwargs):
    layer = nanoattn_nnx.CausalSelfAttention(CONFIG, rngs=nnx.Rngs(0))
    layer.init_cache(B, 4)
    return layer(x, decode=True, **kwargs)


def nnx_init_cache(*args, **kwargs):
    return nanoattn_nnx.CausalSelfAttention(CONFIG, rngs=nnx.Rngs(0)).init_cache(*args, **kwargs)


def nnx_cross(x, context, **kwargs):
    return nanoattn_nnx.CrossAttention(CONFIG, rngs=nnx.Rngs(0))(x, context, **kwargs)


def from_linen(params, config=CONFIG):
    return nanoattn_nnx.from_linen(config, params, rngs=nnx.Rngs(0))


MODULE_ROWS = [  # (id, linen call, nnx call, args, kwargs, raises, match): both frameworks
    ("x-rank-2", linen_self, nnx_self, (X[0],), {}, ValueError,
     "x must have shape (B, T, D) = (*, *, 16), got (3, 16)"),
    ("x-model-width", linen_self, nnx_self, (f32(B, T, 12),), {}, ValueError,
     "x must have shape (B, T, D) = (*, *, 16), got (2, 3, 12)"),
    ("int-x", linen_self, nnx_self, (i32(B, T, D),), {}, TypeError,
     "x must be a floating-point array, got dtype int32"),
    ("float-mask", linen_self, nnx_self, (X,), {"mask": np.ones((T, T))}, TypeError,
     "mask must be a boolean array"),
    ("mask-shape", linen_self, nnx_self, (X,), {"mask": np.ones((4, T), bool)}, ValueError,
     "mask must be broadcastable to (B, N, T, S) = (2, 4, 3, 3), got (4, 3)"),
    ("float-positions", linen_self, nnx_self, (X,), {"positions": np.arange(T, dtype=float)},
     TypeError, "positions must be an integer array"),
    ("positions-length", linen_self, nnx_self, (X,), {"positions": np.arange(4)}, ValueError,
     "positions must have shape (T,) = (3,), got (4,)"),
    ("float-segment-ids", linen_self, nnx_self, (X,), {"segment_ids": f32(B, T)}, TypeError,
     "segment_ids must be an integer array"),
    ("segment-ids-shape", linen_self, nnx_self, (X,), {"segment_ids": i32(B, 4)}, ValueError,
     "segment_ids must have shape (B, T) = (2, 3), got (2, 4)"),
    ("lengths-without-decode", linen_self, nnx_self, (X,), {"lengths": i32(B)}, ValueError,
     "lengths only applies with decode=True"),
    ("decode-past-capacity", linen_decode, nnx_decode, (f32(B, 5, D),), {}, ValueError,
     "the KV cache is full: capacity 4"),
    ("decode-negative-lengths", linen_decode, nnx_decode, (f32(B, 2, D),),
     {"lengths": np.array([-1, 1])}, ValueError,
     "lengths must be in [0, 2] (the chunk length), got lengths[0]=-1"),
    ("decode-oversized-lengths", linen_decode, nnx_decode, (f32(B, 2, D),),
     {"lengths": np.array([1, 3])}, ValueError,
     "lengths must be in [0, 2] (the chunk length), got lengths[1]=3"),
    ("decode-float-lengths", linen_decode, nnx_decode, (f32(B, 2, D),),
     {"lengths": np.array([1.0, 1.0])}, TypeError, "lengths must be an integer array"),
    ("decode-lengths-batch", linen_decode, nnx_decode, (f32(B, 2, D),),
     {"lengths": np.array([1, 1, 1])}, ValueError, "lengths must have shape (B,) = (2,)"),
    ("decode-batch", linen_decode, nnx_decode, (f32(3, 1, D),), {}, ValueError,
     "x must have shape (B, T, D) = (2, *, 16), got (3, 1, 16)"),
    ("decode-with-positions", linen_decode, nnx_decode, (f32(B, 1, D),),
     {"positions": np.arange(1)}, ValueError, "positions is not supported with decode=True"),
    ("decode-with-segment-ids", linen_decode, nnx_decode, (f32(B, 1, D),),
     {"segment_ids": i32(B, 1)}, ValueError, "segment_ids is not supported with decode=True"),
    ("decode-float-mask", linen_decode, nnx_decode, (f32(B, 1, D),), {"mask": np.ones((1, 4))},
     TypeError, "mask must be a boolean array"),
    ("cross-context-batch", linen_cross, nnx_cross, (X, f32(3, S, D)), {}, ValueError,
     "context must have shape (B, S, D) = (2, *, 16), got (3, 5, 16)"),
    ("cross-context-width", linen_cross, nnx_cross, (X, f32(B, S, 12)), {}, ValueError,
     "context must have shape (B, S, D) = (2, *, 16), got (2, 5, 12)"),
    ("cross-context-rank", linen_cross, nnx_cross, (X, CONTEXT[0]), {}, ValueError,
     "context must have shape (B, S, D)"),
    ("cross-x-width", linen_cross, nnx_cross, (f32(B, T, 12), CONTEXT), {}, ValueError,
     "x must have shape (B, T, D) = (*, *, 16), got (2, 3, 12)"),
    ("cross-int-x", linen_cross, nnx_cross, (i32(B, T, D), CONTEXT), {}, TypeError,
     "x must be a floating-point array"),
    ("cross-float-context_mask", linen_cross, nnx_cross, (X, CONTEXT),
     {"context_mask": np.ones((B, S))}, TypeError, "context_mask must be a boolean array"),
    ("cross-context_mask-shape", linen_cross, nnx_cross, (X, CONTEXT),
     {"context_mask": np.ones((B, 4), bool)}, ValueError,
     "context_mask must have shape (B, S) = (2, 5), got (2, 4)"),
    ("cross-4d-context_mask-shape", linen_cross, nnx_cross, (X, CONTEXT),
     {"context_mask": np.ones((B, 1, T, 4), bool)}, ValueError, "mask must be broadcastable"),
]  # fmt: skip

ROWS += [
    row(f"{framework}-{id}", call, *args, raises=raises, match=match, **kwargs)
    for id, linen_call, nnx_call, args, kwargs, raises, match in MODULE_ROWS
    for framework, call in (("linen", linen_call), ("nnx", nnx_call))
]

ROWS += [
    row("linen-dropout-without-rng", linen_self, X, config=DROPOUT, deterministic=False,
        raises=ValueError, match="needs a 'dropout' rng"),
    row("linen-config-not-a-config", lambda: linen.CausalSelfAttention(object()).init(
        jax.random.key(0), X), raises=TypeError, match="config must be an AttentionConfig"),
    row("nnx-rngs-None", nanoattn_nnx.CausalSelfAttention, CONFIG, rngs=None, raises=TypeError,
        match="rngs must be an nnx.Rngs"),
    row("nnx-dropout-without-stream", nanoattn_nnx.CausalSelfAttention, DROPOUT,
        rngs=nnx.Rngs(params=0), raises=ValueError, match="rngs has no 'dropout' stream"),
    row("nnx-decode-without-cache", nnx_self, X, decode=True, raises=ValueError,
        match="decode=True needs a cache: call module.init_cache(batch, max_len) first"),
    row("nnx-init_cache-zero-batch", nnx_init_cache, 0, 4, raises=ValueError,
        match="batch must be an int >= 1, got batch=0"),
    row("nnx-init_cache-negative-max_len", nnx_init_cache, B, -4, raises=ValueError,
        match="max_len must be an int >= 1, got max_len=-4"),
    row("nnx-init_cache-int-dtype", nnx_init_cache, B, 4, dtype=jnp.int32, raises=TypeError,
        match="dtype must be a floating dtype"),
    row("nnx-KVCache-not-a-cache", nanoattn_nnx.KVCache, 3, raises=TypeError,
        match="cache must be a KVCache"),
    row("nnx-from_linen-not-a-dict", from_linen, 3, raises=TypeError,
        match="linen_params must be a dict"),
    row("nnx-from_linen-unknown-layer", from_linen, {"foo": {}}, raises=ValueError,
        match="linen_params must hold a self-attention"),
    row("nnx-from_linen-missing-parameter", from_linen, {"qkv": {}}, raises=ValueError,
        match="linen_params lacks"),
    row("nnx-from_linen-other-width", lambda: from_linen(
        linen_variables("self"), Config(d_model=32, n_heads=4, n_kv_heads=2)),
        raises=ValueError, match="the config expects float32"),
    row("nnx-to_linen-not-a-module", nanoattn_nnx.to_linen, 3, raises=TypeError,
        match="module must be a nanoattn.nnx CausalSelfAttention or CrossAttention"),
]  # fmt: skip


# nanoattn.verify: the checks validate their own arguments before calling anything.
def identity(x):
    return x


def no_decoder(*args):
    raise AssertionError("the check ran although its arguments are bad")


causality, padding, decoding = verify.check_causality, verify.check_padding, verify.check_decoding
ROWS += [
    row("check_causality-no-width", causality, identity, raises=ValueError,
        match="pass d_model for float inputs (B, T, D) or vocab for token ids (B, T)"),
    row("check_causality-both-widths", causality, identity, d_model=2, vocab=3,
        raises=ValueError, match="exactly one of them"),
    row("check_causality-zero-d_model", causality, identity, d_model=0, raises=ValueError,
        match="d_model must be an int >= 1, got d_model=0"),
    row("check_causality-vocab-1", causality, identity, vocab=1, raises=ValueError,
        match="vocab must be an int >= 2, got vocab=1"),
    row("check_causality-zero-batch", causality, identity, d_model=2, batch=0,
        raises=ValueError, match="batch must be an int >= 1, got batch=0"),
    row("check_causality-negative-atol", causality, identity, d_model=2, atol=-1.0,
        raises=ValueError, match="atol must be >= 0"),
    row("check_causality-zero-length", causality, identity, d_model=2, seq_lens=(4, 0),
        raises=ValueError, match="seq_lens must be non-empty lengths >= 1"),
    row("check_causality-no-lengths", causality, identity, d_model=2, seq_lens=(),
        raises=ValueError, match="seq_lens must be non-empty lengths >= 1"),
    row("check_padding-negative-lengths", padding, identity, d_model=2, lengths=[-1, 2],
        raises=ValueError, match="lengths must have shape (B,) = (2,) with values in [0, 9]"),
    row("check_padding-oversized-lengths", padding, identity, d_model=2, lengths=[10, 2],
        raises=ValueError, match="got [10, 2]"),
    row("check_padding-lengths-batch", padding, identity, d_model=2, lengths=[1, 2, 3],
        raises=ValueError, match="lengths must have shape (B,) = (2,)"),
    row("check_padding-zero-seq_len", padding, identity, d_model=2, seq_len=0,
        raises=ValueError, match="seq_len must be >= 1, got 0"),
    row("check_padding-zero-batch", padding, identity, d_model=2, batch=0, raises=ValueError,
        match="batch must be an int >= 1"),
    row("check_causality-zero-max_len", causality, identity, d_model=2, max_len=0,
        raises=ValueError, match=Whole("max_len must be None or an int >= 1, got max_len=0")),
    row("check_causality-float-max_len", causality, identity, d_model=2, max_len=20.0,
        raises=ValueError, match="max_len must be None or an int >= 1, got max_len=20.0"),
    row("check_causality-max_len-below-every-length", causality, identity, d_model=2,
        seq_lens=(17, 33), max_len=16, raises=ValueError,
        match=Whole("every length in seq_lens=[17, 33] exceeds max_len=16: nothing to check")),
    row("check_padding-string-max_len", padding, identity, d_model=2, max_len="8",
        raises=ValueError, match="max_len must be None or an int >= 1, got max_len='8'"),
    row("check_padding-seq_len-above-max_len", padding, identity, d_model=2, seq_len=9,
        max_len=8, raises=ValueError, match=Whole("seq_len=9 exceeds max_len=8: nothing to check")),
    row("check_decoding-seq_len-1", decoding, no_decoder, no_decoder, no_decoder, d_model=2,
        seq_len=1, raises=ValueError, match="seq_len must be an int >= 2, got seq_len=1"),
    row("check_decoding-zero-batch", decoding, no_decoder, no_decoder, no_decoder, d_model=2,
        batch=0, raises=ValueError, match="batch must be an int >= 1, got batch=0"),
    row("check_decoding-ragged-string", decoding, no_decoder, no_decoder, no_decoder,
        d_model=2, ragged="yes", raises=ValueError, match="ragged must be None, True or False"),
    row("check_decoding-no-width", decoding, no_decoder, no_decoder, no_decoder,
        raises=ValueError, match="pass d_model for float inputs"),
    row("check_shapes-zero-batch", verify.check_shapes, CONFIG, batch=0, seq_len=T,
        raises=ValueError, match="batch must be an int >= 1, got batch=0"),
    row("check_shapes-negative-seq_len", verify.check_shapes, CONFIG, batch=B, seq_len=-1,
        raises=ValueError, match="seq_len must be an int >= 1, got seq_len=-1"),
    row("check_shapes-zero-kv_len", verify.check_shapes, CONFIG, batch=B, seq_len=T, kv_len=0,
        raises=ValueError, match="kv_len must be an int >= 1, got kv_len=0"),
    row("check_shapes-not-a-config", verify.check_shapes, 3, batch=B, seq_len=T,
        raises=TypeError, match="config must be an AttentionConfig"),
    row("check_row_sums-float-allowed", verify.check_row_sums, f32(T, S), MASK.astype(float),
        raises=TypeError, match="allowed must be a boolean array"),
    row("check_row_sums-allowed-shape", verify.check_row_sums, f32(T, S), np.ones((S, T), bool),
        raises=ValueError, match="allowed must be broadcastable to (T, S) = (3, 5), got (5, 3)"),
    row("check_row_sums-negative-atol", verify.check_row_sums, f32(T, S), MASK, atol=-1.0,
        raises=ValueError, match="atol must be >= 0"),
]  # fmt: skip


@pytest.mark.parametrize("fn, args, kwargs, raises, match", ROWS)
def test_bad_input_raises_one_line_error(fn, args, kwargs, raises, match):
    with pytest.raises(Exception) as info:
        fn(*args, **kwargs)
    error = info.value
    message = str(error)
    assert type(error) is raises, f"{type(error).__module__}.{type(error).__name__}: {message}"
    assert message and "\n" not in message, repr(message)
    assert message == match if isinstance(match, Whole) else match in message, message


# The command line: (id, argv, substring of the one line on stderr).
CLI_ROWS = [
    ("no-command", [], "the following arguments are required: command"),
    ("unknown-command", ["frobnicate"], "invalid choice: 'frobnicate'"),
    ("audit-unknown-option", ["audit", "--bogus"], "unrecognized arguments: --bogus"),
    ("audit-zero-d-model", ["audit", "--d-model", "0"], "d_model must be >= 1, got d_model=0"),
    ("audit-negative-d-model", ["audit", "--d-model", "-8"], "d_model must be >= 1"),
    ("audit-float-d-model", ["audit", "--d-model", "1.5"], "invalid int value: '1.5'"),
    ("audit-negative-heads", ["audit", "--heads", "-1"], "n_heads must be >= 1, got n_heads=-1"),
    ("audit-heads-not-dividing", ["audit", "--d-model", "130"],
     "d_model=130 is not divisible by n_heads=4"),
    ("audit-kv-heads-not-dividing", ["audit", "--kv-heads", "3"],
     "n_kv_heads=3 does not divide n_heads=4"),
    ("audit-negative-kv-heads", ["audit", "--kv-heads", "-2"], "n_kv_heads must be an int >= 1"),
    ("audit-zero-batch", ["audit", "--batch", "0"], "--batch must be >= 1, got 0"),
    ("audit-word-batch", ["audit", "--batch", "two"], "invalid int value: 'two'"),
    ("audit-negative-seq-len", ["audit", "--seq-len", "-3"], "--seq-len must be >= 1, got -3"),
    ("audit-negative-kv-len", ["audit", "--kv-len", "-1"], "--kv-len must be >= 1, got -1"),
    ("audit-negative-length", ["audit", "--lengths=-1,5"],
     "--lengths: each length must be in [0, 5], got -1"),
    ("audit-negative-length-spaced", ["audit", "--lengths", "-1,5"],
     "--lengths: each length must be in [0, 5], got -1"),
    ("audit-oversized-length", ["audit", "--lengths", "5,9"],
     "--lengths: each length must be in [0, 5], got 9"),
    ("audit-lengths-batch", ["audit", "--lengths", "5,4,3"],
     "--lengths gives 3 lengths for --batch 2"),
    ("audit-word-lengths", ["audit", "--lengths", "a,b"], "expected comma-separated integers"),
    ("verify-no-target", ["verify", "--d-model", "4"],
     "the following arguments are required: MODULE:OBJECT"),
    ("verify-no-width", ["verify", "math:sqrt"], "give --d-model D for float inputs"),
    ("verify-both-widths", ["verify", "math:sqrt", "--d-model", "4", "--vocab", "9"],
     "give --d-model D for float inputs or --vocab V for token ids (one)"),
    ("verify-zero-d-model", ["verify", "math:sqrt", "--d-model", "0"],
     "--d-model must be >= 1, got 0"),
    ("verify-vocab-1", ["verify", "math:sqrt", "--vocab", "1"], "--vocab must be >= 2, got 1"),
    ("verify-zero-batch", ["verify", "math:sqrt", "--d-model", "4", "--batch", "0"],
     "--batch must be >= 1, got 0"),
    ("verify-negative-atol", ["verify", "math:sqrt", "--d-model", "4", "--atol=-1e-3"],
     "--atol must be >= 0"),
    ("verify-negative-atol-spaced", ["verify", "math:sqrt", "--d-model", "4", "--atol", "-1e-3"],
     "--atol must be >= 0, got -0.001"),
    ("verify-nan-atol", ["verify", "math:sqrt", "--d-model", "4", "--atol", "nan"],
     "--atol must be >= 0, got nan"),
    ("verify-word-atol", ["verify", "math:sqrt", "--d-model", "4", "--atol", "tiny"],
     "invalid float value: 'tiny'"),
    ("verify-zero-length", ["verify", "math:sqrt", "--d-model", "4", "--seq-lens", "4,0"],
     "--seq-lens must be lengths >= 1"),
    ("verify-seq-len-without-decode", ["verify", "math:sqrt", "--d-model", "4", "--seq-len", "8"],
     "--seq-len only applies with --decode"),
    ("verify-decode-seq-len-1", ["verify", "math:sqrt", "--d-model", "4", "--decode",
                                 "--seq-len", "1"], "--seq-len must be >= 2, got 1"),
    ("verify-decode-seq-lens", ["verify", "math:sqrt", "--d-model", "4", "--decode",
                                "--seq-lens", "4"], "--seq-lens is for the causality check"),
    ("verify-zero-max-len", ["verify", "math:sqrt", "--d-model", "4", "--max-len", "0"],
     "argument --max-len: expected an int >= 1, got 0"),
    ("verify-negative-max-len", ["verify", "math:sqrt", "--d-model", "4", "--max-len", "-20"],
     "argument --max-len: expected an int >= 1, got -20"),
    ("verify-word-max-len", ["verify", "math:sqrt", "--d-model", "4", "--max-len", "long"],
     "argument --max-len: expected an int >= 1, got 'long'"),
    ("verify-max-len-below-seq-lens", ["verify", "math:sqrt", "--d-model", "4", "--seq-lens",
                                       "17,33", "--max-len", "16"],
     "every length of --seq-lens 17,33 exceeds --max-len 16"),
    ("verify-decode-max-len", ["verify", "math:sqrt", "--d-model", "4", "--decode",
                               "--max-len", "20"], "--max-len is for the causality check"),
    ("verify-target-without-colon", ["verify", "math", "--d-model", "4"],
     "target must look like MODULE:OBJECT, got 'math'"),
    ("verify-unimportable-module", ["verify", "nanoattn_no_such_module:f", "--d-model", "4"],
     "cannot import nanoattn_no_such_module: ModuleNotFoundError"),
    ("verify-missing-attribute", ["verify", "math:nope", "--d-model", "4"],
     "math has no attribute 'nope'"),
    ("verify-not-callable", ["verify", "math:pi", "--d-model", "4"],
     "math:pi is a float, not a callable"),
    ("verify-factory-returns-non-callable", ["verify", "itertools:count", "--d-model", "4"],
     "the factory itertools:count() returned a count, not a callable"),
    ("verify-decode-not-a-decoder", ["verify", "math:sqrt", "--d-model", "4", "--decode"],
     "math:sqrt takes arguments: --decode needs a (full, init, step) decoder"),
    ("bench-unknown-option", ["bench", "--fast"], "unrecognized arguments: --fast"),
    ("bench-zero-tokens", ["bench", "--tokens", "0"], "--tokens must be >= 1, got 0"),
    ("bench-negative-tokens", ["bench", "--tokens", "-8"], "--tokens must be >= 1, got -8"),
    ("bench-zero-length", ["bench", "--lengths", "16,0"], "--lengths must be >= 1"),
    ("bench-negative-length", ["bench", "--lengths", "-16"], "--lengths must be >= 1"),
    ("bench-word-lengths", ["bench", "--lengths", "short"], "expected comma-separated integers"),
    ("bench-half-shape", ["bench", "--shapes", "4x"], "--shapes must look like 4x32,12x64"),
    ("bench-zero-heads", ["bench", "--shapes", "0x32"], "--shapes must look like 4x32,12x64"),
    ("bench-word-shape", ["bench", "--shapes", "axb"], "--shapes must look like 4x32,12x64"),
    ("bench-unknown-implementation", ["bench", "--impls", "flash,fast"],
     "unknown implementation 'fast'"),
    ("bench-zero-context", ["bench", "--contexts", "0"], "--contexts must be >= 1"),
    ("bench-zero-window-length", ["bench", "--window-length", "0"],
     "--window-length must be >= 1, got 0"),
    ("bench-unknown-part", ["bench", "--only", "grid,speed"], "expected parts from grid"),
    ("bench-no-part", ["bench", "--only", ","], "expected parts from grid"),
    ("bench-unknown-dtype", ["bench", "--dtype", "float16"], "invalid choice: 'float16'"),
    ("bench-negative-score-limit", ["bench", "--max-score-gib", "-1"],
     "--max-score-gib must be >= 0, got -1.0"),
    ("bench-nan-score-limit", ["bench", "--max-score-gib", "nan"],
     "--max-score-gib must be >= 0, got nan"),
    ("bench-word-score-limit", ["bench", "--max-score-gib", "lots"], "invalid float value"),
]  # fmt: skip


def must_not_run(*args, **kwargs):
    raise AssertionError("the command ran although its input is bad")


@pytest.mark.parametrize("argv, match", [pytest.param(a, m, id=i) for i, a, m in CLI_ROWS])
def test_cli_bad_input_exits_2_with_one_line(capsys, monkeypatch, argv, match):
    # Bad input must be refused before any work: the work itself is replaced by a failure.
    monkeypatch.setattr(_audit, "check_shapes", must_not_run)
    monkeypatch.setattr(_verify, "check_causality", must_not_run)
    monkeypatch.setattr(_verify, "check_decoding", must_not_run)
    monkeypatch.setattr(_bench, "run_bench", must_not_run)
    code = main(argv)
    out, err = capsys.readouterr()
    assert code == 2 and out == ""
    lines = err.splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith("nanoattn") and ": error: " in lines[0], lines[0]
    assert match in lines[0], lines[0]


def test_cli_entry_point_bad_input_exits_2_without_traceback():
    """The installed ``nanoattn`` script, as a user runs it: exit 2, one line, no traceback."""
    script = pathlib.Path(sys.executable).with_name("nanoattn")
    command = [str(script)] if script.exists() else [sys.executable, "-m", "nanoattn"]
    done = subprocess.run(
        [*command, "bench", "--tokens", "-8"], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.splitlines() == ["nanoattn bench: error: --tokens must be >= 1, got -8"]
