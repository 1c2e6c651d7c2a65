"""The decode sweep's targets and tables (:mod:`nanoattn.bench._decode`)."""

import dataclasses

from ._decode import PEER_SPEEDUP, PEERS, SPLIT_SPEEDUP, SPLIT_THREADS
from ._decode_cases import FULL
from ._markdown import table


def nanoattn_rows(rows: list[dict]) -> dict:
    """The row of nanoattn's automatic choice for each (case, dtype): the backend it
    takes for that call, measured on its own."""
    return {(r["case"], r["dtype"]): r for r in rows if r.get("chosen") and r["impl"] not in PEERS}


def _by(rows: list[dict]) -> dict:
    return {(r["impl"], r["case"], r["dtype"]): r for r in rows}


def peer_targets(result: dict) -> list[dict]:
    """On every float32 case: nanoattn's step at least PEER_SPEEDUP[peer] x faster
    than each peer's, each alone (None where either was not measured)."""
    ours, by = nanoattn_rows(result["rows"]), _by(result["rows"])
    cases = list(dict.fromkeys(r["case"] for r in result["rows"] if r["dtype"] == "float32"))
    out = []
    for case in cases:
        mine = ours.get((case, "float32"))
        for peer, bound in PEER_SPEEDUP.items():
            theirs = by.get((peer, case, "float32"))
            target = f"decode {case} float32: nanoattn >= {bound:g}x faster than {peer}"
            if mine is None or theirs is None or theirs["status"] != "ok":
                why = "nanoattn not measured" if mine is None else (theirs or {}).get(
                    "status", f"{peer} not measured")  # fmt: skip
                out.append({"target": target, "measured": why, "passed": None})
                continue
            ratio = theirs["median_us"] / mine["median_us"]
            measured = (f"nanoattn ({mine['impl']}) {mine['median_us']:.0f} us, {peer} "
                        f"{theirs['median_us']:.0f} us, each alone: {ratio:.2f}x")  # fmt: skip
            out.append({"target": target, "measured": measured, "passed": ratio >= bound})
    return out


def paired_rows(rows: list[dict], subject: str, baseline: str) -> list[dict]:
    """Each (case, dtype) of ``subject``'s rows with ``baseline``'s: both rows and the
    speed-up baseline / subject (None where either was not measured)."""
    by, out = _by(rows), []
    for r in rows:
        if r["impl"] != subject:
            continue
        base = by.get((baseline, r["case"], r["dtype"]))
        ok = r["status"] == "ok" and base is not None and base["status"] == "ok"
        status = r["status"] if r["status"] != "ok" else (base or {}).get("status", "missing")
        out.append({"case": r["case"], "dtype": r["dtype"], "subject": r, "baseline": base,
                    "status": "ok" if ok else status,
                    "speedup": base["median_us"] / r["median_us"] if ok else None})  # fmt: skip
    return out


def split_rows(result: dict) -> list[dict]:
    """Each (case, dtype) of the split job: the split (subject) and unsplit (baseline)
    rows and the speed-up."""
    return paired_rows(result["split"], "native split", "native unsplit")


def huge_rows(result: dict) -> list[dict]:
    """Each (case, dtype) of the huge-pages job: the rows on huge and on 4 KiB pages and
    the speed-up (older results have none)."""
    return paired_rows(result.get("huge", []), "native huge pages", "native 4 KiB pages")


def split_targets(result: dict) -> list[dict]:
    """Split-key decode at least SPLIT_SPEEDUP x faster than the unsplit kernel."""
    out = []
    for s in split_rows(result):
        target = (
            f"decode {s['case']} {s['dtype']}: split-key native >= {SPLIT_SPEEDUP}x the "
            f"unsplit kernel (NANOATTN_SPLIT_KEYS=0), {SPLIT_THREADS} threads, each alone"
        )
        if s["status"] != "ok":
            out.append({"target": target, "measured": s["status"], "passed": None})
            continue
        measured = (f"split {s['subject']['median_us']:.0f} us, unsplit "
                    f"{s['baseline']['median_us']:.0f} us: {s['speedup']:.2f}x")  # fmt: skip
        out.append(
            {"target": target, "measured": measured, "passed": s["speedup"] >= SPLIT_SPEEDUP}
        )
    return out


def decode_targets(result: dict) -> list[dict]:
    """The targets, judged at :data:`~._decode_cases.FULL` only."""
    if result["sweep"] != dataclasses.asdict(FULL):
        return []
    return peer_targets(result) + split_targets(result)


