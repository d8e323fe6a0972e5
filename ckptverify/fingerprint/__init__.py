"""Byte digests and the logical tensor fingerprint.

Two kinds of identity, documented in ``docs/fingerprint.md``:

* **Byte digests** identify exact bytes: xxh3-128 by default (fast), sha256 when tamper evidence is wanted.
  :func:`new_digest` gives a streaming digest, :func:`digest_file_range` digests a byte range of a file with
  flat memory, :func:`block_digests` digests fixed-size blocks of a range in the same pass, so a mismatch
  can be narrowed to one block.
* The **logical tensor fingerprint** identifies a tensor's *values*, independent of how it is sharded or
  serialized: :func:`tensor_fingerprint` for a whole tensor (or a ``DTensor``), :func:`chunk_fingerprint`
  for one chunk of a global tensor, and :func:`combine` to add chunk fingerprints up to the whole.

This module imports torch only when a tensor is fingerprinted, so byte digests stay cheap to import.
"""

from __future__ import annotations

import hashlib
import os
import sys
import warnings
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import xxhash

from ckptverify.errors import TruncatedRangeError, UsageError

if TYPE_CHECKING:
    import torch

__all__ = [
    "ALGORITHMS",
    "DEFAULT_ALGORITHM",
    "FINGERPRINT_VERSION",
    "BlockDigest",
    "ByteDigest",
    "RangeDigest",
    "TensorFingerprint",
    "TruncatedRangeError",
    "block_digests",
    "chunk_fingerprint",
    "combine",
    "digest_bytes",
    "digest_file_range",
    "digest_reader",
    "get_fingerprint_backend",
    "new_digest",
    "set_fingerprint_backend",
    "tensor_fingerprint",
]

# ----------------------------------------------------------------------------------------- byte digests

DEFAULT_ALGORITHM = "xxh3-128"
ALGORITHMS = ("xxh3-128", "sha256")

#: Default size of the reused read buffer (a multiple of the page size).
READ_BUFFER_SIZE = 4 << 20
#: Default block size of :func:`block_digests`.
DEFAULT_BLOCK_SIZE = 1 << 20


class ByteDigest(Protocol):
    """A streaming digest: feed bytes with :meth:`update`, read the result with :meth:`hexdigest`."""

    def update(self, buffer: Any, /) -> None: ...

    def hexdigest(self) -> str: ...


def new_digest(algorithm: str = DEFAULT_ALGORITHM) -> ByteDigest:
    """A fresh streaming digest: ``"xxh3-128"`` (xxhash ``xxh3_128``) or ``"sha256"`` (hashlib)."""
    if algorithm == "xxh3-128":
        return xxhash.xxh3_128()
    if algorithm == "sha256":
        return hashlib.sha256()
    raise UsageError(f"unknown digest algorithm {algorithm!r}; choose one of {', '.join(ALGORITHMS)}")


def digest_bytes(data: Any, algorithm: str = DEFAULT_ALGORITHM) -> str:
    """Hex digest of a bytes-like object."""
    digest = new_digest(algorithm)
    digest.update(data)
    return digest.hexdigest()


class BlockDigest:
    """A streaming digest of a whole byte stream plus one digest per fixed-size block of it.

    Blocks are counted from the first byte fed; the last block may be shorter. Feeding nothing gives no
    blocks. ``hexdigest()`` equals the plain digest of all bytes fed.
    """

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


def _read_range(path: str | os.PathLike[str], offset: int, length: int, read_size: int, sink: ByteDigest,
                root: str | None = None) -> None:
    """Feed ``length`` bytes of ``path`` from ``offset`` to ``sink``.

    The file is opened by :class:`~ckptverify.safeparse.readers.ReadOnlyFile`: only a regular file (a FIFO or device is
    refused unopened, with :class:`~ckptverify.errors.UnsafeFileError`), inside ``root`` when given, read
    through a reused page-aligned buffer. ``read_size`` is kept for compatibility; the reader's buffer size
    applies.
    """
    from ckptverify.safeparse.readers import ReadOnlyFile

    if offset < 0 or length < 0:
        raise UsageError(f"byte range must be non-negative, got offset={offset} length={length}")
    if read_size <= 0:
        raise UsageError(f"read buffer size must be positive, got {read_size}")
    with ReadOnlyFile(os.fspath(path), root=root) as f:
        if offset + length > f.size:
            raise TruncatedRangeError(path, offset, length, max(0, f.size - offset))
        f.fold(offset, offset + length, sink.update)


def digest_file_range(
    path: str | os.PathLike[str],
    offset: int,
    length: int,
    algorithm: str = DEFAULT_ALGORITHM,
    block_size: int = READ_BUFFER_SIZE,
    *,
    root: str | None = None,
) -> str:
    """Hex digest of ``length`` bytes of ``path`` starting at ``offset``.

    Reads with ``os.preadv`` into one reused page-aligned buffer, so memory stays flat whatever the range.
    Raises :class:`TruncatedRangeError` if the file ends inside the range,
    :class:`~ckptverify.errors.UnsafeFileError` if ``path`` is not a regular file (or, with ``root``, resolves
    outside it) and :class:`~ckptverify.errors.FileChangedError` if it shrinks while being read.
    """
    digest = new_digest(algorithm)
    _read_range(path, offset, length, block_size, digest, root)
    return digest.hexdigest()


