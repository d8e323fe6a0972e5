"""Verification after save: every committed checkpoint is verified (in the background or inline) and stamped; a
failure is an event, a warning and, if asked, an exception at the next save; a job waits at exit; retention
leaves a checkpoint alone while it is verified; a resume picks the newest checkpoint that verifies."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import faults as inj
from helpers.multiproc import spawn_ranks

import ckptverify as cv
from ckptverify.errors import (
    CheckpointRefusedError,
    CkptVerifyWarning,
    UsageError,
    VerifyFailedError,
    VerifyFailedWarning,
)
from ckptverify.options import VerifyOptions
from ckptverify.ownfiles.events import read_events
from ckptverify.ownfiles.names import STAMP_FILE, VERIFYING_LOCK
from ckptverify.runs.prune import prune
from ckptverify.runs.stamp import read_stamp
from ckptverify.verifier import background
from ckptverify.verifier.background import BackgroundVerifier

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def verifier(monkeypatch: pytest.MonkeyPatch) -> Iterator[BackgroundVerifier]:
    """A fresh process verifier for each test (short settle time), closed after it."""
    fresh = BackgroundVerifier(settle=0.05)
    monkeypatch.setattr(background, "_default", fresh)
    yield fresh
    fresh.before_verify = None
    fresh.close(timeout=60)


def _state(value: float) -> dict[str, Any]:
    return {"w": torch.full((128, 64), value), "b": torch.arange(64.0) + value, "note": f"v{value}"}


def _stamp(path: Path) -> dict[str, Any]:
    stamp = read_stamp(path)
    assert stamp is not None and stamp.current, f"no current stamp in {path}"
    return stamp.data


@pytest.mark.parametrize("mode", ["background", "inline"])
def test_a_clean_save_is_stamped_passed_with_an_event_and_a_result(tmp_path: Path, verifier: BackgroundVerifier,
                                                                   mode: str) -> None:
    seen: list[cv.Verification] = []
    path = tmp_path / "step_7"
    cv.save(_state(1.0), path, verify=mode, events=tmp_path, on_verified=seen.append)
    assert cv.wait_for_verifications(timeout=60)
    data = _stamp(path)
    assert data["verdict"] == "passed" and data["step"] == 7 and data["manifest"] and data["bytes_checked"] > 0
    last = cv.last_verification()
    assert last is not None and last.passed and last.stamped and last.step == 7 and last.path == str(path)
    assert last.bytes_checked == data["bytes_checked"] > 128 * 64 * 4 and last.summary["error"] == 0
    assert seen == [last]
    events = list(read_events(tmp_path))
    assert [(e["event"], e["step"], e["verdict"]) for e in events] == [("checkpoint-verified", 7, "passed")]
    assert not (path / VERIFYING_LOCK).exists()  # the lock goes with the verification


def test_plain_save_verifies_nothing_by_default(tmp_path: Path, verifier: BackgroundVerifier) -> None:
    cv.save(_state(1.0), tmp_path / "step_1")
    assert not (tmp_path / "step_1" / STAMP_FILE).exists() and cv.last_verification() is None
    assert verifier.pending() == []


def test_async_save_is_verified_once_its_upload_commits(tmp_path: Path, verifier: BackgroundVerifier) -> None:
    cv.async_save(_state(2.0), tmp_path / "step_2", verify="inline").result(timeout=120)
    assert _stamp(tmp_path / "step_2")["passed"]  # inline: stamped before the future completed
    cv.async_save(_state(3.0), tmp_path / "step_3", verify="background", events=tmp_path).result(timeout=120)
    assert cv.wait_for_verifications(timeout=60)
    assert _stamp(tmp_path / "step_3")["passed"]
    assert [e["step"] for e in read_events(tmp_path, "checkpoint-verified")] == [3]


def test_a_shard_damaged_before_verification_fails_warns_logs_and_raises_at_the_next_save(
        tmp_path: Path, verifier: BackgroundVerifier) -> None:
    run = tmp_path / "run"
    verifier.before_verify = lambda p: inj.flip_in_tensor_payload(p, "w") and None
    with pytest.warns(VerifyFailedWarning, match="step_1.*failed verification"):
        cv.save(_state(1.0), run / "step_1", verify=VerifyOptions(when="background", on_failure="raise"), events=run)
        assert cv.wait_for_verifications(timeout=60)
    verifier.before_verify = None
    data = _stamp(run / "step_1")
    assert data["verdict"] == "failed" and data["errors"]
    last = cv.last_verification()
    assert last is not None and last.verdict == "failed" and not last.passed and last.first_error
    assert last.summary["error"] >= 1 and last.bytes_checked > 0
    failed = list(read_events(run, "checkpoint-failed"))
    assert len(failed) == 1 and failed[0]["step"] == 1 and failed[0]["first_error"] == last.first_error
    # The next save in raise mode refuses before it writes anything; the one after goes ahead.
    with pytest.raises(VerifyFailedError, match="step_1") as raised:
        cv.save(_state(2.0), run / "step_2", verify=VerifyOptions(when="background", on_failure="raise"), events=run)
    assert raised.value.verification == last and raised.value.exit_code == 1
    assert not (run / "step_2").exists()
    cv.save(_state(2.0), run / "step_2", verify=VerifyOptions(when="background", on_failure="raise"), events=run)
    assert cv.wait_for_verifications(timeout=60) and _stamp(run / "step_2")["passed"]
    # The stamp says failed, so a resume skips the damaged checkpoint without verifying it again.
    assert cv.latest_verified(run).skipped == []  # step_2 is newest and good
    assert read_stamp(run / "step_1").passed is False


def test_inline_raise_fails_the_save_itself(tmp_path: Path, verifier: BackgroundVerifier) -> None:
    verifier.before_verify = lambda p: inj.flip_in_tensor_payload(p, "w") and None
    with pytest.warns(VerifyFailedWarning), pytest.raises(VerifyFailedError, match="step_4"):
        cv.save(_state(4.0), tmp_path / "step_4", verify=VerifyOptions(on_failure="raise"))
    assert _stamp(tmp_path / "step_4")["verdict"] == "failed"
    assert verifier.take_failures() == []  # raised already: the next save does not raise it again


@pytest.mark.parametrize("mode", ["inline", "background"])
def test_a_failed_verification_whose_stamp_cannot_be_written_still_raises(tmp_path: Path,
                                                                            verifier: BackgroundVerifier,
                                                                            mode: str) -> None:
    def damage(path: str) -> None:
        inj.flip_in_tensor_payload(path, "w")
        os.mkdir(os.path.join(path, STAMP_FILE))  # as a read-only directory would: no stamp can be written

    verifier.before_verify = damage
    seen: list[cv.Verification] = []
    with pytest.warns(VerifyFailedWarning), pytest.raises(VerifyFailedError, match="step_4"):
        raising = VerifyOptions(when=mode, on_failure="raise")
        cv.save(_state(4.0), tmp_path / "step_4", verify=raising, on_verified=seen.append)
        assert cv.wait_for_verifications(timeout=60)
        cv.save(_state(5.0), tmp_path / "step_5", verify=raising)  # raises the earlier one
    (result,) = seen
    assert result.verdict == "failed" and not result.stamped and "not stamped" in (result.reason or "")
    assert read_stamp(tmp_path / "step_4") is None


def test_an_already_damaged_checkpoint_fails_through_the_same_worker(tmp_path: Path,
                                                                     verifier: BackgroundVerifier) -> None:
    cv.save(_state(5.0), tmp_path / "step_5")
    os.truncate(next((tmp_path / "step_5").glob("*.distcp")), 100)
    with pytest.warns(VerifyFailedWarning):
        verifier.submit(tmp_path / "step_5", step=5)
        assert verifier.wait(timeout=60)
    assert verifier.last().verdict == "failed" and _stamp(tmp_path / "step_5")["verdict"] == "failed"


def test_in_thread_isolation_the_worker_thread_verifies_and_stamps(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    threaded = BackgroundVerifier(isolation="thread", settle=0.05)
    monkeypatch.setattr(background, "_default", threaded)
    try:
        cv.save(_state(1.0), tmp_path / "step_1", verify="background")
        assert cv.wait_for_verifications(timeout=60)
        threaded.before_verify = lambda p: inj.flip_in_tensor_payload(p, "w") and None
        with pytest.warns(VerifyFailedWarning):
            cv.save(_state(2.0), tmp_path / "step_2", verify="background")
            assert cv.wait_for_verifications(timeout=60)
    finally:
        threaded.close(timeout=60)
    assert threaded._child._proc is None  # no verifier process was started
    assert _stamp(tmp_path / "step_1")["passed"] and _stamp(tmp_path / "step_2")["verdict"] == "failed"


def test_a_verifier_process_that_dies_leaves_that_checkpoint_unverified_and_the_next_one_is_verified(
        tmp_path: Path, verifier: BackgroundVerifier) -> None:
    cv.save(_state(1.0), tmp_path / "step_1", verify="background")
    assert cv.wait_for_verifications(timeout=60)
    first = verifier._child._proc
    assert first is not None and first.poll() is None  # one process serves the job's verifications

    def kill(path: str) -> None:
        if path.endswith("step_2"):
            # stopped, it cannot answer; it dies while the request is (most likely) out, or before it: either
            # way the verification is left without an answer
            proc = verifier._child._proc
            proc.send_signal(signal.SIGSTOP)
            threading.Timer(1.0, proc.kill).start()

    verifier.before_verify = kill
    with pytest.warns(CkptVerifyWarning,
                      match="step_2.*verifier process (ended without an answer|failed: BrokenPipeError)"):
        cv.save(_state(2.0), tmp_path / "step_2", verify="background", events=tmp_path)
        assert cv.wait_for_verifications(timeout=60)
    assert cv.last_verification().verdict == "unverified"
    assert not (tmp_path / "step_2" / STAMP_FILE).exists()
    assert [e["step"] for e in read_events(tmp_path, "checkpoint-unverified")] == [2]
    cv.save(_state(3.0), tmp_path / "step_3", verify="background")
    assert cv.wait_for_verifications(timeout=60) and _stamp(tmp_path / "step_3")["passed"]
    assert verifier._child._proc is not first  # started again


@pytest.mark.parametrize("isolation", ["process", "thread"])
def test_a_verification_that_raises_reads_the_same_in_either_isolation(tmp_path: Path, isolation: str) -> None:
    cv.save(_state(1.0), tmp_path / "step_1")
    verifier = BackgroundVerifier(isolation=isolation, settle=0.05, jobs="two")  # jobs it cannot use: it raises
    try:
        with pytest.warns(CkptVerifyWarning, match="step_1"):
            verifier.submit(tmp_path / "step_1", step=1)
            assert verifier.wait(timeout=60)
    finally:
        verifier.close(timeout=60)
    last = verifier.last()
    assert (last.verdict, last.no_verdict) == ("unverified", "error")
    assert last.reason.startswith("the verification itself failed: TypeError: "), last.reason
    assert not (tmp_path / "step_1" / STAMP_FILE).exists()


def test_bad_verify_arguments_are_usage_errors(tmp_path: Path, verifier: BackgroundVerifier) -> None:
    for kwargs in ({"verify": "later"}, {"verify": "inline", "on_verified": 3},
                   {"verify": "inline", "verify_deep": True}):  # not a keyword of save
        with pytest.raises(UsageError):
            cv.save(_state(1.0), tmp_path / "x", **kwargs)
    assert not (tmp_path / "x").exists()


def test_a_too_short_wait_says_it_cut_one_short(tmp_path: Path, verifier: BackgroundVerifier) -> None:
    gate = threading.Event()
    verifier.before_verify = lambda p: gate.wait(30) and None
    cv.save(_state(1.0), tmp_path / "step_1", verify="background", events=tmp_path)
    with pytest.warns(CkptVerifyWarning, match=r"1 checkpoint verification\(s\) not finished.*step_1"):
        assert cv.wait_for_verifications(timeout=0.2) is False
    cut = list(read_events(tmp_path, "checkpoint-cut-short"))
    assert [(e["step"], e["verdict"]) for e in cut] == [(1, "unverified")]
    assert not (tmp_path / "step_1" / STAMP_FILE).exists()
    gate.set()  # the verification was only waited for, not abandoned: it finishes
    assert cv.wait_for_verifications(timeout=60) and _stamp(tmp_path / "step_1")["passed"]


def test_prune_keeps_checkpoints_queued_or_being_verified(tmp_path: Path, verifier: BackgroundVerifier) -> None:
    run = tmp_path / "run"
    gate, started = threading.Event(), threading.Event()

    def hold(path: str) -> None:
        if path.endswith("step_1"):
            started.set()
            gate.wait(30)

    verifier.before_verify = hold
    cv.save(_state(1.0), run / "step_1", verify="background")
    cv.save(_state(2.0), run / "step_2", verify="background")  # queued behind step_1
    cv.save(_state(3.0), run / "step_3")
    cv.save(_state(4.0), run / "step_4")
    assert started.wait(30)
    result = prune(run, keep=1)
    kept = {k["path"]: k["why"] for k in result.kept}
    assert result.deleted == ["step_3"], result.to_dict()
    assert kept["step_1"] == kept["step_2"] == "being verified or saved right now"
    gate.set()
    assert cv.wait_for_verifications(timeout=60)
    assert _stamp(run / "step_1")["passed"] and _stamp(run / "step_2")["passed"]
    assert prune(run, keep=1).deleted == ["step_2", "step_1"]  # released: ordinary retention again


# ---------------------------------------------------------------------------------- a job that ends

_JOB = """
import os, sys, threading
import torch
import ckptverify as cv
from ckptverify.verifier.background import default_verifier

