"""A DCP storage writer that digests every byte as it is written and writes the manifest last.

:class:`HashingFileSystemWriter` wraps each output stream in :class:`_HashingStream`: a digest of the whole file,
and segments cut at each ``tell()`` (DCP calls it right before and after each item, so a segment is one item),
each digested whole and in blocks. ``write_data`` swaps each ``storage_data`` for :class:`HashedStorageInfo`
(travelling to the coordinator in DCP's own gather); ``finish`` restores plain ``_StorageInfo`` (``.metadata``
stays an ordinary DCP file), writes ``.metadata``, digests it, and writes the manifest last. It follows
:mod:`ckptverify.dcp.commit`. It touches DCP's private classes; ``tests/unit/test_save.py`` checks every assumption.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import uuid
from collections import deque
from collections.abc import Callable, Generator, Iterator
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import wait as futures_wait
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.filesystem import FileSystem, _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, TensorStorageMetadata
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from ckptverify.dcp.commit import SaveLock, begin_save, invalidate_previous
from ckptverify.dcp.metadata import METADATA_FILE
from ckptverify.errors import ArchiveError, UsageError
from ckptverify.fingerprint import (
    FINGERPRINT_VERSION,
    BlockDigest,
    TensorFingerprint,
    block_digests,
    combine,
    digest_file_range,
    new_digest,
    part_fingerprints,
)
from ckptverify.fingerprint.device import FingerprintStreams
from ckptverify.fingerprint.logical import BlockwiseFingerprint, blockwise_fingerprint, chunk_fingerprint_counted
from ckptverify.fingerprint.nonfinite import nonfinite_counts as _nonfinite_counts
from ckptverify.fingerprint.subclass import is_wrapper_subclass
from ckptverify.ownfiles.manifest import (
    DEFAULT_BLOCK_BYTES,
    MANIFEST_FILE,
    FileEntry,
    ItemEntry,
    Manifest,
    TensorEntry,
    check_settings,
    write_manifest,
)
from ckptverify.safeparse.gcpause import paused_gc

__all__ = ["HashedStorageInfo", "HashingFileSystemWriter"]

_log = logging.getLogger(__name__)


# ------------------------------------------------------------------------------------------ the stream

#: Buffers this large are written in pieces digested by a pool thread (``_HashingStream._write_pipelined``).
PARALLEL_HASH_MIN_BYTES = 1 << 20
#: Small enough to be in cache when digested (three digests), large enough that a submit costs under 1%.
PIECE_BYTES = 4 << 20
#: Seconds a pool thread has to start on a lane the writer waits for before the writer does its work itself.
LANE_START_GRACE = 0.002
#: The pieces the last ``PIECE_BYTES`` of a write are cut in (see ``_HashingStream._write_pipelined``).
TAIL_PIECE_BYTES = 1 << 20
#: Written pieces that may await digests before the write waits (they stay in cache together).
PIECES_IN_FLIGHT = 4
#: Shorter writes are coalesced (up to ``COALESCE_BYTES``; flushed at ``tell()``, a large write or close) into
#: one digest call: streaming digests do not depend on how input is split.
SMALL_WRITE_BYTES = 64 << 10
COALESCE_BYTES = 256 << 10

_pool_lock = threading.Lock()
_pool: ThreadPoolExecutor | None = None
_pool_pid = 0


def _hash_pool() -> ThreadPoolExecutor:
    """The process-wide digest pool (made on first use, re-made after a fork, never pickled)."""
    global _pool, _pool_pid
    with _pool_lock:
        if _pool is None or _pool_pid != os.getpid():
            workers = max(2, min(16, 2 * (os.cpu_count() or 1)))
            _pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="ckptverify-hash")
            _pool_pid = os.getpid()
        return _pool


@dataclass(frozen=True)
class _Segment:
    digest: str
    blocks: tuple[str, ...]


@dataclass
class _FileRecord:
    """What a :class:`_HashingStream` saw: the file's size and digest, and its digested segments."""

    size: int
    digest: str
    segments: dict[tuple[int, int], _Segment]  # (offset, length) -> digests; non-empty segments only


