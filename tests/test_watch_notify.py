"""The watcher wakes on change notification (inotify) instead of waiting out its polling interval."""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from ckptverify.adopt import fingerprint_checkpoint
from ckptverify.runs import notify
from ckptverify.runs.notify import DirectoryNotifier
from ckptverify.runs.stamp import read_stamp
from ckptverify.runs.watch import watch

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="inotify is Linux's")


def _dcp(path: Path, value: float) -> None:
    dcp.save({"w": torch.full((64, 64), value)}, checkpoint_id=str(path))
    fingerprint_checkpoint(path)


@linux_only
def test_the_notifier_wakes_on_a_new_checkpoint_and_on_files_inside_it(tmp_path: Path) -> None:
    with DirectoryNotifier.open(tmp_path) as notifier:
        assert notifier is not None
        assert notifier.wait(0.05) is False  # nothing happened
        (tmp_path / "step_1").mkdir()
        assert notifier.wait(5.0) is True
        (tmp_path / "step_1" / ".metadata").write_bytes(b"x")  # inside the new directory: watched too
        assert notifier.wait(5.0) is True
        assert notifier.wait(0.05) is False  # the burst was drained


@linux_only
def test_watch_verifies_a_new_save_long_before_its_polling_interval(tmp_path: Path) -> None:
    root = tmp_path / "run"
    _dcp(root / "step_1", 1.0)
    seen: list[tuple[float, dict]] = []
    start = time.monotonic()

    def late_save() -> None:
        time.sleep(0.5)
        _dcp(root / "step_2", 2.0)

    def on_result(item: dict) -> None:
        seen.append((time.monotonic() - start, item))
        if item["path"] == "step_2":
            raise KeyboardInterrupt  # the watcher's way out, as from a terminal

    saver = threading.Thread(target=late_save)
    saver.start()
    result = watch(root, interval=120, max_passes=100, on_result=on_result, log=str(tmp_path / "w.jsonl"))
    saver.join()
    assert result.notify
    when = {item["path"]: (t, item["event"]) for t, item in seen}
    assert when["step_2"][1] == "verified"
    assert when["step_2"][0] < 60  # woken by the save, not by the 120-second poll
    assert read_stamp(root / "step_2").current


def test_without_notification_the_watcher_polls(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(notify, "_libc", lambda: None)
    root = tmp_path / "run"
    _dcp(root / "step_1", 1.0)
    assert DirectoryNotifier.open(root) is None
    result = watch(root, interval=0.1, max_passes=2, log=str(tmp_path / "w.jsonl"))
    assert not result.notify and result.passes == 2
    assert read_stamp(root / "step_1").current
