"""``nanoattn audit --latent``: the latent layer's shapes (nanoattn/verify/_latent_audit.py),
printed by the CLI."""

import json

from nanoattn.cli import main


def test_audit_latent_prints_the_layers_shapes_and_its_cache(capsys):
    argv = ["audit", "--latent", "--d-model", "29", "--heads", "3", "--kv-lora-rank", "13",
            "--qk-nope-dim", "7", "--qk-rope-dim", "4", "--v-dim", "5", "--json"]  # fmt: skip
    assert main(argv) == 0
    rows = {row["name"]: row["shape"] for row in json.loads(capsys.readouterr().out)}
    assert rows["params/kv_a/kernel"] == "(29, 17)" and rows["params/kv_b/kernel"] == "(13, 36)"
    assert rows["cache/key"] == "(2, 5, 1, 17)" and rows["cache/value"] == "(2, 5, 1, 0)"
    assert rows["decode: query in latent space"] == "(2, 1, 3, 17)"
    assert rows["forward: value"] == "(2, 5, 3, 5)" and rows["cache bytes per token"] == "68"


def test_audit_latent_names_a_bad_width(capsys):
    assert main(["audit", "--latent", "--qk-rope-dim", "5"]) == 2
    assert "qk_rope_head_dim must be even" in capsys.readouterr().err
