"""``scan``: every checkpoint under a run directory, its state, and the newest good one (states:
:mod:`~ckptverify.runs.states`, ``docs/runs.md``).

Traps: whatever the walk could not see fails the scan (``scan-unseen``), since a checkpoint there was neither found
nor checked. A checkpoint removed while being verified (retention) is ``deleted``, a warning, not corrupt. A
quarantined checkpoint is listed but never the newest good one; a corrupt one in quarantine of a job that has since
saved that step or later is *handled* (a warning, ``handled_by``). Exit 1 on unhandled corruption, no good
checkpoint, or an unseen part."""

from __future__ import annotations

import dataclasses
import os
import stat
import time
from typing import TYPE_CHECKING, Any

from ckptverify.errors import CheckpointNotFoundError, UsageError
from ckptverify.findings import CheckCoverage, Finding, Location, Report, error, info, warning
from ckptverify.formats.rundir import DCP_FORMATS, Candidate, find_checkpoints
from ckptverify.runs.stamp import SETTLE_SECONDS, describe_suspect, files_fingerprint, read_suspect, removed
from ckptverify.runs.states import GOOD_STATES, INCOMPLETE_CHECKS, STATES, is_quarantined, judge_report
from ckptverify.safeparse import paths
from ckptverify.safeparse.paths import WalkNote

if TYPE_CHECKING:
    from ckptverify.checks.dcp_pipeline import Executor

__all__ = ["judge", "scan_run_dir", "unseen_findings"]

def _judge_path(path: str, jobs: int | None, deep: bool = False) -> tuple[str, Report]:
    """A DCP checkpoint or a single file, through ``verify``'s own routing (``deep``: as ``verify --deep``)."""
    from ckptverify.audit.verify import verify_checkpoint

    report = verify_checkpoint(path, jobs=jobs, deep=deep)
    return judge_report(report), report


_DELETED = "removed while it was being verified (retention, or someone deleting it): nothing left to judge"


def judge(root: str, cand: Candidate, jobs: int | None, *, deep: bool = False) -> tuple[str, str, dict[str, Any]]:
    """State, one-line reason and counts for one candidate, verified exactly as ``verify`` routes it. A good one with
    a suspect note is ``suspect``; one removed meanwhile is ``deleted``: a failed verdict stands only after it stayed
    in place for :data:`~ckptverify.runs.stamp.SETTLE_SECONDS` (as the stamper judges). ``deep``: as
    ``verify --deep``."""
    path = paths.normpath(os.path.join(root, cand.path))
    before = files_fingerprint(path)
    try:
        state, reason, counts = _judge_bytes(root, cand, jobs, deep)
    except FileNotFoundError:  # CheckpointNotFoundError included
        if not removed(path):
            raise
        return "deleted", _DELETED, {"errors": 0, "warnings": 0, "bytes_checked": 0}
    # Only a checkpoint committed when found can have been deleted since; files that moved since the walk
    # (retention deletes file by file) get a settle time.
    if state in ("corrupt", "incomplete") and cand.format != "dcp-uncommitted" \
            and (removed(path) or files_fingerprint(path) != before or _moved_since_walk(path, cand)):
        if not removed(path):
            time.sleep(SETTLE_SECONDS)
        if removed(path):
            return "deleted", _DELETED, {**counts, "errors": 0}
    if state in GOOD_STATES:
        suspect = read_suspect(os.path.join(root, cand.path))
        if suspect is not None:
            return "suspect", describe_suspect(suspect), counts
    return state, reason, counts


def _moved_since_walk(path: str, cand: Candidate) -> bool:
    """Whether ``cand``'s files no longer have the size and newest time the walk measured (the run directory itself
    never counts as moved)."""
    if cand.path == ".":
        return False
    try:
        files = [paths.lstat(path)] if cand.kind == "file" else [st for _, st in paths.FolderWalk(path).files()]
    except OSError:
        return True
    regular = [st for st in files if stat.S_ISREG(st.st_mode)]
    return (sum(st.st_size for st in regular), max((st.st_mtime_ns for st in regular), default=0)) != \
        (cand.size, cand.mtime_ns)


def _judge_bytes(root: str, cand: Candidate, jobs: int | None, deep: bool) -> tuple[str, str, dict[str, Any]]:
    path = paths.normpath(os.path.join(root, cand.path))
    if cand.format in DCP_FORMATS or cand.kind == "file":
        state, report = _judge_path(path, jobs, deep)
        return state, reason_of(state, report), counts_of(report)
    from ckptverify.audit.verify import verify_folder_files

    folder = verify_folder_files(path, deep=deep)[0]
    states, reasons = [judge_report(folder)], []
    counts = counts_of(folder)
    # The run directory itself: only the parts the walk gave it (step folders are checkpoints of their own).
    parts = list(cand.parts) if cand.parts or cand.path == "." else list(folder.stats.get("parts") or [])
    if folder.findings or not parts:
        reasons.append(f"files: {reason_of(states[0], folder)}")
    for part in parts:
        state, report = _judge_path(os.path.join(path, part), jobs, deep)
        states.append(state)
        for k, v in counts_of(report).items():
            counts[k] += v
        reasons.append(f"{part}/: {state}")
    worst = max(states, key=STATES.index)  # STATES runs from best to worst
    return worst, "; ".join(reasons), counts


def counts_of(report: Report) -> dict[str, int]:
    return {"errors": len(report.errors), "warnings": len(report.warnings),
            "bytes_checked": int(report.stats.get("bytes", 0) or 0)}