run = sys.argv[1]
# Each verification is held until the job has saved its last checkpoint (at most HOLD seconds), so the job
# ends with verifications still to do; RELEASE=0 keeps holding them past the end.
saved = threading.Event()
default_verifier().before_verify = lambda p: saved.wait(float(os.environ.get("HOLD", "300"))) and None
for step in (1, 2, 3):
    cv.save({"w": torch.full((64, 64), float(step))}, os.path.join(run, f"step_{step}"), verify="background",
            events=run)
print("pending at exit:", len(default_verifier().pending()), flush=True)
if os.environ.get("RELEASE", "1") == "1":
    saved.set()
"""


def _job(run: Path, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", _JOB, str(run)], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(REPO), **env}, cwd=str(REPO))


def test_a_job_that_ends_waits_and_every_checkpoint_carries_a_stamp(tmp_path: Path) -> None:
    done = _job(tmp_path)
    assert done.returncode == 0, done.stderr
    assert int(done.stdout.split("pending at exit:")[1]) == 3  # none verified yet when the script ended
    for step in (1, 2, 3):
        assert _stamp(tmp_path / f"step_{step}")["passed"]
    assert [e["step"] for e in read_events(tmp_path, "checkpoint-verified")] == [1, 2, 3]
    assert "Warning" not in done.stderr


def test_a_job_whose_exit_wait_is_too_short_says_which_it_cut_short(tmp_path: Path) -> None:
    done = _job(tmp_path, HOLD="5", RELEASE="0", CKPTVERIFY_VERIFY_EXIT_TIMEOUT="0.5")
    assert done.returncode == 0, done.stderr
    assert "CkptVerifyWarning" in done.stderr and "not finished after waiting 0.5 s" in done.stderr
    cut = {e["step"] for e in read_events(tmp_path, "checkpoint-cut-short")}
    assert cut == {1, 2, 3} and not list(read_events(tmp_path, "checkpoint-verified"))
    assert not any((tmp_path / f"step_{s}" / STAMP_FILE).exists() for s in (1, 2, 3))


def test_a_close_that_cuts_a_verification_short_ends_the_verifier_process(tmp_path: Path) -> None:
    cv.save(_state(1.0), tmp_path / "step_1")
    os.truncate(next((tmp_path / "step_1").glob("*.distcp")), 100)
    slow = BackgroundVerifier(settle=60)  # a failed verification settles for a minute in the verifier process
    slow.submit(tmp_path / "step_1", step=1)
    deadline = time.monotonic() + 30
    while (slow._child._proc is None) and time.monotonic() < deadline:
        time.sleep(0.05)
    proc = slow._child._proc
    assert proc is not None
    with pytest.warns(CkptVerifyWarning) as said:
        assert slow.close(timeout=0.5) is False
        slow._thread.join(30)
    assert proc.poll() is not None  # ended with the job, not left behind
    assert any("not finished after waiting 0.5 s" in str(w.message) for w in said)
    assert slow.last().verdict == "unverified" and "verifier process ended" in slow.last().reason
    assert not (tmp_path / "step_1" / STAMP_FILE).exists()


# ---------------------------------------------------------------------------------- load pick=

def _train_state(seed: int) -> cv.TrainState:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    return cv.TrainState(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))


def test_load_picks_the_newest_checkpoint_that_verifies_and_says_which(tmp_path: Path,
                                                                       verifier: BackgroundVerifier) -> None:
    run = tmp_path / "run"
    saved = {}
    for step in (10, 20, 30, 40, 50):
        state = _train_state(step)
        state.counters.step = step
        cv.save(state, run / f"step_{step}", verify="background")
        saved[step] = {k: v.clone() for k, v in state.model.state_dict().items()}
    assert cv.wait_for_verifications(timeout=60)
    inj.flip_in_tensor_payload(run / "step_50", "model.0.weight")  # corrupt after its stamp: the stamp is stale
    os.truncate(next((run / "step_40").glob("*.distcp")), 64)  # a shard cut short
    os.remove(run / "step_30" / ".metadata")  # a save that never finished
    target = _train_state(0)
    report = cv.load(target, run, pick="latest-verified")
    assert report.passed and report.stats["picked"] == str(run / "step_20") and report.stats["step"] == 20
    assert [(s["path"], s["state"], s["how"]) for s in report.stats["skipped"]] == [
        ("step_50", "corrupt", "verified now"), ("step_40", "corrupt", "verified now"),
        ("step_30", "incomplete", "verified now")]
    assert report.findings[0].check == "load-picked" and "step_20" in report.findings[0].message
    assert target.counters.step == 20
    for name, value in target.model.state_dict().items():
        assert torch.equal(value, saved[20][name]), name
    # Nothing good: refused, naming what was skipped and why; the state is untouched.
    for step in (10, 20):
        inj.flip_in_tensor_payload(run / f"step_{step}", "model.0.weight")
    fresh = _train_state(1)
    before = {k: v.clone() for k, v in fresh.model.state_dict().items()}
    with pytest.raises(CheckpointRefusedError, match=r"no checkpoint verifies.*step_50: corrupt.*step_30: "
                       r"incomplete.*step_10: corrupt"):
        cv.load(fresh, run, pick="latest-verified")
    assert all(torch.equal(v, before[k]) for k, v in fresh.model.state_dict().items())
    with pytest.raises(UsageError):
        cv.load(fresh, run, pick="newest")
    with pytest.raises(UsageError):
        cv.load(fresh, run, pick="latest-verified", verify="off")


def test_load_pick_trusts_a_failed_stamp_from_the_background_verifier(tmp_path: Path,
                                                                      verifier: BackgroundVerifier) -> None:
    run = tmp_path / "run"
    for step in (1, 2):
        state = _train_state(step)
        state.counters.step = step
        if step == 2:
            verifier.before_verify = lambda p: inj.flip_in_tensor_payload(p, "model.0.weight") and None
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", VerifyFailedWarning)
            cv.save(state, run / f"step_{step}", verify="inline")
    report = cv.load(_train_state(0), run, pick="latest-verified")
    assert report.stats["step"] == 1
    assert [(s["path"], s["how"]) for s in report.stats["skipped"]] == [("step_2", "stamp")]


# ---------------------------------------------------------------------------------- two ranks

def _two_rank_worker(rank: int, world: int, root: str) -> None:
    import torch.distributed as dist

    warnings.simplefilter("ignore")
    out: dict[str, Any] = {"rank": rank}
    try:
        def save(step: int) -> None:
            state = {f"w.{rank}": torch.full((256,), float(step + rank)), "shared": torch.arange(512.0) * step}
            cv.save(state, os.path.join(root, f"step_{step}"),
                    verify=VerifyOptions(when="background", on_failure="raise"), events=root)

        save(1)
        out["after_save_1"] = background._default is not None and background._default.pending() != []
        if rank == 0:
            background.default_verifier().before_verify = (
                lambda p: inj.flip_in_tensor_payload(p, "shared") and None if p.endswith("step_2") else None)
        dist.barrier()
        save(2)
        out["waited"] = cv.wait_for_verifications(timeout=120)
        last = cv.last_verification()
        out["last"] = None if last is None else last.verdict
        out["has_verifier"] = background._default is not None
        dist.barrier()
        try:
            save(3)
            out["third"] = "saved"
        except VerifyFailedError as exc:
            out["third"] = f"raised: {exc}"
        cv.wait_for_verifications(timeout=120)
    finally:
        with open(os.path.join(root, f"rank{rank}.json"), "w") as f:
            json.dump(out, f)


@pytest.mark.slow
def test_two_ranks_only_rank_0_verifies_and_both_ranks_see_a_raise_mode_failure(tmp_path: Path) -> None:
    spawn_ranks(_two_rank_worker, 2, str(tmp_path))
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert ranks[0]["has_verifier"] and not ranks[1]["has_verifier"], ranks
    assert [r["last"] for r in ranks] == ["failed", None]
    assert ranks[1]["after_save_1"] is False  # rank 1 queued nothing and went on
    assert all(r["third"].startswith("raised:") and "step_2" in r["third"] for r in ranks), ranks
    assert not (tmp_path / "step_3").exists()
    assert _stamp(tmp_path / "step_1")["passed"] and _stamp(tmp_path / "step_2")["verdict"] == "failed"
    events = [e for e in read_events(tmp_path) if e["event"].startswith("checkpoint-")]
    assert [(e["event"], e["step"], e["rank"]) for e in events] == [("checkpoint-verified", 1, 0),
                                                                     ("checkpoint-failed", 2, 0)]


def test_load_pick_passes_over_newer_checkpoints_of_a_format_load_cannot_restore(tmp_path: Path) -> None:
    run = tmp_path / "run"
    state = _train_state(3)
    state.counters.step = 10
    cv.save(state, run / "step_10")
    saved = {k: v.clone() for k, v in state.model.state_dict().items()}
    torch.save({"state_dict": state.model.state_dict()}, run / "epoch=0-step=20.ckpt")  # newer, intact, not DCP
    target = _train_state(0)
    report = cv.load(target, run, pick="latest-verified")
    assert report.stats["picked"] == str(run / "step_10")
    assert [(s["path"], s["state"]) for s in report.stats["skipped"]] == [("epoch=0-step=20.ckpt", "other-format")]
    assert all(torch.equal(v, saved[k]) for k, v in target.model.state_dict().items())
    # `latest` itself still names the newest good checkpoint of any format.
    assert cv.latest_verified(run).path.endswith("epoch=0-step=20.ckpt")


def test_a_module_planted_in_the_job_s_working_directory_does_not_run_in_the_verifier_process(
        tmp_path: Path, verifier: BackgroundVerifier, monkeypatch: pytest.MonkeyPatch) -> None:
    work = tmp_path / "work"
    work.mkdir()
    ran = tmp_path / "planted-module-ran"
    for name in ("xxhash", "isal", "json"):  # modules the verifier process imports
        (work / f"{name}.py").write_text(f"open({str(ran)!r}, 'a').write({name!r})\nraise SystemExit(3)\n")
    monkeypatch.chdir(work)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(["", ".", os.environ.get("PYTHONPATH", "")]))
    path = tmp_path / "step_3"
    cv.save(_state(3.0), path, verify="background")
    assert cv.wait_for_verifications(timeout=60)
    assert not ran.exists(), ran.read_text()
    assert _stamp(path)["verdict"] == "passed"
