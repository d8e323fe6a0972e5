"""The trace store: one rank-local, append-only zarr (v3) group per run and rank (layout: ``docs/trace.md``).

Layout::

    <store>/zarr.json        attributes: header, rows (the commit marker), layout {flush_every, site_chunk}
    <store>/sites/zarr.json  empty array whose attribute ``sites`` is the site table, by column
    <store>/steps            int64  [capacity]             step of each row
    <store>/values           uint64 [capacity, sites, 2]   128-bit value of each cell
    <store>/present          bool   [capacity, sites]      whether the cell was recorded

Rows are written ``flush_every`` at a time on a background thread; arrays grow in whole chunks ahead of the rows.
``rows`` is written last on each flush and a reader trusts only that many rows (and the sites first recorded before
them), so a store whose writer died mid-flush still opens with every committed row."""

from __future__ import annotations

import itertools
import math
import os
import struct
import threading
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import numpy as np

from ckptverify.errors import CkptVerifyError, JSONError, UsageError
from ckptverify.fingerprint.spec import MASK64 as _MASK64
from ckptverify.ownfiles.names import own_folder
from ckptverify.safeparse import safejson
from ckptverify.safeparse.readers import read_small_file
from ckptverify.safeparse.zstd import decompress as zstd_decompress

__all__ = ["DIGEST_ENCODINGS", "ENCODINGS", "KINDS", "LEVELS", "TRACE_SCHEMA", "TRACE_SCHEMA_VERSION",
           "Cell", "Site", "Trace", "TraceHeader", "TraceRow", "TraceWriter", "open_trace", "rank_store_path"]

TRACE_SCHEMA = "ckptverify/trace"
TRACE_SCHEMA_VERSION = 1

#: Recording levels, each including the previous one: ``comm`` adds every collective and point-to-point op,
#: ``module`` every module's inputs, outputs and input gradients, ``op`` the op log of a window
#: (:mod:`ckptverify.trace.ops`).
LEVELS = ("metrics", "state", "comm", "module", "op")

#: How a trace's tensor digests read (header ``digest_encoding``), in words. Digests under two known encodings never
#: match, so such traces cannot be compared site by site.
DIGEST_ENCODINGS = {
    "unknown": "no tensor digested",
    "host": "xxh3 of the bytes of tensors in host memory",
    "device": "logical fingerprints computed on an accelerator",
    "host-as-device": "host tensors sent down the accelerator path (CKPTVERIFY_TRACE_HOST_AS_DEVICE=1)",
}

#: ``category``: one cell per tensor category per step; ``tensor``: one cell per tensor as well.
DETAILS = ("category", "tensor")

