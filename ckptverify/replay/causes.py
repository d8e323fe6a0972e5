"""Why production differs from two agreeing replays: the cause of the first difference.

:func:`judge` takes the first step ``s`` where production and ``R1`` differ and applies :data:`RULES` in order, with
``resume-check``'s kinds and sentences (:mod:`ckptverify.resume.causes`): the step's inputs first (restore, random
streams, hyperparameters, data, buffers: none is evidence about hardware), then ``undetermined`` when the inputs are
not all known equal (level ``metrics``, untraced earlier steps, production ran on from memory past ``K``), else
``hardware-fault-suspected``; each a :class:`~ckptverify.resume.verdict.Verdict`. Trap: a rank is named only when
it alone differs, or alone differs where another rank records an equal value; differences every rank shares came
through a reduction, and ``candidate_ranks`` lists who could hold them."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from ckptverify.resume import causes
from ckptverify.resume.causes import REPLAY, first_verdict, ranks_text
from ckptverify.resume.compare import StepEvidence, restore_findings, step_evidence
from ckptverify.resume.run import rank_files
from ckptverify.resume.verdict import Verdict
from ckptverify.trace.compare import RankComparison, rank_comparisons, sites_at

__all__ = ["RULES", "judge", "twin_cause"]


def twin_cause(comparisons: list[RankComparison], step: int) -> str:
    """Where the two replays' nondeterminism at ``step`` (their first divergent step, in ``comparisons``) lies, and
    what to do."""
    sites = sorted({s for names in sites_at(comparisons, step).values() for s in names})
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
    """``(candidate ranks, rank singled out, its own differing site)`` at the first differing step, from each rank's
    differing sites; ``records(rank, site)``: both runs record it there."""
    differing = [r for r, names in found.items() if names]
    missing = sorted(set(range(world)) - set(found))
    if world == 1 and differing == [0]:
        return (0,), 0, None  # one rank: no reduction brings others' values in
    if len(differing) + len(missing) < world:
        # Ranks that agree are cleared; one without a store in both runs cannot be.
        candidates = tuple(sorted({*differing, *missing}))
        if len(candidates) == 1 and not missing:
            return candidates, candidates[0], None
        return candidates, None, None
    # Every rank differs: shared differences arrived through a reduction; an own one marks the origin.
    own: dict[int, str] = {}
    for r in differing:
        site = next((x for x in found[r]
                     if any(o != r and x not in found[o] and records(o, x) for o in found)), None)
        if site is not None:
            own[r] = site
    if len(own) == 1 and not missing:
        ((rank, site),) = own.items()
        return (rank,), rank, site
    # Ranks with an own difference narrow the candidates down, if any.
    return tuple(sorted({*(own or differing), *missing})), None, None


@dataclass
class _Case:
    """The evidence of a replay verdict: the first step ``s`` where production and ``R1`` differ, each rank's
    comparison (``first``: those diverging at ``s``) and restore notes; derived facts are computed once, when a rule
    first asks. ``ran_on``: production's process ran on from memory past the checkpoint the replay restored."""

    replay: str
    start: int
    world: int
    ran_on: bool
    where: Callable[[int], str]
    s: int
    comparisons: list[RankComparison]
    notes: dict[int, Any]

    @cached_property
    def first(self) -> dict[int, RankComparison]:
        return {c.rank: c for c in self.comparisons if c.first is not None and c.first.step == self.s}

    @cached_property
    def pairs(self) -> dict[int, tuple[Any, Any]]:
        return {c.rank: c.traces for c in self.comparisons if c.traces is not None}

    @cached_property
    def sites(self) -> dict[int, list[str]]:
        return sites_at(self.comparisons, self.s)

    @property
    def first_replayed(self) -> bool:
        return self.s == self.start + 1

    def at(self, rank: int) -> causes.At:
        """Step ``s`` on ``rank``, as the shared cause sentences name it."""
        return causes.At(REPLAY, self.s, self.start, rank)

    @property
    def lead(self) -> Any:
        return self.first[min(self.first)].first

    @cached_property
    def evidence(self) -> dict[int, StepEvidence]:
        """The step's inputs on every differing rank (one rank's input difference reaches the others)."""
        return {r: step_evidence(comp, first_resumed=self.first_replayed,
                                 restored=(self.notes.get(r) or {}).get("restored") or {})
                for r, comp in sorted(self.first.items())}

    @cached_property
    def origin(self) -> tuple[tuple[int, ...], int | None, str | None, str | None]:
        """``(candidates, rank, own site, site the verdict names)`` for a differing computed value."""
        def records(rank: int, site: str) -> bool:
            ta, tb = self.pairs[rank]
            return (ta.has_site(site) and tb.has_site(site) and ta.row_index(self.s) is not None
                    and tb.row_index(self.s) is not None)

        candidates, rank, own_site = _origin(self.sites, self.world, records)
        if rank is not None:
            d = self.first[rank].first if rank in self.first else None
            site = own_site if own_site is not None else (d.site if d is not None else None)
        else:
            site = self.lead.site
        return candidates, rank, own_site, site


