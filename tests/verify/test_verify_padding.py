"""nanoattn.verify.check_padding (verify/_padding.py): a function that ignores its mask
fails, in the layout that exposes it; the positive control; token ids; the report
exactly; huge and non-finite padded content; reproducibility from the seed."""

import jax
import jax.numpy as jnp
import numpy as np

from nanoattn.linen import AttentionConfig, CausalSelfAttention
from nanoattn.verify import check_padding

from _verify_functions import EMBED, D, V, by_name, causal_sum_valid


def test_padding_function_that_ignores_its_mask_fails():
    layer = CausalSelfAttention(AttentionConfig(D, 2))
    params = layer.init(jax.random.key(0), jnp.ones((1, 2, D)), deterministic=True)
    ignores = jax.jit(lambda x, v: layer.apply(params, x, deterministic=True))
    report = check_padding(ignores, d_model=D)
    checks = by_name(report)
    # Causal attention never sees right padding, so only the left layout exposes it.
    assert checks["padded content is ignored (right padding)"].passed
    left = checks["padded content is ignored (left padding)"]
    assert not left.passed and not report.passed
    assert "changed by" in left.detail and left.where["batch"] == 1
    # A non-causal function that ignores the mask fails both layouts.
    mean = check_padding(
        lambda x, v: jnp.broadcast_to(x.mean(1, keepdims=True), x.shape), d_model=D
    )
    assert not by_name(mean)["padded content is ignored (right padding)"].passed


def test_padding_constant_function_is_insensitive():
    report = check_padding(lambda x, v: jnp.zeros_like(x), d_model=D)
    assert not by_name(report)["positive control"].passed


# Token ids: a model from ids (B, T) in [0, V) to outputs, checked without embeddings.


def test_padding_on_token_ids():
    def masked_mean(ids, valid):
        w = valid[:, :, None]
        mean = (EMBED[ids] * w).sum(1, keepdims=True) / w.sum(1, keepdims=True)
        return jnp.broadcast_to(mean, (*ids.shape, D))

    assert check_padding(masked_mean, vocab=V).passed

    def ignores_valid(ids, valid):
        return jnp.broadcast_to(EMBED[ids].mean(1, keepdims=True), (*ids.shape, D))

    report = check_padding(ignores_valid, vocab=V)
    assert not by_name(report)["padded content is ignored (right padding)"].passed
    assert (
        "other token ids"
        in by_name(check_padding(masked_mean, vocab=V))
        .get("padded content is ignored (left padding)")
        .detail
    )


# Details a mutation audit found unpinned: report text, boundaries, non-finite outputs


def test_padding_report_exactly():
    # x * valid is exact: no rounding in the numbers, so the whole table is pinned.
    report = check_padding(lambda x, valid: x * valid[..., None], d_model=4)
    assert report.to_dict()["title"] == "padding"
    moved = by_name(report)["positive control"].worst
    assert str(report) == "\n".join(
        [
            "padding: PASS",
            "  check                                      result  worst  where  detail",
            *[
                f"  {f'padded content is ignored ({side} padding)':<41}  PASS    0             "
                "content at 3 padded positions set to +-1e+06, 15 valid outputs compared, "
                "tolerance 1e-05"
                for side in ("right", "left")
            ],
            f"  positive control                           PASS    {moved:.3g}          "
            f"changing the first token moved valid outputs by at least {moved:.3g} (must "
            "exceed 0.0001)",
        ]
    )
    right = by_name(report)["padded content is ignored (right padding)"]
    assert right.where is None and right.worst == 0.0


def test_padding_failure_names_the_row_and_its_huge_content():
    def sums_everything(x, valid):
        return jnp.broadcast_to((x * x).sum(1, keepdims=True), x.shape)

    check = by_name(check_padding(sums_everything, d_model=4))[
        "padded content is ignored (right padding)"
    ]
    assert check.where == {"batch": 1, "position": 0}
    assert check.detail == (
        f"output at valid position 0 of batch row 1 changed by {check.worst:.3g} when only "
        "padded content changed"
    )


def test_padding_non_finite_output_is_an_infinite_change():
    # +-1e30 overflows x * x: the output turns NaN, which must fail as an inf change.
    def nan_when_padding_is_huge(x, valid):
        return x + 0 * (x * x).sum(1, keepdims=True)

    report = check_padding(nan_when_padding_is_huge, d_model=4, huge=1e30)
    check = by_name(report)["padded content is ignored (right padding)"]
    assert not check.passed and check.worst == np.inf
    assert (
        "set to +-1e+30"
        in by_name(check_padding(causal_sum_valid, d_model=4, huge=1e30))[
            "padded content is ignored (right padding)"
        ].detail
    )


def test_padding_positive_control_failure_names_the_valid_outputs():
    control = by_name(check_padding(lambda x, v: jnp.zeros_like(x), d_model=4))["positive control"]
    assert control.detail.startswith(
        "insensitive: changing the first token moved valid outputs by only 0 "
    )


# A second mutation sample of nanoattn/verify (40 per file, seed 2) found these unpinned.


def test_padding_is_reproducible_from_its_seed():
    def sums_everything(x, valid):
        return jnp.broadcast_to((x * x).sum(1, keepdims=True), x.shape)

    runs = [check_padding(sums_everything, d_model=4, seed=s).to_dict() for s in (3, 3, 4)]
    assert runs[0] == runs[1] and runs[0] != runs[2]


# A third sample (60 per file, seed 3), run after the tests above, found these unpinned.


def test_padding_positive_control_reads_only_valid_outputs_and_their_change():
    def only_padded_outputs_move(x, valid):
        return jnp.cumsum(x, axis=1) * (1 - valid[..., None])

    def constant(x, valid):
        return jnp.ones_like(x)

    for fn in (only_padded_outputs_move, constant):
        control = by_name(check_padding(fn, d_model=4))["positive control"]
        assert not control.passed and control.worst == 0.0, fn.__name__
