"""``ckptverify compare BASE CHANGED``: does a change to the training function change the run beyond natural variation,
and where does it enter? (Verdicts and findings: ``docs/cli.md``, ``docs/locate.md``.)

BASE runs once plus ``repeats`` controls (fresh processes each), CHANGED once, all traced from scratch. If every
control equals BASE bitwise: ``no-effect`` or ``effect`` (then the walk locates the op). Otherwise each site is
judged against the controls: before the baseline's first varying value, CHANGED must equal them (else *beyond*);
after it, agreeing controls may agree by chance, so a difference is only *undecided*; where they vary, a number is
within ``[lo - WIDEN u, hi + WIDEN u]`` (``u`` the site's widest control range) and a fingerprint always is.
``within-variation`` or ``beyond-variation`` follow."""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ckptverify.errors import UsageError
from ckptverify.findings import CheckCoverage, Finding, Location, Report, error, info
from ckptverify.resume.harness_target import check_target, split_target
from ckptverify.resume.locate.walk import DEFAULT_REPEATS, Side, Walk, walk
from ckptverify.resume.run import LEVELS, RunConfig
from ckptverify.resume.verdict import Verdict

__all__ = ["MAX_SITES", "VERDICTS", "WIDEN", "ChangePlan", "compare_change"]

VERDICTS = ("no-effect", "effect", "within-variation", "beyond-variation")

#: Sites beyond variation listed as findings (the count of all of them is in ``stats``).
MAX_SITES = 20


@dataclass(frozen=True, kw_only=True)
class ChangePlan:
    """``base``/``changed`` training functions, ``steps`` each runs, ``repeats`` control runs of ``base``,
    ``locate``: walk the ladder when they differ."""

    base: str
    changed: str
    steps: int
    nproc: int = 1
    repeats: int = 1
    device: str = "cpu"
    level: str = "state"
    locate: bool = True
    locate_repeats: int = DEFAULT_REPEATS

    def __post_init__(self) -> None:
        split_target(self.base)
        split_target(self.changed)
        for flag, value, what in (("--steps", self.steps, ""), ("--nproc", self.nproc, ""),
                                  ("--repeats", self.repeats, " (the control runs that measure variation)"),
                                  ("--locate-repeats", self.locate_repeats, "")):
            if value < 1:
                raise UsageError(f"{flag} must be at least 1{what}, got {value}")
        # metrics has no per-site state; op is the walk's own level.
        allowed = [x for x in LEVELS if x not in ("metrics", "op")]
        if self.level not in allowed:
            raise UsageError(f"--level must be one of {', '.join(allowed)}, got {self.level!r}")


_STREAMS = ("rng.", "start.rng.")

#: Ranges added on each side: a few runs only sample the spread; a new draw often lands a little outside.
WIDEN = 3


@dataclass(frozen=True)
class _Cell:
    step: int
    rank: int
    site: str
    order: int
    controls: tuple[Any, ...]
    changed: Any

    @property
    def controls_agree(self) -> bool:
        return len(set(self.controls)) == 1

    def numbers(self) -> list[float] | None:
        """The baseline runs' values when all are numbers (a metric), else ``None``."""
        numbers = [v for v in self.controls if isinstance(v, (int, float)) and not isinstance(v, bool)]
        return numbers if len(numbers) == len(self.controls) else None

    def beyond(self, variation_from: tuple[int, int, int] | None = None, spread: float = 0.0) -> bool:
        """Whether CHANGED lies outside the baseline's variation. After ``variation_from`` (the baseline's first
        varying ``(step, rank, order)``) an agreeing value may agree by chance: not beyond (:meth:`undecided`).
        ``spread``: the site's widest control range over all steps and ranks, the unit for numbers."""
        if self.site.startswith(_STREAMS) and not self.controls_agree:
            return False
        if self.controls_agree:
            return self.changed != self.controls[0] and not self._after(variation_from)
        numbers = self.numbers()
        if numbers is not None and isinstance(self.changed, (int, float)):
            lo, hi = min(numbers), max(numbers)
            unit = max(hi - lo, spread)
            return not lo - WIDEN * unit <= self.changed <= hi + WIDEN * unit
        return False

    def undecided(self, variation_from: tuple[int, int, int] | None) -> bool:
        """CHANGED differs where the controls agree, but after the baseline began to vary: more control runs would
        tell."""
        return self.controls_agree and self.changed != self.controls[0] and self._after(variation_from)

    def _after(self, variation_from: tuple[int, int, int] | None) -> bool:
        if variation_from is None:
            return False
        step, rank, order = variation_from
        # Same step on another rank counts: a collective may carry the noise there.
        return self.step > step or (self.step == step and (self.rank != rank or self.order > order))


