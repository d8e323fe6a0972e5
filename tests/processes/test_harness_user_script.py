"""The harness runs training scripts as users write them, and says plainly when it cannot.

The scripts (``tests/user_scripts/harness_*.py``) define their own Dataset with random augmentation and read it
through a DataLoader with worker processes, train with AdamW, an LR scheduler, gradient clipping and dropout, keep
an EMA (registered or not), and end with an ``if __name__ == "__main__":`` block. What a verdict says about them
is judged elsewhere (tests/processes/test_diagnosis.py); here: they run under ``resume-check`` and ``replay`` on 1 and 2
ranks to a verdict, their output is labelled or kept out of the JSON, and usage errors come before any process
starts, as the user's own traceback.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from helpers.inproc_cli import invoke

from ckptverify.errors import CkptVerifyError, UsageError
from ckptverify.replay.replay import VERDICTS as REPLAY_VERDICTS
from ckptverify.resume.harness import Plan, resume_check

SCRIPTS = Path(__file__).resolve().parents[1] / "user_scripts"
AUGMENT = SCRIPTS / "harness_augment.py"
#: Where the harness's own frames would show (they must not, in anything shown for the user's code).
OURS = os.path.join("ckptverify", "resume", "")
VERDICT_KINDS = {"pass", "restore-mismatch", "nondeterministic", "rng", "changed-after-restore", "changed-after-save",
                 "scheduler", "data", "hidden-state", "unregistered-state", "diverged"}


def _cli(*args: str, cwd: Path, timeout: int = 900) -> subprocess.CompletedProcess[str]:
    """A real ``python -m ckptverify``: for what its ranks write to descriptors 1 and 2 (labelled lines, a JSON
    stdout kept clean of the script's prints), which an in-process run would not show."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    return subprocess.run([sys.executable, "-m", "ckptverify", *args], capture_output=True, text=True, env=env,
                          cwd=cwd, timeout=timeout)


def _no_crash(done: subprocess.CompletedProcess[str]) -> None:
    both = done.stdout + done.stderr
    assert done.returncode in (0, 1), both[-4000:]
    assert "ModuleNotFoundError" not in both and "Traceback" not in both, both[-4000:]


def _step_lines(out: str) -> dict[str, list[int]]:
    """Labelled step lines of the script (``[A r1] step 3 loss 1.2345``), by label; any step line that is not
    whole and labelled fails."""
    seen: dict[str, list[int]] = {}
    for line in out.splitlines():
        if "loss" not in line or "│" in line or "verdict" in line:
            continue
        m = re.fullmatch(r"\[(A|A2|B)( r[01])?\] step (\d+) loss \d+\.\d{4}", line)
        assert m, f"not a whole, labelled line: {line!r}"
        seen.setdefault(m.group(1) + (m.group(2) or ""), []).append(int(m.group(3)))
    return seen


# ------------------------------------------------------------------------------------------ runs to a verdict


@pytest.mark.slow
def test_resume_check_runs_a_script_with_its_own_dataset_and_spawned_workers_and_labels_its_lines(tmp_path):
    """DataLoader workers started by spawn (the default inside the harness's ranks) unpickle the script's own
    Dataset class; A and A2 run side by side, and every line of theirs and B's says whose it is."""
    done = _cli("resume-check", "--no-locate", f"{AUGMENT}:train", "--steps", "4", "--resume-at", "2", cwd=tmp_path)
    _no_crash(done)
    assert "verdict:" in done.stdout
    steps = _step_lines(done.stdout)
    assert steps == {"A": [1, 2, 3, 4], "A2": [1, 2, 3, 4], "B": [3, 4]}, steps
    assert "[A] starting rank 0 of 1" in done.stdout and "[B] starting rank 0 of 1" in done.stdout


@pytest.mark.slow
def test_resume_check_runs_the_script_under_ddp_on_two_ranks(tmp_path):
    done = _cli("resume-check", "--no-locate", f"{AUGMENT}:train", "--steps", "3", "--resume-at", "1", "--nproc", "2",
                "--runs", "A,B", "--level", "metrics", cwd=tmp_path)
    _no_crash(done)
    assert "verdict:" in done.stdout
    steps = _step_lines(done.stdout)
    assert steps == {"A r0": [1, 2, 3], "A r1": [1, 2, 3], "B r0": [2, 3], "B r1": [2, 3]}, steps
    assert "[A r1] starting rank 1 of 2" in done.stdout


