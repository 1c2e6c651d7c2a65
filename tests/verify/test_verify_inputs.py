"""The inputs of the verify checks (verify/_inputs.py): d_model for floats or vocab for
token ids, sizes that must be ints, the smallest valid arguments, random inputs that
cover the vocabulary and keep their dtypes, and outputs of the wrong shape."""

import re

import jax.numpy as jnp
import numpy as np
import pytest

from nanoattn.verify import check_causality, check_padding

from _verify_functions import causal_sum, causal_sum_valid


def test_argument_errors():
    with pytest.raises(ValueError, match="seq_lens must be non-empty"):
        check_causality(lambda x: x, d_model=4, seq_lens=())
    with pytest.raises(ValueError, match=r"lengths must have shape \(B,\) = \(2,\)"):
        check_padding(lambda x, v: x, d_model=4, lengths=[3])
    with pytest.raises(ValueError, match=r"fn must map an input of shape \(B, T, D\)"):
        check_causality(lambda x: x[:, :1], d_model=4, seq_lens=(3,))


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(d_model=4, vocab=5), "pass d_model for float inputs (B, T, D) or vocab"),
        (dict(), "exactly one of them; got d_model=None, vocab=None"),
        (dict(vocab=1), "vocab must be an int >= 2, got vocab=1"),
        (dict(d_model=0), "d_model must be an int >= 1, got d_model=0"),
        (dict(d_model=4, batch=0), "batch must be an int >= 1, got batch=0"),
    ],
)
def test_input_kind_errors(kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        check_causality(lambda x: x, **kwargs)


# Details a mutation audit found unpinned: report text, boundaries, non-finite outputs


def test_smallest_valid_arguments_are_accepted():
    # vocab 2, batch 1, one feature: the bounds of the argument checks are inclusive.
    def causal_ids(ids):
        return jnp.cumsum(ids, axis=1).astype(jnp.float32)[..., None]

    assert check_causality(causal_ids, vocab=2, seq_lens=(3,), batch=1).passed
    assert check_causality(causal_sum, d_model=1, seq_lens=(3,), batch=1).passed
    assert check_padding(causal_sum_valid, d_model=1, batch=1).passed


def test_token_output_of_the_wrong_length_names_both_shapes():
    message = "fn must map an input of shape (B, T) = (2, 3) to (B, T, ...), got (2, 1)"
    with pytest.raises(ValueError, match=re.escape(message) + "$"):
        check_causality(lambda ids: ids[:, :1], vocab=5, seq_lens=(3,))


# A second mutation sample of nanoattn/verify (40 per file, seed 2) found these unpinned.


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(d_model=4.0), "d_model must be an int >= 1, got d_model=4.0"),
        (dict(d_model=True), "d_model must be an int >= 1, got d_model=True"),
        (dict(vocab=5.0), "vocab must be an int >= 2, got vocab=5.0"),
    ],
)
def test_sizes_must_be_ints_not_floats_or_bools(kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message) + "$"):
        check_causality(lambda x: x, **kwargs)


@pytest.mark.parametrize("batch", [2.0, True])
def test_padding_batch_must_be_an_int(batch):
    message = f"batch must be an int >= 1, got batch={batch!r}"
    with pytest.raises(ValueError, match=re.escape(message) + "$"):
        check_padding(causal_sum_valid, d_model=4, batch=batch)


def test_inputs_cover_the_vocabulary_and_keep_their_dtypes():
    from nanoattn.verify._inputs import Inputs, as_features

    rng = np.random.default_rng(0)
    ids = Inputs.of(None, 2).random(rng, 4, 64)
    assert ids.dtype == np.int32 and set(np.unique(ids)) == {0, 1}
    tokens = Inputs.of(None, 1000)
    x = tokens.random(rng, 4, 64)
    other = tokens.changed(rng, x)
    assert other.dtype == np.int32 and (other != x).all()
    assert len(np.unique((other - x) % 1000)) > 100  # each token moved independently
    floats = Inputs.of(3, None)
    assert floats.random(rng, 2, 5).dtype == np.float32
    assert floats.changed(rng, np.zeros((2, 5, 3), np.float32)).dtype == np.float32
    features = as_features(np.ones((2, 5, 3, 4), np.float32), (2, 5, 7))
    assert features.dtype == np.float64 and features.shape == (2, 5, 12)


# A third sample (60 per file, seed 3), run after the tests above, found these unpinned.


def test_the_input_kind_message_whole_and_outputs_of_rank_two():
    from nanoattn.verify._inputs import as_features

    with pytest.raises(ValueError) as error:
        check_causality(causal_sum, d_model=4, vocab=5)
    assert str(error.value) == (
        "pass d_model for float inputs (B, T, D) or vocab for token ids (B, T), exactly one "
        "of them; got d_model=4, vocab=5"
    )
    assert as_features(np.ones((2, 5)), (2, 5, 3)).shape == (2, 5, 1)  # one number per token
