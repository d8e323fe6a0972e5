"""The adoption's pass over a verified DCP checkpoint (:meth:`~ckptverify.checks.dcp_pipeline.VerificationRun.digests`):
every item's, block's and file's digest and every tensor's scan, on the run's workers and opened files.

Small items are digested in batched reads, and small tensors stored whole fingerprinted many at a time in numpy:
the same values as the general paths, which take everything else.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable
from typing import Any, ClassVar

from ckptverify.checks import deep as deep_check
from ckptverify.checks.content import WINDOW_BYTES, read_windows
from ckptverify.errors import FileChangedError
from ckptverify.formats.describe import StoredRange
from ckptverify.ownfiles.manifest import FileEntry, ItemEntry


def digests_and_scans(run: Any, desc: Any, *, digest: str, block_bytes: int, executor: Any,
                      release_kept: Callable[[], None]) -> tuple[list[ItemEntry], dict[str, FileEntry], dict[str, Any],
                                                              list[Any]]:
    """Every item's and file's digests and every tensor's scan of ``desc`` (what ``run`` verified, and what ``executor``
    brings from elsewhere): the manifest entries, scans and any ``replica-mismatch`` findings. ``release_kept`` drops
    the run's small files held in memory, once the small items and tensors are done."""
    from ckptverify.fingerprint import BlockDigest, digest_reader
    from ckptverify.fingerprint.digest import digest_bytes

    def digest_item(item: StoredRange) -> ItemEntry:
        d = BlockDigest(digest, block_bytes)
        with desc.open(item.file) as f:
            f.fold(item.offset, item.offset + item.length, d.update)
        run.advance(item.length)
        return ItemEntry(fqn=item.name, chunk_offsets=item.chunk_offsets, file=item.file, offset=item.offset,
                         length=item.length, digest=d.hexdigest(), blocks=tuple(d.block_hexdigests()))

    whole_files: dict[str, FileEntry] = {}  # files one batch of small items read whole

    def digest_batch(batch: _Batch) -> list[ItemEntry]:
        # A small item is one block: its digest and its block's are the same, taken once.
        name, start, end, items = batch
        buf, size = _read_batch(desc, batch)
        out = []
        view = memoryview(buf)
        for item in items:
            h = digest_bytes(view[item.offset - start:item.offset - start + item.length], digest)
            out.append(ItemEntry(fqn=item.name, chunk_offsets=item.chunk_offsets, file=item.file,
                                 offset=item.offset, length=item.length, digest=h, blocks=(h,)))
        if start == 0 and end == size:
            # One item that is the whole file (one file per item): the file's digest is the item's.
            whole = out[0].digest if len(items) == 1 and len(buf) == items[0].length else \
                digest_bytes(view, digest)
            whole_files[name] = FileEntry(size=size, digest=whole)
        run.advance(sum(i.length for i in items))
        return out

    def digest_file(name: str) -> FileEntry:
        known = whole_files.get(name)
        if known is not None:
            return known
        with desc.open(name) as f:
            return FileEntry(size=f.size, digest=digest_reader(f, digest))

    names = sorted(desc.files)
    if executor is not None:  # the item and file digests, read by the ranks or parts (each its share), in order
        ordered = sorted(desc.stored, key=lambda i: -i.length)
        got = executor.map_units(run, [["item", i.file, i.offset, i.length, digest, block_bytes] for i in ordered]
                                 + [["digest", n, digest] for n in names])
        entries = [ItemEntry(fqn=i.name, chunk_offsets=i.chunk_offsets, file=i.file, offset=i.offset,
                             length=i.length, digest=value[0], blocks=tuple(value[1]))
                   for i, value in zip(ordered, got, strict=False)]
        # A file another node's part digested is not opened here (its part's signature of it is compared apart).
        file_digests = [FileEntry(size=f.size if (f := run.file(n)) is not None else
                                  os.stat(os.path.join(run.root, n)).st_size, digest=value)
                        for n, value in zip(names, got[len(ordered):], strict=True)]
        scans, replica_findings = deep_check.scan_description(desc, executor.tensor_map(run))
    else:
        # Small items and small whole tensors in batched reads (a checkpoint of many small tensors).
        small, large = _small_item_batches(desc.stored, block_bytes)
        entries = [e for batch in run.map(digest_batch, small) for e in batch]
        entries += run.map(digest_item, sorted(large, key=lambda i: -i.length))
        file_digests = run.map(digest_file, names)
        scans = _scan_small_tensors(desc, run.map)
        release_kept()
        rest = {name for name in desc.tensors if name not in scans}
        more, replica_findings = deep_check.scan_description(desc, run.map, only=rest)
        scans.update(more)
    return entries, dict(zip(names, file_digests, strict=True)), scans, replica_findings


