"""The resume-equivalence harness: run A continuously, B resumed from A's checkpoint, and A2 again.

Each run is a fresh set of spawned processes (one per rank) running ``train(run)`` under a
:class:`~ckptverify.resume.run.RunConfig`: A runs 1..T saving at K and T; A2 reruns 1..T (to tell nondeterminism from
missing state; beside A when cores allow); B resumes from A's checkpoint K in a new process group. Then (a) B's
restored state vs A's saved, (b) A vs A2, (c) A vs B for K+1..T, (d) final checkpoints;
:mod:`ckptverify.resume.verdict` names the cause. Launching is :mod:`~ckptverify.resume.launch`; drawing is left to
the caller's :class:`FigureWriter` (:mod:`ckptverify.render` sits above this layer)."""

from __future__ import annotations

import dataclasses
import os
import shutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol

from ckptverify.errors import UsageError
from ckptverify.findings import Report
from ckptverify.resume.compare import Evidence, compare
from ckptverify.resume.harness_target import check_target, split_target
from ckptverify.resume.launch import launch_each, log_files, scratch
from ckptverify.resume.locate.walk import DEFAULT_REPEATS, for_resume
from ckptverify.resume.run import RunConfig, checkpoint_path
from ckptverify.resume.verdict import Verdict, decide

__all__ = ["FigureWriter", "Outcome", "Plan", "resume_check", "resume_check_many"]

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
    #: On failure, walk the ladder (:mod:`ckptverify.resume.locate.walk`); off in the API, on in the command.
    locate: bool = False
    locate_repeats: int = DEFAULT_REPEATS

    def __post_init__(self) -> None:
        split_target(self.target)
        if self.locate_repeats < 1:
            raise UsageError(f"--locate-repeats must be at least 1, got {self.locate_repeats}")
        if not 0 < self.resume_at < self.steps:
            raise UsageError(f"--resume-at must be between 1 and --steps - 1 ({self.steps - 1}), got {self.resume_at}")
        if self.nproc < 1:
            raise UsageError(f"--nproc must be at least 1, got {self.nproc}")
        if not set(self.runs) <= set(RUN_NAMES) or "A" not in self.runs:
            raise UsageError(f"--runs must include A and be drawn from {', '.join(RUN_NAMES)}, got {self.runs}")


@dataclass
class Outcome:
    """The harness's result: the report (findings), the verdict, and the evidence the verdict was read from."""

    report: Report
    verdict: Verdict
    evidence: Evidence | None = None


class FigureWriter(Protocol):
    """Draws one plan's report page into ``report_dir`` while its traces exist and returns its path (e.g.
    :func:`ckptverify.render.figures.write_report`); ``trace_dirs`` by run name, ``steps`` the resumed steps."""

    def __call__(self, report_dir: str, *, report: Report, verdict: Verdict, trace_dirs: Mapping[str, str],
                 steps: range) -> str: ...


def resume_check(plan: Plan, *, keep: str | None = None, progress: Callable[[str], None] | None = None,
                 verbose: bool = False, report_dir: str | None = None, figures: FigureWriter | None = None
                 ) -> Outcome:
    """Run the resume-equivalence check of ``plan``; return findings and verdict. Workdir kept if ``keep``.

    ``verbose`` lists every final-state difference; inside :func:`~ckptverify.resume.launch.workload_logs` each
    rank's output goes to a log file, named in the report's ``stats["logs"]``. With ``report_dir``, ``figures``
    draws a report page there (``ckptverify.resume_check`` passes :func:`ckptverify.render.figures.write_report`);
    ``report_dir`` without ``figures`` is a :class:`UsageError`: this layer draws nothing itself."""
    return resume_check_many([plan], keep=keep, progress=progress, verbose=verbose, report_dir=report_dir,
                             figures=figures)[0]


