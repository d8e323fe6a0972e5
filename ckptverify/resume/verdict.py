"""From comparisons to a verdict in plain words (verdict kinds: ``docs/resume.md``).

The harness compares (a) B's restored state with A's saved one, (b) A with A2, (c) A with B after the resume, (d) the
final states (and held values); the verdict is the first conclusive rule of :data:`RULES` in that order. Trap: within
(c), :data:`PARTED` judges the causes a step starts from (random streams, hyperparameters) before what they change: a
batch drawn from a moved random stream is a consequence, not the cause. Rules are small functions taken in order by
the engine ``replay`` shares (:func:`~ckptverify.resume.causes.first_verdict`)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from functools import cached_property
from typing import TYPE_CHECKING, Any

from ckptverify.findings import Finding, Location, error, info
from ckptverify.resume import causes
from ckptverify.resume.causes import RESUME
from ckptverify.resume.compare import Evidence, StepEvidence
from ckptverify.resume.locate.walk import receiver_entries, walk_fields

if TYPE_CHECKING:
    from ckptverify.resume.locate.walk import Walked
    from ckptverify.trace.compare import FirstDivergence


#: Kinds that pass: resume-check's, replay's and compare's (every other kind is an error).
PASSING = ("pass", "reproduced", "no-effect", "within-variation")


@dataclass(frozen=True)
class Verdict:
    """What ``resume-check``, ``replay`` and ``compare`` conclude: ``kind``, the ``message`` (cause), ``advice``
    (what to do, ``""`` when the message says it), where, and the walk (``located``) when one ran."""

    kind: str
    message: str
    step: int | None = None
    rank: int | None = None
    site: str | None = None
    category: str | None = None
    #: Module where the first divergence originates; ``origin_module`` in JSON.
    origin: str | None = None
    advice: str = ""
    located: Walked | None = None
    #: Ranks that only received the difference (the walk's receivers replace them in ``to_dict``).
    receivers: tuple[Mapping[str, Any], ...] = ()
    #: Ranks that could hold the origin of a computed difference no rank is singled out for (``replay``).
    candidate_ranks: tuple[int, ...] | None = None
    #: Evidence behind the verdict, for the report (not in ``to_dict``).
    findings: tuple[Finding, ...] = ()

    @property
    def passed(self) -> bool:
        return self.kind in PASSING

    def to_dict(self) -> dict[str, Any]:
        """The verdict's fields (``origin`` as ``origin_module``) plus the walk's ``origin``, ``receivers`` and
        ``locate`` (:func:`~ckptverify.resume.locate.walk.walk_fields`; ``None`` when it did not run)."""
        return {"kind": self.kind, "message": self.message, "step": self.step, "rank": self.rank,
                "site": self.site, "category": self.category, "origin_module": self.origin,
                "advice": self.advice,
                "candidate_ranks": list(self.candidate_ranks) if self.candidate_ranks is not None else None,
                **walk_fields(self.located, self.receivers)}

    def _said(self) -> str:
        located = f" {self.located.sentence}" if self.located is not None and self.located.sentence else ""
        return self.message + located + (f" What to do: {self.advice}" if self.advice else "")

    def headline(self) -> str:
        """One line: kind, step, rank, category, site, cause, where the walk found it born, what to do."""
        where = [f"step {self.step}" if self.step is not None else None,
                 f"rank {self.rank}" if self.rank is not None else None,
                 self.category, self.site]
        head = " · ".join(w for w in where if w)
        return f"verdict: {self.kind}" + (f" ({head})" if head else "") + f" — {self._said()}"

    def finding(self, check: str) -> Finding:
        """The verdict as the report's finding ``check``: info when it passes, else an error."""
        make = info if self.passed else error
        return make(check, self._said(), location=Location(rank=self.rank, fqn=self.site), actual=self.to_dict())


def origin_rank(div: FirstDivergence) -> int | None:
    """The one rank the traces single out as where ``div`` is born; ``None`` when several are origins or all differ
    only in values a collective wrote."""
    if div.origin_ranks is None:  # one rank's own divergence: not judged across ranks
        return div.rank
    return div.origin_ranks[0] if len(div.origin_ranks) == 1 else None


