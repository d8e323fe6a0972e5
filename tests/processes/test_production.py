"""Production mode and replay: a real job saves, traces and watches its replicas; replay judges the hardware.

The job is `tests/user_scripts/production_workload.py`, a DDP script written the way users write one, started as
users start it (`python` for 1 rank, `torchrun` for 2). Faults are planted with the documented `--fault` hook.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import faults as inj

from ckptverify.hardware.inject import BitFlip
from ckptverify.ownfiles.events import read_events
from ckptverify.replay.replay import replay
from ckptverify.runs.stamp import read_stamp

SCRIPT = Path(__file__).resolve().parents[1] / "user_scripts" / "production_workload.py"
#: What a replay runs: the function run.json records, named by the caller (a run directory is data).
TARGET = f"{SCRIPT.resolve()}:train"
SITE = "blocks.0.mlp.fc.weight"


def _job(run_dir: Path, *, steps: int = 6, save_every: int = 3, nproc: int = 1, fault: BitFlip | None = None,
         env: dict[str, str] | None = None) -> None:
    args = [str(SCRIPT), "--run-dir", str(run_dir), "--steps", str(steps), "--save-every", str(save_every)]
    if fault is not None:
        args += ["--fault", fault.to_json()]
    launcher = [sys.executable] if nproc == 1 else [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                                    f"--nproc_per_node={nproc}"]
    done = subprocess.run(launcher + args, capture_output=True, text=True, timeout=600,
                          env={**os.environ, **(env or {})})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


@pytest.fixture(scope="module")
def six_steps(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A clean 6-step job (saving every 3 steps), the start of two tests, run once: ``"original"`` is its run
    directory, for the test that resumes it from its newest checkpoint's current stamp (a stamp is of the files'
    inodes too); ``"copy"`` a copy of it, for the test that corrupts that checkpoint (its stamp stale either way)."""
    base = tmp_path_factory.mktemp("six-steps")
    _job(base / "original")
    shutil.copytree(base / "original", base / "copy", symlinks=True)
    return {"original": base / "original", "copy": base / "copy"}


@pytest.mark.slow
def test_a_production_job_saves_traces_resumes_and_replays_as_reproduced(six_steps: dict[str, Path]) -> None:
    run = six_steps["original"]  # a clean 6-step job's run directory, as the job left it
    assert sorted(p.name for p in run.iterdir() if p.name.startswith("step_")) == ["step_3", "step_6"]
    meta = json.loads((run / "run.json").read_text())
    assert meta["target"].endswith("production_workload.py:train") and meta["world_size"] == 1
    verification = ("checkpoint-verified", "checkpoint-failed", "checkpoint-unverified", "checkpoint-deleted",
                    "checkpoint-cut-short")
    assert [e["event"] for e in read_events(run) if e["event"] not in verification] == ["start", "save", "save", "end"]
    host = json.loads((run / "trace" / "from-00000000" / "host-rank0.json").read_text())
    assert host["hostname"] and host["device"]["type"] == "cpu" and "determinism" in host
    # Restarted with more steps, the job resumes from its newest verified checkpoint, in a new trace segment.
    _job(run, steps=9)
    restore = next(read_events(run, "restore"))
    assert restore["step"] == 6 and restore["resumed_from"].endswith("step_6")
    assert (run / "trace" / "from-00000006").is_dir() and (run / "step_9").is_dir()
    report = replay(run, target=TARGET)  # the two newest verified checkpoints: 6 -> 9
    verdict = report.stats["verdict"]
    assert report.exit_code == 0 and verdict["kind"] == "reproduced", verdict
    assert (report.stats["from"], report.stats["to"]) == (6, 9)
    assert {c.check for c in report.coverage} >= {"replay-twins", "replay-production"}


