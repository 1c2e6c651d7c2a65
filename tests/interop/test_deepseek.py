"""nanoattn.linen.from_deepseek against transformers' DeepseekV3Attention: fixtures made
by tools/make_deepseek_fixtures.py (small random configurations, float32 and float64
runs of transformers' own code; torch is not a test dependency)."""

import functools
import json

import jax
import numpy as np
import pytest

from nanoattn.linen import LatentAttention, from_deepseek

from _paths import TESTS

FIXTURES = TESTS / "fixtures" / "models"

CASES = ["v3", "v2_lite"]  # a low-rank query with YaRN; one query projection with biases


@functools.cache
def _fixture(case):
    data = np.load(FIXTURES / f"deepseek_{case}.npz")
    config = json.loads(str(data["config"]))
    return config, {k: data[k] for k in data.files if k != "config"}


@pytest.mark.parametrize("case", CASES)
def test_forward_equals_transformers_within_its_own_float32_error(case):
    config, arrays = _fixture(case)
    cfg, params = from_deepseek(config, arrays, 0)
    x = arrays["x"]
    y = np.asarray(jax.jit(LatentAttention(cfg).apply)({"params": params}, x), np.float64)
    truth = arrays["y_f64"]
    theirs = np.abs(arrays["y_f32"] - truth).max()
    assert np.abs(y - truth).max() <= 2 * theirs + 1e-6, (np.abs(y - truth).max(), theirs)


@pytest.mark.parametrize(
    "case",
    # v3's decode is slow; its fast path: v3's forward above and v2_lite's decode here
    [pytest.param("v3", marks=pytest.mark.slow), "v2_lite"],
)
def test_absorbed_decoding_of_the_loaded_layer_equals_transformers(case):
    config, arrays = _fixture(case)
    cfg, params = from_deepseek(config, arrays, 0)
    layer, x = LatentAttention(cfg), arrays["x"]
    cache = layer.init(jax.random.key(0), np.zeros(x.shape, np.float32), decode=True)["cache"]
    outs = []
    for part in (slice(0, 6), slice(6, 7), slice(7, 11)):
        y, state = layer.apply({"params": params, "cache": cache}, x[:, part], decode=True,
                               mutable=["cache"])  # fmt: skip
        cache = state["cache"]
        outs.append(np.asarray(y))
    np.testing.assert_allclose(np.concatenate(outs, 1), arrays["y_f64"], atol=5e-5, rtol=1e-4)


def test_the_configuration_and_the_names():
    config, arrays = _fixture("v3")
    cfg, params = from_deepseek(config, arrays, 0)
    assert (cfg.q_lora_rank, cfg.rope_layout, cfg.rope_scaling.rope_type) == (
        17,
        "interleaved",
        "yarn",
    )
    assert sorted(params) == ["kv_a", "kv_a_norm", "kv_b", "out", "q_a", "q_a_norm", "q_b"]
    lite, params = from_deepseek(*_fixture("v2_lite"), 0)
    assert lite.q_lora_rank is None and lite.rope_layout == "half" and "bias" in params["kv_a"]
    broken = {k: v for k, v in arrays.items() if "kv_b_proj" not in k}
    with pytest.raises(ValueError, match=r"has no model\.layers\.0\.self_attn\.kv_b_proj"):
        from_deepseek(config, broken, 0)
    with pytest.raises(ValueError, match="config has no 'kv_lora_rank'"):
        from_deepseek({k: v for k, v in config.items() if k != "kv_lora_rank"}, arrays, 0)