def ranks_said(div: FirstDivergence) -> str:
    """Where ``div`` is born, for a sentence (``rank 1``, ``ranks 0, 1 (each on its own)``, or that it cannot be
    told)."""
    one = origin_rank(div)
    if one is not None:
        return f"rank {one}"
    origins = div.origin_ranks or ()
    if len(origins) > 1:
        return f"ranks {', '.join(map(str, origins))} (each on its own)"
    return f"rank {div.rank} and others (which rank it is born on cannot be told)"


def receivers_said(div: FirstDivergence) -> str:
    """A sentence naming the ranks that differ only through a collective (``""`` when none)."""
    receivers = div.receiver_ranks or ()
    origins = div.origin_ranks or ()
    if not receivers or not origins:
        return ""
    many = len(receivers) > 1
    return (f" Rank{'s' if many else ''} {', '.join(map(str, receivers))} differ{'' if many else 's'} only in values "
            f"a collective carried from {causes.ranks_text(origins)} (gradients, parameters, optimizer state, "
            f"metrics computed after the reduction): {'receivers' if many else 'a receiver'}, not where it is born.")


def _undetermined(div: FirstDivergence) -> str:
    """What would tell the rank when the traces cannot (all differ only downstream of a collective)."""
    if div.origin_ranks != ():
        return ""
    return (" Every differing rank differs only in values a collective wrote, so the rank it is born on cannot be "
            "told from this trace; --level module records each rank's own activations and input gradients, which "
            "tell.")


def _site(div: FirstDivergence) -> str:
    """The site a verdict names: on several ranks the origin's first own difference (its loss, not a post-reduction
    gradient norm that comes first in the row), else the first differing site."""
    several = bool(div.receiver_ranks) or len(div.origin_ranks or ()) > 1
    return div.own_site if div.own_site and several else div.site


def _where(div: FirstDivergence) -> str:
    parts = [f"step {div.step}", ranks_said(div), f"first at {_site(div)}"]
    if div.origin:
        parts.append(f"originating in module {div.origin}" + (
            f" (its own forward changed the input of {div.origin_fed})" if div.origin_fed else ""))
    return ", ".join(parts)


def _forgotten(unregistered: tuple[Mapping[str, str], ...], missing_optimizer: str | None = None) -> str:
    parts = ", ".join(f"{u['name']} ({u['type']})" for u in unregistered)
    return (" No optimizer is registered in the TrainState." if missing_optimizer else "") + (
        f" Not in the TrainState: {parts}." if parts else "")


@dataclass
class _Case:
    """What :func:`decide` judges: ``plan`` and the ``evidence`` of its comparisons."""

    plan: Any
    evidence: Evidence

    @cached_property
    def forgotten(self) -> str:
        return _forgotten(self.evidence.unregistered, self.evidence.missing_optimizer)


def decide(plan: Any, evidence: Evidence) -> Verdict:
    """The verdict for ``plan``'s ``evidence``: the first of :data:`RULES` that applies."""
    return causes.first_verdict(RULES, _Case(plan, evidence))


def _restore(c: _Case) -> Verdict | None:
    restore = c.evidence.restore
    if not restore:
        return None
    f = restore[0]
    ranks = sorted({x.location.rank for x in restore if x.location.rank is not None})
    on = f" ({causes.ranks_text(ranks)}{', each on its own' if len(ranks) > 1 else ''})" if ranks else ""
    return Verdict("restore-mismatch", f"resume drops state: restored {f.location.fqn or 'state'} differs from "
                   f"what was saved{on}; {len(restore)} field(s) in all.{c.forgotten}",
                   rank=ranks[0] if len(ranks) == 1 else None, site=f.location.fqn, category="restore",
                   advice=causes.RESTORE_ADVICE + ".")


def _nondeterministic(c: _Case) -> Verdict | None:
    nd = c.evidence.nondeterminism
    if nd is None:
        return None
    return Verdict("nondeterministic", f"two continuous runs (A and A2) differ at {_where(nd)}: the "
                   f"computation is not deterministic, so no resume can be exact.{receivers_said(nd)}"
                   f"{_undetermined(nd)}",
                   step=nd.step, rank=origin_rank(nd), site=_site(nd), category=nd.category, origin=nd.origin,
                   advice="fix the thread count, seeds and nondeterministic kernels "
                   "(torch.use_deterministic_algorithms) until A and A2 agree.", receivers=receiver_entries(nd))


