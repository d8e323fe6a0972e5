"""``verify --deep`` on views whose stored bytes stand for more elements (stride 0, overlapping, transposed), and
low-precision tensor-subclass records crafted opcode by opcode (torchao's ``MXTensor`` and ``NVFP4Tensor``, as
:mod:`ckptverify.safeparse.torchsave` recognises them) refused without importing torchao or resolving any global
outside the allowlist (docs/security.md, docs/formats.md)."""

from __future__ import annotations

import importlib.abc
import json
import math
import os
import pickle
import struct
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from ckptverify.audit.adopt import fingerprint_checkpoint
from ckptverify.audit.verify import verify_checkpoint
from ckptverify.checks import deep
from ckptverify.errors import BadPickle
from ckptverify.fingerprint import chunk_fingerprint, combine, tensor_fingerprint
from ckptverify.formats import describe as describe_module
from ckptverify.formats.describe import describe, iter_payload_blocks
from ckptverify.safeparse.torchsave import SubclassHeader, item_header, scan_pickle

REPO = Path(__file__).resolve().parents[2]


def _found(report: Any, severity: str) -> list[Any]:
    return [f for f in report.findings if f.severity.value == severity]


def _counted(report: Any, check: str) -> int:
    return sum(c.count for c in report.coverage if c.check == check and c.unit == "tensors")


# ------------------------------------------------------------------------------------- views over few bytes


def test_deep_verify_passes_an_expanded_tensor_saved_with_torch_save(tmp_path: Path) -> None:
    """torch.save keeps one element of storage for a stride-0 view of 2**27 elements: a valid tensor, rebuilt."""
    path = tmp_path / "expanded.pt"
    torch.save({"x": torch.zeros(1).expand(1 << 27)}, path)
    assert path.stat().st_size < 4096
    report = verify_checkpoint(path, deep=True)
    assert report.exit_code == 0, [f.message for f in report.findings]
    assert not _found(report, "error") and not _found(report, "warning")
    assert _counted(report, "fingerprint") == 1


def test_expanded_tensor_fingerprint_written_and_checked_is_the_live_tensors(tmp_path: Path) -> None:
    live = torch.full((1, 3), 1.5).expand(1 << 25, 3)
    path = tmp_path / "expanded.pt"
    torch.save({"x": live}, path)
    adopted, manifest = fingerprint_checkpoint(path)
    assert adopted.exit_code == 0 and manifest is not None, [f.message for f in adopted.findings]
    assert manifest.tensors["x"].fingerprint == tensor_fingerprint(live).value
    report = verify_checkpoint(path, deep=True)
    assert report.exit_code == 0 and not _found(report, "warning"), [f.message for f in report.findings]


_VIEWS = {
    "stride 0": lambda: torch.arange(3.0)[1:2].expand(40),
    "stride 0 inside": lambda: torch.arange(12.0).reshape(3, 1, 4).expand(3, 5, 4),
    "overlapping": lambda: torch.arange(16.0).as_strided((6, 4, 3), (1, 2, 1), 2),
    "transposed": lambda: torch.arange(60.0).reshape(5, 12).t(),
    "scalar of a longer storage": lambda: torch.arange(5.0)[3],
}


@pytest.mark.parametrize("name", sorted(_VIEWS))
def test_strided_views_are_rebuilt_in_bounded_blocks_to_the_live_fingerprint(tmp_path: Path, name: str) -> None:
    live = _VIEWS[name]()
    torch.save({"x": live}, tmp_path / "v.pt")
    desc = describe(tmp_path / "v.pt")
    (p,) = desc.tensors["x"].payloads
    assert (p.shape, p.stride) == (tuple(live.shape), live.stride())
    with desc.open(p) as f:
        blocks = list(iter_payload_blocks(f, p, max_bytes=24))
    assert all(b.numel() * b.element_size() <= max(24, b.element_size()) for _, b in blocks)
    assert sum(b.numel() for _, b in blocks) == live.numel()
    fp = combine(chunk_fingerprint(b, offsets, live.shape) for offsets, b in blocks)
    assert fp.value == tensor_fingerprint(live).value


