"""A Triton kernel of the logical fingerprint for CUDA tensors (``docs/fingerprint.md``).

Eager torch runs at a few percent of GPU bandwidth; this computes the same integers in one pass (one program per
block of a run, partials summed mod 2**64, so order does not matter). :func:`lanes_many` does a whole list at
once, small tensors packed into buffers of at most ``MANY_GROUP_BYTES`` (never a copy of the whole list).
Launches use the current device and stream: callers enter :func:`~ckptverify.fingerprint.device.device_scope`.
Used only after matching eager on test data per width (else ``None``: caller takes eager); a failed launch falls
back for that call only. ``TRITON_INTERPRET=1`` (set before import) runs it on CPU for the tests.
"""

from __future__ import annotations

import logging
import math
import threading
from collections import OrderedDict
from typing import Any

import torch

from ckptverify.fingerprint import eager
from ckptverify.fingerprint.device import is_capturing
from ckptverify.fingerprint.spec import INDEX_MULTIPLIER, LANES, MASK64, dtype_seed
from ckptverify.fingerprint.spec import signed as _signed

_log = logging.getLogger(__name__)

#: Elements per program: a multiple of every warp layout, and small enough that short runs waste little.
BLOCK = 2048
#: Element widths the kernel has been checked for against the eager path, by (device type, bits dtype).
_verified: dict[tuple[str, torch.dtype], bool] = {}
_lock = threading.Lock()
#: Self-checks that raised, by key (a (device type, dtype) of ``_verified``, a device type of ``_many_verified``);
#: after ``_CHECK_TRIES`` the key is left out.
_check_errors: dict[Any, int] = {}
_CHECK_TRIES = 3
_failures = 0
_failure_lock = threading.Lock()


try:
    import triton
    import triton.language as tl
except Exception as _exc:  # pragma: no cover - depends on the environment
    _log.debug("triton unavailable: %s", _exc)
    triton = None

