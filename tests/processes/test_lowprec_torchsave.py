"""Low-precision tensors in whole-file ``torch.save`` checkpoints (``.pt``): torchao's MXTensor and NVFP4Tensor
read by their parts (data and scales) and attributes, and plain float8 tensors (``_rebuild_tensor_v3``), through
scan, describe, ``fingerprint``, ``verify`` (``--deep``) and ``diff``, without importing torchao while reading
(docs/fingerprint.md, docs/diff.md, docs/security.md, docs/formats.md)."""

from __future__ import annotations

import json
import os
import pickle
import struct
import subprocess
import sys
import warnings
import zipfile
import zlib
from pathlib import Path

import pytest
import torch
from helpers.preloaded_children import PreloadedServer

pytest.importorskip("torchao", reason="torchao is not installed: pip install 'ckptverify[lowprec]' (CI installs it)")
warnings.filterwarnings("ignore", message=".*register_constant.*")

from torchao.prototype.mx_formats.mx_tensor import MXTensor  # noqa: E402
from torchao.prototype.mx_formats.nvfp4_tensor import NVFP4Tensor  # noqa: E402

from ckptverify.audit.adopt import fingerprint_checkpoint  # noqa: E402
from ckptverify.audit.diff import diff_checkpoints  # noqa: E402
from ckptverify.audit.verify import verify_checkpoint  # noqa: E402
from ckptverify.checks.single import check_file  # noqa: E402
from ckptverify.errors import BadPickle  # noqa: E402
from ckptverify.fingerprint import part_fingerprints, tensor_fingerprint  # noqa: E402
from ckptverify.formats.describe import describe  # noqa: E402
from ckptverify.safeparse.torchsave import leaf_values, scan_pickle  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
SCRIPT = Path(__file__).resolve().parents[1] / "user_scripts" / "lowprec_torchsave_train.py"
BASE = "model.base.weight"


def _mx(seed: int = 0) -> MXTensor:
    g = torch.Generator().manual_seed(seed)
    return MXTensor.to_mx(torch.randn(4, 64, generator=g), torch.float8_e4m3fn, 32)


def _remake(m: MXTensor, *, qdata: torch.Tensor | None = None, scale: torch.Tensor | None = None) -> MXTensor:
    return MXTensor(m.qdata.clone() if qdata is None else qdata, m.scale.clone() if scale is None else scale,
                    m.elem_dtype, m.block_size, m.orig_dtype, m.kernel_preference, m.act_quant_kwargs,
                    m.is_swizzled_scales)


def _bumped_scale(m: MXTensor) -> torch.Tensor:
    scale = m.scale.clone()
    scale.view(torch.uint8)[1, 0] += 1
    return scale


def _flipped_qdata(m: MXTensor) -> torch.Tensor:
    qdata = m.qdata.clone()
    qdata.view(torch.uint8)[2, 7] ^= 1
    return qdata


def _errors(report) -> list:
    return [f for f in report.findings if f.severity.value == "error"]


def _data_pkl(path: Path) -> bytes:
    z = zipfile.ZipFile(path)
    return z.read(next(n for n in z.namelist() if n.endswith("data.pkl")))


def _record_of(path: Path, tensor: str, part: str | None = None) -> str:
    """The zip record that holds ``tensor`` (its ``part``, for a tensor subclass)."""
    scan = scan_pickle(_data_pkl(path))
    ref = dict(scan.subclasses[tensor].parts)[part] if part else scan.tensors[tensor]
    return next(n for n in zipfile.ZipFile(path).namelist() if n.endswith(f"/data/{ref.storage_key}"))