def _edit_data_pkl(path: Path, old: bytes, new: bytes) -> None:
    """Rewrite ``path`` (a torch.save archive) with ``old`` replaced by ``new`` in its data.pkl, CRCs valid."""
    with zipfile.ZipFile(path) as z:
        records = [(i.filename, z.read(i)) for i in z.infolist()]
    writer = torch._C.PyTorchFileWriter(str(path))  # torch's own zip writer: a well-formed archive
    for name, data in records:
        if name.endswith("/data.pkl"):
            assert data.count(old) == 1, data
            data = data.replace(old, new)
        writer.write_record(name.split("/", 1)[1], data, len(data))
    writer.write_end_of_file()


@pytest.mark.parametrize(("tensor", "old", "new"), [
    # A row-major tensor of 9 elements over its storage of 5: the deep check must not read the next record.
    pytest.param(torch.ones(5), b"K\x05\x85", b"K\x09\x85", id="row-major"),
    # A stride-0 view whose one element lies past its storage of one element.
    pytest.param(torch.ones(1).expand(6), b"K\x00K\x06\x85", b"K\x05K\x06\x85", id="stride 0"),
])
def test_a_view_past_its_storage_is_damage_for_the_deep_check(tmp_path: Path, tensor: torch.Tensor, old: bytes,
                                                              new: bytes) -> None:
    path = tmp_path / "v.pt"
    torch.save({"x": tensor, "y": torch.arange(4.0)}, path)
    _edit_data_pkl(path, old, new)
    report = verify_checkpoint(path, deep=True)
    assert report.exit_code == 1
    rebuilt = [f for f in _found(report, "error") if f.check == "fingerprint"]
    assert [f.location.fqn for f in rebuilt] == ["x"], [f.message for f in report.findings]
    assert "cannot be rebuilt" in rebuilt[0].message and "reaches element" in rebuilt[0].message


def test_an_expanded_view_past_the_work_bound_is_a_limit_not_damage(tmp_path: Path) -> None:
    """2**40 elements from four stored bytes: not fingerprinted (that would run for hours), said so, no error."""
    path = tmp_path / "huge.pt"
    torch.save({"x": torch.zeros(1).expand(1 << 40), "y": torch.ones(3)}, path)
    report = verify_checkpoint(path, deep=True)
    assert report.exit_code == 0 and not _found(report, "error"), [f.message for f in report.findings]
    limit, incomplete = _found(report, "warning")
    assert limit.check == "deep-limit" and limit.location.fqn == "x" and "stride [0]" in limit.message
    assert incomplete.check == "deep-incomplete" and "rebuilt 1 of 2 tensor(s)" in incomplete.message
    assert _counted(report, "fingerprint") == 1