def digest_reader(f: Any, algorithm: str = DEFAULT_ALGORITHM, start: int = 0, end: int | None = None) -> str:
    """Hex digest of bytes ``[start, end)`` (default: all) of an open
    :class:`~ckptverify.safeparse.readers.ReadOnlyFile`.

    For a file already opened and checked: no second open by name, which could meet another file.
    """
    digest = new_digest(algorithm)
    f.fold(start, f.size if end is None else end, digest.update)
    return digest.hexdigest()


def block_digests(
    path: str | os.PathLike[str],
    offset: int,
    length: int,
    algorithm: str = DEFAULT_ALGORITHM,
    block_size: int = DEFAULT_BLOCK_SIZE,
    read_size: int = READ_BUFFER_SIZE,
) -> RangeDigest:
    """Digest of a byte range and of each ``block_size`` block of it, in one pass over the bytes.

    Block ``k`` covers bytes ``[offset + k*block_size, offset + (k+1)*block_size)``, the last one ending at
    ``offset + length``.
    """
    digest = BlockDigest(algorithm, block_size)
    _read_range(path, offset, length, read_size, digest)
    return RangeDigest(algorithm, digest.hexdigest(), block_size, tuple(digest.block_hexdigests()))


# ------------------------------------------------------------------------------------ tensor fingerprint

#: Version of the tensor fingerprint algorithm; any change to its values bumps it.
FINGERPRINT_VERSION = 1

_MASK64 = (1 << 64) - 1


