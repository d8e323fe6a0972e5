"""``fingerprint``: adopt an existing checkpoint (torchtitan, Megatron, plain ``dcp.save``, ...) by writing its
manifest.

It is verified first; one that fails is refused, never blessed. Then every item, block, file and metadata file is
digested and every tensor fingerprinted from its description (:mod:`ckptverify.formats.describe`), and the
manifest written atomically. The only command that writes into a checkpoint, and only its manifest.
"""

from __future__ import annotations

import datetime as _dt
import os
import re
import time
from typing import Any

from ckptverify.checks.dcp_pipeline import (
    UNCHECKABLE,
    Executor,
    ProgressSink,
    VerificationRun,
    changed_finding,
    changed_under,
    default_jobs,
)
from ckptverify.errors import CheckpointNotFoundError, CkptVerifyError, FileChangedError
from ckptverify.findings import CheckCoverage, Finding, Location, Report, error, info, merge_coverage, merge_reports
from ckptverify.fingerprint.nonfinite import counts_kept
from ckptverify.ownfiles.manifest import (
    DEFAULT_BLOCK_BYTES,
    MANIFEST_FILE,
    FileEntry,
    Manifest,
    TensorEntry,
    check_settings,
    write_manifest,
)
from ckptverify.safeparse import paths
from ckptverify.safeparse.gcpause import paused_gc

_RANK_FILE = re.compile(r"^__(\d+)_\d+\.distcp$")


def fingerprint_checkpoint(path: str | os.PathLike[str], *, digest: str = "xxh3-128",
                           block_bytes: int = DEFAULT_BLOCK_BYTES, force: bool = False, jobs: int | None = None,
                           trust_uncheckable: bool = False, progress: ProgressSink | None = None,
                           executor: Executor | None = None,
                           parts: list[tuple[frozenset[str], Report]] | None = None) -> tuple[Report, Manifest | None]:
    """Verify the checkpoint at ``path`` and, if it passes, write its manifest. Returns the report and the manifest
    (``None`` when refused).

    Content verification could not check (no CRC-32) is refused unless ``trust_uncheckable`` (the report names it
    either way). ``executor``: share a DCP checkpoint's reads among ranks (:mod:`ckptverify.cluster`), same manifest.
    ``parts``: other nodes' files (not opened here) with their verification; their tensor pieces and work units'
    results come through ``executor`` (:class:`~ckptverify.cluster.recorded.Recorded`).
    Raises :class:`~ckptverify.errors.CkptVerifyError` (a manifest exists without ``force``, or its path is not a
    regular file), ``ValueError`` (parts cannot be merged),
    :class:`~ckptverify.errors.UsageError` (bad arguments).
    """
    root = os.fspath(path)
    check_settings(digest, block_bytes)
    if not paths.lexists(root):
        raise CheckpointNotFoundError(f"checkpoint path does not exist: {root}")
    single = not paths.isdir(root)
    manifest_path = file_manifest_path(root) if single else os.path.join(root, MANIFEST_FILE)
    if paths.lexists(manifest_path):
        if not force:
            raise CkptVerifyError(f"{manifest_path} exists; pass --force to replace it")
        if paths.islink(manifest_path) or not paths.isfile(manifest_path):
            raise CkptVerifyError(f"{manifest_path} exists and is not a regular file (a directory, link or "
                                      "special file); it is not replaced: remove it by hand if it is yours")

    started = time.perf_counter()
    from ckptverify.audit.verify import _other_format

    if single or _other_format(root)[0] == "folder":
        return _fingerprint_described(root, digest=digest, block_bytes=block_bytes, force=force, jobs=jobs,
                                      trust_uncheckable=trust_uncheckable, started=started)
    skip = frozenset(f for files, _ in parts or () for f in files)
    # The digest pass and the scan read the small files again (hold_kept).
    run = VerificationRun(root, jobs or default_jobs(), progress, skip=skip, executor=executor,
                          hold_kept=executor is None)
    try:
        # Many small acyclic objects (see gcpause): a third of the time of 100 000 items without the pause.
        with paused_gc():
            run.execute(deep=False, use_manifest=False)
            checked = run.report("fingerprint", time.perf_counter() - started)
            if parts is not None:
                here, opened = checked.stats.get("bytes"), run.opened_files()
                checked = merge_reports("fingerprint", root, [checked, *(report for _, report in parts)])
                # What this process read; the rest was read by the parts, each on its node.
                checked.stats.update(bytes_read_here=here, opened=opened)
            if not checked.passed:
                return _refusal(checked, _FAILS), None
            uncheckable = [f for f in checked.findings if f.check == UNCHECKABLE]
            if uncheckable and not trust_uncheckable:
                return _refusal(checked, _unchecked(uncheckable, "no CRC-32")), None
            desc = run.description()
            if progress is not None:
                progress.start(sum(i.length for i in desc.stored))
            entries, files, scans, replica_findings = run.digests(desc, digest=digest, block_bytes=block_bytes,
                                                                  executor=executor)
            metadata = {n: _metadata_entry(root, n, digest) for n in desc.metadata_files}
            if replica_findings:
                return _refusal(checked, "replicas of a chunk differ; refusing to write a manifest that would bless "
                                "the checkpoint", *replica_findings), None
            tensors, unfingerprinted = _tensor_entries(desc, scans)
            ranks = {int(m.group(1)) for n in files if (m := _RANK_FILE.match(n))}
            manifest = _manifest(digest_algorithm=digest, block_bytes=block_bytes, items=tuple(entries), files=files,
                                 tensors=tensors, metadata_files=metadata, world_size=max(ranks) + 1 if ranks else 1)
            changed = run.changed_files()
            if changed:
                return _refusal(checked, f"files changed while they were digested; {_GONE}", *changed), None
            written = write_manifest(root, manifest)
    except FileChangedError as exc:
        return _refusal(checked, f"a file changed while it was digested; {_GONE}", changed_under(root, exc)), None
    finally:
        run.close()
    notes = [info("manifest-written",
                  f"wrote {written}: {len(entries)} items, {len(files)} files, "
                  f"{len(tensors) - unfingerprinted} of {len(tensors)} tensors fingerprinted",
                  location=Location(file=MANIFEST_FILE))]
    if unfingerprinted:
        notes.append(info("fingerprint", f"{unfingerprinted} tensor(s) could not be rebuilt from their bytes "
                          "(e.g. safetensors format) and carry no logical fingerprint; their bytes are digested",
                          location=Location(file=MANIFEST_FILE)))
    coverage = (*checked.coverage, CheckCoverage(check="manifest-digest", count=len(entries), unit="items"))
    notes.extend(_trusted(uncheckable, MANIFEST_FILE))
    findings = tuple(f for f in checked.findings if f.check != "manifest-absent") + tuple(notes)
    return Report(command="fingerprint", target=root, findings=findings, coverage=merge_coverage(coverage),
                  stats=checked.stats), manifest


