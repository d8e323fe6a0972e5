"""Torch kernels of the logical tensor fingerprint (see ``docs/fingerprint.md``).

Everything here runs on the tensor's own device with torch operations only. Two implementations of the
same arithmetic exist:

* the **eager** path: a fixed sequence of in-place torch operations over blocks of a fixed number of
  elements, writing into buffers allocated once per call. It runs on every device and is the reference.
* the **compiled** path: the same formula handed to ``torch.compile``, which fuses it into one loop
  (C++/OpenMP on CPU). It is used only for full blocks of one fixed shape, so one compilation per source
  integer width is all it ever needs, and any block it does not take goes through the eager path.

Both compute exactly the same integers (wrapping 64-bit arithmetic has no rounding), which the tests check.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import math
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ckptverify.errors import UsageError
from ckptverify.fingerprint import FINGERPRINT_VERSION

_log = logging.getLogger(__name__)

_MASK64 = (1 << 64) - 1


def _signed(value: int) -> int:
    """The int64 (two's complement) reading of a value taken modulo 2**64."""
    value &= _MASK64
    return value - (1 << 64) if value >= 1 << 63 else value


#: K: the odd multiplier that spreads the global index over 64 bits before it meets the element's bits.
INDEX_MULTIPLIER = 0x9E3779B97F4A7C15


@dataclass(frozen=True)
class _Mixer:
    """``x ^= x >> s1; x *= m1; x ^= x >> s2; x *= m2; x ^= x >> s3`` (logical shifts, modulo 2**64)."""

    shifts: tuple[int, int, int]
    multipliers: tuple[int, int]


#: Lane 0 mixes with the MurmurHash3 ``fmix64`` finalizer, lane 1 with the SplitMix64 finalizer
#: (Stafford's "Mix13"). Both are bijections of 64-bit words.
LANES: tuple[_Mixer, _Mixer] = (
    _Mixer((33, 33, 33), (0xFF51AFD7ED558CCD, 0xC4CEB9FE1A85EC53)),
    _Mixer((30, 27, 31), (0xBF58476D1CE4E5B9, 0x94D049BB133111EB)),
)


def mix_python(x: int, lane: int) -> int:
    """The lane's mixer on one unsigned 64-bit word, in plain Python (the reference for docs and tests)."""
    mixer = LANES[lane]
    s1, s2, s3 = mixer.shifts
    m1, m2 = mixer.multipliers
    x &= _MASK64
    x ^= x >> s1
    x = (x * m1) & _MASK64
    x ^= x >> s2
    x = (x * m2) & _MASK64
    x ^= x >> s3
    return x


# --------------------------------------------------------------------------------------------- dtypes

#: Element dtypes the fingerprint is defined for, by name. Complex dtypes are fingerprinted through their
#: real view (pairs of the matching float), under the complex dtype's own name.
_INT_VIEW_BY_SIZE = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}

_DTYPE_NAMES = (
    "float64", "float32", "float16", "bfloat16",
    "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu",
    "float4_e2m1fn_x2",
    "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
    "bool",
    "complex32", "complex64", "complex128",
)  # fmt: skip

SUPPORTED_DTYPES: dict[torch.dtype, str] = {
    getattr(torch, name): name for name in _DTYPE_NAMES if isinstance(getattr(torch, name, None), torch.dtype)
}


def dtype_name(dtype: torch.dtype) -> str:
    """The stable name of a dtype (``torch.float32`` -> ``"float32"``); refuses unsupported dtypes."""
    try:
        return SUPPORTED_DTYPES[dtype]
    except KeyError:
        raise UsageError(f"the tensor fingerprint is not defined for dtype {dtype}") from None


@functools.cache
def dtype_seed(name: str, lane: int) -> int:
    """S: the per-dtype, per-lane seed, as an unsigned 64-bit integer."""
    text = f"ckptverify/fingerprint/v{FINGERPRINT_VERSION}/lane{lane}/{name}".encode()
    return int.from_bytes(hashlib.sha256(text).digest()[:8], "little")


# ------------------------------------------------------------------------------------------- geometry


