"""``diff``: compare two checkpoints tensor by tensor and value by value, whatever their sharding or format.

Each side is read via its format's description, so DCP, ``dcp_to_torch_save`` and HF exports compare by name.
Tensors compare by logical fingerprint (a valid manifest's, else rebuilt); only differing ones are loaded, one at a
time, to say how they differ. Plain values compare exactly. Both sides are verified first; damaged tensors are not
compared. A tensor that could not be read back fails the comparison, and comparing nothing never passes.
``ignore``: globs left out on both sides (counted).
"""

from __future__ import annotations

import dataclasses
import fnmatch
import json
import logging
import math
import os
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ckptverify.checks import deep as deep_check
from ckptverify.checks.dcp_pipeline import ProgressSink, VerificationRun, cap_findings, default_jobs
from ckptverify.errors import CheckpointNotFoundError, FileChangedError, FindingError, UsageError
from ckptverify.findings import CheckCoverage, Finding, Location, Report, error, info, warning
from ckptverify.formats.describe import describe, read_parts, read_tensor
from ckptverify.safeparse import paths

if TYPE_CHECKING:
    import torch

    from ckptverify.formats.describe import Description, SubclassDesc


def diff_checkpoints(a: str | os.PathLike[str], b: str | os.PathLike[str], *, jobs: int | None = None,
                     progress: ProgressSink | None = None, ignore: Sequence[str] = (),
                     map_prefix: Sequence[str | tuple[str, str]] = ()) -> Report:
    """Compare checkpoints ``a`` and ``b`` (DCP folder, folder of files, or single file); exit code 0 when every tensor
    and value is bitwise equal and something was compared.

    ``map_prefix``: ``"A_PREFIX=B_PREFIX"`` strings or pairs; A's names starting with ``A_PREFIX`` are compared with
    B's names with ``B_PREFIX`` instead (longest prefix wins; one side may be empty). Raises
    :class:`~ckptverify.errors.UsageError` for a malformed mapping or one mapping two names of A onto one.
    """
    from ckptverify.formats.rundir import is_dcp

    mapping = parse_prefix_map(map_prefix)
    roots = (os.fspath(a), os.fspath(b))
    for root in roots:
        if not paths.lexists(root):
            raise CheckpointNotFoundError(f"checkpoint path does not exist: {root}")
    started = time.perf_counter()
    sides: list[_Side] = []
    findings: list[Finding] = []
    coverage: tuple[CheckCoverage, ...] = ()
    stats: dict[str, Any] = {}
    try:
        for tag, root in zip("AB", roots, strict=True):
            workers = jobs or default_jobs()
            side = _DcpSide(root, workers, progress) if is_dcp(root) else _DescribedSide(root, workers)
            sides.append(side)
            findings.extend(dataclasses.replace(f, message=f"[{tag}] {f.message}") for f in side.errors)
        found, coverage, stats = _compare(sides[0], sides[1], tuple(ignore), mapping)
        findings.extend(found)
        for tag, side in zip("AB", sides, strict=True):
            findings.extend(dataclasses.replace(f, message=f"[{tag}] {f.message}") for f in side.changed())
    except FileChangedError as exc:
        findings.append(error("file-changed", f"file changed during the comparison: {exc}",
                              location=Location(file=exc.path if isinstance(exc.path, str) else None)))
        coverage = ()
    finally:
        for side in sides:
            side.close()
    stats["seconds"] = round(time.perf_counter() - started, 6)
    return Report(command="diff", target=f"{roots[0]} {roots[1]}", findings=tuple(cap_findings(findings)),
                  coverage=coverage, stats=stats)


