"""nanoattn.verify.check_mask (verify/_mask.py, the claim of verify/_claimed.py, the
measurement of verify/_dependence.py): it passes on nanoattn's layers under each mask
they realise (causal, causal window, bidirectional window, documents, padding,
prefix-LM, per-head masks) and fails on planted bugs: windows off by one either way, a
leak across documents, a mask that claims more than the layer sees, a row reading
another row, a vanishing layer, a leak only outside jit; on token ids and numpy
functions by perturbation; bad mask_fns raise in one line before fn is called."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from nanoattn import dot_product_attention, padding_mask, window_mask
from nanoattn.linen import AttentionConfig, CausalSelfAttention, CrossAttention
from nanoattn.verify import check_mask

from _layer_configs import EVERYTHING
from _verify_functions import by_name, nanogpt_like, self_attention

D, N = 8, 2  # model width and heads of the small layers: H = 4
AT = (9,)  # past every window and document here; checked under jit and eagerly
W = 3  # the causal window's left width


def causal(b, n, q, k):
    return k <= q


def causal_window(width):
    return lambda b, n, q, k: (k <= q) & (q - k <= width)


def documents(b, n, q, k):
    """Row b packs documents of 2 + b tokens: (t // (2 + b)) is token t's id."""
    return (k <= q) & (q // (2 + b) == k // (2 + b))


def bidirectional(b, n, q, k):
    return (q - k <= 2) & (k - q <= 1)


def prefix_lm(b, n, q, k):
    return (k <= q) | (k < 4)


def padded(b, n, q, k):
    """Row b has 40 - 5 b real tokens: keys past them are padding (elementwise: the
    lengths are positions, not read from the grid's shape)."""
    return (k <= q) & (k < 40 - 5 * b)


@functools.cache
def self_layer(**options):
    """nanoattn's causal self-attention in evaluation mode, ``fn(x, **call kwargs)``
    (built outside any trace: cached parameters must be arrays, not tracers)."""
    layer = CausalSelfAttention(AttentionConfig(options.pop("d_model", D), N, **options))
    params = layer.init(jax.random.key(0), jnp.ones((1, 2, layer.config.d_model)), True)
    return lambda x, **kwargs: layer.apply(params, x, True, **kwargs)


@functools.cache
def cross_layer():
    """nanoattn's cross-attention over x itself: ``fn(x, allowed (T, T))``."""
    layer = CrossAttention(AttentionConfig(D, N))
    params = layer.init(jax.random.key(0), jnp.ones((1, 2, D)), jnp.ones((1, 2, D)), True)
    return lambda x, allowed: layer.apply(params, x, x, True, context_mask=allowed[None, None])


def with_documents():
    attend = self_layer()

    def fn(x):
        ids = jnp.arange(x.shape[1])[None] // (2 + jnp.arange(x.shape[0]))[:, None]  # (B, T)
        return attend(x, segment_ids=ids)

    return fn


def with_padding():
    attend = self_layer()

    def fn(x):
        B, T = x.shape[:2]
        valid = jnp.arange(T)[None] < (40 - 5 * jnp.arange(B))[:, None]
        return attend(x, mask=padding_mask(valid))

    return fn


def prefix_lm_layer():
    attend = cross_layer()

    def fn(x):
        t = jnp.arange(x.shape[1])
        return attend(x, (t[None] <= t[:, None]) | (t[None] < 4))

    return fn


def bidirectional_layer():
    attend = cross_layer()
    return lambda x: attend(x, window_mask(x.shape[1], x.shape[1], window=(2, 1)))


LAYERS = {  # name: (a factory of fn, the mask fn realises)
    "causal": (self_layer, causal),
    "causal window": (lambda: self_layer(window=(W, 0)), causal_window(W)),
    "grouped heads, RoPE, window, soft-cap, QK norm": (
        lambda: self_layer(d_model=16, **EVERYTHING),
        causal_window(EVERYTHING["window"][0]),
    ),
    "bidirectional window": (bidirectional_layer, bidirectional),
    "documents": (with_documents, documents),
    "padding": (with_padding, padded),
    "prefix-LM": (prefix_lm_layer, prefix_lm),
}


def layer(name):
    return LAYERS[name][0]()


def statuses(report) -> dict[str, str]:
    return {check.name: check.status for check in report.checks}


FAST_LAYERS = ("causal", "documents")  # the others with the slow cases, `make test-all`


@pytest.mark.parametrize(
    "name", [n if n in FAST_LAYERS else pytest.param(n, marks=pytest.mark.slow) for n in LAYERS]
)
def test_passes_on_each_mask_the_layers_realise(name):
    fn, mask_fn = layer(name), LAYERS[name][1]
    d_model = 16 if name.startswith("grouped") else D
    report = check_mask(fn, mask_fn, d_model=d_model, seq_lens=AT)
    assert report.passed, report
    assert report.title == "mask" and len(report.checks) == 4
    assert not any(check.skipped for check in report.checks)
    assert report.checks[0].detail.startswith(
        "by gradients at lengths 9 under jit, by perturbation at lengths 9 eagerly: "
    )


def test_a_window_claimed_one_wider_fails_inside_the_mask():
    report = check_mask(layer("causal window"), causal_window(W + 1), d_model=D, seq_lens=AT)
    assert statuses(report) == {
        "outside the mask": "PASS",
        "inside the mask": "FAIL",
        "other rows": "PASS",
        "positive control": "PASS",
    }
    inside = by_name(report)["inside the mask"]
    assert inside.detail == (
        "first missing: output 4 of row 0 does not depend on input 0, which mask_fn lets it "
        "see (T=9, jit): mask_fn claims more than fn sees; 20 of 140 visible pairs have no "
        "effect"
    )
    assert inside.where == {"length": 9, "mode": "jit", "batch": 0, "output": 4, "input": 0}
    assert inside.worst == 0 and inside.data["failed"] == 20


def test_a_window_claimed_one_narrower_fails_outside_the_mask():
    report = check_mask(layer("causal window"), causal_window(W - 1), d_model=D, seq_lens=AT)
    assert statuses(report)["outside the mask"] == "FAIL"
    assert [s for s in statuses(report).values()].count("FAIL") == 1
    outside = by_name(report)["outside the mask"]
    assert outside.detail.startswith(
        "first leak: output 3 of row 0 depends on input 0, which mask_fn hides from it (gradient "
    )
    assert outside.detail.endswith(", T=9, jit); 24 of 228 hidden pairs leak")
    first = outside.data["first"]
    assert (first["output"], first["input"], first["batch"]) == (3, 0, 0)
    assert first["deviation"] > 0.01 and outside.worst >= first["deviation"]


def test_a_layer_that_ignores_the_documents_leaks_across_them():
    report = check_mask(layer("causal"), documents, d_model=D, seq_lens=AT)
    assert statuses(report)["outside the mask"] == "FAIL"
    assert statuses(report)["inside the mask"] == "PASS"
    first = by_name(report)["outside the mask"].data["first"]
    assert (first["length"], first["batch"], first["output"], first["input"]) == (9, 0, 2, 0)


def test_a_mask_that_claims_more_than_the_layer_sees_fails():
    everything = lambda b, n, q, k: q >= 0  # noqa: E731  (bidirectional, on a causal layer)
    report = check_mask(layer("causal"), everything, d_model=D, seq_lens=AT)
    assert statuses(report) == {
        "outside the mask": "PASS",
        "inside the mask": "FAIL",
        "other rows": "PASS",
        "positive control": "PASS",
    }
    assert by_name(report)["inside the mask"].detail.startswith(
        "first missing: output 0 of row 0 does not depend on input 1, which mask_fn lets it see"
    )


def heads(x, per_head):
    """Plain attention of x over itself, 2 heads, head n under the mask ``per_head``."""
    B, T, _ = x.shape
    t = jnp.arange(T)
    allowed = per_head(
        0, jnp.arange(N)[:, None, None], t[None, :, None], t[None, None]
    )  # (N, T, S)
    q = x.reshape(B, T, N, D // N)  # (B, T, N, H)
    return dot_product_attention(q, q, q, mask=allowed).reshape(B, T, D)


def near_and_far(b, n, q, k):
    """Head 0 sees the token before; head 1 the whole past."""
    return (k <= q) & ((n == 1) | (q - k <= 1))


def test_n_heads_asks_mask_fn_about_every_head():
    fn = functools.partial(heads, per_head=near_and_far)
    assert check_mask(fn, near_and_far, d_model=D, n_heads=2, seq_lens=AT).passed
    report = check_mask(fn, near_and_far, d_model=D, seq_lens=AT)  # head 0 only
    first = by_name(report)["outside the mask"].data["first"]
    assert (first["output"], first["input"]) == (2, 0)


def strict_past(b, n, q, k):
    return k < q


def test_a_row_with_one_key_needs_no_query_and_a_row_with_none_depends_on_nothing():
    # Row 0 sees no key: nanoattn gives it zeros. Row 1 sees only key 0: its weight is 1
    # whatever its query, so it does not depend on input 1. From row 2 on, the query counts.
    fn = functools.partial(heads, per_head=strict_past)
    report = check_mask(fn, strict_past, d_model=D, seq_lens=AT)
    assert report.passed, report


def test_a_row_that_sees_nothing_must_not_read_its_own_input():
    # jax.nn returns the mean of the values for a row that sees no key: output 0
    # depends on every input, its own included.
    def jax_nn(x):
        B, T, _ = x.shape
        q = x.reshape(B, T, N, D // N)
        t = jnp.arange(T)
        return jax.nn.dot_product_attention(q, q, q, mask=t[None] < t[:, None]).reshape(B, T, D)

    first = by_name(check_mask(jax_nn, strict_past, d_model=D, seq_lens=AT))["outside the mask"]
    assert (first.data["first"]["output"], first.data["first"]["input"]) == (0, 0)

    def own_input_when_blind(x):  # row 0 returns its own input instead of zeros
        return heads(x, strict_past).at[:, 0].set(x[:, 0])

    report = check_mask(own_input_when_blind, strict_past, d_model=D, seq_lens=AT)
    assert by_name(report)["outside the mask"].detail.startswith(
        "first leak: output 0 of row 0 depends on input 0, which mask_fn hides from it"
    )


def window_heads(x):
    return heads(x, causal_window(W))


def test_a_row_reading_another_row_fails_other_rows():
    fn = window_heads

    def second_row_reads_the_first(x):
        y = fn(x)
        return y.at[1].add(1e-3 * y[0])

    report = check_mask(second_row_reads_the_first, causal_window(W), d_model=D, seq_lens=AT)
    assert [s for s in statuses(report).values()].count("FAIL") == 1
    rows = by_name(report)["other rows"]
    assert rows.detail.startswith("first leak: output 0 of row 1 depends on other batch rows")
    assert rows.detail.endswith("; 18 of 36 outputs depend on other rows")
    assert rows.worst > 0 and rows.data["first"]["batch"] == 1


def test_the_positive_control_fails_a_vanishing_layer():
    report = check_mask(lambda x: 1e-9 * window_heads(x), causal_window(W), d_model=D, seq_lens=AT)
    assert statuses(report) == {
        "outside the mask": "PASS",
        "inside the mask": "PASS",  # non-zero, just small
        "other rows": "PASS",
        "positive control": "FAIL",
    }
    assert by_name(report)["positive control"].detail.startswith("insensitive: ")
    blind = lambda b, n, q, k: q < 0  # noqa: E731  (no output sees any key)
    report = check_mask(lambda x: 0 * x, blind, d_model=D, batch=1, seq_lens=(2,))
    assert report.passed and [check.skipped for check in report.checks] == [
        False,  # nothing hidden is read
        True,  # nothing is visible
        True,  # batch=1 has no other row
        True,  # no output to move
    ]


def test_a_leak_only_outside_jit_fails_in_the_eager_run():
    def fn(x):  # causal when traced, sees everything when run op by op
        T = x.shape[1]
        traced = isinstance(x, jax.core.Tracer)
        return self_attention(
            x, np.tril(np.ones((T, T), bool)) if traced else np.ones((T, T), bool)
        )

    report = check_mask(fn, causal, d_model=D, seq_lens=AT)
    assert statuses(report)["outside the mask"] == "FAIL"
    assert by_name(report)["outside the mask"].data["first"]["mode"] == "eager"


EMBED = jnp.asarray(np.random.default_rng(0).standard_normal((7, D)), jnp.float32)


def test_token_ids_by_perturbation():
    model = lambda ids: window_heads(EMBED[ids])  # noqa: E731
    report = check_mask(model, causal_window(W), vocab=7, seq_lens=AT)
    assert report.passed, report
    assert "by perturbation (token ids have no gradient) at lengths 9 under jit and 9 eagerly" in (
        report.checks[0].detail
    )
    report = check_mask(model, causal_window(W - 1), vocab=7, seq_lens=AT)
    assert by_name(report)["outside the mask"].detail.startswith(
        "first leak: output 3 of row 0 depends on input 0, which mask_fn hides from it (change "
    )
    report = check_mask(model, causal_window(W + 1), vocab=7, seq_lens=AT)
    assert statuses(report)["inside the mask"] == "FAIL"


def test_a_numpy_function_by_perturbation():
    def window_sum(x):  # numpy: output t sums inputs t - 2 .. t
        x = np.asarray(x)
        return sum(np.pad(x, ((0, 0), (i, 0), (0, 0)))[:, : x.shape[1]] for i in range(3))

    report = check_mask(window_sum, causal_window(2), d_model=3, seq_lens=(1, 5, 70))
    assert report.passed, report
    assert report.checks[0].detail.startswith("by perturbation (jax cannot trace fn (")
    report = check_mask(window_sum, causal_window(1), d_model=3, seq_lens=(70,))
    first = by_name(report)["outside the mask"].data["first"]
    assert (first["output"], first["input"]) == (2, 0)  # past 64, position 0 is still probed


def test_a_length_where_fn_raises_fails_and_the_others_run():
    seen = []
    fn = nanogpt_like(seen)  # causal, raises past 20 tokens
    report = check_mask(fn, causal, d_model=D, seq_lens=(9, 33))
    assert [check.status for check in report.checks] == ["FAIL", "PASS", "PASS", "PASS", "PASS"]
    assert report.checks[0].name == "fn runs" and report.checks[0].where["length"] == 33
    seen.clear()
    assert check_mask(fn, causal, d_model=D, seq_lens=(9, 33), max_len=20).passed
    assert max(seen) == 9


def never_called(x):
    raise AssertionError("fn must not be called")


@pytest.mark.parametrize(
    "mask_fn, kwargs, error, message",
    [
        (lambda b, n, q, k: (k <= q).astype(int), {}, TypeError, "mask_fn must return booleans"),
        (
            lambda b, n, q, k: jnp.ones((3,), bool),
            {},
            ValueError,
            "must broadcast to (B, N, T, S) = (2, 1, 4, 4), got shape (3,)",
        ),
        ("causal", {}, TypeError, "mask_fn must be callable"),
        (causal, {"n_heads": 0}, ValueError, "n_heads must be an int >= 1, got n_heads=0"),
        (causal, {"seq_lens": (8,), "max_len": 4}, ValueError, "exceeds max_len=4"),
    ],
)
def test_bad_arguments_raise_in_one_line_before_fn_runs(mask_fn, kwargs, error, message):
    with pytest.raises(error) as caught:
        check_mask(never_called, mask_fn, d_model=D, **({"seq_lens": (4,)} | kwargs))
    assert message in str(caught.value) and "\n" not in str(caught.value)