def _patch(path: Path, record: str, edit, *, fix_crc: bool) -> None:
    """Apply ``edit(bytearray)`` to the bytes of zip record ``record`` in place; with ``fix_crc``, write the
    record's new CRC-32 into its data descriptor or local header and its central directory entry (so only a
    manifest or a fingerprint can tell)."""
    raw = bytearray(path.read_bytes())
    info = zipfile.ZipFile(path).getinfo(record)
    name_len, extra_len = struct.unpack("<HH", raw[info.header_offset + 26:info.header_offset + 30])
    start = info.header_offset + 30 + name_len + extra_len
    data = bytearray(raw[start:start + info.file_size])
    edit(data)
    raw[start:start + info.file_size] = data
    if fix_crc:
        crc = struct.pack("<I", zlib.crc32(bytes(data)))
        flags = struct.unpack("<H", raw[info.header_offset + 6:info.header_offset + 8])[0]
        if flags & 0x08:
            end = start + info.file_size
            at = end + 4 if raw[end:end + 4] == b"PK\x07\x08" else end
            raw[at:at + 4] = crc
        else:
            raw[info.header_offset + 14:info.header_offset + 18] = crc
        central = raw.find(b"PK\x01\x02")
        while central != -1:
            n = struct.unpack("<H", raw[central + 28:central + 30])[0]
            if raw[central + 46:central + 46 + n].decode() == record:
                raw[central + 16:central + 20] = crc
                break
            central = raw.find(b"PK\x01\x02", central + 4)
    path.write_bytes(bytes(raw))


def _flip_first_byte(data: bytearray) -> None:
    data[0] ^= 0x01


