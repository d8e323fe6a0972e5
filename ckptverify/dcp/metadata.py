"""Safe reader for DCP's ``.metadata`` — the one module that knows DCP's private classes.

DCP's own ``FileSystemReader.read_metadata`` calls ``pickle.load`` with no restriction, so a crafted
``.metadata`` runs arbitrary code on whoever opens it. Here the pickle is read by an unpickler whose
``find_class`` resolves only an allowlist of names, and resolves them to *stand-ins* defined in this
module, never to torch's classes or functions: unpickling executes nothing from torch or from the file.
The stand-ins record the state the pickle carries; :func:`read_layout` then validates every field
(names, paths, offsets, lengths are hostile input) and builds :class:`~ckptverify.dcp.layout.Layout`.

If torch renames or reshapes these classes, ``tests/test_dcp_metadata.py`` fails loudly: it checks the
allowlist and the field names below against the installed torch.
"""

from __future__ import annotations

import io
import os
import pickle
import re
from pathlib import PurePosixPath
from typing import Any

from ckptverify.dcp.layout import DTYPE_ITEMSIZE, Chunk, Item, Layout, TensorInfo
from ckptverify.findings import Finding, Location, error
from ckptverify.readers import read_small_file

METADATA_FILE = ".metadata"
#: ``__{rank}.metadata``, written per rank when DCP saves with ``use_collectives=False``.
RANK_METADATA_RE = re.compile(r"^__(\d+)\.metadata$")
#: A metadata file larger than this is refused rather than read (a pickle can be made to claim anything).
MAX_METADATA_BYTES = 1 << 30

_DCP_MD = "torch.distributed.checkpoint.metadata"
_DCP_FS = "torch.distributed.checkpoint.filesystem"

#: Field names of DCP's dataclasses, as pickled by torch (checked against torch by the tests).
METADATA_FIELDS = ("state_dict_metadata", "planner_data", "storage_data", "storage_meta", "version")
TENSOR_STORAGE_FIELDS = ("properties", "size", "chunks")
CHUNK_FIELDS = ("offsets", "sizes")
INDEX_FIELDS = ("fqn", "offset", "index")
STORAGE_INFO_FIELDS = ("relative_path", "offset", "length", "transform_descriptors")
STORAGE_META_FIELDS = ("checkpoint_id", "save_id", "load_id", "modules")


class _Record:
    """Stand-in for an instance of an allowlisted DCP class: it only stores what the pickle sets."""

    kind = "object"
    # NEWOBJ calls only __new__, so the defaults live on the class.
    args: tuple[Any, ...] = ()
    state: Any = None

    def __init__(self, *args: Any) -> None:
        self.args = args

    def __setstate__(self, state: Any) -> None:
        self.state = state

    def fields(self) -> dict[str, Any]:
        """The instance dict the pickle carried (dataclass state, or ``(None, slots)`` form)."""
        state = self.state
        if isinstance(state, tuple) and len(state) == 2 and (state[0] is None or isinstance(state[0], dict)):
            merged: dict[str, Any] = dict(state[0] or {})
            merged.update(state[1] or {})
            return merged
        if state is None:
            return {}
        if isinstance(state, dict):
            return state
        raise _BadMetadata(f"{self.kind} carries state of type {type(state).__name__}, expected a dict")


def _record_class(kind: str) -> type[_Record]:
    return type(f"_Shadow_{kind}", (_Record,), {"kind": kind})


class _DType(str):
    """Stand-in for a ``torch.dtype`` global: just its name."""


class _BadMetadata(Exception):
    """The metadata parsed as a pickle but does not have the shape DCP writes."""


class _UnsafeGlobal(pickle.UnpicklingError):
    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.name = name


def _size(*args: Any) -> tuple[Any, ...]:
    # torch.Size((a, b, ...)) pickles as REDUCE(torch.Size, ((a, b, ...),))
    if len(args) != 1 or not isinstance(args[0], tuple | list):
        raise _BadMetadata("torch.Size with unexpected arguments")
    return tuple(args[0])


def _layout(name: Any) -> str:
    if not isinstance(name, str):
        raise _BadMetadata("layout is not a string")
    return name


def _mem_format(value: Any) -> int:
    return value if isinstance(value, int) else -1


def _path(*parts: Any) -> str:
    if not all(isinstance(p, str) for p in parts):
        raise _BadMetadata("path with non-string parts")
    return str(PurePosixPath(*parts)) if parts else ""


