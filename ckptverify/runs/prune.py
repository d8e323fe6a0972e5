"""Retention that never deletes what a restart would need.

:func:`prune` keeps the ``keep`` newest checkpoints (by step) and deletes older ones, except: the newest that
verifies (also the newest DCP, and the newest holding a TrainState: a newer export is nothing to resume from); a
stamped failure (evidence); one being verified or saved right now (locked); unknown steps and non-checkpoints;
anything in ``quarantine/``. Traps: nothing is deleted when the walk did not see the whole run directory (it cannot
know what is newest: :class:`CkptVerifyError`); deletion never follows a link or leaves the run directory."""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
from dataclasses import asdict, dataclass, field
from typing import Any

from ckptverify.errors import CheckpointNotFoundError, CkptVerifyError, UsageError
from ckptverify.formats.rundir import find_checkpoints
from ckptverify.ownfiles.names import SAVE_MARKER, VERIFYING_LOCK
from ckptverify.runs.stamp import read_stamp
from ckptverify.runs.states import is_quarantined
from ckptverify.safeparse.paths import WalkNote

__all__ = ["PruneResult", "is_locked", "prune"]


@dataclass
class PruneResult:
    deleted: list[str] = field(default_factory=list)
    kept: list[dict[str, Any]] = field(default_factory=list)
    dry_run: bool = False

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def is_locked(path: str) -> bool:
    """Whether another process holds an ``flock`` on ``path`` (a missing file is not locked)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0))
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)  # released as the descriptor closes
    except BlockingIOError:
        return True
    except OSError:
        return False
    finally:
        os.close(fd)
    return False


def prune(run_dir: str | os.PathLike[str], *, keep: int, dry_run: bool = False, jobs: int | None = None) -> PruneResult:
    """Delete all but the ``keep`` newest checkpoints of ``run_dir``, with the module docstring's exceptions;
    ``dry_run`` deletes nothing. Returns what was deleted and what was kept, and why."""
    from ckptverify.runs.latest import latest_verified

    root = os.path.realpath(os.fspath(run_dir))
    if keep < 1:
        raise UsageError(f"keep must be at least 1, got {keep}")
    if not os.path.isdir(root):
        raise CheckpointNotFoundError(f"not a directory: {root}")
    notes: list[WalkNote] = []
    found = find_checkpoints(root, notes=notes)
    if notes:
        raise CkptVerifyError(
            f"prune deleted nothing: the walk of {root} did not see all of it, so it cannot tell which checkpoints "
            f"are the newest: {'; '.join(n.describe() for n in notes)}. Make it visible (permissions), move what is "
            "not a checkpoint out of the run directory, or prune the folder that holds the checkpoints.")
    candidates = [c for c in found if c.step is not None and not is_quarantined(c.path)]
    newest_first = sorted(candidates, key=lambda c: (c.step, c.mtime_ns), reverse=True)
    protected: dict[str, str] = {}
    # load's need first, so the kept reason names the strongest one.
    for formats, train_state, reason in (
            ({"dcp"}, True, "the newest checkpoint that verifies that load restores (DCP, holding a TrainState)"),
            ({"dcp"}, False, "the newest checkpoint that verifies of the format load restores (DCP)"),
            (None, False, "the newest checkpoint that verifies")):
        good = latest_verified(root, jobs=jobs, formats=formats, train_state=train_state)
        if good.unseen:  # the run directory changed since the walk above: decide nothing on a partial view
            raise CkptVerifyError(f"prune deleted nothing: the walk of {root} did not see all of it: "
                                  f"{'; '.join(WalkNote(**u).describe() for u in good.unseen)}")
        if good.path is not None:
            protected.setdefault(os.path.relpath(good.path, root), reason)
    result = PruneResult(dry_run=dry_run)
    for n, cand in enumerate(newest_first):
        path = os.path.join(root, cand.path)
        why = None
        if n < keep:
            why = f"one of the {keep} newest"
        elif cand.path in protected:
            why = protected[cand.path]
        elif (stamp := read_stamp(path)) is not None and not stamp.passed:  # current or not
            why = "failed verification: kept as evidence, never deleted"
        elif cand.kind == "dir" and (is_locked(os.path.join(path, VERIFYING_LOCK))
                                     or is_locked(os.path.join(path, SAVE_MARKER))):
            why = "being verified or saved right now"
        elif os.path.islink(path) or not os.path.realpath(path).startswith(root + os.sep):
            why = "not inside the run directory"
        if why is not None:
            result.kept.append({"path": cand.path, "step": cand.step, "why": why})
            continue
        if not dry_run:
            with contextlib.suppress(FileNotFoundError):
                if cand.kind == "dir":
                    shutil.rmtree(path)
                else:
                    os.unlink(path)
        result.deleted.append(cand.path)
    return result