def parse_prefix_map(specs: Sequence[str | tuple[str, str]]) -> list[tuple[str, str]]:
    """Validate ``--map-prefix`` values (one ``=`` each or a pair; not both empty; no repeated A prefix; no control
    characters). Raises :class:`~ckptverify.errors.UsageError`."""
    if isinstance(specs, str | bytes):
        raise UsageError("map_prefix must be a list of 'A_PREFIX=B_PREFIX' strings, not one string")
    out: list[tuple[str, str]] = []
    for spec in specs:
        if isinstance(spec, str):
            if spec.count("=") != 1:
                raise UsageError(f"--map-prefix {spec!r}: expected A_PREFIX=B_PREFIX with exactly one '=' "
                                 "(e.g. --map-prefix net.=model.net.)")
            pair = tuple(spec.split("="))
        elif isinstance(spec, tuple) and len(spec) == 2 and all(isinstance(x, str) for x in spec):
            pair = spec
        else:
            raise UsageError(f"--map-prefix {spec!r}: expected 'A_PREFIX=B_PREFIX' or a pair of strings")
        a_prefix, b_prefix = pair
        if not a_prefix and not b_prefix:
            raise UsageError("--map-prefix '=': both prefixes are empty, so it maps nothing")
        if any(ord(c) < 0x20 or ord(c) == 0x7F for c in a_prefix + b_prefix):
            raise UsageError(f"--map-prefix {spec!r}: a prefix holds a control character")
        if any(a_prefix == seen for seen, _ in out):
            raise UsageError(f"--map-prefix: A prefix {a_prefix!r} is given twice")
        out.append((a_prefix, b_prefix))
    return out


def _mapped_names(names: Sequence[str], mapping: list[tuple[str, str]],
                  used: dict[tuple[str, str], int]) -> dict[str, str]:
    """``{B's name: A's name}`` for ``names`` under ``mapping`` (longest prefix wins), counting renames in ``used``. Two
    names onto one is a usage error."""
    by_length = sorted(mapping, key=lambda m: -len(m[0]))
    out: dict[str, str] = {}
    for name in names:
        target = name
        for a_prefix, b_prefix in by_length:
            if name.startswith(a_prefix):
                target = b_prefix + name[len(a_prefix):]
                used[(a_prefix, b_prefix)] += 1
                break
        if target in out:
            raise UsageError(f"--map-prefix maps both {out[target]!r} and {name!r} of A onto {target!r}: the "
                             "comparison would be ambiguous")
        out[target] = name
    return out