_ALLOWED: dict[tuple[str, str], Any] = {
    (_DCP_MD, "Metadata"): _record_class("Metadata"),
    (_DCP_MD, "TensorStorageMetadata"): _record_class("TensorStorageMetadata"),
    (_DCP_MD, "TensorProperties"): _record_class("TensorProperties"),
    (_DCP_MD, "ChunkStorageMetadata"): _record_class("ChunkStorageMetadata"),
    (_DCP_MD, "BytesStorageMetadata"): _record_class("BytesStorageMetadata"),
    (_DCP_MD, "MetadataIndex"): _record_class("MetadataIndex"),
    (_DCP_MD, "StorageMeta"): _record_class("StorageMeta"),
    (_DCP_MD, "_MEM_FORMAT_ENCODING"): _mem_format,
    (_DCP_FS, "_StorageInfo"): _record_class("_StorageInfo"),
    ("torch", "Size"): _size,
    ("torch.serialization", "_get_layout"): _layout,
    ("pathlib", "PosixPath"): _path,
    ("pathlib", "PurePosixPath"): _path,
    ("pathlib", "WindowsPath"): _path,
    ("pathlib", "PureWindowsPath"): _path,
    ("pathlib", "Path"): _path,
}
for _name in DTYPE_ITEMSIZE:
    _ALLOWED[("torch", _name)] = _DType(_name)

#: Every global a DCP ``.metadata`` may name, as ``module.name`` (documented; checked by the tests).
ALLOWED_GLOBALS: frozenset[str] = frozenset(f"{m}.{n}" for m, n in _ALLOWED)


class _SafeUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        try:
            return _ALLOWED[(module, name)]
        except KeyError:
            raise _UnsafeGlobal(f"{module}.{name}") from None

    def persistent_load(self, pid: Any) -> Any:
        raise _BadMetadata("persistent ids are not used by DCP metadata")


def safe_unpickle(data: bytes) -> Any:
    """Unpickle ``data`` resolving only DCP metadata globals, to stand-ins. Raises on anything else."""
    return _SafeUnpickler(io.BytesIO(data)).load()


def metadata_files(root: str) -> list[str]:
    """Names of the metadata files in ``root``: ``.metadata`` if present, else every ``__N.metadata``."""
    names = os.listdir(root)
    if METADATA_FILE in names:
        return [METADATA_FILE]
    ranked = [n for n in names if RANK_METADATA_RE.match(n)]
    return sorted(ranked, key=lambda n: int(RANK_METADATA_RE.match(n).group(1)))  # type: ignore[union-attr]


def read_layout(root: str) -> tuple[Layout | None, list[Finding]]:
    """Read and validate all metadata of the checkpoint at ``root``.

    Returns the merged layout, or ``None`` when no metadata could be trusted, and the findings
    (``metadata-missing``, ``metadata-unreadable``, ``metadata-unsafe``, ``metadata-inconsistent``).
    Nothing from the files is executed.
    """
    names = metadata_files(root)
    if not names:
        return None, [
            error(
                "metadata-missing",
                "no .metadata (or per-rank __N.metadata) file: the checkpoint is incomplete, "
                "or its save never committed",
                location=Location(file=METADATA_FILE),
            )
        ]
    layout = Layout(metadata_files=names, per_rank=names != [METADATA_FILE])
    findings: list[Finding] = []
    usable = 0
    for name in names:
        match = RANK_METADATA_RE.match(name)
        rank = int(match.group(1)) if match else None
        ok, file_findings = _read_one(root, name, rank, layout)
        findings.extend(file_findings)
        usable += ok
    if usable == 0:
        return None, findings
    return layout, findings


def _read_one(root: str, name: str, rank: int | None, layout: Layout) -> tuple[bool, list[Finding]]:
    """Merge one metadata file into ``layout``; ``False`` when nothing of it could be used."""
    where = Location(file=name, rank=rank)
    path = os.path.join(root, name)
    try:
        # A regular file inside the checkpoint, at most MAX_METADATA_BYTES: never a FIFO, device or link out.
        data = read_small_file(path, MAX_METADATA_BYTES, root=root)
    except OSError as exc:
        return False, [error("metadata-unreadable", f"cannot read {name}: {exc}", location=where)]
    try:
        md = safe_unpickle(data)
    except _UnsafeGlobal as exc:
        return False, [
            error(
                "metadata-unsafe",
                f"{name} asks to load the global {exc.name}, which DCP metadata never contains; "
                "refused without executing anything (the file may be hostile)",
                location=where,
                expected="only DCP metadata classes, torch.Size, torch dtypes, pathlib paths",
                actual=exc.name,
            )
        ]
    except (_BadMetadata, pickle.UnpicklingError, EOFError, ValueError, TypeError, IndexError, KeyError,
            AttributeError, RecursionError, MemoryError, OverflowError) as exc:
        return False, [error("metadata-unreadable", f"{name} is not a readable DCP metadata pickle: "
                      f"{type(exc).__name__}: {exc}", location=where)]
    try:
        return True, _convert(md, name, rank, layout)
    except (_BadMetadata, RecursionError) as exc:
        return False, [error("metadata-unreadable", f"{name} does not have the structure DCP writes: {exc}",
                      location=where)]


