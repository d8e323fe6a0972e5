"""Work units done ahead and written down: the after-save parts' transport. A node's part runs the adoption's
digest pass and tensor scan (or, deep, the tensor scan) over its own files with :class:`Recorded` as executor
(:func:`record`): each unit (:mod:`.units`) is read there and written, with its result, into its part verdict. The
coordinator adopts, or verifies deeply, as one process does with :class:`Recorded` over the parts' records: the same
units as the store carries among ranks (:mod:`.session`), answered from the records, judged and merged by the same
code.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

from ckptverify.cluster.units import Unit, UnitExecutor, execute, is_raw, opened_in, payload_unit, unit_file
from ckptverify.errors import FileChangedError

#: ``[unit, result]``, as a part verdict holds it.
Record = list[Any]


def record(root: str, only: frozenset[str], jobs: int, deep: bool) -> tuple[Any, list[Record]]:
    """One node's share of an adoption: the byte-level verification of ``only`` (no other file opened) and, if it
    passed, the work units of the adoption's digest pass and tensor scan over those files, with their results
    (none if it failed or a file changed: the report says why). ``deep``: of a deep verification instead, the
    verification against the manifest and the tensor scan's units, passed or not. Writes nothing."""
    from ckptverify.checks.dcp_pipeline import VerificationRun, changed_under
    from ckptverify.checks.deep import scan_description
    from ckptverify.findings import Report
    from ckptverify.ownfiles.manifest import DEFAULT_BLOCK_BYTES
    from ckptverify.safeparse.gcpause import paused_gc

    started = time.perf_counter()
    command = "verify" if deep else "fingerprint"
    recorded = Recorded([])
    run = VerificationRun(root, jobs, None, only=only)
    report = Report(command=command, target=root, findings=())
    try:
        with paused_gc():
            run.execute(deep=False, use_manifest=deep)
            report = run.report(command, time.perf_counter() - started)
            if not report.passed and not deep:
                return report, []
            desc = run.description()
            if deep:
                scan_description(desc, recorded.tensor_map(run))
            else:  # the adoption's defaults (fingerprint_checkpoint): the coordinator asks for these very units
                run.digests(desc, digest="xxh3-128", block_bytes=DEFAULT_BLOCK_BYTES, executor=recorded)
            # What the coordinator cannot describe without opening these files: their items, unread pieces.
            items: dict[str, list[Any]] = {n: [] for n in desc.files}
            for i in desc.stored:  # grouped in one pass: a layout of one file per item has as many files as items
                items.setdefault(i.file, []).append([i.name, i.chunk_offsets, i.offset, i.length])
            recorded.records += [[["stored", n, f], items[n]] for n, f in desc.files.items()]
            recorded.records += [[["unread", t.name], t.unread] for t in desc.tensors.values() if t.unread]
            changed = run.changed_files()
    except FileChangedError as exc:
        changed = [changed_under(root, exc)]
    finally:
        run.close()
    if changed:
        return Report(command=command, target=root, findings=(*report.findings, *changed),
                      coverage=report.coverage, stats=report.stats), []
    report.stats["seconds"] = round(time.perf_counter() - started, 6)
    return report, recorded.records


def records_of(data: Any, files: set[str] | frozenset[str] | None = None) -> list[Record] | None:
    """The records a part verdict holds, or ``None`` when it holds none usable (damaged, planted); with ``files``
    (that part's), also when a tensor piece lies outside them or outside its tensor."""
    ok = isinstance(data, list) and all(isinstance(r, list) and len(r) == 2 and isinstance(r[0], list) and r[0]
                                        and isinstance(r[0][0], str) for r in data)
    if ok and files is not None:
        try:
            ok = all(u[3]["file"] in files and len(u[3]["chunk_offsets"]) == len(u[2]) and all(
                0 <= o < max(n, 1) for o, n in zip(u[3]["chunk_offsets"], u[2], strict=True))
                for u, _ in data if u[0] == "payload")
        except (LookupError, TypeError, ValueError):
            ok = False
    return data if ok else None


def _key(unit: Unit) -> str:
    """The unit as records answer it. A piece's scan does not depend on how its bytes are protected (its
    ``checksum``, which a manifest written in between changes): that is left out."""
    if unit[0] == "payload" and len(unit) > 3 and isinstance(unit[3], dict) and "checksum" in unit[3]:
        unit = [*unit[:3], {k: v for k, v in unit[3].items() if k != "checksum"}]
    return json.dumps(unit, sort_keys=True)


def _unit(item: Any) -> Unit:
    """The unit of a :func:`~ckptverify.checks.deep.scan_description` item: a piece ``(tensor, payload)`` or a tensor
    subclass."""
    return payload_unit(item[0].name, item[0].shape, item[1]) if isinstance(item, tuple) else ["subclass", item.name]


