"""Safe reader for DCP's ``.metadata``: the one module that knows DCP's metadata structure.

DCP's ``read_metadata`` unpickles without restriction (a crafted file runs code), and on failure ``dcp.load``
falls back to ``__{rank}.metadata``. Here every metadata file is parsed by :mod:`ckptverify.dcp.metadata_pickle`
(nothing runs) and **every field** validated, giving :class:`ParsedMetadata` and, merged, a
:class:`~ckptverify.dcp.layout.Layout`. A ``__N.metadata`` beside ``.metadata`` is ``metadata-stray`` (a second,
unverified entry point). All work is linear in metadata size and chunk count.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Any

from ckptverify.dcp import metadata_pickle as sp
from ckptverify.dcp.layout import Chunk, Item, Layout, TensorInfo
from ckptverify.errors import BadPickle, StorageError, UnsafeGlobal
from ckptverify.findings import Finding, Location, error
from ckptverify.safeparse import paths
from ckptverify.safeparse.gcpause import paused_gc
from ckptverify.safeparse.readers import read_small_file

#: DCP's metadata file (``torch.distributed.checkpoint.filesystem._metadata_fn``).
METADATA_FILE = ".metadata"
#: ``__{rank}.metadata``, written per rank when DCP saves with ``use_collectives=False``.
RANK_METADATA_RE = re.compile(r"^__(\d+)\.metadata$")
#: A metadata file larger than this is refused rather than read (a pickle can be made to claim anything).
MAX_METADATA_BYTES = 1 << 30
#: Longest state dict key, storage path or other string the reader accepts.
MAX_STRING = 1 << 16
#: Most dimensions of a tensor (the unpickler's bound on a ``torch.Size``).
MAX_DIMS = sp.MAX_DIMS


# -------- What a validated metadata file says.


@dataclass(frozen=True, slots=True)
class TensorProps:
    """``TensorProperties``: dtype name, layout name, and the three deprecated fields as pickled."""

    dtype: str
    layout: str
    requires_grad: bool
    memory_format: int
    pin_memory: bool


@dataclass(frozen=True, slots=True)
class StorageEntry:
    """One ``MetadataIndex -> _StorageInfo`` entry of ``storage_data``."""

    fqn: str
    chunk_offsets: tuple[int, ...] | None
    index: int | None
    relative_path: str
    offset: int
    length: int
    #: ``None`` when the pickle had ``None`` (older DCP), else the descriptors.
    transforms: tuple[str, ...] | None


@dataclass(frozen=True, slots=True)
class StorageMetaInfo:
    checkpoint_id: str | None
    checkpoint_id_is_path: bool
    save_id: str | None
    load_id: str | None
    modules: tuple[str, ...]


@dataclass(slots=True)
class ParsedMetadata:
    """One metadata file, validated; ``planner_data`` and ``extras`` values are the inert plain tree."""

    name: str
    entries: dict[str, TensorInfo | None]  # None: a BytesStorageMetadata (a non-tensor value)
    #: Each tensor entry's ``TensorProperties``, by fqn.
    properties: dict[str, TensorProps]
    storage: list[StorageEntry]
    planner_data: Any
    storage_meta: StorageMetaInfo | None
    version: str | None
    extras: dict[str, Any]
    #: Storage entries whose path leaves the directory (reported, not usable).
    unsafe_paths: list[tuple[str, tuple[int, ...] | None, str]]


# -------- Files.


def metadata_files(root: str) -> list[str]:
    """Every metadata file DCP could read in ``root``: ``.metadata`` first, then each ``__N.metadata``."""
    names = paths.listdir(root)
    ranked = sorted((n for n in names if _rank(n) is not None), key=_rank)  # type: ignore[arg-type,return-value]
    return ([METADATA_FILE] if METADATA_FILE in names else []) + ranked


def _rank(name: str) -> int | None:
    """The rank of a ``__N.metadata`` file, else ``None``."""
    match = RANK_METADATA_RE.match(name)
    return int(match.group(1)) if match else None


def read_metadata_bytes(path: str) -> bytes:
    """A metadata file's bytes: a regular file inside its checkpoint directory, at most :data:`MAX_METADATA_BYTES`;
    never blocks. Raises ``OSError`` (:class:`~ckptverify.errors.UnsafeFileError` for refusals)."""
    return read_small_file(path, MAX_METADATA_BYTES, root=os.path.dirname(os.path.abspath(path)))


def parse_metadata(data: bytes, name: str = METADATA_FILE) -> ParsedMetadata:
    """Parse and validate one metadata file's bytes. Raises :class:`~ckptverify.errors.UnsafeGlobal` or
    :class:`~ckptverify.errors.BadPickle` (budget, or a structure DCP never writes)."""
    with paused_gc():
        return _validate_metadata(sp.parse(data), name)


def read_layout(root: str) -> tuple[Layout | None, list[Finding]]:
    """Read and validate all metadata at ``root``, executing nothing. Returns the merged layout (``None`` if none
    could be trusted) and findings (``metadata-missing``/``-unreadable``/``-unsafe``/``-inconsistent``/``-stray``)."""
    return read_all(root)[:2]


@paused_gc()
def read_all(root: str) -> tuple[Layout | None, list[Finding], dict[str, ParsedMetadata]]:
    """:func:`read_layout`, also returning each file that parsed, by name."""
    names = metadata_files(root)
    if not names:
        return None, [
            error(
                "metadata-missing",
                "no .metadata (or per-rank __N.metadata) file: the checkpoint is incomplete, "
                "or its save never committed",
                location=Location(file=METADATA_FILE),
            )
        ], {}
    findings: list[Finding] = []
    parsed: dict[str, ParsedMetadata] = {}
    for name in names:
        result = _read_one(root, name, _rank(name))
        if isinstance(result, ParsedMetadata):
            parsed[name] = result
        else:
            findings.append(result)
    ranked = [n for n in names if n != METADATA_FILE]
    if METADATA_FILE in names:
        for name in ranked:
            findings.append(error(
                "metadata-stray",
                f"{name} lies beside .metadata: DCP loads it instead whenever .metadata fails to unpickle, so "
                "it is a second, unchecked way into this checkpoint (a leftover of another save, or planted)",
                location=Location(file=name),
            ))
        used = [METADATA_FILE] if METADATA_FILE in parsed else []
    else:
        used = [n for n in ranked if n in parsed]
    if not used:
        return None, findings, parsed
    layout, merged = merged_layout(names, [parsed[name] for name in used])
    return layout, findings + merged, parsed


def merged_layout(names: list[str], used: list[ParsedMetadata]) -> tuple[Layout, list[Finding]]:
    """The layout of the files ``used`` (parsed, of the metadata files ``names``), merged in order, and the findings
    of files that disagree."""
    layout = Layout(metadata_files=names, per_rank=METADATA_FILE not in names)
    merger = _Merger(layout)
    findings = [f for parsed in used for f in merger.add(parsed, _rank(parsed.name))]
    return layout, findings


def _read_one(root: str, name: str, rank: int | None) -> ParsedMetadata | Finding:
    where = Location(file=name, rank=rank)
    try:
        data = read_metadata_bytes(os.path.join(root, name))
    except StorageError:
        raise  # the store failed, not the checkpoint: the command could not run
    except OSError as exc:
        return error("metadata-unreadable", f"cannot read {name}: {exc.strerror or exc}", location=where)
    try:
        return parse_metadata(data, name)
    except UnsafeGlobal as exc:
        return error(
            "metadata-unsafe",
            f"{name} asks to load the global {exc.name}, which DCP metadata never contains; "
            "refused without executing anything (the file may be hostile)",
            location=where,
            expected="only DCP metadata and planner classes, torch.Size, torch dtypes and layouts, pathlib paths",
            actual=exc.name,
        )
    except BadPickle as exc:
        return error("metadata-unreadable", f"{name} is not a DCP metadata file torch could load: {exc}",
                     location=where)


# -------- Validation of the plain tree. Everything below treats the values as hostile.


def _short(value: Any) -> str:
    if type(value) in (str, int, bool, float) or value is None:
        return repr(value)[:120]
    return type(value).__name__


def _obj(value: Any, kind: str, what: str) -> dict[str, Any]:
    if not isinstance(value, sp.Obj) or value.kind != kind:
        raise BadPickle(f"{what} is {value.kind if isinstance(value, sp.Obj) else _short(value)}, "
                          f"expected {kind}")
    return value.fields


def _int(value: Any, what: str) -> int:
    if type(value) is not int or value < 0 or value >= 1 << 63:
        raise BadPickle(f"{what} must be an integer in [0, 2^63), got {_short(value)}")
    return value


def _dims(value: Any, what: str) -> tuple[int, ...]:
    # DCP stores every shape, offset and size as a torch.Size; anything else is not what it wrote. A Size holds at
    # most MAX_DIMS ints (its stand-in refuses anything else): only their range is left to check.
    if type(value) is not sp.Size:
        raise BadPickle(f"{what} must be a torch.Size of at most {MAX_DIMS} integers")
    if value and (min(value) < 0 or max(value) >= 1 << 63):
        for v in value:
            _int(v, what)
    return tuple(value)


def _str(value: Any, what: str, limit: int = MAX_STRING) -> str:
    if type(value) is not str:
        raise BadPickle(f"{what} must be a string, got {_short(value)}")
    if len(value) > limit or "\x00" in value:
        raise BadPickle(f"{what} is not an acceptable string")
    return value


def _opt_str(value: Any, what: str, limit: int = MAX_STRING) -> str | None:
    return None if value is None else _str(value, what, limit)


def _seq(value: Any, what: str) -> list[Any] | tuple[Any, ...]:
    if not isinstance(value, list | tuple):
        raise BadPickle(f"{what} is {_short(value)}, expected a list")
    return value


def _dict(value: Any, what: str) -> tuple[tuple[Any, Any], ...]:
    if not isinstance(value, sp.PDict):
        raise BadPickle(f"{what} is {_short(value)}, expected a dict")
    return value.items


def _properties(value: Any, what: str) -> TensorProps:
    # Its stand-in took only DCP's 5-tuple of a dtype, layout, bool, memory format and bool: the kind is what is left.
    f = _obj(value, "TensorProperties", what)
    return TensorProps(f["dtype"].name, f["layout"].name, f["requires_grad"], f["memory_format"].value,
                       f["pin_memory"])


def _chunk(value: Any, what: str) -> Chunk:
    f = _obj(value, "ChunkStorageMetadata", what)
    return Chunk(_dims(f["offsets"], f"offsets of {what}"), _dims(f["sizes"], f"sizes of {what}"))


def _index(value: Any, what: str) -> tuple[str, tuple[int, ...] | None, int | None]:
    f = _obj(value, "MetadataIndex", what)
    fqn = _str(f["fqn"], f"fqn of {what}")
    offset = None if f["offset"] is None else _dims(f["offset"], f"offset of {fqn!r}")
    return fqn, offset, None if f["index"] is None else _int(f["index"], f"index hint of {fqn!r}")


def _storage_key(value: Any) -> tuple[str, tuple[int, ...] | None, int | None]:
    """:func:`_index` of a ``storage_data`` key."""
    if type(value) is sp.Obj and value.kind == "MetadataIndex":
        f = value.fields
        fqn, offset, hint = f["fqn"], f["offset"], f["index"]
        if _ok_str(fqn) and (offset is None or _ok_dims(offset)) and (hint is None or _ok_int(hint)):
            return fqn, None if offset is None else tuple(offset), hint
    return _index(value, "a storage key")


def _storage_meta(value: Any) -> StorageMetaInfo | None:
    if value is None:
        return None
    f = _obj(value, "StorageMeta", "storage_meta")
    cid = f["checkpoint_id"]
    is_path = isinstance(cid, sp.Path)
    modules = tuple(_str(m, "a storage_meta module") for m in _seq(f["modules"], "storage_meta modules"))
    return StorageMetaInfo(_opt_str(cid.value if is_path else cid, "storage_meta checkpoint_id"), is_path,
                           _opt_str(f["save_id"], "storage_meta save_id", 256),
                           _opt_str(f["load_id"], "storage_meta load_id", 256), modules)


# Fast paths of the checks above (no message formatted); a failing value goes through them for the message.

_I63 = 1 << 63


def _ok_str(value: Any, limit: int = MAX_STRING) -> bool:
    return type(value) is str and len(value) <= limit and "\x00" not in value


def _ok_int(value: Any) -> bool:
    return type(value) is int and 0 <= value < _I63


def _ok_dims(value: Any) -> bool:
    # A Size holds at most MAX_DIMS ints (its stand-in refuses anything else).
    return type(value) is sp.Size and (not value or (min(value) >= 0 and max(value) < _I63))


class _Interned:
    """Equal values built once: chunks, tensor properties and paths repeat across a checkpoint's entries."""

    def __init__(self) -> None:
        self.chunks: dict[tuple[Any, Any], Chunk] = {}
        self.props: dict[tuple[Any, ...], TensorProps] = {}
        self.paths: dict[str, str | None] = {}

    def chunk(self, value: Any, what: str) -> Chunk:
        if type(value) is sp.Obj and value.kind == "ChunkStorageMetadata":
            f = value.fields
            offsets, sizes = f["offsets"], f["sizes"]
            if _ok_dims(offsets) and _ok_dims(sizes):
                key = (offsets, sizes)
                chunk = self.chunks.get(key)
                if chunk is None:
                    chunk = self.chunks[key] = Chunk(tuple(offsets), tuple(sizes))
                return chunk
        return _chunk(value, what)

    def properties(self, value: Any, what: str) -> TensorProps:
        f = _obj(value, "TensorProperties", what)  # its fields were checked by its stand-in (see _properties)
        key = (f["dtype"].name, f["layout"].name, f["requires_grad"], f["memory_format"].value, f["pin_memory"])
        props = self.props.get(key)
        if props is None:
            props = self.props[key] = TensorProps(*key)
        return props

    def path(self, value: Any) -> str | None:
        if type(value) is not str:
            return None
        try:
            return self.paths[value]
        except KeyError:
            rel = self.paths[value] = paths.safe_relative_path(value)
            return rel


