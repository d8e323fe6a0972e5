"""The newest checkpoint of a run that verifies: what a restarted job should resume from.

Checkpoints are tried newest first (by step). A checkpoint with a *current* verification stamp
(:mod:`~ckptverify.runs.stamp`) is judged by it; one without a stamp, or with a stale one, is verified on the
spot. The first one that is ``verified`` or ``intact`` wins; every newer one is listed as skipped, with why
(corrupt, torn, incomplete, uncheckable, a format that is not read). Nothing is written.
"""

from __future__ import annotations

import os
import time
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

from ckptverify.errors import CheckpointNotFoundError
from ckptverify.findings import CheckCoverage, Finding, Location, Report, error, info, warning
from ckptverify.formats.rundir import Candidate, find_checkpoints
from ckptverify.runs.scan import GOOD_STATES, judge
from ckptverify.runs.stamp import read_stamp

__all__ = ["Latest", "latest_verified"]


@dataclass
class Latest:
    """The pick: ``path`` (absolute) and ``step`` of the newest good checkpoint, or ``None``; ``skipped`` lists
    the newer ones passed over; ``report`` holds one finding per checkpoint examined."""

    path: str | None
    step: int | None
    skipped: list[dict[str, Any]] = field(default_factory=list)
    report: Report | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"path": self.path, "step": self.step, "skipped": self.skipped}


def _judge(root: str, cand: Candidate, jobs: int | None, use_stamps: bool) -> tuple[str, str, str]:
    """State, reason, and how it was decided (``stamp`` or ``verified now``)."""
    if use_stamps and cand.format != "dcp-uncommitted":
        stamp = read_stamp(os.path.join(root, cand.path))
        if stamp is not None and stamp.current:
            checked_at = stamp.data.get("checked_at", "?")
            if not stamp.passed:
                return "corrupt", f"its stamp ({checked_at}) says it failed verification", "stamp"
            state = "verified" if stamp.data.get("manifest") else "intact"
            return state, f"stamped {checked_at}", "stamp"
    state, reason, _ = judge(root, cand, jobs)
    return state, reason, "verified now"


def latest_verified(run_dir: str | os.PathLike[str], *, jobs: int | None = None, use_stamps: bool = True,
                    formats: Collection[str] | None = None) -> Latest:
    """The newest checkpoint under ``run_dir`` that verifies; see the module docstring.

    ``formats``: consider only checkpoints of these formats (``find_checkpoints``' names, e.g. ``{"dcp"}`` for
    what :func:`ckptverify.load` restores); newer ones of other formats are listed as skipped, with why.

    Raises :class:`~ckptverify.errors.CheckpointNotFoundError` when ``run_dir`` is not a directory. A run
    directory with no good checkpoint gives ``path=None`` and a report that fails.
    """
    root = os.fspath(run_dir)
    if not os.path.isdir(root):
        raise CheckpointNotFoundError(f"not a directory: {root}")
    started = time.perf_counter()
    candidates = sorted(find_checkpoints(root), key=lambda c: (c.step is not None, c.step or 0, c.mtime_ns),
                        reverse=True)
    findings: list[Finding] = []
    result = Latest(path=None, step=None)
    examined = 0
    for cand in candidates:
        examined += 1
        if formats is not None and cand.format not in formats and cand.format != "dcp-uncommitted":
            state, reason, how = "other-format", f"a {cand.format} checkpoint, not {'/'.join(sorted(formats))}", \
                "format"
        else:
            state, reason, how = _judge(root, cand, jobs, use_stamps)
        where = Location(file=cand.path)
        if state in GOOD_STATES:
            result.path, result.step = os.path.abspath(os.path.join(root, cand.path)), cand.step
            findings.append(info("latest", f"{cand.path}: {state} ({how}: {reason})", location=where))
            break
        result.skipped.append({"path": cand.path, "step": cand.step, "state": state, "reason": reason,
                               "how": how})
        findings.append(warning("latest-skipped", f"skipped {cand.path}: {state} ({reason})", location=where))
    if result.path is None:
        findings.append(error("latest-none", f"no checkpoint under {root} verifies "
                              f"({len(candidates)} examined)" if candidates else f"no checkpoint under {root}"))
    stats = {"seconds": round(time.perf_counter() - started, 6), **result.to_dict()}
    result.report = Report(command="latest", target=root, findings=tuple(findings),
                           coverage=(CheckCoverage(check="latest", count=examined, unit="checkpoints"),),
                           stats=stats)
    return result
