"""One description of what a checkpoint holds, whatever its format: the layer ``fingerprint``, ``verify --deep`` and
``diff`` work on.

A :class:`Description` lists files (by content format), tensors (with a :class:`Payload` per stored piece, and
what checksum protects it) and plain values. Readers here go by content (nothing unpickled, no link followed, no
special file opened): ``torch.save`` (via :mod:`~ckptverify.safeparse.torchsave`; allowlisted subclasses by
part), safetensors, plain and legacy pickles (values only), JSON. In a single file names are paths in the file;
in a folder, weight files' tensors keep their own names (to compare with DCP), everything else is ``FILE:PATH``.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import os
import stat
import struct
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

from ckptverify.dcp import safetensors
from ckptverify.dcp.layout import DTYPE_ITEMSIZE
from ckptverify.dcp.tensors import BLOCK_BYTES
from ckptverify.errors import ArchiveError, BadPickle, FindingError, JSONError
from ckptverify.ownfiles.names import MANIFEST_FILE, OWN_FILES, PARTS_PREFIX
from ckptverify.safeparse import paths, safejson
from ckptverify.safeparse.dtypes import contiguous_strides, is_row_major, view_extent
from ckptverify.safeparse.readers import ReadOnlyFile
from ckptverify.safeparse.torchsave import MAX_PICKLE_BYTES, PickleScan, leaf_values, scan_pickle
from ckptverify.safeparse.zipwalk import Archive, looks_like_zip, parse_archive, range_reader

if TYPE_CHECKING:
    import torch

__all__ = ["JSON_MAX_BYTES", "Description", "Payload", "StoredRange", "SubclassDesc", "SubclassPart", "TensorDesc",
           "add_side_files", "describe", "folder_files", "is_own_file", "iter_payload_blocks", "read_parts",
           "read_payload", "read_tensor", "sniff", "stored_part", "stored_payloads", "view_span"]


def is_own_file(name: str) -> bool:
    """ckptverify's own files: manifest, stamp, a file's manifest beside it, parts plan and verdicts."""
    return name in OWN_FILES or name.endswith(f".{MANIFEST_FILE}") or name.startswith(PARTS_PREFIX)


_WEIGHT_PREFIXES = ("pytorch_model", "model")
#: Bound on bytes laid out by views expanding their storage (stride 0, overlaps), per view and per deep scan:
#: otherwise a few stored bytes could stand for unbounded work.
MAX_VIEW_BYTES = 4 << 30
#: Largest such view materialised whole (:func:`read_tensor`, :func:`read_parts`).
MAX_MATERIALISED_VIEW_BYTES = 256 << 20
#: Largest JSON side file (config, index, trainer state) that is parsed.
JSON_MAX_BYTES = 64 << 20


def sniff(head: bytes) -> str | None:
    """``torch.save`` (a zip), ``safetensors`` (an 8-byte length plus JSON), ``pickle`` (a protocol byte: legacy
    ``torch.save``) or ``None`` from a file's first 16 bytes; never by name alone. Safetensors is tried first: its
    first byte is ``0x80`` for one header length in 256, while a pickle never has ``{`` at byte 8 (legacy
    ``torch.save`` has its magic number there)."""
    if looks_like_zip(head):
        return "torch.save"
    if len(head) >= 9:
        (n,) = struct.unpack("<Q", head[:8])
        if 2 <= n <= safetensors.MAX_HEADER_BYTES and head[8:9] == b"{":
            return "safetensors"
    if head[:1] == b"\x80" and head[1:2] in (b"\x02", b"\x03", b"\x04", b"\x05"):
        return "pickle"
    return None


@dataclass(frozen=True, slots=True)
class Payload:
    """One stored piece of a tensor: storage bytes ``[offset, offset + length)`` of ``file``, the view (``shape``,
    ``stride``, ``storage_offset``), its place in the global tensor (``chunk_offsets``). ``encoding``: ``raw`` or
    ``+``-joined stream transforms (then the range addresses the decoded stream of ``stored``). ``checksum``:
    ``crc32``, ``manifest``, ``crc32+manifest`` or ``none``."""

    file: str
    offset: int
    length: int
    dtype: str
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    storage_offset: int = 0
    chunk_offsets: tuple[int, ...] = ()
    encoding: str = "raw"
    checksum: str = "none"
    stored: tuple[int, int] | None = None

    def to_json(self) -> dict[str, Any]:
        """The piece as JSON values, for :meth:`from_json` in another process."""
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Payload:
        """The piece :meth:`to_json` gave (what another process described or scanned)."""
        fields = dict(d)
        for key in ("shape", "stride", "chunk_offsets"):
            fields[key] = tuple(fields[key])
        if fields.get("stored") is not None:
            fields["stored"] = tuple(fields["stored"])
        return cls(**fields)


@dataclass(slots=True)
class SubclassPart:
    """One inner tensor of a stored subclass: name, dtype, shape, and its payload."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    payload: Payload


@dataclass(slots=True)
class SubclassDesc:
    """How a stored tensor subclass keeps its values: class, ``context`` (canonical JSON,
    :mod:`ckptverify.fingerprint.subclass`) and inner tensors in flatten order."""

    cls: str
    context: str
    parts: list[SubclassPart] = field(default_factory=list)


@dataclass(slots=True)
class TensorDesc:
    """A tensor: global dtype and shape, stored pieces, and ``unread`` pieces (why, one line each). A subclass has no
    payloads of its own: ``subclass`` describes its parts."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    payloads: list[Payload] = field(default_factory=list)
    unread: list[str] = field(default_factory=list)
    subclass: SubclassDesc | None = None


class StoredRange(NamedTuple):
    """A byte range of ``file`` a manifest digests as one item (a DCP item; ``name`` its FQN)."""

    name: str
    chunk_offsets: tuple[int, ...] | None
    file: str
    offset: int
    length: int


@dataclass(slots=True)
class Description:
    """What a checkpoint holds. ``root``: base of file names; ``files``: name -> format; ``unread``: undescribable
    files, with why; ``metadata_files``; ``stored``: items a manifest digests singly (DCP). ``opener``: how bytes are
    read (:meth:`open`; default read-only inside ``root``)."""

    root: str
    format: str
    files: dict[str, str] = field(default_factory=dict)
    tensors: dict[str, TensorDesc] = field(default_factory=dict)
    values: dict[str, str] = field(default_factory=dict)
    unread: dict[str, str] = field(default_factory=dict)
    metadata_files: list[str] = field(default_factory=list)
    stored: list[StoredRange] = field(default_factory=list)
    opener: Callable[[Payload | str], Any] | None = field(default=None, repr=False, compare=False)

    def open(self, what: Payload | str) -> AbstractContextManager[Any]:
        """A reader (``pread``, ``fold``, ``crc32``, ``size``) of a payload's bytes (decoded if encoded) or of a file by
        name, as a context manager. ``OSError`` if unopenable, ``ValueError`` for an encoding without decoder."""
        if self.opener is not None:
            return nullcontext(self.opener(what))
        if isinstance(what, Payload) and what.encoding != "raw":
            raise ValueError(f"{what.file}: payload encoded as {what.encoding!r}, which this description cannot "
                             "decode")
        name = what if isinstance(what, str) else what.file
        return ReadOnlyFile(os.path.join(self.root, name), root=self.root)


def stored_payloads(t: TensorDesc) -> list[Payload]:
    """Every stored piece of ``t``: its payloads, or, stored as a tensor subclass, its parts' payloads."""
    return t.payloads if t.subclass is None else [part.payload for part in t.subclass.parts]


def stored_part(t: TensorDesc, p: Payload) -> str | None:
    """The name of the part of tensor subclass ``t`` that payload ``p`` holds (``None`` for a plain tensor)."""
    if t.subclass is None:
        return None
    return next((part.name for part in t.subclass.parts if part.payload == p), None)


def describe(path: str | os.PathLike[str], *,
             read: tuple[Archive, PickleScan] | safetensors.Blob | Mapping[str, Callable[[], Description]] | None
             = None) -> Description:
    """Describe a single checkpoint file, or a folder's own regular files (DCP sub-folders are not part of it).
    ``read``, what the checks already read, so that it is not read again: a single file's archive and pickle
    (``torch.save``) or blob (safetensors); a folder's files' descriptions by name, each a call (a file not named is
    read here)."""
    target = os.fspath(path)
    if not isinstance(read, Mapping) and (read is not None or not paths.isdir(target)):
        root, name = os.path.split(paths.abspath(target))
        return _file(root, name, read)
    files = read or {}
    desc = Description(root=target, format="folder")
    for name in folder_files(target):  # directories (DCP parts) are described apart
        weights = name.endswith(".safetensors") or (name.startswith(_WEIGHT_PREFIXES) and name.endswith(".bin"))
        own = files[name]() if name in files else _file(target, name)
        _add_named(desc, name, own, plain=weights)
    return desc


def folder_files(root: str) -> list[str]:
    """Regular files directly in ``root`` except ckptverify's own, sorted (links and special files are never opened:
    folder-check findings)."""
    out = []
    with paths.scandir(root) as it:
        for e in it:
            try:
                if not is_own_file(e.name) and stat.S_ISREG(e.stat(follow_symlinks=False).st_mode):
                    out.append(e.name)
            except OSError:
                continue
    return sorted(out)


def add_side_files(desc: Description, names: list[str]) -> None:
    """The side files ``names`` beside a DCP checkpoint (in ``desc.root``) into ``desc``, every name prefixed by its
    file."""
    for name in names:
        _add_named(desc, name, _file(desc.root, name), plain=False)


def _file(root: str, name: str, read: tuple[Archive, PickleScan] | safetensors.Blob | None = None) -> Description:
    """File ``name`` of ``root`` in its own terms (tensors and values by their paths in it), from ``read`` if given."""
    desc = Description(root=root, format="file")
    if read is None:
        _add_file(desc, name)
    elif isinstance(read, tuple):
        _torch_save_read(desc, name, *read)
    else:
        _safetensors_read(desc, name, read)
    desc.format = desc.files.get(name, "unknown")
    return desc


def _add_named(desc: Description, name: str, own: Description, *, plain: bool) -> None:
    """File ``name``'s own description ``own`` into ``desc``, of the files beside it: its tensors keep their names if
    ``plain`` (and no other file took them first), else are ``NAME:PATH``, as its values always are."""
    desc.files.update(own.files)
    desc.unread.update(own.unread)
    for path, t in own.tensors.items():
        tname = path if plain and path not in desc.tensors else f"{name}:{path}"
        desc.tensors[tname] = dataclasses.replace(t, name=tname)
    desc.values.update((f"{name}:{path}", v) for path, v in own.values.items())


def _add_file(desc: Description, name: str) -> None:
    try:
        with ReadOnlyFile(os.path.join(desc.root, name), root=desc.root) as f:
            kind = "json" if name.endswith(".json") else sniff(f.pread(0, 16))
            reader = {"torch.save": _torch_save, "safetensors": _safetensors, "pickle": _pickle, "json": _json}.get(
                kind or "")
            if reader is None:
                desc.unread[name] = "not a checkpoint file (unknown content)"
            else:
                reader(desc, f, name)
    except OSError as exc:
        desc.unread[name] = f"cannot be read: {exc}"


def _tensor_name(desc: Description, name: str, path: str) -> str:
    return path if path not in desc.tensors else f"{name}:{path}"


def _torch_save(desc: Description, f: ReadOnlyFile, name: str) -> None:
    try:
        archive = parse_archive(range_reader(f), f.size)
    except ArchiveError as exc:
        desc.unread[name] = f"not an intact torch.save archive: {exc}"
        return
    desc.files[name] = "torch.save"
    pkl = archive.record("data.pkl")
    if pkl is None or pkl.size > MAX_PICKLE_BYTES:
        desc.unread[name] = "no data.pkl it can read"
        return
    try:
        scan = scan_pickle(f.pread(pkl.data_offset, pkl.size))
    except BadPickle as exc:
        desc.unread[name] = f"data.pkl cannot be read safely: {exc}"
        return
    _torch_save_read(desc, name, archive, scan)


def _torch_save_read(desc: Description, name: str, archive: Archive, scan: PickleScan) -> None:
    desc.files[name] = "torch.save"
    for path, sub in scan.subclasses.items():
        tname = _tensor_name(desc, name, path)
        t = desc.tensors[tname] = TensorDesc(tname, sub.dtype, sub.size)
        stored = SubclassDesc(sub.cls, sub.context)
        for part, ref in sub.parts:
            rec = archive.record(f"data/{ref.storage_key}")
            if rec is None or ref.dtype is None:
                t.unread.append(f"{tname}: no storage record for its {part!r} part")
                break
            stored.parts.append(SubclassPart(part, ref.dtype, ref.size, _record_payload(name, rec, ref)))
        else:
            t.subclass = stored
    for path, ref in scan.tensors.items():
        rec = archive.record(f"data/{ref.storage_key}")
        if rec is None or ref.dtype is None:
            desc.unread.setdefault(name, f"tensor {path!r} has no storage record or dtype")
            continue
        tname = _tensor_name(desc, name, path)
        desc.tensors[tname] = TensorDesc(tname, ref.dtype, ref.size, [_record_payload(name, rec, ref)])
    desc.values.update(leaf_values(scan.root))


def _record_payload(name: str, rec: Any, ref: Any) -> Payload:
    """The whole tensor ``ref`` (a :class:`~ckptverify.safeparse.torchsave.TensorHeader`) in record ``rec`` of ``name``.
    """
    return Payload(file=name, offset=rec.data_offset, length=rec.size, dtype=ref.dtype, shape=ref.size,
                   stride=ref.stride, storage_offset=ref.storage_offset, chunk_offsets=(0,) * len(ref.size),
                   checksum="crc32")


def _safetensors(desc: Description, f: ReadOnlyFile, name: str) -> None:
    try:
        blob = safetensors.read_blob(f, 0)
    except ArchiveError as exc:
        desc.unread[name] = f"not a well-formed safetensors file: {exc}"
        return
    _safetensors_read(desc, name, blob)


def _safetensors_read(desc: Description, name: str, blob: safetensors.Blob) -> None:
    desc.files[name] = "safetensors"
    for tname, t in blob.tensors.items():
        if t.dtype is None:
            desc.unread.setdefault(name, f"tensor {tname!r} has a dtype this tool does not read")
            continue
        full = _tensor_name(desc, name, tname)
        desc.tensors[full] = TensorDesc(full, t.dtype, t.shape, [Payload(
            file=name, offset=blob.data_start + t.begin, length=t.end - t.begin, dtype=t.dtype, shape=t.shape,
            stride=contiguous_strides(t.shape), chunk_offsets=(0,) * len(t.shape))])


def _why(what: str, exc: Exception) -> str:
    """``what: exc``, but once where the reader's own message already starts with ``what``."""
    said = str(exc)
    return said if said.startswith(what) else f"{what}: {said}"


def _pickle(desc: Description, f: ReadOnlyFile, name: str) -> None:
    if f.size > MAX_PICKLE_BYTES:
        desc.unread[name] = f"a pickle of {f.size} bytes, more than this tool reads"
        return
    data = f.pread(0, f.size)
    try:
        scan = scan_pickle(data)
    except BadPickle as exc:
        desc.unread[name] = _why("not a readable pickle", exc)
        return
    # A legacy (pre-1.6) torch.save starts with the pickled magic number; its tensors follow in raw form.
    desc.files[name] = "legacy" if isinstance(scan.root, int) and scan.root == 0x1950A86A20F9469CFC6C else "pickle"
    desc.values.update(leaf_values(scan.root))


def _json(desc: Description, f: ReadOnlyFile, name: str) -> None:
    if f.size > JSON_MAX_BYTES:
        desc.unread[name] = f"JSON of {f.size} bytes, more than this tool parses"
        return
    try:
        value = safejson.loads(f.pread(0, f.size), nonfinite=True)
    except JSONError as exc:
        desc.unread[name] = _why("not valid JSON", exc)[:200]
        return
    desc.files[name] = "json"
    if not name.endswith(".index.json"):  # a shard index is layout (which file holds what), not state
        desc.values.update(leaf_values(value))


# ------------------------------------------------------------------------------------------ reading tensors


def view_span(p: Payload) -> tuple[int, int]:
    """The storage bytes ``[start, end)`` ``p``'s view addresses (``(0, 0)`` if empty). ``ValueError`` for a damaged
    view (unknown dtype size, negative size/stride/offset, element outside the storage)."""
    itemsize = DTYPE_ITEMSIZE.get(p.dtype)
    if itemsize is None:
        raise ValueError(f"dtype {str(p.dtype)[:40]!r} has no known element size")
    if len(p.shape) != len(p.stride) or any(v < 0 for v in (*p.shape, *p.stride, p.storage_offset)):
        raise ValueError(f"the view (shape {list(p.shape)}, stride {list(p.stride)}, offset {p.storage_offset}) "
                         "is malformed")
    extent = view_extent(p.shape, p.stride, p.storage_offset)
    if extent == 0:
        return 0, 0
    if extent * itemsize > p.length:
        raise ValueError(f"the view reaches element {extent} but the storage holds {p.length // itemsize}")
    return p.storage_offset * itemsize, extent * itemsize


def read_payload(f: Any, p: Payload, limit: int = MAX_VIEW_BYTES) -> torch.Tensor:
    """Piece ``p`` as a tensor view onto the storage bytes it addresses (memory: those bytes). ``ValueError`` if the
    bytes cannot hold the view or it lays out more than ``limit`` bytes from fewer stored."""
    import torch

    from ckptverify.dcp.tensors import torch_dtype

    dtype = torch_dtype(p.dtype)
    start, end = view_span(p)
    if start == end:
        return torch.empty(p.shape, dtype=dtype)
    size = math.prod(p.shape) * DTYPE_ITEMSIZE[p.dtype]
    if size > max(end - start, limit):
        raise ValueError(f"the view lays out {size} bytes from {end - start} stored: refused")
    raw = bytearray(f.pread(p.offset + start, end - start))
    if len(raw) != end - start:
        raise ValueError("the storage bytes are cut short")
    return torch.frombuffer(raw, dtype=dtype).as_strided(p.shape, p.stride, 0)


def read_tensor(desc: Description, name: str) -> torch.Tensor:
    """Tensor ``name`` assembled from its payloads (memory: the whole tensor). ``ValueError`` for a subclass (see
    :func:`read_parts`)."""
    import torch

    from ckptverify.dcp.tensors import torch_dtype

    t = desc.tensors[name]
    if t.subclass is not None:
        raise ValueError(f"{name!r} is stored as a {t.subclass.cls.rsplit('.', 1)[-1]}: read its parts")
    out = torch.empty(t.shape, dtype=torch_dtype(t.dtype))
    for p in t.payloads:
        with desc.open(p) as f:
            piece = read_payload(f, p, MAX_MATERIALISED_VIEW_BYTES)
        view = out
        for dim, (o, n) in enumerate(zip(p.chunk_offsets, p.shape, strict=True)):
            view = view.narrow(dim, o, n)
        view.copy_(piece)
    return out


def read_parts(desc: Description, name: str) -> dict[str, torch.Tensor]:
    """The inner tensors of subclass tensor ``name`` by name, rebuilt (memory: the whole parts); ``ValueError`` if
    plain."""
    t = desc.tensors[name]
    if t.subclass is None:
        raise ValueError(f"{name!r} is not stored as a tensor subclass")
    out = {}
    for part in t.subclass.parts:
        with desc.open(part.payload) as f:
            out[part.name] = read_payload(f, part.payload, MAX_MATERIALISED_VIEW_BYTES)
    return out


def iter_payload_blocks(f: Any, p: Payload, max_bytes: int = BLOCK_BYTES, *,
                        row_major: bool | None = None) -> Iterator[tuple[tuple[int, ...], torch.Tensor]]:
    """Yield ``(global_offsets, tensor)`` boxes of at most ``max_bytes`` laid out making up piece ``p`` (via ``f``), so
    block fingerprints combine exactly: row-major views read block by block; other views (transposed, stride 0,
    overlapping) read once via :func:`read_payload`. ``row_major``: :func:`is_row_major` if known. Raises
    :class:`~ckptverify.errors.FindingError` (bytes too short, unknown dtype) or ``ValueError`` (view its bytes cannot
    hold)."""
    import torch

    from ckptverify.dcp.tensors import torch_dtype

    dtype = torch_dtype(p.dtype)
    itemsize = DTYPE_ITEMSIZE[p.dtype]
    sizes = p.shape
    if math.prod(sizes) == 0:
        yield p.chunk_offsets, torch.empty(sizes, dtype=dtype)
        return
    if row_major is None:
        row_major = is_row_major(sizes, p.stride)
    view_span(p)  # a view past its storage is damage, never the bytes of whatever lies beyond it
    if not row_major or not sizes:
        view = read_payload(f, p)
        for starts, lengths in _boxes(sizes, itemsize, max_bytes):
            block = view
            for dim, (s, n) in enumerate(zip(starts, lengths, strict=True)):
                if n != sizes[dim]:
                    block = block.narrow(dim, s, n)
            yield tuple(o + s for o, s in zip(p.chunk_offsets, starts, strict=True)), block
        return
    row_elems = math.prod(sizes[1:])
    row_bytes = row_elems * itemsize
    rows_per_block = max(1, max_bytes // row_bytes)
    start = p.offset + p.storage_offset * itemsize
    for r0 in range(0, sizes[0], rows_per_block):
        r1 = min(sizes[0], r0 + rows_per_block)
        raw = bytearray(f.pread(start + r0 * row_bytes, (r1 - r0) * row_bytes))
        if len(raw) != (r1 - r0) * row_bytes:
            raise FindingError("payload shorter than its shape")
        block = torch.frombuffer(raw, dtype=dtype).view((r1 - r0, *sizes[1:]))
        yield (p.chunk_offsets[0] + r0, *p.chunk_offsets[1:]), block


def _boxes(shape: tuple[int, ...], itemsize: int, max_bytes: int,
           ) -> Iterator[tuple[tuple[int, ...], tuple[int, ...]]]:
    """``(starts, lengths)`` of row-major boxes tiling ``shape``, each at most ``max_bytes`` laid out (at least one
    element)."""
    whole, inner = len(shape), 1
    while whole and inner * shape[whole - 1] * itemsize <= max_bytes:
        whole -= 1
        inner *= shape[whole]
    if not whole:
        yield (0,) * len(shape), tuple(shape)
        return
    cut = whole - 1
    per = max(1, max_bytes // (inner * itemsize))
    rest = len(shape) - whole
    for lead in itertools.product(*(range(n) for n in shape[:cut])):
        for s in range(0, shape[cut], per):
            yield (*lead, s, *(0,) * rest), (*(1,) * cut, min(per, shape[cut] - s), *shape[whole:])