def _compare(sa: _Side, sb: _Side, ignore: tuple[str, ...], mapping: Sequence[tuple[str, str]] = (),
             ) -> tuple[list[Finding], tuple[CheckCoverage, ...], dict[str, Any]]:
    findings: list[Finding] = []
    used = dict.fromkeys(mapping, 0)
    a_tensors = _mapped_names(list(sa.tensors), list(mapping), used)  # B's terms -> A's name
    a_values = _mapped_names(list(sa.values), list(mapping), used)

    def ignored(name: str, a_name: str | None = None) -> bool:
        return any(fnmatch.fnmatchcase(name, pat) or (a_name is not None and fnmatch.fnmatchcase(a_name, pat))
                   for pat in ignore)

    def label(name: str, a_name: str | None) -> str:
        return repr(name) if a_name is None or a_name == name else f"{a_name!r} (A) / {name!r} (B)"

    all_tensors = set(a_tensors) | set(sb.tensors)
    all_values = set(a_values) | set(sb.values)
    names = sorted(n for n in all_tensors if not ignored(n, a_tensors.get(n)))
    values = sorted(n for n in all_values if not ignored(n, a_values.get(n)))
    left_out = len(all_tensors) - len(names) + len(all_values) - len(values)
    both = [n for n in names if n in a_tensors and n in sb.tensors and sa.tensors[a_tensors[n]] == sb.tensors[n]]
    fp_a = sa.fingerprints({a_tensors[n] for n in both})
    fp_b = sb.fingerprints(set(both))
    compared = uncompared = 0
    for name in names:
        a_name = a_tensors.get(name)
        what = label(name, a_name)
        ta, tb = sa.tensors.get(a_name) if a_name is not None else None, sb.tensors.get(name)
        if ta is None or tb is None:
            findings.append(error("diff-missing", f"tensor {what} is missing from {'A' if ta is None else 'B'}",
                                  location=Location(fqn=name)))
            continue
        if ta != tb:
            findings.append(error("diff-tensor", f"{what} is {ta[0]}{list(ta[1])} in A and {tb[0]}{list(tb[1])} in B",
                                  location=Location(fqn=name), expected=f"{ta[0]}{list(ta[1])}",
                                  actual=f"{tb[0]}{list(tb[1])}"))
            continue
        assert a_name is not None
        fa, fb = fp_a.get(a_name), fp_b.get(name)
        if fa is None or fb is None:
            uncompared += 1
            side = "A" if fa is None else "B"
            if (a_name in sa.damaged) if fa is None else (name in sb.damaged):  # its damage is reported above
                findings.append(info("diff-uncompared", f"{what} is damaged in {side}; not compared",
                                     location=Location(fqn=name)))
            else:
                findings.append(error("diff-uncompared", f"{what} could not be rebuilt from its bytes in {side}; "
                                      "not compared, so its equality is not shown", location=Location(fqn=name)))
            continue
        compared += 1
        if fa == fb:
            continue
        if sa.desc.tensors[a_name].subclass is not None or sb.desc.tensors[name].subclass is not None:
            findings.append(_subclass_finding(what, sa, a_name, sb, name, fa, fb))
            continue
        try:
            stats = tensor_difference(read_tensor(sa.desc, a_name), read_tensor(sb.desc, name))
        except (ValueError, RuntimeError, TypeError) as exc:
            findings.append(error("diff-tensor", f"{what} differs (by fingerprint); loading it to say how failed: "
                                  f"{exc}"[:300], location=Location(fqn=name), expected=fa, actual=fb))
            continue
        findings.append(error(
            "diff-tensor",
            f"{what} differs: {stats['differing']} of {stats['elements']} elements, max |a-b| "
            f"{_number(stats['max_abs_diff'])}, max ULP distance {stats['max_ulp']}, first at {stats['first_index']}",
            location=Location(fqn=name, global_index_first=tuple(stats["first_index"] or ())),
            expected=fa, actual=stats,
        ))
    values_compared = values_uncompared = 0
    for name in values:
        a_name = a_values.get(name)
        what = label(name, a_name)
        va, vb = sa.values.get(a_name) if a_name is not None else None, sb.values.get(name)
        if va is None or vb is None:
            findings.append(error("diff-missing", f"value {what} is missing from {'A' if va is None else 'B'}",
                                  location=Location(fqn=name)))
            continue
        if a_name in sa.damaged_values or name in sb.damaged_values:
            values_uncompared += 1
            side = "A" if a_name in sa.damaged_values else "B"
            findings.append(info("diff-uncompared", f"value {what}: its file is damaged in {side}; not compared",
                                 location=Location(fqn=name)))
            continue
        values_compared += 1
        if va != vb:
            findings.append(error("diff-value", f"value {what} differs: {_short(va)} in A, {_short(vb)} in B",
                                  location=Location(fqn=name), expected=va, actual=vb))
    for (a_prefix, b_prefix), n in used.items():
        make = info if n else warning
        findings.append(make("diff-mapped", f"--map-prefix {a_prefix}={b_prefix} renamed {n} name(s) of A"
                             + ("" if n else ": no name of A starts with it"),
                             actual={"a_prefix": a_prefix, "b_prefix": b_prefix, "renamed": n}))
    if ignore:
        findings.append(info("diff-ignored", f"{left_out} name(s) matching --ignore {list(ignore)} left out of the "
                             "comparison", actual={"ignored": left_out, "patterns": list(ignore)}))
    if compared == 0 and (names or values_compared == 0):
        why = ("neither checkpoint holds a tensor or value it could read" if not names and not values
               else f"none of the {len(names)} tensor name(s) could be compared on both sides")
        findings.append(error("diff-nothing-compared", f"nothing was compared: {why}; equality is not shown"))
    coverage = (CheckCoverage(check="diff-tensor", count=compared, unit="tensors"),
                CheckCoverage(check="diff-value", count=values_compared, unit="values"))
    return findings, coverage, {"tensors_compared": compared, "tensors_not_compared": uncompared,
                                "values_compared": values_compared, "values_not_compared": values_uncompared,
                                "ignored": left_out, "mapped": sum(used.values()),
                                "formats": [sa.format, sb.format]}


def _number(x: Any) -> str:
    """A float for people: 6 significant digits (the exact value is in ``actual``)."""
    return f"{x:.6g}" if isinstance(x, float) else str(x)


def _short(value: str) -> str:
    return value if len(value) <= 80 else value[:77] + "..."


