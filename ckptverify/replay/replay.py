"""``ckptverify replay RUN_DIR --from K --to L``: re-run production steps and judge the hardware.

From production checkpoint ``K`` (:mod:`~ckptverify.production.mode`), steps ``K+1..L`` run twice (R1, R2) in fresh
processes at the production world size. In order: checkpoints must verify (``checkpoint-corrupt``); R1 and R2 must
agree (``nondeterministic``: the replay cannot judge); production must agree with R1, the first differing step
classified by :mod:`~ckptverify.replay.causes`; the final states must agree; else ``reproduced``. Traps: only a
computed difference on equal inputs is ``hardware-fault-suspected`` (input causes say nothing about hardware), a rank
is named only when the evidence singles it out, and the run directory is data: the function to run must be named by
the caller."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from ckptverify.errors import TraceHeaderMismatchError, UsageError
from ckptverify.findings import CheckCoverage, Finding, Report
from ckptverify.production.mode import read_run_file, segments

if TYPE_CHECKING:
    from ckptverify.resume.verdict import Verdict
    from ckptverify.trace.compare import RankComparison

__all__ = ["VERDICTS", "replay"]

VERDICTS = ("reproduced", "nondeterministic", "hardware-fault-suspected", "undetermined", "checkpoint-corrupt",
            "restore-mismatch", "rng", "changed-after-restore", "changed-after-save", "scheduler", "data",
            "hidden-state", "unregistered-state")


@dataclass(frozen=True)
class _Checkpoints:
    start: int
    end: int
    start_path: str
    end_path: str
    verified: frozenset[str] = frozenset()


def _pick(run_dir: str, start: int | None, end: int | None) -> _Checkpoints:
    from ckptverify.formats.rundir import find_checkpoints

    steps = {c.step: os.path.join(run_dir, c.path) for c in find_checkpoints(run_dir)
             if c.kind == "dir" and c.format == "dcp" and c.step is not None}
    verified: set[str] = set()
    if start is None or end is None:
        from ckptverify.runs.latest import latest_verified

        newest = latest_verified(run_dir)
        if newest.path is None or newest.step is None:
            raise UsageError(f"no verified checkpoint under {run_dir} to replay from")
        chosen_end = newest.step if end is None else end
        if end is None and chosen_end in steps and os.path.abspath(steps[chosen_end]) == newest.path:
            verified.add(steps[chosen_end])
        if start is None:
            from ckptverify.audit.verify import verify_checkpoint

            good = next((s for s in sorted((s for s in steps if s < chosen_end), reverse=True)
                         if verify_checkpoint(steps[s]).passed), None)
            if good is None:
                raise UsageError(f"no verified checkpoint before step {chosen_end} under {run_dir} to replay from")
            verified.add(steps[good])
            start = good
        end = chosen_end
    if not 0 <= start < end:
        raise UsageError(f"--from must be below --to, got {start} and {end}")
    for s in (start, end):
        if s not in steps:
            raise UsageError(f"no checkpoint of step {s} under {run_dir} (have: {sorted(steps) or 'none'})")
    return _Checkpoints(start, end, steps[start], steps[end], frozenset(verified))


def _first_unverified(ckpts: _Checkpoints) -> tuple[int, list[Finding]] | None:
    """The first of the two checkpoints that fails verification, with its errors (those verified while picked are not
    verified again)."""
    from ckptverify.audit.verify import verify_checkpoint

    for step, path in ((ckpts.start, ckpts.start_path), (ckpts.end, ckpts.end_path)):
        if path not in ckpts.verified:
            report = verify_checkpoint(path)
            if not report.passed:
                return step, list(report.errors)
    return None


def _where(host: dict[str, Any] | None) -> str:
    if not host:
        return "host unknown"
    dev = host.get("device") or {}
    device = dev.get("type", "?")
    if dev.get("index") is not None:
        device += f":{dev['index']}"
    if dev.get("name"):
        device += f" ({dev['name']}{', ' + dev['uuid'] if dev.get('uuid') else ''})"
    return f"host {host.get('hostname', '?')}, device {device}"


#: Final-state items no device computation produces: a difference there is no hardware fault.
_FINAL_CAUSES = (
    ("data.", "data", "the data loader's position after the last step differs (not saved or not restored)"),
    ("rng.", "rng", "a random stream after the last step differs (re-seeded, or drawn outside the steps)"),
    ("scheduler.", "scheduler", "the LR scheduler's state differs (not saved, or its counter restarted)"),
    ("counters.", "restore-mismatch", "the step counters differ (not restored, or advanced differently)"),
)


def _final_differs(first: Finding, end: int, world: int) -> Verdict:
    """The verdict when every traced site agreed but the final checkpoints differ: the cause the item names, else a
    fault no rank is singled out for."""
    from ckptverify.resume.verdict import Verdict

    item = first.location.fqn or first.check
    for prefix, kind, what in _FINAL_CAUSES:
        if item.startswith(prefix):
            return Verdict(kind, f"every traced site agreed, but the production checkpoint of step {end} differs from "
                           f"the replay's in {item}: {what}; this says nothing about the hardware.",
                           step=end, site=first.location.fqn)
    return Verdict("hardware-fault-suspected",
                   f"every traced site agreed, but the production checkpoint of step {end} differs from the replay's "
                   f"({item}): a fault between the last traced site and the save, or in state the trace does not "
                   f"cover; the evidence cannot tell which rank ({world} could).",
                   step=end, site=first.location.fqn, candidate_ranks=tuple(range(world)))


def _twins_differ(comparisons: list[RankComparison]) -> Verdict:
    """The verdict when the two replays differ from each other (``comparisons``), where they first do."""
    from ckptverify.replay.causes import twin_cause
    from ckptverify.resume.verdict import Verdict

    first = [c.first for c in comparisons if c.first is not None]
    if not first:
        return Verdict("nondeterministic", "the two replays differ from each other, so no judgement about the "
                       "hardware is possible: the job is not deterministic; make it deterministic "
                       "(torch.use_deterministic_algorithms, fixed seeds) and replay again.")
    d = min(first, key=lambda x: (x.step, x.rank))
    return Verdict("nondeterministic", f"the two replays differ from each other, first at step {d.step} on rank "
                   f"{d.rank}, site {d.site}, so no judgement about the hardware is possible: "
                   f"{twin_cause(comparisons, d.step)}.", step=d.step, rank=d.rank, site=d.site)


#: Default cap on ranks started: the (untrusted) run directory says how many.
MAX_PROCS = 64


def pinned(meta: dict[str, Any], run_dir: str, target: str | None, max_procs: int) -> tuple[str, int]:
    """The training function and rank count a replay runs, as the caller pinned them. A run directory is data anyone
    with write access can change: ``target`` is required (the message names what ``run.json`` records) and the
    recorded world size must be 1..``max_procs``."""
    recorded = meta["target"]
    world = meta.get("world_size", 1)
    if type(world) is not int or world < 1:
        raise UsageError(f"{run_dir}/run.json records a world size of {world!r}: not a rank count")
    if world > max_procs:
        raise UsageError(f"{run_dir}/run.json records a world size of {world}: a replay would start {world} "
                         f"processes twice, more than the {max_procs} allowed (--max-procs / max_procs= raises it)")
    if target is None:
        raise UsageError(f"{run_dir}/run.json records the training function {recorded!r} on {world} rank(s). A run "
                         "directory is data: a replay runs (imports and calls) only a function you name. To replay "
                         f"it, pass --target {recorded} (target= in Python).")
    return target, world  # its shape is checked where it is resolved (same_function)


def same_function(target: str, meta: dict[str, Any], run_dir: str) -> str:
    """``target`` resolved as every harness run resolves it, once known to name the function ``run.json`` records
    (same name, same file, however spelled); a ``module:FUNC`` target is imported to find its file, the recorded one
    never is. :class:`UsageError` when they differ (before any process starts) or ``target`` cannot load."""
    from ckptverify.resume.harness_target import check_target, resolve_target, same_file, split_target

    recorded = meta["target"]
    resolved = resolve_target(target)
    where, name, is_file = split_target(resolved)
    try:
        r_where, r_name, r_is_file = split_target(recorded)
    except UsageError:
        raise UsageError(f"{run_dir}/run.json records the training function {recorded!r}, which is not "
                         "FILE.py:FUNC or module:FUNC: the run directory does not say what production ran") from None
    file = where if is_file else check_target(resolved)
    # A recorded module is compared by name: importing it would run what the run directory names.
    same = (file is not None and same_file(file, r_where)) if r_is_file else (not is_file and where == r_where)
    if same and name == r_name:
        return resolved
    named = f"{name} in {file}" if file else resolved
    absent = (f"; {r_where} is not on this machine: replay where the job's code is at that path"
              if r_is_file and not os.path.isfile(r_where) else "")
    raise UsageError(f"--target {target} names {named}, but the job in {run_dir} ran {recorded} (its run.json): a "
                     "replay judges production only by running the function production ran, so nothing was "
                     f"started. Pass --target {recorded} (target= in Python){absent}.")


def comparable(segment: str, *, level: str, workload: str, world: int, device: str = "cpu") -> None:
    """Refuse before any process starts a replay whose traces could not be compared with production's ``segment``
    (other versions, level, world size, or digest encoding than a replay on ``device`` gives): :class:`UsageError`
    naming what differs."""
    from ckptverify.trace.compare import run_stores
    from ckptverify.trace.readback import digest_encoding
    from ckptverify.trace.store import DIGEST_ENCODINGS, TraceHeader, open_trace

    stores = run_stores(segment)
    if not stores:
        return  # no rank's store: the comparison says so, rank by rank
    prod = open_trace(stores[min(stores)]).header
    ours = TraceHeader(run="R1", level=level, workload=workload, detail="tensor", rank=prod.rank, world_size=world)
    fields = prod.differences(ours, ignore=("run", "detail"))
    if fields:
        a, b = prod.to_dict(), ours.to_dict()
        detail = "; ".join(f"{f}: production {a[f]!r}, this replay {b[f]!r}" for f in fields)
        raise UsageError(f"production's trace in {segment} and this replay's would describe different runs "
                         f"({detail}), so no step could be compared bitwise and nothing was started. Replay with "
                         "the versions production ran with installed.")
    # What a replay on ``device`` records: its ranks read this environment at their import, maybe unlike this process.
    want = digest_encoding(device.startswith("cpu"), os.environ.get("CKPTVERIFY_TRACE_HOST_AS_DEVICE") == "1")
    if prod.digest_encoding not in ("unknown", want):
        raise UsageError(f"production's trace in {segment} has digest_encoding {prod.digest_encoding!r} "
                         f"({DIGEST_ENCODINGS[prod.digest_encoding]}), but a replay on --device {device} records "
                         f"{want!r} ({DIGEST_ENCODINGS[want]}): every tensor site would differ at "
                         "the first step, so nothing was started. Replay on the kind of device production ran on "
                         f"({_REPLAY_AS[prod.digest_encoding]}).")


_REPLAY_AS = {"host": "--device cpu", "device": "--device cuda",
              "host-as-device": "--device cpu with CKPTVERIFY_TRACE_HOST_AS_DEVICE=1"}


def replay(run_dir: str | os.PathLike[str], *, target: str | None = None, start: int | None = None,
           end: int | None = None, device: str = "cpu", keep: str | None = None,
           progress: Callable[[str], None] | None = None, max_procs: int = MAX_PROCS, locate: bool = False,
           locate_repeats: int = 2) -> Report:
    """Replay production steps ``start+1..end`` twice and judge them (see the module docstring).

    ``target`` is required (:func:`pinned`); ``max_procs`` caps the ranks started; ``locate`` walks the ladder when
    the verdict is not ``reproduced`` (:mod:`ckptverify.resume.locate.walk`). ``stats["verdict"]`` holds ``kind`` (of
    :data:`VERDICTS`) and the other fields of :meth:`~ckptverify.resume.verdict.Verdict.to_dict`, plus ``host``
    (the named rank's). Raises :class:`UsageError` for a non-production directory or missing checkpoints,
    ``CkptVerifyError`` when the workload crashes."""
    from ckptverify.audit.diff import diff_checkpoints
    from ckptverify.replay.causes import judge
    from ckptverify.resume.harness_target import check_target
    from ckptverify.resume.launch import launch_each, scratch
    from ckptverify.resume.locate.walk import Side, for_replay
    from ckptverify.resume.run import RunConfig, checkpoint_path, rank_files
    from ckptverify.resume.verdict import Verdict
    from ckptverify.trace.compare import comparison_findings, rank_comparisons

    if locate_repeats < 1:
        raise UsageError(f"--locate-repeats must be at least 1, got {locate_repeats}")
    root = os.fspath(run_dir)
    say = progress or (lambda _msg: None)
    began = time.perf_counter()
    meta = read_run_file(root)
    named, world = pinned(meta, root, target, max_procs)
    workload = same_function(named, meta, root)
    check_target(workload)  # a usage error now, not after the checkpoints are verified
    ckpts = _pick(root, start, end)
    findings: list[Finding] = []
    coverage: list[CheckCoverage] = []
    stats: dict[str, Any] = {"from": ckpts.start, "to": ckpts.end, "world_size": world, "target": workload,
                             "recorded_target": meta["target"]}

    replayed_for = 0.0  # bounds the walk's launches

    def done(verdict: Verdict, host: str | None = None) -> Report:
        findings.extend(verdict.findings)
        # A checkpoint-corrupt verdict comes before the runs' folder exists.
        if locate and verdict.kind not in ("reproduced", "checkpoint-corrupt"):
            say(f"locate: walking down from the verdict {verdict.kind}")
            replayed = Side(name="R1", target=workload, resume_from=ckpts.start_path, total_steps=total)
            located = for_replay(verdict, replayed, world=world, device=device, repeats=locate_repeats,
                                 workdir=os.path.join(work, "locate"), progress=say, timeout_s=10 * replayed_for + 60)
            findings.extend(located.findings())
            verdict = replace(verdict, located=located)
        stats.update(verdict={**verdict.to_dict(), "host": host}, seconds=round(time.perf_counter() - began, 3))
        findings.append(verdict.finding(f"replay-{verdict.kind}"))
        return Report(command="replay", target=root, findings=tuple(findings), coverage=tuple(coverage),
                      stats=stats)

    say(f"verify checkpoints of steps {ckpts.start} and {ckpts.end}")
    corrupt = _first_unverified(ckpts)
    if corrupt is not None:
        step, errors = corrupt
        findings.extend(errors[:20])
        return done(Verdict("checkpoint-corrupt", f"the production checkpoint of step {step} fails verification "
                            f"({errors[0].check}): nothing can be replayed or judged from it.", step=step))
    segs = [(s, p) for s, p in segments(root) if s <= ckpts.start]
    if not segs:
        raise UsageError(f"no production trace under {root} covers step {ckpts.start + 1}")
    seg_start, segment = max(segs)
    level = str(meta.get("level", "metrics"))
    comparable(segment, level=level, workload=meta["target"], world=world, device=device)
    try:
        hosts = rank_files(segment, "host")
    except (OSError, ValueError):  # production's files are data: a damaged one leaves the hosts unknown
        hosts = {}
    steps = range(ckpts.start + 1, ckpts.end + 1)
    # For run.total_steps schedules: a replay stops early, they must not change.
    total = meta["steps"] if type(meta.get("steps")) is int and meta["steps"] >= ckpts.end else None
    with scratch(keep, "ckptverify-replay-") as work:
        try:
            # Per-tensor cells, so a differing category is traced back to its tensor.
            configs = {name: RunConfig(name=name, stop_step=ckpts.end, total_steps=total, save_at=(ckpts.end,),
                                       checkpoint_dir=os.path.join(work, name), resume_from=ckpts.start_path,
                                       trace_dir=os.path.join(work, f"trace-{name}"), level=level,
                                       workload=meta["target"], trace_every=int(meta.get("trace_every", 1)),
                                       trace_detail="tensor") for name in ("R1", "R2")}

            # Fresh processes each: process-dependent nondeterminism (hash seeds, allocation order) must show.
            replayed_for = launch_each(world, device, [
                (f"replay {name}: steps {steps.start}..{steps.stop - 1} on {world} rank(s)",
                 [(workload, configs[name])]) for name in ("R1", "R2")], say=say)
            r1, r2 = configs["R1"].trace_dir, configs["R2"].trace_dir
            assert r1 is not None and r2 is not None
            twins = rank_comparisons(r1, r2, steps=steps)
            twin = [f for f in comparison_findings(twins) if f.severity.value == "error"]
            coverage.append(CheckCoverage(check="replay-twins", count=len(steps), unit="steps"))
            if twin:
                findings.extend(twin[:20])
                return done(_twins_differ(twins))
            say("compare production with the replay")
            compared = rank_comparisons(segment, r1, steps=steps)  # judged from these too: compared once
            prod = [f for f in comparison_findings(compared) if f.severity.value == "error"]
            coverage.append(CheckCoverage(check="replay-production", count=len(steps), unit="steps"))
            if prod:
                findings.extend(prod[:20])
                judged = judge(segment, r1, start=ckpts.start, end=ckpts.end, world=world, production_start=seg_start,
                               where=lambda r: _where(hosts.get(r)), comparisons=compared)
                return done(judged, host=hosts.get(judged.rank, {}).get("hostname"))
            say("compare the final state with the production checkpoint")
            final = diff_checkpoints(ckpts.end_path, checkpoint_path(os.path.join(work, "R1"), ckpts.end))
            coverage.extend(final.coverage)
            if not final.passed:
                findings.extend(final.errors[:20])
                return done(_final_differs(final.errors[0], ckpts.end, world))
            return done(Verdict("reproduced", f"production steps {steps.start}..{steps.stop - 1} are bitwise "
                                f"reproducible on {world} rank(s): two replays agree with each other and with "
                                "production, traces and final state: no fault seen."))
        except TraceHeaderMismatchError as exc:
            # Another rank's differing header (only rank 0's was checked up front), in this command's words.
            raise UsageError(f"production's trace and the replay's describe different runs ({', '.join(exc.fields)} "
                             f"differ{'s' if len(exc.fields) == 1 else ''}): no step can be compared bitwise") from None
