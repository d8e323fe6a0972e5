"""Content without checksums is reported as uncheckable (never as passed), until a manifest covers it."""

from __future__ import annotations

import torch
import torch.distributed.checkpoint as dcp
from helpers import faults as inj

from ckptverify.audit.adopt import fingerprint_checkpoint
from ckptverify.audit.verify import verify_checkpoint


def test_items_saved_with_crc_disabled_are_uncheckable_then_covered_by_a_manifest(tmp_path):
    path = tmp_path / "nocrc"
    torch.serialization.set_crc32_options(False)
    try:
        dcp.save({"w": torch.randn(64, 64), "b": torch.arange(10), "step": 3}, checkpoint_id=str(path))
    finally:
        torch.serialization.set_crc32_options(True)
    report = verify_checkpoint(path)
    uncheckable = [f for f in report.warnings if f.check == "content-uncheckable"]
    assert report.exit_code == 0 and len(uncheckable) == 3
    assert all("CRC-32 disabled" in f.message for f in uncheckable)

    fault = inj.flip_in_tensor_payload(path, "w")
    assert verify_checkpoint(path).exit_code == 0  # nothing can see it without checksums ...
    inj.flip_bit(path, fault.file, fault.byte_offset, fault.bit)  # (undo)

    refused, manifest = fingerprint_checkpoint(path)  # fail closed: nothing could check these bytes
    assert manifest is None and "fingerprint-refused" in {f.check for f in refused.errors}
    assert not (path / "ckptverify.manifest.json").exists()
    assert verify_checkpoint(path, strict=True).exit_code == 1
    _, manifest = fingerprint_checkpoint(path, trust_uncheckable=True)
    assert manifest is not None
    covered = verify_checkpoint(path)
    assert covered.passed and not [f for f in covered.warnings if f.check == "content-uncheckable"]
    inj.flip_bit(path, fault.file, fault.byte_offset, fault.bit)
    assert any(f.check == "manifest-digest" for f in verify_checkpoint(path).errors)  # ... until a manifest does
