"""A production restart never trains on damaged state, never loses evidence, and never needs a second start to get
past a checkpoint that fails as it is loaded.

The job runs in this process (``cv.Run.main`` with a small ``TrainState``), so that writing can be made to fail
as on a read-only file system (``chmod`` does not stop root).
"""

from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import faults as inj

import ckptverify as cv
import ckptverify.ownfiles.names as names
from ckptverify.ownfiles.events import read_events
from ckptverify.runs.stamp import read_stamp
from ckptverify.runs.states import QUARANTINE_DIR

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")

#: The step each job resumed from (``None``: a fresh start), in order.
RESUMED: list[int | None] = []


def train(run: cv.Run) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    state = cv.TrainState(model=model, optimizer=opt)
    run.restore(state)
    RESUMED.append(run.step or None)
    for _ in run.steps():
        model(torch.randn(3, 4)).sum().backward()
        opt.step()
        opt.zero_grad()
        run.record(loss=torch.zeros(()))


def _job(run_dir: Path, steps: int) -> None:
    cv.Run.main(train, steps=steps, run_dir=str(run_dir), save_every=2, verify="inline")


def _tree(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def _flip_keeping_times(ckpt: Path) -> None:
    """One bit of a tensor flipped in place, every file's times put back: its passing stamp stays current."""
    times = {p: os.stat(p) for p in ckpt.rglob("*") if p.is_file()}
    inj.flip_in_tensor_payload(ckpt, "model.0.weight")
    for p, st in times.items():
        os.utime(p, ns=(st.st_atime_ns, st.st_mtime_ns))
    stamp = read_stamp(ckpt)
    assert stamp is not None and stamp.current and stamp.passed


@pytest.fixture
def stamped_run(tmp_path: Path) -> Path:
    """A run of 4 steps: ``step_2`` and ``step_4``, each stamped passed."""
    run = tmp_path / "run"
    RESUMED.clear()
    _job(run, 4)
    assert all(read_stamp(run / f"step_{n}").passed for n in (2, 4))
    return run


def test_a_pick_that_fails_its_proof_at_load_falls_back_in_the_same_start_and_is_kept_aside(
        stamped_run: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = stamped_run
    _flip_keeping_times(run / "step_4")
    damaged = {k: v for k, v in _tree(run / "step_4").items() if k != "ckptverify.verified.json"}
    capsys.readouterr()

    _job(run, 6)  # one start: no SystemExit

    assert RESUMED[-1] == 2
    err = capsys.readouterr().err
    assert "step_4 (step 4) failed its proof while loading" in err and "manifest-digest" in err
    assert "moved step_4 aside to quarantine/step_4.moved-" in err
    (refused,) = read_events(run, "checkpoint-refused-at-load")
    assert (refused["path"], refused["step"], refused["check"]) == ("step_4", 4, "manifest-digest")
    assert [e["path"] for e in read_events(run, "checkpoint-moved-aside")] == ["step_4"]
    assert not list(read_events(run, "resume-refused"))
    (restore,) = read_events(run, "restore")
    assert restore["step"] == 2 and restore["resumed_from"] == str(run / "step_2")
    # The damaged checkpoint is evidence: moved whole, bytes as found, stamped failed; the job saved its steps anew.
    (moved,) = (run / QUARANTINE_DIR).iterdir()
    assert moved.name.startswith("step_4.moved-") and not read_stamp(moved).passed
    assert {k: v for k, v in _tree(moved).items() if k != "ckptverify.verified.json"} == damaged
    assert read_stamp(run / "step_4").passed and read_stamp(run / "step_6").passed
    assert (run / "trace" / "from-00000002").is_dir() and not (run / "trace" / "from-00000004").exists()


def test_a_read_only_run_directory_is_refused_with_exit_2_and_nothing_moved(
        stamped_run: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    run = stamped_run
    inj.flip_in_tensor_payload(run / "step_4", "model.0.weight")  # a newest checkpoint that fails: moved aside
    before = _tree(run)
    capsys.readouterr()

    def read_only(*args: Any, **kwargs: Any) -> Any:
        raise OSError(errno.EROFS, "Read-only file system", str(args[0]) if args else None)

    for name in ("open_append", "write_atomic"):  # how ckptverify writes its own files
        monkeypatch.setattr(names, name, read_only)
    monkeypatch.setattr(os, "rename", read_only)  # how a checkpoint is moved aside
    monkeypatch.setattr(os, "makedirs", lambda path, *a, **k: None if os.path.isdir(path) else read_only(path))

    with pytest.raises(SystemExit) as exit_:
        _job(run, 6)

    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    (line,) = [x for x in err.splitlines() if "cannot write to the run directory" in x]
    assert "Read-only file system" in line and "could not be recorded in events.jsonl" in line
    monkeypatch.undo()
    assert _tree(run) == before and RESUMED == [None]  # nothing moved, written or trained


def test_a_pick_refused_at_load_whose_failed_stamp_cannot_be_written_is_refused_not_loaded_again(
        stamped_run: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    import ckptverify.runs.stamp as stamp

    run = stamped_run
    _flip_keeping_times(run / "step_4")
    before = _tree(run / "step_4")
    capsys.readouterr()

    def no_space(*args: Any, **kwargs: Any) -> Any:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(stamp, "write_stamp", no_space)
    with pytest.raises(SystemExit) as exit_:
        _job(run, 6)

    assert exit_.value.code == 2 and RESUMED == [None]
    err = capsys.readouterr().err
    assert "Traceback" not in err and "its failed stamp could not be written" in err
    # Still where it was, bytes and (current, passing) stamp as found: the next start proves it again.
    assert _tree(run / "step_4") == before and not (run / QUARANTINE_DIR).exists()
    assert [e["path"] for e in read_events(run, "checkpoint-refused-at-load")] == ["step_4"]
    assert len(list(read_events(run, "resume-refused"))) == 1
