"""The plan of a save's verification shared among its nodes, and where part verdicts go
(:data:`~ckptverify.ownfiles.names.PARTS_PLAN`, ``.ckptverify-part-N.json``). Written by the coordinator once the
save committed (:func:`share_out`); read by every node's part and the coordinator's verifier."""

from __future__ import annotations

import json
import os
import re
import uuid
import warnings
from typing import Any

from ckptverify.errors import CkptVerifyWarning
from ckptverify.ownfiles.names import PARTS_PLAN, PARTS_PREFIX, STAMP_TEMP_PREFIX, write_atomic
from ckptverify.safeparse import safejson
from ckptverify.safeparse.readers import read_small_file

__all__ = ["PLAN_SCHEMA", "dcp_folders", "make_plan", "nodes_of", "part_verdict_path", "plan_from_names", "read_json",
           "read_plan", "share_out", "write_plan"]

PLAN_SCHEMA = "ckptverify/parts-plan"
#: Most of a plan or part verdict ever read (a fingerprinted part carries digests and scans).
MAX_BYTES = 256 << 20
_DCP_FILE = re.compile(r"__(\d+)_\d+\.distcp")


def nodes_of(hosts: list[str]) -> list[tuple[str, list[int]]]:
    """``(host, ranks)`` per node of a group whose rank ``r`` runs on ``hosts[r]``, by lowest rank (node 0:
    coordinator)."""
    order: dict[str, list[int]] = {}
    for rank, host in enumerate(hosts):
        order.setdefault(host, []).append(rank)
    return list(order.items())


def make_plan(hosts: list[str], files_of_rank: list[list[str]]) -> dict[str, Any]:
    """The plan of a save whose rank ``r`` ran on ``hosts[r]`` and wrote ``files_of_rank[r]``."""
    nodes = []
    for k, (host, ranks) in enumerate(nodes_of(hosts)):
        files = sorted({f for r in ranks if r < len(files_of_rank) for f in files_of_rank[r]})
        nodes.append({"node": k, "host": host, "ranks": ranks, "files": files})
    return {"schema": PLAN_SCHEMA, "save_id": uuid.uuid4().hex, "nodes": nodes}


def dcp_folders(root: str) -> list[str]:
    """The committed DCP checkpoints of the local save at ``root``: ``[""]`` if it is one, else its sub-folders that
    are (a ``.metadata`` regular file; links not followed), else ``[]``.

    The one answer to which DCP folders a save's verification is shared out by: the plan gives nodes the files of
    these (:func:`plan_from_names`), a part's files are split by them
    (:func:`~ckptverify.audit.verify.each_shard_folder`), and a folder of them is committed when they are. Committed
    ones only: a save is shared out once committed, so an uncommitted DCP folder beside them is no node's, and stays
    with the coordinator's check of the whole (which reports it)."""
    if os.path.isfile(os.path.join(root, ".metadata")):
        return [""]
    try:
        with os.scandir(root) as it:
            entries = sorted(it, key=lambda e: e.name)
    except OSError:
        return []
    return [e.name for e in entries if e.is_dir(follow_symlinks=False)
            and os.path.isfile(meta := os.path.join(e.path, ".metadata")) and not os.path.islink(meta)]


def plan_from_names(root: str, hosts: list[str]) -> dict[str, Any]:
    """The plan of DCP files written through DCP's file system writer (rank ``r`` names ``__r_N.distcp``; in a folder of
    files, ``SUB/__r_N.distcp``), from names alone. Files of no rank's name are left to the coordinator."""
    files: list[list[str]] = [[] for _ in hosts]
    for sub in dcp_folders(root):
        for name in sorted(os.listdir(os.path.join(root, sub))):
            m = _DCP_FILE.fullmatch(name)
            if m is not None and int(m.group(1)) < len(hosts):
                files[int(m.group(1))].append(f"{sub}/{name}" if sub else name)
    return make_plan(hosts, files)


def write_plan(root: str, plan: dict[str, Any]) -> str:
    return write_atomic(os.path.join(root, PARTS_PLAN), json.dumps(plan, indent=1), prefix=STAMP_TEMP_PREFIX)


def share_out(root: str, hosts: list[str], *, fingerprint: Any = False, deep: bool = False) -> bool:
    """The coordinator's side as a save into ``root`` committed: write its plan (:func:`plan_from_names`, with the
    after-save check's ``fingerprint`` and ``deep``). ``False``, with a warning, if unwritable: the coordinator then
    verifies the checkpoint whole."""
    try:
        write_plan(os.path.abspath(root), {**plan_from_names(root, hosts), "fingerprint": fingerprint, "deep": deep})
    except OSError as exc:  # the save stands
        warnings.warn(f"{root}: its verification cannot be shared out among nodes ({type(exc).__name__}: {exc}); "
                      "the coordinator verifies it whole", CkptVerifyWarning, stacklevel=3)
        return False
    return True


def part_verdict_path(root: str, node: int) -> str:
    return os.path.join(root, f"{PARTS_PREFIX}-{int(node)}.json")


def read_json(path: str, limit: int = MAX_BYTES) -> dict[str, Any] | None:
    """The JSON object in the small regular file ``path`` (at most ``limit`` bytes), else ``None``."""
    try:
        data = safejson.loads(read_small_file(path, limit))
    except (OSError, ValueError, UnicodeDecodeError):
        return None
    return data if isinstance(data, dict) else None


def read_plan(root: str) -> dict[str, Any] | None:
    """The plan in the checkpoint folder ``root``, when there is a readable one (else ``None``)."""
    data = read_json(os.path.join(root, PARTS_PLAN))
    if data is None or data.get("schema") != PLAN_SCHEMA or not isinstance(data.get("nodes"), list):
        return None
    nodes = data["nodes"]
    ok = all(isinstance(n, dict) and isinstance(n.get("node"), int) and isinstance(n.get("files"), list)
             and all(isinstance(f, str) for f in n["files"]) for n in nodes)
    return data if ok and isinstance(data.get("save_id"), str) else None