def _tensor_entries(desc: Any, scans: dict[str, Any]) -> tuple[dict[str, TensorEntry], int]:
    """The manifest's entry of each tensor of ``desc`` from its scan, and how many non-empty ones have no fingerprint.
    """
    tensors: dict[str, TensorEntry] = {}
    unfingerprinted = 0
    for fqn, tinfo in desc.tensors.items():
        scan = scans.get(fqn)
        value = scan.value(tinfo.shape) if scan is not None else None
        if value is None and 0 not in tinfo.shape:
            unfingerprinted += 1
        inner = tuple(scan.part_values.items()) if scan is not None and scan.part_values and value else None
        # The counts as a save keeps them: for the dtypes it counts, and only once every chunk was counted.
        counted = scan is not None and counts_kept(tinfo.dtype) and not scan.uncounted
        tensors[fqn] = TensorEntry(dtype=tinfo.dtype, shape=tinfo.shape, fingerprint=value,
                                   nan_count=scan.nan if counted else None,
                                   inf_count=scan.inf if counted else None, parts=inner)
    return tensors, unfingerprinted


def _manifest(**fields: Any) -> Manifest:
    """A manifest of ``fields`` as ``fingerprint`` writes it now (versions, time, source)."""
    from ckptverify._version import __version__
    from ckptverify.fingerprint import FINGERPRINT_VERSION

    return Manifest(**fields, fingerprint_version=FINGERPRINT_VERSION, tool_version=__version__,
                    created=_dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"), torch_version=torch_version(),
                    source="fingerprint")


_TORCH_VERSION_LINE = re.compile(r"""^__version__\s*=\s*['"]([^'"\\]+)['"]\s*$""", re.MULTILINE)