if triton is not None:

    @triton.jit
    def _mix(y, s1: tl.constexpr, m1, s2: tl.constexpr, m2, s3: tl.constexpr):
        # ckptverify.fingerprint.spec.mix on uint64 words, where >> is a logical shift and * wraps modulo 2**64.
        # Triton cannot call the Python definition: the self-checks and the tests hold this to it.
        y = y ^ (y >> s1)
        y = y * m1
        y = y ^ (y >> s2)
        y = y * m2
        return y ^ (y >> s3)

    @triton.jit
    def _block_sums(w, p, mask, seed0, seed1, a_m1, a_m2, b_m1, b_m2, A1: tl.constexpr, A2: tl.constexpr,
                    A3: tl.constexpr, B1: tl.constexpr, B2: tl.constexpr, B3: tl.constexpr):
        # Both lanes' sums where ``mask``; ``w`` sign-extended bits, ``p`` global index * K (spec.LANES' constants).
        y0 = _mix(w ^ (p + seed0.to(tl.uint64, bitcast=True)), A1, a_m1.to(tl.uint64, bitcast=True), A2,
                  a_m2.to(tl.uint64, bitcast=True), A3)
        y1 = _mix(w ^ (p + seed1.to(tl.uint64, bitcast=True)), B1, b_m1.to(tl.uint64, bitcast=True), B2,
                  b_m2.to(tl.uint64, bitcast=True), B3)
        zero = tl.zeros_like(y0)
        return (tl.sum(tl.where(mask, y0, zero), axis=0).to(tl.int64, bitcast=True),
                tl.sum(tl.where(mask, y1, zero), axis=0).to(tl.int64, bitcast=True))

    @triton.jit
    def _fingerprint_kernel(bits_ptr, starts_ptr, out_ptr, run_length, blocks_per_run, k, seed0, seed1,
                            a_m1, a_m2, b_m1, b_m2, A1: tl.constexpr, A2: tl.constexpr, A3: tl.constexpr,
                            B1: tl.constexpr, B2: tl.constexpr, B3: tl.constexpr, BLOCK: tl.constexpr):
        pid = tl.program_id(0).to(tl.int64)
        q = pid // blocks_per_run  # the run
        b = pid - q * blocks_per_run  # the block within it
        j = b * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
        mask = j < run_length
        # Sign-extend the element's bits to 64, as every path does.
        w = tl.load(bits_ptr + q * run_length + j, mask=mask, other=0).to(tl.int64).to(tl.uint64, bitcast=True)
        g = (tl.load(starts_ptr + q) + j).to(tl.uint64, bitcast=True)  # global index of each element
        p = g * k.to(tl.uint64, bitcast=True)
        s0, s1 = _block_sums(w, p, mask, seed0, seed1, a_m1, a_m2, b_m1, b_m2, A1, A2, A3, B1, B2, B3)
        tl.store(out_ptr + 2 * pid, s0)
        tl.store(out_ptr + 2 * pid + 1, s1)

    @triton.jit
    def _many_kernel(bits_ptr, table_ptr, out_ptr, k, a_m1, a_m2, b_m1, b_m2, A1: tl.constexpr, A2: tl.constexpr,
                     A3: tl.constexpr, B1: tl.constexpr, B2: tl.constexpr, B3: tl.constexpr, BLOCK: tl.constexpr):
        # Row `pid` of the table: where the block starts in `bits`, the global index of its first element in
        # its tensor, how many elements it holds, and its tensor's two seeds.
        pid = tl.program_id(0).to(tl.int64)
        row = table_ptr + 5 * pid
        start = tl.load(row)
        first = tl.load(row + 1)
        length = tl.load(row + 2)
        j = tl.arange(0, BLOCK).to(tl.int64)
        mask = j < length
        w = tl.load(bits_ptr + start + j, mask=mask, other=0).to(tl.int64).to(tl.uint64, bitcast=True)
        p = (first + j).to(tl.uint64, bitcast=True) * k.to(tl.uint64, bitcast=True)
        s0, s1 = _block_sums(w, p, mask, tl.load(row + 3), tl.load(row + 4), a_m1, a_m2, b_m1, b_m2,
                             A1, A2, A3, B1, B2, B3)
        tl.store(out_ptr + 2 * pid, s0)
        tl.store(out_ptr + 2 * pid + 1, s1)


def _launch_args() -> dict[str, int]:
    """The mixing constants of spec.LANES: multipliers as int64, shifts as compile-time constants."""
    (a1, a2), (b1, b2) = LANES[0].multipliers, LANES[1].multipliers
    (s1, s2, s3), (t1, t2, t3) = LANES[0].shifts, LANES[1].shifts
    return {"a_m1": _signed(a1), "a_m2": _signed(a2), "b_m1": _signed(b1), "b_m2": _signed(b2),
            "A1": s1, "A2": s2, "A3": s3, "B1": t1, "B2": t2, "B3": t3, "BLOCK": BLOCK}


def _kernel() -> Any:
    """The jitted kernel, or ``None`` when Triton cannot be imported."""
    return _fingerprint_kernel if triton is not None else None


def _self_check(bits_dtype: torch.dtype, device: torch.device) -> bool:
    """Run the kernel and the eager path on pseudo-random chunks of several shapes; they must agree."""
    info = torch.iinfo(bits_dtype)
    gen = torch.Generator(device="cpu").manual_seed(0x7121)
    seeds = (dtype_seed("self-check", 0), dtype_seed("self-check", 1))
    # One long run crossing block edges, and a column split of a matrix (many short runs).
    for shape, offsets, gshape in (((3 * BLOCK + 17,), (1 << 33,), ((1 << 34),)), ((37, 301), (5, 123), (64, 512))):
        bits = torch.randint(info.min, info.max, (math.prod(shape),), dtype=bits_dtype, generator=gen)
        geometry = eager.chunk_geometry(shape, offsets, gshape)
        got = lanes_of(bits.to(device), geometry, seeds)
        if got != eager.eager_lanes(bits, geometry, seeds):  # pragma: no cover - a miscompilation
            _log.warning("triton fingerprint kernel disagrees with eager torch for %s; not using it", bits_dtype)
            return False
    return True