def reason_of(state: str, report: Report) -> str:
    """One line saying why a checkpoint has ``state``, naming the first finding behind it."""
    if state == "corrupt":
        first = report.errors[0]
        return f"{len(report.errors)} error(s); first: {first.check}: {first.message}"
    if state == "incomplete":
        first = next(f for f in report.errors if f.check in INCOMPLETE_CHECKS)
        return f"never committed: {first.message}"
    if state == "uncheckable":
        from ckptverify.audit.verify import UNCHECKABLE

        first = next(f for f in report.findings if f.check == UNCHECKABLE)
        return (f"{first.location.describe() or 'some content'} carries no checksum and no manifest covers it; "
                "`ckptverify fingerprint` would protect it from now on")
    if state == "verified":
        return "every byte matches the manifest"
    return "structure and every CRC-32 check out; no manifest"


def scan_run_dir(run_dir: str | os.PathLike[str], *, jobs: int | None = None, progress: Any = None,
                 deep: bool = False, executor: Executor | None = None) -> Report:
    """Verify every checkpoint under ``run_dir`` (see the module docstring). ``deep``: as ``verify --deep``;
    ``executor``: share checkpoints among ranks by bytes, with the same report as one process.
    :class:`CheckpointNotFoundError` for a non-directory, :class:`UsageError` when it holds no checkpoint."""
    root = os.fspath(run_dir)
    if not paths.isdir(root):
        raise CheckpointNotFoundError(f"not a directory: {root}")
    started = time.perf_counter()
    notes: list[WalkNote] = []
    candidates = find_checkpoints(root, notes=notes)
    if not candidates:
        unseen = "; ".join(n.describe() for n in notes)
        raise UsageError(f"no checkpoint found under {root} (looked for DCP folders, Hugging Face and accelerate "
                         "folders, .pt/.pth/.bin/.ckpt/.safetensors files)"
                         + (f"; the walk could not see all of it: {unseen}" if unseen else ""))
    rows: list[dict[str, Any]] = []
    findings: list[Finding] = []
    judged = _judged_by_ranks(root, candidates, executor, jobs, deep, progress) if executor is not None else None
    for n, cand in enumerate(candidates):
        if judged is None and progress is not None:
            progress(f"{n + 1}/{len(candidates)} {cand.path}")
        state, reason, counts = judged[n] if judged is not None else judge(root, cand, jobs, deep=deep)
        rows.append({**cand.to_dict(), "state": state, "reason": reason, **counts,
                     "quarantined": is_quarantined(cand.path), "handled_by": None})
    good = [r for r in rows if r["state"] in GOOD_STATES and not r["quarantined"]]
    newest = good[-1] if good else None
    for row in rows:
        state = row["state"]
        # Handled when the newest good checkpoint outside quarantine is of its step or later (unknown never count).
        if state == "corrupt" and row["quarantined"] and newest is not None and row["step"] is not None \
                and newest["step"] is not None and newest["step"] >= row["step"]:
            row["handled_by"] = {"path": newest["path"], "step": newest["step"]}
            row["reason"] += (f"; handled: the job moved it aside and recovered ({newest['path']}, step "
                              f"{newest['step']}, is good), so it is kept as evidence, not a failure")
            make = warning
        else:
            make = error if state == "corrupt" else warning if state in ("incomplete", "uncheckable", "suspect",
                                                                         "deleted") else info
        at = "" if row["step"] is None else f", step {row['step']}"
        findings.append(make("scan", f"{row['path']}: {state} ({row['format']}{at}): {row['reason']}",
                             location=Location(file=row["path"])))
    if newest is None:
        findings.append(error("scan-no-good-checkpoint",
                              f"none of the {len(rows)} checkpoint(s) under {root} is verified or intact"))
    findings.extend(unseen_findings(notes, "scan-unseen", root))
    stats = {"seconds": round(time.perf_counter() - started, 6), "checkpoints": rows,
             "newest_good": None if newest is None else {"path": newest["path"], "step": newest["step"]},
             "bytes": sum(r["bytes_checked"] for r in rows), "unseen": [n.to_dict() for n in notes], "deep": deep}
    coverage = (CheckCoverage(check="scan", count=len(rows), unit="checkpoints"),)
    return Report(command="scan", target=root, findings=tuple(findings), coverage=coverage, stats=stats)


def _judged_by_ranks(root: str, candidates: list[Candidate], executor: Executor, jobs: int | None, deep: bool,
                     progress: Any) -> list[tuple[str, str, dict[str, Any]]]:
    """Every candidate judged by :func:`judge` on the rank it was given (``[state, reason, counts]`` each)."""
    if progress is not None:
        progress(f"{len(candidates)} checkpoint(s) shared among {executor.world} ranks")
    units = [["checkpoint", dataclasses.asdict(c), deep] for c in candidates]

    def no_files(name: str) -> Any:
        raise ValueError(f"a checkpoint unit opens no single file ({name})")

    got = executor.map_plain(units, root=root, open_file=no_files, size_of=lambda n: 0,
                             local_map=lambda fn, xs: [fn(x) for x in xs], jobs=jobs)
    return [(state, reason, dict(counts)) for state, reason, counts in got]


def advice(note: WalkNote, root: str) -> str:
    """What to do so that the walk sees what ``note`` says it did not."""
    if note.kind == "unlisted":
        return (f"give this account read and search permission on {note.path}, or move it out of {root} if it "
                "holds no checkpoint")
    if note.kind == "folder-cap":
        return (f"move {note.path} out of the run directory (a folder of that many entries is no checkpoint "
                "folder), or point the command at the folder that holds the checkpoints")
    return "point the command at the folder that holds the checkpoints, or move what is not a checkpoint elsewhere"


def unseen_findings(notes: list[WalkNote], check: str, root: str) -> list[Finding]:
    """One error per part of the run directory the walk could not see, naming it and what to do."""
    return [error(check, f"not seen: {n.describe()}; {advice(n, root)}", location=Location(file=n.path))
            for n in notes]
