"""Production jobs of the user scripts in ``tests/user_scripts/replay_*.py``, started as users start them
(``python script.py`` or ``torchrun``), and the verdict of a ``replay`` of them (the replay tests' shared part)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from ckptverify.hardware.inject import BitFlip
from ckptverify.replay.replay import VERDICTS, replay

SCRIPTS = Path(__file__).parent.parent / "user_scripts"
TRAIN = SCRIPTS / "replay_train.py"
FAULT = BitFlip(kind="activation", name="fc1", step=5, rank=0, element=5, bit=20)


def job(run_dir: Path, script: Path = TRAIN, *, nproc: int = 1, fault: BitFlip | None = None,
        trace: str | None = None) -> None:
    args = [str(script), "--run-dir", str(run_dir), "--steps", "6", "--save-every", "3"]
    if fault is not None:
        args += ["--fault", fault.to_json()]
    if trace is not None:
        args += ["--trace", trace]
    launcher = [sys.executable] if nproc == 1 else [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                                    f"--nproc_per_node={nproc}"]
    done = subprocess.run(launcher + args, capture_output=True, text=True, timeout=600, env=dict(os.environ))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


def verdict_of(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, *, env: dict[str, str], **kw: object) -> dict:
    """Run the production job and replay steps 4..6 from its checkpoint 3, both under ``env`` (the replays
    run the same code with the same settings)."""
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    run = tmp_path / "run"
    job(run, **kw)  # type: ignore[arg-type]
    # The function the run records, named as a user names it (a run directory is data).
    script = Path(kw.get("script", TRAIN))  # type: ignore[arg-type]
    report = replay(run, target=f"{script.resolve()}:train", start=3, end=6)
    verdict = report.stats["verdict"]
    assert verdict["kind"] in VERDICTS
    assert report.exit_code == (0 if verdict["kind"] == "reproduced" else 1), verdict
    return verdict


def not_hardware(verdict: dict) -> None:
    assert verdict["kind"] != "hardware-fault-suspected", verdict
    assert "suspect the hardware" not in verdict["message"]


def losses_run(run_dir: Path, losses: dict[int, dict[int, float]], world: int, monkeypatch: pytest.MonkeyPatch,
               level: str) -> str:
    """A trace directory of ``world`` ranks at ``level``: ``losses[rank][step]`` (each rank's store written from this
    process, as that rank would)."""
    from ckptverify.trace import TraceHeader, TraceRecorder

    for rank in range(world):
        monkeypatch.setattr("ckptverify.trace.recorder.rank_world", lambda rank=rank: (rank, world))
        header = TraceHeader(run=run_dir.name, level=level, rank=rank, world_size=world)
        with TraceRecorder(run_dir, header=header) as rec:
            for step, loss in sorted(losses[rank].items()):
                rec.record_step(step, metrics={"loss": loss})
    return str(run_dir)
