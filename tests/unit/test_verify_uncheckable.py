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


def _crc_disabled(path, seed=0):
    torch.serialization.set_crc32_options(False)
    try:
        g = torch.Generator().manual_seed(seed)
        dcp.save({"w": torch.randn(64, 64, generator=g), "b": torch.arange(10), "step": 3}, checkpoint_id=str(path))
    finally:
        torch.serialization.set_crc32_options(True)
    return path


def _advice(report):
    return [f.message for f in report.findings if f.check == "fingerprint-advice"]


def test_unchecked_content_is_advised_a_fingerprint_once_and_never_when_damaged_or_covered(tmp_path):
    path = _crc_disabled(tmp_path / "nocrc")
    assert _advice(verify_checkpoint(path)) == [
        f"`ckptverify fingerprint {path} --trust-uncheckable` would protect the content without a checksum (3 "
        "finding(s) above) from now on: later verifies check it byte for byte (it vouches for the bytes as they are "
        "now, not as they were saved)"]
    assert _advice(verify_checkpoint(path, use_manifest=False)) == []
    # A folder of DCP parts: one advice for the whole, naming the folder and every part's unchecked content.
    step = tmp_path / "step_4"
    _crc_disabled(step / "model"), _crc_disabled(step / "optim", seed=1)
    folder = verify_checkpoint(step)
    assert folder.passed and len(_advice(folder)) == 1
    assert _advice(folder)[0].startswith(f"`ckptverify fingerprint {step} --trust-uncheckable` would protect the "
                                         "content without a checksum (6 finding(s) above)")
    # Damage is never blessed: an error anywhere and there is no advice.
    (step / "optim" / ".metadata").write_bytes(b"not a pickle")
    damaged = verify_checkpoint(step)
    assert damaged.errors and _advice(damaged) == []
    _, manifest = fingerprint_checkpoint(path, trust_uncheckable=True)
    assert manifest is not None and _advice(verify_checkpoint(path)) == []


class _Sink:
    """A progress sink that keeps each stage's total and what was advanced in it."""

    def __init__(self):
        self.stages = []

    def start(self, total_bytes):
        self.stages.append([total_bytes, 0])

    def advance(self, n):
        self.stages[-1][1] += n


def test_a_deep_verification_reports_the_progress_of_each_stage_to_its_sink(tmp_path):
    path = tmp_path / "ckpt"
    w = torch.randn(64, 64)
    dcp.save({"w": w, "b": torch.arange(10), "step": 3}, checkpoint_id=str(path))
    sink = _Sink()
    assert verify_checkpoint(path, deep=True, jobs=2, progress=sink).passed
    # The CRC stage over the records not checked while planning, then the deep stage over the tensors laid out (not
    # the archives holding them), each advanced to its total.
    assert len(sink.stages) == 2 and all(total == done for total, done in sink.stages)
    assert sink.stages[1][0] == w.nbytes + 10 * 8
