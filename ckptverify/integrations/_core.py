"""What every framework integration shares: check a checkpoint the framework just wrote, and one about to be loaded.

After a save (:meth:`Verifier.after_save`), the coordinator runs :func:`~ckptverify.verifier.saved.check_saved`
(verify; fingerprint when content no checksum protects, or with ``fingerprint=True``; stamp) and appends one event
to ``events.jsonl``. A failure is a :class:`VerifyFailedWarning` and a ``checkpoint-failed`` event, and with
``on_failure="raise"`` a :class:`~ckptverify.errors.CheckpointRefusedError` on every rank. Non-error findings are
recorded, never warned about. Before a load (:meth:`Verifier.before_resume`) the checkpoint is verified read-only
and refused on every rank if it fails or cannot be verified. Verdicts reach every rank through the framework's
broadcast (:class:`Group`), so every rank raises or none does.

With ``verify="background"`` the coordinator queues the checkpoint for the process's background verifier (its
``check-saved`` job) and the save returns with a *pending* verdict; a ``raise`` failure surfaces at the next
:meth:`Verifier.after_save` or :meth:`Verifier.wait` (which the integrations call at the end, bounded, reporting
``checkpoint-cut-short``). :meth:`Verifier.before_resume` waits for a pending check first. A checkpoint the
framework's retention deleted meanwhile is a ``checkpoint-deleted`` event, not a failure; our files are removed.
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import sys
import threading
import time
import warnings
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from ckptverify.errors import (
    CheckpointRefusedError,
    CkptVerifyWarning,
    UsageError,
    VerifyFailedWarning,
)
from ckptverify.findings import Report
from ckptverify.options import VerifyOptions, verify_options
from ckptverify.state.distributed import Group
from ckptverify.verifier.saved import (
    Fingerprint,
    cannot_verify,
    check_saved,
    stopped_by,
    verification_of,
    was_deleted,
)
from ckptverify.verifier.verification import Verification, event_of, unverified

__all__ = ["WHEN", "Verifier", "integration_verify", "numbered_folders"]

#: When an integration verifies a saved checkpoint (every save is verified: ``"off"`` is not one).
WHEN: tuple[str, ...] = ("inline", "background")


def integration_verify(where: str, verify: VerifyOptions | str) -> VerifyOptions:
    """An integration's ``verify=`` as :class:`~ckptverify.options.VerifyOptions` with ``when`` in :data:`WHEN` (every
    save is verified)."""
    return verify_options(where, verify, when=WHEN)


class Verifier:
    """Verify checkpoints after a framework saves them and before it loads them (see the module docstring).

    Args:
        verify: a :class:`~ckptverify.options.VerifyOptions` or its ``when``: ``"inline"`` (default) or
            ``"background"`` (the framework must call :meth:`wait` at the end). ``on_failure``: ``"warn"`` or
            ``"raise"`` (:class:`~ckptverify.errors.CheckpointRefusedError` on every rank) for a failed save; a
            failing load is always refused. ``deep``: also compare every tensor's fingerprint with the manifest's.
        fingerprint: write a manifest right after a save. ``"auto"`` (default): only for content no checksum
            protects (safetensors weights, DCP items without CRC-32); elsewhere CRC-32 covers every byte and the
            fingerprints cost more than the save (``docs/integrations.md``). ``True``: always. ``False``: never.
        jobs: verification threads (default: one per core inline, one in the background).
        events_dir: where ``events.jsonl`` goes (default: the checkpoint's folder).
    """

    def __init__(self, *, verify: VerifyOptions | str = "inline", fingerprint: Fingerprint = "auto",
                 jobs: int | None = None, events_dir: str | os.PathLike[str] | None = None) -> None:
        options = integration_verify("Verifier", verify)
        from ckptverify.state.train_state import watch_optimizer_steps

        watch_optimizer_steps()  # from now on a save can tell accumulated gradients from a step's
        if jobs is not None and jobs < 1:
            raise UsageError(f"jobs must be at least 1, got {jobs}")
        if fingerprint not in (True, False, "auto"):
            raise UsageError(f"fingerprint must be True, False or 'auto', got {fingerprint!r}")
        self.verify, self.on_failure, self.deep = options, options.on_failure, bool(options.deep)
        self.background = options.when == "background"
        self.fingerprint: Fingerprint = fingerprint
        self.jobs = jobs
        self.events_dir = None if events_dir is None else os.fspath(events_dir)
        # Coordinator's background state (pending, arrived, unraised failures), filled from the verifier thread.
        self._lock = threading.Lock()
        self._pending: list[str] = []
        self._arrived_verdicts: list[Verification] = []
        self._unraised: list[Verification] = []

    # -- the entry points
    def after_save(self, path: str | os.PathLike[str], *, step: int | None = None, group: Group = Group(),
                   fingerprint: Fingerprint | None = None) -> Verification:
        """Check the checkpoint just written at ``path`` (every rank calls; the coordinator checks). ``fingerprint``:
        override for this save (``False`` when the hashing writer wrote the manifest). Returns the verdict on every rank
        (pending with ``background``); raises :class:`~ckptverify.errors.CheckpointRefusedError` on every rank for a
        failure with ``on_failure="raise"`` (with ``background``: one found since the last call)."""
        root = os.fspath(path)
        if group.barrier is not None:
            group.barrier()  # every rank's files are written before any is read
        mine = None
        fingerprint = self.fingerprint if fingerprint is None else fingerprint
        hosts = self._node_hosts(root, group)
        if hosts is not None and not group.coordinator:
            from ckptverify.verifier.background import submit_part

            submit_part(root, step, hosts, group.rank)
        if group.coordinator:
            from ckptverify.ownfiles.partsplan import share_out

            if hosts is not None and share_out(root, hosts, fingerprint=fingerprint, deep=self.deep):
                verdict = self._submit(root, step, fingerprint, parts=True)
            else:  # verified now, or queued for the background verifier
                verdict = (self._submit if self.background else self._check_saved)(root, step, fingerprint)
            mine = [self._take_unraised(), verdict]
        earlier, verdict = _agree(mine, group)
        assert verdict is not None
        _refuse_earlier(earlier)
        if not verdict.passed and not verdict.pending:
            if self.on_failure == "raise":
                raise CheckpointRefusedError(f"checkpoint saved at {verdict.message}", verdict.report)
            if group.coordinator:
                warnings.warn(verdict.message, VerifyFailedWarning, stacklevel=3)
        return verdict

    def wait(self, *, group: Group = Group(), timeout: float | None = None) -> list[Verification]:
        """Wait for this verifier's background verifications (every rank calls), up to ``timeout`` (default
        ``CKPTVERIFY_VERIFY_EXIT_TIMEOUT``, 600 s); unfinished ones are warned about and logged ``checkpoint-cut-short``
        (verified when a resume picks them). Returns the verdicts arrived since the last wait on every rank; raises
        :class:`~ckptverify.errors.CheckpointRefusedError` for an unraised failure with ``on_failure="raise"``."""
        if not self.background:
            return []
        mine = None
        if group.coordinator:
            from ckptverify.verifier.background import default_verifier, exit_timeout

            limit = exit_timeout() if timeout is None else timeout
            with self._lock:
                queued = list(self._pending)
            if queued and not default_verifier().wait_for(queued, limit):
                with self._lock:
                    left = [p for p in self._pending if p in queued]
                if left:
                    self._cut_short([(p, None, self._events_folder(p)) for p in left],
                                    f"not verified within the {limit} s waited")
            with self._lock:
                arrived, self._arrived_verdicts = self._arrived_verdicts, []
            mine = [self._take_unraised(), *arrived]
        elif group.gather is not None:
            # This rank may verify its node's part of a save shared out among nodes (verifier.parts).
            from ckptverify.verifier.background import exit_timeout, wait_for_verifications

            wait_for_verifications(exit_timeout() if timeout is None else timeout)
        earlier, *arrived = _agree(mine, group)
        _refuse_earlier(earlier)
        return arrived  # type: ignore[return-value]

    def settle(self, verdicts: list[Verification], *, group: Group = Group()) -> list[Verification]:
        """:meth:`wait` (every rank calls), then ``verdicts`` with each pending one replaced by the verdict that arrived
        for it (same path and step)."""
        final = {(v.path, v.step): v for v in self.wait(group=group)}
        return [final.get((v.path, v.step), v) if v.pending else v for v in verdicts]

    def pending(self) -> list[str]:
        """The checkpoints handed to the background verifier and not finished yet (on the coordinator)."""
        with self._lock:
            return list(self._pending)

    def before_resume(self, path: str | os.PathLike[str], *, group: Group = Group()) -> Verification:
        """Verify ``path`` before it is loaded (after any pending background check), read-only; refuse on every rank if
        it fails or cannot be verified. Returns the verdict when it passed."""
        verdict = self.check(path, group=group, warn=False)
        if not verdict.passed:
            raise CheckpointRefusedError(f"refusing to resume: {verdict.message}", verdict.report)
        return verdict

    def newest_verified(self, paths: list[str], folder: str, *, group: Group = Group()) -> Verification | None:
        """The verdict of the first of ``paths`` (newest first, same on every rank) that verifies; earlier ones are
        skipped with a warning and ``resume-refused`` event. ``None`` if ``paths`` is empty;
        :class:`~ckptverify.errors.CheckpointRefusedError` if none verifies (starting over would silently lose the run).
        """
        refused: list[Verification] = []
        for path in paths:
            verdict = self.check(path, group=group)
            if verdict.passed:
                return verdict
            refused.append(verdict)
        if not refused:
            return None
        raise CheckpointRefusedError(f"refusing to resume: none of the {len(refused)} checkpoint(s) under {folder} "
                                     f"verifies; newest: {refused[0].message}", refused[0].report)

    def newest_numbered(self, folder: str, number: Callable[[str], re.Match[str] | None], *,
                        group: Group = Group()) -> Verification | None:
        """:meth:`newest_verified` over the folders in ``folder`` whose name ``number`` matches (group 1: ``N``),
        listed on the coordinator; links are not followed (a resume follows no link planted among the checkpoints).
        """
        names = group.share(lambda: [n for _, n in numbered_folders(
            folder, number, lambda path: os.path.isdir(path) and not os.path.islink(path))])
        return self.newest_verified([os.path.join(folder, n) for n in names], folder, group=group)

    def check(self, path: str | os.PathLike[str], *, group: Group = Group(), warn: bool = True) -> Verification:
        """Verify ``path`` read-only on the coordinator (after any pending background check), log ``resume-verified``
        or ``resume-refused``, and return the verdict on every rank. Never raises for a failing checkpoint."""
        root = os.fspath(path)
        mine = None
        if group.coordinator:
            background = sys.modules.get("ckptverify.verifier.background")
            if background is not None:  # else nothing was ever queued in this process: nothing to wait for
                background.wait_for_checkpoint(root, background.exit_timeout())
            verdict = self._verify_only(root)
            self._emit(self._events_folder(root), "resume-verified" if verdict.passed else "resume-refused", verdict,
                       group.rank)
            mine = [verdict]
        verdict = _agree(mine, group)[0]
        assert verdict is not None
        if warn and not verdict.passed and group.coordinator:
            warnings.warn(f"resume: {verdict.message}", VerifyFailedWarning, stacklevel=3)
        return verdict

    # -- coordinator side
    def _check_saved(self, root: str, step: int | None, fingerprint: Fingerprint) -> Verification:
        verdict, extra = check_saved(root, step, fingerprint, jobs=self.jobs, deep=self.deep)
        self._emit(self._events_folder(root), event_of(verdict), verdict, 0, **extra)
        return verdict

    def _node_hosts(self, root: str, group: Group) -> list[str] | None:
        """Each rank's node when this background verification is shared among nodes (every rank calls it): a local DCP
        folder, or a folder with DCP folders inside, a group that can gather, and more than one node. Else ``None`` (the
        coordinator verifies everything). Parts rebuild pieces with ``deep`` and bring digests when fingerprinting
        (:func:`~ckptverify.verifier.saved.saved_job`)."""
        if not self.background or "://" in root:
            return None
        from ckptverify.ownfiles.partsplan import dcp_folders
        from ckptverify.verifier.background import node_hosts

        return node_hosts(group) if dcp_folders(root) else None

    def _submit(self, root: str, step: int | None, fingerprint: Fingerprint, parts: bool = False) -> Verification:
        """Queue ``root`` for the background verifier (``parts``: shared among nodes)."""
        from ckptverify.verifier.background import Task, default_verifier
        from ckptverify.verifier.jobs import CHECK_SAVED

        if "://" in root:  # refused at once, as inline: there is nothing to queue
            return self._check_saved(root, step, fingerprint)
        where = os.path.abspath(root)  # the verifier process may not share this process's working directory
        folder = self._events_folder(root)
        verifier = default_verifier()
        task = Task(job=CHECK_SAVED,
                    args={"root": where, "step": step, "fingerprint": fingerprint, "jobs": self.jobs or 1,
                          "deep": self.deep, "settle": verifier.settle, **({"parts": True} if parts else {})},
                    done=functools.partial(self._arrived, root, where, step, folder),
                    cut_short=lambda why: self._cut_short([(root, step, folder)], why))
        with self._lock:
            self._pending.append(where)
        try:
            verifier.submit(where, step=step, task=task)
        except UsageError:  # the process's verifier was closed (the interpreter is exiting): verify it now
            with self._lock:
                self._pending.remove(where)
            return self._check_saved(root, step, fingerprint)
        return unverified(root, step, "pending", "queued for verification in the background", deep=self.deep,
                          message=f"{root} is queued for verification in the background")

    def _arrived(self, root: str, where: str, step: int | None, folder: str, result: Any, why: str | None) -> None:
        """A background verification finished (verifier thread): event, warning, and a failure kept for the next save.
        """
        extra: dict[str, Any] = {}
        from ckptverify.verifier.background import REMOVED

        if result is None and why == REMOVED:
            verdict, event = was_deleted(root, step), "checkpoint-deleted"
        elif result is None:
            verdict, event = cannot_verify(root, f"the background verification did not finish: {why}", step), \
                "checkpoint-failed"
        else:
            verdict = Verification.from_dict({**result["verification"], "path": root},
                                             report=None if result.get("report") is None
                                             else Report.from_dict(result["report"]))
            extra, event = dict(result.get("extra") or {}), str(result["event"])
            if verdict.stamp is not None and where != root:
                from ckptverify.runs.stamp import stamp_path

                verdict = replace(verdict, stamp=stamp_path(root))
        self._emit(folder, event, verdict, 0, **extra)
        failed = event == "checkpoint-failed"
        with self._lock:
            with contextlib.suppress(ValueError):
                self._pending.remove(where)
            self._arrived_verdicts.append(verdict)
            if failed and self.on_failure == "raise":
                self._unraised.append(verdict)
        if failed:
            warnings.warn(verdict.message, VerifyFailedWarning, stacklevel=2)

    def _cut_short(self, cut: list[tuple[str, int | None, str]], why: str) -> None:
        """Background verifications given up on (by :meth:`wait`, or by the process's verifier at interpreter exit):
        a ``checkpoint-cut-short`` event for each ``(path, step, events folder)``, and one warning."""
        for path, step, folder in cut:
            self._emit(folder, "checkpoint-cut-short",
                       unverified(path, step, "cut-short", why, message=f"{path} was not verified: {why}"), 0)
        warnings.warn(f"{len(cut)} checkpoint verification(s) cut short, {why}: {', '.join(p for p, _, _ in cut)}; "
                      "they carry no stamp and are verified when a resume picks them", CkptVerifyWarning, stacklevel=3)

    def _take_unraised(self) -> Verification | None:
        with self._lock:
            first = self._unraised[0] if self._unraised else None
            self._unraised.clear()
        return first

    def _verify_only(self, root: str) -> Verification:
        from ckptverify.audit.verify import verify_checkpoint

        started = time.perf_counter()
        if "://" in root:
            return cannot_verify(root, "ckptverify verifies checkpoints on a local file system only")
        try:
            report = verify_checkpoint(root, jobs=self.jobs, deep=self.deep)
        except Exception as exc:  # a resume that cannot be checked is refused, with why
            return cannot_verify(root, stopped_by(exc), seconds=time.perf_counter() - started)
        return verification_of(root, report, None, time.perf_counter() - started, None)

    def _events_folder(self, root: str) -> str:
        return self.events_dir or os.path.dirname(os.path.abspath(root))

    @staticmethod
    def _emit(folder: str, event: str, verdict: Verification, rank: int, **extra: Any) -> None:
        from ckptverify.ownfiles.events import EventLog

        try:
            EventLog(folder, rank=rank).emit(event, **verdict.to_dict(), **extra)
        except OSError as exc:  # the log is a record; an unwritable one must not stop training
            warnings.warn(f"ckptverify could not append to {folder}/events.jsonl: {exc}",
                          VerifyFailedWarning, stacklevel=4)


def _agree(mine: list[Verification | None] | None, group: Group) -> list[Verification | None]:
    """The coordinator's verdicts (``mine``; ``None`` elsewhere) on every rank, in one broadcast (the coordinator keeps
    its own, reports included)."""
    data = group.share(lambda: [None if v is None else v.to_dict() for v in mine or ()])
    return mine if mine is not None else [None if v is None else Verification.from_dict(v) for v in data]


def _refuse_earlier(earlier: Verification | None) -> None:
    """Raise for a failure the background verifier found since the last call (``on_failure="raise"``)."""
    if earlier is not None:
        raise CheckpointRefusedError(f"an earlier checkpoint failed verification in the background: checkpoint "
                                     f"saved at {earlier.message}", earlier.report)


def warn_if_accumulating(model: Any, path: str | os.PathLike[str]) -> None:
    """Warn when ``model`` holds gradients accumulated since the last step as ``path`` is saved (not in the checkpoint).
    """
    from ckptverify.state.train_state import pending_gradients_warning

    text = pending_gradients_warning(model, f"the checkpoint {os.fspath(path)}") if model is not None else None
    if text is not None:
        warnings.warn(text, CkptVerifyWarning, stacklevel=3)


def numbered_folders(root: str, number: Callable[[str], re.Match[str] | None],
                     keep: Callable[[str], bool]) -> list[tuple[int, str]]:
    """``(N, name)`` of ``root``'s entries ``number`` matches (group 1: ``N``) and ``keep`` accepts, newest first; none
    if unlistable."""
    try:
        names = os.listdir(root)
    except OSError:
        return []
    found = [(int(m.group(1)), n) for n in names if (m := number(n)) and keep(os.path.join(root, n))]
    return sorted(found, reverse=True)
