"""``watch``, ``--metrics-file``, ckptverify's own output files and ``latest --path-only`` against careless
operators and planted files: a verdict stands without its stamp, nothing hangs on a FIFO or writes through a
link, gauges describe the run after every pass, and every number and name is printed exactly."""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from click.testing import CliRunner
from helpers import faults as inj

from ckptverify.audit.adopt import fingerprint_checkpoint
from ckptverify.cli import main
from ckptverify.ownfiles.events import EventLog
from ckptverify.ownfiles.names import STAMP_FILE, append_line, write_atomic
from ckptverify.runs.stamp import read_stamp
from ckptverify.verifier.notify import DirectoryNotifier
from ckptverify.verifier.watch import watch

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="inotify and FIFOs as on Linux")
REPO = Path(__file__).resolve().parents[2]
#: A command that regressed into blocking on a FIFO fails the test at this bound instead of hanging the suite.
HANG_LIMIT_S = 60


def _dcp(path: Path, value: float) -> Path:
    dcp.save({"w": torch.full((64, 64), value), "step": int(value)}, checkpoint_id=str(path))
    fingerprint_checkpoint(path)
    return path


def _cli(*args: str | bytes, timeout: float = HANG_LIMIT_S) -> subprocess.CompletedProcess[bytes]:
    """``ckptverify ARGS`` in a fresh process (raw bytes in and out), failing the test if it hangs."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    try:
        return subprocess.run([sys.executable, "-m", "ckptverify", *args], capture_output=True, timeout=timeout,
                              env=env, cwd=REPO)
    except subprocess.TimeoutExpired:
        pytest.fail(f"ckptverify {args!r} still running after {timeout} s: it hangs")


def _gauges(path: Path) -> dict[str, str]:
    """``{metric name: value as written}`` of a Prometheus text file (one target per file)."""
    out = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        if line and not line.startswith("#"):
            name, value = re.fullmatch(r"ckptverify_(\w+)\{.*\} (\S+)", line).groups()
            out[name] = value
    return out


def _unstampable(checkpoint: Path) -> None:
    """Make the stamp impossible to write, as a read-only directory does (root ignores permissions): a
    directory where the stamp file goes."""
    (checkpoint / STAMP_FILE).mkdir()


# ---------------------------------------------------------------- a verdict does not depend on its stamp


def test_a_corrupt_checkpoint_whose_stamp_cannot_be_written_still_fails_watch(tmp_path: Path) -> None:
    root = tmp_path / "run"
    good, bad = _dcp(root / "step_1", 1.0), _dcp(root / "step_2", 2.0)
    inj.flip_in_tensor_payload(bad, "w")
    for ckpt in (good, bad):
        _unstampable(ckpt)
    log = tmp_path / "w.jsonl"
    result = CliRunner().invoke(main, ["watch", "--once", "--json", "--log", str(log), str(root)])
    assert result.exit_code == 1, result.output
    items = {i["path"]: i for i in map(json.loads, result.output.splitlines())}
    assert items["step_2"]["event"] == "failed" and items["step_2"]["state"] == "corrupt"
    assert items["step_1"]["event"] == "verified"
    for item in items.values():
        assert item["stamped"] is False and "stamp_error" in item
    assert read_stamp(good) is None and read_stamp(bad) is None
    # Text mode says the same, and says the verdicts carry no stamp.
    text = CliRunner().invoke(main, ["watch", "--once", "--log", str(log), str(root)])
    assert text.exit_code == 1
    assert "FAILED: step_2 (step 2): corrupt" in text.output and "NOT STAMPED" in text.output


def test_a_good_checkpoint_that_cannot_be_stamped_passes_with_a_note(tmp_path: Path) -> None:
    root = tmp_path / "run"
    _unstampable(_dcp(root / "step_1", 1.0))
    result = CliRunner().invoke(main, ["watch", "--once", "--log", str(tmp_path / "w.jsonl"), str(root)])
    assert result.exit_code == 0, result.output
    assert "verified: step_1 (step 1)" in result.output and "NOT STAMPED" in result.output


def test_a_checkpoint_that_cannot_be_verified_at_all_exits_2(tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    import ckptverify.audit.verify

    root = tmp_path / "run"
    _dcp(root / "step_1", 1.0)

    def unreadable(*args: object, **kwargs: object) -> None:
        raise PermissionError(13, "Permission denied", str(root / "step_1" / ".metadata"))

    monkeypatch.setattr(ckptverify.audit.verify, "verify_checkpoint", unreadable)
    result = CliRunner().invoke(main, ["watch", "--once", "--json", "--log", str(tmp_path / "w.jsonl"), str(root)])
    assert result.exit_code == 2, result.output
    (item,) = map(json.loads, result.output.splitlines())
    assert item["event"] == "error" and "Permission denied" in item["reason"]


@pytest.mark.skipif(hasattr(os, "geteuid") and os.geteuid() == 0, reason="root writes read-only directories")
def test_a_read_only_run_directory_still_gets_verdicts(tmp_path: Path) -> None:
    root = tmp_path / "run"
    good, bad = _dcp(root / "step_1", 1.0), _dcp(root / "step_2", 2.0)
    inj.flip_in_tensor_payload(bad, "w")
    for path in (good, bad, root):
        path.chmod(0o555)
    try:
        result = CliRunner().invoke(main, ["watch", "--once", "--json", "--log", str(tmp_path / "w.jsonl"),
                                           str(root)])
    finally:
        for path in (root, good, bad):
            path.chmod(0o755)
    assert result.exit_code == 1, result.output
    items = {i["path"]: (i["event"], i["stamped"]) for i in map(json.loads, result.output.splitlines())}
    assert items == {"step_1": ("verified", False), "step_2": ("failed", False)}


# ---------------------------------------------------------------- own output files: no FIFO, link or device


@linux_only
def test_a_fifo_named_events_jsonl_is_refused_not_waited_on(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "events.jsonl")
    code = ("import sys\nfrom ckptverify.ownfiles.events import EventLog\n"
            "try:\n    EventLog(sys.argv[1]).emit('save', step=1)\n"
            "except OSError as exc:\n    print(exc); sys.exit(3)\n")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    try:
        done = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True,
                              timeout=HANG_LIMIT_S, env=env)
    except subprocess.TimeoutExpired:
        pytest.fail("appending an event to a FIFO hangs")
    assert done.returncode == 3 and "FIFO" in done.stdout, done.stdout + done.stderr
    assert (tmp_path / "events.jsonl").is_fifo()


def test_a_symlinked_events_jsonl_is_not_written_through(tmp_path: Path) -> None:
    target = tmp_path / "elsewhere.txt"
    target.write_text("precious\n")
    run = tmp_path / "run"
    run.mkdir()
    (run / "events.jsonl").symlink_to(target)
    with pytest.raises(OSError, match="symbolic link"):
        EventLog(run).emit("save", step=1)
    assert target.read_text() == "precious\n"


@linux_only
def test_a_fifo_named_like_the_watch_log_is_refused_at_once(tmp_path: Path) -> None:
    root = tmp_path / "run"
    _dcp(root / "step_1", 1.0)
    os.mkfifo(root / "ckptverify-watch.jsonl")
    done = _cli("watch", "--once", str(root))
    assert done.returncode == 2, done.stderr
    assert b"FIFO" in done.stderr and done.stdout == b""
    assert read_stamp(root / "step_1") is None  # refused before anything was done


@linux_only
@pytest.mark.parametrize("command", ["verify", "watch"])
def test_a_metrics_file_that_is_a_fifo_or_a_link_to_a_device_is_never_replaced(tmp_path: Path,
                                                                               command: str) -> None:
    root = tmp_path / "run"
    ckpt = _dcp(root / "step_1", 1.0)
    fifo, link = tmp_path / "fifo.prom", tmp_path / "link.prom"
    os.mkfifo(fifo)
    link.symlink_to("/dev/null")
    for metrics in (fifo, link):
        args = ["--once", "--log", str(tmp_path / "w.jsonl"), str(root)] if command == "watch" else [str(ckpt)]
        done = _cli(command, "--metrics-file", str(metrics), *args)
        assert done.returncode == 2, done.stdout + done.stderr
        assert b"not a regular file" in done.stderr and b"internal error" not in done.stderr
    assert fifo.is_fifo() and link.is_symlink() and os.readlink(link) == "/dev/null"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".ckptverify-metrics-")]


@linux_only
def test_an_atomic_write_never_replaces_what_is_not_a_regular_file(tmp_path: Path) -> None:
    fifo, link, device = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    os.mkfifo(fifo)
    link.symlink_to("/dev/null")
    targets = [fifo, link]
    try:  # a device node of its own (as root): never replaced by a regular file
        os.mknod(device, 0o600 | stat.S_IFCHR, os.makedev(1, 3))
        targets.append(device)
    except OSError:  # not root, or a file system without device nodes
        pass
    for target in targets:
        with pytest.raises(OSError, match="not a regular file"):
            write_atomic(target, "x", prefix=".ckptverify-metrics-")
        with pytest.raises(OSError, match="not a regular file"):
            append_line(target, b"x\n")
    assert fifo.is_fifo() and link.is_symlink() and sorted(os.listdir(tmp_path)) == [t.name for t in targets]
    if device in targets:
        assert stat.S_ISCHR(os.lstat(device).st_mode)


# ---------------------------------------------------------------- gauges describe the run, every pass


def test_watch_gauges_describe_the_run_not_the_last_result(tmp_path: Path) -> None:
    root = tmp_path / "run"
    inj.flip_in_tensor_payload(_dcp(root / "step_1", 1.0), "w")  # corrupt first, then a good one
    _dcp(root / "step_2", 2.0)
    metrics = tmp_path / "watch.prom"
    result = CliRunner().invoke(main, ["watch", "--once", "--metrics-file", str(metrics), "--log",
                                       str(tmp_path / "w.jsonl"), str(root)])
    assert result.exit_code == 1
    gauges = _gauges(metrics)
    assert gauges["passed"] == "0" and gauges["errors"] == "1"
    assert gauges["corrupt_checkpoints"] == "1" and gauges["verified_checkpoints"] == "1"
    assert gauges["checkpoints"] == "2" and gauges["last_good_step"] == "2"


def test_an_idle_pass_refreshes_the_gauges(tmp_path: Path) -> None:
    root = tmp_path / "run"
    _dcp(root / "step_1", 1.0)
    metrics = tmp_path / "watch.prom"
    watch(root, once=True, log=str(tmp_path / "w.jsonl"), metrics_file=str(metrics))  # stamps it
    os.unlink(metrics)
    before = time.time()
    result = watch(root, interval=0.1, max_passes=3, notify=False, log=str(tmp_path / "w.jsonl"),
                   metrics_file=str(metrics))
    assert result.results == []  # nothing new to verify: every pass was idle
    gauges = _gauges(metrics)
    assert gauges["passes"] == "3" and gauges["verified_checkpoints"] == "1" and gauges["passed"] == "1"
    assert before - 1 <= float(gauges["last_run_timestamp_seconds"]) <= time.time() + 1


def test_gauges_print_integers_and_timestamps_exactly(tmp_path: Path) -> None:
    root = tmp_path / "run"
    _dcp(root / "step_1234567", 3.0)
    metrics = tmp_path / "scan.prom"
    before = time.time()
    result = CliRunner().invoke(main, ["scan", "--json", "--metrics-file", str(metrics), str(root)])
    assert result.exit_code == 0, result.output
    gauges = _gauges(metrics)
    assert gauges["last_good_step"] == "1234567"
    assert int(gauges["bytes_checked"]) > 64 * 64 * 4 and "e" not in gauges["bytes_checked"]
    assert before - 1 <= float(gauges["last_run_timestamp_seconds"]) <= time.time() + 1  # not rounded to 6 digits
    watch(root, once=True, log=str(tmp_path / "w.jsonl"), metrics_file=str(metrics))
    assert _gauges(metrics)["last_good_step"] == "1234567"


@linux_only
def test_a_target_that_is_not_utf8_is_written_as_escaped_bytes(tmp_path: Path) -> None:
    ckpt = _dcp(tmp_path / "step_1", 1.0)
    odd = os.path.join(os.fsencode(tmp_path), b"ckpt-\xff")
    try:
        os.rename(ckpt, odd)
    except OSError:
        pytest.skip("this file system refuses names that are not UTF-8")
    metrics = tmp_path / "m.prom"
    done = _cli("verify", "--no-progress", "--metrics-file", str(metrics), odd)
    assert done.returncode == 0, done.stderr
    text = metrics.read_bytes().decode("utf-8")  # valid UTF-8, as the text format requires
    assert 'target="' in text and "ckpt-\\\\xff" in text


def test_a_missing_metrics_directory_stops_watch_before_it_stamps_anything(tmp_path: Path) -> None:
    root = tmp_path / "run"
    _dcp(root / "step_1", 1.0)
    result = CliRunner().invoke(main, ["watch", "--once", "--metrics-file", str(tmp_path / "no" / "m.prom"),
                                       "--log", str(tmp_path / "w.jsonl"), str(root)])
    assert result.exit_code == 2 and "does not exist" in result.output
    assert "internal error" not in result.output
    assert read_stamp(root / "step_1") is None  # nothing stamped behind the operator's back


# ---------------------------------------------------------------- the watcher is not woken by its own writes


@linux_only
def test_a_checkpoint_that_cannot_be_stamped_is_not_retried_faster_than_the_interval(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = tmp_path / "run"
    _unstampable(_dcp(root / "step_1", 1.0))
    interval, passes = 0.6, 4
    woken: list[bool] = []  # what each wait between passes answered: True when a change cut it short
    wait = DirectoryNotifier.wait
    monkeypatch.setattr(DirectoryNotifier, "wait", lambda self, timeout: woken.append(wait(self, timeout)) or woken[-1])
    result = watch(root, interval=interval, max_passes=passes)  # the log in the run directory, inotify on
    assert result.notify
    # Each pass waits out the interval: its own log line and lock do not wake it ...
    assert woken == [False] * (passes - 1)
    # ... and an unchanged checkpoint already judged is neither verified nor logged again.
    lines = (root / "ckptverify-watch.jsonl").read_text().splitlines()
    assert [(json.loads(x)["event"], json.loads(x)["stamped"]) for x in lines] == [("verified", False)]


# ---------------------------------------------------------------- what is printed


def test_latest_path_only_refuses_a_newline_and_null_prints_it_exactly(tmp_path: Path) -> None:
    root = tmp_path / "run\nrm -rf x"
    _dcp(root / "step_5", 5.0)
    line = _cli("latest", "--path-only", str(root))
    assert line.returncode == 2 and line.stdout == b"" and b"--null" in line.stderr
    null = _cli("latest", "-0", str(root))
    assert null.returncode == 0 and null.stdout == os.fsencode(root / "step_5") + b"\0"
    plain = tmp_path / "plain"
    shutil.copytree(root, plain)
    ok = _cli("latest", "--path-only", str(plain))
    assert ok.returncode == 0 and ok.stdout == os.fsencode(plain / "step_5") + b"\n"


def test_watch_once_on_an_empty_folder_says_there_was_nothing_to_verify(tmp_path: Path) -> None:
    empty = tmp_path / "run"
    empty.mkdir()
    result = CliRunner().invoke(main, ["watch", "--once", "--log", str(tmp_path / "w.jsonl"), str(empty)])
    assert result.exit_code == 2 and "error: nothing to verify" in result.output
    as_json = CliRunner().invoke(main, ["watch", "--once", "--json", "--log", str(tmp_path / "w.jsonl"),
                                        str(empty)])
    assert as_json.exit_code == 2
    (item,) = map(json.loads, as_json.output.splitlines())
    assert item["event"] == "nothing" and item["exit_code"] == 2
    # A run whose checkpoints are all verified already is not "nothing": it passes.
    _dcp(empty / "step_1", 1.0)
    assert CliRunner().invoke(main, ["watch", "--once", "--log", str(tmp_path / "w.jsonl"), str(empty)]).exit_code == 0
    again = CliRunner().invoke(main, ["watch", "--once", "--log", str(tmp_path / "w.jsonl"), str(empty)])
    assert again.exit_code == 0 and again.output == ""


def test_watch_errors_are_one_line_of_text_or_one_json_object_per_line(tmp_path: Path) -> None:
    missing = tmp_path / "nope"
    text = _cli("watch", "--once", str(missing))
    assert text.returncode == 2 and text.stdout == b""
    assert text.stderr.decode().strip().count("\n") == 0 and b"not a directory" in text.stderr
    as_json = _cli("watch", "--once", "--json", str(missing))
    assert as_json.returncode == 2
    (line,) = as_json.stdout.decode().splitlines()
    assert json.loads(line)["exit_code"] == 2
    # Results too: text lines without --json, JSON objects with it.
    root = tmp_path / "run"
    _dcp(root / "step_1", 1.0)
    shown = _cli("watch", "--once", "--log", str(tmp_path / "w.jsonl"), str(root))
    assert shown.returncode == 0 and shown.stdout.decode().startswith("verified: step_1 (step 1): verified")


def test_a_pass_that_could_not_see_part_of_the_run_does_not_pass(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    from ckptverify.formats import rundir

    monkeypatch.setattr(rundir, "MAX_FOLDER_ENTRIES", 50)
    root = tmp_path / "run"
    _dcp(root / "step_1", 1.0)
    crowded = root / "crowded"
    crowded.mkdir()
    for i in range(80):  # more entries than the walk reads from one folder: a checkpoint among them is unseen
        (crowded / f"f{i:03d}").write_bytes(b"")
    result = CliRunner().invoke(main, ["watch", "--once", "--json", "--log", str(tmp_path / "w.jsonl"), str(root)])
    assert result.exit_code == 2, result.output
    items = [json.loads(x) for x in result.output.splitlines()]
    assert [i["event"] for i in items if i["event"] != "problem"] == ["verified"]
    (problem,) = [i for i in items if i["event"] == "problem"]
    assert "was not seen" in problem["reason"] and "crowded" in problem["reason"]
