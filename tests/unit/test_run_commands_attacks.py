"""``latest``, ``scan`` and ``watch`` against a run directory that changes under them: bit rot under a current
stamp, retention deleting a checkpoint as it is reached, a folder with nothing to verify, and checkpoints
written, renamed and deleted while the watcher runs."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from click.testing import CliRunner
from helpers import faults as inj

import ckptverify as cv
from ckptverify.audit.verify import verify_checkpoint
from ckptverify.cli import main
from ckptverify.runs.latest import latest_verified
from ckptverify.runs.scan import scan_run_dir
from ckptverify.runs.stamp import read_stamp
from ckptverify.verifier.stamper import verify_and_stamp

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
REPO = Path(__file__).resolve().parents[2]
#: A command that regressed into a hang fails the test at this bound instead of hanging the suite.
HANG_LIMIT_S = 300
#: A watcher stops on SIGINT at its next check of signals: seconds, even on a loaded machine.
STOP_LIMIT_S = 60


def _dcp(path: Path, value: float) -> Path:
    dcp.save({"w": torch.full((64, 64), value), "step": int(value)}, checkpoint_id=str(path))
    return path


def _tree(path: Path) -> dict[str, tuple[bytes, int]]:
    return {str(p.relative_to(path)): (p.read_bytes(), p.stat().st_mtime_ns) for p in sorted(path.rglob("*"))
            if p.is_file()}


@pytest.fixture
def rotted(tmp_path: Path) -> Path:
    """Two stamped checkpoints; one bit of the newer one flipped in place, every file's time put back: its stamp
    is still current (size, time and inode unchanged), as after bit rot."""
    run = tmp_path / "run"
    for step in (1, 2):
        assert verify_and_stamp(str(_dcp(run / f"step_{step}", float(step))), step=step).verdict == "passed"
    newest = run / "step_2"
    times = {p: p.stat() for p in newest.rglob("*") if p.is_file()}
    inj.flip_in_tensor_payload(newest, "w")
    for p, st in times.items():
        os.utime(p, ns=(st.st_atime_ns, st.st_mtime_ns))
    stamp = read_stamp(newest)
    assert stamp is not None and stamp.current and stamp.passed
    return run


def test_latest_path_only_does_not_name_a_checkpoint_rotted_under_a_current_stamp(rotted: Path) -> None:
    evidence = _tree(rotted / "step_2")
    out = CliRunner().invoke(main, ["latest", "--path-only", str(rotted)])
    assert out.exit_code == 0 and out.stdout == f"{rotted / 'step_1'}\n"
    assert _tree(rotted / "step_2") == evidence  # the failed one is kept as it is, stamp included
    report = CliRunner().invoke(main, ["latest", "--json", str(rotted)])
    data = json.loads(report.stdout)
    (skipped,) = data["stats"]["skipped"]
    assert (skipped["path"], skipped["state"], skipped["how"]) == ("step_2", "corrupt", "verified now")
    assert "its current stamp" in skipped["reason"] and data["stats"]["trust_stamps"] is False


def test_latest_api_verifies_the_pick_afresh_by_default(rotted: Path) -> None:
    assert latest_verified(rotted).step == 1
    assert cv.latest_verified(rotted).step == 1


def test_latest_trust_stamps_is_the_explicit_fast_path_across_cli_api_and_json(rotted: Path) -> None:
    assert latest_verified(rotted, trust_stamps=True).step == 2
    out = CliRunner().invoke(main, ["latest", "--trust-stamps", "--json", str(rotted)])
    data = json.loads(out.stdout)
    assert out.exit_code == 0 and data["stats"]["step"] == 2 and data["stats"]["trust_stamps"] is True


def test_latest_refuses_trust_stamps_with_no_stamps_as_a_usage_error(rotted: Path) -> None:
    out = CliRunner().invoke(main, ["latest", "--trust-stamps", "--no-stamps", str(rotted)])
    assert out.exit_code == 2 and "contradict" in out.output and "Traceback" not in out.output


def test_scan_calls_a_checkpoint_retention_was_deleting_when_scan_reached_it_deleted(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Retention had deleted the shards of step_1 when scan reached it, and removes the rest a moment after
    its verification: nothing moved while it was verified, but it is no corrupt checkpoint."""
    import ckptverify.audit.verify as verify_module

    run = tmp_path / "run"
    for step in (1, 2):
        _dcp(run / f"step_{step}", float(step))
    doomed = run / "step_1"
    real = verify_module.verify_checkpoint
    finisher: list[threading.Timer] = []

    def reached(line: str) -> None:  # scan is about to verify a checkpoint: retention is half done with step_1
        if line.endswith(" step_1"):
            for shard in doomed.glob("*.distcp"):
                shard.unlink()

    def verify(path: str, **kw: object) -> object:
        report = real(path, **kw)
        if Path(path) == doomed and not finisher:  # retention finishes a moment after the verification
            finisher.append(threading.Timer(0.2, shutil.rmtree, (doomed,)))
            finisher[0].start()
        return report

    monkeypatch.setattr(verify_module, "verify_checkpoint", verify)
    report = scan_run_dir(run, progress=reached)
    finisher[0].join()
    states = {r["path"]: r["state"] for r in report.stats["checkpoints"]}
    assert states == {"step_1": "deleted", "step_2": "intact"}
    assert report.exit_code == 0 and not report.errors


