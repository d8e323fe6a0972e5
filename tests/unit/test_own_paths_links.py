"""The folders ckptverify makes and moves into (a run's quarantine and trace segments, a trace store, its op logs
and captures, a checkpoint folder given a suspect note) are never reached through a planted link and never leave
the folder they belong to; a quarantine that cannot take a checkpoint (a link, a file, another file system) is
refused with a clear message and nothing is moved, never copied and deleted."""

from __future__ import annotations

import datetime
import errno
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

from ckptverify.errors import CkptVerifyError, NotRegularFileError, ResumeRefusedError
from ckptverify.ownfiles.events import read_events
from ckptverify.ownfiles.names import own_dir
from ckptverify.production import mode
from ckptverify.runs import latest as latest_mod
from ckptverify.runs.latest import Latest, move_aside
from ckptverify.runs.stamp import write_suspect_note
from ckptverify.runs.states import QUARANTINE_DIR
from ckptverify.trace.ops import _capture, write_op_log
from ckptverify.trace.store import TraceHeader, TraceWriter

SCRIPT = Path(__file__).resolve().parents[1] / "user_scripts" / "production_train.py"


def _evidence(run: Path, name: str = "step_4") -> dict[str, bytes]:
    """A stand-in checkpoint folder ``run/name`` with one file; returns what is in it."""
    (run / name).mkdir(parents=True)
    (run / name / "__0_0.distcp").write_bytes(b"evidence")
    return _files(run / name)


def _files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in folder.iterdir()} if folder.is_dir() else {}


def _elsewhere(tmp_path: Path) -> Path:
    out = tmp_path / "elsewhere"
    out.mkdir()
    return out


# ------------------------------------------------------------------------------------------------ own_dir


def test_own_dir_refuses_a_link_on_the_way_and_makes_nothing_through_it(tmp_path: Path) -> None:
    out = _elsewhere(tmp_path)
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "trace").symlink_to(out)
    with pytest.raises(NotRegularFileError, match="a symbolic link, not a directory"):
        own_dir(tmp_path / "run", "trace", "from-00000000")
    assert list(out.iterdir()) == []


def test_own_dir_refuses_a_file_where_its_folder_should_be(tmp_path: Path) -> None:
    (tmp_path / "trace").write_text("x")
    with pytest.raises(NotRegularFileError, match="a regular file, not a directory"):
        own_dir(tmp_path, "trace", "from-00000000")
    assert (tmp_path / "trace").read_text() == "x"


def test_own_dir_refuses_a_name_that_leaves_its_root(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="not one folder name"):
        own_dir(tmp_path / "run", "..", "elsewhere")
    assert not (tmp_path / "elsewhere").exists()


# ------------------------------------------------------------------------------------------------ quarantine


def test_a_quarantine_linked_out_of_the_run_directory_is_refused_and_nothing_moves(tmp_path: Path) -> None:
    run, out = tmp_path / "run", _elsewhere(tmp_path)
    before = _evidence(run)
    (run / QUARANTINE_DIR).symlink_to(out)
    with pytest.raises(CkptVerifyError, match=r"a symbolic link, not a directory.*nothing was moved"):
        move_aside(run, "step_4")
    assert _files(run / "step_4") == before and list(out.iterdir()) == []


def test_a_quarantine_that_is_a_file_is_refused_and_nothing_moves(tmp_path: Path) -> None:
    run = tmp_path / "run"
    before = _evidence(run)
    (run / QUARANTINE_DIR).write_text("not a folder")
    with pytest.raises(CkptVerifyError, match=r"a regular file, not a directory.*nothing was moved"):
        move_aside(run, "step_4")
    assert _files(run / "step_4") == before and (run / QUARANTINE_DIR).read_text() == "not a folder"