# ---------------------------------------------------------------------------------------------
# Validation of the stand-ins. Everything below treats the values as hostile.


def _want(obj: Any, kind: str, what: str) -> _Record:
    if not isinstance(obj, _Record) or obj.kind != kind:
        raise _BadMetadata(f"{what} is {type(obj).__name__}, expected {kind}")
    return obj


def _int(value: Any, what: str, *, allow_none: bool = False) -> int:
    if value is None and allow_none:
        return None  # type: ignore[return-value]
    if type(value) is not int or value < 0 or value >= 1 << 63:
        raise _BadMetadata(f"{what} must be an integer in [0, 2^63), got {value!r}"[:200])
    return value


def _dims(value: Any, what: str) -> tuple[int, ...]:
    if not isinstance(value, tuple | list) or len(value) > 64:
        raise _BadMetadata(f"{what} must be a short sequence of integers")
    return tuple(_int(v, what) for v in value)


def _str(value: Any, what: str, limit: int = 1 << 16) -> str:
    if type(value) is not str and not isinstance(value, _DType):
        raise _BadMetadata(f"{what} must be a string, got {type(value).__name__}")
    if len(value) > limit or "\x00" in value:
        raise _BadMetadata(f"{what} is not an acceptable string")
    return str(value)


def safe_relative_path(value: Any) -> str | None:
    """Return ``value`` if it names a file inside the checkpoint directory, else ``None``."""
    if type(value) is not str or not value or "\x00" in value or "\\" in value or len(value) > 4096:
        return None
    parts = value.split("/")
    if value.startswith("/") or any(p in ("", ".", "..") for p in parts):
        return None
    return value


def _dtype_of(properties: _Record) -> str:
    state = properties.state
    if isinstance(state, tuple) and len(state) == 5:
        dtype = state[0]
    elif isinstance(state, dict) and "dtype" in state:
        dtype = state["dtype"]
    else:
        raise _BadMetadata("tensor properties without a dtype")
    if not isinstance(dtype, _DType):
        raise _BadMetadata(f"tensor dtype is {type(dtype).__name__}, expected a torch dtype")
    return str(dtype)


