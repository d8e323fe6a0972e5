"""The safe metadata reader against the installed torch: breaks loudly if DCP's classes change."""

from __future__ import annotations

import dataclasses
import importlib
import io
import os
import pickle

import pytest
import torch
import torch.distributed.checkpoint as dcp

from ckptverify.dcp import metadata as md
from ckptverify.dcp import metadata_pickle
from ckptverify.dcp.layout import DTYPE_ITEMSIZE


def _save(tmp_path, state, **kw):
    path = tmp_path / "ckpt"
    dcp.save(state, checkpoint_id=str(path), **kw)
    return path


def _globals_in(data: bytes) -> set[str]:
    """Every global a (trusted, test-made) pickle names."""
    names: set[str] = set()

    class Recorder(pickle.Unpickler):
        def find_class(self, module, name):
            names.add(f"{module}.{name}")
            return super().find_class(module, name)

    Recorder(io.BytesIO(data)).load()
    return names


def test_every_global_dcp_writes_is_allowlisted(tmp_path):
    state = {"f": torch.randn(3, 4), "i": torch.arange(5), "b": torch.ones(2, dtype=torch.bool),
             "h": torch.zeros(4, dtype=torch.bfloat16), "x": {"n": 3, "s": "text"}}
    path = _save(tmp_path, state)
    used = _globals_in((path / ".metadata").read_bytes())
    assert used, "expected DCP metadata to name globals"
    refused = used - metadata_pickle.ALLOWED_GLOBALS
    assert not refused, f"DCP now pickles globals the reader refuses: {refused}"


def test_dcp_dataclass_fields_are_the_ones_the_reader_expects():
    for kind in metadata_pickle.KINDS.values():
        if kind.module.startswith("megatron"):
            continue
        cls = getattr(importlib.import_module(kind.module), kind.name)
        fields = tuple(f.name for f in dataclasses.fields(cls))
        assert fields == kind.fields, f"{kind.module}.{kind.name} fields changed: {fields} (reader: {kind.fields})"


def test_tensor_properties_still_pickle_as_a_five_tuple():
    from torch.distributed.checkpoint.metadata import TensorProperties

    state = TensorProperties(dtype=torch.float16).__getstate__()
    assert isinstance(state, tuple) and len(state) == 5 and state[0] is torch.float16


def test_every_torch_dtype_is_known():
    dtypes = {str(v).removeprefix("torch.") for v in vars(torch).values() if isinstance(v, torch.dtype)}
    missing = dtypes - set(DTYPE_ITEMSIZE)
    assert not missing, f"torch has dtypes the layout does not know: {sorted(missing)}"
    for name, size in DTYPE_ITEMSIZE.items():
        dtype = getattr(torch, name, None)
        if dtype is not None:
            assert dtype.itemsize == size, name


def test_layout_matches_what_dcp_itself_reads(tmp_path):
    state = {"w": torch.randn(6, 5), "v": torch.arange(7), "meta": {"step": 3}}
    path = _save(tmp_path, state)
    layout, findings = md.read_layout(str(path))
    assert findings == [] and layout is not None
    real = dcp.FileSystemReader(str(path)).read_metadata()
    assert set(layout.tensors) == {k for k, v in real.state_dict_metadata.items() if hasattr(v, "chunks")}
    assert layout.byte_values == {"meta.step"}
    assert layout.tensors["w"].dtype == "float32" and layout.tensors["w"].shape == (6, 5)
    real_items = {(k.fqn, None if k.offset is None else tuple(k.offset)): (v.relative_path, v.offset, v.length)
                  for k, v in real.storage_data.items()}
    ours = {(i.fqn, i.chunk.offsets if i.chunk else None): (i.file, i.offset, i.length) for i in layout.items}
    assert ours == real_items
    assert layout.dcp_version == real.version