#: A run of small items of one file read at once: (file, start, end, items).
_Batch = tuple[str, int, int, list[StoredRange]]


def _read_batch(desc: Any, batch: _Batch) -> tuple[bytes, int]:
    """The bytes a batch spans, and its file's size; ``FileChangedError`` if the file ends before them now."""
    name, start, end, _ = batch
    with desc.open(name) as f:
        buf, size = f.pread(start, end - start), f.size
    if len(buf) != end - start:  # inside the size seen at open: the file changed
        raise FileChangedError(f"{name} ends before byte {end} now", os.path.join(desc.root, name))
    return buf, size


def _small_item_batches(stored: list[StoredRange], block_bytes: int) -> tuple[list[_Batch], list[StoredRange]]:
    """Items of 1 byte to one block grouped into per-file runs read at once (:func:`.content.read_windows`; items
    that overlap in separate runs), and the other items, digested singly."""
    limit = min(block_bytes, WINDOW_BYTES)
    small = sorted((i for i in stored if 0 < i.length <= limit), key=lambda i: (i.file, i.offset))
    large = [i for i in stored if not 0 < i.length <= limit]
    return [(name, start, end, items) for name, group in itertools.groupby(small, key=lambda i: i.file)
            for start, end, items in read_windows(((i.offset, i.offset + i.length, i) for i in group), overlap=False)
            ], large


#: Tensors of at most this many elements, stored whole in one raw row-major piece, are fingerprinted many at once.
SMALL_TENSOR_ELEMENTS = 1 << 14
#: Dtypes fingerprinted many at once (others, complex and float8 among them, take the general scan).
_BATCHED_DTYPES = frozenset({"float64", "float32", "float16", "bfloat16", "int64", "int32", "int16", "int8",
                             "uint8", "bool"})


def _scan_small_tensors(desc: Any, run_map: Any) -> dict[str, Any]:
    """Scans of the small tensors stored whole in one raw row-major piece of a batched dtype, fingerprinted many at a
    time in numpy (:func:`_whole_lanes`, no torch import) from the batched reads: the same values as
    :func:`~ckptverify.checks.deep.scan_description` at a fraction of its per-tensor cost. Returns the scans by name;
    every other tensor is left to the general scan (which also reports what is wrong)."""
    import math

    from ckptverify.dcp.layout import DTYPE_ITEMSIZE
    from ckptverify.safeparse.dtypes import is_row_major

    picked: list[StoredRange] = []
    what: dict[str, tuple[str, int]] = {}
    for t in desc.tensors.values():
        if t.subclass is not None or t.unread or len(t.payloads) != 1 or t.dtype not in _BATCHED_DTYPES:
            continue
        p = t.payloads[0]
        n = math.prod(p.shape)
        if (p.encoding != "raw" or p.stored is not None or p.dtype != t.dtype or any(p.chunk_offsets)
                or tuple(p.shape) != tuple(t.shape) or not 0 < n <= SMALL_TENSOR_ELEMENTS
                or not is_row_major(p.shape, p.stride) or p.storage_offset < 0):
            continue
        itemsize = DTYPE_ITEMSIZE[p.dtype]
        start, nbytes = p.offset + p.storage_offset * itemsize, n * itemsize
        if start + nbytes > p.offset + p.length:
            continue
        picked.append(StoredRange(t.name, None, p.file, start, nbytes))
        what[t.name] = (p.dtype, n)
    batches, _ = _small_item_batches(picked, WINDOW_BYTES)

    def read(batch: _Batch) -> list[tuple[str, bytes]]:
        buf, _ = _read_batch(desc, batch)
        return [(r.name, buf[r.offset - batch[1]:r.offset - batch[1] + r.length]) for r in batch[3]]

    scans: dict[str, Any] = {}
    for group in _rounds(batches, ROUND_BYTES):
        by_dtype: dict[str, tuple[list[str], list[bytes], list[int]]] = {}
        for got in run_map(read, group):
            for fqn, bits in got:
                dtype, n = what[fqn]
                names, chunks, counts = by_dtype.setdefault(dtype, ([], [], []))
                names.append(fqn)
                chunks.append(bits)
                counts.append(n)
        for dtype, (names, chunks, counts) in by_dtype.items():
            joined = b"".join(chunks)
            values = _lane_values(_whole_lanes(joined, DTYPE_ITEMSIZE[dtype], counts, dtype))
            nan, inf = _nonfinite_counts(joined, dtype, counts) if dtype in _FLOAT_DTYPES else (None, None)
            none = [0] * len(names)
            for fqn, value, a, b in zip(names, values, nan or none, inf or none, strict=True):
                scans[fqn] = SmallScan(value, a, b)
    return scans


