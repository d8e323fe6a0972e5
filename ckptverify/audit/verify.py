"""``verify``: what a path is, and which checks judge it. Routed by content (:mod:`ckptverify.formats.rundir`): DCP
through :mod:`ckptverify.checks.dcp_pipeline`; single files and folders of files through their own and
description checks; folders holding DCP parts through both; a run directory is refused (use ``scan``). Nothing is
ever written into the checkpoint."""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable
from typing import Any

from ckptverify.checks.dcp_pipeline import (
    UNCHECKABLE,
    Executor,
    ProgressSink,
    VerificationRun,
    cap_findings,
    default_jobs,
)
from ckptverify.errors import CheckpointNotFoundError, UsageError
from ckptverify.findings import Finding, Report, Severity, info, merge_coverage, merge_reports
from ckptverify.safeparse import paths

__all__ = ["FINGERPRINT_ADVICE", "by_subfolder", "each_shard_folder", "fail_uncheckable", "needs_manifest",
           "verify_checkpoint", "verify_folder_files", "verify_part"]


def verify_checkpoint(path: str | os.PathLike[str], *, jobs: int | None = None, deep: bool = False,
                      use_manifest: bool = True, strict: bool = False,
                      progress: ProgressSink | None = None, executor: Executor | None = None) -> Report:
    """Verify the checkpoint at ``path`` and return a report of findings.

    ``path``: a DCP directory, a single ``torch.save``/safetensors file, or a folder of them (``docs/formats.md``);
    may be a URL (``docs/storage.md``). ``jobs``: workers (default one per core). ``use_manifest``: compare with every
    covering manifest (``docs/manifest.md``). ``deep``: rebuild every tensor and compare fingerprints (and count
    NaN/Inf). ``strict``: uncheckable content is an error, not a warning. ``executor``: share a DCP checkpoint's
    hashing among ranks (same findings). Raises :class:`~ckptverify.errors.CheckpointNotFoundError` (missing) and
    :class:`~ckptverify.errors.UsageError` (bad arguments, a run directory); problems *with* the checkpoint are
    findings, never exceptions.
    """
    root = os.fspath(path)
    url = paths.is_url(root)
    if url:  # trust nothing cached, and count requests, bytes and retries in stats["storage"]
        from ckptverify.safeparse import remote

        remote.forget(root)
        before = remote.stats()
    if jobs is not None and jobs < 1:
        raise UsageError(f"--jobs must be at least 1, got {jobs}")
    if not paths.lexists(root):
        raise CheckpointNotFoundError(f"checkpoint path does not exist: {root}")
    started = time.perf_counter()
    other, found, unseen = _other_format(root) if paths.isdir(root) else ("file", [], False)
    if other == "run-directory":
        newest = next((c for c in reversed(found) if c.step is not None), found[-1])
        held = f"{len(found)} checkpoint(s)" if not unseen else f"at least {len(found)} checkpoint(s)"
        raise UsageError(f"{root} is a run directory holding {held} (newest seen: {newest.path}), "
                         f"not a checkpoint: name one of them, or run `ckptverify scan {root}` for all")
    if other == "file":
        report = _verify_file(root, started, deep, use_manifest)
    elif other is not None:
        report = _verify_folder(root, jobs, deep, use_manifest, started)
    else:
        # One worker per core; for a URL at least remote.JOBS (network-bound).
        workers = jobs or (max(default_jobs(), remote.JOBS) if url else default_jobs())
        run = VerificationRun(root, workers, progress, executor=executor)
        report = _executed(run, deep, use_manifest, started)
        if use_manifest:
            advice = _fingerprint_advice(root, list(report.findings), bool(report.stats.get("manifest")))
            report = dataclasses.replace(report, findings=(*report.findings, *advice))
    if url:
        after = remote.stats()
        storage = {k: after[k] - before[k] for k in after}
        report = dataclasses.replace(report, stats={**report.stats, "storage": storage})
    return fail_uncheckable(report) if strict else report


