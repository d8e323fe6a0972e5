"""The commit protocol of a save: killed at any point, a save never leaves a directory that verifies or loads
as complete unless the whole save committed; a second save into a directory being saved fails clearly.

Kills are real: a fresh job (1 or 2 ranks over gloo) is SIGKILLed, all its ranks at once, at a chosen point
inside the save (``scripts/chaos_save.py`` runs the same jobs at random points). As in the script, each job's
ranks are processes of their own forked from one zygote that imported torch once (not fresh interpreters that
each pay the imports): a kill is still a SIGKILL of the job's own process group, the test process untouched."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import ckptverify
from ckptverify.audit.verify import verify_checkpoint
from ckptverify.dcp.commit import begin_save, read_marker
from ckptverify.errors import SaveFailedError
from ckptverify.ownfiles.manifest import MANIFEST_FILE
from ckptverify.ownfiles.names import SAVE_MARKER

# The jobs are scripts/chaos_save.py's own (the tool runs them at random kill points; these tests at chosen ones).
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
import chaos_save as chaos

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning",
                                        "ignore:Detected an existing checkpoint:UserWarning")


@pytest.fixture(scope="module")
def zygote() -> Iterator[chaos.Zygote]:
    """The chaos script's own fork server: one process that imported torch and ckptverify, forking each job's
    ranks (each job in a process group of its own, killed whole)."""
    server = chaos.Zygote()
    yield server
    server.close()


def _killed(job: chaos.Job, path: Path, zygote: chaos.Zygote) -> dict[str, Any]:
    result = chaos.run_job(job, path, zygote=zygote)
    assert result["killed"], f"the job was not killed at {job.kill_at}: {result}"
    return result


@pytest.mark.parametrize(("kill_at", "layout"), [
    ("invalidated", "single"),   # the old commit records are gone, no shard rewritten yet
    ("file:1", "per-item"),      # some shards of the new save, the rest of the old one
    ("write:3", "single"),       # a shard cut short mid-file
    ("metadata", "per-item"),    # every shard and .metadata written, no manifest
    ("manifest", "single"),      # the manifest written, the marker not yet removed
])
def test_a_resave_killed_inside_is_refused_by_verify_and_load(tmp_path: Path, kill_at: str, layout: str,
                                                             zygote: chaos.Zygote) -> None:
    path = tmp_path / "ckpt"
    _killed(chaos.Job(world=1, mode="sync", existing=True, layout=layout, kill_at=kill_at), path, zygote)
    assert read_marker(str(path)) is not None
    report = verify_checkpoint(path, jobs=1)
    assert "save-uncommitted" in {f.check for f in report.errors}
    assert chaos.judge(path, existing=True)[0] == "refused"
    if kill_at in ("invalidated", "file:1", "write:3"):
        # Plain DCP cannot read the directory either: the old .metadata went before any shard was rewritten.
        assert not (path / ".metadata").exists() and not (path / MANIFEST_FILE).exists()


def test_an_async_resave_killed_between_shards_is_refused(tmp_path: Path, zygote: chaos.Zygote) -> None:
    path = tmp_path / "ckpt"
    _killed(chaos.Job(world=1, mode="async", existing=True, layout="per-item", kill_at="file:2"), path, zygote)
    assert chaos.judge(path, existing=True)[0] == "refused"


def test_two_ranks_one_writing_late_killed_when_the_other_has_written(tmp_path: Path, zygote: chaos.Zygote) -> None:
    """Rank 1 starts writing its shards late (here: not before the job dies); the job dies as soon as rank 0
    has written one: old shards of rank 1 beside new shards of rank 0, and the directory must not pass."""
    path = tmp_path / "ckpt"
    never = str(tmp_path / "never")  # rank 1 waits for this file, which never appears
    _killed(chaos.Job(world=2, mode="sync", existing=True, layout="single", kill_at="file:1", kill_rank=0,
                      late=0.5, late_rank=1, hold=never), path, zygote)
    assert chaos.judge(path, existing=True)[0] == "refused"


def test_two_ranks_async_killed_before_the_manifest(tmp_path: Path, zygote: chaos.Zygote) -> None:
    path = tmp_path / "ckpt"
    _killed(chaos.Job(world=2, mode="async", existing=True, layout="per-item", kill_at="metadata"), path, zygote)
    assert chaos.judge(path, existing=True)[0] == "refused"


def test_a_killed_save_does_not_block_the_next_one(tmp_path: Path, zygote: chaos.Zygote) -> None:
    """The lock dies with the process that held it; the next save commits and its directory is clean."""
    path = tmp_path / "ckpt"
    _killed(chaos.Job(world=1, existing=True, layout="per-item", kill_at="file:3"), path, zygote)
    assert read_marker(str(path)) is not None
    state = chaos.make_state(7)
    ckptverify.save(state, path, single_file_per_rank=False)
    assert read_marker(str(path)) is None
    report = verify_checkpoint(path, jobs=1)
    assert report.passed and not report.warnings, report.findings
    loaded = chaos.make_state(-1)
    assert ckptverify.load(loaded, path).passed
    assert loaded.counters.step == 7


def test_an_uninterrupted_resave_commits(tmp_path: Path, zygote: chaos.Zygote) -> None:
    path = tmp_path / "ckpt"
    result = chaos.run_job(chaos.Job(world=1, existing=True), path, zygote=zygote)
    assert result["returncodes"] == [0], result["output"]
    assert chaos.judge(path, existing=True) == ("new", "")
    assert not (path / SAVE_MARKER).exists()


# ------------------------------------------------------------------------------------- concurrent saves


def test_a_second_save_into_a_directory_being_saved_fails_clearly(tmp_path: Path, monkeypatch) -> None:
    from ckptverify.dcp import writer as writer_mod

    path = tmp_path / "ckpt"
    ckptverify.save({"w": torch.zeros(8)}, path)  # an existing checkpoint
    inside, release = threading.Event(), threading.Event()
    original = writer_mod.HashingFileSystemWriter.write_data

    def paused_write_data(self: Any, plan: Any, planner: Any) -> Any:
        if threading.current_thread().name == "first-save":
            inside.set()
            assert release.wait(60)
        return original(self, plan, planner)

    monkeypatch.setattr(writer_mod.HashingFileSystemWriter, "write_data", paused_write_data)
    errors: list[BaseException] = []

    def first() -> None:
        try:
            ckptverify.save({"w": torch.ones(8)}, path)
        except BaseException as exc:  # reported to the test thread
            errors.append(exc)

    thread = threading.Thread(target=first, name="first-save")
    thread.start()
    try:
        assert inside.wait(60)
        assert verify_checkpoint(path, jobs=1).errors  # mid-save: not a checkpoint
        with pytest.raises(SaveFailedError, match=f"another save into .* is in progress .*pid {os.getpid()}"):
            ckptverify.save({"w": torch.full((8,), 2.0)}, path)
        with pytest.raises(SaveFailedError, match="is in progress"):
            ckptverify.async_save({"w": torch.full((8,), 3.0)}, path).result(timeout=60)
    finally:
        release.set()
        thread.join(60)
    assert not errors, errors
    # The first save committed, whole: the losers wrote nothing.
    assert verify_checkpoint(path, jobs=1).passed
    template = {"w": torch.zeros(8)}
    import torch.distributed.checkpoint as dcp

    dcp.load(template, checkpoint_id=str(path))
    assert torch.equal(template["w"], torch.ones(8))


def test_a_save_from_another_process_into_a_directory_being_saved_fails_clearly(tmp_path: Path,
                                                                               zygote: chaos.Zygote) -> None:
    """The lock holds across processes: a job holds inside its save (before writing its shards) while this
    process tries to save into the same directory."""
    path = tmp_path / "ckpt"
    go = tmp_path / "go"
    job = chaos.Job(world=1, existing=False, late_rank=0, hold=str(go))
    args = chaos._worker_args(job, path, 0, str(tmp_path / "rendezvous"), str(tmp_path / "signal"))
    pid = zygote.start([args], str(tmp_path / "job.log"))  # one rank: its pid is its job's process group
    reply = None
    try:
        deadline = time.monotonic() + 120
        # The marker exists (empty) a moment before its holder writes who it is: wait for the record.
        while not (read_marker(str(path)) or {}).get("pid") and time.monotonic() < deadline and reply is None:
            reply = zygote.reply(timeout=0.01)  # an answer here: the job ended before it held the lock
        info = read_marker(str(path))
        assert info is not None and info.get("pid") == pid, (info, reply)
        with pytest.raises(SaveFailedError, match=f"pid {pid}"):
            ckptverify.save(chaos.make_state(9), path)
        go.touch()
        reply = zygote.reply(timeout=120)
        assert reply is not None and reply["returncodes"] == [0], (tmp_path / "job.log").read_text()
    finally:
        if reply is None:  # leave the zygote ready for the next job: end this one and take its answer
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)
            zygote.reply(timeout=60)
    assert chaos.judge(path, existing=False) == ("new", "")  # the job's save, whole


def test_saves_into_one_directory_from_many_threads_never_mix(tmp_path: Path) -> None:
    """Eight threads save eight different states into one directory at once: each either commits whole or
    fails with SaveFailedError; what is left is exactly one of them."""
    path = tmp_path / "ckpt"
    outcomes: dict[int, str] = {}
    barrier = threading.Barrier(8)

    def one(i: int) -> None:
        state = {f"t{k}": torch.full((64,), float(i)) for k in range(6)}
        barrier.wait()
        try:
            ckptverify.save(state, path, single_file_per_rank=False)
            outcomes[i] = "saved"
        except SaveFailedError:
            outcomes[i] = "conflict"

    threads = [threading.Thread(target=one, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert len(outcomes) == 8 and "saved" in outcomes.values()
    assert verify_checkpoint(path, jobs=1).passed
    import torch.distributed.checkpoint as dcp

    template = {f"t{k}": torch.zeros(64) for k in range(6)}
    dcp.load(template, checkpoint_id=str(path))
    values = {float(t[0]) for t in template.values()}
    assert len(values) == 1 and all(torch.equal(t, t[0].expand(64)) for t in template.values())
    assert outcomes[int(values.pop())] == "saved"


# ------------------------------------------------------------------------------------------- the marker


def test_verify_names_the_save_that_did_not_commit(tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    ckptverify.save({"w": torch.zeros(4)}, path)
    (path / SAVE_MARKER).write_text(json.dumps({"save_id": "abc", "pid": 4242, "host": "node7",
                                                "started": "2026-01-01T00:00:00+00:00"}))
    errors = verify_checkpoint(path, jobs=1).errors
    hit = next(f for f in errors if f.check == "save-uncommitted")
    assert "pid 4242" in hit.message and "node7" in hit.message and hit.location.file == SAVE_MARKER


@pytest.mark.parametrize("kind", ["fifo", "symlink to /dev/zero", "directory", "garbage"])
def test_a_marker_of_any_kind_is_reported_without_hanging(tmp_path: Path, kind: str) -> None:
    path = tmp_path / "ckpt"
    ckptverify.save({"w": torch.zeros(4)}, path)
    marker = path / SAVE_MARKER
    if kind == "fifo":
        os.mkfifo(marker)
    elif kind == "directory":
        marker.mkdir()
    elif kind == "garbage":
        marker.write_bytes(b"\xff" * 10000)
    else:
        marker.symlink_to("/dev/zero")
    errors = verify_checkpoint(path, jobs=1).errors
    assert "save-uncommitted" in {f.check for f in errors}
    if kind != "garbage":
        # A save cannot take such a marker over: it refuses rather than follow or block.
        with pytest.raises(ckptverify.errors.SaveFailedError):
            ckptverify.save({"w": torch.ones(4)}, path)


def test_begin_save_writes_who_is_saving_and_commit_removes_it(tmp_path: Path) -> None:
    lock = begin_save(str(tmp_path), "save-1")
    info = read_marker(str(tmp_path))
    assert info is not None and info["save_id"] == "save-1" and info["pid"] == os.getpid()
    with pytest.raises(SaveFailedError, match="is in progress"):
        begin_save(str(tmp_path), "save-2")
    lock.commit()
    assert read_marker(str(tmp_path)) is None and lock.fd is None
    begin_save(str(tmp_path), "save-3").release()  # free again; release leaves the marker
    assert read_marker(str(tmp_path))["save_id"] == "save-3"


def test_chaos_script_runs_and_counts_every_kill(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A few random kills through the script's command line: every kill is judged, none passes torn."""
    code = chaos.main(["--kills", "3", "--seed", "5", "--json", "--workdir", str(tmp_path)])
    result = json.loads(capsys.readouterr().out)
    assert code == 0, result
    assert result["kills"] == 3 and sum(result["outcomes"].values()) == 3
    assert result["torn_passed"] == 0 and result["hung"] == 0
    assert set(result["outcomes"]) == {"refused", "old", "new", "torn"}