@dataclass(frozen=True)
class _Geometry:
    """A chunk (local shape at global offsets) as runs of consecutive global indices.

    Dimensions ``p+1 ..`` of the chunk span the whole global extent, so each run covers dims ``p ..`` and
    is ``run_length`` elements long; runs are enumerated by the outer dims ``0 .. p-1`` in row-major order.
    """

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

#: Elements per block of the eager path on CPU (a few int64 buffers of this many words per call: small
#: enough to stay in cache, large enough to amortize the per-operation overhead).
EAGER_BLOCK = 1 << 16
#: Elements per block of the eager path on accelerators, where each operation costs a kernel launch.
EAGER_BLOCK_ACCELERATOR = 1 << 22
#: Width of the rows that runs at least one block long are cut into (shorter runs are one row each).
ROW_WIDTH = 1 << 13
#: Elements per block of the compiled path (``COMPILED_BLOCK // ROW_WIDTH`` rows of ``ROW_WIDTH``).
COMPILED_BLOCK = 1 << 20


def eager_block(device: torch.device) -> int:
    return EAGER_BLOCK if device.type == "cpu" else EAGER_BLOCK_ACCELERATOR


@dataclass
class _Block:
    bits: torch.Tensor  # (rows, width), an integer view of the chunk's bits
    starts: torch.Tensor | None  # (rows,) int64 global index of each row's first element, on device
    first_start: int  # when ``starts`` is None: rows follow each other at ``row_step``
    row_step: int


def iter_blocks(flat: torch.Tensor, geometry: _Geometry, block: int) -> Iterator[_Block]:
    """Cut the chunk's flat integer view into blocks of about ``block`` elements, each a set of rows of
    consecutive global indices."""
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


class _EagerState:
    """Buffers and tables for one fingerprint call on one device, allocated once per call."""

    def __init__(self, device: torch.device, seeds: tuple[int, int], numel: int) -> None:
        kw: dict = {"dtype": torch.int64, "device": device}
        self.block = eager_block(device)
        n = min(self.block, numel)  # no block holds more elements than this
        self.w = torch.empty(n, **kw)
        self.idx = torch.empty(n, **kw)
        self.y = torch.empty(n, **kw)
        self.t = torch.empty(n, **kw)
        self.row_terms = torch.empty(n, **kw)
        self.lane_terms = torch.empty(n, **kw)
        # column_table[k] = k * K; a row starting at global index r contributes r * K + S on top.
        width = min(max(ROW_WIDTH, self.block), numel)  # no row is wider
        self.column_table = torch.arange(width, **kw).mul_(_signed(INDEX_MULTIPLIER))
        self.seeds = [_signed(s) for s in seeds]
        self.acc = torch.zeros(2, **kw)

    def add_block(self, blk: _Block) -> None:
        rows, width = blk.bits.shape
        n = rows * width
        w = self.w[:n].view(rows, width)
        w.copy_(blk.bits)  # sign-extends the element bits to 64
        row_terms = self.row_terms[:rows]
        if blk.starts is None:
            torch.arange(rows, out=row_terms)
            row_terms.mul_(blk.row_step).add_(blk.first_start)
        else:
            row_terms.copy_(blk.starts)
        row_terms.mul_(_signed(INDEX_MULTIPLIER))
        lane_terms = self.lane_terms[:rows]
        idx = self.idx[:n].view(rows, width)
        y = self.y[:n].view(rows, width)
        t = self.t[:n].view(rows, width)
        for lane, mixer in enumerate(LANES):
            # idx = (row start + column) * K + S_lane, modulo 2**64
            torch.add(row_terms, self.seeds[lane], out=lane_terms)
            torch.add(self.column_table[:width], lane_terms[:, None], out=idx)
            torch.bitwise_xor(w, idx, out=y)
            s1, s2, s3 = mixer.shifts
            m1, m2 = mixer.multipliers
            _xorshift(y, t, s1)
            y.mul_(_signed(m1))
            _xorshift(y, t, s2)
            y.mul_(_signed(m2))
            _xorshift(y, t, s3)
            self.acc[lane] += y.sum()


def _xorshift(y: torch.Tensor, t: torch.Tensor, s: int) -> None:
    """``y ^= y >> s`` with a logical shift (an arithmetic shift, then the sign copies masked off)."""
    torch.bitwise_right_shift(y, s, out=t)
    t.bitwise_and_((1 << (64 - s)) - 1)
    y.bitwise_xor_(t)