# ------------------------------------------------------------------------------------------- the user's file


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The user's script three times: clean, re-quantizing the frozen base after the last update, and doubling
    the learning rate of the last step instead. Each run is a child forked from a server that imported torch and
    torchao once (not a fresh interpreter each: some 4 s of CPU to import them); the test that needs a process
    without torchao (``test_reading_hostile_and_real_files_imports_no_torchao``) starts a fresh one."""
    root = tmp_path_factory.mktemp("torchsave")
    plan = {"clean": (), "rescaled": ("--rescale",), "lr": ("--lr-bump",)}
    preload = ("numpy", "torch", "torch.utils.data", "torchao.prototype.mx_formats.mx_tensor",
               "torchao.prototype.mx_formats.nvfp4_tensor")
    with PreloadedServer(preload) as children:
        for name, args in plan.items():
            done = children.script(SCRIPT, str(root / f"{name}.pt"), *args, cwd=SCRIPT.parent, timeout=600)
            assert done.returncode == 0, f"{name}: {done.stderr[-3000:]}"
    return {name: root / f"{name}.pt" for name in plan}


def test_user_file_is_described_checked_and_fingerprinted_by_parts(saved: dict[str, Path], tmp_path: Path) -> None:
    path = tmp_path / "ckpt.pt"
    path.write_bytes(saved["clean"].read_bytes())
    live = torch.load(path, weights_only=False)
    weight = live["model"]["base.weight"]
    assert isinstance(weight, MXTensor)

    desc = describe(path)
    t = desc.tensors[BASE]
    assert (t.dtype, t.shape, t.payloads) == ("float32", (32, 64), [])
    assert t.subclass is not None and t.subclass.cls.endswith("mx_tensor.MXTensor")
    assert [(p.name, p.dtype, p.shape) for p in t.subclass.parts] == [("qdata", "float8_e4m3fn", (32, 64)),
                                                                      ("scale", "float8_e8m0fnu", (32, 2))]
    assert json.loads(t.subclass.context)["block_size"] == 32
    assert [(desc.tensors[n].dtype, desc.tensors[n].shape) for n in ("export.head.weight", "export.up.weight")] == \
        [("float8_e4m3fn", (4, 32)), ("float8_e5m2", (32, 4))]
    assert desc.values["step"] == "int:4" and desc.values["optimizer.param_groups.0.lr"].startswith("float:")

    found, _, facts = check_file(str(path))
    assert not [f for f in found if f.severity.value != "info"], found
    assert not any(f.check == "pickle-opaque" for f in found)  # nothing of the subclass record is left unread
    assert facts["description"]() == desc  # the check's read describes the file as describe does

    adopted, _ = fingerprint_checkpoint(path)
    assert adopted.exit_code == 0, adopted.findings
    tensors = json.loads((tmp_path / "ckpt.pt.ckptverify.manifest.json").read_text())["tensors"]
    assert tensors[BASE]["fingerprint"] == tensor_fingerprint(weight).value
    assert tensors[BASE]["parts"] == {name: f.value for name, f in part_fingerprints(weight).items()}
    for name in ("head.weight", "up.weight"):
        assert tensors[f"export.{name}"]["fingerprint"] == tensor_fingerprint(live["export"][name]).value
    assert tensors["model.head.weight"]["fingerprint"] == tensor_fingerprint(live["model"]["head.weight"]).value
    before = path.read_bytes()
    deep = verify_checkpoint(path, deep=True)
    assert deep.exit_code == 0, deep.findings
    assert path.read_bytes() == before


def test_flipped_scale_byte_is_named_by_the_crc_check(saved: dict[str, Path], tmp_path: Path) -> None:
    for part in ("scale", "qdata"):
        path = tmp_path / f"{part}.pt"
        path.write_bytes(saved["clean"].read_bytes())
        _patch(path, _record_of(path, BASE, part), _flip_first_byte, fix_crc=False)
        before = path.read_bytes()
        report = verify_checkpoint(path, deep=True)
        (crc,) = [f for f in _errors(report) if f.check == "zip-crc"]
        assert f"(the {part!r} part of tensor {BASE!r}, a MXTensor) is corrupt" in crc.message
        other = "qdata" if part == "scale" else "scale"
        assert f"{other!r} part" not in crc.message and crc.location.fqn == BASE
        assert report.exit_code == 1 and path.read_bytes() == before  # never rewritten


def test_flipped_scale_byte_with_a_valid_crc_is_caught_by_deep(saved: dict[str, Path], tmp_path: Path) -> None:
    """The CRC-32 rewritten to match: the file's own checks pass; the manifest written by ``fingerprint`` names
    the part whose bytes changed, and the deep check finds the values are not those fingerprinted, naming the
    part. A flipped data byte the same way is named as data, and a flipped float8 export byte as that tensor."""
    for part in ("scale", "qdata"):
        path = tmp_path / f"{part}.pt"
        path.write_bytes(saved["clean"].read_bytes())
        assert fingerprint_checkpoint(path)[0].exit_code == 0
        _patch(path, _record_of(path, BASE, part), _flip_first_byte, fix_crc=True)
        assert not _errors(verify_checkpoint(path, use_manifest=False))  # nothing in the archive shows it
        before = path.read_bytes()
        report = verify_checkpoint(path, deep=True)
        digest = [f.message for f in _errors(report) if f.check == "manifest-digest" and f.location.fqn]
        assert digest and all(m.startswith(f"'{BASE}.{part}' (the {part!r} part of {BASE!r}, a MXTensor)")
                              for m in digest)
        (fp,) = [f for f in _errors(report) if f.check == "fingerprint"]
        assert fp.location.fqn == BASE and fp.message.endswith(f"(its {part!r} part differs)")
        assert path.read_bytes() == before

    path = tmp_path / "export.pt"
    path.write_bytes(saved["clean"].read_bytes())
    assert fingerprint_checkpoint(path)[0].exit_code == 0
    _patch(path, _record_of(path, "export.up.weight"), _flip_first_byte, fix_crc=True)
    report = verify_checkpoint(path, deep=True)
    assert {f.location.fqn for f in _errors(report) if f.check == "fingerprint"} == {"export.up.weight"}


def test_diff_of_user_files_tells_requantization_from_the_learning_rate(saved: dict[str, Path]) -> None:
    clean = diff_checkpoints(saved["clean"], saved["clean"])
    assert clean.exit_code == 0 and not _errors(clean)

    rescaled = _errors(diff_checkpoints(saved["clean"], saved["rescaled"]))
    assert [f.location.fqn for f in rescaled if f.check == "diff-tensor"] == [BASE]
    (f,) = [f for f in rescaled if f.check == "diff-tensor"]
    assert f.actual["parts"]["scale"]["differing"] == 64 and f.actual["parts"]["qdata"]["differing"] > 0
    assert not any("lr" in (g.location.fqn or "") for g in rescaled)

    # The learning rate of the last step (OneCycleLR sets it again after the step, so only the trained weights
    # show it): the trained layers differ, the quantized weight does not.
    lr = {g.location.fqn for g in _errors(diff_checkpoints(saved["clean"], saved["lr"])) if g.check == "diff-tensor"}
    assert {"model.head.weight", "model.up.weight", "ema.head.weight"} <= lr and BASE not in lr


# ------------------------------------------------------------------------------------------- diff


def test_diff_equal_data_different_scales_names_the_scale_and_decoded_values(tmp_path: Path) -> None:
    m = _mx()
    variants = {"a": m, "same": _remake(m), "scale": _remake(m, scale=_bumped_scale(m)),
                "data": _remake(m, qdata=_flipped_qdata(m)), "plain": m.dequantize(torch.float32)}
    for name, t in variants.items():
        torch.save({"w": t, "other": torch.arange(6.0)}, tmp_path / f"{name}.pt")

    def diff_of(name: str):
        return diff_checkpoints(tmp_path / "a.pt", tmp_path / f"{name}.pt")

    assert diff_of("same").exit_code == 0 and not _errors(diff_of("same"))
    report = diff_of("scale")
    (f,) = _errors(report)
    assert report.exit_code == 1 and f.check == "diff-tensor" and f.location.fqn == "w"
    assert "its 'scale' differs in 1 of 8 elements" in f.message and "'qdata' equal" in f.message
    assert "decoded values differ in 32 of 256 elements" in f.message  # one scale covers a block of 32
    assert f.actual["decoded"]["first_index"] == [1, 0]
    (f,) = _errors(diff_of("data"))
    assert "its 'qdata' differs in 1 of 256 elements" in f.message and "'scale' equal" in f.message
    assert f.actual["decoded"]["differing"] == 1 and f.actual["decoded"]["first_index"] == [2, 7]
    (f,) = _errors(diff_of("plain"))
    assert "stored as MXTensor in A and plain in B" in f.message and "decoded values are equal" in f.message

    # Equal data, different scales differ in the fingerprint the manifest keeps, and in the scale part only.
    fa, fb = (describe(tmp_path / f"{n}.pt") for n in ("a", "scale"))
    assert fa.tensors["w"].subclass.context == fb.tensors["w"].subclass.context
    for name in ("a", "scale"):
        assert fingerprint_checkpoint(tmp_path / f"{name}.pt")[0].exit_code == 0
    ta, tb = (json.loads((tmp_path / f"{n}.pt.ckptverify.manifest.json").read_text())["tensors"]["w"]
              for n in ("a", "scale"))
    assert ta["fingerprint"] != tb["fingerprint"]
    assert ta["parts"]["qdata"] == tb["parts"]["qdata"] and ta["parts"]["scale"] != tb["parts"]["scale"]


def test_nvfp4_per_tensor_scale_is_a_part_in_a_torch_save_file(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(3)
    n = NVFP4Tensor.to_nvfp4(torch.randn(4, 64, generator=g), per_tensor_scale=torch.tensor(0.5))
    other = NVFP4Tensor(n.qdata.clone(), n.scale.clone(), n.block_size, n.orig_dtype, torch.tensor(0.25))
    torch.save({"w": n}, tmp_path / "a.pt")
    torch.save({"w": other}, tmp_path / "b.pt")
    parts = describe(tmp_path / "a.pt").tensors["w"].subclass.parts
    assert [p.name for p in parts] == ["qdata", "scale", "per_tensor_scale"]
    assert fingerprint_checkpoint(tmp_path / "a.pt")[0].exit_code == 0
    saved = json.loads((tmp_path / "a.pt.ckptverify.manifest.json").read_text())["tensors"]["w"]
    assert saved["fingerprint"] == tensor_fingerprint(n).value
    assert saved["parts"] == {k: f.value for k, f in part_fingerprints(n).items()}
    (f,) = _errors(diff_checkpoints(tmp_path / "a.pt", tmp_path / "b.pt"))
    assert "its 'per_tensor_scale' differs in 1 of 1 elements" in f.message
    assert f.actual["parts"]["qdata"]["differing"] == 0 == f.actual["parts"]["scale"]["differing"]


def test_a_parameter_holding_a_subclass_fingerprints_as_its_values(tmp_path: Path) -> None:
    """``nn.Parameter`` marks the subclass it wraps (``_is_param`` in its saved state); saved with
    ``keep_vars=True`` or as the parameter itself, it is the same values as the plain tensor."""
    m = _mx()
    param = torch.nn.Parameter(_remake(m), requires_grad=False)
    torch.save({"param": param, "plain": m, "other": _remake(m, scale=_bumped_scale(m))}, tmp_path / "a.pt")
    assert "_is_param" not in describe(tmp_path / "a.pt").tensors["param"].subclass.context
    assert fingerprint_checkpoint(tmp_path / "a.pt")[0].exit_code == 0
    tensors = json.loads((tmp_path / "a.pt.ckptverify.manifest.json").read_text())["tensors"]
    assert tensors["param"]["fingerprint"] == tensors["plain"]["fingerprint"] == tensor_fingerprint(param).value
    assert tensors["other"]["fingerprint"] != tensors["plain"]["fingerprint"]


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_plain_float8_tensors_are_described_fingerprinted_verified_and_diffed(tmp_path: Path,
                                                                              dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(6, 8, generator=g).to(dtype)
    view = x[1:5, 2:6]  # a view onto the storage: offset and strides kept
    y = x.clone()
    y.view(torch.uint8)[3, 4] ^= 1
    torch.save({"x": x, "view": view, "plain": torch.ones(3)}, tmp_path / "a.pt")
    torch.save({"x": y, "view": view, "plain": torch.ones(3)}, tmp_path / "b.pt")
    name = str(dtype).removeprefix("torch.")

    desc = describe(tmp_path / "a.pt")
    assert (desc.tensors["x"].dtype, desc.tensors["x"].shape) == (name, (6, 8))
    p = desc.tensors["view"].payloads[0]
    assert (p.dtype, p.shape, p.stride, p.storage_offset) == (name, (4, 4), (8, 1), 10)
    found, _, facts = check_file(str(tmp_path / "a.pt"))
    assert not [f for f in found if f.severity.value != "info"] and facts["description"]() == desc

    assert fingerprint_checkpoint(tmp_path / "a.pt")[0].exit_code == 0
    tensors = json.loads((tmp_path / "a.pt.ckptverify.manifest.json").read_text())["tensors"]
    assert tensors["x"]["fingerprint"] == tensor_fingerprint(x).value
    assert tensors["view"]["fingerprint"] == tensor_fingerprint(view).value
    assert verify_checkpoint(tmp_path / "a.pt", deep=True).exit_code == 0

    (f,) = _errors(diff_checkpoints(tmp_path / "a.pt", tmp_path / "b.pt"))
    assert f.check == "diff-tensor" and f.location.fqn == "x" and "1 of 48 elements" in f.message
    assert f.actual["first_index"] == [3, 4] and f.actual["max_ulp"] == 1

    path = tmp_path / "a.pt"
    _patch(path, _record_of(path, "x"), lambda d: d.__setitem__(30, d[30] ^ 1), fix_crc=True)
    report = verify_checkpoint(path, deep=True)
    assert {f.location.fqn for f in _errors(report) if f.check == "fingerprint"} == {"x"}
    # Byte 30 is row 3, column 6 of x, outside the view: the view's values are unchanged, though the bytes
    # it is stored in (the record it shares with x) are not.
    assert {f.location.fqn for f in _errors(report) if f.check == "manifest-digest" and f.location.fqn} == \
        {"x", "view"}


def test_a_record_shorter_than_its_storage_is_a_tensor_record_error(tmp_path: Path) -> None:
    """A storage the pickle records as larger than its record, though the view fits the bytes there: torch.load
    refuses it, and the check judges it as it does a DCP item's."""
    torch.save({"x": torch.zeros(4)}, tmp_path / "a.pt")
    pkl = _data_pkl(tmp_path / "a.pt")
    crafted = pkl.replace(b"K\x04tq", b"K\x08tq", 1)
    assert crafted != pkl
    _patch(tmp_path / "a.pt", next(n for n in zipfile.ZipFile(tmp_path / "a.pt").namelist()
                                   if n.endswith("data.pkl")),
           lambda d: d.__setitem__(slice(None), crafted), fix_crc=True)
    with pytest.raises(RuntimeError):
        torch.load(tmp_path / "a.pt")
    found, _, _ = check_file(str(tmp_path / "a.pt"))
    (f,) = [f for f in found if f.severity.value == "error"]
    assert f.check == "tensor-record" and "storage record is 16 bytes but holds 8 float32 elements" in f.message
    assert f.location.record == _record_of(tmp_path / "a.pt", "x")


