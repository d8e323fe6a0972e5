"""The resume-equivalence harness: run A continuously, B resumed from A's checkpoint, and A2 again.

Each run is a fresh set of processes (``torch.multiprocessing`` spawn, one per rank; gloo on CPU, NCCL on
CUDA) executing the user's ``train(run)`` under a :class:`~ckptverify.resume.run.RunConfig`:

* **A** runs steps 1..T continuously, saving at K and T, tracing every step;
* **A2** runs 1..T again (saving at T), to tell nondeterminism from missing state;
* **B** starts in a new process group from A's checkpoint K, runs K+1..T (saving at T), tracing.

Then, in order: (a) the state restored in B against the state A saved, field by field, before any step;
(b) A against A2; (c) A against B for steps K+1..T; (d) the final checkpoints of A and B. The verdict
(:mod:`ckptverify.resume.verdict`) names what went wrong in plain words.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import shutil
import socket
import sys
import tempfile
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ckptverify.errors import CkptVerifyError, UsageError
from ckptverify.findings import Finding, Location, Report, error
from ckptverify.resume.run import ENV_VAR, Run, RunConfig, checkpoint_path

RUN_NAMES = ("A", "A2", "B")


class WorkloadCrashedError(CkptVerifyError):
    """The training function raised (exit 2: nothing could be concluded). Carries the traceback."""

    def __init__(self, message: str, traceback_text: str) -> None:
        super().__init__(message + "\n" + traceback_text)
        self.traceback_text = traceback_text


@dataclass(frozen=True, kw_only=True)
class Plan:
    target: str
    steps: int
    resume_at: int
    nproc: int = 1
    level: str = "state"
    runs: tuple[str, ...] = RUN_NAMES
    device: str = "cpu"

    def __post_init__(self) -> None:
        if ":" not in self.target:
            raise UsageError(f"target must be FILE.py:FUNC or module:FUNC, got {self.target!r}")
        if not 0 < self.resume_at < self.steps:
            raise UsageError(f"--resume-at must be between 1 and --steps - 1 ({self.steps - 1}), got {self.resume_at}")
        if self.nproc < 1:
            raise UsageError(f"--nproc must be at least 1, got {self.nproc}")
        unknown = set(self.runs) - set(RUN_NAMES)
        if unknown or "A" not in self.runs:
            raise UsageError(f"--runs must include A and be drawn from {', '.join(RUN_NAMES)}, got {self.runs}")


@dataclass
class Outcome:
    """The harness's result: the report (findings) and the verdict."""

    report: Report
    verdict: Any
    workdir: str
    runs: dict[str, str] = field(default_factory=dict)


