"""What every framework integration shares: check a checkpoint the framework has just written, and one it is
about to load.

After a save (:meth:`Verifier.after_save`), on the coordinator: the checkpoint is verified
(:func:`~ckptverify.audit.verify.verify_checkpoint`); when it holds content no checksum protects (safetensors weights),
or always with ``fingerprint=True``, it is fingerprinted (its manifest written,
:func:`~ckptverify.audit.adopt.fingerprint_checkpoint`: inside a folder, beside a single file) and verified against that
manifest; then its stamp is written
(:func:`~ckptverify.runs.stamp.write_stamp`) and one event appended to ``events.jsonl``
(:class:`~ckptverify.ownfiles.events.EventLog`). A failure is a :class:`CheckpointVerificationWarning` and a
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

By default the integrations verify inline: a save returns once its checkpoint is verified and stamped. With
``verify="background"`` (:meth:`Verifier.after_save`'s one dispatch, ``self._dispatch``) the coordinator hands the
checkpoint to the process's background verifier (:mod:`ckptverify.verifier.background`, the one
``ckptverify.save(verify="background")`` uses: its queue, the checkpoint's verifying lock, its verifier process at
idle CPU priority) and the save returns at once, with a *pending* verdict. The verifier process runs the same
check as inline (:func:`check_saved`: fingerprinted when needed, verified, stamped), and the same event is
appended when it finishes, with the same fields; a failure is then a :class:`CheckpointVerificationWarning` (on
the coordinator, from the verifier's thread), and with ``on_failure="raise"`` a
:class:`~ckptverify.errors.CheckpointRefusedError` raised by the next :meth:`Verifier.after_save` (or
:meth:`Verifier.wait`) on every rank together. :meth:`Verifier.wait` (the integrations call it at the end of
training) waits for the pending ones, up to a bound, and says which were cut short (a ``checkpoint-cut-short``
event each). :meth:`Verifier.before_resume` of a checkpoint still pending waits for it, then verifies it as
always. A checkpoint the framework's retention deleted before its verification finished is no failure: a
``checkpoint-deleted`` event, no warning, and ckptverify's own files left beside or inside it removed.
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import threading
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from ckptverify.errors import (
    CheckpointRefusedError,
    CheckpointVerificationWarning,
    CkptVerifyDeprecationWarning,
    UsageError,
    reported_as_itself,
)
from ckptverify.findings import Report
from ckptverify.options import (
    FAILURE_POLICIES,
    VerifyOptions,
    no_other_keywords,
    take_renamed,
    verify_options,
)

__all__ = ["ON_FAILURE", "WHEN", "CheckpointVerificationWarning", "Group", "Verdict", "Verifier", "VerifyOptions",
           "check_saved", "integration_verify", "numbered_folders", "plain_folder", "settle_verdicts", "torch_group"]

OnFailure = Literal["warn", "raise"]
Fingerprint = bool | Literal["auto"]
ON_FAILURE: tuple[str, ...] = FAILURE_POLICIES
#: When an integration verifies a saved checkpoint (every save is verified: ``"off"`` is not one).
WHEN: tuple[str, ...] = ("inline", "background")
#: Keywords of the integrations renamed in this release -> what replaces them (still accepted, with a warning).
RENAMED = {"on_failure": "verify=VerifyOptions(on_failure=...)", "background": 'verify="background"',
           "deep": "verify=VerifyOptions(deep=...)"}
#: Errors carried by a verdict (and broadcast to every rank): the first few are enough to act on.
_MAX_ERRORS = 5


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
    rank. ``bytes_checked`` and ``coverage`` say how much was
    checked; ``unchecked`` names the files with content nothing could check (no checksum, no manifest covering
    it). ``pending``: handed to the background verifier, no verdict yet (``passed`` is ``False``: nothing was
    checked). ``deleted``: removed (by the framework's retention) before its verification finished; no verdict."""

    path: str
    passed: bool
    message: str
    step: int | None = None
    errors: tuple[dict[str, Any], ...] = ()
    bytes_checked: int = 0
    coverage: tuple[dict[str, Any], ...] = ()
    manifest: bool = False
    unchecked: tuple[str, ...] = ()
    warnings: tuple[str, ...] = ()
    seconds: float = 0.0
    stamp: str | None = None
    report: Report | None = field(default=None, compare=False)
    pending: bool = False
    deleted: bool = False

    @property
    def checked_bytes(self) -> int:
        """Deprecated (one release): :attr:`bytes_checked`, the name every result and JSON file uses."""
        warnings.warn("Verdict.checked_bytes is deprecated and will be removed in the next release; use "
                      "Verdict.bytes_checked instead", CkptVerifyDeprecationWarning, stacklevel=2)
        return self.bytes_checked

    def to_dict(self) -> dict[str, Any]:
        """Everything but the report: what is broadcast, and what an event records."""
        data = {"path": self.path, "passed": self.passed, "message": self.message, "step": self.step,
                "errors": list(self.errors), "bytes_checked": self.bytes_checked, "coverage": list(self.coverage),
                "manifest": self.manifest, "unchecked": list(self.unchecked), "warnings": list(self.warnings),
                "seconds": self.seconds, "stamp": self.stamp}
        if self.pending:
            data["pending"] = True
        if self.deleted:
            data["deleted"] = True
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Verdict:
        return cls(path=data["path"], passed=data["passed"], message=data["message"], step=data.get("step"),
                   errors=tuple(data.get("errors", ())),
                   # ``checked_bytes``: the key's name in what earlier versions wrote (events.jsonl).
                   bytes_checked=data.get("bytes_checked", data.get("checked_bytes", 0)),
                   coverage=tuple(data.get("coverage", ())), manifest=data.get("manifest", False),
                   unchecked=tuple(data.get("unchecked", ())), warnings=tuple(data.get("warnings", ())),
                   seconds=data.get("seconds", 0.0), stamp=data.get("stamp"), pending=data.get("pending", False),
                   deleted=data.get("deleted", False))


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
    from ckptverify.audit.verify import UNCHECKABLE

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
                   bytes_checked=int(report.stats.get("bytes", 0) or 0),
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
    from ckptverify.audit.adopt import file_manifest_path
    from ckptverify.ownfiles.manifest import MANIFEST_FILE

    if os.path.isdir(root) and not os.path.islink(root):
        return os.path.lexists(os.path.join(root, MANIFEST_FILE))
    return os.path.lexists(file_manifest_path(root))