def test_a_short_float8_record_is_a_tensor_record_error(tmp_path: Path) -> None:
    """A float8 tensor's extent is counted in its own element size over an untyped (byte-sized) storage."""
    torch.save({"x": torch.zeros(4, 4, dtype=torch.float8_e5m2)}, tmp_path / "a.pt")
    record = _record_of(tmp_path / "a.pt", "x")
    pkl = _data_pkl(tmp_path / "a.pt")
    scan = scan_pickle(pkl)
    assert scan.storages[scan.tensors["x"].storage_key].numel == 16
    # The same record read as 4x8: past the 16 bytes stored.
    crafted = pkl.replace(b"K\x04K\x04\x86", b"K\x04K\x08\x86", 1)
    assert crafted != pkl and scan_pickle(crafted).tensors["x"].size == (4, 8)
    _patch(tmp_path / "a.pt", next(n for n in zipfile.ZipFile(tmp_path / "a.pt").namelist()
                                   if n.endswith("data.pkl")),
           lambda d: d.__setitem__(slice(None), crafted), fix_crc=True)
    found, _, _ = check_file(str(tmp_path / "a.pt"))
    (f,) = [f for f in found if f.severity.value == "error"]
    assert f.check == "tensor-record" and "reach 20 float8_e5m2 elements (20 bytes)" in f.message
    assert f.location.record == record


