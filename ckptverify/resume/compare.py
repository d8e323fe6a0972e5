"""Comparing the runs of a resume check into findings (tagged by stage) and the :class:`Evidence` the verdict reads:
(a) restore, (b) A vs A2, (c) A vs B after the resume with the causes the first differing step starts from
(:func:`step_evidence`), (d) final checkpoints, then values held outside the TrainState."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ckptverify.findings import Finding, Location, error, info, warning
from ckptverify.resume.run import RunConfig, checkpoint_path, rank_files

if TYPE_CHECKING:
    from ckptverify.trace.compare import FirstDivergence, RankComparison

__all__ = ["FOLD_ABOVE", "Evidence", "HeldComparison", "Indices", "SiteDiff", "StepEvidence", "compare",
           "restore_findings", "step_evidence"]


@dataclass(frozen=True)
class SiteDiff:
    """A random stream (``name``: its site without ``start.``) or hyperparameter (``<group>.<key>``) that differs,
    its values in A and B (``a`` ``None`` when A has only the category cell) and, when a step starts, whether each
    run moved it since the previous step (B's first resumed step: since the restore)."""

    name: str
    a: Any
    b: Any
    a_moved: bool | None = None
    b_moved: bool | None = None


@dataclass(frozen=True)
class Indices:
    """Digests of ``data.indices``: in A, in B, and A's of the next step; ``None`` where not recorded."""

    a: Any = None
    b: Any = None
    a_next: Any = None


@dataclass(frozen=True)
class StepEvidence:
    """What differs at a rank's first divergent step among the causes a step starts from (:func:`step_evidence`):
    ``sites`` all that differ there, ``position`` whether the loader's position (``data``) is among them."""

    rng: tuple[SiteDiff, ...] = ()
    hparams_start: tuple[SiteDiff, ...] = ()
    hparams_step: tuple[SiteDiff, ...] = ()
    buffers: tuple[str, ...] = ()
    batch: bool = False
    indices: Indices = Indices()
    position: bool = False
    sites: tuple[str, ...] = ()


@dataclass(frozen=True)
class HeldComparison:
    """Values held outside the TrainState at the end: ``differ`` (A vs B, per variable and rank),
    ``nondeterministic`` (those A2 holds differently too), ``a2`` (A2 compared)."""

    differ: tuple[Mapping[str, Any], ...] = ()
    nondeterministic: tuple[str, ...] = ()
    a2: bool = False


@dataclass(frozen=True)
class Evidence:
    """Everything the comparisons of one resume check found that the verdict reads: what ``run.restore`` noticed in A
    (``unsaved_schedulers``, ``unregistered``, ``missing_optimizer``), then (a) ``restore``, (b)
    ``nondeterminism``, (c) ``resume[_sites]`` and ``step``, (d) ``final``, and ``held`` (``None``: no B)."""

    unsaved_schedulers: tuple[str, ...] = ()
    unregistered: tuple[Mapping[str, str], ...] = ()
    #: Registered objects a run rebuilt after ``run.restore``.
    replaced: tuple[Mapping[str, Any], ...] = ()
    #: Per rank: A saved B's checkpoint while parameters held accumulated gradients.
    pending_gradients: tuple[Mapping[str, Any], ...] = ()
    #: The registered loader as A saw it at ``run.restore`` (``type``, ``iterable``); ``None``: none.
    loader: Mapping[str, Any] | None = None
    missing_optimizer: str | None = None
    restore: tuple[Finding, ...] = ()
    nondeterminism: FirstDivergence | None = None
    resume: FirstDivergence | None = None
    resume_sites: frozenset[str] = frozenset()
    step: StepEvidence | None = None
    final: tuple[Finding, ...] = ()
    held: HeldComparison | None = None


def compare(configs: Mapping[str, RunConfig], *, steps: int, resume_at: int, verbose: bool = False
            ) -> tuple[list[Finding], Evidence]:
    """Compare the runs of ``configs`` (A, and A2/B when they ran): findings tagged with their stage, and the
    evidence for the verdict."""
    from ckptverify.audit.diff import diff_checkpoints

    T, K = steps, resume_at
    findings: list[Finding] = []
    notes = {name: rank_files(config.trace_dir, "notes") for name, config in configs.items()}
    notes_a = notes["A"]
    found: dict[str, Any] = {"unsaved_schedulers": tuple(notes_a.get(0, {}).get("unsaved_schedulers", [])),
                             "unregistered": tuple(_unregistered(notes_a)),
                             "missing_optimizer": notes_a.get(0, {}).get("missing_optimizer")}
    findings.extend(warning("unregistered-state", f"{u['name']} ({u['type']}: {u['kind']}) is not in the TrainState: "
                            "a resume does not save or restore it", location=Location(fqn=u["name"]), actual=dict(u))
                    for u in found["unregistered"])
    if found["missing_optimizer"]:
        findings.append(warning("no-optimizer", found["missing_optimizer"]))
    replaced = [{**r, "run": name, "rank": rank} for name, by_rank in notes.items()
                for rank, n in sorted(by_rank.items()) for r in n.get("replaced", []) or []]
    found["replaced"] = tuple(replaced)
    found["loader"] = notes_a.get(min(notes_a), {}).get("loader") if notes_a else None
    found["pending_gradients"] = tuple({**p, "rank": rank} for rank, n in sorted(notes_a.items())
                                       for p in n.get("pending_gradients", []) or [] if p.get("step") == K)
    findings.extend(warning("replaced-after-restore", f"[{r['run']}] {r['name']} ({r['type']}) was rebuilt after "
                            f"run.restore() on rank {r['rank']}: the TrainState saves and restores the "
                            f"{r['registered_type']} registered as {r['field']}, not the one the loop uses",
                            location=Location(rank=r["rank"], fqn=r["name"]), actual=dict(r)) for r in replaced)
    # (a) restored state vs saved state
    if "B" in configs:
        restore = restore_findings(configs["B"].trace_dir)
        findings.extend(_tag("B restore", restore))
        found["restore"] = tuple(restore)
    # (b) A vs A2: nondeterminism
    a_trace = configs["A"].trace_dir
    if "A2" in configs:
        nd, found["nondeterminism"], _ = _trace_stage("A vs A2", a_trace, configs["A2"].trace_dir, None)
        findings.extend(nd)
    # (c) A vs B after the resume
    if "B" in configs:
        ab, div, comps = _trace_stage("A vs B", a_trace, configs["B"].trace_dir, range(K + 1, T + 1))
        findings.extend(ab)
        found["resume"] = div
        if div is not None:
            from ckptverify.trace.compare import sites_at

            found["resume_sites"] = frozenset(n for names in sites_at(comps, div.step).values() for n in names)
            restored = notes["B"].get(div.rank, {}).get("restored", {})
            found["step"] = step_evidence(next(c for c in comps if c.rank == div.rank),
                                          first_resumed=div.step == K + 1, restored=restored)
        # (d) final states
        final = diff_checkpoints(checkpoint_path(configs["A"].checkpoint_dir, T),  # type: ignore[arg-type]
                                 checkpoint_path(configs["B"].checkpoint_dir, T))  # type: ignore[arg-type]
        errors = [f for f in final.findings if f.severity.value == "error"]
        findings.extend(_tag("final A vs B", errors if verbose else _fold(errors)))
        found["final"] = tuple(errors)
    # Each run's own recompute mismatches (activation checkpointing).
    from ckptverify.trace.compare import recompute_findings

    for name, config in configs.items():
        if config.trace_dir and os.path.isdir(config.trace_dir):
            findings.extend(_tag(f"{name} recompute", recompute_findings(config.trace_dir)))
    if "B" in configs:
        earlier = any(found.get(k) for k in ("restore", "nondeterminism", "resume", "final"))
        found["held"], held_findings = _held_state(configs, earlier=earlier)
        findings.extend(held_findings)
    return findings, Evidence(**found)


#: Final-state differences listed one by one in the text report (all under ``--verbose`` and in JSON).
FOLD_ABOVE = 3


def _fold(errors: list[Finding]) -> list[Finding]:
    """Many final-state differences as one row: how many, which come first, and the full list in ``actual``."""
    if len(errors) <= FOLD_ABOVE:
        return errors
    shown = ", ".join(str(f.location.fqn or f.location.record or f.check) for f in errors[:FOLD_ABOVE])
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


def _held_state(configs: Mapping[str, RunConfig], *, earlier: bool) -> tuple[HeldComparison, list[Finding]]:
    """Compare values held outside the TrainState at the end of A, B (and A2): errors when the runs otherwise agree,
    info (a possible consequence) when an ``earlier`` comparison failed."""
    from ckptverify.resume.unregistered import compare_held

    held = {name: rank_files(c.trace_dir, "held") for name, c in configs.items()}
    differ = compare_held(held["A"], held["B"])
    a2 = "A2" in configs and bool(held["A2"])
    again = {d["var"] for d in compare_held(held["A"], held["A2"])} if a2 else set()
    nondeterministic = tuple(sorted(again & {d["var"] for d in differ}))
    out: list[Finding] = []
    for d in differ:
        text = (f"[end of A vs B] {d['var']} differs at the end of the run (rank {d['rank']}, first at "
                f"{d['path']}): the training function holds it outside the TrainState")
        where = Location(fqn=d["path"], rank=d["rank"])
        out.append(info("held-state", text + " (it may follow from the divergence above)", location=where,
                        actual=d) if earlier else error("held-state", text, location=where, actual=d))
    incomplete = _held_gaps(held)
    if incomplete:
        out.append(warning("held-state-incomplete", "the values held outside the TrainState were not all "
                           "compared: " + "; ".join(incomplete)))
    return HeldComparison(differ=tuple(differ), nondeterministic=nondeterministic, a2=a2), out


def _held_gaps(held: dict[str, dict[int, dict[str, Any]]]) -> list[str]:
    """Why some held values were not compared: a missing rank record, a failed walk, a limit, or an unfingerprintable
    value."""
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


def step_evidence(comparison: RankComparison, *, first_resumed: bool, restored: Mapping[str, Any]) -> StepEvidence:
    """What differs at a rank's first divergent step (``comparison``) among the causes a step starts from (random
    streams and hyperparameters at step start, hyperparameters as used, non-persistent buffers, batch,
    ``data.indices``), and for streams and start hyperparameters whether each run moved them since the previous step
    (B's first step: since ``restored``). A category cell (``buffer.*``) that differs alone, as production's does
    against a replay's finer trace, stands for the member its bits name; a hyperparameter's, else for B's field that
    moved since the restore, else B's first."""
    from ckptverify.trace.compare import named_member

    assert comparison.first is not None and comparison.traces is not None
    ta, tb = comparison.traces
    step, differing = comparison.first.step, comparison.first_differing

    def changed(now: Any, before: Any) -> bool | None:
        return None if now is None or before is None else bool(now != before)

    def stream(n: str) -> SiteDiff:
        name = n[len("start."):]
        b_before = restored.get(n) if first_resumed else tb.value(step - 1, name)
        a_before = restored[n] if first_resumed and n in restored else ta.value(step - 1, name)
        return SiteDiff(name, ta.value(step, n), tb.value(step, n), a_moved=changed(ta.value(step, n), a_before),
                        b_moved=changed(tb.value(step, n), b_before))

    def named(prefix: str) -> list[str]:
        names = [n for n in differing if n.startswith(prefix)]
        whole = prefix + "*"
        if names != [whole]:
            return [n for n in names if n != whole]  # the members that differ name it
        member, _ = named_member(ta, tb, step, (ta if ta.has_site(whole) else tb).site(whole))
        if member is None and prefix.endswith("hparam."):
            fields = [x.name for x in tb.sites if x.group == whole]
            member = next((f for f in fields if first_resumed and f in restored and tb.value(step, f) != restored[f]),
                          fields[0] if fields else None)
        return [member or whole]

    def hparam(prefix: str, name: str) -> SiteDiff:
        a, b = ta.value(step, name), tb.value(step, name)
        before = restored.get(name) if first_resumed else None
        b_moved = changed(b, before)
        # A holds only the category cell, which differs from B's: A moved the field exactly when B did not.
        a_moved = changed(a, before) if a is not None or b_moved is None else not b_moved
        return SiteDiff(name[len(prefix):], a, b, a_moved=a_moved, b_moved=b_moved)

    return StepEvidence(rng=tuple(stream(n) for n in differing if n.startswith("start.rng.")),
                        hparams_start=tuple(hparam("start.hparam.", n) for n in named("start.hparam.")),
                        hparams_step=tuple(hparam("hparam.", n) for n in named("hparam.")),
                        buffers=tuple(named("buffer.")),
                        batch=any(n == "batch" or n.startswith("batch.") for n in differing),
                        indices=Indices(ta.value(step, "data.indices"), tb.value(step, "data.indices"),
                                        ta.value(step + 1, "data.indices")),
                        position="data" in differing, sites=differing)


def _trace_stage(stage: str, a: str | None, b: str | None, steps: range | None
                 ) -> tuple[list[Finding], FirstDivergence | None, list[RankComparison]]:
    """Compare two runs' traces: the findings, the job's first divergence and the comparisons. Random streams that
    differ while nothing computed from them does (an unseeded, unused generator) are an info line, not a
    divergence."""
    from ckptverify.trace.compare import comparison_findings, job_divergence, rank_comparisons

    comps = rank_comparisons(a, b, steps=steps, every_step=True)  # type: ignore[arg-type]
    found = comparison_findings(comps)
    if not any(f.severity.value == "error" for f in found):
        return _tag(stage, found), None, comps
    differing = {n for c in comps for n in c.differing}
    if differing and all(name.startswith(("rng.", "start.rng.")) for name in differing):
        names = ", ".join(sorted({n.removeprefix("start.") for n in differing}))
        return [info("trace-rng-unused", f"[{stage}] unused random stream(s) differ: {names} (no traced value "
                     "depends on them: an unseeded generator the job does not draw from)")], None, comps
    idle = _idle_streams(comps, steps, differing)
    note: list[Finding] = []
    if idle:
        # A stream no step drew from caused none of the other differences, however early its site comes.
        comps = rank_comparisons(a, b, steps=steps,  # type: ignore[arg-type]
                                 ignore_sites=[name for s in idle for name in (s, f"start.{s}")])
        found = [f for f in comparison_findings(comps) if f.check != "trace-ignored"]
        note = [info("trace-rng-unused", f"[{stage}] unused random stream(s) differ: {', '.join(idle)} (no step "
                     "drew from them in either run, so nothing that differs comes from them)")]
    return [*_tag(stage, found), *note], job_divergence([c.first for c in comps if c.first is not None]), comps


def _idle_streams(comps: list[RankComparison], steps: range | None, differing: set[str]) -> list[str]:
    """Streams among ``differing`` that no compared step moved, in either run, on any rank (``start.rng.<s>`` equals
    ``rng.<s>`` every step)."""
    from ckptverify.trace.store import open_trace

    candidates = sorted({n.removeprefix("start.") for n in differing if n.startswith(("rng.", "start.rng."))})
    if not candidates:
        return []
    idle = set(candidates)
    for trace in (t for c in comps for t in (c.traces or [open_trace(p) for p in (c.path_a, c.path_b) if p])):
        names = {s.name for s in trace.sites}
        recorded = [int(x) for x in trace.steps if steps is None or int(x) in steps]
        for stream in list(idle):
            # Not recorded at both sites, or at no step: cannot tell it stood still.
            if stream not in names or f"start.{stream}" not in names or not recorded or any(
                    trace.value(step, f"start.{stream}") != trace.value(step, stream) for step in recorded):
                idle.discard(stream)
    return [s for s in candidates if s in idle]


def restore_findings(trace_dir: str | None) -> list[Finding]:
    """A run's restore check, every rank in order: the restored fields that differ from the checkpoint."""
    return [Finding.from_dict(x) for data in rank_files(trace_dir, "restore").values()
            for x in data.get("findings") or [] if x.get("severity") == "error"]


def _tag(stage: str, findings: list[Finding]) -> list[Finding]:
    """``findings`` with each error's message prefixed ``[stage]``."""
    return [error(f.check, f"[{stage}] {f.message}", location=f.location or Location(), expected=f.expected,
                  actual=f.actual) if f.severity.value == "error" else f for f in findings]
