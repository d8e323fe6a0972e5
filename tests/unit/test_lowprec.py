"""Low-precision tensor subclasses (torchao's MXTensor and NVFP4Tensor) in fingerprints, traces and checkpoints:
covered by their parts (data and scales) and attributes, read back from disk without importing torchao, and
told apart part by part and by decoded values in ``diff`` (docs/fingerprint.md, docs/diff.md, docs/trace.md)."""

from __future__ import annotations

import io
import json
import os
import pickle
import struct
import subprocess
import sys
import warnings
import zipfile
import zlib
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from helpers.preloaded_children import PreloadedServer

pytest.importorskip("torchao", reason="torchao is not installed: pip install 'ckptverify[lowprec]' (CI installs it)")
warnings.filterwarnings("ignore", message=".*register_constant.*")

from torchao.prototype.mx_formats.mx_tensor import MXTensor  # noqa: E402
from torchao.prototype.mx_formats.nvfp4_tensor import NVFP4Tensor  # noqa: E402

import ckptverify as cv  # noqa: E402
from ckptverify.audit.diff import diff_checkpoints  # noqa: E402
from ckptverify.audit.verify import verify_checkpoint  # noqa: E402
from ckptverify.errors import UsageError  # noqa: E402
from ckptverify.fingerprint import chunk_fingerprint, part_fingerprints, tensor_fingerprint  # noqa: E402
from ckptverify.safeparse.torchsave import SubclassHeader, item_header  # noqa: E402
from ckptverify.trace.category import HostViews, tensor_digests  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
SCRIPT = Path(__file__).resolve().parents[1] / "user_scripts" / "lowprec_adapter_train.py"


def _mx(seed: int = 0, rows: int = 4, cols: int = 64) -> MXTensor:
    g = torch.Generator().manual_seed(seed)
    return MXTensor.to_mx(torch.randn(rows, cols, generator=g), torch.float8_e4m3fn, 32)


def _remake(m: MXTensor, *, qdata: torch.Tensor | None = None, scale: torch.Tensor | None = None,
            **attrs: object) -> MXTensor:
    """``m`` with some parts or attributes replaced (everything else copied)."""
    fields = {"elem_dtype": m.elem_dtype, "block_size": m.block_size, "orig_dtype": m.orig_dtype,
              "kernel_preference": m.kernel_preference, "act_quant_kwargs": m.act_quant_kwargs,
              "is_swizzled_scales": m.is_swizzled_scales} | attrs
    return MXTensor(m.qdata.clone() if qdata is None else qdata, m.scale.clone() if scale is None else scale,
                    *fields.values())


def _bumped_scale(m: MXTensor, row: int = 1, block: int = 0) -> torch.Tensor:
    scale = m.scale.clone()
    scale.view(torch.uint8)[row, block] += 1
    return scale


def _nvfp4(per_tensor: float | None = 0.5) -> NVFP4Tensor:
    g = torch.Generator().manual_seed(3)
    pts = None if per_tensor is None else torch.tensor(per_tensor)
    return NVFP4Tensor.to_nvfp4(torch.randn(4, 64, generator=g), per_tensor_scale=pts)


def _findings(report) -> list[tuple[str, str, str]]:
    return [(f.severity.value, f.check, f.message) for f in report.findings]


# ------------------------------------------------------------------------------------------- fingerprint