# ------------------------------------------------------------------------------------------- hostile input


class _Call:
    def __init__(self, fn, args) -> None:
        self.fn, self.args = fn, args

    def __reduce__(self):
        return self.fn, self.args


def test_crafted_subclass_records_are_refused() -> None:
    buf = __import__("io").BytesIO()
    torch.save({"w": _mx()}, buf)
    pkl = _data_pkl(buf)
    assert scan_pickle(pkl).subclasses["w"].short_name == "MXTensor"
    swaps = [
        (b"emulated", b"emulatex", "has no member 'emulatex'"),  # a value the enum does not have
        (b"X\x05\x00\x00\x00scale", b"X\x05\x00\x00\x00scalf", "has no inner tensor 'scalf'"),
        (b"X\x05\x00\x00\x00qdata", b"X\x05\x00\x00\x00qdatb", "has no inner tensor 'qdatb'"),
        # An attribute that is no scalar, dtype, enum member or attribute record: an arbitrary global.
        (b"is_swizzled_scalesq2\x89", b"is_swizzled_scalesq2cposix\nsystem\n", "attribute of type type is not"),
    ]
    for old, new, why in swaps:
        assert old in pkl, old
        with pytest.raises(BadPickle, match=why):
            scan_pickle(pkl.replace(old, new, 1))

    # _rebuild_from_type_v2 of an allowlisted class over the plain tensor rebuild, not the wrapper rebuild.
    crafted = pickle.dumps(_Call(torch._tensor._rebuild_from_type_v2,
                                 (torch._utils._rebuild_tensor_v2, MXTensor, (), {})), protocol=2)
    with pytest.raises(BadPickle, match="other than an allowlisted tensor subclass"):
        scan_pickle(crafted)
    # A float8 rebuild whose dtype is no dtype.
    with pytest.raises(BadPickle, match="_rebuild_tensor_v3 without a dtype"):
        scan_pickle(pkl.replace(b"torch\nfloat8_e8m0fnu", b"torch\nfloat8_e8m0fnx", 1))
    assert scan_pickle(pkl).opaque == set()
    # The object budget counts a subclass record's rebuilds and globals like any other.
    with pytest.raises(BadPickle, match="builds more than"):
        scan_pickle(pkl, max_objects=8)


