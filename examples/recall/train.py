"""Training: optax AdamW on on-the-fly batches, a tqdm progress bar, periodic
exact-match evaluation on held-out sequences, orbax checkpoints, bit-exact resume
and the loss/accuracy plot.

Everything random in a step is a function of ``(seed, step)``: the batch
(``data.train_batch``) and the dropout key (``fold_in(key(seed), step)``). A
checkpoint holds the parameters and the optimizer's state (its step count
included), so a run resumed from step s computes exactly the steps s+1, s+2, ...
of the uninterrupted run, bit for bit.
"""

import dataclasses
import functools
import hashlib
import shutil
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from tqdm.auto import tqdm

from . import checkpoint, data
from .model import Decoder, ModelConfig


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """How to train.

    Attributes:
      seed: the one seed of the run: initial parameters, batches, dropout.
      steps: optimizer steps in the whole run.
      batch: sequences per step.
      lr: the peak learning rate (linear warmup, then cosine decay to lr / 10).
      warmup: warmup steps.
      weight_decay: AdamW's decoupled weight decay.
      eval_every: evaluate on the held-out sequences every this many steps.
      eval_recall, eval_copy: held-out recall and copy sequences.
      checkpoint_every: save a checkpoint every this many steps (and at the end).
      log_every: record the mean training loss every this many steps.
    """

    seed: int = 0
    steps: int = 2000
    batch: int = 32
    lr: float = 3e-3
    warmup: int = 50
    weight_decay: float = 0.01
    eval_every: int = 100
    eval_recall: int = 1000
    eval_copy: int = 250
    checkpoint_every: int = 250
    log_every: int = 10

    def __post_init__(self):
        for name in ("steps", "batch", "eval_every", "checkpoint_every", "log_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {name}={getattr(self, name)}")


@dataclasses.dataclass
class Run:
    """A run's configuration and what it recorded: ``history`` holds
    ``{"step", "loss"}`` every ``log_every`` steps and ``{"step", "recall",
    "recall_answers", "copy"}`` at every evaluation."""

    model: ModelConfig
    task: data.TaskConfig
    train: TrainConfig
    history: list = dataclasses.field(default_factory=list)

    def to_json(self) -> dict:
        return {
            "model": dataclasses.asdict(self.model),
            "task": dataclasses.asdict(self.task),
            "train": dataclasses.asdict(self.train),
            "history": self.history,
        }

    @classmethod
    def from_json(cls, meta: dict) -> "Run":
        return cls(
            ModelConfig(**meta["model"]),
            data.TaskConfig(**meta["task"]),
            TrainConfig(**meta["train"]),
            list(meta["history"]),
        )

    def evals(self) -> list[dict]:
        return [h for h in self.history if "recall" in h]


@functools.cache  # one object per config: equal graph definitions, one compiled step
def optimizer(cfg: TrainConfig) -> optax.GradientTransformation:
    schedule = optax.warmup_cosine_decay_schedule(
        0.0, cfg.lr, cfg.warmup, max(cfg.steps, cfg.warmup + 1), end_value=cfg.lr / 10
    )
    return optax.chain(
        optax.clip_by_global_norm(1.0),
        optax.adamw(schedule, b2=0.98, weight_decay=cfg.weight_decay),
    )


def build(run: Run) -> tuple[Decoder, nnx.Optimizer]:
    """The model and optimizer at step 0 of ``run`` (initialised in one compiled call)."""
    return _initialiser(run.model, run.train)()


@functools.cache  # compiled once per configuration
def _initialiser(model: ModelConfig, cfg: TrainConfig):
    @nnx.jit
    def create():
        decoder = Decoder(model, rngs=nnx.Rngs(cfg.seed))
        return decoder, nnx.Optimizer(decoder, optimizer(cfg), wrt=nnx.Param)

    return create


def answer_loss(logits, tokens, answers):
    """Mean cross-entropy of the answer tokens: logits (B, T-1, V) predict tokens[:, 1:]."""
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:])  # (B, T-1)
    weights = answers[:, 1:]
    return (ce * weights).sum() / jnp.maximum(weights.sum(), 1)


@functools.cache
def step_function(graphdef, seed: int):
    """The jitted training step ``(state, tokens, answers, step) -> (state, loss)``."""

    @jax.jit
    def train_step(state, tokens, answers, step):
        model, opt = nnx.merge(graphdef, state)
        key = jax.random.fold_in(jax.random.key(seed), step)

        def loss_fn(model):
            rngs = nnx.Rngs(dropout=key)
            logits = model(tokens[:, :-1], deterministic=False, rngs=rngs)
            return answer_loss(logits, tokens, answers)

        loss, grads = nnx.value_and_grad(loss_fn)(model)
        opt.update(model, grads)
        return nnx.state((model, opt)), loss

    return train_step