def _resumed(c: _Case) -> Verdict | None:
    """A and B part after the resume: the first of :data:`PARTED` that applies, with the receiving ranks."""
    div = c.evidence.resume
    if div is None:
        return None
    parted = _Parted(c.plan, c.evidence, div, c.evidence.step or StepEvidence())
    return replace(causes.first_verdict(PARTED, parted), receivers=receiver_entries(div))


def _final(c: _Case) -> Verdict | None:
    final = c.evidence.final
    if not final:
        return None
    f = final[0]
    return Verdict("diverged", f"the traced steps agree, but the final checkpoints differ ({len(final)} "
                   f"item(s), first {f.location.fqn or f.message}).{c.forgotten}", site=f.location.fqn,
                   category="final", advice="trace at a higher --level to see the step where they part.")


def _passed(c: _Case) -> Verdict:
    plan, evidence, forgotten = c.plan, c.evidence, c.forgotten
    runs = "B equals A" if "B" in plan.runs else "A ran"
    message = (f"resume-equivalent: {runs} bitwise for steps {plan.resume_at + 1}..{plan.steps}"
               + (", and two continuous runs agree" if "A2" in plan.runs else "")
               + f" ({plan.nproc} rank(s), level {plan.level}).")
    if forgotten:
        return Verdict("pass", message + " But a real resume would lose state that no traced value shows:"
                       + forgotten, advice="register those objects in the TrainState (extras= for your own).")
    if evidence.replaced:
        r = evidence.replaced[0]
        return Verdict("pass", message + f" But {r['name']} ({r['type']}) was rebuilt after run.restore() (run "
                       f"{r['run']}, rank {r['rank']}): checkpoints save the {r['field']} registered in the "
                       "TrainState, which the loop no longer uses.",
                       advice=f"build {r['name']} before run.restore(state) and do not rebuild it after.")
    return Verdict("pass", message)


@dataclass
class _Parted(_Case):
    """Where A and B first part after the resume (``div``) and what the step started from (``ev``), for the rules of
    :data:`PARTED`; ``said`` adds receivers and unregistered objects to a message."""

    div: FirstDivergence
    ev: StepEvidence

    @property
    def site(self) -> str:
        return _site(self.div)

    @property
    def common(self) -> dict[str, Any]:
        return dict(step=self.div.step, rank=origin_rank(self.div), site=self.site, category=self.div.category,
                    origin=self.div.origin)

    @property
    def said(self) -> str:
        return receivers_said(self.div) + _undetermined(self.div) + self.forgotten

    @property
    def at(self) -> causes.At:
        """The step, as the shared cause sentences name it."""
        return causes.At(RESUME, self.div.step, self.plan.resume_at, ranks_said(self.div))

    @property
    def sites(self) -> set[str]:
        return set(self.evidence.resume_sites) | {self.site}


def _pending(c: _Parted) -> Verdict | None:
    """A saved mid gradient accumulation: B starts that optimizer step from zero gradients."""
    plan, div, forgotten, step, when = c.plan, c.div, c.forgotten, c.div.step, c.at.when
    pending = c.evidence.pending_gradients
    if not pending:
        return None
    p = pending[0]
    ranks = sorted({x["rank"] for x in pending})
    on = causes.ranks_text(ranks)
    names = ", ".join(p.get("names") or []) + (", ..." if p.get("count", 0) > len(p.get("names") or []) else "")
    return Verdict("accumulated-gradients",
                   f"the checkpoint of step {plan.resume_at} was saved in the middle of gradient accumulation: "
                   f"{p.get('count')} parameter(s) held accumulated gradients ({names}; {on}), which a checkpoint "
                   f"does not save, so B's optimizer step starts from zero gradients while A's carries the "
                   f"accumulated ones; the runs part at {when} (step {step}, first at {_site(div)}) as a "
                   f"consequence.{forgotten}",
                   step=step, rank=ranks[0] if len(ranks) == 1 else None, site="grad", category="gradients",
                   origin=div.origin,
                   advice="save at optimizer-step boundaries: take each optimizer step's micro-batches as one "
                   "step (for batches in run.steps(loader, micro_batches=K)), so run.record() and its save come "
                   "after optimizer.step() and zero_grad(); or keep the gradients in the state "
                   "(TrainState(extras=...)).")