def test_other_subclasses_stay_inert_placeholders() -> None:
    """A tensor subclass outside the allowlist is named, not interpreted (as before), and nothing of it runs;
    dtypes, devices and layouts elsewhere in a file read as they always did."""
    crafted = pickle.dumps(_Call(torch._tensor._rebuild_from_type_v2,
                                 (torch._utils._rebuild_wrapper_subclass, torch.nn.Buffer, (), {})), protocol=2)
    scan = scan_pickle(crafted)
    assert scan.subclasses == {} and "torch._tensor._rebuild_from_type_v2" in scan.opaque
    assert "torch.nn.parameter.Buffer" in scan.opaque
    values = leaf_values(scan_pickle(pickle.dumps({"d": torch.device("cuda", 0), torch.float32: 1,
                                                   "l": torch.sparse_coo, "x": torch.bfloat16})).root)
    assert values == {"d.__class__": "global:torch.device", "d.args.0": "str:'cuda'", "d.args.1": "int:0",
                      "d.state": "NoneType:None", "('dtype', 'float32')": "int:1",
                      "l.__class__": "global:torch.serialization._get_layout", "l.args.0": "str:'torch.sparse_coo'",
                      "l.state": "NoneType:None", "x": "dtype:bfloat16"}


def test_reading_hostile_and_real_files_imports_no_torchao(tmp_path: Path) -> None:
    """In a fresh process: verify (deep), fingerprint and describe a torch.save file holding MX and NVFP4
    tensors, and verify a crafted one; torchao is never imported, the crafted file is refused as a pickle
    that cannot be read safely, and no file is changed."""
    g = torch.Generator().manual_seed(3)
    nv = NVFP4Tensor.to_nvfp4(torch.randn(4, 64, generator=g), per_tensor_scale=torch.tensor(0.5))
    torch.save({"mx": _mx(), "nv": nv, "f8": torch.ones(4, dtype=torch.float8_e4m3fn)}, tmp_path / "real.pt")
    torch.save({"w": _mx()}, tmp_path / "crafted.pt")
    _patch(tmp_path / "crafted.pt", next(n for n in zipfile.ZipFile(tmp_path / "crafted.pt").namelist()
                                         if n.endswith("data.pkl")),
           lambda d: d.__setitem__(slice(None), bytes(d).replace(b"emulated", b"emulatex")), fix_crc=True)
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    code = f"""
import json, sys
from ckptverify.audit.adopt import fingerprint_checkpoint
from ckptverify.audit.verify import verify_checkpoint
from ckptverify.formats.describe import describe
real, crafted = {str(tmp_path / "real.pt")!r}, {str(tmp_path / "crafted.pt")!r}
adopted = fingerprint_checkpoint(real)[0]
deep = verify_checkpoint(real, deep=True)
bad = verify_checkpoint(crafted, deep=True)
refused = fingerprint_checkpoint(crafted)[0]
parts = [p.name for p in describe(real).tensors["nv"].subclass.parts]
print(json.dumps({{"torchao": sorted(m for m in sys.modules if m.startswith("torchao")), "parts": parts,
                   "codes": [adopted.exit_code, deep.exit_code, bad.exit_code, refused.exit_code],
                   "bad": [[f.check, f.message] for f in bad.findings if f.severity.value == "error"]}}))
"""
    out = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, PYTHONPATH=str(REPO)),
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["torchao"] == [] and got["parts"] == ["qdata", "scale", "per_tensor_scale"]
    assert got["codes"] == [0, 0, 1, 1]
    (check, message), = got["bad"]
    assert check == "pickle-structure" and "has no member 'emulatex'" in message
    after = {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.name in before}
    assert after == before
