"""A save's verification shared among the nodes that wrote it: each node checks the files its ranks just wrote
(still in its page cache), and one stamp is written once every part reports (``docs/verify-after-save.md``).

Ranks exchange node names before the save (one node: nothing here happens). Once the save committed the coordinator
writes the plan (:func:`~ckptverify.ownfiles.partsplan.share_out`: per node its host, ranks and files). Each other
node's lowest rank runs a part (:func:`part_job`): byte-level checks of its files only, verdict written beside the
plan. The coordinator checks the whole checkpoint and its node's files, waits for the parts
(:func:`stamp_parts_locked`, up to :func:`part_timeout`), and stamps: passed if all passed; failed with a
``node-part-failed`` error per failed part; **unverified** naming nodes that never reported. With a manifest to
write, parts bring the adoption's work units with their results and the coordinator adopts as one process does
(:func:`_adopt`); with ``deep``, their tensor pieces' scans, and the coordinator verifies deeply as one process does
(:func:`_deep`): both with :class:`~ckptverify.cluster.recorded.Recorded` as executor, which also carries the scans
of the coordinator's own DCP tensor pieces from one of these runs to the next: each is scanned once. Judged before
the adoption, the deep check's scans are judged again against the manifest written (:func:`_rejudged`), not read.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import socket
import time
from collections.abc import Callable
from typing import Any

from ckptverify.ownfiles.names import PARTS_PLAN, STAMP_TEMP_PREFIX, write_atomic
from ckptverify.ownfiles.partsplan import dcp_folders, part_verdict_path, read_json, read_plan
from ckptverify.runs.stamp import SETTLE_SECONDS, committed, files_fingerprint, removed

__all__ = ["NODE_ENV", "PART_SCHEMA", "PART_TIMEOUT_ENV", "adoption_note", "node_name", "part_job", "part_timeout",
           "stamp_parts_locked"]

PART_SCHEMA = "ckptverify/part"
#: The node a rank runs on, when its host name does not say it (a container per rank; a test hook that
#: simulates several nodes on one machine); by default the host name (:func:`node_name`).
NODE_ENV = "CKPTVERIFY_NODE"
PART_TIMEOUT_ENV = "CKPTVERIFY_PART_TIMEOUT"
DEFAULT_PART_TIMEOUT = 1800.0
#: How long a node's part waits for the plan once the checkpoint has committed.
_PLAN_GRACE_SECONDS = 60.0
#: How often a waiting side looks for the plan or a part verdict.
_POLL_SECONDS = 0.1


def node_name() -> str:
    """This process's node: ``CKPTVERIFY_NODE`` if set, else the host name (with torchrun's ``GROUP_RANK`` when under
    torchrun: two agents on one host are two nodes)."""
    name = os.environ.get(NODE_ENV)
    if name:
        return name
    group = os.environ.get("GROUP_RANK")
    return socket.gethostname() + (f":{group}" if group else "")


def part_timeout() -> float:
    """Seconds the coordinator waits for other parts (``CKPTVERIFY_PART_TIMEOUT``, default 1800; unreadable: default).
    """
    from ckptverify.verifier.throttle import env_number

    return env_number(PART_TIMEOUT_ENV, DEFAULT_PART_TIMEOUT)


def _signatures(root: str, files: list[str]) -> dict[str, list[int] | None]:
    """(size, mtime, inode) of ``files`` by ``stat``: nothing is opened."""
    out: dict[str, list[int] | None] = {}
    for name in files:
        try:
            st = os.stat(os.path.join(root, name), follow_symlinks=False)
            out[name] = [st.st_size, st.st_mtime_ns, st.st_ino]
        except OSError:
            out[name] = None
    return out


def part_job(root: str, node: int, jobs: int = 1, wait_s: float | None = None) -> dict[str, Any]:
    """The ``verify-part`` job: wait (up to ``wait_s``, default :func:`part_timeout`) for ``root`` to commit with a
    plan, verify node ``node``'s files only, write its verdict. Returns what was written, or ``{"written": False,
    "why"}``."""
    deadline = time.monotonic() + (part_timeout() if wait_s is None else wait_s)
    plan = None
    while True:
        if _committed(root):
            plan = read_plan(root)
            # Once committed, a plan still missing after a grace time is not coming.
            deadline = min(deadline, time.monotonic() + _PLAN_GRACE_SECONDS) if plan is None else deadline
        if plan is not None or time.monotonic() >= deadline:
            break
        if not os.path.isdir(root):
            return {"written": False, "why": "the checkpoint was removed before its part was verified"}
        time.sleep(_POLL_SECONDS)
    if plan is None:
        return {"written": False, "why": f"no committed checkpoint with a plan ({PARTS_PLAN}) at {root}"}
    mine = next((n for n in plan["nodes"] if n["node"] == node), None)
    if mine is None:
        return {"written": False, "why": f"the plan of {root} has no node {node}"}
    files = list(mine["files"])
    started = time.perf_counter()
    before = _signatures(root, files)
    deep = checked = None
    if plan.get("deep") is True:  # its tensor pieces' scans, judged by the coordinator with the others'
        checked, deep = _recorded(root, frozenset(files), jobs, deep=True)
    report, adoption = _part_checks(root, frozenset(files), jobs, plan.get("fingerprint", False), checked)
    changed = _signatures(root, files) != before
    data = {"schema": PART_SCHEMA, "save_id": plan["save_id"], **_whose(mine), "passed": report.passed,
            "changed": changed, "signatures": before, "bytes": int(report.stats.get("bytes") or 0),
            "seconds": round(time.perf_counter() - started, 6), "report": report.to_dict()}
    data.update((k, v) for k, v in (("adoption", adoption), ("deep", deep)) if v is not None)
    try:
        write_atomic(part_verdict_path(root, node), json.dumps(data, default=str), prefix=STAMP_TEMP_PREFIX)
    except OSError as exc:
        return {"written": False, "why": f"cannot write the part verdict: {type(exc).__name__}: {exc}"}
    return {"written": True, "node": node, "passed": report.passed, "bytes": data["bytes"]}


def _one_dcp(root: str) -> bool:
    """Whether ``root`` is one DCP checkpoint (:func:`~ckptverify.ownfiles.partsplan.dcp_folders` gives ``[""]``), not
    a folder of them whose parts name files ``SUB/FILE``."""
    return os.path.isfile(os.path.join(root, ".metadata"))


def _committed(root: str) -> bool:
    """Whether the save at ``root`` finished: a committed DCP folder, or a folder whose DCP folders all committed."""

    if committed(root):
        return True
    where = dcp_folders(root)
    return bool(where) and "" not in where and all(committed(os.path.join(root, sub)) for sub in where)


def _part_checks(root: str, files: frozenset[str], jobs: int, fingerprint: Any,
                 checked: Any = None) -> tuple[Any, Any]:
    """A node's checks of ``files``: their verification (``checked`` if done already) and, when the save is
    fingerprinted (plan's ``fingerprint``: ``True``, or ``"auto"`` with a former manifest or unprotected content),
    the adoption's work units over them, with their results (:func:`~ckptverify.cluster.recorded.record`). A node
    with no files reports an empty part.
    """
    from ckptverify.audit.verify import by_subfolder, needs_manifest, verify_part
    from ckptverify.ownfiles.names import MANIFEST_FILE

    if not files:  # this node's ranks wrote nothing: nothing to check, and nothing found
        from ckptverify.findings import Report

        empty = Report(command="verify", target=root, findings=(), stats={"bytes": 0, "files": 0, "opened": []})
        return checked or empty, None
    # In a folder of checkpoint files the parts' files are DCP-folder shards ``SUB/FILE``: a manifest there
    # is a former save's (the top's files are the coordinator's).
    manifests = [MANIFEST_FILE] if _one_dcp(root) else [f"{sub}/{MANIFEST_FILE}" for sub in by_subfolder(files)]
    stale = fingerprint == "auto" and any(os.path.lexists(os.path.join(root, m)) for m in manifests)
    if fingerprint is not True and not stale:
        report = checked if checked is not None else verify_part(root, jobs=jobs, only=files)
        if fingerprint != "auto" or not needs_manifest(report):
            return report, None
    return _recorded(root, files, jobs, deep=False)


def _recorded(root: str, files: frozenset[str], jobs: int, deep: bool) -> tuple[Any, Any]:
    """:func:`~ckptverify.cluster.recorded.record` of ``files``; in a folder of checkpoint files, per DCP folder
    (``{"folders": {SUB: records}}``)."""
    from ckptverify.audit.verify import each_shard_folder
    from ckptverify.cluster.recorded import record

    if _one_dcp(root):
        return record(root, files, jobs, deep)
    report, by_sub = each_shard_folder(root, files, "verify" if deep else "fingerprint", lambda where, names: (
        dataclasses.replace((got := record(where, names, jobs, deep))[0], stats={**got[0].stats,
                                                                                  "opened": sorted(names)}), got[1]))
    return report, {"folders": by_sub}


def _part_summary(data: dict[str, Any], report: Any) -> dict[str, Any]:
    """A part as its stamp records it; ``failed_files``: its files that an error names."""
    files = set(data.get("files") or [])
    failed = sorted({f.location.file for f in report.errors if f.location.file in files})
    return {**{k: data.get(k) for k in ("node", "host", "ranks", "files", "bytes", "seconds")},
            "opened": report.stats.get("opened"),
            "verdict": "failed" if failed or not report.passed else "passed", "failed_files": failed}


def _whose(node: dict[str, Any]) -> dict[str, Any]:
    """Who wrote a part, from its node in the plan (not from what a verdict file claims): as stamps record it."""
    return {"node": node["node"], "host": node.get("host"), "ranks": node.get("ranks"), "files": node["files"]}


def _describe_node(node: dict[str, Any]) -> str:
    return f"node {node.get('node')} (host {node.get('host')}, ranks {node.get('ranks')})"


def stamp_parts_locked(path: str, *, step: int | None, jobs: int | None = None, settle: float = SETTLE_SECONDS,
                       throttle: Any = None, wait_s: float | None = None, deep: bool = False,
                       adopt: bool | Callable[[Any], bool] = False, notes: list[str] | None = None) -> Any:
    """The coordinator's side (caller holds the verifying lock): verify the whole checkpoint and this node's files,
    gather the other parts (up to ``wait_s``, default :func:`part_timeout`) and stamp the merged verdict. Returns a
    :class:`~ckptverify.verifier.verification.Verification`. Without a readable plan, verifies everything itself via
    :func:`~ckptverify.verifier.stamper.stamp_locked` (or returns ``None`` when ``adopt`` is set).

    ``adopt``: write the manifest from the parts (always, or when the merged report needs it) via
    :func:`~ckptverify.audit.adopt.fingerprint_checkpoint`, reading files of parts that brought none; notes go to
    ``notes``. ``deep``: once the parts reported, the deep check of one process with their tensor pieces' scans
    answered from their records (:func:`_deep`); a part without its records did not report.
    """
    from ckptverify.audit.verify import verify_part
    from ckptverify.findings import Report
    from ckptverify.safeparse.readers import pacing
    from ckptverify.verifier.stamper import GONE, stamp, stamp_locked, unmoved, unreadable
    from ckptverify.verifier.verification import unverified

    plan = read_plan(path)
    if plan is None or len(plan["nodes"]) < 2:
        if adopt:  # the caller checks it as on one node (fingerprinting it when needed)
            return None
        return stamp_locked(path, step=step, jobs=jobs, deep=deep, settle=settle, throttle=throttle)
    started = time.perf_counter()
    nodes = plan["nodes"]
    others = nodes[1:]
    other_files = frozenset(f for n in others for f in n["files"])
    records: dict[str, list[Any]] = {}  # the parts' deep records, by DCP folder ("" for the checkpoint itself)
    scanned: dict[str, list[Any]] = {}  # this node's tensor pieces as scanned here, by DCP folder: scanned once
    judges = None  # the deep check's executors, by DCP folder: they judge its scans again (_rejudged)
    try:
        before = files_fingerprint(path)
        mine = None
        if not deep and adopt is not True:  # while the parts run; deep, once they reported
            with pacing(throttle):
                mine = verify_part(path, jobs=jobs or 1, skip=other_files)
        reports: list[tuple[dict[str, Any], Report]] = []
        deadline = time.monotonic() + (part_timeout() if wait_s is None else wait_s)
        waiting = {n["node"]: n for n in others}
        got: dict[int, dict[str, Any]] = {}
        while waiting:
            for k in list(waiting):
                data = read_json(part_verdict_path(path, k))
                if data is not None and data.get("schema") == PART_SCHEMA and data.get("save_id") == plan["save_id"]:
                    got[k] = data
                    del waiting[k]
            if not waiting or time.monotonic() >= deadline:
                break
            if removed(path):
                return unverified(path, step, "deleted", GONE)
            time.sleep(_POLL_SECONDS)
        missing: list[dict[str, Any]] = [waiting[k] for k in sorted(waiting)]
        changed = False
        for k in sorted(got):
            node = next(n for n in others if n["node"] == k)
            try:
                report = Report.from_dict(got[k]["report"])
            except Exception:  # a verdict file that is not one (damaged, planted): that part did not report
                missing.append(node)
                continue
            theirs = _part_records(path, got[k].get("deep"), node["files"]) if deep else {}
            if theirs is None:  # not what a deep part writes: its pieces were not checked
                missing.append(node)
                continue
            for sub, r in theirs.items():
                records.setdefault(sub, []).extend(r)
            # The plan, not the verdict file, says whose files these are.
            data = {**got[k], **_whose(node)}
            # A part read its files at another time than this side: they must be the files it read.
            changed = changed or bool(data.get("changed")) or _signatures(path, node["files"]) \
                != data.get("signatures")
            reports.append((data, report))
        if deep and adopt is not True:
            with pacing(throttle):
                mine, judges = _deep(path, jobs, other_files, records, True, scanned)
    except OSError as exc:
        return unreadable(path, step, exc)
    merged = parts = None
    if mine is not None:
        parts, merged = _summarize(path, nodes, mine, reports, mine.stats.get("bytes"))
    if adopt is True or (adopt and merged is not None and adopt(merged)):
        if missing:  # their files cannot go into a manifest unread
            return _silent(path, step, nodes, missing, wait_s)
        try:
            with pacing(throttle):
                adopted, note, written = _adopt(path, jobs, reports, scanned, read_all=adopt is True)
                if deep:  # judged against the manifest just written from the parts, or none: an older one left
                    # in the folder no longer describes it
                    adopted = _judged(adopted, _rejudged(path, jobs, other_files, records, written, scanned, judges))
        except OSError as exc:
            return unreadable(path, step, exc)
        if notes is not None:
            notes.append(note)
        # The fingerprint covers the new manifest; its files were change-checked by the adoption and signatures.
        before = files_fingerprint(path)
        parts, merged = _summarize(path, nodes, adopted, reports, adopted.stats.get("bytes_read_here"), whole=True)
    assert parts is not None and merged is not None
    if missing and merged.passed:
        # Not a pass: what those nodes wrote was not checked.
        return _silent(path, step, nodes, missing, wait_s)
    moved = unmoved(path, step, merged.passed, before, settle, changed=changed)
    if moved is not None:
        return moved
    for n in missing:  # a failed checkpoint is stamped failed; what was not checked is said with it
        parts.append({**_whose(n), "verdict": "unreported"})
    verdict = stamp(path, step, merged, before, started, throttle, parts=parts)
    if verdict.stamped:
        _tidy_parts(path, nodes)
    return verdict


def _part_records(path: str, data: Any, files: list[str] | frozenset[str],
                  pieces: bool = True) -> dict[str, list[Any]] | None:
    """A part's records (its ``"deep"`` or ``"adoption"``) by DCP folder (``""``: the checkpoint itself): exactly its
    files' folders, with ``pieces`` each piece in its files; ``None`` when they are not that (damaged, planted)."""
    from ckptverify.audit.verify import by_subfolder
    from ckptverify.cluster.recorded import records_of

    if _one_dcp(path):
        mine, got = {"": frozenset(files)}, {"": data}
    else:  # a folder of checkpoint files: by its DCP folders
        mine, got = by_subfolder(frozenset(files)), data.get("folders") if isinstance(data, dict) else None
    if not isinstance(got, dict) or set(got) != set(mine):
        return None
    out = {sub: records_of(got[sub], names if pieces else None) for sub, names in mine.items()}
    return None if any(r is None for r in out.values()) else out  # type: ignore[return-value]


def _deep(path: str, jobs: int | None, skip: frozenset[str], records: dict[str, list[Any]],
          use_manifest: bool, scanned: dict[str, list[Any]]) -> tuple[Any, dict[str, Any] | None]:
    """The deep verification of the whole checkpoint and this node's files, the ``skip`` files' tensor pieces answered
    from their parts' ``records`` (by DCP folder) and this node's from ``scanned``, to which those scanned here are
    added: the adoption scans none of them again. Every piece read here when they cannot be merged (a piece no part
    brought, a tensor subclass stored on another node). Returns the report and, unless read so, its executors by DCP
    folder (each DCP folder has one), which judge its scans again (:func:`_rejudged`)."""
    from ckptverify.audit.verify import verify_part

    executors = _executors({sub: records.get(sub, []) for sub in {*dcp_folders(path), *records}}, scanned)
    try:
        report = verify_part(path, jobs=jobs or 1, skip=skip, deep=True, use_manifest=use_manifest,
                             executors=executors)
    except ValueError:
        return verify_part(path, jobs=jobs or 1, deep=True, use_manifest=use_manifest), None
    _keep_scans(executors, scanned)
    return report, executors


def _rejudged(path: str, jobs: int | None, skip: frozenset[str], records: dict[str, list[Any]], written: bool,
              scanned: dict[str, list[Any]], judges: dict[str, Any] | None) -> Any:
    """The deep check (its findings and ``fingerprint`` coverage) against the manifest just ``written``, or none:
    each DCP folder's description and scans of :func:`_deep` judged again through its executor in ``judges``
    (:meth:`~ckptverify.cluster.recorded.Recorded.judge`), none of their bytes read again. A folder's own files are
    verified deeply again: their scans stay inside their verification
    (:func:`~ckptverify.audit.verify.verify_folder_files`). The deep verification is run here when there is nothing to
    judge again: no deep check before the adoption (``adopt=True``), pieces read whole, or a DCP folder whose scan did
    not finish."""
    from ckptverify.audit.verify import FINGERPRINT_ADVICE, _under, verify_folder_files
    from ckptverify.checks.dcp_pipeline import cap_findings
    from ckptverify.errors import ManifestError
    from ckptverify.findings import CheckCoverage, Report, merge_coverage
    from ckptverify.ownfiles.manifest import read_manifest

    def judged(sub: str, judges: dict[str, Any]) -> tuple[list[Any], CheckCoverage]:  # as its deep verification
        manifest = None
        if written:
            with contextlib.suppress(ManifestError):  # unreadable: judged against none, as it reads it
                manifest = read_manifest(os.path.join(path, sub))
        found, rebuilt = judges[sub].judge(manifest)
        return cap_findings(found), CheckCoverage(check="fingerprint", count=rebuilt, unit="tensors")

    def again(judges: dict[str, Any]) -> Any:
        if _one_dcp(path):
            findings, coverage = judged("", judges)
            return Report(command="verify", target=path, findings=tuple(findings), coverage=(coverage,))
        # Read again: the deep check keeps the scans of a folder's own files inside their verification
        # (judge_described), so only verifying them again judges them against the manifest written.
        top, _ = verify_folder_files(path, deep=True, use_manifest=written)
        out = [f for f in top.findings if f.check != FINGERPRINT_ADVICE]
        cover = list(top.coverage)
        for sub in top.stats["parts"]:
            findings, coverage = judged(sub, judges)
            out += _under(sub, findings)
            cover.append(coverage)
        return Report(command="verify", target=path, findings=tuple(cap_findings(out)), coverage=merge_coverage(cover))

    if judges is not None:
        with contextlib.suppress(LookupError):  # a DCP folder without its scan whole: verified deeply below
            return again(judges)
    return _deep(path, jobs, skip, records, written, scanned)[0]


def _executors(records: dict[str, list[Any]], scanned: dict[str, list[Any]]) -> dict[str, Any]:
    """A :class:`~ckptverify.cluster.recorded.Recorded` per DCP folder of ``records``, answering also this node's
    pieces ``scanned`` there already."""
    from ckptverify.cluster.recorded import Recorded

    return {sub: Recorded([*r, *scanned.get(sub, ())]) for sub, r in records.items()}


def _keep_scans(executors: dict[str, Any], scanned: dict[str, list[Any]]) -> None:
    """Add to ``scanned`` the pieces ``executors`` scanned here
    (:meth:`~ckptverify.cluster.recorded.Recorded.scanned_here`), for the next run over this node's files."""
    for sub, executor in executors.items():
        scanned.setdefault(sub, []).extend(executor.scanned_here())


def _judged(adopted: Any, deep: Any) -> Any:
    """The adoption's report with the deep check's findings (each once) and tensors rebuilt from ``deep``
    (:func:`_rejudged`, which also judged a folder's top-level files)."""
    from ckptverify.checks.deep import CHECKS
    from ckptverify.findings import Report

    seen = {json.dumps(f.to_dict(), sort_keys=True, default=str) for f in adopted.findings}
    more = [f for f in deep.findings if (f.check in CHECKS or f.check == "file-changed")
            and json.dumps(f.to_dict(), sort_keys=True, default=str) not in seen]
    return Report(command=adopted.command, target=adopted.target, findings=(*adopted.findings, *more),
                  coverage=(*(c for c in adopted.coverage if c.check != "fingerprint"),
                            *(c for c in deep.coverage if c.check == "fingerprint")),
                  stats={**adopted.stats, "deep": True})


def _silent(path: str, step: int | None, nodes: list[dict[str, Any]], missing: list[dict[str, Any]],
            wait_s: float | None) -> Any:
    """No verdict: the ``missing`` parts did not report, so their files are unchecked (the parts' files removed)."""
    from ckptverify.verifier.verification import unverified

    _tidy_parts(path, nodes)
    names = "; ".join(f"{_describe_node(n)}: {', '.join(n['files'])}" for n in missing)
    return unverified(path, step, "error", f"the part of {len(missing)} node(s) did not report within "
                      f"{part_timeout() if wait_s is None else wait_s} s, so their files are unchecked: {names}")


def _summarize(path: str, nodes: list[dict[str, Any]], mine: Any, reports: list[tuple[dict[str, Any], Any]],
               mine_bytes: Any, *, whole: bool = False) -> tuple[list[dict[str, Any]], Any]:
    """Every part as the stamp records it, and the merged report (``mine`` plus the others', a ``node-part-failed``
    error first per failed part). ``whole``: ``mine`` already holds the others' findings."""
    from ckptverify.findings import Report, error, merge_reports

    own_data = {**_whose(nodes[0]), "bytes": int(mine_bytes or 0), "seconds": mine.stats.get("seconds")}
    parts = [_part_summary(own_data, mine), *(_part_summary(d, r) for d, r in reports)]
    named: list[Any] = []
    for k, part in enumerate(parts):
        if k == 0 and not part["failed_files"]:
            # The coordinator's node is named only for errors in its own files, not whole-checkpoint ones.
            part["verdict"] = "passed"
        if part["verdict"] == "passed":
            continue
        files = ", ".join(part["failed_files"]) or "errors that name no file of its own"
        named.append(error("node-part-failed", f"the part of {_describe_node(part)} failed: {files}"))
    if whole:
        stats = {**mine.stats, "bytes": sum(int(p.get("bytes") or 0) for p in parts)}
        merged = Report(command="verify", target=path, findings=(*named, *mine.findings), coverage=mine.coverage,
                        stats=stats)
    else:
        merged = merge_reports("verify", path, [mine, *(r for _, r in reports)], first=named)
    merged.stats["parts"] = len(nodes)
    return parts, merged


def _adopt(path: str, jobs: int | None, reports: list[tuple[dict[str, Any], Any]], scanned: dict[str, list[Any]],
           read_all: bool = True) -> tuple[Any, str, bool]:
    """The manifest written as one process writes it, the parts' work units answered from their records (others'
    files read here; the whole when unmergeable) and this node's pieces from ``scanned`` (:func:`_deep`), to which
    those scanned here are added. Returns the adoption's report, what writing did, and whether written. Folders:
    :func:`_adopt_folder`."""
    from ckptverify.audit.adopt import fingerprint_checkpoint

    if not _one_dcp(path):
        return _adopt_folder(path, jobs, reports, scanned, read_all)
    parts, records = [], []
    for data, part in reports:
        got = _part_records(path, data.get("adoption"), data["files"], pieces=False)
        if got is not None:  # else none, or not what a part writes (damaged, planted): its files are read here
            parts.append((frozenset(data["files"]), part))
            records += got[""]
    executors = _executors({"": records}, scanned)
    try:
        report, manifest = fingerprint_checkpoint(path, force=True, jobs=jobs, trust_uncheckable=True,
                                                  executor=executors[""], parts=parts)
        _keep_scans(executors, scanned)
        how = f"the digests of {len(parts)} other node(s) taken from their parts"
    except (ValueError, TypeError, LookupError) as exc:  # parts that cannot be merged, or records no part writes
        report, manifest = fingerprint_checkpoint(path, force=True, jobs=jobs, trust_uncheckable=True, parts=[])
        how = f"read whole here: {exc}"
    if manifest is None:
        return (*_refusal(report), False)
    return report, f"{adoption_note(report, manifest)}; {how}", True


def adoption_note(report: Any, manifest: Any) -> str:
    """What an adoption (:func:`~ckptverify.audit.adopt.fingerprint_checkpoint`) did, as an event's ``fingerprint``
    note: the manifest written, or why none."""
    if manifest is None:
        return "no manifest: " + next((f.message for f in report.findings if f.check == "fingerprint-refused"),
                                      "refused")
    return (f"manifest written: {len(manifest.files)} files, {len(manifest.items)} items, "
            f"{len(manifest.tensors)} tensors")


def _refusal(report: Any) -> tuple[Any, str]:
    """An adoption that wrote no manifest: its report (without the refusal when another error says why) and the note."""
    causes = [f for f in report.findings if f.check != "fingerprint-refused"]
    note = adoption_note(report, None)
    if any(f.severity.value == "error" for f in causes):
        report = type(report)(command=report.command, target=report.target, findings=tuple(causes),
                              coverage=report.coverage, stats=report.stats)
    return report, note


def _adopt_folder(path: str, jobs: int | None, reports: list[tuple[dict[str, Any], Any]],
                  scanned: dict[str, list[Any]], read_all: bool) -> tuple[Any, str, bool]:
    """:func:`_adopt` for a folder whose DCP folders several nodes wrote
    (:func:`~ckptverify.audit.adopt.fingerprint_folder_parts`). Shards of a part that brought no digests are read
    here when ``read_all`` or their folder holds a former manifest; else that folder gets no manifest and the part's
    verification stands."""
    from ckptverify.audit.adopt import fingerprint_folder_parts
    from ckptverify.audit.verify import by_subfolder

    files_of: dict[str, set[str]] = {}
    records: dict[str, list[Any]] = {}
    brought: list[Any] = []
    elsewhere: list[tuple[frozenset[str], Any]] = []
    for data, report in reports:
        files = frozenset(data.get("files") or ())
        got = _part_records(path, data.get("adoption"), files, pieces=False)
        # Each of its folders exactly as the plan gives it, or it brought nothing usable: its files are read here or
        # its report stands.
        if not got:
            elsewhere.append((files, report))
            continue
        brought.append(report)
        for sub, names in by_subfolder(files).items():
            files_of.setdefault(sub, set()).update(names)
            records.setdefault(sub, []).extend(got[sub])
    executors = _executors(records, scanned)
    parts = {sub: (frozenset(names), executors[sub]) for sub, names in files_of.items()}
    try:
        report, manifest, unwritten = fingerprint_folder_parts(path, parts, brought, elsewhere,
                                                               read_elsewhere=read_all, jobs=jobs)
        _keep_scans(executors, scanned)
        overlap = None
    except (ValueError, TypeError, LookupError) as exc:  # parts that cannot be merged, or records no part writes
        every = [(frozenset(data.get("files") or ()), r) for data, r in reports]
        report, manifest, unwritten = fingerprint_folder_parts(path, {}, [], every, read_elsewhere=True, jobs=jobs)
        elsewhere, overlap = every, exc
    if manifest is None:
        return (*_refusal(report), False)
    adopted = len(report.stats.get("parts") or []) - len(unwritten)
    said = [f"manifest written: {len(manifest.files)} files at the top"]
    if adopted:
        taken = len(reports) - len(elsewhere)
        read = sum(1 for files, _ in elsewhere if set(by_subfolder(files)) - set(unwritten))
        said.append(f"a manifest in each of {adopted} DCP folder(s)"
                    + (f", the digests of {taken} other node(s) taken from their parts" if taken else "")
                    + (f", the shards of {read} other node(s) read here" if read and overlap is None else ""))
    if unwritten:
        said.append(f"none in {', '.join(unwritten)}: their shards, under CRC-32, were verified on the nodes "
                    "that wrote them")
    if overlap is not None:
        said.append(f"read whole here: {overlap}")
    return report, "; ".join(said), True


def _tidy_parts(root: str, nodes: list[dict[str, Any]]) -> None:
    """The plan and the part verdicts (of the plan's ``nodes``) are done with once the stamp records them."""
    for name in [PARTS_PLAN, *(os.path.basename(part_verdict_path(root, n["node"])) for n in nodes)]:
        with contextlib.suppress(OSError):
            os.unlink(os.path.join(root, name))
