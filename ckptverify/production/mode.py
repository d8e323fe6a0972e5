"""Production mode of the Run protocol: the same ``train(run)`` as a real job, saving, tracing and watching its
replicas, so that a later replay can judge it.

``cv.Run.main(train, steps=T, run_dir=DIR, save_every=N, trace="metrics"|"state", trace_every=1)`` under
``python file.py`` or ``torchrun`` (any number of ranks):

- resumes from the newest checkpoint in ``DIR`` that verifies (a save that did not commit, and a suspect one,
  saved after a replica mismatch, are never taken), as ``resume=`` allows (see below), and says on stderr (rank
  0) and in ``events.jsonl`` every checkpoint it skipped and why; a pick whose bytes fail their proof as they
  are loaded is recorded (``checkpoint-refused-at-load``) and the pick made again in the same start
  (:meth:`Production.restore`);
- refuses (exit 2, one line on stderr, nothing moved or loaded) a run directory it cannot write: it could not
  save, record, or move aside what fails;
- never overwrites a checkpoint that failed verification: one that a save of this job would write over is first
  moved aside, whole, into ``DIR/quarantine/`` (:func:`~ckptverify.runs.latest.move_aside`), and the job says
  so (stderr, a ``checkpoint-moved-aside`` event);
- saves the full ``TrainState`` every ``N`` steps to ``DIR/step_N`` (with manifest), and verifies each one in
  the background once it has committed (``verify=``), stamping the verdict beside it; the job waits for the
  pending verifications before it ends (``CKPTVERIFY_VERIFY_EXIT_TIMEOUT``, 600 s by default);
- records a rank-local trace in ``DIR/trace/from-<K>/`` (``K`` the step it started from), every
  ``trace_every`` steps, and each rank's host, device, versions and determinism settings beside it;
- on more than one rank, compares its data-parallel replicas after every traced step, one traced step late (the
  parameter digests of a row reach the host when the next row is recorded; waiting for them at once would stall
  the device every step), and at once before a save and at the last step
  (:meth:`~ckptverify.hardware.replica.ReplicaCheck.check_late`); a checkpoint saved after a mismatch is marked
  suspect (a note in its folder, copied into its stamp), and no resume picks it;
- appends what happened to ``DIR/events.jsonl`` (checkpoint-skipped, checkpoint-refused-at-load,
  checkpoint-moved-aside, resume-refused,
  start, restore, save, checkpoint-verified, checkpoint-failed, checkpoint-unverified, checkpoint-deleted,
  checkpoint-cut-short, replica-mismatch, replica-mismatch-end, fault-injected, end; ``docs/json-schema.md``);
- writes ``DIR/run.json`` (the target, world size, trace level, ``trace_every``) for ``ckptverify replay``.

``resume=``:

- ``"auto"`` (the default): resume from the newest checkpoint that verifies; start from step 0 when the run
  directory holds no checkpoint; **refuse** (:class:`ResumeRefusedError`, exit 2, nothing changed) when it holds
  checkpoints and none verifies, rather than start over and bury them;
- ``"required"``: as ``"auto"``, but refuse too when there is nothing to resume from;
- ``"never"``: start from step 0. The checkpoints that fail are moved aside into ``quarantine/`` first; a run
  directory that holds a checkpoint that verifies is refused (its steps would be overwritten, or a later
  ``"auto"`` would resume from the older run's state instead of this one's): use a new run directory.

Checkpoints already in ``quarantine/`` are listed at every start but never count as checkpoints to resume from.

A fault (:class:`~ckptverify.hardware.inject.BitFlip`) can be planted for fire drills with ``fault=`` or the
``CKPTVERIFY_FAULT`` environment variable; it is never planted under the harness (a replay).
"""

from __future__ import annotations

import contextlib
import errno
import inspect
import json
import os
import sys
from dataclasses import asdict, dataclass
from typing import Any

from ckptverify.errors import CkptVerifyError, ResumeRefusedError, UsageError
from ckptverify.options import VerifyOptions, failure_policy, verify_options
from ckptverify.ownfiles.names import NotRegularFileError, own_dir, write_atomic
from ckptverify.safeparse import safejson

