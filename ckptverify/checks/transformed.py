"""Items written through DCP stream transforms (ZStandard, ...): decoded, then judged like any other item.

Findings name the item's *stored* byte range (a position in the decoded stream means nothing in the file). An
item that cannot be decoded here (no decoder) stays ``content-uncheckable``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ckptverify.checks import item_label, item_location
from ckptverify.checks.content import FileResult, ItemPlan, judge_item
from ckptverify.dcp.layout import Item
from ckptverify.dcp.transforms import decoded_item
from ckptverify.errors import ArchiveError, TransformError
from ckptverify.findings import Finding, error, warning
from ckptverify.safeparse.readers import ReadOnlyFile
from ckptverify.safeparse.zipwalk import parse_archive

__all__ = ["plan_transformed"]


def plan_transformed(f: ReadOnlyFile, item: Item, result: FileResult, *,
                     registry: Any = None) -> ItemPlan | None:
    """Decode ``item`` and check its archive and CRC-32s into ``result``; the plan (reading decoded bytes via
    ``plan.reader``) if intact, else ``None``."""
    if item.end > f.size:
        return None  # reported by the structural check
    try:
        decoded = decoded_item(f, item, registry=registry)
    except TransformError as exc:
        if exc.unavailable:
            result.findings.append(warning(
                "content-uncheckable",
                f"{item_label(item)} was written through stream transforms {list(item.transforms)} and cannot be "
                f"decoded here: {exc}; its content cannot be checked without a manifest",
                location=item_location(item)))
        else:
            result.findings.append(error(
                "stream-transform", f"{item_label(item)}: {exc}",
                location=item_location(item, byte_range=(item.offset, item.end))))
        return None
    result.items += 1
    inner = decoded.item
    try:
        archive = parse_archive(lambda off, n: decoded.pread(off, n), inner.length)
    except ArchiveError as exc:
        result.findings.append(error(
            "zip-structure", f"{item_label(item)} decodes ({list(item.transforms)}) to something that is not an "
            f"intact torch.save archive: {exc}", location=item_location(item, byte_range=(item.offset, item.end))))
        decoded.drop()
        return None
    plan = ItemPlan(inner, archive, reader=decoded)
    crcs = [decoded.crc32(r.data_offset, r.data_end) for r in archive.records]
    inner_result = FileResult()
    judge_item(decoded, plan, crcs, inner_result)  # type: ignore[arg-type]
    result.records += inner_result.records
    result.bytes_hashed += item.length
    result.findings.extend(_stored(f_, item) for f_ in inner_result.findings)
    decoded.drop()
    return plan


def _stored(finding: Finding, item: Item) -> Finding:
    """``finding`` about the decoded bytes, placed at the item's stored bytes."""
    where = finding.location
    if where.byte_range is None:
        return finding
    return dataclasses.replace(
        finding, message=f"{finding.message} (inside the decoded {list(item.transforms)} stream)",
        location=dataclasses.replace(where, byte_range=(item.offset, item.end)))
