"""Every exception and warning class of ckptverify, in one tree.

Anything a check *concludes* about a checkpoint is a :class:`~ckptverify.findings.Finding`, never an
exception. Exceptions are reserved for situations where no conclusion can be drawn: bad arguments, a path
that does not exist, an environment that cannot run the check. Every error knows its exit code, so front
ends catch :class:`CkptVerifyError` once at the boundary.

A class exists only where some caller tells it apart from its parent (an exit code, an ``except``, an
attribute); anything else is raised as its parent, and the message says what happened. Exit 1 (a checkpoint
failed): :class:`CheckpointRefusedError`, :class:`VerifyFailedError`, :class:`ReplicaMismatchError`; a
:class:`FindingError` is raised by a reader and turned into a finding, never meant to reach a user; every other
error exits 2. Warnings derive from :class:`CkptVerifyWarning`.

A message of several lines (a workload's traceback, an unusable target's) is printed line by line.

Several are also a standard exception (``ValueError``, ``OSError``, ``pickle.UnpicklingError``),
so code that catches those catches them too.
"""

from __future__ import annotations

import pickle
from collections.abc import Sequence
from typing import Any


class CkptVerifyError(Exception):
    """Root of all ckptverify errors. ``exit_code`` is what the command line exits with."""

    exit_code = 2


class UsageError(CkptVerifyError, ValueError):
    """The caller asked for something that cannot be done (bad option, inconsistent arguments)."""


class CheckpointNotFoundError(CkptVerifyError, FileNotFoundError):
    """The checkpoint path does not exist or is not a directory."""


class _FileError(CkptVerifyError, OSError):
    """An error about one file; ``path`` is that file's path."""

    def __init__(self, message: str, path: str | None = None) -> None:
        super().__init__(message)
        self.path = path


class UnsafeFileError(_FileError):
    """A file was not opened because opening or reading it could hang, exhaust memory or leave the checkpoint:
    it is not a regular file (FIFO, device, socket, directory), it resolves outside the checkpoint directory,
    or it is larger than the limit for its role. Checks turn it into a finding."""


class FileChangedError(_FileError):
    """A file changed while it was being read (it shrank, grew, or was rewritten or replaced).

    What was read is no evidence about what is on disk now; checks turn it into a ``file-changed`` finding.
    """


class CheckpointRefusedError(CkptVerifyError):
    """A checkpoint failed verification and the caller asked for it to be refused, or its metadata is what the
    safe reader refuses (hostile, malformed, or a second entry point) when DCP asks for it.

    Carries the report whose findings explain the refusal.
    """

    exit_code = 1

    def __init__(self, message: str, report: object | None = None) -> None:
        super().__init__(message)
        self.report = report


class ProofFailedError(CheckpointRefusedError):
    """Bytes being loaded failed their proof (a manifest digest, a zip CRC-32, the archive structure) in the read
    that loaded them; nothing was applied. ``info`` names the item and the check (see ``docs/state.md``):
    ``check`` (``manifest-digest``, ``manifest-mismatch``, ``zip-crc``, ``zip-structure``, ``item-bounds``,
    ``manifest-invalid``), ``fqn``, ``chunk_offsets``, ``file``, ``byte_range``, ``expected``, ``actual``. Raised
    by the reader on the rank that read the item, it crosses ranks inside DCP's ``CheckpointException``
    (pickled, so ``info`` holds only plain values); ``load`` raises it again on every rank with the ``report``."""

    def __init__(self, message: str, report: object | None = None, info: dict | None = None) -> None:
        super().__init__(message, report)
        self.info = dict(info or {})

    def __reduce__(self) -> tuple[Any, ...]:
        return type(self), (str(self), self.report, self.info)


class SaveFailedError(CkptVerifyError):
    """A save did not commit (some rank failed while planning, writing or committing), or another save into the
    same directory is in progress and this one wrote nothing (the message says so).

    The directory holds no committed checkpoint of this save: if the save got as far as marking it, it is
    marked as not committed and ``verify``/``load`` refuse it. ``failures`` maps each failed rank to its
    exception (as DCP reported them); the DCP exception is the ``__cause__``.
    """

    def __init__(self, message: str, failures: dict[int, BaseException] | None = None) -> None:
        super().__init__(message)
        self.failures = dict(failures or {})


class VerifyFailedError(CkptVerifyError):
    """A checkpoint saved with ``verify=`` and ``VerifyOptions(on_failure="raise")`` failed its verification.

    Raised by the save that learns of it (see ``docs/verify-after-save.md``); ``verification`` is the
    :class:`~ckptverify.verifier.verification.Verification` of the checkpoint that failed.
    """

    exit_code = 1

    def __init__(self, message: str, verification: object | None = None) -> None:
        super().__init__(message)
        self.verification = verification


class FindingError(CkptVerifyError):
    """Raised by a reader or a check inside ckptverify and turned into a finding (or a refusal) by its caller:
    what the input is, not that the tool could not run. Never meant to reach a user as itself."""


def reported_as_itself(exc: BaseException) -> bool:
    """Whether ``exc`` is a ckptverify error meant for the caller as it is (every :class:`CkptVerifyError` but a
    :class:`FindingError`): code that wraps what it does not expect passes these through unchanged."""
    return isinstance(exc, CkptVerifyError) and not isinstance(exc, FindingError)


