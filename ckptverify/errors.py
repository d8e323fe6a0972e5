"""Errors for "the tool could not run" (exit code 2).

Anything a check *concludes* about a checkpoint is a :class:`~ckptverify.findings.Finding`, never an
exception. Exceptions are reserved for situations where no conclusion can be drawn: bad arguments, a path
that does not exist, an environment that cannot run the check. Every error knows its exit code, so front
ends catch :class:`CkptVerifyError` once at the boundary.
"""

from __future__ import annotations


class CkptVerifyError(Exception):
    """Root of all ckptverify errors. ``exit_code`` is what the command line exits with."""

    exit_code = 2


class UsageError(CkptVerifyError, ValueError):
    """The caller asked for something that cannot be done (bad option, inconsistent arguments)."""


class CheckpointNotFoundError(CkptVerifyError, FileNotFoundError):
    """The checkpoint path does not exist or is not a directory."""


class ManifestExistsError(CkptVerifyError, FileExistsError):
    """A manifest is already present and overwriting it was not requested."""


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
    """A checkpoint failed verification and the caller asked for it to be refused.

    Carries the report whose findings explain the refusal.
    """

    exit_code = 1

    def __init__(self, message: str, report: object | None = None) -> None:
        super().__init__(message)
        self.report = report


class ProofFailedError(CheckpointRefusedError):
    """Bytes being loaded failed their proof (a manifest digest, a zip CRC-32, the archive structure) in the read
    that loaded them; nothing was applied. ``info`` names the item and the check (see ``docs/state.md``)."""

    def __init__(self, message: str, report: object | None = None, info: dict | None = None) -> None:
        super().__init__(message, report)
        self.info = dict(info or {})


class UnsafeMetadataError(CheckpointRefusedError):
    """DCP asked for metadata the safe reader refuses (hostile, malformed, or a second entry point)."""


class SaveFailedError(CkptVerifyError):
    """A save did not commit (some rank failed while planning, writing or committing).

    The directory holds no committed checkpoint of this save: if the save got as far as marking it, it is
    marked as not committed and ``verify``/``load`` refuse it. ``failures`` maps each failed rank to its
    exception (as DCP reported them); the DCP exception is the ``__cause__``.
    """

    def __init__(self, message: str, failures: dict[int, BaseException] | None = None) -> None:
        super().__init__(message)
        self.failures = dict(failures or {})


class SaveConflictError(SaveFailedError):
    """Another save into the same directory is in progress; this one wrote nothing."""


class LoadFailedError(CkptVerifyError):
    """A checkpoint could not be loaded into the given state (DCP failed, or a saved field does not fit).

    Raised only before anything was changed: the state is exactly what it was before the call.
    """


class VerifyFailedError(CkptVerifyError):
    """A checkpoint saved with ``verify=`` and ``on_verify_failure="raise"`` failed its verification.

    Raised by the save that learns of it (see ``docs/verify-after-save.md``); ``verification`` is the
    :class:`~ckptverify.verifier.background.Verification` of the checkpoint that failed.
    """

    exit_code = 1

    def __init__(self, message: str, verification: object | None = None) -> None:
        super().__init__(message)
        self.verification = verification
