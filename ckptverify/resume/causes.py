"""The causes a step can differ by, in words, shared by ``resume-check`` (:mod:`ckptverify.resume.verdict`) and
``replay`` (:mod:`ckptverify.replay.causes`). :class:`Runs` names the run that saved and the one that restored.
Sentences carry no final period and advice no "What to do:", so each command frames them. Both verdicts use
:func:`first_verdict`: an ordered table of rules, the first that applies decides."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

__all__ = ["REGISTER_LOADER", "REPLAY", "RESTORE_ADVICE", "RESUME", "UNREGISTERED_ADVICE", "Runs",
           "buffer_cause", "first_verdict", "hparam_start_cause", "on_ranks", "ranks_text", "rng_cause", "rng_sentence",
           "show", "step_hparam_cause", "step_hparam_what", "values_in"]

@dataclass(frozen=True)
class Runs:
    """How a sentence names the two runs: ``saved``, ``restored``, the ``checkpoint`` restored, and ``first`` (the
    first step after the restore)."""

    saved: str
    restored: str
    checkpoint: str
    first: str


RESUME = Runs(saved="A", restored="B", checkpoint="the checkpoint", first="the first resumed step")
REPLAY = Runs(saved="production", restored="the replay", checkpoint="production's checkpoint",
              first="the first replayed step")

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
    raise AssertionError(f"no rule applies to {type(case).__name__}: the last rule of a table always applies")


def show(value: Any) -> str:
    """A recorded value, short: a digest cut to 12 characters, a number as it is."""
    if isinstance(value, str) and len(value) > 12:
        return value[:12] + "…"
    return repr(value)


def values_in(runs: Runs, a: Any, b: Any) -> str:
    """``a`` in the first run, ``b`` in the second (``a`` ``None``: only the category cell recorded)."""
    if a is None:
        return f"{show(b)} in {runs.restored}, another value in {runs.saved}"
    return f"{show(a)} in {runs.saved}, {show(b)} in {runs.restored}"


def rng_cause(runs: Runs, *, a_moved: list[str], b_moved: list[str], first_step: bool, step: int,
              saved_at: int) -> tuple[str, str]:
    """Why random streams differ when ``step`` starts, and what to do: re-seeded after the restore, drawn by the
    first run after its save point, drawn between steps, or not restored."""
    if b_moved and first_step:
        return (f"{runs.restored} re-seeded or drew from {', '.join(b_moved)} after run.restore() and before step "
                f"{step} (e.g. torch.manual_seed after the restore)",
                "seed before run.restore(state), never after it; draw nothing between restore and the loop")
    if a_moved and first_step:
        return (f"{runs.saved} drew from {', '.join(a_moved)} after its save point (between run.record() of step "
                f"{saved_at}, which saved, and step {step}: e.g. an evaluation placed after the end-of-step save)",
                "do that work inside the step, before run.record(), or draw it from its own generator registered "
                "in TrainState(generators=...)")
    if b_moved or a_moved:
        side = runs.restored if b_moved else runs.saved
        return (f"{side} drew from {', '.join(b_moved or a_moved)} between steps {step - 1} and {step}",
                "draw random numbers only inside the steps, the same way in every run")
    return ("the stream was not restored from the checkpoint",
            "register every generator the job draws from in TrainState(generators=...)")


def ranks_text(ranks: Sequence[int]) -> str:
    """``rank 1`` or ``ranks 0, 2`` (in order)."""
    ranks = sorted(ranks)
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def on_ranks(rank: int | str | None) -> str:
    """Where, in a sentence: ``rank 1``, a given description of several, or nothing."""
    if rank is None:
        return ""
    return f"rank {rank}" if isinstance(rank, int) else rank


def rng_sentence(names: str, *, when: str, step: int, rank: int | str | None, cause: str,
                 between: str = "") -> str:
    """Random streams ``names`` differ when a step begins: the cause and its consequence."""
    where = ", ".join(x for x in (f"step {step}", on_ranks(rank)) if x)
    return (f"random stream {names} differs{between} when {when} begins ({where}): {cause}; the "
            "batch and values computed from it differ as a consequence")


def hparam_start_cause(runs: Runs, *, name: str, a: Any, b: Any, first_step: bool, a_moved: bool | None,
                       b_moved: bool | None, step: int, saved_at: int, when: str) -> tuple[str, str, str]:
    """A hyperparameter differs when ``step`` starts: ``(kind, sentence, advice)``: changed after the restore,
    changed after the save point, or an unrestored scheduler or counter."""
    values = values_in(runs, a, b)
    if first_step and b_moved:
        return ("changed-after-restore",
                f"{name} was restored exactly from {runs.checkpoint}, then changed after run.restore() in "
                f"{runs.restored}: step {step} starts with {values}",
                "do not re-apply configuration values to restored objects after run.restore(state); apply them "
                "only on a fresh start (run.step == 0)")
    if first_step and a_moved:
        return ("changed-after-save",
                f"{runs.saved} changed {name} after its save point (between run.record() of step {saved_at} and "
                f"step {step}): step {step} starts with {values}",
                "change hyperparameters (scheduler.step()) inside the step, before run.record()")
    return ("scheduler", f"{name} differs when {when} begins ({values}): the LR scheduler or the step counter it "
            "follows was not restored",
            "register the LR scheduler in the TrainState (TrainState(scheduler=...)) and derive schedules from "
            "run.step")


def step_hparam_what(runs: Runs, *, key: str, group: str, a: Any, b: Any, step: int) -> str:
    """The hyperparameter ``key`` of param group ``group`` the optimizer step used differs."""
    return (f"the {key} the optimizer used at step {step} differs (param group {group}: {values_in(runs, a, b)}) "
            "although the step started from equal state")


def step_hparam_cause(unsaved: list[str]) -> tuple[str, str]:
    """Why a hyperparameter the optimizer step used differs, and what to do: an unsaved LR scheduler, or a counter
    that was not restored."""
    if unsaved:
        return (f"an LR scheduler drives {', '.join(unsaved)} but is not saved in the TrainState",
                "register it: TrainState(scheduler=...)")
    return ("the code that sets it during the step reads a step counter or schedule that was not restored (a "
            "counter that restarts at 0 on resume)",
            "compute it from run.step (restored with the checkpoint), or register the scheduler")


def buffer_cause(runs: Runs, *, name: str, when: str, rank: int | str | None) -> tuple[str, str]:
    """A ``persistent=False`` buffer ``name`` differs: the sentence and the advice."""
    where = f" ({on_ranks(rank)})" if rank is not None else ""
    return (f"buffer {name} differs at {when}{where}; it is registered with persistent=False, so no "
            f"checkpoint holds it, and {runs.restored} starts it afresh while {runs.saved} carried it on",
            f"register {name} as a persistent buffer, or recompute it from saved state")