def _validate_metadata(tree: Any, name: str) -> ParsedMetadata:
    fields = _obj(tree, "Metadata", "the top-level object")
    interned = _Interned()
    entries: dict[str, TensorInfo | None] = {}
    properties: dict[str, TensorProps] = {}
    for fqn_raw, entry in _dict(fields["state_dict_metadata"], "state_dict_metadata"):
        # Keys of one dict: a string is never repeated.
        fqn = fqn_raw if _ok_str(fqn_raw) else _str(fqn_raw, "a state dict key")
        if type(entry) is sp.Obj and entry.kind == "BytesStorageMetadata":
            entries[fqn] = None
            continue
        if type(entry) is sp.Obj and entry.kind == "TensorStorageMetadata":
            tsm = entry.fields
        else:
            tsm = _obj(entry, "TensorStorageMetadata", f"entry {fqn!r}")
        props = interned.properties(tsm["properties"], f"{fqn!r}")  # of a dtype the allowlist names: a known one
        size = tsm["size"]
        shape = tuple(size) if _ok_dims(size) else _dims(size, f"size of {fqn!r}")
        chunks_raw = tsm["chunks"]
        if type(chunks_raw) is not list and type(chunks_raw) is not tuple:
            chunks_raw = _seq(chunks_raw, f"chunks of {fqn!r}")
        chunks = tuple(interned.chunk(c, f"a chunk of {fqn!r}") for c in chunks_raw)
        entries[fqn] = TensorInfo(fqn, props.dtype, shape, chunks)
        properties[fqn] = props

    storage_raw = fields["storage_data"]
    if not isinstance(storage_raw, sp.PDict):
        raise BadPickle("storage_data is not a dict (was the checkpoint written by FileSystemWriter?)")
    seen: set[tuple[str, tuple[int, ...] | None]] = set()
    storage: list[StorageEntry] = []
    unsafe_paths: list[tuple[str, tuple[int, ...] | None, str]] = []
    for key, info in storage_raw.items:
        fqn, chunk_offsets, hint = _storage_key(key)
        if (fqn, chunk_offsets) in seen:
            raise BadPickle(f"storage entry {fqn!r} at {chunk_offsets} appears twice (DCP would keep one)")
        seen.add((fqn, chunk_offsets))
        if type(info) is sp.Obj and info.kind == "_StorageInfo":
            sinfo = info.fields
        else:
            sinfo = _obj(info, "_StorageInfo", f"storage info of {fqn!r}")
        raw_path = sinfo["relative_path"]
        start, length = sinfo["offset"], sinfo["length"]
        if not _ok_int(start):
            start = _int(start, f"storage offset of {fqn!r}")
        if not _ok_int(length):
            length = _int(length, f"storage length of {fqn!r}")
        transforms_raw = sinfo["transform_descriptors"]
        transforms = None if transforms_raw is None else tuple(
            _str(t, "a transform descriptor", 256) for t in _seq(transforms_raw, f"transforms of {fqn!r}"))
        rel = interned.path(raw_path)
        if rel is None:
            unsafe_paths.append((fqn, chunk_offsets, raw_path[:200] if type(raw_path) is str else _short(raw_path)))
            continue
        storage.append(StorageEntry(fqn, chunk_offsets, hint, rel, start, length, transforms))

    planner_data = _inert(fields["planner_data"], "planner_data")
    storage_meta = _storage_meta(fields["storage_meta"])
    version = _opt_str(fields["version"], "version", 64)
    extras = {extra: _inert(fields[extra], extra) for extra in sorted(set(fields) - sp.KINDS["Metadata"].field_set)}
    return ParsedMetadata(name, entries, properties, storage, planner_data, storage_meta, version, extras, unsafe_paths)