def lanes_of(flat: torch.Tensor, geometry: Any, seeds: tuple[int, int]) -> tuple[int, int]:
    """The two unsigned lane sums of the chunk whose flat integer view is ``flat``, laid out as ``geometry``."""
    num_runs, run_length = geometry.num_runs, geometry.run_length
    if num_runs == 1:
        starts = torch.tensor([geometry.first_start], dtype=torch.int64, device=flat.device)
    else:
        starts = geometry.run_starts(0, num_runs, flat.device)
    blocks_per_run = -(-run_length // BLOCK)
    programs = num_runs * blocks_per_run
    partials = torch.empty(programs * 2, dtype=torch.int64, device=flat.device)
    _kernel()[(programs,)](flat, starts, partials, run_length, blocks_per_run, _signed(INDEX_MULTIPLIER),
                           _signed(seeds[0]), _signed(seeds[1]), **_launch_args(), num_warps=8)
    # Integer sums wrap modulo 2**64 (two's complement), which is the fingerprint's arithmetic.
    a, b = partials.view(programs, 2).sum(dim=0).tolist()
    return a & MASK64, b & MASK64


def lanes(flat: torch.Tensor, geometry: Any, seeds: tuple[int, int]) -> tuple[int, int] | None:
    """The lane sums through the kernel, or ``None`` (Triton missing, runs too short, self-check failed, graph capture,
    or the launch failed: counted, logged once by :func:`failures`, retried next call). Call inside
    :func:`~ckptverify.fingerprint.device.device_scope`."""
    if flat.numel() == 0 or geometry.run_length < 64 or _kernel() is None or is_capturing(flat.device):
        return None
    key = (flat.device.type, flat.dtype)
    with _lock:
        if not _checked(_verified, key, lambda: _self_check(flat.dtype, flat.device)):
            return None
    try:
        return lanes_of(flat, geometry, seeds)
    except Exception as exc:  # pragma: no cover - depends on the environment (the CPU tests fake it)
        _note_failure("launch", exc)
        return None


def _checked(verdicts: dict[Any, bool], key: Any, check: Any) -> bool:
    """Whether ``key`` passed its self-check (running ``check`` the first time; hold ``_lock``). A disagreement is
    final;
    a check that raised is retried, ``_CHECK_TRIES`` times in all."""
    verdict = verdicts.get(key)
    if verdict is not None:
        return verdict
    try:
        verdicts[key] = bool(check())
    except Exception as exc:  # pragma: no cover - depends on the environment (the CPU tests fake it)
        _check_errors[key] = _check_errors.get(key, 0) + 1
        _note_failure("self-check", exc)
        if _check_errors[key] >= _CHECK_TRIES:
            verdicts[key] = False
        return False
    return verdicts[key]


def _note_failure(what: str, exc: BaseException) -> None:
    """Count a failed launch or self-check; log the first per process as a warning, the rest at debug level."""
    global _failures
    with _failure_lock:
        _failures += 1
        first = _failures == 1
    log = _log.warning if first else _log.debug
    log("triton fingerprint kernel %s failed (this call takes eager torch; failures so far: %d): %s",
        what, _failures, exc)


def failures() -> int:
    """How many launches and self-checks of the kernels failed in this process (each fell back to eager)."""
    return _failures


# ------------------------------------------------------------------------------------------------ many


#: Smaller tensors are packed into buffers of at most this size (larger read in place): bounds the copy.
MANY_GROUP_BYTES = 64 << 20


def _groups(numels: list[int], sizes: list[int], bound: int) -> list[list[int]]:
    """Members each launch takes: by width (first-appearance order), empties left out, consecutive while within
    ``bound`` bytes (a larger member alone)."""
    out: list[list[int]] = []
    for size in dict.fromkeys(sizes):
        group: list[int] = []
        nbytes = 0
        for m, (n, z) in enumerate(zip(numels, sizes, strict=True)):
            if z != size or not n:
                continue
            if group and nbytes + n * z > bound:
                out.append(group)
                group, nbytes = [], 0
            group.append(m)
            nbytes += n * z
        if group:
            out.append(group)
    return out


def _rows(numels: torch.Tensor, seeds: torch.Tensor) -> torch.Tensor:
    """The kernel's table for members laid end to end: per ``BLOCK`` block one int64 row ``(buffer start, first index in
    its tensor, elements, seed 0, seed 1)``, built in a few CPU tensor operations."""
    blocks = (numels + (BLOCK - 1)) // BLOCK
    total = int(blocks.sum())
    member = torch.repeat_interleave(torch.arange(len(numels)), blocks, output_size=total)
    first_row = torch.cumsum(blocks, 0) - blocks  # each member's first row
    first = (torch.arange(total) - first_row[member]) * BLOCK
    offset = torch.cumsum(numels, 0) - numels  # each member's place in the buffer
    length = torch.clamp(numels[member] - first, max=BLOCK)
    return torch.stack([offset[member] + first, first, length, seeds[member, 0], seeds[member, 1]], dim=1)


def _to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``host`` on ``device`` via pinned memory without waiting (the allocator records the copy on its stream)."""
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


class _ManyPlan:
    """How one layout goes through :func:`lanes_many`: launches and per-member program ranges. Its device tensors are
    recorded on any other stream it is used on (:meth:`use_on`), so evicting the plan never frees memory in use."""

    def __init__(self, numels: list[int], sizes: list[int], seeds: list[tuple[int, int]],
                 device: torch.device, bound: int) -> None:
        self.groups: list[tuple[list[int], torch.Tensor, int, int]] = []
        first = torch.zeros(len(numels), dtype=torch.int64)
        last = torch.zeros(len(numels), dtype=torch.int64)
        signed_seeds = torch.tensor([[_signed(a), _signed(b)] for a, b in seeds], dtype=torch.int64).reshape(-1, 2)
        counts = torch.tensor(numels, dtype=torch.int64)
        programs = 0
        for members in _groups(numels, sizes, bound):
            index = torch.tensor(members, dtype=torch.int64)
            rows = _rows(counts[index], signed_seeds[index])
            blocks = (counts[index] + (BLOCK - 1)) // BLOCK
            ends = torch.cumsum(blocks, 0) + programs
            first[index] = ends - blocks
            last[index] = ends
            self.groups.append((members, _to_device(rows.reshape(-1), device), programs, rows.shape[0]))
            programs += rows.shape[0]
        self.programs = programs
        self.first = _to_device(first, device)
        self.last = _to_device(last, device)
        self.nbytes = sum(table.numel() * 8 for _, table, _, _ in self.groups) + 16 * len(numels)
        self._streams = {_stream_key(_current_stream(device))}

    def use_on(self, stream: Any) -> None:
        """Record the device tensors on ``stream`` (once per stream other than the building one)."""
        key = _stream_key(stream)
        if key in self._streams:
            return
        for tensor in [table for _, table, _, _ in self.groups] + [self.first, self.last]:
            _record_stream(tensor, stream)
        self._streams.add(key)


def _current_stream(device: torch.device) -> Any:
    """The calling thread's current stream of ``device`` (``None`` off CUDA, where there are no streams)."""
    return torch.cuda.current_stream(device) if device.type == "cuda" else None


def _stream_key(stream: Any) -> Any:
    # A torch.cuda.Stream is a new Python object at each current_stream() call: compare the CUDA streams.
    return getattr(stream, "cuda_stream", stream)


def _record_stream(tensor: torch.Tensor, stream: Any) -> None:
    if stream is not None:
        tensor.record_stream(stream)


#: Plans by layout, LRU, bounded by ``_PLANS_KEPT`` and ``_PLAN_BYTES_KEPT`` (a trace uses hundreds per step).
_plans: OrderedDict[tuple[Any, ...], _ManyPlan] = OrderedDict()
_PLANS_KEPT = 1024
_PLAN_BYTES_KEPT = 256 << 20
_plans_lock = threading.Lock()


def _launch_many(bits: torch.Tensor, table: torch.Tensor, out: torch.Tensor, programs: int) -> None:
    """One launch of the many-tensor kernel: ``programs`` rows of ``table`` over ``bits``, sums into ``out``."""
    _many_kernel[(programs,)](bits, table, out, _signed(INDEX_MULTIPLIER), **_launch_args(), num_warps=8)


def lanes_many_of(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Each whole tensor's lane sums as ``(n, 2)`` int64 on their device, unchecked (:func:`lanes_many` is the guarded
    entry). Only one launch's buffer exists at a time."""
    device = tensors[0].device
    names = [eager.dtype_name(t.dtype) for t in tensors]
    widths = [t.element_size() // (2 if t.is_complex() else 1) for t in tensors]
    numels = [t.numel() * (2 if t.is_complex() else 1) for t in tensors]
    bound = MANY_GROUP_BYTES
    key = (str(device), bound, tuple(zip(numels, widths, names, strict=True)))
    with _plans_lock:
        plan = _plans.get(key)
        if plan is not None:
            _plans.move_to_end(key)
    if plan is None:
        plan = _ManyPlan(numels, widths, [(dtype_seed(n, 0), dtype_seed(n, 1)) for n in names], device, bound)
        with _plans_lock:
            _plans[key] = plan
            total = sum(p.nbytes for p in _plans.values())
            while len(_plans) > 1 and (len(_plans) > _PLANS_KEPT or total > _PLAN_BYTES_KEPT):
                _, old = _plans.popitem(last=False)
                total -= old.nbytes
    plan.use_on(_current_stream(device))
    partials = torch.empty((plan.programs + 1, 2), dtype=torch.int64, device=device)
    partials[0].zero_()
    for members, table, first, count in plan.groups:
        # Copied only if non-contiguous, conjugated or negated, or to pack several members into one buffer.
        bits = eager.flat_bits(tensors[members[0]]) if len(members) == 1 else torch.cat(
            [eager.flat_bits(tensors[m]) for m in members])
        _launch_many(bits, table, partials[1 + first:1 + first + count], count)
        del bits  # the next launch's buffer replaces this one
    # Sums wrap mod 2**64; a member's sum is the difference of running sums at its ends.
    running = torch.cumsum(partials, dim=0)
    return running[plan.last] - running[plan.first]


def _self_check_many(device: torch.device) -> bool:
    """:func:`lanes_many_of` must agree with eager on every width, short/long/empty/complex tensors."""
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


#: Device type -> whether the many-tensor kernel passed its check against the eager path there.
_many_verified: dict[str, bool] = {}


def lanes_many(tensors: list[torch.Tensor]) -> torch.Tensor | None:
    """:func:`lanes_many_of`, or ``None`` where not applicable (as :func:`lanes`). Call inside
    :func:`~ckptverify.fingerprint.device.device_scope`."""
    if not tensors or _kernel() is None or is_capturing(tensors[0].device):
        return None
    device = tensors[0].device
    with _lock:
        if not _checked(_many_verified, device.type, lambda: _self_check_many(device)):
            return None
    try:
        return lanes_many_of(tensors)
    except Exception as exc:  # pragma: no cover - depends on the environment (the CPU tests fake it)
        _note_failure("many-tensor launch", exc)
        return None
