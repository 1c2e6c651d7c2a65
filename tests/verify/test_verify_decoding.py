"""nanoattn.verify.check_decoding and its adapters: planted decoder bugs, each caught by
the right check; the real flax NNX bug (google/flax#5591); no false alarm on nanoattn's
linen and NNX layers or on flax linen's decode path; `nanoattn verify --decode / --vocab`.

Every decoder under test is built (and so compiled) once per configuration; the planted
bugs share one compiled step (tests/_verify_decoders.py switches them with a traced array).
"""

import functools
import json
import re

import flax
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from nanoattn import nnx as nanoattn_nnx
from nanoattn.cli import main
from nanoattn.linen import AttentionConfig, CausalSelfAttention
from nanoattn.verify import Decoder, Report, check_decoding, decoders
from nanoattn.verify._decoding import ragged_schedule, rewind_schedule

import _verify_decoders
from _layer_configs import CONFIGS, D, N  # the configurations of the decoding issue
from _paths import ROOT

DOCS = (ROOT / "docs/verify.md").read_text()


def by_name(report: Report):
    return {c.name: c for c in report.checks}


def failed(report: Report) -> set[str]:
    return {c.name for c in report.checks if not c.passed}


@functools.cache
def tiny_report(bug, vocab=None) -> Report:
    inputs = {"vocab": vocab} if vocab else {"d_model": _verify_decoders.D}
    return check_decoding(*_verify_decoders.tiny(bug, vocab), **inputs)


def test_the_correct_tiny_decoder_passes():
    report = tiny_report(None)
    assert report.passed, report
    assert [c.name for c in report.checks] == [
        "cache equivalence",
        "ragged rows",
        "no future in the cache",
        "positive control",
    ]
    assert not any(c.skipped for c in report.checks)
    equivalence = by_name(report)["cache equivalence"].detail
    assert equivalence.startswith(
        "3 chunkings (1 token per call; all 13 in one call; chunks 4,1,4,1,1,1,1) reproduce "
        "the full forward at all 13 positions of 2 rows, tolerance "
    )


# bug -> (the checks that fail, first diverging position of the named check, its detail)
PLANTED = {
    "late_write": ({"cache equivalence", "ragged rows"}, 0, "decoding 1 token per call"),
    "advance_by_chunk": ({"ragged rows"}, 1, "right-padded chunks of 4"),
    "rope_at_zero": ({"cache equivalence", "ragged rows"}, 1, "matches: all 13 in one call"),
    "wide_window": (
        {"cache equivalence", "ragged rows"},
        _verify_decoders.WINDOW + 1,
        "decoding 1 token per call",
    ),
    "ignore_cache": (
        {"cache equivalence", "ragged rows", "positive control"},
        1,
        "matches: all 13 in one call",
    ),
    "future_in_chunk": (
        {"cache equivalence", "ragged rows", "no future in the cache"},
        0,
        "decoding all 13 in one call",
    ),
}


def test_a_cache_off_by_a_thousandth_is_caught():
    # Pins the tolerance: keys and values rounded to bfloat16 in a float32 layer move the
    # outputs by about 1e-3, far above float32 rounding, far below a planted logic bug.
    report = tiny_report("bfloat16_cache")
    assert failed(report) == {"cache equivalence", "ragged rows"}
    equivalence = by_name(report)["cache equivalence"]
    assert 1e-4 < equivalence.data["first"]["deviation"] <= equivalence.worst < 3e-2


@pytest.mark.parametrize("bug", list(PLANTED))
def test_planted_decoder_bug_is_caught_by_the_right_check(bug):
    report = tiny_report(bug)
    checks, (names, position, words) = by_name(report), PLANTED[bug]
    assert failed(report) == names, report
    named = "ragged rows" if bug == "advance_by_chunk" else "cache equivalence"
    if bug == "future_in_chunk":
        named = "no future in the cache"
    first = checks[named].data["first"]
    assert first["position"] == position and first["deviation"] > 0.1
    assert words in checks[named].detail
    if bug == "advance_by_chunk":  # the ragged run's where names its chunk width
        assert first["width"] == 4 and checks[named].where["width"] == 4
    if bug == "ignore_cache":
        assert checks["positive control"].detail.startswith("insensitive")
        assert checks["positive control"].worst == 0.0