# Inert data: what planner_data and writer-attached fields may hold.

_SCALARS = (str, int, float, bool, bytes)


def _inert(value: Any, what: str) -> Any:
    """Check that ``value`` is plain data or DCP planner dataclasses of the right shape; return it."""
    stack = [(value, what)]
    while stack:
        v, where = stack.pop()
        t = type(v)
        if v is None or t in _SCALARS:
            if t is str and len(v) > MAX_STRING:
                raise BadPickle(f"a string in {where} is too long")
            continue
        if t in (sp.Size, sp.DType, sp.Path, sp.TorchLayout):
            if t is sp.Size:
                _dims(v, where)
            continue
        if t is sp.Enum:
            if v.kind != "WriteItemType":
                raise BadPickle(f"{where} holds a {v.kind}")
            continue
        if t in (list, tuple):
            stack.extend((x, where) for x in v)
            continue
        if t is sp.PDict:
            for k, x in v.items:
                if not _hashable_key(k):
                    raise BadPickle(f"{where} has a dict key of type {type(k).__name__}")
                stack.append((x, where))
            continue
        stack.extend(_planner_children(v, where))  # an Obj: the plain tree holds no other type
    return value


def _hashable_key(k: Any) -> bool:
    if k is None or type(k) in _SCALARS or type(k) in (sp.Size, sp.DType, sp.Path, sp.Enum, sp.TorchLayout):
        return True
    return type(k) is tuple and all(_hashable_key(x) for x in k)


