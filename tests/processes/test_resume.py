"""Resume equivalence: the harness reaches the right verdict for every planted bug, on 1 and 2 ranks."""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

import pytest
from click.testing import CliRunner

from ckptverify.cli import main
from ckptverify.errors import CkptVerifyError
from ckptverify.resume.harness import Outcome, Plan, resume_check, resume_check_many

WORKLOADS = "ckptverify.examples.workloads"


# The verdict of every built-in and planted workload on 1 and 2 ranks: tests/processes/test_diagnosis.py (one launch per
# run for all of them).


@pytest.fixture(scope="module")
def checked(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[Outcome]]:
    """The plans of the tests below, checked together with one launch per run (``resume_check_many``: each plan
    its own runs, checkpoints, traces and verdict; only process start-up shared), their work kept in
    ``<root>/<i>``: 0, a nondeterministic run at level module; 1, a data bug; 2 and 3, a correct workload traced
    at levels metrics and state (run A alone: only its trace is read)."""
    root = tmp_path_factory.mktemp("checked")
    outcomes = resume_check_many([
        Plan(target=f"{WORKLOADS}:rng_not_restored", steps=4, resume_at=2, level="module", runs=("A", "B")),
        Plan(target=f"{WORKLOADS}:data_not_restored", steps=5, resume_at=3, runs=("A", "B")),
        Plan(target=f"{WORKLOADS}:correct", steps=3, resume_at=1, runs=("A",), level="metrics"),
        Plan(target=f"{WORKLOADS}:correct", steps=3, resume_at=1, runs=("A",), level="state"),
    ], keep=str(root))
    return root, outcomes


def test_module_level_names_the_origin_module_of_a_nondeterministic_run(checked):
    outcome = checked[1][0]
    assert outcome.verdict.kind == "rng"
    assert outcome.verdict.site.startswith(("module.", "rng.", "metric."))


def test_first_divergence_of_a_data_bug_is_the_first_resumed_step(checked):
    outcome, work = checked[1][1], checked[0] / "1"
    assert outcome.verdict.step == 4 and outcome.verdict.category == "data"
    # The kept traces compare with `trace diff` too; identical traces pass.
    runner = CliRunner()
    same = runner.invoke(main, ["trace", "diff", str(work / "A" / "trace"), str(work / "A" / "trace")])
    assert same.exit_code == 0, same.output
    differ = runner.invoke(main, ["trace", "diff", "--json", str(work / "A" / "trace"),
                                  str(work / "B" / "trace")])
    assert differ.exit_code == 1
    assert any(f["check"] == "trace-incomplete" or f["check"] == "trace-divergence"
               for f in json.loads(differ.output)["findings"])


def test_trace_diff_refuses_different_headers_unless_allowed(checked):
    runner = CliRunner()
    a, b = str(checked[0] / "2" / "A" / "trace"), str(checked[0] / "3" / "A" / "trace")  # levels metrics, state
    assert runner.invoke(main, ["trace", "diff", a, b]).exit_code == 2
    assert runner.invoke(main, ["trace", "diff", "--allow-header-mismatch", a, b]).exit_code == 0


def test_a_crashing_workload_is_exit_2_with_its_traceback(tmp_path):
    script = tmp_path / "crashy.py"
    script.write_text(textwrap.dedent("""
        def train(run):
            raise RuntimeError("the workload fell over")
    """))
    with pytest.raises(CkptVerifyError, match="the workload fell over"):
        resume_check(Plan(target=f"{script}:train", steps=3, resume_at=1, runs=("A",)))
    result = CliRunner().invoke(main, ["resume-check", "--no-locate", f"{script}:train", "--steps", "3",
                                       "--resume-at", "1"])
    assert result.exit_code == 2
    assert "the workload fell over" in result.output


def test_bad_arguments_are_exit_2():
    runner = CliRunner()
    assert runner.invoke(main, ["resume-check", f"{WORKLOADS}:correct", "--steps", "3",
                                "--resume-at", "3"]).exit_code == 2
    assert runner.invoke(main, ["resume-check", "no_colon", "--steps", "3", "--resume-at", "1"]).exit_code == 2
    assert runner.invoke(main, ["resume-check", f"{WORKLOADS}:nope", "--steps", "3",
                                "--resume-at", "1"]).exit_code == 2


