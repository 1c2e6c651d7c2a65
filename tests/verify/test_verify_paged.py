"""check_decoding on paged decoders (nanoattn.verify.PagedDecoder): the planted paged
bugs of tests/_verify_decoders.py, each caught by the checks that must catch it; the
forks check; no false alarm on nanoattn's linen and NNX paged layers; the adapters, the
row protocol's pool (shuffled, poisoned, reused) and `nanoattn verify --decode`; a
prefix-cached decoder (hits, namespaces, evictions, a page reused after its eviction)
and a windowed one (pages given back and reused while a sequence goes on), each with
the allocator bugs that their checks must catch.

The planted bugs share one compiled step per token count (a traced switch); every
report is computed once.
"""

import dataclasses
import functools
import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from nanoattn import PageAllocator, PagedBatch
from nanoattn import nnx as nanoattn_nnx
from nanoattn._layers.caches.prefix_cache import PrefixIndex
from nanoattn.cli import main
from nanoattn.linen import AttentionConfig, CausalSelfAttention, LatentAttention, LatentConfig
from nanoattn.verify import Decoder, PagedDecoder, Report, check_decoding, decoders
from nanoattn.verify._inputs import Inputs
from nanoattn.verify._paged_decoding import as_rows, fork_point, fork_schedule
from nanoattn.verify._prefix_check import check_prefix_cache
from nanoattn.verify._window_check import check_window_pages

import _verify_decoders
from _layer_configs import random_params

PS = _verify_decoders.PAGE_SIZE
CHECKS = [
    "cache equivalence",
    "ragged rows",
    "no future in the cache",
    "positive control",
    "rewinding",
    "forks",
    "programs",
]


def by_name(report: Report):
    return {c.name: c for c in report.checks}


def failed(report: Report) -> set[str]:
    return {c.name for c in report.checks if not c.passed}


@functools.cache
def paged_report(bug) -> Report:
    return check_decoding(_verify_decoders.paged(bug), d_model=_verify_decoders.D)


def test_the_correct_paged_decoder_passes_every_check():
    report = paged_report(None)
    assert report.passed, report
    assert [c.name for c in report.checks] == CHECKS
    assert not any(c.skipped for c in report.checks)
    checks = by_name(report)
    assert "through pages of 3 tokens handed out in a shuffled order" in (
        checks["cache equivalence"].detail
    )
    assert checks["forks"].detail.startswith(
        "a parent's prefix of 5 tokens (pages of 3, the last one partial) forked into 2 children"
    )


# bug -> (the checks that fail, the check whose first divergence is pinned, its row, position)
PLANTED = {
    # a stale page (NaN, inf) past each sequence's: every check, from the first token
    "one_page_too_far": (set(CHECKS), "cache equivalence", 0, 0),
    # only a fork writes a copied page: the first child's first own token, at the prefix
    "fork_writes_shared": ({"forks", "programs"}, "forks", 1, 5),
    # RoPE is relative within a page: the first divergence is the second page's first token
    "page_order": (
        {"cache equivalence", "ragged rows", "rewinding", "forks", "programs"},
        "cache equivalence",
        0,
        PS,
    ),
    # rows at one position hide it: only where rows sit at different positions
    "decode_takes_prefill_positions": (
        {"ragged rows", "rewinding", "forks", "programs"},
        "ragged rows",
        1,
        1,
    ),
    # a copy made after the writes overwrites a child's first own token
    "copies_after_writes": ({"forks", "programs"}, "forks", 1, 5),
    # copies in turn, the last first: only a step whose copy reads a page another copy
    # of the step fills, an order only the random programs reach
    "copies_last_first": ({"programs"}, None, None, None),
}


@pytest.mark.parametrize("bug", list(PLANTED))
def test_planted_paged_bug_is_caught_by_the_right_checks(bug):
    report = paged_report(bug)
    names, check, row, position = PLANTED[bug]
    assert failed(report) == names, report
    if check is not None:
        first = by_name(report)[check].data["first"]
        assert (first["batch"], first["position"]) == (row, position), first
        assert first["deviation"] > 0.1


