"""``fingerprint``: adopt an existing checkpoint (torchtitan, Megatron, plain ``dcp.save``, ...) by writing its
manifest.

It is verified first; one that fails is refused, never blessed. Then every item, block, file and metadata file is
digested and every tensor fingerprinted from its description (:mod:`ckptverify.formats.describe`), and the
manifest written atomically. The only command that writes into a checkpoint, and only its manifest.
"""

from __future__ import annotations

import datetime as _dt
import os
import re
import threading
import time
from contextlib import nullcontext
from typing import Any, ClassVar

from ckptverify.checks import deep as deep_check
from ckptverify.checks.dcp_pipeline import (
    KEEP_FILE_BYTES,
    KEEP_TOTAL_BYTES,
    UNCHECKABLE,
    Executor,
    ProgressSink,
    VerificationRun,
    changed_finding,
    default_jobs,
)
from ckptverify.errors import CheckpointNotFoundError, CkptVerifyError, FileChangedError, UsageError
from ckptverify.findings import CheckCoverage, Finding, Location, Report, error, info, merge_coverage, merge_reports
from ckptverify.fingerprint.nonfinite import counts_kept
from ckptverify.formats.describe import StoredRange
from ckptverify.ownfiles.manifest import (
    DEFAULT_BLOCK_BYTES,
    MANIFEST_FILE,
    MAX_BLOCK_BYTES,
    MIN_BLOCK_BYTES,
    FileEntry,
    ItemEntry,
    Manifest,
    TensorEntry,
    write_manifest,
)
from ckptverify.safeparse import paths
from ckptverify.safeparse.gcpause import paused_gc

_RANK_FILE = re.compile(r"^__(\d+)_\d+\.distcp$")


def fingerprint_checkpoint(path: str | os.PathLike[str], *, digest: str = "xxh3-128",
                           block_bytes: int = DEFAULT_BLOCK_BYTES, force: bool = False, jobs: int | None = None,
                           trust_uncheckable: bool = False, progress: ProgressSink | None = None,
                           executor: Executor | None = None,
                           parts: list[tuple[frozenset[str], Report]] | None = None) -> tuple[Report, Manifest | None]:
    """Verify the checkpoint at ``path`` and, if it passes, write its manifest. Returns the report and the manifest
    (``None`` when refused).

    Content verification could not check (no CRC-32) is refused unless ``trust_uncheckable`` (the report names it
    either way). ``executor``: share a DCP checkpoint's reads among ranks (:mod:`ckptverify.cluster`), same manifest.
    ``parts``: other nodes' files (not opened here) with their verification; their tensor pieces and work units'
    results come through ``executor`` (:class:`~ckptverify.cluster.recorded.Recorded`).
    Raises :class:`~ckptverify.errors.CkptVerifyError` (a manifest exists without ``force``, or its path is not a
    regular file), ``ValueError`` (parts cannot be merged),
    :class:`~ckptverify.errors.UsageError` (bad arguments).
    """
    from ckptverify.fingerprint import ALGORITHMS

    root = os.fspath(path)
    if digest not in ALGORITHMS:
        raise UsageError(f"unknown digest {digest!r}; choose one of {', '.join(ALGORITHMS)}")
    if not MIN_BLOCK_BYTES <= block_bytes <= MAX_BLOCK_BYTES:
        raise UsageError(f"--block-bytes must be in [{MIN_BLOCK_BYTES}, {MAX_BLOCK_BYTES}], got {block_bytes}")
    single = paths.lexists(root) and not paths.isdir(root)
    manifest_path = os.path.join(root, MANIFEST_FILE) if not single else file_manifest_path(root)
    if paths.lexists(manifest_path) and (single or paths.isdir(root)):
        if not force:
            raise CkptVerifyError(f"{manifest_path} exists; pass --force to replace it")
        if paths.islink(manifest_path) or not paths.isfile(manifest_path):
            raise CkptVerifyError(f"{manifest_path} exists and is not a regular file (a directory, link or "
                                      "special file); it is not replaced: remove it by hand if it is yours")

    started = time.perf_counter()
    if single:
        return _fingerprint_described(root, digest=digest, block_bytes=block_bytes, force=force, jobs=jobs,
                                      trust_uncheckable=trust_uncheckable, started=started)
    if not paths.isdir(root):
        raise CheckpointNotFoundError(f"checkpoint path does not exist: {root}")
    from ckptverify.audit.verify import _other_format

    if _other_format(root)[0] == "folder":
        return _fingerprint_described(root, digest=digest, block_bytes=block_bytes, force=force, jobs=jobs,
                                      trust_uncheckable=trust_uncheckable, started=started)
    # Many small acyclic objects (see gcpause): a third of the time of 100 000 items without the pause.
    with paused_gc():
        return _adopt_dcp(root, digest=digest, block_bytes=block_bytes, jobs=jobs,
                          trust_uncheckable=trust_uncheckable, progress=progress, executor=executor,
                          started=started, parts=parts)