# --------------------------------------------------------------------------------------- compiled path


def _mix_tensor(x: torch.Tensor, mixer: _Mixer) -> torch.Tensor:
    s1, s2, s3 = mixer.shifts
    m1, m2 = mixer.multipliers
    x = x ^ ((x >> s1) & ((1 << (64 - s1)) - 1))
    x = x * _signed(m1)
    x = x ^ ((x >> s2) & ((1 << (64 - s2)) - 1))
    x = x * _signed(m2)
    return x ^ ((x >> s3) & ((1 << (64 - s3)) - 1))


def _block_lanes(
    bits: torch.Tensor, row_terms: torch.Tensor, column_table: torch.Tensor, seeds: torch.Tensor
) -> torch.Tensor:
    """Lane sums of one block: ``bits`` (rows, width), where row ``r`` starts at global index ``start_r``.

    ``row_terms[r] = start_r * K`` and ``column_table[k] = k * K`` (mod 2**64), so ``p = g * K`` is one
    addition; ``seeds`` is ``[S_0, S_1]``. Building ``p`` from tables rather than from ``arange * K`` in the
    kernel ran about 1.5x faster, and a constant-folded ``arange * K`` has given wrong values from 16-bit
    inputs under ``torch.compile`` (which the self-check would catch).
    """
    w = bits.to(torch.int64)
    p = row_terms[:, None] + column_table[None, :]
    out = [_mix_tensor(w ^ (p + seeds[lane]), mixer).sum() for lane, mixer in enumerate(LANES)]
    return torch.stack(out)


_BACKENDS = ("auto", "eager", "compiled", "triton")
_backend = os.environ.get("CKPTVERIFY_FINGERPRINT_BACKEND", "auto")
if _backend not in _BACKENDS:  # pragma: no cover - environment
    _log.warning("ignoring CKPTVERIFY_FINGERPRINT_BACKEND=%r (not one of %s)", _backend, _BACKENDS)
    _backend = "auto"
#: "auto" turns to the compiled path once this many bytes went through the eager path on CPU in this
#: process. Compiling costs 5-15 s once, about what the eager path spends on this many bytes, so the
#: total time is never much more than twice the better choice made in hindsight.
AUTO_COMPILE_AFTER_BYTES = 2 << 30
_eager_cpu_bytes = 0
_compiled_fn: Callable[..., torch.Tensor] | None = None
_compile_failed = False
#: (device type, bits dtype) -> whether the compiled kernel passed its check against the eager path.
_verified: dict[tuple[str, torch.dtype], bool] = {}
_lock = threading.Lock()


def set_backend(name: str) -> None:
    global _backend
    if name not in _BACKENDS:
        raise UsageError(f"unknown fingerprint backend {name!r}; choose one of {', '.join(_BACKENDS)}")
    _backend = name


def get_backend() -> str:
    return _backend


def _wants_compiled(device: torch.device, numel: int) -> bool:
    if _compile_failed or _backend == "eager" or numel < COMPILED_BLOCK:
        return False
    if _backend == "compiled":
        return True
    return device.type == "cpu" and _eager_cpu_bytes >= AUTO_COMPILE_AFTER_BYTES


def _disable_compiled(reason: object) -> None:
    global _compile_failed
    if not _compile_failed:
        _log.warning("compiled fingerprint kernel unavailable, using eager torch: %s", reason)
    _compile_failed = True


def _compiled_kernel(bits_dtype: torch.dtype, device: torch.device) -> Callable[..., torch.Tensor] | None:
    """The compiled block kernel, once it has matched the eager path on a test block of this dtype."""
    global _compiled_fn
    key = (device.type, bits_dtype)
    with _lock:
        if _compile_failed or _verified.get(key) is False:
            return None
        if _compiled_fn is None:
            try:
                _compiled_fn = torch.compile(_block_lanes, dynamic=False, fullgraph=True)
            except Exception as exc:  # pragma: no cover - depends on the environment
                _disable_compiled(exc)
                return None
        if key not in _verified:
            _verified[key] = _self_check(_compiled_fn, bits_dtype, device)
        return _compiled_fn if _verified[key] else None