def _executed(run: VerificationRun, deep: bool, use_manifest: bool, started: float) -> Report:
    """``run`` executed (and closed): its report."""
    try:
        run.execute(deep=deep, use_manifest=use_manifest)
    finally:
        run.close()
    return run.report("verify", time.perf_counter() - started)


def needs_manifest(report: Report) -> bool:
    """Whether ``report`` passed without a manifest over content nothing could check (``fingerprint="auto"`` then
    writes one)."""
    return report.passed and not report.stats.get("manifest") and any(f.check == UNCHECKABLE
                                                                      for f in report.findings)


def verify_part(path: str | os.PathLike[str], *, jobs: int | None = None, only: frozenset[str] | None = None,
                skip: frozenset[str] = frozenset(), use_manifest: bool = True, deep: bool = False,
                executors: dict[str, Executor | None] | None = None) -> Report:
    """One part of a DCP verification shared among nodes: ``only`` (byte-level checks of those files) or ``skip`` (all
    but those); see :class:`~ckptverify.checks.dcp_pipeline.VerificationRun`. ``stats["bytes"]``/``["opened"]``: this
    part's files. ``deep`` with ``skip``: the ``skip`` files' tensor pieces come through ``executors`` (by DCP folder,
    ``""`` for the checkpoint itself), every tensor judged as one process judges it.

    In a folder whose DCP sub-folders several nodes wrote, names are ``SUB/FILE``; its top-level files belong to the
    ``skip`` side, so nothing goes unchecked."""
    root = os.fspath(path)
    if not os.path.isdir(root):
        raise CheckpointNotFoundError(f"not a checkpoint directory: {root}")
    started = time.perf_counter()
    executors = executors or {}
    if not os.path.isfile(os.path.join(root, ".metadata")) and _other_format(root)[0] == "folder":
        if only is None:
            return _verify_folder(root, jobs, deep, use_manifest, started, skip=by_subfolder(skip),
                                  executors=executors)
        report, _ = each_shard_folder(root, only, "verify", lambda where, names: (verify_part(
            where, jobs=jobs, only=names, use_manifest=use_manifest, deep=deep), None))
        report.stats["deep"] = deep
        return report
    run = VerificationRun(root, jobs or default_jobs(), None, only=only, skip=skip, executor=executors.get(""))
    report = _executed(run, deep, use_manifest, started)
    # Named also when this part skips nothing (every other node's ranks wrote no file).
    report.stats["opened"] = run.opened_files()
    return report


def each_shard_folder(root: str, only: frozenset[str], command: str,
                      run: Callable[[str, frozenset[str]], tuple[Report, Any]]) -> tuple[Report, dict[str, Any]]:
    """``run(SUB_PATH, FILES)`` on each DCP sub-folder ``only`` gives files in (other names ignored). Returns the merged
    report as the folder's (names ``SUB/FILE``, ``stats["format"]`` ``"folder"``, ``["seconds"]`` of the whole) and
    ``run``'s extras by sub-folder."""
    from ckptverify.ownfiles.partsplan import dcp_folders

    started = time.perf_counter()
    by_sub = by_subfolder(only)
    reports = []
    got: dict[str, Any] = {}
    for sub in dcp_folders(root):  # only these: a name cannot lead a part out of the folder
        if sub in by_sub:
            report, got[sub] = run(os.path.join(root, sub), by_sub[sub])
            reports.append(dataclasses.replace(report, findings=tuple(_under(sub, report.findings)), stats={
                **report.stats, "opened": [f"{sub}/{n}" for n in report.stats.get("opened") or []]}))
    merged = merge_reports(command, root, reports)
    merged.stats.update({"format": "folder", "opened": sorted(n for r in reports for n in r.stats["opened"]),
                         "seconds": round(time.perf_counter() - started, 6)})
    return merged, got


def by_subfolder(names: frozenset[str]) -> dict[str, frozenset[str]]:
    """``SUB/FILE`` names as ``{SUB: {FILE, ...}}``; other names left out."""
    out: dict[str, set[str]] = {}
    for name in names:
        sub, sep, rest = name.partition("/")
        if sep and sub and rest and "/" not in rest:
            out.setdefault(sub, set()).add(rest)
    return {sub: frozenset(files) for sub, files in out.items()}


