"""Hostile metadata (a fallback to a second metadata file, shared stand-ins, malformed state) against verify,
the safe reader and load."""

from __future__ import annotations

import contextlib
import os
import pickle
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

import ckptverify
from ckptverify.audit.verify import verify_checkpoint
from ckptverify.dcp import metadata as md
from ckptverify.dcp import metadata_pickle as sp
from ckptverify.dcp.storage_reader import SafeFileSystemReader
from ckptverify.errors import BadPickle, CheckpointRefusedError


class _Canary:
    """Unpickling this creates the file ``path``: proof that a payload ran."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


class _RaisesOnLoad:
    """Pickles as ``torch.Size(("boom",))``: harmless to a stand-in, but real unpickling raises."""

    def __reduce__(self):
        return (torch.Size, (("boom",),))


def _state(seed: int = 0) -> ckptverify.TrainState:
    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 3)
    return ckptverify.TrainState(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))


def _save(tmp_path: Path) -> Path:
    path = tmp_path / "ckpt"
    ckptverify.save(_state(), path)
    return path


def _cli_verify(path: Path) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=os.getcwd() + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-m", "ckptverify", "verify", str(path)], capture_output=True,
                          text=True, timeout=300, env=env)


def _plant_attack(path: Path, canary: Path) -> None:
    real = pickle.loads((path / ".metadata").read_bytes())  # test-made, trusted
    real.planner_data = {"x": _RaisesOnLoad()}
    (path / ".metadata").write_bytes(pickle.dumps(real))
    (path / "__0.metadata").write_bytes(pickle.dumps(_Canary(str(canary))))


def test_the_attack_is_real_against_plain_dcp(tmp_path):
    path = _save(tmp_path)
    canary = tmp_path / "canary"
    _plant_attack(path, canary)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with contextlib.suppress(BaseException):
            dcp.load(_state(1).state_dict(), checkpoint_id=str(path))
    assert canary.exists(), "torch no longer falls back to __0.metadata; the attack test below proves less"


def test_fallback_attack_fails_verify_and_load_and_never_runs(tmp_path):
    path = _save(tmp_path)
    canary = tmp_path / "canary"
    _plant_attack(path, canary)

    report = verify_checkpoint(path)
    checks = {f.check for f in report.errors}
    assert "metadata-unreadable" in checks  # .metadata: torch.Size of a string
    assert "metadata-stray" in checks and "metadata-unsafe" in checks  # __0.metadata beside it, and hostile
    proc = _cli_verify(path)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr

    with pytest.raises(CheckpointRefusedError):
        ckptverify.load(_state(1), path)
    with pytest.raises(BaseException):  # noqa: B017 - whatever DCP wraps the refusal in
        ckptverify.load(_state(1), path, verify="off")
    with pytest.raises(CheckpointRefusedError, match="refusing"):
        SafeFileSystemReader(str(path)).read_metadata()
    with pytest.raises(CheckpointRefusedError, match="refusing"):
        SafeFileSystemReader(str(path)).read_metadata(rank=0)
    assert not canary.exists()


def test_hostile_rank_metadata_alone_is_refused_by_reader_and_verify(tmp_path):
    path = _save(tmp_path)
    os.rename(path / ".metadata", path / "__0.metadata")
    canary = tmp_path / "canary"
    (path / "__1.metadata").write_bytes(pickle.dumps(_Canary(str(canary))))
    assert any(f.check == "metadata-unsafe" for f in verify_checkpoint(path).errors)
    with pytest.raises(CheckpointRefusedError, match="refusing"):
        SafeFileSystemReader(str(path)).read_metadata(rank=1)
    assert not canary.exists()


def test_stray_rank_metadata_beside_clean_metadata_is_an_error(tmp_path):
    path = _save(tmp_path)
    (path / "__3.metadata").write_bytes((path / ".metadata").read_bytes())
    report = verify_checkpoint(path)
    assert [f.check for f in report.errors] == ["metadata-stray"]
    assert report.errors[0].location.file == "__3.metadata"


def test_clean_checkpoint_loads_through_the_safe_reader(tmp_path):
    path = _save(tmp_path)
    state = _state(5)
    report = ckptverify.load(state, path)
    assert report.errors == []
    assert torch.equal(state.model.weight, _state(0).model.weight)


def test_build_state_none_five_is_a_finding_not_a_typeerror(tmp_path):
    # PROTO 2, GLOBAL Metadata, EMPTY_TUPLE, NEWOBJ, (None, 5) state, BUILD, STOP.
    data = (b"\x80\x02ctorch.distributed.checkpoint.metadata\nMetadata\n)\x81N\x4b\x05\x86b.")
    (tmp_path / ".metadata").write_bytes(data)
    layout, findings = md.read_layout(str(tmp_path))
    assert layout is None and [f.check for f in findings] == ["metadata-unreadable"]
    assert "slot state" in findings[0].message
    tiny = b"\x80\x02NNK\x05\x86b."  # BUILD (None, 5) onto None: 9 bytes, no global at all
    with pytest.raises(Exception):  # noqa: B017 - real unpickling fails too
        pickle.loads(tiny)
    (tmp_path / ".metadata").write_bytes(tiny)
    layout, findings = md.read_layout(str(tmp_path))
    assert layout is None and [f.check for f in findings] == ["metadata-unreadable"]


def _evil_build_on_global(target: bytes, state: bytes) -> bytes:
    """A pickle that BUILDs ``state`` onto the global ``target`` (``module\\nname\\n``)."""
    return b"\x80\x02c" + target + state + b"b."


@pytest.mark.parametrize("target", [
    b"torch\nSize\n", b"torch\nfloat32\n", b"torch.distributed.checkpoint.metadata\nMetadata\n",
    b"torch.distributed.checkpoint.metadata\nTensorStorageMetadata\n",
    b"torch.distributed.checkpoint.metadata\n_MEM_FORMAT_ENCODING\n",
])
def test_hostile_metadata_cannot_change_later_parses(tmp_path, target):
    clean = _save(tmp_path)
    assert verify_checkpoint(clean).errors == []
    hostile = tmp_path / "hostile"
    hostile.mkdir()
    # dict state and slot state: try to overwrite attributes of the shared global.
    for state in (b"}X\x04\x00\x00\x00kindX\x03\x00\x00\x00bads", b"N}X\x05\x00\x00\x00fieldsK\x01s\x86",
                  b"N}X\x06\x00\x00\x00_labelK\x01s\x86"):
        (hostile / ".metadata").write_bytes(_evil_build_on_global(target, state))
        layout, findings = md.read_layout(str(hostile))
        assert layout is None and findings and findings[0].check == "metadata-unreadable"
    assert verify_checkpoint(clean).errors == []
    assert md.read_layout(str(clean))[1] == []


def _laughs(depth: int, width: int = 10) -> bytes:
    """A memoized pickle: a list of ``width`` references to a list of ``width`` references ... ``depth``
    levels, under a Metadata's planner_data. Tiny on disk, ``width ** depth`` nodes when walked."""
    out = bytearray(b"\x80\x04")
    out += b"\x8c\x25torch.distributed.checkpoint.metadata\x8c\x08Metadata\x93)\x81"
    out += b"\x8c\x01x\x940"  # memo 0: the leaf (then popped)
    out += b"}(\x8c\x13state_dict_metadata}\x8c\x0cstorage_data}\x8c\x0cplanner_data"
    for level in range(depth):
        out += b"("
        out += bytes([0x68, level]) * width  # BINGET previous
        out += b"l\x94"  # LIST, MEMOIZE as level + 1
        if level < depth - 1:
            out += b"0"  # POP: only the top level stays on the stack
    out += b"ub."
    return bytes(out)


