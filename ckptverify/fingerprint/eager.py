"""The eager torch path of the logical fingerprint: any device, and the reference the fused kernels check against.

Also the dtype table, a chunk's geometry (runs of consecutive global indices) and block cutting, shared with the
compiled and Triton paths, and :func:`lanes_many_eager`. Imports only :mod:`ckptverify.fingerprint.spec`, so the
kernels depend on it, never the reverse.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ckptverify.errors import UsageError
from ckptverify.fingerprint.spec import DTYPE_NAMES, INDEX_MULTIPLIER, LANES, MASK64, Mixer, dtype_seed, mix
from ckptverify.fingerprint.spec import signed as _signed

# --------------------------------------------------------------------------------------------- dtypes

#: Integer view of each element width (an element's bits, as the fingerprint reads them).
_INT_VIEW_BY_SIZE = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}

SUPPORTED_DTYPES: dict[torch.dtype, str] = {
    getattr(torch, name): name for name in DTYPE_NAMES if isinstance(getattr(torch, name, None), torch.dtype)
}


def dtype_name(dtype: torch.dtype) -> str:
    """The stable name of a dtype (``torch.float32`` -> ``"float32"``); refuses unsupported dtypes."""
    try:
        return SUPPORTED_DTYPES[dtype]
    except KeyError:
        raise UsageError(f"the tensor fingerprint is not defined for dtype {dtype}") from None


def as_real(t: torch.Tensor, offsets: Sequence[int] = (), global_shape: Sequence[int] = ()
            ) -> tuple[torch.Tensor, list[int], list[int]]:
    """``t`` as fingerprinted, with its chunk's ``offsets`` and ``global_shape``: a conjugated or negated view
    resolved to its values, complex as its real view (a last dim of 2 in the global shape too)."""
    offsets, global_shape = list(offsets), list(global_shape)
    if t.is_conj():
        t = t.resolve_conj()
    if t.is_neg():
        t = t.resolve_neg()
    if t.is_complex():
        t = torch.view_as_real(t)
        offsets.append(0)
        global_shape.append(2)
    return t, offsets, global_shape


def flat_bits(t: torch.Tensor) -> torch.Tensor:
    """The flat contiguous signed-integer view of ``t``'s elements as fingerprinted (:func:`as_real`).
    Reinterpretation precedes any copy, so dtypes torch cannot copy everywhere (packed ``float4_e2m1fn_x2``) are
    copied as plain integers."""
    t = as_real(t.detach())[0]
    return t.view(_INT_VIEW_BY_SIZE[t.element_size()]).contiguous().reshape(-1)


# ------------------------------------------------------------------------------------------- geometry


@dataclass(frozen=True)
class _Geometry:
    """A chunk as runs of consecutive global indices: dims ``p+1..`` span the global extent, so each run covers dims
    ``p..`` (``run_length`` elements); runs enumerate dims ``0..p-1`` in row-major order."""

    outer_shape: tuple[int, ...]
    outer_strides: tuple[int, ...]  # global strides of the outer dims
    first_start: int  # global index of the chunk's first element
    run_length: int

    @property
    def num_runs(self) -> int:
        return math.prod(self.outer_shape)

    def run_start(self, q: int) -> int:
        start = self.first_start
        for size, stride in zip(reversed(self.outer_shape), reversed(self.outer_strides), strict=True):
            q, i = divmod(q, size)
            start += i * stride
        return start

    def run_starts(self, q0: int, count: int, device: torch.device) -> torch.Tensor:
        """Global starts of runs ``q0 .. q0+count-1`` as an int64 tensor on ``device``."""
        if len(self.outer_shape) == 1:
            stride = self.outer_strides[0]
            starts = torch.arange(count, dtype=torch.int64, device=device)
            return starts.mul_(stride).add_(self.first_start + q0 * stride)
        q = torch.arange(q0, q0 + count, dtype=torch.int64, device=device)
        starts = torch.full((count,), self.first_start, dtype=torch.int64, device=device)
        for size, stride in zip(reversed(self.outer_shape), reversed(self.outer_strides), strict=True):
            starts.add_(torch.remainder(q, size).mul_(stride))
            q = torch.div(q, size, rounding_mode="floor")
        return starts


def chunk_geometry(shape: Sequence[int], offsets: Sequence[int], global_shape: Sequence[int]) -> _Geometry:
    shape, offsets, global_shape = tuple(shape), tuple(offsets), tuple(global_shape)
    if not (len(shape) == len(offsets) == len(global_shape)):
        raise UsageError(
            f"chunk shape {list(shape)}, offsets {list(offsets)} and global shape {list(global_shape)} "
            "must have the same number of dimensions"
        )
    for size, off, total in zip(shape, offsets, global_shape, strict=True):
        if size < 0 or off < 0 or total < 0 or off + size > total:
            raise UsageError(
                f"chunk of shape {list(shape)} at offsets {list(offsets)} does not fit in global shape "
                f"{list(global_shape)}"
            )
    if not shape:
        return _Geometry((), (), 0, 1)
    strides = [1] * len(shape)
    for j in range(len(shape) - 2, -1, -1):
        strides[j] = strides[j + 1] * global_shape[j + 1]
    p = len(shape) - 1
    while p > 0 and shape[p] == global_shape[p]:
        p -= 1
    first = sum(off * stride for off, stride in zip(offsets, strides, strict=True))
    return _Geometry(tuple(shape[:p]), tuple(strides[:p]), first, math.prod(shape[p:]))


# --------------------------------------------------------------------------------------------- blocks

#: Elements per eager block on CPU (buffers stay in cache, per-operation overhead amortized).
EAGER_BLOCK = 1 << 16
#: Elements per block of the eager path on accelerators, where each operation costs a kernel launch.
EAGER_BLOCK_ACCELERATOR = 1 << 22
#: Width of the rows that runs at least one block long are cut into (shorter runs are one row each).
ROW_WIDTH = 1 << 13


def eager_block(device: torch.device) -> int:
    return EAGER_BLOCK if device.type == "cpu" else EAGER_BLOCK_ACCELERATOR


@dataclass
class _Block:
    bits: torch.Tensor  # (rows, width), an integer view of the chunk's bits
    starts: torch.Tensor | None  # (rows,) int64 global index of each row's first element, on device
    first_start: int  # when ``starts`` is None: rows follow each other at ``row_step``
    row_step: int


def iter_blocks(flat: torch.Tensor, geometry: _Geometry, block: int) -> Iterator[_Block]:
    """Cut the flat view into blocks of about ``block`` elements, each a set of rows of consecutive global indices."""
    run = geometry.run_length
    if run >= block:  # long runs: each cut into rows, a block holding rows of one run
        width = min(ROW_WIDTH, block)
        rows_per_block = block // width
        for q in range(geometry.num_runs):
            g = geometry.run_start(q)
            seg = flat[q * run : (q + 1) * run]
            pos = 0
            full_rows = run // width
            while full_rows > 0:
                rows = min(rows_per_block, full_rows)
                n = rows * width
                yield _Block(seg[pos : pos + n].view(rows, width), None, g + pos, width)
                pos += n
                full_rows -= rows
            if pos < run:
                yield _Block(seg[pos:].view(1, run - pos), None, g + pos, 0)
    else:  # short runs: one row per run, a block holding whole runs
        runs_per_block = max(1, block // run)
        total = geometry.num_runs
        for q0 in range(0, total, runs_per_block):
            rows = min(runs_per_block, total - q0)
            bits = flat[q0 * run : (q0 + rows) * run].view(rows, run)
            starts = geometry.run_starts(q0, rows, flat.device)
            yield _Block(bits, starts, 0, 0)


# ------------------------------------------------------------------------------------------ eager path


def eager_lanes(flat: torch.Tensor, geometry: _Geometry, seeds: tuple[int, int]) -> tuple[int, int]:
    """The two unsigned lane sums of the chunk ``flat`` (laid out as ``geometry``) in torch operations on its device:
    the path of devices without a fused kernel, and the reference. Sums stay on the device until the end (no host
    synchronisation per block)."""
    kw: dict = {"dtype": torch.int64, "device": flat.device}
    block = eager_block(flat.device)
    k = _signed(INDEX_MULTIPLIER)
    # column_table[j] = j * K; a row starting at global index r adds r * K on top.
    column_table = torch.arange(min(max(ROW_WIDTH, block), flat.numel()), **kw).mul_(k)  # no row is wider
    lane_seeds = [_signed(s) for s in seeds]
    acc = torch.zeros(2, **kw)
    for blk in iter_blocks(flat, geometry, block):
        rows, width = blk.bits.shape
        w = blk.bits.to(torch.int64)  # sign-extends the element bits to 64
        starts = blk.starts
        if starts is None:
            starts = torch.arange(rows, **kw).mul_(blk.row_step).add_(blk.first_start)
        p = starts.mul(k)[:, None] + column_table[:width]  # g * K, modulo 2**64
        for lane, mixer in enumerate(LANES):
            acc[lane] += mix_tensor(w ^ (p + lane_seeds[lane]), mixer).sum()
    a, b = acc.tolist()
    return a & MASK64, b & MASK64


def _xorshift(x: torch.Tensor, s: int) -> torch.Tensor:
    """``x ^ (x >> s)`` with a logical shift: torch's int64 shift is arithmetic, so the sign copies are masked off."""
    return x ^ ((x >> s) & ((1 << (64 - s)) - 1))


