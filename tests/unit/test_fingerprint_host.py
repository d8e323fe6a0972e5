"""The host (numpy) path of the logical tensor fingerprint and the way backend ``auto`` picks the CPU kernels.

The host path must give the eager path's integers bit for bit, for every dtype, chunk geometry (long runs cut
into blocks, short runs packed several to a block), thread split, non-contiguous input and special value;
``auto`` must keep giving them while the compiled kernel compiles in the background and after it is used.
"""

from __future__ import annotations

import contextlib
import math
import threading
from collections.abc import Iterator

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_fingerprint import ALL_DTYPES, backend, chunkings, eager_fingerprint, make_tensor, ref_fingerprint

from ckptverify import fingerprint as fp
from ckptverify.fingerprint import eager as ref
from ckptverify.fingerprint import kernels as kern
from ckptverify.fingerprint import spec


@contextlib.contextmanager
def host_geometry(block: int, min_per_thread: int = 1) -> Iterator[None]:
    """Shrink the host path's blocks (and the share a thread needs) so small tensors cross block and
    thread boundaries."""
    saved = (kern.HOST_BLOCK, kern.HOST_MIN_PER_THREAD, kern.SMALL_NUMPY)
    kern.HOST_BLOCK, kern.HOST_MIN_PER_THREAD, kern.SMALL_NUMPY = block, min_per_thread, 0
    try:
        yield
    finally:
        kern.HOST_BLOCK, kern.HOST_MIN_PER_THREAD, kern.SMALL_NUMPY = saved


def both(part: torch.Tensor, offsets: tuple[int, ...], shape: tuple[int, ...]) -> tuple[object, object]:
    with backend("numpy"):
        host = fp.chunk_fingerprint(part, offsets, shape)
    return host, eager_fingerprint(part, offsets, shape)


shapes = st.lists(st.integers(0, 7), min_size=0, max_size=4).map(tuple)


@settings(max_examples=80, deadline=None)
@given(dtype=st.sampled_from(ALL_DTYPES), shape=shapes, seed=st.integers(0, 2**32),
       block=st.sampled_from([1, 3, 8, 16, 1 << 14]), data=st.data())
def test_host_path_equals_eager_for_any_chunking(dtype: torch.dtype, shape: tuple[int, ...], seed: int, block: int,
                                                 data: st.DataObject) -> None:
    t = make_tensor(dtype, shape, seed)
    parts = []
    with host_geometry(block):
        for slices, offsets in data.draw(chunkings(shape)):
            part = t[slices] if shape else t
            host, eager = both(part, offsets if shape else (), shape)
            assert host == eager, (slices, offsets)
            parts.append(host)
        with backend("numpy"):
            whole = fp.tensor_fingerprint(t)
    assert whole.value == ref_fingerprint(t)
    assert fp.combine(parts) == whole


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 40), cols=st.integers(1, 40), block=st.integers(1, 64), threads=st.integers(1, 5),
       seed=st.integers(0, 2**32), data=st.data())
def test_any_thread_split_gives_the_same_lanes(rows: int, cols: int, block: int, threads: int, seed: int,
                                               data: st.DataObject) -> None:
    """Threads take contiguous ranges of blocks; their partial sums add up to one thread's, in long-run and
    short-run geometries."""
    t = make_tensor(torch.bfloat16, (rows, cols), seed)
    c = data.draw(st.integers(0, cols - 1))
    part = t[:, c:]
    flat = part.contiguous().reshape(-1).view(torch.int16)
    geometry = ref.chunk_geometry(part.shape, (0, c), t.shape)
    seeds = (spec.dtype_seed("bfloat16", 0), spec.dtype_seed("bfloat16", 1))
    with host_geometry(block):
        one = kern.host_lanes(flat, geometry, seeds, threads=1)
        many = kern.host_lanes(flat, geometry, seeds, threads=threads)
    assert one == many
    assert fp.TensorFingerprint.from_lanes(one, "bfloat16", t.shape, part.numel()) == eager_fingerprint(
        part, (0, c), t.shape)