def test_cache_equivalence_names_the_first_divergence():
    detail = by_name(tiny_report("wide_window"))["cache equivalence"].detail
    first = by_name(tiny_report("wide_window"))["cache equivalence"].data["first"]
    assert detail.startswith(
        f"first divergence: position 6 of row {first['batch']} (feature {first['feature']}) "
        f"differs from the full forward by {first['deviation']:.3g}, decoding 1 token per call; "
        "diverges: 1 token per call, all 13 in one call, chunks 4,1,4,1,1,1,1"
    )


def test_token_id_language_model():
    # One token per call: the programs of `nanoattn verify --vocab` below, compiled once.
    def check(bug):
        return check_decoding(*_verify_decoders.tiny(bug, vocab=11), vocab=11, chunked=False)

    assert check(None).passed, check(None)
    report = check("late_write")
    assert failed(report) == {"cache equivalence", "ragged rows"}
    assert (
        "chunks of 1 with lengths per call row 0: 1,1,0,1," in by_name(report)["ragged rows"].detail
    )


def test_the_protocol_as_a_decoder_sees_it():
    full, init, step = _verify_decoders.tiny()
    inits, calls = [], []

    def spy_init(batch, max_len):
        inits.append((batch, max_len))
        return init(batch, max_len)

    def spy_step(state, chunk, lengths):
        calls.append((np.array(chunk), None if lengths is None else np.array(lengths)))
        return step(state, chunk, lengths)

    assert check_decoding(full, spy_init, spy_step, d_model=12).passed
    assert set(inits) == {(2, 16)}  # capacity T + 3: unwritten slots are there to be misread
    assert {c.shape[1] for c, n in calls if n is None} == {1, 4, 13}
    ragged = [(c, n) for c, n in calls if n is not None]
    assert all(n.dtype == np.int32 and n.shape == (2,) and c.shape == (2, 4, 12) for c, n in ragged)
    padding = np.concatenate([c[b, n[b] :] for c, n in ragged for b in range(2)])
    assert len(padding) > 10 and (np.abs(padding) > 0).all()  # random tokens, not zeros
    real = np.concatenate([c[b, : n[b]] for c, n in ragged for b in range(2)])
    assert not np.isin(padding, real).any()  # and not the row's own next tokens


def test_ragged_schedule_puts_rows_at_different_positions():
    calls = ragged_schedule(3, 13, 4)
    assert np.stack(calls).sum(0).tolist() == [13, 13, 13]
    assert np.stack(calls)[:3].tolist() == [[4, 1, 0], [1, 0, 3], [0, 3, 2]]
    assert np.stack(ragged_schedule(2, 5, 1)).max() == 1  # one token per call: 0 or 1


@jax.jit
def _flax_nnx_second_token(x):
    """Flax NNX's full forward and second decoded token with is_causal=True, (B, D) each."""
    mha = nnx.MultiHeadAttention(num_heads=2, in_features=8, rngs=nnx.Rngs(1))
    full = mha(x, decode=False, is_causal=True)
    mha.init_cache(x.shape)
    mha(x[:, :1], decode=True, is_causal=True)
    return full[:, 1], mha(x[:, 1:], decode=True, is_causal=True)[:, 0]