def test_fingerprint_covers_data_scales_and_attributes() -> None:
    m = _mx()
    same = _remake(m)
    scaled = _remake(m, scale=_bumped_scale(m))
    qdata = m.qdata.clone()
    qdata.view(torch.uint8)[0, 5] ^= 1
    recoded = _remake(m, qdata=qdata)
    other_kernel = _remake(m, kernel_preference=type(m.kernel_preference)("torch"))

    fp = tensor_fingerprint(m)
    assert tensor_fingerprint(same) == fp
    assert (fp.dtype, fp.shape, fp.elements) == ("float32", (4, 64), 256)
    # Equal data and different scales differ; so do equal scales and different data, and a different attribute.
    assert len({fp.value, tensor_fingerprint(scaled).value, tensor_fingerprint(recoded).value,
                tensor_fingerprint(other_kernel).value}) == 4
    parts, parts_scaled = part_fingerprints(m), part_fingerprints(scaled)
    assert list(parts) == ["qdata", "scale"]
    assert parts["qdata"] == parts_scaled["qdata"] and parts["scale"] != parts_scaled["scale"]
    assert part_fingerprints(other_kernel) == parts  # the attribute, not a part, tells those two apart
    # A subclass's parts cannot be addressed by a chunk of the outer tensor; the whole tensor can.
    assert chunk_fingerprint(m, [0, 0], [4, 64]) == fp
    with pytest.raises(UsageError, match="chunk of a MXTensor"):
        chunk_fingerprint(m, [0, 0], [8, 64])
    with pytest.raises(UsageError, match="not a tensor subclass"):
        part_fingerprints(torch.zeros(3))


def test_nvfp4_per_tensor_scale_is_a_part() -> None:
    n = _nvfp4(0.5)
    other = NVFP4Tensor(n.qdata.clone(), n.scale.clone(), n.block_size, n.orig_dtype, torch.tensor(0.25))
    assert list(part_fingerprints(n)) == ["qdata", "scale", "per_tensor_scale"]
    parts, other_parts = part_fingerprints(n), part_fingerprints(other)
    assert parts["qdata"] == other_parts["qdata"] and parts["scale"] == other_parts["scale"]
    assert parts["per_tensor_scale"] != other_parts["per_tensor_scale"]
    assert tensor_fingerprint(n) != tensor_fingerprint(other)
    assert list(part_fingerprints(_nvfp4(None))) == ["qdata", "scale"]


# ------------------------------------------------------------------------------------------- traces


def test_trace_member_digests_cover_data_and_scales() -> None:
    m = _mx()
    scaled = _remake(m, scale=_bumped_scale(m))
    a, b, c = tensor_digests([m, _remake(m), scaled])
    assert a == b and a != c
    # The digest is not that of the data alone or of the scale alone.
    assert a not in tensor_digests([m.qdata, m.scale])
    # Held host views (parameters, optimizer state) digest a subclass by its parts at each call, and see its
    # parts replaced.
    views = HostViews([torch.ones(3), m])
    first = views.digests()
    assert first is not None and first[1] == a
    assert views.digests() == first
    m.scale.view(torch.uint8)[0, 0] += 1  # in place: same storage, new value
    again = views.digests()
    assert again is not None and again[1] != a and again[0] == first[0]
    m.qdata = m.qdata.clone()  # a new storage for a part: the views are stale
    assert views.digests() is None


def test_an_async_collective_result_is_not_taken_apart() -> None:
    """Its inner buffer may still be in flight: it is digested as a tensor (any op on it waits first)."""
    from torch.distributed._functional_collectives import AsyncCollectiveTensor

    from ckptverify.fingerprint.subclass import is_wrapper_subclass

    pending = AsyncCollectiveTensor(torch.arange(4.0))
    assert not is_wrapper_subclass(pending) and is_wrapper_subclass(_mx())
    assert tensor_fingerprint(pending) == tensor_fingerprint(torch.arange(4.0))


