"""``fingerprint`` of many small items: its fast paths give what the general paths give, on planted faults.

The fast paths: small whole tensors fingerprinted a round of batched reads at a time by numpy alone (torch not
imported), the verification pass's small files held in memory through the digest pass and the scan (each file
read once), the cyclic collector paused. The general path turns all of them off: every tensor by the general
scan, every file opened and read again. Same manifest (byte for
byte, but the time it was written), same refusals.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

from ckptverify.audit import adopt
from ckptverify.audit.adopt import fingerprint_checkpoint
from ckptverify.audit.verify import verify_checkpoint
from ckptverify.checks import adoption, dcp_pipeline
from ckptverify.ownfiles.manifest import MANIFEST_FILE, manifest_text, read_manifest


def _save(path: Path, state: dict[str, Any], *, per_item: bool) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, storage_writer=dcp.FileSystemWriter(str(path), thread_count=1,
                                                            single_file_per_rank=not per_item))


def _state(n: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(5)
    state: dict[str, Any] = {f"layers.{i}.weight": torch.randn(4, generator=g) for i in range(n)}
    state.update({
        "f16": torch.tensor([1.0, float("nan"), float("inf"), 2.0]).half(),
        "bf16": torch.tensor([float("-inf"), float("nan"), float("nan"), 0.5]).bfloat16(),
        "f64": torch.tensor([float("inf"), 3.0]).double(),
        "i8": torch.tensor([-3, 4, -128], dtype=torch.int8), "u8": torch.tensor([200, 1], dtype=torch.uint8),
        "flag": torch.tensor([True, False]), "step": torch.tensor(7), "i16": torch.tensor([-2, 9], dtype=torch.int16),
        "big": torch.randn(1 << 15, generator=g), "c64": torch.randn(2, generator=g, dtype=torch.complex64),
        "view": torch.randn(3, 5, generator=g).t(), "lr": 0.01,
    })
    return state


def _general(m: pytest.MonkeyPatch) -> None:
    """Every fast path off: the general scan for every tensor, every file read again by each pass."""
    m.setattr(adoption, "_scan_small_tensors", lambda desc, run_map: {})
    m.setattr(dcp_pipeline, "KEEP_TOTAL_BYTES", 0)


def _fingerprint(path: Path, monkeypatch: pytest.MonkeyPatch, *, general: bool, **patch: Any) -> tuple[Any, Any]:
    with monkeypatch.context() as m:
        if general:
            _general(m)
        for name, value in patch.items():
            m.setattr(adoption if hasattr(adoption, name) else dcp_pipeline, name, value)
        return fingerprint_checkpoint(path, force=True, jobs=2)


def _text(manifest: Any) -> str:
    return manifest_text(dataclasses.replace(manifest, created=""))


def _flip_bit(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x04]))


@pytest.mark.parametrize("per_item", [False, True])
def test_the_fast_paths_write_the_general_paths_manifest(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                         per_item: bool) -> None:
    path = tmp_path / "ckpt"
    state = _state(150 if per_item else 1500)
    _save(path, state, per_item=per_item)
    general, general_manifest = _fingerprint(path, monkeypatch, general=True)
    assert general.passed and general_manifest is not None
    general_text = (path / MANIFEST_FILE).read_text()
    scanned: list[set[str]] = []
    real = adoption._scan_small_tensors

    def spy(desc: Any, run_map: Any) -> Any:
        scans = real(desc, run_map)
        scanned.append(set(scans))
        return scans

    variants = [{}, {"ROUND_BYTES": 64}, {"KEEP_TOTAL_BYTES": 3000}, {"KEEP_FILE_BYTES": 0}]
    for patch in variants:
        report, manifest = _fingerprint(path, monkeypatch, general=False, _scan_small_tensors=spy, **patch)
        assert report.passed and manifest is not None, patch
        assert _text(manifest) == _text(general_manifest), patch
        # What is on disk is that text (the time written aside), and reads back as the manifest.
        written = (path / MANIFEST_FILE).read_text()
        assert written == manifest_text(manifest)
        assert read_manifest(str(path)) == manifest
    assert len(general_text) == len(written)
    assert {"layers.0.weight", "f16", "bf16", "f64", "i8", "u8", "flag", "step", "i16"} <= scanned[0]
    assert not {"big", "c64", "view"} & scanned[0]
    tensors = general_manifest.tensors
    assert (tensors["f16"].nan_count, tensors["f16"].inf_count) == (1, 1)
    assert (tensors["bf16"].nan_count, tensors["bf16"].inf_count) == (2, 1)
    assert (tensors["f64"].nan_count, tensors["f64"].inf_count) == (0, 1)
    assert verify_checkpoint(path, jobs=2, deep=True).passed


@pytest.mark.parametrize("per_item", [False, True])
def test_a_flipped_bit_is_refused_alike(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, per_item: bool) -> None:
    path = tmp_path / "ckpt"
    state = {f"w.{i}": torch.full((4,), float(i)) for i in range(120 if per_item else 1200)}
    _save(path, state, per_item=per_item)
    shards = sorted(p for p in path.iterdir() if p.suffix == ".distcp")
    target = shards[len(shards) // 2]
    data = target.read_bytes()
    # A byte of a tensor's values (the float 4 bytes before the last records of the archive's bytes).
    where = data.index(b"data/0") if per_item else len(data) // 2
    _flip_bit(target, where + 100 if per_item else where)
    outcomes = []
    for general in (False, True):
        report, manifest = _fingerprint(path, monkeypatch, general=general)
        assert not report.passed and manifest is None
        assert not (path / MANIFEST_FILE).exists()
        outcomes.append(sorted((f.check, f.location.file) for f in report.findings))
    assert outcomes[0] == outcomes[1]
    assert ("fingerprint-refused", MANIFEST_FILE) in outcomes[0]
    assert any(file == target.name for _, file in outcomes[0])


@pytest.mark.parametrize("fault", ["missing", "truncated"])
def test_a_missing_or_truncated_file_is_refused_alike(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                      fault: str) -> None:
    path = tmp_path / "ckpt"
    _save(path, {f"w.{i}": torch.full((4,), float(i)) for i in range(60)}, per_item=True)
    target = sorted(p for p in path.iterdir() if p.suffix == ".distcp")[17]
    if fault == "missing":
        target.unlink()
    else:
        os.truncate(target, target.stat().st_size - 9)
    outcomes = []
    for general in (False, True):
        report, manifest = _fingerprint(path, monkeypatch, general=general)
        assert manifest is None and not (path / MANIFEST_FILE).exists()
        outcomes.append(sorted((f.check, f.location.file) for f in report.findings))
    assert outcomes[0] == outcomes[1]
    assert any(file == target.name for _, file in outcomes[0])


@pytest.mark.parametrize("general", [False, True])
def test_a_file_rewritten_after_it_was_digested_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                           general: bool) -> None:
    """The scan reads kept bytes (the fast path) or the file again (the general one): either way a file
    rewritten between the digest pass and the manifest is caught, and no manifest is written."""
    path = tmp_path / "ckpt"
    _save(path, {f"w.{i}": torch.full((4,), float(i)) for i in range(40)}, per_item=True)
    target = sorted(p for p in path.iterdir() if p.suffix == ".distcp")[5]
    real = adoption._scan_small_tensors

    def rewrite_then_scan(desc: Any, run_map: Any) -> Any:
        data = bytearray(target.read_bytes())
        data[-30] ^= 1
        target.write_bytes(bytes(data))  # same size, new content and modification time
        os.utime(target, ns=(target.stat().st_atime_ns, target.stat().st_mtime_ns + 10_000_000))
        return real(desc, run_map) if not general else {}

    with monkeypatch.context() as m:
        if general:
            _general(m)
        m.setattr(adoption, "_scan_small_tensors", rewrite_then_scan)
        report, manifest = fingerprint_checkpoint(path, force=True, jobs=2)
    assert manifest is None and not (path / MANIFEST_FILE).exists()
    checks = {(f.check, f.location.file) for f in report.findings}
    assert ("file-changed", target.name) in checks
    assert ("fingerprint-refused", MANIFEST_FILE) in checks


def test_fingerprint_of_small_tensors_imports_no_torch(tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    _save(path, {f"w.{i}": torch.full((3,), float(i)) for i in range(30)}, per_item=False)
    code = ("import sys; from ckptverify.audit.adopt import fingerprint_checkpoint\n"
            f"r, m = fingerprint_checkpoint({str(path)!r}, jobs=2)\n"
            "assert r.passed and m is not None\n"
            "print('torch' in sys.modules, m.torch_version)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": os.getcwd()}).stdout.split()
    assert out == ["False", str(torch.__version__)]
    assert read_manifest(str(path)).torch_version == str(torch.__version__)  # type: ignore[union-attr]


def test_the_torch_version_is_read_as_importing_torch_gives_it(monkeypatch: pytest.MonkeyPatch,
                                                                tmp_path: Path) -> None:
    import importlib.util

    assert adopt.torch_version() == str(torch.__version__)
    code = ("from ckptverify.audit.adopt import torch_version; import sys\n"
            "print(torch_version(), 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": os.getcwd()}).stdout.split()
    assert out == [str(torch.__version__), "False"]
    # A version file that says something else than one plain assignment: torch is imported and asked.
    fake = tmp_path / "torch"
    fake.mkdir()
    (fake / "version.py").write_text("__version__ = '1.0'\n__version__ = '2.0'\n")

    class Spec:
        submodule_search_locations = (str(fake),)

    with monkeypatch.context() as m:
        m.delitem(sys.modules, "torch")
        m.setattr(importlib.util, "find_spec", lambda name: Spec())
        m.setitem(sys.modules, "torch", None)  # importing it now fails: the fallback is taken, not the file
        with pytest.raises(ImportError):
            adopt.torch_version()
        m.delitem(sys.modules, "torch")
        (fake / "version.py").write_text("__version__ = '9.9.9+odd'\n")
        assert adopt.torch_version() == "9.9.9+odd"