def flax_nnx_has_the_causal_decode_bug() -> bool:
    """An independent probe of google/flax#5591, on a tiny layer: does the second token
    decoded with is_causal=True differ from the full forward?"""
    full, second = _flax_nnx_second_token(jax.random.normal(jax.random.key(2), (1, 2, 8)))
    return not np.allclose(second, full, atol=1e-5)


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def shown_in_docs(out: str) -> bool:
    """Whether docs/verify.md shows this output, up to float rounding: values below 1e-4
    (a float32 rounding error, which another CPU may round differently) and spacing."""

    def normal(text):
        return " ".join(re.sub(r"\b\d(\.\d+)?e-(0[5-9]|[1-9]\d)\b", "~0", text).split())

    return normal(out) in normal(DOCS)


def docs_command(target: str) -> list[str]:
    return ["verify", f"examples.verify_demo:{target}", "--decode", "--d-model", "16"]


def test_flax_nnx_causal_decode_is_caught_as_the_docs_show(capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    code, out, err = run(capsys, *docs_command("flax_nnx_decoder"))
    if not flax_nnx_has_the_causal_decode_bug():
        assert code == 0, out
        pytest.skip(
            f"google/flax#5591 is fixed in flax {flax.__version__}: check_decoding passes on "
            "flax NNX's is_causal decode; update docs/verify.md and this test"
        )
    assert code == 1 and err == ""
    row = next(line for line in out.splitlines() if "cache equivalence" in line)
    assert re.search(r"FAIL .* first divergence: position 1 of row \d", row)
    assert "decoding 1 token per call" in row
    assert shown_in_docs(out)  # docs/verify.md shows this real report


@pytest.mark.parametrize("target", ["nanoattn_decoder", "flax_linen_decoder"])
def test_nanoattn_and_flax_linen_decode_pass_as_the_docs_show(capsys, monkeypatch, target):
    monkeypatch.chdir(ROOT)
    code, out, _ = run(capsys, *docs_command(target))
    assert code == 0, out
    assert shown_in_docs(out)
    if target == "flax_linen_decoder":  # one cache index for the whole batch: no lengths
        assert "ragged rows             SKIP" in out


@functools.cache
def nanoattn_decoder(framework: str, name: str):
    config = AttentionConfig(D, N, **CONFIGS[name])
    if framework == "nnx":
        return decoders.nnx(nanoattn_nnx.CausalSelfAttention(config, rngs=nnx.Rngs(0)))
    layer = CausalSelfAttention(config)
    init = jax.jit(lambda key: layer.init(key, jnp.ones((1, 2, D)), deterministic=True))
    return decoders.linen(layer, init(jax.random.key(0)))


def test_no_false_alarm_on_nanoattn_nnx_in_bfloat16():
    # Grouped-query heads, RoPE, window, soft-cap and QK norm at once, computing in bfloat16
    # (the linen layer with all of them in float32 is the docs' example above).
    report = check_decoding(*nanoattn_decoder("nnx", "bfloat16"), d_model=D, seq_len=11)
    assert report.passed, report
    assert not any(c.skipped for c in report.checks)
    assert "tolerance 0.0" in by_name(report)["cache equivalence"].detail  # 3e-2 x scale


@pytest.mark.slow
@pytest.mark.parametrize("framework", ["linen", "nnx"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_no_false_alarm_on_nanoattn_modules_in_every_configuration(framework, name):
    report = check_decoding(*nanoattn_decoder(framework, name), d_model=D, seq_len=11)
    assert report.passed, report


def test_one_token_decoders_and_decoders_without_lengths():
    full, init, step = _verify_decoders.tiny()

    def one_token_no_lengths(state, chunk, lengths):
        if chunk.shape[1] != 1 or lengths is not None:
            raise ValueError("one token per call, no lengths")
        return step(state, chunk, lengths)

    report = check_decoding(full, init, one_token_no_lengths, d_model=12, chunked=False)
    assert report.passed, report
    checks = by_name(report)
    assert checks["cache equivalence"].detail.startswith("1 chunking (1 token per call) reproduces")
    assert checks["ragged rows"].skipped
    assert checks["ragged rows"].detail == (
        "skipped, the step takes no lengths: ValueError: one token per call, no lengths"
    )
    report = check_decoding(
        full, init, one_token_no_lengths, d_model=12, chunked=False, ragged=False
    )
    assert by_name(report)["ragged rows"].detail == "skipped: ragged=False"
    assert by_name(report)["ragged rows"].skipped and by_name(report)["ragged rows"].passed
    with pytest.raises(ValueError, match="no lengths"):  # asked for, the error is not hidden
        check_decoding(full, init, one_token_no_lengths, d_model=12, chunked=False, ragged=True)
    with pytest.raises(ValueError, match="one token per call"):
        check_decoding(full, init, one_token_no_lengths, d_model=12)


def test_a_decoder_that_mutates_its_state_in_place_is_checked_too():
    # Every run starts from init and threads the state, so an in-place cache works.
    full, init, step = _verify_decoders.tiny()

    class Stateful:
        def __init__(self, batch, max_len):
            self.state = init(batch, max_len)

    def stateful_step(box, chunk, lengths):
        box.state, y = step(box.state, chunk, lengths)
        return box, y

    assert check_decoding(full, Stateful, stateful_step, d_model=_verify_decoders.D).passed


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(d_model=12, vocab=5), "pass d_model for float inputs (B, T, D) or vocab"),
        (dict(d_model=12, seq_len=1), "seq_len must be an int >= 2, got seq_len=1"),
        (dict(d_model=12, batch=0), "batch must be an int >= 1, got batch=0"),
        (dict(d_model=12, ragged="yes"), "ragged must be None, True or False, got ragged='yes'"),
        (dict(d_model=12, atol=-1.0), "atol must be >= 0, got -1.0"),
    ],
)
def test_argument_errors(kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        check_decoding(*_verify_decoders.tiny(), **kwargs)


def test_wrong_output_shapes_are_one_line_errors():
    full, init, step = _verify_decoders.tiny()
    with pytest.raises(ValueError, match=r"full must map an input of shape \(B, T, D\) = \(2, 13"):
        check_decoding(lambda x: full(x)[:, :1], init, step, d_model=_verify_decoders.D)

    def drops_a_token(state, chunk, lengths):
        state, y = step(state, chunk, lengths)
        return state, y[:, 1:]

    with pytest.raises(ValueError, match=r"step must map an input of shape"):
        check_decoding(full, init, drops_a_token, d_model=_verify_decoders.D)


# `nanoattn verify --decode`, `--vocab`: targets in tests/_verify_decoders.py.


def test_cli_decode_exit_statuses_and_json(capsys):
    code, out, _ = run(capsys, "verify", "_verify_decoders:correct", "--decode", "--d-model", "12")
    assert code == 0 and out.startswith(
        "nanoattn verify _verify_decoders:correct --decode (d_model 12, batch 2, length 13)\n"
        "decoding: PASS"
    )
    code, out, _ = run(
        capsys, "verify", "_verify_decoders:late_write", "--decode", "--d-model", "12", "--json"
    )
    report = json.loads(out)
    assert code == 1 and report["target"] == "_verify_decoders:late_write"
    checks = {c["name"]: c for c in report["checks"]}
    assert checks["cache equivalence"]["status"] == "FAIL"
    assert checks["cache equivalence"]["data"]["first"]["position"] == 0


def test_cli_vocab_for_token_id_models(capsys):
    argv = ["verify", "_verify_decoders:language_model", "--decode", "--vocab", "11"]
    code, out, _ = run(capsys, *argv, "--seq-len", "13", "--one-token")
    assert code == 0 and "(vocab 11, batch 2, length 13)" in out
    assert "1 chunking (1 token per call) reproduces" in out


def test_cli_causality_on_token_ids(capsys, monkeypatch):
    monkeypatch.setattr(
        _verify_decoders, "lm_forward", lambda: _verify_decoders.tiny(vocab=11)[0], raising=False
    )
    code, out, _ = run(
        capsys, "verify", "_verify_decoders:lm_forward", "--vocab", "11", "--seq-lens", "1,3"
    )
    assert code == 0 and "token ids have no gradient" in out


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["_verify_decoders:correct", "--decode"],
            "give --d-model D for float inputs or --vocab V",
        ),
        (
            ["_verify_decoders:correct", "--decode", "--d-model", "12", "--vocab", "3"],
            "give --d-model D for float inputs or --vocab V for token ids (one)",
        ),
        (["_verify_decoders:correct", "--decode", "--vocab", "1"], "--vocab must be >= 2, got 1"),
        (
            ["_verify_decoders:not_a_triple", "--decode", "--d-model", "12"],
            "the factory _verify_decoders:not_a_triple() returned an ArrayImpl, not a "
            "(full, init, step) decoder",
        ),
        (
            ["_verify_targets:reversed_time", "--decode", "--d-model", "12"],
            "_verify_targets:reversed_time takes arguments: --decode needs a (full, init, step)",
        ),
        (
            ["_verify_decoders:correct", "--decode", "--d-model", "12", "--seq-lens", "3"],
            "--seq-lens is for the causality check; with --decode use --seq-len",
        ),
        (
            ["_verify_decoders:correct", "--decode", "--d-model", "12", "--seq-len", "1"],
            "--seq-len must be >= 2, got 1",
        ),
        (["_verify_targets:reversed_time", "--d-model", "4", "--one-token"], "only applies"),
        (
            ["_verify_decoders:correct", "--decode", "--d-model", "5"],
            "calling _verify_decoders:correct failed: ",
        ),
    ],
)
def test_cli_decode_errors_exit_2(capsys, argv, message):
    code, out, err = run(capsys, "verify", *argv)
    assert code == 2 and out == ""
    assert len(err.strip().splitlines()) == 1 and message in err and "Traceback" not in err


