"""check_selection: nanoattn's key selection passes on every backend that serves it;
layers that read a key no query selected, or drop one it did, fail the right check."""

import functools

import jax
import jax.numpy as jnp
import pytest

import nanoattn
from nanoattn.verify import check_selection

D, SEQ_LENS = 6, (2, 13)


def _layer(implementation, x, key_indices, *, ignore=False, first_only=False):
    """One head of width D over x as queries, keys (x rotated) and values."""
    h = x[:, :, None]
    if first_only:  # reads only each query's first entry
        key_indices = key_indices[..., :1]
    rules = dict(is_causal=True)
    if not ignore:
        rules["key_indices"] = key_indices
    out = nanoattn.dot_product_attention(h, jnp.roll(h, 1, -1), h, **rules,
                                         implementation=implementation)  # fmt: skip
    return out[:, :, 0]


@pytest.mark.parametrize("implementation", ["xla", "native"])  # flash: tests/core/test_selection.py
def test_nanoattn_reads_exactly_the_selected_keys(implementation):
    layer = functools.partial(_layer, implementation)
    check_selection(layer, d_model=D, seq_lens=SEQ_LENS).raise_if_failed()


@pytest.mark.parametrize(
    ("bug", "status"),
    [
        ("ignore", ["FAIL", "PASS", "PASS", "PASS"]),
        ("first_only", ["PASS", "FAIL", "PASS", "PASS"]),
    ],
)
def test_a_layer_that_reads_other_keys_fails(bug, status):
    layer = functools.partial(_layer, "xla", **{bug: True})
    report = check_selection(layer, d_model=D, seq_lens=SEQ_LENS)
    assert report.title == "selection"
    assert [check.status for check in report.checks] == status, str(report)


def test_a_selection_of_a_non_causal_layer():
    def layer(x, key_indices):
        h = x[:, :, None]
        return nanoattn.dot_product_attention(h, h, h, key_indices=key_indices)[:, :, 0]

    check_selection(layer, d_model=D, causal=False, seq_lens=(7,)).raise_if_failed()
    assert not check_selection(jax.jit(layer), d_model=D, seq_lens=(7,)).passed
