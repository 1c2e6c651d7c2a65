"""examples/recall, the end-to-end example, in a tiny configuration (seconds): the
tasks, a loss that decreases, the orbax checkpoint round trip, a resumed run equal
bit for bit to an uninterrupted one, cached generation equal to uncached for prompts
of different lengths, and the whole model passing nanoattn.verify.

The trained model has dropout on (rate 0.1) so that dropout left on in generation or
verification shows. The full training run is not here (examples/recall/README.md).
"""

import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # `examples` is a package at the repository root

from examples.recall import data, generate, train, verify  # noqa: E402
from examples.recall.__main__ import main  # noqa: E402
from examples.recall.model import ModelConfig  # noqa: E402

TASK = data.TaskConfig(pairs=3, seq_len=14, n_keys=7, n_values=11, copy_fraction=0.25)
STEPS = 40


def tiny_run(**train_options) -> train.Run:
    model = ModelConfig(
        vocab=TASK.vocab, d_model=24, n_heads=6, n_kv_heads=2, n_layers=2, mlp_ratio=2,
        dropout=0.1,
    )  # fmt: skip
    options = dict(
        steps=STEPS, batch=16, lr=1e-2, warmup=5, eval_every=20, eval_recall=20, eval_copy=10,
        checkpoint_every=20, log_every=5,
    )  # fmt: skip
    return train.Run(model, TASK, train.TrainConfig(**options | train_options))


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """The tiny run trained for STEPS steps without a break: (model, run, directory)."""
    directory = tmp_path_factory.mktemp("uninterrupted")
    model, run = train.train(tiny_run(), directory, progress=False, log=lambda _: None)
    return model, run, directory


def params(model) -> list[np.ndarray]:
    return [np.asarray(x) for x in jax.tree.leaves(nnx.state(model, nnx.Param))]


def test_recall_answers_are_the_values_of_the_queried_keys():
    tokens, answers = data.recall(np.random.default_rng(3), TASK, 5)
    P = TASK.pairs
    assert tokens.shape == (5, 14) and answers.sum(1).tolist() == [TASK.queries] * 5
    assert (tokens[:, 0] == data.RECALL).all() and (tokens[:, 1 + 2 * P] == data.SEP).all()
    for row in range(5):
        values, keys = tokens[row, 1 : 1 + 2 * P : 2], tokens[row, 2 : 2 + 2 * P : 2]
        assert len(set(keys.tolist())) == P  # distinct keys
        lookup = dict(zip(keys.tolist(), values.tolist()))
        queries = tokens[row, 2 + 2 * P :: 2]
        assert sorted(queries[:P].tolist()) == sorted(keys.tolist())  # each key queried
        assert tokens[row, answers[row]].tolist() == [lookup[q] for q in queries.tolist()]


def test_copy_sequences_and_their_answers():
    tokens, answers = data.copy(np.random.default_rng(4), TASK, 2, lengths=[2, 5])
    s = tokens[1, 1:6].tolist()
    assert tokens[1].tolist() == [3, *s, 3, *s[::-1], 3, 0]  # COPY s COPY reversed(s) COPY PAD
    assert tokens[0].tolist()[:7] == [3, *tokens[0, 1:3], 3, *tokens[0, 2:0:-1], 3]
    assert (tokens[0, 7:] == data.PAD).all()
    assert np.flatnonzero(answers[0]).tolist() == [4, 5, 6]  # the copy and the stop token


def test_batches_are_a_function_of_seed_and_step():
    a, b = data.train_batch(0, 7, TASK, 8), data.train_batch(0, 7, TASK, 8)
    assert all(np.array_equal(x, y) for x, y in zip(a, b))
    assert not np.array_equal(a[0], data.train_batch(0, 8, TASK, 8)[0])
    assert not np.array_equal(a[0], data.train_batch(1, 7, TASK, 8)[0])


def test_loss_decreases(trained):
    _, run, _ = trained
    losses = [h["loss"] for h in run.history if "loss" in h]
    assert len(losses) == STEPS // 5
    assert np.mean(losses[-2:]) < 0.8 * np.mean(losses[:2]), losses
    assert [h["step"] for h in run.evals()] == [20, 40]


def test_checkpoint_round_trip(trained):
    model, run, directory = trained
    restored, restored_run, step = train.restore(directory / "checkpoints")
    assert step == STEPS and restored_run.to_json() == run.to_json()
    assert all(np.array_equal(a, b) for a, b in zip(params(restored), params(model), strict=True))


def test_resume_reproduces_the_uninterrupted_run_bit_for_bit(trained, tmp_path):
    model, run, _ = trained
    quiet = {"progress": False, "log": lambda _: None}
    train.train(tiny_run(), tmp_path, stop_at=13, **quiet)  # interrupted
    assert train.checkpoint.latest(tmp_path / "checkpoints") == 13
    resumed, second = train.train(tiny_run(), tmp_path, **quiet)  # the same command again
    assert second.history == run.history
    assert all(np.array_equal(a, b) for a, b in zip(params(resumed), params(model), strict=True))
    with pytest.raises(ValueError, match="another configuration"):
        train.train(tiny_run(lr=2e-2), tmp_path, **quiet)


def test_cached_generation_equals_uncached_for_ragged_prompts(trained):
    model, _, _ = trained
    rng = np.random.default_rng(5)
    prompts = [rng.integers(TASK.vocab, size=n).tolist() for n in (7, 2, 11, 4)]
    result = generate.compare(model, prompts, 9, 20, repeat=1)
    assert result.cached.shape == (4, 9)
    np.testing.assert_array_equal(result.cached, result.uncached)
    assert len({tuple(row) for row in result.cached.tolist()}) > 1


def test_the_whole_model_passes_nanoattn_verify(trained):
    model, _, _ = trained
    reports = verify.verify(model, seq_lens=(14,), decode_len=9)
    assert [r.title for r in reports] == ["causality", "padding", "decoding"]
    for report in reports:
        assert report.passed, report
        assert not any(c.skipped for c in report.checks), report


def test_every_command_has_help(capsys):
    for command in ("train", "generate", "verify"):
        with pytest.raises(SystemExit) as exit:
            main([command, "--help"])
        assert exit.value.code == 0
        assert "--run" in capsys.readouterr().out