__all__ = ["RESUME_MODES", "RUN_FILE", "TRACE_ROOT", "ProductionOptions", "ResumeRefusedError", "read_run_file",
           "resume_point", "segment_dir"]

#: What ``Run.main(..., resume=)`` accepts; see the module docstring.
RESUME_MODES = ("auto", "required", "never")

#: What a replay needs to know about the production job, written by rank 0 in the run directory.
RUN_FILE = "run.json"
#: Production traces live under ``DIR/trace/from-<step>/`` (one segment per start of the job).
TRACE_ROOT = "trace"


@dataclass(frozen=True, kw_only=True)
class ProductionOptions:
    run_dir: str
    steps: int
    save_every: int | None = None
    trace: str = "metrics"
    trace_every: int = 1
    on_replica_mismatch: str = "warn"
    replica_check: bool = True
    fault: str | None = None  # BitFlip JSON
    #: How each saved checkpoint is verified once committed: a VerifyOptions after construction (a ``when``
    #: string given here is turned into one).
    verify: VerifyOptions | str = "background"
    resume: str = "auto"

    def __post_init__(self) -> None:
        if not isinstance(self.run_dir, str) or "://" in self.run_dir:
            # Checkpoints, traces, events and the quarantine are written and renamed there (docs/storage.md).
            raise UsageError(f"run_dir must be a local or mounted directory path, got {self.run_dir!r}; verify, "
                             "scan and latest read object-store URLs")
        object.__setattr__(self, "verify", verify_options("Run.main", self.verify))  # the same checks as save's
        if self.steps < 1:
            raise UsageError(f"steps must be at least 1, got {self.steps}")
        if self.save_every is not None and self.save_every < 1:
            raise UsageError(f"save_every must be at least 1, got {self.save_every}")
        if self.trace_every < 1:
            raise UsageError(f"trace_every must be at least 1, got {self.trace_every}")
        failure_policy("on_replica_mismatch", self.on_replica_mismatch)
        if self.resume not in RESUME_MODES:
            raise UsageError(f"resume must be one of {', '.join(map(repr, RESUME_MODES))}, got {self.resume!r}")


def _say(message: str) -> None:
    print(f"ckptverify: {message}", file=sys.stderr, flush=True)