def test_the_programs_reach_every_order_they_are_for():
    """Forks before and after the parent's step, chains of copies, copies into and
    from freed pages, refusals: each met by the correct decoder's programs, whose
    every token is checked."""
    programs = by_name(paged_report(None))["programs"]
    assert programs.passed and all(n > 0 for n in programs.data["orders"].values()), programs


@pytest.mark.parametrize("bug", list(_verify_decoders.ALLOCATOR_BUGS))
def test_the_wrong_answers_of_the_old_allocator_are_caught_on_nanoattns_layer(bug):
    """Issue 45's three: a fork before the parent's step, a copy whose source is another
    pending copy's target, a freed copy target handed to another copy in one step,
    each planted back into the allocator: the programs check fails, naming the moves."""
    decoder = _paged_layer("linen", "rope")
    planted = dataclasses.replace(decoder, allocator=_verify_decoders.ALLOCATOR_BUGS[bug])
    report = check_decoding(planted, d_model=D)
    assert "programs" in failed(report), report
    programs = by_name(report)["programs"]
    assert programs.detail.startswith("first divergence: program ")
    assert "the last moves: " in programs.detail and "fork" in programs.detail


def test_a_fork_that_writes_the_shared_page_names_the_child_and_the_schedule():
    forks = by_name(paged_report("fork_writes_shared"))["forks"]
    assert forks.detail.startswith(
        "first divergence: position 5 of row 1 (feature 0) differs from the full forward "
        "of its own sequence by inf; row 0 took a prefix of 5 tokens (pages of 3), forked "
        "into rows 1-2, then tokens per call row 0: 0,2,3,3; row 1: 2,3,3,0; row 2: 3,4,1,0"
    )
    assert forks.where["prefix"] == 5


def test_the_fork_point_is_never_a_whole_number_of_pages():
    assert [fork_point(T, 3) for T in (2, 3, 12, 13, 14)] == [1, 1, 5, 5, 7]
    assert fork_point(13, 1) == 6  # pages of one token: every prefix is whole pages
    calls, forked_at = fork_schedule(3, 13, 5, 4)
    assert forked_at == 2 and [c.tolist() for c in calls[:2]] == [[4, 0, 0], [1, 0, 0]]
    assert calls[2][0] == 0 and (calls[2][1:] > 0).all()  # the children write first
    assert (sum(calls[2:]) == 13 - 5).all()


def test_the_rows_get_poisoned_shuffled_pages_and_random_unused_entries():
    """What a paged step sees of the row protocol: the pool was filled and freed first,
    the rows' pages are not in order, the padding holds poison, the page table's
    unused entries are valid random pages."""
    seen = []

    def step(state, chunk, batch):
        seen.append((np.asarray(chunk), batch))
        return state, np.zeros(chunk.shape)

    decoder = PagedDecoder(lambda x: x, lambda pages: pages, step, page_size=PS)
    init, row_step, rewind = as_rows(decoder, Inputs(d_model=2))
    rows = init(2, 16)  # M = 6 pages a row, P = 2 * 6 + 3
    assert rows.state == 15
    rows, y = row_step(rows, np.ones((2, 4, 2), np.float32), np.array([4, 1], np.int32))
    poison, (chunk, batch) = seen[:-1], seen[-1]
    written = sum(int(b.query_starts[-1]) for _, b in poison)
    assert written == 15 * PS and all(c.shape == (1, 8, 2) for c, _ in seen)
    assert np.isnan(np.concatenate([c[0] for c, _ in poison])).any()
    assert (np.abs(np.concatenate([c[0] for c, _ in poison])) > 1e38).any()
    assert isinstance(batch, PagedBatch) and batch.query_starts.tolist() == [0, 4, 5]
    assert (chunk[0, :5] == 1).all() and (chunk[0, 5:] != 1).all()  # poison padding
    pages = rows.alloc.pages_of(("row", 0)) + rows.alloc.pages_of(("row", 1))
    assert pages != list(range(3))  # shuffled, not lowest first
    table = batch.page_table
    assert table.shape == (2, 6) and ((table >= 0) & (table < 15)).all()
    assert (table[0, 2:] != 0).any() and (table[1, 1:] != 0).any()  # not the allocator's zeros
    assert y.shape == (2, 4, 2)
    rows = rewind(rows, np.array([3, 1]))
    assert [rows.alloc.length(s) for s in rows.ids] == [1, 0]


