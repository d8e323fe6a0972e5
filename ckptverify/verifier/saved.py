"""The check an integration runs on a checkpoint it just saved (:func:`check_saved`), inline or as the
``check-saved`` job (:func:`saved_job`): verify; fingerprint (write a manifest) when content no checksum protects
or with ``fingerprint=True``, and verify against it; stamp. Gives a
:class:`~ckptverify.verifier.verification.Verification` and its event name."""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import replace
from typing import Any, Literal

from ckptverify.errors import reported_as_itself
from ckptverify.findings import Report
from ckptverify.formats.describe import is_own_file
from ckptverify.runs.stamp import files_fingerprint, removed, stamp_path
from ckptverify.verifier.parts import adoption_note, stamp_parts_locked
from ckptverify.verifier.stamper import CHANGED
from ckptverify.verifier.verification import Verification, event_of, from_report, unverified

__all__ = ["Fingerprint", "cannot_verify", "check_saved", "remove_beside", "saved_job", "stopped_by", "verification_of",
           "was_deleted"]

Fingerprint = bool | Literal["auto"]


def verification_of(path: str, report: Report, step: int | None, seconds: float, stamp: str | None,
                    reason: str | None = None) -> Verification:
    """The :class:`~ckptverify.verifier.verification.Verification` of ``report``, with the integrations' message
    (``PATH fails verification with N error(s); first: CHECK (WHERE): MESSAGE``, or what passed)."""
    result = from_report(path, step, report, seconds=seconds, stamped=stamp is not None, stamp=stamp, reason=reason)
    if report.errors:
        first = report.errors[0]
        message = (f"{path} fails verification with {result.summary.get('error', 0)} error(s); first: {first.check} "
                   f"({first.location.describe() or '?'}): {first.message}")
    else:
        against = " against its manifest" if result.manifest else ""
        message = f"{path} passed verification{against}: {_checked_text(report)}"
        if result.unchecked:
            message += f"; no checksum covers {', '.join(result.unchecked[:4])}"
    return replace(result, message=message)


def _checked_text(report: Report) -> str:
    """``N bytes; 184 zip-crc records, 28 manifest-digest blocks`` (the checks that read the content)."""
    key = [c for c in report.coverage if c.count and c.check in ("zip-crc", "manifest-digest", "tensor-record")]
    parts = [f"{c.count} {c.check} {c.unit}" for c in key or [c for c in report.coverage if c.count][:3]]
    return f"{int(report.stats.get('bytes', 0) or 0)} bytes; {', '.join(parts) or 'nothing'}"


def cannot_verify(path: str, why: str, step: int | None = None, seconds: float = 0.0) -> Verification:
    """A failed verification of a checkpoint that could not be verified at all (missing, not one, remote)."""
    return Verification(path=path, step=step, verdict="failed", summary={"error": 1},
                        first_error=f"not-verified: {why}", seconds=round(seconds, 6),
                        errors=({"check": "not-verified", "severity": "error", "message": why,
                                 "location": {"file": path}},),
                        message=f"{path} cannot be verified: {why}")


def _has_manifest(root: str) -> bool:
    from ckptverify.audit.adopt import file_manifest_path
    from ckptverify.ownfiles.manifest import MANIFEST_FILE
    from ckptverify.ownfiles.partsplan import dcp_folders

    if os.path.isdir(root) and not os.path.islink(root):
        # The DCP folders inside a folder of checkpoint files (an FSDP save) have manifests of their own.
        return any(os.path.lexists(os.path.join(root, sub, MANIFEST_FILE)) for sub in {"", *dcp_folders(root)})
    return os.path.lexists(file_manifest_path(root))


def stopped_by(exc: Exception) -> str:
    """What stopped a verification: the message of a ckptverify error, the type too for anything else."""
    return str(exc) if reported_as_itself(exc) else f"the check stopped: {type(exc).__name__}: {exc}"


def was_deleted(path: str, step: int | None, seconds: float = 0.0) -> Verification:
    """The result for a checkpoint deleted before its verification finished: no verdict, no failure."""
    return unverified(path, step, "deleted", "deleted before its verification finished", seconds=seconds,
                      message=f"{path} was deleted before its verification finished (the framework's retention, "
                              "most likely): nothing to verify")


def _fingerprint(root: str, jobs: int | None) -> str:
    """Write the manifest of the checkpoint just saved (replacing a former save's, which describes gone bytes);
    unprotected content is adopted as written. Returns what happened; a refusal is no failure by itself."""
    from ckptverify.audit.adopt import fingerprint_checkpoint

    return adoption_note(*fingerprint_checkpoint(root, force=True, jobs=jobs, trust_uncheckable=True))


def _vanished(root: str) -> bool:
    """Whether ``root`` was (or is being) deleted: gone, a DCP folder without metadata, or only ckptverify's files left.
    """
    if removed(root):
        return True
    if os.path.isdir(root) and not os.path.islink(root):
        try:
            names = os.listdir(root)
        except OSError:
            return True
        return all(is_own_file(n) for n in names)
    return False


def _tidy(root: str) -> None:
    """Remove ckptverify's own files from a checkpoint deleted while verified (and the folder, if left empty)."""
    if os.path.isdir(root) and not os.path.islink(root):
        with contextlib.suppress(OSError):
            names = os.listdir(root)
            if all(is_own_file(n) for n in names):
                for name in names:
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(os.path.join(root, name))
                os.rmdir(root)
        return
    remove_beside(root)