def _adopt_dcp(root: str, *, digest: str, block_bytes: int, jobs: int | None, trust_uncheckable: bool,
               progress: ProgressSink | None, executor: Executor | None, started: float,
               parts: list[tuple[frozenset[str], Report]] | None = None) -> tuple[Report, Manifest | None]:
    """:func:`fingerprint_checkpoint` of a DCP checkpoint (see there)."""
    from ckptverify._version import __version__
    from ckptverify.fingerprint import FINGERPRINT_VERSION

    skip = frozenset(f for files, _ in parts or () for f in files)
    # The digest pass and the scan read the small files again (hold_kept).
    run = VerificationRun(root, jobs or default_jobs(), progress, skip=skip, executor=executor,
                          hold_kept=HOLD_KEPT and executor is None)
    try:
        run.execute(deep=False, use_manifest=False)
        checked = run.report("fingerprint", time.perf_counter() - started)
        if parts is not None:
            here, opened = checked.stats.get("bytes"), run.opened_files()
            checked = merge_reports("fingerprint", root, [checked, *(report for _, report in parts)])
            # What this process read; the rest was read by the parts, each on its node.
            checked.stats.update(bytes_read_here=here, opened=opened)
        if not checked.passed:
            refusal = error("fingerprint-refused", "the checkpoint fails verification; refusing to write a "
                            "manifest that would bless it", location=Location(file=MANIFEST_FILE))
            return Report(command="fingerprint", target=root, findings=(*checked.findings, refusal),
                          coverage=checked.coverage, stats=checked.stats), None
        uncheckable = [f for f in checked.findings if f.check == UNCHECKABLE]
        if uncheckable and not trust_uncheckable:
            refusal = error(
                "fingerprint-refused",
                f"{len(uncheckable)} finding(s) name content that nothing could check (no CRC-32); a manifest "
                "would bless it as it is now. Refused: pass --trust-uncheckable to adopt it anyway",
                location=Location(file=MANIFEST_FILE))
            return Report(command="fingerprint", target=root, findings=(*checked.findings, refusal),
                          coverage=checked.coverage, stats=checked.stats), None
        desc = run.description()
        if skip:  # other nodes' files, items and tensor pieces, as their parts described them
            executor.describe(desc, skip)  # type: ignore[union-attr]
        if progress is not None:
            progress.start(sum(i.length for i in desc.stored))
        entries, files, scans, replica_findings = digests_and_scans(run, desc, digest=digest,
                                                                    block_bytes=block_bytes, executor=executor)
        metadata = {n: _metadata_entry(root, n, digest) for n in desc.metadata_files}
        names = sorted(files)
        file_digests = [files[n] for n in names]
        if replica_findings:
            return Report(command="fingerprint", target=root, findings=(*checked.findings, *replica_findings, error(
                "fingerprint-refused", "replicas of a chunk differ; refusing to write a manifest that would bless "
                "the checkpoint", location=Location(file=MANIFEST_FILE))), coverage=checked.coverage,
                stats=checked.stats), None
        tensors: dict[str, TensorEntry] = {}
        unfingerprinted = 0
        for fqn, tinfo in desc.tensors.items():
            scan = scans.get(fqn)
            value = scan.value(tinfo.shape) if scan is not None else None
            if value is None and 0 not in tinfo.shape:
                unfingerprinted += 1
            inner = tuple(scan.part_values.items()) if scan is not None and scan.part_values and value else None
            # The counts as a save keeps them: for the dtypes it counts, and only once every chunk was counted.
            counted = scan is not None and counts_kept(tinfo.dtype) and not scan.uncounted
            tensors[fqn] = TensorEntry(dtype=tinfo.dtype, shape=tinfo.shape, fingerprint=value,
                                       nan_count=scan.nan if counted else None,
                                       inf_count=scan.inf if counted else None, parts=inner)
        ranks = {int(m.group(1)) for n in names if (m := _RANK_FILE.match(n))}
        manifest = Manifest(
            digest_algorithm=digest, block_bytes=block_bytes, items=tuple(entries),
            files=dict(zip(names, file_digests, strict=True)), tensors=tensors, metadata_files=metadata,
            world_size=max(ranks) + 1 if ranks else 1, fingerprint_version=FINGERPRINT_VERSION,
            created=_dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"), tool_version=__version__,
            torch_version=torch_version(), source="fingerprint",
        )
        changed = run.changed_files()
        if changed:
            return _refused(checked, changed, "files changed while they were digested"), None
        written = write_manifest(root, manifest)
    except FileChangedError as exc:
        name = os.path.relpath(exc.path, root) if isinstance(exc.path, str) else "?"
        return _refused(checked, [changed_finding(name, str(exc))], "a file changed while it was digested"), None
    finally:
        run.close()
    notes = [info("manifest-written",
                  f"wrote {written}: {len(entries)} items, {len(names)} files, "
                  f"{len(tensors) - unfingerprinted} of {len(tensors)} tensors fingerprinted",
                  location=Location(file=MANIFEST_FILE))]
    if unfingerprinted:
        notes.append(info("fingerprint", f"{unfingerprinted} tensor(s) could not be rebuilt from their bytes "
                          "(e.g. safetensors format) and carry no logical fingerprint; their bytes are digested",
                          location=Location(file=MANIFEST_FILE)))
    coverage = (*checked.coverage, CheckCoverage(check="manifest-digest", count=len(entries), unit="items"))
    notes.extend(_trusted(uncheckable, MANIFEST_FILE))
    findings = tuple(f for f in checked.findings if f.check != "manifest-absent") + tuple(notes)
    return Report(command="fingerprint", target=root, findings=findings, coverage=merge_coverage(coverage),
                  stats=checked.stats), manifest