def judge(prod: str, replay: str, *, start: int, end: int, world: int, production_start: int,
          where: Callable[[int], str] = lambda rank: "host unknown",
          comparisons: list[RankComparison] | None = None) -> Verdict:
    """Classify the first difference between production's segment ``prod`` and ``replay`` over ``start+1..end``: the
    first of :data:`RULES` that applies. ``production_start``: where production's segment (and process) started;
    ``where(rank)``: a rank's host and device in words; ``comparisons``: the two compared over those steps already
    (:func:`~ckptverify.trace.compare.rank_comparisons`)."""
    comps = comparisons if comparisons is not None else rank_comparisons(prod, replay, steps=range(start + 1, end + 1))
    found = [c.first for c in comps if c.first is not None]
    if not found:
        return Verdict("undetermined", "production's trace and the replay's do not cover the same steps and ranks, "
                       "and every step both cover agrees: the steps not compared cannot be judged. What would tell: a "
                       "production trace of every replayed step on every rank (trace_every=1).")
    case = _Case(replay=replay, start=start, world=world, ran_on=production_start != start, where=where,
                 s=min(d.step for d in found), comparisons=comps, notes=rank_files(replay, "notes"))
    return first_verdict(RULES, case)


_NONE_HW = "this says nothing about the hardware"

# ---------------------------------------------------------------------------- the step's inputs


def _restore(c: _Case) -> Verdict | None:
    """The replay's restore: its inputs are production's checkpoint only if it restored exactly that."""
    restore = restore_findings(c.replay)
    if not restore:
        return None
    f = restore[0]
    return Verdict("restore-mismatch", f"the replay's restored {f.location.fqn or 'state'} differs from what "
                   f"production's checkpoint of step {c.start} holds (rank {f.location.rank}; {len(restore)} "
                   f"field(s) in all), so the replay did not start from production's state: {_NONE_HW}.",
                   advice=f"{causes.RESTORE_ADVICE}, then replay again.",
                   step=c.s, rank=f.location.rank, site=f.location.fqn, findings=tuple(restore[:20]))


def _rng(c: _Case) -> Verdict | None:
    r, ev = _first_rank(c, lambda ev: bool(ev.rng))
    if ev is None:
        return None
    sentence, advice = causes.rng_cause(c.at(r), ev.rng)
    return Verdict("rng", f"{sentence}, and {_NONE_HW}.", advice=f"{advice}, then replay again.",
                   step=c.s, rank=r, site=ev.rng[0].name)