def test_a_quarantine_on_another_file_system_is_refused_never_copied(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    run = tmp_path / "run"
    before = _evidence(run)

    def cross_device(*args: object, **kwargs: object) -> None:
        raise OSError(errno.EXDEV, "Invalid cross-device link")

    monkeypatch.setattr(os, "rename", cross_device)
    monkeypatch.setattr(os, "replace", cross_device)
    with pytest.raises(CkptVerifyError, match=r"on another file system.*never copied and deleted.*nothing was moved"):
        move_aside(run, "step_4")
    assert _files(run / "step_4") == before and list((run / QUARANTINE_DIR).iterdir()) == []


def test_a_name_swapped_for_a_link_after_the_quarantine_was_opened_does_not_redirect_the_move(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    run, out = tmp_path / "run", _elsewhere(tmp_path)
    before = _evidence(run)
    opened = latest_mod.open_own_dir

    def then_swap(root: str, *names: str) -> int:
        fd = opened(root, *names)
        os.rename(run / QUARANTINE_DIR, run / "kept")  # the folder opened stays the one moved into
        (run / QUARANTINE_DIR).symlink_to(out)
        return fd

    monkeypatch.setattr(latest_mod, "open_own_dir", then_swap)
    moved = move_aside(run, "step_4")
    assert list(out.iterdir()) == [] and _files(run / "kept" / moved.split("/", 1)[1]) == before


def test_a_quarantine_name_taken_gets_a_counter_and_none_free_moves_nothing(tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    class _Frozen(datetime.datetime):
        @classmethod
        def now(cls, tz: datetime.tzinfo | None = None) -> _Frozen:  # type: ignore[override]
            return cls(2026, 1, 2, 3, 4, 5, tzinfo=tz)

    monkeypatch.setattr(latest_mod, "_dt", types.SimpleNamespace(datetime=_Frozen, UTC=datetime.UTC))
    run = tmp_path / "run"
    before = _evidence(run)
    earlier = run / QUARANTINE_DIR / "step_4.moved-20260102T030405Z"
    earlier.mkdir(parents=True)
    (earlier / "kept").write_bytes(b"earlier evidence")
    assert move_aside(run, "step_4") == f"{QUARANTINE_DIR}/step_4.moved-20260102T030405Z-1"
    assert (earlier / "kept").read_bytes() == b"earlier evidence"
    assert _files(run / QUARANTINE_DIR / "step_4.moved-20260102T030405Z-1") == before
    again = _evidence(run)
    for n in range(2, 1000):
        (run / QUARANTINE_DIR / f"step_4.moved-20260102T030405Z-{n}").write_bytes(b"")
    with pytest.raises(CkptVerifyError, match=r"no free name in .* for step_4; nothing was moved"):
        move_aside(run, "step_4")
    assert _files(run / "step_4") == again


def _production(run: Path, **kw: object) -> mode.ProductionOptions:
    return mode.ProductionOptions(run_dir=str(run), steps=6, save_every=2, verify="off", **kw)


def _corrupt_newest(run: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, bytes]:
    """``run`` holds step_2 (good, picked) and step_4 (corrupt, to be moved aside) as the pick sees them."""
    _evidence(run, "step_2")
    before = _evidence(run)
    skipped = [{"path": "step_4", "step": 4, "state": "corrupt", "reason": "zip-crc: a record's CRC-32 differs",
                "how": "verified now"}]
    monkeypatch.setattr(latest_mod, "latest_verified",
                        lambda *a, **k: Latest(path=str(run / "step_2"), step=2, skipped=skipped))
    return before


def test_a_production_restart_over_a_corrupt_checkpoint_refuses_a_linked_quarantine(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    run, out = tmp_path / "run", _elsewhere(tmp_path)
    before = _corrupt_newest(run, monkeypatch)
    (run / QUARANTINE_DIR).symlink_to(out)
    with pytest.raises(ResumeRefusedError, match=r"cannot move step_4 aside.*a symbolic link"):
        mode.resume_point(_production(run), rank=0, world=1)
    assert _files(run / "step_4") == before and list(out.iterdir()) == []
    assert "a symbolic link, not a directory" in capsys.readouterr().err
    assert "cannot move step_4 aside" in next(iter(read_events(run, "resume-refused")))["reason"]


def test_a_production_restart_over_a_corrupt_checkpoint_refuses_a_quarantine_on_another_file_system(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    run = tmp_path / "run"
    before = _corrupt_newest(run, monkeypatch)

    def cross_device(*args: object, **kwargs: object) -> None:
        raise OSError(errno.EXDEV, "Invalid cross-device link")

    monkeypatch.setattr(os, "rename", cross_device)
    with pytest.raises(ResumeRefusedError, match="on another file system"):
        mode.resume_point(_production(run), rank=0, world=1)
    assert _files(run / "step_4") == before


def test_a_save_over_something_in_the_way_stops_the_job_when_the_quarantine_is_a_link(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run, out = tmp_path / "run", _elsewhere(tmp_path)
    before = _evidence(run)
    job = mode.Production(_production(run), rank=0, world=1, target="train.py:train", start=0)
    (run / QUARANTINE_DIR).symlink_to(out)
    with pytest.raises(SystemExit) as stopped:
        job.before_save(4, str(run / "step_4"))
    assert stopped.value.code == 2 and "a symbolic link, not a directory" in capsys.readouterr().err
    assert _files(run / "step_4") == before and list(out.iterdir()) == []


@pytest.mark.slow
def test_a_production_job_over_a_corrupt_checkpoint_exits_2_and_keeps_it_when_the_quarantine_is_a_link(
        tmp_path: Path) -> None:
    from helpers import faults as inj

    run, out = tmp_path / "run", _elsewhere(tmp_path)

    def job(steps: int) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, str(SCRIPT), "--run-dir", str(run), "--steps", str(steps),
                               "--save-every", "2"], capture_output=True, text=True, timeout=600)

    assert job(4).returncode == 0
    inj.flip_in_tensor_payload(run / "step_4", "model.0.weight")
    corrupt = {str(p.relative_to(run)): p.read_bytes() for p in (run / "step_4").rglob("*") if p.is_file()}
    (run / QUARANTINE_DIR).symlink_to(out)
    done = job(6)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert "cannot move step_4 aside" in done.stderr and "a symbolic link, not a directory" in done.stderr
    assert {str(p.relative_to(run)): p.read_bytes() for p in (run / "step_4").rglob("*") if p.is_file()} == corrupt
    assert list(out.iterdir()) == []


# ------------------------------------------------------------------------------------------------ traces


def test_a_production_job_refuses_a_trace_folder_linked_out_of_its_run_directory(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run, out = tmp_path / "run", _elsewhere(tmp_path)
    run.mkdir()
    (run / mode.TRACE_ROOT).symlink_to(out)
    with pytest.raises(ResumeRefusedError, match="a symbolic link, not a directory"):
        mode.Production(_production(run), rank=0, world=1, target="train.py:train", start=0)
    assert "cannot record the trace" in capsys.readouterr().err and list(out.iterdir()) == []


def test_a_trace_store_is_never_made_through_a_link_at_its_name(tmp_path: Path) -> None:
    out = _elsewhere(tmp_path)
    (tmp_path / "rank0").symlink_to(out)
    with pytest.raises(NotRegularFileError, match="a symbolic link"):
        TraceWriter(tmp_path / "rank0", header=TraceHeader(run="a", level="metrics"), background=False)
    assert list(out.iterdir()) == []


def test_an_op_log_is_never_written_through_a_linked_ops_folder(tmp_path: Path) -> None:
    out = _elsewhere(tmp_path)
    (tmp_path / "ops").symlink_to(out)
    with pytest.raises(NotRegularFileError, match="a symbolic link"):
        write_op_log(tmp_path, 3, [], 0, [], 1)
    assert list(out.iterdir()) == []


def test_an_op_log_is_never_written_through_a_link_at_a_temporary_name(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_text("kept")
    (tmp_path / "ops").mkdir()
    (tmp_path / "ops" / ".step3.json.tmp").symlink_to(victim)
    write_op_log(tmp_path, 3, [], 0, [], 1)
    assert victim.read_text() == "kept" and (tmp_path / "ops" / "step3.json").is_file()


def test_a_capture_is_never_written_through_a_linked_capture_folder(tmp_path: Path) -> None:
    out = _elsewhere(tmp_path)
    (tmp_path / "capture").symlink_to(out)
    with pytest.raises(NotRegularFileError, match="a symbolic link"):
        _capture(str(tmp_path / "capture" / "op-rank0.pt"), "aten.add", (), {})
    assert list(out.iterdir()) == []


def test_a_capture_is_never_written_through_a_link_at_a_temporary_name(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_text("kept")
    (tmp_path / "capture").mkdir()
    (tmp_path / "capture" / f"op-rank0.pt.tmp{os.getpid()}").symlink_to(victim)
    _capture(str(tmp_path / "capture" / "op-rank0.pt"), "aten.add", (), {})
    assert victim.read_text() == "kept" and (tmp_path / "capture" / "op-rank0.pt").is_file()


# ------------------------------------------------------------------------------------------------ notes


def test_a_suspect_note_is_never_written_through_a_link_at_the_checkpoint_name(tmp_path: Path) -> None:
    out = _elsewhere(tmp_path)
    (tmp_path / "step_4").symlink_to(out)
    with pytest.raises(NotRegularFileError, match="a symbolic link"):
        write_suspect_note(tmp_path / "step_4", {"step": 4, "reason": "replicas differ"})
    assert list(out.iterdir()) == []
