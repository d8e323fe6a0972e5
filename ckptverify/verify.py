"""``verify``: prove a DCP checkpoint intact, or say exactly where it is not.

Order of work: read the metadata safely, check the structure (files, bounds, overlaps, chunk tiling),
then read every item once, files in parallel, checking each item's zip structure and record CRCs.
Nothing is ever written into the checkpoint: files are opened ``O_RDONLY`` and mapped ``PROT_READ``.
"""

from __future__ import annotations

import os
import threading
import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from typing import Protocol

from ckptverify.checks.content import (
    FileResult,
    ItemPlan,
    Segment,
    judge_item,
    plan_file,
    safetensors_files,
    segments,
)
from ckptverify.checks.structure import check_coverage, check_files, check_items, check_tiling, stat_files
from ckptverify.dcp.layout import Item
from ckptverify.dcp.metadata import read_layout
from ckptverify.errors import CheckpointNotFoundError, UsageError
from ckptverify.findings import CheckCoverage, Finding, Location, Report, error, merge_coverage
from ckptverify.readers import ReadOnlyFile, crc32_combine

#: Largest byte range hashed as one task; larger records are split and their CRCs combined.
SEGMENT_BYTES = 64 << 20


class ProgressSink(Protocol):
    """Receives progress of long work. ``start`` once with the total bytes, then ``advance`` calls."""

    def start(self, total_bytes: int) -> None: ...

    def advance(self, n: int) -> None: ...


def default_jobs() -> int:
    """One worker per usable core."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover - non-Linux
        return max(1, os.cpu_count() or 1)


def verify_checkpoint(path: str | os.PathLike[str], *, jobs: int | None = None,
                      progress: ProgressSink | None = None) -> Report:
    """Verify the DCP checkpoint directory at ``path`` and return a report of findings.

    ``jobs`` is the number of files read in parallel (default: one per core). Raises
    :class:`~ckptverify.errors.CheckpointNotFoundError` when ``path`` is not a directory and
    :class:`~ckptverify.errors.UsageError` for bad arguments; every problem *with* the checkpoint is a
    finding in the report, never an exception.
    """
    root = os.fspath(path)
    if jobs is not None and jobs < 1:
        raise UsageError(f"--jobs must be at least 1, got {jobs}")
    if not os.path.exists(root):
        raise CheckpointNotFoundError(f"checkpoint path does not exist: {root}")
    if not os.path.isdir(root):
        raise CheckpointNotFoundError(f"a DCP checkpoint is a directory; {root} is not one")
    started = time.perf_counter()
    findings: list[Finding] = []
    coverage: list[CheckCoverage] = []

    layout, md_findings = read_layout(root)
    findings.extend(md_findings)
    if layout is None:
        return Report(command="verify", target=root, findings=tuple(findings),
                      stats={"seconds": round(time.perf_counter() - started, 6)})
    coverage.append(CheckCoverage(check="metadata", count=len(layout.metadata_files), unit="metadata files"))

    stats = stat_files(root, layout.files)
    findings.extend(check_files(root, layout, stats))
    findings.extend(check_coverage(layout))
    tiling_findings, tiling_cov = check_tiling(layout)
    findings.extend(tiling_findings)
    coverage.append(tiling_cov)

    opened: dict[str, ReadOnlyFile | None] = {}
    try:
        for name, st in stats.items():
            opened[name] = _open(root, name, findings) if st is not None else None
        st_files = safetensors_files(opened, layout.items)
        findings.extend(check_items(layout, {n: (s if opened.get(n) else None) for n, s in stats.items()},
                                    skip=st_files))
        coverage.append(CheckCoverage(check="item-bounds", count=len(layout.items), unit="items"))
        results = _check_contents(opened, layout.items, st_files, jobs or default_jobs(), progress)
    finally:
        for f in opened.values():
            if f is not None:
                f.close()

    total_bytes = 0
    for res in results:
        findings.extend(res.findings)
        coverage.append(CheckCoverage(check="zip-structure", count=res.items, unit="items"))
        coverage.append(CheckCoverage(check="zip-crc", count=res.records, unit="records"))
        total_bytes += res.bytes_hashed
    seconds = time.perf_counter() - started
    file_bytes = sum(f.size for f in opened.values() if f is not None)
    return Report(
        command="verify",
        target=root,
        findings=tuple(findings),
        coverage=merge_coverage(coverage),
        stats={
            "files": len([f for f in opened.values() if f is not None]),
            "items": len(layout.items),
            "tensors": len(layout.tensors),
            "bytes": file_bytes,
            "bytes_hashed": total_bytes,
            "seconds": round(seconds, 6),
            "throughput_bytes_per_s": round(file_bytes / seconds) if seconds > 0 else None,
            "jobs": jobs or default_jobs(),
            "dcp_version": layout.dcp_version,
            "per_rank_metadata": layout.per_rank,
        },
    )


def _open(root: str, name: str, findings: list[Finding]) -> ReadOnlyFile | None:
    try:
        return ReadOnlyFile(os.path.join(root, name))
    except OSError as exc:
        findings.append(error("file-missing", f"{name} cannot be opened for reading: {exc}",
                              location=Location(file=name)))
        return None


def _check_contents(opened: dict[str, ReadOnlyFile | None], items: list[Item], st_files: set[str], jobs: int,
                    progress: ProgressSink | None) -> list[FileResult]:
    by_file: dict[str, list[Item]] = defaultdict(list)
    for item in items:
        if opened.get(item.file) is not None:
            by_file[item.file].append(item)
    names = sorted(by_file)
    pool = ThreadPoolExecutor(max_workers=jobs, thread_name_prefix="ckptverify") if jobs > 1 else None
    run = pool.map if pool is not None else map
    try:
        # 1. Structure of every item (headers and directories only), files in parallel.
        planned = list(run(lambda n: plan_file(opened[n], n, by_file[n], safetensors=n in st_files), names))
        plans: list[ItemPlan] = []
        results: dict[str, FileResult] = {}
        segs = []
        for name, (file_plans, result) in zip(names, planned, strict=True):
            results[name] = result
            segs.extend(segments(file_plans, len(plans), SEGMENT_BYTES))
            plans.extend(file_plans)
        # 2. Every record payload, split into segments hashed in parallel, largest first.
        segs.sort(key=lambda s: s.start - s.end)
        if progress is not None:
            progress.start(sum(s.end - s.start for s in segs))
        lock = threading.Lock()

        def hash_segment(seg: Segment) -> int:
            value = opened[seg.file].crc32(seg.start, seg.end)  # type: ignore[union-attr]
            if progress is not None:
                with lock:
                    progress.advance(seg.end - seg.start)
            return value

        crc_of = dict(zip(segs, run(hash_segment, segs), strict=True))
    finally:
        if pool is not None:
            pool.shutdown()
    # 3. Combine segment CRCs per record and judge each item.
    parts: dict[tuple[int, int], list[Segment]] = defaultdict(list)
    for seg in segs:
        parts[(seg.plan, seg.record)].append(seg)
    for p, plan in enumerate(plans):
        crcs = []
        for r in range(len(plan.archive.records)):
            value = 0
            for seg in sorted(parts[(p, r)], key=lambda s: s.index):
                value = crc32_combine(value, crc_of[seg], seg.end - seg.start)
            crcs.append(value)
        judge_item(opened[plan.item.file], plan, crcs, results[plan.item.file])  # type: ignore[arg-type]
    return [results[n] for n in names]
