"""A production job's resume never buries or overwrites evidence, and a checkpoint saved after its replicas
diverged is never resumed from.

The job is `tests/user_scripts/production_train.py`, written the way a user writes one (its Dataset in
`production_data.py`, DataLoader workers, AdamW, OneCycleLR, gradient clipping, an EMA in `extras`, DDP on 2
ranks), started as users start it (`python`, or `torchrun` for 2 ranks). Checkpoints are damaged with
`tests/helpers/faults.py`; replicas are made to diverge with the documented `fault=` hook (a BitFlip).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from helpers import faults as inj
from helpers import production_replica_worker as episode_worker
from helpers.multiproc import spawn_ranks

from ckptverify.hardware.inject import BitFlip
from ckptverify.ownfiles.events import read_events
from ckptverify.runs.latest import latest_verified
from ckptverify.runs.prune import prune
from ckptverify.runs.scan import scan_run_dir
from ckptverify.runs.stamp import read_stamp, read_suspect
from ckptverify.runs.states import QUARANTINE_DIR

SCRIPTS = Path(__file__).resolve().parents[1] / "user_scripts"
SCRIPT = SCRIPTS / "production_train.py"
# Rank 1's copy of the first layer's weight gets one bit flipped at the end of step 3: under DDP nothing
# re-synchronizes parameters, so the replicas differ from then on.
FLIP = BitFlip(kind="param", name="0.weight", step=3, rank=1, element=5, bit=20)


def _job(run_dir: Path, *, steps: int, save_every: int = 2, nproc: int = 1, resume: str = "auto",
         fault: BitFlip | None = None) -> subprocess.CompletedProcess[str]:
    args = [str(SCRIPT), "--run-dir", str(run_dir), "--steps", str(steps), "--save-every", str(save_every),
            "--resume", resume]
    if fault is not None:
        args += ["--fault", fault.to_json()]
    launcher = [sys.executable] if nproc == 1 else [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                                    f"--nproc_per_node={nproc}"]
    return subprocess.run(launcher + args, capture_output=True, text=True, timeout=600)


def _ok(done: subprocess.CompletedProcess[str]) -> str:
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stderr


def _refused(done: subprocess.CompletedProcess[str]) -> str:
    assert done.returncode == 2, done.stdout[-3000:] + done.stderr[-3000:]
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    return done.stderr


def _tree(root: Path) -> dict[str, bytes]:
    """Every file under ``root`` (relative path -> bytes)."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _steps(run: Path) -> list[str]:
    return sorted(p.name for p in run.iterdir() if p.name.startswith("step_"))


def _quarantined(run: Path) -> dict[str, Path]:
    """The quarantine, by original name (``step_4.moved-<time>`` -> ``step_4``)."""
    root = run / QUARANTINE_DIR
    return {p.name.split(".moved-")[0]: p for p in sorted(root.iterdir())} if root.is_dir() else {}


def _flip(ckpt: Path) -> None:
    inj.flip_in_tensor_payload(ckpt, "model.0.weight")


