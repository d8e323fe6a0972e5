"""`replay --target` names a function as `resume-check` does (a relative FILE.py from the working directory, a
module from it too), compares the *function* with the one the run directory records, not its spelling, and
refuses a different one, or traces that could not be compared, before any process starts, in its own words."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from helpers.replay_jobs import losses_run

from ckptverify.cli import main
from ckptverify.errors import UsageError
from ckptverify.replay.replay import replay

SCRIPTS = Path(__file__).resolve().parents[1] / "user_scripts"
PRINTING = SCRIPTS / "printing_train.py"
#: Options no replay error may advise: they belong to other commands (trace diff) or to Python.
FOREIGN = ("--allow-header-mismatch", "force=True")


def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    return subprocess.run([sys.executable, "-m", "ckptverify", *args], capture_output=True, text=True, env=env,
                          cwd=cwd, timeout=600)


def _replay_options() -> set[str]:
    return {opt for p in main.commands["replay"].params for opt in (*p.opts, *p.secondary_opts)}


def _advice_is_replays_own(message: str) -> None:
    """Every ``--option`` a replay error names is one of replay's own, and nothing it names belongs elsewhere."""
    named = set(re.findall(r"(?<![\w-])--[a-z][a-z-]*", message))
    assert named <= _replay_options(), (named - _replay_options(), message)
    assert not any(foreign in message for foreign in FOREIGN), message


def _recorded_run(tmp_path: Path, script: Path, *, world: int = 1) -> Path:
    """A run directory as a production job of ``script`` leaves it: run.json naming its absolute path, and
    committed checkpoints of steps 3 and 6 (small DCP folders: nothing here runs the job)."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "run.json").write_text(json.dumps({"target": f"{script.resolve()}:train", "world_size": world,
                                              "level": "state", "steps": 6}))
    for step in (3, 6):
        dcp.save({"w": torch.full((4,), float(step))}, checkpoint_id=str(run / f"step_{step}"))
    return run


@pytest.fixture
def no_processes(monkeypatch: pytest.MonkeyPatch) -> None:
    """Any way of starting a process fails the test."""
    import multiprocessing.process

    import torch.multiprocessing

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("a process was started")

    monkeypatch.setattr(torch.multiprocessing, "start_processes", refuse)
    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", refuse)
    monkeypatch.setattr(subprocess.Popen, "__init__", refuse)


def _production_trace(run: Path, workload: str, **header: object) -> None:
    """Production's trace segment from step 0 (rank 0, one step), its header naming ``workload``."""
    from ckptverify.production.mode import segment_dir
    from ckptverify.trace import TraceHeader, TraceRecorder

    with TraceRecorder(segment_dir(str(run), 0), header=TraceHeader(run="production", level="state",
                                                                      workload=workload, **header)) as rec:
        rec.record_step(1, metrics={"loss": 1.0})


class _Launched(Exception):
    """Raised in place of the launch: what would have run."""


def test_a_relative_file_or_a_module_naming_the_recorded_function_replays_it_traced_as_recorded(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, no_processes: None) -> None:
    import ckptverify.resume.launch as launching

    script = tmp_path / "prod.py"
    script.write_text("def train(run):\n    run.restore(None)\n")
    run = _recorded_run(tmp_path, script)
    recorded = f"{script}:train"
    _production_trace(run, recorded)

    def launch(nproc: int, device: str, jobs: list, **kwargs: object) -> None:
        raise _Launched([(target, config.workload) for target, config in jobs])

    monkeypatch.setattr(launching, "launch_jobs", launch)  # the replays' launches, side by side or in turn
    monkeypatch.chdir(tmp_path)
    for spelling, runs in (("prod.py:train", recorded), ("./prod.py:train", recorded),
                           (f"{tmp_path}/../{tmp_path.name}/prod.py:train", recorded), ("prod:train", "prod:train")):
        with pytest.raises(_Launched) as caught:
            replay(run, target=spelling, start=3, end=6)
        # The function named runs; its trace says it is the function production recorded (headers agree).
        assert caught.value.args[0] == [(runs, recorded)], spelling


@pytest.mark.parametrize("named", ["prod.py:evaluate", "moved.py:train", "prod:evaluate"])
def test_another_function_is_refused_before_any_process_starts_naming_both(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, no_processes: None, named: str) -> None:
    script = tmp_path / "prod.py"
    script.write_text("def train(run):\n    run.restore(None)\n\n\ndef evaluate(run):\n    run.restore(None)\n")
    (tmp_path / "moved.py").write_text(script.read_text())
    run = _recorded_run(tmp_path, script)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UsageError) as caught:
        replay(run, target=named, start=3, end=6)
    message = str(caught.value)
    assert f"--target {named} names" in message and f"ran {script}:train" in message, message
    assert f"Pass --target {script}:train" in message and "nothing was started" in message
    _advice_is_replays_own(message)