def digests_and_scans(run: VerificationRun, desc: Any, *, digest: str, block_bytes: int, executor: Executor | None
                      ) -> tuple[list[ItemEntry], dict[str, FileEntry], dict[str, Any], list[Any]]:
    """Every item's and file's digests and every tensor's scan of ``desc`` (what ``run`` verified, and what ``executor``
    brings from elsewhere): the manifest entries, scans and any ``replica-mismatch`` findings."""
    from ckptverify.fingerprint import BlockDigest, digest_reader
    from ckptverify.fingerprint.digest import digest_bytes

    root = run.root

    def digest_item(item: StoredRange) -> ItemEntry:
        d = BlockDigest(digest, block_bytes)
        with desc.open(item.file) as f:
            f.fold(item.offset, item.offset + item.length, d.update)
        run.advance(item.length)
        return ItemEntry(fqn=item.name, chunk_offsets=item.chunk_offsets, file=item.file, offset=item.offset,
                         length=item.length, digest=d.hexdigest(), blocks=tuple(d.block_hexdigests()))

    whole_files: dict[str, FileEntry] = {}  # files one batch of small items read whole
    kept = _KeptFiles(KEEP_FILE_BYTES, KEEP_TOTAL_BYTES)  # and their bytes, for the tensor scan: read once

    def digest_batch(batch: _Batch) -> list[ItemEntry]:
        # A small item is one block: its digest and its block's are the same, taken once.
        name, start, end, items = batch
        with desc.open(name) as f:
            buf = f.pread(start, end - start)
            size = f.size
        if len(buf) != end - start:  # inside the size seen at open: the file changed
            raise FileChangedError(f"{name} ends before byte {end} now", os.path.join(root, name))
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
            kept.keep(name, buf)
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
                                  os.stat(os.path.join(root, n)).st_size, digest=value)
                        for n, value in zip(names, got[len(ordered):], strict=True)]
        scans, replica_findings = deep_check.scan_description(desc, executor.tensor_map(run))
    else:
        # Small items and small whole tensors in batched reads (a checkpoint of many small tensors).
        small, large = _small_item_batches(desc.stored, block_bytes)
        entries = [e for batch in run.map(digest_batch, small) for e in batch]
        entries += run.map(digest_item, sorted(large, key=lambda i: -i.length))
        file_digests = run.map(digest_file, names)
        scans, batched = _scan_small_tensors(kept.over(desc), run.map)
        kept.clear()
        run.release_kept()
        rest = {name for name in desc.tensors if name not in batched}
        more, replica_findings = deep_check.scan_description(desc, run.map, only=rest)
        scans.update(more)
    return entries, dict(zip(names, file_digests, strict=True)), scans, replica_findings