def _under(sub: str, findings: Any) -> list[Finding]:
    """``findings`` of the DCP sub-folder ``sub`` as its folder reports them: their file as ``SUB/FILE``."""
    return [dataclasses.replace(f, location=dataclasses.replace(f.location, file=f"{sub}/{f.location.file or ''}"))
            for f in findings]


def _other_format(root: str) -> tuple[str | None, list[Any], bool]:
    """``None`` for DCP (or torn DCP), ``"folder"`` for a folder of files, ``"run-directory"`` (with the checkpoints
    found: the walk is done once); and whether the walk missed anything."""
    from ckptverify.formats.rundir import DCP_FORMATS, dir_format, find_checkpoints, is_dcp

    try:
        names = paths.listdir(root)
    except OSError:
        return None, [], False
    fmt = dir_format(names)
    if fmt in DCP_FORMATS:
        return None, [], False
    from ckptverify.checks.folder import CHECKPOINT_SUFFIXES  # only past DCP: a plain verify skips its imports

    if fmt is not None or any(n.endswith(CHECKPOINT_SUFFIXES) for n in names):
        return "folder", [], False
    subdirs = [n for n in names if paths.isdir(os.path.join(root, n)) and not paths.islink(os.path.join(root, n))]
    if any(is_dcp(os.path.join(root, n)) for n in subdirs):
        # DCP folders beside each other: the parts of one checkpoint (model + optimizer) when the folder's own
        # name carries a step, else a run directory.
        from ckptverify.formats.rundir import step_of

        if step_of(os.path.basename(os.path.normpath(root))) is not None and len(subdirs) <= 8:
            return "folder", [], False
    notes: list[Any] = []
    found = find_checkpoints(root, notes=notes)
    return ("run-directory" if found else None), found, bool(notes)


def _verify_file(path: str, started: float, deep: bool = False, use_manifest: bool = True) -> Report:
    """A single file, judged by content and by its own manifest beside it."""
    from ckptverify.checks.single import check_file

    found, coverage, facts = check_file(path, root=os.path.dirname(os.path.abspath(path)))
    report = _judged(path, found, coverage, facts, started, deep, use_manifest, files=1, bytes=facts.get("bytes", 0),
                     format=facts.get("format"), tensors=len(facts.get("tensors", {})))
    return dataclasses.replace(report, findings=tuple(cap_findings(report.findings)))


def verify_folder_files(root: str | os.PathLike[str], *, deep: bool = False,
                        use_manifest: bool = True) -> tuple[Report, list[str]]:
    """A folder of checkpoint files without its DCP sub-folders (named in ``stats["parts"]``): each file by content,
    against the folder's manifest and its own (``docs/manifest.md``); and the names of the files it checked."""
    from ckptverify.checks.folder import check_folder

    started = time.perf_counter()
    path = os.fspath(root)
    found, coverage, facts = check_folder(path)
    return _judged(path, found, coverage, facts, started, deep, use_manifest, files=len(facts["files"]),
                   bytes=facts.get("bytes", 0), format="folder", parts=facts["dcp_parts"]), sorted(facts["files"])


def _judged(path: str, found: list[Finding], coverage: list[Any], facts: dict[str, Any], started: float, deep: bool,
            use_manifest: bool, **counted: Any) -> Report:
    """The report on a file or folder of files after its content checks (``found``, ``coverage``, ``facts``): its
    manifests' and deep stages (:func:`~ckptverify.checks.described.judge_described`, from the reads
    ``facts["description"]``) added; ``counted`` as :func:`_stats` takes it."""
    from ckptverify.checks.described import judge_described

    findings, added, with_manifest = judge_described(path, found, deep=deep, use_manifest=use_manifest,
                                                     described=facts.get("description"))
    if use_manifest:
        findings.extend(_fingerprint_advice(path, findings, with_manifest))
    return Report(command="verify", target=path, findings=tuple(findings), coverage=merge_coverage(
        [*coverage, *added]), stats=_stats(started, with_manifest, deep, **counted))


