"""What every framework integration shares: check a checkpoint the framework has just written, and one it is
about to load.

After a save (:meth:`Verifier.after_save`), on the coordinator: the checkpoint is verified
(:func:`~ckptverify.verify.verify_checkpoint`); when it holds content no checksum protects (safetensors weights),
or always with ``fingerprint=True``, it is fingerprinted (its manifest written,
:func:`~ckptverify.adopt.fingerprint_checkpoint`: inside a folder, beside a single file) and verified against that
manifest; then its stamp is written
(:func:`~ckptverify.runs.stamp.write_stamp`) and one event appended to ``events.jsonl``
(:class:`~ckptverify.events.EventLog`). A failure is a :class:`CheckpointVerificationWarning` and a
``checkpoint-failed`` event, and with ``on_failure="raise"`` a
:class:`~ckptverify.errors.CheckpointRefusedError` on every rank.

Before a load (:meth:`Verifier.before_resume`): the checkpoint is verified (read only: nothing is written into
it) and one that fails, or that cannot be verified at all, is refused on every rank with
:class:`~ckptverify.errors.CheckpointRefusedError` naming the first error's file, before the framework reads it.

A clean checkpoint raises no warning. Findings that are not errors (content no checksum protects, such as
safetensors weights; a framework's side file DCP's metadata does not list) are recorded in the event, never
warned about: they are the same on every clean save.

The verdict is reached on the coordinator (rank 0) and handed to every rank through the framework's own
broadcast (:class:`Group`), so every rank raises or none does.

The integrations verify inline: a save returns once its checkpoint is verified and stamped. ``background=True``
is refused for now (``ckptverify.save(verify="background")`` and ``Run`` verify in the background through
:mod:`ckptverify.runs.background`); every integration goes through :meth:`Verifier.after_save`, whose one dispatch
(``self._dispatch``) is where a checkpoint would be handed to that verifier instead.
"""

from __future__ import annotations

import os
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from ckptverify.errors import CheckpointRefusedError, CkptVerifyError, UsageError
from ckptverify.findings import Report

__all__ = ["ON_FAILURE", "CheckpointVerificationWarning", "Group", "Verdict", "Verifier", "torch_group"]

OnFailure = Literal["warn", "raise"]
Fingerprint = bool | Literal["auto"]
ON_FAILURE: tuple[str, ...] = ("warn", "raise")
#: Errors carried by a verdict (and broadcast to every rank): the first few are enough to act on.
_MAX_ERRORS = 5


class CheckpointVerificationWarning(UserWarning):
    """A checkpoint a framework saved (or was asked to load) failed verification."""


@dataclass(frozen=True)
class Group:
    """How the ranks of a job agree on a verdict. ``coordinator``: this rank verifies; ``broadcast(obj)``:
    the coordinator's ``obj`` on every rank; ``barrier()``: wait until every rank is here. A single process
    is ``Group()``."""

    coordinator: bool = True
    broadcast: Callable[[Any], Any] | None = None
    barrier: Callable[[], None] | None = None
    rank: int = 0


def torch_group() -> Group:
    """The default ``torch.distributed`` process group (a single process when there is none)."""
    import sys

    if "torch.distributed" not in sys.modules:
        return Group()
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return Group()

    def broadcast(obj: Any) -> Any:
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    rank = dist.get_rank()
    return Group(coordinator=rank == 0, broadcast=broadcast, barrier=dist.barrier, rank=rank)


@dataclass(frozen=True)
class Verdict:
    """The outcome of checking one checkpoint. ``report`` is set on the coordinator only; the rest is on every
    rank. ``checked_bytes`` and ``coverage`` say how much was checked; ``unchecked`` names the files with
    content nothing could check (no checksum, no manifest covering it)."""

    path: str
    passed: bool
    message: str
    step: int | None = None
    errors: tuple[dict[str, Any], ...] = ()
    checked_bytes: int = 0
    coverage: tuple[dict[str, Any], ...] = ()
    manifest: bool = False
    unchecked: tuple[str, ...] = ()
    warnings: tuple[str, ...] = ()
    seconds: float = 0.0
    stamp: str | None = None
    report: Report | None = field(default=None, compare=False)

    def to_dict(self) -> dict[str, Any]:
        """Everything but the report: what is broadcast, and what an event records."""
        return {"path": self.path, "passed": self.passed, "message": self.message, "step": self.step,
                "errors": list(self.errors), "checked_bytes": self.checked_bytes, "coverage": list(self.coverage),
                "manifest": self.manifest, "unchecked": list(self.unchecked), "warnings": list(self.warnings),
                "seconds": self.seconds, "stamp": self.stamp}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Verdict:
        return cls(path=data["path"], passed=data["passed"], message=data["message"], step=data.get("step"),
                   errors=tuple(data.get("errors", ())), checked_bytes=data.get("checked_bytes", 0),
                   coverage=tuple(data.get("coverage", ())), manifest=data.get("manifest", False),
                   unchecked=tuple(data.get("unchecked", ())), warnings=tuple(data.get("warnings", ())),
                   seconds=data.get("seconds", 0.0), stamp=data.get("stamp"))


