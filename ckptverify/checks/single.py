"""Checks of single checkpoint files, recognized by their first bytes (:func:`~ckptverify.formats.describe.sniff`).

A zip is a whole-file ``torch.save`` (``.pt``, ``.pth``, ``.bin``, ``.ckpt``; ``dcp_to_torch_save`` output):
checked are its zip structure, every record's CRC-32, and the pickle read inertly
(:mod:`~ckptverify.safeparse.torchsave`): every tensor's storage record exists, is the size the pickle records and
holds the tensor's view (:func:`~ckptverify.checks.content.storage_findings`, as a DCP item's); subclass tensors part
by part. A pass guarantees the bytes as written (up to CRC-32), not the values in memory (no manifest), nor anything
about objects outside the allowlist (named, not interpreted). A length-prefixed JSON header is safetensors, and a
pickle protocol byte legacy ``torch.save``: neither carries a checksum (``content-uncheckable`` until a manifest
covers it).
"""

from __future__ import annotations

import functools
import os
from typing import Any

from ckptverify.checks import unopened
from ckptverify.checks.content import bad_records, crc_disabled, crc_findings, storage_findings, structure_finding
from ckptverify.dcp import safetensors
from ckptverify.errors import ArchiveError, BadPickle, JSONError
from ckptverify.findings import CheckCoverage, Finding, Location, error, info, warning
from ckptverify.formats.describe import JSON_MAX_BYTES, describe, sniff
from ckptverify.safeparse import safejson
from ckptverify.safeparse.readers import ReadOnlyFile
from ckptverify.safeparse.torchsave import MAX_PICKLE_BYTES, PickleScan, scan_pickle
from ckptverify.safeparse.zipwalk import Archive, parse_archive, range_reader

__all__ = ["check_file", "check_json"]


def check_file(path: str, *, root: str | None = None) -> tuple[list[Finding], list[CheckCoverage], dict[str, Any]]:
    """Check one file by content (``root``: it must resolve inside it). Returns findings, coverage and facts
    (``format``; ``bytes``; ``tensors``: the paths of the tensors it holds; ``description``, where the check read the
    tensors: a call giving the file's :func:`~ckptverify.formats.describe.describe` from this same read)."""
    label = os.path.basename(path)
    try:
        f = ReadOnlyFile(path, root=root)
    except OSError as exc:
        return [unopened(label, exc)], [], {"format": None, "bytes": 0}
    with f:
        head = f.pread(0, 16)
        kind = sniff(head)
        facts: dict[str, Any] = {"format": None, "bytes": f.size, "tensors": []}
        if kind == "pickle":
            facts["format"] = "torch.save"
            return [warning("content-uncheckable", f"{label} is in the legacy (non-zip) torch.save format, which "
                            "carries no checksum: its content cannot be checked", location=Location(file=label))], \
                [], facts
        if kind in ("torch.save", "safetensors"):
            facts["format"] = kind
            found, cov, read = (_check_torchsave if kind == "torch.save" else _check_safetensors)(f, label, facts)
            if read is not None:
                facts["description"] = functools.partial(describe, path, read=read)
            return found, cov, facts
    return [error("format-unknown", f"{label} is neither a torch.save archive nor a safetensors file (it starts "
                  f"with {head[:8].hex() or 'nothing'})", location=Location(file=label, byte_range=(0, 8)))], [], \
        {"format": None, "bytes": 0}


def _check_torchsave(f: ReadOnlyFile, label: str, facts: dict[str, Any],
                     ) -> tuple[list[Finding], list[CheckCoverage], tuple[Archive, PickleScan] | None]:
    findings: list[Finding] = []
    try:
        archive = parse_archive(range_reader(f), f.size)
    except ArchiveError as exc:
        return [structure_finding(label, exc, Location(file=label), 0, f.size)], [], None
    coverage = [CheckCoverage(check="zip-structure", count=1, unit="files")]
    computed = [f.crc32(rec.data_offset, rec.data_end) for rec in archive.records]
    crcs = dict(zip((rec.name for rec in archive.records), computed, strict=True))
    coverage.append(CheckCoverage(check="zip-crc", count=len(crcs), unit="records"))
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
        facts["tensors"] = [*scan.tensors, *scan.subclasses]
        views: dict[str, list[Any]] = {}
        for tname, part, ref in scan.all_tensors():
            owners.setdefault(ref.storage_key, []).append(tname)
            views.setdefault(ref.storage_key, []).append(ref)
            if part is not None:
                holds.setdefault(ref.storage_key, f"the {part!r} part of tensor {tname!r}, a "
                                                  f"{scan.subclasses[tname].short_name}")

        def named(key: str) -> tuple[str, Location]:  # built only for an error: a file can hold 100 000 storages
            names = owners.get(key, [])
            who = f"{label}: " + (holds.get(key) or (f"tensor {names[0]!r}" if names else f"storage {key!r}"))
            return who, Location(file=label, fqn=", ".join(names[:3]) or None, record=f"{archive.prefix}/data/{key}")

        for key in scan.storages:
            findings.extend(storage_findings(archive, key, views.get(key, []), functools.partial(named, key)))
        coverage.append(CheckCoverage(check="tensor-record", count=len(facts["tensors"]), unit="tensors"))
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
    return findings, coverage, None if scan is None else (archive, scan)


def _check_safetensors(f: ReadOnlyFile, label: str,
                       facts: dict[str, Any]) -> tuple[list[Finding], list[CheckCoverage], safetensors.Blob | None]:
    try:
        blob = safetensors.read_blob(f, 0)
    except ArchiveError as exc:
        return [error("blob-structure", f"{label} is not a well-formed safetensors file: {exc}",
                      location=Location(file=label, byte_range=(exc.start, exc.end)))], [], None
    findings: list[Finding] = []
    facts["tensors"] = list(blob.tensors)
    if blob.end < f.size:
        findings.append(warning("bytes-unreferenced", f"{label} holds {f.size - blob.end} bytes after its last "
                                "tensor", location=Location(file=label, byte_range=(blob.end, f.size))))
    findings.append(warning("content-uncheckable", f"{label} is safetensors, which carries no checksum: its "
                            f"{len(blob.tensors)} tensor(s) are well placed, but their values cannot be checked "
                            "without a manifest", location=Location(file=label)))
    return findings, [CheckCoverage(check="safetensors-header", count=len(blob.tensors), unit="tensors")], blob


def check_json(path: str, *, root: str | None = None) -> tuple[list[Finding], Any]:
    """Parse a JSON side file (bounded; ``json-invalid`` if it does not parse). ``root``: it must resolve inside it."""
    label = os.path.basename(path)
    try:
        with ReadOnlyFile(path, root=root) as f:
            if f.size > JSON_MAX_BYTES:
                return [error("json-invalid", f"{label} is {f.size} bytes, more than a JSON side file may be "
                              f"({JSON_MAX_BYTES})", location=Location(file=label))], None
            raw = f.pread(0, f.size)
    except OSError as exc:
        return [unopened(label, exc)], None
    try:
        return [], safejson.loads(raw, nonfinite=True)
    except JSONError as exc:
        return [error("json-invalid", f"{label} is not valid JSON: {exc}"[:300], location=Location(file=label))], None
