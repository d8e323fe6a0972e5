"""Verify one committed checkpoint and stamp it (for ``watch`` and for saves with ``verify=``).

The verifying lock (``.ckptverify-verifying``, an ``flock``) is held until the stamp is written, so retention
leaves it alone. The files' fingerprint is compared before and after: a verdict is stamped only on the files
verified. A failure is judged after a settle time with nothing moving (a checkpoint being deleted is not corrupt).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import time
from typing import TYPE_CHECKING, Any

from ckptverify.ownfiles.names import VERIFYING_LOCK
from ckptverify.runs.stamp import SETTLE_SECONDS, files_fingerprint, removed, stamp_path, write_stamp
from ckptverify.safeparse.readers import pacing
from ckptverify.verifier.throttle import Throttle
from ckptverify.verifier.verification import Verification, from_report, unverified

if TYPE_CHECKING:
    from ckptverify.findings import Report

__all__ = ["CHANGED", "GONE", "VerifyingLock", "stamp", "stamp_locked", "unmoved", "unreadable", "verify_and_stamp"]

GONE = "removed while it was being verified"
#: Why a verification whose files moved under it gives no verdict.
CHANGED = "its files changed while it was being verified"


class VerifyingLock:
    """The verifying lock of one checkpoint directory (exclusive ``flock`` on ``.ckptverify-verifying``). The file is
    removed on release, while held; a lock on a file removed meanwhile is retaken, so holders never differ in file."""

    def __init__(self, checkpoint: str) -> None:
        # A single file has no directory for a lock: a no-op (two watchers may verify it twice).
        self._checkpoint = checkpoint
        self._single = os.path.lexists(checkpoint) and not os.path.isdir(checkpoint)
        self.path = os.path.join(checkpoint, VERIFYING_LOCK)
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self) -> bool:
        """Take the lock (not held yet) without blocking; ``False`` if held elsewhere. ``FileNotFoundError`` if the
        directory is gone."""
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
        # Finish a retention rmtree our lock file blocked: rmdir removes only an empty folder.
        with contextlib.suppress(OSError):
            os.rmdir(self._checkpoint)


def verify_and_stamp(path: str, *, step: int | None, jobs: int | None = None, deep: bool = False,
                     settle: float = SETTLE_SECONDS) -> Verification:
    """Verify ``path`` and stamp the verdict beside it (see the module docstring).

    Returns a :class:`~ckptverify.verifier.verification.Verification`: ``passed``/``failed`` (unstamped if
    ``stamped`` is false, ``reason`` saying why; the verdict stands), or ``unverified`` with ``no_verdict``
    ``deleted``, ``changed``, ``error`` or ``busy`` (the verifying lock is held elsewhere).
    """
    own = VerifyingLock(path)
    try:
        if not own.acquire():
            return unverified(path, step, "busy", "another process is verifying it", deep=deep)
        return stamp_locked(path, step=step, jobs=jobs, deep=deep, settle=settle)
    except OSError as exc:
        # Gone: no verdict. No lock possible (read-only, foreign file): verify anyway; the verdict stands unstamped.
        if own.held or isinstance(exc, FileNotFoundError):
            return unreadable(path, step, exc, deep=deep)
        return stamp_locked(path, step=step, jobs=jobs, deep=deep, settle=settle)
    finally:
        own.release()


def stamp_locked(path: str, *, step: int | None, jobs: int | None = None, deep: bool = False,
                 settle: float = SETTLE_SECONDS, throttle: Throttle | None = None,
                 unstamped: str | None = None) -> Verification:
    """:func:`verify_and_stamp` for a caller holding the verifying lock (here or in the parent). ``throttle`` paces this
    thread's reads; its waits are recorded as ``throttled_s``. ``unstamped``: why no stamp can be written; the verdict
    on unmoved files is returned unstamped, with that reason."""
    from ckptverify.audit.verify import verify_checkpoint

    started = time.perf_counter()
    try:
        before = files_fingerprint(path)
        with pacing(throttle):
            report = verify_checkpoint(path, jobs=jobs, deep=deep)
        moved = unmoved(path, step, report.passed, before, settle, deep=deep)
    except OSError as exc:  # it could not be read
        return unreadable(path, step, exc, deep=deep)
    if moved is None and unstamped is not None:
        return from_report(path, step, report, seconds=time.perf_counter() - started, stamped=False, reason=unstamped)
    return moved or stamp(path, step, report, before, started, throttle, deep=deep)


def unreadable(path: str, step: int | None, exc: OSError, *, deep: bool = False) -> Verification:
    """No verdict on ``path``, which ``exc`` stopped reading: ``deleted`` when gone, else ``error``."""
    if isinstance(exc, FileNotFoundError):  # CheckpointNotFoundError included
        return unverified(path, step, "deleted", GONE, deep=deep)
    return unverified(path, step, "error", f"{type(exc).__name__}: {exc}", deep=deep)


def unmoved(path: str, step: int | None, passed: bool, before: str, settle: float, *, changed: bool = False,
            deep: bool = False) -> Verification | None:
    """``None`` when a verdict may be stamped on ``path``: its files are still those fingerprinted ``before`` (and not
    ``changed``, as a caller saw); else why not. A failure is judged after ``settle`` seconds."""
    if not passed:
        # Retention deletes a checkpoint file by file: what looks torn may be on its way out. Let it
        # settle, then judge only if nothing moved.
        time.sleep(settle)
    if removed(path):
        return unverified(path, step, "deleted", GONE, deep=deep)
    if changed or files_fingerprint(path) != before:
        # Not a verdict on anything: the files verified are not the files there now.
        return unverified(path, step, "changed", CHANGED, deep=deep)
    return None


def stamp(path: str, step: int | None, report: Report, before: str, started: float, throttle: Throttle | None, *,
          deep: bool = False, **extra: Any) -> Verification:
    """Stamp ``report`` on ``path`` (``extra``: more for :func:`~ckptverify.runs.stamp.write_stamp`); an unwritable
    stamp leaves the verdict standing, unstamped."""
    throttled = None if throttle is None or throttle.probe is None else round(throttle.throttled_s, 6)
    try:
        write_stamp(path, report, step=step, fingerprint=before, throttled_s=throttled, **extra)
    except FileNotFoundError:
        return unverified(path, step, "deleted", GONE, deep=deep)
    except OSError as exc:  # e.g. a read-only run directory: the verdict stands, unstamped
        return from_report(path, step, report, seconds=time.perf_counter() - started, stamped=False,
                           reason=f"not stamped: {type(exc).__name__}: {exc}", throttled_s=throttled or 0.0)
    return from_report(path, step, report, seconds=time.perf_counter() - started, stamped=True,
                       stamp=stamp_path(path), throttled_s=throttled or 0.0)