def _verify_folder(root: str, jobs: int | None, deep: bool, use_manifest: bool, started: float,
                   skip: dict[str, frozenset[str]] | None = None,
                   executors: dict[str, Executor | None] | None = None) -> Report:
    """A folder of files and its DCP sub-folders, each in full (part findings name the part). ``skip``: per sub-folder,
    files other parts check (their pieces through ``executors``, by sub-folder); ``stats["opened"]`` then names what
    was opened."""
    files, opened = verify_folder_files(root, deep=deep, use_manifest=use_manifest)
    findings = [f for f in files.findings if f.check != FINGERPRINT_ADVICE]  # one for the whole, below
    cover = list(files.coverage)
    total = int(files.stats.get("bytes", 0) or 0)
    with_manifest = bool(files.stats.get("manifest"))
    for part in files.stats["parts"]:
        where = os.path.join(root, part)
        if skip is None:
            sub = verify_checkpoint(where, jobs=jobs, deep=deep, use_manifest=use_manifest)
        else:
            sub = verify_part(where, jobs=jobs, skip=skip.get(part, frozenset()), use_manifest=use_manifest, deep=deep,
                              executors={"": (executors or {}).get(part)})
        findings.extend(_under(part, (f for f in sub.findings if f.check != FINGERPRINT_ADVICE)))
        opened.extend(f"{part}/{n}" for n in sub.stats.get("opened") or [])
        cover.extend(sub.coverage)
        total += int(sub.stats.get("bytes", 0) or 0)
        with_manifest = with_manifest and bool(sub.stats.get("manifest"))
    if use_manifest:
        findings.extend(_fingerprint_advice(root, findings, with_manifest))
    stats = _stats(started, with_manifest, deep, files=files.stats["files"], bytes=total, format="folder",
                   parts=files.stats["parts"])
    if skip is not None:
        stats["opened"] = sorted(opened)
    return Report(command="verify", target=root, findings=tuple(cap_findings(findings)),
                  coverage=merge_coverage(cover), stats=stats)


def _stats(started: float, with_manifest: bool, deep: bool, **counted: Any) -> dict[str, Any]:
    """A report's ``stats`` of a file or folder verification begun at ``started``: ``counted`` (``files``, ``bytes``,
    ``format``, then any more, in that order) with the throughput after ``bytes``."""
    seconds = time.perf_counter() - started
    files, nbytes = counted.pop("files"), counted.pop("bytes")
    return {"seconds": round(seconds, 6), "files": files, "bytes": nbytes,
            "throughput_bytes_per_s": round(nbytes / seconds) if nbytes and seconds > 0 else None, **counted,
            "manifest": with_manifest, "deep": deep}


#: The advice that ``fingerprint`` would protect content nothing can check now.
FINGERPRINT_ADVICE = "fingerprint-advice"


def _fingerprint_advice(path: str, findings: list[Finding], with_manifest: bool) -> list[Finding]:
    """An ``info`` that ``fingerprint`` would protect unchecked content: only with ``content-uncheckable`` and no error
    (damage is never blessed). A manifest protects bytes from then on, proving nothing about them now."""
    unchecked = [f for f in findings if f.check == UNCHECKABLE]
    if not unchecked or with_manifest or any(f.severity.value == "error" for f in findings):
        return []
    return [info(FINGERPRINT_ADVICE, f"`ckptverify fingerprint {path} --trust-uncheckable` would protect the "
                 f"content without a checksum ({len(unchecked)} finding(s) above) from now on: later verifies check "
                 "it byte for byte (it vouches for the bytes as they are now, not as they were saved)")]


def fail_uncheckable(report: Report) -> Report:
    """``report`` with every ``content-uncheckable`` warning raised to an error (fail closed)."""
    findings = tuple(
        dataclasses.replace(f, severity=Severity.ERROR,
                            message=f"{f.message} (an error under --strict: unchecked content fails)")
        if f.check == UNCHECKABLE and f.severity is Severity.WARNING else f
        for f in report.findings
    )
    return dataclasses.replace(report, findings=findings)
