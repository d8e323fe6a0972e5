"""Run ``resume-check`` on the language-model trainer of ``tests/user_scripts/llm_stream_train.py`` with one bug
planted (on rank 1, or on every rank), the way a user runs it, and read its JSON report."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

SCRIPT = Path(__file__).resolve().parents[1] / "user_scripts" / "llm_stream_train.py"


def resume_check(tmp_path: Path, *, plant: str = "", ranks: str = "all", parallel: str = "ddp", nproc: int = 2,
                 steps: int = 4, resume_at: int = 2, runs: str = "A,B", extra: tuple[str, ...] = ()
                 ) -> dict[str, Any]:
    """The JSON report of ``ckptverify resume-check --json`` on the trainer with ``PLANT=plant``; the command
    must finish with a verdict (exit 0 or 1) and print exactly one JSON document."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "PLANT": plant, "PLANT_RANKS": ranks,
           "PARALLEL": parallel}
    done = subprocess.run(
        [sys.executable, "-m", "ckptverify", "resume-check", f"{SCRIPT}:train", "--steps", str(steps),
         "--resume-at", str(resume_at), "--nproc", str(nproc), "--runs", runs, "--no-locate", "--json", *extra],
        capture_output=True, text=True, env=env, cwd=tmp_path, timeout=800)
    assert done.returncode in (0, 1), (done.stdout[-3000:], done.stderr[-3000:])
    report = json.loads(done.stdout)
    report["_stderr"] = done.stderr
    return report


def verdict(report: dict[str, Any]) -> dict[str, Any]:
    return report["stats"]["verdict"]


def receiver_ranks(report: dict[str, Any]) -> list[int]:
    return sorted(r["rank"] for r in verdict(report)["receivers"])


def checks(report: dict[str, Any], severity: str | None = None) -> list[str]:
    return [f["check"] for f in report["findings"] if severity is None or f["severity"] == severity]
