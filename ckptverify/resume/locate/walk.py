"""The automatic walk down the ladder: from the step where two runs part to the op (and kernel) where it is born.

1. A difference in what step ``s`` starts from (restored field, random stream, hyperparameter, batch) is a ``state``
   origin, no re-run.
2. Otherwise step ``s`` is re-run at level ``op``, ``repeats`` times per side, each in fresh processes
   (process-dependent nondeterminism must be able to show), from the nearest point whose state is proved equal on both
   sides (A vs A2: checkpoint K if ``s`` > K; A vs B: A from scratch, B from K; replays: the production checkpoint).
   Only ``s`` is op-traced.
3. :mod:`~ckptverify.resume.locate.ops` names the origin, receivers or untraced producer per rank.
4. An origin op's inputs are captured and :mod:`ckptverify.trace.kernel` re-runs it alone.

Trap: the walk adds to the verdict, never changes it; its own failure is ``status: "failed"`` and the verdict stands."""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import TYPE_CHECKING, Any

from ckptverify.findings import Finding, Location, info, warning
from ckptverify.ownfiles.names import own_dir
from ckptverify.resume.locate.ops import locate
from ckptverify.trace.kernel import rerun
from ckptverify.trace.oplog import OpWindow, read_ops

if TYPE_CHECKING:
    from ckptverify.trace.compare import FirstDivergence

__all__ = ["DEFAULT_REPEATS", "STATE_KINDS", "WALK_KINDS", "Side", "Walk", "Walked", "for_replay", "for_resume",
           "receiver_entries", "skipped", "state_origin", "walk", "walk_fields"]

DEFAULT_REPEATS = 2

#: Verdict kinds whose cause is in what the step starts from: named as origin kind ``"state"``, no re-run.
STATE_KINDS = ("restore-mismatch", "accumulated-gradients", "rng", "changed-after-restore", "changed-after-save",
               "scheduler", "data")

#: Verdict kinds whose step is re-run at level ``op``: the difference is computed within the step.
WALK_KINDS = ("nondeterministic", "hidden-state", "unregistered-state", "diverged", "effect", "beyond-variation")

#: Least seconds a re-run may take before it counts as hung.
MIN_TIMEOUT_S = 180.0


@dataclass(frozen=True, kw_only=True)
class Side:
    """One re-run side: ``name``, training ``target``, checkpoint to resume from (``None``: scratch) and
    ``total_steps`` (so ``run.total_steps`` schedules match the run that diverged)."""

    name: str
    target: str
    resume_from: str | None = None
    total_steps: int | None = None


@dataclass(frozen=True, kw_only=True)
class Walk:
    """What to re-run: ``step`` of both ``sides`` on ``nproc`` ranks, ``repeats`` times each, with the op window on
    that step. ``timeout_s``: per launch before it counts as hung (at least :data:`MIN_TIMEOUT_S`)."""

    step: int
    sides: tuple[Side, Side]
    nproc: int = 1
    device: str = "cpu"
    repeats: int = DEFAULT_REPEATS
    timeout_s: float | None = None
    #: Starting state proved equal (``None``: unknown); tells ``untraced`` from ``state``.
    state_equal: bool | None = None
    #: Sides the caller found bitwise equal run to run: never called naturally varying.
    deterministic: tuple[str, ...] = ()
    #: Wall time of the caller's whole run, for the walk's time estimate.
    run_seconds: float | None = None


