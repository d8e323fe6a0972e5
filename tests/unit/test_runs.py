"""A run's checkpoints over time: stamps, the newest good checkpoint, retention, and the watcher."""

from __future__ import annotations

import fcntl
import json
import os
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

from ckptverify.audit.adopt import fingerprint_checkpoint
from ckptverify.audit.verify import verify_checkpoint
from ckptverify.cli import main
from ckptverify.ownfiles.names import STAMP_FILE, VERIFYING_LOCK
from ckptverify.runs.latest import latest_verified
from ckptverify.runs.prune import prune
from ckptverify.runs.stamp import read_stamp, write_stamp
from ckptverify.verifier.watch import watch


def _dcp(path: Path, value: float, manifest: bool = True) -> Path:
    dcp.save({"w": torch.full((64, 64), value), "step": int(value)}, checkpoint_id=str(path))
    if manifest:
        fingerprint_checkpoint(path)
    return path


def test_a_stamp_is_current_until_any_file_changes(tmp_path: Path) -> None:
    path = _dcp(tmp_path / "step_1", 1.0)
    write_stamp(path, verify_checkpoint(path), step=1)
    stamp = read_stamp(path)
    assert stamp is not None and stamp.passed and stamp.current and stamp.step == 1
    assert verify_checkpoint(path).passed and not verify_checkpoint(path).warnings  # the stamp is our own file
    shard = next(p for p in path.iterdir() if p.suffix == ".distcp")
    os.utime(shard, ns=(time.time_ns(), time.time_ns() + 10**9))
    assert not read_stamp(path).current
    (path / STAMP_FILE).write_text("{not json")
    assert read_stamp(path) is None
    os.unlink(path / STAMP_FILE)
    os.mkfifo(path / STAMP_FILE)  # never blocks, never trusted
    assert read_stamp(path) is None


@pytest.fixture
def run(tmp_path: Path) -> Path:
    root = tmp_path / "run"
    for step in (10, 20, 30, 40):
        _dcp(root / f"step_{step}", float(step))
    inj.flip_in_tensor_payload(root / "step_40", "w")  # the newest is corrupt
    os.remove(root / "step_30" / ".metadata")  # the one before was torn
    return root


def test_latest_skips_corrupt_and_torn_checkpoints_and_says_why(run: Path) -> None:
    found = latest_verified(run)
    assert found.path == str(run / "step_20") and found.step == 20
    assert [(s["path"], s["state"]) for s in found.skipped] == [("step_40", "corrupt"), ("step_30", "incomplete")]
    as_json = CliRunner().invoke(main, ["latest", "--json", str(run)])
    data = json.loads(as_json.output)
    assert as_json.exit_code == 0 and data["stats"]["path"] == str(run / "step_20")
    assert len(data["stats"]["skipped"]) == 2
    only = CliRunner().invoke(main, ["latest", "--path-only", str(run)])
    assert only.exit_code == 0 and only.output == f"{run / 'step_20'}\n"


def test_latest_trusts_current_stamps_only(run: Path) -> None:
    # A stamp that says "failed" on a good checkpoint is believed while current ...
    good = run / "step_20"
    report = verify_checkpoint(run / "step_40")
    write_stamp(good, report, step=20)
    assert latest_verified(run).step == 10
    # ... and ignored once stale, or when asked to verify everything now.
    assert latest_verified(run, use_stamps=False).step == 20
    os.utime(good / ".metadata", ns=(time.time_ns(), time.time_ns() + 10**9))
    assert latest_verified(run).step == 20


