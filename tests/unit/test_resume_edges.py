"""Refusals and fallbacks of the resume harness and replay that need no launched process: plan checks, target
loading, output labelling, rebuilt-object detection, and the verdict texts built from evidence."""

from __future__ import annotations

import multiprocessing
import os
import sys
import threading
from types import SimpleNamespace

import pytest
import torch
from torch.multiprocessing import ProcessExitedException

from ckptverify.errors import CkptVerifyError, UsageError
from ckptverify.findings import Location, error
from ckptverify.replay import causes as replay_causes
from ckptverify.replay import replay as replay_mod
from ckptverify.resume import harness_output, harness_target, launch, unregistered
from ckptverify.resume.causes import RESUME, At, _values_in, rng_cause
from ckptverify.resume.compare import Evidence, Indices, SiteDiff, StepEvidence, _held_gaps
from ckptverify.resume.harness import Plan, resume_check_many
from ckptverify.resume.locate import walk as walk_mod
from ckptverify.resume.locate.ops import _output_difference
from ckptverify.resume.locate.walk import Side, Walk, for_replay, skipped, state_origin
from ckptverify.resume.run import Run, RunConfig
from ckptverify.resume.unregistered import held_state, registered_bindings, replaced_objects
from ckptverify.resume.verdict import Verdict, decide
from ckptverify.state.train_state import TrainState
from ckptverify.trace.compare import FirstDivergence
from ckptverify.trace.oplog import OpEvent


@pytest.mark.parametrize("field,value,said", [("nproc", 0, "--nproc must be at least 1"),
                                              ("runs", ("B",), "--runs must include A"),
                                              ("runs", ("A", "C"), "--runs must include A")])
def test_plan_refuses_bad_counts_and_runs(field: str, value: object, said: str) -> None:
    with pytest.raises(UsageError, match=said):
        Plan(target="x.py:train", steps=4, resume_at=2, **{field: value})  # type: ignore[arg-type]


def test_plans_checked_together_share_nproc_and_device() -> None:
    assert resume_check_many([]) == []
    plans = [Plan(target="x.py:train", steps=4, resume_at=2), Plan(target="x.py:train", steps=4, resume_at=2, nproc=2)]
    with pytest.raises(UsageError, match="same nproc and device"):
        resume_check_many(plans)


