"""The trace store: one rank-local, append-only zarr (v3) group per run and rank.

Layout (documented in ``docs/trace.md``)::

    <store>/zarr.json        group attributes: header (TraceHeader.to_dict()), rows (committed rows: the
                             commit marker), layout {flush_every, site_chunk}
    <store>/sites/zarr.json  an empty array whose attribute ``sites`` is the site table, by column:
                             [{name, kind, category, encoding, order, first_row, info, group}, ...]
    <store>/steps            int64  [capacity]             the step number of each row
    <store>/values           uint64 [capacity, sites, 2]   the 128-bit value of each cell (lane 0, lane 1)
    <store>/present          bool   [capacity, sites]      whether the cell was recorded

Rows are buffered in memory and written ``flush_every`` at a time, so each flush writes whole chunks instead of
rewriting a chunk once per step. The write itself runs on a background thread (one at a time, in order), so a
training step never waits for it; :meth:`TraceWriter.flush` and :meth:`TraceWriter.close` wait. The arrays grow
in steps of whole chunks ahead of the rows (``capacity``): only ``rows`` of them hold rows. Every array's
metadata and the attributes are plain zarr v3 ``zarr.json`` files, so the store opens without consolidated
metadata. The site table is rewritten only when a site is added; ``rows`` is written last on each flush, and a
reader trusts only that many rows (and the sites first recorded before them), so a store whose writer died
mid-flush still opens with every committed row.
"""

from __future__ import annotations

import os
import struct
import threading
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import numpy as np

from ckptverify.errors import CkptVerifyError, UsageError

__all__ = [
    "CATEGORIES",
    "ENCODINGS",
    "KINDS",
    "LEVELS",
    "TRACE_SCHEMA",
    "TRACE_SCHEMA_VERSION",
    "Cell",
    "Site",
    "Trace",
    "TraceFormatError",
    "TraceHeader",
    "TraceNotFoundError",
    "TraceRow",
    "TraceWriter",
    "open_trace",
    "rank_store_path",
]

TRACE_SCHEMA = "ckptverify/trace"
#: 2: category cells (``set128``), site groups, header ``detail``, arrays allocated ahead of the rows.
TRACE_SCHEMA_VERSION = 2

#: Recording levels, each including the previous one.
LEVELS = ("metrics", "state", "module")

#: What a state-level trace records of a tensor category (gradients, parameters, optimizer state, buffers):
#: ``category`` one cell per category per step; ``tensor`` one cell per tensor as well.
DETAILS = ("category", "tensor")

#: Site kind -> category.
KINDS: dict[str, str] = {
    "metric": "metric",
    "batch": "data",
    "module_out": "module",
    "module_grad_in": "module",
    "module_in": "module",
    "grad": "gradients",
    "optim": "optimizer",
    "param": "parameters",
    "buffer": "buffers",
    "hparam": "hyperparameters",
    "scheduler": "scheduler",
    "rng": "rng",
    "data": "data",
    "counter": "counters",
    "extra": "extras",
}
CATEGORIES = tuple(dict.fromkeys(KINDS.values()))

#: How a cell's 128 bits are to be read:
#: ``fp128`` a logical tensor fingerprint; ``digest128`` an xxh3-128 digest; ``f64`` lane 0 holds the
#: IEEE-754 binary64 bits of a number (lane 1 is 0); ``i64`` lane 0 holds a two's-complement 64-bit integer;
#: ``set128`` a category cell (:mod:`ckptverify.trace.category`): two sums modulo 2**61 - 1 over its members.
ENCODINGS = ("fp128", "digest128", "f64", "i64", "set128")

_MASK64 = (1 << 64) - 1
DEFAULT_FLUSH_EVERY = 64
DEFAULT_SITE_CHUNK = 512


class TraceNotFoundError(CkptVerifyError, FileNotFoundError):
    """The trace store does not exist."""


class TraceFormatError(CkptVerifyError):
    """The path is not a readable trace store (wrong schema, newer version, damaged metadata)."""


def _torch_version() -> str:
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a dependency
        return "unknown"
    return str(torch.__version__)


def _tool_version() -> str:
    from ckptverify import __version__

    return __version__