def remove_beside(path: str) -> None:
    """Once the single-file checkpoint ``path`` is gone, remove ckptverify's files kept beside it (stamp, manifest)."""
    from ckptverify.audit.adopt import file_manifest_path

    if not os.path.lexists(path):
        for beside in (stamp_path(path), file_manifest_path(path)):
            with contextlib.suppress(OSError):
                os.unlink(beside)


def check_saved(root: str, step: int | None, fingerprint: Fingerprint, *, jobs: int | None = None,
                deep: bool = False, settle: float | None = None) -> tuple[Verification, dict[str, Any]]:
    """Fingerprint (when needed), verify and stamp the checkpoint just saved at ``root`` (see the module docstring).
    Returns the verification (its event: :func:`~ckptverify.verifier.verification.event_of`) and the event's extra
    fields (``fingerprint``, ``stamp_error``); appends no event, warns of nothing. ``settle``: a failure or change is
    judged only after that many seconds; a checkpoint gone by then is ``deleted``, its own files removed."""
    from ckptverify.audit.verify import needs_manifest, verify_checkpoint
    from ckptverify.runs.stamp import write_stamp  # looked up at each call (tests replace it)

    started = time.perf_counter()
    background = settle is not None

    def deleted_now() -> bool:
        if not background:
            return False
        if not _vanished(root):
            time.sleep(settle or 0.0)  # a checkpoint deleted file by file is not corrupt: let it settle
            if not _vanished(root):
                return False
        _tidy(root)
        return True

    if "://" in root:
        return cannot_verify(root, "ckptverify verifies checkpoints on a local file system only", step), {}
    if background and _vanished(root):
        _tidy(root)
        return was_deleted(root, step), {}
    try:
        # A manifest already here (fingerprint=False aside: the hashing writer's own) is a former save's.
        stale = fingerprint == "auto" and _has_manifest(root)
        fp_note = _fingerprint(root, jobs) if fingerprint is True or stale else None
        before = files_fingerprint(root)
        report = verify_checkpoint(root, jobs=jobs, deep=deep)
        if fingerprint == "auto" and needs_manifest(report):
            # Content nothing could check now, or ever after, without digests of it as it was just written.
            fp_note = _fingerprint(root, jobs)
            before = files_fingerprint(root)
            report = verify_checkpoint(root, jobs=jobs, deep=deep)
    except Exception as exc:  # whatever stops the check, training is told, not killed
        if deleted_now():
            return was_deleted(root, step, time.perf_counter() - started), {}
        return cannot_verify(root, stopped_by(exc), step, time.perf_counter() - started), {}
    stamp: str | None = None
    stamp_error: str | None = None
    changed = files_fingerprint(root) != before
    if (changed or not report.passed) and deleted_now():
        return was_deleted(root, step, time.perf_counter() - started), {}
    if changed:  # not a verdict on anything: the files verified are not the files there now
        return unverified(root, step, "changed", CHANGED, deep=deep,
                          seconds=time.perf_counter() - started), {"fingerprint": fp_note} if fp_note else {}
    try:
        write_stamp(root, report, step=step, fingerprint=before)
        stamp = stamp_path(root)
    except OSError as exc:
        stamp_error = f"{type(exc).__name__}: {exc}"
    if background and (_vanished(root) or files_fingerprint(root) != before) and deleted_now():
        # Deleted as the stamp was written (an rmtree listing it before the stamp fails on it): tidy ours too.
        return was_deleted(root, step, time.perf_counter() - started), {}
    verdict = verification_of(root, report, step, time.perf_counter() - started, stamp, stamp_error)
    return verdict, {k: v for k, v in (("fingerprint", fp_note), ("stamp_error", stamp_error)) if v is not None}


def saved_job(root: str, step: int | None, fingerprint: Fingerprint, jobs: int | None, deep: bool,
              settle: float, parts: bool = False) -> dict[str, Any]:
    """:func:`check_saved` in the verifier process, as JSON values. ``parts``: shared among nodes
    (:func:`~ckptverify.verifier.parts.stamp_parts_locked`), with the manifest written from the parts' digests when
    fingerprinting; ``deep``: parts' tensor pieces judged together here."""
    result = None
    if parts:
        from ckptverify.audit.verify import needs_manifest

        started = time.perf_counter()
        notes: list[str] = []
        # "auto": fingerprinted when a former manifest is present, or the parts found unprotected content.
        adopt: Any = fingerprint is True or (fingerprint == "auto" and (
            lambda merged: _has_manifest(root) or needs_manifest(merged)))
        result = stamp_parts_locked(root, step=step, jobs=jobs, settle=settle, adopt=adopt, notes=notes, deep=deep)
        if result is not None:
            if result.report is not None:
                result = verification_of(root, result.report, step, time.perf_counter() - started, result.stamp,
                                         result.reason)
            extra = {} if result.stamped or result.verdict == "unverified" else {"stamp_error": result.reason}
            if notes:
                extra["fingerprint"] = notes[0]
    if result is None:
        result, extra = check_saved(root, step, fingerprint, jobs=jobs, deep=deep, settle=settle)
    return {"verification": result.to_dict(), "extra": extra, "event": event_of(result),
            "report": None if result.report is None else result.report.to_dict()}
