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

ROOT = Path(__file__).resolve().parent.parent


def _dry_run(script: str, out: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHON": sys.executable, "PYTHONPATH": str(ROOT), "PYTHONWARNINGS": "ignore"}
    return subprocess.run(["bash", str(ROOT / "scripts" / script), str(out), "--dry-run"], capture_output=True,
                          text=True, timeout=120, env=env, cwd=ROOT)


@pytest.mark.parametrize(("script", "parts"), [("gpu_check.sh", ["parity", "many", "throughput"]),
                                               ("gpu_check_multi.sh", ["devices", "save", "dtensor"])])
def test_the_gpu_check_script_dry_runs_every_part_on_the_cpu(script: str, parts: list[str], tmp_path: Path) -> None:
    done = _dry_run(script, tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "all parts passed" in done.stdout
    for name in parts:
        assert f"== {name}" in done.stdout
        assert (tmp_path / f"{name}.log").read_text().strip(), name
    assert "tests" not in [p.name.removesuffix(".log") for p in tmp_path.iterdir()]  # the GPU tests: not in a dry run


def test_a_gpu_check_part_that_fails_fails_the_script(tmp_path: Path) -> None:
    # An interpreter that fails every part: the script goes on to the next part, and says which ones failed.
    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\nexit 3\n")
    fake.chmod(0o755)
    env = {**os.environ, "PYTHON": str(fake)}
    done = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), str(tmp_path / "out"), "--dry-run"],
                          capture_output=True, text=True, timeout=60, env=env, cwd=ROOT)
    assert done.returncode == 1
    assert "FAILED: parity many throughput" in done.stdout