class _Side:
    """One checkpoint as ``diff`` sees it: tensor names with (dtype, shape), plain values, and fingerprints."""

    format = "?"
    errors: list[Finding]
    damaged: set[str]
    #: Values whose file is damaged: named, not compared.
    damaged_values: frozenset[str] | set[str] = frozenset()
    tensors: dict[str, tuple[str, tuple[int, ...]]]
    values: dict[str, str]
    #: Fingerprints a manifest vouches for, by name: taken in memory at save time, and the bytes matched them.
    saved: dict[str, str]

    desc: Description

    def scan(self, only: set[str]) -> dict[str, deep_check.TensorScan]:
        """The tensors ``only`` rebuilt from their payloads (:func:`~ckptverify.checks.deep.scan_description`)."""
        raise NotImplementedError

    def fingerprints(self, names: set[str]) -> dict[str, str]:
        """Fingerprints of the undamaged tensors among ``names``: the manifest's, else rebuilt; ``"empty"`` for no
        elements and nothing stored. Tensors not fully rebuilt are left out (reported as not compared)."""
        wanted = names - self.damaged
        out = {n: self.saved[n] for n in wanted if n in self.saved}
        rest = wanted - set(out)
        scans = self.scan(rest)
        for name in sorted(rest):
            shape = self.desc.tensors[name].shape
            scan = scans.get(name)
            value = scan.value(shape) if scan is not None else None
            if value is not None:
                out[name] = value
            elif math.prod(shape) == 0:  # nothing stored for it (no chunk of a tensor with no elements)
                out[name] = "empty"
        return out

    def changed(self) -> list[Finding]:
        return []

    def close(self) -> None:
        pass


class _DescribedSide(_Side):
    """A single file or folder through :func:`~ckptverify.formats.describe.describe`.

    Errors leave out only what they touch: tensors overlapping an error's bytes or named by it; all of a file's
    tensors for an error naming no bytes, except payloads a covering manifest item still vouches for (rehashed here).
    A file with an error not confined to tensor bytes has its values left out (named, not compared).
    """

    def __init__(self, root: str, jobs: int) -> None:
        from ckptverify.audit.verify import verify_checkpoint

        checked = verify_checkpoint(root, jobs=jobs)
        self.errors = [f for f in checked.findings if f.severity.value == "error"]
        self.desc = describe(root)
        self.format = self.desc.format
        folder = self.desc.format == "folder"
        single = None if folder else os.path.basename(paths.abspath(root))
        ranged: dict[str, list[tuple[int, int]]] = {}
        whole: dict[str, set[str]] = {}  # file -> checks of its errors that name no bytes
        named: set[str] = set()
        no_values: set[str] = set()  # files with an error not confined to a tensor's bytes
        for f in self.errors:
            where = f.location
            file = where.file
            if file is not None and where.fqn is None:
                no_values.add(file)
            if file is not None and where.byte_range is not None:
                ranged.setdefault(file, []).append(where.byte_range)
            elif file is not None and where.fqn is None:
                whole.setdefault(file, set()).add(f.check)
            if where.fqn is not None:  # by its own name, and as a folder names a tensor of a non-weight file
                named.update((where.fqn, f"{file}:{where.fqn}") if folder and file else (where.fqn,))
        proven = _manifest_proven(root, self.desc, {n for n, checks in whole.items() if checks == {"manifest-digest"}})
        self.damaged = {t.name for t in self.desc.tensors.values() for p in t.payloads
                        if t.name in named or any(lo < p.offset + p.length and p.offset < hi
                                                  for lo, hi in ranged.get(p.file, []))
                        or (p.file in whole and (p.file, p.offset, p.length) not in proven)}
        self.tensors = {n: (t.dtype, t.shape) for n, t in self.desc.tensors.items()}
        self.saved = {}  # every fingerprint rebuilt
        self.values = dict(self.desc.values)
        self.damaged_values = {n for n in self.values if (single or n.partition(":")[0]) in no_values}
        bad_files = set(whole) | set(ranged)
        for name, why in sorted(self.desc.unread.items()):
            if name not in bad_files:
                self.errors.append(error("diff-unread", f"{name} cannot be read for the comparison: {why}",
                                         location=Location(file=name)))

    def scan(self, only: set[str]) -> dict[str, deep_check.TensorScan]:
        return deep_check.scan_here(self.desc, only)[0]  # a file changing here leaves its tensors uncompared