class _HashingStream:
    """A write-only stream digesting what it forwards to ``raw`` and cutting segments at ``tell()`` (bytes written so
    far; DCP writes from offset 0). Seeking is refused: it would make the digests meaningless."""

    def __init__(self, raw: Any, algorithm: str, block_bytes: int,
                 fused: Callable[[memoryview], BlockwiseFingerprint | None] | None = None,
                 fused_jobs: list[Any] | None = None) -> None:
        self._raw = raw
        self._fused = fused  # the chunk fingerprint that rides on a large write of these bytes, if any
        self._fused_jobs = fused_jobs
        self._algorithm = algorithm
        self._block_bytes = block_bytes
        self._file_digest = new_digest(algorithm)
        self._pos = 0
        self._seg_start = 0
        self._seg: BlockDigest | None = None
        self._segments: dict[tuple[int, int], _Segment] = {}
        self._record: _FileRecord | None = None
        self._pending = bytearray()
        self.tell_calls = 0

    # -- the part of the file-object protocol DCP and torch.save use
    def write(self, b: Any, /) -> int:
        if self._record is not None:
            raise ValueError("write to a closed stream")
        size = b.nbytes if type(b) is memoryview else memoryview(b).nbytes
        if size < SMALL_WRITE_BYTES:
            # The common case by count (torch.save writes a few dozen small records per item): kept short.
            _check_written(self._raw.write(b), size)
            self._pending += b
            self._pos += size
            if len(self._pending) >= COALESCE_BYTES:
                self._drain()
            return size
        view = memoryview(b).cast("B")
        self._drain()
        seg = self._segment()
        if size >= PARALLEL_HASH_MIN_BYTES:
            return self._write_pipelined(view, seg, self._fused(view) if self._fused is not None else None)
        _check_written(self._raw.write(view), size)
        self._file_digest.update(view)
        seg.update(view)
        self._pos += size
        return size

    def _segment(self) -> BlockDigest:
        """The current segment's digest (started at its first byte)."""
        if self._seg is None:
            self._seg = BlockDigest(self._algorithm, self._block_bytes)
        return self._seg

    def _drain(self) -> None:
        """Digest the small writes collected so far (they belong to the current segment)."""
        if self._pending:
            self._file_digest.update(self._pending)
            self._segment().update(self._pending)
            del self._pending[:]

    def _write_pipelined(self, view: memoryview, seg: BlockDigest, fused: BlockwiseFingerprint | None) -> int:
        """Write a large buffer in ``PIECE_BYTES`` pieces while a pool thread digests earlier ones (reading them from
        cache; the calls release the GIL), at most ``PIECES_IN_FLIGHT`` behind (:class:`_DigestLane`). ``fused``: the
        chunk fingerprint advanced after each piece. The buffer is only read during the call."""
        lane = _DigestLane(self._file_digest, seg, fused, self._fused_jobs)
        total = len(view)
        pos = 0
        try:
            while pos < total:
                # Smaller tail pieces: the write ends waiting on the last piece's digest.
                step = PIECE_BYTES if total - pos > PIECE_BYTES else TAIL_PIECE_BYTES
                piece = view[pos : pos + step]
                _check_written(self._raw.write(piece), len(piece))
                lane.wait(PIECES_IN_FLIGHT - 1)
                pos += len(piece)
                lane.put(piece, pos)
        finally:
            lane.wait(0)
        self._pos += total
        return total

    def tell(self) -> int:
        self.tell_calls += 1
        self._cut()
        return self._pos

    def flush(self) -> None:
        if not self._raw.closed:
            self._raw.flush()

    def fileno(self) -> int:
        return self._raw.fileno()

    def writable(self) -> bool:
        return True

    def readable(self) -> bool:
        return False

    def seekable(self) -> bool:
        return False

    def seek(self, *args: Any) -> int:
        raise OSError("a hashing checkpoint stream cannot seek")

    @property
    def closed(self) -> bool:
        return self._record is not None

    def close(self) -> None:
        self.finalize()
        self._raw.close()

    def __enter__(self) -> _HashingStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- bookkeeping
    def _cut(self) -> None:
        """End the current segment here (if it holds bytes) and start the next one."""
        self._drain()
        if self._seg is not None:
            length = self._pos - self._seg_start
            if length:
                self._segments[(self._seg_start, length)] = _Segment(
                    self._seg.hexdigest(), tuple(self._seg.block_hexdigests())
                )
            self._seg = None
        self._seg_start = self._pos

    def finalize(self) -> _FileRecord:
        if self._record is None:
            self._cut()
            self._record = _FileRecord(self._pos, self._file_digest.hexdigest(), self._segments)
        return self._record