def _hparam_start(c: _Case) -> Verdict | None:
    r, ev = _first_rank(c, lambda ev: bool(ev.hparams_start))
    if ev is None:
        return None
    kind, text, advice, site = causes.hparam_start_cause(c.at(r), ev.hparams_start[0])
    return Verdict(kind, f"{text}; {_NONE_HW}.", advice=f"{advice}.", step=c.s, rank=r, site=site)


_LR_SITES = ("optim.param_groups", "metric.lr", "scheduler")


def _step_hparams(c: _Case) -> Verdict | None:
    unsaved = sorted({u for n in c.notes.values() for u in (n or {}).get("unsaved_schedulers") or []})
    r, ev = _first_rank(c, lambda ev: bool(ev.hparams_step) or bool(
        unsaved and any(x.startswith(_LR_SITES) for x in ev.sites)))
    if ev is None:
        return None
    if ev.hparams_step:
        what, site = causes.step_hparam_what(c.at(r), ev.hparams_step)
    else:
        what = f"the learning rate differs at {c.at(r).when}"
        site = next(x for x in ev.sites if x.startswith(_LR_SITES))
    cause, advice = causes.step_hparam_cause(unsaved)
    return Verdict("scheduler", f"{what} on rank {r}: {cause}; {_NONE_HW}.", advice=f"{advice}, then replay again.",
                   step=c.s, rank=r, site=site)


def _data(c: _Case) -> Verdict | None:
    r, ev = _first_rank(c, lambda ev: ev.batch or ev.position)
    if ev is None:
        return None
    s = c.s
    batch_site = next((x for x in ev.sites if x == "batch" or x.startswith("batch.")), "data")
    if ev.batch and not ev.position and all(t.has_site("data") for t in c.pairs[r]):
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
    return Verdict("data", f"{cause}; {_NONE_HW}.", advice=f"{advice}, then replay again.",
                   step=s, rank=r, site=batch_site)


def _buffer(c: _Case) -> Verdict | None:
    r, ev = _first_rank(c, lambda ev: bool(ev.buffers))
    if ev is None:
        return None
    text, advice = causes.buffer_cause(c.at(r), ev.buffers[0])
    return Verdict("hidden-state", f"{text}; {_NONE_HW}.", advice=f"{advice}.", step=c.s, rank=r,
                   site=ev.buffers[0])


def _first_rank(c: _Case, differs: Callable[[StepEvidence], bool]) -> tuple[int, StepEvidence | None]:
    """The lowest differing rank whose step inputs ``differ`` in what a rule is about, and its evidence."""
    return next(((r, ev) for r, ev in c.evidence.items() if differs(ev)), (-1, None))


# ---------------------------------------------------------------------------- inputs equal: a computed value


def _undetermined(c: _Case, at: str, why: str) -> Verdict:
    """``undetermined`` for a computed value that differs at step ``s`` (``at``: how the sentence leads to it):
    ``why`` its inputs are not all known equal, and what would tell."""
    candidates, _, _, site = c.origin
    return Verdict("undetermined", f"production differs from two agreeing replays {at} {c.s} "
                   f"({ranks_text(candidates)}), site {site}, {why}", step=c.s, site=site, candidate_ranks=candidates)


def _metrics_level(c: _Case) -> Verdict | None:
    if c.pairs and next(iter(c.pairs.values()))[0].header.level != "metrics":
        return None
    return _undetermined(c, "first at step", "but the trace is at level metrics: it records no input of a step "
                         "(batch, random streams, hyperparameters), so a data pipeline or restore that does not "
                         "reproduce production cannot be told from a fault. What would tell: trace at level state "
                         "(cv.Run.main(..., trace=\"state\")) and replay again.")


