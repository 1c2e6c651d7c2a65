"""examples/recall, the end-to-end example, in a tiny configuration (seconds): the
tasks, a loss that decreases, the orbax checkpoint round trip, a resumed run equal
bit for bit to an uninterrupted one, cached generation equal to uncached for prompts
of different lengths, and the whole model passing nanoattn.verify.

The trained model has dropout on (rate 0.1) so that dropout left on in generation or
verification shows. The full training run is not here (examples/recall/README.md).
"""

import ast
import collections
import dataclasses
import functools
import importlib.metadata
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # `examples` is a package at the repository root

from examples.recall import __main__ as recall_main  # noqa: E402
from examples.recall import (  # noqa: E402
    data,
    engine,
    generate,
    lookup,
    quantized,
    selection,
    speculate,
    train,
    verify,
)
from examples.recall.__main__ import main  # noqa: E402
from examples.recall.model import Decoder, ModelConfig  # noqa: E402

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


@pytest.mark.parametrize("key_first", [False, True])
def test_recall_answers_are_the_values_of_the_queried_keys(key_first):
    task = dataclasses.replace(TASK, key_first=key_first)
    tokens, answers = data.recall(np.random.default_rng(3), task, 5)
    P = TASK.pairs
    assert tokens.shape == (5, 14) and answers.sum(1).tolist() == [TASK.queries] * 5
    assert (tokens[:, 0] == data.RECALL).all() and (tokens[:, 1 + 2 * P] == data.SEP).all()
    for row in range(5):
        first, second = tokens[row, 1 : 1 + 2 * P : 2], tokens[row, 2 : 2 + 2 * P : 2]
        keys, values = (first, second) if key_first else (second, first)
        is_key = (keys >= data.FIRST_KEY) & (keys < data.FIRST_KEY + TASK.n_keys)
        assert is_key.all() and (values >= data.FIRST_KEY + TASK.n_keys).all()
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


