"""Byte digests: identities of exact bytes (``docs/fingerprint.md``); xxh3-128 by default, sha256 for tamper
evidence. Ranges are digested with flat memory; :func:`block_digests` narrows a mismatch to a block."""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from typing import Any, Protocol

import xxhash

from ckptverify.errors import CkptVerifyError, UsageError

__all__ = ["ALGORITHMS", "DEFAULT_ALGORITHM", "DEFAULT_BLOCK_SIZE", "BlockDigest", "ByteDigest", "RangeDigest",
           "block_digests", "digest_bytes", "digest_file_range", "digest_maker",
           "digest_reader", "new_digest"]

DEFAULT_ALGORITHM = "xxh3-128"
ALGORITHMS = ("xxh3-128", "sha256")

#: Default block size of :func:`block_digests`.
DEFAULT_BLOCK_SIZE = 1 << 20


class ByteDigest(Protocol):
    """A streaming digest: feed bytes with :meth:`update`, read the result with :meth:`hexdigest`."""

    def update(self, buffer: Any, /) -> None: ...

    def hexdigest(self) -> str: ...


_MAKERS: dict[str, Any] = {"xxh3-128": xxhash.xxh3_128, "sha256": hashlib.sha256}


def digest_maker(algorithm: str) -> Any:
    """The constructor of ``algorithm``'s digests; :class:`UsageError` for an unknown one."""
    make = _MAKERS.get(algorithm)
    if make is None:
        raise UsageError(f"unknown digest algorithm {algorithm!r}; choose one of {', '.join(ALGORITHMS)}")
    return make


def new_digest(algorithm: str = DEFAULT_ALGORITHM) -> ByteDigest:
    """A fresh streaming digest: ``"xxh3-128"`` (xxhash ``xxh3_128``) or ``"sha256"`` (hashlib)."""
    return digest_maker(algorithm)()


def digest_bytes(data: Any, algorithm: str = DEFAULT_ALGORITHM) -> str:
    """Hex digest of a bytes-like object, fed at construction (which releases the GIL; xxhash's one-shot functions
    do not)."""
    return digest_maker(algorithm)(data).hexdigest()


class BlockDigest:
    """A streaming digest of a byte stream plus one per fixed-size block (counted from the first byte; the last may be
    shorter; none if nothing fed). ``hexdigest()`` equals the plain digest of all bytes."""

    def __init__(self, algorithm: str = DEFAULT_ALGORITHM, block_size: int = DEFAULT_BLOCK_SIZE) -> None:
        if block_size <= 0:
            raise UsageError(f"block size must be positive, got {block_size}")
        self.algorithm = algorithm
        self.block_size = block_size
        self._whole = new_digest(algorithm)
        self._block = new_digest(algorithm)
        self._in_block = 0
        self._blocks: list[str] = []
        self.length = 0

    def update(self, buffer: Any, /) -> None:
        with memoryview(buffer) as raw, raw.cast("B") as view:
            self._whole.update(view)
            self.length += len(view)
            pos = 0
            while pos < len(view):
                take = min(self.block_size - self._in_block, len(view) - pos)
                with view[pos : pos + take] as piece:
                    self._block.update(piece)
                self._in_block += take
                pos += take
                if self._in_block == self.block_size:
                    self._blocks.append(self._block.hexdigest())
                    self._block = new_digest(self.algorithm)
                    self._in_block = 0

    def hexdigest(self) -> str:
        return self._whole.hexdigest()

    def block_hexdigests(self) -> list[str]:
        """One hex digest per block, the last (partial) block included."""
        if self._in_block:
            return [*self._blocks, self._block.hexdigest()]
        return list(self._blocks)


@dataclass(frozen=True)
class RangeDigest:
    """The digest of a byte range and of each ``block_size`` block of it (counted from the range start)."""

    algorithm: str
    digest: str
    block_size: int
    blocks: tuple[str, ...]


def _read_range(path: str | os.PathLike[str], offset: int, length: int, sink: ByteDigest,
                root: str | None = None) -> None:
    """Feed ``length`` bytes of ``path`` from ``offset`` to ``sink`` through a
    :class:`~ckptverify.safeparse.readers.ReadOnlyFile` (regular files only, inside ``root`` if given)."""
    from ckptverify.safeparse.readers import ReadOnlyFile

    if offset < 0 or length < 0:
        raise UsageError(f"byte range must be non-negative, got offset={offset} length={length}")
    with ReadOnlyFile(os.fspath(path), root=root) as f:
        if offset + length > f.size:
            raise CkptVerifyError(f"{os.fspath(path)}: range [{offset}, {offset + length}) extends past the end of "
                                  f"the file ({max(0, f.size - offset)} of {length} bytes readable)")
        f.fold(offset, offset + length, sink.update)


def digest_file_range(
    path: str | os.PathLike[str],
    offset: int,
    length: int,
    algorithm: str = DEFAULT_ALGORITHM,
    *,
    root: str | None = None,
) -> str:
    """Hex digest of ``length`` bytes of ``path`` from ``offset``, with flat memory. Raises
    :class:`~ckptverify.errors.CkptVerifyError` (file ends inside the range),
    :class:`~ckptverify.errors.UnsafeFileError` (not regular, or outside ``root``),
    :class:`~ckptverify.errors.FileChangedError` (shrinks while read)."""
    digest = new_digest(algorithm)
    _read_range(path, offset, length, digest, root)
    return digest.hexdigest()


def digest_reader(f: Any, algorithm: str = DEFAULT_ALGORITHM, start: int = 0, end: int | None = None) -> str:
    """Hex digest of bytes ``[start, end)`` of an open :class:`~ckptverify.safeparse.readers.ReadOnlyFile` (no second
    open by name, which could meet another file)."""
    digest = new_digest(algorithm)
    f.fold(start, f.size if end is None else end, digest.update)
    return digest.hexdigest()


def block_digests(
    path: str | os.PathLike[str],
    offset: int,
    length: int,
    algorithm: str = DEFAULT_ALGORITHM,
    block_size: int = DEFAULT_BLOCK_SIZE,
) -> RangeDigest:
    """Digest of a byte range and of each ``block_size`` block of it (from ``offset``), in one pass."""
    digest = BlockDigest(algorithm, block_size)
    _read_range(path, offset, length, digest)
    return RangeDigest(algorithm, digest.hexdigest(), block_size, tuple(digest.block_hexdigests()))