def _stamped(run: Path, steps: list[int]) -> None:
    """Every checkpoint saved carries a current passed stamp and a `verified` event of rank 0, before `end`."""
    for step in steps:
        stamp = read_stamp(run / f"step_{step}")
        assert stamp is not None and stamp.current and stamp.passed and stamp.step == step
    names = [e["event"] for e in read_events(run)]
    verified = list(read_events(run, "checkpoint-verified"))
    assert sorted(e["step"] for e in verified) == steps and {e["rank"] for e in verified} == {0}
    assert names.index("end") > max(i for i, n in enumerate(names) if n == "checkpoint-verified")
    assert not [n for n in names if n in ("checkpoint-failed", "checkpoint-unverified", "checkpoint-cut-short")]


@pytest.mark.slow
def test_production_verifies_every_checkpoint_in_the_background_and_resumes_from_a_verified_one(
        tmp_path: Path) -> None:
    run = tmp_path / "run"
    _job(run, steps=6, save_every=2)
    _stamped(run, [2, 4, 6])
    # The newest is damaged after its verification: the restarted job skips it and resumes from step 4.
    inj.flip_in_tensor_payload(run / "step_6", "model.blocks.0.mlp.fc.weight")
    _job(run, steps=8, save_every=2)
    restore = next(read_events(run, "restore"))
    assert restore["step"] == 4 and restore["resumed_from"].endswith("step_4")
    assert read_stamp(run / "step_8").passed and read_stamp(run / "step_6").passed  # step_6 saved anew


@pytest.mark.slow
def test_a_flipped_gradient_bit_is_named_by_replay(tmp_path: Path) -> None:
    run = tmp_path / "run"
    _job(run, fault=BitFlip(kind="grad", name=SITE, step=5, rank=0, element=7, bit=20))
    assert [e["step"] for e in read_events(run, "fault-injected")] == [5]
    report = replay(run, target=TARGET, start=3, end=6)
    verdict = report.stats["verdict"]
    assert report.exit_code == 1 and verdict["kind"] == "hardware-fault-suspected", verdict
    assert (verdict["step"], verdict["rank"], verdict["site"]) == (5, 0, f"grad.{SITE}")
    assert verdict["host"] and "device cpu" in verdict["message"]


@pytest.mark.slow
def test_two_ranks_the_replica_check_sees_it_during_production_and_replay_names_the_rank(tmp_path: Path) -> None:
    run = tmp_path / "run"
    _job(run, nproc=2, fault=BitFlip(kind="grad", name=SITE, step=5, rank=1, element=7, bit=20))
    _stamped(run, [3, 6])
    mismatch = next(read_events(run, "replica-mismatch"))
    assert mismatch["step"] == 5 and mismatch["tensors"] == [SITE]
    assert sorted(tuple(s["ranks"]) for s in mismatch["sides"]) == [(0,), (1,)]
    report = replay(run, target=TARGET, start=3, end=6)
    verdict = report.stats["verdict"]
    assert verdict["kind"] == "hardware-fault-suspected" and (verdict["step"], verdict["rank"]) == (5, 1), verdict
    assert verdict["site"] == f"grad.{SITE}"
    assert "the other ranks (0) computed the step exactly as the replays did" in verdict["message"]


@pytest.mark.slow
def test_a_nondeterministic_job_cannot_be_judged(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    run = tmp_path / "run"
    env = {"PRODUCTION_WORKLOAD_NONDETERMINISTIC": "1"}
    _job(run, env=env)
    monkeypatch.setenv("PRODUCTION_WORKLOAD_NONDETERMINISTIC", "1")  # the replays inherit it
    verdict = replay(run, target=TARGET, start=3, end=6).stats["verdict"]
    assert verdict["kind"] == "nondeterministic" and verdict["step"] == 4, verdict


@pytest.mark.slow
def test_a_corrupt_checkpoint_is_named_before_anything_is_replayed(six_steps: dict[str, Path]) -> None:
    run = six_steps["copy"]  # a clean 6-step job's run directory
    inj.flip_in_tensor_payload(run / "step_6", "model.blocks.0.mlp.fc.weight")
    report = replay(run, target=TARGET, start=3, end=6)
    assert report.stats["verdict"]["kind"] == "checkpoint-corrupt" and report.stats["verdict"]["step"] == 6
