"""DCP ``StorageReader`` s that never unpickle checkpoint metadata.

:class:`SafeFileSystemReader` parses metadata with :func:`ckptverify.dcp.metadata.parse_metadata` and only then
**constructs** torch's real metadata objects from validated values. It closes DCP's fallback: ``__N.metadata`` is
refused beside ``.metadata`` (and vice versa), so a hostile per-rank file never stands in for a broken one.
Items are still read by ``read_data`` (``weights_only=True``), non-tensors via
:class:`~ckptverify.dcp.loading.SafeLoadPlanner`.

:class:`ProvingFileSystemReader` reads each item once into memory, proves it there (manifest digest, else every
zip CRC-32) and only then deserializes that buffer; a failure raises
:class:`~ckptverify.errors.ProofFailedError` before any copy.
"""

from __future__ import annotations

import io
import os
from typing import TYPE_CHECKING, Any, cast

from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata

from ckptverify.dcp import metadata as md
from ckptverify.dcp import metadata_pickle as sp
from ckptverify.dcp.tensors import torch_dtype
from ckptverify.errors import BadPickle, CheckpointRefusedError, ProofFailedError, StorageError, UnsafeGlobal
from ckptverify.safeparse import paths

if TYPE_CHECKING:
    from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, ReadItem

    from ckptverify.dcp.layout import Layout
    from ckptverify.ownfiles.manifest import Manifest


class SafeFileSystemReader(FileSystemReader):
    """``FileSystemReader`` whose ``read_metadata`` builds DCP objects from safely parsed metadata. A URL is read via
    torch's fsspec file system with :mod:`ckptverify.safeparse.remote`'s options."""

    def __init__(self, path: str | os.PathLike[str], *args: Any, **kwargs: Any) -> None:
        super().__init__(path, *args, **kwargs)
        #: Metadata files :meth:`layout` read (parsed, or why not), until :meth:`read_metadata` takes them.
        self._kept: dict[str, md.ParsedMetadata | Exception] = {}
        if paths.is_url(os.fspath(path)):
            from torch.distributed.checkpoint._fsspec_filesystem import FileSystem as FsspecFileSystem

            from ckptverify.safeparse import remote

            url = os.fspath(path)
            remote.filesystem(url)  # the extra is installed, or a UsageError saying what to install
            self.fs = FsspecFileSystem()  # type: ignore[assignment]
            self.path = self.fs.init_path(url, **remote.storage_options(url))

    def layout(self) -> Layout | None:
        """The layout of the metadata DCP will load (``.metadata``, else every ``__N.metadata`` merged): each file read,
        checked and parsed here once, kept for :meth:`read_metadata`. ``None`` when none could be; a file's failure is
        raised by :meth:`read_metadata`, inside DCP's load, so every rank fails alike."""
        root = os.fspath(self.path)
        names = md.metadata_files(root)
        for name in names[:1] if md.METADATA_FILE in names else names:
            try:
                self._kept[name] = self._parse(name)
            except StorageError:
                raise  # the store failed, not the checkpoint: the command could not run
            except Exception as exc:
                self._kept[name] = exc
        used = [p for p in self._kept.values() if isinstance(p, md.ParsedMetadata)]
        return md.merged_layout(names, used)[0] if used else None

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        rank = kwargs.get("rank")
        root = os.fspath(self.path)
        name = md.METADATA_FILE if rank is None else f"__{int(rank)}.metadata"
        names = md.metadata_files(root)
        if rank is not None and md.METADATA_FILE in names:
            raise CheckpointRefusedError(
                f"refusing {name}: {root} has a .metadata, so the per-rank file is a second entry point; "
                "DCP reads it only because .metadata failed")
        if rank is None and len(names) > 1 and md.METADATA_FILE in names:
            raise CheckpointRefusedError(
                f"refusing {root}: per-rank metadata {names[1]} lies beside .metadata (run ckptverify verify)")
        kept = self._kept.pop(name, None)
        if isinstance(kept, Exception):
            raise kept
        metadata = build_metadata(kept or self._parse(name))
        if metadata.storage_meta is None:
            from torch.distributed.checkpoint.metadata import StorageMeta

            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def _parse(self, name: str) -> md.ParsedMetadata:
        """Read, check (:meth:`_check_metadata`) and validate one metadata file;
        :class:`~ckptverify.errors.CheckpointRefusedError` on anything wrong."""
        try:
            raw = md.read_metadata_bytes(os.path.join(os.fspath(self.path), name))
            self._check_metadata(name, raw)
            parsed = md.parse_metadata(raw, name)
        except (FileNotFoundError, StorageError):
            raise
        except OSError as exc:
            raise CheckpointRefusedError(f"cannot read {name}: {exc.strerror or exc}") from None
        except UnsafeGlobal as exc:
            raise CheckpointRefusedError(f"refusing {name}: it asks to load the global {exc.name}") from None
        except BadPickle as exc:
            raise CheckpointRefusedError(f"refusing {name}: {exc}") from None
        if parsed.unsafe_paths:
            fqn, _, raw_path = parsed.unsafe_paths[0]
            raise CheckpointRefusedError(f"refusing {name}: storage path {raw_path!r} of {fqn!r} leaves the checkpoint")
        return parsed

    def _check_metadata(self, name: str, raw: bytes) -> None:
        """Called with each metadata file's bytes as read (nothing to check here)."""