def _cells(dirs: list[str], changed: str) -> list[_Cell]:
    """Every (step, rank, site) of the first run, with its value in each control and in ``changed``."""
    from ckptverify.trace.compare import run_stores
    from ckptverify.trace.store import open_trace

    *controls, changed_run = [{r: open_trace(p) for r, p in run_stores(d).items()} for d in (*dirs, changed)]
    out: list[_Cell] = []
    for rank, first in controls[0].items():
        traces = [c.get(rank) for c in controls]
        tc = changed_run.get(rank)
        names = [s.name for s in first.sites]
        if tc is not None:
            names += [s.name for s in tc.sites if not first.has_site(s.name)]

        def val(trace: Any, step: int, name: str) -> Any:
            return None if trace is None else trace.value(step, name)

        for step in sorted(int(s) for s in first.steps):
            for order, name in enumerate(names):
                out.append(_Cell(step, rank, name, order, tuple(val(t, step, name) for t in traces),
                                 val(tc, step, name)))
    return out


def compare_change(plan: ChangePlan, *, keep: str | None = None, progress: Callable[[str], None] | None = None
                   ) -> Report:
    """Run ``plan`` and return its report; ``keep``: keep the runs' traces there. :class:`UsageError` for a target
    that cannot run, :class:`~ckptverify.errors.CkptVerifyError` when a workload raises."""
    from ckptverify.resume.launch import launch_each, scratch

    for target in dict.fromkeys((plan.base, plan.changed)):
        check_target(target)
    say = progress or (lambda _msg: None)
    began = time.perf_counter()
    with scratch(keep, "ckptverify-compare-") as work:
        names = ["base", *(f"control-{i + 1}" for i in range(plan.repeats)), "changed"]
        configs: dict[str, RunConfig] = {}
        for name in names:
            d = os.path.join(work, name)
            if os.path.exists(d):
                shutil.rmtree(d)
            configs[name] = RunConfig(name=name, stop_step=plan.steps, trace_dir=os.path.join(d, "trace"),
                                      level=plan.level, workload=plan.changed if name == "changed" else plan.base,
                                      trace_detail="tensor")
        # Fresh processes each: process-dependent variation must show.
        longest = launch_each(plan.nproc, plan.device, [
            (f"run {name}: {target}, steps 1..{plan.steps} on {plan.nproc} rank(s)", [(target, configs[name])])
            for name in names for target in [plan.changed if name == "changed" else plan.base]], say=say)
        say("comparing")
        controls = [configs[n].trace_dir or "" for n in names[:-1]]
        cells = _cells(controls, configs["changed"].trace_dir or "")
        report = _judge(plan, cells, work, say, timeout_s=10 * longest + 60)
        report.stats.update(seconds=round(time.perf_counter() - began, 3), workdir=work if keep else None)
        return report