def _check_written(n: int | None, size: int) -> None:
    # DCP's buffered files take every byte or raise; a stream taking less (or, non-blocking, none) would leave
    # digests of bytes it did not write.
    if n != size:
        raise OSError(f"short write: {n or 0} of {size} bytes")


def _digest_piece(file_digest: Any, seg: BlockDigest, piece: memoryview) -> None:
    file_digest.update(piece)
    seg.update(piece)


class _DigestLane:
    """The pieces of one large write, digested in order by one pool thread at a time.

    The writer :meth:`put` s each piece and :meth:`wait` s until few are pending; letting digests lag a few pieces
    avoids stalls on late-scheduled threads (1-4% of a save). Pieces no pool thread started on within
    ``LANE_START_GRACE`` are digested by the writer itself (taking over at once put every write's tail on it).
    """

    def __init__(self, file_digest: Any, seg: BlockDigest, fused: BlockwiseFingerprint | None = None,
                 jobs: list[Any] | None = None) -> None:
        self._file_digest = file_digest
        self._seg = seg
        self._fused = fused
        self._jobs = jobs  # where the jobs that fingerprint ``fused`` are kept, for the storage writer to wait on
        self._cond = threading.Condition()
        self._queue: deque[tuple[memoryview, int]] = deque()
        self._busy = 0  # pieces taken off the queue whose digests are not done
        self._job: Any = None  # the pool job draining the queue, while there is one
        self._started = False  # whether that job has started
        self._error: BaseException | None = None

    def put(self, piece: memoryview, end: int) -> None:
        """Queue ``piece``, which ends ``end`` bytes into the write."""
        with self._cond:
            self._queue.append((piece, end))
            if self._job is None:
                self._started = False
                self._job = _hash_pool().submit(self._drain)
                if self._fused is not None and self._jobs is not None:
                    self._jobs.append(self._job)

    def _drain(self) -> None:
        """Digest the queued pieces in order until none is left (in a pool thread, or in the writer's)."""
        with self._cond:
            self._started = True
            self._cond.notify_all()
        while True:
            with self._cond:
                if not self._queue or self._error is not None:
                    self._job = None
                    self._cond.notify_all()
                    return
                piece, end = self._queue.popleft()
                self._busy += 1
            failed = True
            try:
                _digest_piece(self._file_digest, self._seg, piece)
                failed = False
            except BaseException as exc:  # handed to the writing thread by wait()
                with self._cond:
                    self._error = exc
            finally:
                with self._cond:
                    self._busy -= 1
                    self._cond.notify_all()
            if self._fused is not None and not failed:
                # After the piece is done: the fingerprint reads the chunk's memory (kept alive by the storage writer),
                # so the write need not wait for it. A failure leaves it incomplete (fingerprinted after the write).
                try:
                    self._fused.advance(end)
                except Exception as exc:  # pragma: no cover - a kernel failing here fails the same way on its own
                    _log.debug("fingerprint beside the write stopped: %s", exc)

    def wait(self, most: int) -> None:
        """Return once at most ``most`` pieces are pending; raise what a digest raised."""
        grace = True
        while True:
            with self._cond:
                if self._error is not None:
                    raise self._error
                if len(self._queue) + self._busy <= most:
                    return
                job = self._job
                if job is not None and not self._started and grace:
                    grace = False
                    self._cond.wait_for(lambda: self._started or self._error is not None
                                        or len(self._queue) + self._busy <= most, timeout=LANE_START_GRACE)
                    continue
            if job is not None and job.cancel():
                # No pool thread has started on this lane: digest its pieces here.
                with self._cond:
                    self._job = None
                self._drain()
                continue
            with self._cond:
                self._cond.wait_for(lambda: self._error is not None or len(self._queue) + self._busy <= most
                                    or self._job is None)