@pytest.mark.parametrize(
    "T, cycle",
    [(13, [4, 1, 4, 1, 1, 1, 1]), (14, [4, 1, 4, 1, 4]), (10, [4, 1, 4, 1]), (3, [1, 1, 1])],
)
def test_chunkings_cycle_4_1_and_finish_one_by_one(T, cycle):
    # The cycle goes on while its next chunk fits exactly too (T = 14 ends with a 4).
    from nanoattn.verify._decoding import _chunkings

    runs = _chunkings(T, chunked=True)
    assert runs == {
        "1 token per call": [1] * T,
        f"all {T} in one call": [T],
        "chunks " + ",".join(map(str, cycle)): cycle,
    }
    assert _chunkings(T, chunked=False) == {"1 token per call": [1] * T}


# A second mutation sample of nanoattn/verify (40 per file, seed 2) found these unpinned.


def test_an_explicit_atol_is_the_tolerance():
    # The bfloat16 cache is off by about 1e-3: it fails the default tolerance (above) and
    # passes a tolerance of 0.05 given as atol.
    full, init, step = _verify_decoders.tiny("bfloat16_cache")
    report = check_decoding(full, init, step, d_model=_verify_decoders.D, atol=0.05)
    checks = by_name(report)
    assert checks["cache equivalence"].passed and checks["ragged rows"].passed
    assert checks["cache equivalence"].detail.endswith("tolerance 0.05")


