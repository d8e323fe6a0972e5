"""The manifest: what a checkpoint held when it was saved, written beside it as JSON.

A manifest records, for every item DCP wrote, its exact place and a digest of its bytes (plus digests of
fixed-size blocks, to localize damage), for every file its size and digest, and for every tensor its dtype,
global shape and the logical fingerprint of the live tensor at save time. It also pins ``.metadata``.

It is written atomically (temporary file, fsync, rename) and **last**, so its presence marks a committed
checkpoint. Its own integrity is protected by ``self_digest``, a digest of its canonical JSON form without
that field: a truncated or edited manifest is detected, never trusted.

File name: :data:`MANIFEST_FILE`. Schema: ``docs/manifest.md``.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass, field
from typing import Any

MANIFEST_FILE = "ckptverify.manifest.json"
MANIFEST_SCHEMA = "ckptverify/manifest"
MANIFEST_SCHEMA_VERSION = 1
DEFAULT_BLOCK_BYTES = 1 << 20


class ManifestError(Exception):
    """The manifest is unreadable, truncated, edited, or of an unknown schema. Becomes a finding."""


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
            chunk_offsets=None if offsets is None else tuple(_i(x) for x in offsets),
            file=_s(d["file"]),
            offset=_i(d["offset"]),
            length=_i(d["length"]),
            digest=_s(d["digest"]),
            blocks=tuple(_s(b) for b in d.get("blocks", ())),
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
    """A tensor as it was in memory at save time: dtype, global shape, logical fingerprint (if taken)."""

    dtype: str
    shape: tuple[int, ...]
    fingerprint: str | None = None
    nan_count: int | None = None
    inf_count: int | None = None

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"dtype": self.dtype, "shape": list(self.shape), "fingerprint": self.fingerprint}
        if self.nan_count is not None:
            out["nan_count"] = self.nan_count
        if self.inf_count is not None:
            out["inf_count"] = self.inf_count
        return out

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TensorEntry:
        fp = d.get("fingerprint")
        return cls(
            dtype=_s(d["dtype"]),
            shape=tuple(_i(x) for x in d["shape"]),
            fingerprint=None if fp is None else _s(fp),
            nan_count=_opt_i(d.get("nan_count")),
            inf_count=_opt_i(d.get("inf_count")),
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

    def to_dict(self) -> dict[str, Any]:
        body = {
            "schema": MANIFEST_SCHEMA,
            "schema_version": MANIFEST_SCHEMA_VERSION,
            "created": self.created,
            "tool_version": self.tool_version,
            "torch_version": self.torch_version,
            "source": self.source,
            "world_size": self.world_size,
            "digest_algorithm": self.digest_algorithm,
            "block_bytes": self.block_bytes,
            "fingerprint_version": self.fingerprint_version,
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
        recorded = d.get("self_digest")
        body = {k: v for k, v in d.items() if k != "self_digest"}
        if recorded != _self_digest(body):
            raise ManifestError("manifest self-digest does not match its content: it was edited or damaged")
        try:
            return cls(
                digest_algorithm=_s(d["digest_algorithm"]),
                block_bytes=_i(d["block_bytes"]),
                items=tuple(ItemEntry.from_dict(i) for i in d["items"]),
                files={_s(k): FileEntry.from_dict(v) for k, v in d["files"].items()},
                tensors={_s(k): TensorEntry.from_dict(v) for k, v in d["tensors"].items()},
                metadata_files={_s(k): FileEntry.from_dict(v) for k, v in d.get("metadata_files", {}).items()},
                world_size=_i(d.get("world_size", 1)),
                fingerprint_version=_opt_i(d.get("fingerprint_version")),
                created=str(d.get("created", "")),
                tool_version=str(d.get("tool_version", "")),
                torch_version=str(d.get("torch_version", "")),
                source=str(d.get("source", "save")),
            )
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ManifestError(f"manifest has the wrong structure: {type(exc).__name__}: {exc}") from None


def _self_digest(body: dict[str, Any]) -> str:
    import hashlib

    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()
    return "sha256:" + hashlib.sha256(canonical).hexdigest()


def _i(v: Any) -> int:
    if type(v) is not int or v < 0:
        raise ValueError(f"expected a non-negative integer, got {v!r}"[:120])
    return v


def _opt_i(v: Any) -> int | None:
    return None if v is None else _i(v)


def _s(v: Any) -> str:
    if type(v) is not str:
        raise ValueError(f"expected a string, got {type(v).__name__}")
    return v


def read_manifest(root: str, *, max_bytes: int = 1 << 30) -> Manifest | None:
    """The manifest of the checkpoint at ``root``; ``None`` if it has none. Raises :class:`ManifestError`."""
    path = os.path.join(root, MANIFEST_FILE)
    if not os.path.lexists(path):
        return None
    try:
        if os.path.getsize(path) > max_bytes:
            raise ManifestError(f"manifest is larger than {max_bytes} bytes")
        with open(path, "rb") as f:
            data = json.loads(f.read())
    except (OSError, ValueError, RecursionError) as exc:
        raise ManifestError(f"manifest cannot be read: {type(exc).__name__}: {exc}") from None
    if not isinstance(data, dict):
        raise ManifestError("manifest is not a JSON object")
    return Manifest.from_dict(data)


def _umask() -> int:
    """The process umask, read without changing it (``os.umask`` would race with other threads)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    return 0o022


def write_manifest(root: str, manifest: Manifest) -> str:
    """Write ``manifest`` into ``root`` atomically (temp file, fsync, rename, fsync dir). Returns its path."""
    path = os.path.join(root, MANIFEST_FILE)
    data = json.dumps(manifest.to_dict(), indent=1, sort_keys=False).encode()
    fd, tmp = tempfile.mkstemp(prefix=".ckptverify-manifest-", dir=root)
    try:
        # mkstemp creates 0600; give the manifest the permissions any new file here would get.
        os.fchmod(fd, 0o666 & ~_umask())
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    dir_fd = os.open(root, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
    return path