def _multiply(x: torch.Tensor, m: int) -> torch.Tensor:
    return x * _signed(m)  # int64 multiplication wraps modulo 2**64


def mix_tensor(x: torch.Tensor, mixer: Mixer) -> torch.Tensor:
    """:func:`~ckptverify.fingerprint.spec.mix` on an int64 tensor (two's complement of the words)."""
    return mix(x, mixer, _xorshift, _multiply)


# ------------------------------------------------------------------------------------------- many


@dataclass(frozen=True)
class _Piece:
    member: int  # position of the tensor in the caller's list
    start: int  # first element of the piece in the tensor (its global index: whole tensors)
    length: int


@dataclass
class _ManyBlock:
    """Consecutive pieces of tensors of one element size; ``tables`` (several pieces only) on the device."""

    pieces: tuple[_Piece, ...]
    numel: int
    tables: dict[str, torch.Tensor] | None = None


@dataclass
class _ManyPlan:
    """How one layout goes through :func:`lanes_many_eager`: its blocks and each tensor's range of piece sums."""

    blocks: list[_ManyBlock]
    first: torch.Tensor  # (n,) index in the zero-prefixed cumulative piece sums
    last: torch.Tensor  # (n,)


#: Layouts -> plans (a trace category keeps its shapes, so each plan is built once).
_many_plans: dict[tuple[Any, ...], _ManyPlan] = {}
_MANY_PLANS_KEPT = 64


