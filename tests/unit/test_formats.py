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
import torch.distributed.checkpoint as dcp
from helpers.dcp_encodings import dcp_checkpoint as _dcp
from helpers.dcp_encodings import safetensors_ckpt, zstd_ckpt

from ckptverify.checks.folder import check_folder
from ckptverify.checks.single import check_file
from ckptverify.errors import BadPickle, TransformError
from ckptverify.safeparse.torchsave import scan_pickle


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


def test_a_file_verified_with_its_manifest_and_deep_has_its_pickle_read_once(pt_file: Path, monkeypatch) -> None:
    """The check's read of data.pkl describes the file for its manifest and for the deep check; named by a relative
    path too, the file is rebuilt once (one fingerprint error for the one changed tensor)."""
    from ckptverify.audit.adopt import fingerprint_checkpoint
    from ckptverify.audit.verify import verify_checkpoint
    from ckptverify.safeparse import torchsave

    assert fingerprint_checkpoint(pt_file)[0].exit_code == 0
    start, end = _record_span(pt_file, "data/0")
    _flip(pt_file, start + (end - start) // 2)
    reads = []
    load = torchsave._Reader.load
    monkeypatch.setattr(torchsave._Reader, "load", lambda self: reads.append(self) or load(self))
    monkeypatch.chdir(pt_file.parent)
    report = verify_checkpoint(pt_file.name, deep=True)
    assert len(reads) == 1 and report.stats["manifest"]
    assert [f.location.fqn for f in report.errors if f.check == "fingerprint"] == ["state_dict.0.weight"]


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
    with pytest.raises(BadPickle):
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
    torch.manual_seed(0)
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


def test_an_index_that_leaves_out_a_tensor_or_a_shard_or_maps_nothing_is_reported(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    root = _hf_folder(tmp_path / "hf")
    save_file({"old.weight": torch.ones(2)}, str(root / "model-00003-of-00003.safetensors"))
    index_file = root / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    del index["weight_map"]["head.bias"]
    index_file.write_text(json.dumps(index))
    said = sorted((f.check, f.message) for f in check_folder(str(root))[0] if f.check.startswith("index"))
    assert said == [
        ("index-mismatch", "model-00002-of-00002.safetensors holds 'head.bias', which model.safetensors.index.json "
                           "does not map to it"),
        ("index-mismatch", "model-00003-of-00003.safetensors is not named by model.safetensors.index.json: a "
                           "leftover shard, or the index is stale")]
    index_file.write_text(json.dumps({"weight_map": ["embed.weight"]}))
    assert [f.message for f in check_folder(str(root))[0] if f.check == "index-invalid"] == [
        "model.safetensors.index.json has no weight_map of tensor names to shard files"]


def test_side_files_parse_with_the_safe_reader_and_a_framework_nan_is_not_a_failure(tmp_path: Path) -> None:
    root = _hf_folder(tmp_path / "hf")
    # Python's json.dumps writes a diverged loss as NaN: a trainer state with one is valid, not damage.
    (root / "trainer_state.json").write_text(json.dumps({"log_history": [{"loss": float("nan")}], "step": 3}))
    assert not _errors(check_folder(str(root))[0])
    for hostile in ('{"hidden_size": 4, "hidden_size": 8}', "[" * 100 + "]" * 100):
        (root / "config.json").write_text(hostile)
        assert "json-invalid" in {f.check for f in _errors(check_folder(str(root))[0])}, hostile


def test_special_files_in_a_folder_are_findings_never_opened(tmp_path: Path) -> None:
    root = _hf_folder(tmp_path / "hf")
    os.mkfifo(root / "optimizer.bin")
    os.symlink("/dev/zero", root / "rng_state.pth")
    findings, _, _ = check_folder(str(root))
    assert sorted(f.location.file for f in _errors(findings) if f.check == "file-type") == ["optimizer.bin",
                                                                                            "rng_state.pth"]


@pytest.mark.parametrize(("fqn", "label"), [("b", "'b' chunk [0]"), ("step", "'step'")])
def test_a_dcp_item_without_its_data_pkl_record_is_a_structure_error_at_the_item(tmp_path: Path, fqn: str,
                                                                                 label: str) -> None:
    from ckptverify.audit.verify import verify_checkpoint

    ckpt = tmp_path / "ckpt"
    dcp.save({"w": torch.randn(8, 8), "b": torch.arange(10), "step": 3}, checkpoint_id=str(ckpt))
    item = next(i for i in _items(ckpt).items if i.fqn == fqn)
    shard = ckpt / item.file
    raw = bytearray(shard.read_bytes())
    archive = bytes(raw[item.offset:item.end])
    assert archive.count(b"/data.pkl") == 2  # its local header and its central directory entry
    raw[item.offset:item.end] = archive.replace(b"/data.pkl", b"/data.pkX")  # an intact archive all the same
    shard.write_bytes(bytes(raw))
    errors = verify_checkpoint(ckpt).errors
    assert [(f.check, f.message) for f in errors] == [("zip-structure", f"{label} has no data.pkl record")]
    assert (errors[0].location.file, errors[0].location.byte_range) == (item.file, (item.offset, item.end))


# ---- DCP encodings: the ZStandard stream transform and the safetensors serialization -------------------------


def _items(path: Path):
    from ckptverify.dcp.metadata import read_layout

    layout, _ = read_layout(str(path))
    return layout


def test_zstd_items_are_decoded_and_checked_by_the_crcs_inside(tmp_path: Path) -> None:
    from ckptverify.audit.verify import verify_checkpoint

    ckpt = zstd_ckpt(tmp_path / "z")
    assert all(i.transforms == ("stream.zstd/1",) for i in _items(ckpt).items)
    report = verify_checkpoint(ckpt, deep=True)
    assert report.passed and not report.warnings, [f.message for f in report.findings]
    cov = {c.check: c.count for c in report.coverage}
    assert cov["zip-structure"] == 39 and cov["zip-crc"] > 200 and cov["fingerprint"] == 21


def test_a_flipped_byte_in_a_zstd_item_is_caught_and_placed_at_the_item(tmp_path: Path) -> None:
    from ckptverify.audit.verify import verify_checkpoint

    ckpt = zstd_ckpt(tmp_path / "z")
    item = next(i for i in _items(ckpt).items if i.fqn == "model.0.weight")
    _flip(ckpt / item.file, item.offset + item.length // 2)
    errors = verify_checkpoint(ckpt).errors
    assert errors and {f.location.fqn for f in errors} == {"model.0.weight"}, [f.message for f in errors]
    assert all(f.location.byte_range == (item.offset, item.end) for f in errors)


def test_a_zstd_item_that_cannot_be_decoded_here_is_uncheckable_and_deep_does_not_pass(tmp_path: Path,
                                                                                       monkeypatch) -> None:
    from ckptverify.audit.verify import verify_checkpoint
    from ckptverify.dcp import transforms

    ckpt = zstd_ckpt(tmp_path / "z")

    def unavailable(raw, limit):
        raise TransformError("no zstd decoder", unavailable=True)

    monkeypatch.setattr(transforms, "_zstd", unavailable)
    report = verify_checkpoint(ckpt)
    assert report.passed and {f.check for f in report.warnings} == {"content-uncheckable"}
    deep = verify_checkpoint(ckpt, deep=True)
    assert "deep-nothing-rebuilt" in {f.check for f in deep.errors}
    assert {c.check: c.count for c in deep.coverage}["fingerprint"] == 0


def test_a_zstd_item_that_fails_to_decode_or_decodes_to_no_archive_is_an_error(tmp_path: Path, monkeypatch) -> None:
    from ckptverify.audit.verify import verify_checkpoint
    from ckptverify.dcp import transforms

    ckpt = zstd_ckpt(tmp_path / "z")

    def damaged(raw, limit):
        raise TransformError("frame checksum mismatch")

    monkeypatch.setattr(transforms, "_zstd", damaged)
    errors = verify_checkpoint(ckpt).errors
    assert errors and {f.check for f in errors} == {"stream-transform"}
    assert all("frame checksum mismatch" in f.message for f in errors)
    monkeypatch.setattr(transforms, "_zstd", lambda raw, limit: b"not a zip archive at all")
    errors = verify_checkpoint(ckpt).errors
    assert errors and {f.check for f in errors} == {"zip-structure"}
    assert all("decodes (['stream.zstd/1']) to something that is not an intact torch.save archive" in f.message
               for f in errors)


def test_dcps_own_zstd_streams_decode_by_the_one_bounded_decoder() -> None:
    """DCP's ZStandard extension writes frames that declare no size (a streaming writer, flushed mid-stream); they
    decode exactly, and are bounded by their blocks before anything is inflated."""
    import io

    pytest.importorskip("zstandard")
    from torch.distributed.checkpoint._extension import ZStandard

    from ckptverify.dcp.transforms import decode
    from ckptverify.errors import TransformError

    class Kept(io.BytesIO):
        def close(self) -> None:  # the writer closes its output; its bytes are read after
            pass

    data = bytes(range(256)) * 5000 + b"\0" * (3 << 20)
    out = Kept()
    stream = ZStandard().transform_to(out)
    stream.write(data[:700_000])
    stream.flush()
    stream.write(data[700_000:])
    stream.close()
    raw = out.getvalue()
    assert decode(raw, ["stream.zstd/1"]) == data
    assert decode(raw + raw, ["stream.zstd/1"]) == data + data
    with pytest.raises(TransformError, match="more than"):
        decode(raw, ["stream.zstd/1"], limit=len(data) // 2)
    with pytest.raises(TransformError, match="corrupt"):
        decode(raw[:-3], ["stream.zstd/1"])
    # RLE blocks of 128 KiB from 4 bytes each, in a frame declaring no size: refused by its blocks' bound
    block = 128 << 10
    bomb = b"\x28\xb5\x2f\xfd\x00\x58" + b"".join(
        ((block << 3) | 2 | (i == 8191)).to_bytes(3, "little") + b"\0" for i in range(8192))
    with pytest.raises(TransformError, match="more than"):
        decode(bomb, ["stream.zstd/1"], limit=1 << 20)


class _Codec:
    """A registered stream transform that decodes to ``data``, or raises ``error``."""

    def __init__(self, data: bytes = b"", error: Exception | None = None) -> None:
        self.data, self.error = data, error

    def from_descriptor_list(self, descriptors: list[str]) -> list[_Codec]:
        return [self]

    def transform_from(self, stream: object) -> object:
        import contextlib
        import io

        if self.error is not None:
            raise self.error
        return contextlib.nullcontext(io.BytesIO(self.data))


def test_a_registered_transform_decodes_within_its_bound_and_its_failure_is_named() -> None:
    from ckptverify.dcp.transforms import decode

    assert decode(b"raw", ["my.codec/1"], registry=_Codec(b"decoded")) == b"decoded"
    with pytest.raises(TransformError, match="more than 4 bytes"):
        decode(b"raw", ["my.codec/1"], registry=_Codec(b"decoded"), limit=4)
    with pytest.raises(TransformError, match=r"'my\.codec/1' stream does not decode: ValueError: damaged"):
        decode(b"raw", ["my.codec/1"], registry=_Codec(error=ValueError("damaged")))
    with pytest.raises(TransformError, match=r"no decoder for the stream transform 'my\.codec/1'"):
        decode(b"raw", ["my.codec/1"])


def test_a_zstd_bomb_is_refused_within_its_bound() -> None:
    zstandard = pytest.importorskip("zstandard")
    from ckptverify.dcp.transforms import decode
    from ckptverify.errors import TransformError

    raw = zstandard.ZstdCompressor().compress(b"\0" * (8 << 20))
    assert len(decode(raw, ["stream.zstd/1"])) == 8 << 20
    with pytest.raises(TransformError, match="more than"):
        decode(raw, ["stream.zstd/1"], limit=1 << 20)
    with pytest.raises(TransformError) as exc:
        decode(raw, ["stream.rot13/1"])
    assert exc.value.unavailable


def test_a_registered_transform_is_decoded_through_the_callers_registry(tmp_path: Path) -> None:
    import io

    from torch.distributed.checkpoint._extension import ExtensionRegistry, StreamTransformExtension

    from ckptverify.audit.verify import VerificationRun

    class Invert(StreamTransformExtension):
        """Every byte inverted: a stand-in for any registered stream transform."""

        @staticmethod
        def registry_name() -> str:
            return "test.invert"

        @staticmethod
        def from_descriptor(version: str) -> Invert:
            return Invert()

        def get_descriptor(self) -> str:
            return "test.invert/1"

        def transform_to(self, output):
            class W(io.RawIOBase):
                def writable(self) -> bool:
                    return True

                def write(self, b) -> int:
                    output.write(bytes(x ^ 0xFF for x in bytes(b)))
                    return len(b)

            return W()

        def transform_from(self, input):
            return io.BytesIO(bytes(x ^ 0xFF for x in input.read()))

    ckpt = _dcp(tmp_path / "inv", _extensions=[Invert()])
    registry = ExtensionRegistry()
    registry.register(Invert)
    run = VerificationRun(str(ckpt), 1, None, extension_registry=registry)
    try:
        run.execute(deep=True, use_manifest=False)
    finally:
        run.close()
    report = run.report("verify", 1.0)
    assert report.passed and not report.warnings, [f.message for f in report.findings]
    assert {c.check: c.count for c in report.coverage}["fingerprint"] == 21


def test_dcp_safetensors_manifest_digests_each_tensors_own_bytes(tmp_path: Path) -> None:
    from ckptverify.audit.adopt import fingerprint_checkpoint
    from ckptverify.audit.verify import verify_checkpoint

    ckpt = safetensors_ckpt(tmp_path / "st")
    report, manifest = fingerprint_checkpoint(ckpt, trust_uncheckable=True, block_bytes=4096)
    assert manifest is not None, [f.message for f in report.findings]
    tensors = [i for i in manifest.items if i.chunk_offsets is not None]
    assert len({i.offset for i in tensors}) == len(tensors) == 21  # no longer all at the blob's start
    assert all(m.fingerprint for m in manifest.tensors.values())
    target = next(i for i in tensors if i.fqn == "model.2.weight")
    _flip(ckpt / target.file, target.offset + 5000)
    errors = verify_checkpoint(ckpt).errors
    blamed = {f.location.fqn for f in errors if f.check == "manifest-digest" and f.location.fqn}
    assert blamed == {"model.2.weight"}, [f.message for f in errors]
    block = next(f for f in errors if f.location.fqn == "model.2.weight")
    assert block.location.byte_range == (target.offset + 4096, target.offset + 8192)


def test_the_hashing_writer_digests_safetensors_tensors_where_they_are(tmp_path: Path) -> None:
    import warnings

    import torch.distributed.checkpoint as dcp
    from helpers.ckpt_factory import single_process_state_dict
    from torch.distributed.checkpoint.filesystem import SerializationFormat

    from ckptverify.audit.verify import verify_checkpoint
    from ckptverify.dcp.writer import HashingFileSystemWriter

    writer = HashingFileSystemWriter(tmp_path / "st", serialization_format=SerializationFormat.SAFETENSORS)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(single_process_state_dict(), storage_writer=writer)
    tensors = [i for i in writer.manifest.items if i.chunk_offsets is not None]
    assert len({i.offset for i in tensors}) == 21
    report = verify_checkpoint(tmp_path / "st", deep=True)
    assert report.passed and not report.warnings, [f.message for f in report.findings]
    assert {c.check: c.count for c in report.coverage}["fingerprint"] == 21
    target = next(i for i in tensors if i.fqn == "extra.i64")
    _flip(tmp_path / "st" / target.file, target.offset + 3)
    assert {f.location.fqn for f in verify_checkpoint(tmp_path / "st").errors if f.location.fqn} == {"extra.i64"}


def test_dcp_safetensors_deep_rebuilds_every_tensor(tmp_path: Path) -> None:
    from ckptverify.audit.verify import verify_checkpoint

    report = verify_checkpoint(safetensors_ckpt(tmp_path / "st"), deep=True)
    assert report.passed and {c.check: c.count for c in report.coverage}["fingerprint"] == 21
    assert {f.check for f in report.warnings} == {"content-uncheckable"}  # no checksum: said, not hidden


@pytest.mark.parametrize(("old", "new", "got"), [
    (b'"model.2.weight":{"dtype":"F32"', b'"model.2.weight":{"dtype":"I32"', "int32[32, 384]"),
    (b'"shape":[32,384],"data_offsets":[199072', b'"shape":[384,32],"data_offsets":[199072', "float32[384, 32]"),
    (b'"model.2.weight":{', b'"model.2.weighT":{', "nothing"),
], ids=["dtype", "shape", "name"])
def test_a_dcp_safetensors_blob_entry_that_disagrees_with_the_metadata_is_blamed_on_its_tensor(
        tmp_path: Path, old: bytes, new: bytes, got: str) -> None:
    from ckptverify.audit.verify import verify_checkpoint

    ckpt = safetensors_ckpt(tmp_path / "st")
    shard = ckpt / "__0_0.distcp"
    raw = shard.read_bytes()
    assert raw.count(old) == 1
    shard.write_bytes(raw.replace(old, new))  # the same length: the blob stays well formed
    errors = verify_checkpoint(ckpt).errors
    assert [(f.check, f.location.fqn) for f in errors] == [("tensor-record", "model.2.weight")]
    assert errors[0].message.endswith(f": the safetensors blob holds {got} under this name, the metadata says "
                                      "float32[32, 384]")


def test_a_dcp_safetensors_blob_entry_whose_byte_range_disagrees_with_its_shape_is_a_blob_error(
        tmp_path: Path) -> None:
    from ckptverify.audit.verify import verify_checkpoint

    ckpt = safetensors_ckpt(tmp_path / "st")
    shard = ckpt / "__0_0.distcp"
    raw = shard.read_bytes()
    old = b'"model.2.weight":{"dtype":"F32","shape":[32,384]'
    assert raw.count(old) == 1
    shard.write_bytes(raw.replace(old, old.replace(b"[32,384]", b"[32,383]")))  # 4 bytes short of its range
    errors = verify_checkpoint(ckpt).errors
    assert [f.check for f in errors] == ["blob-structure"]
    assert errors[0].location.file == "__0_0.distcp"
    assert "the safetensors blob is malformed: safetensors entry 'model.2.weight': 49152 bytes for " \
           "float32[32, 383]" in errors[0].message


# ---- framework side files beside DCP shards ----------------------------------------------------------------


def test_known_side_files_are_checked_by_content_and_covered_by_the_manifest(tmp_path: Path) -> None:
    from ckptverify.audit.adopt import fingerprint_checkpoint
    from ckptverify.audit.verify import verify_checkpoint

    ckpt = _dcp(tmp_path / "ckpt")
    torch.save({"global_step": 4, "loops": {"fit_loop": {"epoch": 0}}}, ckpt / "meta.pt")
    (ckpt / "metadata.json").write_text(json.dumps({"sharded_backend": "torch_dist"}))
    report = verify_checkpoint(ckpt)
    assert report.passed and not report.warnings, [f.message for f in report.findings]
    assert {c.check: c.count for c in report.coverage}["side-file"] == 2
    (ckpt / "leftover.bin").write_bytes(b"x")
    assert [f.location.file for f in verify_checkpoint(ckpt).warnings] == ["leftover.bin"]
    os.remove(ckpt / "leftover.bin")
    _, manifest = fingerprint_checkpoint(ckpt)
    assert manifest is not None and {"meta.pt", "metadata.json"} <= set(manifest.files)
    (ckpt / "metadata.json").write_text(json.dumps({"sharded_backend": "torch_diS"}))
    assert [f.location.file for f in verify_checkpoint(ckpt).errors] == ["metadata.json"]


def test_a_side_file_is_judged_by_its_content_not_its_name(tmp_path: Path) -> None:
    from ckptverify.audit.verify import verify_checkpoint

    ckpt = _dcp(tmp_path / "ckpt")
    (ckpt / "meta.pt").write_bytes(b"not a torch.save archive")
    assert {f.location.file for f in verify_checkpoint(ckpt).errors} == {"meta.pt"}
    os.remove(ckpt / "meta.pt")
    os.mkfifo(ckpt / "meta.pt")
    assert [f.check for f in verify_checkpoint(ckpt).errors] == ["file-type"]


# ---- folders of files: fingerprint, verify against the manifest, --deep -----------------------------------


def test_a_folder_of_files_is_fingerprinted_and_a_changed_byte_is_blamed_on_its_tensor(tmp_path: Path) -> None:
    from ckptverify.audit.adopt import fingerprint_checkpoint
    from ckptverify.audit.verify import verify_checkpoint

    root = _hf_folder(tmp_path / "hf")
    refused, manifest = fingerprint_checkpoint(root)
    assert manifest is None and "fingerprint-refused" in {f.check for f in refused.errors}  # safetensors: no CRC
    _, manifest = fingerprint_checkpoint(root, trust_uncheckable=True)
    assert manifest is not None and set(manifest.files) == {"model-00001-of-00002.safetensors",
                                                            "model-00002-of-00002.safetensors", "config.json",
                                                            "model.safetensors.index.json", "scheduler.bin"}
    assert all(t.fingerprint for t in manifest.tensors.values()) and len(manifest.tensors) == 3
    clean = verify_checkpoint(root, deep=True)
    assert clean.passed and not clean.warnings, [f.message for f in clean.findings]
    assert {c.check: c.count for c in clean.coverage}["fingerprint"] == 3
    tensor = flip_safetensors(root / "model-00002-of-00002.safetensors")
    errors = verify_checkpoint(root).errors
    assert {f.location.fqn for f in errors if f.location.fqn} == {tensor}
    deep = verify_checkpoint(root, deep=True)
    assert any(f.check == "fingerprint" and f.location.fqn == tensor for f in deep.errors)
    (root / "extra.txt").write_text("planted")
    assert "manifest-unlisted" in {f.check for f in verify_checkpoint(root).warnings}
    with open(root / "config.json", "a") as f:
        f.write(" ")
    said = [f.message for f in verify_checkpoint(root).errors if f.check == "manifest-digest"]
    assert any(m.startswith("config.json is ") and "bytes when fingerprinted" in m for m in said), said
    (root / "config.json").unlink()
    said = [f.message for f in verify_checkpoint(root).errors if f.check == "manifest-digest"]
    assert "config.json was fingerprinted but is gone" in said, said


def flip_safetensors(path: Path) -> str:
    raw = path.read_bytes()
    (n,) = struct.unpack_from("<Q", raw)
    header = json.loads(raw[8:8 + n])
    name, entry = max(((k, v) for k, v in header.items() if k != "__metadata__"),
                      key=lambda kv: kv[1]["data_offsets"][1] - kv[1]["data_offsets"][0])
    _flip(path, 8 + n + entry["data_offsets"][0] + 1)
    return name


def test_a_folder_verified_with_manifests_and_deep_has_each_file_read_once(tmp_path: Path, monkeypatch) -> None:
    """Each file's check read describes it for the folder's manifest, a file's own manifest and the deep check: two
    torch.save pickles unpickled twice in all, one safetensors header read once; the findings name the changed
    tensor as before."""
    from safetensors.torch import save_file

    from ckptverify.audit.adopt import fingerprint_checkpoint
    from ckptverify.audit.verify import verify_checkpoint
    from ckptverify.dcp import safetensors
    from ckptverify.safeparse import torchsave

    root = tmp_path / "checkpoint-10"
    root.mkdir()
    torch.manual_seed(0)
    save_file({"w": torch.randn(32, 32), "b": torch.zeros(32)}, str(root / "model.safetensors"))
    torch.save({"state": {0: {"exp_avg": torch.randn(32, 32)}}, "param_groups": [{"lr": 1e-3}]}, root / "optimizer.pt")
    torch.save({"python": [1, 2], "torch": torch.get_rng_state()}, root / "rng_state_0.pth")
    assert fingerprint_checkpoint(root, trust_uncheckable=True)[0].exit_code == 0
    assert fingerprint_checkpoint(root / "optimizer.pt")[0].exit_code == 0
    tensor = flip_safetensors(root / "model.safetensors")
    reads: list[object] = []
    load, read_blob = torchsave._Reader.load, safetensors.read_blob
    monkeypatch.setattr(torchsave._Reader, "load", lambda self: reads.append(self) or load(self))
    monkeypatch.setattr(safetensors, "read_blob", lambda *a, **k: reads.append(a) or read_blob(*a, **k))
    report = verify_checkpoint(root, deep=True)
    assert len(reads) == 3 and report.stats["manifest"]
    assert {f.location.fqn for f in report.errors if f.check == "fingerprint"} == {tensor}
    assert {f.location.file for f in report.errors} == {"model.safetensors"}


def test_a_single_file_deep_check_rebuilds_its_tensors(pt_file: Path) -> None:
    from ckptverify.audit.verify import verify_checkpoint

    report = verify_checkpoint(pt_file, deep=True)
    assert report.passed, [f.message for f in report.findings]
    from ckptverify.formats.describe import describe

    assert {c.check: c.count for c in report.coverage}["fingerprint"] == len(describe(pt_file).tensors) > 10


def test_plain_values_of_a_pickle_are_listed_exactly() -> None:
    from ckptverify.safeparse.torchsave import leaf_values

    scan = scan_pickle(pickle.dumps({"a": [1, 2.5, -0.0], "b": {"c": None, "d": b"\x00" * 1000}, "e": "x"}))
    values = leaf_values(scan.root)
    assert values["a.0"] == "int:1" and values["a.2"] == "float:-0.0" and values["b.c"] == "NoneType:None"
    assert values["b.d"].startswith("bytes[1000]:xxh3-128:") and values["e"] == "str:'x'"


def test_a_single_file_gets_its_manifest_beside_it(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    from ckptverify.audit.adopt import fingerprint_checkpoint
    from ckptverify.audit.verify import verify_checkpoint

    path = tmp_path / "w.safetensors"
    save_file({"a": torch.randn(64, 64), "b": torch.arange(10)}, str(path))
    _, manifest = fingerprint_checkpoint(path, trust_uncheckable=True, block_bytes=4096)
    assert manifest is not None and list(manifest.files) == ["w.safetensors"]
    assert (tmp_path / "w.safetensors.ckptverify.manifest.json").is_file()
    clean = verify_checkpoint(path, deep=True)
    assert clean.passed and not clean.warnings and clean.stats["manifest"], [f.message for f in clean.findings]
    flip_safetensors(path)
    errors = verify_checkpoint(path).errors
    assert {f.location.fqn for f in errors if f.location.fqn} == {"a"}
    # The folder holding it has no manifest of its own: the file's manifest is not taken for a file of it.
    assert "w.safetensors.ckptverify.manifest.json" not in str(verify_checkpoint(tmp_path).findings)


# ---- one conformance suite that every format runs ---------------------------------------------------------


def _make_pt(path: Path) -> Path:
    torch.manual_seed(0)
    torch.save({"w": torch.randn(64, 32), "b": torch.zeros(32), "step": 3}, path)
    return path


def _make_st(path: Path) -> Path:
    from safetensors.torch import save_file

    torch.manual_seed(0)
    save_file({"w": torch.randn(64, 32), "b": torch.zeros(32)}, str(path))
    return path


FORMATS = {
    "dcp": lambda p: _dcp(p), "dcp-zstd": lambda p: zstd_ckpt(p), "dcp-safetensors": lambda p: safetensors_ckpt(p),
    "torch.save": lambda p: _make_pt(p.with_suffix(".pt")),
    "safetensors": lambda p: _make_st(p.with_suffix(".safetensors")),
    "hf-folder": lambda p: _hf_folder(p),
}


def _largest_payload(path: Path) -> tuple[Path, int, int]:
    """(file, offset, length) of the largest tensor's stored bytes, as the format's own reader places it."""
    if path.is_dir() and (path / ".metadata").exists():
        item = max((i for i in _items(path).items if i.kind == "tensor"), key=lambda i: i.length)
        return path / item.file, item.offset, item.length
    from ckptverify.formats.describe import describe

    desc = describe(path)
    p = max((t.payloads[0] for t in desc.tensors.values()), key=lambda p: p.length)
    return Path(desc.root) / p.file, p.offset, p.length


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_every_format_passes_clean_catches_or_declares_a_flip_and_equals_its_copy(tmp_path: Path, fmt: str) -> None:
    from ckptverify.audit.diff import diff_checkpoints
    from ckptverify.audit.verify import verify_checkpoint

    a, b = FORMATS[fmt](tmp_path / "a"), FORMATS[fmt](tmp_path / "b")
    clean = verify_checkpoint(a, deep=True)
    assert clean.passed, [f.message for f in clean.findings]
    assert not [f for f in clean.warnings if f.check != "content-uncheckable"], [f.message for f in clean.warnings]
    assert {c.check: c.count for c in clean.coverage}["fingerprint"] > 0
    same = diff_checkpoints(a, b)
    assert same.passed and sum(c.count for c in same.coverage if c.check == "diff-tensor") > 0
    file, offset, length = _largest_payload(b)
    _flip(file, offset + length // 2)
    report = verify_checkpoint(b)
    named = {f.location.file for f in report.errors} | {f.location.file for f in report.warnings
                                                        if f.check == "content-uncheckable"}
    assert file.name in named, [f.message for f in report.findings]
    assert not diff_checkpoints(a, b).passed


def test_a_file_that_changes_while_it_is_digested_gets_no_manifest(pt_file: Path, monkeypatch) -> None:
    """The adoption of a described file refuses, writing nothing, when the file changes while it is digested."""
    from ckptverify.audit.adopt import file_manifest_path, fingerprint_checkpoint
    from ckptverify.checks import described
    from ckptverify.errors import FileChangedError

    def changing(*args: object) -> None:
        raise FileChangedError("it was rewritten", str(pt_file))

    monkeypatch.setattr(described, "manifest_entries", changing)
    report, manifest = fingerprint_checkpoint(pt_file)
    assert manifest is None and not os.path.exists(file_manifest_path(str(pt_file)))
    refusal = next(f for f in report.findings if f.check == "fingerprint-refused")
    assert refusal.message.startswith("a file changed while it was digested")
    assert any(f.check == "file-changed" and f.location.file == pt_file.name for f in report.findings)


def test_a_single_file_without_crcs_pickle_or_end_says_so(tmp_path: Path, monkeypatch) -> None:
    from safetensors.torch import save_file

    from ckptverify.checks import single

    bare = tmp_path / "bare.pt"
    writer = torch._C.PyTorchFileWriter(str(bare))  # torch's own zip writer, but no data.pkl in it
    writer.write_record("data/0", b"\0" * 8, 8)
    writer.write_end_of_file()
    assert [(f.check, f.message) for f in check_file(str(bare))[0]] == [
        ("zip-structure", "bare.pt has no data.pkl record")]
    full, lost = tmp_path / "full.pt", tmp_path / "lost.pt"
    torch.save({"w": torch.arange(4.0)}, full)
    writer = torch._C.PyTorchFileWriter(str(lost))  # the same pickle, without the record of its one storage
    with zipfile.ZipFile(full) as z:
        for name in z.namelist():
            record = name.split("/", 1)[1]
            if record == "data.pkl":
                writer.write_record(record, z.read(name), len(z.read(name)))
    writer.write_end_of_file()
    assert [(f.check, f.message) for f in check_file(str(lost))[0]] == [
        ("tensor-record", "lost.pt: tensor 'w' has no storage record data/0")]
    blob = tmp_path / "m.safetensors"
    save_file({"w": torch.ones(2)}, str(blob))
    with open(blob, "ab") as f:
        f.write(b"xx")
    assert "m.safetensors holds 2 bytes after its last tensor" in [
        f.message for f in check_file(str(blob))[0] if f.check == "bytes-unreferenced"]
    plain = tmp_path / "plain.pt"
    torch.serialization.set_crc32_options(False)
    try:
        torch.save({"w": torch.arange(4.0)}, plain)
    finally:
        torch.serialization.set_crc32_options(True)
    assert [f.check for f in check_file(str(plain))[0]] == ["content-uncheckable"]
    monkeypatch.setattr(single, "MAX_PICKLE_BYTES", 10)
    assert [f.check for f in check_file(str(plain))[0]] == ["content-uncheckable", "pickle-unread"]


def test_fingerprinting_a_path_that_does_not_exist_is_refused_before_anything_is_written(tmp_path: Path) -> None:
    from ckptverify.audit.adopt import fingerprint_checkpoint
    from ckptverify.errors import CheckpointNotFoundError

    with pytest.raises(CheckpointNotFoundError, match="checkpoint path does not exist"):
        fingerprint_checkpoint(tmp_path / "nowhere")
    assert list(tmp_path.iterdir()) == []


def test_a_folder_description_reads_plain_and_legacy_pickles_and_says_why_a_file_is_unread(tmp_path: Path) -> None:
    from ckptverify.formats.describe import describe

    torch.save({"w": torch.ones(2)}, tmp_path / "legacy.pt", _use_new_zipfile_serialization=False)
    (tmp_path / "plain.pkl").write_bytes(pickle.dumps({"lr": 0.5}, protocol=2))
    (tmp_path / "bad.json").write_bytes(b"{nope")
    with zipfile.ZipFile(tmp_path / "other.pt", "w") as z:  # a zip, but not as torch.save writes one
        z.writestr("a.txt", "hi")
    (tmp_path / "broken.safetensors").write_bytes(struct.pack("<Q", 16) + b"{" + b"x" * 20)
    (tmp_path / "bad.pkl").write_bytes(b"\x80\x02\xff\xff")
    desc = describe(tmp_path)
    assert desc.files == {"legacy.pt": "legacy", "plain.pkl": "pickle"}
    assert desc.values["plain.pkl:lr"] == "float:0.5"
    assert {name: why.split(":")[0] for name, why in desc.unread.items()} == {
        "bad.json": "not valid JSON", "other.pt": "not an intact torch.save archive",
        "broken.safetensors": "not a well-formed safetensors file", "bad.pkl": "not a readable pickle"}


def test_an_unread_file_s_reason_names_its_kind_once(tmp_path: Path) -> None:
    from ckptverify.formats.describe import describe

    (tmp_path / "bad.json").write_bytes(b"{nope")
    (tmp_path / "deep.json").write_bytes(b"[" * 5000 + b"]" * 5000)
    (tmp_path / "bad.pkl").write_bytes(b"\x80\x02\xff\xff")
    unread = describe(tmp_path).unread
    assert unread["bad.json"].startswith("not valid JSON: ") and unread["bad.json"].count("not valid JSON") == 1
    assert unread["deep.json"].startswith("not valid JSON: the JSON nests deeper than")
    assert unread["bad.pkl"].startswith("not a readable pickle: ")
    assert unread["bad.pkl"].count("not a readable pickle") == 1


def test_a_pickle_that_uses_a_global_outside_the_allowlist_as_more_than_a_value_names_the_global(
        tmp_path: Path) -> None:
    import collections

    from ckptverify.formats.describe import describe

    (tmp_path / "h.pkl").write_bytes(pickle.dumps({"h": collections.deque([1, 2])}, protocol=2))
    assert describe(tmp_path).unread == {"h.pkl": "not a readable pickle: AttributeError: collections.deque is "
                                                  "outside the allowlist and not rebuilt, so it has no 'append'"}
