"""Production mode of the Run protocol (``cv.Run.main(train, steps=T, run_dir=DIR, ...)``): the same ``train(run)`` as a
real job that saves, verifies in the background, traces to ``DIR/trace/from-<K>/``, checks its replicas, logs
``DIR/events.jsonl`` and writes ``DIR/run.json`` so a later replay can judge it.

Traps, all to keep a job from training on or burying damaged state:

- it resumes from the newest checkpoint that verifies (never an uncommitted or suspect one); ``resume="auto"`` refuses
  when checkpoints exist and none verifies, ``"required"`` also when there are none, ``"never"`` when one verifies; a
  refusal is exit 2 with nothing changed; a pick failing its proof at load falls back in-start;
- a checkpoint that fails is never overwritten: it is moved aside whole into ``DIR/quarantine/``;
- an unwritable run directory is refused before anything is moved or loaded;
- replicas are compared one traced step late (no device stall), and before each save, so a checkpoint saved after a
  mismatch is marked suspect and never resumed from;
- a fault (``fault=`` / ``CKPTVERIFY_FAULT``) is never planted under the harness (a replay)."""

from __future__ import annotations

import contextlib
import errno
import inspect
import json
import os
import sys
from dataclasses import asdict, dataclass
from typing import Any

from ckptverify.errors import CkptVerifyError, NotRegularFileError, ResumeRefusedError, UsageError
from ckptverify.options import VerifyOptions, failure_policy, verify_options
from ckptverify.ownfiles.events import EventLog
from ckptverify.ownfiles.names import own_dir, write_atomic
from ckptverify.safeparse import safejson
from ckptverify.state.distributed import torch_group

__all__ = ["RESUME_MODES", "RUN_FILE", "TRACE_ROOT", "ProductionOptions", "read_run_file",
           "resume_point", "segment_dir"]

RESUME_MODES = ("auto", "required", "never")

#: Written by rank 0 for replays.
RUN_FILE = "run.json"
#: One segment ``DIR/trace/from-<step>/`` per start of the job.
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
    #: A VerifyOptions after construction (a ``when`` string is converted).
    verify: VerifyOptions | str = "background"
    resume: str = "auto"

    def __post_init__(self) -> None:
        if not isinstance(self.run_dir, str) or "://" in self.run_dir:
            # Everything is written and renamed there (docs/storage.md).
            raise UsageError(f"run_dir must be a local or mounted directory path, got {self.run_dir!r}; verify, "
                             "scan and latest read object-store URLs")
        object.__setattr__(self, "verify", verify_options("Run.main", self.verify))  # the same checks as save's
        for name in ("steps", "save_every", "trace_every"):  # save_every may be None (never)
            value = getattr(self, name)
            if value is not None and value < 1:
                raise UsageError(f"{name} must be at least 1, got {value}")
        failure_policy("on_replica_mismatch", self.on_replica_mismatch)
        if self.resume not in RESUME_MODES:
            raise UsageError(f"resume must be one of {', '.join(map(repr, RESUME_MODES))}, got {self.resume!r}")


def _say(message: str) -> None:
    print(f"ckptverify: {message}", file=sys.stderr, flush=True)


def _move_aside(log: Any, root: str, rel: str, step: int | None, state: str, reason: str) -> CkptVerifyError | None:
    """Move checkpoint ``rel`` into the quarantine, said on stderr and in ``log``; the :class:`CkptVerifyError` why
    it cannot be (nothing moved), else ``None``. Only the move is caught: a log that cannot be written fails as
    itself."""
    from ckptverify.runs.latest import move_aside

    try:
        moved = move_aside(root, rel)
    except CkptVerifyError as exc:
        return exc
    _say(f"moved {rel} aside to {moved} ({state}: {reason}); it is kept as it is, never overwritten")
    log.emit("checkpoint-moved-aside", path=rel, to=moved, step=step, state=state, reason=reason)
    return None


