"""Deep verification: rebuild every tensor from disk and compare its logical fingerprint with the one taken at
save time (memory -> disk -> memory).

Tensors are rebuilt from the format's description (:mod:`ckptverify.formats.describe`), never via ``torch.load``;
NaN/Inf are counted on the way (warnings).
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ckptverify.dcp.layout import DTYPE_ITEMSIZE
from ckptverify.dcp.tensors import BLOCK_BYTES
from ckptverify.errors import FileChangedError, FindingError
from ckptverify.findings import Finding, Location, error, info, warning
from ckptverify.formats.describe import (
    MAX_VIEW_BYTES,
    Description,
    Payload,
    TensorDesc,
    iter_payload_blocks,
    stored_payloads,
    view_span,
)
from ckptverify.ownfiles.manifest import Manifest
from ckptverify.safeparse.dtypes import is_row_major
from ckptverify.safeparse.gcpause import paused_gc

#: The checks whose findings the deep check (:func:`scan_description`, :func:`judge_scans`) gives.
CHECKS = frozenset({"nonfinite", "deep-limit", "fingerprint", "deep-incomplete", "deep-nothing-rebuilt",
                    "replica-mismatch"})


@dataclass(slots=True)
class TensorScan:
    """What reading one tensor's chunks back gave: parts of its fingerprint and value counts."""

    parts: list = field(default_factory=list)
    elements: int = 0
    nan: int = 0
    inf: int = 0
    #: Some chunk's NaN/Inf could not be counted: ``nan`` and ``inf`` are not the tensor's counts.
    uncounted: bool = False
    unreadable: list[str] = field(default_factory=list)
    #: Chunks not read back because of a size limit (not damage): why, one line each.
    limited: list[str] = field(default_factory=list)
    #: A tensor stored as a tensor subclass: its fingerprint (from its parts') and each part's, by name.
    whole: str | None = None
    part_values: dict[str, str] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        """The scan as JSON values (read back by :meth:`from_json`): what another process computed of it."""
        return {"parts": [[f.value, f.dtype, list(f.shape), f.version, f.elements] for f in self.parts],
                "elements": self.elements, "nan": self.nan,
                "inf": self.inf, "uncounted": self.uncounted, "unreadable": list(self.unreadable),
                "limited": list(self.limited), "whole": self.whole, "part_values": dict(self.part_values)}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> TensorScan:
        from ckptverify.fingerprint.logical import TensorFingerprint

        return cls(parts=[TensorFingerprint(v, dt, tuple(sh), ver, el) for v, dt, sh, ver, el in d["parts"]],
                   elements=int(d["elements"]), nan=int(d["nan"]), inf=int(d["inf"]),
                   uncounted=bool(d.get("uncounted")), unreadable=list(d["unreadable"]), limited=list(d["limited"]),
                   whole=d["whole"], part_values=dict(d["part_values"]))

    def add(self, other: TensorScan) -> None:
        """Add ``other``'s value counts and reasons (not its fingerprint parts) to this scan's."""
        self.nan += other.nan
        self.inf += other.inf
        self.uncounted |= other.uncounted
        self.unreadable.extend(other.unreadable)
        self.limited.extend(other.limited)

    def value(self, shape: tuple[int, ...]) -> str | None:
        """The tensor's logical fingerprint if every element of ``shape`` was read back, else ``None``."""
        from ckptverify.fingerprint import combine

        if self.unreadable or self.limited:
            return None
        if self.whole is not None:
            return self.whole
        if not self.parts or self.elements != math.prod(shape):
            return None
        return combine(self.parts).value