def test_a_paged_decoder_refuses_the_options_of_a_slot_cache():
    decoder = _verify_decoders.paged()
    for name, value in (("rewind", _verify_decoders.rewind_tiny), ("capacity", 5)):
        with pytest.raises(ValueError, match=f"a PagedDecoder takes no {name}"):
            check_decoding(decoder, d_model=12, **{name: value})
    with pytest.raises(ValueError, match="pass a PagedDecoder alone"):
        check_decoding(decoder, decoder.init, decoder.step, d_model=12)
    with pytest.raises(ValueError, match="page_size must be an int >= 1, got page_size=0"):
        PagedDecoder(decoder.full, decoder.init, decoder.step, page_size=0)
    with pytest.raises(ValueError, match="step must be a function"):
        PagedDecoder(decoder.full, decoder.init, None, page_size=PS)


def test_a_paged_step_of_the_wrong_shape_is_a_one_line_error():
    decoder = _verify_decoders.paged()
    no_tokens = PagedDecoder(
        decoder.full, decoder.init, lambda s, x, b: (s, np.zeros((1, 1, 12))), page_size=PS
    )
    with pytest.raises(ValueError, match=r"step must map an input of shape \(B, T, D\) = "):
        check_decoding(no_tokens, d_model=12)


# nanoattn's paged layers: no false alarm (prime sizes, H = 4, GQA).
D, N, K = 20, 5, 1
PAGED_CONFIGS = {
    "rope": dict(n_kv_heads=K, rope_base=100.0, page_size=3),
    "window_cap_norm": dict(
        n_kv_heads=K, rope_base=100.0, window=(4, 0), logit_soft_cap=2.0, qk_norm=True, page_size=5
    ),
}


def _paged_layer(framework: str, name: str):
    config = AttentionConfig(D, N, **PAGED_CONFIGS[name])
    if framework == "nnx":
        return decoders.nnx(nanoattn_nnx.CausalSelfAttention(config, rngs=nnx.Rngs(0)))
    layer = CausalSelfAttention(config)
    init = functools.partial(layer.init, deterministic=True)
    shapes = jax.eval_shape(init, jax.random.key(0), jnp.zeros((1, 2, D)))
    return decoders.linen(layer, random_params(shapes["params"], 5))


@pytest.mark.parametrize(("framework", "name"), [("linen", "rope"), ("nnx", "window_cap_norm")])
def test_no_false_alarm_on_nanoattn_paged_layers(framework, name):
    decoder = _paged_layer(framework, name)
    assert isinstance(decoder, PagedDecoder)
    assert decoder.page_size == PAGED_CONFIGS[name]["page_size"]
    report = check_decoding(decoder, d_model=D)
    assert report.passed, report
    windowed = PAGED_CONFIGS[name].get("window") is not None
    assert [c.name for c in report.checks] == CHECKS + ["window pages"] * windowed
    assert decoder.window == PAGED_CONFIGS[name].get("window")


def test_no_false_alarm_on_a_quantized_pool_and_the_latent_layers_pool():
    """The programs (and every other check) over an int8 pool, whose tolerance is the
    quantization's, and over multi-head latent attention's pool of one latent head."""
    layer = CausalSelfAttention(AttentionConfig(D, N, n_kv_heads=K, rope_base=100.0,
                                                kv_cache_dtype="int8", page_size=3))  # fmt: skip
    params = layer.init(jax.random.key(1), jnp.zeros((1, 2, D)), True)
    report = check_decoding(decoders.linen(layer, params), d_model=D, atol=0.05)
    assert report.passed and "programs" in by_name(report), report
    latent = LatentAttention(LatentConfig(d_model=16, n_heads=2, kv_lora_rank=7,
                                          qk_nope_head_dim=3, qk_rope_head_dim=4,
                                          v_head_dim=5, page_size=3))  # fmt: skip
    params = latent.init(jax.random.key(2), jnp.ones((1, 2, 16)))
    report = check_decoding(decoders.linen(latent, params), d_model=16, seq_len=7)
    assert report.passed and "programs" in by_name(report), report