def _self_check(fn: Callable[..., torch.Tensor], bits_dtype: torch.dtype, device: torch.device) -> bool:
    """Run the compiled kernel and the eager path on one pseudo-random block; they must agree."""
    info = torch.iinfo(bits_dtype)
    gen = torch.Generator(device="cpu").manual_seed(0x5EED)
    bits = torch.randint(info.min, info.max, (COMPILED_BLOCK,), dtype=bits_dtype, generator=gen)
    bits = bits.to(device).view(COMPILED_BLOCK // ROW_WIDTH, ROW_WIDTH)
    first = (1 << 40) + 12345
    seeds = (dtype_seed("self-check", 0), dtype_seed("self-check", 1))
    tables = _CompiledTables(device, seeds)
    try:
        with torch.no_grad():  # one grad mode for every call: no recompilation on its account
            got = fn(bits, tables.row_terms(first), tables.column_table, tables.seeds).tolist()
    except Exception as exc:  # pragma: no cover - depends on the environment
        _disable_compiled(exc)
        return False
    eager = _EagerState(device, seeds, COMPILED_BLOCK)
    rows = max(1, eager.block // ROW_WIDTH)
    for r in range(0, bits.shape[0], rows):
        eager.add_block(_Block(bits[r : r + rows], None, first + r * ROW_WIDTH, ROW_WIDTH))
    if got != eager.acc.tolist():  # pragma: no cover - a miscompilation
        _log.warning("compiled fingerprint kernel disagrees with eager torch for %s; not using it", bits_dtype)
        return False
    return True


class _CompiledTables:
    """The compiled kernel's inputs besides the bits, for blocks of ``COMPILED_BLOCK // ROW_WIDTH`` rows of
    ``ROW_WIDTH`` consecutive global indices."""

    def __init__(self, device: torch.device, seeds: tuple[int, int]) -> None:
        k = _signed(INDEX_MULTIPLIER)
        kw: dict = {"dtype": torch.int64, "device": device}
        self.column_table = torch.arange(ROW_WIDTH, **kw).mul_(k)
        self._row_steps = torch.arange(COMPILED_BLOCK // ROW_WIDTH, **kw).mul_(ROW_WIDTH)
        self._row_terms = torch.empty_like(self._row_steps)
        self.seeds = torch.tensor([_signed(s) for s in seeds], **kw)
        self._k = k

    def row_terms(self, first: int) -> torch.Tensor:
        """``(first + r * ROW_WIDTH) * K`` for each row ``r``."""
        return torch.add(self._row_steps, first, out=self._row_terms).mul_(self._k)


# ------------------------------------------------------------------------------------------- entry


def fingerprint_lanes(
    t: torch.Tensor, offsets: Sequence[int], global_shape: Sequence[int], name: str
) -> tuple[int, int]:
    """The two lane sums (unsigned 64-bit) of a chunk ``t`` at ``offsets`` in ``global_shape``."""
    global _eager_cpu_bytes
    t = t.detach()
    offsets, global_shape = list(offsets), list(global_shape)
    if t.is_complex():
        t = torch.view_as_real(t)
        offsets.append(0)
        global_shape.append(2)
    geometry = chunk_geometry(t.shape, offsets, global_shape)
    if t.numel() == 0:
        return (0, 0)
    flat = t.contiguous().reshape(-1).view(_INT_VIEW_BY_SIZE[t.element_size()])
    seeds = (dtype_seed(name, 0), dtype_seed(name, 1))
    device = flat.device
    nbytes = flat.numel() * flat.element_size()

    if device.type == "cuda" and _backend in ("auto", "triton"):
        # One fused Triton pass on the GPU (checked against this module's eager path before first use).
        from ckptverify.fingerprint import triton_kernel as _fingerprint_triton

        got = _fingerprint_triton.lanes(flat, geometry, seeds)
        if got is not None:
            return got

    if device.type == "cpu" and _backend == "auto" and flat.numel() <= SMALL_NUMPY:
        # A small chunk (a bias, a norm, one of a checkpoint's 100 000 items): numpy's fixed cost per
        # operation is a tenth of torch's, and the eager path's buffers cost more than its arithmetic.
        return _small_lanes(flat, geometry, seeds)

    compiled = None
    if geometry.run_length >= COMPILED_BLOCK and _wants_compiled(device, flat.numel()):
        compiled = _compiled_kernel(flat.dtype, device)
    block = COMPILED_BLOCK if compiled is not None else eager_block(device)
    compiled_shape = (COMPILED_BLOCK // ROW_WIDTH, ROW_WIDTH)
    tables = stage = None
    if compiled is not None:
        tables = _CompiledTables(device, seeds)
        if device.type == "cpu":
            # Copying each block into one reused buffer first, then running the fused kernel on it, was
            # 1.5-1.8x faster on CPU than running the kernel on the tensor's memory directly.
            stage = torch.empty(compiled_shape, dtype=flat.dtype, device=device)
    lanes = [0, 0]
    eager: _EagerState | None = None
    for blk in iter_blocks(flat, geometry, block):
        if compiled is not None and tables is not None and blk.bits.shape == compiled_shape:
            src = blk.bits if stage is None else stage.copy_(blk.bits)
            try:
                with torch.no_grad():
                    res = compiled(src, tables.row_terms(blk.first_start), tables.column_table, tables.seeds)
                a, b = res.tolist()
            except Exception as exc:  # pragma: no cover - depends on the environment
                _disable_compiled(exc)
                compiled = None
            else:
                lanes[0] += a
                lanes[1] += b
                continue
        if eager is None:
            eager = _EagerState(device, seeds, flat.numel())
        if blk.bits.numel() <= eager.block:
            eager.add_block(blk)
            continue
        # A compiled-size block (consecutive rows of one run) that the compiled kernel did not take.
        rows = max(1, eager.block // ROW_WIDTH)
        for r in range(0, blk.bits.shape[0], rows):
            eager.add_block(_Block(blk.bits[r : r + rows], None, blk.first_start + r * ROW_WIDTH, ROW_WIDTH))
    if eager is not None:
        a, b = eager.acc.tolist()
        lanes[0] += a
        lanes[1] += b
    if device.type == "cpu" and compiled is None:
        _eager_cpu_bytes += nbytes
    return (lanes[0] & _MASK64, lanes[1] & _MASK64)


#: Chunks of at most this many elements take :func:`_small_lanes` on CPU under backend ``auto``.
SMALL_NUMPY = 1 << 14


def _small_lanes(flat: torch.Tensor, geometry: _Geometry, seeds: tuple[int, int]) -> tuple[int, int]:
    """The eager path's two lane sums, in numpy: the same integers (uint64 arithmetic wraps modulo 2**64,
    ``>>`` on uint64 is a logical shift; sign extension by ``astype(int64)``, as the eager copy into int64)."""
    import numpy as np

    w = flat.numpy().astype(np.int64).view(np.uint64)
    run = geometry.run_length
    if geometry.num_runs == 1:
        g = np.arange(geometry.first_start, geometry.first_start + run, dtype=np.uint64)
    else:
        starts = geometry.run_starts(0, geometry.num_runs, flat.device).numpy().view(np.uint64)
        g = (starts[:, None] + np.arange(run, dtype=np.uint64)[None, :]).reshape(-1)
    p = g * np.uint64(INDEX_MULTIPLIER)
    out = []
    with np.errstate(over="ignore"):
        for seed, mixer in zip(seeds, LANES, strict=True):
            s1, s2, s3 = (np.uint64(x) for x in mixer.shifts)
            m1, m2 = (np.uint64(x) for x in mixer.multipliers)
            y = w ^ (p + np.uint64(seed))
            y ^= y >> s1
            y *= m1
            y ^= y >> s2
            y *= m2
            y ^= y >> s3
            out.append(int(y.sum(dtype=np.uint64)))
    return out[0], out[1]


# ------------------------------------------------------------------------------------------- many


@dataclass(frozen=True)
class _Piece:
    member: int  # position of the tensor in the caller's list
    start: int  # first element of the piece in the tensor (its global index: whole tensors)
    length: int


@dataclass
class _ManyBlock:
    """Consecutive pieces of tensors of one element size, processed together. ``tables`` (several pieces
    only) lives on the device."""

    pieces: tuple[_Piece, ...]
    numel: int
    tables: dict[str, torch.Tensor] | None = None


@dataclass
class _ManyPlan:
    """How one list of tensors (a layout: device, numels, dtypes) goes through :func:`lanes_many`: its
    blocks, and for each tensor the range of its pieces in the order the blocks produce their sums."""

    blocks: list[_ManyBlock]
    first: torch.Tensor  # (n,) index in the zero-prefixed cumulative piece sums
    last: torch.Tensor  # (n,)


#: Layouts -> plans. The members of a trace category keep their shapes from step to step, so a plan and its
#: device tables are built once.
_many_plans: dict[tuple[Any, ...], _ManyPlan] = {}
_MANY_PLANS_KEPT = 64


def _plan_many(numels: Sequence[int], sizes: Sequence[int], seeds: Sequence[tuple[int, int]], block: int,
               device: torch.device) -> _ManyPlan:
    """Cut the tensors into blocks of at most ``block`` elements, by element size: a large tensor alone, in
    pieces of ``block``; small tensors whole, several to a block."""
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
    """Per-piece tables of a block of several pieces: how long each piece is and where it ends in the block,
    the offset that turns a position in the block into the element's index in its tensor, and the seeds."""
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


def lanes_many(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """The lane sums of each whole tensor (those :func:`fingerprint_lanes` gives for the whole tensor), as an
    ``(n, 2)`` int64 tensor (the two's complement of each unsigned sum) on the tensors' common device.

    Tensors of one element size are streamed through blocks of :func:`eager_block` elements, several small
    tensors to a block, so the number of device operations follows the total size, not the number of
    tensors. Nothing waits for the device: the caller reads the result when it needs it (``.tolist()``).
    Sums per tensor come from cumulative sums read at each tensor's end, and the result is put in order by
    gathers: no scatter-add, so it runs under ``torch.use_deterministic_algorithms(True)``. Plain tensors
    only (for a DTensor, pass its local shard).
    """
    if not tensors:
        return torch.zeros((0, 2), dtype=torch.int64)
    device = tensors[0].device
    for t in tensors:
        if t.device != device:
            raise UsageError(f"lanes_many needs tensors on one device, got {t.device} and {device}")
    # A sparse tensor (a sparse gradient of nn.Embedding(sparse=True)) stands for its dense values.
    tensors = [t if t.layout == torch.strided else t.detach().to_dense() for t in tensors]
    if device.type == "cuda" and _backend in ("auto", "triton"):
        # One Triton launch per element width instead of about fifty eager launches per block: checked
        # against the eager path before first use (None when Triton is missing or the check failed).
        from ckptverify.fingerprint import triton_kernel as _fingerprint_triton

        got = _fingerprint_triton.lanes_many(list(tensors))
        if got is not None:
            return got
    return _lanes_many_eager(tensors)


def _lanes_many_eager(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """:func:`lanes_many` with torch operations only (any device; the reference)."""
    if not tensors:
        return torch.zeros((0, 2), dtype=torch.int64)
    device = tensors[0].device
    flats: list[torch.Tensor] = []
    seeds: list[tuple[int, int]] = []
    for t in tensors:
        if t.device != device:
            raise UsageError(f"lanes_many needs tensors on one device, got {t.device} and {device}")
        flat = t.detach()
        name = dtype_name(flat.dtype)
        if flat.is_complex():
            flat = torch.view_as_real(flat)
        flat = flat.contiguous().reshape(-1)
        flats.append(flat.view(_INT_VIEW_BY_SIZE[flat.element_size()]))
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
                y = _mix_tensor(bits ^ (g + _signed(seeds[p.member][lane])), mixer)
                sums[lane].append(y.sum().reshape(1))
            continue
        tab = blk.tables
        bits = torch.cat([flats[p.member] for p in blk.pieces]).to(torch.int64)
        piece = torch.repeat_interleave(tab["pieces"], tab["lengths"], output_size=blk.numel)
        g = torch.arange(blk.numel, dtype=torch.int64, device=device).add_(tab["offsets"][piece]).mul_(k)
        for lane, mixer in enumerate(LANES):
            y = _mix_tensor(bits ^ (g + tab[f"seed{lane}"][piece]), mixer)
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
