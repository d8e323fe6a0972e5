"""A whole-file ``torch.save`` checkpoint (``.pt``, ``.pth``, ``.bin``, ``.ckpt``; ``dcp_to_torch_save`` output).

Checked: zip structure, every record's CRC-32, and the pickle read inertly (:mod:`~ckptverify.safeparse.torchsave`):
every tensor's storage exists and covers its extent, no storage is orphaned; subclass tensors part by part. A pass
guarantees the bytes as written (up to CRC-32), not the values in memory (no manifest), nor anything about
objects outside the allowlist (named, not interpreted). Legacy non-zip files carry no checksum: uncheckable.
"""

from __future__ import annotations

import os
from typing import Any

from ckptverify.checks import unopened
from ckptverify.checks.content import bad_records, crc_disabled, crc_findings
from ckptverify.errors import ArchiveError, BadPickle
from ckptverify.findings import CheckCoverage, Finding, Location, error, info, warning
from ckptverify.formats.single import sniff
from ckptverify.safeparse.readers import ReadOnlyFile
from ckptverify.safeparse.torchsave import MAX_PICKLE_BYTES, scan_pickle
from ckptverify.safeparse.zipwalk import looks_like_zip, parse_archive, range_reader

__all__ = ["verify_torchsave_file"]


def verify_torchsave_file(path: str, *, name: str | None = None,
                          root: str | None = None) -> tuple[list[Finding], list[CheckCoverage], dict[str, Any]]:
    """Check the ``torch.save`` file ``path`` (``name``: as findings call it). Returns findings, coverage and facts
    (``tensors``: path -> dtype/shape, subclasses with ``stored_as`` and ``parts``; ``bytes``)."""
    label = name or os.path.basename(path)
    findings: list[Finding] = []
    coverage: list[CheckCoverage] = []
    facts: dict[str, Any] = {"tensors": {}, "bytes": 0}
    try:
        f = ReadOnlyFile(path, root=root)
    except OSError as exc:
        return [unopened(label, exc)], coverage, facts
    with f:
        facts["bytes"] = f.size
        head = f.pread(0, 16)
        if not looks_like_zip(head):
            if sniff(head) == "pickle":
                findings.append(warning(
                    "content-uncheckable", f"{label} is in the legacy (non-zip) torch.save format, which carries "
                    "no checksum: its content cannot be checked", location=Location(file=label)))
            else:
                findings.append(error("zip-structure", f"{label} is not a torch.save archive (it starts with "
                                      f"{head[:4].hex() or 'nothing'})",
                                      location=Location(file=label, byte_range=(0, 4))))
            return findings, coverage, facts
        try:
            archive = parse_archive(range_reader(f), f.size)
        except ArchiveError as exc:
            start = exc.start or 0
            end = exc.end if exc.end else f.size
            findings.append(error("zip-structure", f"{label} is not an intact torch.save archive: {exc}",
                                  location=Location(file=label, byte_range=(start, max(end, start + 1)))))
            return findings, coverage, facts
        coverage.append(CheckCoverage(check="zip-structure", count=1, unit="files"))
        computed = [f.crc32(rec.data_offset, rec.data_end) for rec in archive.records]
        crcs = dict(zip((rec.name for rec in archive.records), computed, strict=True))
        coverage.append(CheckCoverage(check="zip-crc", count=len(crcs), unit="records"))
        facts["bytes_hashed"] = sum(r.size for r in archive.records)
        bad = bad_records(archive.records, computed)
        if bad is None:
            findings.append(crc_disabled(label, Location(file=label)))
            bad = []
        pkl = archive.record("data.pkl")
        scan = None
        if pkl is None:
            findings.append(error("zip-structure", f"{label} has no data.pkl record", location=Location(file=label)))
        elif pkl.size > MAX_PICKLE_BYTES:
            findings.append(warning("pickle-unread", f"{label}: data.pkl is {pkl.size} bytes, more than this tool "
                                    f"reads ({MAX_PICKLE_BYTES}); tensors are not mapped to records",
                                    location=Location(file=label, record=pkl.name)))
        elif pkl not in bad:
            try:
                scan = scan_pickle(f.pread(pkl.data_offset, pkl.size))
            except BadPickle as exc:
                findings.append(error("pickle-structure", f"{label}: data.pkl cannot be read safely: {exc}",
                                      location=Location(file=label, record=pkl.name,
                                                        byte_range=(pkl.data_offset, pkl.data_end))))
        owners: dict[str, list[str]] = {}
        holds: dict[str, str] = {}  # storage key -> what its record holds, for a damaged record's message
        if scan is not None:
            for tname, ref in scan.tensors.items():
                facts["tensors"][tname] = {"dtype": ref.dtype, "shape": list(ref.shape)}
            for tname, sub in scan.subclasses.items():
                facts["tensors"][tname] = {"dtype": sub.dtype, "shape": list(sub.size), "stored_as": sub.short_name,
                                           "parts": {n: {"dtype": r.dtype, "shape": list(r.shape)}
                                                     for n, r in sub.parts}}
            views: dict[str, list[Any]] = {}
            for tname, part, ref in scan.all_tensors():
                owners.setdefault(ref.storage.key, []).append(tname)
                views.setdefault(ref.storage.key, []).append(ref)
                if part is not None:
                    holds.setdefault(ref.storage.key, f"the {part!r} part of tensor {tname!r}, a "
                                                      f"{scan.subclasses[tname].short_name}")
            for key in scan.storages:
                rec = archive.record(f"data/{key}")
                where = Location(file=label, fqn=", ".join(owners.get(key, [])[:3]) or None,
                                 record=f"{archive.prefix}/data/{key}")
                if rec is None:
                    findings.append(error("tensor-record", f"{label}: storage {key!r} has no record: the bytes of "
                                          f"{owners.get(key, ['a tensor'])[0]!r} are missing", location=where))
                    continue
                reach = [(t.extent_bytes(), t) for t in views.get(key, [])]
                known = [(n, t) for n, t in reach if n is not None]
                if known:
                    need, widest = max(known, key=lambda nt: nt[0])
                    if need > rec.size:
                        findings.append(error(
                            "tensor-record", f"{label}: record {rec.name} holds {rec.size} bytes, but its tensors "
                            f"reach {widest.extent()} {widest.dtype} elements ({need} bytes)", location=where,
                            expected=need, actual=rec.size))
            coverage.append(CheckCoverage(check="tensor-record", count=len(scan.tensors) + len(scan.subclasses),
                                          unit="tensors"))
            if scan.opaque:
                findings.append(info("pickle-opaque", f"{label}: objects of {len(scan.opaque)} type(s) outside the "
                                     f"tensor allowlist were named, not interpreted: {sorted(scan.opaque)[:8]}",
                                     location=Location(file=label, record=pkl.name if pkl else None)))
        for rec in bad:
            key = rec.name.rsplit("/", 1)[-1]
            names = owners.get(key, [])
            held = holds.get(key) if rec.name.startswith(f"{archive.prefix}/data/") else None
            role = f"record {rec.name}" + (f" ({held})" if held else
                                           f" (tensor {', '.join(repr(n) for n in names[:3])})" if names else "")
            findings.extend(crc_findings(label, role, rec, crcs[rec.name], Location(
                file=label, fqn=names[0] if names else None, record=rec.name,
                byte_range=(rec.data_offset, rec.data_end))))
    return findings, coverage, facts