def test_trace_device_path_digests_parts_by_fingerprint(children: PreloadedServer) -> None:
    """With host tensors taking the accelerator path (fingerprints batched and read back once per step), a
    subclass is digested by its parts' logical fingerprints, now; a scale change still shows."""
    code = """
import warnings, torch
warnings.filterwarnings("ignore")
from torchao.prototype.mx_formats.mx_tensor import MXTensor
from ckptverify.trace.cells import _tensor_item
from ckptverify.trace.store import Cell
m = MXTensor.to_mx(torch.randn(4, 64), torch.float8_e4m3fn, 32)
s = m.scale.clone(); s.view(torch.uint8)[0, 0] += 1
n = MXTensor(m.qdata, s, m.elem_dtype, m.block_size, m.orig_dtype, m.kernel_preference, None, False)
cells = [_tensor_item("x", "value", t) for t in (m, m, n)]
assert all(isinstance(c, Cell) for c in cells), cells
assert cells[0].encoding == "fp128" and cells[0].lanes == cells[1].lanes != cells[2].lanes
print("ok")
"""
    # The variable is read when ckptverify.trace is imported: the child imports it, the server did not.
    out = children.run(code, env={"CKPTVERIFY_TRACE_HOST_AS_DEVICE": "1"}, timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


#: What the scripts below import first (torch, torchao's formats); not ckptverify, whose trace modules read the
#: environment when imported.
_PRELOAD = ("numpy", "torch", "torch.utils.data", "torchao.prototype.mx_formats.mx_tensor",
            "torchao.prototype.mx_formats.nvfp4_tensor")


@pytest.fixture(scope="module")
def children() -> Iterator[PreloadedServer]:
    """The scripts' processes: children forked from a server that imported :data:`_PRELOAD` once, not a fresh
    interpreter each (torch and torchao cost some 4 s of CPU to import). A test that needs a process without
    torchao (``test_hostile_files_naming_torchao_functions_import_nothing``) starts a fresh one."""
    with PreloadedServer(_PRELOAD) as server:
        yield server


@pytest.fixture(scope="module")
def adapter_runs(tmp_path_factory: pytest.TempPathFactory, children: PreloadedServer) -> dict[str, Path]:
    """The adapter script four times: twice clean, once re-quantizing the frozen base after step 3, once
    doubling the learning rate at step 3."""
    root = tmp_path_factory.mktemp("adapter")
    plan = {"clean": (), "clean2": (), "rescaled": ("--rescale-at", "3"), "lr": ("--lr-bump-at", "3")}
    runs = {name: root / name for name in plan}
    for name, args in plan.items():
        done = children.script(SCRIPT, str(runs[name]), *args, cwd=SCRIPT.parent, timeout=600)
        assert done.returncode == 0, f"{name}: {done.stderr[-3000:]}"
    return runs


def test_trace_names_the_requantized_weight_and_not_the_lr(adapter_runs: dict[str, Path]) -> None:
    from ckptverify.trace import compare_runs, first_divergence

    clean = adapter_runs["clean"] / "trace"
    assert first_divergence(clean, adapter_runs["clean2"] / "trace") is None
    assert [f for f in compare_runs(clean, adapter_runs["clean2"] / "trace") if f.severity.value == "error"] == []
    # Re-quantized with scales one power of two up and data halved: decoded values barely move, the parts do.
    d = first_divergence(clean, adapter_runs["rescaled"] / "trace")
    assert d is not None and (d.step, d.site, d.category) == (3, "param.base.weight", "parameters")
    # The other cause planted at the same step is told apart: the learning rate, not the quantized weight.
    lr = first_divergence(clean, adapter_runs["lr"] / "trace")
    assert lr is not None and lr.step == 3 and lr.site == "hparam.0.lr" and lr.category == "hyperparameters"


# ------------------------------------------------------------------------------------------- checkpoints


def test_user_checkpoint_round_trip_passes_deep_verification(adapter_runs: dict[str, Path]) -> None:
    ckpt = adapter_runs["clean"] / "ckpt"
    manifest = json.loads((ckpt / "ckptverify.manifest.json").read_text())
    assert manifest["tensors"]["model.base.weight"]["fingerprint"] is not None
    report = verify_checkpoint(ckpt, deep=True)
    assert report.exit_code == 0, _findings(report)
    counted = {c.check: c.count for c in report.coverage}
    assert counted["fingerprint"] == len(manifest["tensors"])
    # The re-quantized run's weight has other parts: the manifests tell them apart.
    other = json.loads((adapter_runs["rescaled"] / "ckpt" / "ckptverify.manifest.json").read_text())
    weight = "model.base.weight"
    assert other["tensors"][weight]["fingerprint"] != manifest["tensors"][weight]["fingerprint"]


def test_train_state_with_a_quantized_weight_loads_back_with_its_scales(tmp_path: Path) -> None:
    """``ckptverify.save`` of a TrainState whose model holds a frozen MX weight, then ``ckptverify.load`` (deep)
    into a fresh model quantized from other values: data and scales come back bitwise, the restore check
    (fingerprints of the restored state against the saved ones) passes."""
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        import lowprec_adapter_train as script
    finally:
        sys.path.remove(str(SCRIPT.parent))

    def make(seed: int):
        torch.manual_seed(seed)
        model = script.AdapterNet()
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
        return model, cv.TrainState(model=model, optimizer=optimizer)

    saved_model, saved = make(0)
    cv.save(saved, tmp_path / "ck")
    model, state = make(1)
    assert not torch.equal(model.base.weight.scale.view(torch.uint8), saved_model.base.weight.scale.view(torch.uint8))
    report = cv.load(state, tmp_path / "ck", verify=cv.VerifyOptions(deep=True))
    assert report.exit_code == 0, _findings(report)
    for part in ("qdata", "scale"):
        assert torch.equal(getattr(model.base.weight, part).view(torch.uint8),
                           getattr(saved_model.base.weight, part).view(torch.uint8)), part
    assert tensor_fingerprint(model.base.weight) == tensor_fingerprint(saved_model.base.weight)


def test_save_manifest_holds_the_subclass_fingerprints(tmp_path: Path) -> None:
    m, n = _mx(), _nvfp4()
    scaled = _remake(m, scale=_bumped_scale(m))
    cv.save({"mx": m, "nv": n, "plain": torch.arange(6.0)}, tmp_path / "a")
    cv.save({"mx": scaled, "nv": n, "plain": torch.arange(6.0)}, tmp_path / "b")
    ta = json.loads((tmp_path / "a" / "ckptverify.manifest.json").read_text())["tensors"]
    tb = json.loads((tmp_path / "b" / "ckptverify.manifest.json").read_text())["tensors"]
    assert ta["mx"]["fingerprint"] == tensor_fingerprint(m).value
    assert ta["nv"]["fingerprint"] == tensor_fingerprint(n).value
    assert (ta["mx"]["dtype"], ta["mx"]["shape"]) == ("float32", [4, 64])
    assert tb["mx"]["fingerprint"] == tensor_fingerprint(scaled).value != ta["mx"]["fingerprint"]
    assert tb["nv"] == ta["nv"]
    # The parts' fingerprints too: equal data, different scales.
    assert ta["mx"]["parts"] == {n: f.value for n, f in part_fingerprints(m).items()}
    assert ta["mx"]["parts"]["qdata"] == tb["mx"]["parts"]["qdata"]
    assert ta["mx"]["parts"]["scale"] != tb["mx"]["parts"]["scale"]
    assert list(ta["nv"]["parts"]) == ["qdata", "scale", "per_tensor_scale"]
    assert "parts" not in ta["plain"]
    for name in ("a", "b"):
        report = verify_checkpoint(tmp_path / name, deep=True)
        assert report.exit_code == 0, _findings(report)


def test_activation_settings_stored_with_a_weight_are_read_and_fingerprinted(tmp_path: Path) -> None:
    """Weights quantized for MX/NVFP4 inference carry their activation settings (a dataclass holding enums):
    the allowlist reads them into the same canonical attributes the live fingerprint uses, so a save verifies
    deep; a different setting is a different fingerprint."""
    from torchao.prototype.mx_formats.config import ScaleCalculationMode
    from torchao.prototype.mx_formats.mx_tensor import QuantizeTensorToMXKwargs
    from torchao.prototype.mx_formats.nvfp4_tensor import QuantizeTensorToNVFP4Kwargs

    m = _mx()
    with_act = _remake(m, act_quant_kwargs=QuantizeTensorToMXKwargs())
    rceil = _remake(m, act_quant_kwargs=QuantizeTensorToMXKwargs(scaling_mode=ScaleCalculationMode.RCEIL))
    n = _nvfp4()
    n_act = NVFP4Tensor(n.qdata, n.scale, n.block_size, n.orig_dtype, n.per_tensor_scale,
                        act_quant_kwargs=QuantizeTensorToNVFP4Kwargs())
    assert len({tensor_fingerprint(t).value for t in (m, with_act, rceil)}) == 3
    cv.save({"mx": with_act, "mx_rceil": rceil, "nv": n_act}, tmp_path / "ck")
    report = verify_checkpoint(tmp_path / "ck", deep=True)
    assert report.exit_code == 0, _findings(report)
    assert {c.check: c.count for c in report.coverage}["fingerprint"] == 3
    tensors = json.loads((tmp_path / "ck" / "ckptverify.manifest.json").read_text())["tensors"]
    assert tensors["mx"]["fingerprint"] == tensor_fingerprint(with_act).value


def test_plain_dcp_save_is_read_part_by_part(tmp_path: Path) -> None:
    """Saved by DCP itself (no manifest): no tensor-record error, every tensor rebuilt and fingerprinted, and
    ``ckptverify fingerprint`` adopts it with the same fingerprints a live save records."""
    import torch.distributed.checkpoint as dcp

    from ckptverify.audit.adopt import fingerprint_checkpoint

    m, n = _mx(), _nvfp4()
    dcp.save({"mx": m, "nv": n}, checkpoint_id=str(tmp_path / "ck"))
    stages: list[list[int]] = []
    sink = type("Sink", (), {"start": lambda _, total: stages.append([total, 0]),
                             "advance": lambda _, k: stages[-1].__setitem__(1, stages[-1][1] + k)})()
    report = verify_checkpoint(tmp_path / "ck", deep=True, progress=sink)
    assert report.exit_code == 0, _findings(report)
    laid_out = sum(getattr(t, a).nbytes for t in (m, n) for a in t.__tensor_flatten__()[0])
    assert stages[-1] == [laid_out, laid_out]  # the deep stage: every inner tensor, advanced to its total
    assert {c.check: c.count for c in report.coverage}["fingerprint"] == 2
    assert not [f for f in report.findings if f.check in ("tensor-record", "deep-incomplete")]
    adopted, _ = fingerprint_checkpoint(tmp_path / "ck")
    assert adopted.exit_code == 0, _findings(adopted)
    tensors = json.loads((tmp_path / "ck" / "ckptverify.manifest.json").read_text())["tensors"]
    assert tensors["mx"]["fingerprint"] == tensor_fingerprint(m).value
    assert tensors["nv"]["fingerprint"] == tensor_fingerprint(n).value
    assert tensors["mx"]["parts"] == {name: f.value for name, f in part_fingerprints(m).items()}
    assert verify_checkpoint(tmp_path / "ck", deep=True).exit_code == 0


def _item_bytes(ckpt: Path, fqn: str) -> tuple[Path, int, int]:
    entry = next(i for i in json.loads((ckpt / "ckptverify.manifest.json").read_text())["items"] if i["fqn"] == fqn)
    return ckpt / entry["file"], entry["offset"], entry["length"]


def _patch_record(path: Path, base: int, length: int, suffix: str, edit, fix_crc: bool) -> None:
    """Apply ``edit(bytearray)`` to the bytes of the zip record ending in ``suffix`` of the item at ``base``;
    with ``fix_crc``, write the record's new CRC-32 into its local header and central directory entry (so
    only a manifest or a fingerprint can tell)."""
    raw = bytearray(path.read_bytes())
    item = bytes(raw[base:base + length])
    info = next(i for i in zipfile.ZipFile(io.BytesIO(item)).infolist() if i.filename.endswith(suffix))
    name_len, extra_len = struct.unpack("<HH", item[info.header_offset + 26:info.header_offset + 30])
    start = base + info.header_offset + 30 + name_len + extra_len
    data = bytearray(raw[start:start + info.file_size])
    edit(data)
    assert len(data) == info.file_size
    raw[start:start + info.file_size] = data
    if fix_crc:
        crc = struct.pack("<I", zlib.crc32(bytes(data)))
        flags = struct.unpack("<H", item[info.header_offset + 6:info.header_offset + 8])[0]
        if flags & 0x08:  # torch.save writes a data descriptor after the data: the CRC is there
            end = start + info.file_size
            at = end + 4 if raw[end:end + 4] == b"PK\x07\x08" else end
            raw[at:at + 4] = crc
        else:
            raw[base + info.header_offset + 14:base + info.header_offset + 18] = crc
        central = item.find(b"PK\x01\x02")
        while central != -1:
            n = struct.unpack("<H", item[central + 28:central + 30])[0]
            if item[central + 46:central + 46 + n].decode() == info.filename:
                raw[base + central + 16:base + central + 20] = crc
                break
            central = item.find(b"PK\x01\x02", central + 4)
    path.write_bytes(bytes(raw))


def _flip_first_byte(data: bytearray) -> None:
    data[0] ^= 0x01


def test_flipped_scale_byte_is_caught_and_named(tmp_path: Path) -> None:
    cv.save({"mx": _mx(), "plain": torch.arange(6.0)}, tmp_path / "ck")
    path, base, length = _item_bytes(tmp_path / "ck", "mx")
    before = path.stat().st_size
    _patch_record(path, base, length, "/data/1", _flip_first_byte, fix_crc=False)
    found = _findings(verify_checkpoint(tmp_path / "ck", deep=True))
    crc = next((s, m) for s, c, m in found if c == "zip-crc")
    assert crc[0] == "error" and crc[1].startswith("'mx' chunk [0, 0]: the 'scale' part of its MXTensor is corrupt")
    assert any(c == "fingerprint" and s == "error" for s, c, _ in found)
    assert path.stat().st_size == before  # verification never rewrites what it judged


def test_flipped_scale_byte_with_a_valid_crc_is_caught_by_deep(tmp_path: Path) -> None:
    """The CRC-32 rewritten to match: the zip check passes, the manifest's digest names the scale part, and the
    deep check finds the values are not those saved. The data part alone, the same way, is named as data."""
    cv.save({"mx": _mx(), "plain": torch.arange(6.0)}, tmp_path / "ck")
    path, base, length = _item_bytes(tmp_path / "ck", "mx")
    _patch_record(path, base, length, "/data/1", _flip_first_byte, fix_crc=True)
    shallow = _findings(verify_checkpoint(tmp_path / "ck", use_manifest=False))
    assert not [f for f in shallow if f[0] == "error"], shallow  # nothing in the archive itself shows it
    found = _findings(verify_checkpoint(tmp_path / "ck", deep=True))
    assert not any(c == "zip-crc" for _, c, _ in found)
    digest = next(m for _, c, m in found if c == "manifest-digest")
    assert "the MXTensor's 'qdata' and 'scale' parts" in digest or "the MXTensor's 'scale' part" in digest
    fp = next((s, m) for s, c, m in found if c == "fingerprint")
    assert fp[0] == "error" and fp[1].startswith("'mx': the values read back") and "(its 'scale' part differs)" in fp[1]


def test_flipped_data_byte_with_a_valid_crc_names_the_data_part(tmp_path: Path) -> None:
    cv.save({"mx": _mx()}, tmp_path / "ck")
    path, base, length = _item_bytes(tmp_path / "ck", "mx")
    _patch_record(path, base, length, "/data/0", _flip_first_byte, fix_crc=True)
    fp = next(m for _, c, m in _findings(verify_checkpoint(tmp_path / "ck", deep=True)) if c == "fingerprint")
    assert "(its 'qdata' part differs)" in fp


# ------------------------------------------------------------------------------------------- diff


def test_diff_names_scale_data_attributes_and_decoded_values(tmp_path: Path) -> None:
    m = _mx()
    qdata = m.qdata.clone()
    qdata.view(torch.uint8)[2, 7] ^= 1
    variants = {
        "a": m,
        "scale": _remake(m, scale=_bumped_scale(m)),
        "data": _remake(m, qdata=qdata),
        "attr": _remake(m, kernel_preference=type(m.kernel_preference)("torch")),
        "same": _remake(m),
        "plain": m.dequantize(torch.float32),
    }
    for name, t in variants.items():
        cv.save({"w": t, "other": torch.arange(6.0)}, tmp_path / name)

    def diff_of(name: str):
        report = diff_checkpoints(tmp_path / "a", tmp_path / name)
        errors = [f for f in report.findings if f.severity.value == "error"]
        return report, errors

    report, errors = diff_of("same")
    assert report.exit_code == 0 and not errors

    report, (f,) = diff_of("scale")
    assert report.exit_code == 1 and f.check == "diff-tensor" and f.location.fqn == "w"
    assert "its 'scale' differs in 1 of 8 elements" in f.message and "'qdata' equal" in f.message
    assert "decoded values differ in 32 of 256 elements" in f.message  # one scale covers a block of 32
    assert f.actual["parts"]["scale"]["differing"] == 1 and f.actual["parts"]["qdata"]["differing"] == 0
    assert f.actual["decoded"]["differing"] == 32 and f.actual["context"] == {}
    assert f.location.global_index_first == (1, 0)

    _, (f,) = diff_of("data")
    assert "its 'qdata' differs in 1 of 256 elements" in f.message and "'scale' equal" in f.message
    assert f.actual["decoded"]["differing"] == 1 and f.actual["decoded"]["first_index"] == [2, 7]

    _, (f,) = diff_of("attr")
    assert "attribute kernel_preference is" in f.message and "decoded values are equal" in f.message
    assert f.actual["parts"]["qdata"]["differing"] == 0 == f.actual["parts"]["scale"]["differing"]

    _, (f,) = diff_of("plain")
    assert "stored as MXTensor in A and plain in B" in f.message and "decoded values are equal" in f.message


def test_decoding_without_torchao_says_so(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    m = _mx()
    cv.save({"w": m}, tmp_path / "a")
    cv.save({"w": _remake(m, scale=_bumped_scale(m))}, tmp_path / "b")
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torchao" else real(name, *a))
    (f,) = [f for f in diff_checkpoints(tmp_path / "a", tmp_path / "b").findings if f.severity.value == "error"]
    assert "its 'scale' differs" in f.message and "decoded values not compared: torchao is not installed" in f.message
    assert f.actual["decoded"] is None


# ------------------------------------------------------------------------------------------- hostile input


def _mx_record() -> bytes:
    buf = io.BytesIO()
    torch.save(_mx(), buf)
    z = zipfile.ZipFile(io.BytesIO(buf.getvalue()))
    return z.read(next(n for n in z.namelist() if n.endswith("data.pkl")))


def test_subclass_record_is_read_without_torchao_and_other_globals_are_refused() -> None:
    record = _mx_record()
    header = item_header(record)
    assert isinstance(header, SubclassHeader) and header.short_name == "MXTensor"
    assert [(n, h.dtype, h.size) for n, h in header.parts] == [("qdata", "float8_e4m3fn", (4, 64)),
                                                                ("scale", "float8_e8m0fnu", (4, 2))]
    assert json.loads(header.context)["block_size"] == 32
    swaps = [
        (b"mx_tensor\nMXTensor\n", b"mx_tensor\nto_dtype\n",  # a torchao function, not a tensor class
         "mx_tensor.to_dtype is not part of a tensor record"),
        (b"kernel_preference\nKernelPreference\n", b"kernel_preference\nKernelPreferencX\n",
         "KernelPreferencX is not part of a tensor record"),
        (b"emulated", b"emulatex", "has no member 'emulatex'"),  # a value the enum does not have
    ]
    for old, new, why in swaps:
        assert old in record
        with pytest.raises(pickle.UnpicklingError, match=why):
            item_header(record.replace(old, new))

    class Call:
        def __init__(self, fn, args) -> None:
            self.fn, self.args = fn, args

        def __reduce__(self):
            return self.fn, self.args

    # _rebuild_from_type_v2 over anything but the wrapper-subclass rebuild, or onto a class not allowlisted.
    for func, cls, why in ((torch._utils._rebuild_tensor_v2, MXTensor, "other than an allowlisted tensor subclass"),
                           (torch._utils._rebuild_wrapper_subclass, torch.nn.Parameter,
                            "Parameter is not part of a tensor record")):
        crafted = pickle.dumps(Call(torch._tensor._rebuild_from_type_v2, (func, cls, (), {})), protocol=2)
        with pytest.raises(pickle.UnpicklingError, match=why):
            item_header(crafted)


def _evil_torch_save(path: Path) -> None:
    from torchao.prototype.mx_formats import mx_tensor

    class Evil:
        def __reduce__(self):
            return (mx_tensor.to_dtype, (torch.zeros(1), torch.zeros(1), torch.float32, 32, torch.float32))

    torch.save({"w": torch.ones(2), "evil": Evil()}, path)


def test_hostile_files_naming_torchao_functions_import_nothing(tmp_path: Path) -> None:
    """A torch.save file and a DCP item whose pickle names a torchao function (not a rebuild function): the
    file is judged without torchao ever being imported; the DCP item is a tensor-record error, nothing runs,
    nothing is rewritten."""
    _evil_torch_save(tmp_path / "evil.pt")
    cv.save({"w": _mx(), "plain": torch.arange(6.0)}, tmp_path / "ck")
    path, base, length = _item_bytes(tmp_path / "ck", "w")
    _patch_record(path, base, length, "data.pkl",
                  lambda d: d.__setitem__(slice(None), bytes(d).replace(b"\nMXTensor\n", b"\nto_dtype\n")),
                  fix_crc=True)
    before = path.read_bytes()
    code = f"""
import json, sys
from ckptverify.audit.verify import verify_checkpoint
single = verify_checkpoint({str(tmp_path / "evil.pt")!r}, deep=True)
dcp = verify_checkpoint({str(tmp_path / "ck")!r}, deep=True)
print(json.dumps({{"torchao": any(m.startswith("torchao") for m in sys.modules),
                   "single": [[f.check, f.message] for f in single.findings],
                   "dcp": [[f.severity.value, f.check, f.message] for f in dcp.findings], "dcp_exit": dcp.exit_code}}))
"""
    out = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, PYTHONPATH=str(REPO)),
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout)
    assert got["torchao"] is False
    assert any("torchao.prototype.mx_formats.mx_tensor.to_dtype" in m for _, m in got["single"])
    assert got["dcp_exit"] == 1
    record = next(m for s, c, m in got["dcp"] if c == "tensor-record")
    assert "torchao.prototype.mx_formats.mx_tensor.to_dtype is not part of a tensor record" in record
    assert path.read_bytes() == before


def test_a_file_changing_under_a_subclass_part_stops_the_scan_as_under_any_piece(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``stop_on_change`` holds for a subclass's parts as for plain pieces: the scan stops (what was read proves
    nothing about the file now); without it the part is unreadable."""
    from ckptverify.checks import deep
    from ckptverify.errors import FileChangedError
    from ckptverify.formats.describe import describe

    torch.save({"mx": _mx()}, tmp_path / "q.pt")
    desc = describe(str(tmp_path / "q.pt"))
    assert desc.tensors["mx"].subclass is not None

    def changed(*args: object, **kwargs: object) -> None:
        raise FileChangedError("q.pt changed while it was read")

    monkeypatch.setattr(deep, "scan_payload", changed)
    with pytest.raises(FileChangedError):
        deep.scan_description(desc, lambda fn, items: [fn(x) for x in items])
    scans, _ = deep.scan_here(desc)
    assert "changed while it was read" in scans["mx"].unreadable[0]
