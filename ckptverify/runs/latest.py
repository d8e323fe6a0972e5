"""The newest checkpoint of a run that verifies: what a restarted job should resume from.

Checkpoints are tried newest first (by step). A *current* verification stamp
(:mod:`~ckptverify.runs.stamp`) that says a checkpoint is not good (failed, uncheckable, suspect) skips it; one
without a stamp, or with a stale one, is verified on the spot. The checkpoint about to be named is always
verified afresh, whole, even under a current stamp that says it passed: a stamp is current by the files' size,
time and inode, which a bit flipped in place (bit rot, with the time put back) leaves unchanged. When that
verification fails, it is skipped with why and the next older one is tried. ``trust_stamps`` (``latest
--trust-stamps``) takes a current passing stamp at its word instead: the fast path for a caller that proves the
bytes again as it reads them (``load``, a production job's resume). The first one that is ``verified`` or
``intact`` wins; every newer one is listed as skipped, with why (corrupt, torn, incomplete, uncheckable,
suspect, a format that is not read). Nothing is written, moved or deleted.

A **suspect** checkpoint (saved after the job saw its replicas disagree: a suspect note in the folder or in its
stamp, :func:`~ckptverify.runs.stamp.read_suspect`) is never picked, whatever its bytes verify to.

**Quarantine.** A production job never overwrites a checkpoint that failed verification: before it could save
over one, it moves it aside, whole, into ``RUN_DIR/quarantine/`` as ``step_N.moved-<UTC time>``
(:func:`move_aside`). A checkpoint under ``quarantine/`` is never a resume candidate (it is listed in
``quarantined``, not judged), never deleted by :func:`~ckptverify.runs.prune.prune`, and still shown by
``scan``.
"""

from __future__ import annotations

import datetime as _dt
import errno
import os
import re
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Any

from ckptverify.errors import CheckpointNotFoundError, CkptVerifyError, UsageError
from ckptverify.findings import CheckCoverage, Finding, Location, Report, error, info, warning
from ckptverify.formats.rundir import Candidate, WalkNote, find_checkpoints, step_of
from ckptverify.ownfiles.names import open_own_dir
from ckptverify.runs.scan import judge, unseen_findings
from ckptverify.runs.stamp import describe_suspect, read_stamp, read_suspect
from ckptverify.runs.states import GOOD_STATES, QUARANTINE_DIR, is_quarantined
from ckptverify.safeparse import paths

__all__ = [
    "QUARANTINE_DIR",
    "TRAIN_STATE_KEYS",
    "Latest",
    "is_quarantined",
    "latest_verified",
    "missing_train_state_keys",
    "move_aside",
]

#: Entries every :class:`~ckptverify.state.train_state.TrainState` saves, whatever it holds: a DCP checkpoint
#: without them is no TrainState checkpoint (a weights-only export) and ``load`` cannot restore it.
TRAIN_STATE_KEYS = ("version", "world_size", "rng.version", "rng.world_size", "counters.step", "counters.epoch",
                    "counters.samples_seen", "counters.tokens_seen")
_OWN_NAME = re.compile(r"^step_\d+$")


def is_own_step_dir(rel_path: str) -> bool:
    """Whether ``rel_path`` is a ``step_N`` folder at the top of the run directory: where a production job
    saves, so what a save of it could overwrite."""
    return "/" not in rel_path.replace(os.sep, "/") and bool(_OWN_NAME.match(rel_path))


def move_aside(run_dir: str | os.PathLike[str], rel_path: str) -> str:
    """Move the checkpoint ``rel_path`` of ``run_dir`` into the quarantine, whole (one ``rename``: its files,
    stamp and notes keep their bytes, inodes and times, so a current stamp stays current); return its new path
    relative to ``run_dir``. Never overwrites: an existing name gets a counter.

    The quarantine is a folder of ``run_dir`` (:func:`~ckptverify.ownfiles.names.open_own_dir`: a link there is
    never followed out of it), and the checkpoint is renamed into it, never copied and deleted. Raises
    :class:`~ckptverify.errors.CkptVerifyError` (nothing moved) when it cannot be: a link or a file at
    ``quarantine``, another file system, no permission."""
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
            try:
                os.lstat(name, dir_fd=fd)
                continue
            except FileNotFoundError:
                pass
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
    """The pick: ``path`` (absolute) and ``step`` of the newest good checkpoint, or ``None``; ``skipped`` lists
    the newer ones passed over; ``quarantined`` the checkpoints moved aside into ``quarantine/`` (never
    candidates); ``report`` holds one finding per checkpoint examined."""

    path: str | None
    step: int | None
    skipped: list[dict[str, Any]] = field(default_factory=list)
    report: Report | None = None
    quarantined: list[dict[str, Any]] = field(default_factory=list)
    #: What the walk of the run directory could not see (:meth:`WalkNote.to_dict`), whether or not it blocked
    #: the pick.
    unseen: list[dict[str, Any]] = field(default_factory=list)

    #: Whether a current passing stamp was taken at its word (``trust_stamps``) rather than the pick verified
    #: afresh.
    trust_stamps: bool = False

    def to_dict(self) -> dict[str, Any]:
        return {"path": self.path, "step": self.step, "skipped": self.skipped, "quarantined": self.quarantined,
                "unseen": self.unseen, "trust_stamps": self.trust_stamps}


