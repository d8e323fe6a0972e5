"""The DCP verification pipeline: prove a DCP checkpoint intact, or say exactly where it is not.

Stages (:class:`VerificationRun`): metadata read safely; structure (files, bounds, overlaps, tiling); every
item's archive; CRC-32 of every record payload; with a manifest, its comparison and block digests; with
``deep``, every tensor rebuilt and fingerprinted. Nothing is written into the checkpoint. What was read is
handed on as a :class:`~ckptverify.formats.describe.Description` (:meth:`VerificationRun.description`), the one
contract ``fingerprint`` and ``diff`` use.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import threading
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol, TypeVar

from ckptverify.checks import item_label, item_location, manifest_check, unopened
from ckptverify.checks.commit import check_commit
from ckptverify.checks.content import (
    FileResult,
    ItemPlan,
    judge_item,
    plan_file,
    safetensors_files,
    segments,
)
from ckptverify.checks.structure import check_coverage, check_files, check_items, check_tiling, stat_files
from ckptverify.dcp.layout import Item, Layout
from ckptverify.dcp.metadata import METADATA_FILE, RANK_METADATA_RE, read_layout
from ckptverify.errors import ArchiveError, FileChangedError, ManifestError, StorageError, UnsafeFileError
from ckptverify.findings import CheckCoverage, Finding, Location, Report, error, info, merge_coverage
from ckptverify.ownfiles.manifest import MANIFEST_FILE, Manifest, read_manifest
from ckptverify.safeparse import paths
from ckptverify.safeparse.gcpause import paused_gc
from ckptverify.safeparse.readers import ReadOnlyFile, crc32_combine
from ckptverify.safeparse.torchsave import SubclassHeader
from ckptverify.safeparse.zipwalk import TemplateCache

if TYPE_CHECKING:
    from ckptverify.formats.describe import Description

# Deep checks, descriptions and safetensors blobs are imported where used: a plain verify pays no import.

#: Largest byte range hashed as one task; larger records are split and their CRCs combined.
SEGMENT_BYTES = 64 << 20
#: With a manifest, larger records are checked by block digests only; smaller ones (``data.pkl``) also by CRC,
#: so a header is read only once proven.
SMALL_RECORD_BYTES = 64 << 10
#: The check whose findings name content that nothing (no CRC-32, no manifest digest) could check.
UNCHECKABLE = "content-uncheckable"
#: Files this small are read whole at open (within ``KEEP_TOTAL_BYTES``) until planned, or with ``hold_kept`` through
#: :meth:`VerificationRun.digests`: one open and one read per file.
KEEP_FILE_BYTES = 64 << 10
KEEP_TOTAL_BYTES = 256 << 20
#: Above this many tasks, :meth:`VerificationRun.map` pulls per worker (a future costs as much as a small item).
PULL_MAP_MIN = 64

T = TypeVar("T")
R = TypeVar("R")


class ProgressSink(Protocol):
    """Receives progress of long work: ``start`` with the total bytes of a stage, then ``advance`` calls."""

    def start(self, total_bytes: int) -> None: ...

    def advance(self, n: int) -> None: ...


class Executor(Protocol):
    """Shares reads among ranks or nodes (:class:`ckptverify.cluster.session.RankExecutor` through the store,
    :class:`ckptverify.cluster.recorded.Recorded` from the after-save parts' records): ``map_units`` gives, in order,
    results of work units (:mod:`ckptverify.cluster.units`) over ``run``'s files, each read on some rank, advancing
    ``run``'s progress; ``tensor_map`` a ``run_map`` for :func:`~ckptverify.checks.deep.scan_description` sharing the
    raw tensor pieces; ``world`` and ``map_plain`` (the units under ``root`` via ``open_file``: ``scan``) the ranks';
    ``describe`` adds to a description what it brings of ``files`` not opened here (asked only by a run with ``skip``).
    """

    world: int

    def map_units(self, run: VerificationRun, units: list[list[Any]]) -> list[Any]: ...

    def map_plain(self, units: list[list[Any]], *, root: str, open_file: Callable[[str], Any],
                  size_of: Callable[[str], int], local_map: Callable[..., list[Any]],
                  advance: Callable[[int], None] | None = None, jobs: int | None = 1) -> list[Any]: ...

    def tensor_map(self, run: VerificationRun) -> Callable[[Callable[[Any], Any], list[Any]], list[Any]]: ...

    def describe(self, desc: Description, files: frozenset[str]) -> None: ...


def default_jobs() -> int:
    """One worker per usable core."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover - non-Linux
        return max(1, os.cpu_count() or 1)


class VerificationRun:
    """One verification of a DCP checkpoint, stage by stage; run once by :meth:`execute`, ended by :meth:`close`.

    The interface, all that callers outside :mod:`ckptverify.checks` use: the constructor's options, :meth:`execute`;
    then :meth:`report`, :meth:`description`, :attr:`manifest`, :meth:`opened_files`, :meth:`changed_files`, and two
    passes over what was read on the run's workers: :meth:`scan` (tensors rebuilt and fingerprinted) and
    :meth:`digests` (the adoption's digests and scans). An :class:`Executor` is lent the run itself (:attr:`root`,
    :meth:`file`, :meth:`map`, :meth:`advance`): its opened files, workers and progress.

    ``executor`` shares hashing and the deep scan among ranks, or brings the pieces of the ``skip`` files from their
    parts' records (:class:`~ckptverify.cluster.recorded.Recorded`). ``hold_kept`` keeps the small files read at open
    in memory through :meth:`digests`. ``only`` restricts the run to the byte-level checks of the named files (the
    whole-checkpoint checks are another part's); ``skip`` names files another part checks. Files left out are
    neither opened nor reported missing (``docs/verify-after-save.md``).
    """

    def __init__(self, root: str, jobs: int, progress: ProgressSink | None, *,
                 only: frozenset[str] | None = None, skip: frozenset[str] = frozenset(),
                 executor: Executor | None = None, hold_kept: bool = False, extension_registry: Any = None) -> None:
        self.root = root
        self._only, self._skip, self._whole = only, skip, only is None  # whole: also the whole-checkpoint checks
        self._jobs, self._progress, self._executor = jobs, progress, executor
        self._hold_kept, self._extension_registry = hold_kept, extension_registry
        self._findings: list[Finding] = []
        self._coverage: list[CheckCoverage] = []
        self._layout: Layout | None = None
        self._manifest: Manifest | None = None
        self._opened: dict[str, ReadOnlyFile | None] = {}
        self._plans: list[ItemPlan] = []
        self._results: dict[str, FileResult] = {}
        self._bytes_hashed = 0
        self._deep = False
        self._named: dict[str, tuple[int, int, int, int] | None] = {}
        self._reported_changed: set[str] = set()
        #: Plans with their own reader (transformed items, safetensors blobs): joined after the hashing pass.
        self._extra_plans: list[ItemPlan] = []
        #: Framework side files beside the shards (``meta.pt``, ``metadata.json``), checked and opened.
        self._side_files: list[str] = []
        #: What protects each payload: records only block digests checked, and items digested by block.
        self._manifest_records: set[tuple[str, int, str]] = set()
        self._manifest_items: set[tuple[str, int, int]] = set()
        self._pool = ThreadPoolExecutor(max_workers=jobs, thread_name_prefix="ckptverify") if jobs > 1 else None
        self._lock = threading.Lock()
        self._real_root: str | None = None  # the root resolved once, for every file the run opens
        self._kept_bytes = 0  # bytes of small files read whole at open, until the archives are planned

    @property
    def manifest(self) -> Manifest | None:
        """The manifest the run compared the checkpoint with (after :meth:`execute`), or ``None``."""
        return self._manifest

    def report(self, command: str, seconds: float, *, cap: bool = True) -> Report:
        """The findings so far as a report; ``cap``: at most :data:`MAX_FINDINGS_PER_CHECK` listed per check."""
        files = [f for f in self._opened.values() if f is not None]
        file_bytes = sum(f.size for f in files)
        stats: dict[str, Any] = {"seconds": round(seconds, 6)}
        if self._layout is not None:
            stats.update({
                "files": len(files),
                "items": len(self._layout.items),
                "tensors": len(self._layout.tensors),
                "bytes": file_bytes,
                "bytes_hashed": self._bytes_hashed,
                "throughput_bytes_per_s": round(file_bytes / seconds) if seconds > 0 else None,
                "jobs": self._jobs,
                "dcp_version": self._layout.dcp_version,
                "per_rank_metadata": self._layout.per_rank,
                "manifest": self._manifest is not None,
                "deep": self._deep,
            })
        if self._only is not None or self._skip:  # a part: which files it opened (no other node's)
            stats["opened"] = self.opened_files()
        per_check = Counter(f.check for f in self._findings)
        omitted = {c: n - MAX_FINDINGS_PER_CHECK for c, n in sorted(per_check.items()) if n > MAX_FINDINGS_PER_CHECK}
        if omitted:
            stats["findings_omitted"] = omitted
        return Report(command=command, target=self.root,
                      findings=tuple(cap_findings(self._findings) if cap else self._findings),
                      coverage=merge_coverage(self._coverage), stats=stats)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown()
        for f in self._opened.values():
            if f is not None:
                f.close()

    def file(self, name: str) -> ReadOnlyFile | None:
        """The file ``name`` as this run opened (and judged) it, or ``None``."""
        return self._opened.get(name)

    def opened_files(self) -> list[str]:
        """The names of the files this run opened (those whose bytes it checks), sorted."""
        return sorted(n for n, f in self._opened.items() if f is not None)

    def _release_kept(self) -> None:
        """Forget the bytes of the small files read whole at open: later reads go to the files."""
        for f in self._opened.values():  # what planning needed of the small files read whole: now read
            if f is not None:
                f.release_kept()
        self._kept_bytes = 0

    def map(self, fn: Callable[[T], R], items: Iterable[T]) -> list[R]:
        """``[fn(x) for x in items]``, on all workers; raises what the first failing item (in order) raised."""
        if self._pool is None:
            return [fn(x) for x in items]
        items = list(items)
        if len(items) <= PULL_MAP_MIN:
            return list(self._pool.map(fn, items))
        return pulled_map(self._pool, self._jobs, fn, items)

    def advance(self, n: int) -> None:
        if self._progress is not None:
            with self._lock:
                self._progress.advance(n)

    def execute(self, *, deep: bool, use_manifest: bool) -> None:
        """Run every stage. A file that changes under the run stops it with a ``file-changed`` finding."""
        self._named = _name_signatures(self.root)
        try:
            with paused_gc():  # the layout, plans and results of a large checkpoint form no cycles
                self._stages(deep=deep, use_manifest=use_manifest)
        except FileChangedError as exc:
            self._findings.append(changed_under(self.root, exc))
        self._findings.extend(self.changed_files())

    def _mine(self, name: str) -> bool:
        """Whether this run checks the bytes of the file ``name`` (see the class docstring)."""
        return (self._only is None or name in self._only) and name not in self._skip

    def changed_files(self) -> list[Finding]:
        """A ``file-changed`` finding, once each, for every file that differs from when the run first saw it (opened
        files by ``fstat`` and name, metadata and manifest by ``stat``)."""
        out: list[Finding] = []
        for name in sorted(self._opened):  # by name alone: sorting (name, file) pairs costs more
            f = self._opened[name]
            if f is None or name in self._reported_changed:
                continue
            how = f.changed()
            if how is not None:
                out.append(changed_finding(name, how))
        now = _name_signatures(self.root)
        for name in sorted(set(self._named) | set(now)):
            if name not in self._reported_changed and self._named.get(name) != now.get(name):
                out.append(changed_finding(name, "it was replaced, rewritten, created or removed"))
        for finding in out:
            self._reported_changed.add(finding.location.file or "")
        return out

    def _stages(self, *, deep: bool, use_manifest: bool) -> None:
        self._deep = deep
        if self._whole:
            self._findings.extend(check_commit(self.root))  # a save that did not commit: never complete
        layout, md_findings = read_layout(self.root)
        self._findings.extend(md_findings)
        if layout is None:
            return
        self._layout = layout
        if self._whole:
            self._coverage.append(CheckCoverage(check="metadata", count=len(layout.metadata_files),
                                               unit="metadata files"))
        if use_manifest:
            self._read_manifest()
        self._structure(layout)
        self._archives(layout)
        self._hash(layout)
        self._plans.extend(self._extra_plans)
        if deep:
            self._deep_scan()

    def _read_manifest(self) -> None:
        try:
            self._manifest = read_manifest(self.root)
        except ManifestError as exc:
            self._findings.append(error("manifest-invalid", f"{MANIFEST_FILE} cannot be trusted: {exc}",
                                       location=Location(file=MANIFEST_FILE)))
            return
        if self._manifest is None:
            self._findings.append(info(
                "manifest-absent",
                f"no {MANIFEST_FILE}: content is checked against the CRC-32s inside the items only, not against "
                "what was in memory at save time (write one with ckptverify.save or `ckptverify fingerprint`)",
            ))

    def _structure(self, layout: Layout) -> None:
        from ckptverify.checks.sidefiles import check_side_files, side_files

        # A part of the files (``only``, ``skip``) looks at (stat), opens and reports only its own.
        stats = stat_files(self.root, [n for n in layout.files if self._mine(n)])
        others = [n for n in layout.files if not self._mine(n)]
        found = check_files(self.root, layout, stats, others=others, unreferenced=self._whole)
        if self._whole:
            # Side files are checked by content and opened like shards (a manifest digests them), not unreferenced.
            known = [n for n in side_files(self.root) if n not in stats and n not in others]
            found = [f for f in found if not (f.check == "file-unreferenced" and f.location.file in known)]
            self._findings.extend(found)
            found, cov, self._side_files = check_side_files(self.root, known)
            self._findings.extend(found)
            self._coverage.extend(cov)
            for name in self._side_files:
                self._opened[name] = self._open(name)
            self._findings.extend(check_coverage(layout))
            tiling, cov = check_tiling(layout)
            self._findings.extend(tiling)
            self._coverage.append(cov)
        else:
            self._findings.extend(found)
        for name, st in stats.items():
            self._opened[name] = self._open(name) if st is not None else None
        self._safetensors = safetensors_files(self._opened, layout.items)
        blobs = self._blobs(layout)
        usable = {n: (s if self._opened.get(n) else None) for n, s in stats.items()}
        self._findings.extend(check_items(layout, usable, blobs))
        # A part counts its own files' items; a whole run, every item without a look at each.
        bounded = len(layout.items) if self._only is None and not self._skip else \
            sum(1 for i in layout.items if self._mine(i.file))
        self._coverage.append(CheckCoverage(check="item-bounds", count=bounded, unit="items"))

    def _blobs(self, layout: Layout) -> dict[str, tuple[int, int]]:
        """Parse each safetensors blob; check it against the metadata's tensor items."""
        blobs: dict[str, tuple[int, int]] = {}
        if not self._safetensors:
            return blobs
        from ckptverify.dcp import safetensors

        resolved: dict[Item, tuple[int, int]] = {}
        for name in sorted(self._safetensors):
            f = self._opened[name]
            tensor_items = [i for i in layout.items if i.file == name and i.kind == "tensor"]
            start = min(i.offset for i in tensor_items)
            try:
                blob = safetensors.read_blob(f, start)  # type: ignore[arg-type]
            except ArchiveError as exc:
                self._findings.append(error("blob-structure", f"{name}: the safetensors blob is malformed: {exc}",
                                           location=Location(file=name, byte_range=(exc.start, exc.end))))
                blobs[name] = (start, f.size)  # type: ignore[union-attr]
                continue
            blobs[name] = (blob.start, blob.end)
            for item in tensor_items:
                entry = blob.tensors.get(item.fqn)
                want = item.chunk.sizes if item.chunk else ()
                if entry is None or entry.shape != want or (entry.dtype is not None and entry.dtype != item.dtype):
                    got = "nothing" if entry is None else f"{entry.dtype}{list(entry.shape)}"
                    self._findings.append(error(
                        "tensor-record",
                        f"{item_label(item)}: the safetensors blob holds {got} under this name, the metadata "
                        f"says {item.dtype}{list(want)}",
                        location=item_location(item),
                    ))
                    continue
                resolved[item] = safetensors.data_range(blob, item.fqn)  # type: ignore[assignment]
        # From here each item addresses its own bytes in the blob, so digests and findings use real ranges.
        for n, item in enumerate(layout.items):
            if item not in resolved:
                continue
            offset, length = resolved[item]
            item = layout.items[n] = dataclasses.replace(item, offset=offset, length=length)
            if item.chunk is not None and item.dtype is not None:
                archive, header = safetensors.raw_payload(item.dtype, item.chunk.sizes, length)
                self._extra_plans.append(ItemPlan(dataclasses.replace(item, offset=0), archive, header,
                                                 reader=_Window(self._opened[item.file], offset)))  # type: ignore[arg-type]
        return blobs

    def _open(self, name: str) -> ReadOnlyFile | None:
        try:
            if self._real_root is None:
                self._real_root = os.path.realpath(self.root)
            keep = KEEP_FILE_BYTES if self._kept_bytes < KEEP_TOTAL_BYTES else 0
            f = ReadOnlyFile(os.path.join(self.root, name), root=self.root, real_root=self._real_root,
                             keep_bytes=keep)
            self._kept_bytes += f.kept
            return f
        except FileChangedError as exc:
            self._findings.append(changed_finding(name, str(exc)))
        except UnsafeFileError as exc:
            self._findings.append(error("file-unsafe", f"{name} is not opened: {exc}", location=Location(file=name)))
        except StorageError:
            raise
        except OSError as exc:
            self._findings.append(unopened(name, exc))
        return None

    def _archives(self, layout: Layout) -> None:
        by_file: dict[str, list[Item]] = defaultdict(list)
        for item in layout.items:
            if self._opened.get(item.file) is not None:
                by_file[item.file].append(item)
        names = sorted(by_file)
        templates = TemplateCache()  # shared: a checkpoint saved one file per item has one item per file
        planned = self.map(lambda n: plan_file(self._opened[n], n, [i for i in by_file[n] if not i.transforms],  # type: ignore[arg-type]
                                               safetensors=n in self._safetensors, templates=templates), names)
        for name, (file_plans, result) in zip(names, planned, strict=True):
            self._results[name] = result
            self._plans.extend(file_plans)
        if not self._hold_kept:
            self._release_kept()
        # Stream-transformed items are decoded and judged now; their plans join after the hashing pass.
        transformed = [i for n in names for i in by_file[n] if i.transforms]
        decoded = self.map(self._transformed, transformed)
        self._extra_plans.extend(p for p in decoded if p is not None)

    def _transformed(self, item: Item) -> ItemPlan | None:
        from ckptverify.checks.transformed import plan_transformed

        result = FileResult()
        plan = plan_transformed(self._opened[item.file], item, result,  # type: ignore[arg-type]
                                registry=self._extension_registry)
        with self._lock:
            into = self._results[item.file]
            into.findings.extend(result.findings)
            for count in ("items", "records", "bytes_hashed"):  # what the stages read of a file's result
                setattr(into, count, getattr(into, count) + getattr(result, count))
        return plan

    def _hash(self, layout: Layout) -> None:
        """One pass over the bytes on all cores: CRC-32 of every record and, with a manifest, every block digest (items
        it covers as block-aligned tasks computing both; the rest as CRC-only segments)."""
        manifest = self._manifest
        matched: dict[int, Item] = {}
        tasks: list[manifest_check.BlockTask] = []
        crc_ranges: list[list[tuple[int, int]]] = []
        crc_keys: list[list[tuple[int, int]]] = []
        task_plans: list[ItemPlan | None] = []  # each task's item's plan, if its archive parsed
        covered: set[int] = set()
        by_manifest: set[tuple[int, int]] = set()  # (plan, record) whose bytes only the manifest checks
        if manifest is not None:
            found, matched = manifest_check.compare_layout(manifest, layout)
            self._findings.extend(found)
            self._findings.extend(f for f in manifest_check.check_files(manifest, self._opened, self.root)
                                 if self._mine(f.location.file or "")
                                 or (self._whole and f.location.file not in manifest.files))
            tasks = manifest_check.block_tasks(manifest, matched, self._opened, SEGMENT_BYTES)
            plan_index = {(p.item.file, p.item.offset, p.item.length): n for n, p in enumerate(self._plans)}
            for task in tasks:
                item = matched[task.entry]
                n = plan_index.get((item.file, item.offset, item.length))
                ranges, keys = [], []
                task_plans.append(None if n is None else self._plans[n])
                if n is not None:
                    covered.add(n)
                if n is not None and self._plans[n].crcs is None:
                    base = item.offset
                    for r, rec in enumerate(self._plans[n].archive.records):
                        if rec.size > SMALL_RECORD_BYTES:
                            # The block digests cover these bytes: a CRC on top would only halve the speed.
                            by_manifest.add((n, r))
                            self._manifest_records.add((item.file, item.offset, rec.name))
                            continue
                        lo, hi = max(task.start, base + rec.data_offset), min(task.end, base + rec.data_end)
                        if lo < hi or (rec.size == 0 and task.start <= base + rec.data_offset < task.end):
                            ranges.append((lo, max(lo, hi)))
                            keys.append((n, r))
                crc_ranges.append(ranges)
                crc_keys.append(keys)
        segs = segments(((n, p) for n, p in enumerate(self._plans) if n not in covered and p.crcs is None),
                        SEGMENT_BYTES)

        def piece(w: Any) -> Any:  # the byte range a work item reads: a block task or a CRC segment
            return tasks[w[1]] if w[0] == "blocks" else w[1]

        work: list[Any] = [("blocks", k) for k in range(len(tasks))] + [("crc", s) for s in segs]
        work.sort(key=lambda w: piece(w).start - piece(w).end)  # largest first
        if self._progress is not None:
            self._progress.start(sum(piece(w).end - piece(w).start for w in work))

        def run(w: Any) -> Any:
            p = piece(w)
            f: Any = self._opened[p.file]
            value = f.crc32(p.start, p.end) if w[0] == "crc" else \
                manifest_check.hash_task(f, p, manifest, crc_ranges[w[1]])
            self.advance(p.end - p.start)
            return value

        def unit(w: Any) -> list[Any]:  # a work item as a plain unit another rank can read (cluster.units)
            p = piece(w)
            if w[0] == "crc":
                return ["crc", p.file, p.start, p.end]
            assert manifest is not None
            return ["blocks", p.file, p.start, p.end, p.first, p.last, manifest.digest_algorithm, manifest.block_bytes,
                    [list(r) for r in crc_ranges[w[1]]]]

        if self._executor is not None:
            got = self._executor.map_units(self, [unit(w) for w in work])
        else:
            got = self.map(run, work)
        results = dict(zip(work, got, strict=True))
        # CRC partials per record, combined in file order.
        partials: dict[tuple[int, int], list[tuple[int, int, int]]] = defaultdict(list)
        for seg in segs:
            partials[(seg.plan, seg.record)].append((seg.start, seg.end - seg.start, results[("crc", seg)]))
        for k in range(len(tasks)):
            _, crcs = results[("blocks", k)]
            for (lo, hi), key, value in zip(crc_ranges[k], crc_keys[k], crcs, strict=True):
                partials[key].append((lo, hi - lo, value))
        for n, plan in enumerate(self._plans):
            crcs = plan.crcs  # small items: computed while planning
            if crcs is None:  # a record only the block digests below judge keeps its own CRC here
                crcs = [rec.crc if (n, r) in by_manifest else functools.reduce(
                    lambda value, part: crc32_combine(value, part[2], part[1]), sorted(partials[(n, r)]), 0)
                    for r, rec in enumerate(plan.archive.records)]
            judge_item(self._opened[plan.item.file], plan, crcs, self._results[plan.item.file])  # type: ignore[arg-type]
        for name in sorted(self._results):
            res = self._results[name]
            self._findings.extend(res.findings)
            self._coverage.append(CheckCoverage(check="zip-structure", count=res.items, unit="items"))
            self._coverage.append(CheckCoverage(check="zip-crc", count=res.records, unit="records"))
            self._bytes_hashed += res.bytes_hashed
        if manifest is None:
            return
        blocks = 0
        for k, task in enumerate(tasks):
            digests, _ = results[("blocks", k)]
            item = matched[task.entry]
            self._manifest_items.add((item.file, item.offset, item.length))
            self._findings.extend(manifest_check.judge_blocks(manifest, task, item, digests, task_plans[k]))
            blocks += len(digests)
        self._coverage.append(CheckCoverage(check="manifest-digest", count=blocks, unit="blocks"))
        self._untiled_files(manifest, matched)
        # Content the CRCs could not cover is now covered by the manifest's digests.
        verified = {matched[t.entry].file for t in tasks}
        covered_items = {(i.fqn, i.file) for i in matched.values()}
        self._findings = [
            f for f in self._findings
            if not (f.check == UNCHECKABLE
                    and ((f.location.fqn is None and f.location.file in verified)
                         or (f.location.fqn, f.location.file) in covered_items))
        ]

    def _untiled_files(self, manifest: Manifest, matched: dict[int, Item]) -> None:
        """Whole-file digests for files whose items do not cover every byte. A file its matched items tile exactly,
        every block matching, needs no second pass."""
        from ckptverify.fingerprint import digest_reader

        ranges: dict[str, list[tuple[int, int]]] = defaultdict(list)
        for item in matched.values():
            ranges[item.file].append((item.offset, item.end))
        todo = []
        for name, entry in manifest.files.items():
            f = self._opened.get(name)
            if f is None or f.size != entry.size:
                continue  # missing or resized: already reported
            cursor = 0
            for start, end in sorted(ranges.get(name, [])):
                if start != cursor:
                    break
                cursor = end
            if cursor != f.size:
                todo.append(name)
        if self._executor is not None:
            got = self._executor.map_units(self, [["digest", n, manifest.digest_algorithm] for n in todo])
        else:
            got = self.map(lambda n: digest_reader(self._opened[n], manifest.digest_algorithm), todo)  # type: ignore[arg-type]
        for name, digest in zip(todo, got, strict=True):
            if digest != manifest.files[name].digest:
                self._findings.append(error(
                    "manifest-digest", f"{name} differs from the file written at save time",
                    location=Location(file=name), expected=manifest.files[name].digest, actual=digest))
        self._coverage.append(CheckCoverage(check="manifest-digest", count=len(todo), unit="whole files"))

    def _deep_scan(self) -> None:
        from ckptverify.checks import deep as deep_check

        desc = self.description()
        if self._progress is not None:
            self._progress.start(deep_check.scan_bytes(desc))
        run_map = self.map if self._executor is None else self._executor.tensor_map(self)
        scans, found = deep_check.scan_description(desc, run_map, self.advance)
        # Never pass a deep check that rebuilt nothing; say how many were left out when some were.
        judged, rebuilt = deep_check.judge_scans(desc, self._manifest, scans, found)
        self._findings.extend(judged)
        self._coverage.append(CheckCoverage(check="fingerprint", count=rebuilt, unit="tensors"))

    def scan(self, desc: Description, only: set[str]) -> dict[str, Any]:
        """The scans (:class:`~ckptverify.checks.deep.TensorScan`) by name of ``desc``'s tensors in ``only``, rebuilt on
        the run's workers."""
        from ckptverify.checks import deep as deep_check

        return deep_check.scan_description(desc, self.map, only=only)[0]

    def digests(self, desc: Description, *, digest: str, block_bytes: int, executor: Executor | None = None
                ) -> tuple[list[Any], dict[str, Any], dict[str, Any], list[Finding]]:
        """The adoption's pass over ``desc`` (:func:`~ckptverify.checks.adoption.digests_and_scans`): manifest item and
        file entries, tensor scans, ``replica-mismatch`` findings; ``executor`` reads its share elsewhere."""
        from ckptverify.checks.adoption import digests_and_scans

        return digests_and_scans(self, desc, digest=digest, block_bytes=block_bytes, executor=executor,
                                 release_kept=self._release_kept)

    def description(self, *, values: bool = False, values_skip: frozenset[str] | set[str] = frozenset(),
                    side_files: bool = False) -> Description:
        """What the run read as a format description (:mod:`ckptverify.formats.dcp`), through its opened files, and the
        ``skip`` files as the executor brings them; empty if the metadata could not be read. Call after
        :meth:`execute`. ``values``: also plain values of non-tensor items (not those in ``values_skip``);
        ``side_files``: side files merged in (``meta.pt:...``)."""

        from ckptverify.formats.describe import Description, add_side_files

        if self._layout is None:
            return Description(root=self.root, format="dcp")
        from ckptverify.formats.dcp import ReadItem, describe_dcp

        read = []
        by_manifest, digested, opened = self._manifest_records, self._manifest_items, self._opened.get
        with paused_gc():  # one object per item and payload, no reference cycles (see gcpause)
            for plan in self._plans:
                item, base, reader, header = plan.item, plan.item.offset, plan.reader, plan.header
                # A subclass's first storage record stands for all (one archive, checked alike).
                key = header.parts[0][1].storage_key if isinstance(header, SubclassHeader) else \
                    header.storage_key if header is not None else None
                rec = plan.archive.record(f"data/{key}") if key is not None else None
                if reader is None:
                    reader = opened(item.file)
                    # A record whose CRC-32 field is 0 over nonzero bytes: saved with CRC-32 disabled.
                    checksum = "none" if rec is not None and rec.crc == 0 and rec.size else "crc32"
                    if by_manifest and rec is not None and (item.file, item.offset, rec.name) in by_manifest:
                        checksum = "manifest"
                elif isinstance(reader, _Window):  # a tensor of DCP's safetensors blob: its own bytes of the file
                    item = dataclasses.replace(item, offset=reader.offset)
                    base, reader = item.offset, reader.file
                    checksum = "none"
                else:  # decoded stream transforms: the archive is the decoded bytes'
                    item = reader.stored
                    checksum = "crc32"
                if digested and checksum != "manifest" and (item.file, item.offset, item.length) in digested:
                    checksum = "manifest" if checksum == "none" else f"{checksum}+manifest"
                read.append(ReadItem(item, plan.archive, header, base, reader, rec, checksum))
            desc = describe_dcp(self.root, self._layout, read, files=self._opened, values=values,
                                values_skip=values_skip)
            if side_files:
                add_side_files(desc, self._side_files)
        if self._skip and self._executor is not None:  # other nodes' files, items and pieces, as their parts recorded
            self._executor.describe(desc, self._skip)
        return desc


class _Window(NamedTuple):
    """Where a tensor of DCP's safetensors blob lies: from ``offset`` of the opened ``file`` (the item's archive is
    the raw payload there)."""

    file: ReadOnlyFile
    offset: int


#: At most this many findings of one check are reported in full; the rest are counted in one more finding.
MAX_FINDINGS_PER_CHECK = 100


def cap_findings(findings: Iterable[Finding], limit: int = MAX_FINDINGS_PER_CHECK) -> list[Finding]:
    """The first ``limit`` findings of each check in order, then per check one summary (worst severity left out)
    counting the rest."""
    kept: list[Finding] = []
    left: dict[str, list[Finding]] = defaultdict(list)
    seen: dict[str, int] = defaultdict(int)
    for f in findings:
        seen[f.check] += 1
        if seen[f.check] <= limit:
            kept.append(f)
        else:
            left[f.check].append(f)
    for check, rest in left.items():
        worst = max(rest, key=lambda f: f.severity.rank)
        by_severity = Counter(f.severity.value for f in rest)
        kept.append(Finding(
            check=check, severity=worst.severity,
            message=f"{len(rest)} more {check} finding(s) not listed (the first {limit} are); "
                    f"{seen[check]} in all",
            location=Location(),
            actual={"omitted": len(rest), "total": seen[check], "omitted_by_severity": dict(by_severity)},
        ))
    return kept


def pulled_map(pool: ThreadPoolExecutor, workers: int, fn: Callable[[T], R], items: list[T]) -> list[R]:
    """``[fn(x) for x in items]`` by ``workers`` loops on ``pool``, each taking the next index (one future per item
    costs too much). As ``pool.map``: results in order, and the lowest-indexed exception (items are taken in order
    and every taken one finishes)."""
    results: list[Any] = [None] * len(items)
    failed: dict[int, BaseException] = {}
    take = iter(range(len(items))).__next__  # a C iterator: one index per call, atomic under the GIL
    lock = threading.Lock()

    def loop() -> None:
        while not failed:
            try:
                n = take()
            except StopIteration:
                return
            try:
                results[n] = fn(items[n])
            except BaseException as exc:  # re-raised in the caller, as pool.map would
                with lock:
                    failed[n] = exc
                return

    for future in [pool.submit(loop) for _ in range(min(workers, len(items)))]:
        future.result()
    if failed:
        raise failed[min(failed)]
    return results


def changed_finding(name: str, how: str) -> Finding:
    """The ``file-changed`` error: ``name`` changed while it was being verified."""
    return error("file-changed", f"{name}: file changed during verification ({how}); what was read proves "
                 "nothing about what is on disk now: verify again once nothing writes to the checkpoint",
                 location=Location(file=name))


def changed_under(root: str, exc: FileChangedError) -> Finding:
    """:func:`changed_finding` for ``exc``, raised reading a file of the checkpoint at ``root``: the file named as the
    checkpoint names it (relative to ``root``, ``/``-separated; ``?`` if ``exc`` names no path)."""
    name = os.path.relpath(exc.path, root).replace(os.sep, "/") if isinstance(exc.path, str) else "?"
    return changed_finding(name, str(exc))


def _name_signatures(root: str) -> dict[str, tuple[int, int, int, int] | None]:
    """``stat`` (size, mtime, device, inode) of the metadata files and the manifest, by name; nothing opened."""
    out: dict[str, tuple[int, int, int, int] | None] = {}
    try:
        names = paths.listdir(root)
    except StorageError:
        raise
    except OSError:
        return out
    for name in names:
        if name in (METADATA_FILE, MANIFEST_FILE) or RANK_METADATA_RE.match(name):
            try:
                st = paths.stat(os.path.join(root, name))
                out[name] = (st.st_size, st.st_mtime_ns, st.st_dev, st.st_ino)
            except StorageError:
                raise
            except OSError:
                out[name] = None
    return out