def _planner_children(v: sp.Obj, where: str) -> list[tuple[Any, str]]:
    """Validate one planner dataclass in inert data; return the values still to check."""
    f = v.fields
    kind = v.kind
    if kind in ("SavePlan", "MCoreSavePlan"):
        for item in _seq(f["items"], f"items of a plan in {where}"):
            if not (isinstance(item, sp.Obj) and item.kind == "WriteItem"):
                raise BadPickle(f"a plan in {where} holds {_short(item)} among its write items")
        if type(f["usable"]) is not bool:
            raise BadPickle(f"usable of a plan in {where} must be a bool, got {_short(f['usable'])}")
        out = [(f["items"], where), (f["storage_data"], where), (f["planner_data"], where)]
        if kind == "MCoreSavePlan":
            out.append((f["mcore_data"], where))
        return out
    if kind == "WriteItem":
        _index(f["index"], f"the index of a write item in {where}")
        t = f["type"]
        if not (isinstance(t, sp.Enum) and t.kind == "WriteItemType"):
            raise BadPickle(f"a write item in {where} has no WriteItemType")
        if f["bytes_io_data"] is not None:
            _int(_obj(f["bytes_io_data"], "BytesIOWriteData", f"bytes data in {where}")["nbytes"], "nbytes")
        if f["tensor_data"] is not None:
            td = _obj(f["tensor_data"], "TensorWriteData", f"tensor data in {where}")
            _chunk(td["chunk"], f"a write item chunk in {where}")
            _properties(td["properties"], f"a write item in {where}")
            _dims(td["size"], f"a write item size in {where}")
    elif kind == "_StoragePrefix":
        _str(f["prefix"], f"a storage prefix in {where}")
    elif kind == "MetadataIndex":
        _index(v, where)
    elif kind == "ChunkStorageMetadata":
        _chunk(v, where)
    elif kind == "StorageMeta":
        _storage_meta(v)
    else:
        raise BadPickle(f"{where} holds a {kind}, which belongs elsewhere in DCP metadata")
    return []


