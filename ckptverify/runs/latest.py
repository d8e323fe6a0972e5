"""The newest checkpoint of a run that verifies: what a restarted job should resume from.

Candidates are tried newest first; a current stamp saying not good (failed, uncheckable, suspect) skips one, others
are verified on the spot. Trap: the pick itself is always verified afresh, whole, even under a current passing stamp,
since a bit flipped in place with its time put back leaves the stamp current; only ``trust_stamps`` (for callers that
prove the bytes while reading, like ``load``) skips that. Suspect checkpoints and anything under ``quarantine/``
(where :func:`move_aside` puts failed ones, never overwritten or pruned) are never picked. Nothing is written, moved
or deleted here."""

from __future__ import annotations

import contextlib
import datetime as _dt
import errno
import os
import re
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field, fields
from typing import Any

from ckptverify.errors import CheckpointNotFoundError, CkptVerifyError, UsageError
from ckptverify.findings import CheckCoverage, Finding, Location, Report, error, info, warning
from ckptverify.formats.rundir import Candidate, find_checkpoints, step_of
from ckptverify.ownfiles.names import open_own_dir
from ckptverify.runs.scan import judge, unseen_findings
from ckptverify.runs.stamp import describe_suspect, read_stamp
from ckptverify.runs.states import GOOD_STATES, QUARANTINE_DIR, is_quarantined
from ckptverify.safeparse import paths
from ckptverify.safeparse.paths import WalkNote

__all__ = [
    "TRAIN_STATE_KEYS",
    "Latest",
    "latest_verified",
    "missing_train_state_keys",
    "move_aside",
]

#: Entries every TrainState saves: a DCP checkpoint without them is a weights-only export ``load`` cannot restore.
TRAIN_STATE_KEYS = ("version", "world_size", "rng.version", "rng.world_size", "counters.step", "counters.epoch",
                    "counters.samples_seen", "counters.tokens_seen")
_OWN_NAME = re.compile(r"^step_\d+$")


def is_own_step_dir(rel_path: str) -> bool:
    """Whether ``rel_path`` is a top-level ``step_N`` folder: where a production job saves, so what it could
    overwrite."""
    return "/" not in rel_path.replace(os.sep, "/") and bool(_OWN_NAME.match(rel_path))


def move_aside(run_dir: str | os.PathLike[str], rel_path: str) -> str:
    """Move checkpoint ``rel_path`` whole into the run's quarantine with one ``rename`` (bytes, inodes and times
    kept, so a current stamp stays current); returns the new relative path. Never overwrites (a counter is added) and
    never follows a link out of the run directory. :class:`CkptVerifyError` (nothing moved) when it cannot (a link or
    file at ``quarantine``, another file system, no permission)."""
    root = os.fspath(run_dir)
    if "://" in root:
        raise UsageError(f"checkpoints are moved aside in a local or mounted run directory only, not in {root}")
    source = os.path.join(root, rel_path)
    base = os.path.basename(os.path.normpath(rel_path))
    when = _dt.datetime.now(_dt.UTC).strftime("%Y%m%dT%H%M%SZ")
    quarantine = os.path.join(root, QUARANTINE_DIR)
    try:
        fd = open_own_dir(root, QUARANTINE_DIR)
    except OSError as exc:
        raise CkptVerifyError(f"cannot move {rel_path} aside: {_why(exc)}; nothing was moved") from None
    try:
        for n in range(1000):
            name = f"{base}.moved-{when}" + (f"-{n}" if n else "")
            with contextlib.suppress(FileNotFoundError):
                os.lstat(name, dir_fd=fd)
                continue  # taken
            try:
                os.rename(source, name, dst_dir_fd=fd)  # into the folder opened above, whatever its name is now
            except OSError as exc:
                why = (f"{quarantine} is on another file system than {source} (a checkpoint is renamed aside, "
                       "never copied and deleted); make it a folder on the run directory's file system"
                       if exc.errno == errno.EXDEV else _why(exc))
                raise CkptVerifyError(f"cannot move {rel_path} aside into {quarantine}: {why}; nothing was moved") \
                    from None
            return f"{QUARANTINE_DIR}/{name}"
    finally:
        os.close(fd)
    raise CkptVerifyError(f"cannot move {rel_path} aside: no free name in {quarantine} for {base}; nothing was moved")


def _why(exc: OSError) -> str:
    """``exc`` in a few words, with the path it is about."""
    where = f"{exc.filename}: " if exc.filename else ""
    return f"{where}{exc.strerror or exc}"


