"""Production mode of the Run protocol: the same ``train(run)`` as a real job, saving, tracing and watching its
replicas, so that a later replay can judge it.

``cv.Run.main(train, steps=T, run_dir=DIR, save_every=N, trace="metrics"|"state", trace_every=1)`` under
``python file.py`` or ``torchrun`` (any number of ranks):

- resumes from the newest checkpoint in ``DIR`` that verifies (a save that did not commit is never taken);
- saves the full ``TrainState`` every ``N`` steps to ``DIR/step_N`` (with manifest), and verifies each one in
  the background once it has committed (``verify=``), stamping the verdict beside it; the job waits for the
  pending verifications before it ends (``CKPTVERIFY_VERIFY_EXIT_TIMEOUT``, 600 s by default);
- records a rank-local trace in ``DIR/trace/from-<K>/`` (``K`` the step it started from), every
  ``trace_every`` steps, and each rank's host, device, versions and determinism settings beside it;
- on more than one rank, compares its data-parallel replicas after every traced step
  (:class:`~ckptverify.hardware.replica.ReplicaCheck`);
- appends what happened to ``DIR/events.jsonl`` (start, restore, save, verified, verify-failed, verify-skipped,
  verify-cut-short, replica-mismatch, fault-injected, end);
- writes ``DIR/run.json`` (the target, world size, trace level, ``trace_every``) for ``ckptverify replay``.

A fault (:class:`~ckptverify.hardware.inject.BitFlip`) can be planted for fire drills with ``fault=`` or the
``CKPTVERIFY_FAULT`` environment variable; it is never planted under the harness (a replay).
"""

from __future__ import annotations

import inspect
import json
import os
from dataclasses import asdict, dataclass
from typing import Any

from ckptverify.errors import UsageError
from ckptverify.own_files import write_atomic

__all__ = ["RUN_FILE", "TRACE_ROOT", "ProductionOptions", "read_run_file", "segment_dir"]

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
    on_mismatch: str = "warn"
    replica_check: bool = True
    fault: str | None = None  # BitFlip JSON
    verify: str = "background"
    on_verify_failure: str = "warn"

    def __post_init__(self) -> None:
        from ckptverify.runs.background import VerifyOptions

        VerifyOptions(mode=self.verify, on_failure=self.on_verify_failure)  # the same checks as save's
        if self.steps < 1:
            raise UsageError(f"steps must be at least 1, got {self.steps}")
        if self.save_every is not None and self.save_every < 1:
            raise UsageError(f"save_every must be at least 1, got {self.save_every}")
        if self.trace_every < 1:
            raise UsageError(f"trace_every must be at least 1, got {self.trace_every}")
        if self.on_mismatch not in ("warn", "raise"):
            raise UsageError(f"on_mismatch must be 'warn' or 'raise', got {self.on_mismatch!r}")


def segment_dir(run_dir: str, start: int) -> str:
    """The trace segment of a production job that started (fresh or resumed) at step ``start``."""
    return os.path.join(run_dir, TRACE_ROOT, f"from-{start:08d}")


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
            data = json.loads(f.read(1 << 20))
    except (OSError, ValueError) as exc:
        raise UsageError(f"{path} cannot be read ({exc}): is {run_dir} the run directory of a production job "
                         "(cv.Run.main(..., run_dir=...))?") from None
    if not isinstance(data, dict) or not isinstance(data.get("target"), str):
        raise UsageError(f"{path} does not describe a production job")
    return data


class Production:
    """The production side of one :class:`~ckptverify.resume.run.Run`: events, replicas, faults, run file."""

    def __init__(self, options: ProductionOptions, *, rank: int, world: int, target: str, start: int) -> None:
        from ckptverify.events import EventLog

        self.options = options
        self.rank = rank
        self.world = world
        self.target = target
        self.start = start
        self.events = EventLog(options.run_dir, rank=rank)
        self.replicas: Any = None
        self.injector: Any = None
        self._step = start

    def began(self, state: Any, resumed_from: str | None) -> None:
        """After ``run.restore``: write the run file and host info, attach the replica check and any fault."""
        from ckptverify.hardware.hostinfo import host_info

        seg = segment_dir(self.options.run_dir, self.start)
        os.makedirs(seg, exist_ok=True)
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

            self.replicas = ReplicaCheck(model, optimizer=None, on_mismatch=self.options.on_mismatch,
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
        """At the end of step ``step`` (after the optimizer step): compare the replicas on traced steps."""
        self._step = step
        if traced and self.replicas is not None:
            self.replicas.check(step)

    def save_options(self) -> dict[str, Any]:
        """How ``run`` saves in production: verified after the commit, results in ``events.jsonl``."""
        return {"verify": self.options.verify, "on_verify_failure": self.options.on_verify_failure,
                "events": self.events}

    def saved(self, step: int, path: str) -> None:
        if self.rank == 0:
            self.events.emit("save", step=step, path=path)

    def close(self, step: int) -> None:
        if self.injector is not None:
            self.injector.detach()
        if self.rank == 0:
            pending = 0
            if self.options.verify != "off":
                from ckptverify.runs.background import default_verifier, exit_timeout

                verifier = default_verifier()
                verifier.wait(exit_timeout())  # says so (warning, events) if it cuts any short
                pending = len(verifier.pending())
            self.events.emit("end", step=step, **({"unverified": pending} if pending else {}))


def _write_json(path: str, data: Any) -> None:
    write_atomic(path, json.dumps(data, indent=1, default=str), prefix=f".{os.path.basename(path)}.")