def scan_payload(f: Any, name: str, p: Payload, shape: tuple[int, ...],
                 progress: Callable[[int], None] | None = None, view_limit: int | None = BLOCK_BYTES,
                 budget: int = MAX_VIEW_BYTES) -> TensorScan:
    """Fingerprint stored piece ``p`` of tensor ``name`` block by block through ``f``, counting non-finite values.
    A non-row-major view is read back from the storage bytes it addresses (any strides), unless :func:`view_limited`
    says it is over ``view_limit``/``budget`` (then ``limited``: a size limit, not damage); a view its storage cannot
    hold is ``unreadable``."""
    from ckptverify.fingerprint import chunk_fingerprint
    from ckptverify.fingerprint.nonfinite import nonfinite_counts

    scan = TensorScan()
    row_major = is_row_major(p.shape, p.stride)
    why = None if row_major else view_limited(p, view_limit, budget)
    if why is not None:
        return TensorScan(limited=[f"{name} chunk {list(p.chunk_offsets)} is {why}"])
    try:
        for offsets, block in iter_payload_blocks(f, p, row_major=row_major):
            scan.parts.append(chunk_fingerprint(block, offsets, shape))
            scan.elements += block.numel()
            if block.numel():
                nan, inf = nonfinite_counts(block)  # as a save counts them (one reduction when all are finite)
                if nan is None or inf is None:
                    scan.uncounted = True
                else:
                    scan.nan += nan
                    scan.inf += inf
            if progress is not None:
                progress(block.numel() * block.element_size())
    except FileChangedError:
        raise  # the run stops and says so: what was read proves nothing about the file now
    except (FindingError, RuntimeError, TypeError, ValueError, OSError) as exc:
        scan.unreadable.append(f"{name} chunk {list(p.chunk_offsets)}: {exc}")
    return scan


def view_limited(p: Payload, view_limit: int | None, budget: int = MAX_VIEW_BYTES) -> str | None:
    """Why the view ``p`` is not read back (``None``: it is, damaged or not): it addresses more than ``view_limit``
    bytes (held whole: memory), or lays out more than ``budget`` bytes from fewer stored (work)."""
    sizes = _view_sizes(p)
    if sizes is None:
        return None
    stored, laid_out = sizes
    view = f"a strided view (shape {list(p.shape)}, stride {list(p.stride)})"
    if view_limit is not None and stored > view_limit:
        return f"{view} over {stored} stored bytes, more than the {view_limit} the deep check holds at once"
    if laid_out > max(stored, budget):
        return (f"{view} of {laid_out} bytes once laid out from {stored} stored, past the {MAX_VIEW_BYTES} "
                "bytes of such views the deep check reads back")
    return None


def _view_sizes(p: Payload) -> tuple[int, int] | None:
    """Bytes of storage the view ``p`` addresses, and bytes it lays out; ``None`` for a damaged view."""
    try:
        start, end = view_span(p)
    except ValueError:
        return None
    return end - start, math.prod(p.shape) * DTYPE_ITEMSIZE[p.dtype]


def _view_budget(pieces: list[Payload]) -> dict[int, int]:
    """What is left of :data:`~ckptverify.formats.describe.MAX_VIEW_BYTES` for each expanding piece (by ``id``), in
    order: such views of one scan share the bound, so many small records cannot add up to unbounded work."""
    left, out = MAX_VIEW_BYTES, {}
    for p in pieces:
        sizes = _view_sizes(p)
        if sizes is None:
            continue
        stored, laid_out = sizes
        if laid_out > stored:
            out[id(p)] = left
            if laid_out <= left:
                left -= laid_out
    return out


def scan_description(desc: Description, run_map: Callable[[Callable[[Any], TensorScan], list[Any]], list[TensorScan]],
                     progress: Callable[[int], None] | None = None, only: set[str] | None = None, *,
                     view_limit: int | None = BLOCK_BYTES, stop_on_change: bool = True
                     ) -> tuple[dict[str, TensorScan], list[Finding]]:
    """Rebuild and fingerprint every stored piece of every tensor of ``desc`` (or of ``only``) through ``run_map``.

    A chunk stored more than once (a replicated tensor) is read in every copy: copies must match
    (``replica-mismatch``), and the fingerprint counts it once. An undescribed piece leaves its tensor without a
    fingerprint. ``view_limit``: see :func:`scan_payload`. ``stop_on_change``: a file changing under the scan raises
    :class:`~ckptverify.errors.FileChangedError`, else its piece is unreadable.
    """
    wanted = [(t, p) for t in desc.tensors.values() if only is None or t.name in only for p in t.payloads]
    subclassed = [t for t in desc.tensors.values() if t.subclass is not None and (only is None or t.name in only)]
    budgets = _view_budget([p for _, p in wanted] + [q for t in subclassed for q in stored_payloads(t)])

    def piece(name: str, p: Payload, shape: tuple[int, ...], where: str) -> TensorScan:
        """:func:`scan_payload` of ``p`` through ``desc``'s reader; unreadable (``where``: what it names) if it
        cannot be read, unless ``stop_on_change`` and its file changed."""
        try:
            with desc.open(p) as f:
                return scan_payload(f, name, p, shape, progress, view_limit, budgets.get(id(p), MAX_VIEW_BYTES))
        except (OSError, ValueError, KeyError) as exc:  # FileChangedError is an OSError
            if stop_on_change and isinstance(exc, FileChangedError):
                raise
            return TensorScan(unreadable=[f"{where}: {exc}"])

    def scan(pair: tuple[TensorDesc, Payload]) -> TensorScan:
        t, p = pair
        return piece(t.name, p, t.shape, f"{t.name} chunk {list(p.chunk_offsets)}")

    with paused_gc():  # thousands of scans and blocks, no reference cycles (see gcpause)
        scans, findings = _merge(desc, wanted, run_map(scan, wanted), only)
        parts = run_map(lambda t: scan_subclass_parts(t, piece), subclassed)
        for t, got in zip(subclassed, parts, strict=True):
            got.unreadable.extend(t.unread)
            scans[t.name] = got
        return scans, findings


