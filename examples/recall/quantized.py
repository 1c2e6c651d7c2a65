"""The trained model with quantized KV caches (nanoattn's
``AttentionConfig(kv_cache_dtype=)``): does an int8 or float8 cache change the tokens
the model decodes greedily, and how far is each attention layer's output from float64?

* **Agreement.** Held-out recall sequences decoded through the cache as greedy
  generation does it: one prefill call of the prompt ``RECALL v1 k1 ... vP kP SEP``,
  then one token per call, each sequence's own tokens fed at every step (teacher
  forcing, so that one differing token does not change the inputs of the steps after
  it). At every step the greedy token (the argmax of the logits) of the model with a
  quantized cache is compared with the float cache's: the share of steps where they
  are equal, over every step and over the answer steps (the tokens the task
  determines; the other steps predict the next query, which is random).
* **Layer error.** The input of each attention layer (its block's normed residual
  stream, from the float model's forward on the same sequences) decoded through that
  layer alone with each cache (float32, int8, float8_e4m3fn) on the same schedule,
  against the layer's full forward in float64 (parameters and input in float64, in
  JAX's x64 mode): the largest absolute difference of an output feature, relative to
  the largest output.

``python -m examples.recall quantized`` prints both (target: int8 agrees on at least
99% of the steps); ``nanoattn bench --only serving`` reports the cache's bytes and
speed, not this, since it has no trained model.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from . import data
from .model import Decoder

STORAGE_DTYPES = ("int8", "float8_e4m3fn")
TARGET = 0.99  # int8's greedy tokens equal the float cache's on at least this share of steps


def with_cache(model: Decoder, kv_cache_dtype: str | None) -> Decoder:
    """``model``'s parameters in a decoder whose every layer keeps its KV cache in
    ``kv_cache_dtype`` (None: the float cache), in evaluation mode."""
    return model.rebuilt(kv_cache_dtype=kv_cache_dtype)


def decode(module, x, prefix: int) -> np.ndarray:
    """``module`` (the decoder, or one attention layer: both have ``init_cache`` and
    ``module(chunk, decode=True)``) fed x (B, T, ...) through a fresh cache of T
    tokens: one call of the first ``prefix`` tokens, then one call per token. Returns
    the outputs (B, T, ...) of every position."""
    B, T = x.shape[:2]
    module = nnx.clone(module)
    module.init_cache(B, T)
    graphdef, state = nnx.split(module)
    state, y = _call(graphdef, state, x[:, :prefix])
    outputs = [y]
    for t in range(prefix, T):
        state, y = _call(graphdef, state, x[:, t : t + 1])
        outputs.append(y)
    return np.concatenate(jax.device_get(outputs), axis=1)


@functools.partial(jax.jit, static_argnums=0)  # per module and chunk shape: prefill, step
def _call(graphdef, state, chunk):
    """One decoding call of the module ``graphdef`` with ``state``: (new state, outputs)."""
    module = nnx.merge(graphdef, state)
    y = module(chunk, decode=True)
    return nnx.state(module), y


@dataclasses.dataclass(frozen=True)
class Agreement:
    """One cache's greedy tokens against the float cache's, and against the answers.

    Attributes:
      steps, equal: decoding steps, and those whose greedy token is the float cache's.
      answer_steps, answer_equal: the same over the steps that predict an answer.
      answers_right: answer steps whose greedy token is the right answer.
    """

    steps: int
    equal: int
    answer_steps: int
    answer_equal: int
    answers_right: int

    @property
    def fraction(self) -> float:
        return self.equal / self.steps

    @property
    def answer_fraction(self) -> float:
        return self.answer_equal / self.answer_steps

    @classmethod
    def of(cls, greedy, reference, truth, graded) -> "Agreement":
        """Greedy tokens (B, steps) against the ``reference`` ones and the ``truth``,
        ``graded`` (B, steps) True at the steps that predict an answer."""
        same = greedy == reference
        return cls(
            steps=same.size, equal=int(same.sum()), answer_steps=int(graded.sum()),
            answer_equal=int(same[graded].sum()),
            answers_right=int((greedy == truth)[graded].sum()),
        )  # fmt: skip


def greedy_steps(model: Decoder, tokens: np.ndarray, prefix: int) -> np.ndarray:
    """The greedy token of every decoding step, (B, T - prefix): step i predicts token
    ``prefix + i`` from the tokens before it (the prefill's last position, then each
    one-token call but the last)."""
    logits = decode(model, tokens, prefix)  # (B, T, V)
    return logits[:, prefix - 1 : -1].argmax(-1)


def _name(dtype: str | None) -> str:
    return "float32" if dtype is None else dtype


def stages(model: Decoder, dtypes=STORAGE_DTYPES) -> list[str]:
    """What :func:`measure` computes, in order, one name per stage (``progress``): the
    greedy tokens through each cache, then per attention layer its float64 forward and
    its decoding through each cache."""
    caches = [_name(d) for d in (None, *dtypes)]
    names = [f"greedy tokens, {c} cache" for c in caches]
    for layer in range(model.config.n_layers):
        names += [f"layer {layer}, float64 forward"]
        names += [f"layer {layer}, {c} cache" for c in caches]
    return names


def agreement(
    model: Decoder, tokens, answers, prefix: int, dtypes=STORAGE_DTYPES, progress=None
) -> dict:
    """``{None: Agreement, dtype: Agreement, ...}``: the float cache (against itself,
    its answers right) and each of ``dtypes`` against it, on recall sequences
    ``tokens`` (B, T) with ``answers`` (B, T) True at the answer tokens.
    ``progress(stage)`` is called as each cache's decoding begins."""
    progress = progress or (lambda stage: None)
    graded = np.asarray(answers)[:, prefix:]  # (B, T - prefix): steps predicting an answer
    truth = np.asarray(tokens)[:, prefix:]
    out, reference = {}, None
    for dtype in (None, *dtypes):
        progress(f"greedy tokens, {_name(dtype)} cache")
        greedy = greedy_steps(with_cache(model, dtype), tokens, prefix)
        reference = greedy if dtype is None else reference
        out[dtype] = Agreement.of(greedy, reference, truth, graded)
    return out