def _manifest_proven(root: str, desc: Description, files: set[str]) -> set[tuple[str, int, int]]:
    """Payloads ``(file, offset, length)`` of ``files`` that are a covering manifest's item and hash to its digest now.
    """
    if not files:
        return set()
    from ckptverify.checks.described import manifests_of
    from ckptverify.fingerprint import new_digest
    from ckptverify.safeparse.readers import ReadOnlyFile

    items = {(item.file, item.offset, item.length): (manifest.digest_algorithm, item.digest)
             for _, manifest in manifests_of(root)[0] for item in manifest.items if item.file in files}
    out: set[tuple[str, int, int]] = set()
    for t in desc.tensors.values():
        for p in t.payloads:
            key = (p.file, p.offset, p.length)
            if key not in items or key in out:
                continue
            algorithm, want = items[key]
            d = new_digest(algorithm)
            try:
                with ReadOnlyFile(os.path.join(desc.root, p.file), root=desc.root) as f:
                    if f.size < p.offset + p.length:
                        continue
                    f.fold(p.offset, p.offset + p.length, d.update)
            except OSError:
                continue
            if d.hexdigest() == want:
                out.add(key)
    return out


class _DcpSide(_Side):
    """A DCP checkpoint via its pipeline's verification and description (chunks, plain values, side files)."""

    format = "dcp"

    def __init__(self, root: str, jobs: int, progress: ProgressSink | None) -> None:
        self.run = VerificationRun(root, jobs, progress)
        self.run.execute(deep=False, use_manifest=True)
        found = self.run.report("diff", 0.0, cap=False).findings
        self.errors = [f for f in found if f.severity.value == "error"]
        self.damaged = {f.location.fqn for f in self.errors if f.location.fqn}
        self.desc = self.run.description(values=True, values_skip=self.damaged, side_files=True)
        manifest = None if any(f.check.startswith("manifest") for f in self.errors) else self.run.manifest
        self.saved = {n: t.fingerprint for n, t in manifest.tensors.items()
                      if t.fingerprint is not None} if manifest is not None else {}
        bad_side_files = {n for n, fmt in self.desc.files.items() if fmt != "dcp"} & \
            {f.location.file for f in self.errors}
        self.tensors = {n: (t.dtype, t.shape) for n, t in self.desc.tensors.items()}
        self.damaged |= {n for n, t in self.desc.tensors.items() if any(p.file in bad_side_files for p in t.payloads)}
        self.values = {n: v for n, v in self.desc.values.items() if n.partition(":")[0] not in bad_side_files}

    def scan(self, only: set[str]) -> dict[str, deep_check.TensorScan]:
        return self.run.scan(self.desc, only)

    def changed(self) -> list[Finding]:
        return self.run.changed_files()

    def close(self) -> None:
        self.run.close()


_INT_OF_SIZE = {1: "int8", 2: "int16", 4: "int32", 8: "int64"}


# ------------------------------------------------------------------------------- tensor subclasses


def _subclass_finding(what: str, sa: _Side, a_name: str, sb: _Side, b_name: str, fa: str, fb: str) -> Finding:
    """The ``diff-tensor`` error for a tensor stored as a subclass on either side: differing parts, attributes, values.
    """
    try:
        stats = subclass_difference(sa.desc, a_name, sb.desc, b_name)
    except FileChangedError:
        raise  # the comparison stops and says so
    except (ValueError, RuntimeError, TypeError, OSError, FindingError) as exc:
        return error("diff-tensor", f"{what} differs (by fingerprint); reading its parts to say how failed: "
                     f"{exc}"[:300], location=Location(fqn=b_name), expected=fa, actual=fb)
    said = []
    kinds = stats["stored_as"]
    if kinds[0] != kinds[1]:
        said.append(f"stored as {kinds[0]} in A and {kinds[1]} in B")
    for part, d in stats["parts"].items():
        if isinstance(d, str):
            said.append(f"its {part!r} is {d}")
        elif d["differing"]:
            said.append(f"its {part!r} differs in {d['differing']} of {d['elements']} elements")
    equal = [repr(p) for p, d in stats["parts"].items() if not isinstance(d, str) and not d["differing"]]
    if equal:
        said.append(f"{' and '.join(equal)} equal")
    for key, (va, vb) in stats["context"].items():
        said.append(f"attribute {key} is {va!r} in A and {vb!r} in B")
    decoded = stats["decoded"]
    if decoded is None:
        said.append(f"decoded values not compared: {stats['decoded_note']}")
    elif decoded["differing"]:
        said.append(f"decoded values differ in {decoded['differing']} of {decoded['elements']} elements, max |a-b| "
                    f"{_number(decoded['max_abs_diff'])}, first at {decoded['first_index']}")
    else:
        said.append("decoded values are equal")
    first = decoded["first_index"] if decoded is not None and decoded["differing"] else None
    return error("diff-tensor", f"{what} differs: " + "; ".join(said),
                 location=Location(fqn=b_name, global_index_first=tuple(first) if first else None),
                 expected=fa, actual=stats)


