"""nanoattn.verify.Report (verify/_report.py): the table, its JSON and raise_if_failed."""

import json

import pytest

from nanoattn.verify import CheckResult, Report


def test_report_table_json_and_raise():
    report = Report(
        "demo",
        [
            CheckResult("a", True, "fine", 0.0),
            CheckResult("b", False, "broken", 0.5, {"length": 3}),
        ],
    )
    text = str(report)
    assert text.splitlines()[0] == "demo: FAIL"
    assert "b      FAIL    0.5    length 3  broken" in text
    with pytest.raises(AssertionError, match=r"(?s)verification failed.*broken"):
        report.raise_if_failed()
    data = json.loads(json.dumps(report.to_dict()))
    assert data["passed"] is False and data["checks"][1]["where"] == {"length": 3}
    ok = Report("ok", [CheckResult("a", True)])
    assert ok.raise_if_failed() is ok


# Details a mutation audit found unpinned: report text, boundaries, non-finite outputs


def test_report_table_exactly():
    report = Report("demo", [CheckResult("a", True, "fine", 0.0), CheckResult("bb", False)])
    assert str(report) == (
        "demo: FAIL\n"
        "  check  result  worst  where  detail\n"
        "  a      PASS    0             fine\n"
        "  bb     FAIL"
    )
    assert list(report.to_dict()) == ["title", "passed", "checks"]
    assert report.to_dict()["title"] == "demo"