#: The verification pass's small files read whole at open stay in memory through the digest pass and the scan.
HOLD_KEPT = True


class _KeptFiles:
    """Bytes of small files read whole, kept within bounds for a later pass (the bytes that were digested; a change on
    disk is caught by ``changed_files`` before the manifest is written)."""

    def __init__(self, file_bytes: int, total_bytes: int) -> None:
        self.file_bytes, self.left = file_bytes, total_bytes
        self.files: dict[str, bytes] = {}
        self._lock = threading.Lock()

    def keep(self, name: str, data: bytes) -> None:
        if len(data) <= self.file_bytes:
            with self._lock:
                if len(data) <= self.left:
                    self.files[name] = data
                    self.left -= len(data)

    def over(self, desc: Any) -> Any:
        """``desc`` with kept files opening as readers of their kept bytes."""
        return _KeptOver(desc, self.files) if self.files else desc

    def clear(self) -> None:
        self.files = {}


class _KeptOver:
    """A description whose kept files read from memory; everything else is the description's own."""

    def __init__(self, desc: Any, files: dict[str, bytes]) -> None:
        self._desc, self._files = desc, files

    def __getattr__(self, name: str) -> Any:
        return getattr(self._desc, name)

    def open(self, what: Any) -> Any:
        data = self._files.get(what) if isinstance(what, str) else None
        return nullcontext(_KeptReader(data)) if data is not None else self._desc.open(what)


class _KeptReader:
    """A kept file's bytes with the reader calls the passes use (``pread``, ``size``)."""

    __slots__ = ("data", "size")

    def __init__(self, data: bytes) -> None:
        self.data, self.size = data, len(data)

    def pread(self, offset: int, n: int) -> bytes:
        return self.data[offset:offset + n] if offset >= 0 and n > 0 else b""


#: A run of small items of one file read at once: (file, start, end, items).
_Batch = tuple[str, int, int, list[StoredRange]]
#: Most bytes read at once for consecutive small items, and the largest gap between two read over.
BATCH_BYTES = 8 << 20
BATCH_GAP = 64 << 10


def _small_item_batches(stored: list[StoredRange], block_bytes: int) -> tuple[list[_Batch], list[StoredRange]]:
    """Items of 1 byte to one block grouped into per-file runs read at once (at most :data:`BATCH_BYTES`, gaps up to
    :data:`BATCH_GAP`), and the other items, digested singly."""
    limit = min(block_bytes, BATCH_BYTES)
    small = sorted((i for i in stored if 0 < i.length <= limit), key=lambda i: (i.file, i.offset))
    large = [i for i in stored if not 0 < i.length <= limit]
    batches: list[_Batch] = []
    for item in small:
        end = item.offset + item.length
        if batches:
            name, start, stop, items = batches[-1]
            if name == item.file and stop <= item.offset <= stop + BATCH_GAP and end - start <= BATCH_BYTES:
                items.append(item)
                batches[-1] = (name, start, end, items)
                continue
        batches.append((item.file, item.offset, end, [item]))
    return batches, large