@dataclass(frozen=True, kw_only=True)
class Walked:
    """What the walk found. ``status``: ``located``, ``clean`` (sides agree at op level), ``state``, ``skipped`` or
    ``failed`` (``reason``). ``origin``/``receivers`` in the JSON shapes; ``sentence`` for the text verdict;
    ``kernel``: the origin op's re-run; ``extra``: the analysis' other fields (:meth:`Located.to_dict`)."""

    status: str
    sentence: str = ""
    origin: Mapping[str, Any] | None = None
    receivers: tuple[Mapping[str, Any], ...] = ()
    kernel: Mapping[str, Any] | None = None
    reason: str | None = None
    step: int | None = None
    repeats: int | None = None
    seconds: float | None = None
    extra: Mapping[str, Any] = field(default_factory=dict)
    found: tuple[Finding, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        """The walk as ``stats.verdict.locate``; ``origin`` and ``receivers`` go to ``stats.verdict`` itself."""
        out = {"status": self.status, "sentence": self.sentence, "reason": self.reason, "step": self.step,
               "repeats": self.repeats, "within_side": None, "kernel": dict(self.kernel) if self.kernel
               else None, "seconds": self.seconds}
        out.update(self.extra)
        return out

    def findings(self) -> list[Finding]:
        """The walk as findings: the analysis' and kernel re-run's own, ``locate-origin`` for a state origin,
        ``locate-skipped`` (info) or ``locate-failed`` (warning). None is an error: they explain a verdict already
        reached."""
        if self.found:
            return list(self.found)
        o = self.origin
        if self.status == "state" and o is not None:
            return [info("locate-origin", self.sentence, location=Location(rank=o.get("rank"), fqn=o.get("site")),
                         actual=dict(o))]
        if self.status == "failed":
            return [warning("locate-failed", self.sentence)]
        if self.status == "skipped":
            return [info("locate-skipped", self.sentence)]
        return []


def walk_fields(located: Walked | None, receivers: Sequence[Mapping[str, Any]] = ()) -> dict[str, Any]:
    """``origin``, ``receivers`` and ``locate`` of ``stats.verdict`` from the walk; without one, ``None``, the
    traces' ``receivers`` and ``None``."""
    walked = located.receivers if located is not None and located.receivers else receivers
    return {"origin": dict(located.origin) if located is not None and located.origin is not None else None,
            "receivers": [dict(r) for r in walked], "locate": located.to_dict() if located is not None else None}


def state_origin(*, kind: str, step: int | None, rank: int | None, site: str | None,
                 divergence: FirstDivergence | None = None) -> Walked:
    """A ``state`` origin at ``site`` for a verdict ``kind`` in :data:`STATE_KINDS`, no re-run; ranks of
    ``divergence`` that only received the difference are listed as receivers."""
    origins = (divergence.origin_ranks or ()) if divergence is not None else ()
    origin = {"kind": "state", "rank": rank, "step": step, "phase": None, "module": None, "op": None,
              "occurrence": None, "repeats_differing": None, "site": site,
              "ranks": list(origins) if origins else ([rank] if rank is not None else [])}
    receivers = receiver_entries(divergence)
    where = (f" on rank {rank}" if rank is not None else
             f" on ranks {', '.join(map(str, origins))}, each on its own" if len(origins) > 1 else "")
    at = f"step {step}" if step is not None else "the restore"
    sentence = (f"The difference is born in the state {at} starts from ({site or kind}{where}), before any op of "
                "the step runs: the op walk is not needed.")
    return Walked(status="state", sentence=sentence, origin=origin, receivers=receivers, step=step)


def receiver_entries(divergence: FirstDivergence | None) -> tuple[dict[str, Any], ...]:
    """Ranks of the job's first divergence that only received the difference, as ``stats.verdict.receivers`` entries:
    the collective unknown at trace level, the senders being the origin ranks."""
    if divergence is None or not divergence.origin_ranks:
        return ()
    origins = list(divergence.origin_ranks)
    return tuple({"rank": r, "step": divergence.step, "op": None,
                  "via": {"collective": None, "group": None, "seq": None, "senders": origins}}
                 for r in divergence.receiver_ranks or ())


def skipped(reason: str, *, step: int | None = None) -> Walked:
    return Walked(status="skipped", sentence=f"Not located: {reason}.", reason=reason, step=step)


def walk(request: Walk, workdir: str, *, progress: Callable[[str], None] | None = None) -> Walked:
    """Re-run ``request.step`` of both sides at level ``op`` in ``workdir`` and locate where the difference is born.
    Never raises for the walk's own failure (``status: "failed"``)."""
    say = progress or (lambda _msg: None)
    began = time.perf_counter()
    try:
        located = _walk(request, workdir, say)
    except Exception as exc:  # the verdict stands; the walk says why it stopped
        reason = _reason(exc)
        located = Walked(status="failed", reason=reason, step=request.step, repeats=request.repeats,
                          sentence=f"The op-level walk of step {request.step} could not finish: {reason}. The "
                          "verdict above stands; re-run with --keep to inspect the re-runs' traces.")
    return replace(located, seconds=round(time.perf_counter() - began, 3))


def _reason(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}".rstrip(": ")


def _walk(request: Walk, workdir: str, say: Callable[[str], None]) -> Walked:
    from ckptverify.resume.launch import launch_each, launches_at_once
    from ckptverify.resume.run import RunConfig

    s, n = request.step, request.repeats
    timeout = max(MIN_TIMEOUT_S, request.timeout_s or 0.0)
    os.makedirs(workdir, exist_ok=True)
    window = OpWindow(steps=(s,))

    def config(side: Side, tag: str, win: OpWindow) -> RunConfig:
        d = os.path.join(workdir, tag)
        if os.path.exists(d):
            shutil.rmtree(d)
        return RunConfig(name=tag, stop_step=s, total_steps=side.total_steps, resume_from=side.resume_from,
                         trace_dir=os.path.join(d, "trace"), level="op", workload=side.target,
                         trace_detail="tensor", op_window=asdict(win))

    # Independent fresh launches: as many at once as the machine has room for.
    runs = [(r, side, config(side, f"{side.name}-{r}", window)) for r in range(n) for side in request.sides]
    width = min(len(runs), launches_at_once(request.nproc, request.device))
    say(f"locate: re-running step {s} at level op: {len(runs)} runs ({n} per side), {width} at a time"
        + _estimate(request, width, len(runs)))

    starts = {side.name: f"from {os.path.basename(side.resume_from)}" if side.resume_from else "from scratch"
              for side in request.sides}
    launch_each(request.nproc, request.device, [
        (f"locate: step {s} at level op, side {side.name} ({starts[side.name]}), repeat {r + 1} of {n}",
         [(side.target, cfg)]) for r, side, cfg in runs], say=say, timeout_s=timeout)
    logs: dict[str, dict[int, list[list[Any]]]] = {side.name: {} for side in request.sides}
    for _r, side, cfg in runs:  # in repeat order, whatever order the launches finished in
        for rank in range(request.nproc):
            logs[side.name].setdefault(rank, []).append(list(read_ops(cfg.trace_dir, rank, s)))
    say(f"locate: comparing the op logs of step {s}")
    a, b = (logs[side.name] for side in request.sides)
    names = (request.sides[0].name, request.sides[1].name)
    known = tuple(x for x, side in zip("ab", request.sides, strict=True) if side.name in request.deterministic)
    result = locate(a, b, step=s, state_equal=request.state_equal, names=names, deterministic=known)
    data = result.to_dict()
    origin, receivers = data.get("origin"), tuple(data.get("receivers") or ())
    extra = {k: data[k] for k in ("origins", "one_side", "output", "last_equal", "within_side", "missing",
                                  "arguments", "seen_in") if k in data}
    found = tuple(result.findings())
    if origin is None and not receivers:
        sentence = (f"At level op, the {n} re-run(s) of each side agree at step {s}: the difference does not "
                    f"reproduce when the step is re-run alone ({result.sentence()})")
        return Walked(status="clean", sentence=sentence, step=s, repeats=n, extra=extra, found=found)
    sentence, kernel = result.sentence(), None
    if origin is not None and origin.get("kind") == "op" and origin.get("op"):
        side = request.sides[1] if data.get("one_side") == "b" or data.get("seen_in") == "b" else request.sides[0]
        kernel, kernel_finding = _kernel(request, side, origin, workdir, say, timeout, config)
        if kernel_finding is not None:
            found += (kernel_finding,)
        if kernel and kernel.get("sentence"):
            sentence = f"{sentence} {kernel['sentence']}"
    return Walked(status="located", sentence=sentence, origin=origin, receivers=receivers, kernel=kernel,
                  step=s, repeats=n, extra=extra, found=found)


def _estimate(request: Walk, width: int, count: int) -> str:
    """``", about N s"`` from the check's own run time (waves of re-runs plus the kernel capture); ``""`` without
    one."""
    total = next((side.total_steps for side in request.sides if side.total_steps), None)
    if not request.run_seconds or not total:
        return ""

    def cost(side: Side) -> float:
        # From the step of its resume checkpoint (``step_N``); from scratch, step 0.
        name = os.path.basename(os.path.normpath(side.resume_from)) if side.resume_from else ""
        steps = request.step - (int(name[5:]) if name.startswith("step_") and name[5:].isdigit() else 0)
        return request.run_seconds * max(1, steps) / max(total, request.step)

    longest = max(cost(side) for side in request.sides)
    waves = -(-count // max(1, width))
    return f", about {round((waves + 1) * longest)} s with the kernel's capture"


def _kernel(request: Walk, side: Side, origin: Mapping[str, Any], workdir: str, say: Callable[[str], None],
            timeout: float, config: Callable[..., Any]) -> tuple[dict[str, Any] | None, Finding | None]:
    """Capture the origin op's inputs in one more run of ``side`` and re-run it alone: the kernel entry and its
    finding. A failure here is a ``locate-kernel-failed`` warning; the origin stands."""
    s, rank = request.step, origin.get("rank")
    if rank is None:
        return {"status": "not-captured", "sentence": f"{origin.get('op')} is an origin on several ranks on their "
                "own; its kernel was not re-run alone (capture it on one rank to tell)."}, None
    key = (s, origin.get("phase"), origin.get("module"), origin.get("op"), origin.get("occurrence"))
    path = os.path.join(own_dir(workdir, "capture"), f"op-rank{rank}.pt")
    say(f"locate: capturing the inputs of {origin.get('op')} (rank {rank}) and re-running it alone "
        f"{request.repeats} times")
    try:
        win = OpWindow(steps=(s,), ranks=(rank,), capture=key, capture_path=path)  # type: ignore[arg-type]
        from ckptverify.resume.launch import launch_jobs

        launch_jobs(request.nproc, request.device, [(side.target, config(side, "capture", win))], timeout_s=timeout)
        if not os.path.exists(path):
            text = (f"The inputs of {origin.get('op')} were not captured in a further run (its key did not recur), "
                    "so the kernel was not re-run alone.")
            return {"status": "not-captured", "sentence": text}, warning("locate-kernel-failed", text)
        verdict = rerun(path, runs=max(2, request.repeats), device=request.device)
        out = dict(verdict.to_dict())
        out.setdefault("sentence", verdict.sentence())
        return out, verdict.finding()
    except Exception as exc:
        text = f"The origin op could not be re-run alone ({_reason(exc)})."
        return {"status": "failed", "sentence": text}, warning("locate-kernel-failed", text)


def for_resume(plan: Any, verdict: Any, evidence: Any, configs: Mapping[str, Any], workdir: str, *,
               progress: Callable[[str], None] | None = None, timeout_s: float | None = None,
               run_seconds: float | None = None) -> Walked:
    """The walk of a failed ``resume-check`` ``verdict`` over its ``configs`` (A, A2, B); ``run_seconds``: run A's
    time, for the estimate."""
    kind = verdict.kind
    if kind in STATE_KINDS:
        step = plan.resume_at + 1 if kind == "restore-mismatch" else verdict.step
        return state_origin(kind=kind, step=step, rank=verdict.rank, site=verdict.site,
                            divergence=None if kind == "restore-mismatch" else getattr(evidence, "resume", None))
    if kind not in WALK_KINDS or verdict.step is None or verdict.category in ("final", "held-state"):
        return skipped("the verdict names no traced step whose computation differs (it is in "
                       f"{verdict.category or kind}), so there is no step to re-run at level op", step=verdict.step)
    from ckptverify.resume.run import checkpoint_path

    s, K, T = verdict.step, plan.resume_at, plan.steps
    a_ckpt = configs["A"].checkpoint_dir
    nd = getattr(evidence, "nondeterminism", None)
    # A resumed run may start s from differing state outside the TrainState; continuous runs do not.
    state_equal: bool | None = None
    if kind == "nondeterministic" or (nd is not None and getattr(nd, "step", None) == s):
        start = checkpoint_path(a_ckpt, K) if s > K else None
        sides = (Side(name="A", target=plan.target, resume_from=start, total_steps=T),
                 Side(name="A2", target=plan.target, resume_from=start, total_steps=T))
        state_equal = True
    else:
        sides = (Side(name="A", target=plan.target, total_steps=T),
                 Side(name="B", target=plan.target, resume_from=checkpoint_path(a_ckpt, K), total_steps=T))
    request = Walk(step=s, sides=sides, nproc=plan.nproc, device=plan.device, repeats=plan.locate_repeats,
                   timeout_s=timeout_s, state_equal=state_equal, run_seconds=run_seconds)
    return walk(request, workdir, progress=progress)


def for_replay(verdict: Any, replayed: Side, *, world: int, device: str, repeats: int, workdir: str,
               progress: Callable[[str], None] | None = None, timeout_s: float | None = None) -> Walked:
    """The walk of a ``replay`` ``verdict``: differing replays (``replayed``, re-run as R1 and R2) are re-run; input
    causes are ``state`` origins; production vs replay cannot be walked (production has no op log)."""
    kind, step = verdict.kind, verdict.step
    if kind in STATE_KINDS:
        return state_origin(kind=kind, step=step, rank=verdict.rank, site=verdict.site)
    if kind != "nondeterministic" or step is None:
        why = {"hardware-fault-suspected": "production recorded no op log to compare the replays' with, and the "
               "replays agree with each other; to locate the op, run the job with an op window on the suspected "
               "step (trace level op) and replay again",
               "undetermined": "the evidence does not single out a step and rank to re-run"}
        return skipped(why.get(kind, f"a {kind} verdict has no computed step to re-run at level op"), step=step)
    request = Walk(step=step, sides=(replace(replayed, name="R1"), replace(replayed, name="R2")), nproc=world,
                   device=device, repeats=repeats, timeout_s=timeout_s, state_equal=True)
    return walk(request, workdir, progress=progress)
