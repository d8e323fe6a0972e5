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

import hashlib
import logging
import math
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch

from ckptverify.errors import UsageError
from ckptverify.fingerprint import FINGERPRINT_VERSION

_log = logging.getLogger(__name__)

_MASK64 = (1 << 64) - 1


def _signed(value: int) -> int:
    """The int64 (two's complement) reading of a value taken modulo 2**64."""
    value &= _MASK64
    return value - (1 << 64) if value >= 1 << 63 else value


@dataclass(frozen=True)
class _Lane:
    index_multiplier: int  # K: odd, multiplies the global index
    shifts: tuple[int, int, int]
    multipliers: tuple[int, int]


#: Lane 0 mixes with the MurmurHash3 ``fmix64`` finalizer, lane 1 with the SplitMix64 finalizer
#: (Stafford's "Mix13"). Both are bijections of 64-bit words.
LANES: tuple[_Lane, _Lane] = (
    _Lane(0x9E3779B97F4A7C15, (33, 33, 33), (0xFF51AFD7ED558CCD, 0xC4CEB9FE1A85EC53)),
    _Lane(0xD6E8FEB86659FD93, (30, 27, 31), (0xBF58476D1CE4E5B9, 0x94D049BB133111EB)),
)


def _mix_python(x: int, lane: _Lane) -> int:
    """The lane's mixer on one word, in plain Python (reference for docs and tests)."""
    s1, s2, s3 = lane.shifts
    m1, m2 = lane.multipliers
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

