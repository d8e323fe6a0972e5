"""State the training function keeps outside the TrainState (an EMA as an ``AveragedModel`` or a dict of tensors)
fails the resume check, naming the variable; a registered EMA passes; other causes keep their verdicts."""

from __future__ import annotations

from pathlib import Path

import pytest

from ckptverify.resume.harness import Plan, resume_check_many

SCRIPT = Path(__file__).resolve().parents[1] / "user_scripts" / "ema_train.py"
ONE_RANK = ("averaged", "dict", "dict_rebound", "registered", "scheduler_unsaved", "nonpersistent")
TWO_RANKS = ("averaged", "dict", "registered")


@pytest.fixture(scope="module")
def checked():
    """``checked(nproc)``: the outcomes of the scripts checked on ``nproc`` ranks, by name (each set run once)."""
    cache: dict[int, dict] = {}

    def outcomes(nproc: int) -> dict:
        if nproc not in cache:
            names = ONE_RANK if nproc == 1 else TWO_RANKS
            # A2 on one rank: it tells a lost value from a nondeterministic one.
            runs = ("A", "A2", "B") if nproc == 1 else ("A", "B")
            plans = [Plan(target=f"{SCRIPT}:train_{name}", steps=4, resume_at=2, nproc=nproc, runs=runs)
                     for name in names]
            cache[nproc] = dict(zip(names, resume_check_many(plans), strict=True))
        return cache[nproc]

    return outcomes


BOTH = pytest.mark.parametrize("nproc", [1, 2], ids=["1rank", "2ranks"])


def _held_errors(outcome) -> list:
    return [f for f in outcome.report.findings if f.check == "held-state" and f.severity.value == "error"]


@BOTH
def test_an_unregistered_averaged_model_fails_naming_it(checked, nproc):
    o = checked(nproc)["averaged"]
    v = o.verdict
    assert (v.kind, v.category, v.step) == ("unregistered-state", "held-state", 4), v.headline()
    assert v.site.startswith("ema_model.module.net.") and "ema_model" in v.message
    assert "extras=" in v.advice
    assert o.report.exit_code == 1
    assert [f.location.fqn.split(".")[0] for f in _held_errors(o)] == ["ema_model"] * len(_held_errors(o))


@pytest.mark.parametrize(("nproc", "name"), [(1, "dict"), (1, "dict_rebound"), (2, "dict")],
                         ids=["1rank-dict", "1rank-dict_rebound", "2ranks-dict"])
def test_an_unregistered_dict_of_ema_tensors_fails_naming_it_and_the_key(checked, nproc, name):
    v = checked(nproc)[name].verdict
    assert (v.kind, v.category) == ("unregistered-state", "held-state"), v.headline()
    assert v.site == "ema['net.0.weight']" and "holds ema with different values" in v.message
    if nproc == 1:
        assert "A and A2 hold equal values there" in v.message
    else:
        assert "A2 was not compared" in v.message


@BOTH
def test_an_ema_registered_in_extras_passes(checked, nproc):
    o = checked(nproc)["registered"]
    assert o.verdict.passed, o.verdict.headline()
    assert o.report.exit_code == 0
    # The loss, the last batch and the model's own tensors under other names are held too, and equal.
    assert not [f for f in o.report.findings if f.check.startswith("held-state")]


def test_an_unsaved_scheduler_is_still_the_scheduler(checked):
    o = checked(1)["scheduler_unsaved"]
    assert o.verdict.kind == "scheduler", o.verdict.headline()
    # The EMA differs at the end too, as a possible consequence: an info line, not the verdict.
    held = [f for f in o.report.findings if f.check == "held-state"]
    assert held and all(f.severity.value == "info" and "may follow" in f.message for f in held)


def test_a_non_persistent_buffer_is_still_hidden_state(checked):
    v = checked(1)["nonpersistent"].verdict
    assert (v.kind, v.site) == ("hidden-state", "buffer.input_rms"), v.headline()