def test_views_that_lay_out_more_than_they_store_share_one_work_bound(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Many small records cannot add up to unbounded work: past the bound, later views are limits."""
    monkeypatch.setattr(deep, "MAX_VIEW_BYTES", 10 << 20)
    monkeypatch.setattr(describe_module, "MAX_VIEW_BYTES", 10 << 20)
    path = tmp_path / "many.pt"
    torch.save({f"x{i}": torch.full((1,), float(i)).expand(1 << 20) for i in range(5)}, path)  # 4 MiB each
    report = verify_checkpoint(path, deep=True)
    assert report.exit_code == 0 and not _found(report, "error"), [f.message for f in report.findings]
    assert sorted(f.location.fqn for f in _found(report, "warning") if f.check == "deep-limit") == ["x2", "x3", "x4"]
    assert _counted(report, "fingerprint") == 2


def test_a_strided_view_over_more_stored_bytes_than_the_deep_check_holds_is_a_limit() -> None:
    """A transposed view is read back whole: past ``view_limit`` stored bytes it is a limit, not damage."""
    from ckptverify.formats.describe import Payload

    transposed = Payload(file="x", offset=0, length=4096, dtype="float32", shape=(32, 32), stride=(1, 32))
    assert deep.view_limited(transposed, 4096) is None and deep.view_limited(transposed, None) is None
    assert deep.view_limited(transposed, 1024) == ("a strided view (shape [32, 32], stride [1, 32]) over 4096 stored "
                                                   "bytes, more than the 1024 the deep check holds at once")
    scan = deep.scan_payload(None, "x", transposed, (32, 32), view_limit=1024)
    assert scan.limited and not scan.unreadable and scan.value((32, 32)) is None


# ------------------------------------------------------------------------------------ crafted subclass records


@dataclass(frozen=True)
class G:
    """A global, named: written as ``GLOBAL``, never looked up."""

    module: str
    name: str


@dataclass(frozen=True)
class Call:
    fn: Any
    args: tuple[Any, ...]


@dataclass(frozen=True)
class NewObj:
    cls: Any
    state: dict[str, Any]


@dataclass(frozen=True)
class Pid:
    pid: tuple[Any, ...]


def _op(v: Any) -> bytes:
    """``v`` as protocol-2 opcodes, by hand: no pickler looks a global up or calls a reducer."""
    if v is None:
        return b"N"
    if isinstance(v, bool):
        return b"\x88" if v else b"\x89"
    if isinstance(v, int):
        return b"J" + struct.pack("<i", v)
    if isinstance(v, float):
        return b"G" + struct.pack(">d", v)
    if isinstance(v, str):
        return b"X" + struct.pack("<I", len(v.encode())) + v.encode()
    if isinstance(v, tuple):
        return b"(" + b"".join(_op(x) for x in v) + b"t"
    if isinstance(v, dict):
        return b"}(" + b"".join(_op(k) + _op(x) for k, x in v.items()) + b"u"
    if isinstance(v, G):
        return f"c{v.module}\n{v.name}\n".encode()
    if isinstance(v, Call):
        return _op(v.fn) + _op(v.args) + b"R"
    if isinstance(v, NewObj):
        return _op(v.cls) + b")\x81" + _op(v.state) + b"b"
    assert isinstance(v, Pid)
    return _op(v.pid) + b"Q"


def _pickled(root: Any) -> bytes:
    return b"\x80\x02" + _op(root) + b"."


MX = "torchao.prototype.mx_formats.mx_tensor.MXTensor"
NVFP4 = "torchao.prototype.mx_formats.nvfp4_tensor.NVFP4Tensor"
KERNEL = G("torchao.quantization.quantize_.common.kernel_preference", "KernelPreference")
SCALING = G("torchao.prototype.mx_formats.config", "ScaleCalculationMode")
MX_KWARGS = G("torchao.prototype.mx_formats.mx_tensor", "QuantizeTensorToMXKwargs")
SENTINEL = "ckptverify_sentinel_module"
DROP = object()


def _stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(math.prod(shape[i + 1:]) for i in range(len(shape)))


def _tensor(key: str, dtype: str, shape: tuple[int, ...]) -> Call:
    nbytes = math.prod(shape) * {"float32": 4}.get(dtype, 1)
    storage = Pid(("storage", G("torch.storage", "UntypedStorage"), key, "cpu", nbytes))
    return Call(G("torch._utils", "_rebuild_tensor_v3"), (storage, 0, shape, _stride(shape), False,
                                                          Call(G("collections", "OrderedDict"), ()), G("torch", dtype)))


def _kwargs(**edits: Any) -> NewObj:
    state = {"elem_dtype": G("torch", "float8_e4m3fn"), "block_size": 32, "scaling_mode": Call(SCALING, ("floor",)),
             "kernel_preference": Call(KERNEL, ("emulated",)), "is_swizzled_scales": False}
    return NewObj(MX_KWARGS, {k: v for k, v in {**state, **edits}.items() if v is not DROP})


def _state(cls: str, **edits: Any) -> dict[str, Any]:
    if cls == MX:
        state = {"qdata": _tensor("0", "float8_e4m3fn", (4, 64)), "scale": _tensor("1", "float8_e8m0fnu", (4, 2)),
                 "elem_dtype": G("torch", "float8_e4m3fn"), "block_size": 32, "orig_dtype": G("torch", "float32"),
                 "kernel_preference": Call(KERNEL, ("emulated",)), "act_quant_kwargs": _kwargs(),
                 "is_swizzled_scales": False}
    else:
        state = {"qdata": _tensor("0", "uint8", (4, 32)), "scale": _tensor("1", "float8_e4m3fn", (4, 4)),
                 "block_size": 16, "orig_dtype": G("torch", "float32"), "per_tensor_scale": _tensor("2", "float32", ()),
                 "act_per_tensor_scale": None, "is_swizzled_scales": False, "use_triton_kernel": False,
                 "act_quant_kwargs": None}
    return {k: v for k, v in {**state, **edits}.items() if v is not DROP}


def _record(cls: str, state: dict[str, Any], dtype: str = "float32") -> Call:
    """``torch._tensor._rebuild_from_type_v2`` of a wrapper subclass, as torch.save writes it."""
    klass = G(*cls.rsplit(".", 1))
    shape = (4, 64)
    args = (klass, G("torch", dtype), shape, _stride(shape), 0,
            Call(G("torch.serialization", "_get_layout"), ("torch.strided",)), Call(G("torch", "device"), ("cpu",)),
            False)
    return Call(G("torch._tensor", "_rebuild_from_type_v2"),
                (G("torch._utils", "_rebuild_wrapper_subclass"), klass, args, state))


class _ImportWatch(importlib.abc.MetaPathFinder):
    """Records every attempt to import torchao or the sentinel module (and lets none of them through)."""

    def __init__(self) -> None:
        self.tried: list[str] = []

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if name.split(".")[0] in ("torchao", SENTINEL):
            self.tried.append(name)
            raise ImportError(f"{name} must not be imported")
        return None


@pytest.fixture
def no_imports(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> _ImportWatch:
    """torchao out of ``sys.modules`` and a sentinel module that marks its import on disk: every import of
    either is recorded and refused, so a global resolved through the import system shows."""
    for name in [m for m in sys.modules if m.split(".")[0] == "torchao"]:
        monkeypatch.delitem(sys.modules, name)
    (tmp_path / f"{SENTINEL}.py").write_text(f"open({str(tmp_path / 'imported')!r}, 'w').close()\nboom = print\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    watch = _ImportWatch()
    monkeypatch.setattr(sys, "meta_path", [watch, *sys.meta_path])
    yield watch
    assert watch.tried == [] and not (tmp_path / "imported").exists()
    assert not [m for m in sys.modules if m.split(".")[0] in ("torchao", SENTINEL)]


def test_hand_made_records_read_as_the_subclasses_they_name(no_imports: _ImportWatch) -> None:
    """The records below are refused for their edit alone: unedited, both readers take them."""
    for cls, parts in ((MX, ["qdata", "scale"]), (NVFP4, ["qdata", "scale", "per_tensor_scale"])):
        scan = scan_pickle(_pickled({"w": _record(cls, _state(cls))}))
        assert [n for n, _ in scan.subclasses["w"].parts] == parts and scan.opaque == set()
        header = item_header(_pickled(_record(cls, _state(cls))))
        assert isinstance(header, SubclassHeader) and [n for n, _ in header.parts] == parts
        assert header.context == scan.subclasses["w"].context


_SENTINEL_GLOBAL = G(SENTINEL, "boom")

#: A crafted record (class, its state) and what its refusal says, in the whole-file reader's and the DCP item
#: reader's words.
_CRAFTED = {
    "unknown enum value": (MX, {"kernel_preference": Call(KERNEL, ("fastest",))}, "has no member 'fastest'"),
    "member of another enum": (MX, {"kernel_preference": Call(SCALING, ("floor",))}, r"MXTensor.kernel_preference"),
    "dtype where an enum is": (MX, {"kernel_preference": G("torch", "float32")}, r"MXTensor.kernel_preference"),
    "extra attribute": (MX, {"backdoor": 1}, "has no attribute 'backdoor'"),
    "extra inner tensor": (MX, {"bias": _tensor("2", "float32", (4,))}, "has no inner tensor 'bias'"),
    "missing scale": (MX, {"scale": DROP}, "without its 'scale'"),
    "missing attribute": (MX, {"block_size": DROP}, "without its 'block_size'"),
    "int as a string": (MX, {"block_size": "32"}, r"type str is not what .*MXTensor.block_size"),
    "bool as an int": (MX, {"is_swizzled_scales": 1}, r"type int is not what .*is_swizzled_scales"),
    "dtype as a string": (MX, {"orig_dtype": "torch.float32"}, r"type str is not what .*orig_dtype"),
    "number as an inner tensor": (MX, {"scale": 3}, r"type int is not what .*MXTensor.scale"),
    "subclass as an inner tensor": (MX, {"scale": _record(MX, _state(MX))}, r"MXTensor.scale"),
    "another original dtype": (MX, {"orig_dtype": G("torch", "bfloat16")}, "another original dtype"),
    "global as an attribute": (MX, {"is_swizzled_scales": _SENTINEL_GLOBAL},
                               rf"{SENTINEL}.boom is not part|type type is not what"),
    "call of a global as an attribute": (MX, {"block_size": Call(_SENTINEL_GLOBAL, ("x",))},
                                         rf"{SENTINEL}.boom is not part|type {SENTINEL}.boom is not what"),
    "settings with a field missing": (MX, {"act_quant_kwargs": _kwargs(scaling_mode=DROP)},
                                      "without its 'scaling_mode'"),
    "settings with a field of another type": (MX, {"act_quant_kwargs": _kwargs(block_size=2.5)},
                                              r"type float is not what .*QuantizeTensorToMXKwargs.block_size"),
    "settings with an extra field": (MX, {"act_quant_kwargs": _kwargs(extra=True)}, "has no attribute 'extra'"),
    "global in a settings field": (MX, {"act_quant_kwargs": _kwargs(scaling_mode=_SENTINEL_GLOBAL)},
                                   rf"{SENTINEL}.boom is not part|type type is not what"),
    "NVFP4 scale as a number": (NVFP4, {"per_tensor_scale": 0.5}, r"type float is not what .*per_tensor_scale"),
    "NVFP4 without its block size": (NVFP4, {"block_size": DROP}, "without its 'block_size'"),
}


@pytest.mark.parametrize("case", sorted(_CRAFTED))
def test_crafted_subclass_records_are_refused_by_both_readers(case: str, no_imports: _ImportWatch) -> None:
    cls, edits, why = _CRAFTED[case]
    with pytest.raises(BadPickle, match=why):
        scan_pickle(_pickled({"w": _record(cls, _state(cls, **edits))}))
    with pytest.raises(pickle.UnpicklingError, match=why):
        item_header(_pickled(_record(cls, _state(cls, **edits))))


def _archive(path: Path, pkl: bytes) -> Path:
    """A torch.save archive of data.pkl ``pkl`` and the storages of :func:`_state`'s MXTensor."""
    writer = torch._C.PyTorchFileWriter(str(path))  # torch's own zip writer: a well-formed archive
    for name, data in (("data.pkl", pkl), ("byteorder", b"little"), ("version", b"3\n"),
                       ("data/0", bytes(range(256))), ("data/1", b"\x7f" * 8)):
        writer.write_record(name, data, len(data))
    writer.write_end_of_file()
    return path


def test_verify_deep_refuses_a_crafted_subclass_file_and_imports_no_torchao(tmp_path: Path) -> None:
    """End to end, in a fresh interpreter (``-X importtime`` lists every module it imports): the hand-made
    file verifies, the one with an attribute MXTensor does not have is refused as a pickle that cannot be read
    safely (exit 1, one line, no traceback), torchao is never imported and neither file changes."""
    good = _archive(tmp_path / "good.pt", _pickled({"w": _record(MX, _state(MX))}))
    bad = _archive(tmp_path / "bad.pt", _pickled({"w": _record(MX, _state(MX, backdoor=G(SENTINEL, "boom")))}))
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), str(tmp_path)]))
    codes = {}
    for path in (good, bad):
        done = subprocess.run([sys.executable, "-X", "importtime", "-m", "ckptverify", "verify", "--deep", "--json",
                               str(path)], capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
        assert "Traceback" not in done.stderr, done.stderr[-3000:]
        imported = {line.rsplit("|", 1)[-1].strip().split(".")[0] for line in done.stderr.splitlines()
                    if line.startswith("import time:")}
        assert "ckptverify" in imported and not imported & {"torchao", SENTINEL}
        codes[path.name] = done.returncode
        report = json.loads(done.stdout)
        if path is bad:
            (f,) = [f for f in report["findings"] if f["severity"] == "error"]
            assert f["check"] == "pickle-structure" and "has no attribute 'backdoor'" in f["message"], report
    assert codes == {"good.pt": 0, "bad.pt": 1}
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.name in before} == before