class _Canary:
    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_hostile_pickle_is_refused_and_never_run(tmp_path):
    canary = tmp_path / "canary"
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / ".metadata").write_bytes(pickle.dumps(_Canary(str(canary))))
    layout, findings = md.read_layout(str(ckpt))
    assert layout is None
    assert [f.check for f in findings] == ["metadata-unsafe"]
    assert findings[0].actual in ("builtins.open", "io.open")
    assert not canary.exists()


def test_hostile_global_nested_inside_real_metadata_is_refused(tmp_path):
    path = _save(tmp_path, {"w": torch.ones(2)})
    real = pickle.loads((path / ".metadata").read_bytes())
    real.planner_data = {"evil": _Canary(str(tmp_path / "canary"))}
    (path / ".metadata").write_bytes(pickle.dumps(real))
    layout, findings = md.read_layout(str(path))
    assert layout is None and findings[0].check == "metadata-unsafe"
    assert not (tmp_path / "canary").exists()


@pytest.mark.parametrize("bad", ["../outside.distcp", "/etc/passwd", "a/../../b", "", "x\x00y", "..", "a\\b"])
def test_storage_paths_outside_the_directory_are_refused(tmp_path, bad):
    path = _save(tmp_path, {"w": torch.ones(2)})
    real = pickle.loads((path / ".metadata").read_bytes())
    for info in real.storage_data.values():
        info.relative_path = bad
    (path / ".metadata").write_bytes(pickle.dumps(real))
    layout, findings = md.read_layout(str(path))
    assert any(f.check == "metadata-unsafe" for f in findings)
    assert layout is not None and layout.items == []


def test_a_storage_path_outside_the_directory_is_refused_by_the_safe_reader(tmp_path):
    from ckptverify.dcp.storage_reader import SafeFileSystemReader
    from ckptverify.errors import CheckpointRefusedError

    path = _save(tmp_path, {"w": torch.ones(2)})
    real = pickle.loads((path / ".metadata").read_bytes())
    for info in real.storage_data.values():
        info.relative_path = "../outside.distcp"
    (path / ".metadata").write_bytes(pickle.dumps(real))
    with pytest.raises(CheckpointRefusedError, match=r"path '\.\./outside\.distcp' of 'w' leaves the checkpoint"):
        SafeFileSystemReader(str(path)).read_metadata()


def test_the_safe_reader_refuses_unreadable_metadata_and_completes_an_old_one(tmp_path):
    from ckptverify.dcp.storage_reader import SafeFileSystemReader
    from ckptverify.errors import CheckpointRefusedError

    path = _save(tmp_path, {"w": torch.ones(2)})
    good = (path / ".metadata").read_bytes()
    real = pickle.loads(good)
    real.storage_meta = None  # as DCP before storage_meta wrote it
    (path / ".metadata").write_bytes(pickle.dumps(real))
    reader = SafeFileSystemReader(str(path))
    assert reader.read_metadata().storage_meta.load_id == reader.load_id
    (path / ".metadata").write_bytes(b"not a pickle")
    with pytest.raises(CheckpointRefusedError, match=r"^refusing \.metadata: "):
        SafeFileSystemReader(str(path)).read_metadata()
    (path / ".metadata").unlink()
    (path / ".metadata").mkdir()
    with pytest.raises(CheckpointRefusedError, match=r"^cannot read \.metadata: "):
        SafeFileSystemReader(str(path)).read_metadata()


def test_a_storage_entry_listed_twice_is_unreadable(tmp_path):
    """Real unpickling would keep one of two equal keys; the safe parse keeps both and refuses the repeat."""
    path = _save(tmp_path, {"w": torch.ones(2)})
    real = pickle.loads((path / ".metadata").read_bytes())
    (key, info), = real.storage_data.items()
    real.storage_data = {key: info, dataclasses.replace(key, fqn="Q"): info}
    data = pickle.dumps(real)
    assert data.count(b"\x8c\x01Q") == 1
    # The second key renamed to the first: a real dict would keep one of the two, the bytes hold both.
    (path / ".metadata").write_bytes(data.replace(b"\x8c\x01Q", b"\x8c\x01w"))
    layout, findings = md.read_layout(str(path))
    assert layout is None and findings[0].check == "metadata-unreadable"
    assert "storage entry 'w' at (0,) appears twice" in findings[0].message


