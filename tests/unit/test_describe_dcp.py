"""A DCP checkpoint described by the same contract as every other format (:mod:`ckptverify.formats.dcp`):
every tensor's payloads chunk by chunk (byte ranges, encoding, the checksum that protects them), every item
as stored, the plain values; and ``verify --deep``, ``fingerprint`` and ``diff`` working on that description.

Each fact is checked against what DCP itself loads (``dcp_to_torch_save``), the state that was saved, or the
bytes on disk, never against the description's own arithmetic.
"""

from __future__ import annotations

import ast
import collections
import contextlib
import shutil
import warnings
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from helpers.dcp_encodings import dcp_checkpoint, safetensors_ckpt, zstd_ckpt

from ckptverify.audit.adopt import fingerprint_checkpoint
from ckptverify.audit.diff import diff_checkpoints
from ckptverify.audit.verify import verify_checkpoint
from ckptverify.checks.dcp_pipeline import VerificationRun
from ckptverify.checks.deep import scan_description
from ckptverify.fingerprint import tensor_fingerprint
from ckptverify.formats.describe import Description, read_tensor
from ckptverify.safeparse.zipwalk import parse_archive

ROOT = Path(__file__).resolve().parents[2]


@contextlib.contextmanager
def described(path: Path, *, use_manifest: bool = False, **kw: Any) -> Iterator[tuple[Any, Description]]:
    """The verification report and the description of the DCP checkpoint at ``path`` (readable while open)."""
    run = VerificationRun(str(path), 2, None)
    try:
        run.execute(deep=False, use_manifest=use_manifest)
        yield run.report("verify", 1.0), run.description(**kw)
    finally:
        run.close()


def _flatten(obj: Any, prefix: str = "") -> dict[str, Any]:
    """A nested state dict by DCP's flattened names (``optim.param_groups.0.lr``)."""
    if isinstance(obj, dict):
        out: dict[str, Any] = {}
        for k, v in obj.items():
            out.update(_flatten(v, f"{prefix}{k}."))
        return out
    if isinstance(obj, list | tuple):
        out = {}
        for k, v in enumerate(obj):
            out.update(_flatten(v, f"{prefix}{k}."))
        return out
    return {prefix[:-1]: obj}


def _dcp_loaded(path: Path, tmp: Path) -> dict[str, Any]:
    """What DCP itself loads from ``path`` (through ``dcp_to_torch_save``), by flattened name."""
    import warnings

    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = tmp / f"{path.name}-loaded.pt"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp_to_torch_save(str(path), str(out))
    return _flatten(torch.load(out, weights_only=False))


def _saved_state(seed: int = 0) -> dict[str, Any]:
    from helpers.ckpt_factory import single_process_state_dict

    return _flatten(single_process_state_dict(seed))


def _flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x08
    path.write_bytes(bytes(data))


def _serial(fn: Any, items: list[Any]) -> list[Any]:
    return [fn(x) for x in items]


