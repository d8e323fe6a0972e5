"""Structural checks: does the metadata describe a complete, consistent set of files?

Nothing here reads item contents; only directory listings, file sizes and the layout.
"""

from __future__ import annotations

import itertools
import math
import os
import stat
from collections import Counter, defaultdict
from collections.abc import Iterable

from ckptverify.checks import item_label, item_location
from ckptverify.dcp.layout import Chunk, Item, Layout, TensorInfo
from ckptverify.errors import StorageError
from ckptverify.findings import CheckCoverage, Finding, Location, error, info, warning
from ckptverify.ownfiles.names import OWN_FILES, PARTS_PREFIX, STAMP_TEMP_PREFIX
from ckptverify.safeparse import paths
from ckptverify.safeparse.readers import file_kind, is_inside


def stat_files(root: str, names: Iterable[str]) -> dict[str, os.stat_result | None]:
    """``os.stat`` of each referenced file; ``None`` where it must not be opened (missing, not regular, or outside the
    checkpoint). Opens nothing."""
    out: dict[str, os.stat_result | None] = {}
    real_root = os.path.realpath(root)
    for name in names:
        path = os.path.join(root, name)
        try:
            st = paths.stat(path)
        except StorageError:
            raise
        except OSError:
            out[name] = None
            continue
        out[name] = st if stat.S_ISREG(st.st_mode) and is_inside(root, path, real_root=real_root) else None
    return out


def check_files(root: str, layout: Layout, stats: dict[str, os.stat_result | None], *,
                others: Iterable[str] = (), unreferenced: bool = True) -> list[Finding]:
    """Referenced files that are missing or must not be opened, and (with ``unreferenced``) files nobody
    references. ``others``: referenced files another part of a shared verification checks (not looked at)."""
    findings: list[Finding] = []
    per_file = Counter(it.file for it in layout.items)
    for name, st in sorted(stats.items()):
        if st is not None:
            continue
        n = per_file[name]
        unsafe = _unsafe_reason(root, os.path.join(root, name))
        if unsafe is not None:
            findings.append(error(
                "file-unsafe",
                f"{name} {unsafe}; it is not opened, and the {n} item(s) the metadata places in it are unchecked",
                location=Location(file=name),
            ))
        else:
            findings.append(error(
                "file-missing",
                f"{name} is missing; the metadata places {n} item(s) in it",
                location=Location(file=name),
            ))
    if not unreferenced:
        return findings
    referenced = set(stats) | set(others) | set(layout.metadata_files) | OWN_FILES
    walk = paths.FolderWalk(root)
    for folder, _, entries in walk:
        for entry in entries:
            rel = f"{folder}/{entry.name}" if folder else entry.name
            if rel in referenced or (not folder and entry.name.startswith(PARTS_PREFIX)):
                continue  # a part verdict of a verification shared out among nodes: ckptverify's own
            if not folder and entry.name.startswith(STAMP_TEMP_PREFIX):
                findings.append(info(
                    "file-unreferenced",
                    f"{rel} is the temporary file of a verification stamp whose writing did not finish (the "
                    "process stopped); it is never read and can be deleted",
                    location=Location(file=rel),
                ))
            else:
                try:  # lstat: listed, never opened (it may be a FIFO or a link to a device)
                    st = entry.stat(follow_symlinks=False)
                except OSError:
                    continue  # gone since the listing
                what = f"{st.st_size} bytes" if stat.S_ISREG(st.st_mode) else file_kind(st.st_mode)
                findings.append(warning(
                    "file-unreferenced",
                    f"{rel} ({what}) is not referenced by the metadata: a leftover, a file from another "
                    "checkpoint, or something planted",
                    location=Location(file=rel),
                ))
    return findings + walk_findings(walk)


def walk_findings(walk: paths.FolderWalk) -> list[Finding]:
    """What ``walk`` did not see, as errors: ``key-unaddressable`` per key no path reaches, ``walk-incomplete`` if cut
    short (unchecked content: the checkpoint cannot pass)."""
    out: list[Finding] = []
    for p in walk.problems:
        if p.kind == "unaddressable":
            norm = os.path.normpath(p.path)
            where = ("outside the checkpoint" if norm == ".." or norm.startswith("../")
                     else f"{norm!r} in the checkpoint")
            out.append(error("key-unaddressable", f"object key {p.path!r} has a '.', '..' or empty segment: no "
                             f"path reaches it (normalised, its name is {where}); it is never opened",
                             location=Location(file=p.path)))
        elif p.kind == "unlisted":
            out.append(error("walk-incomplete", f"{p.path} could not be listed ({p.detail}): the files in it are "
                             "unchecked", location=Location(file=p.path)))
        else:
            out.append(error("walk-incomplete", f"the listing of the checkpoint was cut short at {p.path}: "
                             f"{p.detail}; the files beyond are unchecked", location=Location(file=p.path)))
    return out


