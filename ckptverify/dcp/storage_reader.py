"""A DCP ``StorageReader`` that never unpickles checkpoint bytes: :class:`SafeFileSystemReader`.

``FileSystemReader.read_metadata`` is ``pickle.load`` on ``.metadata`` (or ``__{rank}.metadata``) with
every global available, and ``dcp.load`` retries with ``__{rank}.metadata`` whenever the first call raises.
This reader instead parses the file with :func:`ckptverify.dcp.metadata.parse_metadata` (allowlist,
stand-ins, budget, every field validated) and only then **constructs** torch's real ``Metadata``,
``TensorStorageMetadata``, ``MetadataIndex``, ``_StorageInfo``, ... from the validated values. Nothing in
the file chooses what is constructed beyond those validated values. It also closes DCP's fallback: with
``.metadata`` present it refuses any ``__N.metadata`` (and refuses ``.metadata`` itself while a
``__N.metadata`` lies beside it), so a hostile per-rank file is never read in place of a broken
``.metadata``.

Works for every layout ``FileSystemWriter`` writes: one ``.metadata``, per-rank ``__N.metadata``
(``use_collectives=False``), and the safetensors serialization (its metadata has the same structure).
Tensor and byte items are still read by ``FileSystemReader.read_data`` (``torch.load(weights_only=True)``);
non-tensor values additionally go through :class:`~ckptverify.dcp.loading.SafeLoadPlanner`.
"""

from __future__ import annotations

import os
from typing import Any

from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata

from ckptverify.dcp import metadata as md
from ckptverify.dcp import safepickle as sp
from ckptverify.errors import UnsafeMetadataError


class SafeFileSystemReader(FileSystemReader):
    """``FileSystemReader`` whose ``read_metadata`` builds real DCP objects from safely parsed metadata."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        rank = kwargs.get("rank")
        root = os.fspath(self.path)
        name = md.METADATA_FILE if rank is None else f"__{int(rank)}.metadata"
        names = md.metadata_files(root)
        if rank is not None and md.METADATA_FILE in names:
            raise UnsafeMetadataError(
                f"refusing {name}: {root} has a .metadata, so the per-rank file is a second entry point; "
                "DCP reads it only because .metadata failed")
        if rank is None and len(names) > 1 and md.METADATA_FILE in names:
            raise UnsafeMetadataError(
                f"refusing {root}: per-rank metadata {names[1]} lies beside .metadata (run ckptverify verify)")
        metadata = build_metadata(load_parsed(os.path.join(root, name), name))
        if metadata.storage_meta is None:
            from torch.distributed.checkpoint.metadata import StorageMeta

            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def load_parsed(path: str, name: str) -> md.ParsedMetadata:
    """Read and validate one metadata file; :class:`~ckptverify.errors.UnsafeMetadataError` on anything wrong."""
    try:
        parsed = md.parse_metadata(md.read_metadata_bytes(path), name)
    except FileNotFoundError:
        raise
    except OSError as exc:
        raise UnsafeMetadataError(f"cannot read {name}: {exc.strerror or exc}") from None
    except sp.UnsafeGlobal as exc:
        raise UnsafeMetadataError(f"refusing {name}: it asks to load the global {exc.name}") from None
    except (sp.BadPickle, md.BadMetadata) as exc:
        raise UnsafeMetadataError(f"refusing {name}: {exc}") from None
    if parsed.unsafe_paths:
        fqn, _, raw = parsed.unsafe_paths[0]
        raise UnsafeMetadataError(f"refusing {name}: storage path {raw!r} of {fqn!r} leaves the checkpoint")
    return parsed


def build_metadata(parsed: md.ParsedMetadata) -> Metadata:
    """Construct torch's ``Metadata`` from a validated parse (no unpickling)."""
    import torch
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        ChunkStorageMetadata,
        MetadataIndex,
        TensorStorageMetadata,
    )

    sd: dict[str, Any] = {}
    for fqn, entry in parsed.entries.items():
        if entry is None:
            sd[fqn] = BytesStorageMetadata()
            continue
        chunks = [ChunkStorageMetadata(offsets=torch.Size(c.offsets), sizes=torch.Size(c.sizes)) for c in entry.chunks]
        sd[fqn] = TensorStorageMetadata(properties=_properties(entry.properties), size=torch.Size(entry.shape),
                                        chunks=chunks)
    storage: dict[Any, Any] = {}
    for s in parsed.storage:
        key = MetadataIndex(fqn=s.fqn, offset=s.chunk_offsets, index=s.index)
        storage[key] = _StorageInfo(relative_path=s.relative_path, offset=s.offset, length=s.length,
                                    transform_descriptors=None if s.transforms is None else list(s.transforms))
    metadata = Metadata(state_dict_metadata=sd, planner_data=_real(parsed.planner_data), storage_data=storage,
                        storage_meta=_storage_meta(parsed.storage_meta), version=parsed.version)
    for name, value in parsed.extras.items():
        setattr(metadata, name, _real(value))
    return metadata