_REBUILT = {"scheduler": "its schedule starts afresh in B while A's carries on from the saved one",
            "optimizer": "its moments and step counts start from zero in B while A's carry on",
            "dataloader": "it reads from the start of the data in B while A's position carries on",
            "model": "its parameters are not the restored ones in B"}


def _replaced(c: _Parted) -> Verdict | None:
    """A registered object was rebuilt after ``run.restore``: named as the cause, whatever value shows it first."""
    evidence, div, forgotten, step = c.evidence, c.div, c.forgotten, c.div.step
    if not evidence.replaced:
        return None
    origins = div.origin_ranks or ()
    r = min(evidence.replaced, key=lambda r: (r["run"] != "B", bool(origins) and r["rank"] not in origins, r["rank"]))
    ranks = sorted({x["rank"] for x in evidence.replaced if x["name"] == r["name"] and x["run"] == r["run"]})
    on = causes.ranks_text(ranks)
    field = r["field"]
    effect = _REBUILT.get(field, "B trains with state that was not restored")
    message = (f"the {r['type']} the loop uses is not the one in the TrainState: {r['name']} was rebuilt after "
               f"run.restore() in run {r['run']} ({on}), so {effect}; the runs part at {c.at.when} ({_where(div)}) "
               f"as a consequence.{receivers_said(div)}{forgotten}")
    return Verdict("changed-after-restore", message, step=step, rank=ranks[0] if len(ranks) == 1 else None,
                   site=r["name"], category=field if field in _REBUILT else "extras", origin=div.origin,
                   advice=f"build {r['name']} before run.restore(state) and do not rebuild it after; to change it "
                   "on resume, change the registered object itself.")


def _rng(c: _Parted) -> Verdict | None:
    """Random streams at the start of the step: the cause of whatever they feed."""
    rngs = c.ev.rng
    if not rngs:
        return None
    sentence, advice = causes.rng_cause(c.at, rngs)
    later = "" if c.site.startswith("start.") else f" What differs after it (first {c.site}) is a consequence."
    return Verdict("rng", f"{sentence}.{later}{c.said}", advice=advice + ".",
                   **{**c.common, "site": rngs[0].name, "category": "rng"})


def _hparam_start(c: _Parted) -> Verdict | None:
    """Hyperparameters at the start of the step."""
    hstart = c.ev.hparams_start
    if not hstart:
        return None
    kind, text, advice, site = causes.hparam_start_cause(c.at, hstart[0])
    return Verdict(kind, f"{text} (fields: {', '.join(x.name for x in hstart)}).{c.said}", advice=advice + ".",
                   **{**c.common, "site": site, "category": "hyperparameters"})


def _step_hparams(c: _Parted) -> Verdict | None:
    """Hyperparameters as the optimizer step used them (set during the step, e.g. from a counter)."""
    unsaved = list(c.evidence.unsaved_schedulers)
    hstep, sites = c.ev.hparams_step, c.sites
    lr_moved = any(s.startswith(("optim.param_groups", "metric.lr")) for s in sites)
    if not (hstep or c.div.category == "scheduler" or any(s.startswith("scheduler") for s in sites)
            or (unsaved and lr_moved)):
        return None
    what, site = causes.step_hparam_what(c.at, hstep) if hstep else \
        (f"the learning rate differs at {c.at.when} ({_where(c.div)})", c.site)
    cause, advice = causes.step_hparam_cause(unsaved)
    return Verdict("scheduler", f"{what}: {cause}. A batch or value that differs in the same step is a "
                   f"consequence.{c.said}", advice=advice + ".", **{**c.common, "site": site, "category": "scheduler"})


def _data(c: _Parted) -> Verdict | None:
    """The batch."""
    sites = c.sites
    if not (c.ev.batch or c.div.category == "data" or "data.indices" in sites
            or any(s.startswith("batch") for s in sites)):
        return None
    message, advice = _data_cause(c)
    return Verdict("data", f"the batch of step {c.div.step} differs ({_where(c.div)}) while the random streams and "
                   f"hyperparameters it started from are equal: {message}{c.said}", advice=advice, **c.common)


