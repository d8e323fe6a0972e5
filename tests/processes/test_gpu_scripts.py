"""The GPU check scripts run: their dry run (CPU, tiny sizes) goes through every Python part they run on GPUs.

scripts/gpu_check.sh (one GPU) and scripts/gpu_check_multi.sh (two or more) are run on GPU machines only; the
dry run here proves on every CI run that they start, parse and check what they claim, so a GPU session is not
spent on a script that breaks at its first line.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _dry_run(script: str, out: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHON": sys.executable, "PYTHONPATH": str(ROOT), "PYTHONWARNINGS": "ignore"}
    return subprocess.run(["bash", str(ROOT / "scripts" / script), str(out), "--dry-run"], capture_output=True,
                          text=True, timeout=120, env=env, cwd=ROOT)


@pytest.mark.parametrize(("script", "parts"), [
    ("gpu_check.sh", ["parity", "many", "throughput", "train", "saveload"]),
    ("gpu_check_multi.sh", ["devices", "save", "dtensor", "remap"]),
])
def test_the_gpu_check_script_dry_runs_every_part_on_the_cpu(script: str, parts: list[str], tmp_path: Path) -> None:
    done = _dry_run(script, tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "all parts passed" in done.stdout
    for name in parts:
        assert f"== {name}" in done.stdout
        assert (tmp_path / f"{name}.log").read_text().strip(), name
    assert "tests" not in [p.name.removesuffix(".log") for p in tmp_path.iterdir()]  # the GPU tests: not in a dry run
    logs = {name: (tmp_path / f"{name}.log").read_text() for name in parts}
    if script == "gpu_check.sh":
        for level in ("none", "state", "comm"):  # one summary line per trace level, each level traced as asked
            assert f"train level {level:<5}: step " in logs["train"], logs["train"]
        assert "comm.*" in logs["train"] and "(0 comm.*)" not in logs["train"].split("train level comm")[1]
        assert "restored equal" in logs["saveload"]
    else:
        assert "remap load-same: loaded on cpu" in logs["remap"] and "CUDA parts skipped" in logs["remap"]


def test_a_gpu_check_part_that_fails_fails_the_script(tmp_path: Path) -> None:
    # An interpreter that fails every part: the script goes on to the next part, and says which ones failed.
    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\nexit 3\n")
    fake.chmod(0o755)
    env = {**os.environ, "PYTHON": str(fake)}
    done = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), str(tmp_path / "out"), "--dry-run"],
                          capture_output=True, text=True, timeout=60, env=env, cwd=ROOT)
    assert done.returncode == 1
    assert "FAILED: parity many throughput train saveload" in done.stdout


def test_a_training_level_that_crashes_fails_the_train_part() -> None:
    # One level raises: the others still run and print their line, the crashed one says so, and the part fails.
    code = """if True:
        import sys
        sys.path.insert(0, "scripts")
        import gpu_train_check as g
        real = g._train_level
        def crashing(level, *args):
            if level == "state":
                raise RuntimeError("planted crash")
            return real(level, *args)
        g._train_level = crashing
        sys.exit(g.main(["--part", "train", "--dry-run", "--steps", "1,1,1"]))
    """
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONWARNINGS": "ignore"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env, cwd=ROOT)
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-3000:]
    assert "train level state: CRASHED" in done.stdout
    assert "planted crash" in done.stderr
    for level in ("none", "comm"):
        assert f"train level {level:<5}: step " in done.stdout
    assert "FAIL: train levels state" in done.stdout