@functools.partial(nnx.jit, static_argnames="chunk")
def _correct(model: Decoder, tokens, answers, chunk: int):
    """Per sequence: all answers right (B,), and right answers (B,), teacher-forced."""
    right, exact = [], []
    for start in range(0, tokens.shape[0], chunk):
        t, a = tokens[start : start + chunk], answers[start : start + chunk, 1:]
        hit = jnp.argmax(model(t[:, :-1]), -1) == t[:, 1:]  # (b, T-1)
        exact.append(jnp.all(hit | ~a, axis=1))
        right.append(jnp.sum(hit & a, axis=1))
    return jnp.concatenate(exact), jnp.concatenate(right)


def evaluate(model: Decoder, held_out: dict) -> dict:
    """Exact-match accuracy on the held-out sequences: the share of sequences whose
    every answer is the model's top token given the tokens before it. For both tasks
    that is also what greedy generation gets right: every answer follows its query
    (recall), or the previous answers, which are then right too (copy)."""
    tokens = np.concatenate([t for t, _ in held_out.values()])  # one compiled call
    answers = np.concatenate([a for _, a in held_out.values()])
    exact, right = jax.device_get(_correct(model, tokens, answers, chunk=250))
    out, start = {}, 0
    for task, (t, a) in held_out.items():
        rows = slice(start, start + len(t))
        out[task] = float(exact[rows].mean())
        if task == "recall":
            out["recall_answers"] = float(right[rows].sum() / a[:, 1:].sum())
        start += len(t)
    return out


def _format_time(seconds: float) -> str:
    return f"{int(seconds // 60)}m{seconds % 60:04.1f}s"


def check_resumable(run: Run, out: Path) -> None:
    """Raises ValueError when ``out`` holds checkpoints of a run with another
    configuration, naming each option that differs (as its flag of the command line)."""
    ckpt_dir = Path(out) / "checkpoints"
    step = checkpoint.latest(ckpt_dir)
    if step is None:
        return
    saved = Run.from_json(checkpoint.load_meta(ckpt_dir, step)).to_json()
    given = run.to_json()
    differ = [
        f"--{name.replace('_', '-')} {given[part][name]}, saved {saved[part].get(name)}"
        for part in ("model", "task", "train")
        for name in given[part]
        if name != "vocab" and given[part][name] != saved[part].get(name)
    ]
    if differ or saved | {"history": []} != given | {"history": []}:
        which = f" ({'; '.join(differ)})" if differ else ""
        raise ValueError(
            f"{ckpt_dir} holds a run with another configuration{which}: pass --restart "
            "to replace it, or choose another --run"
        )