def _buffer(c: _Parted) -> Verdict | None:
    """Non-persistent buffers: state a checkpoint never holds."""
    buffers = c.ev.buffers
    if not buffers:
        return None
    text, advice = causes.buffer_cause(c.at, buffers[0])
    return Verdict("hidden-state", f"{text}.{c.said}", advice=advice + ".",
                   **{**c.common, "site": buffers[0], "category": "buffers"})


#: Computed categories: a difference there no cause above explains is state the TrainState does not hold.
_COMPUTED = ("metric", "parameters", "gradients", "optimizer", "module", "buffers")


def _unregistered(c: _Parted) -> Verdict | None:
    evidence, div = c.evidence, c.div
    if c.div.category not in _COMPUTED or not (evidence.missing_optimizer or evidence.unregistered):
        return None
    items = evidence.unregistered
    named = next((u for u in items if u["kind"] == "optimizer"), items[0] if items else None)
    lead = ("no optimizer is registered in the TrainState, so B starts its moments from zero"
            if evidence.missing_optimizer else "state the TrainState does not hold drives the run")
    listed = _forgotten(items) + receivers_said(div) + _undetermined(div)
    return Verdict("unregistered-state", f"the runs part at {c.at.when} ({_where(div)}): {lead}.{listed}",
                   advice=causes.UNREGISTERED_ADVICE + ".",
                   **{**c.common, "site": named["name"] if named else "optimizer"})


def _hidden(c: _Parted) -> Verdict | None:
    div = c.div
    if c.div.category not in _COMPUTED:
        return None
    origin, fed = div.origin, div.origin_fed
    if origin and fed:
        advice = (f"look at what {origin}.forward computes before it calls {fed}: the state it reads (a global "
                  "counter, a cache) is not saved; keep it in the model as a persistent buffer or save it "
                  "with TrainState(extras=...).")
    elif origin:
        advice = (f"look at the state module {origin} reads besides its inputs and parameters, and save it "
                  "(a persistent buffer, or TrainState(extras=...)).")
    else:
        advice = ("find the value the first differing site reads and save it (TrainState(extras=...)); "
                  "trace with --level module to name the module.")
    return Verdict("hidden-state", f"the runs part at {c.at.when} ({_where(div)}) although every saved field was "
                   "restored exactly: state outside the TrainState (a global counter, a cache, an "
                   f"unregistered generator) drives the computation.{receivers_said(div)}{_undetermined(div)}",
                   advice=advice, **c.common)


def _diverged(c: _Parted) -> Verdict:
    return Verdict("diverged", f"resumed run diverges at {_where(c.div)}.{c.said}", **c.common)


#: In order: rebuilt or half-accumulated state (the cause whatever shows first), then what a step starts
#: from before what it changes, then what it computes.
PARTED: tuple[Callable[[_Parted], Verdict | None], ...] = (
    _pending, _replaced, _rng, _hparam_start, _step_hparams, _data, _buffer, _unregistered, _hidden, _diverged)


def _held(c: _Case) -> Verdict | None:
    """Steps and final checkpoints agree, but A and B end holding different values outside the TrainState: state a
    resume loses, or (A and A2 differ too) a nondeterministic computation."""
    plan, held = c.plan, c.evidence.held
    differ = held.differ if held is not None else ()
    if held is None or not differ:
        return None
    nd = set(held.nondeterministic)
    lost = [d for d in differ if d["var"] not in nd]
    T = plan.steps
    if not lost:
        d = differ[0]
        return Verdict("nondeterministic", f"every traced step agrees, but two continuous runs (A and A2) end "
                       f"holding different {', '.join(sorted(nd))} (first at {d['path']}, rank {d['rank']}): "
                       "its computation is not deterministic, so whether a resume keeps it cannot be told.",
                       step=T, rank=d["rank"], site=d["path"], category="held-state",
                       advice="make its computation deterministic (seeds, thread count, "
                       "torch.use_deterministic_algorithms) until A and A2 agree, then check again.")
    d = lost[0]
    names = list(dict.fromkeys(x["var"] for x in lost))
    if held.a2:
        sure = " A and A2 hold equal values there, so it is not nondeterminism."
    else:
        sure = " (A2 was not compared: a nondeterministic computation of it is not ruled out; run A2 to tell.)"
    also = f" Also nondeterministic: {', '.join(sorted(nd))}." if nd else ""
    return Verdict("unregistered-state", f"every traced step and the final checkpoints agree, but at the end of "
                   f"the run (step {T}) the training function holds {', '.join(names)} with different values in A "
                   f"and in B (first at {d['path']}, rank {d['rank']}): state the job updates outside the "
                   f"TrainState, which a resume loses.{sure}{also}", step=T, rank=d["rank"], site=d["path"],
                   category="held-state",
                   advice=f"register {d['var']} in the TrainState (extras={{'{d['var']}': ...}}: a module such as "
                   "an AveragedModel as it is, a dict of tensors in an object with state_dict()/load_state_dict()), "
                   "or rebuild it from saved state after run.restore().")