#: Tensors of at most this many elements, stored whole in one raw row-major piece, are fingerprinted many at once.
SMALL_TENSOR_ELEMENTS = 1 << 14
#: Dtypes fingerprinted many at once (others, complex and float8 among them, take the general scan).
_BATCHED_DTYPES = frozenset({"float64", "float32", "float16", "bfloat16", "int64", "int32", "int16", "int8",
                             "uint8", "bool"})


def _scan_small_tensors(desc: Any, run_map: Any) -> tuple[dict[str, Any], set[str]]:
    """Scans of the small tensors stored whole in one raw row-major piece of a batched dtype, fingerprinted many at a
    time in numpy (:func:`_whole_lanes`, no torch import) from the batched reads: the same values as
    :func:`~ckptverify.checks.deep.scan_description` at a fraction of its per-tensor cost. Returns the scans and
    names; every other tensor is left to the general scan (which also reports what is wrong)."""
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
    batches, _ = _small_item_batches(picked, BATCH_BYTES)

    def read(batch: _Batch) -> list[tuple[str, bytes]]:
        name, start, end, ranges = batch
        with desc.open(name) as f:
            buf = f.pread(start, end - start)
        if len(buf) != end - start:
            raise FileChangedError(f"{name} ends before byte {end} now", os.path.join(desc.root, name))
        return [(r.name, buf[r.offset - start:r.offset - start + r.length]) for r in ranges]

    scans: dict[str, SmallScan] = {}
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
            nan = inf = None
            if dtype in _FLOAT_DTYPES:
                nan, inf = _nonfinite_counts(joined, dtype, counts)
            if nan is None or inf is None:
                for fqn, value in zip(names, values, strict=True):
                    scans[fqn] = SmallScan(value, 0, 0)
            else:
                for fqn, value, a, b in zip(names, values, nan, inf, strict=True):
                    scans[fqn] = SmallScan(value, a, b)
    return scans, set(scans)  # type: ignore[return-value]


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

    lane0, lane1 = lanes
    pairs = np.empty((len(lane0), 2), dtype=">u8")  # big-endian: the bytes in the order the hex digits read
    pairs[:, 0] = lane0
    pairs[:, 1] = lane1
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
    return _segment_sums(np.isnan(values), counts), _segment_sums(np.isinf(values), counts)


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


def _segment_sums(flags: Any, counts: list[int]) -> list[int]:
    """The number of true values in each consecutive run of ``counts`` of ``flags``."""
    import numpy as np

    starts = np.zeros(len(counts), dtype=np.int64)
    np.cumsum(np.asarray(counts[:-1], dtype=np.int64), out=starts[1:])
    return np.add.reduceat(flags.astype(np.int64), starts).tolist()


_TORCH_VERSION_LINE = re.compile(r"""^__version__\s*=\s*['"]([^'"\\]+)['"]\s*$""", re.MULTILINE)


def torch_version() -> str:
    """``torch.__version__`` without importing torch (over a second) when not yet imported, from ``torch/version.py``;
    imports torch if that cannot be read."""
    import sys

    loaded = sys.modules.get("torch")
    if loaded is None:
        import importlib.util

        try:
            spec = importlib.util.find_spec("torch")
            where = list(spec.submodule_search_locations or []) if spec is not None else []
            if len(where) == 1:
                with open(os.path.join(where[0], "version.py"), encoding="utf-8") as f:
                    found = _TORCH_VERSION_LINE.findall(f.read(1 << 16))
                if len(found) == 1:
                    return found[0]
        except (OSError, ImportError, ValueError, UnicodeDecodeError):
            pass
        import torch as loaded
    return str(loaded.__version__)


def _refused(checked: Report, findings: list[Any], why: str) -> Report:
    refusal = error("fingerprint-refused", f"{why}; refusing to write a manifest of bytes that are no longer "
                    "on disk", location=Location(file=MANIFEST_FILE))
    return Report(command="fingerprint", target=checked.target, findings=(*checked.findings, *findings, refusal),
                  coverage=checked.coverage, stats=checked.stats)


def _trusted(uncheckable: list[Any], where: str) -> list[Finding]:
    """The note that content nothing could check was adopted as asked (none when there is none)."""
    return [info("fingerprint-trusted", f"adopted, as asked (--trust-uncheckable), content that nothing could check: "
                 f"{len(uncheckable)} uncheckable finding(s) above", location=Location(file=where))] if uncheckable \
        else []