def test_a_nan_output_diverges_in_the_chunking_that_made_it():
    full, init, step = _verify_decoders.tiny()

    def nan_one_by_one(state, chunk, lengths):
        state, y = step(state, chunk, lengths)
        return state, y * jnp.nan if chunk.shape[1] == 1 and lengths is None else y

    report = check_decoding(full, init, nan_one_by_one, d_model=_verify_decoders.D, ragged=False)
    equivalence = by_name(report)["cache equivalence"]
    assert not equivalence.passed and equivalence.worst == np.inf
    assert equivalence.detail.endswith(
        "; diverges: 1 token per call, chunks 4,1,4,1,1,1,1; matches: all 13 in one call"
    )


def test_a_future_leak_names_its_chunking_and_split():
    check = by_name(tiny_report("future_in_chunk"))["no future in the cache"]
    assert set(check.where) >= {"chunking", "split"}
    assert check.where["split"] in (1, 6, 12)


@pytest.mark.parametrize(
    "module_dtype, param_dtype, chunk_dtype, cache_dtype, dropout",
    [
        ("bfloat16", "float32", "float32", "bfloat16", 0.0),
        (None, "bfloat16", "bfloat16", "bfloat16", 0.0),
        (None, "float32", "bfloat16", "float32", 0.0),  # flax computes keys in float32 here
        (None, "bfloat16", "float32", "float32", 0.0),
        (
            None,
            "float32",
            "float32",
            "float32",
            0.1,
        ),  # dropout: an rng in the state too  # dropout: rng state too
    ],
)
def test_flax_nnx_cache_takes_the_dtype_flax_computes_in(
    module_dtype, param_dtype, chunk_dtype, cache_dtype, dropout
):
    mha = nnx.MultiHeadAttention(
        num_heads=2,
        in_features=8,
        dtype=module_dtype,
        param_dtype=param_dtype,
        dropout_rate=dropout,
        decode=False,
        rngs=nnx.Rngs(0),
    )
    _, init, step = decoders.flax_nnx(mha)
    (_, cache), _ = step(init(2, 4), jnp.ones((2, 1, 8), chunk_dtype), None)
    caches = {
        str(path[-1]): leaf.dtype
        for path, leaf in jax.tree_util.tree_flatten_with_path(nnx.to_pure_dict(cache))[0]
        if "cached" in str(path)
    }
    assert caches and set(caches.values()) == {jnp.dtype(cache_dtype)}, caches