class Recorded(UnitExecutor):
    """An executor that answers units from ``records`` and reads (and records) the others here, through the run's
    files. A unit of a file the run did not open that no record answers raises
    ``ValueError`` (as does a tensor subclass stored on another node): the caller reads the checkpoint whole."""

    def __init__(self, records: list[Record]) -> None:
        self.records = records
        self._given = len(records)
        self._known = {_key(u): r for u, r in records}
        #: The run whose tensors :meth:`tensor_map` scanned, for :meth:`judge`.
        self.run: Any = None

    def scanned_here(self) -> list[Record]:
        """The records of the tensor pieces scanned here (``payload`` units): handed to a later run over the same files
        with the records it is given, it reads none of those pieces again. A subclass's scan is left out (in records,
        :meth:`describe` takes it for one stored on another node)."""
        return [r for r in self.records[self._given:] if r[0][0] == "payload"]

    def _missing(self, run: Any, unit: Unit) -> None:
        if run.file(unit_file(unit)) is None:
            raise ValueError(f"no part brought the {unit[0]} of {unit_file(unit)}, a file not opened here")

    def map_units(self, run: Any, units: list[Unit]) -> list[Any]:
        keys = [_key(u) for u in units]
        got = self._read_here(run, units, [n for n, k in enumerate(keys) if k not in self._known])
        return [got[n] if n in got else self._known[k] for n, k in enumerate(keys)]

    def _read_here(self, run: Any, units: list[Unit], todo: list[int]) -> dict[int, Any]:
        """The results of ``units[n]`` for ``n`` in ``todo``, read through the run's files and recorded."""
        for n in todo:
            self._missing(run, units[n])
        got = dict(zip(todo, run.map(lambda n: execute(units[n], opened_in(run), run.root), todo), strict=True))
        self.records += [[units[n], got[n]] for n in todo]
        return got

    def tensor_map(self, run: Any) -> Callable[[Callable[[Any], Any], list[Any]], list[Any]]:
        """:meth:`UnitExecutor.tensor_map` answering every piece the records hold (transformed ones too), recording
        those scanned here; a tensor subclass is scanned where it is stored, never shared (:meth:`describe`)."""
        from ckptverify.checks.deep import TensorScan

        self.run = run
        shared = super().tensor_map(run)

        def recorded(fn: Callable[[Any], Any], items: list[Any]) -> list[Any]:
            units = [_unit(x) for x in items]
            keys = [_key(u) for u in units]
            rest = [n for n, k in enumerate(keys) if k not in self._known]
            other = [n for n in rest if not is_raw(items[n])]  # rebuilt here; raw pieces are read as units
            for n in other:
                if units[n][0] == "payload":
                    self._missing(run, units[n])
            got = dict(zip(rest, shared(fn, [items[n] for n in rest]), strict=True))
            self.records += [[units[n], got[n].to_json()] for n in other]
            return [got[n] if n in got else TensorScan.from_json(self._known[k]) for n, k in enumerate(keys)]

        return recorded

    def judge(self, manifest: Any) -> tuple[list[Any], int]:
        """:func:`~ckptverify.checks.deep.judge_scans` against ``manifest`` of the tensors :attr:`run` scanned through
        this executor (its description and scans again, every piece answered from the records: none read again).
        Raises ``LookupError`` (no tensors scanned, or a scan cut short) when they cannot all be answered."""
        from ckptverify.checks.deep import TensorScan, judge_scans, scan_description

        if self.run is None:
            raise LookupError("no tensors were scanned through this executor")
        desc = self.run.description()
        known = {_key(u): r for u, r in self.records}
        scans, found = scan_description(desc, lambda _, items: [TensorScan.from_json(known[_key(_unit(x))])
                                                                for x in items])
        return judge_scans(desc, manifest, scans, found)

    def describe(self, desc: Any, files: frozenset[str]) -> None:
        """Add to ``desc`` what the records it was given describe of ``files`` (not opened here): the files, their
        items, the tensor pieces in them and those that could not be read."""
        from ckptverify.formats.describe import Payload, StoredRange

        for unit, result in self.records[:self._given]:
            kind, name = unit[0], unit[1] if len(unit) > 1 else None
            tensor = desc.tensors.get(name) if isinstance(name, str) else None
            if kind == "subclass":
                raise ValueError(f"{name!r} is a tensor subclass stored on another node")
            if kind == "stored" and name in files:
                desc.files[name] = str(unit[2])
                desc.stored += [StoredRange(str(n), None if c is None else tuple(c), name, int(o), int(k))
                                for n, c, o, k in result]
            elif kind == "unread" and tensor is not None:
                tensor.unread.extend(str(why) for why in result)
            elif kind == "payload" and tensor is not None and unit[3].get("file") in files:
                tensor.payloads.append(Payload.from_json(unit[3]))
