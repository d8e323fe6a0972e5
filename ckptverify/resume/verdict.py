"""From comparisons to a verdict in plain words.

The harness compares (a) the state B restored with the state A saved, (b) A with A2, (c) A with B after the
resume, (d) the final states. The verdict takes the first conclusive comparison in that order:

| kind | when |
|---|---|
| ``restore-mismatch`` | (a) some restored field differs from the saved one: the loader dropped or changed state |
| ``nondeterministic`` | (b) two continuous runs differ: saving more state cannot make a resume exact |
| ``data`` | (c) first divergence is the batch: the data position was not restored (hidden data state) |
| ``rng`` | (c) first divergence is a random stream: an RNG was not restored |
| ``scheduler`` | (c) the learning rate parts while an LR scheduler drives an optimizer but is not saved |
| ``hidden-state`` | (c) the first divergence is in a value no saved field explains (e.g. a global counter) |
| ``diverged`` | (c)/(d) the runs part in a category not covered above |
| ``pass`` | none of the above: B equals A bitwise for steps K+1..T, A equals A2, final states equal |
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from ckptverify.findings import Finding, Location, Severity


@dataclass(frozen=True)
class Verdict:
    kind: str
    message: str
    step: int | None = None
    rank: int | None = None
    site: str | None = None
    category: str | None = None
    origin: str | None = None

    @property
    def passed(self) -> bool:
        return self.kind == "pass"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def finding(self) -> Finding:
        return Finding(
            check="resume-verdict",
            severity=Severity.INFO if self.passed else Severity.ERROR,
            message=self.message,
            location=Location(rank=self.rank, fqn=self.site),
            actual=self.to_dict(),
        )


def _get(div: Any, name: str) -> Any:
    return getattr(div, name, None) if div is not None else None


def _where(div: Any) -> str:
    parts = [f"step {_get(div, 'step')}"]
    if _get(div, "rank") is not None:
        parts.append(f"rank {_get(div, 'rank')}")
    site = _get(div, "site")
    if site:
        parts.append(f"first at {site}")
    origin = _get(div, "origin")
    if origin:
        parts.append(f"originating in module {origin}")
    return ", ".join(parts)


def decide(plan: Any, analysis: dict[str, Any]) -> Verdict:
    """The verdict for the harness's ``analysis`` (see the module docstring for the order of rules)."""
    restore: list[Finding] = analysis.get("restore") or []
    if restore:
        f = restore[0]
        return Verdict("restore-mismatch", f"resume drops state: restored {f.location.fqn or 'state'} differs from "
                       f"what was saved (rank {f.location.rank}); {len(restore)} field(s) in all",
                       rank=f.location.rank, site=f.location.fqn, category="restore")
    nd = analysis.get("nondeterminism")
    if nd is not None:
        return Verdict("nondeterministic", f"nondeterministic: two continuous runs differ at {_where(nd)}; a resume "
                       "cannot be exact until the computation is deterministic",
                       step=_get(nd, "step"), rank=_get(nd, "rank"), site=_get(nd, "site"),
                       category=_get(nd, "category"), origin=_get(nd, "origin"))
    div = analysis.get("resume")
    if div is not None:
        category = _get(div, "category")
        site = _get(div, "site") or ""
        common = dict(step=_get(div, "step"), rank=_get(div, "rank"), site=site, category=category,
                      origin=_get(div, "origin"))
        first_resumed = _get(div, "step") == plan.resume_at + 1
        when = "the first resumed step" if first_resumed else f"step {_get(div, 'step')}"
        # Every site that differs at that step, not only the first: causes (batch, random streams, learning
        # rate) are recorded after the values they changed within a step's row.
        sites = set(analysis.get("resume_sites") or ()) | {site}
        if category == "data" or any(s.startswith("batch") for s in sites):
            return Verdict("data", f"hidden state: the batch of {when} differs ({_where(div)}): the data loader's "
                           "position was not saved or not restored", **common)
        rngs = sorted(s for s in sites if s.startswith("rng."))
        if category == "rng" or rngs:
            return Verdict("rng", f"resume drops state: random stream {', '.join(rngs) or site} differs at {when} "
                           f"({_where(div)}): an RNG was not restored, or was re-seeded after loading", **common)
        unsaved = analysis.get("unsaved_schedulers") or []
        lr_moved = any(s.startswith(("optim.param_groups", "metric.lr")) for s in sites)
        if category == "scheduler" or any(s.startswith("scheduler") for s in sites) or (unsaved and lr_moved):
            return Verdict("scheduler", f"resume drops state: the learning rate differs at {when} ({_where(div)}); "
                           f"an LR scheduler drives {', '.join(unsaved) or 'the optimizer'} but is not saved in the "
                           "TrainState", **common)
        if category in ("metric", "parameters", "gradients", "optimizer", "module"):
            return Verdict("hidden-state", f"hidden state: the runs part at {when} ({_where(div)}) although every "
                           "saved field was restored exactly: state outside the TrainState (a global counter, a "
                           "cache, an unregistered generator) drives the computation", **common)
        return Verdict("diverged", f"resumed run diverges at {_where(div)}", **common)
    final = analysis.get("final") or []
    if final:
        f = final[0]
        return Verdict("diverged", f"final states differ: {f.message}", site=f.location.fqn)
    runs = "B equals A" if "B" in plan.runs else "A ran"
    return Verdict("pass", f"resume-equivalent: {runs} bitwise for steps {plan.resume_at + 1}..{plan.steps}"
                   + (", and two continuous runs agree" if "A2" in plan.runs else "")
                   + f" ({plan.nproc} rank(s), level {plan.level})")