# -------- Merging validated files into the layout the checks use: linear in entries and chunks.


class _Merger:
    def __init__(self, layout: Layout) -> None:
        self.layout = layout
        #: Per tensor: the set of its chunks (dedupe) and chunk offsets -> chunk (storage lookup).
        self.chunk_sets: dict[str, set[Chunk]] = {}
        self.by_offsets: dict[str, dict[tuple[int, ...], Chunk]] = {}

    def add(self, parsed: ParsedMetadata, rank: int | None) -> list[Finding]:
        layout, name = self.layout, parsed.name
        findings: list[Finding] = []
        if parsed.version is not None:
            layout.dcp_version = parsed.version
        for fqn, entry in parsed.entries.items():
            if entry is None:
                layout.byte_values.add(fqn)
                continue
            previous = layout.tensors.get(fqn)
            if previous is None:
                layout.tensors[fqn] = entry
                self.by_offsets[fqn] = {c.offsets: c for c in reversed(entry.chunks)}  # the first chunk at an offset
            elif previous.dtype != entry.dtype or previous.shape != entry.shape:
                findings.append(error(
                    "metadata-inconsistent",
                    f"{name} describes {fqn!r} as {entry.dtype}{list(entry.shape)} but another metadata file as "
                    f"{previous.dtype}{list(previous.shape)}",
                    location=Location(file=name, fqn=fqn, rank=rank),
                ))
            else:
                known = self.chunk_sets.get(fqn)
                if known is None:  # built when a second file lists the tensor
                    known = self.chunk_sets[fqn] = set(previous.chunks)
                new = []
                for c in entry.chunks:
                    if c not in known:
                        known.add(c)
                        new.append(c)
                        self.by_offsets[fqn].setdefault(c.offsets, c)
                if new:
                    layout.tensors[fqn] = TensorInfo(fqn, entry.dtype, entry.shape, previous.chunks + tuple(new))

        for fqn, chunk_offsets, raw in parsed.unsafe_paths:
            findings.append(error(
                "metadata-unsafe",
                f"storage path {raw!r} of {fqn!r} points outside the checkpoint directory; it is not opened",
                location=Location(file=name, fqn=fqn, chunk_offsets=chunk_offsets, rank=rank),
                actual=raw,
            ))
        items = layout.items
        for s in parsed.storage:
            if s.chunk_offsets is None:
                kind, chunk, dtype = "bytes", None, None
                if s.fqn not in layout.byte_values:
                    findings.append(error(
                        "metadata-inconsistent",
                        f"storage entry for {s.fqn!r} has no tensor offset, but the state dict metadata does not "
                        "list it as a byte value",
                        location=Location(file=name, fqn=s.fqn, chunk_offsets=s.chunk_offsets, rank=rank),
                    ))
            else:
                kind = "tensor"
                tinfo = layout.tensors.get(s.fqn)
                chunk = None if tinfo is None else self.by_offsets[s.fqn].get(s.chunk_offsets)
                if chunk is None:
                    findings.append(error(
                        "metadata-inconsistent",
                        f"storage entry for {s.fqn!r} at offsets {list(s.chunk_offsets)} matches no chunk in the "
                        "state dict metadata",
                        location=Location(file=name, fqn=s.fqn, chunk_offsets=s.chunk_offsets, rank=rank),
                    ))
                    continue
                dtype = tinfo.dtype  # type: ignore[union-attr]
            items.append(Item(s.fqn, kind, s.relative_path, s.offset, s.length, chunk, dtype, s.transforms or (),
                              rank))
        return findings