def scan_bytes(desc: Description) -> int:
    """The bytes :func:`scan_description` passes to ``progress`` over all of ``desc`` when every piece reads back: each
    piece laid out (a subclass's by its parts)."""
    pieces = [p for t in desc.tensors.values()
              for p in [*t.payloads, *(part.payload for part in (t.subclass.parts if t.subclass else ()))]]
    return sum(math.prod(p.shape) * DTYPE_ITEMSIZE.get(p.dtype, 0) for p in pieces)


def scan_here(desc: Description, only: set[str] | None = None) -> tuple[dict[str, TensorScan], list[Finding]]:
    """:func:`scan_description` in this process, piece after piece, as :func:`~ckptverify.formats.describe.read_tensor`
    bounds a view; a file changing under it leaves its pieces unreadable."""
    return scan_description(desc, lambda fn, items: [fn(x) for x in items], only=only, view_limit=None,
                            stop_on_change=False)


def judge_scans(desc: Description, manifest: Manifest | None, scans: dict[str, TensorScan],
                found: list[Finding]) -> tuple[list[Finding], int]:
    """``found`` plus each tensor's verdict (the ``--deep`` checks of docs/verify.md): non-finite counts, a size limit
    (``deep-limit``), a tensor not rebuilt from its bytes or not the values fingerprinted (``fingerprint`` errors).
    Returns the findings and the tensors rebuilt; rebuilding none is an error (``deep-nothing-rebuilt``), some a
    warning (``deep-incomplete``): the report says how much of the check it made."""
    out = list(found)
    rebuilt = 0
    for fqn, t in sorted(desc.tensors.items()):
        scan = scans.get(fqn)
        if scan is None:
            continue  # not scanned here (no piece stored, or another part's): said by what left it out
        files = {p.file for p in stored_payloads(t)}
        loc = Location(fqn=fqn, file=files.pop() if len(files) == 1 else None)  # the file, when it is one
        if scan.nan or scan.inf:
            out.append(warning("nonfinite", f"{fqn!r} holds {scan.nan} NaN and {scan.inf} Inf values",
                               location=loc, actual={"nan": scan.nan, "inf": scan.inf}))
        if scan.limited:
            out.append(warning("deep-limit", f"{fqn!r} was not read back: {scan.limited[0]}; its stored bytes are "
                               "checked as any other's, its values are not", location=loc))
            continue
        value = scan.value(t.shape)
        if value is None:
            if scan.unreadable:
                out.append(error("fingerprint", f"{fqn!r} cannot be rebuilt from its bytes ({scan.unreadable[0]})",
                                 location=loc))
            # else pieces are missing (or the tensor is empty): said by what left them out (item-missing,
            # chunk-tiling, a part that did not report)
            continue
        rebuilt += 1
        saved = manifest.tensors.get(fqn) if manifest is not None else None
        if saved is not None and saved.fingerprint is not None and saved.fingerprint != value:
            out.append(error(
                "fingerprint",
                f"{fqn!r}: the values read back from disk are not the values that were in memory at save time"
                + parts_note(saved.parts, scan.part_values),
                location=loc, expected=saved.fingerprint, actual=value,
            ))
    wanted = sum(1 for t in desc.tensors.values() if 0 not in t.shape)
    if wanted and not rebuilt:
        out.append(error("deep-nothing-rebuilt", f"--deep rebuilt none of the {wanted} tensor(s) from "
                         "their bytes: nothing was checked end to end"))
    elif rebuilt < wanted:
        out.append(warning("deep-incomplete", f"--deep rebuilt {rebuilt} of {wanted} tensor(s); the others were not "
                           "read back (see the findings above)"))
    elif not desc.tensors:
        out.append(info("fingerprint", "no tensors to rebuild"))
    return out, rebuilt


