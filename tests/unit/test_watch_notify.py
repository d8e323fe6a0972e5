"""The watcher wakes on change notification (inotify) instead of waiting out its polling interval; a pass with
nothing to judge says why."""

from __future__ import annotations

import sys
import threading
from pathlib import Path

import pytest
import torch

from ckptverify import save
from ckptverify.runs.stamp import read_stamp
from ckptverify.verifier import notify
from ckptverify.verifier.notify import DirectoryNotifier
from ckptverify.verifier.watch import watch

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="inotify is Linux's")


def _dcp(path: Path, value: float) -> None:
    # ckptverify's save: its manifest is the commit, so a watcher never sees it committed and then changing.
    save({"w": torch.full((64, 64), value)}, path)


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
def test_watch_verifies_a_new_save_long_before_its_polling_interval(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = tmp_path / "run"
    _dcp(root / "step_1", 1.0)
    seen: list[tuple[list[bool], dict]] = []
    first_pass_done = threading.Event()
    woken: list[bool] = []  # what each wait between passes answered: True when a change cut it short
    wait = notify.DirectoryNotifier.wait
    monkeypatch.setattr(notify.DirectoryNotifier, "wait",
                        lambda self, timeout: woken.append(wait(self, timeout)) or woken[-1])

    def late_save() -> None:
        assert first_pass_done.wait(timeout=300)
        _dcp(root / "step_2", 2.0)

    def on_result(item: dict) -> None:
        seen.append((list(woken), item))
        if item["path"] == "step_1":
            first_pass_done.set()
        if item["path"] == "step_2":
            raise KeyboardInterrupt  # the watcher's way out, as from a terminal

    saver = threading.Thread(target=late_save)
    saver.start()
    try:
        result = watch(root, interval=120, max_passes=100, on_result=on_result, log=str(tmp_path / "w.jsonl"))
    finally:
        first_pass_done.set()
        saver.join()
    assert result.notify
    when = {item["path"]: (waits, item["event"]) for waits, item in seen}
    assert when["step_2"][1] == "verified"
    # Every wait before it ended early, woken by the save; none ran out the 120-second poll.
    assert when["step_2"][0] and all(when["step_2"][0]), when["step_2"][0]
    assert read_stamp(root / "step_2").current


def test_without_notification_the_watcher_polls(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(notify, "_libc", lambda: None)
    root = tmp_path / "run"
    _dcp(root / "step_1", 1.0)
    assert DirectoryNotifier.open(root) is None
    result = watch(root, interval=0.1, max_passes=2, log=str(tmp_path / "w.jsonl"))
    assert not result.notify and result.passes == 2
    assert read_stamp(root / "step_1").current


def test_watch_verifies_and_stamps_every_format_once_it_has_settled(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    from ckptverify.runs.latest import latest_verified
    from ckptverify.verifier.watch import watch

    def watch_pass(root: Path, quiet: float) -> list[dict]:
        return watch(root, once=True, quiet=quiet, log=str(tmp_path / "watch.jsonl")).results

    root = tmp_path / "run"
    _dcp(root / "step_10", 1.0)
    (root / "checkpoint-20").mkdir()
    save_file({"w": torch.full((32, 32), 2.0)}, str(root / "checkpoint-20" / "model.safetensors"))
    torch.save({"state_dict": {"w": torch.full((32, 32), 3.0)}, "global_step": 30}, root / "epoch=0-step=30.ckpt")
    # Just written, with no commit marker: not taken for finished until it has been quiet for a while.
    early = {r["path"]: r["event"] for r in watch_pass(root, quiet=60)}
    assert early == {"step_10": "verified"}
    done = {r["path"]: r["event"] for r in watch_pass(root, quiet=0)}
    assert done == {"checkpoint-20": "verified", "epoch=0-step=30.ckpt": "verified"}
    assert read_stamp(root / "checkpoint-20").current
    assert read_stamp(root / "epoch=0-step=30.ckpt").current  # beside the file
    assert watch_pass(root, quiet=0) == []  # every stamp current: nothing to do
    assert latest_verified(root).path.endswith("epoch=0-step=30.ckpt")
    # A byte flipped in the file's payload: its stamp goes stale, the next pass verifies it again and fails it.
    ckpt = root / "epoch=0-step=30.ckpt"
    data = bytearray(ckpt.read_bytes())
    at = data.find(torch.full((32, 32), 3.0).numpy().tobytes()[:64])
    assert at > 0
    data[at + 5] ^= 0x40
    ckpt.write_bytes(bytes(data))
    again = watch_pass(root, quiet=0)
    assert [(r["path"], r["event"]) for r in again] == [("epoch=0-step=30.ckpt", "failed")]
    assert not read_stamp(ckpt).passed
    # The bare safetensors folder passed, but nothing could check its content: its stamp ranks it no higher than
    # that, and the older DCP checkpoint that verified is the one to resume from.
    found = latest_verified(root)
    assert found.path.endswith("step_10")
    assert [(s["path"], s["state"], s["how"]) for s in found.skipped] == [
        ("epoch=0-step=30.ckpt", "corrupt", "stamp"), ("checkpoint-20", "uncheckable", "stamp")]


def test_a_pass_with_nothing_finished_says_so_and_exits_1(tmp_path: Path) -> None:
    torn = tmp_path / "step_1"
    _dcp(torn, 1.0)
    (torn / ".metadata").unlink()  # a DCP save not committed (still being written, or torn)
    result = watch(tmp_path, once=True, notify=False)
    assert result.nothing == "1 checkpoint(s) found, none finished (still being written, or torn)"
    assert result.exit_code == 1 and result.state.pending == 1


def test_a_pass_whose_checkpoints_were_all_removed_before_their_verification_says_so_and_exits_2() -> None:
    from ckptverify.verifier.watch import RunState, WatchResult

    gone = WatchResult(state=RunState(checkpoints=2, deleted=2))
    assert gone.nothing == "2 checkpoint(s) found, all removed before they could be verified"
    assert gone.exit_code == 2
