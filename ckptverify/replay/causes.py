"""Why production differs from two agreeing replays: the cause of the first difference.

A replay judges hardware only where the inputs of a step are known to be equal in production and in the
replay. :func:`judge` takes the first step ``s`` at which production and the replay ``R1`` differ (on any rank)
and classifies what differs there, with the causes, kind names and sentences of ``resume-check``
(:mod:`ckptverify.resume.causes`), in this order:

* ``restore-mismatch`` — the replay's restored state differs from what production's checkpoint holds;
* ``rng`` — a random stream differs when step ``s`` starts (re-seeded or drawn after ``run.restore`` in the
  replay, or drawn by production after its save point);
* ``changed-after-restore`` / ``changed-after-save`` / ``scheduler`` — a hyperparameter differs when the
  step starts, or as the optimizer step used it;
* ``data`` — the batch (or the loader's position after the step) differs while the random streams and
  hyperparameters are equal;
* ``hidden-state`` / ``unregistered-state`` — a non-persistent buffer differs, or, at the first replayed step
  of a trace that records the step's inputs, the job holds state its ``TrainState`` does not;
* ``undetermined`` — a computed value differs but the step's inputs are not all known to be equal: the trace
  records no inputs (level ``metrics``), the steps before ``s`` are not traced, or ``s`` is the first
  replayed step and production ran on from memory (state a checkpoint does not hold would look the same);
* ``hardware-fault-suspected`` — the inputs of step ``s`` are equal and a computed value differs.

None of the input causes is evidence about hardware. For the last two, the rank is named only when the
evidence singles it out: it is the only rank that differs at step ``s``, or the only one with a difference
that another rank, recording the same site, does not have (its own loss, its own activations, before any
reduction). When every difference shows on every rank alike (values after an all-reduce: averaged gradients,
a reduced loss, the gradient norm) the origin cannot be told, and ``candidate_ranks`` lists the ranks that
could hold it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from ckptverify.findings import Finding
from ckptverify.resume import causes
from ckptverify.resume.causes import CAUSE_KINDS, REPLAY
from ckptverify.resume.compare import HparamDiff, StepEvidence

__all__ = ["CAUSE_KINDS", "Judgement", "judge", "twin_cause"]


@dataclass(frozen=True)
class Judgement:
    """One replay verdict: ``kind``, the ``sentence`` (cause and what to do), where, and the candidates."""

    kind: str
    sentence: str
    step: int | None = None
    rank: int | None = None
    site: str | None = None
    candidate_ranks: tuple[int, ...] | None = None
    findings: tuple[Finding, ...] = ()


def _read_json_files(trace_dir: str, prefix: str) -> dict[int, Any]:
    out: dict[int, Any] = {}
    if not os.path.isdir(trace_dir):
        return out
    for name in os.listdir(trace_dir):
        middle = name[len(prefix):-5]
        if name.startswith(prefix) and name.endswith(".json") and middle.isdigit():
            try:
                with open(os.path.join(trace_dir, name)) as f:
                    out[int(middle)] = json.load(f)
            except (OSError, ValueError):
                continue
    return out


def restore_findings(replay_dir: str) -> list[Finding]:
    """The replay's restore check: fields restored from production's checkpoint that differ from it."""
    out: list[Finding] = []
    for _, data in sorted(_read_json_files(replay_dir, "restore-rank").items()):
        out.extend(Finding.from_dict(x) for x in (data.get("findings") or []) if x.get("severity") == "error")
    return out


def differing_sites(dir_a: str, dir_b: str, step: int) -> dict[int, list[str]]:
    """Per rank (with a store in both runs), the sites that differ at ``step``, in execution order. A tensor's
    own cell that only a trace of detail ``tensor`` records is left out (its category cell stands for it)."""
    from ckptverify.trace.compare import _member_of_finer, _merged_order, run_stores
    from ckptverify.trace.store import open_trace

    stores_a, stores_b = run_stores(dir_a), run_stores(dir_b)
    out: dict[int, list[str]] = {}
    for rank in sorted(set(stores_a) & set(stores_b)):
        ta, tb = open_trace(stores_a[rank]), open_trace(stores_b[rank])
        if ta.row_index(step) is None or tb.row_index(step) is None:
            out[rank] = []
            continue
        names = _merged_order([s.name for s in ta.sites], [s.name for s in tb.sites])
        names = [n for n in names if (ta.has_site(n) and tb.has_site(n)) or not _member_of_finer(n, ta, tb)]
        out[rank] = [n for n in names if ta.lanes(step, n) != tb.lanes(step, n)]
    return out


def _both(dir_a: str, dir_b: str) -> dict[int, tuple[Any, Any]]:
    from ckptverify.trace.compare import run_stores
    from ckptverify.trace.store import open_trace

    stores_a, stores_b = run_stores(dir_a), run_stores(dir_b)
    return {r: (open_trace(stores_a[r]), open_trace(stores_b[r])) for r in sorted(set(stores_a) & set(stores_b))}


def twin_cause(r1: str, r2: str, step: int) -> str:
    """What the two replays' first difference at ``step`` says about where the nondeterminism is, and what to do."""
    sites = sorted({s for names in differing_sites(r1, r2, step).values() for s in names})
    if any(s.startswith("start.rng.") for s in sites):
        names = ", ".join(s[len("start."):] for s in sites if s.startswith("start.rng."))
        return (f"random stream {names} differs between them when step {step} starts: the job seeds it from a "
                "source that changes from process to process (a clock, os.urandom, a hash seed); seed it with a "
                "fixed value and replay again")
    if any(s == "batch" or s.startswith("batch.") for s in sites):
        return (f"their batches of step {step} differ while their random streams are equal: the data pipeline "
                "draws from a source no seed fixes (augmentation from os.urandom, the clock or an unseeded "
                "generator, in the loader or its workers); draw it from torch's generator (seeded per worker "
                "by the DataLoader) or one derived from the sample index, and replay again")
    return ("the job is not deterministic; make it deterministic (torch.use_deterministic_algorithms, fixed "
            "seeds) and replay again")