FLOATS = [torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.complex64, torch.complex128]


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
def test_special_values_and_non_contiguous_inputs(dtype: torch.dtype) -> None:
    """NaN (both signs), infinities, -0.0 and subnormals are bits like any other: the host path reads them as
    the eager path does, through transposed, strided and expanded views too."""
    real = torch.float32 if dtype == torch.complex64 else torch.float64 if dtype == torch.complex128 else dtype
    tiny = torch.finfo(real).tiny / 4
    specials = torch.tensor([math.nan, -math.nan, math.inf, -math.inf, -0.0, 0.0, tiny, -tiny, 1.0, -1.0],
                            dtype=torch.float64).to(real)
    base = specials.repeat(7)[:64].reshape(8, 8)
    if dtype.is_complex:
        base = torch.complex(base, base.flip(0))
    views = {
        "contiguous": base,
        "transposed": base.t(),
        "strided": base[::2, 1::3],
        "expanded": base[:1].expand(5, 8),
        "requires-grad": base.clone().requires_grad_(True) if not dtype.is_complex else base,
    }
    for label, v in views.items():
        with host_geometry(3):
            host, eager = both(v, (0,) * v.dim(), tuple(v.shape))
        assert host == eager, label
        assert host.value == ref_fingerprint(v.detach()), label
    # -0.0 and 0.0 are equal values with different bits: different fingerprints.
    zeros = torch.zeros(4, dtype=dtype)
    negative = zeros.clone()
    negative[2] = -0.0 if not dtype.is_complex else complex(-0.0, 0.0)
    with backend("numpy"):
        assert fp.tensor_fingerprint(zeros) != fp.tensor_fingerprint(negative)


@settings(max_examples=40, deadline=None)
@given(dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.complex64, torch.int8]),
       shape=st.lists(st.integers(1, 6), min_size=2, max_size=4).map(tuple), slab=st.integers(1, 12),
       seed=st.integers(0, 2**32), data=st.data())
def test_non_contiguous_chunks_are_fingerprinted_in_bounded_pieces(
    dtype: torch.dtype, shape: tuple[int, ...], slab: int, seed: int, data: st.DataObject
) -> None:
    """A non-contiguous chunk larger than ``SLAB`` elements is never copied whole: it is cut into disjoint
    pieces of at most ``SLAB`` elements whose lanes add up to the eager path's."""
    t = make_tensor(dtype, shape, seed)
    perm = data.draw(st.permutations(range(len(shape))))
    view = t.permute(*perm)[..., :: data.draw(st.integers(1, 2))]
    offsets = (0,) * view.dim()
    seen = []
    real = kern.host_lanes

    def spy(flat: torch.Tensor, *args: object, **kw: object) -> tuple[int, int]:
        # (elements, whether it is the chunk's own memory rather than a copy)
        seen.append((flat.numel(), flat.untyped_storage().data_ptr() == t.untyped_storage().data_ptr()))
        return real(flat, *args, **kw)

    saved = kern.SLAB
    kern.SLAB, kern.host_lanes = slab, spy
    try:
        with host_geometry(4):
            host, eager = both(view, offsets, tuple(view.shape))
    finally:
        kern.SLAB, kern.host_lanes = saved, real
    assert host == eager
    assert host.value == ref_fingerprint(view)
    assert seen
    assert all(n <= slab or own for n, own in seen), (seen, slab)  # no copy larger than a slab


def test_large_chunk_on_default_blocks_and_threads() -> None:
    """A chunk large enough for several threads with the shipped block size, whole and split by columns."""
    t = make_tensor(torch.float32, (1 << 10, 1 << 11 | 5), 7)
    want = eager_fingerprint(t)
    with backend("numpy"):
        got = fp.tensor_fingerprint(t)
        parts = [fp.chunk_fingerprint(t[:, :1000], (0, 0), t.shape),
                 fp.chunk_fingerprint(t[:, 1000:], (0, 1000), t.shape)]
    assert got == want
    assert fp.combine(parts) == want
    assert t.numel() >= 2 * kern.HOST_MIN_PER_THREAD  # two threads where torch has two


@contextlib.contextmanager
def fresh_compile_state(key: torch.dtype) -> Iterator[None]:
    """Forget whether the compiled kernel was checked for bits dtype ``key`` (restored after)."""
    saved = (kern._verified.pop(key, None), key in kern._compiling, kern._host_bytes,
             kern.AUTO_COMPILE_AFTER_BYTES, kern._compiled_fn)
    kern._compiling.discard(key)
    try:
        yield
    finally:
        verified, compiling, kern._host_bytes, kern.AUTO_COMPILE_AFTER_BYTES, kern._compiled_fn = saved
        kern._verified.pop(key, None)
        if verified is not None:
            kern._verified[key] = verified
        (kern._compiling.add if compiling else kern._compiling.discard)(key)


def _compile_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "ckptverify-fingerprint-compile"]


