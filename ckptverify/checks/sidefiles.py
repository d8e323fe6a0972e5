"""Framework files beside a DCP checkpoint's shards, recognized by name *and* checked by content.

Known side files (:data:`SIDE_FILES`: Lightning's ``meta.pt``, Megatron's ``common.pt``, ``metadata.json``,
``integrity.json``) are not ``file-unreferenced``; each is checked by content (a ``meta.pt`` that is not a
``torch.save`` archive is an error), digested by ``fingerprint`` and compared by ``diff``.

Megatron's ``integrity.json`` (``{"algorithm": "sha256", "files": {NAME: HEX}}``) is checked as such:
``integrity-mismatch``, ``integrity-missing``, ``integrity-unlisted`` (warning) and ``integrity-invalid``
(malformed, escaping the folder, another algorithm). Only a manifest covers the record itself. Checking it
re-reads every listed file (SHA-256, about a tenth of xxh3's speed).
"""

from __future__ import annotations

import os
import re
import stat
from typing import Any

from ckptverify.checks import plain_name
from ckptverify.findings import CheckCoverage, Finding, Location, error, info, warning
from ckptverify.safeparse import paths

__all__ = ["SIDE_FILES", "check_side_files", "side_files"]

#: Known side files: name -> (expected content, who writes it).
SIDE_FILES: dict[str, tuple[str, str]] = {
    "meta.pt": ("torch.save", "Lightning"),
    "common.pt": ("torch.save", "Megatron Core"),
    "metadata.json": ("json", "Megatron Core"),
    "integrity.json": ("megatron-integrity", "Megatron Core"),
}

#: The one algorithm Megatron Core's integrity record uses (and the only one its loader accepts).
INTEGRITY_ALGORITHM = "sha256"
#: Files one integrity record may list at most (Megatron lists the files of one checkpoint folder).
INTEGRITY_MAX_FILES = 100_000
_SHA256_HEX = re.compile(r"^[0-9a-f]{64}$")
# Files of a DCP checkpoint that Megatron's record lists when it is written after the save.
_COVERED = re.compile(r"^(?:__\d+_\d+\.distcp|(?:__\d+)?\.metadata|common\.pt|metadata\.json)$")


def side_files(root: str) -> list[str]:
    """Known side files in ``root``, any file type (a FIFO named ``meta.pt`` is listed; the check refuses to open it).
    """
    return sorted(n for n in SIDE_FILES if paths.lexists(os.path.join(root, n)))


def check_side_files(root: str, names: list[str]) -> tuple[list[Finding], list[CheckCoverage], list[str]]:
    """Check each side file by content. Returns findings, coverage, and the names that are regular files inside
    ``root``."""
    if not names:
        return [], [], []
    # Imported here: most checkpoints have no side file, and a plain verify should not pay for these readers.
    from ckptverify.checks.single import check_file, check_json

    findings: list[Finding] = []
    coverage: list[CheckCoverage] = []
    usable: list[str] = []
    for name in names:
        path = os.path.join(root, name)
        try:
            st = paths.lstat(path)
        except OSError:
            continue
        if not stat.S_ISREG(st.st_mode):
            kind = "a symbolic link" if stat.S_ISLNK(st.st_mode) else "not a regular file"
            findings.append(error("file-type", f"{name} ({SIDE_FILES[name][1]}'s side file) is {kind}; it is not "
                                  "opened", location=Location(file=name)))
            continue
        want, who = SIDE_FILES[name]
        if want == "megatron-integrity":
            found, cov = check_integrity_record(root, name)
            findings.extend(found)
            coverage.extend(cov)
        elif want == "json":
            found, _ = check_json(path, root=root)
            findings.extend(found)
            if not found:
                findings.append(info("side-file", f"{name} ({who}) is valid JSON; JSON carries no checksum, so only a "
                                     "manifest protects its bytes", location=Location(file=name)))
        else:
            found, _cov, facts = check_file(path, root=root)
            if facts.get("format") != want and not any(f.severity.value == "error" for f in found):
                found.append(error("side-file", f"{name} should be {who}'s {want} file, but its content is "
                                   f"{facts.get('format') or 'unknown'}", location=Location(file=name)))
            findings.extend(found)
        usable.append(name)
    return findings, [CheckCoverage(check="side-file", count=len(usable), unit="files"), *coverage], usable