# A third sample (60 per file, seed 3), run after the tests above, found these unpinned.


def test_ragged_divergence_is_named_whole():
    check = by_name(tiny_report("advance_by_chunk"))["ragged rows"]
    first = check.data["first"]
    assert check.detail.startswith(
        f"first divergence: position 1 of row {first['batch']} (feature {first['feature']}) "
        f"differs from its full "
    )


def test_a_linen_layer_with_dropout_decodes_deterministically():
    layer = CausalSelfAttention(AttentionConfig(D, N, dropout=0.1))
    params = layer.init(jax.random.key(0), jnp.ones((1, 2, D)), deterministic=True)
    report = check_decoding(*decoders.linen(layer, params), d_model=D, seq_len=5, chunked=False)
    assert report.passed, report


# Rolling caches, sink tokens and rewinding: check_decoding(capacity, max_chunk, rewind)
# on the rolling decoder of tests/_verify_decoders.py (C = 10 slots, W = 5, 2 sinks).


@functools.cache
def rolling_report(bug) -> Report:
    return check_decoding(_verify_decoders.rolling(bug), d_model=_verify_decoders.D)


def test_a_correct_rolling_decoder_passes_far_past_its_capacity():
    report = rolling_report(None)
    assert report.passed, report
    assert [c.name for c in report.checks][-1] == "rewinding"
    assert not any(c.skipped for c in report.checks)
    equivalence = by_name(report)["cache equivalence"].detail
    # 4 C + 3 tokens through C slots; the largest chunk, C - W - S0, is fed
    assert equivalence.startswith("3 chunkings (1 token per call; chunks of 3; chunks 3,1,3,1,")
    assert "at all 43 positions of 2 rows through a cache of 10 slots" in equivalence
    assert "2 rows fed 28 right-padded chunks of 3" in by_name(report)["ragged rows"].detail


