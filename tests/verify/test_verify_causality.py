"""nanoattn.verify.check_causality (verify/_causality.py, and the leak bookkeeping of
verify/_leaks.py): flax's attention with and without its mask, our modules, planted
leaks of every kind (one head, one length, one mode, one batch row, a thousandth),
token-id models, and the report's details."""

import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from nanoattn import dot_product_attention, padding_mask
from nanoattn.linen import AttentionConfig, CausalSelfAttention, CrossAttention
from nanoattn.verify import check_causality, check_padding
from nanoattn.verify._causality import DEFAULT_SEQ_LENS, changed_positions, split_points

from _verify_functions import EMBED, D, V, by_name, causal_sum

LENS = (1, 2, 5, 17)


def heads_attention(mask_for_length):
    """A tiny attention over x itself, 2 heads, with a (T, T) mask from a function."""

    def fn(x):
        B, T, _ = x.shape
        q = x.reshape(B, T, 2, D // 2)  # (B, T, N, H)
        return dot_product_attention(q, q, q, mask=mask_for_length(T)).reshape(B, T, D)

    return fn


def flax_attention(with_mask: bool):
    mha = nn.MultiHeadDotProductAttention(num_heads=2, qkv_features=D)
    params = mha.init(jax.random.key(0), jnp.ones((1, 3, D)))

    def fn(x):
        mask = nn.make_causal_mask(x[..., 0]) if with_mask else None
        return mha.apply(params, x, mask=mask)

    return jax.jit(fn)


def test_flax_attention_with_causal_mask_passes():
    report = check_causality(flax_attention(with_mask=True), d_model=D, seq_lens=LENS)
    assert report.passed, report
    assert set(by_name(report)) == {
        "prefix invariance",
        "future perturbation",
        "positive control",
        "receptive field",
    }
    assert not by_name(report)["receptive field"].skipped


def test_flax_attention_without_mask_fails_and_names_the_first_leak():
    report = check_causality(flax_attention(with_mask=False), d_model=D, seq_lens=LENS)
    assert not report.passed
    prefix = by_name(report)["prefix invariance"]
    assert not prefix.passed
    assert prefix.detail.startswith("first leak: output 0 of row ")
    assert prefix.detail.endswith("when only positions >= 1 changed (T=2, jit)")
    assert set(prefix.where) == {"length", "mode", "split", "position", "batch", "feature"}
    assert prefix.worst > 0.1
    first = prefix.data["first"]
    assert (first["length"], first["split"], first["position"]) == (2, 1, 0)
    field = by_name(report)["receptive field"]
    assert not field.passed
    assert field.detail.startswith("first leak: output 0 of row 0 has gradient")
    assert field.detail.endswith("from the later input 1 (T=2)")
    assert "first leak" in str(report)


@pytest.mark.slow
def test_our_modules_pass():
    layer = CausalSelfAttention(AttentionConfig(D, 2))
    params = layer.init(jax.random.key(0), jnp.ones((1, 2, D)), deterministic=True)
    causal = jax.jit(lambda x: layer.apply(params, x, deterministic=True))
    check_causality(causal, d_model=D).raise_if_failed()  # the default lengths, up to 64
    padded = jax.jit(lambda x, v: layer.apply(params, x, deterministic=True, mask=padding_mask(v)))
    check_padding(padded, d_model=D).raise_if_failed()
    cross = CrossAttention(AttentionConfig(D, 2))
    cparams = cross.init(
        jax.random.key(0), jnp.ones((1, 2, D)), jnp.ones((1, 3, D)), deterministic=True
    )
    cross_fn = jax.jit(lambda x, v: cross.apply(cparams, x, x, deterministic=True, context_mask=v))
    check_padding(cross_fn, d_model=D, lengths=[4, 9], batch=2).raise_if_failed()


MAX = 64


TRIANGLE = np.tril(np.ones((MAX, MAX), bool))


@pytest.mark.slow
def test_mask_sliced_wrongly_from_a_precomputed_maximum_is_caught():
    # Right only at T = MAX: rows taken from the bottom of the triangle see the future.
    buggy = heads_attention(lambda T: TRIANGLE[MAX - T :, :T])
    assert check_causality(buggy, d_model=D, seq_lens=(MAX,)).passed  # fine at one length
    report = check_causality(buggy, d_model=D, seq_lens=(1, 2, 5, MAX))
    assert not report.passed
    assert by_name(report)["prefix invariance"].detail.endswith("(T=2, jit)")


def test_mask_sliced_too_tight_is_caught_by_the_receptive_field():
    # Sliced from the right: rows see too little (nothing at all for early rows).
    buggy = heads_attention(lambda T: TRIANGLE[:T, MAX - T :])
    report = check_causality(buggy, d_model=D, seq_lens=(2, 5))
    field = by_name(report)["receptive field"]
    assert not field.passed and "no gradient from any visible input" in field.detail


@pytest.mark.parametrize("k", [0, 40, 62])
def test_single_off_by_one_leak_in_64_tokens_is_caught(k):
    def mask(T):
        m = np.tril(np.ones((T, T), bool))
        if k + 1 < T:
            m[k, k + 1] = True  # position k sees position k + 1
        return m

    report = check_causality(heads_attention(mask), d_model=D, seq_lens=(64,))
    assert not report.passed
    single = by_name(report)["future perturbation"]
    first = single.data["first"]
    assert first.pop("deviation") == single.worst and first == single.where  # the only leak
    assert {key: single.where[key] for key in ("length", "mode", "changed", "position")} == {
        "length": 64,
        "mode": "jit",
        "changed": k + 1,
        "position": k,
    }
    field = by_name(report)["receptive field"]
    assert field.where | {"batch": 0} == {"length": 64, "batch": 0, "output": k, "input": k + 1}


def test_leak_caught_without_jax_gradients():
    # A numpy function: the receptive field is skipped, the perturbation sweep still finds it.
    def numpy_leak(x):
        x = np.asarray(x)
        y = np.cumsum(x, axis=1)
        y[:, 40] += x[:, 41]
        return y

    report = check_causality(numpy_leak, d_model=D, seq_lens=(64,))
    assert by_name(report)["receptive field"].skipped
    assert by_name(report)["future perturbation"].where["position"] == 40
    assert not report.passed


def test_constant_function_is_insensitive():
    report = check_causality(lambda x: jnp.zeros_like(x), d_model=D, seq_lens=LENS)
    control = by_name(report)["positive control"]
    assert not report.passed and not control.passed
    assert control.detail.startswith("insensitive")
    # The leak checks alone would have passed: the control is what fails it.
    assert by_name(report)["prefix invariance"].passed


def test_position_wise_function_is_insensitive():
    report = check_causality(lambda x: 2 * x, d_model=D, seq_lens=LENS)
    assert not by_name(report)["positive control"].passed


def test_gradient_across_batch_rows_is_caught():
    # Causal in time, but every row also reads the other rows' prefixes.
    def mixes_batch(x):
        return jnp.cumsum(x, axis=1) + jnp.cumsum(x[::-1], axis=1)

    report = check_causality(mixes_batch, d_model=4, seq_lens=(3,))
    field = by_name(report)["receptive field"]
    assert by_name(report)["prefix invariance"].passed
    assert not field.passed and "from other batch rows (T=3)" in field.detail
    # The sentence and the worst give the leak's size.
    assert re.search(
        r"output \d of row \d has gradient [0-9.]+ from other batch rows", field.detail
    )
    assert f"{field.worst:.3g}" == re.search(r"has gradient ([0-9.]+) from", field.detail)[1]


# The bug classes the default sweep must catch: one head of many, one length past a
# block size, one mode (jit or eager), one batch row; and the pinned leak tolerance.


def prefix_mean(x):
    """A causal numpy function: the mean of the tokens so far, scale about 1."""
    x = np.asarray(x, np.float64)
    return np.cumsum(x, 1) / np.arange(1, x.shape[1] + 1)[:, None]


def test_a_leak_in_one_head_of_many_counts_at_its_full_size():
    # Six heads of width 3; head 4 (features 12..14) sees the next token a little. A numpy
    # function: no jit, no gradient, only the feature-by-feature comparison can see it.
    def one_head_leaks(x):
        y = prefix_mean(x)
        y[:, :-1, 12:15] += 1.5e-5 * np.asarray(x)[:, 1:, 12:15]
        return y

    report = check_causality(one_head_leaks, d_model=18, seq_lens=(2, 5))
    single = by_name(report)["future perturbation"]
    assert not single.passed and 12 <= single.data["first"]["feature"] < 15
    # Averaged over the 18 features, even three features at the worst would pass 1e-5.
    assert single.worst * 3 / 18 < 1e-5 < single.worst


def test_a_leak_past_128_tokens_is_caught_at_bounded_cost():
    def blockwise(T):  # past one tile of 128, the last query of a 32-key block sees the next
        m = np.tril(np.ones((T, T), bool))
        if T > 128:
            m[31, 32] = True
        return m

    buggy = heads_attention(blockwise)
    assert {129, 257, 513} <= set(DEFAULT_SEQ_LENS)
    report = check_causality(buggy, d_model=D, seq_lens=(64, 129))
    first = by_name(report)["future perturbation"].data["first"]  # none at 64, the old longest
    assert (first["length"], first["changed"], first["position"]) == (129, 32, 31)
    prefix = by_name(report)["prefix invariance"].data["first"]  # split at a block's first key
    assert (prefix["length"], prefix["split"], prefix["position"]) == (129, 32, 31)
    for T in (129, 257, 513, 4097):  # calls per length grow with log2(T), not T
        assert len(changed_positions(T)) <= 3 * np.log2(T) and len(split_points(T)) <= np.log2(T)


def next_token_sum(x):  # position t also sees t + 1
    return jnp.cumsum(x, axis=1) + jnp.roll(x, -1, axis=1)


def test_a_leak_only_under_jit_is_caught():
    def leaks_when_traced(x):
        return (next_token_sum if isinstance(x, jax.core.Tracer) else causal_sum)(x)

    report = check_causality(leaks_when_traced, d_model=4, seq_lens=(5,))
    prefix = by_name(report)["prefix invariance"]
    assert not prefix.passed and prefix.data["first"]["mode"] == "jit"


def test_a_leak_only_outside_jit_is_caught_even_in_a_jitted_function():
    @jax.jit
    def leaks_when_eager(x):  # as a function with a numpy fallback for concrete inputs
        return (causal_sum if isinstance(x, jax.core.Tracer) else next_token_sum)(x)

    report = check_causality(leaks_when_eager, d_model=4, seq_lens=(2, 5))
    prefix = by_name(report)["prefix invariance"]
    assert not prefix.passed
    assert prefix.detail.endswith("(T=5, eager)") and prefix.data["first"]["mode"] == "eager"
    assert by_name(report)["receptive field"].passed  # traced, it is causal


def test_a_leak_in_the_second_batch_row_only_is_caught_exactly():
    def row_1_leaks(x):  # row 1 sees its next token, by far less than the tolerance
        return jnp.cumsum(x, axis=1) + 1e-7 * jnp.zeros_like(x).at[1, :-1].set(x[1, 1:])

    report = check_causality(row_1_leaks, d_model=4, seq_lens=(3,))
    assert by_name(report)["prefix invariance"].passed  # too small to change an output
    field = by_name(report)["receptive field"]
    assert not field.passed and field.where["batch"] == 1
    assert field.detail.startswith("first leak: output 0 of row 1 has gradient")


def test_a_leak_of_a_thousandth_of_the_output_is_caught():
    # Pins the leak tolerance: loosened a thousandfold (to 1e-2) it would pass this.
    def leaks_a_thousandth(x):
        y = prefix_mean(x)
        y[:, :-1] += 1e-3 * np.asarray(x)[:, 1:]
        return y

    report = check_causality(leaks_a_thousandth, d_model=D, seq_lens=(2, 9))
    assert by_name(report)["receptive field"].skipped  # numpy: no gradient
    single = by_name(report)["future perturbation"]
    assert not single.passed and single.worst < 1e-2
    assert single.data["first"]["deviation"] > 1e-5


# Token ids: a model from ids (B, T) in [0, V) to outputs, checked without embeddings.


def token_model(mask_for_length):
    attend = heads_attention(mask_for_length)
    return lambda ids: attend(EMBED[ids])


def test_token_id_model_passes_with_an_exact_receptive_field():
    causal = token_model(lambda T: np.tril(np.ones((T, T), bool)))
    report = check_causality(causal, vocab=V, seq_lens=(1, 2, 5))
    assert report.passed, report
    field = by_name(report)["receptive field"]
    assert field.detail.startswith("token ids have no gradient, so exactly, by perturbation")


def test_token_id_model_leaks_are_caught():
    def mask(T):
        m = np.tril(np.ones((T, T), bool))
        m[2, 3] = True
        return m

    report = check_causality(token_model(mask), vocab=V, seq_lens=(5,))
    single, field = by_name(report)["future perturbation"], by_name(report)["receptive field"]
    assert single.data["first"]["changed"] == 3 and single.data["first"]["position"] == 2
    assert not field.passed and field.data["first"]["position"] == 2


def test_token_id_model_mixing_rows_or_ignoring_its_input_fails_the_receptive_field():
    def mixes_rows(ids):
        return jnp.cumsum(EMBED[ids], 1) + jnp.cumsum(EMBED[ids[::-1]], 1)

    field = by_name(check_causality(mixes_rows, vocab=V, seq_lens=(3,)))["receptive field"]
    assert not field.passed and "when only the other rows changed (T=3)" in field.detail

    def forgets_position_1(ids):
        return jnp.cumsum(EMBED[ids], 1).at[:, 1].set(0.0)

    field = by_name(check_causality(forgets_position_1, vocab=V, seq_lens=(3,)))["receptive field"]
    assert (
        not field.passed
        and "unchanged when every token changed for output 1 of row 0" in field.detail
    )


# Details a mutation audit found unpinned: report text, boundaries, non-finite outputs


def test_causality_nan_output_is_an_infinite_leak():
    def nan_first(x):
        return jnp.cumsum(x, axis=1).at[:, 0].set(jnp.nan)

    report = check_causality(nan_first, d_model=D, seq_lens=(5,))
    check = by_name(report)["prefix invariance"]
    assert check.passed is False and check.worst == np.inf
    assert check.data["first"]["position"] == 0


def test_positive_control_must_exceed_its_threshold_strictly():
    from nanoattn.verify._leaks import SENSITIVITY, positive_control

    assert not positive_control(SENSITIVITY * 1e-5, 1e-5, "outputs").passed
    assert positive_control(SENSITIVITY * 1e-5 * 1.01, 1e-5, "outputs").passed
    assert not positive_control(0.0, 0.0, "outputs").passed


def test_long_sequences_are_probed_around_each_power_of_two():
    marks = {31, 32, 33, 63, 64, 65, 127, 128, 129}
    assert changed_positions(200) == sorted({1, 2, 100, 198, 199} | marks)
    assert split_points(200) == [1, 32, 64, 100, 128, 199]


# A second mutation sample of nanoattn/verify (40 per file, seed 2) found these unpinned.


def test_check_details_name_what_was_counted():
    report = by_name(check_causality(causal_sum, d_model=4, seq_lens=(3,)))
    assert report["prefix invariance"].detail.startswith("shared-prefix pairs: ")
    assert report["future perturbation"].detail.startswith("single-token changes: ")
    causal = token_model(lambda T: np.tril(np.ones((T, T), bool)))
    field = by_name(check_causality(causal, vocab=V, seq_lens=(3,)))["receptive field"]
    assert field.detail.endswith("; every output changes when every token does")


# A third sample (60 per file, seed 3), run after the tests above, found these unpinned.


def test_causality_details_exactly():
    report = by_name(check_causality(causal_sum, d_model=4, seq_lens=(3,)))
    assert report["prefix invariance"].detail == (
        "shared-prefix pairs: 2 under jit and 2 eagerly (length 3), tolerance 1e-05"
    )
    assert (
        report["future perturbation"].detail == "single-token changes: 2 under jit, tolerance 1e-05"
    )
    assert report["positive control"].detail.endswith(" (must exceed 0.0001) in each of 2 runs")
    assert report["receptive field"].detail == (
        "gradients of 6 outputs (every batch row): exactly 0 from every later input and "
        "other row, non-zero from earlier inputs"
    )


def test_a_function_jax_cannot_trace_is_noted_once_and_skips_gradients():
    def numpy_prefix_sum(x):
        return np.cumsum(np.asarray(x, np.float64), 1)

    report = by_name(check_causality(numpy_prefix_sum, d_model=4, seq_lens=(3,)))
    assert report["prefix invariance"].detail.startswith(
        "shared-prefix pairs: 2 (fn run as given), tolerance 1e-05; not under jit, jax "
        "cannot trace fn (TracerArrayConversionError: "
    )
    assert report["future perturbation"].detail == (
        "single-token changes: 2 (fn run as given), tolerance 1e-05"
    )
    field = report["receptive field"]
    assert field.skipped and field.detail.startswith(
        "skipped, fn is not differentiable with jax (TracerArrayConversionError: "
    )


def test_a_small_batch_leak_and_a_dead_output_fail_the_receptive_field():
    def mixes_batch_slightly(x):
        return jnp.cumsum(x, axis=1) + 1e-3 * jnp.cumsum(x[::-1], axis=1)

    field = by_name(check_causality(mixes_batch_slightly, d_model=4, seq_lens=(3,)))[
        "receptive field"
    ]
    assert not field.passed and "from other batch rows (T=3)" in field.detail

    def forgets_position_1(x):
        return jnp.cumsum(x, axis=1).at[:, 1].set(0.0)

    field = by_name(check_causality(forgets_position_1, d_model=4, seq_lens=(3,)))[
        "receptive field"
    ]
    assert not field.passed
    assert "no gradient from any visible input for output 1 of row 0 (T=3)" in field.detail


def test_gradient_programs_are_kept_per_function_and_dropped_with_it():
    # The receptive field's differentiated program is made once per fn (and batch,
    # outputs, seed): a second check of the same fn reuses it, another fn of the same
    # shapes gets its own (its leak is still found), and a dropped fn drops its programs.
    import gc
    import weakref

    from nanoattn.verify import _receptive_field

    programs = _receptive_field._PROGRAMS

    def prefix_sum(x):
        return jnp.cumsum(x, axis=1)

    assert check_causality(prefix_sum, d_model=4, seq_lens=(3,)).passed
    (made,) = programs[id(prefix_sum)][1].items()
    assert made[0] == (2, (0, 1, 2), 0)
    assert check_causality(prefix_sum, d_model=4, seq_lens=(3,)).passed
    assert programs[id(prefix_sum)][1] == dict([made])  # the same program, reused
    field = by_name(check_causality(next_token_sum, d_model=4, seq_lens=(3,)))["receptive field"]
    assert not field.passed and "from the later input 1 (T=3)" in field.detail
    key, alive = id(prefix_sum), weakref.ref(prefix_sum)
    del prefix_sum, made
    gc.collect()
    assert alive() is None and key not in programs  # the cache kept it alive nowhere
