"""Diagnosis a user can act on: every planted bug gets the right verdict kind and names the right site or
variable, on 1 and 2 ranks. All cases of one rank count share one launch per run (see resume_check_many)."""

from __future__ import annotations

import pytest

from ckptverify.examples.planted import EXPECTED
from ckptverify.examples.workloads import EXPECTED_VERDICTS
from ckptverify.resume.harness import Plan, resume_check_many

PLANTED = "ckptverify.examples.planted"
WORKLOADS = "ckptverify.examples.workloads"


def _plans(nproc: int) -> list[tuple[str, Plan]]:
    steps = 5 if nproc == 1 else 4
    out = []
    for name in sorted(EXPECTED):
        level = "module" if name == "parent_forward" else "state"
        out.append((name, Plan(target=f"{PLANTED}:{name}", steps=steps, resume_at=2, nproc=nproc, level=level,
                               runs=("A", "B"))))
    for name in sorted(EXPECTED_VERDICTS):
        runs = ("A", "A2", "B") if name in ("correct", "nondeterministic") else ("A", "B")
        out.append((name, Plan(target=f"{WORKLOADS}:{name}", steps=steps, resume_at=2, nproc=nproc, runs=runs)))
    return out


def _named(outcome) -> set[str]:
    """Every name the verdict or a warning gives: the verdict's site and origin, warned-about variables."""
    v = outcome.verdict
    names = {v.site or "", v.origin or ""}
    names |= {f.location.fqn or "" for f in outcome.report.findings if f.severity.value == "warning"}
    return names


@pytest.fixture(scope="module", params=[1, 2], ids=["1rank", "2ranks"])
def outcomes(request):
    cases = _plans(request.param)
    found = resume_check_many([plan for _, plan in cases])
    return request.param, {name: outcome for (name, _), outcome in zip(cases, found, strict=True)}


def test_every_planted_bug_gets_its_verdict_and_names_its_cause(outcomes):
    _, by_name = outcomes
    wrong = {}
    for name, (kind, named) in EXPECTED.items():
        o = by_name[name]
        names = _named(o)
        if o.verdict.kind != kind or not any(named == n or n.endswith("." + named) or n.endswith(named)
                                             for n in names):
            wrong[name] = (o.verdict.kind, sorted(names), o.verdict.message)
    assert not wrong, wrong


def test_built_in_workloads_keep_their_verdicts(outcomes):
    _, by_name = outcomes
    got = {name: by_name[name].verdict.kind for name in EXPECTED_VERDICTS}
    assert got == EXPECTED_VERDICTS
    assert by_name["correct"].report.exit_code == 0


def test_rng_verdicts_say_which_run_moved_the_stream(outcomes):
    _, by_name = outcomes
    assert "B re-seeded or drew" in by_name["reseed_after_restore"].verdict.message
    assert "A drew from rng.torch_cpu after its save point" in by_name["eval_after_save"].verdict.message
    # A batch drawn from the moved stream differs too, but it is the consequence, not the verdict.
    for name in ("reseed_after_restore", "eval_after_save"):
        assert by_name[name].verdict.step == 3 and by_name[name].verdict.kind == "rng"


def test_data_verdicts_read_as_data_and_name_the_forgotten_loader(outcomes):
    _, by_name = outcomes
    v = by_name["data_not_restored"].verdict
    assert v.message.startswith("the batch of step 3 differs")
    assert "loader (DataLoader)" in v.message
    assert v.advice and v.headline().startswith("verdict: data (step 3")


def test_parent_forward_names_the_parent_and_the_child_it_fed(outcomes):
    _, by_name = outcomes
    v = by_name["parent_forward"].verdict
    assert v.origin == "blocks.0" and v.site == "module.blocks.0.ln1.in#0"
    assert "blocks.0.ln1" in v.message


def test_restored_value_changed_after_restore_is_not_called_outside_the_train_state(outcomes):
    _, by_name = outcomes
    v = by_name["hparam_reapplied"].verdict
    assert v.site == "optim.param_groups[0].weight_decay"
    assert "restored exactly" in v.message and "outside the TrainState" not in v.message


