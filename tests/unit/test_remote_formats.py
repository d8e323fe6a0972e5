"""``fingerprint``, ``diff`` and the other formats (``torch.save`` and safetensors files, Hugging Face folders)
at ``s3://`` URLs on moto's S3 server; and the object layouts s3torchconnector's DCP writer produces.

s3torchconnector's ``S3StorageWriter`` is a ``FileSystemWriter`` over its own S3 client: it writes DCP's
names (``__{rank}_{n}.distcp``, ``.metadata`` written as ``.metadata.tmp`` and then copied over), under a
per-rank key prefix when a prefix strategy is given (``<pattern>/[epoch_<n>/]__{rank}_{n}.distcp``, the
relative paths recorded in the metadata). Its client is a compiled extension not installable here, so the
tests write the same names with DCP's own fsspec writer, planned with the same prefixes.

Skipped, with the reason, when s3fs or moto is not installed (the ``test`` extra installs both).
"""

from __future__ import annotations

import dataclasses
import os
import uuid
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("s3fs", reason="s3fs is not installed (pip install 'ckptverify[s3]'): S3 tests skipped")
pytest.importorskip("moto.server", reason="moto's S3 server is not installed (the `test` extra): S3 tests skipped")

import torch
import torch.distributed.checkpoint as dcp
from helpers.remote_s3 import serve_bucket

from ckptverify.audit.adopt import fingerprint_checkpoint
from ckptverify.audit.diff import diff_checkpoints
from ckptverify.audit.verify import verify_checkpoint
from ckptverify.ownfiles.manifest import MANIFEST_FILE
from ckptverify.runs.scan import scan_run_dir

BUCKET = "formats"


@pytest.fixture(scope="module")
def s3() -> Iterator[Any]:
    yield from serve_bucket(BUCKET)


def _url(name: str) -> str:
    return f"s3://{BUCKET}/{name}-{uuid.uuid4().hex[:8]}"


def _state(seed: int) -> dict[str, Any]:
    torch.manual_seed(seed)
    return {"model": {"w": torch.randn(300, 200), "b": torch.randn(200)}, "step": seed}


def _fsspec_save(state: dict[str, Any], url: str, prefix: Any = None) -> None:
    """DCP's fsspec writer; ``prefix(rank)``: the storage prefix each rank's files get (s3torchconnector's
    prefix strategies), default DCP's ``__{rank}_``."""
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter
    from torch.distributed.checkpoint.filesystem import _StoragePrefix

    class Writer(FsspecWriter):
        def prepare_global_plan(self, plans: list[Any]) -> list[Any]:
            plans = super().prepare_global_plan(plans)
            if prefix is None:
                return plans
            return [dataclasses.replace(p, storage_data=_StoragePrefix(prefix(i))) for i, p in enumerate(plans)]

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, storage_writer=Writer(url))


def _judged(report: Any) -> set[tuple[str, str, str | None]]:
    return {(f.check, f.severity.value, f.location.file) for f in report.findings
            if f.check != "fingerprint-advice"}  # its message names the path given: compared apart


def test_fingerprint_writes_the_manifest_into_s3_and_verify_uses_it(s3: Any) -> None:
    url = _url("fp")
    _fsspec_save(_state(1), url)
    report, manifest = fingerprint_checkpoint(url)
    assert report.passed and manifest is not None
    assert s3.exists(f"{url}/{MANIFEST_FILE}".removeprefix("s3://"))
    checked = verify_checkpoint(url)
    assert checked.passed and checked.stats["manifest"] is True
    assert any(c.check == "manifest-digest" and c.count > 0 for c in checked.coverage)


def test_diff_between_s3_and_local(s3: Any, tmp_path: Path) -> None:
    a, b = _url("diff-a"), _url("diff-b")
    _fsspec_save(_state(1), a)
    _fsspec_save(_state(2), b)
    dcp.save(_state(1), checkpoint_id=str(tmp_path / "same"))
    same = diff_checkpoints(a, tmp_path / "same")
    assert same.passed, [f.message for f in same.findings]
    other = diff_checkpoints(a, b)
    assert not other.passed
    assert {f.location.fqn for f in other.findings if f.severity.value == "error"} >= {"model.w", "model.b"}


