"""Checks of single checkpoint files, recognized by their first bytes (:func:`~ckptverify.formats.single.sniff`):
a zip (``torch.save``), a length-prefixed JSON header (safetensors: no checksum, ``content-uncheckable`` until a
manifest covers it), or a pickle protocol byte (legacy ``torch.save``, no checksum)."""

from __future__ import annotations

import os
from typing import Any

from ckptverify.checks import unopened
from ckptverify.checks.torchsave_file import verify_torchsave_file
from ckptverify.dcp import safetensors
from ckptverify.errors import ArchiveError, JSONError
from ckptverify.findings import CheckCoverage, Finding, Location, error, warning
from ckptverify.formats.single import JSON_MAX_BYTES, sniff
from ckptverify.safeparse import safejson
from ckptverify.safeparse.readers import ReadOnlyFile

__all__ = ["check_file", "check_json"]


def check_file(path: str, *, name: str | None = None,
               root: str | None = None) -> tuple[list[Finding], list[CheckCoverage], dict[str, Any]]:
    """Check one file by content. Returns findings, coverage and facts (``format``, ``bytes``, ``tensors``)."""
    label = name or os.path.basename(path)
    try:
        with ReadOnlyFile(path) as f:
            head = f.pread(0, 16)
    except OSError as exc:
        return [unopened(label, exc)], [], {"format": None, "bytes": 0}
    kind = sniff(head)
    if kind in ("torch.save", "pickle"):
        found, cov, facts = verify_torchsave_file(path, name=label, root=root)
        return found, cov, {"format": "torch.save", **facts}
    if kind == "safetensors":
        found, cov, facts = _check_safetensors(path, label)
        return found, cov, {"format": "safetensors", **facts}
    return [error("format-unknown", f"{label} is neither a torch.save archive nor a safetensors file (it starts "
                  f"with {head[:8].hex() or 'nothing'})", location=Location(file=label, byte_range=(0, 8)))], [], \
        {"format": None, "bytes": 0}


def _check_safetensors(path: str, label: str) -> tuple[list[Finding], list[CheckCoverage], dict[str, Any]]:
    findings: list[Finding] = []
    facts: dict[str, Any] = {"tensors": {}, "bytes": 0}
    with ReadOnlyFile(path) as f:
        facts["bytes"] = f.size
        try:
            blob = safetensors.read_blob(f, 0)
        except ArchiveError as exc:
            return [error("blob-structure", f"{label} is not a well-formed safetensors file: {exc}",
                          location=Location(file=label, byte_range=(exc.start, exc.end)))], [], facts
        for tname, t in blob.tensors.items():
            facts["tensors"][tname] = {"dtype": t.dtype, "shape": list(t.shape),
                                       "byte_range": [blob.data_start + t.begin, blob.data_start + t.end]}
        if blob.end < f.size:
            findings.append(warning("bytes-unreferenced", f"{label} holds {f.size - blob.end} bytes after its last "
                                    "tensor", location=Location(file=label, byte_range=(blob.end, f.size))))
        findings.append(warning("content-uncheckable", f"{label} is safetensors, which carries no checksum: its "
                                f"{len(blob.tensors)} tensor(s) are well placed, but their values cannot be checked "
                                "without a manifest", location=Location(file=label)))
    return findings, [CheckCoverage(check="safetensors-header", count=len(blob.tensors), unit="tensors")], facts


def check_json(path: str, *, name: str | None = None, root: str | None = None) -> tuple[list[Finding], Any]:
    """Parse a JSON side file (bounded; ``json-invalid`` if it does not parse). ``root``: it must resolve inside it."""
    label = name or os.path.basename(path)
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
