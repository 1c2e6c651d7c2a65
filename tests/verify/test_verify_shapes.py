"""nanoattn.verify.check_shapes (verify/_shapes.py): every traced stage's shape, axes
and element count, grouped-query and cross-attention axes, and shape_report on planted
stages that lose elements or name the wrong axis sizes."""

from nanoattn._base.trace import Stage
from nanoattn.linen import AttentionConfig
from nanoattn.verify import check_shapes
from nanoattn.verify._shapes import shape_report

from _verify_functions import by_name


def test_check_shapes_records_every_stage():
    report = check_shapes(AttentionConfig(128, 4), batch=2, seq_len=5)
    assert report.passed
    records = {c.name: c.data for c in report.checks}
    assert list(records)[:3] == ["input", "qkv", "q"]
    assert records["qkv"] == {
        "shape": [2, 5, 384],
        "axes": ["B", "T", "3D"],
        "elements": 3840,
        "op": "project",
        "source": "input",
    }
    cross = check_shapes(AttentionConfig(64, 4), batch=2, seq_len=3, kv_len=7)
    assert {c.name: c.data["shape"] for c in cross.checks}["scores"] == [2, 4, 3, 7]


def test_check_shapes_knows_the_grouped_query_axes():
    from nanoattn.verify._shapes import axis_sizes, trace_stages

    config = AttentionConfig(48, 6, n_kv_heads=2)  # H = 8, (N + 2K) H = 80, K H = 16
    report = check_shapes(config, batch=2, seq_len=5)
    assert report.passed, report
    shapes = {c.name: (c.data["shape"], c.data["axes"]) for c in report.checks}
    assert shapes["qkv"] == ([2, 5, 80], ["B", "T", "(N+2K)H"])
    assert shapes["k heads"] == ([2, 5, 2, 8], ["B", "S", "K", "H"])
    # Every one of those axis names is checked: the same trace judged against K = 3 fails.
    stages = trace_stages(config, 2, 5, None)
    wrong = axis_sizes(AttentionConfig(48, 6, n_kv_heads=3), 2, 5, None)
    failed = {c.name for c in shape_report(stages, wrong, "planted").checks if not c.passed}
    assert {"qkv", "k", "v", "k heads", "v heads"} <= failed


def test_check_shapes_knows_a_head_width_of_its_own():
    from nanoattn.verify._shapes import axis_sizes, trace_stages

    config = AttentionConfig(30, 6, n_kv_heads=2, head_dim=7)  # N H = 42, not D = 30
    for kv_len in (None, 5):
        report = check_shapes(config, batch=2, seq_len=3, kv_len=kv_len)
        assert report.passed, report
        shapes = {c.name: (c.data["shape"], c.data["axes"]) for c in report.checks}
        assert shapes["q"] == ([2, 3, 42], ["B", "T", "NH"])
        assert shapes["concatenated heads"] == ([2, 3, 42], ["B", "T", "NH"])
        assert shapes["output"] == ([2, 3, 30], ["B", "T", "D"])
    # The same trace judged against H = D / N = 5 fails at every stage of width N H.
    stages = trace_stages(config, 2, 3, None)
    wrong = axis_sizes(AttentionConfig(30, 6, n_kv_heads=2, head_dim=5), 2, 3, None)
    failed = {c.name for c in shape_report(stages, wrong, "planted").checks if not c.passed}
    assert {"q", "q heads", "concatenated heads"} <= failed


def test_shape_report_catches_lost_elements_and_wrong_axis_sizes():
    sizes = {"B": 2, "T": 5, "D": 8, "N": 2, "H": 4, "3D": 24}
    stages = [
        Stage("q", (2, 5, 8), ("B", "T", "D"), "input"),
        Stage("q heads", (2, 5, 2, 3), ("B", "T", "N", "H"), "reshape", "q"),
        Stage("qkv", (2, 5, 24), ("B", "T", "3D"), "project"),
        Stage("k", (2, 5, 8), ("B", "T", "D"), "split", "qkv"),
        Stage("v", (2, 5, 8), ("B", "T", "D"), "split", "qkv"),
    ]
    checks = by_name(shape_report(stages, sizes, "planted"))
    assert checks["q"].passed and not checks["q heads"].passed
    assert "axis H has size 3, expected 4" in checks["q heads"].detail
    assert "60 elements, but q had 80" in checks["q heads"].detail
    assert "the parts of qkv hold 160 elements, it held 240" in checks["k"].detail


# Details a mutation audit found unpinned: report text, boundaries, non-finite outputs


def test_check_shapes_knows_every_axis_it_traces_and_runs_with_dropout():
    from nanoattn.verify._shapes import axis_sizes, trace_stages

    every = set()
    for config, kv_len in [
        (AttentionConfig(48, 6, n_kv_heads=2), None),
        (AttentionConfig(64, 4), None),
        (AttentionConfig(48, 6, n_kv_heads=2), 7),
        (AttentionConfig(64, 4), 7),
    ]:
        sizes = axis_sizes(config, 2, 5, kv_len)
        used = {axis for stage in trace_stages(config, 2, 5, kv_len) for axis in stage.axes}
        assert used <= set(sizes), used - set(sizes)  # an unknown name would go unchecked
        every |= used
    assert {"H", "3D", "2KH"} <= every
    assert check_shapes(AttentionConfig(64, 4, dropout=0.1), batch=2, seq_len=5).passed


# A second mutation sample of nanoattn/verify (40 per file, seed 2) found these unpinned.


def test_check_shapes_titles_and_cross_attention_axes():
    self_report = check_shapes(AttentionConfig(64, 4), batch=2, seq_len=5)
    assert self_report.title == "shapes of CausalSelfAttention"
    cross = check_shapes(AttentionConfig(64, 4), batch=2, seq_len=3, kv_len=7)
    assert cross.title == "shapes of CrossAttention"
    assert cross.passed, cross  # the kv projection is (B, S, 2D) when K = N
    assert {c.name: c.data["axes"] for c in cross.checks}["kv"] == ["B", "S", "2D"]


# A third sample (60 per file, seed 3), run after the tests above, found these unpinned.


def test_shape_problems_are_each_named_and_joined():
    sizes = {"B": 2, "T": 5, "D": 8}
    stages = [Stage("x", (2, 5), ("B", "T", "D"), "input")]
    check = shape_report(stages, sizes, "planted").checks[0]
    assert not check.passed and check.detail == "3 axis names for a rank-2 shape"
    stages = [
        Stage("q", (2, 5, 8), ("B", "T", "D"), "input"),
        Stage("q heads", (2, 5, 2, 3), ("B", "T", "N", "H"), "reshape", "q"),
    ]
    check = by_name(shape_report(stages, {**sizes, "N": 2, "H": 4}, "planted"))["q heads"]
    assert check.detail.count("; ") == 1 and check.detail.startswith(
        "axis H has size 3, expected 4; "
    )