def subclass_difference(desc_a: Description, name_a: str, desc_b: Description, name_b: str) -> dict[str, Any]:
    """How tensor ``name_a`` of ``desc_a`` and ``name_b`` of ``desc_b`` differ when either is stored as a subclass:
    ``stored_as`` (A, B), ``parts`` (per inner tensor), ``context`` (differing attributes), ``decoded`` (of the
    float32 values, or ``None`` with ``decoded_note``)."""
    import torch

    sub_a, sub_b = desc_a.tensors[name_a].subclass, desc_b.tensors[name_b].subclass

    def kind(d: SubclassDesc | None) -> str:
        return "plain" if d is None else d.cls.rsplit(".", 1)[-1]

    out: dict[str, Any] = {"stored_as": [kind(sub_a), kind(sub_b)], "parts": {}, "context": {},
                           "decoded": None, "decoded_note": None}
    pa = read_parts(desc_a, name_a) if sub_a is not None else None
    pb = read_parts(desc_b, name_b) if sub_b is not None else None
    if sub_a is not None and sub_b is not None and pa is not None and pb is not None:
        order = [p.name for p in sub_a.parts] + [p.name for p in sub_b.parts if p.name not in pa]
        for part in order:
            if part not in pa or part not in pb:
                out["parts"][part] = f"only in {'A' if part in pa else 'B'}"
            elif (pa[part].dtype, pa[part].shape) != (pb[part].dtype, pb[part].shape):
                out["parts"][part] = (f"{str(pa[part].dtype)[6:]}{list(pa[part].shape)} in A and "
                                      f"{str(pb[part].dtype)[6:]}{list(pb[part].shape)} in B")
            else:
                out["parts"][part] = tensor_difference(pa[part], pb[part])
        ca, cb = json.loads(sub_a.context), json.loads(sub_b.context)
        out["context"] = {k: [ca.get(k), cb.get(k)] for k in sorted(set(ca) | set(cb)) if ca.get(k) != cb.get(k)}
    values = []
    for desc, sub, parts, name in ((desc_a, sub_a, pa, name_a), (desc_b, sub_b, pb, name_b)):
        got: torch.Tensor | str | None
        if sub is None:
            plain = read_tensor(desc, name)
            got = plain.to(torch.float32) if plain.is_floating_point() else \
                f"the plain side holds {str(plain.dtype)[6:]} values"
        else:
            got = decoded_values(sub, parts)
        if isinstance(got, str):  # why these values cannot be compared
            out["decoded_note"], got = got, None
        values.append(got)
    va, vb = values
    if va is not None and vb is not None:
        if va.shape != vb.shape:
            out["decoded_note"] = f"the decoded shapes differ: {list(va.shape)} in A, {list(vb.shape)} in B"
        else:
            out["decoded"] = tensor_difference(va, vb)
    return out


def decoded_values(desc: SubclassDesc, parts: dict[str, torch.Tensor]) -> torch.Tensor | str:
    """A stored subclass's values as float32 via torchao's decoding, or why not. Safe on hostile files: parts are plain
    rebuilt tensors and attributes the allowlist's canonical values, rechecked; only
    :data:`~ckptverify.safeparse.torchsave.SUBCLASSES` are decoded."""
    import importlib.util

    if importlib.util.find_spec("torchao") is None:
        return "torchao is not installed (pip install 'ckptverify[lowprec]')"
    previous = logging.root.manager.disable
    logging.disable(logging.WARNING)  # torchao's and torch's import-time warnings: noise, not findings
    try:  # a stored subclass is one of SUBCLASSES (the reader refuses others), each of which has a decoder
        return _DECODERS[desc.cls](json.loads(desc.context), parts)
    except (ValueError, TypeError, RuntimeError, AssertionError, KeyError, NotImplementedError, ImportError) as exc:
        return f"decoding failed: {type(exc).__name__}: {exc}"[:300]
    finally:
        logging.disable(previous)


def _ctx_dtype(context: dict[str, Any], key: str) -> torch.dtype:
    from ckptverify.dcp.tensors import torch_dtype

    value = context.get(key)
    if not isinstance(value, str) or not value.startswith("torch."):
        raise ValueError(f"attribute {key} is not a dtype")
    return torch_dtype(value.removeprefix("torch."))


