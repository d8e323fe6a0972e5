"""Single torch.save files, safetensors files and Hugging Face style folders: checked by their content."""

from __future__ import annotations

import dataclasses
import json
import os
import pickle
import struct
import zipfile
from pathlib import Path

import pytest
import torch

from ckptverify.formats.folder import check_folder
from ckptverify.formats.pickle_scan import PickleScanError, scan_pickle
from ckptverify.formats.single import check_file


@dataclasses.dataclass
class TrainingArgs:
    """A user object pickled with NEWOBJ (as transformers' training_args.bin is)."""

    lr: float = 1e-3
    name: str = "run"


def _errors(findings):
    return [f for f in findings if f.severity.value == "error"]


def _record_span(path: Path, suffix: str) -> tuple[int, int]:
    """Byte range of the zip member ending in ``suffix`` (its data, after the local header)."""
    with zipfile.ZipFile(path) as z:
        info = next(i for i in z.infolist() if i.filename.endswith(suffix))
    raw = path.read_bytes()
    name_len, extra_len = struct.unpack_from("<HH", raw, info.header_offset + 26)
    start = info.header_offset + 30 + name_len + extra_len
    return start, start + info.file_size


def _flip(path: Path, offset: int, bit: int = 3) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 1 << bit
    path.write_bytes(bytes(data))


@pytest.fixture
def pt_file(tmp_path: Path) -> Path:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 8), torch.nn.LayerNorm(8))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 16)).sum().backward()
    opt.step()
    path = tmp_path / "epoch=0-step=10.ckpt"
    torch.save({"state_dict": model.state_dict(), "optimizer_states": [opt.state_dict()], "global_step": 10,
                "hyper_parameters": {"lr": 1e-3, "path": Path("/data"), "args": TrainingArgs()},
                "extra": {"u16": torch.arange(5).to(torch.uint16), "bf": torch.ones(3, dtype=torch.bfloat16),
                          "view": torch.arange(20.0)[5:15:2]}}, path)
    return path


def test_a_clean_torch_save_file_passes_and_names_its_tensors(pt_file: Path) -> None:
    findings, coverage, facts = check_file(str(pt_file))
    assert not _errors(findings), findings
    assert facts["format"] == "torch.save" and "state_dict.0.weight" in facts["tensors"]
    assert "optimizer_states.0.state.0.exp_avg" in facts["tensors"]
    assert {c.check for c in coverage} >= {"zip-structure", "zip-crc", "tensor-record"}
    assert any(f.check == "pickle-opaque" and "pathlib" in f.message and "TrainingArgs" in f.message
               for f in findings)