def _origin(found: dict[int, list[str]], world: int, records: Callable[[int, str], bool]
            ) -> tuple[tuple[int, ...], int | None, str | None]:
    """``(candidate ranks, the rank singled out or None, its own differing site or None)`` at the first
    differing step; ``found``: each rank's differing sites; ``records(rank, site)``: both runs record ``site``
    on ``rank``."""
    differing = [r for r, names in found.items() if names]
    missing = sorted(set(range(world)) - set(found))
    if world == 1 and differing == [0]:
        return (0,), 0, None  # one rank: no reduction brings another rank's values in
    if len(differing) + len(missing) < world:
        # Some rank computed the step exactly as the replay did: the others are the candidates (a rank with no
        # store in one of the runs cannot be cleared).
        candidates = tuple(sorted({*differing, *missing}))
        if len(candidates) == 1 and not missing:
            return candidates, candidates[0], None
        return candidates, None, None
    # Every rank differs: a rank whose own value differs where another rank's recorded value is equal holds the
    # origin; the differences that every rank shares arrived through a reduction.
    own: dict[int, str] = {}
    for r in differing:
        site = next((x for x in found[r]
                     if any(o != r and x not in found[o] and records(o, x) for o in found)), None)
        if site is not None:
            own[r] = site
    if len(own) == 1 and not missing:
        ((rank, site),) = own.items()
        return (rank,), rank, site
    if own:
        return tuple(sorted({*own, *missing})), None, None
    return tuple(sorted({*differing, *missing})), None, None