def torch_version() -> str:
    """``torch.__version__`` without importing torch (over a second) when not yet imported, from ``torch/version.py``;
    imports torch if that cannot be read."""
    import sys

    loaded = sys.modules.get("torch")
    if loaded is None:
        import importlib.util

        try:
            spec = importlib.util.find_spec("torch")
            where = list(spec.submodule_search_locations or []) if spec is not None else []
            if len(where) == 1:
                with open(os.path.join(where[0], "version.py"), encoding="utf-8") as f:
                    found = _TORCH_VERSION_LINE.findall(f.read(1 << 16))
                if len(found) == 1:
                    return found[0]
        except (OSError, ImportError, ValueError, UnicodeDecodeError):
            pass
        import torch as loaded
    return str(loaded.__version__)


_GONE = "refusing to write a manifest of bytes that are no longer on disk"
_FAILS = "the checkpoint fails verification; refusing to write a manifest that would bless it"


def _unchecked(uncheckable: list[Finding], unprotected: str) -> str:
    """The refusal of content nothing could check (``unprotected``: why not)."""
    return (f"{len(uncheckable)} finding(s) name content that nothing could check ({unprotected}); a manifest would "
            "bless it as it is now. Refused: pass --trust-uncheckable to adopt it anyway")


def _refusal(checked: Report, why: str, *more: Finding, where: str = MANIFEST_FILE) -> Report:
    """``checked`` with ``more`` findings and the ``fingerprint-refused`` error saying ``why`` (about ``where``)."""
    return Report(command="fingerprint", target=checked.target, findings=(
        *checked.findings, *more, error("fingerprint-refused", why, location=Location(file=where))),
        coverage=checked.coverage, stats=checked.stats)


def _trusted(uncheckable: list[Any], where: str) -> list[Finding]:
    """The note that content nothing could check was adopted as asked (none when there is none)."""
    return [info("fingerprint-trusted", f"adopted, as asked (--trust-uncheckable), content that nothing could check: "
                 f"{len(uncheckable)} uncheckable finding(s) above", location=Location(file=where))] if uncheckable \
        else []


def _metadata_entry(root: str, name: str, algorithm: str) -> FileEntry:
    """Size and digest of a metadata file, opened as a regular file inside the checkpoint only."""
    from ckptverify.fingerprint import digest_reader
    from ckptverify.safeparse.readers import ReadOnlyFile

    with ReadOnlyFile(os.path.join(root, name), root=root) as f:
        return FileEntry(size=f.size, digest=digest_reader(f, algorithm))


def file_manifest_path(path: str) -> str:
    """Where the manifest of the single checkpoint file ``path`` is written: beside it."""
    from ckptverify.ownfiles.manifest import file_manifest_name

    head, base = os.path.split(os.path.abspath(path))
    return os.path.join(head, file_manifest_name(base))


def _fingerprint_described(root: str, *, digest: str, block_bytes: int, force: bool, jobs: int | None,
                           trust_uncheckable: bool, started: float) -> tuple[Report, Manifest | None]:
    """Adopt a folder of checkpoint files or a single file: verified by each file's checks, then every file digested and
    every tensor payload digested and fingerprinted (:mod:`ckptverify.checks.described`). DCP sub-folders get their
    own manifests; a single file's goes beside it."""
    from ckptverify.audit.verify import _under, verify_checkpoint

    single = not os.path.isdir(root)
    # Findings about the manifest name the file it is (beside a single file, inside a folder).
    own = os.path.basename(file_manifest_path(root)) if single else MANIFEST_FILE
    verified = verify_checkpoint(root, jobs=jobs, use_manifest=False)
    findings = [f for f in verified.findings if f.check != "manifest-absent"]
    checked = Report(command="fingerprint", target=root, findings=tuple(findings), coverage=verified.coverage,
                     stats=verified.stats)
    if not checked.passed:
        return _refusal(checked, _FAILS, where=own), None
    uncheckable = [f for f in findings if f.check == UNCHECKABLE]
    if uncheckable and not trust_uncheckable:
        return _refusal(checked, _unchecked(uncheckable, "no checksum: safetensors, pickles"), where=own), None
    parts = list(checked.stats.get("parts") or [])
    for part in parts:  # each DCP part gets its own manifest, as `fingerprint PART` would write it
        sub, _ = fingerprint_checkpoint(os.path.join(root, part), digest=digest, block_bytes=block_bytes, force=force,
                                        jobs=jobs, trust_uncheckable=trust_uncheckable)
        if not sub.passed:
            return Report(command="fingerprint", target=root, findings=(*findings, *_under(part, sub.findings)),
                          coverage=checked.coverage, stats=checked.stats), None
    names = [os.path.basename(os.path.abspath(root))] if single else None
    written, manifest, missing, why = _described_manifest(root, names, own, digest, block_bytes)
    if manifest is None:
        return _refusal(verified, *why), None
    notes, coverage = _described_written(checked, written, manifest, missing, uncheckable, own,
                                         f", and a manifest in each of {len(parts)} DCP part(s)" if parts else "")
    stats = {**checked.stats, "seconds": round(time.perf_counter() - started, 6)}
    return Report(command="fingerprint", target=root, findings=(*findings, *notes),
                  coverage=merge_coverage(coverage), stats=stats), manifest