@pytest.fixture
def modules(tmp_path, monkeypatch):
    """A working directory holding importable modules, as ``module:FUNC`` targets find them."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))

    def write(name: str, text: str) -> None:
        (tmp_path / f"{name}.py").write_text(text)

    return write


def test_a_missing_module_says_where_to_run_from(modules) -> None:
    with pytest.raises(UsageError, match=r"no module named 'cv_no_such_module'.*run from the folder"):
        harness_target.check_target("cv_no_such_module:train")


def test_a_module_failing_to_import_shows_its_traceback(modules) -> None:
    modules("cv_broken_target", "import cv_missing_dependency\n\ndef train(run):\n    run.restore(None)\n")
    with pytest.raises(UsageError, match=r"cv_broken_target failed to import:(.|\n)*cv_missing_dependency"):
        harness_target.check_target("cv_broken_target:train")


def test_a_target_that_is_not_a_function_is_refused(modules) -> None:
    modules("cv_value_target", "train = 3\n")
    with pytest.raises(UsageError, match="is a int, not a function"):
        harness_target.check_target("cv_value_target:train")


def test_a_module_inside_a_package_is_loaded_checked_and_forgotten(modules, tmp_path) -> None:
    """``package.module:FUNC``: the check finds the function in the submodule and forgets the package and its
    submodule afterwards (found only through the working directory); a misspelt function is refused with the
    name it most likely means; a rank loads that same function."""
    pkg = tmp_path / "cv_pkg_target"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "sub.py").write_text("def main(run):\n    run.restore(None)\n")
    try:
        assert harness_target.check_target("cv_pkg_target.sub:main") == str(pkg / "sub.py")
        assert "cv_pkg_target" not in sys.modules and "cv_pkg_target.sub" not in sys.modules
        with pytest.raises(UsageError) as refused:
            harness_target.check_target("cv_pkg_target.sub:mian")
        assert str(refused.value) == (
            "cv_pkg_target.sub has no function 'mian'; did you mean 'main'? (functions defined there: main)\n"
            f'  File "{pkg / "sub.py"}", line 1, in main\n    def main(run):')
        func = harness_target.load_target("cv_pkg_target.sub:main")
        assert (func.__module__, func.__qualname__) == ("cv_pkg_target.sub", "main")
    finally:
        for name in ("cv_pkg_target", "cv_pkg_target.sub"):
            sys.modules.pop(name, None)


def test_a_file_target_inside_a_package_forgets_the_packages_it_found_beside_it(tmp_path, monkeypatch) -> None:
    """``FILE.py:FUNC`` of a file inside a package that imports a sibling package: the sibling, found only through
    the file's folder, is forgotten after the check (a later script's same-named sibling is its own)."""
    monkeypatch.setattr(sys, "path", list(sys.path))
    proj = tmp_path / "cv_proj_target"
    (proj / "cv_models_beside").mkdir(parents=True)
    (proj / "__init__.py").write_text("")
    (proj / "cv_models_beside" / "__init__.py").write_text("WIDTH = 4\n")
    (proj / "train.py").write_text("from cv_models_beside import WIDTH\n\ndef train(run):\n    run.restore(WIDTH)\n")
    assert harness_target.check_target(f"{proj / 'train.py'}:train") == str(proj / "train.py")
    assert "cv_models_beside" not in sys.modules


def _pumped(data: bytes) -> list[bytes]:
    """The writes :func:`harness_output._pump` makes for ``data`` written into its pipe."""
    read, write = os.pipe()
    writes: list[bytes] = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(harness_output, "_write_all", lambda _out, batch: writes.append(batch))
        pump = threading.Thread(target=harness_output._pump, args=(read, -1, b"[A] "))
        pump.start()
        view = memoryview(data)
        while view:
            view = view[os.write(write, view):]
        os.close(write)
        pump.join(10)
    assert not pump.is_alive()
    return writes


def test_output_lines_are_labelled_in_writes_of_at_most_pipe_buf() -> None:
    lines = [f"line {i}".encode() for i in range(2000)]
    writes = _pumped(b"\n".join(lines) + b"\n")
    assert b"".join(writes) == b"".join(b"[A] " + line + b"\n" for line in lines)
    assert len(writes) > 1 and all(len(w) <= harness_output._ATOMIC for w in writes)
    assert all(w.endswith(b"\n") for w in writes)


def test_an_unended_line_longer_than_the_limit_is_written_as_it_stands() -> None:
    bar = b"#" * (3 * harness_output._LONGEST)
    out = b"".join(_pumped(bar))
    pieces = out.split(b"\n")[:-1]
    assert len(pieces) > 1 and all(p.startswith(b"[A] ") for p in pieces)
    assert b"".join(p[len(b"[A] "):] for p in pieces) == bar


def test_a_registered_object_rebuilt_after_restore_is_named() -> None:
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    state = TrainState(model=model, optimizer=optimizer)
    bindings = registered_bindings({"model": model, "optimizer": optimizer, "_hidden": model}, state)
    assert set(bindings) == {"model", "optimizer"}
    rebuilt = torch.optim.Adam(model.parameters())
    found = replaced_objects(bindings, {"model": model, "optimizer": rebuilt}, state)
    assert found == [{"name": "optimizer", "field": bindings["optimizer"][1], "type": "Adam",
                      "registered_type": "SGD"}]
    # A name reused for something stateless is no rebuilt object.
    assert replaced_objects(bindings, {"model": model, "optimizer": 3}, state) == []


def test_a_category_cell_alone_names_the_restored_value_only() -> None:
    assert _values_in(RESUME, None, "0123456789abcdef") == "0123456789ab… in B, another value in A"
    assert _values_in(RESUME, 1, 2) == "1 in A, 2 in B"


def test_events_with_other_output_counts_differ_at_the_first_missing_output() -> None:
    a = OpEvent(step=1, phase="forward", module="m", op="aten.add", occurrence=0, index=0, outputs=(1, 2))
    b = OpEvent(step=1, phase="forward", module="m", op="aten.add", occurrence=0, index=0, outputs=(1,))
    assert _output_difference(a, b) == {"index": 1}


def test_walk_findings_of_a_state_origin_and_a_skipped_walk() -> None:
    (origin,) = state_origin(kind="rng", step=3, rank=1, site="rng.torch").findings()
    assert origin.check == "locate-origin" and origin.location.rank == 1 and origin.location.fqn == "rng.torch"
    assert "step 3" in origin.message and "on rank 1" in origin.message
    (said,) = skipped("no step", step=2).findings()
    assert said.check == "locate-skipped" and said.severity.value == "info" and said.message == "Not located: no step."


def test_hosts_are_described_from_what_production_recorded() -> None:
    assert replay_mod._where(None) == "host unknown"
    host = {"hostname": "n1", "device": {"type": "cuda", "index": 2, "name": "H100", "uuid": "GPU-1"}}
    assert replay_mod._where(host) == "host n1, device cuda:2 (H100, GPU-1)"


@pytest.mark.parametrize("fqn,kind", [("data.position", "data"), ("rng.torch", "rng"),
                                      ("scheduler.last_epoch", "scheduler"), ("counters.step", "restore-mismatch"),
                                      ("model.weight", "hardware-fault-suspected")])
def test_a_final_state_difference_is_judged_by_the_item_it_names(fqn: str, kind: str) -> None:
    verdict = replay_mod._final_differs(error("diff", "differs", location=Location(fqn=fqn)), 7, 2)
    assert verdict.kind == kind and verdict.step == 7 and verdict.site == fqn
    assert (verdict.candidate_ranks == (0, 1)) == (kind == "hardware-fault-suspected")


def test_replays_differing_with_no_step_named_are_still_nondeterministic() -> None:
    verdict = replay_mod._twins_differ([SimpleNamespace(first=None)])  # type: ignore[list-item]
    assert verdict.kind == "nondeterministic" and verdict.step is None


def test_a_stream_drawn_between_later_steps_names_the_run_that_drew() -> None:
    drew = SiteDiff("rng.torch", "aa", "bb", a_moved=False, b_moved=True)
    sentence, advice = rng_cause(At(runs=RESUME, step=5, saved_at=2, rank=0), [drew])
    assert "B drew from rng.torch between steps 4 and 5" in sentence and "rank 0" in sentence
    assert advice == "draw random numbers only inside the steps, the same way in every run"


def test_held_values_not_all_compared_say_why() -> None:
    held = {"A": {0: {"error": "walk failed", "truncated": True, "skipped": ["x", "y", "z", "w"]}, 1: {}},
            "B": {0: {}}}
    gaps = _held_gaps(held)
    assert gaps[0] == "run B left no record of rank 1"
    assert gaps[1] == "run A rank 0: walk failed"
    assert gaps[2].startswith("run A rank 0 holds more than was compared (at most ")
    assert gaps[3] == "run A rank 0 could not fingerprint x, y, z"
    assert len(gaps) == 4


def test_run_api_misuse_is_refused() -> None:
    with pytest.raises(UsageError, match=r"run.restore\(\) takes a TrainState, got dict"):
        Run(RunConfig(stop_step=2)).restore({})
    with pytest.raises(UsageError, match=r"must be called once per step yielded by run.steps\(\)"):
        Run(RunConfig(stop_step=2)).record(loss=1.0)
    steps = Run(RunConfig(stop_step=2)).steps()
    next(steps)
    with pytest.raises(UsageError, match=r"call run.record\(...\) once at the end of every step"):
        next(steps)
    with pytest.raises(UsageError, match="production mode needs steps="):
        Run.main(lambda run: None, run_dir="somewhere")


def test_replay_checkpoint_choice_refusals(tmp_path) -> None:
    with pytest.raises(UsageError, match="--from must be below --to, got 3 and 2"):
        replay_mod._pick(str(tmp_path), 3, 2)
    with pytest.raises(UsageError, match=r"no checkpoint of step 1 under .* \(have: none\)"):
        replay_mod._pick(str(tmp_path), 1, 2)
    with pytest.raises(UsageError, match="no verified checkpoint under"):
        replay_mod._pick(str(tmp_path), None, None)


def test_a_recorded_target_of_no_known_shape_is_refused(tmp_path) -> None:
    job = tmp_path / "job.py"
    job.write_text("def train(run):\n    run.restore(None)\n")
    with pytest.raises(UsageError, match=r"records the training function 'nonsense', which is not FILE\.py:FUNC"):
        replay_mod.same_function(f"{job}:train", {"target": "nonsense"}, str(tmp_path))


def test_a_target_changing_the_environment_at_import_leaves_it_as_it_was(modules) -> None:
    modules("cv_env_target", "import os\nos.environ['CV_SET_BY_TARGET'] = '1'\n\n"
                             "def train(run):\n    run.restore(None)\n")
    harness_target.check_target("cv_env_target:train")
    assert "CV_SET_BY_TARGET" not in os.environ


class _UnreadableOptimizer(torch.optim.SGD):
    def state_dict(self):  # type: ignore[override]
        raise RuntimeError("no state here")


def test_held_values_beyond_the_bounds_or_unreadable_are_said_not_compared(monkeypatch) -> None:
    model = torch.nn.Linear(2, 2)
    state = TrainState(model=model)
    held = held_state({"big": list(range(unregistered.HELD_ITEMS + 1)), "meta": torch.empty(2, device="meta"),
                       "opt": _UnreadableOptimizer(model.parameters(), lr=0.1)}, state)
    assert held["truncated"] and held["skipped"] == ["meta", "opt"] and held["entries"] == {}
    monkeypatch.setattr(unregistered, "HELD_ENTRIES", 2)
    held = held_state({"a": torch.ones(1), "b": torch.zeros(1), "c": torch.full((1,), 3.0)}, state)
    assert held["truncated"] and list(held["entries"]) == ["a", "b"]
    monkeypatch.setattr(unregistered, "HELD_ENTRIES", 100)
    monkeypatch.setattr(unregistered, "HELD_VISITS", 1)
    held = held_state({"a": torch.ones(1), "b": torch.zeros(1)}, state)
    assert held["truncated"] and list(held["entries"]) == ["a"]


def test_sparse_tensors_have_no_memory_to_alias_and_are_said_not_compared() -> None:
    """A sparse tensor has no storage: registered, it covers no held value; held, it is named as not compared,
    while a dense value beside it is compared and an alias of the registered weight is not."""
    model = torch.nn.Linear(2, 2)
    sparse = torch.eye(2).to_sparse()
    model.register_buffer("mask", sparse)
    held = held_state({"mask_copy": sparse.clone(), "scale": torch.ones(1), "weight": model.weight.data},
                      TrainState(model=model))
    assert held["skipped"] == ["mask_copy"] and not held["truncated"]
    assert list(held["entries"]) == ["scale"] and held["entries"]["scale"]["var"] == "scale"


def test_a_crash_leaving_no_rank_text_is_said_with_the_launch_error(tmp_path) -> None:
    jobs = [("x.py:train", RunConfig(name="A", trace_dir=str(tmp_path / "trace")))]
    with pytest.raises(CkptVerifyError, match="the workload crashed in run A: ProcessExitedException\nsignal 9"):
        launch._raise_failure(jobs, ProcessExitedException("signal 9", error_index=0, error_pid=1, exit_code=-9))


def test_launch_width_and_start_method_off_the_common_path(monkeypatch) -> None:
    assert launch.launches_at_once(2, "cuda") == 1
    monkeypatch.setattr(multiprocessing, "get_all_start_methods", lambda: ["spawn"])
    assert launch.start_method() == "spawn"


PLAN = SimpleNamespace(resume_at=2, steps=4, runs=("A", "A2", "B"), nproc=1, level="state")
LOADER = {"name": "loader", "type": "DataLoader", "kind": "data loader"}


def _parted(category: str, site: str, step: StepEvidence | None = None, origin: str | None = None,
            **evidence: object) -> Verdict:
    """The verdict when A and B first part at step 4 in ``site``."""
    div = FirstDivergence(step=4, rank=0, site=site, category=category, kind=site.split(".")[0], origin=origin)
    return decide(PLAN, Evidence(resume=div, resume_sites=frozenset({site}), step=step or StepEvidence(),
                                 **evidence))  # type: ignore[arg-type]


def test_final_checkpoints_differing_alone_is_a_divergence_found_at_the_end() -> None:
    v = decide(PLAN, Evidence(final=(error("diff", "differs", location=Location(fqn="model.w")),)))
    assert (v.kind, v.category, v.site) == ("diverged", "final", "model.w")
    assert "the final checkpoints differ (1 item(s), first model.w)" in v.message


def test_a_pass_still_names_unregistered_and_rebuilt_objects() -> None:
    v = decide(PLAN, Evidence(unregistered=({"name": "ema", "type": "EMA", "kind": "stateful object"},)))
    assert v.passed and "would lose state" in v.message and "ema (EMA)" in v.message
    rebuilt = {"name": "sched", "type": "StepLR", "run": "B", "rank": 0, "field": "scheduler"}
    v = decide(PLAN, Evidence(replaced=(rebuilt,)))
    assert v.passed and "sched (StepLR) was rebuilt after run.restore() (run B, rank 0)" in v.message
    assert v.advice == "build sched before run.restore(state) and do not rebuild it after."


def test_a_computed_difference_in_a_module_points_at_the_state_it_reads() -> None:
    v = _parted("module", "module.layer1", origin="layer1")
    assert v.kind == "hidden-state" and v.advice.startswith("look at the state module layer1 reads")


def test_a_difference_no_rule_explains_is_a_divergence() -> None:
    v = _parted("counters", "counters.epoch")
    assert v.kind == "diverged" and v.message.startswith("resumed run diverges at step 4")


def test_a_batch_difference_is_explained_from_the_sample_indices() -> None:
    batch = StepEvidence(batch=True)
    v = _parted("data", "batch", batch, unregistered=(LOADER,))
    assert v.kind == "data" and "loader (DataLoader) is not registered in the TrainState" in v.message
    v = _parted("data", "batch", batch)
    assert "whether B drew the same samples as A cannot be told" in v.message
    other = StepEvidence(batch=True, indices=Indices(a="i1", b="i2", a_next="i3"))
    v = _parted("data", "batch", other)
    assert "data.indices differ) although the loader is registered" in v.message
    v = _parted("data", "batch", other, unregistered=(LOADER,))
    assert "(data.indices differ): loader (DataLoader) is not registered" in v.message


def test_a_replay_verdict_on_a_step_input_is_a_state_origin_without_a_rerun(tmp_path) -> None:
    verdict = SimpleNamespace(kind="rng", step=3, rank=1, site="rng.torch")
    walked = for_replay(verdict, Side(name="R1", target="x.py:train"), world=2, device="cpu", repeats=2,
                        workdir=str(tmp_path))
    assert walked.status == "state" and walked.origin is not None and walked.origin["rank"] == 1


def test_an_origin_op_whose_inputs_cannot_be_captured_leaves_the_origin_standing(tmp_path, monkeypatch) -> None:
    request = Walk(step=2, sides=(Side(name="A", target="x.py:train"), Side(name="B", target="x.py:train")))
    op = {"rank": 0, "op": "aten.mm", "phase": "forward", "module": "fc", "occurrence": 0}

    def kernel(origin: dict, launched: object) -> tuple[dict, object]:
        monkeypatch.setattr(launch, "launch_jobs", launched)
        return walk_mod._kernel(request, request.sides[0], origin, str(tmp_path), lambda _m: None, 1.0,
                                lambda *_a: RunConfig(name="capture"))

    entry, finding = kernel({**op, "rank": None}, None)
    assert entry["status"] == "not-captured" and "on several ranks" in entry["sentence"] and finding is None
    entry, finding = kernel(op, lambda *_a, **_k: None)
    assert entry["status"] == "not-captured" and finding.check == "locate-kernel-failed"
    assert "were not captured in a further run" in finding.message

    def crash(*_a: object, **_k: object) -> None:
        raise CkptVerifyError("boom")

    entry, finding = kernel(op, crash)
    assert entry["status"] == "failed"
    assert finding.message == "The origin op could not be re-run alone (CkptVerifyError: boom)."


@pytest.mark.parametrize("sites,said", [(["start.rng.torch", "batch"], "random stream rng.torch differs between them"),
                                        (["batch.x"], "their batches of step 4 differ"),
                                        (["metric.loss"], "the job is not deterministic")])
def test_differing_replays_name_where_their_nondeterminism_lies(monkeypatch, sites: list[str], said: str) -> None:
    monkeypatch.setattr(replay_causes, "sites_at", lambda _comparisons, _step: {0: sites})
    assert said in replay_causes.twin_cause([], 4)


def _case(s: int, **known: object) -> replay_causes._Case:
    """A replay case at step ``s`` (production restarted at step 2 from its checkpoint, or ran on past it), with
    ``known`` facts in place of those its traces would give."""
    case = replay_causes._Case(replay="r", start=2, world=1, ran_on=bool(known.pop("ran_on", False)),
                               where=lambda _r: "host h", s=s, comparisons=[], notes=known.pop("notes", {}))
    case.__dict__.update(known)
    return case


_LEAD = {0: SimpleNamespace(first=SimpleNamespace(rank=0, site="metric.loss"))}


def test_replay_rules_on_the_step_inputs() -> None:
    moved = SiteDiff("0.lr", 0.1, 0.2, a_moved=False, b_moved=True)
    v = replay_causes._hparam_start(_case(3, evidence={0: StepEvidence(hparams_start=(moved,))}))
    assert v is not None and v.kind == "changed-after-restore" and v.site == "optim.param_groups[0].lr"
    assert v.message.endswith("; this says nothing about the hardware.")
    used = SiteDiff("0.lr", 0.1, 0.2)
    v = replay_causes._step_hparams(_case(4, evidence={0: StepEvidence(hparams_step=(used,), sites=("hparam.0.lr",))}))
    assert v is not None and v.kind == "scheduler" and v.rank == 0
    traced = SimpleNamespace(has_site=lambda _site: True)
    v = replay_causes._data(_case(4, evidence={0: StepEvidence(batch=True, sites=("batch",))},
                                  pairs={0: (traced, traced)}))
    assert v is not None and v.kind == "data" and "the samples at the same position differ" in v.message


def test_replay_rules_when_a_computed_value_differs_but_the_inputs_may_not_be_equal() -> None:
    origin = ((0,), 0, None, "metric.loss")
    v = replay_causes._unregistered(_case(3, ran_on=True, notes={0: {"unregistered": [{"name": "ema"}]}},
                                          first=_LEAD))
    assert v is not None and v.kind == "unregistered-state" and "does not hold: ema" in v.message
    v = replay_causes._unregistered(_case(3, ran_on=True, notes={0: {"missing_optimizer": "none"}}, first=_LEAD))
    assert v is not None and "no optimizer is registered in the TrainState" in v.message
    untraced = SimpleNamespace(row_index=lambda _step: None)
    v = replay_causes._untraced_before(_case(5, pairs={0: (untraced, untraced)}, origin=origin))
    assert v is not None and v.kind == "undetermined" and "but step 4 is not traced" in v.message
    v = replay_causes._ran_on_from_memory(_case(3, ran_on=True, origin=origin))
    assert v is not None and v.kind == "undetermined" and "production ran on from memory" in v.message