def judge(prod: str, replay: str, *, start: int, end: int, world: int, production_start: int,
          where: Callable[[int], str] = lambda rank: "host unknown") -> Judgement:
    """Classify the first difference between production's trace segment ``prod`` and the replay's trace
    directory ``replay`` over steps ``start+1..end`` (see the module docstring). ``production_start``: the
    step that production's trace segment (and its process) started from; ``where(rank)``: the host and device
    of a production rank, in words."""
    from ckptverify.resume.compare import step_evidence
    from ckptverify.trace.compare import divergences

    steps = range(start + 1, end + 1)
    found = divergences(prod, replay, steps=steps)
    if not found:
        # The comparison failed without a divergence: steps or ranks recorded in one run only.
        return Judgement("undetermined", "production's trace and the replay's do not cover the same steps and "
                         "ranks, and every step both cover agrees: the steps not compared cannot be judged. What "
                         "would tell: a production trace of every replayed step on every rank (trace_every=1)")
    s = min(d.step for d in found)
    first = {d.rank: d for d in found if d.step == s}
    pairs = _both(prod, replay)
    level = next(iter(pairs.values()))[0].header.level if pairs else "metrics"
    sites = differing_sites(prod, replay, s)
    notes = _read_json_files(replay, "notes-rank")
    first_replayed = s == start + 1
    lead = min(first.values(), key=lambda d: d.rank)

    # 0. The replay's restore: its inputs are production's checkpoint only if it restored exactly that.
    restore = restore_findings(replay)
    if restore:
        f = restore[0]
        return Judgement("restore-mismatch", f"the replay's restored {f.location.fqn or 'state'} differs from what "
                         f"production's checkpoint of step {start} holds (rank {f.location.rank}; {len(restore)} "
                         "field(s) in all), so the replay did not start from production's state: this says nothing "
                         f"about the hardware. What to do: {causes.RESTORE_ADVICE}, then replay again",
                         step=s, rank=f.location.rank, site=f.location.fqn, findings=tuple(restore[:20]))

    # 1.-5. The step's inputs, on every rank that differs (what differs on one rank's inputs reaches the others).
    evidence: dict[int, StepEvidence] = {}
    for r in sorted(first):
        restored = (notes.get(r) or {}).get("restored") or {}
        ev = step_evidence(prod, replay, r, s, first_resumed=first_replayed, restored=restored)
        ta, tb = pairs[r]
        mine = sites.get(r, [])
        # Production records one cell per category; the replay a cell per tensor and per hyperparameter too.
        # Only what both record is evidence: the per-field cells only the replay holds are not differences.
        evidence[r] = replace(
            ev, rng=tuple(x for x in ev.rng if f"start.{x.stream}" in mine),
            hparams_start=_hparams(ta, tb, s, "start.hparam.", mine, restored, first_replayed),
            hparams_step=_hparams(ta, tb, s, "hparam.", mine, None, first_replayed),
            buffers=tuple(n for n in mine if n.startswith("buffer.")),
            batch=any(n == "batch" or n.startswith("batch.") for n in mine), position="data" in mine,
            sites=tuple(mine))
    when = REPLAY.first if first_replayed else f"step {s}"
    none_hw = "this says nothing about the hardware"

    for r, ev in evidence.items():
        if not ev.rng:
            continue
        names = ", ".join(x.stream for x in ev.rng)
        b_moved = [x.stream for x in ev.rng if x.b_moved]
        cause, advice = causes.rng_cause(REPLAY, b_moved=b_moved, a_moved=[x.stream for x in ev.rng if x.a_moved],
                                         first_step=first_replayed, step=s, saved_at=start)
        if b_moved and first_replayed:
            cause += f", which production, running on from step {start}, did not"
        sentence = causes.rng_sentence(names, when=when, step=s, rank=r, cause=cause,
                                       between=" between production and the replays")
        return Judgement("rng", f"{sentence}, and {none_hw}. What to do: {advice}, then replay again",
                         step=s, rank=r, site=ev.rng[0].stream)

    for r, ev in evidence.items():
        if not ev.hparams_start:
            continue
        h = ev.hparams_start[0]
        g, _, key = h.field.partition(".")
        name = f"param_groups[{g}].{key}"
        kind, text, advice = causes.hparam_start_cause(REPLAY, name=name, a=h.a, b=h.b, first_step=first_replayed,
                                                       a_moved=h.a_moved, b_moved=h.b_moved, step=s, saved_at=start,
                                                       when=when)
        return Judgement(kind, f"{text}; {none_hw}. What to do: {advice}", step=s, rank=r, site=f"optim.{name}")

    unsaved = sorted({u for n in notes.values() for u in (n or {}).get("unsaved_schedulers") or []})
    for r, ev in evidence.items():
        lr_moved = any(x.startswith(("optim.param_groups", "metric.lr", "scheduler")) for x in ev.sites)
        if not ev.hparams_step and not (unsaved and lr_moved):
            continue
        if ev.hparams_step:
            h = next((x for x in ev.hparams_step if x.field.endswith(".lr")), ev.hparams_step[0])
            g, _, key = h.field.partition(".")
            what = causes.step_hparam_what(REPLAY, key=key, group=g, a=h.a, b=h.b, step=s)
            site = f"optim.param_groups[{g}].{key}"
        else:
            what = f"the learning rate differs at {when}"
            site = next(x for x in ev.sites if x.startswith(("optim.param_groups", "metric.lr", "scheduler")))
        cause, advice = causes.step_hparam_cause(unsaved)
        return Judgement("scheduler", f"{what} on rank {r}: {cause}; {none_hw}. What to do: {advice}, then replay "
                         "again", step=s, rank=r, site=site)

    for r, ev in evidence.items():
        if not (ev.batch or ev.position):
            continue
        batch_site = next((x for x in ev.sites if x == "batch" or x.startswith("batch.")), "data")
        if ev.batch and not ev.position and all(_records_position(pairs[r])):
            cause = (f"the batch of step {s} differs on rank {r} ({batch_site}) while the loader's position, the "
                     "random streams and the hyperparameters are equal: the samples at the same position differ, "
                     "so the data pipeline does not reproduce production after a restart. DataLoader workers draw "
                     "augmentation from their own random streams, seeded from the main process when the "
                     "iterator is made, and no checkpoint holds them")
            advice = ("draw augmentation from a generator derived from the sample index (and epoch), so that a "
                      "sample reads the same after a restart")
        else:
            cause = (f"the batch of step {s} differs on rank {r} ({batch_site}) while the random streams and "
                     "hyperparameters it started from are equal: the data loader's position was not saved or not "
                     "restored")
            advice = (f"{causes.REGISTER_LOADER}, and keep the batch fetch inside the step (a batch prefetched "
                      "before the save is lost)")
        return Judgement("data", f"{cause}; {none_hw}. What to do: {advice}, then replay again",
                         step=s, rank=r, site=batch_site)

    for r, ev in evidence.items():
        if ev.buffers:
            name = ev.buffers[0]
            if name == "buffer.*":
                from ckptverify.trace.compare import _named_member

                ta, tb = pairs[r]
                member, _ = _named_member(ta, tb, s, ta.site(name))
                name = member or name
            text, advice = causes.buffer_cause(REPLAY, name=name.removeprefix("buffer."), when=when, rank=r)
            return Judgement("hidden-state", f"{text}; {none_hw}. What to do: {advice}", step=s, rank=r, site=name)

    # 6. Inputs equal: a computed value differs. Which ranks could hold the origin.
    def records(rank: int, site: str) -> bool:
        ta, tb = pairs[rank]
        return ta.has_site(site) and tb.has_site(site) and ta.row_index(s) is not None and tb.row_index(s) is not None

    candidates, rank, own_site = _origin(sites, world, records)
    if rank is not None:
        d = first.get(rank)
        site = own_site if own_site is not None else (d.site if d is not None else None)
    else:
        site = lead.site
    if level == "metrics":
        return Judgement("undetermined", f"production differs from two agreeing replays first at step {s} "
                         f"({_ranks(candidates)}), site {site}, but the trace is at level metrics: it records no "
                         "input of a step (batch, random streams, hyperparameters), so a data pipeline or restore "
                         "that does not reproduce production cannot be told from a fault. What would tell: trace "
                         "at level state (cv.Run.main(..., trace=\"state\")) and replay again",
                         step=s, rank=None, site=site, candidate_ranks=candidates)
    unregistered = sorted({u["name"] for n in notes.values() for u in (n or {}).get("unregistered") or []})
    missing_optim = any((n or {}).get("missing_optimizer") for n in notes.values())
    if first_replayed and production_start != start and (unregistered or missing_optim):
        what = (f"objects the TrainState does not hold: {', '.join(unregistered)}" if unregistered
                else "no optimizer is registered in the TrainState")
        return Judgement("unregistered-state", f"the replay differs from production at the first replayed step "
                         f"(rank {lead.rank}, {lead.site}) and the job holds state no checkpoint saves ({what}): the "
                         f"replay starts it afresh while production carried it on; {none_hw}. What to do: "
                         f"{causes.UNREGISTERED_ADVICE}",
                         step=s, rank=lead.rank, site=lead.site)

    prev_traced = s - 1 >= start + 1 and all(ta.row_index(s - 1) is not None and tb.row_index(s - 1) is not None
                                             for ta, tb in pairs.values())
    if not first_replayed and not prev_traced:
        return Judgement("undetermined", f"production differs from two agreeing replays first at step {s} "
                         f"({_ranks(candidates)}), site {site}, with the batch, random streams and hyperparameters "
                         f"of step {s} equal; but step {s - 1} is not traced, so the inputs of the untraced steps "
                         f"before it may already have differed. What would tell: trace every step (trace_every=1) "
                         "and replay again", step=s, site=site, candidate_ranks=candidates)
    if first_replayed and production_start != start:
        return Judgement("undetermined", f"production differs from two agreeing replays at the first replayed step "
                         f"{s} ({_ranks(candidates)}), site {site}, with the batch, random streams and "
                         "hyperparameters equal and the restore exact; but production ran on from memory past its "
                         f"checkpoint of step {start}, so state that no checkpoint holds (a global counter, a cache) "
                         "would look the same as a fault. What would tell: `ckptverify resume-check` on the job (a "
                         "resume-exact job rules that out), or a replay from an earlier checkpoint (--from)",
                         step=s, site=site, candidate_ranks=candidates)
    if rank is not None:
        # What the other ranks show, said only where there are others (on one rank there is nothing to add).
        agreed = ", ".join(str(r) for r in range(world) if r not in first)
        if world == 1:
            others = ""
        elif own_site is not None:
            others = (f"; its own value ({site}) differs while the other ranks' equal values are recorded, so the "
                      "differences they show arrived through a reduction"
                      + (f"; rank(s) {agreed} agreed with the replays" if agreed else ""))
        else:
            others = f"; the other ranks ({agreed}) computed the step exactly as the replays did"
        return Judgement("hardware-fault-suspected",
                         f"production differs from two agreeing replays first at step {s} on rank {rank} "
                         f"({where(rank)}), site {site}, with the step's inputs (batch, random streams, "
                         f"hyperparameters, the state it started from) equal{others}; suspect the hardware of that "
                         "rank",
                         step=s, rank=rank, site=site, candidate_ranks=candidates)
    return Judgement("hardware-fault-suspected",
                     f"production differs from two agreeing replays first at step {s}, site {site}, with the step's "
                     "inputs (batch, random streams, hyperparameters, the state it started from) equal; every "
                     f"difference shows on {'every rank' if len(candidates) == world else _ranks(candidates)} alike "
                     "(values after a reduction: averaged gradients, a reduced loss, the gradient norm), so the "
                     f"evidence cannot tell which rank computed it wrong: {_ranks(candidates)} could. What would "
                     "tell: record each rank's own loss (before any all-reduce) or trace at level module "
                     "(cv.Run.main(..., trace=\"module\")) so that each rank's forward is compared, and replay "
                     "again", step=s, site=site, candidate_ranks=candidates)