def _described_written(checked: Report, written: str, manifest: Manifest, missing: int, uncheckable: list[Finding],
                       where: str, also: str) -> tuple[list[Finding], tuple[CheckCoverage, ...]]:
    """The notes (``manifest-written``, ``also`` saying what more was written; ``fingerprint-trusted``) and coverage
    of a described manifest written at ``where`` after ``checked``, ``missing`` of its tensors unfingerprinted."""
    files, tensors = len(manifest.files), len(manifest.tensors)
    notes = [info("manifest-written", f"wrote {written}: {files} files, {len(manifest.items)} tensor payloads, "
                  f"{tensors - missing} of {tensors} tensors fingerprinted{also}", location=Location(file=where)),
             *_trusted(uncheckable, where)]
    return notes, (*checked.coverage, CheckCoverage(check="manifest-digest", count=files, unit="files"),
                   CheckCoverage(check="fingerprint", count=tensors - missing, unit="tensors"))


def _described_manifest(root: str, names: list[str] | None, own: str, digest: str,
                        block_bytes: int) -> tuple[str, Manifest | None, int, tuple[Any, ...]]:
    """The manifest of one file (``names``) or a folder's top files (``None``), written as ``own``: path, manifest,
    unfingerprinted count and ``()``; no manifest when a file changed or files came or went, with the refusal's words
    and findings instead."""
    from ckptverify.checks.described import manifest_entries
    from ckptverify.formats.describe import describe, folder_files

    try:
        desc = describe(root)
        listed = folder_files(root) if names is None else names
        files, items, tensors, missing = manifest_entries(desc, listed, digest, block_bytes)
        manifest = _manifest(digest_algorithm=digest, block_bytes=block_bytes, items=tuple(items), files=files,
                             tensors=tensors, world_size=1)
        if names is None and set(folder_files(root)) != set(listed):
            return "", None, missing, (f"files were added or removed while they were digested; {_GONE}",)
        return write_manifest(desc.root, manifest, name=own), manifest, missing, ()
    except FileChangedError as exc:
        return "", None, 0, (f"a file changed while it was digested; {_GONE}",
                             changed_finding(os.path.basename(str(exc.path)), str(exc)))