def test_forgotten_objects_are_warnings_and_fail_when_they_end_the_run_different(outcomes):
    _, by_name = outcomes
    for name, var in (("ema_unregistered", "ema"), ("scaler_unregistered", "scaler")):
        o = by_name[name]
        # No traced value reads them, but the values the function holds at the end differ in A and B.
        assert o.verdict.kind == "unregistered-state" and o.verdict.category == "held-state"
        assert o.verdict.site.startswith(var + ".") and f"holds {var} with different values" in o.verdict.message
        assert [f.check for f in o.report.findings if f.severity.value == "warning"] == ["unregistered-state"]
    assert any(f.check == "no-optimizer" for f in by_name["missing_optimizer"].report.findings)
    # The correct workload holds nothing unregistered: no warning at all.
    assert not [f for f in by_name["correct"].report.findings if f.severity.value == "warning"]


def test_runs_are_labelled_by_their_own_names(outcomes):
    _, by_name = outcomes
    nd = [f for f in by_name["nondeterministic"].report.findings
          if f.check == "trace-divergence" and f.message.startswith("[A vs A2]")]
    assert nd and all("in run A and" in f.message and "in run A2" in f.message for f in nd)
    assert not any("('A2')" in f.message for f in by_name["nondeterministic"].report.findings)


def _write(path, run: str, rng: int) -> None:
    from ckptverify.trace.store import Cell, TraceHeader, TraceWriter

    with TraceWriter(path / "rank0", header=TraceHeader(run=run, level="state", rank=0, world_size=1)) as w:
        for step in (1, 2, 3):
            w.append(step, [Cell("start.rng.python", "rng", (rng, step), "digest128"),
                            Cell.from_float("metric.loss", "metric", 1.0 / step),
                            Cell("rng.python", "rng", (rng, step + 1), "digest128")])


def test_an_unused_random_stream_is_one_info_line_naming_it(tmp_path):
    from ckptverify.resume.compare import _trace_stage

    _write(tmp_path / "a", "A", 1)
    _write(tmp_path / "b", "A2", 2)
    found, first, _ = _trace_stage("A vs A2", str(tmp_path / "a"), str(tmp_path / "b"), None)
    assert first is None
    assert [(f.check, f.severity.value) for f in found] == [("trace-rng-unused", "info")]
    assert "rng.python" in found[0].message


def test_find_unregistered_names_locals_container_fields_and_module_attributes():
    import types

    import torch

    from ckptverify.resume.unregistered import find_unregistered, missing_optimizer
    from ckptverify.state.train_state import TrainState

    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Dropout())
    model[1].noise = torch.Generator().manual_seed(0)  # a layer's own generator, saved nowhere
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1)
    ema = torch.nn.Linear(2, 2)
    scaler = torch.amp.GradScaler("cpu")
    box = types.SimpleNamespace(aux_opt=torch.optim.SGD(ema.parameters(), lr=0.1), width=3)
    state = TrainState(model=model, optimizer=opt)
    found = {u["name"]: (u["kind"], u["type"]) for u in find_unregistered(
        {"model": model, "opt": opt, "sched": sched, "ema": ema, "scaler": scaler, "box": box, "state": state,
         "_": torch.nn.Linear(1, 1), "n": 3}, state)}
    assert found == {"sched": ("LR scheduler", "StepLR"), "ema": ("module", "Linear"),
                     "scaler": ("gradient scaler", "GradScaler"), "box.aux_opt": ("optimizer", "SGD"),
                     "model.1.noise": ("random generator", "Generator")}
    assert missing_optimizer(state) is None and "no optimizer" in missing_optimizer(TrainState(model=model))
    # Wrappers around the registered model are not "another module"; a registered generator is registered.
    wrapper = torch.nn.Sequential(model)
    full = TrainState(model=model, optimizer=opt, generators={"noise": model[1].noise})
    assert find_unregistered({"wrapper": wrapper}, full) == []
