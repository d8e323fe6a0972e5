"""Folders of checkpoint files: Hugging Face model folders, accelerate ``save_state``, transformers ``checkpoint-N``.

Every file is judged by content (:func:`~ckptverify.checks.single.check_file`). A sharded model's index is
checked against its shards (each exists in the folder, holds every tensor mapped to it, and nothing unmapped).
DCP sub-folders go to ``dcp_parts`` for the caller. Links are not followed out; special files are never opened.
"""

from __future__ import annotations

import stat
from typing import Any

from ckptverify.checks import plain_name
from ckptverify.checks.single import check_file, check_json
from ckptverify.findings import CheckCoverage, Finding, Location, error, info, warning
from ckptverify.formats.describe import is_own_file
from ckptverify.formats.rundir import is_dcp
from ckptverify.safeparse import paths

__all__ = ["CHECKPOINT_SUFFIXES", "check_folder"]

CHECKPOINT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".pkl")


def check_folder(root: str) -> tuple[list[Finding], list[CheckCoverage], dict[str, Any]]:
    """Check every file of the non-DCP folder ``root``. Facts: ``files``, ``tensors``, ``dcp_parts``, ``bytes``,
    ``description`` (each file's from its check's read, by name: see :func:`~ckptverify.checks.single.check_file`)."""
    findings: list[Finding] = []
    coverage: list[CheckCoverage] = []
    facts: dict[str, Any] = {"files": {}, "tensors": {}, "dcp_parts": [], "bytes": 0, "unchecked": [],
                             "description": {}}
    indexes: dict[str, Any] = {}
    with paths.scandir(root) as it:
        entries = sorted(it, key=lambda e: e.name)
    for e in entries:
        if is_own_file(e.name):
            continue  # ckptverify's manifest and stamp: checked by the commands that read them
        try:
            st = e.stat(follow_symlinks=False)
        except OSError:
            continue
        if stat.S_ISDIR(st.st_mode):
            if is_dcp(e.path):
                facts["dcp_parts"].append(e.name)
            else:
                facts["unchecked"].append(e.name + "/")
            continue
        if not stat.S_ISREG(st.st_mode):
            kind = "a symbolic link" if stat.S_ISLNK(st.st_mode) else "a special file"
            findings.append(error("file-type", f"{e.name} is {kind}; checkpoint files must be regular files inside "
                                  "the folder (not opened)", location=Location(file=e.name)))
            continue
        if e.name.endswith(".json"):
            found, value = check_json(e.path)
            findings.extend(found)
            facts["files"][e.name] = "json"
            if e.name.endswith(".index.json") and value is not None:
                indexes[e.name] = value
            continue
        if not e.name.endswith(CHECKPOINT_SUFFIXES):
            facts["unchecked"].append(e.name)
            continue
        found, cov, file_facts = check_file(e.path)
        findings.extend(found)
        coverage.extend(cov)
        facts["files"][e.name] = file_facts.get("format")
        facts["tensors"][e.name] = file_facts.get("tensors", [])
        facts["bytes"] += file_facts.get("bytes", 0)
        if "description" in file_facts:
            facts["description"][e.name] = file_facts["description"]
    for name, index in sorted(indexes.items()):
        findings.extend(_check_index(root, name, index, facts))
    if indexes:
        coverage.append(CheckCoverage(check="index", count=len(indexes), unit="index files"))
    if facts["unchecked"]:
        findings.append(info("file-unchecked", f"{len(facts['unchecked'])} entr(ies) are not checkpoint files and "
                             f"were not checked: {facts['unchecked'][:8]}"))
    return findings, coverage, facts


def _check_index(root: str, name: str, index: Any, facts: dict[str, Any]) -> list[Finding]:
    where = Location(file=name)
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                                    for k, v in weight_map.items()):
        return [error("index-invalid", f"{name} has no weight_map of tensor names to shard files", location=where)]
    out: list[Finding] = []
    by_shard: dict[str, set[str]] = {}
    for tensor, shard in weight_map.items():
        by_shard.setdefault(shard, set()).add(tensor)
    for shard, mapped in sorted(by_shard.items()):
        if not plain_name(shard):
            out.append(error("index-invalid", f"{name} maps tensors to {shard[:200]!r}, which is not a file inside "
                             "the folder; it is not opened", location=where))
            continue
        if shard not in facts["tensors"]:
            out.append(error("file-missing", f"{shard} is missing; {name} places {len(mapped)} tensor(s) in it",
                             location=Location(file=shard)))
            continue
        held = set(facts["tensors"][shard])
        for tensor in sorted(mapped - held)[:50]:
            out.append(error("index-mismatch", f"{name} maps {tensor!r} to {shard}, which does not hold it",
                             location=Location(file=shard, fqn=tensor)))
        for tensor in sorted(held - mapped)[:50]:
            out.append(error("index-mismatch", f"{shard} holds {tensor!r}, which {name} does not map to it",
                             location=Location(file=shard, fqn=tensor)))
    suffix = name.removesuffix(".index.json").rsplit(".", 1)[-1]  # only *.index.json are read as indexes
    for shard in sorted(facts["tensors"]):
        if shard.endswith("." + suffix) and shard not in by_shard and suffix:
            out.append(warning("index-mismatch", f"{shard} is not named by {name}: a leftover shard, or the index is "
                             "stale", location=Location(file=shard)))
    return out
