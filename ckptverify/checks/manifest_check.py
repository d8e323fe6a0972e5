"""Checks against the save-time manifest (per-block item digests, file sizes, ``.metadata`` files, logical
fingerprints). These compare; :mod:`ckptverify.audit.verify` schedules the hashing."""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass

from ckptverify.checks import item_label, item_location
from ckptverify.checks.content import ItemPlan, global_index, touched_elements
from ckptverify.dcp.layout import DTYPE_ITEMSIZE, Item, Layout
from ckptverify.errors import FileChangedError
from ckptverify.findings import Finding, Location, error
from ckptverify.ownfiles.manifest import FileEntry, ItemEntry, Manifest
from ckptverify.safeparse.readers import ReadOnlyFile, crc32
from ckptverify.safeparse.torchsave import SubclassHeader, TensorHeader


@dataclass(frozen=True, slots=True)
class BlockTask:
    """Hash blocks ``[first, last)`` of a manifest item (block ``i`` covers ``block_bytes`` from its start)."""

    file: str
    entry: int
    first: int
    last: int
    start: int
    end: int


def compare_layout(manifest: Manifest, layout: Layout) -> tuple[list[Finding], dict[int, Item]]:
    """Manifest items vs metadata items (same set, places, dtypes, shapes). Returns findings and, per matching entry,
    its item."""
    findings: list[Finding] = []
    by_key = {(item.fqn, item.chunk.offsets if item.chunk else None, item.file): item for item in layout.items}
    matched: dict[int, Item] = {}
    for n, entry in enumerate(manifest.items):
        item = by_key.get(entry.key)
        if item is None:
            findings.append(error(
                "manifest-mismatch",
                f"the manifest lists {entry.fqn!r}" + (f" chunk {list(entry.chunk_offsets)}" if entry.chunk_offsets
                                                       is not None else "")
                + f" in {entry.file}, but the metadata has no such item (metadata replaced or edited?)",
                location=Location(file=entry.file, fqn=entry.fqn, chunk_offsets=entry.chunk_offsets),
            ))
            continue
        if (item.offset, item.length) != (entry.offset, entry.length):
            findings.append(error(
                "manifest-mismatch",
                f"{item_label(item)}: the metadata places it at bytes [{item.offset}, {item.end}) of {item.file}, "
                f"the manifest at [{entry.offset}, {entry.offset + entry.length})",
                location=item_location(item), expected=[entry.offset, entry.length],
                actual=[item.offset, item.length],
            ))
            continue
        matched[n] = item
    seen = {entry.key for entry in manifest.items}
    for key, item in by_key.items():
        if key not in seen:
            findings.append(error(
                "manifest-mismatch",
                f"{item_label(item)} in {item.file} is in the metadata but not in the manifest "
                "(metadata replaced or edited?)",
                location=item_location(item),
            ))
    findings.extend(compare_tensors(manifest, {fqn: (t.dtype, t.shape) for fqn, t in layout.tensors.items()},
                                    when="saved"))
    return findings, matched


def compare_tensors(manifest: Manifest, tensors: dict[str, tuple[str, tuple[int, ...]]], *,
                    when: str) -> list[Finding]:
    """``manifest-mismatch`` per tensor (name -> dtype, shape) the manifest lacks or has with another dtype or shape,
    and per tensor it has that ``tensors`` lacks. ``when``: how the manifest was made (``saved``, ``fingerprinted``)."""
    findings: list[Finding] = []
    for name, (dtype, shape) in sorted(tensors.items()):
        saved = manifest.tensors.get(name)
        if saved is None:
            findings.append(error("manifest-mismatch", f"tensor {name!r} is not in the manifest",
                                  location=Location(fqn=name)))
        elif (saved.dtype, saved.shape) != (dtype, shape):
            findings.append(error(
                "manifest-mismatch", f"tensor {name!r} is {dtype}{list(shape)}; it was "
                f"{saved.dtype}{list(saved.shape)} when {when}", location=Location(fqn=name),
                expected=f"{saved.dtype}{list(saved.shape)}", actual=f"{dtype}{list(shape)}"))
    for name in sorted(set(manifest.tensors) - set(tensors)):
        findings.append(error("manifest-mismatch", f"tensor {name!r} was {when} but is no longer there",
                              location=Location(fqn=name)))
    return findings


