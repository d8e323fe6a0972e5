"""The causes a step can differ by, in words, shared by ``resume-check`` (:mod:`ckptverify.resume.verdict`) and
``replay`` (:mod:`ckptverify.replay.causes`). :class:`Runs` names the run that saved and the one that restored,
:class:`At` the step a cause is said of; each sentence builder reads the evidence
(:class:`~ckptverify.resume.compare.SiteDiff`) itself, so a command's rule only picks it and frames the verdict.
Sentences carry no final period and advice no "What to do:", so each command frames them. Both verdicts use
:func:`first_verdict`: an ordered table of rules, the first that applies decides."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from ckptverify.resume.compare import SiteDiff

__all__ = ["REGISTER_LOADER", "REPLAY", "RESTORE_ADVICE", "RESUME", "UNREGISTERED_ADVICE", "At", "Runs",
           "buffer_cause", "first_verdict", "hparam_start_cause", "ranks_text", "rng_cause", "step_hparam_cause",
           "step_hparam_what"]


@dataclass(frozen=True)
class Runs:
    """How a sentence names the two runs: ``saved``, ``restored``, the ``checkpoint`` restored, ``first`` (the
    first step after the restore), and ``between`` (which runs a value differs between; ``""``: the two)."""

    saved: str
    restored: str
    checkpoint: str
    first: str
    between: str = ""


RESUME = Runs(saved="A", restored="B", checkpoint="the checkpoint", first="the first resumed step")
REPLAY = Runs(saved="production", restored="the replay", checkpoint="production's checkpoint",
              first="the first replayed step", between=" between production and the replays")


@dataclass(frozen=True)
class At:
    """The step a cause is said of: the ``runs``' naming, the ``step``, the step ``saved_at`` whose checkpoint the
    second run restored, and where: a rank, or several in words."""

    runs: Runs
    step: int
    saved_at: int
    rank: int | str | None = None

    @property
    def first(self) -> bool:
        """``step`` is the first after the restore."""
        return self.step == self.saved_at + 1

    @property
    def when(self) -> str:
        return self.runs.first if self.first else f"step {self.step}"


RESTORE_ADVICE = "make the object's load_state_dict restore exactly what its state_dict saved"
UNREGISTERED_ADVICE = ("register it in the TrainState (optimizer=, scheduler=, scaler=, generators=, extras= for "
                       "your own objects)")
REGISTER_LOADER = "register the loader: TrainState(dataloader=...)"


C = TypeVar("C")
V = TypeVar("V")


def first_verdict(rules: Sequence[Callable[[C], V | None]], case: C) -> V:
    """The verdict of the first rule that applies to ``case`` (returns non-``None``); the last rule always applies."""
    for rule in rules:
        verdict = rule(case)
        if verdict is not None:
            return verdict
    # An explicit error, not next()'s StopIteration, which a map() or generator calling this would end on silently.
    raise AssertionError(f"no rule applies to {type(case).__name__}: the last rule of a table always applies")


def _values_in(runs: Runs, a: Any, b: Any) -> str:
    """``a`` in the first run, ``b`` in the second (``a`` ``None``: only the category cell recorded), each short: a
    digest cut to 12 characters, a number as it is."""
    def show(value: Any) -> str:
        return value[:12] + "…" if isinstance(value, str) and len(value) > 12 else repr(value)

    if a is None:
        return f"{show(b)} in {runs.restored}, another value in {runs.saved}"
    return f"{show(a)} in {runs.saved}, {show(b)} in {runs.restored}"


def rng_cause(at: At, rng: Sequence[SiteDiff]) -> tuple[str, str]:
    """Random streams ``rng`` differ when ``at.step`` starts: the sentence, with its cause (re-seeded after the
    restore, drawn by the first run after its save point, drawn between steps, or not restored), and what to do."""
    runs, step = at.runs, at.step
    names = ", ".join(x.name for x in rng)
    a_moved, b_moved = [x.name for x in rng if x.a_moved], [x.name for x in rng if x.b_moved]
    if b_moved and at.first:
        cause, advice = (f"{runs.restored} re-seeded or drew from {', '.join(b_moved)} after run.restore() and "
                         f"before step {step} (e.g. torch.manual_seed after the restore), which {runs.saved}, "
                         f"running on from step {at.saved_at}, did not",
                         "seed before run.restore(state), never after it; draw nothing between restore and the loop")
    elif a_moved and at.first:
        cause, advice = (f"{runs.saved} drew from {', '.join(a_moved)} after its save point (between run.record() "
                         f"of step {at.saved_at}, which saved, and step {step}: e.g. an evaluation placed after the "
                         "end-of-step save)",
                         "do that work inside the step, before run.record(), or draw it from its own generator "
                         "registered in TrainState(generators=...)")
    elif b_moved or a_moved:
        side = runs.restored if b_moved else runs.saved
        cause, advice = (f"{side} drew from {', '.join(b_moved or a_moved)} between steps {step - 1} and {step}",
                         "draw random numbers only inside the steps, the same way in every run")
    else:
        cause, advice = ("the stream was not restored from the checkpoint",
                         "register every generator the job draws from in TrainState(generators=...)")
    where = ", ".join(x for x in (f"step {step}", _on_ranks(at.rank)) if x)
    return (f"random stream {names} differs{runs.between} when {at.when} begins ({where}): {cause}; the batch and "
            "values computed from it differ as a consequence", advice)


def ranks_text(ranks: Sequence[int]) -> str:
    """``rank 1`` or ``ranks 0, 2`` (in order)."""
    ranks = sorted(ranks)
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def _on_ranks(rank: int | str | None) -> str:
    """Where, in a sentence: ``rank 1``, a given description of several, or nothing."""
    return "" if rank is None else f"rank {rank}" if isinstance(rank, int) else rank


def hparam_start_cause(at: At, h: SiteDiff) -> tuple[str, str, str, str]:
    """Hyperparameter ``h`` differs when ``at.step`` starts: ``(kind, sentence, advice, site)``: changed after the
    restore, changed after the save point, or an unrestored scheduler or counter."""
    runs, step = at.runs, at.step
    group, _, key = h.name.partition(".")
    name = f"param_groups[{group}].{key}"
    values = _values_in(runs, h.a, h.b)
    if at.first and h.b_moved:
        return ("changed-after-restore",
                f"{name} was restored exactly from {runs.checkpoint}, then changed after run.restore() in "
                f"{runs.restored}: step {step} starts with {values}",
                "do not re-apply configuration values to restored objects after run.restore(state); apply them "
                "only on a fresh start (run.step == 0)", f"optim.{name}")
    if at.first and h.a_moved:
        return ("changed-after-save",
                f"{runs.saved} changed {name} after its save point (between run.record() of step {at.saved_at} "
                f"and step {step}): step {step} starts with {values}",
                "change hyperparameters (scheduler.step()) inside the step, before run.record()", f"optim.{name}")
    return ("scheduler", f"{name} differs when {at.when} begins ({values}): the LR scheduler or the step counter it "
            "follows was not restored",
            "register the LR scheduler in the TrainState (TrainState(scheduler=...)) and derive schedules from "
            "run.step", f"optim.{name}")


def step_hparam_what(at: At, hparams: Sequence[SiteDiff]) -> tuple[str, str]:
    """Of the hyperparameters the optimizer step used that differ (``lr`` first): what differs, and its site."""
    h = next((x for x in hparams if x.name.endswith(".lr")), hparams[0])
    group, _, key = h.name.partition(".")
    return (f"the {key} the optimizer used at step {at.step} differs (param group {group}: "
            f"{_values_in(at.runs, h.a, h.b)}) although the step started from equal state",
            f"optim.param_groups[{group}].{key}")


def step_hparam_cause(unsaved: list[str]) -> tuple[str, str]:
    """Why a hyperparameter the optimizer step used differs, and what to do: an unsaved LR scheduler, or a counter
    that was not restored."""
    if unsaved:
        return (f"an LR scheduler drives {', '.join(unsaved)} but is not saved in the TrainState",
                "register it: TrainState(scheduler=...)")
    return ("the code that sets it during the step reads a step counter or schedule that was not restored (a "
            "counter that restarts at 0 on resume)",
            "compute it from run.step (restored with the checkpoint), or register the scheduler")


def buffer_cause(at: At, site: str) -> tuple[str, str]:
    """A ``persistent=False`` buffer (``site``: ``buffer.<name>``) differs: the sentence and the advice."""
    runs, name = at.runs, site.removeprefix("buffer.")
    where = f" ({_on_ranks(at.rank)})" if at.rank is not None else ""
    return (f"buffer {name} differs at {at.when}{where}; it is registered with persistent=False, so no "
            f"checkpoint holds it, and {runs.restored} starts it afresh while {runs.saved} carried it on",
            f"register {name} as a persistent buffer, or recompute it from saved state")