RULES: tuple[Callable[[_Case], Verdict | None], ...] = (
    _restore, _nondeterministic, _resumed, _final, _held, _passed)


def _data_cause(c: _Parted) -> tuple[str, str]:
    """Why a batch differs and what to do, from ``data.indices`` in A and B: other samples (loader unregistered or
    position not restored), a batch taken before the save, or the same samples with other contents."""
    evidence, step = c.evidence, c.div.step
    a, b, a_next = c.ev.indices.a, c.ev.indices.b, c.ev.indices.a_next
    loaders = [u for u in evidence.unregistered if u.get("kind") in ("data loader", "sampler")]
    named = ", ".join(f"{u['name']} ({u['type']})" for u in loaders)
    register = causes.REGISTER_LOADER
    if a is None or b is None:
        if loaders:
            return (f"{named} is not registered in the TrainState, so its position is not saved (whether the "
                    "step drew other samples is not recorded).", f"{register}.")
        loader = evidence.loader or {}
        if loader.get("type") == "StatefulDataLoader" or loader.get("iterable"):
            dataset = ("its IterableDataset's own state_dict in each worker" if loader.get("iterable")
                       else "the state of its sampler and dataset")
            return (f"the registered {loader.get('type')} holds the position ({dataset}), but no sample indices "
                    "are recorded for it, so other samples cannot be told from the same samples with other "
                    "contents. The usual causes: the loop reads batches from an iterator of the loader made before "
                    "run.restore() or from another loader, or the dataset's state_dict leaves out part of its "
                    "position (a shuffle buffer, a random offset).",
                    "iterate the registered loader with run.steps(loader) (run.steps(loader, micro_batches=K) for "
                    "gradient accumulation), make no iterator of it before run.restore(state), and give the "
                    "dataset a state_dict()/load_state_dict() that holds its whole position.")
        return ("whether B drew the same samples as A cannot be told: the sample indices of the step's batch are "
                "not recorded (they are for a loader driven by a ResumableSampler, iterated through "
                "run.steps(loader) or sampler.track(loader), at --level state or module).",
                "drive the loader with ckptverify.state.sampler.ResumableSampler and run the check again: it "
                "then tells a data position that was not restored from randomness inside the dataset.")
    if a != b:
        if c.at.first and a_next is not None and b == a_next:
            return (f"B's first batch holds the samples A trained on at step {step + 1}: A took a batch from the "
                    f"loader before its save point (after step {c.plan.resume_at}), so the saved position counts it as "
                    "consumed and the resumed run skips it.",
                    "take each step's batch inside the step (for batch in run.steps(loader)), not ahead of "
                    "run.record(), which saves.")
        if loaders:
            return (f"the step drew other samples in B than in A (data.indices differ): {named} is not "
                    "registered in the TrainState, so its position is not saved.", f"{register}.")
        return ("the step drew other samples in B than in A (data.indices differ) although the loader is "
                "registered: its position was not restored into the loader the loop iterates.",
                "iterate the loader registered in the TrainState, and do not rebuild it, reset its sampler or "
                "call set_epoch with another epoch after run.restore(state).")
    return ("the same sample indices were drawn in A and B (data.indices equal), yet the batch contents "
            "differ: randomness (or other state) inside the Dataset or its DataLoader workers, such as "
            "augmentation, is not reproduced.",
            "draw augmentation noise from torch's, random's or numpy's global generators inside __getitem__ "
            "(a registered loader with a ResumableSampler re-seeds them in its workers for each batch), or from "
            "a generator made from torch.initial_seed() there; not from os.urandom, the clock, or a generator "
            "created once per worker. With reseed_workers=False on the sampler, workers keep torch's own seeding, "
            "which a resume does not reproduce.")