@pytest.mark.parametrize("layout", ["fsdp2", "nocoll"])
def test_sharded_tensors_are_described_chunk_by_chunk_as_dcp_loads_them(fresh_ckpt: Any, layout: str,
                                                                        tmp_path: Path) -> None:
    path = fresh_ckpt(layout)
    # What DCP loads (``nocoll`` has per-rank metadata only, which DCP's own loader does not read: it holds the
    # same state as ``fsdp2``, saved by the same two processes).
    loaded = _dcp_loaded(fresh_ckpt("fsdp2"), tmp_path)
    with described(path) as (report, desc):
        assert report.passed, [f.message for f in report.findings]
        assert desc.format == "dcp" and desc.files and set(desc.files.values()) == {"dcp"}
        tensors = {n: v for n, v in loaded.items() if isinstance(v, torch.Tensor)}
        # DCP's own loader leaves out one rank's rank-keyed state; everything else it loads is described.
        assert set(tensors) <= set(desc.tensors)
        assert all(n.startswith("rank_state.") for n in set(desc.tensors) - set(tensors))
        chunks = {n: {p.chunk_offsets for p in t.payloads} for n, t in desc.tensors.items()}
        assert len(chunks["model.0.weight"]) == 2  # sharded on two ranks: two chunks
        if layout == "nocoll":  # per-rank metadata: a replicated chunk is stored once per rank
            copies = Counter((n, p.chunk_offsets) for n, t in desc.tensors.items() for p in t.payloads)
            assert max(copies.values()) >= 2
        compared = 0
        for name, t in desc.tensors.items():
            if name not in tensors:
                continue
            assert (t.dtype, t.shape) == (str(tensors[name].dtype).removeprefix("torch."), tuple(tensors[name].shape))
            assert torch.equal(read_tensor(desc, name), tensors[name]), name
            for p in t.payloads:
                assert (p.encoding, p.checksum, p.stored) == ("raw", "crc32", None)
                # The payload's bytes on disk are the chunk's bytes as DCP loads them.
                piece = tensors[name]
                for dim, (o, n) in enumerate(zip(p.chunk_offsets, p.shape, strict=True)):
                    piece = piece.narrow(dim, o, n)
                if p.storage_offset == 0 and p.length == piece.numel() * piece.element_size() and piece.numel():
                    with desc.open(p) as f:
                        raw = f.pread(p.offset, p.length)
                    assert raw == piece.contiguous().view(-1).view(torch.uint8).numpy().tobytes(), name
                    compared += 1
        assert compared >= len(desc.tensors) // 2
        scans, replicas = scan_description(desc, _serial)
        assert not replicas
        for name, t in desc.tensors.items():
            assert scans[name].value(t.shape) is not None, name
            if name in tensors:
                assert scans[name].value(t.shape) == tensor_fingerprint(tensors[name]).value, name
    # The items described as stored are the ones `fingerprint` digests one by one.
    copy = shutil.copytree(path, tmp_path / "adopted")
    _, manifest = fingerprint_checkpoint(copy, trust_uncheckable=True)
    assert manifest is not None
    with described(copy) as (_, desc):
        assert sorted((s.file, s.offset, s.length) for s in desc.stored) == sorted(
            (i.file, i.offset, i.length) for i in manifest.items)
        assert set(desc.metadata_files) == set(manifest.metadata_files) and desc.metadata_files
        for name in desc.tensors:
            assert manifest.tensors[name].fingerprint is not None
            if name in tensors:
                assert manifest.tensors[name].fingerprint == tensor_fingerprint(tensors[name]).value


def test_a_zstd_item_is_described_through_its_decoded_stream(tmp_path: Path) -> None:
    path = zstd_ckpt(tmp_path / "z")
    state = _saved_state()
    with described(path) as (report, desc):
        assert report.passed, [f.message for f in report.findings]
        w = desc.tensors["model.0.weight"]
        (p,) = w.payloads
        assert p.encoding == "stream.zstd/1" and p.checksum == "crc32"
        start, end = p.stored  # type: ignore[misc]
        assert 0 <= start < end <= (path / p.file).stat().st_size
        # The stored bytes are compressed: fewer than the tensor's, and not the tensor's bytes.
        assert end - start < p.length == state["model.0.weight"].numel() * 4
        for name in desc.tensors:
            assert torch.equal(read_tensor(desc, name), state[name]), name
    deep = verify_checkpoint(path, deep=True)
    assert deep.passed and {c.check: c.count for c in deep.coverage}["fingerprint"] == len(desc.tensors)


def test_the_checksum_that_protects_each_payload_is_named(tmp_path: Path) -> None:
    plain = dcp_checkpoint(tmp_path / "p")
    blob = safetensors_ckpt(tmp_path / "s")
    with described(blob) as (_, desc):
        assert {p.checksum for t in desc.tensors.values() for p in t.payloads} == {"none"}
    for path in (plain, blob):
        _, manifest = fingerprint_checkpoint(path, trust_uncheckable=True)
        assert manifest is not None
    with described(plain, use_manifest=True) as (report, desc):
        # Items of up to 1 MiB are CRC-checked from memory as they are parsed; the manifest digests them too.
        assert report.passed
        assert {p.checksum for t in desc.tensors.values() for p in t.payloads} == {"crc32+manifest"}
    big = tmp_path / "big"
    dcp.save({"big": torch.randn(1024, 1024), "small": torch.randn(8)}, checkpoint_id=str(big))
    _, manifest = fingerprint_checkpoint(big)
    assert manifest is not None
    with described(big, use_manifest=True) as (report, desc):
        assert report.passed
        # A large record: the manifest's block digests alone (a CRC on top would only halve the speed).
        assert [p.checksum for p in desc.tensors["big"].payloads] == ["manifest"]
        assert [p.checksum for p in desc.tensors["small"].payloads] == ["crc32+manifest"]
    with described(blob, use_manifest=True) as (_, desc):
        assert {p.checksum for t in desc.tensors.values() for p in t.payloads} == {"manifest"}
        state = _saved_state()
        for name in desc.tensors:
            assert torch.equal(read_tensor(desc, name), state[name]), name


