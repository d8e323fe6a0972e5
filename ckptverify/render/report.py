"""Rendering a :class:`~ckptverify.findings.Report` for people (rich) and machines (JSON); library code never prints.
Trap: every name and value may come from a hostile checkpoint, so text output never lets it act as rich markup, emoji
or terminal control: it is shown as :class:`rich.text.Text` after :func:`printable`."""

from __future__ import annotations

import json
import re
import sys
from typing import Any, NoReturn

from ckptverify.findings import REPORT_SCHEMA, REPORT_SCHEMA_VERSION, Report, Severity, sort_findings

__all__ = ["SEVERITY_STYLE", "fail", "human_bytes", "number_width", "printable", "render_text", "safe_text",
           "to_json", "verdict_text"]

SEVERITY_STYLE = {Severity.ERROR: "bold red", Severity.WARNING: "yellow", Severity.INFO: "cyan"}

# Controls, DEL and bidi overrides (a name could read as something else); tabs/newlines too: one cell each.
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u200e\u200f\u202a-\u202e\u2066-\u2069]")


def fail(command: str, target: str, error: object, json_out: bool, *, lines: bool = False,
         label: str = "error: ") -> NoReturn:
    """Say why ``command`` could not run and exit with ``error``'s ``exit_code`` (2 for a plain message): the JSON
    report's ``error`` on stdout (one line for ``watch``, which prints an object per line), or ``ckptverify COMMAND:
    error: ...`` on stderr with every control escaped, as one line; ``lines``: a message of several lines (a
    traceback) is printed line by line instead."""
    message, exit_code = str(error), getattr(error, "exit_code", 2)
    if json_out:
        print(json.dumps({"schema": REPORT_SCHEMA, "schema_version": REPORT_SCHEMA_VERSION, "command": command,
                          "target": target, "passed": False, "exit_code": exit_code, "error": message,
                          "findings": []}, indent=None if command == "watch" else 2))
    else:
        first, *rest = (message.splitlines() or [""]) if lines else [message]
        print("\n".join([f"ckptverify {command}: {label}{printable(first)}", *map(printable, rest)]), file=sys.stderr)
    sys.exit(exit_code)


def printable(value: object) -> str:
    """``str(value)`` with every control character shown as an escape (``\\x1b``, ``\\u202e``)."""
    return _CONTROL.sub(lambda m: repr(m.group())[1:-1] if ord(m.group()) < 0x100 else f"\\u{ord(m.group()):04x}",
                        str(value))


# A whitespace-delimited word that is a number, bare or in punctuation: "0.00123,", "[8672,", "1.5e-07)".
_NUMBER_WORD = re.compile(r"[\[(]*[-+]?(?:\d[\d_]*\.?\d*|\.\d+)(?:[eE][-+]?\d+)?%?[\]),;:.]*")
#: Longer numbers may fold (a hostile name can hold any digit string).
_MAX_NUMBER_WIDTH = 40


def number_width(texts: object) -> int:
    """Width of the longest number (with surrounding punctuation) among the words of ``texts``: a column at least
    this wide never splits a number (rich folds only words wider than the column)."""
    widest = 0
    for text in texts:  # type: ignore[attr-defined]
        for word in str(text).split():
            if len(word) > widest and len(word) <= _MAX_NUMBER_WIDTH and _NUMBER_WORD.fullmatch(word):
                widest = len(word)
    return widest


def to_json(report: Report, indent: int | None = 2) -> str:
    """The documented JSON form (``docs/json-schema.md``). JSON escapes control characters itself."""
    return json.dumps(report.to_dict(), indent=indent, sort_keys=False,
                      default=lambda v: list(v) if isinstance(v, tuple | set | frozenset) else str(v))


def safe_text(value: object, style: str = "") -> Any:
    """``value`` as a rich ``Text`` in ``style``, made :func:`printable` (never read as markup)."""
    from rich.text import Text

    return Text(printable(value), style=style)


def render_text(report: Report, console: Any, *, max_findings: int = 200) -> None:
    """Print ``report`` on a rich ``Console``: a findings table, what was covered, and the verdict."""
    from rich.table import Table

    findings = sort_findings(report.findings)
    if findings:
        shown = findings[:max_findings]
        where_w, what_w = _text_widths(
            console.width, ["severity", *(f.severity.value for f in shown)], ["check", *(f.check for f in shown)],
            ["where", *(printable(f.location.describe() or "-") for f in shown)],
            ["what", *(printable(f.message) for f in shown)])
        table = Table(title=safe_text(f"{report.command}: {report.target}"), show_lines=False, expand=False)
        table.add_column("severity", no_wrap=True)
        table.add_column("check", no_wrap=True)
        table.add_column("where", overflow="fold", width=where_w)
        table.add_column("what", overflow="fold", width=what_w)
        for f in shown:
            table.add_row(safe_text(f.severity.value, SEVERITY_STYLE[f.severity]), safe_text(f.check),
                          safe_text(f.location.describe() or "-"), safe_text(f.message))
        console.print(table)
        if len(findings) > max_findings:
            console.print(safe_text(f"... and {len(findings) - max_findings} more findings (use --json for all)"))
    if report.coverage:
        covered = ", ".join(f"{c.check}: {c.count} {c.unit}" for c in report.coverage)
        console.print(safe_text(f"checked {covered}", "dim"))
    stats = report.stats
    if stats.get("bytes") is not None and stats.get("seconds"):
        # The rate only where it was measured: a rate of 0 B/s would say the read stalled.
        rate = stats.get("throughput_bytes_per_s")
        console.print(safe_text(
            f"{stats.get('files', 0)} files, {human_bytes(stats['bytes'])} in {stats['seconds']:.2f} s"
            + (f" ({human_bytes(rate)}/s)" if rate else ""), "dim"))
    counts = report.summary()
    tail = f"{counts['error']} error(s), {counts['warning']} warning(s)"
    note = " — read the warnings" if report.passed and counts["warning"] else ""
    console.print(verdict_text(report.passed, f"{report.command} {report.target}: {tail}{note}"))


def verdict_text(passed: bool, text: str) -> Any:
    """The last line of a command's text output: ``PASSED``/``FAILED`` and ``text`` (made printable)."""
    from rich.text import Text

    return Text.assemble(("PASSED", "bold green") if passed else ("FAILED", "bold red"), " ", safe_text(text))


def _text_widths(width: int, *fixed_and_text: list[str]) -> tuple[int | None, int | None]:
    """Widths of the ``where``/``what`` columns of a findings table ``width`` wide, or ``None`` for rich's choice
    when everything fits; each at least its widest number, so no number is cut."""
    *fixed, where, what = fixed_and_text
    borders = 3 * (len(fixed) + 2) + 1  # "│ " before each column, " " after it, and the last "│"
    rest = width - borders - sum(max((len(x) for x in col), default=0) for col in fixed)
    where_nat, what_nat = max(map(len, where), default=0), max(map(len, what), default=0)
    if where_nat + what_nat <= rest:
        return None, None
    where_min = min(where_nat, max(number_width(where), 8))
    what_min = min(what_nat, max(number_width(what), 12))
    if rest < where_min + what_min:
        return None, None  # too narrow to keep every number whole: rich's own choice
    where_w = max(where_min, min(where_nat, rest * 2 // 5))
    return where_w, rest - where_w


def human_bytes(n: float) -> str:
    """``n`` bytes for people: ``512 B``, ``1.5 KiB``, ... ``2.0 TiB``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n} B"  # pragma: no cover
