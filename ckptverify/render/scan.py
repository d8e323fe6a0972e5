"""How ``scan`` shows its report: a table of checkpoints in step order, the newest good one, the verdict. Names come
from the file system, so they are shown via :func:`~ckptverify.render.report.printable` as plain Text."""

from __future__ import annotations

from typing import Any

from ckptverify.findings import Report
from ckptverify.render.report import SEVERITY_STYLE, human_bytes, number_width, printable, safe_text, verdict_text
from ckptverify.runs.states import STATES

__all__ = ["render_scan"]


def render_scan(report: Report, console: Any) -> None:
    """A table of the checkpoints in step order, the newest good one last, then the verdict."""
    from rich.table import Table
    from rich.text import Text

    style = {"verified": "green", "intact": "green", "suspect": "yellow", "uncheckable": "yellow",
             "incomplete": "yellow", "corrupt": "bold red", "deleted": "yellow"}
    table = Table(title=safe_text(f"scan: {report.target}"), expand=False)
    rows = report.stats.get("checkpoints", [])
    why_width = number_width(printable(r["reason"]) for r in rows) or None
    for col in ("step", "checkpoint", "format", "size", "state", "why"):
        table.add_column(col, overflow="fold", no_wrap=col in ("step", "format", "size", "state"),
                         min_width=why_width if col == "why" else None)
    for row in rows:
        table.add_row(Text("-" if row["step"] is None else str(row["step"])), safe_text(row["path"]),
                      Text(row["format"]), Text(human_bytes(row["size"])),
                      Text(row["state"] + (" (quarantined, handled)" if row.get("handled_by") else
                                           " (quarantined)" if row.get("quarantined") else ""),
                           style="yellow" if row.get("handled_by") else style[row["state"]]),
                      safe_text(row["reason"]))
    console.print(table)
    newest = report.stats.get("newest_good")
    if newest:
        console.print(Text.assemble(("newest good: ", "bold"), printable(newest["path"]),
                                    f" (step {newest['step']})" if newest["step"] is not None else ""))
    # Show non-row findings, so the verdict never counts an error the page hides.
    for f in report.findings:
        if f.check != "scan":
            console.print(Text.assemble((f"{f.severity.value}: ", SEVERITY_STYLE[f.severity]),
                                        printable(f"{f.check}: {f.message}")))
    by_state = [f"{n} {state}" for state in (*STATES, "deleted") if (n := sum(r["state"] == state for r in rows))]
    console.print(verdict_text(report.passed, f"scan {report.target}: {len(rows)} checkpoint(s): "
                                              f"{', '.join(by_state) or 'none'}"))