@pytest.fixture(scope="module")
def four_steps(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A clean 4-step job (``step_2``, ``step_4``), the start of two tests, run once: ``"original"`` is its run
    directory, for the test that needs ``step_2``'s stamp current (a stamp is of the files' inodes too);
    ``"copy"`` a copy of it, for the test that corrupts both checkpoints (their stamps stale either way)."""
    base = tmp_path_factory.mktemp("four-steps")
    _ok(_job(base / "original", steps=4))
    shutil.copytree(base / "original", base / "copy", symlinks=True)
    return {"original": base / "original", "copy": base / "copy"}


@pytest.fixture(scope="module")
def empty_required(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, subprocess.CompletedProcess[str]]:
    """``resume="required"`` in an empty run directory (two tests judge the same job)."""
    run = tmp_path_factory.mktemp("empty") / "run"
    return run, _job(run, steps=2, resume="required")


@pytest.mark.slow
def test_every_checkpoint_corrupt_refuses_to_start_and_never_starts_over_without_burying_them(
        four_steps: dict[str, Path]) -> None:
    run = four_steps["copy"]  # a clean 4-step job's run directory
    for name in ("step_2", "step_4"):
        _flip(run / name)
    before = {name: _tree(run / name) for name in ("step_2", "step_4")}

    err = _refused(_job(run, steps=6))
    # Each checkpoint named with the check that failed, and the way out; nothing touched, nothing trained.
    for name in ("step_2", "step_4"):
        assert f"skipped {name} (step {name[5:]}): corrupt" in err
    assert "zip-crc" in err and "none verifies" in err and "resume='never'" in err
    assert {name: _tree(run / name) for name in before} == before and _steps(run) == ["step_2", "step_4"]
    assert not (run / QUARANTINE_DIR).exists()
    assert sorted(e["path"] for e in read_events(run, "checkpoint-skipped")) == ["step_2", "step_4"]
    refused = list(read_events(run, "resume-refused"))
    assert len(refused) == 1 and refused[0]["resume"] == "auto" and "zip-crc" in refused[0]["reason"]
    assert [e["step"] for e in read_events(run, "start")] == [0]  # only the first job's
    _refused(_job(run, steps=6, resume="required"))
    assert {name: _tree(run / name) for name in before} == before

    # Asked to start over: it does, from step 0, and the failed checkpoints are moved aside whole.
    err = _ok(_job(run, steps=2, resume="never"))
    assert "moved step_4 aside to quarantine/step_4.moved-" in err and "starting from step 0" in err
    moved = _quarantined(run)
    assert sorted(moved) == ["step_2", "step_4"]
    assert {name: _tree(path) for name, path in moved.items()} == before
    assert sorted(e["path"] for e in read_events(run, "checkpoint-moved-aside")) == ["step_2", "step_4"]
    assert [e["step"] for e in read_events(run, "start")] == [0, 0]
    assert _steps(run) == ["step_2"] and read_stamp(run / "step_2").passed
    assert _tree(run / "step_2") != before["step_2"]
    # The quarantine is never a resume candidate, never pruned, and scan still shows it.
    pick = latest_verified(run)
    assert pick.step == 2 and pick.path == str(run / "step_2")
    rows = {r["path"]: r for r in scan_run_dir(run).stats["checkpoints"]}
    assert all(rows[f"quarantine/{p.name}"]["state"] == "corrupt" and rows[f"quarantine/{p.name}"]["quarantined"]
               for p in moved.values())
    # resume="never" where a checkpoint verifies: refused (it would bury or overwrite the good one).
    good = _tree(run / "step_2")
    err = _refused(_job(run, steps=2, resume="never"))
    assert "holds a checkpoint that verifies (step_2, step 2)" in err and _tree(run / "step_2") == good


@pytest.mark.slow
def test_newest_corrupt_resumes_from_the_older_one_says_so_and_keeps_the_corrupt_one(
        four_steps: dict[str, Path]) -> None:
    run = four_steps["original"]  # a clean 4-step job's run directory, as the job left it
    _flip(run / "step_4")
    corrupt = _tree(run / "step_4")

    err = _ok(_job(run, steps=6))
    assert "skipped step_4 (step 4): corrupt" in err and "zip-crc" in err
    assert "resuming from step_2 (step 2)" in err and "moved step_4 aside to quarantine/" in err
    restore = list(read_events(run, "restore"))
    assert [e["step"] for e in restore] == [2] and restore[0]["resumed_from"].endswith("step_2")
    skipped = list(read_events(run, "checkpoint-skipped"))
    assert [(e["path"], e["state"]) for e in skipped] == [("step_4", "corrupt")] and "zip-crc" in skipped[0]["reason"]
    # The corrupt one is preserved byte for byte; the new step 4 was saved beside it, not over it.
    moved = _quarantined(run)
    assert list(moved) == ["step_4"] and _tree(moved["step_4"]) == corrupt
    assert _steps(run) == ["step_2", "step_4", "step_6"]
    for name in ("step_4", "step_6"):
        assert read_stamp(run / name).passed and read_suspect(run / name) is None
    assert _tree(run / "step_4") != corrupt
    # Retention never deletes the quarantine.
    result = prune(run, keep=1)
    assert sorted(result.deleted) == ["step_2", "step_4"] and _tree(moved["step_4"]) == corrupt


@pytest.mark.slow
def test_a_first_save_that_never_committed_does_not_stop_a_fresh_start_and_is_kept(
        tmp_path: Path, empty_required: tuple[Path, subprocess.CompletedProcess[str]]) -> None:
    run = tmp_path / "run"
    _ok(_job(run, steps=2))
    os.remove(run / "step_2" / ".metadata")  # the job died before DCP committed its first save
    torn = _tree(run / "step_2")
    err = _ok(_job(run, steps=2))
    assert "skipped step_2 (step 2): incomplete" in err and "starting from step 0" in err
    assert "moved step_2 aside to quarantine/" in err and _tree(_quarantined(run)["step_2"]) == torn
    assert [e["step"] for e in read_events(run, "start")] == [0, 0] and read_stamp(run / "step_2").passed
    # "required" still wants a checkpoint that verifies.
    assert "nothing to resume from" in _refused(empty_required[1])


def test_required_with_an_empty_run_dir_refuses(empty_required: tuple[Path, subprocess.CompletedProcess[str]]) -> None:
    run, done = empty_required
    err = _refused(done)
    assert "resume='required': there is nothing to resume from" in err
    assert _steps(run) == [] and not list(read_events(run, "start"))


def _load_pick(run: Path) -> dict[str, Any]:
    """``load(state, run, pick="latest-verified")`` in this process (one rank: the two ranks' random streams are
    re-seeded, which this check does not need), into the user's model."""
    import torch

    import ckptverify as cv

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Dropout(0.1),
                                torch.nn.Linear(32, 4))
    state = cv.TrainState(model=model, allow_reseed=True)
    return cv.load(state, str(run), pick="latest-verified", check=False).stats


