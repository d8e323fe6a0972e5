"""What every framework integration shares (``ckptverify.integrations.Verifier``), on checkpoints saved without a
framework: arguments, a save into a folder an earlier save left a manifest in, checkpoints that cannot be verified,
and verification in the background (the same stamp and event as inline, failures raised at the next save, a
checkpoint deleted before its turn, a resume of one still queued).
"""

from __future__ import annotations

import json
import os
import threading
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from ckptverify.errors import CheckpointRefusedError, CkptVerifyWarning, UsageError, VerifyFailedWarning
from ckptverify.integrations import Verifier
from ckptverify.options import VerifyOptions
from ckptverify.ownfiles.events import read_events
from ckptverify.ownfiles.manifest import MANIFEST_FILE, read_manifest
from ckptverify.runs.stamp import read_stamp, stamp_path
from ckptverify.verifier import background
from ckptverify.verifier.background import BackgroundVerifier

RAISE = VerifyOptions(on_failure="raise")
BACKGROUND_RAISE = VerifyOptions(when="background", on_failure="raise")


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(UsageError, match="on_failure"):
        Verifier(verify=VerifyOptions(on_failure="ignore"))  # type: ignore[arg-type]
    with pytest.raises(UsageError, match="verify"):
        Verifier(verify="yes")
    with pytest.raises(UsageError, match="jobs"):
        Verifier(jobs=0)


@pytest.mark.filterwarnings("ignore:Detected an existing checkpoint")
def test_a_resave_into_the_same_folder_replaces_the_stale_manifest_and_passes(tmp_path: Path) -> None:
    folder = tmp_path / "last.ckpt"
    verifier = Verifier()  # fingerprint="auto": a manifest present is replaced
    dcp.save({"w": torch.zeros(64, 64)}, checkpoint_id=folder)
    first = verifier.after_save(folder, step=1, fingerprint=True)
    digest = read_manifest(str(folder)).items[0].digest
    dcp.save({"w": torch.ones(64, 64)}, checkpoint_id=folder)  # the framework overwrites its "last" checkpoint
    with warnings.catch_warnings():
        warnings.simplefilter("error", VerifyFailedWarning)
        second = verifier.after_save(folder, step=2)
    assert first.passed and second.passed and second.manifest, second
    assert read_manifest(str(folder)).items[0].digest != digest  # describes the bytes now on disk
    stamp = read_stamp(folder)
    assert stamp is not None and stamp.passed and stamp.current and stamp.step == 2
    assert [e["step"] for e in read_events(tmp_path, "checkpoint-verified")] == [1, 2]


@pytest.mark.parametrize("fingerprint", [False, "auto"])
def test_a_dcp_folder_is_verified_by_its_crcs_alone_unless_a_manifest_is_asked_for(tmp_path: Path,
                                                                                   fingerprint: object) -> None:
    folder = tmp_path / "step-1"
    dcp.save({"w": torch.randn(64, 64)}, checkpoint_id=folder)
    verdict = Verifier(fingerprint=fingerprint).after_save(folder, step=1)  # type: ignore[arg-type]
    assert verdict.passed and not verdict.manifest and not (folder / MANIFEST_FILE).exists()
    assert any(c["check"] == "zip-crc" and c["count"] > 0 for c in verdict.coverage)


