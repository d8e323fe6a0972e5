"""A Triton kernel of the logical tensor fingerprint, for CUDA tensors (see ``docs/fingerprint.md``).

The eager torch path launches about twenty element-wise kernels per block and lane, each reading and writing
64-bit temporaries, so on a GPU it runs at a few percent of memory bandwidth. This kernel computes the same
integers in one pass: each program takes one block of one run of consecutive global indices, mixes both lanes
in registers and writes its two partial sums; the partials are then added modulo 2**64. Addition modulo 2**64
is associative and commutative, so the order of the programs does not matter: the result is exactly the
eager path's.

A second kernel does the same for a whole list of tensors at once (:func:`lanes_many`, what a trace digests
each step: every gradient, parameter and optimizer state tensor): the tensors of one element width are laid end
to end, each program takes one block of one tensor, and the per-tensor sums come from the programs' partials in
a few more operations, so a list costs about ten kernel launches however many tensors it holds (the eager
path launches about fifty per block).

Used for CUDA tensors when Triton imports, after it has matched the eager path
(:mod:`ckptverify.fingerprint.eager`, which this module imports; :mod:`~ckptverify.fingerprint.kernels` imports
this one) on test data of each element width (:func:`lanes` and :func:`lanes_many` return ``None`` otherwise, and
the caller takes the eager path). With ``TRITON_INTERPRET=1`` set before Triton is imported, the same kernel runs
on CPU tensors through Triton's interpreter: that is how the CPU test suite checks it.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import torch

from ckptverify.fingerprint import eager
from ckptverify.fingerprint.spec import INDEX_MULTIPLIER, LANES, MASK64, dtype_seed
from ckptverify.fingerprint.spec import signed as _signed

_log = logging.getLogger(__name__)

#: Elements per program: a multiple of every warp layout, and small enough that short runs waste little.
BLOCK = 2048
#: Element widths the kernel has been checked for against the eager path, by (device type, bits dtype).
_verified: dict[tuple[str, torch.dtype], bool] = {}
_lock = threading.Lock()
_failed = False


try:
    import triton
    import triton.language as tl
except Exception as _exc:  # pragma: no cover - depends on the environment
    _log.debug("triton unavailable: %s", _exc)
    triton = None

if triton is not None:

    @triton.jit
    def _mix(y, s1: tl.constexpr, m1, s2: tl.constexpr, m2, s3: tl.constexpr):
        # On uint64, >> is a logical shift and * wraps modulo 2**64: the mixer exactly as documented.
        y = y ^ (y >> s1)
        y = y * m1
        y = y ^ (y >> s2)
        y = y * m2
        return y ^ (y >> s3)

    @triton.jit
    def _fingerprint_kernel(bits_ptr, starts_ptr, out_ptr, run_length, blocks_per_run, k, seed0, seed1,
                            a_m1, a_m2, b_m1, b_m2, BLOCK: tl.constexpr):
        pid = tl.program_id(0).to(tl.int64)
        q = pid // blocks_per_run  # the run
        b = pid - q * blocks_per_run  # the block within it
        j = b * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
        mask = j < run_length
        # Sign-extend the element's bits to 64, as the eager path's copy into int64 does.
        w = tl.load(bits_ptr + q * run_length + j, mask=mask, other=0).to(tl.int64).to(tl.uint64, bitcast=True)
        g = (tl.load(starts_ptr + q) + j).to(tl.uint64, bitcast=True)  # global index of each element
        p = g * k.to(tl.uint64, bitcast=True)
        y0 = _mix(w ^ (p + seed0.to(tl.uint64, bitcast=True)), 33, a_m1.to(tl.uint64, bitcast=True), 33,
                  a_m2.to(tl.uint64, bitcast=True), 33)
        y1 = _mix(w ^ (p + seed1.to(tl.uint64, bitcast=True)), 30, b_m1.to(tl.uint64, bitcast=True), 27,
                  b_m2.to(tl.uint64, bitcast=True), 31)
        zero = tl.zeros_like(y0)
        s0 = tl.sum(tl.where(mask, y0, zero), axis=0)
        s1 = tl.sum(tl.where(mask, y1, zero), axis=0)
        tl.store(out_ptr + 2 * pid, s0.to(tl.int64, bitcast=True))
        tl.store(out_ptr + 2 * pid + 1, s1.to(tl.int64, bitcast=True))


    @triton.jit
    def _many_kernel(bits_ptr, table_ptr, out_ptr, k, a_m1, a_m2, b_m1, b_m2, BLOCK: tl.constexpr):
        # Row `pid` of the table: where the block starts in `bits`, the global index of its first element in
        # its tensor, how many elements it holds, and its tensor's two seeds.
        pid = tl.program_id(0).to(tl.int64)
        row = table_ptr + 5 * pid
        start = tl.load(row)
        first = tl.load(row + 1)
        length = tl.load(row + 2)
        seed0 = tl.load(row + 3).to(tl.uint64, bitcast=True)
        seed1 = tl.load(row + 4).to(tl.uint64, bitcast=True)
        j = tl.arange(0, BLOCK).to(tl.int64)
        mask = j < length
        w = tl.load(bits_ptr + start + j, mask=mask, other=0).to(tl.int64).to(tl.uint64, bitcast=True)
        p = (first + j).to(tl.uint64, bitcast=True) * k.to(tl.uint64, bitcast=True)
        y0 = _mix(w ^ (p + seed0), 33, a_m1.to(tl.uint64, bitcast=True), 33, a_m2.to(tl.uint64, bitcast=True), 33)
        y1 = _mix(w ^ (p + seed1), 30, b_m1.to(tl.uint64, bitcast=True), 27, b_m2.to(tl.uint64, bitcast=True), 31)
        zero = tl.zeros_like(y0)
        tl.store(out_ptr + 2 * pid, tl.sum(tl.where(mask, y0, zero), axis=0).to(tl.int64, bitcast=True))
        tl.store(out_ptr + 2 * pid + 1, tl.sum(tl.where(mask, y1, zero), axis=0).to(tl.int64, bitcast=True))


def _kernel() -> Any:
    """The jitted kernel, or ``None`` when Triton cannot be imported."""
    return _fingerprint_kernel if triton is not None else None


def _run(flat: torch.Tensor, starts: torch.Tensor, run_length: int, num_runs: int,
         seeds: tuple[int, int]) -> tuple[int, int]:
    """The two lane sums of ``flat`` (an integer view, ``num_runs`` runs of ``run_length`` elements, run ``q``
    starting at global index ``starts[q]``), unsigned."""
    kernel = _kernel()
    blocks_per_run = -(-run_length // BLOCK)
    programs = num_runs * blocks_per_run
    partials = torch.empty(programs * 2, dtype=torch.int64, device=flat.device)
    assert LANES[0].shifts == (33, 33, 33) and LANES[1].shifts == (30, 27, 31)  # the kernel's constants
    (a1, a2), (b1, b2) = LANES[0].multipliers, LANES[1].multipliers
    kernel[(programs,)](flat, starts, partials, run_length, blocks_per_run, _signed(INDEX_MULTIPLIER),
                        _signed(seeds[0]), _signed(seeds[1]), _signed(a1), _signed(a2), _signed(b1), _signed(b2),
                        BLOCK=BLOCK, num_warps=8)
    # Integer sums wrap modulo 2**64 (two's complement), which is the fingerprint's arithmetic.
    a, b = partials.view(programs, 2).sum(dim=0).tolist()
    return a & MASK64, b & MASK64


def _self_check(bits_dtype: torch.dtype, device: torch.device) -> bool:
    """Run the kernel and the eager path on pseudo-random chunks of several shapes; they must agree."""
    info = torch.iinfo(bits_dtype)
    gen = torch.Generator(device="cpu").manual_seed(0x7121)
    seeds = (dtype_seed("self-check", 0), dtype_seed("self-check", 1))
    # One long run crossing block edges, and a column split of a matrix (many short runs).
    for shape, offsets, gshape in (((3 * BLOCK + 17,), (1 << 33,), ((1 << 34),)), ((37, 301), (5, 123), (64, 512))):
        n = 1
        for s in shape:
            n *= s
        bits = torch.randint(info.min, info.max, (n,), dtype=bits_dtype, generator=gen)
        geometry = eager.chunk_geometry(shape, offsets, gshape)
        got = lanes_of(bits.to(device), geometry, seeds)
        reference = eager._EagerState(torch.device("cpu"), seeds, n)
        for blk in eager.iter_blocks(bits, geometry, reference.block):
            reference.add_block(blk)
        want = tuple(v & MASK64 for v in reference.acc.tolist())
        if got != want:  # pragma: no cover - a miscompilation
            _log.warning("triton fingerprint kernel disagrees with eager torch for %s; not using it", bits_dtype)
            return False
    return True


def lanes_of(flat: torch.Tensor, geometry: Any, seeds: tuple[int, int]) -> tuple[int, int]:
    """The two lane sums of the chunk whose flat integer view is ``flat``, laid out as ``geometry``."""
    num_runs, run_length = geometry.num_runs, geometry.run_length
    if num_runs == 1:
        starts = torch.tensor([geometry.first_start], dtype=torch.int64, device=flat.device)
    else:
        starts = geometry.run_starts(0, num_runs, flat.device)
    return _run(flat, starts, run_length, num_runs, seeds)


def lanes(flat: torch.Tensor, geometry: Any, seeds: tuple[int, int]) -> tuple[int, int] | None:
    """The lane sums through the kernel, or ``None`` where it does not apply (Triton missing, a run too short
    to fill a block, or the kernel failed its check against the eager path): the caller then takes eager."""
    global _failed
    if _failed or flat.numel() == 0 or geometry.run_length < 64 or _kernel() is None:
        return None
    key = (flat.device.type, flat.dtype)
    with _lock:
        if key not in _verified:
            try:
                _verified[key] = _self_check(flat.dtype, flat.device)
            except Exception as exc:  # pragma: no cover - depends on the environment
                _log.warning("triton fingerprint kernel unavailable, using eager torch: %s", exc)
                _failed = True
                return None
        if not _verified[key]:
            return None
    try:
        return lanes_of(flat, geometry, seeds)
    except Exception as exc:  # pragma: no cover - depends on the environment
        _log.warning("triton fingerprint kernel failed, using eager torch: %s", exc)
        _failed = True
        return None


# ------------------------------------------------------------------------------------------------ many


class _ManyPlan:
    """How one layout (device, and each tensor's element count, width and dtype name) goes through
    :func:`lanes_many`: per element width, the members laid end to end and the table of programs (on the
    device); per member, the range of its programs in the partials."""

    def __init__(self, numels: list[int], sizes: list[int], seeds: list[tuple[int, int]],
                 device: torch.device) -> None:
        self.groups: list[tuple[list[int], torch.Tensor, int, int]] = []  # members, table, first program, count
        first = [0] * len(numels)
        last = [0] * len(numels)
        programs = 0
        for size in dict.fromkeys(sizes):
            members = [m for m, z in enumerate(sizes) if z == size and numels[m]]
            if not members:
                continue
            rows: list[tuple[int, int, int, int, int]] = []
            offset = 0
            for m in members:
                first[m] = programs + len(rows)
                for b in range(0, numels[m], BLOCK):
                    rows.append((offset + b, b, min(BLOCK, numels[m] - b), _signed(seeds[m][0]),
                                 _signed(seeds[m][1])))
                last[m] = programs + len(rows)
                offset += numels[m]
            table = torch.tensor(rows, dtype=torch.int64).reshape(-1).to(device)
            self.groups.append((members, table, programs, len(rows)))
            programs += len(rows)
        self.programs = programs
        self.first = torch.tensor(first, dtype=torch.int64).to(device)
        self.last = torch.tensor(last, dtype=torch.int64).to(device)


_plans: dict[tuple[Any, ...], _ManyPlan] = {}
_PLANS_KEPT = 64


def lanes_many_of(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The kernel's answer for :func:`ckptverify.fingerprint.kernels.lanes_many`: each whole tensor's two lane
    sums as an ``(n, 2)`` int64 tensor on their device (unchecked: :func:`lanes_many` is the guarded entry)."""
    device = tensors[0].device
    flats: list[torch.Tensor] = []
    names: list[str] = []
    for t in tensors:
        flat = t.detach()
        names.append(eager.dtype_name(flat.dtype))
        if flat.is_complex():
            flat = torch.view_as_real(flat)
        flat = flat.contiguous().reshape(-1)
        flats.append(flat.view(eager._INT_VIEW_BY_SIZE[flat.element_size()]))
    key = (str(device), tuple((f.numel(), f.element_size(), n) for f, n in zip(flats, names, strict=True)))
    plan = _plans.get(key)
    if plan is None:
        seeds = [(dtype_seed(n, 0), dtype_seed(n, 1)) for n in names]
        plan = _ManyPlan([f.numel() for f in flats], [f.element_size() for f in flats], seeds, device)
        if len(_plans) >= _PLANS_KEPT:
            _plans.pop(next(iter(_plans)))
        _plans[key] = plan
    kernel = _many_kernel
    partials = torch.empty((plan.programs + 1, 2), dtype=torch.int64, device=device)
    partials[0].zero_()
    (a1, a2), (b1, b2) = LANES[0].multipliers, LANES[1].multipliers
    for members, table, first, count in plan.groups:
        bits = flats[members[0]] if len(members) == 1 else torch.cat([flats[m] for m in members])
        kernel[(count,)](bits, table, partials[1 + first:1 + first + count], _signed(INDEX_MULTIPLIER),
                         _signed(a1), _signed(a2), _signed(b1), _signed(b2), BLOCK=BLOCK, num_warps=8)
    # Integer sums wrap modulo 2**64 (two's complement); a member's programs are consecutive, so its sum is the
    # difference of the running sums at its two ends.
    running = torch.cumsum(partials, dim=0)
    return running[plan.last] - running[plan.first]


def _self_check_many(device: torch.device) -> bool:
    """Run :func:`lanes_many_of` and the eager path on a list of every element width, tensors shorter and
    longer than a block, an empty one and a complex one; they must agree."""
    gen = torch.Generator(device="cpu").manual_seed(0x3A11)
    tensors = [
        torch.randn(3 * BLOCK + 5, generator=gen),
        torch.randn(17, generator=gen).to(torch.bfloat16),
        torch.randint(-128, 127, (BLOCK + 1,), dtype=torch.int8, generator=gen),
        torch.zeros(0),
        torch.randint(-2**62, 2**62, (301,), dtype=torch.int64, generator=gen),
        torch.randn(40, 7, generator=gen) > 0,
        torch.randn(9, dtype=torch.complex64, generator=gen),
        torch.randn(5, 600, generator=gen).t(),  # not contiguous
    ]
    want = eager.lanes_many_eager(tensors).tolist()
    got = lanes_many_of([t.to(device) for t in tensors]).tolist()
    if got != want:  # pragma: no cover - a miscompilation
        _log.warning("triton many-tensor fingerprint kernel disagrees with eager torch; not using it")
        return False
    return True


_many_verified: dict[str, bool] = {}


def lanes_many(tensors: list[torch.Tensor]) -> torch.Tensor | None:
    """:func:`lanes_many_of` through the kernel, or ``None`` where it does not apply (Triton missing, or the
    kernel failed its check against the eager path on this kind of device): the caller then takes eager."""
    global _failed
    if _failed or not tensors or _kernel() is None:
        return None
    kind = tensors[0].device.type
    with _lock:
        if kind not in _many_verified:
            try:
                _many_verified[kind] = _self_check_many(tensors[0].device)
            except Exception as exc:  # pragma: no cover - depends on the environment
                _log.warning("triton many-tensor fingerprint kernel unavailable, using eager torch: %s", exc)
                _many_verified[kind] = False
        if not _many_verified[kind]:
            return None
    try:
        return lanes_many_of(tensors)
    except Exception as exc:  # pragma: no cover - depends on the environment
        _log.warning("triton many-tensor fingerprint kernel failed, using eager torch: %s", exc)
        _many_verified[kind] = False
        return None