def test_copies_are_at_most_as_long_as_the_distinct_symbols():
    """A sequence longer than twice the symbols copies at most all of them once (its
    recall sequences ask more queries of the same pairs)."""
    long = dataclasses.replace(TASK, seq_len=60)
    assert long.max_copy == TASK.n_keys + TASK.n_values == 18 and TASK.max_copy == 5
    tokens, answers = data.copy(np.random.default_rng(5), long, 3)
    for row in range(3):
        n = int(answers[row].sum()) - 1  # the copy, then the stop token
        assert 1 <= n <= 18 and len(set(tokens[row, 1 : 1 + n].tolist())) == n
    tokens, answers = data.recall(np.random.default_rng(6), long, 2)
    assert answers.sum(1).tolist() == [long.queries] * 2 == [(60 - 2 - 6) // 2] * 2


def test_global_rope_off_leaves_rope_to_the_local_blocks():
    config = ModelConfig(vocab=11, n_layers=3, global_rope=False)
    assert config.attention(0).rope_base == 10000.0 and config.attention(0).window == (1, 0)
    assert config.attention(1).rope_base is None and config.attention(2).rope_base is None
    assert ModelConfig(vocab=11).attention(1).rope_base == 10000.0


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


def test_served_requests_equal_their_greedy_decoding_alone(trained):
    """Continuous batching over a small pool (page size 5, at most 3 requests in flight,
    steps of 7 tokens: prompts cut in chunks, admissions as others finish, steps that
    mix prompt chunks and decode tokens) and static batches of the same memory give
    every request the tokens of its greedy decoding alone, and free every page."""
    model, run, _ = trained
    requests = engine.workload(7, run.task, 11, prompt_lengths=(2, 17), new_tokens=(1, 9))
    assert len({len(r.prompt) for r in requests}) > 5 and len({r.new_tokens for r in requests}) > 4
    config = engine.EngineConfig(pages=13, page_size=5, max_sequences=3, step_tokens=7)
    server = engine.Engine(model, config, max(r.need for r in requests))
    assert server.warm_up() == ("xla",)  # the tiny run's ModelConfig: implementation="xla"
    served = server.run(requests)
    want = engine.alone(model, requests)
    assert served.outputs == want
    assert served.mixed_steps > 0 and served.tokens == sum(r.new_tokens for r in requests)
    assert server.allocator.free_pages == config.pages and not server.allocator.sequences()
    static = engine.static_for(model, config, requests)
    assert static.batch * engine.static_capacity(requests) <= config.pages * config.page_size
    assert static.run(requests).outputs == want
    assert len({tuple(t) for t in want.values()}) > 5  # not one answer for every prompt
    flash = engine.with_implementation(model, "flash")
    assert flash.config == dataclasses.replace(model.config, implementation="flash")
    assert all(np.array_equal(a, b) for a, b in zip(params(flash), params(model), strict=True))
    assert engine.static_for(flash, config, requests).warm_up(requests) == ("flash",)


def test_prefix_cached_requests_equal_the_run_without(trained):
    """Requests in groups that share a prompt (three groups, interleaved; one prompt of
    exactly the shared 11 tokens: a page and a token to compute) through the engine
    with its prefix cache: every request but its group's first (in arrival order: the
    others wait for its prompt to be in) shares the group's two full pages, the steps
    compute only the rest, and every request gets the tokens of the run without the
    cache and of its greedy decoding alone; every page is free again at the end."""
    model, run, _ = trained
    requests = engine.shared_workload(5, run.task, 9, 3, 11, suffix_lengths=(0, 4),
                                      new_tokens=(1, 5))  # fmt: skip
    groups = collections.Counter(r.prompt[:11] for r in requests)
    assert sorted(groups.values()) == [3, 3, 3] and min(len(r.prompt) for r in requests) == 11
    assert len({r.prompt[:11] for r in requests[:3]}) > 1  # the groups arrive interleaved
    config = engine.EngineConfig(pages=20, page_size=5, max_sequences=3, step_tokens=7)
    plain = engine.Engine(model, config, max(r.need for r in requests)).run(requests)
    cached_config = dataclasses.replace(config, prefix_cache=True)
    server = engine.Engine(model, cached_config, max(r.need for r in requests))
    cached = server.run(requests)
    prompts = sum(len(r.prompt) for r in requests)
    assert (plain.prefill_tokens, plain.cached_tokens) == (prompts, 0)
    # each group's first request computes its prompt, the others all but 10 tokens
    assert cached.cached_tokens == 10 * 6 and cached.cached_pages == 2 * 6
    assert cached.prefill_tokens == prompts - 10 * 6 and cached.evictions == 0
    assert server.allocator.stats().hit_tokens == 10 * 6
    assert cached.outputs == plain.outputs == engine.alone(model, requests)
    assert server.allocator.free_pages == config.pages and not server.allocator.sequences()


def test_prompt_lookup_drafts_a_trie_and_keeps_the_path_greedy_decoding_confirms():
    """The tree of drafts: the continuations of the last 2 tokens' earlier occurrences,
    the most recent first, then the last token's, forward and mirrored in turns (merged
    where they agree: a trie), at most ``nodes`` drafts ``depth`` deep; the path kept is
    the drafts the target's greedy tokens confirm, from the newest token on."""
    history = [5, 6, 7, 8, 5, 6, 9, 1, 5, 6]  # [5, 6] before 9 (at 6) and before 7 (at 2)
    tokens, parents = lookup.draft_tree(history, nodes=6, depth=3)
    assert (tokens, parents) == ([9, 1, 5, 7, 8, 5], [-1, 0, 1, -1, 3, 4])
    # then the last token 6 retraced: 5 8 7 before the 6 at 5 (its 5 is a new root)
    assert lookup.draft_tree(history, nodes=9, depth=3) == (
        [9, 1, 5, 7, 8, 5, 5, 8, 7],
        [-1, 0, 1, -1, 3, 4, -1, 6, 7],
    )
    assert lookup.draft_tree(history, nodes=4, depth=3) == ([9, 1, 5, 7], [-1, 0, 1, -1])
    assert lookup.draft_tree(history, nodes=8, depth=1) == ([9, 7, 5], [-1, -1, -1])
    assert lookup.draft_tree(history, nodes=8, depth=3, per_match=1) == (
        [9, 1, 5, 5, 8, 7],  # one occurrence of each kind: 6 at 5 retraced
        [-1, 0, 1, -1, 3, 4],
    )
    assert lookup.draft_tree([1, 2, 3], nodes=8, depth=3) == ([], [])  # nothing repeats
    assert lookup.draft_tree([4, 3, 4], nodes=8, depth=3) == ([3, 4], [-1, 0])  # to the end
    # mirrored: [5, 4, 3] reversed is [3, 4, 5] at 2: the tokens before it, backwards
    assert lookup.draft_tree([1, 2, 3, 4, 5, 4, 3], nodes=8, depth=3) == (
        [2, 1, 4, 5, 4],  # then the 3 at 2 forward: 4 5 4
        [-1, 0, -1, 2, 3],
    )
    chunk = lookup.chunk_parents(parents)  # [newest 6, 9, 1, 5, 7, 8, 5]
    assert chunk.tolist() == [-1, 0, 1, 2, 0, 4, 5]

    def path(greedy):  # the chunk padded to 9, the padding greedy's first token: not kept
        padded = [6, *tokens, greedy[0], greedy[0]]
        kept = np.asarray(lookup.accepted_path(padded, [*chunk, -1, -1], [*greedy, 5, 5], 7))
        assert (kept[: (kept >= 0).sum()] >= 0).all()  # the path first, then -1s
        return kept[kept >= 0].tolist()

    # greedy after 6 is 7 (a draft), after 6 7 is 8 (a draft), after 6 7 8 is 2 (not 5)
    assert path([7, 0, 0, 0, 8, 2, 0]) == [0, 4, 5]
    assert path([3, 1, 5, 0, 0, 0, 0]) == [0]
    assert path([9, 1, 5, 0, 0, 0, 0]) == [0, 1, 2, 3]
    assert path([9, 0, 5, 0, 0, 0, 0]) == [0, 1]  # 5 matches under 1, but 1 is not kept
    assert path([9, 1, 5, 0, 8, 5, 5]) == [0, 1, 2, 3]  # 7 8 5 would match, 7 is not kept


def test_the_device_drafts_the_host_tree():
    """``draft_tree_on_device`` (jax, inside the compiled step) gives exactly
    ``draft_tree``'s tree (the plain-Python definition) on random histories over small
    vocabularies (many repeats, forward and mirrored), of every length from 2 up in a
    buffer with garbage past it, for two shapes of tree."""
    rng = np.random.default_rng(0)
    for nodes, depth, ngram, per_match in [(9, 3, 3, 2), (16, 5, 2, 4)]:
        shape = dict(nodes=nodes, depth=depth, ngram=ngram, per_match=per_match)
        draft = jax.jit(functools.partial(lookup.draft_tree_on_device, **shape))
        for _ in range(12):
            L = int(rng.integers(2, 29))
            history = rng.integers(int(rng.integers(2, 6)), size=31).astype(np.int32)
            tokens, parents, count = jax.device_get(draft(history, L))
            want = lookup.draft_tree(history[:L], nodes, depth, ngram, per_match)
            assert (tokens[:count].tolist(), parents[:count].tolist()) == want, (history, L)
            assert (tokens[count:] == 0).all() and (parents[count:] == -1).all()


def test_speculative_trees_give_exactly_the_greedy_tokens(monkeypatch):
    """Prompt-lookup trees drafted, verified and accepted on the device, one call a step
    (examples/recall/speculate.py), each tree with a decoy draft put first (so that an
    accepted path skips a sibling: chunk indices 0, 2, ...; its keys move, and the decoy
    must stay unseen): the tokens of plain greedy decoding through the cache, on an
    untrained model (its greedy tokens repeat, so drafts are accepted), a prompt whose
    tokens never repeat (nothing to draft but the decoy) and one of few symbols. The
    drafter itself is test_the_device_drafts_the_host_tree's; undecoyed trees on the
    trained model and both generators in one compiled loop are
    test_speculate_prints_acceptance_and_both_speeds' (one compiled step fewer here)."""
    model = Decoder(ModelConfig(vocab=TASK.vocab, d_model=24, n_heads=6, n_kv_heads=2,
                                n_layers=2, mlp_ratio=2), rngs=nnx.Rngs(1))  # fmt: skip
    rng = np.random.default_rng(1)
    prompts = [rng.integers(TASK.vocab, size=6).tolist() * 3, list(range(5)),
               rng.integers(5, size=12).tolist()]  # fmt: skip  # (a draft's root must see
    greedy = generate.Cached(model, 1, 48)  # the newest token: the last prompt fails else)
    wants = [greedy(*generate.right_pad([p], len(p)), 12)[0].tolist() for p in prompts]
    real = lookup.draft_tree_on_device

    def decoyed(history, length, nodes, depth, ngram, per_match):
        tokens, parents, count = real(history, length, nodes - 1, depth, ngram, per_match)
        tokens = jnp.concatenate([jnp.full(1, TASK.vocab - 1, jnp.int32), tokens])
        parents = jnp.concatenate(
            [jnp.full(1, -1, jnp.int32), jnp.where(parents < 0, -1, parents + 1)]
        )
        return tokens, parents, count + 1

    monkeypatch.setattr(speculate.lookup, "draft_tree_on_device", decoyed)
    spec = speculate.Speculative(model, 48, nodes=8, depth=3)  # traced with the decoy
    for prompt, want in zip(prompts, wants):
        tokens, accepted = spec(prompt, 12)
        assert tokens == want, (prompt, accepted)
        assert sum(accepted) + len(accepted) >= 12 > sum(accepted[:-1]) + len(accepted) - 1
    assert sum(spec(prompts[0], 12)[1]) > 0  # drafts past the decoy: fewer calls than tokens
    with pytest.raises(ValueError, match="prompt must hold at least 2 tokens"):
        spec([3], 4)


def test_speculate_prints_acceptance_and_both_speeds(trained, capsys):
    _, _, directory = trained
    argv = ["speculate", "--run", str(directory), "--prompts", "2", "--prompt-length", "20",
            "--new-tokens", "6", "--nodes", "4", "--depth", "2"]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "2 prompts of 20 tokens, 6 new tokens each, trees of at most 4 drafts 2 deep" in out
    steps = re.findall(r"prompt (\d): (\d+) steps, drafts accepted per step ([\d,]+)", out)
    assert [b for b, _, _ in steps] == ["0", "1"], out
    for _, n, accepted in steps:  # each step gains its accepted drafts and one token
        assert len(accepted.split(",")) == int(n)
        assert sum(map(int, accepted.split(","))) + int(n) >= 6
    speeds = r"speculative [\d,]+, greedy [\d,]+ \([\d.]+x\)"
    assert re.search(rf"tokens/s, one call a step: {speeds}; each prompt in one call: "
                     rf"{speeds}; tokens equal to greedy decoding: yes", out), out  # fmt: skip


def test_speculate_fails_when_its_tokens_differ_from_greedy(trained, capsys, monkeypatch):
    _, _, directory = trained

    def differing(model, prompts, n, **options):
        return speculate.Compared([[1] * n], [[2] * n], [[0] * n], 1.0, 2.0, 1.0, 0.5, True)

    monkeypatch.setattr(speculate, "compare", differing)
    argv = ["speculate", "--run", str(directory), "--prompts", "1", "--new-tokens", "3"]
    assert main(argv) == 1
    out = capsys.readouterr().out
    assert (
        "tokens/s, one call a step: speculative 3, greedy 2 (2.00x); each prompt in one "
        "call: speculative 3, greedy 6 (0.50x); tokens equal to greedy decoding: NO"
    ) in out


# A workload the tiny run serves in seconds (the engine test's pool and steps).
TINY_SERVE = [
    "--requests", "5", "--prompt-lengths", "2,9", "--new-tokens", "1,4", "--pages", "13",
    "--page-size", "5", "--max-sequences", "3", "--step-tokens", "7", "--no-progress",
]  # fmt: skip


def test_serve_runs_a_tiny_workload_on_the_automatic_choice(trained, capsys, monkeypatch):
    """The whole command, untimed (--target 0): the checkpoint was trained with
    implementation="xla" (ModelConfig's default), and the engine, the static batches
    and the check alone all run on the automatic choice instead, the backends nanoattn
    took named."""
    _, _, directory = trained
    seen = []

    def spy(name, function):
        def call(model, *args):
            seen.append((name, model.config.implementation))
            return function(model, *args)

        monkeypatch.setattr(engine, name, call)

    for name in ("Engine", "static_for", "alone"):
        spy(name, getattr(engine, name))
    argv = ["serve", "--run", str(directory), *TINY_SERVE, "--check", "2", "--target", "0"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert seen == [("Engine", None), ("static_for", None), ("alone", None)]
    assert (
        "attention: nanoattn's automatic choice (--implementation; the checkpoint was "
        "trained with implementation='xla')\n" in out
    ), out
    served = re.findall(r"^  attention served by (.+)$", out, re.M)
    assert len(served) == 2, out  # the engine, then the static batches
    assert all(set(s.split(", ")) <= set(recall_main._backend_names()) for s in served), out
    assert re.search(r"^continuous / static batching: \d+\.\d\dx the tokens/s \(not judged: "
                     r"--target 0\)$", out, re.M), out  # fmt: skip
    assert "every request's tokens equal in both: yes" in out, out
    assert "the first 2 requests' tokens equal their greedy decoding alone: yes" in out, out
    assert "FAIL" not in out, out


class _Timed:
    """Stands for engine.Engine and engine.Static in the command's tests of the target:
    it records the backend its model has, and a run gives each request the first token
    of its prompt and takes ``seconds`` (no clock, no model)."""

    batch = 1

    def __init__(self, model, seconds: float, made: list):
        made.append(model.config.implementation)
        self.seconds = seconds

    def warm_up(self, *requests):
        return ("stub",)

    def run(self, requests, progress=None):
        outputs = {r.id: [r.prompt[0]] * r.new_tokens for r in requests}
        return engine.Served(outputs, self.seconds, steps=1)


def serve_timed(monkeypatch, directory, engine_seconds: float, options=()) -> tuple[int, list]:
    """``serve`` on the tiny run with engine.Engine and engine.static_for stubbed by
    :class:`_Timed` (the static batches take 1 s): (exit status, the implementation
    each got)."""
    made = []
    monkeypatch.setattr(engine, "Engine", lambda model, *_: _Timed(model, engine_seconds, made))
    monkeypatch.setattr(engine, "static_for", lambda model, *_: _Timed(model, 1.0, made))
    argv = ["serve", "--run", str(directory), *TINY_SERVE, "--check", "0", *options]
    return main(argv), made


@pytest.mark.parametrize(
    "engine_seconds, options, verdict, status",
    [
        (0.5, [], "2.00x the tokens/s (target >= 2x): met", 0),
        (0.6, [], "1.67x the tokens/s (target >= 2x): MISSED", 1),
        (0.6, ["--target", "1.5"], "1.67x the tokens/s (target >= 1.5x): met", 0),
    ],
)
def test_serve_judges_its_target_in_the_exit_status(
    trained, capsys, monkeypatch, engine_seconds, options, verdict, status
):
    """Continuous batching must make --target (2) times the tokens/s of static batching:
    the ratio printed with its verdict, and a miss is exit status 1 with one FAIL line
    saying why. The runs are stubbed (:class:`_Timed`): no timing is asserted."""
    got, _ = serve_timed(monkeypatch, trained[2], engine_seconds, options)
    out = capsys.readouterr().out
    assert got == status, out
    assert f"\ncontinuous / static batching: {verdict}\n" in out, out
    fail = [line for line in out.splitlines() if line.startswith("FAIL")]
    if status:
        assert fail == [
            "FAIL: continuous batching made 1.67x the tokens/s of static batching, under the "
            "target 2x"
        ], out
    else:
        assert fail == [], out


@pytest.mark.parametrize(
    "options, implementation",
    [([], None), (["--implementation", "none"], None), (["--implementation", "flash"], "flash")],
)
def test_serve_runs_both_on_the_implementation_asked_for(
    trained, capsys, monkeypatch, options, implementation
):
    got, made = serve_timed(monkeypatch, trained[2], 0.5, options)
    out = capsys.readouterr().out
    assert got == 0, out
    assert made == [implementation, implementation]  # the engine, the static batches
    said = "nanoattn's automatic choice" if implementation is None else "implementation='flash'"
    assert f"\nattention: {said} (--implementation; " in out, out


# The shared-prompt workload at the engine test's sizes (two groups of three requests).
TINY_SHARED = [
    "--shared", "--requests", "6", "--groups", "2", "--shared-length", "11",
    "--suffix-lengths", "1,4", "--new-tokens", "1,4", "--pages", "20", "--page-size", "5",
    "--max-sequences", "3", "--step-tokens", "7", "--no-progress",
]  # fmt: skip


def test_serve_shared_compares_the_prefix_cache_with_the_engine_without(trained, capsys):
    """``serve --shared``, untimed (--target 0): the engine with its prefix cache, then
    without it (no static batches), the prompt tokens each computed and what the cache
    found, and every request's tokens equal in both and to its greedy decoding alone."""
    argv = ["serve", "--run", str(trained[2]), *TINY_SHARED, "--check", "2", "--target", "0"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "6 requests in 2 groups, whose prompts share their first 11 tokens" in out, out
    assert "\ncontinuous batching, caching prompt prefixes: a pool of 20 pages" in out, out
    assert "\ncontinuous batching without the prefix cache: the same pool\n" in out, out
    assert "static batches" not in out, out
    computed = [int(n) for n in re.findall(r"^  prompt tokens computed (\d+)", out, re.M)]
    (hits,) = re.findall(r"found cached (\d+) \(prefix hits: (\d+) pages shared", out)
    assert int(hits[0]) == 5 * int(hits[1]) > 0, out
    assert computed[0] + int(hits[0]) == computed[1], out  # every prompt token, once
    assert re.search(r"^prompt tokens computed with / without the prefix cache: \d\.\d\dx "
                     r"\(not judged: --target 0\)$", out, re.M), out  # fmt: skip
    assert "every request's tokens equal with and without: yes" in out, out
    assert "the first 2 requests' tokens equal their greedy decoding alone: yes" in out, out
    assert "FAIL" not in out, out


class _Prefixed:
    """Stands for engine.Engine in ``serve --shared``'s tests of the targets: with the
    prefix cache a run takes ``seconds`` and computes ``prefill`` prompt tokens, without
    it 1 s and 100 (no clock, no model)."""

    def __init__(self, config, seconds: float, prefill: int):
        self.cached = config.prefix_cache
        self.seconds, self.prefill = (seconds, prefill) if self.cached else (1.0, 100)

    def warm_up(self):
        return ("stub",)

    def run(self, requests, progress=None):
        outputs = {r.id: [r.prompt[0]] * r.new_tokens for r in requests}
        return engine.Served(outputs, self.seconds, steps=1, prefill_tokens=self.prefill,
                             cached_tokens=100 - self.prefill)  # fmt: skip


@pytest.mark.parametrize(
    "seconds, prefill, verdicts, fail",
    [
        (0.5, 20, ["0.20x (target <= 0.2x): met", "2.00x the tokens/s (target >= 2x): met"], ""),
        (0.6, 20, ["0.20x (target <= 0.2x): met", "1.67x the tokens/s (target >= 2x): MISSED"],
         "the prefix cache made 1.67x the tokens/s of the engine without it, under the "
         "target 2x"),
        (0.5, 21, ["0.21x (target <= 0.2x): MISSED", "2.00x the tokens/s (target >= 2x): met"],
         "the prefix cache left 0.21x the prompt tokens to compute, over the target 0.2x"),
    ],
)  # fmt: skip
def test_serve_shared_judges_both_targets(trained, capsys, monkeypatch, seconds, prefill,
                                          verdicts, fail):  # fmt: skip
    """The prefix cache's targets: prompt tokens computed at most 0.2x, tokens/s at least
    2x the engine's without it; a miss is exit status 1 with one FAIL line saying why.
    The runs are stubbed (:class:`_Prefixed`): no timing is asserted."""
    monkeypatch.setattr(engine, "Engine", lambda model, config, _: _Prefixed(config, seconds,
                                                                             prefill))  # fmt: skip
    argv = ["serve", "--run", str(trained[2]), *TINY_SHARED, "--check", "0"]
    assert main(argv) == (1 if fail else 0)
    out = capsys.readouterr().out
    assert f"\nprompt tokens computed with / without the prefix cache: {verdicts[0]}\n" in out
    assert f"\nwith / without the prefix cache: {verdicts[1]}\n" in out, out
    fails = [line for line in out.splitlines() if line.startswith("FAIL")]
    assert fails == ([f"FAIL: {fail}"] if fail else []), out


class _Refusing:
    """A backend that serves no call, chosen only by name."""

    name = "refusing_for_the_test"
    priority = None
    serves = frozenset()

    def unsupported(self, rules, dtype, dropout_rate):
        return "it serves no call"

    def pays_off(self, rules, dtype):
        return False

    def __call__(self, *args, **kwargs):
        raise AssertionError("never chosen")


def test_serve_on_a_backend_that_cannot_serve_is_one_error_line(trained, capsys):
    from nanoattn._backends import registry

    registry.register(_Refusing())
    try:
        argv = ["serve", "--run", str(trained[2]), *TINY_SERVE, "--implementation", _Refusing.name]
        line = usage_error(capsys, argv)
    finally:
        registry.unregister(_Refusing.name)
    assert f"--implementation {_Refusing.name}: " in line, line
    assert "cannot serve this call: it serves no call" in line, line


def test_serve_on_a_mesh_of_more_devices_than_jax_has_is_one_error_line(trained, capsys):
    argv = ["serve", "--run", str(trained[2]), *TINY_SERVE, "--mesh", "2x4"]
    line = usage_error(capsys, argv)
    assert "--mesh 2x4: it needs 8 devices, jax has 1" in line, line


@pytest.mark.slow  # a process of 8 simulated devices
def test_serve_on_a_mesh_gives_every_request_the_one_device_tokens(trained):
    """``serve --mesh 2x4`` as a user runs it (the tiny run's K = 2 heads split 2 ways,
    4 groups): the engine on one device, then on the mesh, the same tokens."""
    argv = ["-m", "examples.recall", "serve", "--run", str(trained[2]), *TINY_SERVE,
            "--check", "0", "--target", "0", "--no-static", "--mesh", "2x4"]  # fmt: skip
    flags = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    done = subprocess.run(
        [sys.executable, *argv], cwd=ROOT, capture_output=True, text=True, timeout=300,
        env={**os.environ, "XLA_FLAGS": flags.strip()},
    )  # fmt: skip
    assert done.returncode == 0, (done.stdout, done.stderr[-3000:])
    assert "on a mesh of 2 x 4 devices" in done.stdout, done.stdout
    assert "tokens equal on the mesh and on one device: yes" in done.stdout, done.stdout


def test_the_whole_model_passes_nanoattn_verify(trained):
    model, _, _ = trained
    reports = verify.verify(model, seq_lens=(14,), decode_len=9)
    assert [r.title for r in reports] == ["causality", "padding", "decoding"]
    for report in reports:
        assert report.passed, report
        assert not any(c.skipped for c in report.checks), report


def test_quantized_caches_on_the_trained_model(trained):
    """The float cache's greedy token at every step is the full forward's argmax, and
    the int8 cache's counted against it; an int8 cache holds int8 keys; each layer
    decoded through the float cache is within float32 rounding of its float64 forward,
    through int8 well above that and below 5%."""
    model, run, _ = trained
    tokens, answers = data.held_out(run.train.seed, TASK, 7, 1)["recall"]
    prefix = 2 + 2 * TASK.pairs
    found = quantized.agreement(model, tokens, answers, prefix, dtypes=("int8",))
    full = np.asarray(model(jnp.asarray(tokens)))[:, prefix - 1 : -1].argmax(-1)  # (7, 6)
    graded = answers[:, prefix:]
    right = int((full == tokens[:, prefix:])[graded].sum())
    assert found[None] == quantized.Agreement(42, 42, int(graded.sum()), int(graded.sum()), right)
    assert found["int8"].steps == 42 and 0 < found["int8"].fraction <= 1
    int8 = quantized.with_cache(model, "int8")
    int8.init_cache(1, 3)
    assert np.dtype("int8") in {a.dtype for a in jax.tree.leaves(nnx.state(int8))}
    errors = quantized.layer_errors(model, tokens, prefix, dtypes=(None, "int8"))
    assert len(errors) == 2, errors
    for error in errors:
        assert error[None] < 1e-5 and 10 * error[None] < error["int8"] < 0.05, errors


def test_page_selection_on_the_trained_model(trained, capsys):
    """Through the paged cache page selection of k >= the pages gives the full forward's
    greedy tokens; ``selection`` prints a row for every page read (all equal to
    itself) and each k."""
    model, run, directory = trained
    tokens, _ = data.held_out(run.train.seed, TASK, 7, 1)["recall"]
    prefix = 2 + 2 * TASK.pairs
    full = np.asarray(model(jnp.asarray(tokens)))[:, prefix - 1 : -1].argmax(-1)  # (7, 6)
    greedy, seconds = selection.paged_greedy(selection.with_selection(model, 2, 7), tokens,
                                             prefix)  # fmt: skip
    np.testing.assert_array_equal(greedy, full)
    assert seconds > 0
    argv = ["selection", "--run", str(directory), "--sequences", "3", "--page-size", "2",
            "--select", "1"]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "3 held-out recall sequences of 14 tokens (7 pages of 2), 6 decoding steps" in out
    assert re.search(r"  every page +18/18 100\.00%", out), out
    assert re.search(r"  1 and the last +\d+/18 ", out), out


def test_page_selection_on_longer_sequences_prefills_in_groups(trained, capsys, monkeypatch):
    """Longer held-out sequences than the run's, their prompts prefilled a few at a time
    (the last group short), decode the last tokens as the full forward does; the
    command takes --length and --decoded (and --implementation: asked for the measure
    call's sequences and backend, it reuses that call's compiled steps, 5 s less; the
    command's automatic choice runs in the test above)."""
    model, run, directory = trained
    monkeypatch.setattr(selection, "PREFILL_TOKENS", 2 * 17)  # groups of 2, 2, 1 prompts
    long = dataclasses.replace(TASK, seq_len=22)
    tokens, _ = data.held_out(run.train.seed, long, 5, 1)["recall"]
    full = np.asarray(model(jnp.asarray(tokens)))[:, 16:-1].argmax(-1)  # (5, 5)
    decoder = selection.with_selection(model, 2, 11, implementation=None)
    greedy, _ = selection.paged_greedy(decoder, tokens, 17)
    np.testing.assert_array_equal(greedy, full)
    found = selection.measure(model, TASK, run.train.seed, 5, 2, (1,), length=22, decoded=5)
    assert [s.agreement.steps for s in found] == [25, 25] and found[0].agreement.fraction == 1
    argv = ["selection", "--run", str(directory), "--sequences", "5", "--page-size", "2",
            "--select", "1", "--length", "22", "--decoded", "5",
            "--implementation", "xla"]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "5 held-out recall sequences of 22 tokens (11 pages of 2), 5 decoding steps" in out
    assert re.search(r"  every page +25/25 100\.00%", out), out
    for bad, flag in ((["--length", "21"], "--length=21"), (["--decoded", "1"], "--decoded=1")):
        assert flag in usage_error(capsys, ["selection", "--run", str(directory), *bad])


def _measured(int8_fraction: float) -> quantized.Measured:
    fractions = {None: 1.0, "int8": int8_fraction, "float8_e4m3fn": 0.9}
    agree = {d: quantized.Agreement(100, round(100 * f), 50, 50, 49) for d, f in fractions.items()}
    errors = [{None: 3e-7, "int8": 5e-3, "float8_e4m3fn": 2e-2}] * 2
    return quantized.Measured(agree, errors, sequences=5, prefix=8, seq_len=14)


@pytest.mark.parametrize("int8_fraction, status", [(0.99, 0), (0.98, 1)])
def test_the_quantized_command_prints_both_measures(trained, capsys, monkeypatch,
                                                    int8_fraction, status):  # fmt: skip
    """Its status is the int8 target's (>= 99% of the steps): the numbers come from
    quantized.measure (stubbed here: measured in the test above)."""
    _, _, directory = trained
    calls = []

    def measure(model, task, seed, sequences, progress):
        calls.append((task, sequences))
        return _measured(int8_fraction)

    monkeypatch.setattr(quantized, "measure", measure)
    assert main(["quantized", "--run", str(directory), "--sequences", "5"]) == status
    out = capsys.readouterr().out
    assert calls == [(TASK, 5)]
    assert "5 held-out recall sequences, 6 decoding steps each: a prompt of 8 tokens" in out
    assert re.search(r"  int8 +\d+/100 9[89]\.00% +50/50 100\.00% +98\.00%", out), out
    verdict = "met" if status == 0 else "MISSED"
    assert f"int8 cache: {int8_fraction:.2%} of the steps (target >= 99%): {verdict}" in out
    assert re.search(r"  0 window 1 +3\.00e-07 +5\.00e-03 +2\.00e-02", out), out
    assert "  1 global " in out


def test_measure_reports_each_stage_as_it_begins(trained, monkeypatch):
    """quantized.measure calls progress with every name of quantized.stages, in order,
    each as its work begins (the decodings and forwards stubbed: no compiling)."""
    model, run, _ = trained
    events = []
    progress = events.append

    def work(name):
        def stub(*args):
            events.append(name)
            return stubs[name](*args)

        return stub

    stubs = {
        "greedy_steps": lambda m, tokens, prefix: np.zeros((len(tokens), 6), np.int32),
        "layer_inputs": lambda m, tokens: [np.zeros((len(tokens), 14, 24), np.float32)] * 2,
        "float64_forward": lambda layer, x: np.ones(x.shape),
        "decode": lambda layer, x, prefix: np.zeros(x.shape),
    }
    for name in stubs:
        monkeypatch.setattr(quantized, name, work(name))
    quantized.measure(model, run.task, run.train.seed, 3, progress)
    caches = ("float32", "int8", "float8_e4m3fn")
    layers = [
        [f"layer {layer}, float64 forward", "float64_forward"]
        + [step for c in caches for step in (f"layer {layer}, {c} cache", "decode")]
        for layer in (0, 1)
    ]
    assert events == [
        *(step for c in caches for step in (f"greedy tokens, {c} cache", "greedy_steps")),
        "layer_inputs", *layers[0], *layers[1],
    ]  # fmt: skip
    assert [e for e in events if " " in e] == quantized.stages(model)  # stages have spaces


@pytest.mark.parametrize("no_progress", [False, True])
def test_the_quantized_command_shows_each_stage_as_it_runs(trained, capsys, monkeypatch,
                                                           no_progress):  # fmt: skip
    """A bar on stderr names each stage as it begins (tqdm, as serve's bars; measure
    stubbed, calling progress as the real one does); --no-progress, none."""
    model, _, directory = trained
    stages = quantized.stages(model)

    def measure(model, task, seed, sequences, progress):
        for stage in stages:
            progress(stage)
        return _measured(0.99)

    monkeypatch.setattr(quantized, "measure", measure)
    options = ["--no-progress"] if no_progress else []
    assert main(["quantized", "--run", str(directory), "--sequences", "5", *options]) == 0
    captured = capsys.readouterr()
    if no_progress:
        assert captured.err == ""
        return
    shown = [stage for stage in stages if f"{stage}]" in captured.err]
    assert shown == stages, captured.err
    positions = [captured.err.index(f"{stage}]") for stage in stages]
    assert positions == sorted(positions), captured.err
    assert re.search(rf"10/{len(stages)} .*layer 1, float8_e4m3fn cache\]", captured.err)


def test_every_command_has_help(capsys):
    for command in ("train", "generate", "serve", "speculate", "quantized", "verify"):
        with pytest.raises(SystemExit) as exit:
            main([command, "--help"])
        assert exit.value.code == 0
        assert "--run" in capsys.readouterr().out


# The command line: every bad option, and a run with no checkpoint, is argparse's usage
# and ONE `error:` line naming the flags, exit status 2, never a traceback. Each case is
# (argv, the flags its error line must name); every train case also gets a throwaway
# --run and a one-step run, so a case that were accepted would train one step, not 2,000.
BAD_OPTIONS = [
    (["train", "--d-model", "30"], ["--d-model", "--n-heads"]),  # heads do not divide it
    (["train", "--d-model", "36"], ["--d-model", "--n-heads"]),  # odd head width for RoPE
    (["train", "--n-kv-heads", "3"], ["--n-kv-heads", "--n-heads"]),
    (["train", "--n-heads", "0"], ["--n-heads"]),
    (["train", "--steps", "-5"], ["--steps"]),
    (["train", "--steps", "2.5"], ["--steps"]),
    (["train", "--batch", "0"], ["--batch"]),
    (["train", "--seed", "-1"], ["--seed"]),
    (["train", "--lr", "0"], ["--lr"]),
    (["train", "--lr", "nan"], ["--lr"]),
    (["train", "--weight-decay", "-0.1"], ["--weight-decay"]),
    (["train", "--eval-every", "0"], ["--eval-every"]),
    (["train", "--dropout", "1"], ["--dropout"]),
    (["train", "--local-window", "-1"], ["--local-window"]),
    (["train", "--implementation", "fast"], ["--implementation"]),
    (["train", "--pairs", "0"], ["--pairs"]),
    (["train", "--pairs", "70"], ["--pairs", "--n-keys"]),
    (["train", "--seq-len", "33"], ["--seq-len", "--pairs"]),
    (["train", "--copy-fraction", "1.5"], ["--copy-fraction"]),
    (["train", "--stop-at", "0"], ["--stop-at"]),
    (["train", "--no-such-option"], ["--no-such-option"]),
    (["generate", "--context", "40"], ["--context", "--new-tokens", "--batch"]),
    (["generate", "--new-tokens", "0"], ["--new-tokens"]),
    (["serve", "--prompt-lengths", "9,3"], ["--prompt-lengths"]),
    (["serve", "--new-tokens", "0,3"], ["--new-tokens"]),
    (["serve", "--pages", "0"], ["--pages"]),
    (["serve", "--implementation", "fast"], ["--implementation"]),
    (["serve", "--target", "-1"], ["--target"]),
    (["serve", "--max-sequences", "9", "--step-tokens", "8"], ["--step-tokens", "--max-sequences"]),
    (["serve", "--shared", "--groups", "9", "--requests", "4"], ["--groups", "--requests"]),
    (["serve", "--suffix-lengths", "5,3"], ["--suffix-lengths"]),
    (["speculate", "--nodes", "0"], ["--nodes"]),
    (["speculate", "--prompt-length", "1"], ["--prompt-length"]),
    (["serve", "--mesh", "2x"], ["--mesh"]),
    (["serve", "--mesh", "2x4", "--shared"], ["--mesh", "--shared"]),
    (["quantized", "--sequences", "0"], ["--sequences"]),
    (["verify", "--seq-lens", "1,x"], ["--seq-lens"]),
    (["verify", "--seq-lens", "0"], ["--seq-lens"]),
]
QUICK = ["--steps", "1", "--eval-recall", "1", "--eval-copy", "1", "--no-progress"]


def usage_error(capsys, argv) -> str:
    """Runs the command line on ``argv``, which must stop with exit status 2 after the
    usage and one `error:` line; returns that line."""
    with pytest.raises(SystemExit) as exit:
        main(argv)
    err = capsys.readouterr().err
    assert exit.value.code == 2, err
    assert "Traceback" not in err, err
    lines = err.strip().splitlines()
    errors = [line for line in lines if "error:" in line]
    assert lines[0].startswith("usage: python -m examples.recall"), err
    assert errors == [lines[-1]], err  # one error line, the last
    assert lines[-1].startswith(f"python -m examples.recall {argv[0]}: error: "), err
    return lines[-1]


@pytest.mark.parametrize("argv, flags", BAD_OPTIONS, ids=[" ".join(a) for a, _ in BAD_OPTIONS])
def test_a_bad_option_is_one_error_line_naming_its_flags(capsys, tmp_path, argv, flags):
    command, *options = argv
    run = ["--run", str(tmp_path / "run")]
    line = usage_error(capsys, [command, *run, *(QUICK if command == "train" else []), *options])
    for flag in flags:
        assert flag in line, (flag, line)
    assert not (tmp_path / "run").exists()  # refused before anything is written


@pytest.mark.parametrize("command", ["generate", "serve", "speculate", "quantized", "verify"])
def test_a_run_without_a_checkpoint_is_one_error_line(capsys, tmp_path, command):
    (tmp_path / "empty").mkdir()
    for run in (tmp_path / "missing", tmp_path / "empty"):
        line = usage_error(capsys, [command, "--run", str(run)])
        assert f"no checkpoint in --run {run}" in line, line
        assert f"python -m examples.recall train --run {run}" in line, line


def test_train_into_a_file_is_one_error_line(capsys, tmp_path):
    (tmp_path / "file").write_text("")
    line = usage_error(capsys, ["train", "--run", str(tmp_path / "file"), *QUICK])
    assert "--run" in line, line


def _flags(run: train.Run) -> list[str]:
    """The command line that builds ``run``'s configuration."""
    argv = []
    for config in (run.train, run.model, run.task):
        for name, value in dataclasses.asdict(config).items():
            flag = "--" + name.replace("_", "-")
            if name == "vocab":
                continue
            if isinstance(value, bool):
                argv.append(flag if value else "--no-" + flag[2:])
            else:
                argv += [flag, str(value)]
    return argv


def test_training_a_run_with_another_configuration_names_the_differing_flags(capsys, trained):
    directory = trained[2]
    other = tiny_run(lr=2e-2)
    line = usage_error(capsys, ["train", "--run", str(directory), *_flags(other)])
    assert "another configuration" in line and "(--lr 0.02, saved 0.01)" in line, line
    assert "--restart" in line and "another --run" in line and "--out" not in line, line


def test_a_missing_extra_is_one_line_naming_the_install(capsys, monkeypatch):
    monkeypatch.setattr(recall_main, "EXTRA_MODULES", ("optax", "no_such_module_for_the_test"))
    assert main(["train", "--help"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0, err
    assert "needs no_such_module_for_the_test, not installed" in err, err  # optax is there
    assert "pip install -e '.[examples]'" in err, err


def test_the_examples_extra_is_exactly_what_the_example_imports():
    """pyproject.toml's [examples] holds the distributions of every module that
    examples/recall imports beyond the standard library, nanoattn and nanoattn's own
    dependencies; the command line's EXTRA_MODULES are those modules, and [test]
    includes [examples] (`make test` runs the example)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]

    def name(requirement: str) -> str:
        return re.split(r"[<>=!~\[ ;]", requirement)[0].lower().replace("_", "-")

    core = {name(r) for r in project["dependencies"]}
    modules = set()
    for path in (ROOT / "examples" / "recall").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                modules |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                modules.add(node.module.split(".")[0])
    third_party = {m for m in modules if m not in sys.stdlib_module_names and m != "nanoattn"}
    distributions = importlib.metadata.packages_distributions()
    needed = {name(d) for m in third_party for d in distributions[m]} - core
    extras = project["optional-dependencies"]
    assert {name(r) for r in extras["examples"]} == needed
    assert set(recall_main.EXTRA_MODULES) == third_party - {"jax", "flax", "numpy"}
    test = extras["test"]
    assert "nanoattn[examples]" in test or needed <= {name(r) for r in test}, test


def test_python_dash_m_prints_the_usage_and_one_error_line(tmp_path):
    # As a user runs it: the process, not main(), so nothing but argparse's lines.
    argv = ["-m", "examples.recall", "train", "--run", str(tmp_path), "--d-model", "30"]
    done = subprocess.run(
        [sys.executable, *argv], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 2 and not done.stdout, done
    lines = done.stderr.strip().splitlines()
    assert lines[0].startswith("usage:"), done.stderr
    assert [line for line in lines if "error:" in line] == [lines[-1]], done.stderr
    assert "--d-model" in lines[-1] and "--n-heads" in lines[-1], lines[-1]