def test_the_run_protocol_runs_plainly_without_the_harness(tmp_path, monkeypatch):
    from ckptverify.resume.run import Run

    # A variable of the same name as the one earlier versions passed the harness's plan in changes nothing.
    monkeypatch.setenv("CKPTVERIFY_RUN", '{"stop_step": 1}')
    seen = []

    def train(run: Run) -> None:
        for step in run.steps():
            seen.append(step)
            run.record(loss=float(step))

    Run.main(train, steps=4)
    assert seen == [1, 2, 3, 4]
    assert sys.modules["ckptverify.resume.run"] is not None


def test_a_torchrun_style_script_adopts_unchanged_and_json_stdout_stays_clean(tmp_path):
    """The script imports a sibling module, prints, creates and destroys its own process group (as a torchrun
    script does), on 2 ranks; `--json` prints only JSON and names the per-rank logs holding the prints."""
    import os
    import subprocess

    project = tmp_path / "project"
    project.mkdir()
    (project / "helper.py").write_text("SCALE = 0.5\n")
    (project / "train.py").write_text(textwrap.dedent("""
        import os
        import sys

        import torch
        import torch.distributed as dist

        import ckptverify as cv
        from helper import SCALE


        def train(run):
            if int(os.environ.get("RANK", -1)) != -1:
                dist.init_process_group("gloo")  # the harness's group already exists: tolerated
            print("hello from rank", run.rank)
            print("warming up", file=sys.stderr)
            torch.manual_seed(0)
            model = torch.nn.Linear(4, 1)
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            run.restore(cv.TrainState(model=model, optimizer=opt))
            for step in run.steps():
                x = torch.full((2, 4), float(step))
                loss = (model(x) * SCALE).pow(2).mean()
                loss.backward()
                opt.step()
                opt.zero_grad()
                run.record(loss=loss)
            dist.destroy_process_group()
    """))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run([sys.executable, "-m", "ckptverify", "resume-check", "--no-locate",
                           f"{project / 'train.py'}:train",
                           "--steps", "3", "--resume-at", "1", "--runs", "A,B", "--nproc", "2", "--json",
                           "--keep", str(tmp_path / "work")], capture_output=True, text=True, env=env,
                          cwd=tmp_path, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(done.stdout)
    assert report["stats"]["verdict"]["kind"] == "pass"
    logs = report["stats"]["logs"]
    assert sorted(os.path.basename(p) for p in logs) == ["A-rank0.log", "A-rank1.log", "B-rank0.log", "B-rank1.log"]
    text = Path(next(p for p in logs if p.endswith("B-rank1.log"))).read_text()
    assert "hello from rank 1" in text and "warming up" in text


def test_text_output_ends_with_the_verdict_and_escapes_names(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("from ckptverify.examples.workloads import data_not_restored as train\n")
    result = CliRunner().invoke(main, ["resume-check", "--no-locate", f"{script}:train", "--steps", "4",
                                       "--resume-at", "2",
                                       "--runs", "A,B"])
    assert result.exit_code == 1, result.output
    out = result.output
    assert "train.py:train" in out.replace("\n", "") and "\U0001f68b" not in out  # not the :train: emoji
    tail = out[out.rindex("verdict: data (step 3 · rank 0"):]
    assert "What to do:" in tail and "│" not in tail and "FAILED" not in tail
    # Final-state differences fold into one row.
    assert out.count("diff-tensor") <= 3


def test_train_state_refuses_an_unsupported_loader_when_created():
    import torch
    from torch.utils.data import DataLoader

    from ckptverify.errors import UsageError
    from ckptverify.state.train_state import TrainState

    with pytest.raises(UsageError, match="cannot save the position"):
        TrainState(model=torch.nn.Linear(2, 2), dataloader=DataLoader(list(range(8)), batch_size=2))