@dataclass(frozen=True, kw_only=True)
class TraceHeader:
    """What a trace describes. Two traces are comparable when their headers agree on everything but ``run``.

    ``rank`` and ``world_size`` left as ``None`` are filled in by :class:`~ckptverify.trace.TraceRecorder`
    from ``torch.distributed`` (0 and 1 without it). ``extra`` holds the run's configuration (JSON values).
    ``detail`` (one of :data:`DETAILS`) says whether tensor categories are recorded per category only or per
    tensor too; traces of either detail compare with each other.
    """

    run: str
    level: str = "state"
    workload: str = ""
    detail: str = "category"
    rank: int | None = None
    world_size: int | None = None
    torch_version: str = field(default_factory=_torch_version)
    tool_version: str = field(default_factory=_tool_version)
    extra: Mapping[str, Any] = field(default_factory=dict)
    schema: str = TRACE_SCHEMA
    schema_version: int = TRACE_SCHEMA_VERSION

    def __post_init__(self) -> None:
        if self.level not in LEVELS:
            raise UsageError(f"unknown trace level {self.level!r}; choose one of {', '.join(LEVELS)}")
        if self.detail not in DETAILS:
            raise UsageError(f"unknown trace detail {self.detail!r}; choose one of {', '.join(DETAILS)}")
        if self.schema != TRACE_SCHEMA:
            raise TraceFormatError(f"not a trace header: schema {self.schema!r}")
        if self.schema_version > TRACE_SCHEMA_VERSION:
            raise TraceFormatError(f"trace schema version {self.schema_version} is newer than this tool's "
                                   f"({TRACE_SCHEMA_VERSION})")

    def to_dict(self) -> dict[str, Any]:
        return {f.name: (dict(getattr(self, f.name)) if f.name == "extra" else getattr(self, f.name))
                for f in fields(self)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> TraceHeader:
        known = {f.name for f in fields(cls)}
        values = {k: v for k, v in data.items() if k in known}
        if "detail" not in values and int(values.get("schema_version", 1) or 1) < 2:
            values["detail"] = "tensor"  # version 1 recorded every tensor, and no category cells
        try:
            return cls(**values)
        except TypeError as exc:
            raise TraceFormatError(f"damaged trace header: {exc}") from None

    def with_rank(self, rank: int, world_size: int) -> TraceHeader:
        return replace(self, rank=rank, world_size=world_size)

    def differences(self, other: TraceHeader, ignore: Iterable[str] = ("run",)) -> list[str]:
        """Names of the fields that differ, ``ignore`` aside."""
        skip = set(ignore)
        a, b = self.to_dict(), other.to_dict()
        return [name for name in a if name not in skip and a[name] != b[name]]


@dataclass(frozen=True, slots=True)
class Site:
    """One recorded quantity. ``order`` is its position in execution order (0 first); ``info`` is a free
    note (a module's class name); ``group`` names the category cell a tensor's digest is summed into (empty
    for everything else)."""

    name: str
    kind: str
    category: str
    encoding: str
    order: int
    info: str = ""
    group: str = ""


@dataclass(frozen=True, slots=True)
class Cell:
    """One value of one site at one step, as handed to :meth:`TraceWriter.append`."""

    site: str
    kind: str
    lanes: tuple[int, int]
    encoding: str = "fp128"
    info: str = ""
    group: str = ""

    @classmethod
    def from_hex(cls, site: str, kind: str, value: str, encoding: str = "fp128", info: str = "") -> Cell:
        return cls(site, kind, hex_lanes(value), encoding, info)

    @classmethod
    def from_float(cls, site: str, kind: str, value: float) -> Cell:
        (bits,) = struct.unpack("<Q", struct.pack("<d", float(value)))
        return cls(site, kind, (bits, 0), "f64")

    @classmethod
    def from_int(cls, site: str, kind: str, value: int) -> Cell:
        value = int(value)
        if not -(1 << 63) <= value < (1 << 63):
            raise UsageError(f"{site}: integer {value} does not fit in 64 bits")
        return cls(site, kind, (value & _MASK64, 0), "i64")


def hex_lanes(value: str) -> tuple[int, int]:
    if len(value) != 32:
        raise UsageError(f"expected a 128-bit value as 32 hex digits, got {value!r}")
    return int(value[:16], 16), int(value[16:], 16)


def lanes_hex(lanes: Sequence[int]) -> str:
    return f"{int(lanes[0]) & _MASK64:016x}{int(lanes[1]) & _MASK64:016x}"


def decode(lanes: Sequence[int], encoding: str) -> float | int | str:
    """A cell's value: a float (``f64``), an int (``i64``) or 32 hex digits (fingerprints, digests)."""
    if encoding == "f64":
        return struct.unpack("<d", struct.pack("<Q", int(lanes[0]) & _MASK64))[0]
    if encoding == "i64":
        v = int(lanes[0]) & _MASK64
        return v - (1 << 64) if v >= 1 << 63 else v
    return lanes_hex(lanes)


def rank_store_path(run_dir: str | os.PathLike[str], rank: int) -> Path:
    """Where rank ``rank`` of a run keeps its trace store."""
    return Path(run_dir) / f"rank{rank}"


# ------------------------------------------------------------------------------------------- writer


class TraceWriter:
    """Appends rows to a new trace store at ``path``.

    Each :meth:`append` is one step: the cells in execution order. A site seen for the first time (at any
    step) is added to the site table, placed in execution order right after the site recorded before it in
    that row; its cells at earlier rows read as absent. Rows are buffered and written ``flush_every`` at a
    time on a background thread (``background=False``: in the caller's thread); :meth:`flush` writes what is
    buffered and waits for every write, :meth:`close` (or leaving a ``with`` block) too. An error of a
    background write is raised by the next call.
    """

    def __init__(self, path: str | os.PathLike[str], *, header: TraceHeader, flush_every: int = DEFAULT_FLUSH_EVERY,
                 site_chunk: int = DEFAULT_SITE_CHUNK, overwrite: bool = False, background: bool = True) -> None:
        import zarr

        if flush_every <= 0 or site_chunk <= 0:
            raise UsageError("flush_every and site_chunk must be positive")
        self.path = Path(path)
        if self.path.exists() and not overwrite and (not self.path.is_dir() or any(self.path.iterdir())):
            raise UsageError(f"trace store {self.path} already exists")
        self.header = header
        self.flush_every = flush_every
        self.site_chunk = site_chunk
        self._group = zarr.open_group(str(self.path), mode="w" if overwrite else "a")
        self._steps = self._group.create_array("steps", shape=(0,), chunks=(flush_every,), dtype="int64",
                                               fill_value=0)
        self._values = self._group.create_array("values", shape=(0, 0, 2), chunks=(flush_every, site_chunk, 2),
                                                dtype="uint64", fill_value=0, compressors=None)
        self._present = self._group.create_array("present", shape=(0, 0), chunks=(flush_every, site_chunk),
                                                 dtype="bool", fill_value=False)
        # Site table, by column (first-appearance order).
        self._names: list[str] = []
        self._column: dict[str, int] = {}
        self._kinds: list[str] = []
        self._encodings: list[str] = []
        self._infos: list[str] = []
        self._groups: list[str] = []
        self._first_row: list[int] = []
        # Execution order: column numbers.
        self._order: list[int] = []
        self._position: dict[int, int] = {}
        self._rows = 0  # rows handed to the writing thread (written, or being written)
        self._last_step: int | None = None
        self._buffer: list[tuple[int, list[int], list[tuple[int, int]]]] = []
        self._prev_key: list[tuple[str, str, str]] | None = None
        self._prev_columns: list[int] = []
        self._sites_version = 0
        self._closed = False
        # Written by the writing thread only: the arrays' allocated rows and width, and the site table written.
        self._capacity = (0, 0)
        self._sites_written = -1
        self._background = background
        self._pending: threading.Thread | None = None
        self._error: BaseException | None = None
        self._sites_meta = self._group.create_array("sites", shape=(0,), dtype="uint8", fill_value=0)
        self._write_sites(self._site_table(), 0)
        self._group.update_attributes({"header": header.to_dict(), "rows": 0,
                                       "layout": {"flush_every": flush_every, "site_chunk": site_chunk}})

    # -------------------------------------------------------------- appending

    @property
    def rows(self) -> int:
        """Rows appended so far (written or buffered)."""
        return self._rows + len(self._buffer)

    @property
    def closed(self) -> bool:
        return self._closed

    def append(self, step: int, cells: Iterable[Cell]) -> None:
        """Add the row of ``step`` (larger than every step before); ``cells`` in execution order."""
        if self._closed:
            raise UsageError("the trace writer is closed")
        step = int(step)
        if self._last_step is not None and step <= self._last_step:
            raise UsageError(f"trace steps must increase: step {step} after step {self._last_step}")
        cells = list(cells)
        key = [(c.site, c.kind, c.encoding) for c in cells]
        if key == self._prev_key:
            columns = self._prev_columns  # the common case: the same sites as the step before
        else:
            columns = self._columns_of(step, cells)
            self._prev_key, self._prev_columns = key, columns
        self._buffer.append((step, columns, [c.lanes for c in cells]))
        self._last_step = step
        if len(self._buffer) >= self.flush_every:
            self._hand_off(wait=not self._background)

    def _columns_of(self, step: int, cells: list[Cell]) -> list[int]:
        columns: list[int] = []
        prev: int | None = None
        seen: set[int] = set()
        for cell in cells:
            col = self._column.get(cell.site)
            if col is None:
                col = self._add_site(cell, after=prev)
            else:
                if self._kinds[col] != cell.kind:
                    raise UsageError(f"site {cell.site!r} changed kind from {self._kinds[col]} to {cell.kind}")
                if self._encodings[col] != cell.encoding:
                    raise UsageError(f"site {cell.site!r} changed encoding from {self._encodings[col]} to "
                                     f"{cell.encoding}")
            if col in seen:
                raise UsageError(f"site {cell.site!r} recorded twice at step {step}")
            seen.add(col)
            columns.append(col)
            prev = col
        return columns

    def _add_site(self, cell: Cell, after: int | None) -> int:
        if cell.kind not in KINDS:
            raise UsageError(f"site {cell.site!r}: unknown kind {cell.kind!r}")
        if cell.encoding not in ENCODINGS:
            raise UsageError(f"site {cell.site!r}: unknown encoding {cell.encoding!r}")
        col = len(self._names)
        self._names.append(cell.site)
        self._column[cell.site] = col
        self._kinds.append(cell.kind)
        self._encodings.append(cell.encoding)
        self._infos.append(cell.info)
        self._groups.append(cell.group)
        self._first_row.append(self.rows)
        pos = 0 if after is None else self._position[after] + 1
        if pos == len(self._order):
            self._order.append(col)
            self._position[col] = pos
        else:
            self._order.insert(pos, col)
            self._position = {c: i for i, c in enumerate(self._order)}
        self._sites_version += 1
        return col

    # -------------------------------------------------------------- writing

    def flush(self) -> None:
        """Write the buffered rows and wait until every row handed over so far is committed."""
        self._hand_off(wait=True)

    def _hand_off(self, *, wait: bool) -> None:
        self._join()
        if self._buffer:
            rows, self._buffer = self._buffer, []
            start = self._rows
            self._rows += len(rows)
            sites = self._site_table() if self._sites_version != self._sites_written else None
            job = (rows, start, len(self._names), sites, self._sites_version)
            if wait:
                self._write(*job)
            else:
                self._pending = threading.Thread(target=self._run, args=job, name="ckptverify-trace-writer",
                                                 daemon=False)
                self._pending.start()
        if wait:
            self._join()

    def _join(self) -> None:
        if self._pending is not None:
            self._pending.join()
            self._pending = None
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def _run(self, *job: Any) -> None:
        try:
            self._write(*job)
        except BaseException as exc:  # handed to the caller's thread by the next call
            self._error = exc

    def _write(self, rows: list[tuple[int, list[int], list[tuple[int, int]]]], start: int, width: int,
               sites: list[dict[str, Any]] | None, version: int) -> None:
        """Write ``rows`` from row ``start`` (one write per array), then commit them in the group attributes."""
        n = len(rows)
        end = start + n
        steps = np.fromiter((row[0] for row in rows), dtype=np.int64, count=n)
        values = np.zeros((n, width, 2), dtype=np.uint64)
        present = np.zeros((n, width), dtype=bool)
        for i, (_, cols, lanes) in enumerate(rows):
            if cols:
                idx = np.asarray(cols, dtype=np.int64)
                try:
                    values[i, idx] = np.asarray(lanes, dtype=np.uint64)
                except OverflowError:  # lanes given as signed 64-bit integers
                    values[i, idx] = np.asarray([(int(a) & _MASK64, int(b) & _MASK64) for a, b in lanes],
                                                dtype=np.uint64)
                present[i, idx] = True
        capacity, allocated = self._capacity
        if end > capacity or width > allocated:
            # Grow ahead of the rows (a quarter more, in whole chunks): a resize rewrites metadata, so it
            # should not happen at every flush. Only `rows` of them are ever read.
            chunk = self.flush_every
            new_capacity = max(end, capacity + max(chunk, capacity // 4))
            new_capacity = -(-new_capacity // chunk) * chunk
            new_width = max(width, allocated)
            self._steps.resize((new_capacity,))
            self._values.resize((new_capacity, new_width, 2))
            self._present.resize((new_capacity, new_width))
            self._capacity = (new_capacity, new_width)
        self._steps[start:end] = steps
        self._values[start:end, :width] = values
        self._present[start:end, :width] = present
        if sites is not None:
            self._write_sites(sites, version)
        # Last: the commit marker. A reader trusts only this many rows.
        self._group.update_attributes({"rows": end})

    def _site_table(self) -> list[dict[str, Any]]:
        return [
            {"name": name, "kind": self._kinds[c], "category": KINDS[self._kinds[c]], "encoding": self._encodings[c],
             "order": self._position[c], "first_row": self._first_row[c], "info": self._infos[c],
             "group": self._groups[c]}
            for c, name in enumerate(self._names)
        ]

    def _write_sites(self, sites: list[dict[str, Any]], version: int) -> None:
        """The site table, in the attributes of the (empty) ``sites`` array: rewritten only when it changes."""
        self._sites_meta.update_attributes({"sites": sites})
        self._sites_written = version

    def close(self) -> None:
        if not self._closed:
            try:
                self.flush()
            finally:
                self._closed = True

    def __enter__(self) -> TraceWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ------------------------------------------------------------------------------------------- reader


@dataclass(frozen=True, slots=True)
class TraceRow:
    """One step of a trace: ``values`` maps site name -> value (see :func:`decode`), in execution order,
    recorded sites only."""

    step: int
    values: dict[str, float | int | str]


class Trace:
    """A trace store opened for reading. Use :func:`open_trace`."""

    #: Rows read at once (and cached) when cells are looked up one by one.
    _BLOCK = 256

    def __init__(self, path: str | os.PathLike[str]) -> None:
        import zarr

        self.path = Path(path)
        if not (self.path / "zarr.json").is_file():
            hint = ""
            if self.path.is_dir() and any(c.name.startswith("rank") for c in self.path.iterdir()):
                hint = f" (it is a run directory: its stores are {self.path}/rank<r>)"
            raise TraceNotFoundError(f"no trace store at {self.path}{hint}")
        try:
            group = zarr.open_group(str(self.path), mode="r", use_consolidated=False)
            attrs = dict(group.attrs)
            self.header = TraceHeader.from_dict(attrs["header"])
            raw_sites = list(group["sites"].attrs["sites"])
            self._rows = int(attrs["rows"])
            self._values = group["values"]
            self._present = group["present"]
            steps_array = group["steps"]
            if steps_array.shape[0] < self._rows:
                raise TraceFormatError(f"{self.path}: {steps_array.shape[0]} step entries for {self._rows} rows")
            steps = np.asarray(steps_array[: self._rows], dtype=np.int64)
        except TraceFormatError:
            raise
        except (KeyError, TypeError, ValueError) as exc:
            raise TraceFormatError(f"{self.path}: not a readable trace store ({exc})") from None
        # Sites added by a flush that did not commit (the writer died) have no rows yet; leave them out.
        width = len(raw_sites)
        while width and int(raw_sites[width - 1]["first_row"]) >= self._rows:
            width -= 1
        raw_sites = raw_sites[:width]
        if steps.shape[0] != self._rows or self._values.shape[0] < self._rows or self._values.shape[1] < width:
            raise TraceFormatError(f"{self.path}: arrays are shorter than the committed site table and rows")
        self._width = width
        self._columns: dict[str, int] = {}
        by_column: list[Site] = []
        for col, s in enumerate(raw_sites):
            site = Site(str(s["name"]), str(s["kind"]), str(s["category"]), str(s["encoding"]), int(s["order"]),
                        str(s.get("info", "")), str(s.get("group", "")))
            by_column.append(site)
            self._columns[site.name] = col
        self._first_row = np.asarray([int(s["first_row"]) for s in raw_sites], dtype=np.int64)
        self._by_column = tuple(by_column)
        #: Sites in execution order.
        self.sites: tuple[Site, ...] = tuple(sorted(by_column, key=lambda s: s.order))
        #: Columns in execution order.
        self._order = np.asarray([self._columns[s.name] for s in self.sites], dtype=np.int64)
        self._steps = steps
        self._row_of = {int(s): i for i, s in enumerate(steps)}
        self._cache: tuple[int, np.ndarray, np.ndarray] | None = None

    # -------------------------------------------------------------- lookups

    @property
    def steps(self) -> tuple[int, ...]:
        return tuple(int(s) for s in self._steps)

    @property
    def step_array(self) -> np.ndarray:
        return self._steps

    def __len__(self) -> int:
        return self._rows

    def site(self, name: str) -> Site:
        col = self._columns.get(name)
        if col is None:
            raise KeyError(name)
        return self._by_column[col]

    def has_site(self, name: str) -> bool:
        return name in self._columns

    def column(self, name: str) -> int | None:
        return self._columns.get(name)

    def row_index(self, step: int) -> int | None:
        return self._row_of.get(int(step))

    def rows(self, start: int, end: int) -> tuple[np.ndarray, np.ndarray]:
        """``(values, present)`` of rows ``[start, end)``, all columns by column number; cells of a site before
        it was first recorded read as absent."""
        start, end = max(0, start), min(self._rows, end)
        if end <= start or self._width == 0:
            return (np.zeros((max(end - start, 0), self._width, 2), np.uint64),
                    np.zeros((max(end - start, 0), self._width), bool))
        values = np.asarray(self._values[start:end, : self._width])
        present = np.asarray(self._present[start:end, : self._width]).copy()
        # Cells of a site before its first row were never written: whatever an edge chunk holds there is absent.
        present &= np.arange(start, end)[:, None] >= self._first_row[None, :]
        return values, present

    def _row(self, row: int) -> tuple[np.ndarray, np.ndarray]:
        if self._cache is None or not self._cache[0] <= row < self._cache[0] + self._cache[1].shape[0]:
            base = row - row % self._BLOCK
            values, present = self.rows(base, base + self._BLOCK)
            self._cache = (base, values, present)
        base, values, present = self._cache
        return values[row - base], present[row - base]

    def lanes(self, step: int, site: str) -> tuple[int, int] | None:
        """The raw 128 bits of ``site`` at ``step``; ``None`` when absent (or the step is not in the trace)."""
        row, col = self._row_of.get(int(step)), self._columns.get(site)
        if row is None or col is None:
            return None
        values, present = self._row(row)
        if not present[col]:
            return None
        return int(values[col, 0]), int(values[col, 1])

    def value(self, step: int, site: str) -> float | int | str | None:
        """``site``'s value at ``step``: 32 hex digits for fingerprints and digests, the number itself for
        ``f64``/``i64`` cells; ``None`` when absent."""
        lanes = self.lanes(step, site)
        if lanes is None:
            return None
        return decode(lanes, self._by_column[self._columns[site]].encoding)

    def hex(self, step: int, site: str) -> str | None:
        """``site``'s raw 128 bits at ``step`` as 32 hex digits; ``None`` when absent."""
        lanes = self.lanes(step, site)
        return None if lanes is None else lanes_hex(lanes)

    def metric(self, step: int, name: str) -> float | int | str | None:
        """The metric ``name`` (with or without its ``metric.`` prefix) at ``step``."""
        return self.value(step, name if name.startswith("metric.") else f"metric.{name}")

    def row(self, step: int) -> TraceRow:
        row = self._row_of.get(int(step))
        if row is None:
            raise KeyError(step)
        values, present = self._row(row)
        out: dict[str, float | int | str] = {}
        for site in self.sites:
            col = self._columns[site.name]
            if present[col]:
                out[site.name] = decode(values[col], site.encoding)
        return TraceRow(int(step), out)

    def __iter__(self) -> Iterator[TraceRow]:
        """Rows in step order, each with its sites in execution order."""
        for step in self.steps:
            yield self.row(step)

    def __repr__(self) -> str:
        return (f"Trace({str(self.path)!r}, run={self.header.run!r}, rank={self.header.rank}, "
                f"level={self.header.level}, steps={self._rows}, sites={self._width})")


def open_trace(path: str | os.PathLike[str]) -> Trace:
    """Open one rank's trace store for reading."""
    return Trace(path)


def step_ranges(steps: Iterable[int]) -> str:
    """``"1-3, 7, 9-10"`` for a set of steps."""
    values = sorted(set(int(s) for s in steps))
    parts: list[str] = []
    i = 0
    while i < len(values):
        j = i
        while j + 1 < len(values) and values[j + 1] == values[j] + 1:
            j += 1
        parts.append(str(values[i]) if i == j else f"{values[i]}-{values[j]}")
        i = j + 1
    return ", ".join(parts)
