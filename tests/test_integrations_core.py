"""What every framework integration shares (``ckptverify.integrations.Verifier``), on checkpoints saved without a
framework: arguments, a save into a folder an earlier save left a manifest in, checkpoints that cannot be verified.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from ckptverify.errors import CheckpointRefusedError, UsageError
from ckptverify.events import read_events
from ckptverify.integrations import CheckpointVerificationWarning, Verifier
from ckptverify.manifest import MANIFEST_FILE, read_manifest
from ckptverify.runs.stamp import read_stamp


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(UsageError, match="on_failure"):
        Verifier(on_failure="ignore")  # type: ignore[arg-type]
    with pytest.raises(UsageError, match="background"):
        Verifier(background=True)
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
        warnings.simplefilter("error", CheckpointVerificationWarning)
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
    with pytest.warns(CheckpointVerificationWarning, match="local file system only"):
        verdict = verifier.after_save("s3://bucket/run/step-1", step=1)
    assert not verdict.passed
    with pytest.raises(CheckpointRefusedError, match="checkpoint saved at s3://bucket/run/step-1 cannot be verified"):
        Verifier(on_failure="raise", events_dir=tmp_path).after_save("s3://bucket/run/step-1")
    with pytest.raises(CheckpointRefusedError, match=r"refusing to resume: .*missing.*cannot be verified"):
        verifier.before_resume(tmp_path / "missing")
    assert len(list(read_events(tmp_path, "checkpoint-failed"))) == 2
    (refused,) = read_events(tmp_path, "resume-refused")
    assert refused["errors"][0]["check"] == "not-verified"
