"""The paths of the logical fingerprint and the choice between them (``docs/fingerprint.md``).

On its own device: CPU takes numpy (a one-shot formula for small chunks, the host path otherwise) or the
``torch.compile`` fused kernel once ready (:func:`set_backend`, ``CKPTVERIFY_FINGERPRINT_BACKEND``: ``auto``,
``numpy``, ``compiled``); CUDA takes the Triton kernel where it imports and passed its check; anything else eager
torch. All compute exactly the same integers (wrapping 64-bit arithmetic has no rounding); fused kernels
self-check against eager before first use.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch
from torch.utils import _python_dispatch

from ckptverify.errors import UsageError
from ckptverify.fingerprint import eager as _ref
from ckptverify.fingerprint.device import check_fingerprintable, device_scope
from ckptverify.fingerprint.eager import (
    _INT_VIEW_BY_SIZE,
    _Geometry,
    as_real,
    chunk_geometry,
    eager_lanes,
    flat_bits,
    iter_blocks,
    lanes_many_eager,
    mix_tensor,
)
from ckptverify.fingerprint.spec import INDEX_MULTIPLIER, LANES, Mixer, add_lanes, dtype_seed, mix, numpy_lanes
from ckptverify.fingerprint.spec import MASK64 as _MASK64
from ckptverify.fingerprint.spec import signed as _signed

__all__ = ["AUTO_COMPILE_AFTER_BYTES", "COMPILED_BLOCK", "NO_SCREEN", "SMALL_NUMPY", "SPECIAL_BITS", "STAGE_COPY",
           "CpuBlockLanes", "compile_in_background", "cpu_block_lanes", "eager_fingerprint_lanes", "fingerprint_lanes",
           "fingerprint_lanes_counted", "get_backend", "host_lanes", "lanes_many", "prepare_compiled", "set_backend",
           "thread_limit"]

if TYPE_CHECKING:
    import numpy as np

_log = logging.getLogger(__name__)

# The block geometry (``EAGER_BLOCK``, ``ROW_WIDTH``) is the eager module's, read from it at each call
# (``_ref.ROW_WIDTH``): set it there.

#: Elements per block of the compiled path (``COMPILED_BLOCK // ROW_WIDTH`` rows of ``ROW_WIDTH``).
COMPILED_BLOCK = 1 << 20


# --------------------------------------------------------------------------------------- compiled path


def _block_lanes(
    bits: torch.Tensor, row_terms: torch.Tensor, column_table: torch.Tensor, seeds: torch.Tensor,
    screen: torch.Tensor,
) -> torch.Tensor:
    """Lane sums of one block ``bits`` (rows, width), plus the count of elements with ``bits & screen[0] == screen[1]``
    (NaN/Inf, ``SPECIAL_BITS``), taken on the same read so a save need not re-read the chunk. ``p = g * K`` comes
    from ``row_terms`` + ``column_table`` (mod 2**64): 1.5x faster than ``arange * K``, which ``torch.compile`` has
    also constant-folded wrongly for 16-bit inputs."""
    w = bits.to(torch.int64)
    p = row_terms[:, None] + column_table[None, :]
    out = [mix_tensor(w ^ (p + seeds[lane]), mixer).sum() for lane, mixer in enumerate(LANES)]
    out.append(((w & screen[0]) == screen[1]).sum())
    return torch.stack(out)


def _special_bits() -> dict[torch.dtype, tuple[int, int]]:
    f16, bf16, f32, f64 = (0x7C00, 0x7C00), (0x7F80, 0x7F80), (0x7F800000, 0x7F800000), (0x7FF << 52, 0x7FF << 52)
    table = {torch.float16: f16, torch.bfloat16: bf16, torch.float32: f32, torch.float64: f64,
             torch.complex64: f32, torch.complex128: f64}
    # float8: e5m2 is IEEE-like (exponent all ones); e4m3fn has no infinity, its NaN is S.1111.111; the fnuz
    # formats have one NaN, the bits of negative zero (0x80), and no infinity.
    for name, bits in (("float8_e5m2", (0x7C, 0x7C)), ("float8_e4m3fn", (0x7F, 0x7F)),
                       ("float8_e4m3fnuz", (0xFF, 0x80)), ("float8_e5m2fnuz", (0xFF, 0x80))):
        dtype = getattr(torch, name, None)
        if isinstance(dtype, torch.dtype):
            table[dtype] = bits
    return table


#: ``(mask, pattern)``: an element is NaN/Inf iff its sign-extended bits ``& mask == pattern``. Not for
#: float8_e8m0fnu, float4, complex32 (counted by torch); complex uses its parts'.
SPECIAL_BITS: dict[torch.dtype, tuple[int, int]] = _special_bits()
#: A screen no element matches (``bits & 0 == 1`` never holds).
NO_SCREEN = (0, 1)


#: CPU backends (see :func:`~ckptverify.fingerprint.logical.set_fingerprint_backend`).
_BACKENDS = ("auto", "numpy", "compiled")
_backend = os.environ.get("CKPTVERIFY_FINGERPRINT_BACKEND", "auto")
if _backend not in _BACKENDS:  # pragma: no cover - environment
    _log.warning("ignoring CKPTVERIFY_FINGERPRINT_BACKEND=%r (not one of %s)", _backend, _BACKENDS)
    _backend = "auto"
#: "auto" compiles in the background after this many host-path bytes: compiling costs 5-15 s of a core, which
#: a process fingerprinting less never pays.
AUTO_COMPILE_AFTER_BYTES = 1 << 30
_host_bytes = 0
_compiled_fn: Callable[..., torch.Tensor] | None = None
_compile_failed = False
#: bits dtype -> whether the compiled (CPU) kernel passed its check against the eager path.
_verified: dict[torch.dtype, bool] = {}
_lock = threading.Lock()
#: Keys whose compilation started in the background (each once per process).
_compiling: set[torch.dtype] = set()


def set_backend(name: str) -> None:
    global _backend
    if name not in _BACKENDS:
        raise UsageError(f"unknown fingerprint backend {name!r}; choose one of {', '.join(_BACKENDS)}")
    _backend = name


def get_backend() -> str:
    return _backend


def _wants_compiled(device: torch.device, numel: int, bits_dtype: torch.dtype | None = None) -> bool:
    """Whether a chunk of ``numel`` elements (``bits_dtype``: its staged bits) is for the compiled kernel."""
    # The compiled kernel cannot run under a Python dispatch mode, and failing there would disable it for good.
    if (_compile_failed or _backend == "numpy" or device.type != "cpu" or numel < COMPILED_BLOCK
            or _python_dispatch._get_current_dispatch_mode() is not None):
        return False
    return (_backend == "compiled" or _host_bytes >= AUTO_COMPILE_AFTER_BYTES
            or bool(_verified.get(bits_dtype)))


def prepare_compiled(dtype: torch.dtype = torch.float32) -> bool:
    """Compile and check the fused CPU kernel for ``dtype`` now, waiting, so ``auto`` uses it from the first large
    chunk. ``False`` where ``torch.compile`` does not work or the kernel disagreed with eager."""
    staged = cpu_kernel_dtype(dtype)
    return staged is not None and _compiled_kernel(staged) is not None


def compile_in_background(dtype: torch.dtype) -> None:
    """Start compiling and checking the CPU kernel for ``dtype`` in the background (once per width; nothing if ready,
    failed, or not ``auto``), for a caller about to fingerprint ``AUTO_COMPILE_AFTER_BYTES`` of large chunks."""
    if _backend != "auto" or _compile_failed:
        return
    staged = cpu_kernel_dtype(dtype)
    if staged is not None:
        _compiled_kernel(staged, wait=False)


def cpu_kernel_dtype(dtype: torch.dtype) -> torch.dtype | None:
    """The integer dtype a ``dtype`` chunk (or its bits view) is staged in, naming the kernel compilation it takes:
    int32 for 1-4 byte elements (8/16-bit bits sign-extend to the same values), int64 for 8-byte, complex as two
    parts; ``None`` if the kernel does not take that width."""
    size = dtype.itemsize // (2 if dtype.is_complex else 1)
    return None if size not in _INT_VIEW_BY_SIZE else torch.int64 if size == 8 else torch.int32


def _disable_compiled(reason: object) -> None:
    global _compile_failed
    if not _compile_failed:
        _log.warning("compiled fingerprint kernel unavailable, using numpy (CPU) and eager torch: %s", reason)
    _compile_failed = True


def _compiled_kernel(bits_dtype: torch.dtype, wait: bool = True) -> Callable[..., torch.Tensor] | None:
    """The compiled block kernel once it matched eager on a test block of this dtype. ``wait=False``: ``None`` unless
    ready, compilation and self-check then starting in the background (once)."""
    global _compiled_fn
    if not wait:
        if _verified.get(bits_dtype) and _compiled_fn is not None:
            return _compiled_fn
        with _lock:
            if _compile_failed or bits_dtype in _compiling or bits_dtype in _verified:
                return None
            _compiling.add(bits_dtype)
        threading.Thread(target=_compiled_kernel, args=(bits_dtype,), daemon=True,
                         name="ckptverify-fingerprint-compile").start()
        return None
    with _lock:
        if _compile_failed or _verified.get(bits_dtype) is False:
            return None
        if _compiled_fn is None:
            try:
                # One thread per call: the caller splits blocks between threads (:func:`_lanes`).
                _compiled_fn = torch.compile(_block_lanes, dynamic=False, fullgraph=True,
                                             options={"cpp.threads": 1})
            except Exception as exc:  # pragma: no cover - depends on the environment
                _disable_compiled(exc)
                return None
        if bits_dtype not in _verified:
            _verified[bits_dtype] = _self_check(_compiled_fn, bits_dtype)
        return _compiled_fn if _verified[bits_dtype] else None


def _self_check(fn: Callable[..., torch.Tensor], bits_dtype: torch.dtype) -> bool:
    """Run the compiled kernel and the eager path on one pseudo-random block; they must agree."""
    info = torch.iinfo(bits_dtype)
    gen = torch.Generator(device="cpu").manual_seed(0x5EED)
    bits = torch.randint(info.min, info.max, (COMPILED_BLOCK,), dtype=bits_dtype, generator=gen)
    bits = bits.view(COMPILED_BLOCK // _ref.ROW_WIDTH, _ref.ROW_WIDTH)
    first = (1 << 40) + 12345
    seeds = (dtype_seed("self-check", 0), dtype_seed("self-check", 1))
    tables = _CompiledTables(seeds)
    # About one element in 512 matches (nine fixed bits), in every source width: the count is checked too.
    screen = (0x7FC0, 0x7FC0)
    try:
        with torch.no_grad():  # one grad mode for every call: no recompilation on its account
            got = fn(bits, tables.row_terms(first), tables.column_table, tables.seeds, tables.screen(screen)).tolist()
    except Exception as exc:  # pragma: no cover - depends on the environment
        _disable_compiled(exc)
        return False
    if got[2] != _count_special(bits, screen):  # pragma: no cover - a miscompilation
        _log.warning("compiled fingerprint kernel miscounts special values for %s; not using it", bits_dtype)
        return False
    want = eager_lanes(bits.reshape(-1), _Geometry((), (), first, COMPILED_BLOCK), seeds)
    if (got[0] & _MASK64, got[1] & _MASK64) != want:  # pragma: no cover - a miscompilation
        _log.warning("compiled fingerprint kernel disagrees with eager torch for %s; not using it", bits_dtype)
        return False
    return True


class _CompiledTables:
    """The compiled kernel's non-bits inputs for blocks of ``COMPILED_BLOCK // ROW_WIDTH`` rows of ``ROW_WIDTH``."""

    def __init__(self, seeds: tuple[int, int]) -> None:
        k = _signed(INDEX_MULTIPLIER)
        kw: dict = {"dtype": torch.int64}
        self.column_table = torch.arange(_ref.ROW_WIDTH, **kw).mul_(k)
        self._row_steps = torch.arange(COMPILED_BLOCK // _ref.ROW_WIDTH, **kw).mul_(_ref.ROW_WIDTH)
        self._row_terms = torch.empty_like(self._row_steps)
        self.seeds = torch.tensor([_signed(s) for s in seeds], **kw)
        self._k = k

    def screen(self, screen: tuple[int, int]) -> torch.Tensor:
        """The kernel's ``screen`` argument: ``[mask, pattern]`` (a tensor, so that no value compiles anew)."""
        return torch.tensor([_signed(screen[0]), _signed(screen[1])], dtype=torch.int64)

    def row_terms(self, first: int) -> torch.Tensor:
        """``(first + r * ROW_WIDTH) * K`` for each row ``r``."""
        return torch.add(self._row_steps, first, out=self._row_terms).mul_(self._k)


# ------------------------------------------------------------------------------------------- entry


def fingerprint_lanes(
    t: torch.Tensor, offsets: Sequence[int], global_shape: Sequence[int], name: str
) -> tuple[int, int]:
    """The two lane sums (unsigned 64-bit) of a chunk ``t`` at ``offsets`` in ``global_shape``."""
    return _lanes(t, offsets, global_shape, name, None)[0]


def fingerprint_lanes_counted(
    t: torch.Tensor, offsets: Sequence[int], global_shape: Sequence[int], name: str
) -> tuple[tuple[int, int], int | None]:
    """:func:`fingerprint_lanes` plus the NaN/Inf count where the same pass counted it (compiled kernel on CPU);
    ``None`` otherwise, and the caller counts."""
    screen = SPECIAL_BITS.get(t.dtype)
    lanes, count = _lanes(t, offsets, global_shape, name, screen)
    return lanes, count if screen is not None else None


def eager_fingerprint_lanes(t: torch.Tensor, offsets: Sequence[int], global_shape: Sequence[int],
                            name: str) -> tuple[int, int]:
    """:func:`fingerprint_lanes` via the eager path on any device (the reference the tests and GPU checks use)."""
    return _lanes(t, offsets, global_shape, name, None, eager=True)[0]


def _lanes(
    t: torch.Tensor, offsets: Sequence[int], global_shape: Sequence[int], name: str,
    screen: tuple[int, int] | None, eager: bool = False,
) -> tuple[tuple[int, int], int | None]:
    """A chunk's lane sums and its ``screen`` count (``None`` if not counted or no ``screen``), on ``t``'s device and
    current stream (:func:`~ckptverify.fingerprint.device.device_scope`); refuses unreadable tensors. ``eager``: by
    the eager path, whatever the device."""
    global _host_bytes
    with device_scope(t.device):
        check_fingerprintable(t)
        t, offsets, global_shape = as_real(t.detach(), offsets, global_shape)
        geometry = chunk_geometry(t.shape, offsets, global_shape)
        if t.numel() == 0:
            return (0, 0), 0
        seeds = (dtype_seed(name, 0), dtype_seed(name, 1))
        if eager:
            return eager_lanes(flat_bits(t), geometry, seeds), None
        if t.device.type == "cpu" and t.numel() > SLAB and not t.is_contiguous():
            return _slab_lanes(t, offsets, global_shape, name, screen)
        flat = flat_bits(t)
        device = flat.device
        if device.type != "cpu":
            if device.type == "cuda":
                # One fused Triton pass on the GPU (checked against the eager path before first use).
                from ckptverify.fingerprint import triton_kernel as _fingerprint_triton

                got = _fingerprint_triton.lanes(flat, geometry, seeds)
                if got is not None:
                    return got, None
            return eager_lanes(flat, geometry, seeds), None
        if flat.numel() <= SMALL_NUMPY:
            # A small chunk: one numpy formula has the smallest fixed cost.
            return _small_lanes(flat, geometry, seeds), None
        stage_dtype = cpu_kernel_dtype(flat.dtype)
        if geometry.run_length >= COMPILED_BLOCK and _wants_compiled(device, flat.numel(), stage_dtype):
            # Backend "auto" does not wait for the compilation: the host path takes the chunks until it is ready.
            compiled = _compiled_kernel(stage_dtype, wait=_backend == "compiled")
            if compiled is not None:
                # Blocks split between threads: the kernel is single-threaded (its own OpenMP team ran 3-10x slower
                # on a busy machine).
                runner = CpuBlockLanes(compiled, flat, geometry, seeds, stage_dtype, screen)
                parts = _host_map(runner.run, len(runner.blocks), _host_threads(flat.numel()))
                return add_lanes(parts), sum(p[2] for p in parts)
        # One pass in numpy over cache-sized blocks, both lanes at once, on torch's threads' worth of cores.
        got = host_lanes(flat, geometry, seeds)
        _host_bytes += flat.numel() * flat.element_size()
        return got, None


#: Staging copy: ``"numpy"`` or ``"torch"`` (``Tensor.copy_``, for ``scripts/bench_save.py --before``); same bytes.
STAGE_COPY = "numpy"


class CpuBlockLanes:
    """The compiled CPU kernel's pass over one contiguous chunk, a range of blocks at a time.

    Blocks are ``iter_blocks(flat, geometry, COMPILED_BLOCK)``; :attr:`byte_ends` says where each ends, so a writer
    can fingerprint blocks still in cache (:mod:`ckptverify.dcp.writer`). :meth:`run` gives a range's lane sums and
    ``screen`` count; they add up mod 2**64 in any order, and disjoint ranges may run in parallel threads (each with
    its own staging buffer). Blocks the kernel does not take use the host path.
    """

    def __init__(self, fn: Callable[..., torch.Tensor], flat: torch.Tensor, geometry: _Geometry,
                 seeds: tuple[int, int], stage_dtype: torch.dtype, screen: tuple[int, int] | None) -> None:
        self._fn = fn
        self._seeds = seeds
        self._stage_dtype = stage_dtype
        self._screen = screen
        self.blocks = list(iter_blocks(flat, geometry, COMPILED_BLOCK))
        base, size = flat.storage_offset(), flat.element_size()
        self.byte_ends = [(blk.bits.storage_offset() - base + blk.bits.numel()) * size for blk in self.blocks]

    def run(self, lo: int, hi: int) -> tuple[int, int, int]:
        """Lane sums and ``screen`` count (0 without one) of blocks ``lo`` to ``hi - 1`` (not reduced)."""
        import numpy as np

        shape = (COMPILED_BLOCK // _ref.ROW_WIDTH, _ref.ROW_WIDTH)
        tables, stage, stage_np, screen_arg = self._thread_buffers(shape)
        fn, seeds, screen = self._fn, self._seeds, self._screen
        total = [0, 0, 0]
        for blk in self.blocks[lo:hi]:
            part = None
            if blk.bits.shape == shape and not _compile_failed:
                try:
                    if STAGE_COPY == "numpy":
                        np.copyto(stage_np, blk.bits.numpy(), casting="unsafe")  # int8/int16: sign-extended
                    else:
                        stage.copy_(blk.bits)
                    with torch.no_grad():
                        res = fn(stage, tables.row_terms(blk.first_start), tables.column_table, tables.seeds,
                                 screen_arg)
                    part = res.tolist()
                except Exception as exc:  # pragma: no cover - depends on the environment
                    _disable_compiled(exc)
            if part is None:
                # Rows of one run: consecutive global indices from ``first_start``.
                geometry = _Geometry((), (), blk.first_start, blk.bits.numel())
                part = (*host_lanes(blk.bits.reshape(-1), geometry, seeds, threads=1),
                        _count_special(blk.bits, screen) if screen is not None else 0)
            total = [x + y for x, y in zip(total, part, strict=True)]
        return total[0], total[1], total[2]

    def _thread_buffers(self, shape: tuple[int, int]) -> tuple[_CompiledTables, torch.Tensor, Any, torch.Tensor]:
        """This thread's kernel inputs for the chunk's seeds and screen, and its staging buffer (kept per thread)."""
        cache = getattr(_stage_cache, "buffers", None)
        if cache is None:
            cache = _stage_cache.buffers = {}
        key = (self._stage_dtype, self._seeds, self._screen, shape)
        got = cache.get(key)
        if got is None:
            if len(cache) >= 8:  # a few dtypes and screens at a time: the oldest go
                del cache[next(iter(cache))]
            tables = _CompiledTables(self._seeds)
            # Staging into a reused buffer is 1.5-1.8x faster than running on the tensor's memory. Narrow bits are
            # widened to int32 (inductor vectorizes int32/int64, not int8/int16: 5x for bfloat16). numpy copies:
            # torch's copy_ is an OpenMP region whose spinning worker doubled a save's CPU time.
            stage = torch.empty(shape, dtype=self._stage_dtype)
            got = cache[key] = (tables, stage, stage.numpy(), tables.screen(self._screen or NO_SCREEN))
        return got


_stage_cache = threading.local()


def cpu_block_lanes(t: torch.Tensor, offsets: Sequence[int], global_shape: Sequence[int], name: str,
                    screen: tuple[int, int] | None) -> CpuBlockLanes | None:
    """A :class:`CpuBlockLanes` over contiguous chunk ``t`` when the compiled kernel would take it now (``auto`` or
    ``compiled``, ready for its dtype: no waiting); else ``None`` (use :func:`fingerprint_lanes_counted`). Its results
    equal those of :func:`fingerprint_lanes_counted`."""
    stage = cpu_kernel_dtype(t.dtype)
    if (stage is None or not t.is_contiguous() or not _wants_compiled(t.device, t.numel(), stage)
            or not _verified.get(stage) or _compiled_fn is None):
        return None
    t, offsets, global_shape = as_real(t, offsets, global_shape)
    geometry = chunk_geometry(t.shape, offsets, global_shape)
    if geometry.run_length < COMPILED_BLOCK:
        return None
    flat = t.reshape(-1).view(_INT_VIEW_BY_SIZE[t.element_size()])
    return CpuBlockLanes(_compiled_fn, flat, geometry, (dtype_seed(name, 0), dtype_seed(name, 1)), stage, screen)


def _count_special(bits: torch.Tensor, screen: tuple[int, int]) -> int:
    """How many of ``bits`` (sign-extended to int64) have ``bits & mask == pattern``."""
    w = bits.to(torch.int64)
    return int(((w & _signed(screen[0])) == _signed(screen[1])).sum())


#: Larger non-contiguous CPU chunks are fingerprinted in contiguous pieces of this size, not copied whole.
SLAB = 1 << 22


def _slab_lanes(t: torch.Tensor, offsets: list[int], global_shape: list[int], name: str,
                screen: tuple[int, int] | None = None) -> tuple[tuple[int, int], int | None]:
    """A non-contiguous chunk's lanes as the sum of disjoint pieces' (cut along the first dim longer than 1, and further
    while still above ``SLAB`` and non-contiguous). ``screen`` counts add up too (``None`` if any piece is uncounted).
    """
    dim = next(d for d, size in enumerate(t.shape) if size > 1)
    per = max(1, SLAB // (t.numel() // t.shape[dim]))
    parts, counts = [], []
    for start in range(0, t.shape[dim], per):
        at = list(offsets)
        at[dim] += start
        lanes, count = _lanes(t.narrow(dim, start, min(per, t.shape[dim] - start)), at, global_shape, name, screen)
        parts.append(lanes)
        counts.append(count)
    return add_lanes(parts), None if None in counts else sum(counts)


#: Chunks of at most this many elements take :func:`_small_lanes` on CPU under backend ``auto``.
SMALL_NUMPY = 1 << 14


def _small_lanes(flat: torch.Tensor, geometry: _Geometry, seeds: tuple[int, int]) -> tuple[int, int]:
    """A small CPU chunk's lane sums in one numpy formula (:func:`~ckptverify.fingerprint.spec.numpy_lanes`)."""
    import numpy as np

    run = geometry.run_length
    if geometry.num_runs == 1:
        g = np.arange(geometry.first_start, geometry.first_start + run, dtype=np.uint64)
    else:
        g = (_host_run_starts(geometry, 0, geometry.num_runs)[:, None] + np.arange(run, dtype=np.uint64)).reshape(-1)
    a, b = numpy_lanes(flat.numpy().astype(np.int64), g, seeds)
    return int(a), int(b)


# ------------------------------------------------------------------------------------------ host path

#: Host-path block: its buffers (512 KiB) stay in L2; 8192 and 65536 both ran 10-20% slower.
HOST_BLOCK = 1 << 14
#: Elements per thread below which the host path does not split a chunk over threads.
HOST_MIN_PER_THREAD = 1 << 20
#: Ranges of blocks per thread a chunk is cut into when it is split over threads.
HOST_RANGES_PER_THREAD = 8

_host_pool = None
_host_pool_size = 0
_host_lock = threading.Lock()  # not ``_lock``, which a compilation holds for seconds


def _after_fork_in_child() -> None:
    """A forked child has none of the parent's threads: reset locks they might hold, pools and pending compilations."""
    global _lock, _host_lock, _host_pool, _host_pool_size
    _lock = threading.Lock()
    _host_lock = threading.Lock()
    _host_pool, _host_pool_size = None, 0
    for key in list(_compiling):
        if key not in _verified:
            _compiling.discard(key)


if hasattr(os, "register_at_fork"):  # not on Windows
    os.register_at_fork(after_in_child=_after_fork_in_child)


_thread_cap = threading.local()


@contextmanager
def thread_limit(threads: int | None) -> Iterator[None]:
    """Within the block, this thread's CPU fingerprints use at most ``threads`` threads (``None``: no extra limit). A
    save fingerprints beside its writer and digesters; splitting chunks too oversubscribed the cores."""
    if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
        raise UsageError(f"a thread limit must be a positive int or None, got {threads!r}")
    saved = getattr(_thread_cap, "threads", None)
    _thread_cap.threads = threads
    try:
        yield
    finally:
        _thread_cap.threads = saved


def _host_threads(numel: int) -> int:
    """Threads for ``numel`` elements: torch's intra-op count, capped by CPUs and :func:`thread_limit`, with at least
    ``HOST_MIN_PER_THREAD`` elements each."""
    threads = min(torch.get_num_threads(), os.cpu_count() or 1, numel // HOST_MIN_PER_THREAD)
    cap = getattr(_thread_cap, "threads", None)
    if cap is not None:
        threads = min(threads, cap)
    return max(1, threads)


def _host_map(fn: Callable[[int, int], Any], count: int, workers: int) -> list[Any]:
    """``fn(lo, hi)`` over ranges covering ``[0, count)`` on at most ``workers`` pooled threads (numpy releases the
    GIL). Several ranges per thread, each taking the next when done: a thread slowed by other work takes fewer."""
    global _host_pool, _host_pool_size
    workers = max(1, min(workers, count))
    step = -(-count // (workers if workers == 1 else workers * HOST_RANGES_PER_THREAD))
    ranges = [(lo, min(count, lo + step)) for lo in range(0, count, step)]
    if workers <= 1 or len(ranges) == 1:
        return [fn(*r) for r in ranges]
    from concurrent.futures import ThreadPoolExecutor

    with _host_lock:
        if _host_pool is None or _host_pool_size < workers:
            old = _host_pool
            _host_pool = ThreadPoolExecutor(workers, thread_name_prefix="ckptverify-fingerprint-host")
            _host_pool_size = workers
            if old is not None:
                old.shutdown(wait=False)
        pool = _host_pool
    pending = iter(ranges)
    take = threading.Lock()

    def worker() -> list[tuple[int, int]]:
        done = []
        while True:
            with take:
                r = next(pending, None)
            if r is None:
                return done
            done.append(fn(*r))

    futures = [pool.submit(worker) for _ in range(workers)]
    return [part for f in futures for part in f.result()]


def host_lanes(flat: torch.Tensor, geometry: _Geometry, seeds: tuple[int, int],
               threads: int | None = None) -> tuple[int, int]:
    """The two lane sums of a CPU chunk (contiguous integer view ``flat``) in numpy: one pass in ``HOST_BLOCK`` blocks,
    both lanes mixed in two reused buffers, blocks split over ``threads`` (default :func:`_host_threads`); sums mod
    2**64 add up in any order. Nothing chunk-sized is allocated."""
    import numpy as np

    bits = flat.numpy()
    run = geometry.run_length
    block = HOST_BLOCK
    if run >= block:  # long runs: blocks within one run
        per_run = -(-run // block)
        nblocks = geometry.num_runs * per_run
    else:  # short runs: whole runs, several to a block
        per_block = block // run
        per_run = 0
        nblocks = -(-geometry.num_runs // per_block)
    # Both lanes' mixers at once: each constant a column of the two lanes', broadcast along the block.
    both = Mixer(tuple(np.array([[m.shifts[j]] for m in LANES], np.uint64) for j in range(3)),  # type: ignore[arg-type]
                 tuple(np.array([[m.multipliers[j]] for m in LANES], np.uint64) for j in range(2)))  # type: ignore[arg-type]
    seed_col = np.array([[s] for s in seeds], np.uint64)
    columns = np.arange(min(block, run), dtype=np.uint64) * np.uint64(INDEX_MULTIPLIER)

    def blocks(lo: int, hi: int) -> tuple[int, int]:
        width = min(block, flat.numel())
        y = np.empty((2, width), np.int64)  # the mixer's words (int64 for the sign-extending XOR)
        t = np.empty((2, width), np.uint64)  # shifted copies
        yu = y.view(np.uint64)
        base = np.empty((2, 1), np.uint64)
        acc = np.zeros(2, np.uint64)

        def xorshift(u: np.ndarray, s: np.ndarray) -> np.ndarray:  # in place, through the shifted copies
            np.right_shift(u, s, out=t[:, :u.shape[1]])
            return np.bitwise_xor(u, t[:, :u.shape[1]], out=u)

        def multiply(u: np.ndarray, m: np.ndarray) -> np.ndarray:
            return np.multiply(u, m, out=u)

        with np.errstate(over="ignore"):
            for b in range(lo, hi):
                if per_run:
                    q, pos = divmod(b, per_run)
                    pos *= block
                    n = min(block, run - pos)
                    w = bits[q * run + pos : q * run + pos + n]
                    u = yu[:, :n]
                    # p + S = (g0 + k) * K + S = k * K + (g0 * K + S): the column table plus one term per lane.
                    g0 = geometry.run_start(q) + pos
                    np.add(seed_col, np.uint64((g0 * INDEX_MULTIPLIER) & _MASK64), out=base)
                    np.add(columns[:n], base, out=u)
                else:
                    q0 = b * per_block
                    rows = min(per_block, geometry.num_runs - q0)
                    n = rows * run
                    w = bits[q0 * run : q0 * run + n]
                    u = yu[:, :n]
                    row_terms = _host_run_starts(geometry, q0, rows) * np.uint64(INDEX_MULTIPLIER)
                    terms = row_terms[None, :, None] + seed_col[:, :, None]  # (2, rows, 1)
                    np.add(columns[None, None, :run], terms, out=u.reshape(2, rows, run))
                # XOR with the bits read as int64: numpy widens w with sign extension, as the eager copy does.
                np.bitwise_xor(w, y[:, :n], out=y[:, :n])
                acc += np.add.reduce(mix(u, both, xorshift, multiply), axis=1, dtype=np.uint64)
        return int(acc[0]), int(acc[1])

    parts = _host_map(blocks, nblocks, threads or _host_threads(flat.numel()))
    return add_lanes(parts)


def _host_run_starts(geometry: _Geometry, q0: int, count: int) -> np.ndarray:
    """:meth:`_Geometry.run_starts` in numpy (uint64): global starts of runs ``q0 .. q0+count-1``."""
    import numpy as np

    q = np.arange(q0, q0 + count, dtype=np.uint64)
    starts = np.full(count, geometry.first_start, dtype=np.uint64)
    for size, stride in zip(reversed(geometry.outer_shape), reversed(geometry.outer_strides), strict=True):
        starts += (q % np.uint64(size)) * np.uint64(stride)
        q //= np.uint64(size)
    return starts


# ------------------------------------------------------------------------------------------- many


def lanes_many(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """Each whole tensor's lane sums as an ``(n, 2)`` int64 tensor on their common device.

    Tensors of one element size stream through shared blocks, so device operations follow total size, not count;
    nothing waits for the device (read with ``.tolist()``). No scatter-add: works under
    ``torch.use_deterministic_algorithms(True)``. Plain tensors only (a DTensor: pass its local shard). Runs on the
    device's current stream; refuses what :func:`~ckptverify.fingerprint.device.check_fingerprintable` refuses.
    """
    if not tensors:
        return torch.zeros((0, 2), dtype=torch.int64)
    device = tensors[0].device
    for t in tensors:
        if t.device != device:
            raise UsageError(f"lanes_many needs tensors on one device, got {t.device} and {device}")
    with device_scope(device):
        for t in tensors:
            check_fingerprintable(t)
        # A sparse tensor (a sparse gradient of nn.Embedding(sparse=True)) stands for its dense values.
        tensors = [t if t.layout == torch.strided else t.detach().to_dense() for t in tensors]
        if device.type == "cuda":
            # A few Triton launches per width instead of ~50 eager ones per block (None: not applicable).
            from ckptverify.fingerprint import triton_kernel as _fingerprint_triton

            got = _fingerprint_triton.lanes_many(list(tensors))
            if got is not None:
                return got
        return lanes_many_eager(tensors)
