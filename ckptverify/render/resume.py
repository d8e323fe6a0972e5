"""How ``resume-check`` and ``compare`` show their outcome: findings, the report page, the verdict as the last line. A
front end that imports rich only when called; :func:`resume_check` is ``ckptverify.resume_check``: the core check with
:mod:`ckptverify.render.figures` plugged in (the core never imports render)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ckptverify.resume.harness import FigureWriter, Outcome, Plan

__all__ = ["render_compare", "render_verdict", "resume_check"]


def resume_check(plan: Plan, *, keep: str | None = None, progress: Callable[[str], None] | None = None,
                 verbose: bool = False, report_dir: str | None = None, figures: FigureWriter | None = None
                 ) -> Outcome:
    """:func:`ckptverify.resume.harness.resume_check`, with ``report_dir`` drawn by
    :func:`ckptverify.render.figures.write_report` (an HTML page with PNG figures, its path in the report's stats
    as ``report_page``) unless ``figures`` names another writer. Without matplotlib, ``report_dir`` is refused
    (:class:`~ckptverify.errors.UsageError`) before any run starts."""
    from ckptverify.resume.harness import resume_check as check

    if report_dir and figures is None:
        from ckptverify.render.figures import _pyplot, write_report

        _pyplot()  # refuse before the runs, not after them, when matplotlib is missing
        figures = write_report
    return check(plan, keep=keep, progress=progress, verbose=verbose, report_dir=report_dir, figures=figures)


def render_verdict(report: Any, console: Any, line: str, passed: bool) -> None:
    """A launching command's text output: the findings table, the report page when one was drawn, then ``line``
    (the verdict) as the last line, green when ``passed``."""
    from ckptverify.render.report import render_text, safe_text

    render_text(report, console)
    page = report.stats.get("report_page")
    if page:
        console.print(safe_text(f"report: {page}"))
    console.print(safe_text(line, "bold green" if passed else "bold red"))


def render_compare(report: Any, console: Any) -> None:
    """``compare``'s text output: the verdict line is ``stats.verdict``'s kind and its ``compare-verdict`` finding
    (which adds the walk's sentence)."""
    said = next((f.message for f in report.findings if f.check == "compare-verdict"), "")
    kind = (report.stats.get("verdict") or {}).get("kind")
    render_verdict(report, console, f"verdict: {kind} — {said}", report.passed)