def _metadata_entry(root: str, name: str, algorithm: str) -> FileEntry:
    """Size and digest of a metadata file, opened as a regular file inside the checkpoint only."""
    from ckptverify.fingerprint import digest_reader
    from ckptverify.safeparse.readers import ReadOnlyFile

    with ReadOnlyFile(os.path.join(root, name), root=root) as f:
        return FileEntry(size=f.size, digest=digest_reader(f, algorithm))


def file_manifest_path(path: str) -> str:
    """Where the manifest of the single checkpoint file ``path`` is written: beside it."""
    from ckptverify.ownfiles.manifest import file_manifest_name

    head, base = os.path.split(os.path.abspath(path))
    return os.path.join(head, file_manifest_name(base))


def _fingerprint_described(root: str, *, digest: str, block_bytes: int, force: bool, jobs: int | None,
                           trust_uncheckable: bool, started: float) -> tuple[Report, Manifest | None]:
    """Adopt a folder of checkpoint files or a single file: verified by each file's checks, then every file digested and
    every tensor payload digested and fingerprinted (:mod:`ckptverify.checks.described`). DCP sub-folders get their
    own manifests; a single file's goes beside it."""
    from ckptverify.audit.verify import _under, verify_checkpoint

    single = not os.path.isdir(root)
    # Findings about the manifest name the file it is (beside a single file, inside a folder).
    own = os.path.basename(file_manifest_path(root)) if single else MANIFEST_FILE
    checked = verify_checkpoint(root, jobs=jobs, use_manifest=False)
    findings = [f for f in checked.findings if f.check != "manifest-absent"]
    if not checked.passed:
        return Report(command="fingerprint", target=root, findings=(*findings, error(
            "fingerprint-refused", "the checkpoint fails verification; refusing to write a manifest that would "
            "bless it", location=Location(file=own))), coverage=checked.coverage, stats=checked.stats), None
    uncheckable = [f for f in findings if f.check == UNCHECKABLE]
    if uncheckable and not trust_uncheckable:
        return Report(command="fingerprint", target=root, findings=(*findings, error(
            "fingerprint-refused",
            f"{len(uncheckable)} finding(s) name content that nothing could check (no checksum: safetensors, "
            "pickles); a manifest would bless it as it is now. Refused: pass --trust-uncheckable to adopt it anyway",
            location=Location(file=own))), coverage=checked.coverage, stats=checked.stats), None
    parts = list(checked.stats.get("parts") or [])
    for part in parts:  # each DCP part gets its own manifest, as `fingerprint PART` would write it
        sub, _ = fingerprint_checkpoint(os.path.join(root, part), digest=digest, block_bytes=block_bytes, force=force,
                                        jobs=jobs, trust_uncheckable=trust_uncheckable)
        if not sub.passed:
            return Report(command="fingerprint", target=root, findings=(*findings, *_under(part, sub.findings)),
                          coverage=checked.coverage, stats=checked.stats), None
    names = [os.path.basename(os.path.abspath(root))] if single else None
    try:
        written, manifest, missing = _described_manifest(root, names, own, digest, block_bytes)
    except FileChangedError as exc:
        return _refused(checked, [changed_finding(os.path.basename(str(exc.path)), str(exc))],
                        "a file changed while it was digested"), None
    if manifest is None:
        return _refused(checked, [], "files were added or removed while they were digested"), None
    files, items, tensors = manifest.files, manifest.items, manifest.tensors
    notes = [info("manifest-written", f"wrote {written}: {len(files)} files, {len(items)} tensor payloads, "
                  f"{len(tensors) - missing} of {len(tensors)} tensors fingerprinted"
                  + (f", and a manifest in each of {len(parts)} DCP part(s)" if parts else ""),
                  location=Location(file=own))]
    notes.extend(_trusted(uncheckable, own))
    coverage = (*checked.coverage, CheckCoverage(check="manifest-digest", count=len(files), unit="files"),
                CheckCoverage(check="fingerprint", count=len(tensors) - missing, unit="tensors"))
    stats = {**checked.stats, "seconds": round(time.perf_counter() - started, 6)}
    return Report(command="fingerprint", target=root, findings=(*findings, *notes),
                  coverage=merge_coverage(coverage), stats=stats), manifest