def first_error_line(path: str, errors: list[dict[str, Any]] | tuple[dict[str, Any], ...], total: int) -> str:
    """``PATH fails verification with N error(s); first: CHECK (WHERE): MESSAGE``."""
    from ckptverify.findings import Location

    if not errors:
        return f"{path} fails verification"
    first = errors[0]
    where = Location.from_dict(first.get("location", {})).describe() or "?"
    return (f"{path} fails verification with {total} error(s); first: {first.get('check')} ({where}): "
            f"{first.get('message')}")


def _verdict(path: str, report: Report, step: int | None, seconds: float, stamp: str | None) -> Verdict:
    from ckptverify.verify import UNCHECKABLE

    errors = report.errors
    unchecked = sorted({f.location.file or "?" for f in report.findings if f.check == UNCHECKABLE})
    noted = sorted({f.check for f in report.warnings if f.check != UNCHECKABLE})
    if errors:
        message = first_error_line(path, [f.to_dict() for f in errors[:1]], report.summary().get("error", 0))
    else:
        against = " against its manifest" if report.stats.get("manifest") else ""
        message = f"{path} passed verification{against}: {_checked_text(report)}"
        if unchecked:
            message += f"; no checksum covers {', '.join(unchecked[:4])}"
    return Verdict(path=path, passed=report.passed, message=message, step=step,
                   errors=tuple(f.to_dict() for f in errors[:_MAX_ERRORS]),
                   checked_bytes=int(report.stats.get("bytes", 0) or 0),
                   coverage=tuple(c.to_dict() for c in report.coverage), manifest=bool(report.stats.get("manifest")),
                   unchecked=tuple(unchecked), warnings=tuple(noted), seconds=round(seconds, 6), stamp=stamp,
                   report=report)


def _checked_text(report: Report) -> str:
    """``N bytes; 184 zip-crc records, 28 manifest-digest blocks`` (the checks that read the content)."""
    key = [c for c in report.coverage if c.count and c.check in ("zip-crc", "manifest-digest", "tensor-record")]
    parts = [f"{c.count} {c.check} {c.unit}" for c in key or [c for c in report.coverage if c.count][:3]]
    return f"{int(report.stats.get('bytes', 0) or 0)} bytes; {', '.join(parts) or 'nothing'}"


def _failed(path: str, why: str, step: int | None = None, seconds: float = 0.0) -> Verdict:
    """A verdict for a checkpoint that could not be verified at all (missing, not a checkpoint, remote)."""
    return Verdict(path=path, passed=False, message=f"{path} cannot be verified: {why}", step=step,
                   errors=({"check": "not-verified", "severity": "error", "message": why, "location": {"file": path}},),
                   seconds=round(seconds, 6))


def _has_manifest(root: str) -> bool:
    from ckptverify.adopt import file_manifest_path
    from ckptverify.manifest import MANIFEST_FILE

    if os.path.isdir(root) and not os.path.islink(root):
        return os.path.lexists(os.path.join(root, MANIFEST_FILE))
    return os.path.lexists(file_manifest_path(root))


def _why(exc: Exception) -> str:
    """What stopped a verification: the message of a ckptverify error, the type too for anything else."""
    return str(exc) if isinstance(exc, CkptVerifyError) else f"the check stopped: {type(exc).__name__}: {exc}"