def test_a_stamp_ranks_a_checkpoint_no_higher_than_its_verification_could(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    root = tmp_path / "run"
    _dcp(root / "step_1", 1.0)  # fingerprinted: verified by its manifest
    bare = root / "step_2.safetensors"  # no CRCs, no manifest: nothing can check its content
    save_file({"w": torch.full((64, 64), 2.0)}, str(bare))
    assert latest_verified(root, use_stamps=False).step == 1
    from ckptverify.verifier.stamper import verify_and_stamp

    assert verify_and_stamp(str(bare), step=2).verdict == "passed"  # as watch does: stamped
    stamp = read_stamp(bare)
    assert stamp is not None and stamp.current and stamp.passed and stamp.state == "uncheckable"
    found = latest_verified(root)
    assert found.step == 1, found.skipped
    skipped = [(s["path"], s["state"], s["how"]) for s in found.skipped]
    assert skipped == [("step_2.safetensors", "uncheckable", "stamp")]
    # A stamp that does not say how strong its verdict was (an older stamp) is not used: verified afresh.
    data = json.loads(Path(str(bare) + "." + STAMP_FILE).read_text())
    del data["state"]
    Path(str(bare) + "." + STAMP_FILE).write_text(json.dumps(data))
    assert [s["how"] for s in latest_verified(root).skipped] == ["verified now"]


@pytest.mark.parametrize("hostile", ["[" * 100_000 + "]" * 100_000, '{"schema": "ckptverify/stamp", "passed": true, '
                                     '"state": "verified", "step": 1e999}', '{"passed": true, "passed": false}'])
def test_a_hostile_stamp_is_no_stamp_for_every_reader(tmp_path: Path, hostile: str) -> None:
    root = tmp_path / "run"
    for step in (1, 2):
        _dcp(root / f"step_{step}", float(step))
    for step in (1, 2):
        (root / f"step_{step}" / STAMP_FILE).write_text(hostile)
        assert read_stamp(root / f"step_{step}") is None
    assert latest_verified(root).step == 2  # verified afresh
    assert prune(root, keep=1, dry_run=True).deleted == ["step_1"]
    result = CliRunner().invoke(main, ["latest", "--json", str(root)])
    assert result.exit_code == 0 and json.loads(result.output)["stats"]["step"] == 2, result.output


def test_latest_with_nothing_good_exits_1(tmp_path: Path) -> None:
    root = tmp_path / "run"
    bad = _dcp(root / "step_1", 1.0)
    inj.flip_in_tensor_payload(bad, "w")
    assert latest_verified(root).path is None
    result = CliRunner().invoke(main, ["latest", "--path-only", str(root)])
    assert result.exit_code == 1 and result.output == ""


def test_prune_never_deletes_the_newest_good_checkpoint(run: Path) -> None:
    dry = prune(run, keep=2, dry_run=True)
    assert dry.deleted == ["step_10"] and all(p.exists() for p in run.iterdir())
    kept = {k["path"]: k["why"] for k in dry.kept}
    assert kept["step_20"] == "the newest checkpoint that verifies of the format load restores (DCP)"
    result = prune(run, keep=2)
    assert result.deleted == ["step_10"] and not (run / "step_10").exists() and (run / "step_20").exists()


def test_prune_keeps_the_newest_checkpoint_load_can_restore_behind_a_newer_export(tmp_path: Path) -> None:
    root = tmp_path / "run"
    _dcp(root / "step_10", 10.0)
    _dcp(root / "step_5", 5.0)
    torch.save({"w": torch.full((64, 64), 20.0)}, root / "epoch=0-step=20.ckpt")  # newer, intact, not DCP
    result = prune(root, keep=1)
    kept = {k["path"]: k["why"] for k in result.kept}
    assert kept == {"epoch=0-step=20.ckpt": "one of the 1 newest",
                    "step_10": "the newest checkpoint that verifies of the format load restores (DCP)"}
    assert result.deleted == ["step_5"] and (root / "step_10" / ".metadata").exists()


def test_prune_never_deletes_a_checkpoint_that_failed_verification(tmp_path: Path) -> None:
    root = tmp_path / "run"
    for step in (1, 2, 3, 4):
        _dcp(root / f"step_{step}", float(step))
    inj.flip_in_tensor_payload(root / "step_1", "w")
    write_stamp(root / "step_1", verify_checkpoint(root / "step_1"), step=1)
    before = {p.name: p.read_bytes() for p in (root / "step_1").iterdir()}
    result = prune(root, keep=1)
    kept = {k["path"]: k["why"] for k in result.kept}
    assert kept["step_1"] == "failed verification: kept as evidence, never deleted"
    assert result.deleted == ["step_3", "step_2"]
    assert {p.name: p.read_bytes() for p in (root / "step_1").iterdir()} == before


def test_prune_skips_a_checkpoint_being_verified(tmp_path: Path) -> None:
    root = tmp_path / "run"
    for step in (1, 2, 3):
        _dcp(root / f"step_{step}", float(step))
    lock = os.open(root / "step_1" / VERIFYING_LOCK, os.O_RDWR | os.O_CREAT)
    fcntl.flock(lock, fcntl.LOCK_EX)
    try:
        result = prune(root, keep=1)
    finally:
        os.close(lock)
    assert result.deleted == ["step_2"] and (root / "step_1").exists()


def test_watch_once_stamps_every_committed_checkpoint_and_fails_on_a_bad_one(run: Path, tmp_path: Path) -> None:
    log = tmp_path / "watch.jsonl"
    result = watch(run, once=True, log=str(log))
    events = {r["path"]: r["event"] for r in result.results}
    assert events == {"step_10": "verified", "step_20": "verified", "step_40": "failed"}  # step_30 not committed
    assert [json.loads(line)["path"] for line in log.read_text().splitlines()] == [r["path"] for r in result.results]
    for step in (10, 20, 40):
        stamp = read_stamp(run / f"step_{step}")
        assert stamp is not None and stamp.current and stamp.passed == (step != 40)
    # A second pass verifies nothing again: the stamps are current (the failed one is reported again).
    again = watch(run, once=True, log=str(log)).results
    assert [(r["path"], r["event"], r.get("stamped")) for r in again] == [("step_40", "failed", True)]
    cli = CliRunner().invoke(main, ["watch", "--once", "--json", "--log", str(log), str(run)])
    assert cli.exit_code == 1 and '"step_40"' in cli.output


def test_watch_picks_up_a_checkpoint_committed_later(tmp_path: Path) -> None:
    root = tmp_path / "run"
    _dcp(root / "step_1", 1.0)
    seen: list[dict] = []
    first_pass_done = threading.Event()

    def on_result(item: dict) -> None:
        seen.append(item)
        first_pass_done.set()

    def late_save() -> None:
        assert first_pass_done.wait(timeout=300)  # committed while the watcher runs, after it listed step_1
        _dcp(root / "step_2", 2.0)

    saver = threading.Thread(target=late_save)
    saver.start()
    try:
        watch(root, interval=0.2, max_passes=15, on_result=on_result, log=str(tmp_path / "w.jsonl"))
    finally:
        first_pass_done.set()
        saver.join()
    assert {r["path"] for r in seen if r["event"] == "verified"} >= {"step_1"}
    # Whatever the timing, once the save is done one more pass stamps it.
    watch(root, once=True, log=str(tmp_path / "w.jsonl"))
    assert read_stamp(root / "step_2").current


def test_watch_copes_with_retention_deleting_checkpoints(tmp_path: Path) -> None:
    """A checkpoint removed mid-verification is logged as deleted, never as a failure, and the watcher lives."""
    root = tmp_path / "run"
    for step in range(1, 7):
        _dcp(root / f"step_{step}", float(step), manifest=False)
    code = (
        "import shutil, sys, time, pathlib\n"
        "root = pathlib.Path(sys.argv[1])\n"
        "for p in sorted(root.iterdir()):\n"
        "    time.sleep(0.02)\n"
        "    shutil.rmtree(p, ignore_errors=True)\n"
    )
    deleter = subprocess.Popen([sys.executable, "-c", code, str(root)])
    result = watch(root, interval=0.05, max_passes=5, log=str(tmp_path / "w.jsonl"))
    deleter.wait(timeout=60)
    assert all(r["event"] in ("verified", "deleted", "changed") for r in result.results), [
        r for r in result.results if r["event"] not in ("verified", "deleted", "changed")]


def test_a_stamp_write_cut_short_leaves_a_temporary_file_that_is_noted_not_warned_about(tmp_path: Path) -> None:
    path = _dcp(tmp_path / "step_1", 1.0)
    (path / ".ckptverify-stamp-abc123").write_text('{"schema": "ckptverify/st')  # the process died mid-write
    report = verify_checkpoint(path)
    assert report.passed and not report.warnings
    assert any(f.check == "file-unreferenced" and ".ckptverify-stamp-abc123" in f.message for f in report.findings)
    (path / "planted.bin").write_bytes(b"x")  # anything else is still a warning
    assert [f.location.file for f in verify_checkpoint(path).warnings] == ["planted.bin"]


def test_retention_refuses_keeping_none_and_every_run_command_refuses_what_is_not_a_directory(tmp_path: Path) -> None:
    from ckptverify.errors import CheckpointNotFoundError, UsageError
    from ckptverify.runs.scan import scan_run_dir

    with pytest.raises(UsageError, match="keep must be at least 1, got 0"):
        prune(tmp_path, keep=0)
    afile = tmp_path / "model.pt"
    afile.write_bytes(b"x")
    for call in (lambda p: prune(p, keep=1), latest_verified, scan_run_dir, watch):
        for where in (tmp_path / "missing", afile):
            with pytest.raises(CheckpointNotFoundError, match="not a directory"):
                call(where)
    assert afile.read_bytes() == b"x"


def test_watch_reports_a_failed_stamp_once_however_many_passes_see_it(tmp_path: Path) -> None:
    root = tmp_path / "run"
    path = _dcp(root / "step_1", 1.0)
    inj.flip_in_tensor_payload(path, "w")
    result = watch(root, interval=0.01, max_passes=4, notify=False, settle=0.0, log=str(tmp_path / "w.jsonl"))
    assert [r["event"] for r in result.results] == ["failed", "failed"], result.results
    assert "checked_at" not in result.results[0] and result.results[1]["checked_at"]  # verified, then its stamp
    assert result.exit_code == 1 and result.state.corrupt == 1