@dataclass
class Latest:
    """The pick: absolute ``path`` and ``step`` of the newest good checkpoint, or ``None``; ``skipped``: newer ones
    passed over; ``quarantined``: never candidates; ``report``: one finding per checkpoint examined."""

    path: str | None
    step: int | None
    skipped: list[dict[str, Any]] = field(default_factory=list)
    report: Report | None = None
    quarantined: list[dict[str, Any]] = field(default_factory=list)
    unseen: list[dict[str, Any]] = field(default_factory=list)

    trust_stamps: bool = False

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "report"}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Latest:
        """The pick :meth:`to_dict` gave (as another rank receives it: no report)."""
        return cls(path=data["path"], step=data["step"], skipped=list(data["skipped"]),
                   quarantined=list(data.get("quarantined", [])), unseen=list(data.get("unseen", [])),
                   trust_stamps=bool(data.get("trust_stamps")))


def _judge(root: str, cand: Candidate, jobs: int | None, use_stamps: bool,
           trust_stamps: bool) -> tuple[str, str, str]:
    """State, reason and how decided (``stamp``, ``suspect note``, ``verified now``). A current good stamp decides
    only with ``trust_stamps``."""
    path = os.path.join(root, cand.path)
    vouched = ""
    if use_stamps and cand.format != "dcp-uncommitted":
        stamp = read_stamp(path)
        if stamp is not None and stamp.current:
            checked_at = stamp.data.get("checked_at", "?")
            if not stamp.passed:
                return "corrupt", f"its stamp ({checked_at}) says it failed verification{_first_error(stamp)}", \
                    "stamp"
            if stamp.suspect is not None:
                return "suspect", describe_suspect(stamp.suspect), "stamp"
            if stamp.state is not None:  # a stamp that does not say how strong its verdict was is not used
                why = f"stamped {checked_at}"
                if stamp.state == "uncheckable":
                    why += ": nothing could check its content (no CRCs, no manifest)"
                if trust_stamps or stamp.state not in GOOD_STATES:
                    return stamp.state, why, "stamp"
                vouched = f"; its current stamp ({checked_at}) said {stamp.state}: its bytes changed since"
    state, reason, _ = judge(root, cand, jobs)  # a good one with a suspect note is "suspect"
    if state == "suspect":
        return state, reason, "suspect note"
    return state, reason + (vouched if state == "corrupt" else ""), "verified now"


def _first_error(stamp: Any) -> str:
    """``; first: CHECK: message`` from a failed stamp, naming the check that failed."""
    errors = stamp.data.get("errors")
    first = errors[0] if isinstance(errors, list) and errors and isinstance(errors[0], dict) else None
    if first is None:
        return ""
    count = (stamp.data.get("summary") or {}).get("error", len(errors))
    return f" ({count} error(s); first: {first.get('check')}: {first.get('message')})"


def _quarantined(root: str, cand: Candidate) -> dict[str, Any]:
    stamp = read_stamp(os.path.join(root, cand.path))
    why = "moved aside into quarantine/: never a resume candidate"
    if stamp is not None:
        why += f"; its stamp says {stamp.data.get('verdict', 'passed' if stamp.passed else 'failed')}"
    return {"path": cand.path, "step": cand.step, "state": "quarantined", "reason": why, "how": "quarantine"}


def _may_hide_newer(note: WalkNote, picked_step: int | None) -> bool:
    """Whether the unseen part ``note`` may hold a checkpoint newer than the pick: a cut-short walk may; an unlisted
    folder may unless its name carries a step no newer than the pick's."""
    if note.kind != "unlisted":
        return True
    step = step_of(note.path)
    return picked_step is None or step is None or step > picked_step


def missing_train_state_keys(path: str) -> list[str]:
    """The :data:`TRAIN_STATE_KEYS` the DCP checkpoint at ``path`` lacks, from its metadata via the allowlist reader
    (nothing loaded); ``[]`` when complete or unreadable (verification reports that)."""
    from ckptverify.dcp.metadata import read_all

    try:
        _, _, parsed = read_all(path)
    except (OSError, ValueError, RecursionError):
        return []
    if not parsed:
        return []
    keys = {key for meta in parsed.values() for key in meta.entries}
    return [k for k in TRAIN_STATE_KEYS if k not in keys]