def test_single_files_and_folders_same_findings_as_local(s3: Any, tmp_path: Path) -> None:
    from safetensors.torch import save_file

    folder = tmp_path / "hf"
    folder.mkdir()
    torch.save({"w": torch.randn(50, 40), "epoch": 3}, folder / "pytorch_model.bin")
    save_file({"w": torch.randn(50, 40)}, str(folder / "model.safetensors"))
    (folder / "config.json").write_text('{"model_type": "toy"}')
    url = _url("hf")
    s3.put(str(folder) + "/", url.removeprefix("s3://") + "/", recursive=True)
    for name in ("", "/pytorch_model.bin", "/model.safetensors"):
        remote = verify_checkpoint(url + name)
        local = verify_checkpoint(str(folder) + name)
        assert _judged(remote) == _judged(local), name
        assert remote.passed == local.passed
    # A payload byte changed in the torch.save file: its zip CRC fails, at S3 as on disk.
    key = f"{url}/pytorch_model.bin".removeprefix("s3://")
    data = bytearray(s3.cat_file(key))
    data[len(data) // 2] ^= 0x01
    s3.pipe_file(key, bytes(data))
    (folder / "pytorch_model.bin").write_bytes(bytes(data))
    remote, local = verify_checkpoint(f"{url}/pytorch_model.bin"), verify_checkpoint(str(folder / "pytorch_model.bin"))
    assert not remote.passed and _judged(remote) == _judged(local), [f.message for f in remote.findings]


def test_fingerprint_of_a_single_file_on_s3(s3: Any, tmp_path: Path) -> None:
    torch.save({"w": torch.randn(20, 20)}, tmp_path / "model.pt")
    url = _url("single") + "/model.pt"
    s3.put_file(str(tmp_path / "model.pt"), url.removeprefix("s3://"))
    report, manifest = fingerprint_checkpoint(url)
    assert report.passed and manifest is not None
    assert s3.exists(f"{url}.{MANIFEST_FILE}".removeprefix("s3://"))
    assert verify_checkpoint(url).stats["manifest"] is True


@pytest.mark.parametrize("strategy", [
    lambda rank: f"__{rank}_",  # DefaultPrefixStrategy
    lambda rank: f"{format(rank, '010b')[::-1]}/__{rank}_",  # BinaryPrefixStrategy
    lambda rank: f"{format(rank, '010x')[::-1]}/epoch_3/__{rank}_",  # HexPrefixStrategy with epoch_num
], ids=["default", "binary", "hex-epoch"])
def test_s3torchconnector_layouts(s3: Any, tmp_path: Path, strategy: Any) -> None:
    run = _url("s3tc")
    url = f"{run}/step_7"
    _fsspec_save(_state(7), url, prefix=strategy)
    keys = [k.removeprefix(url.removeprefix("s3://") + "/") for k in s3.find(url.removeprefix("s3://"))]
    assert ".metadata" in keys and any(k.endswith("__0_0.distcp") for k in keys)
    report = verify_checkpoint(url)
    assert report.passed, [f.message for f in report.findings]
    assert report.stats["items"] >= 3
    s3.get(url.removeprefix("s3://") + "/", str(tmp_path / "copy") + "/", recursive=True)
    assert _judged(report) == _judged(verify_checkpoint(str(tmp_path / "copy")))
    # A file left beside the shards is reported as unreferenced, in a sub-folder too.
    shard = next(k for k in keys if k.endswith(".distcp"))
    stray = os.path.dirname(shard) + "/__9_0.distcp" if "/" in shard else "__9_0.distcp"
    s3.pipe_file(f"{url}/{stray}".removeprefix("s3://"), b"leftover")
    assert ("file-unreferenced", "warning", stray) in _judged(verify_checkpoint(url))
    # The commit: the metadata copied from .metadata.tmp. Interrupted before it, the save is not complete,
    # and a scan of the run directory finds it as an uncommitted DCP checkpoint.
    s3.rm_file(f"{url}/{stray}".removeprefix("s3://"))
    s3.mv(f"{url}/.metadata".removeprefix("s3://"), f"{url}/.metadata.tmp".removeprefix("s3://"))
    torn = verify_checkpoint(url)
    assert not torn.passed
    scanned = scan_run_dir(run)
    rows = {r["path"]: (r["format"], r["state"]) for r in scanned.stats["checkpoints"]}
    assert rows == {"step_7": ("dcp-uncommitted", "incomplete")}