#: Site kind -> category.
KINDS: dict[str, str] = {
    "metric": "metric",
    "batch": "data",
    "module_out": "module",
    "module_grad_in": "module",
    "module_in": "module",
    "module_recompute": "module",
    "comm_in": "comm",
    "comm_out": "comm",
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

#: How a cell's 128 bits read: ``fp128`` tensor fingerprint, ``digest128`` xxh3-128, ``f64``/``i64`` a number in
#: lane 0 (lane 1 is 0), ``set128`` a category cell (:mod:`ckptverify.trace.category`).
ENCODINGS = ("fp128", "digest128", "f64", "i64", "set128")

DEFAULT_FLUSH_EVERY = 64
DEFAULT_SITE_CHUNK = 512

#: Reader caps: a store is untrusted bytes. Rows and sites far beyond any run; a chunk's decoded size, whatever
#: its metadata or compressed size says.
MAX_ROWS = 1 << 24
MAX_SITES = 1 << 20
MAX_CHUNK_BYTES = 256 << 20
MAX_METADATA_BYTES = 256 << 20

#: Rows read at once (compared, or cached for cells looked up one by one), capped in bytes for wide traces.
BLOCK_ROWS = 256
BLOCK_BYTES = 64 << 20


def block_rows(width: int) -> int:
    """How many rows of ``width`` sites to read at once (17 bytes a cell)."""
    return max(1, min(BLOCK_ROWS, BLOCK_BYTES // (17 * max(1, width))))


def _torch_version() -> str:
    import torch

    return str(torch.__version__)


def _tool_version() -> str:
    from ckptverify._version import __version__

    return __version__


@dataclass(frozen=True, kw_only=True)
class TraceHeader:
    """What a trace describes; two traces are comparable when their headers agree on everything but ``run``.
    ``rank``/``world_size`` left ``None`` are filled in by the recorder; ``extra`` holds the run's configuration;
    traces of either ``detail`` compare with each other."""

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
    digest_encoding: str = "unknown"

    def __post_init__(self) -> None:
        for what, value, known in (("digest encoding", self.digest_encoding, DIGEST_ENCODINGS),
                                   ("trace level", self.level, LEVELS), ("trace detail", self.detail, DETAILS)):
            if value not in known:
                raise UsageError(f"unknown {what} {value!r}; choose one of {', '.join(known)}")
        if self.schema != TRACE_SCHEMA:
            raise CkptVerifyError(f"not a trace header: schema {self.schema!r}")
        if self.schema_version != TRACE_SCHEMA_VERSION:
            raise CkptVerifyError(f"trace schema version {self.schema_version} is not one this tool reads "
                                  f"({TRACE_SCHEMA_VERSION})")

    def to_dict(self) -> dict[str, Any]:
        return {f.name: (dict(getattr(self, f.name)) if f.name == "extra" else getattr(self, f.name))
                for f in fields(self)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> TraceHeader:
        """The header a store's attributes hold; :class:`CkptVerifyError` for anything but the fields and types
        :meth:`to_dict` writes (an unknown level, detail or schema version included)."""
        if not isinstance(data, Mapping):
            raise CkptVerifyError(f"damaged trace header: {type(data).__name__}, not an object")
        known = {f.name for f in fields(cls)}
        values = {k: v for k, v in data.items() if k in known}
        for name, value in values.items():
            if not isinstance(value, _HEADER_TYPES[name]) or isinstance(value, bool):
                raise CkptVerifyError(f"damaged trace header: {name} is {type(value).__name__}")
        missing = sorted(known - values.keys())
        if missing:
            raise CkptVerifyError(f"damaged trace header: no {', '.join(missing)}")
        try:
            return cls(**values)
        except UsageError as exc:  # a level or detail this tool does not know
            raise CkptVerifyError(f"damaged trace header: {exc}") from None

    def differences(self, other: TraceHeader, ignore: Iterable[str] = ("run",)) -> list[str]:
        """Names of the fields that differ, ``ignore`` aside; ``digest_encoding`` counts only when both are known."""
        skip = set(ignore)
        if "unknown" in (self.digest_encoding, other.digest_encoding):
            skip.add("digest_encoding")
        a, b = self.to_dict(), other.to_dict()
        return [name for name in a if name not in skip and a[name] != b[name]]


_HEADER_TYPES: dict[str, Any] = {
    "run": str, "level": str, "workload": str, "detail": str, "rank": (int, type(None)),
    "world_size": (int, type(None)), "torch_version": str, "tool_version": str, "extra": dict, "schema": str,
    "schema_version": int, "digest_encoding": str,
}


@dataclass(frozen=True, slots=True)
class Site:
    """One recorded quantity. ``order``: position in execution order; ``info``: a free note; ``group``: the category
    cell a tensor's digest is summed into (empty otherwise)."""

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


def bits_float(bits: int) -> float:
    """The float64 whose bits are ``bits`` (signed or unsigned 64-bit)."""
    return struct.unpack("<d", struct.pack("<Q", int(bits) & _MASK64))[0]


def decode(lanes: Sequence[int], encoding: str) -> float | int | str:
    """A cell's value: a float (``f64``), an int (``i64``) or 32 hex digits (fingerprints, digests)."""
    if encoding == "f64":
        return bits_float(lanes[0])
    if encoding == "i64":
        v = int(lanes[0]) & _MASK64
        return v - (1 << 64) if v >= 1 << 63 else v
    return lanes_hex(lanes)


def rank_store_path(run_dir: str | os.PathLike[str], rank: int) -> Path:
    """Where rank ``rank`` of a run keeps its trace store."""
    return Path(run_dir) / f"rank{rank}"


def is_store(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is one rank's trace store (rather than a run's trace directory)."""
    return (Path(path) / "zarr.json").is_file()


class TraceWriter:
    """Appends rows to a new trace store at ``path``; each :meth:`append` is one step's cells in execution order.

    A site first seen at any step is placed right after the site recorded before it in that row; its earlier cells
    read as absent. Writes run on a background thread (``background=False``: the caller's); :meth:`flush` and
    :meth:`close` wait, and a background write's error is raised by the next call."""

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
        # Made here first: zarr's "w" empties whatever the name leads to, so a link there is refused, not followed.
        own_folder(self.path)
        self._group = zarr.open_group(str(self.path), mode="w" if overwrite else "a")
        self._steps = self._group.create_array("steps", shape=(0,), chunks=(flush_every,), dtype="int64",
                                               fill_value=0)
        self._values = self._group.create_array("values", shape=(0, 0, 2), chunks=(flush_every, site_chunk, 2),
                                                dtype="uint64", fill_value=0, compressors=None)
        self._present = self._group.create_array("present", shape=(0, 0), chunks=(flush_every, site_chunk),
                                                 dtype="bool", fill_value=False)
        #: The site table by column, each entry as the store holds it (``order`` filled in when written).
        self._sites: list[dict[str, Any]] = []
        self._column: dict[str, int] = {}
        #: Column -> place in execution order.
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
        self._sites_written = 0
        self._background = background
        self._pending: threading.Thread | None = None
        self._error: BaseException | None = None
        self._sites_meta = self._group.create_array("sites", shape=(0,), dtype="uint8", fill_value=0,
                                                    attributes={"sites": []})
        self._group.update_attributes({"header": header.to_dict(), "rows": 0,
                                       "layout": {"flush_every": flush_every, "site_chunk": site_chunk}})

    def set_header(self, header: TraceHeader) -> None:
        """Replace the header (the recorder learns ``digest_encoding`` from its first row); only before the first row
        is handed to the writing thread."""
        if self._rows or self._pending is not None:
            raise UsageError("the header of a trace store can only change before its first row is written")
        self.header = header
        self._group.update_attributes({"header": header.to_dict()})

    @property
    def rows(self) -> int:
        """Rows appended so far (written or buffered)."""
        return self._rows + len(self._buffer)

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
                known = self._sites[col]
                for what, value in (("kind", cell.kind), ("encoding", cell.encoding)):
                    if known[what] != value:
                        raise UsageError(f"site {cell.site!r} changed {what} from {known[what]} to {value}")
            if col in seen:
                raise UsageError(f"site {cell.site!r} recorded twice at step {step}")
            seen.add(col)
            columns.append(col)
            prev = col
        return columns

    def _add_site(self, cell: Cell, after: int | None) -> int:
        for what, value, known in (("kind", cell.kind, KINDS), ("encoding", cell.encoding, ENCODINGS)):
            if value not in known:
                raise UsageError(f"site {cell.site!r}: unknown {what} {value!r}")
        col = len(self._sites)
        self._sites.append({"name": cell.site, "kind": cell.kind, "category": KINDS[cell.kind],
                            "encoding": cell.encoding, "order": 0, "first_row": self.rows, "info": cell.info,
                            "group": cell.group})
        self._column[cell.site] = col
        pos = 0 if after is None else self._position[after] + 1
        if pos < len(self._position):
            self._position = {c: i + (i >= pos) for c, i in self._position.items()}
        self._position[col] = pos
        self._sites_version += 1
        return col

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
            job = (rows, start, len(self._sites), sites, self._sites_version)
            if wait:
                self._write(*job)
            else:
                self._pending = threading.Thread(target=self._run, args=job, name="ckptverify-trace-writer",
                                                 daemon=False)
                self._pending.start()

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
        """Write ``rows`` from row ``start``, one write per array, then commit them."""
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
            # Grow ahead (doubling, whole chunks): a resize rewrites three arrays' metadata on a thread that
            # shares the GIL with training, so it happens a few times a run; unwritten rows cost no files.
            chunk = self.flush_every
            new_capacity = max(end, 2 * capacity, 16 * chunk)
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
            # The site table lives in the attributes of the empty ``sites`` array.
            self._sites_meta.update_attributes({"sites": sites})
            self._sites_written = version
        # Last: the commit marker.
        self._group.update_attributes({"rows": end})

    def _site_table(self) -> list[dict[str, Any]]:
        return [dict(site, order=self._position[c]) for c, site in enumerate(self._sites)]

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


@dataclass(frozen=True, slots=True)
class TraceRow:
    """One step of a trace: site name -> value (see :func:`decode`), recorded sites only, in execution order."""

    step: int
    values: dict[str, float | int | str]


def _read_file(path: Path, limit: int) -> bytes | None:
    """The bytes of the regular file ``path`` (``None`` if absent); :class:`CkptVerifyError` past ``limit`` bytes or
    for a non-regular file (a FIFO would block the reader)."""
    try:
        return read_small_file(str(path), limit)
    except FileNotFoundError:
        return None
    except CkptVerifyError:
        raise
    except OSError as exc:
        raise CkptVerifyError(f"{path}: cannot be read: {exc}") from None


def _read_json(path: Path) -> Any:
    data = _read_file(path, MAX_METADATA_BYTES)
    if data is None:
        raise CkptVerifyError(f"{path}: missing (not a complete trace store)")
    try:
        return safejson.loads(data, max_bytes=MAX_METADATA_BYTES)
    except JSONError as exc:
        raise CkptVerifyError(f"{path}: damaged metadata: {exc}") from None


def _node(meta: Any, kind: str, where: Path) -> dict[str, Any]:
    if not isinstance(meta, dict) or meta.get("zarr_format") != 3 or meta.get("node_type") != kind:
        raise CkptVerifyError(f"{where}: not a zarr v3 {kind}")
    return meta


def _json_int(value: Any, what: str, where: Path, hi: int, lo: int = 0) -> int:
    try:
        return safejson.exact_int(value, what, lo=lo, hi=hi)
    except JSONError as exc:
        raise CkptVerifyError(f"{where}: {exc}") from None


def _site(raw: Any, col: int, store: Path) -> tuple[Site, int]:
    """One entry of the site table and the row it was first recorded at."""
    where = store / "sites"
    if not isinstance(raw, dict) or not all(isinstance(raw.get(k), str)
                                            for k in ("name", "kind", "category", "encoding")):
        raise CkptVerifyError(f"{where}: site {col} lacks its name, kind, category or encoding")
    if not isinstance(raw.get("info"), str) or not isinstance(raw.get("group"), str):
        raise CkptVerifyError(f"{where}: site {col} lacks its note or group, or one is not text")
    if raw["encoding"] not in ENCODINGS:
        raise CkptVerifyError(f"{where}: site {col} has an unknown encoding {raw['encoding'][:40]!r}")
    order = _json_int(raw.get("order"), f"the order of site {col}", where, MAX_SITES)
    first = _json_int(raw.get("first_row"), f"the first row of site {col}", where, MAX_ROWS)
    site = Site(raw["name"], raw["kind"], raw["category"], raw["encoding"], order, raw["info"], raw["group"])
    return site, first


def _configuration(node: Any, where: Path) -> dict[str, Any]:
    """The ``configuration`` of a zarr metadata object (empty when it has none)."""
    conf = node.get("configuration", {}) if isinstance(node, dict) else None
    if not isinstance(conf, dict):
        raise CkptVerifyError(f"{where}: damaged array metadata")
    return conf


class _Array:
    """One store array read chunk by chunk without zarr, in the only layout :class:`TraceWriter` writes (regular
    grid, default keys, ``bytes`` codec, optional ``zstd``). Every chunk decodes to exactly its size, at most
    :data:`MAX_CHUNK_BYTES`."""

    def __init__(self, path: Path, dtype: str, ndim: int) -> None:
        meta = _node(_read_json(path / "zarr.json"), "array", path)
        bad = lambda why: CkptVerifyError(f"{path}: {why}")  # noqa: E731
        if meta.get("data_type") != dtype:
            raise bad(f"data type {str(meta.get('data_type'))[:40]!r}, not {dtype}")
        shape, grid = meta.get("shape"), meta.get("chunk_grid")
        chunks = _configuration(grid, path).get("chunk_shape")
        if not (isinstance(grid, dict) and grid.get("name") == "regular" and isinstance(chunks, list)
                and isinstance(shape, list) and len(shape) == len(chunks) == ndim):
            raise bad(f"not a {ndim}-dimensional array on a regular chunk grid")
        shape_t = tuple(_json_int(n, "a dimension", path, 1 << 62) for n in shape)
        chunk_t = tuple(_json_int(n, "a chunk dimension", path, MAX_CHUNK_BYTES, lo=1) for n in chunks)
        np_dtype = np.dtype(dtype)
        if math.prod(chunk_t) * np_dtype.itemsize > MAX_CHUNK_BYTES:
            raise bad(f"chunks of {list(chunk_t)} {dtype} values, more than {MAX_CHUNK_BYTES} bytes")
        keys = meta.get("chunk_key_encoding")
        separator = _configuration(keys, path).get("separator", "/")
        if not (isinstance(keys, dict) and keys.get("name") == "default" and separator in ("/", ".")):
            raise bad("chunk keys are not zarr's default encoding")
        if meta.get("storage_transformers", []) != []:
            raise bad("storage transformers are not part of a trace store")
        codecs = meta.get("codecs")
        if not isinstance(codecs, list) or not 1 <= len(codecs) <= 2 or not all(isinstance(c, dict) for c in codecs):
            raise bad("codecs are not the bytes codec, optionally followed by zstd")
        first = codecs[0]
        endian = _configuration(first, path).get("endian", "little")
        if first.get("name") != "bytes" or endian not in ("little", "big"):
            raise bad("the first codec is not the bytes codec")
        zstd = len(codecs) == 2
        if zstd and codecs[1].get("name") != "zstd":
            raise bad(f"codec {str(codecs[1].get('name'))[:40]!r} is not part of a trace store (only zstd is)")
        np_dtype = np_dtype.newbyteorder("<" if endian == "little" else ">") if np_dtype.itemsize > 1 else np_dtype
        fill = meta.get("fill_value")
        if dtype == "bool":
            if not isinstance(fill, bool):
                raise bad("the fill value is not a boolean")
        else:
            info = np.iinfo(np_dtype)
            fill = _json_int(fill, "the fill value", path, int(info.max), lo=int(info.min))
        self.path, self.shape, self.chunks, self.dtype = path, shape_t, chunk_t, np_dtype
        self.fill, self.zstd, self.separator = fill, zstd, separator
        self.chunk_bytes = math.prod(chunk_t) * np_dtype.itemsize

    def _chunk(self, index: tuple[int, ...]) -> np.ndarray | None:
        """The decoded chunk at grid position ``index``; ``None`` when it was never written (all fill)."""
        where = self.path / ("c" + self.separator + self.separator.join(map(str, index)))
        limit = self.chunk_bytes + self.chunk_bytes // 128 + 1024 if self.zstd else self.chunk_bytes
        raw = _read_file(where, limit)
        if raw is None:
            return None
        if self.zstd:
            # Decoded into exactly the chunk's size, which its frames must declare (so none inflates past it).
            try:
                raw = zstd_decompress(raw, self.chunk_bytes, exact=True)
            except ValueError as exc:
                raise CkptVerifyError(f"{where}: {exc}") from None
        if len(raw) != self.chunk_bytes:
            raise CkptVerifyError(f"{where}: {len(raw)} bytes, its array's chunks hold {self.chunk_bytes}")
        return np.frombuffer(raw, dtype=self.dtype).reshape(self.chunks)

    def _chunk_files(self, first: int, last: int, enough: int) -> int:
        """How many chunk files of a 1-D array lie in ``[first, last)``, counted up to ``enough`` (a listing costs
        what is present, not what the metadata declares)."""
        folder, prefix = (self.path / "c", "") if self.separator == "/" else (self.path, "c.")
        found = 0
        try:
            with os.scandir(folder) as entries:
                for entry in entries:
                    name = entry.name[len(prefix):] if entry.name.startswith(prefix) else ""
                    if name.isascii() and name.isdigit() and len(name) < 20 and first <= int(name) < last:
                        found += 1
                        if found >= enough:
                            break
        except OSError:
            return 0
        return found

    def read(self, region: tuple[slice, ...], *, committed: bool = False) -> np.ndarray:
        """The values in ``region``, chunk by chunk. ``committed``: the region holds committed ``steps`` rows, which
        increase, so at most one equals the fill 0 and an unwritten chunk may hold only that one; refusing more makes
        declared rows cost bytes that are present."""
        starts = [s.start for s in region]
        stops = [s.stop for s in region]
        if committed and len(region) == 1:
            # Before allocating: the chunk files present must hold the rows (all but one chunk).
            first, last = starts[0] // self.chunks[0], -(-stops[0] // self.chunks[0])
            if self._chunk_files(first, last, last - first - 1) < last - first - 1:
                raise CkptVerifyError(f"{self.path}: chunks of committed rows are missing")
        out = np.full([b - a for a, b in zip(starts, stops, strict=True)], self.fill,
                      dtype=self.dtype.newbyteorder("="))
        if out.size == 0:
            return out
        missing = 0
        grid = [range(a // c, -(-b // c)) for a, b, c in zip(starts, stops, self.chunks, strict=True)]
        for index in itertools.product(*grid):
            chunk = self._chunk(index)
            lo = [i * c for i, c in zip(index, self.chunks, strict=True)]
            src = tuple(slice(max(a, l0) - l0, min(b, l0 + c) - l0)
                        for a, b, l0, c in zip(starts, stops, lo, self.chunks, strict=True))
            dst = tuple(slice(max(a, l0) - a, min(b, l0 + c) - a)
                        for a, b, l0, c in zip(starts, stops, lo, self.chunks, strict=True))
            if chunk is None:
                missing += math.prod(s.stop - s.start for s in src)
                if committed and missing > 1:
                    raise CkptVerifyError(f"{self.path}: chunks of committed rows are missing")
                continue
            out[dst] = chunk[src]
        return out


class Trace:
    """A trace store opened for reading. Use :func:`open_trace`."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        if not is_store(self.path):
            hint = ""
            if self.path.is_dir() and any(c.name.startswith("rank") for c in self.path.iterdir()):
                hint = f" (it is a run directory: its stores are {self.path}/rank<r>)"
            raise CkptVerifyError(f"no trace store at {self.path}{hint}")
        # Read without zarr: every size is checked against caps and bytes present before allocating.
        group = _read_json(self.path / "zarr.json")
        attrs = _node(group, "group", self.path / "zarr.json").get("attributes")
        if not isinstance(attrs, dict) or "header" not in attrs or "rows" not in attrs:
            raise CkptVerifyError(f"{self.path}: not a trace store (its zarr.json holds no trace header)")
        self.header = TraceHeader.from_dict(attrs["header"])
        self._rows = _json_int(attrs["rows"], "rows", self.path / "zarr.json", MAX_ROWS)
        sites_meta = _node(_read_json(self.path / "sites" / "zarr.json"), "array", self.path / "sites")
        sites_attrs = sites_meta.get("attributes")
        raw_sites = sites_attrs.get("sites") if isinstance(sites_attrs, dict) else None
        if not isinstance(raw_sites, list) or len(raw_sites) > MAX_SITES:
            raise CkptVerifyError(f"{self.path}/sites: the site table is not a list of at most {MAX_SITES} sites")
        steps_array = _Array(self.path / "steps", "int64", 1)
        self._values = _Array(self.path / "values", "uint64", 3)
        self._present = _Array(self.path / "present", "bool", 2)
        if steps_array.shape[0] < self._rows:
            raise CkptVerifyError(f"{self.path}: {steps_array.shape[0]} step entries for {self._rows} rows")
        steps = steps_array.read((slice(0, self._rows),), committed=True)
        if self._rows > 1 and not bool(np.all(steps[1:] > steps[:-1])):
            raise CkptVerifyError(f"{self.path}: the steps of the committed rows do not increase")
        sites = [_site(s, col, self.path) for col, s in enumerate(raw_sites)]
        # Sites of a flush that never committed have no rows: leave them out.
        width = len(sites)
        while width and sites[width - 1][1] >= self._rows:
            width -= 1
        by_column = [site for site, _ in sites[:width]]
        if (self._values.shape[0] < self._rows or self._values.shape[1] < width or self._values.shape[2] != 2
                or self._present.shape[0] < self._rows or self._present.shape[1] < width):
            raise CkptVerifyError(f"{self.path}: arrays are shorter than the committed site table and rows")
        self._width = width
        self._columns: dict[str, int] = {}
        for col, site in enumerate(by_column):
            if site.name in self._columns:
                raise CkptVerifyError(f"{self.path}/sites: the site {site.name[:200]!r} appears twice")
            self._columns[site.name] = col
        self._first_row = np.asarray([first for _, first in sites[:width]], dtype=np.int64)
        self._by_column = tuple(by_column)
        self.sites: tuple[Site, ...] = tuple(sorted(by_column, key=lambda s: s.order))
        self._order = np.asarray([self._columns[s.name] for s in self.sites], dtype=np.int64)
        self._steps = steps
        self._cache: tuple[int, np.ndarray, np.ndarray] | None = None

    @property
    def steps(self) -> tuple[int, ...]:
        return tuple(int(s) for s in self._steps)

    @property
    def step_array(self) -> np.ndarray:
        return self._steps

    def __len__(self) -> int:
        return self._rows

    def site(self, name: str) -> Site:
        return self._by_column[self._columns[name]]

    def has_site(self, name: str) -> bool:
        return name in self._columns

    def column(self, name: str) -> int | None:
        return self._columns.get(name)

    def row_index(self, step: int) -> int | None:
        step = int(step)
        if not -(1 << 63) <= step < 1 << 63:
            return None
        i = int(np.searchsorted(self._steps, step))
        return i if i < self._rows and int(self._steps[i]) == step else None

    def rows(self, start: int, end: int) -> tuple[np.ndarray, np.ndarray]:
        """``(values, present)`` of rows ``[start, end)`` by column; cells before a site's first row read absent."""
        start = max(0, start)
        end = max(start, min(self._rows, end))
        values = self._values.read((slice(start, end), slice(0, self._width), slice(0, 2)))
        present = self._present.read((slice(start, end), slice(0, self._width)))
        present &= np.arange(start, end)[:, None] >= self._first_row[None, :]
        return values, present

    def _row(self, row: int) -> tuple[np.ndarray, np.ndarray]:
        if self._cache is None or not self._cache[0] <= row < self._cache[0] + self._cache[1].shape[0]:
            block = block_rows(self._width)
            base = row - row % block
            values, present = self.rows(base, base + block)
            self._cache = (base, values, present)
        base, values, present = self._cache
        return values[row - base], present[row - base]

    def lanes(self, step: int, site: str) -> tuple[int, int] | None:
        """The raw 128 bits of ``site`` at ``step``; ``None`` when absent (or the step is not in the trace)."""
        row, col = self.row_index(step), self._columns.get(site)
        if row is None or col is None:
            return None
        values, present = self._row(row)
        if not present[col]:
            return None
        return int(values[col, 0]), int(values[col, 1])

    def value(self, step: int, site: str) -> float | int | str | None:
        """``site``'s value at ``step`` (hex digits, or the number for ``f64``/``i64``); ``None`` when absent."""
        lanes = self.lanes(step, site)
        return None if lanes is None else decode(lanes, self.site(site).encoding)

    def hex(self, step: int, site: str) -> str | None:
        """``site``'s raw 128 bits at ``step`` as 32 hex digits; ``None`` when absent."""
        lanes = self.lanes(step, site)
        return None if lanes is None else lanes_hex(lanes)

    def metric(self, step: int, name: str) -> float | int | str | None:
        """The metric ``name`` (with or without its ``metric.`` prefix) at ``step``."""
        return self.value(step, name if name.startswith("metric.") else f"metric.{name}")

    def row(self, step: int) -> TraceRow:
        row = self.row_index(step)
        if row is None:
            raise KeyError(step)
        values, present = self._row(row)
        columns = zip(self.sites, self._order.tolist(), strict=True)
        return TraceRow(int(step), {s.name: decode(values[col], s.encoding) for s, col in columns if present[col]})

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
    runs = [[v for _, v in run] for _, run in itertools.groupby(enumerate(values), lambda iv: iv[1] - iv[0])]
    return ", ".join(str(r[0]) if len(r) == 1 else f"{r[0]}-{r[-1]}" for r in runs)