def resume_check_many(plans: list[Plan], *, keep: str | None = None,
                      progress: Callable[[str], None] | None = None, verbose: bool = False,
                      report_dir: str | None = None, figures: FigureWriter | None = None) -> list[Outcome]:
    """:func:`resume_check` of several plans sharing one launch per run (A, A2, B). Plans must agree on ``nproc`` and
    ``device``; each keeps its own checkpoints, traces and verdict, in ``<workdir>/<i>`` (and ``<report_dir>/<i>``)
    when there are several."""
    if not plans:
        return []
    if len({(p.nproc, p.device) for p in plans}) != 1:
        raise UsageError("plans checked together must have the same nproc and device")
    if report_dir and figures is None:
        raise UsageError("report_dir needs figures= (what draws the page: ckptverify.render.figures.write_report; "
                         "ckptverify.resume_check passes it)")
    for target in dict.fromkeys(p.target for p in plans):
        check_target(target)  # a usage error now, not after the first processes started
    say = progress or (lambda _msg: None)
    with scratch(keep, "ckptverify-resume-") as workdir:
        def each(root: str) -> list[str]:
            return [root] if len(plans) == 1 else [os.path.join(root, str(i)) for i in range(len(plans))]

        roots = each(workdir)
        configs = [_configs(plan, root) for plan, root in zip(plans, roots, strict=True)]
        nproc, device = plans[0].nproc, plans[0].device
        jobs = {name: [(plan.target, c[name]) for plan, c in zip(plans, configs, strict=True) if name in c]
                for name in ("A", "A2", "B")}

        def announce(name: str) -> str:
            if len(plans) == 1:
                T, K = plans[0].steps, plans[0].resume_at
                return {"A": f"run A: steps 1..{T} continuously, saving at step {K}",
                        "A2": f"run A2: steps 1..{T} again (determinism)",
                        "B": f"run B: resume from A's checkpoint at step {K}, steps {K + 1}..{T}"}[name]
            return f"run {name} of {len(jobs[name])} checks"

        # A and A2 are independent: side by side they cost one start-up's wall time, not two.
        # Walk launches far slower than run A have hung (ckptverify.resume.locate).
        run_seconds = launch_each(nproc, device, [(announce(n), jobs[n]) for n in ("A", "A2") if jobs[n]], say=say)
        if jobs["B"]:
            launch_each(nproc, device, [(announce("B"), jobs["B"])], say=say)
        say("comparing")
        pages = each(os.path.abspath(report_dir)) if report_dir else [None] * len(plans)
        return [_outcome(plan, c, root, keep=bool(keep), verbose=verbose, report_dir=page,
                         figures=figures, say=say, run_seconds=run_seconds)
                for plan, c, root, page in zip(plans, configs, roots, pages, strict=True)]


def _configs(plan: Plan, root: str) -> dict[str, RunConfig]:
    T, K = plan.steps, plan.resume_at
    dirs = {name: os.path.join(root, name) for name in plan.runs}
    for d in dirs.values():
        if os.path.exists(d):
            shutil.rmtree(d)
    # Per-tensor cells: runs are short, and a divergence is named down to the tensor in one pass.
    common = dict(stop_step=T, level=plan.level, workload=plan.target, trace_detail="tensor")
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
             report_dir: str | None, figures: FigureWriter | None, say: Callable[[str], None],
             run_seconds: float) -> Outcome:
    findings, evidence = compare(configs, steps=plan.steps, resume_at=plan.resume_at, verbose=verbose)
    verdict = decide(plan, evidence)
    if plan.locate and not verdict.passed:
        # The ladder below the verdict (ckptverify.resume.locate.walk). A walk launch runs at most A's steps: ten
        # times A's time plus a minute is past any honest run.
        say(f"locate: walking down from the verdict {verdict.kind}")
        located = for_resume(plan, verdict, evidence, configs, os.path.join(root, "locate"), progress=say,
                             timeout_s=10 * run_seconds + 60, run_seconds=run_seconds)
        verdict = dataclasses.replace(verdict, located=located)
        findings.extend(located.findings())
    findings.append(verdict.finding("resume-verdict"))
    stats = {"steps": plan.steps, "resume_at": plan.resume_at, "nproc": plan.nproc, "level": plan.level,
             "runs": list(configs), "workdir": root if keep else None, "logs": log_files(),
             "verdict": verdict.to_dict()}
    report = Report(command="resume-check", target=plan.target, findings=tuple(findings), stats=stats)
    if report_dir and figures is not None:
        stats["report_page"] = figures(report_dir, report=report, verdict=verdict,
                                       trace_dirs={n: c.trace_dir or "" for n, c in configs.items()},
                                       steps=range(plan.resume_at + 1, plan.steps + 1))
    return Outcome(report=report, verdict=verdict, evidence=evidence)