def test_held_state_skips_registered_state_and_its_aliases_and_names_the_rest():
    import torch
    from torch.optim.swa_utils import AveragedModel

    from ckptverify.resume.unregistered import held_state
    from ckptverify.state.train_state import TrainState

    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Dropout())
    model.register_buffer("hidden", torch.zeros(2), persistent=False)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 2)).sum().backward()
    opt.step()
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=10)
    registered = AveragedModel(model)
    model[0].shadow = {"w": model[0].weight.detach().clone()}  # an EMA kept on the model, not as a buffer
    state = TrainState(model=model, optimizer=opt, scheduler=sched, extras={"swa": registered})
    local_vars = {
        "model": model, "opt": opt, "sched": sched, "state": state, "swa": registered,
        "weight": model[0].weight, "params": list(model.parameters()), "view": model[0].weight.T,
        "moments": [opt.state[p]["exp_avg"] for p in model.parameters()], "inner": registered.module,
        "hidden": model.hidden, "_": torch.ones(3),
        "ema": {"w": model[0].weight.detach().clone()}, "history": [torch.ones(1), (torch.zeros(1),)],
        "scaler": torch.amp.GradScaler("cpu"), "loss": torch.tensor(0.5),
    }
    entries = held_state(local_vars, state)["entries"]
    assert {e["var"] for e in entries.values()} == {"ema", "history", "scaler", "loss", "model.0.shadow"}
    assert {"ema['w']", "history[0]", "history[1][0]", "loss", "scaler.state_dict()['scale']",
            "model.0.shadow['w']"} <= set(entries)


def test_a_state_dict_cut_at_the_item_bound_is_said_truncated():
    """An unregistered scheduler whose ``state_dict()`` holds more items than are walked: what is walked is named
    and the walk says it was cut, as it does for any other container."""
    import torch

    from ckptverify.resume.unregistered import HELD_ITEMS, held_state
    from ckptverify.state.train_state import TrainState

    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0)
    sched.history = list(range(HELD_ITEMS + 1))
    held = held_state({"sched": sched}, TrainState(model=model, optimizer=opt))
    assert held["truncated"]
    assert f"sched.state_dict()['history'][{HELD_ITEMS - 1}]" in held["entries"]
    assert f"sched.state_dict()['history'][{HELD_ITEMS}]" not in held["entries"]


def test_compare_held_names_each_variable_once_with_its_first_differing_path():
    from ckptverify.resume.unregistered import compare_held

    def run(**values):
        return {0: {"entries": {path: {"var": path.split("[")[0].split(".")[0], "value": v}
                                for path, v in values.items()}}}

    a = run(**{"ema['a']": "1", "ema['b']": "2", "loss": "3", "fresh_only": "4"})
    b = run(**{"ema['a']": "1", "ema['b']": "9", "loss": "3", "ema['c']": "5"})
    assert compare_held(a, b) == [{"var": "ema", "path": "ema['b']", "rank": 0, "a": "2", "b": "9"}]
    # A path only one run holds, inside a variable both hold, is a difference (a history that restarted).
    assert compare_held(run(**{"h[0]": "1", "h[1]": "2"}), run(**{"h[0]": "1"}))[0]["path"] == "h[1]"


def test_a_variable_nondeterministic_between_a_and_a2_is_not_called_lost():
    from ckptverify.resume.compare import Evidence, HeldComparison
    from ckptverify.resume.verdict import decide

    plan = Plan(target="x:y", steps=4, resume_at=2)
    differ = ({"var": "ema", "path": "ema['w']", "rank": 0, "a": "1", "b": "2"},)
    v = decide(plan, Evidence(held=HeldComparison(differ=differ, nondeterministic=("ema",), a2=True)))
    assert v.kind == "nondeterministic" and v.site == "ema['w']" and "A and A2" in v.message
    v = decide(plan, Evidence(held=HeldComparison(differ=differ, nondeterministic=(), a2=True)))
    assert v.kind == "unregistered-state" and "not nondeterminism" in v.message