def _described_manifest(root: str, names: list[str] | None, own: str, digest: str,
                        block_bytes: int) -> tuple[str, Manifest | None, int]:
    """The manifest of one file (``names``) or a folder's top files (``None``), written as ``own``: path, manifest
    (``None`` if files came or went) and unfingerprinted count. Raises ``FileChangedError`` if a file changed."""
    from ckptverify._version import __version__
    from ckptverify.checks.described import manifest_entries
    from ckptverify.fingerprint import FINGERPRINT_VERSION
    from ckptverify.formats.describe import describe, folder_files

    desc = describe(root)
    listed = folder_files(root) if names is None else names
    files, items, tensors, missing = manifest_entries(desc, listed, digest, block_bytes)
    import torch

    manifest = Manifest(digest_algorithm=digest, block_bytes=block_bytes, items=tuple(items), files=files,
                        tensors=tensors, world_size=1, fingerprint_version=FINGERPRINT_VERSION,
                        created=_dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"), tool_version=__version__,
                        torch_version=str(torch.__version__), source="fingerprint")
    if names is None and set(folder_files(root)) != set(listed):
        return "", None, missing
    return write_manifest(desc.root, manifest, name=own), manifest, missing


def fingerprint_folder_parts(path: str | os.PathLike[str], parts: dict[str, tuple[frozenset[str], Executor]],
                             brought: list[Report], elsewhere: list[tuple[frozenset[str], Report]], *,
                             read_elsewhere: bool,
                             digest: str = "xxh3-128", block_bytes: int = DEFAULT_BLOCK_BYTES,
                             jobs: int | None = None,
                             trust_uncheckable: bool = False) -> tuple[Report, Manifest | None, list[str]]:
    """:func:`fingerprint_checkpoint` of a folder whose DCP folders several nodes wrote; top files and unclaimed shards
    are handled here.

    ``parts``: per DCP folder, the shards other nodes' parts read (not opened here) and the executor giving their
    work units' results; ``brought``: those parts' verification (names ``SUB/FILE``). ``elsewhere``: shards of nodes
    that brought no results, with their verification; such a folder is read whole and given a manifest
    when ``read_elsewhere`` or it holds a former manifest, else none (its shards are CRC-protected and were verified
    where written). Returns the report (``stats``: what was read here), the folder's manifest (``None`` if refused)
    and the DCP folders left without one.
    """
    from ckptverify.audit.verify import FINGERPRINT_ADVICE, _folder_files, _under, by_subfolder, verify_part

    root = os.fspath(path)
    if not paths.isdir(root):
        raise CheckpointNotFoundError(f"not a checkpoint directory: {root}")
    started = time.perf_counter()
    top, opened = _folder_files(root, False, False)
    dropped = ("manifest-absent", FINGERPRINT_ADVICE)
    reports = [Report(command="fingerprint", target=root, coverage=top.coverage, stats=top.stats,
                      findings=tuple(f for f in top.findings if f.check not in dropped)), *brought]
    read_here = int(top.stats.get("bytes") or 0)
    subs = list(top.stats.get("parts") or [])
    theirs: dict[str, set[str]] = {}
    for files, _ in elsewhere:
        for sub, names in by_subfolder(files).items():
            theirs.setdefault(sub, set()).update(names)
    unwritten = [s for s in subs if theirs.get(s) and not read_elsewhere
                 and not paths.lexists(os.path.join(root, s, MANIFEST_FILE))]
    # Their own verification stands for the shards not read here.
    reports += [r for files, r in elsewhere if set(by_subfolder(files)) & set(unwritten)]
    for sub in unwritten:
        skip = theirs[sub] | set(parts[sub][0] if sub in parts else ())
        got = verify_part(os.path.join(root, sub), jobs=jobs, skip=frozenset(skip), use_manifest=False)
        read_here += int(got.stats.get("bytes") or 0)
        opened.extend(f"{sub}/{n}" for n in got.stats.get("opened") or [])
        reports.append(Report(command="fingerprint", target=root, coverage=got.coverage, stats=got.stats,
                              findings=tuple(_under(sub, (f for f in got.findings if f.check not in dropped)))))

    def result(findings: tuple[Any, ...], coverage: Any) -> Report:
        stats = {**reports[0].stats, "bytes_read_here": read_here, "opened": sorted(opened),
                 "seconds": round(time.perf_counter() - started, 6)}
        return Report(command="fingerprint", target=root, findings=findings, coverage=merge_coverage(coverage),
                      stats=stats)

    def refused(why: str, *more: Any) -> tuple[Report, None, list[str]]:
        merged = merge_reports("fingerprint", root, reports)
        return result((*merged.findings, *more, error("fingerprint-refused", why, location=Location(
            file=MANIFEST_FILE))), merged.coverage), None, unwritten

    # Every part's verification before any manifest is written: a failed one refuses them all.
    checked = merge_reports("fingerprint", root, reports)
    if not checked.passed:
        return result((*checked.findings, error(
            "fingerprint-refused", "the checkpoint fails verification; refusing to write a manifest that would "
            "bless it", location=Location(file=MANIFEST_FILE))), checked.coverage), None, unwritten
    for sub in subs:  # each other DCP folder gets its manifest, from its nodes' parts and what is read here
        if sub in unwritten:
            continue
        # The parts' verification is the folder's (``brought``): here only their files, pieces and units.
        files, executor = parts.get(sub, (frozenset(), None))
        got, manifest = fingerprint_checkpoint(os.path.join(root, sub), digest=digest, block_bytes=block_bytes,
                                               force=True, jobs=jobs, trust_uncheckable=trust_uncheckable,
                                               executor=executor, parts=[(files, Report(command="fingerprint",
                                                                                        target=root, findings=()))])
        read_here += int(got.stats.get("bytes_read_here") or 0)
        opened.extend(f"{sub}/{n}" for n in got.stats.get("opened") or [])
        keep = tuple(_under(sub, (f for f in got.findings if f.check not in (*dropped, "manifest-written"))))
        reports.append(Report(command="fingerprint", target=root, findings=keep, coverage=got.coverage,
                              stats=got.stats))
        if manifest is None:
            merged = merge_reports("fingerprint", root, reports)
            return result(merged.findings, merged.coverage), None, unwritten
    checked = merge_reports("fingerprint", root, reports)
    uncheckable = [f for f in checked.findings if f.check == UNCHECKABLE]
    if uncheckable and not trust_uncheckable:
        return refused(f"{len(uncheckable)} finding(s) name content that nothing could check (no checksum: "
                       "safetensors, pickles); a manifest would bless it as it is now. Refused: pass "
                       "--trust-uncheckable to adopt it anyway")
    try:
        written, manifest, missing = _described_manifest(root, None, MANIFEST_FILE, digest, block_bytes)
    except FileChangedError as exc:
        return refused("a file changed while it was digested; refusing to write a manifest of bytes that are no "
                       "longer on disk", changed_finding(os.path.basename(str(exc.path)), str(exc)))
    if manifest is None:
        return refused("files were added or removed while they were digested; refusing to write a manifest of "
                       "bytes that are no longer on disk")
    with_manifest = len(subs) - len(unwritten)
    note = (f"wrote {written}: {len(manifest.files)} files, {len(manifest.items)} tensor payloads, "
            f"{len(manifest.tensors) - missing} of {len(manifest.tensors)} tensors fingerprinted, and a manifest "
            f"in each of {with_manifest} DCP part(s)")
    if unwritten:
        note += (f"; none in {', '.join(unwritten)}: their shards, under CRC-32, were verified on the nodes that "
                 "wrote them")
    notes = [info("manifest-written", note, location=Location(file=MANIFEST_FILE))]
    notes.extend(_trusted(uncheckable, MANIFEST_FILE))
    coverage = (*checked.coverage, CheckCoverage(check="manifest-digest", count=len(manifest.files), unit="files"),
                CheckCoverage(check="fingerprint", count=len(manifest.tensors) - missing, unit="tensors"))
    return result((*checked.findings, *notes), coverage), manifest, unwritten
