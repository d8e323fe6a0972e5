"""The walk down the ladder after a failed check: from the divergent step to the op (and kernel) where it is born.

The training functions are in ``tests/user_scripts/ladder_train.py`` (a user-style job: its own Dataset with
augmentation in DataLoader workers, AdamW, OneCycleLR, clipping, dropout, an EMA, DDP on two ranks). Planted
side by side: a custom op that is nondeterministic by itself (origin op, kernel nondeterministic); the same noise
made in numpy outside the dispatcher (untraced, not an op); that op on one rank under DDP (the other rank a
receiver through the all-reduce, with the sender); a clean job (no origin invented).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from helpers.inproc_cli import Done, invoke

from ckptverify.errors import CkptVerifyError, UsageError
from ckptverify.replay.replay import replay
from ckptverify.resume.harness import Plan
from ckptverify.resume.locate.walk import Side, Walk, for_replay, for_resume, walk

SCRIPTS = Path(__file__).resolve().parents[1] / "user_scripts"
SCRIPT = SCRIPTS / "ladder_train.py"


def _cli(*args: str, cwd: Path) -> Done:
    # In this process (its runs from this process's fork server): the report, exit code and progress lines are the
    # point, and with --json the runs' output goes to log files, not to this process's descriptors.
    return invoke(*args, cwd=cwd)


def _resume_check(func: str, *extra: str, cwd: Path) -> tuple[Done, dict]:
    done = _cli("resume-check", f"{SCRIPT}:{func}", "--steps", "2", "--resume-at", "1", "--runs", "A,A2", "--json",
                "--progress", *extra, cwd=cwd)
    assert "Traceback" not in done.stdout, done.stdout[-4000:]
    assert done.returncode in (0, 1), done.stderr[-4000:] + done.stdout[-4000:]
    return done, json.loads(done.stdout)


def _no_launch(*_args: object, **_kw: object) -> None:
    raise AssertionError("no run may be launched")


# ---------------------------------------------------------------------------------- whole walks, end to end


def test_custom_op_nondeterministic_by_itself_is_the_origin(tmp_path: Path) -> None:
    done, report = _resume_check("train_noisy_op", cwd=tmp_path)
    verdict = report["stats"]["verdict"]
    assert verdict["kind"] == "nondeterministic" and done.returncode == 1
    origin = verdict["origin"]
    assert origin is not None, verdict["locate"]
    assert origin["kind"] == "op" and "jitter" in origin["op"], origin
    assert origin["rank"] == 0 and origin["module"].endswith("blocks.1"), origin
    assert origin["repeats_differing"] == 2 and origin["phase"] == "forward", origin
    kernel = verdict["locate"]["kernel"]
    assert kernel["nondeterministic"] is True, kernel
    assert verdict["receivers"] == []
    assert "locate: step" in done.stderr  # progress while it re-runs
    assert any(f["check"] == "locate-origin" for f in report["findings"])


def test_numpy_outside_the_dispatcher_is_untraced_not_an_op(tmp_path: Path) -> None:
    _, report = _resume_check("train_noisy_np", "--locate-repeats", "1", cwd=tmp_path)
    verdict = report["stats"]["verdict"]
    assert verdict["kind"] == "nondeterministic"
    origin = verdict["origin"]
    assert origin is not None and origin["kind"] == "untraced", (origin, verdict["locate"])
    assert origin["module"].endswith("blocks.1"), origin
    assert verdict["locate"]["kernel"] is None  # no op to re-run alone
    assert "jitter" not in json.dumps(origin)


def test_op_on_one_rank_under_ddp_names_the_other_a_receiver(tmp_path: Path) -> None:
    _, report = _resume_check("train_rank1_op", "--nproc", "2", "--locate-repeats", "1", cwd=tmp_path)
    verdict = report["stats"]["verdict"]
    origin = verdict["origin"]
    assert origin is not None and origin["kind"] == "op" and "jitter" in origin["op"], verdict["locate"]
    assert origin["rank"] == 1, origin
    receivers = {r["rank"]: r for r in verdict["receivers"]}
    assert set(receivers) == {0}, verdict["receivers"]
    via = receivers[0]["via"]
    assert "allreduce" in via["collective"] and via["senders"] == [1] and sorted(via["group"]) == [0, 1], via


def test_clean_job_stays_clean(tmp_path: Path) -> None:
    # The check passes: no walk, nothing invented.
    _, report = _resume_check("train", cwd=tmp_path)
    verdict = report["stats"]["verdict"]
    assert verdict["kind"] == "pass" and verdict["origin"] is None and verdict["locate"] is None
    # Walked anyway (two equal sides), the op level finds no origin either.
    sides = (Side(name="A", target=f"{SCRIPT}:train", total_steps=2), Side(name="A2", target=f"{SCRIPT}:train",
                                                                           total_steps=2))
    walked = walk(Walk(step=2, sides=sides, repeats=1, state_equal=True), str(tmp_path / "walk"))
    assert walked.status == "clean" and walked.origin is None and walked.receivers == (), walked


def test_no_locate_skips_the_walk(tmp_path: Path) -> None:
    done, report = _resume_check("train_noisy_op", "--no-locate", cwd=tmp_path)
    verdict = report["stats"]["verdict"]
    assert verdict["kind"] == "nondeterministic"
    assert verdict["locate"] is None and verdict["origin"] is None and verdict["receivers"] == []
    assert "locate:" not in done.stderr
    assert not any(f["check"].startswith("locate-") for f in report["findings"])


# ---------------------------------------------------------------------------------- the walk's own rules


def _plan(**kw: object) -> Plan:
    return Plan(target=f"{SCRIPT}:train", steps=4, resume_at=2, locate=True, **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize("kind,site", [("data", "batch"), ("rng", "rng.torch_cpu"), ("scheduler", "optim.lr"),
                                       ("restore-mismatch", "model.w")])
def test_a_cause_in_the_starting_state_is_a_state_origin_without_reruns(kind: str, site: str, tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("ckptverify.resume.launch.launch_jobs", _no_launch)
    verdict = SimpleNamespace(kind=kind, step=None if kind == "restore-mismatch" else 3, rank=0, site=site,
                              category=None)
    walked = for_resume(_plan(), verdict, SimpleNamespace(nondeterminism=None), {}, str(tmp_path))
    assert walked.status == "state" and walked.origin is not None
    assert (walked.origin["kind"], walked.origin["site"], walked.origin["rank"]) == ("state", site, 0)
    assert walked.origin["step"] == 3  # a restore: the state the first resumed step starts from


def test_final_state_or_held_verdicts_are_not_walked(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("ckptverify.resume.launch.launch_jobs", _no_launch)
    for category in ("final", "held-state"):
        verdict = SimpleNamespace(kind="diverged", step=4, rank=None, site="x", category=category)
        walked = for_resume(_plan(), verdict, SimpleNamespace(nondeterminism=None), {}, str(tmp_path))
        assert walked.status == "skipped" and walked.origin is None and walked.reason


def test_a_production_difference_is_not_walked_and_says_what_would_tell(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("ckptverify.resume.launch.launch_jobs", _no_launch)
    verdict = SimpleNamespace(kind="hardware-fault-suspected", step=5, rank=None, site="param.w")
    walked = for_replay(verdict, Side(name="R1", target=f"{SCRIPT}:train", resume_from=str(tmp_path), total_steps=8),
                        world=2, device="cpu", repeats=2, workdir=str(tmp_path))
    assert walked.status == "skipped" and walked.origin is None and "op window" in walked.sentence


def test_a_failing_walk_is_reported_not_raised(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def crash(*_args: object, **_kw: object) -> None:
        raise CkptVerifyError("the workload crashed in run A-0\nboom")

    monkeypatch.setattr("ckptverify.resume.launch.launch_jobs", crash)

    verdict = SimpleNamespace(kind="nondeterministic", step=3, rank=0, site="metric.loss", category="metric")
    configs = {"A": SimpleNamespace(checkpoint_dir=str(tmp_path / "ckpt"))}
    walked = for_resume(_plan(), verdict, SimpleNamespace(nondeterminism=None), configs, str(tmp_path))
    assert walked.status == "failed" and "crashed in run A-0" in (walked.reason or "")
    assert walked.origin is None and "verdict above stands" in walked.sentence
    assert [f.check for f in walked.findings()] == ["locate-failed"]


def test_walk_sides_start_where_the_state_is_proved_equal(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Nondeterminism after the checkpoint: both sides from it; a resumed run's divergence: A from scratch."""
    monkeypatch.setattr("ckptverify.resume.launch.launches_at_once", lambda nproc, device: 1)  # one at a time
    launched: list[tuple[str, str | None, int]] = []

    def record(nproc: int, device: str, jobs: list, timeout_s: float | None = None) -> None:
        for _, cfg in jobs:
            launched.append((cfg.name, cfg.resume_from, cfg.stop_step))
        raise CkptVerifyError("stop here")

    monkeypatch.setattr("ckptverify.resume.launch.launch_jobs", record)
    configs = {"A": SimpleNamespace(checkpoint_dir=str(tmp_path / "ckpt"))}
    nd = SimpleNamespace(kind="nondeterministic", step=3, rank=0, site="x", category="metric")
    ckpt = str(tmp_path / "ckpt" / "step_2")
    for_resume(_plan(), nd, SimpleNamespace(nondeterminism=None), configs, str(tmp_path / "w1"))
    # One at a time, each launch still runs after another failed.
    assert launched == [(f"{side}-{r}", ckpt, 3) for r in (0, 1) for side in ("A", "A2")]
    launched.clear()
    hidden = SimpleNamespace(kind="hidden-state", step=3, rank=0, site="x", category="parameters")
    for_resume(_plan(), hidden, SimpleNamespace(nondeterminism=None), configs, str(tmp_path / "w2"))
    assert launched == [(f"{side}-{r}", start, 3) for r in (0, 1) for side, start in (("A", None), ("B", ckpt))]