def _why(exc: Exception) -> str:
    """What stopped a verification: the message of a ckptverify error, the type too for anything else."""
    return str(exc) if reported_as_itself(exc) else f"the check stopped: {type(exc).__name__}: {exc}"


def _deleted(path: str, step: int | None, seconds: float = 0.0) -> Verdict:
    return Verdict(path=path, passed=False, deleted=True, step=step, seconds=round(seconds, 6),
                   message=f"{path} was deleted before its verification finished (the framework's retention, "
                           "most likely): nothing to verify")


def _fingerprint(root: str, jobs: int | None) -> str:
    """Write the manifest of the checkpoint just saved at ``root`` (replacing one a former save into the same
    place left: it describes bytes that are gone). Content no checksum protects (safetensors weights) is
    adopted as it was just written: from now on the manifest protects it. Returns what happened, for the
    event; a refusal is no failure by itself (the verification that follows judges the checkpoint)."""
    from ckptverify.audit.adopt import fingerprint_checkpoint

    report, manifest = fingerprint_checkpoint(root, force=True, jobs=jobs, trust_uncheckable=True)
    if manifest is not None:
        return (f"manifest written: {len(manifest.files)} files, {len(manifest.items)} items, "
                f"{len(manifest.tensors)} tensors")
    refusal = next((f for f in report.findings if f.check == "fingerprint-refused"), None)
    return f"no manifest: {refusal.message if refusal else 'refused'}"


def _vanished(root: str) -> bool:
    """Whether the checkpoint at ``root`` was deleted (or is being deleted): gone, a DCP folder that lost its
    metadata, or a folder left holding nothing but ckptverify's own files."""
    from ckptverify.formats.describe import is_own_file
    from ckptverify.verifier.stamper import removed

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
    """Remove ckptverify's own files (stamp, manifest, verifying lock) from a checkpoint that was deleted while
    it was verified: inside a folder left with nothing else (then the folder too), or beside a single file."""
    from ckptverify.audit.adopt import file_manifest_path
    from ckptverify.formats.describe import is_own_file
    from ckptverify.runs.stamp import stamp_path

    if os.path.isdir(root) and not os.path.islink(root):
        with contextlib.suppress(OSError):
            names = os.listdir(root)
            if all(is_own_file(n) for n in names):
                for name in names:
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(os.path.join(root, name))
                os.rmdir(root)
        return
    if not os.path.lexists(root):
        for beside in (stamp_path(root), file_manifest_path(root)):
            with contextlib.suppress(OSError):
                os.unlink(beside)