def test_plain_values_of_non_tensor_items(tmp_path: Path) -> None:
    path = dcp_checkpoint(tmp_path / "p")
    state = _saved_state()
    with described(path, values=True) as (_, desc):
        assert desc.values["optim.param_groups.0.lr"] == f"float:{state['optim.param_groups.0.lr']!r}"
        plain = {n for n, v in state.items() if not isinstance(v, torch.Tensor)}
        assert plain and all(any(k == n or k.startswith(f"{n}.") for k in desc.values) for n in plain), plain
        every = dict(desc.values)
    with described(path, values=True, values_skip={"optim.param_groups.0.lr"}) as (_, desc):
        assert desc.values == {k: v for k, v in every.items() if k != "optim.param_groups.0.lr"}
    with described(path) as (_, desc):
        assert desc.values == {}


def _item(path: Path, stored: Any) -> bytes:
    with path.joinpath(stored.file).open("rb") as f:
        f.seek(stored.offset)
        return f.read(stored.length)


def _rename_record(path: Path, stored: Any, old: bytes, new: bytes) -> None:
    """Rename a record of a stored item in place, in its local header and its central directory entry."""
    item = _item(path, stored)
    assert item.count(old) == 2 and len(old) == len(new)
    raw = bytearray(path.joinpath(stored.file).read_bytes())
    raw[stored.offset:stored.offset + stored.length] = item.replace(old, new)
    path.joinpath(stored.file).write_bytes(bytes(raw))


def test_a_plain_value_the_inert_reader_refuses_is_its_pickle_digest(tmp_path: Path) -> None:
    """A value whose pickle the inert reader refuses (a deque: its items are appended to an instance of a class
    it never imports) is described by the digest of its pickle, not by its contents."""
    from ckptverify.errors import BadPickle
    from ckptverify.fingerprint import digest_bytes
    from ckptverify.safeparse.torchsave import scan_pickle

    path = tmp_path / "d"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.save({"w": torch.ones(3), "history": collections.deque([0.5, 0.25], maxlen=8)}, checkpoint_id=str(path))
    with described(path, values=True) as (report, desc):
        assert report.passed, [f.message for f in report.findings]
        item = _item(path, next(s for s in desc.stored if s.name == "history"))
        pkl = parse_archive(lambda o, n: item[o:o + n], len(item)).record("data.pkl")
        assert pkl is not None
        data = item[pkl.data_offset:pkl.data_end]
        with pytest.raises(BadPickle, match="not a readable pickle"):
            scan_pickle(data)
        assert desc.values == {"history": f"pickle:xxh3-128:{digest_bytes(data)}"}


def test_a_plain_value_whose_item_has_no_pickle_is_not_described(tmp_path: Path) -> None:
    """A non-tensor item whose archive holds no ``data.pkl`` (renamed): a ``zip-structure`` error, and no value
    rather than one read from another record."""
    path = tmp_path / "n"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.save({"w": torch.ones(3), "step": 7}, checkpoint_id=str(path))
    with described(path, values=True) as (_, desc):
        assert desc.values == {"step": "int:7"}
        stored = next(s for s in desc.stored if s.name == "step")
    _rename_record(path, stored, b"archive/data.pkl", b"archive/data.pkx")
    with described(path, values=True) as (report, desc):
        assert [(f.check, f.message) for f in report.errors] == [("zip-structure", "'step' has no data.pkl record")]
        assert desc.values == {}