@dataclass(frozen=True)
class TensorFingerprint:
    """The logical fingerprint of a tensor (or of part of one).

    ``value`` is 128 bits as 32 hex digits: lane 0 then lane 1, each 16 digits. ``shape`` is the *global*
    shape; ``elements`` counts the elements that contributed (``prod(shape)`` for a whole tensor; less for
    a single chunk). Two fingerprints describe equal tensors when all fields are equal.
    """

    value: str
    dtype: str
    shape: tuple[int, ...]
    version: int = FINGERPRINT_VERSION
    elements: int = 0

    @property
    def lanes(self) -> tuple[int, int]:
        return int(self.value[:16], 16), int(self.value[16:], 16)

    @property
    def complete(self) -> bool:
        """Whether every element of the global shape contributed exactly once (by count)."""
        n = 1
        for size in self.shape:
            n *= size
        return self.elements == n

    def to_dict(self) -> dict[str, Any]:
        return {
            "value": self.value,
            "dtype": self.dtype,
            "shape": list(self.shape),
            "version": self.version,
            "elements": self.elements,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TensorFingerprint:
        return cls(
            value=str(data["value"]),
            dtype=str(data["dtype"]),
            shape=tuple(int(s) for s in data["shape"]),
            version=int(data["version"]),
            elements=int(data["elements"]),
        )

    @classmethod
    def from_lanes(cls, lanes: tuple[int, int], dtype: str, shape: Sequence[int], elements: int) -> TensorFingerprint:
        value = f"{lanes[0] & _MASK64:016x}{lanes[1] & _MASK64:016x}"
        return cls(value, dtype, tuple(int(s) for s in shape), FINGERPRINT_VERSION, int(elements))


def combine(parts: Iterable[TensorFingerprint]) -> TensorFingerprint:
    """Add chunk fingerprints of one global tensor up to the fingerprint of the chunks together.

    The chunks must be disjoint; when they cover the tensor the result equals :func:`tensor_fingerprint`
    of the whole. All parts must agree on dtype, global shape and version.
    """
    parts = list(parts)
    if not parts:
        raise UsageError("combine() needs at least one fingerprint")
    first = parts[0]
    lane0 = lane1 = elements = 0
    for part in parts:
        if (part.dtype, part.shape, part.version) != (first.dtype, first.shape, first.version):
            raise UsageError(
                "cannot combine fingerprints of different tensors: "
                f"{first.dtype}{list(first.shape)} v{first.version} vs "
                f"{part.dtype}{list(part.shape)} v{part.version}"
            )
        a, b = part.lanes
        lane0 += a
        lane1 += b
        elements += part.elements
    return TensorFingerprint.from_lanes((lane0, lane1), first.dtype, first.shape, elements)


def chunk_fingerprint(t: torch.Tensor, global_offsets: Sequence[int], global_shape: Sequence[int]) -> TensorFingerprint:
    """Fingerprint of the chunk ``t`` that sits at ``global_offsets`` in a tensor of ``global_shape``.

    Computed on ``t``'s device. Chunk fingerprints of disjoint chunks :func:`combine` to the fingerprint of
    their union; of a covering set of chunks, to :func:`tensor_fingerprint` of the whole tensor.
    """
    from ckptverify.fingerprint import kernels as kern

    name = kern.dtype_name(t.dtype)
    offsets = [int(o) for o in global_offsets]
    gshape = [int(s) for s in global_shape]
    lanes = kern.fingerprint_lanes(t, offsets, gshape, name)
    return TensorFingerprint.from_lanes(lanes, name, gshape, t.numel())


def tensor_fingerprint(t: torch.Tensor) -> TensorFingerprint:
    """Fingerprint of a whole tensor, computed on its own device.

    A ``DTensor`` is fingerprinted collectively: each rank fingerprints its local shard at its global
    offsets and the lanes are summed across the device mesh, so every rank returns the fingerprint of the
    global tensor. Every rank of the mesh must call this.
    """
    from ckptverify.fingerprint import kernels as kern

    dtensor_type = _dtensor_type()
    if dtensor_type is not None and isinstance(t, dtensor_type):
        return _dtensor_fingerprint(t)
    name = kern.dtype_name(t.dtype)
    shape = list(t.shape)
    lanes = kern.fingerprint_lanes(t, [0] * len(shape), shape, name)
    return TensorFingerprint.from_lanes(lanes, name, shape, t.numel())


def set_fingerprint_backend(name: str) -> None:
    """How tensor fingerprints are computed: ``"eager"`` (plain torch operations, any device),
    ``"compiled"`` (``torch.compile`` fused kernel for large blocks), ``"triton"`` (one fused Triton kernel
    for CUDA tensors; other devices take eager) or ``"auto"`` (the default: Triton for CUDA tensors when it
    imports; on CPU eager, switching to compiled once enough data went through to pay for the
    compilation). All give the same values; the fused kernels are checked against eager before first use.
    The environment variable ``CKPTVERIFY_FINGERPRINT_BACKEND`` sets the initial choice."""
    from ckptverify.fingerprint import kernels as kern

    kern.set_backend(name)


def get_fingerprint_backend() -> str:
    from ckptverify.fingerprint import kernels as kern

    return kern.get_backend()


# ------------------------------------------------------------------------------------------- DTensor


def _dtensor_type() -> type | None:
    """``DTensor``, if its module is loaded (a tensor cannot be a DTensor otherwise)."""
    module = sys.modules.get("torch.distributed.tensor")
    return getattr(module, "DTensor", None) if module is not None else None


def _dtensor_fingerprint(t: Any) -> TensorFingerprint:
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    from ckptverify.fingerprint import kernels as kern

    mesh = t.device_mesh
    placements = list(t.placements)
    name = kern.dtype_name(t.dtype)
    gshape = list(t.shape)
    if any(p.is_partial() for p in placements):
        # Pending reductions: the local values are not the tensor's values until they are reduced.
        placements = [Replicate() if p.is_partial() else p for p in placements]
        t = t.redistribute(mesh, placements)
    if not all(type(p) in (Shard, Replicate) for p in placements):
        # Placements whose shards are not one box of the global tensor: fingerprint the full tensor.
        full = t.full_tensor()
        lanes = kern.fingerprint_lanes(full, [0] * len(gshape), gshape, name)
        return TensorFingerprint.from_lanes(lanes, name, gshape, full.numel())

    local = t.to_local()
    local_shape, offsets = compute_local_shape_and_global_offset(gshape, mesh, placements)
    coordinate = mesh.get_coordinate()
    # Replicated mesh dims hold the same shard several times: only coordinate 0 of each contributes.
    contributes = coordinate is not None and all(
        coordinate[d] == 0 for d, p in enumerate(placements) if isinstance(p, Replicate)
    )
    if contributes and local.numel():
        if list(local.shape) != list(local_shape):
            raise UsageError(f"DTensor local shard has shape {list(local.shape)}, expected {list(local_shape)}")
        lanes = kern.fingerprint_lanes(local, offsets, gshape, name)
        count = local.numel()
    else:
        lanes, count = (0, 0), 0

    # Sum over the whole mesh, one mesh dimension at a time. All-gather (exact) then add modulo 2**64.
    values = [kern._signed(lanes[0]), kern._signed(lanes[1]), count]
    for dim in range(mesh.ndim):
        group = mesh.get_group(dim)
        size = dist.get_world_size(group)
        mine = torch.tensor(values, dtype=torch.int64, device=local.device)
        gathered = torch.empty(size * 3, dtype=torch.int64, device=local.device)
        with warnings.catch_warnings():
            # torch 2.13 marks the name deprecated in favour of one older releases lack; same collective.
            warnings.filterwarnings("ignore", message=".*all_gather_into_tensor.*", category=FutureWarning)
            dist.all_gather_into_tensor(gathered, mine, group=group)
        rows = gathered.view(size, 3).tolist()
        values = [
            kern._signed(sum(r[0] for r in rows)),
            kern._signed(sum(r[1] for r in rows)),
            sum(r[2] for r in rows),
        ]
    return TensorFingerprint.from_lanes((values[0], values[1]), name, gshape, values[2])