def _hparams(ta: Any, tb: Any, step: int, prefix: str, differing: list[str], restored: Mapping[str, Any] | None,
             first_replayed: bool) -> tuple[HparamDiff, ...]:
    """The hyperparameters (``<prefix><group>.<key>``) that differ at ``step``: ``field``, ``a`` (production's
    value, ``None`` when only its category cell is recorded), ``b`` (the replay's), and, for the step-start
    cells of the first replayed step, ``b_moved``: whether the replay changed it after the restore (the
    restored value is what production's checkpoint holds, so when the replay did not move it, production
    did after its save point: ``a_moved``)."""
    from ckptverify.trace.compare import _named_member

    out: list[HparamDiff] = []
    for name in differing:
        if not name.startswith(prefix):
            continue
        if name == prefix + "*":
            member, _ = _named_member(ta, tb, step, ta.site(name) if ta.has_site(name) else tb.site(name))
            if member is None:
                # Several differ, or they are not named: the replay's own cells against the restore still tell
                # whether it moved them.
                fields = [x.name for x in tb.sites if x.group == name] or [name]
                member = fields[0]
                if restored is not None and first_replayed:
                    moved = [f for f in fields if f in restored and tb.value(step, f) != restored[f]]
                    member = moved[0] if moved else member
        else:
            member = name
        a = ta.value(step, member) if ta.has_site(member) else None
        b = tb.value(step, member) if tb.has_site(member) else None
        b_moved = a_moved = None
        if restored is not None and first_replayed and member in restored:
            b_moved = b != restored[member]
            a_moved = not b_moved
        out.append(HparamDiff(member[len(prefix):], a, b, a_moved=a_moved, b_moved=b_moved))
    return tuple(out)


def _ranks(ranks: tuple[int, ...]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def _records_position(pair: tuple[Any, Any]) -> tuple[bool, ...]:
    return tuple(t.has_site("data") for t in pair)