def _mx(seed: int) -> Any:
    pytest.importorskip("torchao", reason="torchao is not installed: pip install 'ckptverify[lowprec]'")
    warnings.filterwarnings("ignore", message=".*register_constant.*")
    from torchao.prototype.mx_formats.mx_tensor import MXTensor

    g = torch.Generator().manual_seed(seed)
    return MXTensor.to_mx(torch.randn(4, 64, generator=g), torch.float8_e4m3fn, 32)


def test_a_subclass_stored_as_a_chunk_of_a_larger_tensor_is_left_unread(tmp_path: Path) -> None:
    """DCP saves a tensor subclass whole; metadata placing two (as two ranks' shards would be) in one larger
    tensor leaves both unread, and ``--deep`` says the tensor was not rebuilt rather than judging its bytes."""
    import pickle

    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex

    path = tmp_path / "s"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.save({"mx": _mx(0), "lower": _mx(1)}, checkpoint_id=str(path))
    meta = pickle.loads(path.joinpath(".metadata").read_bytes())  # written by the test itself just above
    mx = meta.state_dict_metadata["mx"]
    mx.size = torch.Size([8, 64])
    mx.chunks.append(ChunkStorageMetadata(offsets=torch.Size([4, 0]), sizes=torch.Size([4, 64])))
    del meta.state_dict_metadata["lower"]
    meta.storage_data[MetadataIndex("mx", torch.Size([4, 0]), 0)] = meta.storage_data.pop(
        MetadataIndex("lower", torch.Size([0, 0]), 0))
    path.joinpath(".metadata").write_bytes(pickle.dumps(meta))
    with described(path) as (report, desc):
        assert report.passed, [f.message for f in report.findings]
        t = desc.tensors["mx"]
        assert t.subclass is None and not t.payloads
        assert t.unread == [f"mx chunk {at}: a MXTensor stored as a chunk of a larger tensor"
                            for at in ([0, 0], [4, 0])]
    deep = verify_checkpoint(path, deep=True)
    assert [(f.check, f.message) for f in deep.findings if f.check in ("fingerprint", "deep-nothing-rebuilt")] == [
        ("fingerprint", "'mx' cannot be rebuilt from its bytes (mx chunk [0, 0]: a MXTensor stored as a chunk of "
                        "a larger tensor)"),
        ("deep-nothing-rebuilt", "--deep rebuilt none of the 1 tensor(s) from their bytes: nothing was checked end "
                                 "to end")]


def test_a_subclass_part_without_its_storage_record_is_left_unread(tmp_path: Path) -> None:
    """The item's pickle names a storage record for the ``scale`` part that the archive does not hold (renamed):
    a ``tensor-record`` error, and the tensor described as unread, its other part not taken for the whole."""
    path = tmp_path / "s"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.save({"mx": _mx(0), "lower": _mx(1)}, checkpoint_id=str(path))
    with described(path) as (report, desc):
        assert report.passed, [f.message for f in report.findings]
        assert [p.name for p in desc.tensors["mx"].subclass.parts] == ["qdata", "scale"]
        stored = next(s for s in desc.stored if s.name == "mx")
    _rename_record(path, stored, b"archive/data/1", b"archive/data/7")
    with described(path) as (report, desc):
        assert [(f.check, f.message) for f in report.errors] == [
            ("tensor-record", "'mx' chunk [0, 0]: the 'scale' part of its MXTensor has no storage record data/1")]
        t = desc.tensors["mx"]
        assert t.subclass is None and not t.payloads
        assert t.unread == ["mx chunk [0, 0]: no storage record for its 'scale' part"]
        assert desc.tensors["lower"].subclass is not None