#: Most bytes of batched reads fingerprinted together (what a round holds in memory at once).
ROUND_BYTES = 64 << 20
_FLOAT_DTYPES = frozenset({"float64", "float32", "float16", "bfloat16"})


class SmallScan:
    """A batched small tensor's scan: what :class:`~ckptverify.checks.deep.TensorScan` gives (fingerprint, counts)."""

    __slots__ = ("fingerprint", "inf", "nan")
    part_values: ClassVar[dict[str, str]] = {}
    uncounted: ClassVar[bool] = False

    def __init__(self, fingerprint: str, nan: int, inf: int) -> None:
        self.fingerprint, self.nan, self.inf = fingerprint, nan, inf

    def value(self, shape: tuple[int, ...]) -> str:
        """The fingerprint (the tensor was read whole: every element of ``shape``)."""
        return self.fingerprint


def _rounds(batches: list[_Batch], limit: int) -> list[list[_Batch]]:
    """``batches`` in consecutive groups of at most ``limit`` bytes read (at least one batch each)."""
    groups: list[list[_Batch]] = []
    size = limit
    for batch in batches:
        n = batch[2] - batch[1]
        if size + n > limit:
            groups.append([])
            size = 0
        groups[-1].append(batch)
        size += n
    return groups


def _lane_values(lanes: tuple[Any, Any]) -> list[str]:
    """Fingerprint values (lane 0 then lane 1, 16 hex digits each) of pairs of unsigned lane-sum arrays."""
    import numpy as np

    pairs = np.empty((len(lanes[0]), 2), dtype=">u8")  # big-endian: the bytes in the order the hex digits read
    pairs[:, 0], pairs[:, 1] = lanes
    text = pairs.tobytes().hex()
    return [text[i:i + 32] for i in range(0, len(text), 32)]


def _nonfinite_counts(bits: bytes, dtype: str, counts: list[int]) -> tuple[list[int] | None, list[int] | None]:
    """NaN and Inf counts per tensor laid end to end in ``bits``; ``(None, None)`` when all finite (one reduction).
    bfloat16 is widened via its bits (numpy has none)."""
    import numpy as np

    if dtype == "bfloat16":
        values = (np.frombuffer(bits, dtype=np.uint16).astype(np.uint32) << np.uint32(16)).view(np.float32)
    else:
        values = np.frombuffer(bits, dtype={"float64": np.float64, "float32": np.float32, "float16": np.float16}[dtype])
    if bool(np.isfinite(values).all()):
        return None, None
    starts = np.zeros(len(counts), dtype=np.int64)
    np.cumsum(np.asarray(counts[:-1], dtype=np.int64), out=starts[1:])
    nan, inf = (np.add.reduceat(flags.astype(np.int64), starts).tolist()
                for flags in (np.isnan(values), np.isinf(values)))
    return nan, inf


def _whole_lanes(bits: bytes, itemsize: int, counts: list[int], dtype_name: str) -> tuple[Any, Any]:
    """Both lane sums of each whole tensor laid end to end in ``bits``, as ``fingerprint_lanes`` gives them, in a few
    numpy operations (:func:`~ckptverify.fingerprint.spec.numpy_lanes`)."""
    import numpy as np

    from ckptverify.fingerprint.spec import dtype_seed, numpy_lanes

    w = np.frombuffer(bits, dtype={1: np.int8, 2: np.int16, 4: np.int32, 8: np.int64}[itemsize]).astype(np.int64)
    sizes = np.asarray(counts, dtype=np.int64)
    starts = np.zeros(len(counts), dtype=np.int64)
    np.cumsum(sizes[:-1], out=starts[1:])
    index = (np.arange(len(w), dtype=np.int64) - np.repeat(starts, sizes)).view(np.uint64)
    return numpy_lanes(w, index, (dtype_seed(dtype_name, 0), dtype_seed(dtype_name, 1)), starts)