def _dtype(name: str) -> Any:
    import torch

    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise UnsafeMetadataError(f"this torch has no dtype {name!r}")
    return dtype


def _layout(name: str) -> Any:
    import torch

    value = getattr(torch, name.removeprefix("torch."), None) if name.startswith("torch.") else None
    if not isinstance(value, torch.layout) or str(value) != name:
        raise UnsafeMetadataError(f"this torch has no layout {name!r}")
    return value


def _properties(p: md.TensorProps) -> Any:
    import torch
    from torch.distributed.checkpoint.metadata import TensorProperties

    memory_format = (torch.contiguous_format, torch.channels_last, torch.preserve_format)[p.memory_format]
    return TensorProperties(dtype=_dtype(p.dtype), layout=_layout(p.layout), requires_grad=p.requires_grad,
                            memory_format=memory_format, pin_memory=p.pin_memory)


def _storage_meta(info: md.StorageMetaInfo | None) -> Any:
    if info is None:
        return None
    import pathlib

    from torch.distributed.checkpoint.metadata import StorageMeta

    cid: Any = info.checkpoint_id
    if cid is not None and info.checkpoint_id_is_path:
        cid = pathlib.Path(cid)
    return StorageMeta(checkpoint_id=cid, save_id=info.save_id, load_id=info.load_id, modules=list(info.modules))


def _real(value: Any) -> Any:
    """The real object for a validated inert value (plain data and DCP planner dataclasses)."""
    import pathlib

    import torch

    t = type(value)
    if value is None or t in (str, int, float, bool, bytes):
        return value
    if t is list:
        return [_real(v) for v in value]
    if t is tuple:
        return tuple(_real(v) for v in value)
    if t is sp.PDict:
        return {_real(k): _real(v) for k, v in value.items}
    if t is sp.Size:
        return torch.Size(value)
    if t is sp.DType:
        return _dtype(value.name)
    if t is sp.Layout:
        return _layout(value.name)
    if t is sp.Path:
        return pathlib.Path(value.value)
    if t is sp.Enum:
        from torch.distributed.checkpoint.planner import WriteItemType

        return WriteItemType(value.value)
    if t is sp.Obj:
        return _real_obj(value)
    raise UnsafeMetadataError(f"unexpected value of type {t.__name__} in validated metadata")


def _real_obj(obj: sp.Obj) -> Any:
    import torch
    from torch.distributed.checkpoint import planner
    from torch.distributed.checkpoint.filesystem import _StoragePrefix
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex

    f = obj.fields
    if obj.kind in ("SavePlan", "MCoreSavePlan"):
        args = {"items": _real(f["items"]), "storage_data": _real(f["storage_data"]),
                "planner_data": _real(f["planner_data"]), "usable": f["usable"]}
        if obj.kind == "MCoreSavePlan":
            try:  # Megatron's subclass when Megatron is installed; the plain DCP plan otherwise
                from megatron.core.dist_checkpointing.strategies.torch import MCoreSavePlan
            except ImportError:
                return planner.SavePlan(**args)
            return MCoreSavePlan(**args, mcore_data=_real(f["mcore_data"]))
        return planner.SavePlan(**args)
    if obj.kind == "WriteItem":
        return planner.WriteItem(index=_real(f["index"]), type=_real(f["type"]),
                                 bytes_io_data=_real(f["bytes_io_data"]), tensor_data=_real(f["tensor_data"]))
    if obj.kind == "TensorWriteData":
        chunk = f["chunk"].fields
        return planner.TensorWriteData(
            chunk=ChunkStorageMetadata(offsets=_real(chunk["offsets"]), sizes=_real(chunk["sizes"])),
            properties=_properties(md._properties(f["properties"], "a write item")),
            size=torch.Size(f["size"]))
    if obj.kind == "BytesIOWriteData":
        return planner.BytesIOWriteData(nbytes=f["nbytes"])
    if obj.kind == "MetadataIndex":
        return MetadataIndex(fqn=f["fqn"], offset=_real(f["offset"]), index=f["index"])
    if obj.kind == "ChunkStorageMetadata":
        return ChunkStorageMetadata(offsets=_real(f["offsets"]), sizes=_real(f["sizes"]))
    if obj.kind == "_StoragePrefix":
        return _StoragePrefix(prefix=f["prefix"])
    if obj.kind == "StorageMeta":
        return _storage_meta(md._storage_meta(obj))
    raise UnsafeMetadataError(f"unexpected {obj.kind} in validated metadata")