def _unsafe_reason(root: str, path: str) -> str | None:
    """Why an existing ``path`` must not be opened as a checkpoint file; ``None`` if it is missing."""
    if not paths.lexists(path):
        return None
    if not is_inside(root, path):
        return f"resolves to {os.path.realpath(path)!r}, outside the checkpoint directory"
    try:
        mode = paths.stat(path).st_mode
    except OSError as exc:
        return f"cannot be examined ({exc.strerror})"
    return f"is a {file_kind(mode)}, not a regular file"


def check_items(layout: Layout, stats: dict[str, os.stat_result | None],
                blobs: dict[str, tuple[int, int]] | None = None) -> list[Finding]:
    """Every item inside its file, none overlapping, no bytes outside all items. ``blobs``: safetensors files' blob
    range, standing in for their tensor items (which do not address their own bytes)."""
    findings: list[Finding] = []
    blobs = blobs or {}
    by_file: dict[str, list[Item]] = defaultdict(list)
    for item in layout.items:
        if item.file in blobs and item.kind == "tensor":
            continue
        by_file[item.file].append(item)
    for name, (start, end) in blobs.items():
        by_file[name].append(Item(fqn="<safetensors blob>", kind="bytes", file=name, offset=start,
                                  length=end - start))
    for name, items in sorted(by_file.items()):
        st = stats.get(name)
        if st is None:
            continue
        size = st.st_size
        for item in items:
            if item.end > size:
                findings.append(error(
                    "item-bounds",
                    f"{item_label(item)} ends at byte {item.end} but {name} has only {size} bytes "
                    f"(truncated by {item.end - size} or more)",
                    location=item_location(item, byte_range=(item.offset, item.end)),
                    expected=item.end, actual=size,
                ))
        items = sorted(items, key=lambda it: (it.offset, it.end))
        cursor = 0
        prev: Item | None = None
        for item in items:
            if prev is not None and item.offset < prev.end:
                findings.append(error(
                    "item-overlap",
                    f"{item_label(item)} overlaps {item_label(prev)} in {name} "
                    f"(bytes [{item.offset}, {min(prev.end, item.end)}))",
                    location=item_location(item, byte_range=(item.offset, min(prev.end, item.end))),
                ))
            elif item.offset > cursor:
                findings.append(_gap(name, cursor, item.offset))
            cursor = max(cursor, item.end)
            prev = item if prev is None or item.end > prev.end else prev
        if cursor < size:
            findings.append(_gap(name, cursor, size))
    return findings


def _gap(name: str, start: int, end: int) -> Finding:
    return warning(
        "bytes-unreferenced",
        f"{name} holds {end - start} bytes at [{start}, {end}) that no item covers",
        location=Location(file=name, byte_range=(start, end)),
    )


def check_coverage(layout: Layout) -> list[Finding]:
    """Every chunk and byte value of the state dict has a storage entry."""
    findings: list[Finding] = []
    stored_chunks = {(it.fqn, it.chunk.offsets) for it in layout.items if it.chunk is not None}
    stored_bytes = {it.fqn for it in layout.items if it.kind == "bytes"}
    for fqn, tinfo in sorted(layout.tensors.items()):
        for chunk in tinfo.chunks:
            if (fqn, chunk.offsets) not in stored_chunks and chunk.numel > 0:
                findings.append(error(
                    "item-missing",
                    f"chunk {list(chunk.offsets)} of {fqn!r} has no storage entry: its values are nowhere",
                    location=Location(fqn=fqn, chunk_offsets=chunk.offsets, chunk_sizes=chunk.sizes),
                ))
    for fqn in sorted(layout.byte_values - stored_bytes):
        findings.append(error(
            "item-missing",
            f"value {fqn!r} has no storage entry",
            location=Location(fqn=fqn),
        ))
    return findings


def check_tiling(layout: Layout) -> tuple[list[Finding], CheckCoverage]:
    """The chunks of each tensor tile its global shape exactly: inside bounds, no overlap, no gap."""
    findings = [f for tinfo in layout.tensors.values() for f in _tiling(tinfo, dedupe=layout.per_rank)]
    return findings, CheckCoverage(check="chunk-tiling", count=len(layout.tensors), unit="tensors")