def test_auto_fingerprints_content_no_checksum_protects(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    folder = tmp_path / "checkpoint-1"
    folder.mkdir()
    save_file({"w": torch.randn(64, 64)}, str(folder / "model.safetensors"))
    torch.save({"step": torch.tensor(1)}, folder / "optimizer.pt")
    verdict = Verifier().after_save(folder, step=1)
    assert verdict.passed and verdict.manifest and verdict.unchecked == (), verdict
    assert (folder / MANIFEST_FILE).is_file()
    with pytest.raises(UsageError, match="fingerprint"):
        Verifier(fingerprint="always")  # type: ignore[arg-type]


def test_a_checkpoint_that_cannot_be_verified_fails_at_save_and_is_refused_at_resume(tmp_path: Path) -> None:
    verifier = Verifier(events_dir=tmp_path)
    with pytest.warns(VerifyFailedWarning, match="local file system only"):
        verdict = verifier.after_save("s3://bucket/run/step-1", step=1)
    assert not verdict.passed
    with pytest.raises(CheckpointRefusedError, match="checkpoint saved at s3://bucket/run/step-1 cannot be verified"):
        Verifier(verify=RAISE, events_dir=tmp_path).after_save("s3://bucket/run/step-1")
    with pytest.raises(CheckpointRefusedError, match=r"refusing to resume: .*missing.*cannot be verified"):
        verifier.before_resume(tmp_path / "missing")
    assert len(list(read_events(tmp_path, "checkpoint-failed"))) == 2
    (refused,) = read_events(tmp_path, "resume-refused")
    assert refused["errors"][0]["check"] == "not-verified"


def _hf_folder(path: Path, value: float = 1.0) -> Path:
    from safetensors.torch import save_file

    path.mkdir()
    save_file({"w": torch.full((64, 64), value)}, str(path / "model.safetensors"))
    torch.save({"step": torch.tensor(1)}, path / "optimizer.pt")
    return path


@pytest.fixture
def thread_queue(monkeypatch: pytest.MonkeyPatch) -> Iterator[BackgroundVerifier]:
    """conftest's ``queue`` (a fresh process-wide background verifier, short settle time, closed after the test),
    verifying in its worker thread at normal priority, for the tests about how the integration queues, waits,
    raises and reports rather than about the verifier process (a process imports torch anew for each test);
    ``test_background_writes_the_same_manifest_stamp_and_event_as_inline`` keeps the process."""
    fresh = BackgroundVerifier(settle=0.05, isolation="thread", priority="normal")
    monkeypatch.setattr(background, "_default", fresh)
    yield fresh
    fresh.before_verify = None
    fresh.close(timeout=60)


def _strip(event: dict[str, object]) -> dict[str, object]:
    """An event without what differs from one run to the next (time, host, seconds, paths)."""
    return {k: v for k, v in event.items() if k not in ("time", "host", "seconds", "path", "message", "stamp")}


def test_background_writes_the_same_manifest_stamp_and_event_as_inline(tmp_path: Path,
                                                                       queue: BackgroundVerifier) -> None:
    inline_dir, bg_dir = tmp_path / "inline", tmp_path / "bg"
    inline_dir.mkdir()
    bg_dir.mkdir()
    inline = Verifier().after_save(_hf_folder(inline_dir / "checkpoint-1"), step=1)
    verifier = Verifier(verify="background")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        pending = verifier.after_save(_hf_folder(bg_dir / "checkpoint-1"), step=1)
        assert pending.pending and not pending.passed and pending.bytes_checked == 0
        assert "queued" in pending.message
        (final,) = verifier.wait(timeout=120)
    assert verifier.pending() == [] and queue.pending() == []
    assert final.passed and final.manifest and final.unchecked == () and not final.pending  # weights fingerprinted
    assert final.bytes_checked == inline.bytes_checked > 64 * 64 * 4
    assert final.stamp == stamp_path(bg_dir / "checkpoint-1")
    assert (bg_dir / "checkpoint-1" / MANIFEST_FILE).is_file()
    stamp = read_stamp(bg_dir / "checkpoint-1")
    assert stamp is not None and stamp.passed and stamp.current and stamp.step == 1 and stamp.data["manifest"]
    (ev_inline,) = read_events(inline_dir)
    (ev_bg,) = read_events(bg_dir)
    assert ev_bg["event"] == "checkpoint-verified" and _strip(ev_bg) == _strip(ev_inline)
    assert ev_bg["path"] == str(bg_dir / "checkpoint-1") and ev_bg["stamp"] == final.stamp
    assert not (bg_dir / "checkpoint-1" / ".ckptverify-verifying").exists()


def test_a_background_failure_warns_logs_and_is_raised_at_the_next_save(tmp_path: Path,
                                                                        thread_queue: BackgroundVerifier) -> None:
    from helpers import faults as inj

    first, second = tmp_path / "step-1", tmp_path / "step-2"
    dcp.save({"w": torch.randn(64, 64)}, checkpoint_id=first)
    dcp.save({"w": torch.randn(64, 64)}, checkpoint_id=second)
    faults: list[object] = []
    # Damage planted right before the verifier reads it: what storage that corrupted the write would show.
    thread_queue.before_verify = (
        lambda p: faults.append(inj.flip_in_tensor_payload(Path(p))) if p == str(first) else None)
    verifier = Verifier(verify=BACKGROUND_RAISE)
    assert verifier.after_save(first, step=1).pending
    with pytest.warns(VerifyFailedWarning, match=r"step-1 fails verification"):
        assert background.wait_for_checkpoint(first, timeout=120)
    (failed,) = read_events(tmp_path, "checkpoint-failed")
    assert failed["step"] == 1 and failed["errors"][0]["location"]["file"] == faults[0].file  # type: ignore[attr-defined]
    stamp = read_stamp(first)
    assert stamp is not None and not stamp.passed and stamp.current
    with pytest.raises(CheckpointRefusedError, match=r"earlier checkpoint failed verification in the background: "
                                                     r"checkpoint saved at .*step-1 fails verification"):
        verifier.after_save(second, step=2)
    assert verifier.wait(timeout=120)[-1].passed  # raised once: the wait does not raise it again
    assert read_stamp(second).passed  # type: ignore[union-attr]


def test_a_checkpoint_deleted_before_its_turn_is_an_event_not_a_failure(tmp_path: Path,
                                                                         thread_queue: BackgroundVerifier) -> None:
    import shutil

    folder = _hf_folder(tmp_path / "checkpoint-1")
    single = tmp_path / "step=2.ckpt"
    torch.save({"w": torch.randn(8)}, single)
    # Retention deletes them as their turn comes (a folder file by file, with ckptverify's lock inside).
    thread_queue.before_verify = lambda p: shutil.rmtree(p) if os.path.isdir(p) else os.unlink(p)
    verifier = Verifier(verify=BACKGROUND_RAISE, fingerprint=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        verifier.after_save(folder, step=1)
        verifier.after_save(single, step=2)
        arrived = verifier.wait(timeout=120)
    assert [(v.deleted, v.passed) for v in arrived] == [(True, False), (True, False)]
    assert [e["path"] for e in read_events(tmp_path, "checkpoint-deleted")] == [str(folder), str(single)]
    assert list(read_events(tmp_path, "checkpoint-failed")) == []
    assert not folder.exists() and not os.path.lexists(stamp_path(single))


def test_a_resume_of_a_checkpoint_still_queued_waits_for_its_verification(tmp_path: Path,
                                                                           thread_queue: BackgroundVerifier) -> None:
    folder = _hf_folder(tmp_path / "checkpoint-1")
    release = threading.Event()
    thread_queue.before_verify = lambda p: release.wait(60)
    verifier = Verifier(verify="background")
    verifier.after_save(folder, step=1)
    assert verifier.pending() == [str(folder)]
    threading.Timer(0.5, release.set).start()
    resumed = Verifier().before_resume(folder)  # waits, then verifies: against the manifest written meanwhile
    assert resumed.passed and resumed.manifest and resumed.unchecked == ()
    assert verifier.pending() == []


def test_a_wait_that_runs_out_says_which_were_cut_short(tmp_path: Path, thread_queue: BackgroundVerifier) -> None:
    folder = _hf_folder(tmp_path / "checkpoint-1")
    release = threading.Event()
    thread_queue.before_verify = lambda p: release.wait(60)
    verifier = Verifier(verify="background")
    verifier.after_save(folder, step=1)
    with pytest.warns(CkptVerifyWarning, match=r"1 checkpoint verification\(s\) cut short.*checkpoint-1"):
        assert verifier.wait(timeout=0.2) == []
    (cut,) = read_events(tmp_path, "checkpoint-cut-short")
    assert cut["path"] == str(folder) and "0.2 s" in cut["message"]
    release.set()
    (final,) = verifier.wait(timeout=120)  # still queued: it finishes, and is stamped
    assert final.passed and read_stamp(folder).passed  # type: ignore[union-attr]
    assert json.loads((folder / "ckptverify.verified.json").read_text())["step"] == 1


def test_a_folder_deleted_while_it_is_verified_or_stamped_is_deleted_not_failed(tmp_path: Path,
                                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    import shutil

    import ckptverify.audit.verify as verify_module
    import ckptverify.runs.stamp as stamp_module
    from ckptverify.verifier.saved import check_saved
    from ckptverify.verifier.verification import event_of

    real_verify, real_stamp = verify_module.verify_checkpoint, stamp_module.write_stamp

    def verify_then_lose_it(root: str, **kw: object) -> object:
        shutil.rmtree(root)  # retention, mid-verification
        return real_verify(root, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(verify_module, "verify_checkpoint", verify_then_lose_it)
    verdict, _ = check_saved(str(_hf_folder(tmp_path / "checkpoint-1")), 1, False, settle=0.01)
    assert event_of(verdict) == "checkpoint-deleted" and verdict.deleted and not verdict.passed
    inline, _ = check_saved(str(_hf_folder(tmp_path / "checkpoint-2")), 2, False)
    assert event_of(inline) == "checkpoint-failed"  # inline, nothing deletes behind the check's back: it fails
    monkeypatch.setattr(verify_module, "verify_checkpoint", real_verify)

    def stamp_as_rmtree_runs(root: str, *args: object, **kw: object) -> object:
        written = real_stamp(root, *args, **kw)  # type: ignore[arg-type]
        for name in ("model.safetensors", "optimizer.pt"):  # an rmtree that listed the folder before the stamp
            os.unlink(os.path.join(root, name))
        return written

    monkeypatch.setattr(stamp_module, "write_stamp", stamp_as_rmtree_runs)
    folder = _hf_folder(tmp_path / "checkpoint-3")
    verdict, _ = check_saved(str(folder), 3, "auto", settle=0.01)
    assert event_of(verdict) == "checkpoint-deleted" and not folder.exists()  # ckptverify's stamp and manifest went too


def test_a_job_that_ends_without_waiting_is_waited_for_at_exit(tmp_path: Path) -> None:
    import subprocess
    import sys

    folder = _hf_folder(tmp_path / "checkpoint-1")
    script = ("import sys; from ckptverify.integrations import Verifier; "
              "v = Verifier(verify=\"background\"); print(v.after_save(sys.argv[1], step=1).pending)")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    done = subprocess.run([sys.executable, "-c", script, str(folder)], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "True", done.stderr[-2000:]
    assert "Traceback" not in done.stderr and "Warning" not in done.stderr, done.stderr[-2000:]
    stamp = read_stamp(folder)
    assert stamp is not None and stamp.passed and stamp.current and stamp.data["manifest"]
    (verified,) = read_events(tmp_path, "checkpoint-verified")
    assert verified["path"] == str(folder) and verified["fingerprint"].startswith("manifest written")