def layer_inputs(model: Decoder, tokens) -> list[np.ndarray]:
    """The input of every attention layer, (B, T, D) float32 each: its block's
    ``attn_norm`` of the residual stream, in the float model's full forward."""
    graphdef, state = nnx.split(model)
    return [np.asarray(x) for x in _layer_inputs(graphdef, state, jnp.asarray(tokens))]


@functools.partial(jax.jit, static_argnums=0)
def _layer_inputs(graphdef, state, tokens):
    model = nnx.merge(graphdef, state)
    x, inputs = model.embed(tokens), []
    for block in model.blocks:
        inputs.append(block.attn_norm(x))
        x = block(x, mask=None, decode=False, lengths=None, pages=None, deterministic=True,
                  rngs=None)  # fmt: skip
    return inputs


def float64_forward(layer, x) -> np.ndarray:
    """``layer``'s full forward on x in float64: its parameters and x cast, in JAX's
    x64 mode (the layer computes in its input's dtype)."""
    with jax.enable_x64(True):
        graphdef, state = nnx.split(layer)
        state = jax.tree.map(
            lambda a: a.astype(jnp.float64) if jnp.issubdtype(a.dtype, jnp.floating) else a,
            state,
        )
        y = _forward(graphdef, state, jnp.asarray(x, jnp.float64))
        if y.dtype != jnp.float64:
            raise ValueError(f"the float64 reference computed in {y.dtype}")
        return np.asarray(y)


@functools.partial(jax.jit, static_argnums=0)
def _forward(graphdef, state, x):
    return nnx.merge(graphdef, state)(x)


def layer_errors(
    model: Decoder, tokens, prefix: int, dtypes=(None, *STORAGE_DTYPES), progress=None
) -> list:
    """Per attention layer, ``{dtype: error}``: the layer decoding its input through a
    cache of ``dtype`` (None: float32) on the schedule of :func:`decode`, against its
    float64 full forward, as ``max |y - y64| / max |y64|``. ``progress(stage)`` is
    called as each layer's float64 forward and each decoding begins."""
    progress = progress or (lambda stage: None)
    base = with_cache(model, None)
    models = {dtype: with_cache(model, dtype) for dtype in dtypes}
    errors = []
    for layer, x in enumerate(layer_inputs(base, tokens)):
        progress(f"layer {layer}, float64 forward")
        reference = float64_forward(base.blocks[layer].attn, x)
        scale = np.abs(reference).max()
        errors.append({})
        for dtype, m in models.items():
            progress(f"layer {layer}, {_name(dtype)} cache")
            y = decode(m.blocks[layer].attn, x, prefix)
            errors[-1][dtype] = float(np.abs(y - reference).max() / scale)
    return errors


@dataclasses.dataclass(frozen=True)
class Measured:
    """What :func:`measure` found: the agreement per cache, the layer errors, the
    sequences and steps it took."""

    agreement: dict
    errors: list
    sequences: int
    prefix: int
    seq_len: int

    @property
    def passed(self) -> bool:
        return self.agreement["int8"].fraction >= TARGET


def measure(
    model: Decoder, task: data.TaskConfig, seed: int, sequences: int, progress=None
) -> Measured:
    """Both measures on ``sequences`` held-out recall sequences of the run's stream;
    ``progress(stage)`` is called as each of :func:`stages` begins (a decoding
    compiles, then runs: seconds to a minute each at the command's sizes)."""
    tokens, answers = data.held_out(seed, task, sequences, 1)["recall"]
    prefix = 2 + 2 * task.pairs  # RECALL, the pairs, SEP
    return Measured(
        agreement(model, tokens, answers, prefix, progress=progress),
        layer_errors(model, tokens, prefix, progress=progress),
        sequences, prefix, task.seq_len,
    )  # fmt: skip