@pytest.mark.slow
def test_a_module_target_with_forked_stateful_loader_workers_runs(tmp_path, monkeypatch):
    """``module:func`` found as ``python -m`` finds it (the working directory), a dataclass config and a
    ``worker_init_fn`` defined in the script, torchdata's StatefulDataLoader with forked workers."""
    monkeypatch.chdir(SCRIPTS)
    # Found through the working directory only (another test module may have put this folder on sys.path).
    monkeypatch.setattr(sys, "path", [p for p in sys.path if os.path.abspath(p or ".") != str(SCRIPTS.resolve())])
    monkeypatch.delitem(sys.modules, "harness_stateful", raising=False)
    outcome = resume_check(Plan(target="harness_stateful:train", steps=3, resume_at=1, runs=("A", "B"),
                                level="metrics"))
    assert outcome.verdict.kind in VERDICT_KINDS
    assert "harness_stateful" not in sys.modules  # checked in this process, then forgotten


@pytest.mark.slow
def test_replay_of_a_production_run_of_the_script_gives_a_verdict_and_json_stays_clean(tmp_path):
    run = tmp_path / "run"
    job = subprocess.run([sys.executable, str(AUGMENT), "--run-dir", str(run), "--steps", "4", "--save-every", "2"],
                         capture_output=True, text=True, timeout=600, cwd=tmp_path,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert job.returncode == 0, job.stdout[-3000:] + job.stderr[-3000:]
    assert "step 4 loss" in job.stdout
    done = _cli("replay", "--no-locate", str(run), "--json", "--target", f"{AUGMENT.resolve()}:train", cwd=tmp_path)
    assert done.returncode in (0, 1), done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(done.stdout)  # the script's prints are not in it
    assert report["stats"]["verdict"]["kind"] in REPLAY_VERDICTS
    logs = report["stats"]["logs"]
    assert sorted(os.path.basename(p) for p in logs) == ["R1-rank0.log", "R2-rank0.log"]
    assert "step 4 loss" in Path(logs[0]).read_text()
    assert "ModuleNotFoundError" not in done.stderr


# ------------------------------------------------------------------------------------------ usage errors

_IMPORT_ERROR = '''
import torch


def build_vocab():
    return torch.zeros(3).nonexistent_attribute


VOCAB = build_vocab()


def train(run):
    pass
'''

_NO_RESTORE = '''
import torch


def train(run):
    model = torch.nn.Linear(2, 1)
    for step in run.steps():
        run.record(loss=model(torch.ones(2)).sum())


if __name__ == "__main__":
    raise SystemExit("the __main__ block must not run")
'''

_TWO_ARGS = '''
def train(run, config):
    pass
'''

# (script source, target function, what the message holds: the user's file and line, or the reason)
USAGE = {
    "import-error": (_IMPORT_ERROR, "train", ['line 6, in build_vocab', "nonexistent_attribute",
                                              "line 9, in <module>", "Traceback (most recent call last):"]),
    "misspelled": (_IMPORT_ERROR.replace("VOCAB = build_vocab()", ""), "trian",
                   ["has no function 'trian'; did you mean 'train'?", "line 12, in train"]),
    "missing-file": (None, "train", ["workload file not found"]),
    "never-restores": (_NO_RESTORE, "train", ["never calls run.restore(state)", "line 5, in train"]),
    "two-arguments": (_TWO_ARGS, "train", ["must take one argument", "line 2, in train"]),
}


@pytest.mark.parametrize("case", sorted(USAGE))
def test_usage_errors_come_before_any_process_starts_as_the_users_traceback(case, tmp_path, monkeypatch):
    import multiprocessing.process

    import torch.multiprocessing

    source, func, expected = USAGE[case]
    script = tmp_path / "train.py"
    if source is not None:
        script.write_text(source)
    target = f"{script}:{func}"

    def no_processes(*args, **kwargs):
        raise AssertionError("a process was started")

    # Any way of starting a process (torch's launcher, multiprocessing, a subprocess) fails the test.
    monkeypatch.setattr(torch.multiprocessing, "start_processes", no_processes)
    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", no_processes)
    monkeypatch.setattr(subprocess.Popen, "__init__", no_processes)
    with pytest.raises(UsageError) as caught:
        resume_check(Plan(target=target, steps=3, resume_at=1), keep=str(tmp_path / "work"))
    message = str(caught.value)
    for part in expected:
        assert part in message, message
    assert OURS not in message and not (tmp_path / "work").exists()

    # The command, in this process with processes still refused: its words and exit code are the point, and it
    # must start nothing either.
    done = invoke("resume-check", "--no-locate", target, "--steps", "3", "--resume-at", "1",
                  "--keep", str(tmp_path / "work"), cwd=tmp_path)
    assert done.returncode == 2, done.stdout + done.stderr
    lines = done.stderr.splitlines()
    assert lines[0].startswith("ckptverify resume-check: error: ")
    if source is not None:
        assert any(line.startswith(f'  File "{script}", line ') for line in lines), done.stderr
    assert "\\n" not in done.stderr and OURS not in done.stderr and done.stdout == ""
    assert not (tmp_path / "work").exists()  # no run was started
    json_done = invoke("resume-check", "--no-locate", target, "--steps", "3", "--resume-at", "1", "--json",
                       cwd=tmp_path)
    assert json_done.returncode == 2 and json.loads(json_done.stdout)["error"] == message


@pytest.mark.slow
def test_a_function_that_hands_run_to_a_helper_and_never_restores_is_named_at_its_first_checkpoint(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent('''
        import torch


        def loop(run, model):
            for step in run.steps():
                run.record(loss=model(torch.ones(2)).sum())


        def train(run):
            loop(run, torch.nn.Linear(2, 1))
    '''))
    with pytest.raises(UsageError, match=r"train\.py:train never calls run\.restore\(state\)"):
        resume_check(Plan(target=f"{script}:train", steps=3, resume_at=1, runs=("A",)))


@pytest.mark.slow
def test_a_crash_shows_the_users_traceback_on_several_lines_without_the_harness(tmp_path):
    script = tmp_path / "crashy.py"
    script.write_text(textwrap.dedent('''
        def forward(x):
            return x / 0


        def train(run):
            forward(1)
    '''))
    with pytest.raises(CkptVerifyError) as caught:
        resume_check(Plan(target=f"{script}:train", steps=3, resume_at=1, runs=("A",)))
    text = str(caught.value)
    assert text.startswith("the workload crashed in run A (rank 0):\nTraceback (most recent call last):\n"
                           f'  File "{script}", line 7, in train\n'), text
    assert "ZeroDivisionError: division by zero" in text and OURS not in text
    # In this process: the words the command prints for the crash are the point (the rank's traceback comes back
    # to the launcher, which prints it).
    done = invoke("resume-check", "--no-locate", f"{script}:train", "--steps", "3", "--resume-at", "1", "--runs",
                  "A", cwd=tmp_path)
    assert done.returncode == 2 and "\\n" not in done.stderr
    assert f'  File "{script}", line 3, in forward' in done.stderr.splitlines(), done.stderr


# ------------------------------------------------------------------------------------------ output labels


def test_labelled_output_writes_whole_lines_from_this_process_and_its_children(tmp_path):
    code = textwrap.dedent('''
        import os, subprocess, sys
        from ckptverify.resume.harness_output import LabelledOutput, label
        with LabelledOutput(label("A2", 1, 2)):
            os.write(1, b"par")
            os.write(1, b"tial\\nsecond")
            print(" line", flush=True)
            print("to stderr", file=sys.stderr)
            subprocess.run([sys.executable, "-c", "print('from a child')"], check=True)
            sys.stdout.write("unterminated")
        print("after")
    ''')
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["[A2 r1] partial", "[A2 r1] second line", "[A2 r1] from a child",
                                        "[A2 r1] unterminated", "after"]
    assert done.stderr.splitlines() == ["[A2 r1] to stderr"]