def test_billion_laughs_is_refused_by_the_budget(tmp_path):
    data = _laughs(9)  # 10^9 leaves in ~1 KB
    assert len(data) < 2000
    with pytest.raises(BadPickle, match="asks for more"):
        sp.parse(data)
    (tmp_path / ".metadata").write_bytes(data)
    layout, findings = md.read_layout(str(tmp_path))
    assert layout is None and "more work" in findings[0].message
    # The same shape a few levels deep is within budget and parses (the budget is not a blanket refusal).
    tree = sp.parse(_laughs(3))
    assert isinstance(tree, sp.Obj)


def test_budget_counts_each_node_once_per_reference():
    data = _laughs(4)  # 10^4 leaves: within budget, and the count shows what was charged
    budget = sp._budget(10**9)  # the budget of a pickle of 10**9 bytes: ample
    raw = sp._SafeUnpickler(data, sp._allowlist(budget), budget).load()
    before = budget.left
    sp._Plain(budget).convert(raw, 0)
    charged = before - budget.left
    assert 10**4 <= charged <= 3 * 10**4


@pytest.mark.parametrize("index", [2**28, 2**31 - 1])
def test_a_huge_memo_index_is_refused_at_once(index):
    # LONG_BINPUT with a huge index: the C unpickler (which DCP uses) would zero-fill index * 16 bytes, or
    # fail with MemoryError and so make dcp.load fall back to another file. Refused here, without allocating.
    data = b"\x80\x04\x8c\x25torch.distributed.checkpoint.metadata\x8c\x08Metadata\x93r" + index.to_bytes(4, "little")
    with pytest.raises(BadPickle, match="memo index"):
        sp.parse(data + b".")