#: Elements per block of the eager path (buffers of this many int64 words, a few per call).
EAGER_BLOCK = 1 << 16
#: Width of a block row: runs longer than this are cut into rows of this width.
ROW_WIDTH = 1 << 13
#: Elements per block of the compiled path (``COMPILED_BLOCK // ROW_WIDTH`` rows of ``ROW_WIDTH``).
COMPILED_BLOCK = 1 << 20


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
    if run >= ROW_WIDTH:
        rows_per_block = max(1, block // ROW_WIDTH)
        for q in range(geometry.num_runs):
            g = geometry.run_start(q)
            seg = flat[q * run : (q + 1) * run]
            pos = 0
            full_rows = run // ROW_WIDTH
            while full_rows > 0:
                rows = min(rows_per_block, full_rows)
                n = rows * ROW_WIDTH
                yield _Block(seg[pos : pos + n].view(rows, ROW_WIDTH), None, g + pos, ROW_WIDTH)
                pos += n
                full_rows -= rows
            if pos < run:
                yield _Block(seg[pos:].view(1, run - pos), None, g + pos, 0)
    else:
        runs_per_block = max(1, block // run)
        total = geometry.num_runs
        for q0 in range(0, total, runs_per_block):
            rows = min(runs_per_block, total - q0)
            bits = flat[q0 * run : (q0 + rows) * run].view(rows, run)
            starts = geometry.run_starts(q0, rows, flat.device)
            yield _Block(bits, starts, 0, 0)


# ------------------------------------------------------------------------------------------ eager path


class _EagerState:
    """Buffers and tables for one fingerprint call on one device."""

    def __init__(self, device: torch.device, block: int, seeds: tuple[int, int]) -> None:
        self.block = block
        kw = {"dtype": torch.int64, "device": device}
        self.w = torch.empty(block, **kw)
        self.idx = torch.empty(block, **kw)
        self.y = torch.empty(block, **kw)
        self.t = torch.empty(block, **kw)
        self.row_terms = torch.empty(block, **kw)
        ar = torch.arange(ROW_WIDTH, **kw)  # rows are never wider than ROW_WIDTH
        # idx_table[L][k] = k * K_L (mod 2**64); row_term[L][r] = start_r * K_L + S_L (mod 2**64).
        self.idx_tables = [ar * _signed(lane.index_multiplier) for lane in LANES]
        self.seeds = seeds
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
        idx = self.idx[:n].view(rows, width)
        y = self.y[:n].view(rows, width)
        t = self.t[:n].view(rows, width)
        for L, lane in enumerate(LANES):
            k = _signed(lane.index_multiplier)
            # idx = (start_row + k) * K + S, built as row term + column table, all modulo 2**64
            terms = torch.mul(row_terms, k).add_(_signed(self.seeds[L]))
            torch.add(self.idx_tables[L][:width], terms[:, None], out=idx)
            torch.bitwise_xor(w, idx, out=y)
            s1, s2, s3 = lane.shifts
            m1, m2 = lane.multipliers
            _xorshift(y, t, s1)
            y.mul_(_signed(m1))
            _xorshift(y, t, s2)
            y.mul_(_signed(m2))
            _xorshift(y, t, s3)
            self.acc[L] += y.sum()


def _xorshift(y: torch.Tensor, t: torch.Tensor, s: int) -> None:
    """``y ^= y >> s`` with a logical shift (an arithmetic shift, then the sign copies masked off)."""
    torch.bitwise_right_shift(y, s, out=t)
    t.bitwise_and_((1 << (64 - s)) - 1)
    y.bitwise_xor_(t)


# --------------------------------------------------------------------------------------- compiled path


def _mix_tensor(x: torch.Tensor, lane: _Lane) -> torch.Tensor:
    s1, s2, s3 = lane.shifts
    m1, m2 = lane.multipliers
    x = x ^ ((x >> s1) & ((1 << (64 - s1)) - 1))
    x = x * _signed(m1)
    x = x ^ ((x >> s2) & ((1 << (64 - s2)) - 1))
    x = x * _signed(m2)
    return x ^ ((x >> s3) & ((1 << (64 - s3)) - 1))


def _block_lanes(bits: torch.Tensor, first: torch.Tensor, seeds: torch.Tensor) -> torch.Tensor:
    """Lane sums of one block of consecutive global indices starting at ``first`` (0-d int64)."""
    w = bits.reshape(-1).to(torch.int64)
    g = torch.arange(w.shape[0], dtype=torch.int64, device=w.device) + first
    out = []
    for L, lane in enumerate(LANES):
        x = w ^ (g * _signed(lane.index_multiplier) + seeds[L])
        out.append(_mix_tensor(x, lane).sum())
    return torch.stack(out)


_BACKENDS = ("auto", "eager", "compiled")
_backend = os.environ.get("CKPTVERIFY_FINGERPRINT_BACKEND", "auto")
#: "auto" switches to the compiled path once this many bytes went through the eager path on CPU
#: (compiling costs a few seconds once; past this point it pays for itself).
AUTO_COMPILE_AFTER_BYTES = 1 << 30
_eager_cpu_bytes = 0
_compiled: Callable[..., torch.Tensor] | None = None
_compile_failed = False
_compile_lock = threading.Lock()


def set_backend(name: str) -> None:
    """Choose how fingerprints are computed: ``"eager"``, ``"compiled"`` or ``"auto"`` (the default)."""
    global _backend
    if name not in _BACKENDS:
        raise UsageError(f"unknown fingerprint backend {name!r}; choose one of {', '.join(_BACKENDS)}")
    _backend = name


def get_backend() -> str:
    return _backend


def _get_compiled() -> Callable[..., torch.Tensor] | None:
    global _compiled, _compile_failed
    if _compiled is not None or _compile_failed:
        return _compiled
    with _compile_lock:
        if _compiled is None and not _compile_failed:
            try:
                _compiled = torch.compile(_block_lanes, dynamic=False, fullgraph=True)
            except Exception as exc:  # pragma: no cover - depends on the environment
                _log.warning("torch.compile unavailable for fingerprints, using eager torch: %s", exc)
                _compile_failed = True
    return _compiled


def _run_compiled(fn: Callable[..., torch.Tensor], *args: torch.Tensor) -> torch.Tensor | None:
    global _compile_failed
    try:
        return fn(*args)
    except Exception as exc:  # pragma: no cover - depends on the environment
        _log.warning("compiled fingerprint kernel failed, using eager torch from now on: %s", exc)
        _compile_failed = True
        return None


def _use_compiled(device: torch.device, nbytes: int) -> bool:
    if _compile_failed or (device.type != "cpu" and _backend != "compiled"):
        return False
    if _backend == "compiled":
        return True
    if _backend == "eager":
        return False
    return _eager_cpu_bytes >= AUTO_COMPILE_AFTER_BYTES and nbytes >= COMPILED_BLOCK


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

    compiled = _get_compiled() if _use_compiled(device, nbytes) else None
    long_runs = geometry.run_length >= ROW_WIDTH
    block = COMPILED_BLOCK if compiled is not None and long_runs else EAGER_BLOCK
    seeds_t = torch.tensor([_signed(s) for s in seeds], dtype=torch.int64, device=device)
    lanes = [0, 0]
    eager: _EagerState | None = None
    for blk in iter_blocks(flat, geometry, block):
        full = blk.bits.numel() == COMPILED_BLOCK and (blk.row_step == ROW_WIDTH or blk.bits.shape[0] == 1)
        if compiled is not None and full:
            first = torch.tensor(blk.first_start, dtype=torch.int64, device=device)
            res = _run_compiled(compiled, blk.bits, first, seeds_t)
            if res is not None:
                a, b = res.tolist()
                lanes[0] += a
                lanes[1] += b
                continue
            compiled = None
        if eager is None:
            eager = _EagerState(device, EAGER_BLOCK, seeds)
        if blk.bits.numel() <= EAGER_BLOCK:
            eager.add_block(blk)
            continue
        # A compiled-size block (consecutive rows of one run) that the compiled path did not take.
        rows = max(1, EAGER_BLOCK // blk.bits.shape[1])
        for r in range(0, blk.bits.shape[0], rows):
            sub = blk.bits[r : r + rows]
            eager.add_block(_Block(sub, None, blk.first_start + r * blk.row_step, blk.row_step))
    if eager is not None:
        a, b = eager.acc.tolist()
        lanes[0] += a
        lanes[1] += b
    if device.type == "cpu" and compiled is None:
        _eager_cpu_bytes += nbytes
    return (lanes[0] & _MASK64, lanes[1] & _MASK64)