def test_the_walk_says_its_runs_and_time_before_it_starts_and_runs_them_side_by_side_where_cores_allow(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("ckptverify.resume.launch.launches_at_once", lambda nproc, device: 2)
    both = threading.Barrier(2, timeout=60)  # broken (an error) unless two launches are in flight at once
    launched: list[str] = []

    def together(nproc: int, device: str, jobs: list, timeout_s: float | None = None) -> None:
        launched.append(jobs[0][1].name)
        both.wait()
        raise CkptVerifyError("stop here")

    monkeypatch.setattr("ckptverify.resume.launch.launch_jobs", together)

    said: list[str] = []
    configs = {"A": SimpleNamespace(checkpoint_dir=str(tmp_path / "ckpt"))}
    hidden = SimpleNamespace(kind="hidden-state", step=3, rank=0, site="x", category="parameters")
    walked = for_resume(_plan(), hidden, SimpleNamespace(nondeterminism=None), configs, str(tmp_path),
                        progress=said.append, run_seconds=8.0)
    assert sorted(launched) == ["A-0", "A-1", "B-0", "B-1"] and not both.broken
    assert walked.status == "failed" and "stop here" in (walked.reason or "")
    # A from scratch runs 3 of the job's 4 steps (6 s of the check's 8), B 1 (2 s): two waves and the capture.
    assert said[0] == ("locate: re-running step 3 at level op: 4 runs (2 per side), 2 at a time, about 18 s with "
                       "the kernel's capture")


def test_repeats_must_be_positive(tmp_path: Path) -> None:
    with pytest.raises(UsageError):
        _plan(locate_repeats=0)
    with pytest.raises(UsageError, match="--locate-repeats must be at least 1"):
        replay(str(tmp_path), target="x.py:f", locate_repeats=0)


def test_a_hung_run_is_stopped_within_its_time_limit(tmp_path: Path) -> None:
    from ckptverify.resume.launch import launch_jobs
    from ckptverify.resume.run import RunConfig

    config = RunConfig(name="hang", stop_step=1, trace_dir=str(tmp_path / "trace"), level="metrics")
    began = time.monotonic()
    with pytest.raises(CkptVerifyError, match="did not finish within"):
        launch_jobs(1, "cpu", [(f"{SCRIPTS / 'ladder_hang.py'}:train", config)], timeout_s=8)
    assert time.monotonic() - began < 120


def test_replays_that_differ_are_walked_to_the_op(tmp_path: Path) -> None:
    run = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    job = subprocess.run([sys.executable, str(SCRIPT), "--func", "train_noisy_op", "--run-dir", str(run), "--steps",
                          "2", "--save-every", "1"], capture_output=True, text=True, env=env, cwd=tmp_path,
                         timeout=600)
    assert job.returncode == 0, job.stderr[-4000:]
    done = _cli("replay", str(run), "--target", f"{SCRIPT}:train_noisy_op", "--from", "1", "--to", "2",
                "--locate-repeats", "1", "--json", cwd=tmp_path)
    assert done.returncode == 1 and "Traceback" not in done.stdout, done.stderr[-4000:]
    verdict = json.loads(done.stdout)["stats"]["verdict"]
    assert verdict["kind"] == "nondeterministic", verdict
    origin = verdict["origin"]
    assert origin is not None and origin["kind"] == "op" and "jitter" in origin["op"], verdict["locate"]
    assert (origin["step"], origin["rank"]) == (2, 0), origin
    assert verdict["locate"]["kernel"]["nondeterministic"] is True
