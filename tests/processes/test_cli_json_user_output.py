"""With ``--json``, stdout is exactly one JSON document whatever the user's training file prints, at import (the
target is checked in the command's own process) or while it trains (each rank's output, the locate walk's
re-runs included, goes to the log files the report names), on every command that runs user code."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from ckptverify.resume.harness_target import check_target

SCRIPTS = Path(__file__).resolve().parents[1] / "user_scripts"
PRINTING = SCRIPTS / "printing_train.py"
MODULE_LINE = "printing_train: module level, on stdout"


def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    return subprocess.run([sys.executable, "-m", "ckptverify", *args], capture_output=True, text=True, env=env,
                          cwd=cwd, timeout=600)


def _one_document(done: subprocess.CompletedProcess[str]) -> dict:
    report = json.loads(done.stdout)  # raises on anything but one JSON document
    assert MODULE_LINE in done.stderr, done.stderr[-2000:]
    logs = report["stats"]["logs"]
    assert logs and all("printing_train: step" in Path(p).read_text() for p in logs if "rank0" in p), logs
    return report


def test_checking_a_target_sends_what_its_module_prints_to_stderr(tmp_path: Path,
                                                                 capfd: pytest.CaptureFixture[str]) -> None:
    script = tmp_path / "noisy.py"
    script.write_text(textwrap.dedent('''
        import os
        import sys

        print("print at import")
        sys.stdout.write("a write at import\\n")
        os.write(1, b"a descriptor write at import\\n")


        def train(run):
            run.restore(None)
    '''))
    assert check_target(f"{script}:train") == str(script)
    print("the command's own output")
    out, err = capfd.readouterr()
    assert out == "the command's own output\n", out
    assert "print at import" in err and "a write at import" in err and "a descriptor write at import" in err


@pytest.mark.slow
def test_resume_check_json_is_one_document_when_the_script_prints(tmp_path: Path) -> None:
    done = _cli("resume-check", f"{PRINTING.name}:train", "--steps", "2", "--resume-at", "1", "--runs", "A,B",
                "--json", cwd=SCRIPTS)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert _one_document(done)["stats"]["verdict"]["kind"] == "pass"


@pytest.mark.slow
def test_compare_json_is_one_document_when_the_script_prints_the_locate_walk_included(tmp_path: Path) -> None:
    done = _cli("compare", f"{PRINTING.name}:train", f"{PRINTING.name}:train_changed", "--steps", "2",
                "--locate-repeats", "1", "--json", cwd=SCRIPTS)
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-3000:]
    report = _one_document(done)
    assert report["stats"]["verdict"]["kind"] == "effect", report["stats"]["verdict"]
    # The walk re-ran the differing step of both sides; their output is in logs of their own.
    names = sorted(os.path.basename(p) for p in report["stats"]["logs"])
    assert "base-0-rank0.log" in names and "changed-0-rank0.log" in names, names