def check_saved(root: str, step: int | None, fingerprint: Fingerprint, *, jobs: int | None = None,
                deep: bool = False, settle: float | None = None) -> tuple[Verdict, dict[str, Any], str]:
    """Fingerprint (when needed), verify and stamp the checkpoint just saved at ``root``; see the module
    docstring. Returns the verdict, the event's extra fields and the event's name (``checkpoint-verified``,
    ``checkpoint-failed``, or ``checkpoint-deleted``). Appends no event and warns of nothing.

    ``settle``: set when the checkpoint may be deleted meanwhile (a verification in the background, while the
    framework's retention runs): a failure, or files that changed, is judged only after ``settle`` seconds, and
    a checkpoint gone by then is ``deleted``, with ckptverify's own files removed."""
    from ckptverify.audit.verify import UNCHECKABLE, verify_checkpoint
    from ckptverify.runs.stamp import files_fingerprint, stamp_path, write_stamp

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
        return _failed(root, "ckptverify verifies checkpoints on a local file system only", step), {}, \
            "checkpoint-failed"
    if background and _vanished(root):
        _tidy(root)
        return _deleted(root, step), {}, "checkpoint-deleted"
    try:
        # A manifest already here (fingerprint=False aside: the hashing writer's own) is a former save's.
        stale = fingerprint == "auto" and _has_manifest(root)
        fp_note = _fingerprint(root, jobs) if fingerprint is True or stale else None
        before = files_fingerprint(root)
        report = verify_checkpoint(root, jobs=jobs, deep=deep)
        if fingerprint == "auto" and report.passed and not report.stats.get("manifest") \
                and any(f.check == UNCHECKABLE for f in report.findings):
            # Content nothing could check now, or ever after, without digests of it as it was just written.
            fp_note = _fingerprint(root, jobs)
            before = files_fingerprint(root)
            report = verify_checkpoint(root, jobs=jobs, deep=deep)
    except Exception as exc:  # whatever stops the check, training is told, not killed
        if deleted_now():
            return _deleted(root, step, time.perf_counter() - started), {}, "checkpoint-deleted"
        return _failed(root, _why(exc), step, time.perf_counter() - started), {}, "checkpoint-failed"
    stamp: str | None = None
    stamp_error: str | None = None
    changed = files_fingerprint(root) != before
    if (changed or not report.passed) and deleted_now():
        return _deleted(root, step, time.perf_counter() - started), {}, "checkpoint-deleted"
    if not changed:  # else it changed while read: no stamp would be current
        try:
            write_stamp(root, report, step=step, fingerprint=before)
            stamp = stamp_path(root)
        except OSError as exc:
            stamp_error = f"{type(exc).__name__}: {exc}"
    else:
        stamp_error = "files changed while they were verified"
    if background and (_vanished(root) or files_fingerprint(root) != before) and deleted_now():
        # Deleted as the stamp was written (a framework's rmtree that listed the folder before the stamp was in
        # it fails on it): ckptverify's files are taken away too.
        return _deleted(root, step, time.perf_counter() - started), {}, "checkpoint-deleted"
    verdict = _verdict(root, report, step, time.perf_counter() - started, stamp)
    extra: dict[str, Any] = {}
    if fp_note is not None:
        extra["fingerprint"] = fp_note
    if stamp_error is not None:
        extra["stamp_error"] = stamp_error
    return verdict, extra, "checkpoint-verified" if verdict.passed else "checkpoint-failed"


def saved_job(root: str, step: int | None, fingerprint: Fingerprint, jobs: int | None, deep: bool,
              settle: float) -> dict[str, Any]:
    """:func:`check_saved` in the background verifier's process: its outcome as JSON values."""
    verdict, extra, event = check_saved(root, step, fingerprint, jobs=jobs, deep=deep, settle=settle)
    return {"verdict": verdict.to_dict(), "extra": extra, "event": event,
            "report": None if verdict.report is None else verdict.report.to_dict()}