def test_a_damaged_payload_and_a_damaged_header(tmp_path: Path) -> None:
    clean = dcp_checkpoint(tmp_path / "clean")
    bad = shutil.copytree(clean, tmp_path / "bad")
    with described(bad) as (_, desc):
        (p,) = desc.tensors["model.0.weight"].payloads
        bias = next(s for s in desc.stored if s.name == "model.2.bias")
    _flip(bad / p.file, p.offset + p.length // 2)
    with bad.joinpath(bias.file).open("rb") as f:
        f.seek(bias.offset)
        item = f.read(bias.length)
    pkl = parse_archive(lambda o, n: item[o:o + n], len(item)).record("data.pkl")
    assert pkl is not None
    _flip(bad / bias.file, bias.offset + pkl.data_offset + pkl.size // 2)

    report = verify_checkpoint(bad, deep=True)
    blamed = {f.location.fqn for f in report.errors}
    assert {"model.0.weight", "model.2.bias"} <= blamed, [f.message for f in report.errors]
    with described(bad) as (_, desc):
        # Still described where it lies (its CRC is what failed); the damaged header leaves its chunk unread.
        (q,) = desc.tensors["model.0.weight"].payloads
        assert (q.offset, q.length, q.checksum) == (p.offset, p.length, "crc32")
        assert desc.tensors["model.2.bias"].unread and not desc.tensors["model.2.bias"].payloads
        scans, _ = scan_description(desc, _serial)
        assert scans["model.2.bias"].value(desc.tensors["model.2.bias"].shape) is None
        assert scans["model.0.weight"].value(desc.tensors["model.0.weight"].shape) != tensor_fingerprint(
            _saved_state()["model.0.weight"]).value
    diff = diff_checkpoints(clean, bad)
    uncompared = {f.location.fqn: f for f in diff.findings if f.check == "diff-uncompared"}
    assert set(uncompared) == {"model.0.weight", "model.2.bias"}
    assert all(f.severity.value == "info" and "damaged in B" in f.message for f in uncompared.values())
    assert diff.stats["tensors_compared"] == len(desc.tensors) - 2
    refused, manifest = fingerprint_checkpoint(bad)
    assert manifest is None and any(f.check == "fingerprint-refused" for f in refused.findings)


def test_diff_of_dcp_and_its_torch_save_goes_through_one_description(tmp_path: Path) -> None:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    path = zstd_ckpt(tmp_path / "z")
    single = tmp_path / "z.pt"
    dcp_to_torch_save(str(path), str(single))
    report = diff_checkpoints(path, single)
    assert report.passed, [f.message for f in report.findings]
    assert report.stats["tensors_compared"] == 21 and report.stats["formats"] == ["dcp", "torch.save"]
    other = zstd_ckpt(tmp_path / "z1", seed=1)
    differs = diff_checkpoints(path, other)
    assert {f.location.fqn for f in differs.findings if f.check == "diff-tensor"} >= {"model.0.weight"}


def _imports(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
    return out


def test_formats_recognise_and_describe_only() -> None:
    """``formats`` never imports the checks (or anything above them); checks import formats."""
    for path in (ROOT / "ckptverify" / "formats").glob("*.py"):
        above = {m for m in _imports(path) if m.startswith(("ckptverify.checks", "ckptverify.audit"))}
        assert not above, (path.name, above)


def test_only_the_dcp_pipeline_reaches_into_a_run() -> None:
    """Every module that uses a ``VerificationRun`` does so through its interface: it reads none of the run's
    own state (``_...``) and sets no attribute of it (its options are constructor arguments)."""
    users = [p for p in (ROOT / "ckptverify").rglob("*.py")
             if p.name != "dcp_pipeline.py" and "VerificationRun" in p.read_text()]
    assert {p.name for p in users} >= {"adopt.py", "diff.py", "verify.py", "session.py"}
    for path in users:
        reached = [(n.attr, n.lineno) for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.Attribute)
                   and (getattr(n.value, "id", None) == "run" or getattr(n.value, "attr", None) == "run")
                   and (n.attr.startswith("_") or isinstance(n.ctx, ast.Store))]
        assert not reached, (path.name, reached)


def test_audit_uses_a_run_through_its_interface_alone() -> None:
    """``audit/`` calls only what ``VerificationRun``'s docstring names as its interface: never the workers, progress
    or opened files it lends to executors (``map``, ``advance``, ``file``)."""
    interface = {"execute", "report", "description", "manifest", "opened_files", "changed_files", "scan", "digests",
                 "close"}
    for path in (ROOT / "ckptverify" / "audit").glob("*.py"):
        used = {n.attr for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.Attribute)
                and (getattr(n.value, "id", None) == "run" or getattr(n.value, "attr", None) == "run")}
        assert used <= interface, (path.name, used - interface)