def train(
    run: Run,
    out: Path,
    *,
    stop_at: int | None = None,
    restart: bool = False,
    progress: bool = True,
    log=print,
) -> tuple[Decoder, Run]:
    """Trains ``run`` in ``out`` (checkpoints in ``out/checkpoints``, the plot in
    ``out/curve.png``), resuming from the latest checkpoint there unless ``restart``.
    Stops after step ``stop_at`` (default: the run's last step), with a checkpoint.

    Returns the trained model and the run, with its history.
    """
    cfg, out = run.train, Path(out)
    ckpt_dir = out / "checkpoints"
    if restart and ckpt_dir.exists():
        shutil.rmtree(ckpt_dir)
    model, opt = build(run)
    graphdef, state = nnx.split((model, opt))
    # Committed to the device, as restored arrays are: the same compiled step either way.
    state = jax.device_put(state, jax.devices()[0])
    start, pending = checkpoint.latest(ckpt_dir) or 0, []
    if start:
        check_resumable(run, out)
        saved = Run.from_json(checkpoint.load_meta(ckpt_dir, start))
        run.history = saved.history
        pending = [np.float32(x) for x in checkpoint.load_meta(ckpt_dir, start)["pending"]]
        restored = checkpoint.load_state(ckpt_dir, start, nnx.to_pure_dict(state))
        nnx.replace_by_pure_dict(state, restored)
        log(f"resuming from the checkpoint at step {start} in {ckpt_dir}")
    stop = cfg.steps if stop_at is None else min(stop_at, cfg.steps)
    held_out = data.held_out(cfg.seed, run.task, cfg.eval_recall, cfg.eval_copy)
    train_step = step_function(graphdef, cfg.seed)
    mngr = checkpoint.manager(ckpt_dir)
    tokens_per_step = cfg.batch * (run.task.seq_len - 1)
    wall0, cpu0 = time.perf_counter(), time.process_time()
    bar = tqdm(
        total=cfg.steps, initial=start, desc="train", unit="step", disable=not progress, ncols=110
    )
    losses, last_eval = pending, {}  # the losses of the steps since the last record
    window_start, window_tokens = time.perf_counter(), 0

    def save(step):
        meta = run.to_json() | {"pending": [float(x) for x in jax.device_get(losses)]}
        checkpoint.save(mngr, step, nnx.to_pure_dict(nnx.state((model, opt))), meta)

    done = start  # the last step whose update is in `state` and whose loss is in `losses`
    try:
        for step in range(start + 1, stop + 1):
            tokens, answers = data.train_batch(cfg.seed, step, run.task, cfg.batch)
            new_state, loss = train_step(state, tokens, answers, step)
            state, losses, done = new_state, [*losses, loss], step
            window_tokens += tokens_per_step
            bar.update()
            if step % cfg.log_every == 0:
                mean = float(np.mean(np.asarray(jax.device_get(losses), np.float32)))
                run.history.append({"step": step, "loss": mean})
                losses, now = [], time.perf_counter()
                bar.set_postfix_str(
                    f"loss {mean:.4f}, {window_tokens / (now - window_start):,.0f} tok/s"
                    + (f", recall {last_eval['recall']:.1%}" if last_eval else ""),
                    refresh=False,
                )
                window_start, window_tokens = now, 0
            if step % cfg.eval_every == 0 or step == cfg.steps:
                nnx.update((model, opt), state)
                last_eval = evaluate(model, held_out)
                run.history.append({"step": step, **last_eval})
                loss = next(h["loss"] for h in reversed(run.history) if "loss" in h)
                bar.write(
                    f"step {step:5d}  loss {loss:.4f}  "
                    f"recall exact match {last_eval['recall']:.1%} "
                    f"(answers {last_eval['recall_answers']:.2%})  copy {last_eval['copy']:.1%}"
                )
                window_start = time.perf_counter()
            if step % cfg.checkpoint_every == 0 or step == stop:
                nnx.update((model, opt), state)
                save(step)
                window_start = time.perf_counter()
    except KeyboardInterrupt:
        bar.write(f"interrupted: saving step {done}")
        if done > start:
            nnx.update((model, opt), state)
            save(done)
        raise
    finally:
        bar.close()
        mngr.close()
    nnx.update((model, opt), state)
    wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
    log(
        f"steps {start + 1}-{stop} in {_format_time(wall)} wall, {_format_time(cpu)} CPU "
        f"({cpu / max(wall, 1e-9):.2f} cores busy on average)"
    )
    log(f"parameters at step {stop}: sha256 {fingerprint(model)[:16]}")
    return model, run


def fingerprint(model: Decoder) -> str:
    """The SHA-256 of every parameter's bytes, in a fixed order: equal digests, equal bits."""
    digest = hashlib.sha256()
    for leaf in jax.tree.leaves(nnx.state(model, nnx.Param)):
        digest.update(np.asarray(leaf).tobytes())
    return digest.hexdigest()


def plot(run: Run, path: Path) -> None:
    """The loss and the held-out exact-match accuracy against the step, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    losses = [h for h in run.history if "loss" in h]
    evals = run.evals()
    fig, (left, right) = plt.subplots(1, 2, figsize=(8, 3), dpi=90)
    left.plot([h["step"] for h in losses], [h["loss"] for h in losses], lw=1)
    left.set(yscale="log", xlabel="step", ylabel="training loss (answers)", title="loss")
    for key, label in (("recall", "recall, exact match"), ("copy", "copy, exact match")):
        right.plot([h["step"] for h in evals], [100 * h[key] for h in evals], label=label)
    right.plot(
        [h["step"] for h in evals],
        [100 * h["recall_answers"] for h in evals],
        ls="--",
        label="recall, answers right",
    )
    right.set(xlabel="step", ylabel="%", ylim=(0, 101), title="held-out accuracy")
    right.legend(loc="lower right", fontsize=8)
    for ax in (left, right):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def restore(directory: Path, step: int | None = None) -> tuple[Decoder, Run, int]:
    """The model of a checkpoint in ``directory`` (the latest unless ``step``), its
    run and its step."""
    step = checkpoint.latest(directory) if step is None else step
    if step is None:
        raise FileNotFoundError(
            f"no checkpoint in {directory}: train first (python -m examples.recall train)"
        )
    run = Run.from_json(checkpoint.load_meta(directory, step))
    model, opt = build(run)
    state = nnx.state((model, opt))
    nnx.replace_by_pure_dict(state, checkpoint.load_state(directory, step, nnx.to_pure_dict(state)))
    nnx.update((model, opt), state)
    return model, run, step