def load_target(target: str) -> Callable[[Run], None]:
    """Resolve ``FILE.py:FUNC`` or ``package.module:FUNC`` to the training function."""
    where, _, name = target.rpartition(":")
    if where.endswith(".py") or os.sep in where:
        path = os.path.abspath(where)
        if not os.path.isfile(path):
            raise UsageError(f"workload file not found: {where}")
        spec = importlib.util.spec_from_file_location(f"_ckptverify_workload_{abs(hash(path))}", path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
    else:
        module = importlib.import_module(where)
    func = getattr(module, name, None)
    if not callable(func):
        raise UsageError(f"{where} has no function {name!r}")
    return func  # type: ignore[return-value]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _worker(rank: int, nproc: int, port: int, target: str, config_json: str, backend: str) -> None:
    import torch.distributed as dist

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(nproc), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    os.environ[ENV_VAR] = config_json
    config = RunConfig.from_json(config_json)
    if nproc > 1:
        if backend == "nccl":
            import torch

            torch.cuda.set_device(rank)
        dist.init_process_group(backend, rank=rank, world_size=nproc)
    try:
        run = Run(config)
        try:
            load_target(target)(run)
        finally:
            run.close()
        if nproc > 1:
            dist.barrier()  # no rank tears down while another is still in a collective
    except BaseException:
        if config.trace_dir:
            os.makedirs(config.trace_dir, exist_ok=True)
            with open(os.path.join(config.trace_dir, f"error-rank{rank}.txt"), "w") as f:
                f.write(traceback.format_exc())
        raise
    finally:
        if nproc > 1 and dist.is_initialized():
            dist.destroy_process_group()


def launch(plan: Plan, config: RunConfig) -> None:
    """Run ``plan.target`` under ``config`` in ``plan.nproc`` fresh processes; raise if any rank fails."""
    import torch.multiprocessing as mp

    backend = "nccl" if plan.device == "cuda" else "gloo"
    args = (plan.nproc, _free_port(), plan.target, config.to_json(), backend)
    try:
        mp.start_processes(_worker, args=args, nprocs=plan.nproc, join=True, start_method="spawn")
    except Exception as exc:
        text = ""
        if config.trace_dir and os.path.isdir(config.trace_dir):
            for name in sorted(os.listdir(config.trace_dir)):
                if name.startswith("error-rank"):
                    with open(os.path.join(config.trace_dir, name)) as f:
                        text += f"--- {name} ---\n{f.read()}"
        raise WorkloadCrashedError(f"the workload crashed in run {config.name}: {type(exc).__name__}",
                                   text or str(exc)) from None


def resume_check(plan: Plan, *, keep: str | None = None,
                 progress: Callable[[str], None] | None = None) -> Outcome:
    """Run the resume-equivalence check of ``plan``; return findings and verdict. Workdir kept if ``keep``."""
    from ckptverify.resume import verdict as verdicts

    say = progress or (lambda _msg: None)
    workdir = os.path.abspath(keep) if keep else tempfile.mkdtemp(prefix="ckptverify-resume-")
    if keep:
        os.makedirs(workdir, exist_ok=True)
    T, K = plan.steps, plan.resume_at
    dirs = {name: os.path.join(workdir, name) for name in plan.runs}
    for d in dirs.values():
        if os.path.exists(d):
            shutil.rmtree(d)
    configs = {
        "A": RunConfig(name="A", stop_step=T, save_at=(K, T), checkpoint_dir=os.path.join(dirs["A"], "ckpt"),
                       trace_dir=os.path.join(dirs["A"], "trace"), level=plan.level, workload=plan.target),
    }
    if "A2" in plan.runs:
        configs["A2"] = RunConfig(name="A2", stop_step=T, save_at=(T,), checkpoint_dir=os.path.join(dirs["A2"], "ckpt"),
                                  trace_dir=os.path.join(dirs["A2"], "trace"), level=plan.level, workload=plan.target)
    if "B" in plan.runs:
        configs["B"] = RunConfig(name="B", stop_step=T, save_at=(T,), checkpoint_dir=os.path.join(dirs["B"], "ckpt"),
                                 resume_from=checkpoint_path(os.path.join(dirs["A"], "ckpt"), K),
                                 trace_dir=os.path.join(dirs["B"], "trace"), level=plan.level, workload=plan.target)
    try:
        for name in ("A", "A2", "B"):
            if name in configs:
                what = {"A": f"run A: steps 1..{T} continuously, saving at step {K}",
                        "A2": f"run A2: steps 1..{T} again (determinism)",
                        "B": f"run B: resume from A's checkpoint at step {K}, steps {K + 1}..{T}"}[name]
                say(what)
                launch(plan, configs[name])
        say("comparing")
        findings, analysis = _compare(plan, configs)
        verdict = verdicts.decide(plan, analysis)
        findings.append(verdict.finding())
        report = Report(command="resume-check", target=plan.target, findings=tuple(findings),
                        stats={"steps": T, "resume_at": K, "nproc": plan.nproc, "level": plan.level,
                               "runs": list(configs), "workdir": workdir if keep else None,
                               "verdict": verdict.to_dict()})
        return Outcome(report=report, verdict=verdict, workdir=workdir, runs=dirs)
    finally:
        if not keep:
            shutil.rmtree(workdir, ignore_errors=True)


def _compare(plan: Plan, configs: dict[str, RunConfig]) -> tuple[list[Finding], dict[str, Any]]:
    from ckptverify.diff import diff_checkpoints

    T, K = plan.steps, plan.resume_at
    findings: list[Finding] = []
    analysis: dict[str, Any] = {"unsaved_schedulers": _read_notes(configs["A"])}
    # (a) restored state vs saved state
    if "B" in configs:
        restore: list[Finding] = []
        for name in sorted(os.listdir(configs["B"].trace_dir)):  # type: ignore[arg-type]
            if name.startswith("restore-rank") and name.endswith(".json"):
                with open(os.path.join(configs["B"].trace_dir, name)) as f:  # type: ignore[arg-type]
                    data = json.load(f)
                restore.extend(Finding.from_dict(x) for x in data.get("findings", [])
                               if x.get("severity") == "error")
        findings.extend(_tag("B restore", restore))
        analysis["restore"] = restore
    # (b) A vs A2: nondeterminism
    a_trace = configs["A"].trace_dir
    if "A2" in configs:
        nd, analysis["nondeterminism"] = _trace_stage("A vs A2", a_trace, configs["A2"].trace_dir, None)
        findings.extend(nd)
        if analysis["nondeterminism"] is not None:
            step = analysis["nondeterminism"].step
            analysis["nondeterminism_sites"] = _differing_sites(a_trace, configs["A2"].trace_dir,
                                                                range(step, step + 1))
    # (c) A vs B after the resume
    if "B" in configs:
        steps = range(K + 1, T + 1)
        ab, analysis["resume"] = _trace_stage("A vs B", a_trace, configs["B"].trace_dir, steps)
        findings.extend(ab)
        if analysis["resume"] is not None:
            step = analysis["resume"].step
            analysis["resume_sites"] = _differing_sites(a_trace, configs["B"].trace_dir, range(step, step + 1))
        # (d) final states
        final = diff_checkpoints(checkpoint_path(configs["A"].checkpoint_dir, T),  # type: ignore[arg-type]
                                 checkpoint_path(configs["B"].checkpoint_dir, T))  # type: ignore[arg-type]
        findings.extend(_tag("final A vs B", [f for f in final.findings if f.severity.value == "error"]))
        analysis["final"] = [f for f in final.findings if f.severity.value == "error"]
    return findings, analysis


def _trace_stage(stage: str, a: str | None, b: str | None, steps: range | None) -> tuple[list[Finding], Any]:
    """Compare two runs' traces. Random streams that differ while no value computed from them does (an
    unseeded, unused generator) are a warning, not a divergence."""
    from ckptverify.findings import warning
    from ckptverify.trace.compare import compare_runs, first_divergence

    found = compare_runs(a, b, steps=steps)  # type: ignore[arg-type]
    if not any(f.severity.value == "error" for f in found):
        return _tag(stage, found), None
    first = first_divergence(a, b, steps=steps)  # type: ignore[arg-type]
    differing = _differing_sites(a, b, steps)  # type: ignore[arg-type]
    if differing and all(name.startswith("rng.") for name in differing):
        names = ", ".join(sorted(differing))
        return [warning("trace-rng-unused", f"[{stage}] random stream(s) {names} differ between the runs, but no "
                        "traced value computed in these steps depends on them (an unseeded generator the job "
                        "does not draw from?)")], None
    return _tag(stage, found), first


def _differing_sites(dir_a: str, dir_b: str, steps: range | None) -> set[str]:
    from ckptverify.trace.compare import run_stores
    from ckptverify.trace.store import open_trace

    out: set[str] = set()
    stores_a, stores_b = run_stores(dir_a), run_stores(dir_b)
    for rank in set(stores_a) & set(stores_b):
        ta, tb = open_trace(stores_a[rank]), open_trace(stores_b[rank])
        common = set(int(s) for s in ta.steps) & set(int(s) for s in tb.steps)
        if steps is not None:
            common &= set(steps)
        names = {s.name for s in ta.sites} | {s.name for s in tb.sites}
        for step in sorted(common):
            for name in names - out:
                if ta.value(step, name) != tb.value(step, name):
                    out.add(name)
    return out


def _read_notes(config: RunConfig) -> list[str]:
    path = os.path.join(config.trace_dir or "", "notes-rank0.json")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return list(json.load(f).get("unsaved_schedulers", []))


def _tag(stage: str, findings: list[Finding]) -> list[Finding]:
    out = []
    for f in findings:
        out.append(error(f.check, f"[{stage}] {f.message}", location=f.location or Location(),
                         expected=f.expected, actual=f.actual) if f.severity.value == "error" else f)
    return out