def _hostile_planner_data():
    from torch.distributed.checkpoint.metadata import _MEM_FORMAT_ENCODING, BytesStorageMetadata, MetadataIndex
    from torch.distributed.checkpoint.planner import SavePlan, WriteItem

    return {
        "a string in planner_data is too long": "x" * (md.MAX_STRING + 1),
        "planner_data holds a _MEM_FORMAT_ENCODING": [_MEM_FORMAT_ENCODING.TORCH_CHANNELS_LAST],
        "planner_data has a dict key of type Obj": {MetadataIndex("w"): 1},
        "usable of a plan in planner_data must be a bool, got 'yes'": SavePlan(items=[], usable="yes"),
        "a write item in planner_data has no WriteItemType": [WriteItem(index=MetadataIndex("w"), type=None)],
        "planner_data holds a BytesStorageMetadata, which belongs elsewhere": {"w": BytesStorageMetadata()},
    }


@pytest.mark.parametrize("message", sorted(_hostile_planner_data()))
def test_planner_data_holding_what_dcp_never_writes_there_is_unreadable(tmp_path, message):
    path = _save(tmp_path, {"w": torch.ones(2)})
    real = pickle.loads((path / ".metadata").read_bytes())
    real.planner_data = _hostile_planner_data()[message]
    (path / ".metadata").write_bytes(pickle.dumps(real))
    layout, findings = md.read_layout(str(path))
    assert layout is None and findings[0].check == "metadata-unreadable"
    assert message in findings[0].message


@pytest.mark.parametrize("field,value", [("offset", -1), ("length", 2**70), ("offset", "12"), ("length", True)])
def test_hostile_offsets_and_lengths_are_unreadable_not_trusted(tmp_path, field, value):
    path = _save(tmp_path, {"w": torch.ones(2)})
    real = pickle.loads((path / ".metadata").read_bytes())
    for info in real.storage_data.values():
        setattr(info, field, value)
    (path / ".metadata").write_bytes(pickle.dumps(real))
    layout, findings = md.read_layout(str(path))
    assert layout is None and findings[0].check == "metadata-unreadable"


def test_garbage_and_empty_metadata_are_unreadable(tmp_path):
    for content in (b"", b"not a pickle", os.urandom(64), pickle.dumps({"a": 1})):
        ckpt = tmp_path / f"c{len(content)}"
        ckpt.mkdir()
        (ckpt / ".metadata").write_bytes(content)
        layout, findings = md.read_layout(str(ckpt))
        assert layout is None and findings[0].check == "metadata-unreadable", content


def test_no_metadata_is_an_incomplete_checkpoint(tmp_path):
    layout, findings = md.read_layout(str(tmp_path))
    assert layout is None and [f.check for f in findings] == ["metadata-missing"]


@pytest.mark.parametrize("use_collectives", [True, False])
def test_the_readers_layout_is_read_layouts_and_what_it_parsed_is_loaded(tmp_path, monkeypatch, use_collectives):
    """The reader's layout is :func:`read_layout`'s (one ``.metadata``, or the per-rank files merged), and
    ``read_metadata`` builds DCP's metadata from the file it parsed for it, without parsing it again."""
    from ckptverify.dcp.storage_reader import SafeFileSystemReader

    path = _save(tmp_path, {"w": torch.randn(6, 5), "meta": {"step": 3}}, use_collectives=use_collectives)
    reader = SafeFileSystemReader(str(path))
    assert reader.layout() == md.read_layout(str(path))[0]
    monkeypatch.setattr(md, "parse_metadata", lambda *a: pytest.fail("parsed twice"))
    metadata = reader.read_metadata() if use_collectives else reader.read_metadata(rank=0)
    assert sorted(metadata.state_dict_metadata) == ["meta.step", "w"]