def _us(row: dict | None) -> str:
    if row is None or row["status"] != "ok":
        return ""
    return f"{row['median_us']:.0f} ({row['min_us']:.0f})"


def _main_table(result: dict) -> list[str]:
    """A line per (case, dtype): every implementation's microseconds, nanoattn's GB/s
    and share of the read bandwidth, and each peer's time over nanoattn's."""
    rows, ours, by = result["rows"], nanoattn_rows(result["rows"]), _by(result["rows"])
    impls = list(dict.fromkeys(r["impl"] for r in rows if r["status"] == "ok"))
    keys = list(dict.fromkeys((r["case"], r["dtype"]) for r in rows))
    header = (
        "| case | dtype | " + " | ".join(f"{i} us" for i in impls) + " | nanoattn | GB/s "
        "| of read bandwidth | " + " | ".join(f"{p} / nanoattn" for p in PEERS) + " |"
    )
    lines = [header, "|" + " --- |" * (5 + len(impls) + len(PEERS))]
    for case, dtype in keys:
        mine = ours.get((case, dtype))
        cells = [_us(by.get((i, case, dtype))) for i in impls]
        if mine is None:
            cells += ["", "", ""]
        else:
            fraction = mine.get("fraction")
            cells += [mine["impl"], f"{mine['gb_per_s']:.1f}",
                      "" if fraction is None else f"{fraction:.0%}"]  # fmt: skip
        for peer in PEERS:
            theirs = by.get((peer, case, dtype))
            ok = mine is not None and theirs is not None and theirs["status"] == "ok"
            cells.append(f"{theirs['median_us'] / mine['median_us']:.2f}x" if ok else "")
        lines.append(f"| {case} | {dtype} | " + " | ".join(cells) + " |")
    return lines


def _notes(result: dict) -> list[str]:
    """Each implementation's reasons for what it did not measure, once each."""
    seen = {}
    for r in [*result["rows"], *result["split"], *result.get("huge", [])]:
        if r["status"] != "ok":
            text = r["status"] + (f" ({r['reason']})" if "reason" in r else "")
            seen.setdefault((r["impl"], text), None)
    return [f"- {impl}: {text}" for impl, text in seen]


def decode_markdown(result: dict | None) -> list[str]:
    """The read bandwidth, the sweep's table, the split-key and huge-pages tables and
    the notes."""
    if not result:
        return []
    read = result["bandwidth"]
    bandwidth = (f"{read['gb_per_s']:.1f} GB/s ({read['how']}, {read['bytes'] / 2**20:.0f} MiB)"
                 if read["status"] == "ok" else read["status"])  # fmt: skip
    peers = "; ".join(f"{name} {p['version']}" if p["status"] is None else f"{name}: {p['status']}"
                      for name, p in result["peers"].items())  # fmt: skip
    lines = [
        "", "### Decode: one query token a sequence over a paged cache; median (min) "
        "microseconds, each implementation alone", "",
        f"Read bandwidth: {bandwidth}. Peers: {peers}. nanoattn: the backend its automatic "
        "choice takes for the call; GB/s: its keys and values read once.", "",
        *_main_table(result), "",
    ]  # fmt: skip
    split = split_rows(result)
    lines += table(
        f"| split-key decode, {SPLIT_THREADS} threads | dtype | split us | unsplit us "
        "| unsplit / split | split GB/s | of read bandwidth |", 7, split,
        lambda s: f"| {s['case']} | {s['dtype']} |",
        lambda s: [_us(s["subject"]), _us(s["baseline"]), f"{s['speedup']:.2f}x",
                   f"{s['subject']['gb_per_s']:.1f}", f"{s['subject'].get('fraction', 0):.0%}"],
        lambda s: s["status"],
    )  # fmt: skip
    huge = huge_rows(result)
    lines += [] if not huge else ["", *table(
        "| huge pages for the pool | dtype | 4 KiB pages us | huge pages us | speed-up "
        "| MiB on huge pages |", 6, huge,
        lambda s: f"| {s['case']} | {s['dtype']} |",
        lambda s: [_us(s["baseline"]), _us(s["subject"]), f"{s['speedup']:.2f}x",
                   str(s["subject"].get("huge_mib"))],
        lambda s: s["status"],
    )]  # fmt: skip
    notes = _notes(result)
    return [*lines, *(["", "Not measured:", *notes] if notes else [])]