@pytest.mark.slow
def test_two_ranks_a_checkpoint_saved_after_a_replica_mismatch_is_suspect_and_never_resumed_from(
        tmp_path: Path) -> None:
    run = tmp_path / "run"
    err = _ok(_job(run, steps=6, nproc=2, fault=FLIP))
    # One warning for the episode (steps 3-6), its count said once at the end.
    assert err.count("CkptVerifyWarning: ckptverify: replica mismatch") == 1 and "replica mismatch at step 3" in err
    assert "replica mismatch episode 1: 4 checked step(s) mismatched (steps 3-6); replicas still differ" in err
    assert [e["step"] for e in read_events(run, "replica-mismatch")] == [3]
    (end,) = read_events(run, "replica-mismatch-end")
    assert (end["first_step"], end["last_step"], end["mismatched_steps"], end["agreed_at"]) == (3, 6, 4, None)
    # step_2 was saved before the flip: passed; step_4 and step_6 after it: suspect, with the step and ranks.
    clean = read_stamp(run / "step_2")
    assert clean.passed and clean.data["verdict"] == "passed" and clean.suspect is None
    for step in (4, 6):
        stamp = read_stamp(run / f"step_{step}")
        assert stamp.current and stamp.data["verdict"] == "suspect" and stamp.suspect is not None
        assert (stamp.suspect["step"], stamp.suspect["first_step"]) == (step, 3)
        assert sorted(s["ranks"] for s in stamp.suspect["sides"]) == [[0], [1]]
    assert [e["suspect"]["step"] for e in read_events(run, "save") if "suspect" in e] == [4, 6]
    # latest and load(pick=) skip them, saying why; scan shows them as suspect.
    pick = latest_verified(run)
    assert pick.step == 2 and [(s["path"], s["state"]) for s in pick.skipped] == [("step_6", "suspect"),
                                                                                  ("step_4", "suspect")]
    assert all("replica mismatch" in s["reason"] for s in pick.skipped)
    stats = _load_pick(run)
    assert stats["step"] == 2 and [s["state"] for s in stats["skipped"]] == ["suspect", "suspect"]
    report = scan_run_dir(run)
    states = {r["path"]: r["state"] for r in report.stats["checkpoints"]}
    assert states == {"step_2": "verified", "step_4": "suspect", "step_6": "suspect"}
    assert report.stats["newest_good"]["step"] == 2

    # Restarted, the job resumes from step 2 and moves the suspect ones aside before saving over their steps.
    err = _ok(_job(run, steps=6, nproc=2))
    assert "skipped step_6 (step 6): suspect" in err and "resuming from step_2 (step 2)" in err
    assert sorted(_quarantined(run)) == ["step_4", "step_6"]
    assert "CkptVerifyWarning: ckptverify: replica mismatch" not in err
    for step in (4, 6):
        stamp = read_stamp(run / f"step_{step}")
        assert stamp.passed and stamp.data["verdict"] == "passed" and stamp.suspect is None


