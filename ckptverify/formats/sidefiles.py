"""Files that frameworks write beside a DCP checkpoint's shards, recognized by name *and* checked by content.

| file | written by | what it is |
| --- | --- | --- |
| ``meta.pt`` | Lightning ``ModelParallelStrategy`` | ``torch.save``: global step, loop and LR-scheduler state |
| ``common.pt`` | Megatron Core ``dist_checkpointing`` (older versions) | ``torch.save``: the common (unsharded) state |
| ``metadata.json`` | Megatron Core ``dist_checkpointing`` | JSON: the sharded backend and its version |

A known side file is not ``file-unreferenced`` (a false warning); it is checked by what its content shows
(:func:`~ckptverify.formats.single.check_file`: a ``torch.save`` archive's structure, every CRC-32 and its
pickle through the inert reader; JSON parsed), ``fingerprint`` digests it into the manifest, and ``diff``
compares its values. Its name alone proves nothing: a ``meta.pt`` that is not a ``torch.save`` archive is
an error. Any other file beside the shards stays ``file-unreferenced``.
"""

from __future__ import annotations

import os
import stat

from ckptverify.findings import CheckCoverage, Finding, Location, error, info
from ckptverify.formats.single import check_file, check_json

__all__ = ["SIDE_FILES", "check_side_files", "side_files"]

#: Known side files: name -> (expected content, who writes it).
SIDE_FILES: dict[str, tuple[str, str]] = {
    "meta.pt": ("torch.save", "Lightning"),
    "common.pt": ("torch.save", "Megatron Core"),
    "metadata.json": ("json", "Megatron Core"),
}


def side_files(root: str) -> list[str]:
    """The known side files present in ``root`` (any file type: a FIFO named ``meta.pt`` is listed, and
    :func:`check_side_files` refuses to open it)."""
    return sorted(n for n in SIDE_FILES if os.path.lexists(os.path.join(root, n)))


def check_side_files(root: str, names: list[str]) -> tuple[list[Finding], list[CheckCoverage], list[str]]:
    """Check each side file by its content. Returns findings, coverage and the names that are regular files
    inside ``root`` (the ones to open, digest and compare)."""
    findings: list[Finding] = []
    usable: list[str] = []
    for name in names:
        path = os.path.join(root, name)
        try:
            st = os.lstat(path)
        except OSError:
            continue
        if not stat.S_ISREG(st.st_mode):
            kind = "a symbolic link" if stat.S_ISLNK(st.st_mode) else "not a regular file"
            findings.append(error("file-type", f"{name} ({SIDE_FILES[name][1]}'s side file) is {kind}; it is not "
                                  "opened", location=Location(file=name)))
            continue
        want, who = SIDE_FILES[name]
        if want == "json":
            found, _ = check_json(path, name=name, root=root)
            findings.extend(found)
            if not found:
                findings.append(info("side-file", f"{name} ({who}) is valid JSON; JSON carries no checksum, so only a "
                                     "manifest protects its bytes", location=Location(file=name)))
        else:
            found, _cov, facts = check_file(path, name=name, root=root)
            if facts.get("format") != want and not any(f.severity.value == "error" for f in found):
                found.append(error("side-file", f"{name} should be {who}'s {want} file, but its content is "
                                   f"{facts.get('format') or 'unknown'}", location=Location(file=name)))
            findings.extend(found)
        usable.append(name)
    coverage = [CheckCoverage(check="side-file", count=len(usable), unit="files")] if names else []
    return findings, coverage, usable