def check_files(manifest: Manifest, opened: dict[str, ReadOnlyFile | None], root: str) -> list[Finding]:
    """File sizes, files the manifest knows that are gone, and the ``.metadata`` digests."""
    from ckptverify.fingerprint import digest_reader

    findings: list[Finding] = []
    for name, entry in sorted(manifest.files.items()):
        f = opened.get(name)
        # A file there but not opened is reported by the structural checks.
        if f is not None or not os.path.lexists(os.path.join(root, name)):
            findings.extend(size_changed(name, None if f is None else f.size, entry, when="saved"))
    for name, entry in sorted(manifest.metadata_files.items()):
        try:  # only a regular file inside the checkpoint (names are checked when the manifest is read)
            with ReadOnlyFile(os.path.join(root, name), root=root) as f:
                size = f.size
                digest = digest_reader(f, manifest.digest_algorithm)
        except FileChangedError:
            raise  # the run reports it
        except OSError:
            continue  # a missing, unreadable or unsafe metadata file is reported by the metadata checks
        if size != entry.size or digest != entry.digest:
            findings.append(error(
                "manifest-digest",
                f"{name} differs from the one written at save time: the checkpoint's index was replaced or edited",
                location=Location(file=name), expected=entry.digest, actual=digest,
            ))
    return findings


def size_changed(name: str, size: int | None, entry: FileEntry, *, when: str) -> list[Finding]:
    """``manifest-digest`` if the file ``name`` the manifest pins is gone (``size`` ``None``) or not of its size.
    ``when``: how the manifest was made (``saved``, ``fingerprinted``)."""
    if size is None:
        return [error("manifest-digest", f"{name} was {when} but is gone", location=Location(file=name))]
    if size != entry.size:
        return [error("manifest-digest", f"{name} is {size} bytes; it was {entry.size} bytes when {when}",
                      location=Location(file=name), expected=entry.size, actual=size)]
    return []


