"""``verify --readers N`` when a rank dies or fails in the middle of reading its share: the command ends with exit 2
and one line naming the rank and saying the verification is incomplete; never a pass, never a hang, and no rank
outlives it."""

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
from helpers.multiproc import process_gone

ROOT = Path(__file__).resolve().parents[2]
#: Generous: two ranks and their start-up on a busy 2-core machine; a hang fails the test instead of the run.
TIMEOUT = 300


def _env(fault: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "TORCHELASTIC_", "CKPTVERIFY_")) and k not in ("RANK", "WORLD_SIZE")}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env["CKPTVERIFY_TEST_RANK_FAULT"] = fault  # struck by rank 1 once it has read its first unit
    return env


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Large enough that each rank reads several units: rank 1 is stopped with part of its share unread."""
    path = tmp_path_factory.mktemp("readers") / "ckpt"
    g = torch.Generator().manual_seed(0)
    state = {f"layers.{i}.weight": torch.randn(512 * 1024 + 37 * i, generator=g) for i in range(12)}
    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(path), thread_count=4))
    return path


def _verify(path: Path, fault: str, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "ckptverify", "verify", str(path), "--readers", "2", "--jobs", "1",
                           "--rank-timeout", "60", *extra], capture_output=True, text=True, timeout=TIMEOUT,
                          cwd=ROOT, env=_env(fault))


def test_a_rank_killed_while_reading_ends_verify_with_exit_2_naming_it(checkpoint: Path) -> None:
    proc = _verify(checkpoint, "1:kill-reading")
    assert proc.returncode == 2, (proc.stdout, proc.stderr[-2000:])
    assert proc.stdout == "" and "Traceback" not in proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    assert "rank 1 on " in line and "was killed by signal 9 (SIGKILL)" in line, proc.stderr[-3000:]
    assert "the verification is incomplete" in line, line
    assert process_gone(int(re.search(r"pid (\d+)", line).group(1)))  # type: ignore[union-attr]


def test_a_rank_killed_while_reading_is_a_json_error_not_a_report(checkpoint: Path) -> None:
    proc = _verify(checkpoint, "1:kill-reading", "--json")
    assert proc.returncode == 2, proc.stderr[-2000:]
    text = json.dumps(json.loads(proc.stdout))
    assert "rank 1 on" in text and "the verification is incomplete" in text and '"passed": true' not in text


def test_a_rank_whose_read_raises_ends_verify_with_exit_2_naming_it(checkpoint: Path) -> None:
    proc = _verify(checkpoint, "1:raise")
    assert proc.returncode == 2, (proc.stdout, proc.stderr[-2000:])
    assert proc.stdout == "" and "Traceback" not in proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    assert "rank 1 on " in line and "could not read its share: RuntimeError: fault planted" in line, line
    assert "the verification is incomplete" in line, line