@pytest.mark.parametrize("data", [
    b"\x80\x02]K\x00b.",  # BUILD a falsy state onto a list: the Python unpickler skips it, the C one raises
    b"\x80\x02]K\x00N\x86b.",  # BUILD (0, None) onto a list: the same, as (state, slot state)
])
def test_where_python_unpickling_is_lenient_the_safe_parse_is_not(data):
    with pytest.raises(Exception):  # noqa: B017 - whatever the C unpickler raises
        pickle.loads(data)
    with pytest.raises(BadPickle):
        sp.parse(data)


@pytest.mark.parametrize("layout", ["single", "threads", "per_item", "safetensors", "fsdp2", "nocoll"])
def test_safe_reader_gives_dcp_the_same_metadata_in_every_layout(fresh_ckpt, layout):
    from helpers.ckpt_factory import safetensors_supported

    if layout == "safetensors" and not safetensors_supported():
        pytest.skip("this torch has no safetensors serialization")
    path = fresh_ckpt(layout)
    ranks = [None] if (path / ".metadata").exists() else [0, 1]
    for rank in ranks:
        kwargs = {} if rank is None else {"rank": rank}
        real = dcp.FileSystemReader(str(path)).read_metadata(**kwargs)  # test-made checkpoint: trusted
        ours = SafeFileSystemReader(str(path)).read_metadata(**kwargs)
        ours.storage_meta.load_id = real.storage_meta.load_id
        assert ours == real
        assert pickle.dumps(ours) == pickle.dumps(real)


@pytest.mark.parametrize("value", [
    b"ctorch.distributed.checkpoint.metadata\n_MEM_FORMAT_ENCODING\nK\x00\x85R",  # an enum member
    b"cpathlib\nPosixPath\nX\x01\x00\x00\x00a\x85R",  # a path
    b"ctorch\nSize\nK\x01K\x02\x86\x85R",  # a torch.Size
])
def test_values_made_by_stand_ins_cannot_be_rewritten(value):
    # BUILD a new state onto the value after the stand-in checked it (a frozen slotted dataclass would obey).
    for state in (b"X\x0d\x00\x00\x00WriteItemTypeK\x63\x86", b"}X\x01\x00\x00\x00aK\x01s"):
        with pytest.raises(BadPickle):
            sp.parse(b"\x80\x02" + value + state + b"b.")


def _built(cls: str, state: bytes) -> bytes:
    """A protocol-4 pickle of a DCP metadata dataclass made by NEWOBJ, then BUILD with ``state`` (pickle opcodes)."""
    def text(v: str) -> bytes:
        return b"\x8c" + bytes([len(v)]) + v.encode()

    return (b"\x80\x04" + text("torch.distributed.checkpoint.metadata") + text(cls) + b"\x93)\x81"
            + state + b"b.")


def test_slot_state_is_set_on_a_plain_dataclass_and_refused_on_a_frozen_one():
    """pickle sets a (dict, slots) state's slots with setattr, which a frozen dataclass refuses."""
    slots = b"N}" + b"\x8c\x03fqn\x8c\x01w" + b"s\x86"  # (None, {"fqn": "w"})
    with pytest.raises(BadPickle, match="MetadataIndex is frozen; setting attributes on it fails"):
        sp.parse(_built("MetadataIndex", slots))
    from dataclasses import FrozenInstanceError

    with pytest.raises(FrozenInstanceError):
        pickle.loads(_built("MetadataIndex", slots))  # test-made: what real unpickling does
    empty = sp.parse(_built("BytesStorageMetadata", b"N}\x86"))  # (None, {}): nothing to set
    assert empty.kind == "BytesStorageMetadata"

