"""Rendering a :class:`~ckptverify.findings.Report` for people (rich) and machines (JSON).

Library code never prints; the command line calls these.
"""

from __future__ import annotations

import json
from typing import Any

from ckptverify.findings import Report, Severity, sort_findings

_STYLE = {Severity.ERROR: "bold red", Severity.WARNING: "yellow", Severity.INFO: "cyan"}


def to_json(report: Report, indent: int | None = 2) -> str:
    """The documented JSON form (``docs/json-schema.md``)."""
    return json.dumps(report.to_dict(), indent=indent, sort_keys=False, default=_jsonable)


def _jsonable(value: Any) -> Any:
    if isinstance(value, tuple | set | frozenset):
        return list(value)
    return str(value)


def render_text(report: Report, console: Any, *, max_findings: int = 200) -> None:
    """Print ``report`` on a rich ``Console``: a findings table, what was covered, and the verdict."""
    from rich.table import Table

    findings = sort_findings(report.findings)
    if findings:
        table = Table(title=f"{report.command}: {report.target}", show_lines=False, expand=False)
        table.add_column("severity", no_wrap=True)
        table.add_column("check", no_wrap=True)
        table.add_column("where", overflow="fold")
        table.add_column("what", overflow="fold")
        for f in findings[:max_findings]:
            table.add_row(
                f"[{_STYLE[f.severity]}]{f.severity.value}[/]",
                f.check,
                f.location.describe() or "-",
                f.message,
            )
        console.print(table)
        if len(findings) > max_findings:
            console.print(f"... and {len(findings) - max_findings} more findings (use --json for all)")
    if report.coverage:
        covered = ", ".join(f"{c.check}: {c.count} {c.unit}" for c in report.coverage)
        console.print(f"[dim]checked {covered}[/]")
    stats = report.stats
    if stats.get("bytes") is not None and stats.get("seconds"):
        console.print(
            f"[dim]{stats.get('files', 0)} files, {_human(stats['bytes'])} in {stats['seconds']:.2f} s "
            f"({_human(stats.get('throughput_bytes_per_s') or 0)}/s)[/]"
        )
    counts = report.summary()
    tail = f"{counts['error']} error(s), {counts['warning']} warning(s)"
    if report.passed:
        note = " — read the warnings" if counts["warning"] else ""
        console.print(f"[bold green]PASSED[/] {report.command} {report.target}: {tail}{note}")
    else:
        console.print(f"[bold red]FAILED[/] {report.command} {report.target}: {tail}")


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n} B"  # pragma: no cover