def _ctx_int(context: dict[str, Any], key: str) -> int:
    value = context.get(key)
    if type(value) is not int or not 0 < value <= 1 << 16:
        raise ValueError(f"attribute {key} is not a block size")
    return value


def _decode_mx(context: dict[str, Any], parts: dict[str, torch.Tensor]) -> torch.Tensor:
    import torch
    from torchao.prototype.mx_formats.mx_tensor import MXTensor

    t = MXTensor(parts["qdata"], parts["scale"], _ctx_dtype(context, "elem_dtype"), _ctx_int(context, "block_size"),
                 _ctx_dtype(context, "orig_dtype"), None, None, context.get("is_swizzled_scales") is True)
    return t.dequantize(torch.float32)


def _decode_nvfp4(context: dict[str, Any], parts: dict[str, torch.Tensor]) -> torch.Tensor:
    import torch
    from torchao.prototype.mx_formats.nvfp4_tensor import NVFP4Tensor

    t = NVFP4Tensor(parts["qdata"], parts["scale"], _ctx_int(context, "block_size"), _ctx_dtype(context, "orig_dtype"),
                    parts.get("per_tensor_scale"), parts.get("act_per_tensor_scale"),
                    context.get("is_swizzled_scales") is True, False, None)
    return t.dequantize(torch.float32)


_DECODERS = {
    "torchao.prototype.mx_formats.mx_tensor.MXTensor": _decode_mx,
    "torchao.prototype.mx_formats.nvfp4_tensor.NVFP4Tensor": _decode_nvfp4,
}


def tensor_difference(a: torch.Tensor, b: torch.Tensor) -> dict[str, Any]:
    """Bitwise comparison of two same-shape, same-dtype tensors, with magnitudes where they make sense."""
    import torch

    def bits(t: torch.Tensor) -> torch.Tensor:
        if t.dtype == torch.bool:
            return t.view(torch.uint8)
        t = torch.view_as_real(t).flatten(-2) if t.is_complex() else t
        return t.contiguous().view(getattr(torch, _INT_OF_SIZE[t.element_size()]))

    ia, ib = bits(a), bits(b)
    neq = (ia != ib).reshape(-1)
    if a.is_complex():
        neq = neq.view(-1, 2).any(dim=1)
    differing = int(neq.sum())
    first = None
    if differing:
        flat = int(torch.nonzero(neq)[0])
        first = [int(x) for x in torch.unravel_index(torch.tensor(flat), a.shape)] if a.dim() else []
    out: dict[str, Any] = {"elements": a.numel(), "differing": differing, "first_index": first,
                           "max_abs_diff": None, "max_ulp": None}
    if not differing:
        return out
    if a.is_floating_point() or a.is_complex():
        da = a.to(torch.complex128 if a.is_complex() else torch.float64)
        db = b.to(da.dtype)
        diff = (da - db).abs()
        finite = diff[torch.isfinite(diff)]
        out["max_abs_diff"] = float(finite.max()) if finite.numel() else float("nan")
        if not a.is_complex():
            out["max_ulp"] = _max_ulp(ia.reshape(-1).to(torch.int64), ib.reshape(-1).to(torch.int64),
                                      a.element_size())
    else:
        out["max_abs_diff"] = int((a.to(torch.int64) - b.to(torch.int64)).abs().max())
    return out


def _max_ulp(ia: torch.Tensor, ib: torch.Tensor, size: int) -> int:
    """Largest distance between the two bit patterns on the ordered line of floats of that width."""
    import torch

    sign = torch.tensor(1 << (8 * size - 1), dtype=torch.int64) if size < 8 else None

    def ordered(i: torch.Tensor) -> torch.Tensor:
        if size < 8:
            i = i & ((1 << (8 * size)) - 1)  # as unsigned
            neg = i >= sign
            return torch.where(neg, sign - i, i)  # -0 and +0 both map to 0
        return torch.where(i < 0, torch.iinfo(torch.int64).min - i, i)

    oa, ob = ordered(ia), ordered(ib)
    if size < 8:
        return int((oa - ob).abs().max())
    # 64-bit: the difference can exceed int64; compute it exactly in Python for the extreme pair.
    d = (oa.double() - ob.double()).abs()
    k = int(torch.argmax(d))
    return abs(int(oa[k]) - int(ob[k]))