def check_integrity_record(root: str, name: str) -> tuple[list[Finding], list[CheckCoverage]]:
    """Check Megatron's integrity record ``name`` in ``root`` against each listed file. A malformed record is one
    ``integrity-invalid`` error, never an exception."""
    from ckptverify.checks.single import check_json
    from ckptverify.fingerprint.digest import digest_reader
    from ckptverify.safeparse.readers import ReadOnlyFile

    where = Location(file=name)
    found, data = check_json(os.path.join(root, name), root=root)
    if found:
        return found, []
    problem = _integrity_problem(data)
    if problem is not None:
        return [error("integrity-invalid", f"{name} is not Megatron Core's integrity record: {problem}; its "
                      "digests were not checked", location=where)], []
    findings: list[Finding] = []
    files: dict[str, str] = data["files"]
    checked = 0
    for listed, expected in sorted(files.items()):
        try:  # only a regular file inside ``root``: a FIFO, device or link out of it is refused unopened
            with ReadOnlyFile(os.path.join(root, listed), root=root) as f:
                actual = digest_reader(f, INTEGRITY_ALGORITHM)
        except FileNotFoundError:
            findings.append(error("integrity-missing", f"{listed} is listed in {name} (Megatron's integrity record) "
                                  "but is absent: a file of the checkpoint as saved is gone",
                                  location=Location(file=listed)))
            continue
        except OSError as exc:
            findings.append(error("integrity-missing", f"{listed} is listed in {name} but cannot be read: {exc}",
                                  location=Location(file=listed)))
            continue
        checked += 1
        if actual != expected:
            findings.append(error("integrity-mismatch", f"{listed}: its SHA-256 differs from the one {name} "
                                  "(Megatron's integrity record) lists: its bytes changed since the save",
                                  location=Location(file=listed), expected=expected, actual=actual))
    try:
        present = sorted(n for n in paths.listdir(root) if _COVERED.match(n))
    except OSError:
        present = []
    for unlisted in (n for n in present if n not in files):
        findings.append(warning("integrity-unlisted", f"{unlisted} is not listed in {name}, which lists every file "
                                "of the checkpoint as Megatron saved it: added or rewritten after the save, or "
                                "the record was edited", location=Location(file=unlisted)))
    if not findings:
        findings.append(info("integrity-record", f"{name} (Megatron Core): the SHA-256 of each of its {checked} "
                             "file(s) matches", location=where))
    return findings, [CheckCoverage(check="integrity-record", count=checked, unit="files")]


def _integrity_problem(data: Any) -> str | None:
    """Why ``data`` is not of the form ``{"algorithm": "sha256", "files": {NAME: HEX}}``, or ``None``."""
    if not isinstance(data, dict):
        return f"it is a JSON {type(data).__name__}, not an object"
    algorithm = data.get("algorithm", INTEGRITY_ALGORITHM)  # Megatron's loader takes a missing one as sha256
    if algorithm != INTEGRITY_ALGORITHM:
        return f"its algorithm is {str(algorithm)[:40]!r}, not {INTEGRITY_ALGORITHM!r}"
    files = data.get("files")
    if not isinstance(files, dict):
        return f"its 'files' is {type(files).__name__}, not an object of file names and digests"
    if len(files) > INTEGRITY_MAX_FILES:
        return f"it lists {len(files)} files, more than one checkpoint folder holds ({INTEGRITY_MAX_FILES})"
    for listed, digest in files.items():
        if not plain_name(listed):
            return f"it lists {listed[:80]!r}, which is not a plain file name inside the checkpoint folder"
        if not isinstance(digest, str) or not _SHA256_HEX.match(digest):
            return f"the digest of {listed!r} is {str(digest)[:80]!r}, not 64 lowercase hex digits"
    return None