def _unregistered(c: _Case) -> Verdict | None:
    unregistered = sorted({u["name"] for n in c.notes.values() for u in (n or {}).get("unregistered") or []})
    missing_optim = any((n or {}).get("missing_optimizer") for n in c.notes.values())
    if not (c.first_replayed and c.ran_on and (unregistered or missing_optim)):
        return None
    what = (f"objects the TrainState does not hold: {', '.join(unregistered)}" if unregistered
            else "no optimizer is registered in the TrainState")
    lead = c.lead
    return Verdict("unregistered-state", f"the replay differs from production at the first replayed step "
                   f"(rank {lead.rank}, {lead.site}) and the job holds state no checkpoint saves ({what}): the "
                   f"replay starts it afresh while production carried it on; {_NONE_HW}.",
                   advice=f"{causes.UNREGISTERED_ADVICE}.", step=c.s, rank=lead.rank, site=lead.site)


def _untraced_before(c: _Case) -> Verdict | None:
    s = c.s
    # Past the first replayed step, the step before it must be traced on every rank in both runs.
    if c.first_replayed or all(ta.row_index(s - 1) is not None and tb.row_index(s - 1) is not None
                               for ta, tb in c.pairs.values()):
        return None
    return _undetermined(c, "first at step", f"with the batch, random streams and hyperparameters of step {s} "
                         f"equal; but step {s - 1} is not traced, so the inputs of the untraced steps before it may "
                         "already have differed. What would tell: trace every step (trace_every=1) and replay "
                         "again.")


def _ran_on_from_memory(c: _Case) -> Verdict | None:
    if not (c.first_replayed and c.ran_on):
        return None
    return _undetermined(c, "at the first replayed step", "with the batch, random streams and hyperparameters "
                         "equal and the restore exact; but production ran on from memory past its checkpoint of "
                         f"step {c.start}, so state that no checkpoint holds (a global counter, a cache) would look "
                         "the same as a fault. What would tell: `ckptverify resume-check` on the job (a "
                         "resume-exact job rules that out), or a replay from an earlier checkpoint (--from).")


def _one_rank(c: _Case) -> Verdict | None:
    candidates, rank, own_site, site = c.origin
    if rank is None:
        return None
    agreed = ", ".join(str(r) for r in range(c.world) if r not in c.first)
    if c.world == 1:
        others = ""
    elif own_site is not None:
        others = (f"; its own value ({site}) differs while the other ranks' equal values are recorded, so the "
                  "differences they show arrived through a reduction"
                  + (f"; rank(s) {agreed} agreed with the replays" if agreed else ""))
    else:
        others = f"; the other ranks ({agreed}) computed the step exactly as the replays did"
    return Verdict("hardware-fault-suspected",
                   f"production differs from two agreeing replays first at step {c.s} on rank {rank} "
                   f"({c.where(rank)}), site {site}, with the step's inputs (batch, random streams, "
                   f"hyperparameters, the state it started from) equal{others}; suspect the hardware of that "
                   "rank.",
                   step=c.s, rank=rank, site=site, candidate_ranks=candidates)


def _every_rank(c: _Case) -> Verdict:
    candidates, _, _, site = c.origin
    return Verdict("hardware-fault-suspected",
                   f"production differs from two agreeing replays first at step {c.s}, site {site}, with the "
                   "step's inputs (batch, random streams, hyperparameters, the state it started from) equal; "
                   f"every difference shows on {'every rank' if len(candidates) == c.world else ranks_text(candidates)}"
                   " alike (values after a reduction: averaged gradients, a reduced loss, the gradient norm), so "
                   f"the evidence cannot tell which rank computed it wrong: {ranks_text(candidates)} could. What "
                   "would tell: record each rank's own loss (before any all-reduce) or trace at level module "
                   "(cv.Run.main(..., trace=\"module\")) so that each rank's forward is compared, and replay "
                   "again.", step=c.s, site=site, candidate_ranks=candidates)


RULES: tuple[Callable[[_Case], Verdict | None], ...] = (
    _restore, _rng, _hparam_start, _step_hparams, _data, _buffer,
    _metrics_level, _unregistered, _untraced_before, _ran_on_from_memory, _one_rank, _every_rank)