def _judge(root: str, cand: Candidate, jobs: int | None, use_stamps: bool,
           trust_stamps: bool) -> tuple[str, str, str]:
    """State, reason, and how it was decided (``stamp``, ``suspect note`` or ``verified now``). A current stamp
    that says good decides only with ``trust_stamps``; otherwise the checkpoint is verified now."""
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
    state, reason, _ = judge(root, cand, jobs)
    if state in GOOD_STATES:
        suspect = read_suspect(path)
        if suspect is not None:
            return "suspect", describe_suspect(suspect), "suspect note"
        return state, reason, "verified now"
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
    """Whether the part of the run directory ``note`` says was not seen may hold a checkpoint newer than the
    pick: anything a cut-short walk did not reach may; a folder that could not be listed may, unless its own
    name carries a step no newer than the pick's."""
    if note.kind != "unlisted":
        return True
    step = step_of(note.path)
    return picked_step is None or step is None or step > picked_step


def missing_train_state_keys(path: str) -> list[str]:
    """The :data:`TRAIN_STATE_KEYS` the DCP checkpoint at ``path`` lacks, read from its metadata through the
    allowlist reader (nothing is loaded or executed); ``[]`` when it has them all or its metadata cannot be read
    (verification then says what is wrong with it)."""
    from ckptverify.dcp.metadata import read_all

    try:
        _, _, parsed = read_all(path)
    except (OSError, ValueError, RecursionError):
        return []
    if not parsed:
        return []
    keys: set[str] = set()
    for meta in parsed.values():
        keys.update(meta.entries)
    return [k for k in TRAIN_STATE_KEYS if k not in keys]


def latest_verified(run_dir: str | os.PathLike[str], *, jobs: int | None = None, use_stamps: bool = True,
                    trust_stamps: bool = False, formats: Collection[str] | None = None, train_state: bool = False,
                    progress: Callable[[str], None] | None = None) -> Latest:
    """The newest checkpoint under ``run_dir`` that verifies; see the module docstring. ``progress``: called
    with one line per candidate as it is examined, newest first.

    ``use_stamps=False``: no stamp is read, every candidate is verified now. ``trust_stamps``: a current stamp
    that says passed picks its checkpoint without reading its bytes (the fast path; only for a caller that
    proves them again as it reads them). By default the pick is verified afresh, whole, whatever its stamp says.

    ``formats``: consider only checkpoints of these formats (``find_checkpoints``' names, e.g. ``{"dcp"}`` for
    what :func:`ckptverify.load` restores); newer ones of other formats are listed as skipped, with why.
    ``train_state``: consider only DCP checkpoints that hold a TrainState (:data:`TRAIN_STATE_KEYS`, read from
    the metadata before anything is verified or loaded); a newer weights-only DCP export is skipped as
    ``other-format``, with why.

    **What the walk could not see.** When part of the run directory could not be seen
    (:class:`~ckptverify.formats.rundir.WalkNote`) and it may hold a checkpoint newer than the pick (the walk was
    cut short; or a folder could not be listed whose name carries no step, or a newer one), nothing is picked:
    ``path=None``, each such part is in ``skipped`` with state ``unseen``, and the report fails with what to do.
    An unlisted folder whose name carries an older step is a warning; the pick stands. ``unseen`` lists all.

    Raises :class:`~ckptverify.errors.CheckpointNotFoundError` when ``run_dir`` is not a directory. A run
    directory with no good checkpoint gives ``path=None`` and a report that fails.
    """
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
        # A newer checkpoint may be hidden: resuming from an older one would drop training progress, and a job
        # that then saves its steps again could write over the hidden one. Refuse, and say what was not seen.
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