# bug -> the checks that fail
ROLLING_PLANTED = {
    "ring_one_slot_off": {
        "cache equivalence",
        "ragged rows",
        "no future in the cache",
        "rewinding",
    },
    "stale_after_rewind": {"rewinding"},
    "sinks_overwritten": {
        "cache equivalence",
        "ragged rows",
        "no future in the cache",
        "rewinding",
    },
    "chunk_limit_plus_one": {"cache equivalence", "ragged rows", "rewinding"},
}


@pytest.mark.parametrize("bug", list(ROLLING_PLANTED))
def test_planted_rolling_and_rewind_bugs_are_caught(bug):
    report = rolling_report(bug)
    assert failed(report) == ROLLING_PLANTED[bug], report
    first = by_name(report)["rewinding"].data["first"]
    assert first["deviation"] > 0.1
    if bug != "stale_after_rewind":  # the ring bugs show only in a chunk that wraps it
        assert by_name(report)["cache equivalence"].data["first"]["position"] >= (
            _verify_decoders.CAPACITY - _verify_decoders.CHUNK_LIMIT
        )


@pytest.mark.parametrize("bug", ["ring_one_slot_off", "sinks_overwritten"])
def test_ring_bugs_hide_within_the_capacity(bug):
    # Why the check decodes past the capacity: until the ring wraps these bugs are right.
    report = check_decoding(
        _verify_decoders.rolling(bug), d_model=_verify_decoders.D, seq_len=_verify_decoders.CAPACITY
    )
    assert report.passed, report


def test_rewinding_a_full_cache_and_the_schedule():
    full, init, step = _verify_decoders.tiny()
    report = check_decoding(full, init, step, rewind=_verify_decoders.rewind_tiny, d_model=12)
    assert report.passed, report
    assert by_name(report)["rewinding"].detail.startswith(
        "2 rows fed 9 chunks of up to 4 new tokens, each call followed by a rewind "
        "(tokens dropped per call row 0: 4,0,2,2,1,2,2,2,0; row 1: 0,1,4,0,1,1,0,0,0)"
    )

    def no_rewind(state, n):  # the rejected tokens stay: caught
        return state

    report = check_decoding(full, init, step, rewind=no_rewind, d_model=12)
    assert failed(report) == {"rewinding"}
    calls = rewind_schedule(3, 13, 4)
    lengths, dropped = (np.stack(a) for a in zip(*calls))
    assert ((0 <= dropped) & (dropped <= lengths)).all()
    assert (lengths - dropped).sum(0).tolist() == [13, 13, 13]
    assert dropped[0, 0] == lengths[0, 0] == 4 and dropped[0, 1] == 0  # all, and none
    assert ((0 < dropped) & (dropped < lengths)).any()  # and part of a chunk