def test_auto_answers_while_compiling_and_never_uses_a_kernel_that_failed_its_check(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``auto`` answers from the host path while the compiled kernel is being checked (it does not wait for
    it), and a kernel that disagrees with the eager path is never used."""
    key = torch.int32
    calls = []
    release = threading.Event()

    def failing_check(fn: object, dtype: torch.dtype) -> bool:
        calls.append(dtype)
        release.wait(timeout=300)  # the compilation is still going on until the test says otherwise
        return False

    monkeypatch.setattr(kern, "_self_check", failing_check)
    t = make_tensor(torch.float32, (3 * kern.COMPILED_BLOCK + 17,), 3)
    want = eager_fingerprint(t)
    with fresh_compile_state(key), backend("auto"):
        kern.AUTO_COMPILE_AFTER_BYTES = 0
        got = []
        caller = threading.Thread(target=lambda: got.append(fp.tensor_fingerprint(t)))
        caller.start()
        caller.join(timeout=120)
        answered = not caller.is_alive()
        release.set()
        caller.join()
        for thread in _compile_threads():
            thread.join(timeout=300)
        assert answered, "auto waited for the compilation"
        assert got == [want]
        assert kern._verified[key] is False and calls == [torch.int32]
        kern._compiled_fn = lambda *a: pytest.fail("a kernel that failed its check ran")  # restored on exit
        assert fp.tensor_fingerprint(t) == want
        assert calls == [torch.int32], "the check ran again"


@pytest.mark.slow
def test_auto_compiles_in_the_background_then_uses_the_kernel() -> None:
    """Past ``AUTO_COMPILE_AFTER_BYTES``, ``auto`` answers from the host path while the kernel compiles in a
    background thread, then takes the kernel for full blocks (bfloat16 staged as int32) and the host path for
    the rest of each run: the same values throughout."""
    key = torch.int32
    t = make_tensor(torch.bfloat16, (4, kern.COMPILED_BLOCK + 333), 11)
    part = t[1:, 5:]
    want_whole = eager_fingerprint(t)
    want_part = eager_fingerprint(part, (1, 5), t.shape)
    with fresh_compile_state(key), backend("auto"):
        kern.AUTO_COMPILE_AFTER_BYTES = 0
        assert fp.tensor_fingerprint(t) == want_whole  # starts the compilation, does not wait for it
        threads = _compile_threads()
        assert threads or kern._verified.get(key), "no compilation was started"
        for thread in threads:
            thread.join(timeout=600)
        if kern._compile_failed:
            pytest.skip("torch.compile does not work here (no C++ compiler?)")
        assert kern._verified.get(key) is True
        real = kern._compiled_fn
        used = []

        def counting(*args: torch.Tensor) -> torch.Tensor:
            used.append(args[0].dtype)
            return real(*args)

        kern._compiled_fn = counting
        assert fp.tensor_fingerprint(t) == want_whole
        assert fp.chunk_fingerprint(part, (1, 5), t.shape) == want_part
    assert used and set(used) == {torch.int32}


@pytest.mark.slow
def test_prepare_compiled_makes_auto_take_the_kernel_from_the_first_chunk() -> None:
    """After :func:`prepare_compiled`, ``auto`` takes the kernel at once, long before ``AUTO_COMPILE_AFTER_BYTES``
    went through the host path; without it, not."""
    key = torch.int32
    t = make_tensor(torch.float16, (2 * kern.COMPILED_BLOCK + 1,), 5)
    want = eager_fingerprint(t)
    with fresh_compile_state(key), backend("auto"):
        kern.AUTO_COMPILE_AFTER_BYTES = 1 << 60
        assert not kern._wants_compiled(torch.device("cpu"), t.numel(), torch.int32)
        if not kern.prepare_compiled(torch.float16):
            pytest.skip("torch.compile does not work here (no C++ compiler?)")
        assert kern._verified[key] is True
        assert kern._wants_compiled(torch.device("cpu"), t.numel(), torch.int32)
        real = kern._compiled_fn
        used = []
        kern._compiled_fn = lambda *args: used.append(1) or real(*args)
        assert fp.tensor_fingerprint(t) == want
        assert len(used) == 2  # the two full blocks; the last element through the host path


@pytest.mark.skipif(not hasattr(__import__("os"), "fork"), reason="needs fork")
def test_a_forked_child_fingerprints_with_fresh_threads_and_locks() -> None:
    """A child forked while the parent's host pool exists and a compilation holds the kernel lock fingerprints
    (through new threads, new locks) instead of waiting forever."""
    import multiprocessing

    t = make_tensor(torch.float32, (3 << 20,), 21)
    with backend("numpy"):
        want = fp.tensor_fingerprint(t)  # the parent's pool of host threads exists now
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    with kern._lock:  # as a compilation in the background would hold it
        child = ctx.Process(target=_child_fingerprint, args=(t, queue))
        child.start()
    child.join(timeout=120)
    alive = child.is_alive()
    if alive:
        child.kill()
    assert not alive, "the forked child hung"
    assert queue.get(timeout=10) == want.value


def _child_fingerprint(t: torch.Tensor, queue: object) -> None:
    with kern._lock:  # the parent held it at the fork
        pass
    kern.set_backend("numpy")
    queue.put(fp.tensor_fingerprint(t).value)  # type: ignore[attr-defined]  # through the host pool
