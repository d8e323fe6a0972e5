"""The manifest: what a checkpoint held when saved, written beside it as JSON (:data:`MANIFEST_FILE`;
schema: ``docs/manifest.md``).

Per item its place and digest (plus block digests, to localize damage), per file size and digest, per tensor
dtype, global shape and live fingerprint; ``.metadata`` pinned too. Written atomically and **last**, so its
presence marks a commit. ``self_digest`` (of its canonical JSON without that field) detects truncation or edits.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import re
from dataclasses import dataclass, field
from typing import Any

from ckptverify.errors import ManifestError, UsageError
from ckptverify.ownfiles.names import MANIFEST_FILE, MANIFEST_TEMP_PREFIX, write_atomic
from ckptverify.safeparse import paths, safejson
from ckptverify.safeparse.paths import safe_relative_path
from ckptverify.safeparse.readers import read_small_file

MANIFEST_SCHEMA = "ckptverify/manifest"
MANIFEST_SCHEMA_VERSION = 1
DEFAULT_BLOCK_BYTES = 1 << 20
#: Smallest and largest ``block_bytes`` accepted (on writing and on reading): one digest per 4 KiB at most.
MIN_BLOCK_BYTES = 4 << 10
MAX_BLOCK_BYTES = 1 << 30


def check_settings(digest: str, block_bytes: Any) -> None:
    """:class:`~ckptverify.errors.UsageError` unless a manifest written with ``digest`` and ``block_bytes`` is one
    verify accepts (checked before anything is written)."""
    from ckptverify.fingerprint.digest import digest_maker  # here: a plain verify imports no fingerprint code

    digest_maker(digest)
    if isinstance(block_bytes, bool) or not isinstance(block_bytes, int) \
            or not MIN_BLOCK_BYTES <= block_bytes <= MAX_BLOCK_BYTES:
        raise UsageError(f"block size must be a whole number of bytes in [{MIN_BLOCK_BYTES}, {MAX_BLOCK_BYTES}], "
                         f"got {block_bytes!r}")


#: A manifest larger than this is refused unread (1 MiB blocks of a 4 TiB checkpoint take about 160 MB).
MAX_MANIFEST_BYTES = 256 << 20
MAX_WORLD_SIZE = 1 << 20
_MAX_DIMS = 64
_RANK_METADATA = re.compile(r"__\d{1,9}\.metadata")
_DIGEST_CHARS = {"xxh3-128": 32, "sha256": 64}
_DIGEST_RE = {name: re.compile(f"[0-9a-f]{{{n}}}") for name, n in _DIGEST_CHARS.items()}
_HEX = re.compile(r"[0-9a-f]*")


@dataclass(frozen=True, slots=True)
class ItemEntry:
    """One stored item: where it is and the digest of its bytes (and of each block of them)."""

    fqn: str
    chunk_offsets: tuple[int, ...] | None
    file: str
    offset: int
    length: int
    digest: str
    blocks: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {
            "fqn": self.fqn,
            "chunk_offsets": None if self.chunk_offsets is None else list(self.chunk_offsets),
            "file": self.file,
            "offset": self.offset,
            "length": self.length,
            "digest": self.digest,
            "blocks": list(self.blocks),
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ItemEntry:
        offsets = d["chunk_offsets"]
        return cls(
            fqn=_s(d["fqn"]),
            chunk_offsets=None if offsets is None else tuple(_i(x) for x in _list(offsets)),
            file=_s(d["file"]),
            offset=_i(d["offset"]),
            length=_i(d["length"]),
            digest=_s(d["digest"]),
            blocks=_block_strings(_list(d.get("blocks", []))),
        )

    @property
    def key(self) -> tuple[str, tuple[int, ...] | None, str]:
        return (self.fqn, self.chunk_offsets, self.file)


@dataclass(frozen=True, slots=True)
class FileEntry:
    size: int
    digest: str

    def to_dict(self) -> dict[str, Any]:
        return {"size": self.size, "digest": self.digest}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> FileEntry:
        return cls(size=_i(d["size"]), digest=_s(d["digest"]))


@dataclass(frozen=True, slots=True)
class TensorEntry:
    """A tensor as in memory at save time: dtype, global shape, fingerprint (if taken); a subclass also has ``parts``
    (each inner tensor's fingerprint by name), so a mismatch names the part."""

    dtype: str
    shape: tuple[int, ...]
    fingerprint: str | None = None
    nan_count: int | None = None
    inf_count: int | None = None
    parts: tuple[tuple[str, str], ...] | None = None

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"dtype": self.dtype, "shape": list(self.shape), "fingerprint": self.fingerprint}
        out.update((k, v) for k, v in (("nan_count", self.nan_count), ("inf_count", self.inf_count)) if v is not None)
        if self.parts is not None:
            out["parts"] = dict(self.parts)
        return out

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TensorEntry:
        fp = d.get("fingerprint")
        return cls(
            dtype=_s(d["dtype"]),
            shape=tuple(_i(x) for x in _list(d["shape"])),
            fingerprint=None if fp is None else _s(fp),
            nan_count=_opt_i(d.get("nan_count")),
            inf_count=_opt_i(d.get("inf_count")),
            parts=_opt_parts(d.get("parts")),
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class Manifest:
    digest_algorithm: str
    block_bytes: int
    items: tuple[ItemEntry, ...]
    files: dict[str, FileEntry]
    tensors: dict[str, TensorEntry]
    metadata_files: dict[str, FileEntry] = field(default_factory=dict)
    world_size: int = 1
    fingerprint_version: int | None = None
    created: str = ""
    tool_version: str = ""
    torch_version: str = ""
    source: str = "save"  # "save": digests taken while writing; "fingerprint": adopted afterwards

    def __post_init__(self) -> None:
        # One canonical item order (by file, then offset), so a manifest equals itself read back.
        object.__setattr__(self, "items", tuple(sorted(self.items, key=lambda i: (i.file, i.offset, i.fqn))))

    def _scalars(self) -> dict[str, Any]:
        """The fields before the sections, in the order they are written."""
        return {"schema": MANIFEST_SCHEMA, "schema_version": MANIFEST_SCHEMA_VERSION, "created": self.created,
                "tool_version": self.tool_version, "torch_version": self.torch_version, "source": self.source,
                "world_size": self.world_size, "digest_algorithm": self.digest_algorithm,
                "block_bytes": self.block_bytes, "fingerprint_version": self.fingerprint_version}

    def to_dict(self) -> dict[str, Any]:
        body = {
            **self._scalars(),
            "metadata_files": {k: v.to_dict() for k, v in sorted(self.metadata_files.items())},
            "files": {k: v.to_dict() for k, v in sorted(self.files.items())},
            "tensors": {k: v.to_dict() for k, v in sorted(self.tensors.items())},
            "items": [i.to_dict() for i in self.items],
        }
        body["self_digest"] = _self_digest(body)
        return body

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Manifest:
        if d.get("schema") != MANIFEST_SCHEMA:
            raise ManifestError(f"not a ckptverify manifest (schema {d.get('schema')!r})")
        if d.get("schema_version") != MANIFEST_SCHEMA_VERSION:
            raise ManifestError(f"manifest schema version {d.get('schema_version')!r} is not supported "
                                f"(this ckptverify reads version {MANIFEST_SCHEMA_VERSION})")
        if d.get("self_digest") != _self_digest({k: v for k, v in d.items() if k != "self_digest"}):
            raise ManifestError("manifest self-digest does not match its content: it was edited or damaged")
        try:
            manifest = cls(
                digest_algorithm=_s(d["digest_algorithm"]),
                block_bytes=_i(d["block_bytes"]),
                items=tuple(ItemEntry.from_dict(i) for i in _list(d["items"])),
                files={_s(k): FileEntry.from_dict(v) for k, v in _dict(d["files"]).items()},
                tensors={_s(k): TensorEntry.from_dict(v) for k, v in _dict(d["tensors"]).items()},
                metadata_files={_s(k): FileEntry.from_dict(v) for k, v in _dict(d.get("metadata_files", {})).items()},
                world_size=_i(d.get("world_size", 1)),
                fingerprint_version=_opt_i(d.get("fingerprint_version")),
                created=_s(d.get("created", ""), 256),
                tool_version=_s(d.get("tool_version", ""), 256),
                torch_version=_s(d.get("torch_version", ""), 256),
                source=_s(d.get("source", "save"), 256),
            )
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ManifestError(f"manifest has the wrong structure: {type(exc).__name__}: {exc}"[:500]) from None
        validate(manifest)
        return manifest


def validate(manifest: Manifest) -> None:
    """Check every field of a manifest read from disk; :class:`ManifestError` at the first bad one. The self-digest
    proves it unchanged, not sensible: algorithms, digest forms, ``block_bytes`` bounds, plain relative paths inside
    the checkpoint, items inside listed files with one digest per block (or none), no duplicates, chunk offsets
    matching shapes (``docs/manifest.md``)."""
    from ckptverify.fingerprint import ALGORITHMS

    if manifest.digest_algorithm not in ALGORITHMS:
        raise ManifestError(f"digest algorithm {manifest.digest_algorithm[:40]!r} is not one this tool knows "
                            f"({', '.join(ALGORITHMS)})")
    digest_re = _DIGEST_RE[manifest.digest_algorithm]
    bb = manifest.block_bytes
    if not MIN_BLOCK_BYTES <= bb <= MAX_BLOCK_BYTES:
        raise ManifestError(f"block_bytes {bb} is outside [{MIN_BLOCK_BYTES}, {MAX_BLOCK_BYTES}]")
    if not 1 <= manifest.world_size <= MAX_WORLD_SIZE:
        raise ManifestError(f"world_size {manifest.world_size} is outside [1, {MAX_WORLD_SIZE}]")
    if manifest.source not in ("save", "fingerprint"):
        raise ManifestError(f"source {manifest.source[:40]!r} is neither 'save' nor 'fingerprint'")

    def digest(value: str, what: str) -> None:
        if not digest_re.fullmatch(value):
            raise ManifestError(f"{what}: {value[:80]!r} is not a {manifest.digest_algorithm} hex digest")

    for name, entry in manifest.files.items():
        if safe_relative_path(name) is None or name == MANIFEST_FILE:
            raise ManifestError(f"file name {name[:200]!r} does not name a file inside the checkpoint")
        digest(entry.digest, f"digest of {name}")
    for name, entry in manifest.metadata_files.items():
        if name != ".metadata" and not _RANK_METADATA.fullmatch(name):
            raise ManifestError(f"metadata file name {name[:200]!r} is not .metadata or __N.metadata")
        digest(entry.digest, f"digest of {name}")
    # Names and strings were bounded as they were read (_s): 64 KiB, a part's name 64, its fingerprint 256.
    for fqn, tensor in manifest.tensors.items():
        if len(tensor.dtype) > 64 or len(tensor.shape) > _MAX_DIMS:
            raise ManifestError(f"tensor entry {fqn[:200]!r} is malformed")
        if tensor.fingerprint is not None and len(tensor.fingerprint) > 256:
            raise ManifestError(f"tensor entry {fqn[:200]!r} has an oversized fingerprint")
        if tensor.parts is not None and len(tensor.parts) > _MAX_PARTS:
            raise ManifestError(f"tensor entry {fqn[:200]!r} has malformed parts")
    seen: set[tuple[str, tuple[int, ...] | None, str]] = set()
    for item in manifest.items:
        what = f"item {item.fqn[:200]!r} in {item.file[:200]!r}"
        file = manifest.files.get(item.file)
        if file is None:
            raise ManifestError(f"{what}: the file is not among the manifest's files")
        if item.offset + item.length > file.size:
            raise ManifestError(f"{what}: bytes [{item.offset}, {item.offset + item.length}) lie past the end of "
                                f"the file ({file.size} bytes)")
        if item.key in seen:
            raise ManifestError(f"{what}: listed twice")
        seen.add(item.key)
        digest(item.digest, f"digest of {what}")
        if item.blocks:
            want = -(-item.length // bb)
            if len(item.blocks) != want:
                raise ManifestError(f"{what}: {len(item.blocks)} block digests for {item.length} bytes in blocks "
                                    f"of {bb} (expected {want})")
            if not _block_digests_valid(item.blocks, _DIGEST_CHARS[manifest.digest_algorithm]):
                for block in item.blocks:  # find and name the first bad one
                    digest(block, f"a block digest of {what}")
        if item.chunk_offsets is not None:
            tensor = manifest.tensors.get(item.fqn)
            if tensor is None or len(tensor.shape) != len(item.chunk_offsets):
                raise ManifestError(f"{what}: its chunk offsets {list(item.chunk_offsets)[:8]} do not fit any "
                                    "tensor the manifest lists")


def _self_digest(body: dict[str, Any]) -> str:
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()
    return "sha256:" + hashlib.sha256(canonical).hexdigest()


def _block_strings(blocks: list[Any]) -> tuple[str, ...]:
    """``tuple(_s(b, 128) for b in blocks)`` checked in a few C passes (millions of block digests, before every verify).
    """
    joined = "".join(blocks) if set(map(type, blocks)) <= {str} else None
    if joined is None or "\x00" in joined or (blocks and max(map(len, blocks)) > 128):
        return tuple(_s(b, 128) for b in blocks)  # raises, naming the first bad one
    return tuple(blocks)


def _block_digests_valid(blocks: tuple[str, ...], size: int) -> bool:
    """Whether every string of ``blocks`` is a ``size``-character hex digest, in one match."""
    return not blocks or (min(map(len, blocks)) == size == max(map(len, blocks))
                          and _HEX.fullmatch("".join(blocks)) is not None)


def _i(v: Any) -> int:
    if type(v) is not int or not 0 <= v < 1 << 63:
        raise ValueError(f"expected an integer in [0, 2^63), got {v!r}"[:120])
    return v


def _opt_i(v: Any) -> int | None:
    return None if v is None else _i(v)


#: Most inner tensors a tensor subclass's entry may name.
_MAX_PARTS = 16


def _opt_parts(v: Any) -> tuple[tuple[str, str], ...] | None:
    if v is None:
        return None
    if not isinstance(v, dict):
        raise ManifestError("tensor parts are not an object")
    return tuple((_s(k, 64), _s(x, 256)) for k, x in v.items())


def _s(v: Any, limit: int = 1 << 16) -> str:
    if type(v) is not str:
        raise ValueError(f"expected a string, got {type(v).__name__}")
    if len(v) > limit or "\x00" in v:
        raise ValueError(f"a string longer than {limit} characters or holding NUL")
    return v


def _list(v: Any) -> list[Any]:
    if type(v) is not list:
        raise ValueError(f"expected a list, got {type(v).__name__}")
    return v


def _dict(v: Any) -> dict[str, Any]:
    if type(v) is not dict:
        raise ValueError(f"expected an object, got {type(v).__name__}")
    return v


def file_manifest_name(filename: str) -> str:
    """The manifest name beside single file ``filename`` (``x.ckpt`` -> ``x.ckpt.ckptverify.manifest.json``)."""
    return f"{filename}.{MANIFEST_FILE}"


def read_manifest(root: str, *, max_bytes: int = MAX_MANIFEST_BYTES, name: str = MANIFEST_FILE) -> Manifest | None:
    """The manifest at ``root`` (``None`` if absent): a regular file inside ``root``, at most ``max_bytes``, passing
    :func:`validate`. Raises :class:`ManifestError`."""
    path = os.path.join(root, name)
    if not paths.lexists(path):
        return None
    try:
        data = safejson.loads(read_small_file(path, max_bytes, root=root), max_bytes=max_bytes)
    except (OSError, ValueError, RecursionError, MemoryError) as exc:
        raise ManifestError(f"manifest cannot be read: {type(exc).__name__}: {exc}"[:500]) from None
    if not isinstance(data, dict):
        raise ManifestError("manifest is not a JSON object")
    return Manifest.from_dict(data)


def write_manifest(root: str, manifest: Manifest, *, name: str = MANIFEST_FILE) -> str:
    """Write ``manifest`` into ``root`` as ``name`` atomically (temp, fsync, rename, fsync dir); returns its path. To a
    URL: one PUT (whole or nothing)."""
    path = os.path.join(root, name)
    text = manifest_text(manifest)
    if paths.is_url(path):
        from ckptverify.safeparse import remote

        remote.put_small(path, text.encode())
        return path
    return write_atomic(path, text, prefix=MANIFEST_TEMP_PREFIX)


def _dumps_by_line(body: dict[str, Any]) -> str:
    """``body`` as JSON, one top-level field and one list/object entry per line (readable, diffable), each encoded by
    the C encoder (``indent=`` uses the pure-Python one, ten times slower)."""
    enc = json.JSONEncoder(ensure_ascii=True, allow_nan=True).encode
    lines = []
    for key, value in body.items():
        head = f" {enc(key)}: "
        if type(value) is dict and value:
            inner = ",\n".join(f"  {enc(k)}: {enc(v)}" for k, v in value.items())
            lines.append(f"{head}{{\n{inner}\n }}")
        elif type(value) is list and value:
            inner = ",\n".join(f"  {enc(v)}" for v in value)
            lines.append(f"{head}[\n{inner}\n ]")
        else:
            lines.append(head + enc(value))
    return "{\n" + ",\n".join(lines) + "\n}"


def manifest_text(manifest: Manifest) -> str:
    """Exactly what :func:`write_manifest` writes (``_dumps_by_line(manifest.to_dict())``), built from string pieces
    each escaped once. Values of unexpected types, or tensors with ``parts``, go through :meth:`Manifest.to_dict` (same
    text)."""
    try:
        sections = {
            "metadata_files": _dict_section(manifest.metadata_files, _file_pieces),
            "files": _dict_section(manifest.files, _file_pieces),
            "tensors": _dict_section(manifest.tensors, _tensor_pieces),
            "items": _list_section(manifest.items),
        }
    except TypeError:  # a value of another type than its column's (_only): the encoder's own way, same text
        return _dumps_by_line(manifest.to_dict())
    enc = json.JSONEncoder(ensure_ascii=True, allow_nan=True).encode
    lines: dict[str, str] = {}
    canonical: dict[str, str] = {}
    for key, value in manifest._scalars().items():
        lines[key] = canonical[key] = enc(value)
    for key, (line, compact) in sections.items():
        lines[key], canonical[key] = line, compact
    text = "{" + ",".join(f"{enc(k)}:{canonical[k]}" for k in sorted(canonical)) + "}"
    digest = "sha256:" + hashlib.sha256(text.encode()).hexdigest()
    lines["self_digest"] = enc(digest)
    return "{\n" + ",\n".join(f" {enc(k)}: {v}" for k, v in lines.items()) + "\n}"


_esc = json.encoder.encode_basestring_ascii  # type: ignore[attr-defined]
_NONE = type(None)


def _only(values: Any, *types: type) -> None:
    """``TypeError`` unless each of ``values`` is exactly one of ``types`` (a subclass, e.g. ``bool`` for ``int``, would
    encode differently)."""
    if not set(map(type, values)) <= set(types):
        raise TypeError("a manifest value of a type its column does not declare")


def _dict_section(entries: dict[str, Any], pieces: Any) -> tuple[str, str]:
    """A section of named entries as its lines and canonical form, in name order."""
    if not entries:
        return "{}", "{}"
    names = sorted(entries)
    _only(names, str)
    lines, compact = pieces([entries[n] for n in names])
    keys = list(map(_esc, names))
    return ("{\n" + ",\n".join([f"  {k}: {v}" for k, v in zip(keys, lines, strict=True)]) + "\n }",
            "{" + ",".join([f"{k}:{v}" for k, v in zip(keys, compact, strict=True)]) + "}")


def _file_pieces(entries: list[FileEntry]) -> tuple[list[str], list[str]]:
    sizes, digests = [e.size for e in entries], [e.digest for e in entries]
    _only(sizes, int)
    _only(digests, str)
    digests = list(map(_esc, digests))
    return ([f'{{"size": {n}, "digest": {d}}}' for n, d in zip(sizes, digests, strict=True)],
            [f'{{"digest":{d},"size":{n}}}' for n, d in zip(sizes, digests, strict=True)])


def _shape_text(shapes: list[Any]) -> list[tuple[str, str]]:
    """Each shape tuple as the encoder writes it with and without spaces (equal tuples share text)."""
    _only(shapes, tuple)
    _only(itertools.chain.from_iterable(shapes), int)
    known: dict[tuple[int, ...], tuple[str, str]] = {}
    out = []
    for shape in shapes:
        text = known.get(shape)
        if text is None:
            wide = "[" + ", ".join(map(int.__repr__, shape)) + "]"
            text = known[shape] = (wide, wide.replace(" ", ""))
        out.append(text)
    return out


def _tensor_pieces(entries: list[TensorEntry]) -> tuple[list[str], list[str]]:
    dtypes, fps = [e.dtype for e in entries], [e.fingerprint for e in entries]
    nans, infs = [e.nan_count for e in entries], [e.inf_count for e in entries]
    _only(dtypes, str)
    _only(fps, str, _NONE)
    _only(nans, int, _NONE)
    _only(infs, int, _NONE)
    shapes = _shape_text([e.shape for e in entries])
    lines, compact = [], []
    for e, dtype, fp, nan, inf, (wide, narrow) in zip(entries, dtypes, fps, nans, infs, shapes, strict=True):
        if e.parts is not None:  # rare (tensor subclasses): as the encoder writes it
            body = e.to_dict()
            lines.append(json.dumps(body, ensure_ascii=True))
            compact.append(json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True))
            continue
        dtype = _esc(dtype)
        fp = "null" if fp is None else _esc(fp)
        # Keys in the encoder's order for the line, sorted for the canonical form.
        line = f'{{"dtype": {dtype}, "shape": {wide}, "fingerprint": {fp}'
        canon = f'{{"dtype":{dtype},"fingerprint":{fp}'
        if nan is not None:
            line += f', "nan_count": {nan}'
        if inf is not None:
            line += f', "inf_count": {inf}'
            canon += f',"inf_count":{inf}'
        if nan is not None:
            canon += f',"nan_count":{nan}'
        lines.append(line + "}")
        compact.append(canon + f',"shape":{narrow}}}')
    return lines, compact


def _list_section(items: tuple[ItemEntry, ...]) -> tuple[str, str]:
    """The items, one a line, and their canonical form (in the manifest's item order)."""
    if not items:
        return "[]", "[]"
    fqns, files, digests = [i.fqn for i in items], [i.file for i in items], [i.digest for i in items]
    offsets, lengths = [i.offset for i in items], [i.length for i in items]
    blocks, chunks = [i.blocks for i in items], [i.chunk_offsets for i in items]
    for column in (fqns, files, digests):
        _only(column, str)
    _only(offsets, int)
    _only(lengths, int)
    _only(blocks, tuple)
    _only(itertools.chain.from_iterable(blocks), str)
    placed = [c for c in chunks if c is not None]
    shapes = iter(_shape_text(placed))
    lines, compact = [], []
    for fqn, file, digest, offset, length, block, chunk in zip(
            map(_esc, fqns), map(_esc, files), map(_esc, digests), offsets, lengths, blocks, chunks, strict=True):
        if len(block) == 1:
            spaced = tight = f"[{_esc(block[0])}]"
        else:
            parts = list(map(_esc, block))
            spaced, tight = "[" + ", ".join(parts) + "]", "[" + ",".join(parts) + "]"
        wide, narrow = ("null", "null") if chunk is None else next(shapes)
        lines.append(f'  {{"fqn": {fqn}, "chunk_offsets": {wide}, "file": {file}, "offset": {offset}, '
                     f'"length": {length}, "digest": {digest}, "blocks": {spaced}}}')
        compact.append(f'{{"blocks":{tight},"chunk_offsets":{narrow},"digest":{digest},"file":{file},'
                       f'"fqn":{fqn},"length":{length},"offset":{offset}}}')
    return "[\n" + ",\n".join(lines) + "\n ]", "[" + ",".join(compact) + "]"