def _decide(options: ProductionOptions, refused: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """On rank 0: pick the checkpoint to resume from as ``options.resume`` allows, say (stderr, events) what was
    skipped and why, and move aside what a save of this job would overwrite. Returns ``{"picked": Latest as a
    dict, or None}`` or ``{"error": message}`` (then nothing was moved).

    ``refused``: the picks of this start that failed their proof while loading (newest last), each ``path``
    (absolute), ``step``, ``check``, ``reason``: the last one is recorded, and the pick made again (a failed
    stamp now says it is corrupt, so it is moved aside and the next older one taken).

    A run directory this job cannot write to (read-only, not permitted, ``events.jsonl`` not a regular file) is
    refused before anything is moved or loaded: the job could neither save nor record, nor move aside what fails.
    """
    root = options.run_dir
    try:
        return _decide_writing(options, refused or [])
    except OSError as exc:
        error = (f"cannot write to the run directory {root} ({exc}): a production job saves, records its events and "
                 "moves aside the checkpoints that fail there. Nothing was loaded (what was moved aside, if "
                 "anything, is said above); this refusal could not be recorded in events.jsonl. Make the run "
                 "directory writable, or give the job another run_dir.")
        _say(error)
        return {"error": error}


def _decide_writing(options: ProductionOptions, refused: list[dict[str, Any]]) -> dict[str, Any]:
    """:func:`_decide`, raising ``OSError`` when the run directory cannot be written."""
    from ckptverify.ownfiles.events import EventLog
    from ckptverify.ownfiles.names import open_append
    from ckptverify.runs.latest import is_own_step_dir, latest_verified, move_aside

    root = options.run_dir
    log = EventLog(root, rank=0)  # creates the run directory
    # Checked before anything is decided, so that a job that could not save or record is refused having changed
    # nothing (a read-only mount refuses even root; opening for append never follows a link).
    os.close(open_append(log.path))
    if not os.access(root, os.W_OK | os.X_OK):
        raise PermissionError(errno.EACCES, "not writable by this process", root)
    if refused:
        last = refused[-1]
        log.emit("checkpoint-refused-at-load", path=os.path.relpath(last["path"], root),
                 **{k: v for k, v in last.items() if k != "path"})
    # What load restores. Stamps trusted: load_picked proves the bytes as it reads them, and a refusal stamps
    # the pick failed so the next start moves on.
    found = latest_verified(root, formats={"dcp"}, train_state=True, trust_stamps=True)
    for q in found.quarantined if not refused else ():  # listed once, at the job's start
        _say(f"not considered: {q['path']}: {q['reason']}")
        log.emit("checkpoint-skipped", **q)
    for s in found.skipped:
        at = "" if s["step"] is None else f" (step {s['step']})"
        _say(f"skipped {s['path']}{at}: {s['state']}: {s['reason']}")
        log.emit("checkpoint-skipped", **s)
    present = [s for s in found.skipped if s["state"] != "other-format"]
    # A save that never committed (the job died while writing it) is no checkpoint whose loss a fresh start would
    # hide: it does not stop "auto" from starting at step 0 (it is still moved aside, never written over).
    committed = [s for s in present if s["state"] != "incomplete"]
    listing = "; ".join(f"{s['path']}: {s['state']} ({s['reason']})" for s in committed)
    error = None
    if found.path is not None and any(r["path"] == found.path for r in refused):
        error = (f"{os.path.relpath(found.path, root)} (step {found.step}) failed its proof while loading and its "
                 "failed stamp could not be written, so it would be picked again: nothing was loaded, and nothing "
                 "was moved.")
    elif options.resume == "never" and found.path is not None:
        error = (f"resume='never' starts over from step 0, but {root} holds a checkpoint that verifies "
                 f"({os.path.relpath(found.path, root)}, step {found.step}): the new run would overwrite its steps, "
                 "or a later resume would pick the older run's state over the new one's. Use a new run directory, "
                 "or resume='auto'. Nothing was changed.")
    elif options.resume != "never" and found.path is None and committed:
        error = (f"resume={options.resume!r}: {len(committed)} checkpoint(s) under {root} and none verifies, so "
                 f"there is nothing to resume from: {listing}. Nothing was changed. To start over from step 0 "
                 "anyway, pass resume='never' (they are then moved aside into quarantine/, never deleted).")
    elif options.resume == "required" and found.path is None:
        error = (f"resume='required': there is nothing to resume from: no checkpoint under {root}. Nothing was "
                 "changed.")
    if error is not None:
        _say(error)
        log.emit("resume-refused", resume=options.resume, reason=error, skipped=found.skipped)
        return {"error": error}
    for s in present:
        # Every skipped checkpoint is newer than the pick (or there is no pick): a save of this job may land on
        # its step. Moved aside now, whole, never written over.
        if not is_own_step_dir(s["path"]):
            continue
        try:
            moved = move_aside(root, s["path"])
        except CkptVerifyError as exc:  # the job does not start over a checkpoint it cannot keep
            error = f"{exc}. The job does not start: a save of it could land on {s['path']}."
            _say(error)
            log.emit("resume-refused", resume=options.resume, reason=error, skipped=found.skipped)
            return {"error": error}
        _say(f"moved {s['path']} aside to {moved} ({s['state']}: {s['reason']}); it is kept as it is, never "
             "overwritten")
        log.emit("checkpoint-moved-aside", path=s["path"], to=moved, step=s["step"], state=s["state"],
                 reason=s["reason"])
    if found.path is not None:
        newer = f"; {len(found.skipped)} newer skipped" if found.skipped else ""
        _say(f"resuming from {os.path.relpath(found.path, root)} (step {found.step}), the newest checkpoint that "
             f"verifies{newer}")
    elif present or found.quarantined:
        _say(f"starting from step 0 (resume={options.resume!r})")
    return {"picked": found.to_dict() if found.path is not None else None}


def resume_point(options: ProductionOptions, *, rank: int, world: int,
                 refused: list[dict[str, Any]] | None = None) -> Any:
    """The checkpoint a production job resumes from (a :class:`~ckptverify.runs.latest.Latest`, the same on
    every rank), or ``None`` for a start from step 0; see the module docstring. Decided on rank 0 (where the
    run directory may be all there is of it) and broadcast. Raises :class:`ResumeRefusedError` on every rank
    when ``options.resume`` forbids starting, or the run directory cannot be written. ``refused``: the picks
    of this start that failed their proof while loading (:meth:`Production.restore`)."""
    from ckptverify.runs.latest import Latest

    box: list[Any] = [_decide(options, refused) if rank == 0 else None]
    if world > 1:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.broadcast_object_list(box, src=0)
    outcome = box[0]
    if "error" in outcome:
        raise ResumeRefusedError(outcome["error"])
    data = outcome["picked"]
    if data is None:
        return None
    return Latest(path=data["path"], step=data["step"], skipped=list(data["skipped"]),
                  quarantined=list(data.get("quarantined", [])))


def segment_dir(run_dir: str, start: int) -> str:
    """The trace segment of a production job that started (fresh or resumed) at step ``start``."""
    return os.path.join(run_dir, TRACE_ROOT, _segment_name(start))


def _segment_name(start: int) -> str:
    return f"from-{start:08d}"


def segments(run_dir: str) -> list[tuple[int, str]]:
    """``(start step, path)`` of every trace segment of a run, by start step."""
    root = os.path.join(run_dir, TRACE_ROOT)
    out = []
    for name in sorted(os.listdir(root)) if os.path.isdir(root) else []:
        if name.startswith("from-") and name[5:].isdigit():
            out.append((int(name[5:]), os.path.join(root, name)))
    return out


def target_of(train: Any) -> str:
    """``FILE.py:FUNC`` for a training function (what the harness and ``replay`` import)."""
    path = inspect.getsourcefile(train)
    if path is None:
        raise UsageError(f"cannot tell where {train!r} is defined; production mode needs a function in a file")
    return f"{os.path.abspath(path)}:{train.__qualname__}"


def read_run_file(run_dir: str) -> dict[str, Any]:
    """The production job's ``run.json``; :class:`~ckptverify.errors.UsageError` when absent or unreadable."""
    path = os.path.join(run_dir, RUN_FILE)
    try:
        with open(path, "rb") as f:
            data = safejson.loads(f.read(1 << 20))
    except (OSError, ValueError) as exc:
        raise UsageError(f"{path} cannot be read ({exc}): is {run_dir} the run directory of a production job "
                         "(cv.Run.main(..., run_dir=...))?") from None
    if not isinstance(data, dict) or not isinstance(data.get("target"), str):
        raise UsageError(f"{path} does not describe a production job")
    return data


class Production:
    """The production side of one :class:`~ckptverify.resume.run.Run`: events, replicas, faults, run file."""

    def __init__(self, options: ProductionOptions, *, rank: int, world: int, target: str, start: int) -> None:
        from ckptverify.ownfiles.events import EventLog

        self.options = options
        self.rank = rank
        self.world = world
        self.target = target
        self.start = start
        self.events = EventLog(options.run_dir, rank=rank)
        try:  # before the run writes its first trace file there: a link at trace/ or from-<K> is never followed
            self.segment = self._own_segment()
        except NotRegularFileError as exc:
            if rank == 0:
                _say(f"cannot record the trace in {exc.filename}: {exc.strerror}. The job does not start.")
            raise ResumeRefusedError(str(exc)) from None
        self.replicas: Any = None
        self.injector: Any = None
        self._step = start
        self._suspect: dict[str, Any] | None = None

    def restore(self, state: Any, picked: Any) -> tuple[Any, Any]:
        """Load ``picked`` (from :func:`resume_point`) into ``state``; return the load's report and the pick
        loaded. A pick whose bytes fail their proof while loading (stamped failed by
        :func:`~ckptverify.checkpoint.load.load_picked`, ``state`` untouched) is recorded
        (``checkpoint-refused-at-load``) and the pick made again, as at the job's start: it is moved aside and the
        next older checkpoint that verifies is loaded, so the job falls back in this start. Raises
        :class:`ResumeRefusedError` on every rank when nothing is left to resume from (as ``resume=`` says) or a
        load is refused otherwise (restore check, commit): never trains on damaged state."""
        from ckptverify.checkpoint.load import load_picked
        from ckptverify.errors import CheckpointRefusedError, ProofFailedError

        refused: list[dict[str, Any]] = []
        while True:
            try:
                report = load_picked(state, picked)
            except ProofFailedError as exc:
                refused.append({"path": picked.path, "step": picked.step, "check": exc.info.get("check"),
                                "reason": str(exc)})
                if self.rank == 0:
                    _say(f"{picked.path} (step {picked.step}) failed its proof while loading: {exc}; trying the "
                         "next older checkpoint that verifies")
                failed = picked.path
                picked = resume_point(self.options, rank=self.rank, world=self.world, refused=refused)
                if picked is None:  # the refused one vanished meanwhile: this start no longer resumes its run
                    self._refuse(refused[-1]["reason"], failed)
                continue
            except CheckpointRefusedError as exc:
                self._refuse(str(exc), picked.path)
            if picked.step != self.start:  # fell back: the trace segment is of the step it resumes from
                made, self.start = self.segment, picked.step
                try:  # as at the job's start: a link there is never followed
                    self.segment = self._own_segment()
                except OSError as exc:
                    self._refuse(f"cannot record the trace: {exc}", picked.path)
                with contextlib.suppress(OSError):  # made for the pick that failed, still empty (rmdir or nothing)
                    os.rmdir(made)
            self._step = self.start
            return report, picked

    def _own_segment(self) -> str:
        """This start's trace segment, made (or checked) as an own folder: a link at ``trace/`` or at its name is
        never followed out of the run directory."""
        return own_dir(self.options.run_dir, TRACE_ROOT, _segment_name(self.start))

    def _refuse(self, reason: str, path: str | None) -> None:
        """Say (rank 0: stderr, a ``resume-refused`` event) that the resume is refused, and raise
        :class:`ResumeRefusedError` (every rank)."""
        if self.rank == 0:
            _say(f"resume refused: {reason}")
            try:
                self.events.emit("resume-refused", reason=reason, path=path)
            except OSError as exc:
                _say(f"this refusal could not be recorded in events.jsonl: {exc}")
        raise ResumeRefusedError(reason)

    def began(self, state: Any, resumed_from: str | None) -> None:
        """After ``run.restore``: write the run file and host info, attach the replica check and any fault."""
        from ckptverify.hardware.hostinfo import host_info

        seg = self._own_segment()
        _write_json(os.path.join(seg, f"host-rank{self.rank}.json"), host_info())
        if self.rank == 0:
            _write_json(os.path.join(self.options.run_dir, RUN_FILE), {
                "target": self.target, "world_size": self.world, "level": self.options.trace,
                "trace_every": self.options.trace_every, "save_every": self.options.save_every,
                "steps": self.options.steps, "options": asdict(self.options)})
            self.events.emit("start" if resumed_from is None else "restore", step=self.start,
                             resumed_from=resumed_from, world_size=self.world, target=self.target)
        model = getattr(state, "model", None)
        optimizers = list(getattr(state, "optimizers", None) or [])
        if self.options.replica_check and self.world > 1 and model is not None:
            from ckptverify.hardware.replica import ReplicaCheck

            self.replicas = ReplicaCheck(model, optimizer=None,
                                         on_replica_mismatch=self.options.on_replica_mismatch,
                                         events=self.events)
        fault = self.options.fault or os.environ.get("CKPTVERIFY_FAULT")
        if fault and model is not None:
            from ckptverify.hardware.inject import BitFlip, FaultInjector

            flip = BitFlip.from_json(fault)
            self.injector = FaultInjector(
                flip, model=model, optimizer=optimizers[0] if optimizers else None, rank=self.rank,
                step_in_progress=lambda: self._step + 1,
                on_fire=lambda f: self.events.emit("fault-injected", step=f.step, site=f.site, element=f.element,
                                                   bit=f.bit))

    def traced_by(self, recorder: Any) -> None:
        """The job's trace recorder: the replica check reuses the parameter digests of each traced row."""
        if self.replicas is not None:
            self.replicas.digest_source = recorder

    def stepped(self, step: int, *, traced: bool) -> None:
        """At the end of step ``step`` (after the optimizer step): on traced steps, compare the replicas as they
        were at the traced step before; at the job's last step, this one's too (nothing comes after it)."""
        self._step = step
        if traced and self.replicas is not None:
            self.replicas.check_late(step)
        if self.replicas is not None and step >= self.options.steps:
            self.replicas.flush_late()

    def save_options(self) -> dict[str, Any]:
        """How ``run`` saves in production: verified after the commit, results in ``events.jsonl``."""
        return {"verify": self.options.verify, "events": self.events}

    def before_save(self, step: int, path: str) -> None:
        """Before the save of ``step`` into ``path`` (every rank calls it): on rank 0, whatever is already at
        ``path`` is moved aside (never written over), and a save after a replica mismatch gets its suspect note.
        The other ranks wait, so none writes into the folder before it is moved. Every rank first compares the
        replicas' step the late check still holds: the suspect note must cover the state being saved."""
        self._suspect = None
        if self.replicas is not None:
            self.replicas.flush_late()
        if self.rank == 0:
            from ckptverify.runs.latest import move_aside

            root = self.options.run_dir
            if os.path.lexists(path):
                rel = os.path.relpath(path, root)
                try:
                    moved = move_aside(root, rel)
                except CkptVerifyError as exc:  # never saved over it: the job stops, as a refused start does
                    _say(f"{exc}. The save of step {step} would write over it: the job stops.")
                    raise SystemExit(2) from None
                why = "something was already at the path of the save of this step"
                _say(f"moved {rel} aside to {moved} ({why}); it is kept as it is, never overwritten")
                self.events.emit("checkpoint-moved-aside", path=rel, to=moved, step=step, state="in-the-way",
                                 reason=why)
            suspect = self.replicas.suspect() if self.replicas is not None else None
            if suspect is not None:
                from ckptverify.runs.stamp import describe_suspect, write_suspect_note

                self._suspect = {"step": step, **suspect}
                write_suspect_note(path, self._suspect)
                _say(f"{os.path.relpath(path, root)} is suspect: {describe_suspect(self._suspect)}; no resume "
                     "picks it")
        if self.world > 1:
            import torch.distributed as dist

            if dist.is_available() and dist.is_initialized():
                dist.barrier()

    def saved(self, step: int, path: str) -> None:
        if self.rank == 0:
            suspect = self._suspect
            self.events.emit("save", step=step, path=path, **({"suspect": suspect} if suspect else {}))

    def close(self, step: int) -> None:
        if self.injector is not None:
            self.injector.detach()
        if self.replicas is not None:
            self.replicas.finish()  # an episode still open: its count, now
        if self.rank == 0:
            pending = 0
            if self.options.verify.when != "off":
                from ckptverify.verifier.background import default_verifier, exit_timeout

                verifier = default_verifier()
                verifier.wait(exit_timeout())  # says so (warning, events) if it cuts any short
                pending = len(verifier.pending())
            self.events.emit("end", step=step, **({"unverified": pending} if pending else {}))
        elif self.options.verify.when != "off":
            # The lowest rank of another node verifies its node's part of each save (verifier.parts): a job
            # that ends with os._exit would cut it short.
            from ckptverify.verifier.background import exit_timeout, wait_for_verifications

            wait_for_verifications(exit_timeout())


def _write_json(path: str, data: Any) -> None:
    write_atomic(path, json.dumps(data, indent=1, default=str), prefix=f".{os.path.basename(path)}.")