def _tiling(tinfo: TensorInfo, *, dedupe: bool) -> list[Finding]:
    fqn, shape = tinfo.fqn, tinfo.shape
    if len(tinfo.chunks) == 1:
        only = tinfo.chunks[0]
        if only.sizes == shape and not any(only.offsets) and len(only.offsets) == len(shape):
            return []  # one chunk that is the whole tensor (most tensors of an unsharded save)
    # Per-rank metadata lists a replicated tensor once per rank: identical boxes are replicas.
    chunks = list(dict.fromkeys(tinfo.chunks)) if dedupe else list(tinfo.chunks)
    out: list[Finding] = []
    boxes: list[Chunk] = []
    for c in chunks:
        if len(c.offsets) != len(shape) or len(c.sizes) != len(shape):
            out.append(error("chunk-tiling", f"chunk {list(c.offsets)} of {fqn!r} has {len(c.offsets)} dims, "
                             f"the tensor has {len(shape)}",
                             location=Location(fqn=fqn, chunk_offsets=c.offsets, chunk_sizes=c.sizes)))
            continue
        if any(o + s > n for o, s, n in zip(c.offsets, c.sizes, shape, strict=True)):
            out.append(error("chunk-tiling", f"chunk {list(c.offsets)}+{list(c.sizes)} of {fqn!r} reaches past "
                             f"its global shape {list(shape)}",
                             location=Location(fqn=fqn, chunk_offsets=c.offsets, chunk_sizes=c.sizes)))
            continue
        if c.numel:
            boxes.append(c)
    if shape:
        pairs, complete = _overlaps(boxes)
        for a, c in pairs:
            out.append(error(
                "chunk-tiling",
                f"chunks {list(a.offsets)} and {list(c.offsets)} of {fqn!r} overlap",
                location=Location(fqn=fqn, chunk_offsets=c.offsets, chunk_sizes=c.sizes),
            ))
        if not complete:
            out.append(error(
                "chunk-tiling",
                f"the {len(boxes)} chunks of {fqn!r} form no grid and are too irregular to compare within "
                f"{MAX_TILING_COMPARISONS} box comparisons; their tiling is not proven",
                location=Location(fqn=fqn),
            ))
            return out
    elif len(boxes) > 1:
        out.append(error("chunk-tiling", f"scalar {fqn!r} is stored more than once", location=Location(fqn=fqn)))
    covered = sum(c.numel for c in boxes)
    total = math.prod(shape)
    if covered != total and not out:  # an overlap is said above; a gap only when nothing else is
        out.append(error(
            "chunk-tiling",
            f"chunks of {fqn!r} cover {covered} of its {total} elements: {total - covered} are in no chunk",
            location=Location(fqn=fqn),
            expected=total, actual=covered,
        ))
    return out


#: Most pairwise box comparisons spent on one tensor whose chunks do not form a grid.
MAX_TILING_COMPARISONS = 2_000_000


def _overlaps(boxes: list[Chunk]) -> tuple[list[tuple[Chunk, Chunk]], bool]:
    """Overlapping pairs among ``boxes`` and whether the search was complete. Linear when chunks form a grid (DCP's
    sharding: boxes overlap iff they start alike); else a sweep capped at :data:`MAX_TILING_COMPARISONS`."""
    pairs: list[tuple[Chunk, Chunk]] = []
    first: dict[tuple[int, ...], Chunk] = {}
    for c in boxes:
        prev = first.setdefault(c.offsets, c)
        if prev is not c:
            pairs.append((prev, c))
    ndim = len(boxes[0].offsets) if boxes else 0
    grid = True
    best_dim, best_starts = 0, -1
    for d in range(ndim):
        intervals: dict[int, int] = {}
        for c in boxes:
            if intervals.setdefault(c.offsets[d], c.sizes[d]) != c.sizes[d]:
                grid = False
        starts = sorted(intervals)
        if any(a + intervals[a] > b for a, b in itertools.pairwise(starts)):
            grid = False
        if len(starts) > best_starts:
            best_dim, best_starts = d, len(starts)
    if grid:
        return pairs, True
    pairs = []
    d = best_dim
    order = sorted(boxes, key=lambda c: c.offsets[d])
    active: list[Chunk] = []
    budget = MAX_TILING_COMPARISONS
    for c in order:
        active = [a for a in active if a.offsets[d] + a.sizes[d] > c.offsets[d]]
        budget -= len(active) + 1
        if budget < 0:
            return pairs, False
        for a in active:
            if all(ao < co + cs and co < ao + asz for ao, asz, co, cs
                   in zip(a.offsets, a.sizes, c.offsets, c.sizes, strict=True)):
                pairs.append((a, c))
                break
        active.append(c)
    return pairs, True