def _plan_many(numels: Sequence[int], sizes: Sequence[int], seeds: Sequence[tuple[int, int]], block: int,
               device: torch.device) -> _ManyPlan:
    """Cut tensors into blocks of at most ``block`` elements by element size: large ones alone in pieces, small ones
    several to a block."""
    blocks: list[_ManyBlock] = []
    for size in dict.fromkeys(sizes):
        pieces: list[_Piece] = []
        count = 0
        for m, n in enumerate(numels):
            if sizes[m] != size or n == 0:
                continue
            if n >= block:
                for start in range(0, n, block):
                    length = min(block, n - start)
                    blocks.append(_ManyBlock((_Piece(m, start, length),), length))
                continue
            if count + n > block:
                blocks.append(_ManyBlock(tuple(pieces), count))
                pieces, count = [], 0
            pieces.append(_Piece(m, 0, n))
            count += n
        if pieces:
            blocks.append(_ManyBlock(tuple(pieces), count))
    first = [0] * len(numels)
    last = [0] * len(numels)
    seen: set[int] = set()
    k = 0
    for blk in blocks:
        if len(blk.pieces) > 1:
            blk.tables = _block_tables(blk, seeds, device)
        for p in blk.pieces:
            if p.member not in seen:
                seen.add(p.member)
                first[p.member] = k
            k += 1
            last[p.member] = k
    kw: dict = {"dtype": torch.int64}
    return _ManyPlan(blocks, torch.tensor(first, **kw).to(device), torch.tensor(last, **kw).to(device))