def dcp_failures(exc: BaseException) -> dict[int, BaseException]:
    """The per-rank exceptions DCP wrapped in a ``CheckpointException`` (``{rank: (exc, trace)}``)."""
    raw = getattr(exc, "failures", None)
    if not isinstance(raw, dict):
        return {}
    out: dict[int, BaseException] = {}
    for rank, pair in raw.items():
        inner = pair[0] if isinstance(pair, tuple) and pair else pair
        if isinstance(inner, BaseException):
            out[rank] = inner
    return out


def first_failure(exc: BaseException) -> str:
    """The lowest rank's failure DCP reported (its ``CheckpointException`` text is a traceback per rank)."""
    failures = dcp_failures(exc)
    if failures:
        rank = min(failures)
        return f"rank {rank} failed: {type(failures[rank]).__name__}: {failures[rank]}"
    return f"{type(exc).__name__}: {exc}"


# ------------------------------------------------------------------ readers (safeparse, dcp, ownfiles)


class JSONError(FindingError, ValueError):
    """The bytes are not JSON this tool accepts (malformed, too large, too deep, non-finite, repeated keys)."""


class BadPickle(FindingError):
    """A pickle (DCP metadata, a ``torch.save`` data.pkl) is refused: malformed, larger or nested deeper than
    the safe unpicklers allow, asking for more work than its size justifies (a memoized "billion laughs"), or
    not the structure its writer makes. The message says which."""


class UnsafeGlobal(FindingError, pickle.UnpicklingError):
    """The pickle names a global outside the allowlist; nothing was resolved."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.name = name


class ArchiveError(FindingError):
    """The bytes are not a well-formed container (a ``torch.save`` archive, a safetensors blob); the message
    says which. ``start``/``end`` locate the bad bytes when known."""

    def __init__(self, message: str, start: int | None = None, end: int | None = None) -> None:
        super().__init__(message)
        self.start = start
        self.end = end


class TransformError(FindingError, ValueError):
    """The item's stream cannot be decoded. ``unavailable``: no decoder here (not damage)."""

    def __init__(self, message: str, *, unavailable: bool = False) -> None:
        super().__init__(message)
        self.unavailable = unavailable


class ManifestError(FindingError):
    """The manifest is unreadable, truncated, edited, or of an unknown schema. Becomes a finding."""


class NotRegularFileError(CkptVerifyError, OSError):
    """What is at the path of one of ckptverify's own files is not a regular file (a symbolic link, a FIFO, a
    device, a socket, a directory), or what is at one of its own folders is not a directory (a link, a file): it
    is neither written through, moved into nor replaced. An ``OSError``, so a caller that copes with an unwritable
    file copes with this one too."""


class StorageError(_FileError):
    """An object store (or remote file system) did not serve a read or a listing after every retry (throttled
    too long, unreachable, access denied): nothing can be said about the checkpoint, so the command could not
    run (exit 2), naming the object. Never turned into a finding about the checkpoint."""


# ------------------------------------------------------------------ training state, traces, runs


class TraceHeaderMismatchError(UsageError):
    """Two traces describe different things (level, workload, world size, versions, config). The message says
    what differs and nothing of what to do: each caller names its own way to compare anyway (``force=True`` of
    the Python API, ``trace diff --allow-header-mismatch``), or none."""

    def __init__(self, fields: Sequence[str], a: Any, b: Any) -> None:
        da, db = a.header.to_dict(), b.header.to_dict()
        detail = "; ".join(f"{name}: {da.get(name)!r} vs {db.get(name)!r}" for name in fields)
        super().__init__(f"trace headers differ ({', '.join(fields)}): {detail} — {a.path} vs {b.path}")
        self.fields = tuple(fields)


class ResumeRefusedError(UsageError):
    """The production job will not start: ``resume=`` forbids what the run directory holds (checkpoints that all
    fail, nothing to resume from, or good checkpoints that ``resume="never"`` would bury). Nothing was changed."""


class ReplicaMismatchError(CkptVerifyError):
    """Replicas that must be identical differ (``on_replica_mismatch="raise"``): a hardware fault is likely.
    ``mismatch`` is the :class:`~ckptverify.hardware.replica.ReplicaMismatch`."""

    exit_code = 1

    def __init__(self, message: str, mismatch: Any) -> None:
        super().__init__(message)
        self.mismatch = mismatch


# ------------------------------------------------------------------ warnings


class CkptVerifyWarning(UserWarning):
    """Root of every warning ckptverify issues: ``warnings.filterwarnings("error", category=CkptVerifyWarning)``
    turns them all into errors. Issued as itself for all but a failed verification: replicas that must be
    identical differ (``on_replica_mismatch="warn"``), a checkpoint left without a verdict (the job ended first,
    or its files changed while verified), or something around a check that went wrong and was passed over (an
    event not appended, a callback raised)."""


class VerifyFailedWarning(CkptVerifyWarning):
    """A checkpoint failed its verification after it was saved (by ``save``, ``Run`` or a framework
    integration), or one a framework was asked to load failed it."""
