"""Checks on a format's description alone (:mod:`ckptverify.formats.describe`): a folder's manifest (write,
compare) and the deep check.

A folder manifest pins every regular file (size, digest) and every tensor payload (byte range, block digests,
logical fingerprint; a tensor subclass per part), so damage is blamed on tensor, part and block. Formats without
their own checksum are protected from the moment it is written.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
from collections import defaultdict
from collections.abc import Callable, Mapping

from ckptverify.errors import ManifestError
from ckptverify.findings import CheckCoverage, Finding, Location, error, warning
from ckptverify.fingerprint import BlockDigest, digest_reader
from ckptverify.fingerprint.nonfinite import counts_kept
from ckptverify.formats.describe import Description, describe, folder_files, stored_part, stored_payloads
from ckptverify.ownfiles.manifest import FileEntry, ItemEntry, Manifest, TensorEntry
from ckptverify.safeparse import paths
from ckptverify.safeparse.readers import ReadOnlyFile

__all__ = ["check_manifest", "judge_described", "manifest_entries", "manifests_of"]


def manifest_entries(desc: Description, files: list[str], digest: str,
                     block_bytes: int) -> tuple[dict[str, FileEntry], list[ItemEntry], dict[str, TensorEntry], int]:
    """Digests of ``files`` and of every tensor payload (whole, per block), and each tensor's fingerprint and NaN/Inf
    counts. Returns files, items, tensors and the count not fingerprinted."""
    from ckptverify.checks.deep import scan_here

    entries: dict[str, FileEntry] = {}
    items: list[ItemEntry] = []
    for name in files:
        with ReadOnlyFile(os.path.join(desc.root, name), root=desc.root) as f:
            entries[name] = FileEntry(size=f.size, digest=digest_reader(f, digest))
            for t, p in ((tt, p) for tt in desc.tensors.values() for p in stored_payloads(tt) if p.file == name):
                d = BlockDigest(digest, block_bytes)
                f.fold(p.offset, p.offset + p.length, d.update)
                part = stored_part(t, p)  # each part of a tensor subclass is an item of its own
                fqn = t.name if part is None else f"{t.name}.{part}"
                items.append(ItemEntry(fqn=fqn, chunk_offsets=None, file=name, offset=p.offset,
                                       length=p.length, digest=d.hexdigest(), blocks=tuple(d.block_hexdigests())))
    # Fingerprints and NaN/Inf counts as the deep check rebuilds them; counts only for floating, non-empty tensors.
    scans, _ = scan_here(desc)
    tensors: dict[str, TensorEntry] = {}
    missing = 0
    for name, t in desc.tensors.items():
        scan = scans.get(name)
        fp = scan.value(t.shape) if scan is not None else None
        missing += fp is None and math.prod(t.shape) != 0
        counted = fp is not None and counts_kept(t.dtype) and not scan.uncounted and math.prod(t.shape) != 0
        tensors[name] = TensorEntry(dtype=t.dtype, shape=t.shape, fingerprint=fp,
                                    nan_count=scan.nan if counted else None, inf_count=scan.inf if counted else None,
                                    parts=tuple(scan.part_values.items()) if fp is not None and scan.part_values
                                    else None)
    return entries, items, tensors, missing


def check_manifest(desc: Description, manifest: Manifest) -> tuple[list[Finding], list[CheckCoverage]]:
    """Every pinned file against its digest; a changed file's payloads block by block. Returns findings and coverage.
    """
    from ckptverify.checks.manifest_check import compare_tensors, size_changed

    findings: list[Finding] = []
    by_file: dict[str, list[ItemEntry]] = defaultdict(list)
    for item in manifest.items:
        by_file[item.file].append(item)
    blocks = 0
    # A payload of a tensor subclass's part, by where it lies: a changed byte there is blamed on the part.
    held = {(p.file, p.offset, f"{t.name}.{part}"): f" (the {part!r} part of {t.name!r}, a "
            f"{t.subclass.cls.rsplit('.', 1)[-1]})"
            for t in desc.tensors.values() if t.subclass is not None
            for p in stored_payloads(t) if (part := stored_part(t, p)) is not None}
    for name, entry in sorted(manifest.files.items()):
        where = Location(file=name)
        try:
            f = ReadOnlyFile(os.path.join(desc.root, name), root=desc.root)
        except FileNotFoundError:
            findings.extend(size_changed(name, None, entry, when="fingerprinted"))
            continue
        except OSError as exc:
            findings.append(error("manifest-digest", f"{name} cannot be opened to compare with the manifest: {exc}",
                                  location=where))
            continue
        with f:
            if changed := size_changed(name, f.size, entry, when="fingerprinted"):
                findings.extend(changed)
                continue
            got = digest_reader(f, manifest.digest_algorithm)
            if got == entry.digest:
                continue
            blamed = 0
            for item in by_file.get(name, []):  # inside the file: validate pins each item within its file's size
                d = BlockDigest(manifest.digest_algorithm, manifest.block_bytes)
                f.fold(item.offset, item.offset + item.length, d.update)
                blocks += len(item.blocks)
                if d.hexdigest() == item.digest:
                    continue
                for n, (want, have) in enumerate(zip(item.blocks, d.block_hexdigests(), strict=False)):
                    if want != have:
                        start = item.offset + n * manifest.block_bytes
                        end = min(item.offset + item.length, start + manifest.block_bytes)
                        blamed += 1
                        findings.append(error(
                            "manifest-digest",
                            f"{item.fqn!r}{held.get((name, item.offset, item.fqn), '')}: bytes [{start}, {end}) "
                            f"of {name} differ from when they were fingerprinted",
                            location=Location(file=name, fqn=item.fqn, byte_range=(start, end)),
                            expected=want, actual=have))
            outside = "" if blamed else " (outside any tensor's bytes: its header, pickle or text)"
            findings.append(error("manifest-digest", f"{name} differs from when it was fingerprinted{outside}",
                                  location=where, expected=entry.digest, actual=got))
    added = set(folder_files(desc.root)) - set(manifest.files) if desc.format in ("folder", "dcp") else set()
    for name in sorted(added):
        findings.append(warning("manifest-unlisted", f"{name} was not there when the folder was fingerprinted: "
                                "added since (nothing vouches for it)", location=Location(file=name)))
    findings.extend(compare_tensors(manifest, {name: (t.dtype, t.shape) for name, t in desc.tensors.items()},
                                    when="fingerprinted"))
    coverage = [CheckCoverage(check="manifest-digest", count=len(manifest.files), unit="whole files")]
    if blocks:
        coverage.append(CheckCoverage(check="manifest-digest", count=blocks, unit="blocks"))
    return findings, coverage


def manifests_of(path: str) -> tuple[list[tuple[str, Manifest]], list[Finding]]:
    """Every manifest covering the file or folder at ``path`` (the rule of ``docs/manifest.md``): the folder's
    ``ckptverify.manifest.json``, and each file's own ``NAME.ckptverify.manifest.json``. Returns ``(target,
    manifest)`` pairs (orphan file manifests included: comparing reports the missing file) and a
    ``manifest-invalid`` error per untrustworthy manifest (refused whole)."""
    from ckptverify.formats.rundir import is_dcp
    from ckptverify.ownfiles.manifest import MANIFEST_FILE, file_manifest_name, read_manifest

    wanted: list[tuple[str, str, str | None]] = []  # (folder the manifest lies in, its name, file it pins)
    if paths.isdir(path):
        wanted.append((path, MANIFEST_FILE, None))
        try:
            names = sorted(paths.listdir(path))
        except OSError:
            names = []
        suffix = f".{MANIFEST_FILE}"
        wanted.extend((path, n, n[: -len(suffix)]) for n in names if n.endswith(suffix) and len(n) > len(suffix))
    else:
        where, base = os.path.split(paths.abspath(path))
        wanted.append((where, file_manifest_name(base), base))
        if paths.isdir(where) and not is_dcp(where):  # a DCP manifest pins shards and side files whole
            wanted.append((where, MANIFEST_FILE, base))  # the file's folder's manifest, for this file alone
    found: list[tuple[str, Manifest]] = []
    findings: list[Finding] = []
    for where, name, pinned in wanted:
        try:
            manifest = read_manifest(where, name=name)
            if manifest is not None and name == MANIFEST_FILE and pinned is not None:
                manifest = _for_one_file(manifest, pinned)
            elif manifest is not None and pinned is not None and set(manifest.files) != {pinned}:
                raise ManifestError(f"a single file's manifest must pin that file ({pinned!r}) and nothing else; "
                                    f"it pins {sorted(manifest.files)[:4]}")
        except ManifestError as exc:
            findings.append(error("manifest-invalid", f"{name} cannot be trusted: {exc}",
                                  location=Location(file=name)))
            continue
        if manifest is not None:
            found.append((where if pinned is None else os.path.join(where, pinned), manifest))
    return found, findings


def _for_one_file(manifest: Manifest, name: str) -> Manifest | None:
    """A folder manifest's entry for ``name`` in the file's own terms (``FILE:PATH`` -> ``PATH``); ``None`` if unlisted.
    """
    if name not in manifest.files:
        return None
    items = [i for i in manifest.items if i.file == name]
    fqns, prefix = {i.fqn for i in items}, f"{name}:"
    return dataclasses.replace(
        manifest, files={name: manifest.files[name]}, metadata_files={},
        items=tuple(dataclasses.replace(i, fqn=i.fqn.removeprefix(prefix)) for i in items),
        tensors={f.removeprefix(prefix): t for f, t in manifest.tensors.items() if f in fqns})


def judge_described(path: str, found: list[Finding], *, deep: bool, use_manifest: bool,
                    described: Callable[[], Description] | Mapping[str, Callable[[], Description]] | None = None,
                    ) -> tuple[list[Finding], list[CheckCoverage], bool]:
    """The manifest and deep stages of ``verify`` for a file or folder, after ``found``. Content a manifest checked is
    no longer ``content-uncheckable``. ``described``, from the reads that checked them: a single file's description,
    or a folder's files' by name (else each file is described here); each file is described once. Returns findings,
    added coverage, and whether manifests cover every file."""
    from ckptverify.checks.deep import judge_scans, scan_here

    findings = list(found)
    coverage: list[CheckCoverage] = []
    manifests, invalid = manifests_of(path) if use_manifest else ([], [])
    findings.extend(invalid)
    if not manifests and not deep:
        return findings, coverage, False
    covered: set[str] = set()
    folder = paths.isdir(path)
    # One description of each file serves every manifest and the deep check: in a folder, the folder's and the file's
    # own (its tensors named in the file's terms).
    files = {n: functools.cache(d) for n, d in described.items()} if isinstance(described, Mapping) else {}
    if folder:
        whole = functools.cache(functools.partial(describe, path, read=files))
    else:
        whole = functools.cache(described if callable(described) else functools.partial(describe, path))
    # Every tensor is rebuilt once; a file's own manifest in a folder finds its tensors' rebuilds by their stored pieces
    # (the folder may name them otherwise).
    scans, replicas = scan_here(whole()) if deep else ({}, [])
    by_pieces = {tuple(pieces): scans[n] for n, t in whole().tensors.items()
                 if n in scans and (pieces := stored_payloads(t))} if deep and folder else {}
    folder_manifest = None
    for target, manifest in manifests:
        if folder and target != path:
            desc = (files.get(os.path.basename(target)) or functools.partial(describe, target))()
        else:
            desc = whole()
            folder_manifest = manifest if folder else None
        checked, cov = check_manifest(desc, manifest)
        findings.extend(checked)
        coverage.extend(cov)
        covered |= {n for n in manifest.files if paths.lexists(os.path.join(desc.root, n))}
        if deep and folder and target != path:  # its fingerprints compared here; the folder's deep check judges
            own = {n: s for n, t in desc.tensors.items()
                   if (s := by_pieces.get(tuple(stored_payloads(t)))) is not None}
            more, _ = judge_scans(desc, manifest, own, [])
            findings.extend(f for f in more if f.check == "fingerprint" and f.expected is not None)
    # Content a manifest checked is no longer uncheckable: it was compared, and any change is an error above.
    # A file added to a fingerprinted folder is vouched for when its own manifest covers it.
    findings = [f for f in findings if not (f.check in ("content-uncheckable", "manifest-unlisted")
                                            and f.location.file in covered)]
    if deep:
        own_manifest = folder_manifest if folder else next((m for _, m in manifests), None)
        judged, rebuilt = judge_scans(whole(), own_manifest, scans, replicas)
        findings.extend(judged)
        coverage.append(CheckCoverage(check="fingerprint", count=rebuilt, unit="tensors"))
    every = set(folder_files(path)) if folder else {os.path.basename(paths.abspath(path))}
    return findings, coverage, bool(manifests) and every <= covered