@pytest.mark.slow
def test_two_ranks_a_healthy_job_warns_nothing_and_a_crc_failure_is_corrupt_not_suspect(tmp_path: Path) -> None:
    run = tmp_path / "run"
    err = _ok(_job(run, steps=4, nproc=2))
    assert "replica mismatch" not in err
    assert not list(read_events(run, "replica-mismatch")) and not list(read_events(run, "replica-mismatch-end"))
    for step in (2, 4):
        stamp = read_stamp(run / f"step_{step}")
        assert stamp.passed and stamp.data["verdict"] == "passed" and read_suspect(run / f"step_{step}") is None
    _flip(run / "step_4")
    pick = latest_verified(run)
    assert pick.step == 2 and [(s["path"], s["state"]) for s in pick.skipped] == [("step_4", "corrupt")]
    assert "zip-crc" in pick.skipped[0]["reason"] and "replica" not in pick.skipped[0]["reason"]
    states = {r["path"]: r["state"] for r in scan_run_dir(run).stats["checkpoints"]}
    assert states == {"step_2": "verified", "step_4": "corrupt"}


@pytest.mark.slow
def test_replica_warnings_come_once_per_episode_with_its_count(tmp_path: Path) -> None:
    (tmp_path / "out").mkdir()
    spawn_ranks(episode_worker.run, 2, str(tmp_path / "out"), 6)
    results = [json.loads((tmp_path / "out" / f"rank{r}.json").read_text()) for r in range(2)]
    for r in results:  # every rank sees every mismatched step (the check is collective)...
        assert r["found"] == [[], [2], [3], [], [5], [6]]
        assert r["suspect"]["mismatched_steps"] == 4 and r["suspect"]["episodes"] == 2 and r["suspect"]["ongoing"]
    # ...and the lowest rank of the group warns once per episode, and says each episode's count when it ends.
    rank0, rank1 = results
    assert [w.split(":")[1].strip() for w in rank0["warnings"]] == ["replica mismatch at step 2",
                                                                    "replica mismatch at step 5"]
    assert "episode 1: 2 checked step(s) mismatched (steps 2-3); replicas agree again at step 4" in rank0["stderr"]
    assert "episode 2: 2 checked step(s) mismatched (steps 5-6); replicas still differ at the end" in rank0["stderr"]
    assert rank1["warnings"] == [] and rank1["stderr"] == ""
    out = tmp_path / "out"
    assert [e["step"] for e in read_events(out, "replica-mismatch")] == [2, 5]
    ends = [(e["first_step"], e["mismatched_steps"], e["agreed_at"]) for e in read_events(out, "replica-mismatch-end")]
    assert ends == [(2, 2, 4), (5, 2, None)]
