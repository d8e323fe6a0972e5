"""How ``resume-check`` shows its outcome: the findings, then the verdict as the last line.

A front end (like :mod:`ckptverify.render.report`): it prints, and imports rich only when called.
"""

from __future__ import annotations

import os
import sys
import tempfile
from typing import Any, NoReturn

__all__ = ["emit_resume", "fail_lines", "log_dir_for", "workload_log_files"]


def log_dir_for(keep: str | None) -> str:
    """Where the workload's per-rank logs go when stdout must stay clean: ``<keep>/logs``, or a fresh
    directory that outlives the check (its files are named in the report)."""
    if keep:
        return os.path.join(os.path.abspath(keep), "logs")
    return tempfile.mkdtemp(prefix="ckptverify-logs-")


def workload_log_files(log_dir: str) -> list[str] | None:
    """The per-rank log files under ``log_dir``, sorted (None when there are none)."""
    if not os.path.isdir(log_dir):
        return None
    return sorted(os.path.join(log_dir, n) for n in os.listdir(log_dir)) or None


def fail_lines(exc: Any, json_out: bool, command: str, target: str) -> NoReturn:
    """Say why ``command`` could not run and exit with the error's code (2).

    The message may have several lines (the user's traceback, the line at fault): on a terminal each is printed
    as it is, control characters shown as escapes, after ``ckptverify COMMAND: error:``; with ``--json`` it is
    the report's ``error`` string."""
    from ckptverify.render.report import printable

    if json_out:
        import json

        from ckptverify.findings import REPORT_SCHEMA, REPORT_SCHEMA_VERSION

        print(json.dumps({"schema": REPORT_SCHEMA, "schema_version": REPORT_SCHEMA_VERSION, "command": command,
                          "target": target, "passed": False, "exit_code": exc.exit_code, "error": str(exc),
                          "findings": []}, indent=2))
    else:
        lines = str(exc).splitlines() or [""]
        text = "\n".join([f"ckptverify {command}: error: {printable(lines[0])}", *map(printable, lines[1:])])
        print(text, file=sys.stderr)
    sys.exit(exc.exit_code)


def emit_resume(outcome: Any, json_out: bool) -> int:
    """Print ``outcome`` (JSON only, or the rich table then the verdict line); return the exit code."""
    from ckptverify.render.report import printable, render_text, to_json

    report = outcome.report
    if json_out:
        print(to_json(report))
        return int(report.exit_code)
    from rich.console import Console
    from rich.markup import escape

    # emoji=False: a target such as `train.py:train` must not become an emoji code.
    console = Console(highlight=False, emoji=False)
    render_text(report, console)
    logs = report.stats.get("logs")
    if logs:
        console.print(f"[dim]workload output: {escape(printable(', '.join(logs)))}[/]")
    page = report.stats.get("report_page")
    if page:
        console.print(f"report: {escape(printable(page))}")
    verdict = outcome.verdict
    style = "bold green" if verdict.passed else "bold red"
    console.print(f"[{style}]{escape(printable(verdict.headline()))}[/]")
    return int(report.exit_code)