class _HashingFileSystem(FileSystem):
    """DCP's local :class:`FileSystem` with every write stream wrapped in a hashing stream; records kept by absolute
    path until :meth:`take_records`."""

    def __init__(self, algorithm: str, block_bytes: int) -> None:
        super().__init__()
        self.algorithm = algorithm
        self.block_bytes = block_bytes
        self._lock = threading.Lock()
        self._records: dict[str, _FileRecord] = {}
        self._tell_calls = 0
        #: Chunks whose fingerprints ride on the write of their memory, by (address, bytes): see ``take_fused``.
        self.fused: dict[tuple[int, int], BlockwiseFingerprint] = {}
        #: The pool jobs that fingerprint them (they may run on after the write of their chunk returned).
        self.fused_jobs: list[Any] = []

    def __reduce__(self) -> tuple[Any, ...]:
        # The lock, records and fused chunks belong to this process: a copy starts afresh.
        return _HashingFileSystem, (self.algorithm, self.block_bytes)

    @contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Generator[Any, None, None]:
        if "w" not in mode or "+" in mode:
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        with super().create_stream(path, mode) as raw:
            stream = _HashingStream(raw, self.algorithm, self.block_bytes, self.take_fused if self.fused else None,
                                    self.fused_jobs)
            yield stream
            record = stream.finalize()
        with self._lock:
            self._records[_key(path)] = record
            self._tell_calls += stream.tell_calls

    def take_fused(self, view: memoryview) -> BlockwiseFingerprint | None:
        """Take out of ``fused`` the fingerprint of the chunk whose memory is exactly ``view``: one write fingerprints
        it, even when the same memory is written twice (tied weights)."""
        import numpy as np

        key = (int(np.frombuffer(view, dtype=np.uint8).ctypes.data), view.nbytes)
        with self._lock:
            return self.fused.pop(key, None)

    def take_records(self) -> tuple[dict[str, _FileRecord], int]:
        """The records of all streams closed since the last call, and how many ``tell()`` calls they saw."""
        with self._lock:
            records, self._records = self._records, {}
            tells, self._tell_calls = self._tell_calls, 0
        return records, tells


def _key(path: str | os.PathLike) -> str:
    return os.path.abspath(os.fspath(path))


# ------------------------------------------------------------------------------ what travels to rank 0


@dataclass
class HashedStorageInfo(_StorageInfo):
    """A ``_StorageInfo`` carrying what the writing rank learned about the item; lives only between ``write_data`` and
    ``finish``. ``extra_files``: a rank's files holding no item (set on one result per rank)."""

    digest: str | None = None
    blocks: tuple[str, ...] = ()
    file_size: int | None = None
    file_digest: str | None = None
    fingerprint: TensorFingerprint | None = None
    nan_count: int | None = None
    inf_count: int | None = None
    parts: tuple[tuple[str, str], ...] | None = None
    extra_files: tuple[tuple[str, int, str], ...] = ()
    #: ``(offset, length)`` digested, where DCP records otherwise (safetensors tensors: the blob's start).
    span: tuple[int, int] | None = None

    def plain(self) -> _StorageInfo:
        return _StorageInfo(self.relative_path, self.offset, self.length, self.transform_descriptors)


#: Threads for a save's CPU fingerprints (``None``: torch's intra-op count); they run beside DCP's writer and
#: the digest pool (``docs/fingerprint.md``).
FINGERPRINT_THREADS: int | None = 1


@dataclass(frozen=True)
class _ChunkFacts:
    fingerprint: TensorFingerprint | None
    nan_count: int | None
    inf_count: int | None
    #: A tensor subclass's inner tensors' fingerprints by name (MXTensor: qdata, scale).
    parts: tuple[tuple[str, str], ...] | None = None


_NO_FACTS = _ChunkFacts(None, None, None)

def _chunk_facts(t: torch.Tensor, item: WriteItem,
                 taken: tuple[TensorFingerprint, int | None] | None = None) -> _ChunkFacts:
    """The chunk's fingerprint and NaN/Inf counts; ``taken``: its fingerprint and count, taken beside its write."""
    td = item.tensor_data
    assert td is not None
    parts = None
    specials: int | None = None
    try:
        fp: TensorFingerprint | None
        fp, specials = taken if taken is not None else chunk_fingerprint_counted(t, td.chunk.offsets, td.size)
        if is_wrapper_subclass(t):
            parts = tuple((name, f.value) for name, f in part_fingerprints(t).items())
    except UsageError:
        fp = None  # a dtype the fingerprint is not defined for
    # The kernel counted NaN/Inf patterns in its pass: zero means none; otherwise a pass tells them apart.
    nan, inf = (0, 0) if specials == 0 else _nonfinite_counts(t)
    return _ChunkFacts(fp, nan, inf, parts)


# --------------------------------------------------------------------------------------------- writer