class ProvingFileSystemReader(SafeFileSystemReader):
    """:class:`SafeFileSystemReader` proving each item in the read that loads it. ``manifest``: validated manifest, or
    ``None`` for zip CRC-32s. ``proven`` counts ``items``, ``bytes``, ``method``; ``refused_metadata`` is a metadata
    file's failed proof (DCP folds it into a message of its own)."""

    def __init__(self, path: str | os.PathLike[str], manifest: Manifest | None = None) -> None:
        super().__init__(path)
        self.manifest = manifest
        self._entries = {e.key: e for e in manifest.items} if manifest is not None else {}
        self.proven = {"items": 0, "bytes": 0, "method": "manifest" if manifest is not None else "zip-crc"}
        self.refused_metadata: ProofFailedError | None = None

    def _check_metadata(self, name: str, raw: bytes) -> None:
        if self.manifest is None or name not in self.manifest.metadata_files:
            return
        from ckptverify.fingerprint import digest_bytes

        entry = self.manifest.metadata_files[name]
        actual = digest_bytes(raw, self.manifest.digest_algorithm)
        if len(raw) != entry.size or actual != entry.digest:
            self.refused_metadata = ProofFailedError(
                f"{name} differs from the one written at save time (manifest-digest): the checkpoint's index was "
                "replaced or edited", info={"check": "manifest-digest", "file": name, "expected": entry.digest,
                                       "actual": actual})
            raise self.refused_metadata

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Any:
        import torch
        from torch.distributed._shard._utils import narrow_tensor_by_index
        from torch.distributed.checkpoint.planner import LoadItemType
        from torch.futures import Future

        per_file: dict[str, list[ReadItem]] = {}
        for read_item in plan.items:
            per_file.setdefault(self.storage_data[read_item.storage_index].relative_path, []).append(read_item)
        for relative_path, reqs in per_file.items():
            with self.fs.create_stream(self.fs.concat_path(self.path, relative_path), "rb") as stream:
                # In file order: one forward pass over each file.
                for req in sorted(reqs, key=lambda r: self.storage_data[r.storage_index].offset):
                    info = self.storage_data[req.storage_index]
                    stream.seek(info.offset)
                    raw = stream.read(info.length)  # the one read of this item: proven, then loaded
                    data = self._prove(req, relative_path, info, raw)
                    del raw
                    if req.type == LoadItemType.BYTE_IO:
                        planner.load_bytes(req, io.BytesIO(data))
                        continue
                    tensor = cast(torch.Tensor, torch.load(io.BytesIO(data), map_location="cpu", weights_only=True))
                    tensor = narrow_tensor_by_index(tensor, req.storage_offsets, req.lengths)
                    target = planner.resolve_tensor(req).detach()
                    if target.size() != tensor.size():
                        raise AssertionError(f"req {req.storage_index} mismatch sizes {target.size()} vs "
                                             f"{tensor.size()}")
                    target.copy_(tensor)
                    planner.commit_tensor(req, target)
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    def _prove(self, req: ReadItem, relative_path: str, info: Any, raw: bytes) -> bytes:
        """The item's bytes with transforms undone, once proven; raises :class:`~ckptverify.errors.ProofFailedError`."""
        idx = req.storage_index
        offsets = None if idx.offset is None else tuple(int(x) for x in idx.offset)
        where = {"fqn": idx.fqn, "chunk_offsets": None if offsets is None else list(offsets), "file": relative_path,
                 "byte_range": [info.offset, info.offset + info.length]}
        label = f"{idx.fqn!r}" + (f" chunk {list(offsets)}" if offsets is not None else "") + f" in {relative_path}"

        def fail(check: str, what: str, **values: Any) -> ProofFailedError:
            return ProofFailedError(f"{label} bytes [{info.offset}, {info.offset + info.length}) {what} ({check})",
                                    info={"check": check, **where, **values})

        if len(raw) != info.length:
            raise fail("item-bounds", f"are cut short: {len(raw)} of {info.length} bytes could be read")
        if self.manifest is not None:
            from ckptverify.fingerprint import digest_bytes

            entry = self._entries.get((idx.fqn, offsets, relative_path))
            if entry is None:
                raise fail("manifest-mismatch", "are not an item the manifest lists (metadata replaced or edited?)")
            if (entry.offset, entry.length) != (info.offset, info.length):
                raise fail("manifest-mismatch", f"are not where the manifest places it "
                           f"([{entry.offset}, {entry.offset + entry.length}))")
            actual = digest_bytes(raw, self.manifest.digest_algorithm)
            if actual != entry.digest:
                raise fail("manifest-digest", "differ from what was saved", expected=entry.digest, actual=actual)
        data = raw
        if info.transform_descriptors:
            stream = self.transforms.transform_load_stream(req, info.transform_descriptors, io.BytesIO(raw))
            data = stream.read(-1)
        if self.manifest is None:
            _prove_crcs(data, fail)
        self.proven["items"] += 1
        self.proven["bytes"] += len(raw)
        return data


