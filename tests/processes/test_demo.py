"""The README's first command: ``ckptverify demo`` on the built-in workload passes, and says what it checked."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.slow
@pytest.mark.timeout(1200)  # past the demo's own 900-second limit, which says more when it is reached
def test_the_demo_passes_and_every_step_reports(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "ckptverify", "demo", "--json", "--keep", str(tmp_path / "demo")],
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(done.stdout)
    assert report["passed"] and report["command"] == "demo"
    messages = " ".join(f["message"] for f in report["findings"])
    # The flipped bit is found, the correct workload resumes bitwise, the planted bug is diagnosed.
    assert "resume-equivalent" in messages and "not saved in the TrainState" in messages
    assert "flipped bit" in messages and "found: nothing" not in messages
    assert len(report["findings"]) == 4  # clean verify, damaged copy, correct workload, planted bug
    assert not [f for f in report["findings"] if f["severity"] != "info"]