def test_the_adapters_keep_slot_caches_and_refuse_a_capacity_for_pages():
    layer = CausalSelfAttention(AttentionConfig(D, N))
    params = layer.init(jax.random.key(0), jnp.zeros((1, 2, D)), True)
    decoder = decoders.linen(layer, params)
    assert isinstance(decoder, Decoder) and not isinstance(decoder, PagedDecoder)
    paged = CausalSelfAttention(AttentionConfig(D, N, page_size=3))
    with pytest.raises(ValueError, match="a paged cache takes no capacity"):
        decoders.linen(paged, params, capacity=6)


def test_cli_decode_runs_a_paged_decoder(capsys):
    code = main(
        ["verify", "_verify_decoders:paged_correct", "--decode", "--d-model", "12", "--json"]
    )
    out = json.loads(capsys.readouterr().out)
    assert code == 0 and [c["name"] for c in out["checks"]] == CHECKS
    code = main(["verify", "_verify_decoders:paged_correct", "--decode", "--d-model", "12"])
    first = capsys.readouterr().out.splitlines()[0]
    assert code == 0
    assert first.endswith("--decode (d_model 12, batch 2, length 13, pages of 3)")


# A prefix-cached decoder (PagedDecoder(prefix_cache=True)) and a windowed one (the
# adapters give a paged layer's window and sink tokens): their checks, and the
# allocator bugs each must catch, planted into nanoattn's PageAllocator (they reach into
# its private state, where such bugs live).


class SharedNamespaces(PageAllocator):
    """Every namespace's prompts share one cache."""

    def allocate(self, seq_id, n_tokens=0, *, tokens=None, namespace=None):
        return super().allocate(seq_id, n_tokens, tokens=tokens)


class CachedBeforeWritten(PageAllocator):
    """A full page is cached when allocated, before a step has written it."""

    def allocate(self, seq_id, n_tokens=0, **options):
        cached = super().allocate(seq_id, n_tokens, **options)
        sequence = self._sequences[seq_id]
        written, sequence.written = sequence.written, sequence.length
        self._register(sequence)
        sequence.written = written
        return cached


class _Unforgetting(PrefixIndex):
    def evict(self):
        page = next(iter(self._reusable))
        self._reusable.pop(page)  # handed out, but its key still points at it
        self.evictions += 1
        return page


class EvictedStillCached(PageAllocator):
    """An evicted page is handed out and written, and its old prefix still hits it."""

    def __init__(self, *args, **options):
        super().__init__(*args, **options)
        if self._cache is not None:
            self._cache = _Unforgetting()


class NeverEvicts(PageAllocator):
    """Cached pages no sequence holds are not counted free: the pool runs out."""

    @property
    def free_pages(self):
        return len(self._free)


class GivesBackEarly(PageAllocator):
    """Pages go back as if no rewind could take the last extension back."""

    def _out_of_window(self, sequence, first_query):
        return super()._out_of_window(sequence, sequence.length)


class KeepsItsWindow(PageAllocator):
    """A windowed allocator that never gives a page back."""

    def _out_of_window(self, sequence, first_query):
        return []


PREFIX_BUGS = {
    SharedNamespaces: r"^namespace 'tenant-b' was served 6 tokens cached under 'tenant-a'",
    CachedBeforeWritten: r"^a prompt allocated before the step that writes its prefix hit 6",
    EvictedStillCached: r"^first divergence: position .* of sequence 'A again'",
    NeverEvicts: r"prompts of fresh tokens were refused \(the pool of 15 pages is exhausted",
}


def _prefix_decoder(allocator=PageAllocator):
    return dataclasses.replace(
        _paged_layer("linen", "rope"), prefix_cache=True, allocator=allocator
    )