def fingerprint_folder_parts(path: str | os.PathLike[str], parts: dict[str, tuple[frozenset[str], Executor]],
                             brought: list[Report], elsewhere: list[tuple[frozenset[str], Report]], *,
                             read_elsewhere: bool,
                             jobs: int | None = None) -> tuple[Report, Manifest | None, list[str]]:
    """:func:`fingerprint_checkpoint` of a folder whose DCP folders several nodes wrote (default digest and blocks,
    uncheckable content trusted and noted, as the parts' records were made); top files and unclaimed shards are
    handled here.

    ``parts``: per DCP folder, the shards other nodes' parts read (not opened here) and the executor giving their
    work units' results; ``brought``: those parts' verification (names ``SUB/FILE``). ``elsewhere``: shards of nodes
    that brought no results, with their verification; such a folder is read whole and given a manifest
    when ``read_elsewhere`` or it holds a former manifest, else none (its shards are CRC-protected and were verified
    where written). Returns the report (``stats``: what was read here), the folder's manifest (``None`` if refused)
    and the DCP folders left without one.
    """
    from ckptverify.audit.verify import FINGERPRINT_ADVICE, _under, by_subfolder, verify_folder_files, verify_part

    root = os.fspath(path)
    if not paths.isdir(root):
        raise CheckpointNotFoundError(f"not a checkpoint directory: {root}")
    started = time.perf_counter()
    top, opened = verify_folder_files(root, use_manifest=False)
    dropped = ("manifest-absent", FINGERPRINT_ADVICE, "manifest-written")  # the parts' manifests: in the one note
    reports = [Report(command="fingerprint", target=root, coverage=top.coverage, stats=top.stats,
                      findings=tuple(f for f in top.findings if f.check not in dropped)), *brought]
    read_here = int(top.stats.get("bytes") or 0)
    subs = list(top.stats.get("parts") or [])
    theirs: dict[str, set[str]] = {}
    for files, _ in elsewhere:
        for sub, names in by_subfolder(files).items():
            theirs.setdefault(sub, set()).update(names)
    unwritten = [s for s in subs if theirs.get(s) and not read_elsewhere
                 and not paths.lexists(os.path.join(root, s, MANIFEST_FILE))]
    # Their own verification stands for the shards not read here.
    reports += [r for files, r in elsewhere if set(by_subfolder(files)) & set(unwritten)]
    for sub in unwritten:
        skip = theirs[sub] | set(parts[sub][0] if sub in parts else ())
        got = verify_part(os.path.join(root, sub), jobs=jobs, skip=frozenset(skip), use_manifest=False)
        read_here += int(got.stats.get("bytes") or 0)
        opened.extend(f"{sub}/{n}" for n in got.stats.get("opened") or [])
        reports.append(Report(command="fingerprint", target=root, coverage=got.coverage, stats=got.stats,
                              findings=tuple(_under(sub, (f for f in got.findings if f.check not in dropped)))))

    def result(findings: tuple[Any, ...], coverage: Any) -> Report:
        stats = {**reports[0].stats, "bytes_read_here": read_here, "opened": sorted(opened),
                 "seconds": round(time.perf_counter() - started, 6)}
        return Report(command="fingerprint", target=root, findings=findings, coverage=merge_coverage(coverage),
                      stats=stats)

    def refused(why: str, *more: Any) -> tuple[Report, None, list[str]]:
        merged = merge_reports("fingerprint", root, reports)
        return result((*merged.findings, *more, error("fingerprint-refused", why, location=Location(
            file=MANIFEST_FILE))), merged.coverage), None, unwritten

    # Every part's verification before any manifest is written: a failed one refuses them all.
    if not merge_reports("fingerprint", root, reports).passed:
        return refused(_FAILS)
    # Each other DCP folder gets its manifest, from its nodes' parts and what is read here.
    for sub in (s for s in subs if s not in unwritten):
        # The parts' verification is the folder's (``brought``): here only their files, pieces and units.
        files, executor = parts.get(sub, (frozenset(), None))
        got, manifest = fingerprint_checkpoint(os.path.join(root, sub), force=True, jobs=jobs, trust_uncheckable=True,
                                               executor=executor, parts=[(files, Report(command="fingerprint",
                                                                                        target=root, findings=()))])
        read_here += int(got.stats.get("bytes_read_here") or 0)
        opened.extend(f"{sub}/{n}" for n in got.stats.get("opened") or [])
        reports.append(Report(command="fingerprint", target=root, coverage=got.coverage, stats=got.stats,
                              findings=tuple(_under(sub, (f for f in got.findings if f.check not in dropped)))))
        if manifest is None:
            merged = merge_reports("fingerprint", root, reports)
            return result(merged.findings, merged.coverage), None, unwritten
    checked = merge_reports("fingerprint", root, reports)
    uncheckable = [f for f in checked.findings if f.check == UNCHECKABLE]
    written, manifest, missing, why = _described_manifest(root, None, MANIFEST_FILE, "xxh3-128", DEFAULT_BLOCK_BYTES)
    if manifest is None:
        return refused(*why)
    also = f", and a manifest in each of {len(subs) - len(unwritten)} DCP part(s)"
    if unwritten:
        also += (f"; none in {', '.join(unwritten)}: their shards, under CRC-32, were verified on the nodes that "
                 "wrote them")
    notes, coverage = _described_written(checked, written, manifest, missing, uncheckable, MANIFEST_FILE, also)
    return result((*checked.findings, *notes), coverage), manifest, unwritten