def latest_verified(run_dir: str | os.PathLike[str], *, jobs: int | None = None, use_stamps: bool = True,
                    trust_stamps: bool = False, formats: Collection[str] | None = None, train_state: bool = False,
                    progress: Callable[[str], None] | None = None) -> Latest:
    """The newest checkpoint under ``run_dir`` that verifies (see the module docstring).

    ``use_stamps=False`` verifies every candidate; ``trust_stamps`` lets a current passing stamp pick without reading
    bytes. ``formats``/``train_state`` restrict candidates (newer others are skipped as ``other-format``). When an
    unseen part of the run directory may hide a newer checkpoint, nothing is picked (resuming older would drop
    progress, and later saves could overwrite the hidden one). :class:`CheckpointNotFoundError` when ``run_dir`` is
    not a directory; no good checkpoint gives ``path=None`` and a failing report."""
    root = os.fspath(run_dir)
    if trust_stamps and not use_stamps:
        raise UsageError("trust_stamps and use_stamps=False (--trust-stamps and --no-stamps) contradict each other: "
                         "give one")
    if not paths.isdir(root):
        raise CheckpointNotFoundError(f"not a directory: {root}")
    started = time.perf_counter()
    notes: list[WalkNote] = []
    candidates = sorted(find_checkpoints(root, notes=notes),
                        key=lambda c: (c.step is not None, c.step or 0, c.mtime_ns), reverse=True)
    findings: list[Finding] = []
    result = Latest(path=None, step=None, trust_stamps=trust_stamps)
    examined = 0
    for cand in candidates:
        if is_quarantined(cand.path):
            result.quarantined.append(_quarantined(root, cand))
            continue
        examined += 1
        if progress is not None:
            progress(f"{examined}/{len(candidates)} {cand.path}")
        if formats is not None and cand.format not in formats and cand.format != "dcp-uncommitted":
            state, reason, how = "other-format", f"a {cand.format} checkpoint, not {'/'.join(sorted(formats))}", \
                "format"
        elif train_state and cand.format == "dcp" and (missing := missing_train_state_keys(
                os.path.join(root, cand.path))):
            state, how = "other-format", "keys"
            reason = (f"a DCP export without the TrainState's keys (no {', '.join(missing[:3])}"
                      f"{', ...' if len(missing) > 3 else ''}): weights only, not a checkpoint load restores")
        else:
            state, reason, how = _judge(root, cand, jobs, use_stamps, trust_stamps)
        where = Location(file=cand.path)
        if state in GOOD_STATES:
            result.path, result.step = paths.abspath(os.path.join(root, cand.path)), cand.step
            findings.append(info("latest", f"{cand.path}: {state} ({how}: {reason})", location=where))
            break
        result.skipped.append({"path": cand.path, "step": cand.step, "state": state, "reason": reason,
                               "how": how})
        findings.append(warning("latest-skipped", f"skipped {cand.path}: {state} ({reason})", location=where))
    result.unseen = [n.to_dict() for n in notes]
    blocking = [n for n in notes if _may_hide_newer(n, result.step if result.path is not None else None)]
    if blocking:
        if result.path is not None:
            findings.append(error("latest-unseen", f"not picked: {os.path.relpath(result.path, root)} (step "
                                  f"{result.step}) verifies, but a newer checkpoint may be hidden where the walk "
                                  "could not see", location=Location(file=os.path.relpath(result.path, root))))
        result.path, result.step = None, None
        for n in blocking:
            result.skipped.append({"path": n.path, "step": step_of(n.path), "state": "unseen",
                                   "reason": n.describe(), "how": "walk"})
    findings.extend(unseen_findings(blocking, "latest-unseen", root))
    findings.extend(warning("latest-unseen", f"not seen: {n.describe()}; it cannot hold a checkpoint newer than the "
                            "pick (its name carries an older step)", location=Location(file=n.path))
                    for n in notes if n not in blocking)
    if result.path is None and not blocking:
        findings.append(error("latest-none", f"no checkpoint under {root} verifies "
                              f"({examined} examined)" if examined else f"no checkpoint under {root}"))
    for q in result.quarantined:
        findings.append(info("latest-quarantined", f"not considered: {q['path']}: {q['reason']}",
                             location=Location(file=q["path"])))
    stats = {"seconds": round(time.perf_counter() - started, 6), **result.to_dict()}
    result.report = Report(command="latest", target=root, findings=tuple(findings),
                           coverage=(CheckCoverage(check="latest", count=examined, unit="checkpoints"),),
                           stats=stats)
    return result