def block_tasks(manifest: Manifest, matched: dict[int, Item], opened: dict[str, ReadOnlyFile | None],
                max_bytes: int) -> list[BlockTask]:
    """Split every matched item's blocks into hashing tasks of at most ``max_bytes`` (whole blocks)."""
    tasks: list[BlockTask] = []
    bb = manifest.block_bytes
    per_task = max(1, max_bytes // bb)
    for n, item in matched.items():
        f = opened.get(item.file)
        if f is None or item.end > f.size:
            continue
        entry = manifest.items[n]
        nblocks = math.ceil(entry.length / bb) if entry.blocks else 0
        if nblocks == 0:
            tasks.append(BlockTask(item.file, n, 0, 0, item.offset, item.end))  # whole-item digest
            continue
        for first in range(0, nblocks, per_task):
            last = min(nblocks, first + per_task)
            tasks.append(BlockTask(item.file, n, first, last, item.offset + first * bb,
                                   min(item.end, item.offset + last * bb)))
    return tasks


def hash_task(f: ReadOnlyFile, task: BlockTask, manifest: Manifest,
              crc_ranges: Sequence[tuple[int, int]] = ()) -> tuple[list[str], list[int]]:
    """The task's block digests (or whole-item digest) and, in the same pass, the CRC-32 of each ``crc_ranges`` range.
    """
    from ckptverify.fingerprint import digest_bytes, new_digest

    algorithm, bb = manifest.digest_algorithm, manifest.block_bytes
    whole = task.last == task.first
    out: list[str] = []
    crcs = [0] * len(crc_ranges)
    digest, filled = new_digest(algorithm), 0

    def feed(view: memoryview, at: int) -> None:
        nonlocal digest, filled
        end = at + len(view)
        for k, (lo, hi) in enumerate(crc_ranges):
            a, b = max(lo, at), min(hi, end)
            if a < b:
                crcs[k] = crc32(view[a - at : b - at], crcs[k])
        if whole:
            digest.update(view)
            return
        if len(view) == bb and not filled:
            # Pieces are block-aligned: one digest per block, fed at construction (hashes without the GIL).
            out.append(digest_bytes(view, algorithm))
            return
        pos = 0
        while pos < len(view):
            take = min(bb - filled, len(view) - pos)
            digest.update(view[pos : pos + take])
            filled += take
            pos += take
            if filled == bb:
                out.append(digest.hexdigest())
                digest, filled = new_digest(algorithm), 0

    f.fold_at(task.start, task.end, feed)
    if whole or filled:
        out.append(digest.hexdigest())
    return out, crcs


def judge_blocks(manifest: Manifest, task: BlockTask, item: Item, digests: list[str],
                 plan: ItemPlan | None) -> list[Finding]:
    """Compare computed block digests with the manifest's; localize each mismatching block."""
    entry: ItemEntry = manifest.items[task.entry]
    if task.last == task.first:
        if digests[0] == entry.digest:
            return []
        return [error("manifest-digest", f"{item_label(item)} differs from what was saved",
                      location=item_location(item, byte_range=(item.offset, item.end)),
                      expected=entry.digest, actual=digests[0])]
    out: list[Finding] = []
    bb = manifest.block_bytes
    for i, digest in enumerate(digests, start=task.first):
        expected = entry.blocks[i]
        if digest == expected:
            continue
        start = item.offset + i * bb
        end = min(item.end, start + bb)
        note, where = _blamed(item, plan, start, end)
        out.append(error(
            "manifest-digest", f"{item_label(item)}: bytes [{start}, {end}) of {item.file} differ from what was saved"
            f"{note}", location=where, expected=expected, actual=digest,
        ))
    return out


def _payload_elements(item: Item, plan: ItemPlan | None, start: int, end: int) -> tuple[int, int] | None:
    if (plan is None or not isinstance(plan.header, TensorHeader) or item.chunk is None
            or not plan.header.is_row_major):  # a tensor subclass's item holds several tensors: no one element range
        return None
    rec = plan.archive.record(f"data/{plan.header.storage_key}")
    if rec is None:
        return None
    base = item.offset + rec.data_offset
    lo, hi = max(start, base), min(end, item.offset + rec.data_end)
    if lo >= hi:
        return None
    return touched_elements(lo - base, hi - base, DTYPE_ITEMSIZE[plan.header.dtype], plan.header.storage_offset,
                            item.chunk.numel)


def _blamed(item: Item, plan: ItemPlan | None, start: int, end: int) -> tuple[str, Location]:
    """What bytes ``[start, end)`` of ``item`` hold, as a note to a message, and their location (with the elements,
    for a plain row-major tensor's payload)."""
    where = item_location(item, byte_range=(start, end))
    if plan is not None and isinstance(plan.header, SubclassHeader):
        return _subclass_note(item, plan, plan.header, start, end), where
    span = _payload_elements(item, plan, start, end)
    if span is None:
        return " (outside the tensor payload: headers or a non-tensor value)", where
    return f": elements [{span[0]}, {span[1]}) of the chunk", item_location(
        item, byte_range=(start, end), element_range=span, global_index_first=global_index(item, span[0]),
        global_index_last=global_index(item, span[1] - 1))


def _subclass_note(item: Item, plan: ItemPlan, header: SubclassHeader, start: int, end: int) -> str:
    """Which inner tensors of a tensor subclass's item (``qdata``, ``scale``, ...) the bytes overlap."""
    touched = []
    for name, part in header.parts:
        rec = plan.archive.record(f"data/{part.storage_key}")
        if rec is not None and start < item.offset + rec.data_end and item.offset + rec.data_offset < end:
            touched.append(repr(name))
    if not touched:
        return f" (outside the {header.short_name}'s inner tensors: headers)"
    return f" (the {header.short_name}'s {' and '.join(touched)} part{'s' if len(touched) > 1 else ''})"
