"""Work units: what a rank is asked to read, as plain JSON lists, and how it reads one.

Kinds: ``crc`` (file, start, end), ``blocks`` (+ first, last, algorithm, block_bytes, crc_ranges), ``digest`` (file,
algorithm), ``item`` (file, offset, length, algorithm, block_bytes), ``checkpoint`` (a ``scan`` candidate, deep),
``payload`` (tensor name, global shape, raw payload). Each is read with the same functions as on one process, so
results are identical. Ranks open names relative to the command's path safely and check each file is the one rank 0
planned from (size, mtime), else ``file-changed``.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

from ckptverify.errors import FileChangedError

Unit = list[Any]


def unit_bytes(unit: Unit, size_of: Callable[[str], int]) -> int:
    """The bytes a unit reads."""
    if unit[0] == "checkpoint":
        return int(unit[1]["size"])
    got = unit_range(unit, size_of)
    if got is None:
        raise ValueError(f"unknown work unit {unit[0]!r}")
    return got[2] - got[1]


def unit_file(unit: Unit) -> str | None:
    """The file a unit reads (``None`` for a whole checkpoint)."""
    if unit[0] == "payload":
        return str(unit[3]["file"])
    return unit[1] if isinstance(unit[1], str) and unit[0] != "checkpoint" else None


def unit_range(unit: Unit, size_of: Callable[[str], int]) -> tuple[str, int, int] | None:
    """The file and byte range a unit reads (``None`` for a whole checkpoint)."""
    kind = unit[0]
    if kind in ("crc", "blocks"):
        return unit[1], int(unit[2]), int(unit[3])
    if kind == "digest":
        return unit[1], 0, size_of(unit[1])
    if kind == "item":
        return unit[1], int(unit[2]), int(unit[2]) + int(unit[3])
    if kind == "payload":
        p = unit[3]
        return p["file"], int(p["offset"]), int(p["offset"]) + int(p["length"])
    return None


def execute(unit: Unit, open_file: Callable[[str], Any], root: str, jobs: int | None = 1) -> Any:
    """Read one unit via ``open_file(name)`` and return its JSON-able result; ``jobs``: workers for a whole checkpoint.
    """
    kind = unit[0]
    if kind == "crc":
        _, name, start, end = unit
        return open_file(name).crc32(start, end)
    if kind == "blocks":
        from ckptverify.checks.manifest_check import BlockTask, hash_task

        _, name, start, end, first, last, algorithm, bb, crc_ranges = unit
        task = BlockTask(name, 0, first, last, start, end)
        hashing = SimpleNamespace(digest_algorithm=algorithm, block_bytes=bb)  # what hash_task needs of a manifest
        digests, crcs = hash_task(open_file(name), task, hashing, [tuple(r) for r in crc_ranges])  # type: ignore[arg-type]
        return [list(digests), list(crcs)]
    if kind == "digest":
        from ckptverify.fingerprint import digest_reader

        return digest_reader(open_file(unit[1]), unit[2])
    if kind == "item":
        from ckptverify.fingerprint import BlockDigest

        _, name, offset, length, algorithm, bb = unit
        d = BlockDigest(algorithm, bb)
        open_file(name).fold(offset, offset + length, d.update)
        return [d.hexdigest(), list(d.block_hexdigests())]
    if kind == "checkpoint":
        from ckptverify.formats.rundir import Candidate
        from ckptverify.runs.scan import judge

        fields = dict(unit[1])
        fields["parts"] = tuple(fields.get("parts") or ())
        state, reason, counts = judge(root, Candidate(**fields), jobs, deep=bool(unit[2]))
        return [state, reason, counts]
    if kind == "payload":  # a raw piece; unreadable, as scan_description has it (a changed file raises)
        from ckptverify.checks.deep import TensorScan, scan_payload
        from ckptverify.formats.describe import Payload

        name, shape, p = unit[1], tuple(unit[2]), Payload.from_json(unit[3])
        try:
            return scan_payload(open_file(p.file), name, p, shape).to_json()
        except FileChangedError:
            raise
        except (OSError, ValueError, KeyError) as exc:
            return TensorScan(unreadable=[f"{name} chunk {list(p.chunk_offsets)}: {exc}"]).to_json()
    raise ValueError(f"unknown work unit {kind!r}")


def opened_in(run: Any) -> Callable[[str], Any]:
    """``open_file`` over the files a ``VerificationRun`` opened (one it did not open: ``FileChangedError``)."""

    def opened(name: str) -> Any:
        f = run.file(name)
        if f is None:
            raise FileChangedError("it could not be opened again", os.path.join(run.root, name))
        return f

    return opened


def payload_unit(name: str, shape: tuple[int, ...], p: Any) -> Unit:
    """The ``payload`` unit of piece ``p`` of tensor ``name``."""
    return ["payload", name, list(shape), p.to_json()]


def is_raw(item: Any) -> bool:
    """Whether a :func:`~ckptverify.checks.deep.scan_description` item is a raw file piece ``(tensor, payload)``, read
    as a ``payload`` unit (the rest, transformed items and subclasses, are rebuilt where the run is)."""
    from ckptverify.formats.describe import Payload

    return isinstance(item, tuple) and len(item) == 2 and isinstance(item[1], Payload) \
        and item[1].encoding == "raw" and item[1].stored is None


class UnitExecutor:
    """What every executor of work units shares (:class:`~ckptverify.checks.dcp_pipeline.Executor`): the tensor scan
    with raw pieces as ``payload`` units through its ``map_units``."""

    def tensor_map(self, run: Any) -> Callable[[Callable[[Any], Any], list[Any]], list[Any]]:
        """A ``run_map`` for :func:`~ckptverify.checks.deep.scan_description`: raw-file pieces as ``payload`` units,
        the rest (transformed items, subclasses) here via ``run.map``; the same scans as computed locally."""
        from ckptverify.checks.deep import TensorScan

        def shared(fn: Callable[[Any], Any], items: list[Any]) -> list[Any]:
            raw = [n for n, x in enumerate(items) if is_raw(x)]
            if not raw:
                return run.map(fn, items)
            got = self.map_units(run, [payload_unit(items[n][0].name, items[n][0].shape, items[n][1]) for n in raw])
            out: dict[int, Any] = {n: TensorScan.from_json(value) for n, value in zip(raw, got, strict=True)}
            rest = [n for n in range(len(items)) if n not in out]
            out.update(zip(rest, run.map(fn, [items[n] for n in rest]), strict=True))
            return [out[n] for n in range(len(items))]

        return shared


class RankFiles:
    """Files one rank opened under ``root``, each checked against rank 0's plan (``expect``: name -> [size, mtime_ns]).
    """

    def __init__(self, root: str) -> None:
        self.root = root
        self.expect: dict[str, list[int]] = {}
        self._open: dict[str, Any] = {}
        self._lock = threading.Lock()

    def __call__(self, name: str) -> Any:
        with self._lock:  # the units of one file run on several threads: one open each
            f = self._open.get(name)
            if f is None:
                f = self._open[name] = self._opened(name)
            return f

    def _opened(self, name: str) -> Any:
        from ckptverify.safeparse.readers import ReadOnlyFile

        path = os.path.join(self.root, name)
        try:
            f = ReadOnlyFile(path, root=self.root)
        except FileNotFoundError:
            raise FileChangedError("it was removed after rank 0 opened it", path) from None
        want = self.expect.get(name)
        if want is not None:
            st = os.stat(path)
            if (st.st_size, st.st_mtime_ns) != (want[0], want[1]) or f.size != want[0]:
                f.close()
                raise FileChangedError(f"it is not the file rank 0 planned from (size {st.st_size}, expected "
                                       f"{want[0]}; or modified since)", path)
        return f

    def close(self) -> None:
        for f in self._open.values():
            f.close()
        self._open.clear()