def integration_verify(where: str, verify: VerifyOptions | str, renamed: dict[str, Any], *,
                       stacklevel: int = 5) -> VerifyOptions:
    """``verify=`` of an integration as a :class:`~ckptverify.options.VerifyOptions`, with the renamed keywords
    ``on_failure``, ``background`` and ``deep`` (taken out of ``renamed``, a ``**kwargs``, with a warning each)
    folded in. Anything else left in ``renamed`` is a ``TypeError``, as for any unknown keyword."""
    old = take_renamed(where, renamed, RENAMED, stacklevel=stacklevel)
    no_other_keywords(where, renamed)
    if "background" in old and not isinstance(old["background"], bool):
        raise UsageError(f"{where}: background must be True or False, got {old['background']!r}")
    options = verify_options(where, verify, deep=old.get("deep"), on_failure=old.get("on_failure"),
                             when=("off", *WHEN))
    if "background" in old:
        options = replace(options, when="background" if old["background"] else "inline")
    if options.when not in WHEN:
        raise UsageError(f"{where}: verify.when must be one of {', '.join(map(repr, WHEN))} (every save is verified), "
                         f"got {options.when!r}")
    return options


class Verifier:
    """Verify checkpoints after a framework saves them and before it loads them; see the module docstring.

    Args:
        verify: how each saved checkpoint is verified, a :class:`~ckptverify.options.VerifyOptions` or its ``when``:
            ``"inline"`` (the default: ``after_save`` returns once it is verified) or ``"background"`` (hand each
            saved checkpoint to the background verifier and return at once, see the module docstring; the
            framework must then call :meth:`wait` at the end of training). ``VerifyOptions.on_failure``:
            ``"warn"`` (a warning and an event; training goes on) or ``"raise"`` (also
            :class:`~ckptverify.errors.CheckpointRefusedError` on every rank) when a saved checkpoint fails; a
            checkpoint that fails before a load is always refused. ``VerifyOptions.deep``: also rebuild every
            tensor and compare its logical fingerprint with the manifest's (after a save and before a load).
            (``on_failure=``, ``background=`` and ``deep=`` still work for one release, with a
            ``DeprecationWarning``.)
        fingerprint: write a manifest right after a save (inside a checkpoint folder, beside a single file), so
            that later verifications check every byte against digests taken now. ``"auto"`` (default): only
            when the checkpoint holds content no checksum protects (safetensors weights, DCP items without
            CRC-32), which nothing else could check later; elsewhere every byte is already under a CRC-32, and
            the manifest's logical tensor fingerprints cost far more than the save (``docs/integrations.md``,
            Cost). ``True``: always (the manifest then also serves ``verify --deep`` and ``diff``). ``False``:
            never.
        jobs: verification threads (default: one per core inline, one in the background).
        events_dir: where ``events.jsonl`` goes (default: the folder that holds the checkpoint).
    """

    def __init__(self, *, verify: VerifyOptions | str = "inline", fingerprint: Fingerprint = "auto",
                 jobs: int | None = None, events_dir: str | os.PathLike[str] | None = None, **renamed: Any) -> None:
        options = integration_verify("Verifier", verify, renamed)
        background, deep = options.when == "background", options.deep
        if jobs is not None and jobs < 1:
            raise UsageError(f"jobs must be at least 1, got {jobs}")
        self.verify = options
        self.on_failure: OnFailure = options.on_failure
        if fingerprint not in (True, False, "auto"):
            raise UsageError(f"fingerprint must be True, False or 'auto', got {fingerprint!r}")
        self.fingerprint: Fingerprint = fingerprint
        self.background = background
        self.deep = bool(deep)
        self.jobs = jobs
        self.events_dir = None if events_dir is None else os.fspath(events_dir)
        # Background state, on the coordinator: checkpoints handed over and not finished, verdicts arrived since
        # the last wait, failures not raised yet (raise mode). Filled from the background verifier's thread.
        self._lock = threading.Lock()
        self._pending: list[str] = []
        self._arrived_verdicts: list[Verdict] = []
        self._unraised: list[Verdict] = []
        # The one place a saved checkpoint is handed over: verified now, or queued for the background verifier.
        self._dispatch: Callable[[str, int | None, Fingerprint], Verdict] = \
            self._submit if background else self._check_saved

    # -- the entry points
    def after_save(self, path: str | os.PathLike[str], *, step: int | None = None, group: Group = Group(),
                   fingerprint: Fingerprint | None = None) -> Verdict:
        """Check the checkpoint just written at ``path`` (every rank calls this; the coordinator checks).

        ``fingerprint``: override the verifier's setting for this save (``False`` when the checkpoint was
        written with its manifest already, by ckptverify's hashing writer). Returns the verdict on every rank
        (with ``background``, a pending one); raises :class:`~ckptverify.errors.CheckpointRefusedError` on every
        rank when it failed and ``on_failure="raise"``, and with ``background`` when an earlier checkpoint's
        verification failed since the last call."""
        root = os.fspath(path)
        if group.barrier is not None:
            group.barrier()  # every rank's files are written before any is read
        verdict = None
        earlier = None
        if group.coordinator:
            verdict = self._dispatch(root, step, self.fingerprint if fingerprint is None else fingerprint)
            earlier = self._take_unraised()
        if self.background:
            verdict, earlier = self._agree_pair(verdict, earlier, group)
        else:
            verdict = self._agree(verdict, group)
        if earlier is not None:
            raise CheckpointRefusedError(f"an earlier checkpoint failed verification in the background: checkpoint "
                                         f"saved at {earlier.message}", earlier.report)
        if not verdict.passed and not verdict.pending:
            if self.on_failure == "raise":
                raise CheckpointRefusedError(f"checkpoint saved at {verdict.message}", verdict.report)
            if group.coordinator:
                warnings.warn(verdict.message, CheckpointVerificationWarning, stacklevel=3)
        return verdict

    def wait(self, *, group: Group = Group(), timeout: float | None = None) -> list[Verdict]:
        """Wait for this verifier's background verifications (every rank calls it; the coordinator waits), up to
        ``timeout`` seconds (default: ``CKPTVERIFY_VERIFY_EXIT_TIMEOUT``, 600). Those not finished by then are
        cut short: a warning naming them, and a ``checkpoint-cut-short`` event each (they carry no stamp, and are
        verified when a resume picks them; they stay queued). Returns, on every rank, the verdicts that arrived
        since the last wait (none without ``background``). With ``on_failure="raise"``, raises
        :class:`~ckptverify.errors.CheckpointRefusedError` on every rank for a failure not raised yet."""
        if not self.background:
            return []
        arrived: list[Verdict] | None = None
        earlier = None
        if group.coordinator:
            from ckptverify.verifier.background import default_verifier, exit_timeout

            limit = exit_timeout() if timeout is None else timeout
            with self._lock:
                mine = list(self._pending)
            if mine and not default_verifier().wait_for(mine, limit):
                with self._lock:
                    left = [p for p in self._pending if p in mine]
                if left:
                    self._cut_short(left, f"not verified within the {limit} s waited")
            with self._lock:
                arrived, self._arrived_verdicts = self._arrived_verdicts, []
            earlier = self._take_unraised()
        if group.broadcast is not None:
            data = group.broadcast(None if arrived is None else
                                   {"arrived": [v.to_dict() for v in arrived],
                                    "earlier": None if earlier is None else earlier.to_dict()})
            if arrived is None:
                arrived = [Verdict.from_dict(v) for v in data["arrived"]]
                earlier = None if data["earlier"] is None else Verdict.from_dict(data["earlier"])
        assert arrived is not None
        if earlier is not None:
            raise CheckpointRefusedError(f"an earlier checkpoint failed verification in the background: checkpoint "
                                         f"saved at {earlier.message}", earlier.report)
        return arrived

    def pending(self) -> list[str]:
        """The checkpoints handed to the background verifier and not finished yet (on the coordinator)."""
        with self._lock:
            return list(self._pending)

    def before_resume(self, path: str | os.PathLike[str], *, group: Group = Group()) -> Verdict:
        """Verify the checkpoint at ``path`` before it is loaded; refuse it on every rank if it fails (or cannot
        be verified). A checkpoint whose background verification is still pending is waited for first.
        Nothing is written into the checkpoint. Returns the verdict when it passed."""
        verdict = self.check(path, group=group, event="resume", warn=False)
        if not verdict.passed:
            raise CheckpointRefusedError(f"refusing to resume: {verdict.message}", verdict.report)
        return verdict

    def newest_verified(self, paths: list[str], folder: str, *, group: Group = Group()) -> Verdict | None:
        """The verdict of the first of ``paths`` (newest first, the same list on every rank) that verifies, on
        every rank; each one before it is skipped with a warning and a ``resume-refused`` event. ``None`` when
        ``paths`` is empty; :class:`~ckptverify.errors.CheckpointRefusedError` when none verifies (starting over
        would silently throw the run away)."""
        refused: list[Verdict] = []
        for path in paths:
            verdict = self.check(path, group=group, event="resume")
            if verdict.passed:
                return verdict
            refused.append(verdict)
        if not refused:
            return None
        raise CheckpointRefusedError(f"refusing to resume: none of the {len(refused)} checkpoint(s) under {folder} "
                                     f"verifies; newest: {refused[0].message}", refused[0].report)

    def check(self, path: str | os.PathLike[str], *, group: Group = Group(), event: str = "resume",
              warn: bool = True) -> Verdict:
        """Verify ``path`` read-only on the coordinator, log ``{event}-verified`` or ``{event}-refused``, and
        return the verdict on every rank (with ``warn``, a failure is also a warning on the coordinator). A
        background verification of ``path`` still pending in this process is waited for first (it may write the
        manifest that protects the weights). Never raises for a checkpoint that fails."""
        root = os.fspath(path)
        verdict = None
        if group.coordinator:
            _await_background(root)
            verdict = self._verify_only(root)
            self._emit(root, f"{event}-verified" if verdict.passed else f"{event}-refused", verdict, group.rank)
        verdict = self._agree(verdict, group)
        if warn and not verdict.passed and group.coordinator:
            warnings.warn(f"{event}: {verdict.message}", CheckpointVerificationWarning, stacklevel=3)
        return verdict

    # -- coordinator side
    def _check_saved(self, root: str, step: int | None, fingerprint: Fingerprint) -> Verdict:
        verdict, extra, event = check_saved(root, step, fingerprint, jobs=self.jobs, deep=self.deep)
        self._emit(root, event, verdict, 0, **extra)
        return verdict

    def _submit(self, root: str, step: int | None, fingerprint: Fingerprint) -> Verdict:
        """Queue ``root`` for the background verifier (:func:`check_saved` in its process)."""
        from ckptverify.verifier.background import Task, default_verifier

        if "://" in root:  # refused at once, as inline: there is nothing to queue
            return self._check_saved(root, step, fingerprint)
        where = os.path.abspath(root)  # the verifier process may not share this process's working directory
        folder = self._events_folder(root)
        verifier = default_verifier()
        task = Task(function=f"{__name__}:saved_job",
                    args={"root": where, "step": step, "fingerprint": fingerprint, "jobs": self.jobs or 1,
                          "deep": self.deep, "settle": verifier.settle},
                    done=functools.partial(self._arrived, root, where, step, folder),
                    cut_short=functools.partial(self._cut_short_one, root, step, folder))
        with self._lock:
            self._pending.append(where)
        try:
            verifier.submit(where, step=step, task=task)
        except UsageError:  # the process's verifier was closed (the interpreter is exiting): verify it now
            with self._lock:
                self._pending.remove(where)
            return self._check_saved(root, step, fingerprint)
        return Verdict(path=root, passed=False, pending=True, step=step,
                       message=f"{root} is queued for verification in the background")

    def _arrived(self, root: str, where: str, step: int | None, folder: str, result: Any, why: str | None) -> None:
        """A background verification finished (in the background verifier's thread): the event, the warning,
        and a failure kept for the next save to raise."""
        extra: dict[str, Any] = {}
        if result is None and why == "removed before it was verified":
            verdict, event = _deleted(root, step), "checkpoint-deleted"
        elif result is None:
            verdict, event = _failed(root, f"the background verification did not finish: {why}", step), \
                "checkpoint-failed"
        else:
            verdict = replace(Verdict.from_dict({**result["verdict"], "path": root}),
                                          report=None if result.get("report") is None
                                          else Report.from_dict(result["report"]))
            extra, event = dict(result.get("extra") or {}), str(result["event"])
            if verdict.stamp is not None and where != root:
                from ckptverify.runs.stamp import stamp_path

                verdict = replace(verdict, stamp=stamp_path(root))
        self._emit_in(folder, event, verdict, 0, **extra)
        failed = event == "checkpoint-failed"
        with self._lock:
            with contextlib.suppress(ValueError):
                self._pending.remove(where)
            self._arrived_verdicts.append(verdict)
            if failed and self.on_failure == "raise":
                self._unraised.append(verdict)
        if failed:
            warnings.warn(verdict.message, CheckpointVerificationWarning, stacklevel=2)

    def _cut_short_one(self, root: str, step: int | None, folder: str, why: str) -> None:
        """The process's background verifier gave up waiting for ``root`` (at interpreter exit)."""
        self._emit_in(folder, "checkpoint-cut-short", _cut(root, step, why), 0)
        warnings.warn(f"{root}: {why}; it carries no stamp and is verified when a resume picks it",
                      _incomplete_warning(), stacklevel=2)

    def _cut_short(self, left: list[str], why: str) -> None:
        for where in left:
            self._emit_in(self._events_folder(where), "checkpoint-cut-short", _cut(where, None, why), 0)
        warnings.warn(f"{len(left)} checkpoint verification(s) cut short, {why}: {', '.join(left)}; they carry no "
                      "stamp and are verified when a resume picks them", _incomplete_warning(), stacklevel=3)

    def _take_unraised(self) -> Verdict | None:
        with self._lock:
            first = self._unraised[0] if self._unraised else None
            self._unraised.clear()
        return first

    def _verify_only(self, root: str) -> Verdict:
        from ckptverify.audit.verify import verify_checkpoint

        started = time.perf_counter()
        if "://" in root:
            return _failed(root, "ckptverify verifies checkpoints on a local file system only")
        try:
            report = verify_checkpoint(root, jobs=self.jobs, deep=self.deep)
        except Exception as exc:  # a resume that cannot be checked is refused, with why
            return _failed(root, _why(exc), seconds=time.perf_counter() - started)
        return _verdict(root, report, None, time.perf_counter() - started, None)

    def _events_folder(self, root: str) -> str:
        return self.events_dir or os.path.dirname(os.path.abspath(root))

    def _emit(self, root: str, event: str, verdict: Verdict, rank: int, **extra: Any) -> None:
        self._emit_in(self._events_folder(root), event, verdict, rank, **extra)

    @staticmethod
    def _emit_in(folder: str, event: str, verdict: Verdict, rank: int, **extra: Any) -> None:
        from ckptverify.ownfiles.events import EventLog

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

    @staticmethod
    def _agree_pair(verdict: Verdict | None, earlier: Verdict | None,
                    group: Group) -> tuple[Verdict, Verdict | None]:
        """The coordinator's verdict of this save and earlier failure, on every rank (one broadcast)."""
        if group.broadcast is None:
            assert verdict is not None
            return verdict, earlier
        mine = None if verdict is None else {"verdict": verdict.to_dict(),
                                             "earlier": None if earlier is None else earlier.to_dict()}
        data = group.broadcast(mine)
        if verdict is not None:
            return verdict, earlier
        first = data["earlier"]
        return Verdict.from_dict(data["verdict"]), None if first is None else Verdict.from_dict(first)