def _convert(md: Any, name: str, rank: int | None, layout: Layout) -> list[Finding]:
    findings: list[Finding] = []
    fields = _want(md, "Metadata", "the top-level object").fields()
    unknown = set(fields) - set(METADATA_FIELDS)
    if unknown:
        raise _BadMetadata(f"Metadata has unexpected fields {sorted(unknown)}")
    sd_md = fields.get("state_dict_metadata")
    storage = fields.get("storage_data")
    if not isinstance(sd_md, dict):
        raise _BadMetadata("state_dict_metadata is not a dict")
    if not isinstance(storage, dict):
        raise _BadMetadata("storage_data is not a dict (was the checkpoint written by FileSystemWriter?)")
    version = fields.get("version")
    if version is not None:
        layout.dcp_version = _str(version, "version", 64)
    smeta = fields.get("storage_meta")
    if isinstance(smeta, _Record) and smeta.kind == "StorageMeta":
        save_id = smeta.fields().get("save_id")
        if isinstance(save_id, str) and len(save_id) < 256:
            layout.save_id = save_id

    # State dict entries: tensors (with their chunks) and opaque byte values.
    for fqn_raw, entry in sd_md.items():
        fqn = _str(fqn_raw, "a state dict key")
        if isinstance(entry, _Record) and entry.kind == "BytesStorageMetadata":
            layout.byte_values.add(fqn)
            continue
        tsm = _want(entry, "TensorStorageMetadata", f"entry {fqn!r}").fields()
        props = _want(tsm.get("properties"), "TensorProperties", f"properties of {fqn!r}")
        dtype = _dtype_of(props)
        shape = _dims(tsm.get("size"), f"size of {fqn!r}")
        chunks_raw = tsm.get("chunks")
        if not isinstance(chunks_raw, list | tuple):
            raise _BadMetadata(f"chunks of {fqn!r} is not a list")
        chunks = []
        for c in chunks_raw:
            cf = _want(c, "ChunkStorageMetadata", f"a chunk of {fqn!r}").fields()
            offsets = _dims(cf.get("offsets"), f"chunk offsets of {fqn!r}")
            sizes = _dims(cf.get("sizes"), f"chunk sizes of {fqn!r}")
            chunks.append(Chunk(offsets, sizes))
        previous = layout.tensors.get(fqn)
        if previous is None:
            layout.tensors[fqn] = TensorInfo(fqn, dtype, shape, tuple(chunks))
        elif previous.dtype != dtype or previous.shape != shape:
            findings.append(error(
                "metadata-inconsistent",
                f"{name} describes {fqn!r} as {dtype}{list(shape)} but another metadata file as "
                f"{previous.dtype}{list(previous.shape)}",
                location=Location(file=name, fqn=fqn, rank=rank),
            ))
        else:
            merged = previous.chunks + tuple(c for c in chunks if c not in previous.chunks)
            layout.tensors[fqn] = TensorInfo(fqn, dtype, shape, merged)

    # Storage entries: where each item lives.
    for key, info in storage.items():
        idx = _want(key, "MetadataIndex", "a storage key").fields()
        fqn = _str(idx.get("fqn"), "a storage key's fqn")
        offset_raw = idx.get("offset")
        chunk_offsets = None if offset_raw is None else _dims(offset_raw, f"storage offset of {fqn!r}")
        sinfo = _want(info, "_StorageInfo", f"storage info of {fqn!r}").fields()
        where = Location(file=name, fqn=fqn, chunk_offsets=chunk_offsets, rank=rank)
        rel = safe_relative_path(sinfo.get("relative_path"))
        if rel is None:
            findings.append(error(
                "metadata-unsafe",
                f"storage path {str(sinfo.get('relative_path'))[:200]!r} of {fqn!r} points outside the "
                "checkpoint directory; it is not opened",
                location=where,
                actual=str(sinfo.get("relative_path"))[:200],
            ))
            continue
        start = _int(sinfo.get("offset"), f"storage offset of {fqn!r}")
        length = _int(sinfo.get("length"), f"storage length of {fqn!r}")
        transforms_raw = sinfo.get("transform_descriptors") or ()
        if not isinstance(transforms_raw, list | tuple):
            raise _BadMetadata(f"transform descriptors of {fqn!r} are not a list")
        transforms = tuple(_str(t, "a transform descriptor", 256) for t in transforms_raw)
        if chunk_offsets is None:
            kind, chunk, dtype = "bytes", None, None
            if fqn not in layout.byte_values:
                findings.append(error(
                    "metadata-inconsistent",
                    f"storage entry for {fqn!r} has no tensor offset, but the state dict metadata does not "
                    "list it as a byte value",
                    location=where,
                ))
        else:
            kind = "tensor"
            tinfo = layout.tensors.get(fqn)
            match = None if tinfo is None else next((c for c in tinfo.chunks if c.offsets == chunk_offsets), None)
            if match is None:
                findings.append(error(
                    "metadata-inconsistent",
                    f"storage entry for {fqn!r} at offsets {list(chunk_offsets)} matches no chunk in the "
                    "state dict metadata",
                    location=where,
                ))
                continue
            chunk, dtype = match, tinfo.dtype  # type: ignore[union-attr]
        layout.items.append(Item(
            fqn=fqn, kind=kind, file=rel, offset=start, length=length, chunk=chunk, dtype=dtype,
            transforms=transforms, source=name, rank=rank,
        ))
    return findings


def field_names_for_tests() -> dict[str, tuple[str, ...]]:
    """The DCP class fields this reader relies on, keyed by ``module.Class`` (used by the tests)."""
    return {
        f"{_DCP_MD}.Metadata": METADATA_FIELDS,
        f"{_DCP_MD}.TensorStorageMetadata": TENSOR_STORAGE_FIELDS,
        f"{_DCP_MD}.ChunkStorageMetadata": CHUNK_FIELDS,
        f"{_DCP_MD}.MetadataIndex": INDEX_FIELDS,
        f"{_DCP_FS}._StorageInfo": STORAGE_INFO_FIELDS,
        f"{_DCP_MD}.StorageMeta": STORAGE_META_FIELDS,
    }