def test_a_prefix_cached_decoder_passes_with_hits_namespaces_and_evictions():
    """Every check through a prefix-cached allocator; the prefix cache check's hit of two
    pages, no hit under the other namespace, evictions and pages written again after
    them; the programs' hits and evictions."""
    report = check_decoding(_prefix_decoder(), d_model=D)
    assert report.passed, report
    assert [c.name for c in report.checks] == [*CHECKS, "prefix cache"]
    checks = by_name(report)
    prefix = checks["prefix cache"].data
    assert prefix["hit"] == 6 and prefix["other_namespace"] == 0
    assert prefix["evictions"] > 0 and prefix["reused"] > 0
    orders = checks["programs"].data["orders"]
    assert orders["prefix hits"] > 0 and orders["evictions"] > 0, orders
    assert "with a prefix cache" in checks["cache equivalence"].detail


@pytest.mark.parametrize("bug", list(PREFIX_BUGS), ids=lambda b: b.__name__)
def test_the_prefix_cache_check_catches_a_broken_cache(bug):
    decoder = _prefix_decoder(bug)
    inputs = Inputs(d_model=D)
    result = check_prefix_cache(decoder, inputs, 1e-4, as_rows(decoder, inputs)[0])
    assert not result.passed and re.search(PREFIX_BUGS[bug], result.detail), result.detail


def test_a_windowed_decoder_gives_pages_back_that_poison_sequences_reuse():
    decoder = _paged_layer("linen", "window_cap_norm")
    inputs = Inputs(d_model=D)
    result = check_window_pages(decoder, inputs, 1e-4, as_rows(decoder, inputs)[0])
    assert result.passed, result
    assert result.data["given_back"] >= 3 and result.data["reused"] >= 1
    assert result.data["most_held"] <= -(-5 // 5) + 1  # ceil(W / page_size) + 1, W = 5


WINDOW_BUGS = {
    GivesBackEarly: r"^first divergence: position \d+ of the windowed sequence",
    KeepsItsWindow: r"^after a step of 1 tokens at length \d+ the sequence holds 3 pages, more",
}


@pytest.mark.parametrize("bug", list(WINDOW_BUGS), ids=lambda b: b.__name__)
def test_the_window_check_catches_pages_given_back_wrong(bug):
    decoder = dataclasses.replace(_paged_layer("linen", "window_cap_norm"), allocator=bug)
    inputs = Inputs(d_model=D)
    result = check_window_pages(decoder, inputs, 1e-4, as_rows(decoder, inputs)[0])
    assert not result.passed and re.search(WINDOW_BUGS[bug], result.detail), result.detail


def test_a_layer_that_reads_the_pages_given_back_fails_the_window_check():
    """A layer of window (7, 0) driven with the allocator of window (4, 0): the pages
    it gives back are pages the layer still reads (its rows NaN under jit)."""
    config = dict(PAGED_CONFIGS["window_cap_norm"], window=(7, 0))
    layer = CausalSelfAttention(AttentionConfig(D, N, **config))
    shapes = jax.eval_shape(functools.partial(layer.init, deterministic=True),
                            jax.random.key(0), jnp.zeros((1, 2, D)))  # fmt: skip
    wider = decoders.linen(layer, random_params(shapes["params"], 5))
    decoder = dataclasses.replace(wider, window=(4, 0))
    inputs = Inputs(d_model=D)
    result = check_window_pages(decoder, inputs, 1e-4, as_rows(decoder, inputs)[0])
    assert not result.passed and "differs from its full forward by inf" in result.detail


def test_a_paged_decoder_refuses_bad_window_and_cache_options():
    decoder = _verify_decoders.paged()
    with pytest.raises(ValueError, match=r"sink_tokens=2 needs a window"):
        dataclasses.replace(decoder, sink_tokens=2)
    with pytest.raises(ValueError, match=r"prefix_cache must be True or False, got 1"):
        dataclasses.replace(decoder, prefix_cache=1)
    assert dataclasses.replace(decoder, window=3).window == (3, 3)