def test_watch_once_with_no_checkpoint_under_it_is_a_usage_error(tmp_path: Path) -> None:
    run = tmp_path / "run"
    (run / "logs").mkdir(parents=True)
    (run / "logs" / "train.log").write_text("not a checkpoint")
    out = CliRunner().invoke(main, ["watch", "--once", "--log", str(tmp_path / "w.jsonl"), str(run)])
    assert out.exit_code == 2
    assert out.stderr.strip().splitlines() == [f"ckptverify watch: error: nothing to verify under {run}: no "
                                               "checkpoint found"]


_WRITER = """
import os, shutil, sys, time, warnings
import torch, torch.distributed.checkpoint as dcp
warnings.simplefilter("ignore")
root = sys.argv[1]
for k in range(1, 13):
    tmp = os.path.join(root, f"tmp-{k}")
    dcp.save({"w": torch.full((512, 512), float(k))}, checkpoint_id=tmp)
    os.rename(tmp, os.path.join(root, f"step_{k}"))            # atomic publish of a finished save
    torch.save({"w": torch.full((64, 64), float(k))}, os.path.join(root, f"model_{k}.pt"))
    if k % 3 == 0:                                                # renamed while the watcher may verify it
        os.rename(os.path.join(root, f"step_{k - 1}"), os.path.join(root, f"kept_{k - 1}"))
    for old in (f"step_{k - 2}", f"model_{k - 2}.pt"):           # retention
        p = os.path.join(root, old)
        shutil.rmtree(p, ignore_errors=True) if os.path.isdir(p) else os.path.exists(p) and os.remove(p)
    time.sleep(0.2)  # let passes of the watcher fall between, and across, these changes
"""


def test_watch_while_checkpoints_are_written_renamed_and_deleted_passes_only_what_it_checked(
        tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    # A watcher that does not stop on SIGINT prints every thread's stack when aborted below: the evidence of a hang.
    env["PYTHONFAULTHANDLER"] = "1"
    # SIGINT as a terminal gives it: a process inherits an ignored SIGINT (a test before this one in the same
    # worker may leave it ignored, as a shell does for a job started with &), and then rightly does not stop on it.
    interruptible = ("import runpy, signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
                     "sys.argv[0] = 'ckptverify'; runpy.run_module('ckptverify', run_name='__main__')")
    watcher = subprocess.Popen([sys.executable, "-c", interruptible, "watch", "--json", "--poll", "--interval",
                                "0.1", "--log", str(tmp_path / "w.jsonl"), str(run)], env=env, cwd=REPO,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        subprocess.run([sys.executable, "-c", _WRITER, str(run)], check=True, timeout=HANG_LIMIT_S, env=env)
        time.sleep(7)  # past the quiet time of the last single-file checkpoint: the watcher judges it
        watcher.send_signal(signal.SIGINT)
        try:
            out, err = watcher.communicate(timeout=STOP_LIMIT_S)
        except subprocess.TimeoutExpired:
            watcher.send_signal(signal.SIGABRT)
            out, err = watcher.communicate(timeout=HANG_LIMIT_S)
            pytest.fail(f"the watcher did not stop within {STOP_LIMIT_S} s of SIGINT; its threads:\n"
                        f"{err.decode(errors='replace')[-6000:]}")
    finally:
        if watcher.poll() is None:
            watcher.kill()
            watcher.wait()
    assert b"Traceback" not in err, err.decode(errors="replace")
    events = [json.loads(line) for line in out.decode().splitlines()]
    assert {e["event"] for e in events} <= {"verified", "deleted", "changed"}, events
    for e in events:
        if e["event"] == "verified":
            assert e["errors"] == 0 and e["bytes"] > 0, e
    assert watcher.returncode == 0, (watcher.returncode, err.decode(errors="replace"))
    # What is left was each verified whole, and its stamp says so.
    left = sorted(p.name for p in run.iterdir() if p.name.startswith(("step_", "kept_", "model_"))
                  and "ckptverify" not in p.name)
    assert left and all(verify_checkpoint(str(run / name)).passed for name in left)
    for name in left:
        stamp = read_stamp(run / name)
        assert stamp is not None and stamp.current and stamp.passed, name