def _decide(options: ProductionOptions, refused: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """On rank 0: pick the checkpoint to resume from as ``options.resume`` allows, report what was skipped and why,
    and move aside what a save would overwrite. Returns ``{"picked": Latest dict or None}`` or ``{"error": msg}``
    (nothing moved). ``refused``: this start's picks that failed while loading; the last is recorded and the pick
    made again. An unwritable run directory is refused before anything is moved."""
    from ckptverify.ownfiles.names import open_append
    from ckptverify.runs.latest import is_own_step_dir, latest_verified

    root = options.run_dir
    refused = refused or []
    try:
        log = EventLog(root, rank=0)  # creates the run directory
        # Before deciding, so an unwritable directory is refused with nothing changed (a read-only mount refuses
        # even root; append-open never follows a link).
        os.close(open_append(log.path))
        if not os.access(root, os.W_OK | os.X_OK):
            raise PermissionError(errno.EACCES, "not writable by this process", root)
        if refused:
            last = refused[-1]
            log.emit("checkpoint-refused-at-load", path=os.path.relpath(last["path"], root),
                     **{k: v for k, v in last.items() if k != "path"})
        # Stamps trusted: load_picked proves the bytes while reading, and a refusal stamps the pick failed.
        found = latest_verified(root, formats={"dcp"}, train_state=True, trust_stamps=True)
        for q in found.quarantined if not refused else ():  # listed once, at the job's start
            _say(f"not considered: {q['path']}: {q['reason']}")
            log.emit("checkpoint-skipped", **q)
        for s in found.skipped:
            at = "" if s["step"] is None else f" (step {s['step']})"
            _say(f"skipped {s['path']}{at}: {s['state']}: {s['reason']}")
            log.emit("checkpoint-skipped", **s)
        present = [s for s in found.skipped if s["state"] != "other-format"]
        # An uncommitted save does not stop "auto" from starting at step 0 (it is still moved aside).
        committed = [s for s in present if s["state"] != "incomplete"]
        listing = "; ".join(f"{s['path']}: {s['state']} ({s['reason']})" for s in committed)
        error = None
        if found.path is not None and any(r["path"] == found.path for r in refused):
            error = (f"{os.path.relpath(found.path, root)} (step {found.step}) failed its proof while loading and its "
                     "failed stamp could not be written, so it would be picked again: nothing was loaded, and nothing "
                     "was moved.")
        elif options.resume == "never" and found.path is not None:
            error = (f"resume='never' starts over from step 0, but {root} holds a checkpoint that verifies "
                     f"({os.path.relpath(found.path, root)}, step {found.step}): the new run would overwrite its "
                     "steps, or a later resume would pick the older run's state over the new one's. Use a new run "
                     "directory, or resume='auto'. Nothing was changed.")
        elif options.resume != "never" and found.path is None and committed:
            error = (f"resume={options.resume!r}: {len(committed)} checkpoint(s) under {root} and none verifies, so "
                     f"there is nothing to resume from: {listing}. Nothing was changed. To start over from step 0 "
                     "anyway, pass resume='never' (they are then moved aside into quarantine/, never deleted).")
        elif options.resume == "required" and found.path is None:
            error = (f"resume='required': there is nothing to resume from: no checkpoint under {root}. Nothing was "
                     "changed.")

        def refuse(error: str) -> dict[str, Any]:
            _say(error)
            log.emit("resume-refused", resume=options.resume, reason=error, skipped=found.skipped)
            return {"error": error}

        if error is not None:
            return refuse(error)
        for s in present:
            # Skipped ones are newer than the pick: a save of this job may land on them.
            if not is_own_step_dir(s["path"]):
                continue
            exc = _move_aside(log, root, s["path"], s["step"], s["state"], s["reason"])
            if exc is not None:  # the job does not start over a checkpoint it cannot keep
                return refuse(f"{exc}. The job does not start: a save of it could land on {s['path']}.")
        if found.path is not None:
            newer = f"; {len(found.skipped)} newer skipped" if found.skipped else ""
            _say(f"resuming from {os.path.relpath(found.path, root)} (step {found.step}), the newest checkpoint that "
                 f"verifies{newer}")
        elif present or found.quarantined:
            _say(f"starting from step 0 (resume={options.resume!r})")
        return {"picked": found.to_dict() if found.path is not None else None}
    except OSError as exc:
        error = (f"cannot write to the run directory {root} ({exc}): a production job saves, records its events and "
                 "moves aside the checkpoints that fail there. Nothing was loaded (what was moved aside, if "
                 "anything, is said above); this refusal could not be recorded in events.jsonl. Make the run "
                 "directory writable, or give the job another run_dir.")
        _say(error)
        return {"error": error}


def resume_point(options: ProductionOptions, *, rank: int, world: int,
                 refused: list[dict[str, Any]] | None = None) -> Any:
    """The checkpoint a production job resumes from (a :class:`~ckptverify.runs.latest.Latest`, equal on every rank),
    or ``None`` for step 0. Decided on rank 0 (the run directory may exist only there) and broadcast;
    :class:`ResumeRefusedError` on every rank when refused."""
    from ckptverify.runs.latest import Latest

    mine = _decide(options, refused) if rank == 0 else None
    broadcast = torch_group().broadcast if world > 1 else None
    outcome = mine if broadcast is None else broadcast(mine)
    if "error" in outcome:
        raise ResumeRefusedError(outcome["error"])
    return None if outcome["picked"] is None else Latest.from_dict(outcome["picked"])


def segment_dir(run_dir: str, start: int) -> str:
    """The trace segment of a production job that started (fresh or resumed) at step ``start``."""
    return os.path.join(run_dir, TRACE_ROOT, _segment_name(start))


def _segment_name(start: int) -> str:
    return f"from-{start:08d}"


def segments(run_dir: str) -> list[tuple[int, str]]:
    """``(start step, path)`` of every trace segment of a run, by start step."""
    root = os.path.join(run_dir, TRACE_ROOT)
    names = sorted(os.listdir(root)) if os.path.isdir(root) else []
    return [(int(n[5:]), os.path.join(root, n)) for n in names if n.startswith("from-") and n[5:].isdigit()]


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
        """Load ``picked`` into ``state``; returns the load's report and the pick loaded. A pick failing its proof
        while loading (``state`` untouched) is recorded and the pick made again, so the job falls back in this start.
        :class:`ResumeRefusedError` on every rank when nothing is left or a load is refused: never trains on damaged
        state."""
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
                picked = resume_point(self.options, rank=self.rank, world=self.world, refused=refused)
                if picked is None:  # the refused one vanished meanwhile: this start no longer resumes its run
                    self._refuse(refused[-1]["reason"], refused[-1]["path"])
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
        """This start's trace segment as an own folder: a link at ``trace/`` or its name is never followed out of the
        run directory."""
        return own_dir(self.options.run_dir, TRACE_ROOT, _segment_name(self.start))

    def _refuse(self, reason: str, path: str | None) -> None:
        """Report the refusal (rank 0: stderr and event) and raise :class:`ResumeRefusedError` on every rank."""
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

            self.injector = FaultInjector(
                BitFlip.from_json(fault), model=model, optimizer=optimizers[0] if optimizers else None, rank=self.rank,
                step_in_progress=lambda: self._step + 1,
                on_fire=lambda f: self.events.emit("fault-injected", step=f.step, site=f.site, element=f.element,
                                                   bit=f.bit))

    def traced_by(self, recorder: Any) -> None:
        """The job's trace recorder: the replica check reuses the parameter digests of each traced row."""
        if self.replicas is not None:
            self.replicas.digest_source = recorder

    def stepped(self, step: int, *, traced: bool) -> None:
        """At the end of ``step``: on traced steps compare the replicas one traced step late; at the last step, this
        one too."""
        self._step = step
        if traced and self.replicas is not None:
            self.replicas.check_late(step)
        if self.replicas is not None and step >= self.options.steps:
            self.replicas.flush_late()

    def save_options(self) -> dict[str, Any]:
        """How ``run`` saves in production: verified after the commit, results in ``events.jsonl``."""
        return {"verify": self.options.verify, "events": self.events}

    def before_save(self, step: int, path: str) -> None:
        """Before the save of ``step`` into ``path`` (every rank): first flush the late replica check (the suspect
        note must cover the saved state); rank 0 moves aside whatever is at ``path`` and writes a suspect note after
        a mismatch; the others wait so none writes into the folder before it moves."""
        self._suspect = None
        if self.replicas is not None:
            self.replicas.flush_late()
        if self.rank == 0:
            root = self.options.run_dir
            if os.path.lexists(path):
                exc = _move_aside(self.events, root, os.path.relpath(path, root), step, "in-the-way",
                                  "something was already at the path of the save of this step")
                if exc is not None:  # never saved over it: the job stops, as a refused start does
                    _say(f"{exc}. The save of step {step} would write over it: the job stops.")
                    raise SystemExit(2) from None
            suspect = self.replicas.suspect() if self.replicas is not None else None
            if suspect is not None:
                from ckptverify.runs.stamp import describe_suspect, write_suspect_note

                self._suspect = {"step": step, **suspect}
                write_suspect_note(path, self._suspect)
                _say(f"{os.path.relpath(path, root)} is suspect: {describe_suspect(self._suspect)}; no resume "
                     "picks it")
        barrier = torch_group().barrier if self.world > 1 else None
        if barrier is not None:
            barrier()

    def saved(self, step: int, path: str) -> None:
        if self.rank == 0:
            self.events.emit("save", step=step, path=path, **({"suspect": self._suspect} if self._suspect else {}))

    def close(self, step: int) -> None:
        if self.injector is not None:
            self.injector.detach()
        if self.replicas is not None:
            self.replicas.finish()  # an episode still open: its count, now
        verified = self.options.verify.when != "off"
        if verified:
            # Rank 0's verifications, and another node's lowest rank's part of each save (os._exit would cut it
            # short); one cut short here is said (warning, events).
            from ckptverify.verifier.background import default_verifier, exit_timeout, wait_for_verifications

            wait_for_verifications(exit_timeout())
        if self.rank == 0:
            pending = len(default_verifier().pending()) if verified else 0
            self.events.emit("end", step=step, **({"unverified": pending} if pending else {}))


def _write_json(path: str, data: Any) -> None:
    write_atomic(path, json.dumps(data, indent=1, default=str), prefix=f".{os.path.basename(path)}.")