def test_a_flipped_payload_bit_is_caught_and_named(pt_file: Path) -> None:
    start, end = _record_span(pt_file, "data/0")
    _flip(pt_file, start + (end - start) // 2)
    errors = _errors(check_file(str(pt_file))[0])
    assert [f.check for f in errors] == ["zip-crc"]
    assert errors[0].location.fqn == "state_dict.0.weight" and errors[0].location.byte_range == (start, end)


def test_a_damaged_pickle_or_a_truncated_file_is_an_error(pt_file: Path, tmp_path: Path) -> None:
    truncated = tmp_path / "cut.pt"
    truncated.write_bytes(pt_file.read_bytes()[:-100])
    assert [f.check for f in _errors(check_file(str(truncated))[0])] == ["zip-structure"]
    start, _ = _record_span(pt_file, "data.pkl")
    _flip(pt_file, start + 5)
    assert "zip-crc" in {f.check for f in _errors(check_file(str(pt_file))[0])}


def test_nothing_in_a_hostile_pickle_runs(tmp_path: Path) -> None:
    canary = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {canary}",))

    path = tmp_path / "evil.pt"
    torch.save({"w": torch.ones(3), "payload": Evil()}, path)  # a real torch.save archive around the payload
    findings, _, facts = check_file(str(path))
    assert not canary.exists()
    assert any("posix.system" in f.message or "os.system" in f.message for f in findings), findings
    assert not _errors(findings) and set(facts["tensors"]) == {"w"}


def test_a_billion_laughs_pickle_is_refused_in_bounded_time() -> None:
    # Each level references the previous one ten times: 10**30 leaves if expanded, a few KB as a pickle.
    layer: list = ["x"]
    for _ in range(30):
        layer = [layer] * 10
    data = pickle.dumps(layer, protocol=4)
    scan = scan_pickle(data)  # shared references are walked once: linear
    assert scan.tensors == {}
    with pytest.raises(PickleScanError):
        scan_pickle(pickle.dumps([[i] for i in range(50_000)]), max_objects=1000)


def test_legacy_and_unknown_files(tmp_path: Path) -> None:
    legacy = tmp_path / "old.pt"
    torch.save({"w": torch.ones(2)}, legacy, _use_new_zipfile_serialization=False)
    findings, _, _ = check_file(str(legacy))
    assert not _errors(findings) and [f.check for f in findings] == ["content-uncheckable"]
    junk = tmp_path / "junk.bin"
    junk.write_bytes(b"hello world, not a checkpoint")
    assert [f.check for f in _errors(check_file(str(junk))[0])] == ["format-unknown"]


def test_safetensors_files_are_checked_for_layout_and_called_uncheckable(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    path = tmp_path / "model.safetensors"
    save_file({"a": torch.randn(4, 4), "b": torch.arange(6, dtype=torch.int64)}, str(path))
    findings, _, facts = check_file(str(path))
    assert not _errors(findings) and facts["format"] == "safetensors" and set(facts["tensors"]) == {"a", "b"}
    assert [f.check for f in findings] == ["content-uncheckable"]
    raw = bytearray(path.read_bytes())
    (n,) = struct.unpack_from("<Q", raw)
    header = raw[8:8 + n].replace(b'"shape":[4,4]', b'"shape":[4,5]')
    path.write_bytes(bytes(raw[:8] + header + raw[8 + n:]))
    assert [f.check for f in _errors(check_file(str(path))[0])] == ["blob-structure"]


def _hf_folder(root: Path) -> Path:
    from safetensors.torch import save_file

    root.mkdir()
    save_file({"embed.weight": torch.randn(8, 4)}, str(root / "model-00001-of-00002.safetensors"))
    save_file({"head.weight": torch.randn(4, 4), "head.bias": torch.zeros(4)},
              str(root / "model-00002-of-00002.safetensors"))
    index = {"metadata": {"total_size": 0}, "weight_map": {"embed.weight": "model-00001-of-00002.safetensors",
                                                           "head.weight": "model-00002-of-00002.safetensors",
                                                           "head.bias": "model-00002-of-00002.safetensors"}}
    (root / "model.safetensors.index.json").write_text(json.dumps(index))
    (root / "config.json").write_text(json.dumps({"hidden_size": 4}))
    torch.save({"step": 3}, root / "scheduler.bin")
    return root


def test_a_sharded_hugging_face_folder_matches_its_index(tmp_path: Path) -> None:
    root = _hf_folder(tmp_path / "hf")
    findings, coverage, facts = check_folder(str(root))
    assert not _errors(findings), findings
    assert facts["files"]["scheduler.bin"] == "torch.save" and any(c.check == "index" for c in coverage)
    index = json.loads((root / "model.safetensors.index.json").read_text())
    index["weight_map"]["lost.weight"] = "model-00002-of-00002.safetensors"
    index["weight_map"]["other.weight"] = "../../etc/passwd"
    (root / "model.safetensors.index.json").write_text(json.dumps(index))
    os.remove(root / "model-00001-of-00002.safetensors")
    checks = sorted(f.check for f in _errors(check_folder(str(root))[0]))
    assert checks == ["file-missing", "index-invalid", "index-mismatch"]
    (root / "config.json").write_text("{broken")
    assert "json-invalid" in {f.check for f in _errors(check_folder(str(root))[0])}


def test_special_files_in_a_folder_are_findings_never_opened(tmp_path: Path) -> None:
    root = _hf_folder(tmp_path / "hf")
    os.mkfifo(root / "optimizer.bin")
    os.symlink("/dev/zero", root / "rng_state.pth")
    findings, _, _ = check_folder(str(root))
    assert sorted(f.location.file for f in _errors(findings) if f.check == "file-type") == ["optimizer.bin",
                                                                                            "rng_state.pth"]
