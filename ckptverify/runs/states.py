"""Where a checkpoint of a run stands: the states a verification gives it, and the quarantine; shared by ``scan``,
``latest``, ``prune`` and the stamps."""

from __future__ import annotations

import os

from ckptverify.findings import Report

__all__ = ["GOOD_STATES", "INCOMPLETE_CHECKS", "QUARANTINE_DIR", "STATES", "is_quarantined", "judge_report"]

QUARANTINE_DIR = "quarantine"

STATES = ("verified", "intact", "suspect", "uncheckable", "incomplete", "corrupt")
GOOD_STATES = frozenset({"verified", "intact"})
INCOMPLETE_CHECKS = frozenset({"metadata-missing", "save-uncommitted"})


def judge_report(report: Report) -> str:
    """The state (one of :data:`STATES`) a ``verify`` report gives a DCP checkpoint."""
    from ckptverify.checks.dcp_pipeline import UNCHECKABLE

    checks = {f.check for f in report.errors}
    if checks & INCOMPLETE_CHECKS:
        return "incomplete"
    if checks:
        return "corrupt"
    if any(f.check == UNCHECKABLE for f in report.findings):
        return "uncheckable"
    return "verified" if report.stats.get("manifest") else "intact"


def is_quarantined(rel_path: str) -> bool:
    """Whether a checkpoint path relative to its run directory lies in the quarantine."""
    return rel_path.replace(os.sep, "/").split("/", 1)[0] == QUARANTINE_DIR