class Verifier:
    """Verify checkpoints after a framework saves them and before it loads them; see the module docstring.

    Args:
        on_failure: ``"warn"`` (a warning and an event; training goes on) or ``"raise"`` (also
            :class:`~ckptverify.errors.CheckpointRefusedError` on every rank) when a saved checkpoint fails.
            A checkpoint that fails before a load is always refused.
        fingerprint: write a manifest right after a save (inside a checkpoint folder, beside a single file), so
            that later verifications check every byte against digests taken now. ``"auto"`` (default): only
            when the checkpoint holds content no checksum protects (safetensors weights, DCP items without
            CRC-32), which nothing else could check later; elsewhere every byte is already under a CRC-32, and
            the manifest's logical tensor fingerprints cost far more than the save (``docs/integrations.md``,
            Cost). ``True``: always (the manifest then also serves ``verify --deep`` and ``diff``). ``False``:
            never.
        background: reserved; refused in this version (the integrations verify inline).
        deep: also rebuild every tensor and compare its logical fingerprint with the manifest's.
        jobs: verification threads (default: one per core).
        events_dir: where ``events.jsonl`` goes (default: the folder that holds the checkpoint).
    """

    def __init__(self, *, on_failure: OnFailure = "warn", fingerprint: Fingerprint = "auto", background: bool = False,
                 deep: bool = False, jobs: int | None = None,
                 events_dir: str | os.PathLike[str] | None = None) -> None:
        if on_failure not in ON_FAILURE:
            raise UsageError(f"on_failure must be one of {', '.join(ON_FAILURE)}, got {on_failure!r}")
        if background:
            raise UsageError("the framework integrations verify inline in this version: use background=False "
                             "(verification runs right after each save); ckptverify.save(verify='background') "
                             "and Run verify in the background")
        if jobs is not None and jobs < 1:
            raise UsageError(f"jobs must be at least 1, got {jobs}")
        self.on_failure: OnFailure = on_failure
        if fingerprint not in (True, False, "auto"):
            raise UsageError(f"fingerprint must be True, False or 'auto', got {fingerprint!r}")
        self.fingerprint: Fingerprint = fingerprint
        self.deep = bool(deep)
        self.jobs = jobs
        self.events_dir = None if events_dir is None else os.fspath(events_dir)
        # The one place a saved checkpoint is handed over: inline now; the background verifier takes it here.
        self._dispatch: Callable[[str, int | None, Fingerprint], Verdict] = self._check_saved

    # -- the two entry points
    def after_save(self, path: str | os.PathLike[str], *, step: int | None = None, group: Group = Group(),
                   fingerprint: Fingerprint | None = None) -> Verdict:
        """Check the checkpoint just written at ``path`` (every rank calls this; the coordinator checks).

        ``fingerprint``: override the verifier's setting for this save (``False`` when the checkpoint was
        written with its manifest already, by ckptverify's hashing writer). Returns the verdict on every rank;
        raises :class:`~ckptverify.errors.CheckpointRefusedError` on every rank when it failed and
        ``on_failure="raise"``."""
        root = os.fspath(path)
        if group.barrier is not None:
            group.barrier()  # every rank's files are written before any is read
        verdict = None
        if group.coordinator:
            verdict = self._dispatch(root, step, self.fingerprint if fingerprint is None else fingerprint)
        verdict = self._agree(verdict, group)
        if not verdict.passed:
            if self.on_failure == "raise":
                raise CheckpointRefusedError(f"checkpoint saved at {verdict.message}", verdict.report)
            if group.coordinator:
                warnings.warn(verdict.message, CheckpointVerificationWarning, stacklevel=3)
        return verdict

    def before_resume(self, path: str | os.PathLike[str], *, group: Group = Group()) -> Verdict:
        """Verify the checkpoint at ``path`` before it is loaded; refuse it on every rank if it fails (or cannot
        be verified). Nothing is written into the checkpoint. Returns the verdict when it passed."""
        verdict = self.check(path, group=group, event="resume", warn=False)
        if not verdict.passed:
            raise CheckpointRefusedError(f"refusing to resume: {verdict.message}", verdict.report)
        return verdict

    def check(self, path: str | os.PathLike[str], *, group: Group = Group(), event: str = "resume",
              warn: bool = True) -> Verdict:
        """Verify ``path`` read-only on the coordinator, log ``{event}-verified`` or ``{event}-refused``, and
        return the verdict on every rank (with ``warn``, a failure is also a warning on the coordinator). Never
        raises for a checkpoint that fails."""
        root = os.fspath(path)
        verdict = None
        if group.coordinator:
            verdict = self._verify_only(root)
            self._emit(root, f"{event}-verified" if verdict.passed else f"{event}-refused", verdict, group.rank)
        verdict = self._agree(verdict, group)
        if warn and not verdict.passed and group.coordinator:
            warnings.warn(f"{event}: {verdict.message}", CheckpointVerificationWarning, stacklevel=3)
        return verdict

    # -- coordinator side
    def _check_saved(self, root: str, step: int | None, fingerprint: Fingerprint) -> Verdict:
        from ckptverify.runs.stamp import files_fingerprint, stamp_path, write_stamp
        from ckptverify.verify import UNCHECKABLE, verify_checkpoint

        started = time.perf_counter()
        if "://" in root:
            verdict = _failed(root, "ckptverify verifies checkpoints on a local file system only", step)
            self._emit(root, "checkpoint-failed", verdict, 0)
            return verdict
        try:
            # A manifest already here (fingerprint=False aside: the hashing writer's own) is a former save's.
            stale = fingerprint == "auto" and _has_manifest(root)
            fp_note = self._fingerprint(root) if fingerprint is True or stale else None
            before = files_fingerprint(root)
            report = verify_checkpoint(root, jobs=self.jobs, deep=self.deep)
            if fingerprint == "auto" and report.passed and not report.stats.get("manifest") \
                    and any(f.check == UNCHECKABLE for f in report.findings):
                # Content nothing could check now, or ever after, without digests of it as it was just written.
                fp_note = self._fingerprint(root)
                before = files_fingerprint(root)
                report = verify_checkpoint(root, jobs=self.jobs, deep=self.deep)
        except Exception as exc:  # whatever stops the check, training is told, not killed
            verdict = _failed(root, _why(exc), step, time.perf_counter() - started)
            self._emit(root, "checkpoint-failed", verdict, 0)
            return verdict
        stamp: str | None = None
        stamp_error: str | None = None
        if files_fingerprint(root) == before:  # else it changed while read: no stamp would be current
            try:
                write_stamp(root, report, step=step, fingerprint=before)
                stamp = stamp_path(root)
            except OSError as exc:
                stamp_error = f"{type(exc).__name__}: {exc}"
        else:
            stamp_error = "files changed while they were verified"
        verdict = _verdict(root, report, step, time.perf_counter() - started, stamp)
        extra: dict[str, Any] = {}
        if fp_note is not None:
            extra["fingerprint"] = fp_note
        if stamp_error is not None:
            extra["stamp_error"] = stamp_error
        self._emit(root, "checkpoint-verified" if verdict.passed else "checkpoint-failed", verdict, 0, **extra)
        return verdict

    def _fingerprint(self, root: str) -> str:
        """Write the manifest of the checkpoint just saved at ``root`` (replacing one a former save into the same
        place left: it describes bytes that are gone). Content no checksum protects (safetensors weights) is
        adopted as it was just written: from now on the manifest protects it. Returns what happened, for the
        event; a refusal is no failure by itself (the verification that follows judges the checkpoint)."""
        from ckptverify.adopt import fingerprint_checkpoint

        report, manifest = fingerprint_checkpoint(root, force=True, jobs=self.jobs, trust_uncheckable=True)
        if manifest is not None:
            return (f"manifest written: {len(manifest.files)} files, {len(manifest.items)} items, "
                    f"{len(manifest.tensors)} tensors")
        refusal = next((f for f in report.findings if f.check == "fingerprint-refused"), None)
        return f"no manifest: {refusal.message if refusal else 'refused'}"

    def _verify_only(self, root: str) -> Verdict:
        from ckptverify.verify import verify_checkpoint

        started = time.perf_counter()
        if "://" in root:
            return _failed(root, "ckptverify verifies checkpoints on a local file system only")
        try:
            report = verify_checkpoint(root, jobs=self.jobs, deep=self.deep)
        except Exception as exc:  # a resume that cannot be checked is refused, with why
            return _failed(root, _why(exc), seconds=time.perf_counter() - started)
        return _verdict(root, report, None, time.perf_counter() - started, None)

    def _emit(self, root: str, event: str, verdict: Verdict, rank: int, **extra: Any) -> None:
        from ckptverify.events import EventLog

        folder = self.events_dir or os.path.dirname(os.path.abspath(root))
        try:
            EventLog(folder, rank=rank).emit(event, **verdict.to_dict(), **extra)
        except OSError as exc:  # the log is a record; an unwritable one must not stop training
            warnings.warn(f"ckptverify could not append to {folder}/events.jsonl: {exc}",
                          CheckpointVerificationWarning, stacklevel=4)

    @staticmethod
    def _agree(verdict: Verdict | None, group: Group) -> Verdict:
        if group.broadcast is None:
            assert verdict is not None
            return verdict
        data = group.broadcast(None if verdict is None else verdict.to_dict())
        if verdict is not None:
            return verdict
        return Verdict.from_dict(data)