def _block_tables(blk: _ManyBlock, seeds: Sequence[tuple[int, int]], device: torch.device) -> dict[str, torch.Tensor]:
    """Per-piece tables of a multi-piece block: lengths, ends, offsets to tensor indices, and seeds."""
    kw: dict = {"dtype": torch.int64}
    ends, offsets, pos = [], [], 0
    for p in blk.pieces:
        offsets.append(p.start - pos)
        pos += p.length
        ends.append(pos - 1)
    host = {
        "lengths": torch.tensor([p.length for p in blk.pieces], **kw),
        "ends": torch.tensor(ends, **kw),
        "offsets": torch.tensor(offsets, **kw),
        "seed0": torch.tensor([_signed(seeds[p.member][0]) for p in blk.pieces], **kw),
        "seed1": torch.tensor([_signed(seeds[p.member][1]) for p in blk.pieces], **kw),
        "pieces": torch.arange(len(blk.pieces), **kw),
    }
    return {name: value.to(device) for name, value in host.items()}


def lanes_many_eager(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """:func:`ckptverify.fingerprint.kernels.lanes_many` with torch operations only (any device; the reference), of
    tensors on one device, at least one (which that entry checks)."""
    device = tensors[0].device
    flats: list[torch.Tensor] = []
    seeds: list[tuple[int, int]] = []
    for t in tensors:
        name = dtype_name(t.dtype)
        flats.append(flat_bits(t))
        seeds.append((dtype_seed(name, 0), dtype_seed(name, 1)))
    block = eager_block(device)
    key = (str(device), block, tuple((f.numel(), t.dtype) for f, t in zip(flats, tensors, strict=True)))
    plan = _many_plans.get(key)
    if plan is None:
        plan = _plan_many([f.numel() for f in flats], [f.element_size() for f in flats], seeds, block, device)
        if len(_many_plans) >= _MANY_PLANS_KEPT:
            _many_plans.pop(next(iter(_many_plans)))
        _many_plans[key] = plan
    k = _signed(INDEX_MULTIPLIER)
    sums: tuple[list[torch.Tensor], list[torch.Tensor]] = ([], [])
    for blk in plan.blocks:
        if blk.tables is None:  # one piece of one tensor
            p = blk.pieces[0]
            bits = flats[p.member][p.start : p.start + p.length].to(torch.int64)
            g = torch.arange(p.start, p.start + p.length, dtype=torch.int64, device=device).mul_(k)
            for lane, mixer in enumerate(LANES):
                y = mix_tensor(bits ^ (g + _signed(seeds[p.member][lane])), mixer)
                sums[lane].append(y.sum().reshape(1))
            continue
        tab = blk.tables
        bits = torch.cat([flats[p.member] for p in blk.pieces]).to(torch.int64)
        piece = torch.repeat_interleave(tab["pieces"], tab["lengths"], output_size=blk.numel)
        g = torch.arange(blk.numel, dtype=torch.int64, device=device).add_(tab["offsets"][piece]).mul_(k)
        for lane, mixer in enumerate(LANES):
            y = mix_tensor(bits ^ (g + tab[f"seed{lane}"][piece]), mixer)
            at_ends = torch.cumsum(y, 0)[tab["ends"]]
            sums[lane].append(torch.diff(at_ends, prepend=at_ends.new_zeros(1)))
    lanes = []
    for lane in (0, 1):
        if not sums[lane]:  # every tensor is empty
            lanes.append(torch.zeros(len(tensors), dtype=torch.int64, device=device))
            continue
        running = torch.cumsum(torch.cat([torch.zeros(1, dtype=torch.int64, device=device), *sums[lane]]), 0)
        lanes.append(running[plan.last] - running[plan.first])
    return torch.stack(lanes, dim=1)
