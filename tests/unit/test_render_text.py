"""The text rendering of reports: compare's verdict line, a findings table cut at its limit, a narrow terminal."""

from __future__ import annotations

import io

from rich.console import Console

from ckptverify.findings import Report, error, info
from ckptverify.render.report import _text_widths, render_text
from ckptverify.render.resume import render_compare


def _console(width: int = 200) -> tuple[Console, io.StringIO]:
    out = io.StringIO()
    return Console(file=out, width=width, color_system=None), out


def test_compare_ends_with_its_verdict_kind_and_sentence() -> None:
    said = error("compare-verdict", "the change enters at op 3")
    report = Report(command="compare", target="a vs b", findings=(said,), stats={"verdict": {"kind": "effect"}})
    console, out = _console()
    render_compare(report, console)
    assert out.getvalue().rstrip().splitlines()[-1] == "verdict: effect — the change enters at op 3"


def test_findings_past_the_limit_are_counted_not_shown() -> None:
    report = Report(command="verify", target="ckpt", findings=tuple(info("c", f"finding {n}") for n in range(5)))
    console, out = _console()
    render_text(report, console, max_findings=2)
    text = out.getvalue()
    assert "finding 1" in text and "finding 2" not in text
    assert "... and 3 more findings (use --json for all)" in text


def test_too_narrow_a_terminal_leaves_the_widths_to_rich() -> None:
    fixed = ["severity", "error"], ["check", "c"]
    where, what = ["where", "x" * 40 + " 123456789012"], ["what", "y" * 80 + " 1234567890123456"]
    assert _text_widths(400, *fixed, where, what) == (None, None)  # everything fits
    assert _text_widths(54, *fixed, where, what) == (12, 16)  # each column as narrow as its widest number
    assert _text_widths(53, *fixed, where, what) == (None, None)  # a number would be cut: rich's own choice