class HashingFileSystemWriter(FileSystemWriter):
    """A :class:`FileSystemWriter` that digests every item and file as written and writes a
    :data:`~ckptverify.ownfiles.manifest.MANIFEST_FILE` beside ``.metadata`` when the save commits.

    Args:
        path: the checkpoint directory.
        digest: ``"xxh3-128"`` (default) or ``"sha256"``.
        block_bytes: block size each item is also digested in (from the item's first byte), in [``MIN_BLOCK_BYTES``,
            ``MAX_BLOCK_BYTES``] (what verify accepts).
        fingerprint: also fingerprint (with NaN/Inf counts) each tensor chunk on its device, large CPU chunks
            beside their writes (``stats["fingerprinted_beside_writes"]``).
        **kwargs: passed to :class:`FileSystemWriter`.

    After a save, ``manifest`` is set on the coordinator (``None`` elsewhere) and ``stats`` counts digests. Picklable
    (for ``dcp.async_save``). Needs ``use_collectives=True`` except in a single process.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        digest: str = "xxh3-128",
        block_bytes: int = DEFAULT_BLOCK_BYTES,
        fingerprint: bool = True,
        **kwargs: Any,
    ) -> None:
        check_settings(digest, block_bytes)
        super().__init__(path, **kwargs)
        self.digest = digest
        self.block_bytes = block_bytes
        self.fingerprint = bool(fingerprint)
        self.fs = _HashingFileSystem(digest, block_bytes)
        self.is_coordinator = True
        self.manifest: Manifest | None = None
        self.stats: dict[str, int] = {}
        self._lock: SaveLock | None = None

    # -- set-up
    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        super().set_up_storage_writer(is_coordinator, *args, **kwargs)
        self.is_coordinator = is_coordinator
        self.manifest = None
        self._release_lock()  # an earlier save through this writer failed before committing
        if not self.use_collectives and dist.is_available() and dist.is_initialized() \
                and dist.get_world_size() > 1:
            raise UsageError(
                "a hashing save needs use_collectives=True when several ranks save: the manifest is "
                "assembled from all ranks' write results on the coordinator"
            )

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        """On the coordinator, before any rank writes: lock, mark uncommitted, remove the earlier manifest and metadata
        (:mod:`ckptverify.dcp.commit`). A conflicting save fails here on every rank, having written nothing."""
        plans = super().prepare_global_plan(plans)
        root = os.fspath(self.path)
        self._release_lock()
        self._lock = begin_save(root, str(getattr(self, "save_id", "") or uuid.uuid4()))
        try:
            invalidate_previous(root, MANIFEST_FILE)
        except BaseException:
            self._release_lock()
            raise
        return plans

    def _release_lock(self) -> None:
        """Drop this writer's hold on its directory, leaving it marked as not committed (a failed save)."""
        lock, self._lock = self._lock, None
        if lock is not None:
            lock.release()

    def __getstate__(self) -> dict[str, Any]:
        # The lock is a descriptor of its process: a pickled writer takes its own.
        return {**self.__dict__, "_lock": None}

    # -- writing
    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        self.fs.take_records()  # drop anything left by an earlier, failed save
        # Large contiguous CPU chunks are fingerprinted by the digest threads (bytes still in cache); the rest in
        # a thread while DCP writes. A GPU chunk uses a side stream waiting on this thread's current stream of
        # its device (the fingerprint thread's current device is cuda:0 whatever this rank's GPU is).
        fused = self._fusable(plan, planner) if self.fingerprint else {}
        self.fs.fused = {key: bw for key, (_, _, bw) in fused.items()}
        self.fs.fused_jobs = jobs = []
        try:
            with ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckptverify-fingerprint") as pool:
                fp_job = None
                if self.fingerprint:
                    skip = {item.index for item, _, _ in fused.values()}
                    streams = FingerprintStreams.capture(_chunk_devices(plan, planner))
                    fp_job = pool.submit(self._fingerprint_items, plan, planner, skip, streams)
                results = super().write_data(plan, planner).wait()
                facts = fp_job.result() if fp_job is not None else {}
        finally:
            self.fs.fused = {}
            # Not the cancelled jobs (the writer did their work): one counts as done only once dequeued.
            futures_wait([job for job in jobs if not job.cancelled()])
            self.fs.fused_jobs = []
        rode = 0
        for item, t, bw in fused.values():
            # A chunk whose write did not carry its fingerprint (memory copied on the way) is fingerprinted now.
            facts[item.index] = _chunk_facts(t, item, bw.result() if bw.complete else None)
            rode += bw.complete
        records, tells = self.fs.take_records()
        # Many small acyclic objects (see gcpause). DCP's write loop keeps the collector: torch.save leaves
        # ~20 objects per item in cycles, which a pause would keep alive.
        with paused_gc():
            out = self._hashed_results(results, facts, records, tells)
        self.stats["fingerprinted_beside_writes"] = rode
        return out

    @staticmethod
    def _fusable(plan: SavePlan, planner: SavePlanner
                 ) -> dict[tuple[int, int], tuple[WriteItem, torch.Tensor, BlockwiseFingerprint]]:
        """Chunks whose fingerprints can ride on their writes, by (address, bytes): CPU, kernel-supported, contiguous,
        the whole storage, and the very memory the state dict holds. The last needs ``lookup_object``: a planner whose
        ``resolve_data`` copies would keep every large copy alive through the write, with no key matching."""
        from ckptverify.fingerprint.kernels import COMPILED_BLOCK

        out: dict[tuple[int, int], tuple[WriteItem, torch.Tensor, BlockwiseFingerprint]] = {}
        lookup = getattr(planner, "lookup_object", None)
        if not callable(lookup):
            return out
        for item, td in _tensor_items(plan):
            if td.chunk.sizes.numel() < COMPILED_BLOCK:
                continue
            data = planner.resolve_data(item)
            if not isinstance(data, torch.Tensor) or data.device.type != "cpu" or is_wrapper_subclass(data):
                continue
            try:
                held = lookup(item.index)
            except Exception:  # a planner's own lookup: whatever it raises, the chunk is fingerprinted after
                continue
            if not isinstance(held, torch.Tensor) or held.data_ptr() != data.data_ptr():
                continue
            t = data.detach()
            nbytes = t.numel() * t.element_size()
            if (not t.is_contiguous() or t.storage_offset() != 0 or t.untyped_storage().nbytes() != nbytes
                    or (t.data_ptr(), nbytes) in out):
                continue
            with torch.no_grad():
                bw = blockwise_fingerprint(t, td.chunk.offsets, td.size)
            if bw is not None and bw.nbytes == nbytes:
                out[(t.data_ptr(), nbytes)] = (item, t, bw)
        return out

    def _hashed_results(self, results: list[WriteResult], facts: dict[MetadataIndex, _ChunkFacts],
                        records: dict[str, _FileRecord], tells: int) -> Future[list[WriteResult]]:
        """DCP's write results with their storage data replaced by :class:`HashedStorageInfo`."""

        out: list[WriteResult] = []
        rereads = 0
        used: set[str] = set()
        blobs: dict[tuple[str, int], Any] = {}
        for wr in results:
            info = wr.storage_data
            if type(info) is not _StorageInfo:
                raise RuntimeError(
                    f"DCP returned storage data of type {type(info).__name__} for {wr.index.fqn!r}; "
                    "ckptverify expects torch.distributed.checkpoint.filesystem._StorageInfo"
                )
            path = self.fs.concat_path(self.path, info.relative_path)
            record = records.get(_key(path))
            if record is None:
                raise RuntimeError(f"no hashing stream wrote {info.relative_path} (item {wr.index.fqn!r})")
            used.add(_key(path))
            span = (info.offset, info.length)
            segment = record.segments.get(span)
            if segment is None and not info.length:
                segment = _Segment(new_digest(self.digest).hexdigest(), ())
            elif segment is None:
                # Safetensors-format tensors all point at the blob's start: digest their own range (from the blob
                # header) from the closed file.
                span = _blob_range(blobs, path, info.offset, wr.index.fqn) or span
                rd = block_digests(path, span[0], span[1], self.digest, self.block_bytes)
                segment = _Segment(rd.digest, rd.blocks)
                rereads += 1
            hashed = HashedStorageInfo(
                info.relative_path,
                info.offset,
                info.length,
                info.transform_descriptors,
                digest=segment.digest,
                blocks=segment.blocks,
                file_size=record.size,
                file_digest=record.digest,
                span=span,
                **vars(facts.get(wr.index, _NO_FACTS)),  # fingerprint, nan_count, inf_count, parts
            )
            out.append(dataclasses.replace(wr, storage_data=hashed))

        extra = tuple(
            sorted(
                (os.path.relpath(k, _key(self.path)).replace(os.sep, "/"), r.size, r.digest)
                for k, r in records.items()
                if k not in used
            )
        )
        if extra and out:
            first = out[0]
            out[0] = dataclasses.replace(
                first, storage_data=dataclasses.replace(first.storage_data, extra_files=extra)
            )
        self.stats = {
            "items": len(out),
            "files": len(records),
            "tell_calls": tells,
            "reread_items": rereads,
            "fingerprinted": sum(1 for f in facts.values() if f.fingerprint is not None),
        }
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(out)
        return fut

    @staticmethod
    def _fingerprint_items(plan: SavePlan, planner: SavePlanner, skip: set[MetadataIndex],
                           streams: FingerprintStreams) -> dict[MetadataIndex, _ChunkFacts]:
        """Facts of every tensor chunk of ``plan`` not in ``skip``, each on its device and ``streams``' side stream."""
        from ckptverify.fingerprint import kernels

        facts: dict[MetadataIndex, _ChunkFacts] = {}
        # Bytes of chunks big enough for the compiled kernel (complex counts two), by the kernel compilation each takes.
        large: dict[torch.dtype | None, int] = {}
        for _, td in _tensor_items(plan):
            numel, dtype = td.chunk.sizes.numel(), td.properties.dtype
            if numel * (2 if dtype.is_complex else 1) >= kernels.COMPILED_BLOCK:
                kernel = kernels.cpu_kernel_dtype(dtype)
                large[kernel] = large.get(kernel, 0) + numel * dtype.itemsize
        with torch.no_grad(), kernels.thread_limit(FINGERPRINT_THREADS):
            for item, _ in _tensor_items(plan):
                if item.index in skip:
                    continue
                data = planner.resolve_data(item)
                if isinstance(data, torch.Tensor):
                    kernel = kernels.cpu_kernel_dtype(data.dtype) if large else None
                    if large.get(kernel, 0) >= kernels.AUTO_COMPILE_AFTER_BYTES and data.device.type == "cpu":
                        # Enough CPU work for "auto" to compile: start now in the background, not after the first save.
                        kernels.compile_in_background(data.dtype)
                        del large[kernel]
                    with streams.scope(data):
                        facts[item.index] = _chunk_facts(data.detach(), item)
        return facts

    # -- committing
    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Commit (coordinator; all writes done): ``.metadata``, then the manifest, then remove the marker and drop the
        lock. Any failure leaves the marker."""
        try:
            with paused_gc():  # the manifest of many items: as in write_data
                self._finish(metadata, results)
            if self._lock is not None:
                self._lock.commit()  # releases it
        finally:
            self._release_lock()

    def _finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        hashed: list[tuple[MetadataIndex, HashedStorageInfo]] = [
            (wr.index, wr.storage_data) for wr_list in results for wr in wr_list
        ]
        for index, info in hashed:
            if not isinstance(info, HashedStorageInfo):
                raise RuntimeError(
                    f"write result for {index.fqn!r} carries no digests (storage data of type "
                    f"{type(info).__name__}): was it written by another storage writer?"
                )
        super().finish(metadata, [[dataclasses.replace(wr, storage_data=wr.storage_data.plain()) for wr in wr_list]
                                  for wr_list in results])

        root = os.fspath(self.path)
        metadata_name = (
            f"__{self.rank}{METADATA_FILE}" if not self.use_collectives and self.rank is not None else METADATA_FILE
        )
        metadata_path = os.path.join(root, metadata_name)
        size = os.path.getsize(metadata_path)
        metadata_files = {metadata_name: FileEntry(size, digest_file_range(metadata_path, 0, size, self.digest))}
        items: list[ItemEntry] = []
        files: dict[str, FileEntry] = {}
        chunks: dict[str, dict[tuple[int, ...], HashedStorageInfo]] = {}
        for index, info in hashed:
            assert info.digest is not None and info.file_size is not None and info.file_digest is not None
            assert info.span is not None
            offsets = None if index.offset is None else tuple(int(o) for o in index.offset)
            items.append(ItemEntry(
                fqn=index.fqn,
                chunk_offsets=offsets,
                file=info.relative_path,
                offset=info.span[0],
                length=info.span[1],
                digest=info.digest,
                blocks=tuple(info.blocks),
            ))
            _add_file(files, info.relative_path, info.file_size, info.file_digest)
            for name, size, digest in info.extra_files:
                _add_file(files, name, size, digest)
            if offsets is not None:
                chunks.setdefault(index.fqn, {}).setdefault(offsets, info)

        tensors: dict[str, TensorEntry] = {}
        for fqn, md in metadata.state_dict_metadata.items():
            if not isinstance(md, TensorStorageMetadata):
                continue
            dtype = str(md.properties.dtype).removeprefix("torch.")
            shape = tuple(int(s) for s in md.size)
            infos = list(chunks.get(fqn, {}).values())
            fp, nan, inf = _combine_chunks(infos, shape) if self.fingerprint else (None, None, None)
            # A tensor subclass is saved whole (one chunk): its parts' fingerprints come with it.
            parts = infos[0].parts if fp is not None and len(infos) == 1 else None
            tensors[fqn] = TensorEntry(dtype=dtype, shape=shape, fingerprint=fp, nan_count=nan, inf_count=inf,
                                       parts=parts)

        from ckptverify._version import __version__

        manifest = Manifest(
            digest_algorithm=self.digest,
            block_bytes=self.block_bytes,
            items=tuple(sorted(items, key=lambda i: (i.file, i.offset))),  # the order the file keeps
            files=files,
            tensors=tensors,
            metadata_files=metadata_files,
            world_size=len(results),
            fingerprint_version=FINGERPRINT_VERSION if self.fingerprint else None,
            created=datetime.now(UTC).isoformat(timespec="microseconds"),
            tool_version=__version__,
            torch_version=str(torch.__version__),
            source="save",
        )
        write_manifest(root, manifest)
        self.manifest = manifest


def _tensor_items(plan: SavePlan) -> Iterator[tuple[WriteItem, Any]]:
    """The plan's tensor chunks, with their ``tensor_data``."""
    for item in plan.items:
        if item.type != WriteItemType.BYTE_IO and item.tensor_data is not None:
            yield item, item.tensor_data