def numbered_folders(root: str, number: Callable[[str], re.Match[str] | None],
                     keep: Callable[[str], bool]) -> list[tuple[int, str]]:
    """``(N, name)`` of the entries of ``root`` whose name ``number`` matches (group 1: ``N``) and whose path
    ``keep`` accepts, newest (highest ``N``) first; none when ``root`` cannot be listed."""
    try:
        names = os.listdir(root)
    except OSError:
        return []
    found = [(int(m.group(1)), n) for n in names if (m := number(n)) and keep(os.path.join(root, n))]
    return sorted(found, reverse=True)


def plain_folder(path: str) -> bool:
    """A folder, not a link to one (a resume follows no link planted among the checkpoints)."""
    return os.path.isdir(path) and not os.path.islink(path)


def settle_verdicts(verdicts: list[Verdict], arrived: list[Verdict]) -> list[Verdict]:
    """``verdicts`` with each pending one replaced by the verdict that arrived for it (same path and step)."""
    final = {(v.path, v.step): v for v in arrived}
    return [final.get((v.path, v.step), v) if v.pending else v for v in verdicts]


def _cut(path: str, step: int | None, why: str) -> Verdict:
    return Verdict(path=path, passed=False, step=step, message=f"{path} was not verified: {why}")


def _incomplete_warning() -> type[Warning]:
    from ckptverify.verifier.background import VerifyIncompleteWarning

    return VerifyIncompleteWarning


def _await_background(root: str) -> None:
    """Wait for a background verification of ``root`` still pending in this process (bounded by
    ``CKPTVERIFY_VERIFY_EXIT_TIMEOUT``); the verification that follows judges the checkpoint either way."""
    import sys

    background = sys.modules.get("ckptverify.verifier.background")
    if background is not None:  # else nothing was ever queued in this process
        background.wait_for_checkpoint(root, background.exit_timeout())
