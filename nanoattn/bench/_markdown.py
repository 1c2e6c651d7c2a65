"""The markdown tables of the bench's parts: one row per measured item, or its status
where it was not measured."""


def table(header: str, columns: int, rows, label, cells, status) -> list[str]:
    """The lines of a markdown table of ``columns`` columns: ``header`` (its first
    line) and the rule under it, then a line per row: ``label(row)`` (its first cells,
    as ``"| a | b |"``), then ``cells(row)`` (the other cells) when the row was measured
    (status ``"ok"``), else ``status(row)`` and empty cells."""
    lines = [header, "|" + " --- |" * columns]
    for r in rows:
        head = label(r)
        if r["status"] != "ok":
            lines.append(f"{head} {status(r)} |" + " |" * (columns - head.count("|")))
        else:
            lines.append(f"{head} " + " | ".join(cells(r)) + " |")
    return lines


def section(result: dict | None, title: str) -> tuple[list[str], bool]:
    """A part's section: ``(lines, measured)``: no lines for no ``result``, its
    ``title`` (a "### " heading) between blank lines, then its status when it was not
    measured (``measured`` False: nothing more to add)."""
    if not result:
        return [], False
    lines = ["", f"### {title}", ""]
    if result["status"] != "ok":
        return [*lines, result["status"]], False
    return lines, True


def timed_calls(row: dict, title: str, calls: list[tuple[str, str]]) -> list[str]:
    """A part's ``title`` (a "### " heading) and its table of calls: a line per
    ``(label, name)`` of ``calls``, the row's ``{name}_median_ms`` and ``_min_ms``."""
    lines = ["", f"### {title}", "", "| call | median ms (min) |", "| --- | --- |"]
    for label, name in calls:
        lines.append(f"| {label} | {row[f'{name}_median_ms']:.3f} ({row[f'{name}_min_ms']:.3f}) |")
    return lines