def _prove_crcs(data: bytes, fail: Any) -> None:
    """Every record of the ``torch.save`` archive ``data`` against its CRC-32 (the structure cross-checked too)."""
    from ckptverify.errors import ArchiveError
    from ckptverify.safeparse.readers import crc32
    from ckptverify.safeparse.zipwalk import parse_item

    try:
        archive = parse_item(data, 0, len(data)).archive
    except ArchiveError as exc:
        raise fail("zip-structure", f"are not a well-formed torch.save archive: {exc}") from None
    view = memoryview(data)
    for rec in archive.records:
        actual = crc32(view[rec.data_offset:rec.data_end])
        if actual != rec.crc:
            raise fail("zip-crc", f"hold record {rec.name} whose payload is corrupt",
                       expected=f"{rec.crc:08x}", actual=f"{actual:08x}")


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
        sd[fqn] = TensorStorageMetadata(properties=_properties(parsed.properties[fqn]), size=torch.Size(entry.shape),
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


def _layout(name: str) -> Any:
    import torch

    value = getattr(torch, name.removeprefix("torch."), None) if name.startswith("torch.") else None
    if not isinstance(value, torch.layout) or str(value) != name:
        raise CheckpointRefusedError(f"this torch has no layout {name!r}")
    return value


def _properties(p: md.TensorProps) -> Any:
    import torch
    from torch.distributed.checkpoint.metadata import TensorProperties

    memory_format = (torch.contiguous_format, torch.channels_last, torch.preserve_format)[p.memory_format]
    return TensorProperties(dtype=torch_dtype(p.dtype, CheckpointRefusedError), layout=_layout(p.layout),
                            requires_grad=p.requires_grad, memory_format=memory_format, pin_memory=p.pin_memory)


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
        return torch_dtype(value.name, CheckpointRefusedError)
    if t is sp.TorchLayout:
        return _layout(value.name)
    if t is sp.Path:
        return pathlib.Path(value.value)
    if t is sp.Enum:
        from torch.distributed.checkpoint.planner import WriteItemType

        return WriteItemType(value.value)
    return _real_obj(value)  # an Obj: validated inert data holds no other type


def _real_obj(obj: sp.Obj) -> Any:
    """The real DCP dataclass (Megatron's plan where Megatron is installed, else DCP's) for a validated one."""
    import importlib

    if obj.kind == "TensorProperties":
        return _properties(md._properties(obj, "a write item"))
    if obj.kind == "StorageMeta":
        return _storage_meta(md._storage_meta(obj))
    kind = sp.KINDS[obj.kind]
    fields = {name: _real(value) for name, value in obj.fields.items()}
    try:
        cls = getattr(importlib.import_module(kind.module), kind.name)
    except (ImportError, AttributeError):  # only Megatron's module may be absent (or lack the plan)
        from torch.distributed.checkpoint.planner import SavePlan

        cls = SavePlan
        del fields["mcore_data"]
    return cls(**fields)