@pytest.mark.parametrize("named", ["prod.py", "prod.py:", ":train"])
def test_a_malformed_target_is_refused_before_any_process_starts(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, no_processes: None, named: str) -> None:
    script = tmp_path / "prod.py"
    script.write_text("def train(run):\n    run.restore(None)\n")
    run = _recorded_run(tmp_path, script)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UsageError, match=r"target must be FILE\.py:FUNC or module:FUNC, got " + repr(named)):
        replay(run, target=named, start=3, end=6)


def test_a_recorded_file_that_is_not_on_this_machine_is_said_so(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                no_processes: None) -> None:
    script = tmp_path / "prod.py"
    script.write_text("def train(run):\n    run.restore(None)\n")
    run = _recorded_run(tmp_path, tmp_path / "elsewhere" / "prod.py")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UsageError, match=r"elsewhere/prod\.py is not on this machine"):
        replay(run, target="prod.py:train", start=3, end=6)


def test_traces_that_could_not_be_compared_are_refused_before_any_process_starts_in_replays_words(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, no_processes: None) -> None:
    script = tmp_path / "prod.py"
    script.write_text("def train(run):\n    run.restore(None)\n")
    run = _recorded_run(tmp_path, script)
    _production_trace(run, f"{script}:train", torch_version="1.0.0")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UsageError) as caught:
        replay(run, target="prod.py:train", start=3, end=6)
    message = str(caught.value)
    assert "torch_version: production '1.0.0', this replay" in message and "nothing was started" in message
    _advice_is_replays_own(message)


@pytest.mark.slow
def test_replay_with_a_relative_target_of_a_printing_script_reproduces_and_prints_one_json_document(
        tmp_path: Path) -> None:
    """The user report: a production job of a script that prints, replayed with the relative FILE.py:FUNC that
    resume-check accepts, from the script's folder."""
    run = tmp_path / "run"
    job = subprocess.run([sys.executable, str(PRINTING), "--run-dir", str(run), "--steps", "4", "--save-every", "2"],
                         capture_output=True, text=True, timeout=600, cwd=tmp_path,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert job.returncode == 0, job.stdout[-3000:] + job.stderr[-3000:]
    done = _cli("replay", str(run), "--target", f"{PRINTING.name}:train", "--json", "--no-locate", cwd=SCRIPTS)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(done.stdout)  # one document: the script's prints are elsewhere
    assert report["stats"]["verdict"]["kind"] == "reproduced", report["stats"]["verdict"]
    assert report["stats"]["target"] == f"{PRINTING}:train"
    assert "printing_train: module level, on stdout" in done.stderr
    logs = report["stats"]["logs"]
    assert "printing_train: step 4 loss" in Path(logs[0]).read_text()
    assert not any(f["severity"] != "info" for f in report["findings"]), report["findings"]


# ------------------------------------------------------------------------------------ the verdict's words


def test_a_suspected_fault_on_a_one_rank_job_says_nothing_about_other_ranks(tmp_path: Path,
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    from ckptverify.replay.causes import judge

    prod = losses_run(tmp_path / "prod", {0: {4: 1.0, 5: 2.0}}, 1, monkeypatch, level="state")
    rep = losses_run(tmp_path / "rep", {0: {4: 1.0, 5: 2.5}}, 1, monkeypatch, level="state")
    j = judge(prod, rep, start=3, end=5, world=1, production_start=3)
    assert (j.kind, j.step, j.rank) == ("hardware-fault-suspected", 5, 0), j
    assert "agreed" not in j.message and "other ranks" not in j.message and "none" not in j.message, j.message


def test_a_suspected_fault_on_several_ranks_names_the_ranks_that_agreed(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    from ckptverify.replay.causes import judge

    prod = losses_run(tmp_path / "prod", {0: {4: 1.0, 5: 2.0}, 1: {4: 1.5, 5: 2.5}, 2: {4: 1.0, 5: 2.0}}, 3,
                      monkeypatch, level="state")
    rep = losses_run(tmp_path / "rep", {0: {4: 1.0, 5: 2.0}, 1: {4: 1.5, 5: 2.25}, 2: {4: 1.0, 5: 2.0}}, 3,
                     monkeypatch, level="state")
    j = judge(prod, rep, start=3, end=5, world=3, production_start=3)
    assert (j.kind, j.rank) == ("hardware-fault-suspected", 1), j
    assert "the other ranks (0, 2) computed the step exactly as the replays did" in j.message, j.message