def test_a_decoder_object_and_its_protocol():
    decoder = _verify_decoders.rolling()
    full, init, step = decoder  # unpacks as the core triple
    assert isinstance(decoder, Decoder) and not isinstance(decoder, tuple)  # a dataclass
    assert (decoder.capacity, decoder.max_chunk) == (10, 3) and decoder.rewind is not None
    with pytest.raises(AttributeError):
        decoder.capacity = 11
    inits, widths = [], set()

    def spy_init(batch, max_len):
        inits.append(max_len)
        return init(batch, max_len)

    def spy_step(state, chunk, lengths):
        widths.add(chunk.shape[1])
        return step(state, chunk, lengths)

    spied = Decoder(full, spy_init, spy_step, capacity=10, max_chunk=3)
    report = check_decoding(spied, d_model=12, seq_len=17)
    assert report.passed and "rewinding" not in by_name(report)  # no rewind: not checked
    assert set(inits) == {10} and widths == {1, 3}  # told the capacity; chunks at most 3
    report = check_decoding(spied, d_model=12, seq_len=17, rewind=decoder.rewind)  # added here
    assert "rewinding" in by_name(report)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(capacity=0), "capacity must be None or an int >= 1, got capacity=0"),
        (dict(max_chunk=2.0), "max_chunk must be None or an int >= 1, got max_chunk=2.0"),
        (dict(rewind=3), "rewind must be None or a function (state, n) -> state, got 3"),
    ],
)
def test_rolling_argument_errors(kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        check_decoding(*_verify_decoders.tiny(), d_model=12, **kwargs)
    with pytest.raises(ValueError, match="pass a Decoder alone"):
        check_decoding(_verify_decoders.rolling(), lambda b, n: None, d_model=12)


# nanoattn's own layers as Decoders: rewind through nanoattn.linen.rewind / module.rewind,
# and a rolling cache bounded by its capacity C = W + S0 + 4 and max_chunk C - W - S0.

TINY_D = 16
TINY_LAYERS = {  # name: AttentionConfig options
    "full": dict(),
    "rolling_sinks": dict(window=(3, 0), rolling_cache=True, sink_tokens=2),
}


def tiny_layer_decoder(framework: str, name: str) -> Decoder:
    config = AttentionConfig(TINY_D, 2, **TINY_LAYERS[name])
    if framework == "nnx":
        return decoders.nnx(nanoattn_nnx.CausalSelfAttention(config, rngs=nnx.Rngs(0)))
    layer = CausalSelfAttention(config)
    params = layer.init(jax.random.key(0), jnp.ones((1, 2, TINY_D)), deterministic=True)
    return decoders.linen(layer, params)


@pytest.mark.parametrize("name", list(TINY_LAYERS))
@pytest.mark.parametrize("framework", ["linen", pytest.param("nnx", marks=pytest.mark.slow)])
def test_nanoattn_layers_as_decoders_rewind_and_roll_past_their_capacity(framework, name):
    decoder = tiny_layer_decoder(framework, name)
    assert decoder.rewind is not None
    report = check_decoding(decoder, d_model=TINY_D)  # the Decoder whole: rewind, capacity
    assert report.passed, report
    assert not any(c.skipped for c in report.checks)
    assert "rewinding" in by_name(report)
    equivalence = by_name(report)["cache equivalence"].detail
    if name == "full":
        assert (decoder.capacity, decoder.max_chunk) == (None, None)
        assert "all 13 in one call" in equivalence
    else:  # C = W + S0 + 4 = 9 slots, chunks of at most 4, 4 C + 3 = 39 tokens
        assert (decoder.capacity, decoder.max_chunk) == (9, 4)
        assert "at all 39 positions of 2 rows through a cache of 9 slots" in equivalence
        assert "chunks of 4" in equivalence


def test_a_rolling_layer_decoder_takes_a_capacity_and_refuses_too_few_slots():
    config = AttentionConfig(TINY_D, 2, **TINY_LAYERS["rolling_sinks"])
    layer = nanoattn_nnx.CausalSelfAttention(config, rngs=nnx.Rngs(0))
    decoder = decoders.nnx(layer, capacity=7)
    assert (decoder.capacity, decoder.max_chunk) == (7, 2)
    with pytest.raises(ValueError, match=r"capacity >= window \+ 1 \+ sink_tokens = 6, got "):
        decoders.nnx(layer, capacity=5)


def test_cli_decode_checks_a_decoder_whole(capsys):
    # A Decoder keeps its rewind, capacity and max_chunk through the CLI: the ring wraps
    # (4 C + 3 tokens through C = 10 slots) and the rewinding check runs.
    code, out, _ = run(capsys, "verify", "_verify_decoders:rolling", "--decode", "--d-model", "12")
    assert code == 0, out
    assert out.startswith(
        "nanoattn verify _verify_decoders:rolling --decode (d_model 12, batch 2, length 43, "
        "capacity 10)\ndecoding: PASS"
    )
    assert "through a cache of 10 slots" in out
    assert re.search(r"^  rewinding +PASS", out, re.M)
