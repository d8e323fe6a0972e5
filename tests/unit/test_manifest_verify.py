"""Verification against a manifest: adopt a checkpoint, then every fault is caught through the manifest,
including those no self-check can see."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from helpers import faults as inj
from helpers.ckpt_factory import ZIP_LAYOUTS

from ckptverify.audit.adopt import fingerprint_checkpoint
from ckptverify.audit.verify import verify_checkpoint
from ckptverify.cli import main
from ckptverify.errors import CkptVerifyError
from ckptverify.ownfiles.manifest import MANIFEST_FILE, read_manifest


def _adopted(fresh_ckpt: Any, layout: str) -> Path:
    path = fresh_ckpt(layout)
    report, manifest = fingerprint_checkpoint(path, block_bytes=4096)
    assert report.passed and manifest is not None, [f.message for f in report.findings]
    return path


def _checks(report: Any) -> set[str]:
    return {f.check for f in report.errors}


@pytest.mark.parametrize("layout", ZIP_LAYOUTS)
def test_adopted_clean_checkpoint_passes_plain_and_deep(fresh_ckpt, layout):
    path = _adopted(fresh_ckpt, layout)
    manifest = read_manifest(str(path))
    assert manifest is not None and manifest.source == "fingerprint"
    assert all(t.fingerprint for t in manifest.tensors.values() if 0 not in t.shape)
    for deep in (False, True):
        report = verify_checkpoint(path, deep=deep)
        assert report.passed, [f.message for f in report.errors]
        assert any(c.check == "manifest-digest" for c in report.coverage)
        assert not [f for f in report.findings if f.check == "manifest-absent"]
    moved = path.parent / "moved-elsewhere"
    shutil.move(str(path), moved)
    assert verify_checkpoint(moved, deep=True).passed


def test_fingerprint_refuses_to_overwrite_and_to_bless_a_corrupt_checkpoint(fresh_ckpt):
    path = _adopted(fresh_ckpt, "single")
    with pytest.raises(CkptVerifyError, match="exists; pass --force"):
        fingerprint_checkpoint(path)
    runner = CliRunner()
    assert runner.invoke(main, ["fingerprint", str(path)]).exit_code == 2
    assert runner.invoke(main, ["fingerprint", "--force", "--no-progress", str(path)]).exit_code == 0

    bad = fresh_ckpt("single")
    inj.flip_in_tensor_payload(bad)
    report, manifest = fingerprint_checkpoint(bad)
    assert manifest is None and report.exit_code == 1
    assert "fingerprint-refused" in _checks(report)
    assert not (bad / MANIFEST_FILE).exists()


@pytest.mark.parametrize("layout", ["single", "fsdp2"])
def test_payload_flip_is_localized_to_the_block_through_the_manifest(fresh_ckpt, layout):
    path = _adopted(fresh_ckpt, layout)
    fault = inj.flip_in_tensor_payload(path, rng=7)
    report = verify_checkpoint(path)
    hits = [f for f in report.errors if f.check == "manifest-digest" and f.location.fqn == fault.fqn]
    assert hits, [f.message for f in report.findings]
    loc = hits[0].location
    assert loc.byte_range[0] <= fault.byte_offset < loc.byte_range[1]
    assert loc.byte_range[1] - loc.byte_range[0] <= 4096  # one block
    assert loc.element_range[0] <= fault.element < loc.element_range[1]


def test_silent_rewrite_with_valid_crc_is_caught_only_through_the_manifest(fresh_ckpt):
    path = _adopted(fresh_ckpt, "single")
    fault = inj.rewrite_payload_valid_crc(path, element=3)
    assert verify_checkpoint(path, use_manifest=False).passed  # every self-check still passes
    report = verify_checkpoint(path)
    hits = [f for f in report.errors if f.check == "manifest-digest"]
    assert hits and hits[0].location.fqn == fault.fqn
    assert hits[0].location.element_range[0] <= 3 < hits[0].location.element_range[1]
    deep = verify_checkpoint(path, deep=True)
    assert any(f.check == "fingerprint" and f.location.fqn == fault.fqn for f in deep.errors)


def test_equal_layout_swap_is_caught_through_the_manifest(fresh_ckpt):
    path = _adopted(fresh_ckpt, "nocoll")
    a, b = path / "__0_0.distcp", path / "__1_0.distcp"
    tmp = path / "swap.tmp"
    os.rename(a, tmp)
    os.rename(b, a)
    os.rename(tmp, b)
    report = verify_checkpoint(path)
    assert report.exit_code == 1 and "manifest-digest" in _checks(report)


def test_file_swapped_with_one_from_another_checkpoint_is_caught(fresh_ckpt):
    path = _adopted(fresh_ckpt, "single")
    other = fresh_ckpt("single")
    inj.rewrite_payload_valid_crc(other, element=0)  # same shapes, different values, valid CRCs
    for name in os.listdir(other):
        if name.endswith(".distcp"):
            shutil.copyfile(other / name, path / name)
    report = verify_checkpoint(path)
    assert report.exit_code == 1 and "manifest-digest" in _checks(report)


@pytest.mark.parametrize("fault", ["truncate", "delete-file", "zero-page", "metadata-edit", "bytes-item"])
def test_faults_are_caught_with_a_manifest(fresh_ckpt, fault):
    path = _adopted(fresh_ckpt, "threads")
    if fault == "truncate":
        inj.truncate(path)
    elif fault == "delete-file":
        inj.delete_file(path, sorted(n for n in os.listdir(path) if n.endswith(".distcp"))[0])
    elif fault == "zero-page":
        inj.zero_page(path)
    elif fault == "bytes-item":
        inj.flip_in_bytes_item(path)
    else:
        def edit(md: Any) -> str:
            md.planner_data = {"edited": ("x",)}
            return "planner data edited"

        inj.edit_metadata(path, edit)
    report = verify_checkpoint(path)
    assert report.exit_code == 1, [f.message for f in report.findings]
    if fault == "metadata-edit":
        assert "manifest-digest" in _checks(report)  # a valid but different .metadata


def _rewrite_manifest(path: Path, edit: Any, keep_digest: bool) -> None:
    from ckptverify.ownfiles.manifest import _self_digest

    data = json.loads((path / MANIFEST_FILE).read_text())
    edit(data)
    if not keep_digest:
        data["self_digest"] = _self_digest({k: v for k, v in data.items() if k != "self_digest"})
    (path / MANIFEST_FILE).write_text(json.dumps(data))


def test_tampered_or_truncated_manifest_is_a_finding_never_a_crash(fresh_ckpt):
    path = _adopted(fresh_ckpt, "single")
    raw = (path / MANIFEST_FILE).read_bytes()
    for bad in (raw[: len(raw) // 2], b"", b"[1, 2]", raw.replace(b'"digest"', b'"digesT"', 1)):
        (path / MANIFEST_FILE).write_bytes(bad)
        report = verify_checkpoint(path)
        assert report.exit_code == 1 and "manifest-invalid" in _checks(report)
    (path / MANIFEST_FILE).write_bytes(raw)

    # An entry edited without fixing the self-digest: refused as a whole.
    _rewrite_manifest(path, lambda d: d["items"][0].update(digest="0" * 32), keep_digest=True)
    assert "manifest-invalid" in _checks(verify_checkpoint(path))
    # An entry edited consistently: the bytes no longer match it.
    (path / MANIFEST_FILE).write_bytes(raw)
    _rewrite_manifest(path, lambda d: d["items"][0]["blocks"].__setitem__(0, "0" * 32), keep_digest=False)
    assert "manifest-digest" in _checks(verify_checkpoint(path))
    # An entry that disagrees with .metadata about where an item lives.
    (path / MANIFEST_FILE).write_bytes(raw)
    _rewrite_manifest(path, lambda d: d["items"][0].update(offset=d["items"][0]["offset"] + 1), keep_digest=False)
    assert "manifest-mismatch" in _checks(verify_checkpoint(path))


def test_deep_verify_catches_values_that_differ_from_memory(fresh_ckpt):
    path = _adopted(fresh_ckpt, "fsdp2")

    def edit(d: dict) -> None:
        name = sorted(k for k, t in d["tensors"].items() if t["fingerprint"])[0]
        d["tensors"][name]["fingerprint"] = "f" * 32

    _rewrite_manifest(path, edit, keep_digest=False)
    assert verify_checkpoint(path).passed  # bytes match the manifest's digests
    deep = verify_checkpoint(path, deep=True)
    assert [f.check for f in deep.errors] == ["fingerprint"]


def test_verify_cli_deep_json(fresh_ckpt):
    path = _adopted(fresh_ckpt, "single")
    result = CliRunner().invoke(main, ["verify", "--deep", "--json", str(path)])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert data["stats"]["deep"] and data["stats"]["manifest"]
    assert {c["check"] for c in data["coverage"]} >= {"manifest-digest", "fingerprint"}


def test_replicas_that_differ_are_reported_by_deep_verify(fresh_ckpt):
    path = fresh_ckpt("nocoll")  # per-rank metadata: each rank stores its own copy of replicated tensors
    replicated = sorted({it.fqn for it in inj.tensor_zip_items(path) if it.file == "__1_0.distcp"}
                        & {it.fqn for it in inj.tensor_zip_items(path) if it.file == "__0_0.distcp"
                           and it.chunk_offsets == tuple(0 for _ in it.chunk_offsets or ())})
    fqn = next(f for f in replicated if f.startswith("extra."))
    inj.rewrite_payload_valid_crc(path, fqn=fqn, file="__1_0.distcp")
    assert verify_checkpoint(path, use_manifest=False).passed  # each copy is self-consistent
    report = verify_checkpoint(path, use_manifest=False, deep=True)
    hits = [f for f in report.errors if f.check == "replica-mismatch"]
    assert hits and hits[0].location.fqn == fqn
    report, manifest = fingerprint_checkpoint(path)
    assert manifest is None and "fingerprint-refused" in _checks(report)


def test_cli_in_a_fresh_process_finds_damage_through_the_manifest(fresh_ckpt):
    import subprocess
    import sys

    path = _adopted(fresh_ckpt, "threads")
    env = dict(os.environ)
    cmd = [sys.executable, "-m", "ckptverify", "verify", "--json", "--jobs", "2", str(path)]
    clean = subprocess.run(cmd, capture_output=True, text=True, env=env)
    assert clean.returncode == 0, clean.stdout[-2000:] + clean.stderr[-2000:]
    fault = inj.flip_in_tensor_payload(path, rng=3)
    bad = subprocess.run(cmd, capture_output=True, text=True, env=env)
    assert bad.returncode == 1
    hits = [f for f in json.loads(bad.stdout)["findings"] if f["check"] == "manifest-digest"]
    assert hits and hits[0]["location"]["fqn"] == fault.fqn
    assert hits[0]["location"]["byte_range"][0] <= fault.byte_offset < hits[0]["location"]["byte_range"][1]


def _first_item_with_blocks(d: dict) -> dict:
    return next(i for i in d["items"] if len(i["blocks"]) > 1)


_OUTSIDE = "/etc/passwd"

# Each edit keeps the manifest's self-digest consistent: only the field checks can refuse it.
_BAD_FIELDS = {
    "block-bytes-1": lambda d: d.update(block_bytes=1),
    "block-bytes-0": lambda d: d.update(block_bytes=0),
    "block-bytes-huge": lambda d: d.update(block_bytes=1 << 40),
    "block-bytes-bool": lambda d: d.update(block_bytes=True),
    "unknown-algorithm": lambda d: d.update(digest_algorithm="md5"),
    "metadata-outside": lambda d: d["metadata_files"].update({_OUTSIDE: {"size": 1, "digest": "0" * 32}}),
    "metadata-dotdot": lambda d: d["metadata_files"].update({"../.metadata": {"size": 1, "digest": "0" * 32}}),
    "metadata-other-name": lambda d: d["metadata_files"].update({"__0_0.distcp": {"size": 1, "digest": "0" * 32}}),
    "file-outside": lambda d: d["files"].update({_OUTSIDE: {"size": 1, "digest": "0" * 32}}),
    "item-file-outside": lambda d: d["items"][0].update(file="../x.distcp"),
    "item-past-file-end": lambda d: d["items"][0].update(length=d["files"][d["items"][0]["file"]]["size"] + 1),
    "offset-huge": lambda d: d["items"][0].update(offset=1 << 70),
    "offset-negative": lambda d: d["items"][0].update(offset=-1),
    "offset-float": lambda d: d["items"][0].update(offset=1.0),
    "block-count": lambda d: _first_item_with_blocks(d)["blocks"].pop(),
    "digest-form": lambda d: d["items"][0].update(digest="zz" * 16),
    "item-twice": lambda d: d["items"].append(dict(d["items"][0])),
    "world-size-0": lambda d: d.update(world_size=0),
    "items-not-list": lambda d: d.update(items={"a": 1}),
    "chunk-offsets-rank": lambda d: next(i for i in d["items"] if i["chunk_offsets"]).update(chunk_offsets=[0] * 9),
}


@pytest.mark.parametrize("edit", sorted(_BAD_FIELDS))
def test_every_manifest_field_is_validated(fresh_ckpt, edit):
    path = _adopted(fresh_ckpt, "single")
    _rewrite_manifest(path, _BAD_FIELDS[edit], keep_digest=False)
    report = verify_checkpoint(path)
    assert report.exit_code == 1, [f.message for f in report.findings]
    invalid = [f for f in report.errors if f.check == "manifest-invalid"]
    assert len(invalid) == 1, [f.message for f in report.findings]
    # Refused as a whole: nothing is compared with (or read because of) a manifest that is not sensible.
    assert not {"manifest-digest", "manifest-mismatch"} & _checks(report)


def test_manifest_never_makes_verify_read_outside_the_checkpoint(fresh_ckpt):
    """Even through the command line, a manifest naming /etc/passwd gets neither it read nor its digest printed."""
    from ckptverify.fingerprint import digest_bytes

    path = _adopted(fresh_ckpt, "single")
    _rewrite_manifest(path, _BAD_FIELDS["metadata-outside"], keep_digest=False)
    result = CliRunner().invoke(main, ["verify", "--json", "--no-progress", str(path)])
    assert result.exit_code == 1
    with open(_OUTSIDE, "rb") as f:
        secret = digest_bytes(f.read())
    assert secret not in result.output


def test_findings_are_capped_per_check_with_a_count_of_the_rest(fresh_ckpt):
    from ckptverify.checks.dcp_pipeline import MAX_FINDINGS_PER_CHECK

    path = _adopted(fresh_ckpt, "single")

    def wrong_everywhere(d: dict) -> None:
        for item in d["items"]:
            item["blocks"] = ["0" * 32 for _ in item["blocks"]]

    _rewrite_manifest(path, wrong_everywhere, keep_digest=False)
    total = sum(len(i.blocks) for i in read_manifest(str(path)).items)
    assert total > MAX_FINDINGS_PER_CHECK + 10
    report = verify_checkpoint(path)
    digests = [f for f in report.findings if f.check == "manifest-digest"]
    assert len(digests) == MAX_FINDINGS_PER_CHECK + 1
    summary = digests[-1]
    expected_actual = {"omitted": total - MAX_FINDINGS_PER_CHECK, "total": total,
                       "omitted_by_severity": {"error": total - MAX_FINDINGS_PER_CHECK}}
    assert summary.actual == expected_actual
    assert summary.severity.value == "error"
    # The summary counts every finding, listed or not.
    assert report.summary()["error"] == sum(1 for f in report.errors if f.check != "manifest-digest") + total
    assert report.stats["findings_omitted"] == {"manifest-digest": total - MAX_FINDINGS_PER_CHECK}
    as_json = CliRunner().invoke(main, ["verify", "--json", "--no-progress", str(path)])
    listed = [f for f in json.loads(as_json.output)["findings"] if f["check"] == "manifest-digest"]
    assert len(listed) == MAX_FINDINGS_PER_CHECK + 1
    assert any(f.get("actual") == expected_actual for f in listed)
    as_text = CliRunner().invoke(main, ["verify", "--no-progress", str(path)])
    # The table wraps messages inside their cells: read the message column back as one text.
    messages = " ".join(cells[4].strip() for line in as_text.output.splitlines()
                        if len(cells := line.split("\u2502")) > 4)
    assert f"{total - MAX_FINDINGS_PER_CHECK} more manifest-digest finding(s) not listed" in " ".join(messages.split())
