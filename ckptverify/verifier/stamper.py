"""Verify one committed checkpoint and stamp it: what ``watch`` does for each checkpoint, and what a save with
``verify=`` does once it has committed.

The checkpoint's verifying lock (``.ckptverify-verifying``, an ``flock``) is held from before the verification
until the stamp is written, so retention (:func:`~ckptverify.runs.prune.prune`) leaves it alone meanwhile. The
directory's fingerprint is taken before the verification and compared after it: a verdict is stamped only on
the files that were verified. A failed verification is judged only after a short settle time in which nothing
moved, so a checkpoint being deleted file by file is not reported corrupt.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import time
from dataclasses import dataclass

from ckptverify.errors import CheckpointNotFoundError
from ckptverify.findings import Report
from ckptverify.ownfiles.names import SAVE_MARKER, VERIFYING_LOCK
from ckptverify.runs.stamp import files_fingerprint, write_stamp
from ckptverify.verifier.throttle import Throttle

__all__ = ["SETTLE_SECONDS", "Outcome", "VerifyingLock", "committed", "removed", "stamp_locked", "verify_and_stamp"]

#: After a failed verification, how long to wait before judging: a checkpoint being deleted file by file must
#: not be reported as corrupt.
SETTLE_SECONDS = 1.0
_METADATA = ".metadata"


def committed(path: str) -> bool:
    """Whether ``path`` holds a DCP checkpoint whose save finished: its ``.metadata`` is in place and no
    ckptverify save is in progress in it."""
    try:
        names = set(os.listdir(path))
    except OSError:  # gone (retention), or not a directory
        return False
    has_metadata = _METADATA in names or any(n.startswith("__") and n.endswith(".metadata") for n in names)
    return has_metadata and SAVE_MARKER not in names


def removed(path: str) -> bool:
    """Whether the checkpoint at ``path`` was removed (or, for DCP, lost its metadata: retention under way)."""
    if os.path.isdir(path):
        from ckptverify.formats.rundir import dir_format

        try:
            names = os.listdir(path)
        except OSError:
            return True
        return dir_format(names) == "dcp-uncommitted" or (dir_format(names) == "dcp" and not committed(path))
    return not os.path.isfile(path)


class VerifyingLock:
    """The verifying lock of one checkpoint directory (an exclusive ``flock`` on ``.ckptverify-verifying``).

    The lock file is removed on release, while still held. A lock taken on a file that was removed (or
    replaced) in the meantime is dropped and taken again, so two holders never hold two different files.
    """

    def __init__(self, checkpoint: str) -> None:
        # A single-file checkpoint has no directory to hold a lock: nothing is created beside it, and the
        # lock is a no-op (two watchers may verify it twice; retention of single files does not wait).
        self._checkpoint = checkpoint
        self._single = os.path.lexists(checkpoint) and not os.path.isdir(checkpoint)
        self.path = os.path.join(checkpoint, VERIFYING_LOCK)
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self) -> bool:
        """Take the lock without blocking; ``False`` when someone else holds it. Raises ``FileNotFoundError``
        when the checkpoint directory is gone."""
        if self._fd is not None:
            return True
        if self._single:
            if not os.path.isfile(self._checkpoint):
                raise FileNotFoundError(self._checkpoint)
            self._fd = -1
            return True
        flags = os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
        for _ in range(8):
            fd = os.open(self.path, flags, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                return False
            try:
                same = os.fstat(fd).st_ino == os.stat(self.path, follow_symlinks=False).st_ino
            except FileNotFoundError:
                same = False
            if same:
                self._fd = fd
                return True
            os.close(fd)  # the previous holder removed this file as it let go: take the new one
        return False

    def release(self) -> None:
        if self._fd is None:
            return
        if self._fd == -1:  # the no-op lock of a single file
            self._fd = None
            return
        try:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)
        finally:
            os.close(self._fd)
            self._fd = None


@dataclass(frozen=True, slots=True)
class Outcome:
    """What :func:`verify_and_stamp` did. ``event``: ``verified`` or ``failed`` (a verdict, stamped unless
    ``stamped`` is false: then ``reason`` says why the stamp could not be written; the verdict stands all the
    same), ``deleted`` (removed while being verified), ``changed`` (its files changed while being verified: no
    verdict, no stamp), ``error`` (it could not be verified: ``reason`` says why) or ``busy`` (someone else holds
    the verifying lock)."""

    event: str
    report: Report | None = None
    reason: str | None = None
    seconds: float = 0.0
    #: Of ``seconds``, those spent waiting for an idle core (:mod:`~ckptverify.verifier.throttle`).
    throttled_s: float = 0.0
    #: Whether the verdict was written beside the checkpoint.
    stamped: bool = True


def verify_and_stamp(path: str, *, step: int | None, jobs: int | None = None, deep: bool = False,
                     settle: float = SETTLE_SECONDS, lock: VerifyingLock | None = None,
                     throttle: Throttle | None = None) -> Outcome:
    """Verify the checkpoint at ``path`` and stamp the verdict beside it; see the module docstring.

    ``lock``: the checkpoint's verifying lock, already held by the caller (released here); by default it is
    taken here, and the outcome is ``busy`` when someone else holds it. ``throttle``: see :func:`stamp_locked`.
    """
    own = lock if lock is not None else VerifyingLock(path)
    try:
        if not own.held and not own.acquire():
            return Outcome("busy", reason="another process is verifying it")
        return stamp_locked(path, step=step, jobs=jobs, deep=deep, settle=settle, throttle=throttle)
    except (FileNotFoundError, CheckpointNotFoundError):
        return Outcome("deleted", reason="removed while it was being verified")
    except OSError as exc:
        # The lock cannot be created (a read-only run directory, something not ours at its name): verify all the
        # same; the verdict is reported whether or not it can be stamped.
        if own.held:
            return Outcome("error", reason=f"{type(exc).__name__}: {exc}")
        return stamp_locked(path, step=step, jobs=jobs, deep=deep, settle=settle, throttle=throttle)
    finally:
        own.release()


def stamp_locked(path: str, *, step: int | None, jobs: int | None = None, deep: bool = False,
                 settle: float = SETTLE_SECONDS, throttle: Throttle | None = None) -> Outcome:
    """:func:`verify_and_stamp` for a caller that holds the checkpoint's verifying lock (in this process or in
    the one that started this one). ``throttle``: paces this thread's reads (with ``jobs=1``, all of them); the
    seconds it waited are recorded in the stamp and the outcome as ``throttled_s``."""
    from ckptverify.audit.verify import verify_checkpoint
    from ckptverify.safeparse.readers import pacing

    started = time.perf_counter()
    try:
        before = files_fingerprint(path)
        with pacing(throttle):
            report = verify_checkpoint(path, jobs=jobs, deep=deep)
        if not report.passed:
            # Retention deletes a checkpoint file by file: what looks torn may be on its way out. Let it
            # settle, then judge only if nothing moved.
            time.sleep(settle)
        if removed(path):
            return Outcome("deleted", reason="removed while it was being verified")
        if files_fingerprint(path) != before:
            # Not a verdict on anything: the files verified are not the files there now.
            return Outcome("changed", reason="its files changed while it was being verified")
        throttled = None if throttle is None or throttle.probe is None else round(throttle.throttled_s, 6)
    except (FileNotFoundError, CheckpointNotFoundError):
        return Outcome("deleted", reason="removed while it was being verified")
    except OSError as exc:  # it could not be read
        return Outcome("error", reason=f"{type(exc).__name__}: {exc}")
    event = "verified" if report.passed else "failed"
    try:
        write_stamp(path, report, step=step, fingerprint=before, throttled_s=throttled)
    except (FileNotFoundError, CheckpointNotFoundError):
        return Outcome("deleted", reason="removed while it was being verified")
    except OSError as exc:  # e.g. a read-only run directory: the verdict stands, unstamped
        return Outcome(event, report=report, reason=f"not stamped: {type(exc).__name__}: {exc}",
                       seconds=time.perf_counter() - started, throttled_s=throttled or 0.0, stamped=False)
    return Outcome(event, report=report, seconds=time.perf_counter() - started, throttled_s=throttled or 0.0)
