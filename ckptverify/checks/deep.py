"""Deep verification: rebuild every tensor from disk and compare its logical fingerprint with the one the
live tensor had at save time (end to end: memory -> disk -> memory).

Tensors are rebuilt from their payload bytes (:mod:`ckptverify.dcp.tensors`), never through
``torch.load``; NaN and Inf are counted on the way (warnings: legal values, but rarely wanted).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field

from ckptverify.checks.content import ItemPlan
from ckptverify.dcp.layout import Layout
from ckptverify.dcp.tensors import UnreadableTensor, iter_row_blocks
from ckptverify.findings import Finding, Location, error, info, warning
from ckptverify.manifest import Manifest
from ckptverify.readers import ReadOnlyFile

_FLOATING = {"float64", "float32", "float16", "bfloat16", "complex128", "complex64", "complex32"}


@dataclass(slots=True)
class TensorScan:
    """What reading one tensor's chunks back gave: parts of its fingerprint and value counts."""

    parts: list = field(default_factory=list)
    chunks: set = field(default_factory=set)
    elements: int = 0
    nan: int = 0
    inf: int = 0
    unreadable: list[str] = field(default_factory=list)


def scan_plan(f: ReadOnlyFile, plan: ItemPlan, shape: tuple[int, ...],
              progress: Callable[[int], None] | None = None) -> TensorScan:
    """Fingerprint one tensor item's chunk, block by block, and count non-finite values."""
    import torch

    from ckptverify.fingerprint import chunk_fingerprint

    scan = TensorScan()
    item = plan.item
    if plan.header is None or item.chunk is None:
        scan.unreadable.append(f"{item.fqn} chunk {list(item.chunk.offsets) if item.chunk else []}")
        return scan
    try:
        for offsets, block in iter_row_blocks(f, item, plan.archive, plan.header):
            scan.parts.append(chunk_fingerprint(block, offsets, shape))
            scan.elements += block.numel()
            if plan.header.dtype in _FLOATING and block.numel():
                values = block.float() if block.dtype in (torch.float16, torch.bfloat16) else block
                scan.nan += int(torch.isnan(values).sum())
                scan.inf += int(torch.isinf(values).sum())
            if progress is not None:
                progress(block.numel() * block.element_size())
    except (UnreadableTensor, RuntimeError, TypeError, ValueError) as exc:
        scan.unreadable.append(f"{item.fqn} chunk {list(item.chunk.offsets)}: {exc}")
    scan.chunks.add(item.chunk.offsets)
    return scan


def merge_scans(scans: list[tuple[str, TensorScan]]) -> dict[str, TensorScan]:
    merged: dict[str, TensorScan] = defaultdict(TensorScan)
    for fqn, s in scans:
        m = merged[fqn]
        m.parts.extend(s.parts)
        m.elements += s.elements
        m.nan += s.nan
        m.inf += s.inf
        m.unreadable.extend(s.unreadable)
        m.chunks |= s.chunks
    return dict(merged)


def judge(layout: Layout, manifest: Manifest | None, scans: dict[str, TensorScan]) -> list[Finding]:
    """Compare rebuilt fingerprints with the manifest's; report non-finite counts."""
    from ckptverify.fingerprint import combine

    out: list[Finding] = []
    for fqn, tinfo in sorted(layout.tensors.items()):
        scan = scans.get(fqn)
        if scan is None:
            continue
        loc = Location(fqn=fqn)
        if scan.nan or scan.inf:
            out.append(warning("nonfinite", f"{fqn!r} holds {scan.nan} NaN and {scan.inf} Inf values",
                               location=loc, actual={"nan": scan.nan, "inf": scan.inf}))
        if manifest is None:
            continue
        saved = manifest.tensors.get(fqn)
        if saved is None or saved.fingerprint is None:
            continue
        if scan.unreadable:
            out.append(info("fingerprint", f"{fqn!r} was not fingerprinted: {scan.unreadable[0]} "
                            "(its corruption is reported above)", location=loc))
            continue
        total = 1
        for n in tinfo.shape:
            total *= n
        if not scan.parts or scan.elements != total:
            out.append(info("fingerprint", f"{fqn!r}: only {scan.elements} of {total} elements could be read back; "
                            "fingerprint not compared", location=loc))
            continue
        rebuilt = combine(scan.parts)
        if rebuilt.value != saved.fingerprint:
            out.append(error(
                "fingerprint",
                f"{fqn!r}: the values read back from disk are not the values that were in memory at save time",
                location=loc, expected=saved.fingerprint, actual=rebuilt.value,
            ))
    return out