def _judge(plan: ChangePlan, cells: list[_Cell], work: str, say: Callable[[str], None], *,
           timeout_s: float) -> Report:
    findings: list[Finding] = []
    varying = [c for c in cells if not c.controls_agree]
    streams = sorted({c.site.removeprefix("start.") for c in varying if c.site.startswith(_STREAMS)})
    # A varying stream nothing depends on is an unused OS-seeded generator, not computation variation.
    varying = [c for c in varying if not c.site.startswith(_STREAMS)]
    if streams and not varying:
        findings.append(info("compare-rng-unused", f"unused random stream(s) differ between the baseline runs: "
                             f"{', '.join(streams)} (no traced value depends on them)"))
    origin = min(varying, key=lambda c: (c.step, c.rank, c.order)) if varying else None
    since = (origin.step, origin.rank, origin.order) if origin is not None else None
    spread: dict[str, float] = {}
    for c in varying:
        numbers = c.numbers()
        if numbers is not None:
            spread[c.site] = max(spread.get(c.site, 0.0), max(numbers) - min(numbers))
    beyond = sorted((c for c in cells if c.beyond(since, spread.get(c.site, 0.0))),
                    key=lambda c: (c.step, c.rank, c.order))
    undecided = sorted((c for c in cells if c.undecided(since)), key=lambda c: (c.step, c.rank, c.order))
    coverage = (CheckCoverage(check="compare-sites", count=len(cells), unit="site-steps"),)
    stats: dict[str, Any] = {"base": plan.base, "changed": plan.changed, "steps": plan.steps, "nproc": plan.nproc,
                             "repeats": plan.repeats, "level": plan.level, "sites_compared": len(cells),
                             "sites_varying": len(varying), "sites_beyond": len(beyond),
                             "sites_undecided": len(undecided)}
    if origin is not None:
        findings.append(info("compare-variation", f"the baseline is not deterministic: its {plan.repeats + 1} runs "
                             f"differ at {len(varying)} site-step(s), first at step {origin.step}, rank {origin.rank}, "
                             f"{origin.site}; the change is judged against that spread", location=Location(
                                 rank=origin.rank, fqn=origin.site), actual={"step": origin.step}))
    if undecided:
        u = undecided[0]
        findings.append(info("compare-undecided", f"{plan.changed} differs at {len(undecided)} site-step(s) where "
                             f"the {plan.repeats + 1} baseline runs agree but which come after the baseline's "
                             f"variation began (first at step {u.step}, rank {u.rank}, {u.site}): its noise may reach "
                             "them and the runs may agree by chance; more --repeats would tell",
                             location=Location(rank=u.rank, fqn=u.site), actual={"step": u.step}))
    if not beyond:
        kind = "within-variation" if varying else "no-effect"
        sentence = (f"{plan.changed} stays within the natural variation of {plan.base} ({plan.repeats + 1} runs) at "
                    f"every traced site of steps 1..{plan.steps}" if varying else
                    f"{plan.changed} is bitwise equal to {plan.base} at every traced site of steps 1..{plan.steps} "
                    f"({plan.repeats + 1} baseline runs agree): the change has no effect on what is traced")
        verdict = Verdict(kind, f"{sentence}.")
    else:
        for c in beyond[:MAX_SITES]:
            spread = "equal in every baseline run" if c.controls_agree else "beyond the baseline runs' spread"
            findings.append(error("compare-site", f"step {c.step}, rank {c.rank}: {c.site} differs ({spread})",
                                  location=Location(rank=c.rank, fqn=c.site),
                                  expected=c.controls[0] if c.controls_agree else list(c.controls),
                                  actual=c.changed))
        first = beyond[0]
        kind = "beyond-variation" if varying else "effect"
        where = f"step {first.step}, rank {first.rank}, site {first.site}"
        sentence = (f"{plan.changed} differs from {plan.base} first at {where}; the baseline is deterministic (its "
                    f"{plan.repeats + 1} runs are bitwise equal at every traced site), so this is the change's "
                    "effect" if kind == "effect" else
                    f"{plan.changed} leaves the natural variation of {plan.base} first at {where} "
                    f"({len(beyond)} site-step(s) beyond it)")
        located = None
        if plan.locate:
            say(f"locate: walking down from the verdict {kind}")
            sides = (Side(name="base", target=plan.base, total_steps=plan.steps),
                     Side(name="changed", target=plan.changed, total_steps=plan.steps))
            located = walk(Walk(step=first.step, sides=sides, nproc=plan.nproc, device=plan.device,
                                repeats=plan.locate_repeats, timeout_s=timeout_s,
                                # the traces agree before this step: both start it from equal traced state
                                state_equal=True,
                                # every baseline run agreed: never call its variation natural
                                deterministic=("base",) if kind == "effect" else ()),
                           os.path.join(work, "locate"), progress=say)
            findings.extend(located.findings())
        verdict = Verdict(kind, f"{sentence}.", step=first.step, rank=first.rank, site=first.site, located=located)
    findings.append(verdict.finding("compare-verdict"))
    stats["verdict"] = verdict.to_dict()
    return Report(command="compare", target=f"{plan.base} vs {plan.changed}", findings=tuple(findings),
                  coverage=coverage, stats=stats)