def _chunk_devices(plan: SavePlan, planner: SavePlanner) -> set[torch.device]:
    """Devices of the plan's tensor chunks, via ``lookup_object`` where available (no copy), else ``resolve_data``."""
    lookup = getattr(planner, "lookup_object", None)
    devices: set[torch.device] = set()
    for item, _ in _tensor_items(plan):
        try:
            data = lookup(item.index) if callable(lookup) else planner.resolve_data(item)
        except Exception:  # a planner's own lookup: whatever it raises, resolve_data says where the chunk is
            data = planner.resolve_data(item)
        if isinstance(data, torch.Tensor):
            devices.add(data.device)
    return devices


def _blob_range(cache: dict[tuple[str, int], Any], path: str, start: int, fqn: str) -> tuple[int, int] | None:
    """Where tensor ``fqn``'s bytes lie in the safetensors blob at ``start`` of ``path`` (header read once per blob);
    ``None`` if no such blob or tensor."""
    from ckptverify.dcp import safetensors
    from ckptverify.safeparse.readers import ReadOnlyFile

    key = (path, start)
    if key not in cache:
        try:
            with ReadOnlyFile(path) as f:
                cache[key] = safetensors.read_blob(f, start)
        except (OSError, ArchiveError):
            cache[key] = None
    blob = cache[key]
    return None if blob is None else safetensors.data_range(blob, fqn)


def _add_file(files: dict[str, FileEntry], name: str, size: int, digest: str) -> None:
    entry = FileEntry(size=size, digest=digest)
    previous = files.setdefault(name, entry)
    if previous != entry:
        raise RuntimeError(f"two ranks report different contents for {name}: {previous} vs {entry}")


def _combine_chunks(
    infos: list[HashedStorageInfo], shape: tuple[int, ...]
) -> tuple[str | None, int | None, int | None]:
    """The tensor's fingerprint and NaN/Inf counts from its unique chunks; ``None`` if any chunk lacks one or they do
    not cover the tensor."""
    if not infos:
        return None, None, None
    fps = [i.fingerprint for i in infos]
    whole = None if None in fps else combine(fps)  # type: ignore[arg-type]
    fp = whole.value if whole is not None and whole.complete and whole.shape == shape else None
    nans, infs = [i.nan_count for i in infos], [i.inf_count for i in infos]
    return fp, None if None in nans else sum(nans), None if None in infs else sum(infs)  # type: ignore[arg-type]