def scan_subclass_parts(t: TensorDesc, piece: Callable[[str, Payload, tuple[int, ...], str], TensorScan]
                        ) -> TensorScan:
    """Rebuild each inner tensor of ``t`` (a tensor subclass) through ``piece`` (:func:`scan_description`'s) and give
    each part's fingerprint and the subclass's (as :mod:`ckptverify.fingerprint.subclass` gives it live)."""
    import json

    from ckptverify.fingerprint import TensorFingerprint, combine
    from ckptverify.fingerprint.subclass import combine_parts

    assert t.subclass is not None
    out = TensorScan()
    parts: list[tuple[str, TensorFingerprint]] = []
    for part in t.subclass.parts:
        got = piece(f"{t.name}.{part.name}", part.payload, part.shape, f"{t.name} part {part.name!r}")
        out.add(got)
        if got.unreadable or got.limited:
            continue  # else every element of the part's shape (its payload's) was read back
        fp = combine(got.parts) if got.parts else TensorFingerprint.from_lanes((0, 0), part.dtype, part.shape, 0)
        parts.append((part.name, fp))
        out.part_values[part.name] = fp.value
    out.elements = math.prod(t.shape)
    if not out.unreadable and not out.limited:
        out.whole = combine_parts(t.subclass.cls, t.dtype, t.shape, json.loads(t.subclass.context), parts)
    return out


def _merge(desc: Description, wanted: list[tuple[TensorDesc, Payload]], results: list[TensorScan],
           only: set[str] | None) -> tuple[dict[str, TensorScan], list[Finding]]:
    """Each tensor's scan from its pieces' (a chunk stored more than once counted once, its copies compared)."""
    from ckptverify.fingerprint import combine

    by_chunk: dict[tuple[str, tuple[int, ...]], list[tuple[Payload, TensorScan]]] = defaultdict(list)
    for (t, p), got in zip(wanted, results, strict=True):
        by_chunk[(t.name, p.chunk_offsets)].append((p, got))
    merged: dict[str, TensorScan] = defaultdict(TensorScan)
    findings: list[Finding] = []
    for (fqn, offsets), copies in by_chunk.items():
        first_p, first = copies[0]
        if len(copies) > 1 and not first.unreadable and first.parts:
            reference = combine(first.parts).value
            for p, other in copies[1:]:
                if not other.unreadable and other.parts and combine(other.parts).value != reference:
                    findings.append(error(
                        "replica-mismatch",
                        f"{fqn!r} chunk {list(offsets)} is stored in {first_p.file} and {p.file} "
                        "with different values: replicas that should be identical are not",
                        location=Location(fqn=fqn, chunk_offsets=offsets, file=p.file),
                    ))
        m = merged[fqn]
        m.add(first)
        m.parts.extend(first.parts)
        m.elements += first.elements
    for t in desc.tensors.values():
        if t.unread and (only is None or t.name in only):
            merged[t.name].unreadable.extend(t.unread)
    return dict(merged), findings


def parts_note(saved: tuple[tuple[str, str], ...] | None, rebuilt: dict[str, str]) -> str:
    """Which inner tensors of a tensor subclass differ from the manifest's, when both sides know them."""
    if not saved or not rebuilt:
        return ""
    saved_parts = dict(saved)
    names = list(saved_parts) + [n for n in rebuilt if n not in saved_parts]
    differ = [n for n in names if saved_parts.get(n) != rebuilt.get(n)]
    if not differ:
        return " (each part matches: its attributes differ)"
    return f" (its {' and '.join(repr(n) for n in differ)} part{'s' if len(differ) > 1 else ''} differ" + \
        ("s" if len(differ) == 1 else "") + ")"
