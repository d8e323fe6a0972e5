"""The resume-equivalence harness: run A continuously, B resumed from A's checkpoint, and A2 again.

Each run is a fresh set of processes (``torch.multiprocessing`` spawn, one per rank; gloo on CPU, NCCL on
CUDA) executing the user's ``train(run)`` under a :class:`~ckptverify.resume.run.RunConfig`:

* **A** runs steps 1..T continuously, saving at K and T, tracing every step;
* **A2** runs 1..T again (no saves: only its trace is compared), to tell nondeterminism from missing state;
  when the machine has a core per rank to spare, A and A2 run at the same time;
* **B** starts in a new process group from A's checkpoint K, runs K+1..T (saving at T), tracing.

Then, in order: (a) the state restored in B against the state A saved, field by field, before any step;
(b) A against A2; (c) A against B for steps K+1..T; (d) the final checkpoints of A and B. The verdict
(:mod:`ckptverify.resume.verdict`) names what went wrong in plain words.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import shutil
import socket
import sys
import tempfile
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from ckptverify.errors import UsageError, WorkloadCrashedError
from ckptverify.findings import Finding, Location, Report, error
from ckptverify.resume.harness_target import (
    TargetError,
    check_target,
    load_target,
    never_restored_message,
    split_target,
    usage_text,
    user_traceback,
)
from ckptverify.resume.run import ENV_VAR, Run, RunConfig, checkpoint_path

__all__ = ["Outcome", "Plan", "TargetError", "WorkloadCrashedError", "check_target", "launch_jobs", "load_target",
           "resume_check", "resume_check_many", "workload_logs"]

RUN_NAMES = ("A", "A2", "B")


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
        split_target(self.target)
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


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _worker(rank: int, nproc: int, port: int, jobs: list[tuple[str, str]], backend: str) -> None:
    """One rank: run each ``(target, RunConfig JSON)`` of ``jobs`` in turn, in this one process."""
    import torch.distributed as dist

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(nproc), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    if nproc > 1:
        if backend == "nccl":
            import torch

            torch.cuda.set_device(rank)
        dist.init_process_group(backend, rank=rank, world_size=nproc)
        _tolerate_init(dist)
    try:
        for target, config_json in jobs:
            _run_job(rank, nproc, target, config_json)
    finally:
        if nproc > 1 and dist.is_initialized():
            dist.destroy_process_group()
    if nproc > 1:
        # Every job succeeded and its files are written: leave without interpreter teardown. After FSDP2 or DDP
        # used a gloo group, destroy_process_group leaves its threads alive, and finalizing the interpreter
        # around them now and then aborts the process (SIGABRT), which would fail a check that passed.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def _run_job(rank: int, nproc: int, target: str, config_json: str) -> None:
    from ckptverify.resume.harness_output import LabelledOutput, label, to_log_file

    os.environ[ENV_VAR] = config_json
    config = RunConfig.from_json(config_json)
    if config.log_dir:
        # The workload's prints go to a per-rank log file, so the command's own stdout stays machine-readable.
        to_log_file(os.path.join(config.log_dir, f"{config.name}-rank{rank}.log"))
        _call_target(rank, nproc, target, config)
    else:
        with LabelledOutput(label(config.name, rank, nproc)):
            try:
                _call_target(rank, nproc, target, config)
            finally:
                # The workload's objects end now (DataLoader workers among them, which hold the output pipe),
                # not whenever a reference cycle is collected: its output is then drained at once.
                gc.collect()


def _call_target(rank: int, nproc: int, target: str, config: RunConfig) -> None:
    """Run the training function once; on failure, leave what the user needs to see in the trace folder:
    ``usage-rank<r>.txt`` (a usage error: its message and the user's lines) or ``error-rank<r>.txt`` (the
    user's traceback), then re-raise."""
    import torch.distributed as dist

    run: Run | None = None
    try:
        func = load_target(target)
        run = Run(config)
        try:
            func(run)
            if run.state is None:
                raise UsageError(never_restored_message(target))
        finally:
            run.close()
        if nproc > 1 and dist.is_initialized():
            dist.barrier()  # no rank tears down while another is still in a collective
    except BaseException as exc:
        if config.trace_dir:
            os.makedirs(config.trace_dir, exist_ok=True)
            if isinstance(exc, TargetError):
                kind, text = "usage", str(exc)
            elif isinstance(exc, UsageError) and run is not None and run.state is None and _from_save(exc):
                kind, text = "usage", never_restored_message(target)  # the first checkpoint, and no state
            elif isinstance(exc, UsageError):
                kind, text = "usage", usage_text(exc)
            else:
                kind, text = "error", user_traceback(exc)
            with open(os.path.join(config.trace_dir, f"{kind}-rank{rank}.txt"), "w") as f:
                f.write(text)
        raise


def _from_save(exc: BaseException) -> bool:
    """Whether ``exc`` was raised by ``Run._save`` (a checkpoint the harness asked for)."""
    frames = traceback.extract_tb(exc.__traceback__)
    return bool(frames) and frames[-1].name == "_save" and os.path.basename(frames[-1].filename) == "run.py"


def _tolerate_init(dist: Any) -> None:
    """Make the workload's own ``init_process_group`` call a no-op while the harness's group exists (a script
    written for torchrun calls it unconditionally)."""
    original = dist.init_process_group
    if getattr(original, "_ckptverify_tolerant", False):
        return

    def init_process_group(*args: Any, **kwargs: Any) -> None:
        if dist.is_initialized():
            return None
        return original(*args, **kwargs)

    init_process_group._ckptverify_tolerant = True  # type: ignore[attr-defined]
    dist.init_process_group = init_process_group


def launch(plan: Plan, config: RunConfig) -> None:
    """Run ``plan.target`` under ``config`` in ``plan.nproc`` fresh processes; raise if any rank fails."""
    launch_jobs(plan.nproc, plan.device, [(plan.target, config)])


#: Set by :func:`workload_logs`: where the runs launched meanwhile write their output (None: the terminal).
_log_dir: str | None = None


@contextlib.contextmanager
def workload_logs(log_dir: str) -> Iterator[str]:
    """Within the block, every run launched sends each rank's stdout and stderr to
    ``<log_dir>/<run>-rank<r>.log`` (as a :class:`RunConfig` ``log_dir`` does) instead of the terminal: for a
    front end whose stdout must stay machine-readable around a call that launches runs (``replay --json``).
    Yields the absolute folder."""
    global _log_dir
    previous, _log_dir = _log_dir, os.path.abspath(log_dir)
    try:
        yield _log_dir
    finally:
        _log_dir = previous


def launch_jobs(nproc: int, device: str, jobs: list[tuple[str, RunConfig]]) -> None:
    """Run each ``(target, config)`` in turn in one set of ``nproc`` fresh processes; raise if any rank fails.

    Each target is checked here first (:func:`check_target`), before any process starts. Several jobs share
    the processes' start-up (interpreter, torch import, process group); each job's training function still
    starts from its own seeds and state. Module-level state of a workload does carry from one job to the
    next, as it would in any long-lived process. Raises :class:`TargetError` (the message: the user's
    traceback or line at fault) when a target cannot run or uses the protocol wrongly, and
    :class:`WorkloadCrashedError` (the user's traceback) when it raises.
    """
    import dataclasses

    import torch.multiprocessing as mp

    for target in dict.fromkeys(t for t, _ in jobs):
        check_target(target)
    if _log_dir is not None:
        jobs = [(t, c if c.log_dir else dataclasses.replace(c, log_dir=_log_dir)) for t, c in jobs]
    # The device travels in each job's config (run.device), not in the environment.
    jobs = [(t, dataclasses.replace(c, device=device)) for t, c in jobs]
    backend = "nccl" if device == "cuda" else "gloo"
    args = (nproc, _free_port(), [(target, config.to_json()) for target, config in jobs], backend)
    try:
        mp.start_processes(_worker, args=args, nprocs=nproc, join=True, start_method="spawn")
    except Exception as exc:
        _raise_failure(jobs, exc)


def _raise_failure(jobs: list[tuple[str, RunConfig]], exc: Exception) -> None:
    """Turn a failed launch into the user's error: a usage error of any rank first, else the traceback of
    each rank that raised (ranks with the same traceback shown once)."""
    found: dict[str, dict[str, dict[str, list[int]]]] = {}  # run -> kind -> text -> ranks
    for _, config in jobs:
        d = config.trace_dir
        for name in sorted(os.listdir(d)) if d and os.path.isdir(d) else []:
            kind, _, rest = name.partition("-rank")
            if kind in ("usage", "error") and rest.endswith(".txt") and rest[:-4].isdigit():
                with open(os.path.join(d, name)) as f:
                    text = f.read()
                found.setdefault(config.name, {}).setdefault(kind, {}).setdefault(text, []).append(int(rest[:-4]))
    for kinds in found.values():
        if "usage" in kinds:
            raise TargetError(next(iter(kinds["usage"])))
    if not found:
        raise WorkloadCrashedError(f"the workload crashed in run {jobs[0][1].name}: {type(exc).__name__}",
                                   str(exc)) from None
    run, kinds = next(iter(found.items()))
    parts = []
    for text, ranks in kinds["error"].items():
        ranks.sort()
        if len(kinds["error"]) > 1:
            parts.append(f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}:")
        parts.append(text)
    ranks = sorted(r for rs in kinds["error"].values() for r in rs)
    raise WorkloadCrashedError(f"the workload crashed in run {run} (rank{'s' if len(ranks) > 1 else ''} "
                               f"{', '.join(map(str, ranks))}):", "\n".join(parts)) from None


def resume_check(plan: Plan, *, keep: str | None = None, progress: Callable[[str], None] | None = None,
                 verbose: bool = False, log_dir: str | None = None, report_dir: str | None = None) -> Outcome:
    """Run the resume-equivalence check of ``plan``; return findings and verdict. Workdir kept if ``keep``.

    ``verbose`` lists every final-state difference (else many are folded into one row; the JSON report
    carries the full list either way). With ``log_dir``, each rank's stdout and stderr go to
    ``<log_dir>/<run>-rank<r>.log`` (named in the report's stats) instead of the terminal. With
    ``report_dir``, an HTML page with figures is written there (:mod:`ckptverify.render.figures`; needs
    matplotlib), its path in the report's stats as ``report_page``.
    """
    return resume_check_many([plan], keep=keep, progress=progress, verbose=verbose, log_dir=log_dir,
                             report_dir=report_dir)[0]


def resume_check_many(plans: list[Plan], *, keep: str | None = None,
                      progress: Callable[[str], None] | None = None, verbose: bool = False,
                      log_dir: str | None = None, report_dir: str | None = None) -> list[Outcome]:
    """:func:`resume_check` of several plans with one launch per run (A, A2, B) for all of them.

    The plans must agree on ``nproc`` and ``device``. Each plan's runs are its own (own checkpoints, traces,
    verdict); only process start-up is shared. Plan ``i`` works in ``<workdir>/<i>`` when there are several
    (and writes its report page, if asked, to ``<report_dir>/<i>``).
    """
    if not plans:
        return []
    if len({(p.nproc, p.device) for p in plans}) != 1:
        raise UsageError("plans checked together must have the same nproc and device")
    if report_dir:
        from ckptverify.render.figures import _pyplot

        _pyplot()  # refuse before the runs, not after them, when matplotlib is missing
    for target in dict.fromkeys(p.target for p in plans):
        check_target(target)  # a usage error now, not after the first processes started
    say = progress or (lambda _msg: None)
    workdir = os.path.abspath(keep) if keep else tempfile.mkdtemp(prefix="ckptverify-resume-")
    if keep:
        os.makedirs(workdir, exist_ok=True)
    if log_dir:
        log_dir = os.path.abspath(log_dir)
    roots = [workdir] if len(plans) == 1 else [os.path.join(workdir, str(i)) for i in range(len(plans))]
    configs = [_configs(plan, root, log_dir) for plan, root in zip(plans, roots, strict=True)]
    try:
        nproc, device = plans[0].nproc, plans[0].device
        jobs = {name: [(plan.target, c[name]) for plan, c in zip(plans, configs, strict=True) if name in c]
                for name in ("A", "A2", "B")}

        def announce(name: str) -> None:
            if len(plans) == 1:
                T, K = plans[0].steps, plans[0].resume_at
                say({"A": f"run A: steps 1..{T} continuously, saving at step {K}",
                     "A2": f"run A2: steps 1..{T} again (determinism)",
                     "B": f"run B: resume from A's checkpoint at step {K}, steps {K + 1}..{T}"}[name])
            else:
                say(f"run {name} of {len(jobs[name])} checks")

        if jobs["A2"] and _spare_cores(nproc, device):
            # A and A2 are independent: side by side they cost one start-up's wall time, not two.
            announce("A")
            announce("A2")
            _launch_side_by_side(nproc, device, jobs["A"], jobs["A2"])
        else:
            for name in ("A", "A2"):
                if jobs[name]:
                    announce(name)
                    launch_jobs(nproc, device, jobs[name])
        if jobs["B"]:
            announce("B")
            launch_jobs(nproc, device, jobs["B"])
        say("comparing")
        pages = [None] * len(plans) if not report_dir else (
            [os.path.abspath(report_dir)] if len(plans) == 1
            else [os.path.join(os.path.abspath(report_dir), str(i)) for i in range(len(plans))])
        return [_outcome(plan, c, root, keep=bool(keep), verbose=verbose, log_dir=log_dir, report_dir=page)
                for plan, c, root, page in zip(plans, configs, roots, pages, strict=True)]
    finally:
        if not keep:
            shutil.rmtree(workdir, ignore_errors=True)


def _spare_cores(nproc: int, device: str) -> bool:
    """Whether two runs of ``nproc`` ranks fit side by side: a core each on CPU (the built-in workloads run
    one intra-op thread per rank)."""
    if device != "cpu":
        return False
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return cores >= 2 * nproc


def _launch_side_by_side(nproc: int, device: str, first: list[tuple[str, RunConfig]],
                         second: list[tuple[str, RunConfig]]) -> None:
    """Launch two independent sets of jobs at once; raise the first one's error if both fail."""
    import threading

    errors: dict[int, BaseException] = {}

    def go(i: int, jobs: list[tuple[str, RunConfig]]) -> None:
        try:
            launch_jobs(nproc, device, jobs)
        except BaseException as exc:  # re-raised in the caller's thread below
            errors[i] = exc

    threads = [threading.Thread(target=go, args=(i, j), daemon=True) for i, j in enumerate((first, second))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i in (0, 1):
        if i in errors:
            raise errors[i]


def _configs(plan: Plan, root: str, log_dir: str | None) -> dict[str, RunConfig]:
    T, K = plan.steps, plan.resume_at
    dirs = {name: os.path.join(root, name) for name in plan.runs}
    for d in dirs.values():
        if os.path.exists(d):
            shutil.rmtree(d)
    # A cell per tensor: the runs are short, and a divergence is then named down to the tensor in one pass.
    common = dict(stop_step=T, level=plan.level, workload=plan.target, log_dir=log_dir, trace_detail="tensor")
    configs = {"A": RunConfig(name="A", save_at=(K, T), checkpoint_dir=os.path.join(dirs["A"], "ckpt"),
                              trace_dir=os.path.join(dirs["A"], "trace"), **common)}  # type: ignore[arg-type]
    if "A2" in plan.runs:
        configs["A2"] = RunConfig(name="A2", trace_dir=os.path.join(dirs["A2"], "trace"), **common)  # type: ignore[arg-type]
    if "B" in plan.runs:
        configs["B"] = RunConfig(name="B", save_at=(T,), checkpoint_dir=os.path.join(dirs["B"], "ckpt"),
                                 resume_from=checkpoint_path(os.path.join(dirs["A"], "ckpt"), K),
                                 trace_dir=os.path.join(dirs["B"], "trace"), **common)  # type: ignore[arg-type]
    return configs


def _outcome(plan: Plan, configs: dict[str, RunConfig], root: str, *, keep: bool, verbose: bool,
             log_dir: str | None, report_dir: str | None) -> Outcome:
    from ckptverify.resume import verdict as verdicts

    findings, analysis = _compare(plan, configs, verbose=verbose)
    verdict = verdicts.decide(plan, analysis)
    findings.append(verdict.finding())
    logs = sorted(os.path.join(log_dir, n) for n in os.listdir(log_dir)) if log_dir and os.path.isdir(log_dir) else None
    stats = {"steps": plan.steps, "resume_at": plan.resume_at, "nproc": plan.nproc, "level": plan.level,
             "runs": list(configs), "workdir": root if keep else None, "logs": logs, "verdict": verdict.to_dict()}
    report = Report(command="resume-check", target=plan.target, findings=tuple(findings), stats=stats)
    if report_dir:
        from ckptverify.render.figures import write_report

        stats["report_page"] = write_report(report_dir, report=report, verdict=verdict,
                                            trace_dirs={n: c.trace_dir or "" for n, c in configs.items()},
                                            steps=range(plan.resume_at + 1, plan.steps + 1))
    return Outcome(report=report, verdict=verdict, workdir=root,
                   runs={name: os.path.dirname(c.trace_dir or "") for name, c in configs.items()})


def _compare(plan: Plan, configs: dict[str, RunConfig], *, verbose: bool = False
             ) -> tuple[list[Finding], dict[str, Any]]:
    from ckptverify.audit.diff import diff_checkpoints

    T, K = plan.steps, plan.resume_at
    findings: list[Finding] = []
    notes_a = _read_notes(configs["A"])
    analysis: dict[str, Any] = {"unsaved_schedulers": list(notes_a.get(0, {}).get("unsaved_schedulers", [])),
                                "unregistered": _unregistered(notes_a),
                                "missing_optimizer": notes_a.get(0, {}).get("missing_optimizer")}
    findings.extend(_forgotten_findings(analysis))
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
        div = analysis["resume"]
        if div is not None:
            step = div.step
            analysis["resume_sites"] = _differing_sites(a_trace, configs["B"].trace_dir, range(step, step + 1))
            restored = _read_notes(configs["B"]).get(div.rank, {}).get("restored", {})
            analysis["evidence"] = step_evidence(a_trace, configs["B"].trace_dir, div.rank,  # type: ignore[arg-type]
                                                 step, first_resumed=step == K + 1, restored=restored)
        # (d) final states
        final = diff_checkpoints(checkpoint_path(configs["A"].checkpoint_dir, T),  # type: ignore[arg-type]
                                 checkpoint_path(configs["B"].checkpoint_dir, T))  # type: ignore[arg-type]
        errors = [f for f in final.findings if f.severity.value == "error"]
        findings.extend(_tag("final A vs B", errors if verbose else _fold(errors)))
        analysis["final"] = errors
    findings.extend(_held_state(configs, analysis))
    return findings, analysis


#: Final-state differences listed one by one in the text report (all of them under ``--verbose`` and in JSON).
FOLD_ABOVE = 3


def _fold(errors: list[Finding]) -> list[Finding]:
    """Many final-state differences as one row: how many, which come first, and the full list in ``actual``."""
    if len(errors) <= FOLD_ABOVE:
        return errors
    names = [f.location.fqn or f.location.record or f.check for f in errors]
    shown = ", ".join(str(n) for n in names[:FOLD_ABOVE])
    return [error("final-state", f"{len(errors)} items of the final checkpoints differ ({shown}, …); the full "
                  "list is under --verbose and in the JSON report", location=Location(),
                  actual={"differing": len(errors), "items": [f.to_dict() for f in errors]})]


def _unregistered(notes: dict[int, dict[str, Any]]) -> list[dict[str, str]]:
    """Unregistered objects over all ranks, once each (by variable name)."""
    out: dict[str, dict[str, str]] = {}
    for rank in sorted(notes):
        for item in notes[rank].get("unregistered", []) or []:
            out.setdefault(item["name"], item)
    return list(out.values())


def _held_state(configs: dict[str, RunConfig], analysis: dict[str, Any]) -> list[Finding]:
    """Compare what the training function holds outside the TrainState at the end of A and B (and A2), into
    ``analysis["held"]``: ``differ`` (A vs B, one per variable and rank), ``nondeterministic`` (the variables
    among them that A and A2 hold differently too), ``a2`` (whether A2 was compared), ``incomplete`` (why some
    values could not be compared). Errors when the runs otherwise agree; info lines (a possible consequence)
    when an earlier comparison already failed."""
    from ckptverify.findings import info, warning
    from ckptverify.resume.unregistered import compare_held, read_held

    if "B" not in configs:
        return []
    held = {name: read_held(c.trace_dir) for name, c in configs.items()}
    differ = compare_held(held["A"], held["B"])
    a2 = "A2" in configs and bool(held["A2"])
    again = {d["var"] for d in compare_held(held["A"], held["A2"])} if a2 else set()
    incomplete = _held_gaps(held)
    analysis["held"] = {"differ": differ, "nondeterministic": sorted(again & {d["var"] for d in differ}),
                        "a2": a2, "incomplete": incomplete}
    earlier = any(analysis.get(k) for k in ("restore", "nondeterminism", "resume", "final"))
    out: list[Finding] = []
    for d in differ:
        text = (f"[end of A vs B] {d['var']} differs at the end of the run (rank {d['rank']}, first at "
                f"{d['path']}): the training function holds it outside the TrainState")
        where = Location(fqn=d["path"], rank=d["rank"])
        out.append(info("held-state", text + " (it may follow from the divergence above)", location=where,
                        actual=d) if earlier else error("held-state", text, location=where, actual=d))
    if incomplete:
        out.append(warning("held-state-incomplete", "the values held outside the TrainState were not all "
                           "compared: " + "; ".join(incomplete)))
    return out


def _held_gaps(held: dict[str, dict[int, dict[str, Any]]]) -> list[str]:
    """Why some held values were not compared: a rank left no record, a walk failed, hit a limit or could
    not fingerprint a value."""
    from ckptverify.resume.unregistered import HELD_ENTRIES, HELD_ITEMS, HELD_VISITS

    out = [f"run {name} left no record of rank {r}" for name in ("A", "B")
           for r in sorted(set(held["A"]) | set(held["B"])) if r not in held[name]]
    for name, runs in held.items():
        for r, data in sorted(runs.items()):
            if data.get("error"):
                out.append(f"run {name} rank {r}: {data['error']}")
            if data.get("truncated"):
                out.append(f"run {name} rank {r} holds more than was compared (at most {HELD_ITEMS} items a "
                           f"container, {HELD_ENTRIES} values, {HELD_VISITS} objects)")
            if data.get("skipped"):
                out.append(f"run {name} rank {r} could not fingerprint {', '.join(data['skipped'][:3])}")
    return out


def _forgotten_findings(analysis: dict[str, Any]) -> list[Finding]:
    from ckptverify.findings import warning

    out = [warning("unregistered-state", f"{u['name']} ({u['type']}: {u['kind']}) is not in the TrainState: a "
                   "resume does not save or restore it", location=Location(fqn=u["name"]), actual=u)
           for u in analysis["unregistered"]]
    if analysis.get("missing_optimizer"):
        out.append(warning("no-optimizer", analysis["missing_optimizer"]))
    return out


def step_evidence(a_dir: str, b_dir: str, rank: int, step: int, *, first_resumed: bool,
                  restored: dict[str, Any]) -> dict[str, Any]:
    """What differs at ``step`` on ``rank`` among the causes a step starts from, and which run moved them.

    * ``rng``: random streams that differ when the step starts (``start.rng.<stream>``), each with
      ``a_moved`` / ``b_moved``: whether that run's stream at the start of the step differs from where the
      previous step (for B on the first resumed step: the restore) left it;
    * ``hparams_start``: optimizer hyperparameters that differ when the step starts, with ``b_moved`` /
      ``a_moved`` as above (on the first resumed step, against the restored value);
    * ``hparams_step``: hyperparameters that differ as the optimizer step uses them;
    * ``buffers``: non-persistent buffers (``buffer.<fqn>``) that differ after the step;
    * ``batch``: whether the batch differs;
    * ``indices``: the digest of the sample indices the step's batch was made from (``data.indices``) in A
      (``a``) and B (``b``), and A's of the next step (``a_next``); ``None`` where not recorded.
    """
    from ckptverify.trace.compare import run_stores
    from ckptverify.trace.store import open_trace

    ta, tb = open_trace(run_stores(a_dir)[rank]), open_trace(run_stores(b_dir)[rank])
    names = [s.name for s in ta.sites] + [s.name for s in tb.sites if not ta.has_site(s.name)]

    def val(trace: Any, at: int, name: str) -> Any:
        return trace.value(at, name) if trace.has_site(name) and trace.row_index(at) is not None else None

    differing = [n for n in names if val(ta, step, n) != val(tb, step, n)]
    out: dict[str, Any] = {"step": step, "rank": rank, "rng": [], "hparams_start": [], "hparams_step": [],
                           "buffers": [n for n in differing if n.startswith("buffer.")],
                           "batch": any(n == "batch" or n.startswith("batch.") for n in differing),
                           "indices": {"a": val(ta, step, "data.indices"), "b": val(tb, step, "data.indices"),
                                       "a_next": val(ta, step + 1, "data.indices")}}

    def moved(trace: Any, name: str, end_name: str, is_b: bool) -> bool | None:
        now = val(trace, step, name)
        if is_b and first_resumed:
            before = restored.get(name)
        elif first_resumed and not is_b:
            # A's value at the end of the previous step is what it saved; B restored exactly that.
            before = restored.get(name) if name in restored else val(trace, step - 1, end_name)
        else:
            before = val(trace, step - 1, end_name)
        if before is None or now is None:
            return None
        return bool(now != before)

    for n in differing:
        if n.startswith("start.rng."):
            out["rng"].append({"stream": n[len("start."):], "a": val(ta, step, n), "b": val(tb, step, n),
                               "a_moved": moved(ta, n, n[len("start."):], False),
                               "b_moved": moved(tb, n, n[len("start."):], True)})
        elif n.startswith("start.hparam."):
            out["hparams_start"].append({"field": n[len("start.hparam."):], "a": val(ta, step, n),
                                         "b": val(tb, step, n), "a_moved": moved(ta, n, "", False),
                                         "b_moved": moved(tb, n, "", True)})
        elif n.startswith("hparam."):
            out["hparams_step"].append({"field": n[len("hparam."):], "a": val(ta, step, n), "b": val(tb, step, n)})
    return out


def _trace_stage(stage: str, a: str | None, b: str | None, steps: range | None) -> tuple[list[Finding], Any]:
    """Compare two runs' traces. Random streams that differ while no value computed from them does (an
    unseeded, unused generator) are an info line, not a divergence."""
    from ckptverify.findings import info
    from ckptverify.trace.compare import compare_runs, first_divergence

    found = compare_runs(a, b, steps=steps)  # type: ignore[arg-type]
    if not any(f.severity.value == "error" for f in found):
        return _tag(stage, found), None
    first = first_divergence(a, b, steps=steps)  # type: ignore[arg-type]
    differing = _differing_sites(a, b, steps)  # type: ignore[arg-type]
    if differing and all(name.startswith(("rng.", "start.rng.")) for name in differing):
        names = ", ".join(sorted({n.removeprefix("start.") for n in differing}))
        return [info("trace-rng-unused", f"[{stage}] unused random stream(s) differ: {names} (no traced value "
                     "depends on them: an unseeded generator the job does not draw from)")], None
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


def _read_notes(config: RunConfig) -> dict[int, dict[str, Any]]:
    """Each rank's notes (``notes-rank<r>.json``: what ``run.restore`` found), by rank."""
    out: dict[int, dict[str, Any]] = {}
    d = config.trace_dir or ""
    if not os.path.isdir(d):
        return out
    for name in os.listdir(d):
        if name.startswith("notes-rank") and name.endswith(".json") and name[10:-5].isdigit():
            with open(os.path.join(d, name)) as f:
                out[int(name[10:-5])] = json.load(f)
    return out


def _tag(stage: str, findings: list[Finding]) -> list[Finding]:
    out = []
    for f in findings:
        out.append(error(f.check, f"[{stage}] {f.message}", location=f.location or Location(),
                         expected=f.expected, actual=f.actual) if f.severity.value == "error" else f)
    return out
