"""NaN/Inf counts taken on the fingerprint's own read of a chunk, and the save's fingerprint threads.

The compiled CPU kernel counts the elements whose bits are a NaN or an infinity (``kernels.SPECIAL_BITS``) while
it reads them for the lane sums; the hashing writer takes that count instead of a pass of its own over every
chunk, and only a chunk with such elements pays for telling NaNs from infinities. Counts, fingerprints and the
manifest must be exactly those of the former way.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from test_fingerprint import backend

import ckptverify.checkpoint.save as cs
import ckptverify.dcp.writer as writer_mod
from ckptverify import fingerprint as fp
from ckptverify.errors import UsageError
from ckptverify.fingerprint import kernels as kern
from ckptverify.fingerprint.logical import chunk_fingerprint_counted
from ckptverify.ownfiles.manifest import read_manifest

FLOAT8 = [d for name in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz")
          if isinstance(d := getattr(torch, name, None), torch.dtype)]
SCREENED = [torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.complex64, *FLOAT8]


@pytest.fixture(scope="module")
def compiled() -> None:
    """The compiled kernel, checked for 32-bit (8- and 16-bit bits are staged as int32) and 64-bit bits."""
    if not (kern.prepare_compiled(torch.float32) and kern.prepare_compiled(torch.float64)):
        pytest.skip("torch.compile does not work here (no C++ compiler?)")


def planted(dtype: torch.dtype, n: int, seed: int, specials: bool = True) -> torch.Tensor:
    """``n`` random values of ``dtype``; with ``specials``, NaNs, +Inf and -Inf (where the dtype has them) at
    spots in the full blocks and in the last, partial one."""
    gen = torch.Generator().manual_seed(seed)
    t = torch.randn(n, generator=gen)
    if specials:
        t[[3, n // 2, n - 2]] = float("nan")
        t[[11, n - 5]] = float("inf")
        t[[n // 3]] = -float("inf")
    if dtype.is_complex:
        return torch.complex(t, t.flip(0)).to(dtype)
    return t.to(dtype)


def reference_specials(t: torch.Tensor) -> int:
    """NaNs and infinities by torch's own tests (a complex element counts twice: its two parts)."""
    r = torch.view_as_real(t) if t.is_complex() else t
    r = r.float() if r.element_size() < 4 else r
    return int(r.isnan().sum() + r.isinf().sum())


@pytest.mark.parametrize("dtype", SCREENED, ids=str)
@pytest.mark.parametrize("specials", [True, False], ids=["specials", "finite"])
def test_the_compiled_kernel_counts_nan_and_inf_on_its_read(compiled: None, dtype: torch.dtype,
                                                            specials: bool) -> None:
    """Per dtype: the count equals torch's NaN + Inf count (in the full blocks and in the end the host path
    takes), and the fingerprint is the one :func:`chunk_fingerprint` gives on the host path."""
    t = planted(dtype, 2 * kern.COMPILED_BLOCK + 333, 1, specials)
    with backend("numpy"):
        want = fp.chunk_fingerprint(t, (0,), t.shape)
    for name, stage in (("compiled", "numpy"), ("auto", "numpy"), ("compiled", "torch")):
        with backend(name), staged_by(stage):
            got, count = chunk_fingerprint_counted(t, (0,), t.shape)
        assert got == want, (name, stage)
        assert count == reference_specials(t), (name, stage)
        assert (count == 0) is (not specials)


@contextlib.contextmanager
def staged_by(how: str) -> Iterator[None]:
    """Blocks copied into the compiled kernel's staging buffer by numpy (sign-extending 8- and 16-bit bits to
    int32 as torch does) or by torch."""
    saved = kern.STAGE_COPY
    kern.STAGE_COPY = how
    try:
        yield
    finally:
        kern.STAGE_COPY = saved


def test_a_non_contiguous_chunk_is_counted_by_its_slabs(compiled: None) -> None:
    """A chunk larger than ``SLAB`` that is not contiguous goes through in pieces: their counts add up."""
    t = planted(torch.float32, 5 * (kern.COMPILED_BLOCK + 100), 2).view(5, -1)
    t[4, -1] = float("nan")
    part = t[:, 60:]
    assert not part.is_contiguous() and part.numel() > kern.SLAB
    with backend("numpy"):
        want = fp.chunk_fingerprint(part, (0, 60), t.shape)
    with backend("auto"):
        got, count = chunk_fingerprint_counted(part, (0, 60), t.shape)
    assert got == want
    assert count == reference_specials(part)


def test_no_count_where_the_pass_did_not_count(compiled: None) -> None:
    """``None`` (the caller counts) for the host path, a chunk too small for the kernel, dtypes without a
    screen; the fingerprint is still :func:`chunk_fingerprint`'s."""
    big = planted(torch.float32, kern.COMPILED_BLOCK + 5, 3)
    small = planted(torch.float32, 1000, 4, specials=False)
    ints = torch.arange(kern.COMPILED_BLOCK + 5, dtype=torch.int32)
    cases = [("numpy", big), ("auto", small), ("compiled", ints)]
    e8m0 = getattr(torch, "float8_e8m0fnu", None)
    if isinstance(e8m0, torch.dtype):
        cases.append(("compiled", torch.ones(kern.COMPILED_BLOCK + 5).to(e8m0)))
    for name, t in cases:
        with backend(name):
            got, count = chunk_fingerprint_counted(t, (0,), t.shape)
            assert got == fp.chunk_fingerprint(t, (0,), t.shape), (name, t.dtype)
        assert count is None, (name, t.dtype)


def test_thread_limit_caps_the_host_threads_and_restores() -> None:
    """:func:`kernels.thread_limit` caps the threads of the calling thread's fingerprints, nests, restores,
    and refuses what is not a positive int."""
    n = 64 * kern.HOST_MIN_PER_THREAD
    free = kern._host_threads(n)
    with kern.thread_limit(1):
        assert kern._host_threads(n) == 1
        with kern.thread_limit(None):
            assert kern._host_threads(n) == free
        assert kern._host_threads(n) == 1
    assert kern._host_threads(n) == free
    for bad in (0, -1, 1.5, True, "2"):
        with pytest.raises(UsageError), kern.thread_limit(bad):  # type: ignore[arg-type]
            pass


# ---------------------------------------------------------------------------------------------- the writer


def big_state() -> dict[str, Any]:
    n = kern.COMPILED_BLOCK + 333
    state: dict[str, Any] = {f"{d}".removeprefix("torch."): planted(d, n + i, 10 + i)
                             for i, d in enumerate(SCREENED)}
    state["finite32"] = planted(torch.float32, n, 30, specials=False)
    state["finite_bf16"] = planted(torch.bfloat16, n, 31, specials=False)
    state["small"] = planted(torch.float32, 2000, 32, specials=False)
    state["ints"] = torch.arange(n, dtype=torch.int64)
    return state


def manifest_body(path: str) -> dict[str, Any]:
    """The manifest as written, but for when it was written and DCP's ``.metadata`` digest (DCP's own file
    names the checkpoint's path), and the manifest's digest over those."""
    m = read_manifest(path)
    assert m is not None
    body = dataclasses.replace(m, created="", metadata_files={}).to_dict()
    del body["self_digest"]
    return json.loads(json.dumps(body, sort_keys=True))


def test_save_takes_the_counts_from_the_fingerprint_pass(compiled: None, tmp_path: Any,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """A save with the compiled kernel counts a chunk's NaNs and Infs element-wise only when the kernel found
    some; the manifest has the counts torch gives, and is the same as one written on the host path with the
    fingerprints split over torch's threads (the former way)."""
    state = big_state()
    counted: list[torch.dtype] = []
    real = writer_mod._nonfinite_counts

    def spy(t: torch.Tensor) -> tuple[int | None, int | None]:
        counted.append(t.dtype)
        return real(t)

    monkeypatch.setattr(writer_mod, "_nonfinite_counts", spy)
    with backend("auto"):
        cs.save(state, os.fspath(tmp_path / "a"), fingerprint=True, sync_files=False)
    # Screened chunks with specials, and those nothing counted (small, int: no count, which gives None).
    assert sorted(map(str, counted)) == sorted(map(str, [*SCREENED, torch.float32, torch.int64]))

    m = read_manifest(os.fspath(tmp_path / "a"))
    assert m is not None
    for fqn, t in state.items():
        entry = m.tensors[fqn]
        assert entry.fingerprint == fp.tensor_fingerprint(t).value, fqn
        assert (entry.nan_count, entry.inf_count) == real(t), fqn
        if t.dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.float8_e5m2):
            assert (entry.nan_count, entry.inf_count) == (int(t.float().isnan().sum()), int(t.float().isinf().sum()))

    monkeypatch.setattr(writer_mod, "_nonfinite_counts", real)
    monkeypatch.setattr(writer_mod, "FINGERPRINT_THREADS", None)
    with backend("numpy"):
        cs.save(state, os.fspath(tmp_path / "b"), fingerprint=True, sync_files=False)
    assert manifest_body(os.fspath(tmp_path / "a")) == manifest_body(os.fspath(tmp_path / "b"))


@pytest.mark.parametrize("limit", [1, None])
def test_save_fingerprints_on_the_threads_it_is_given(tmp_path: Any, monkeypatch: pytest.MonkeyPatch,
                                                     request: pytest.FixtureRequest, limit: int | None) -> None:
    """``FINGERPRINT_THREADS = 1``: a save's fingerprints never split a chunk over threads; ``None``: over
    torch's intra-op threads, as outside a save."""
    if limit is None:
        if (os.cpu_count() or 1) < 2:
            pytest.skip("one core only here")
        # The suite runs torch with one thread per worker (conftest.py): give this test the two it is about.
        threads = torch.get_num_threads()
        torch.set_num_threads(2)
        request.addfinalizer(lambda: torch.set_num_threads(threads))
    workers: list[int] = []
    real = kern._host_map

    def spy(fn: Any, ranges: Any, n: int) -> Any:
        workers.append(n)
        return real(fn, ranges, n)

    monkeypatch.setattr(kern, "_host_map", spy)
    monkeypatch.setattr(writer_mod, "FINGERPRINT_THREADS", limit)
    state = {"w": planted(torch.float32, 4 * kern.HOST_MIN_PER_THREAD, 5, specials=False)}
    with backend("numpy"):
        cs.save(state, os.fspath(tmp_path / "c"), fingerprint=True, sync_files=False)
    assert workers
    assert max(workers) == 1 if limit == 1 else max(workers) >= 2


@pytest.mark.parametrize(("threshold_mib", "name", "want"), [
    (5, "auto", [(torch.int32, False)]),  # the save fingerprints 6 MiB of large 32- and 16-bit chunks
    (64, "auto", []),  # less than the threshold: as before, nothing until that much went through the host path
    (5, "numpy", []),  # another backend never compiles
])
def test_a_large_save_starts_compiling_the_kernel_at_once(tmp_path: Any, monkeypatch: pytest.MonkeyPatch,
                                                          threshold_mib: int, name: str, want: list[Any]) -> None:
    """A save that alone fingerprints at least ``AUTO_COMPILE_AFTER_BYTES`` of large CPU chunks starts the
    kernel's background compilation at its first such chunk (once), rather than after that much has gone
    through the host path; the fingerprints are the host path's meanwhile."""
    calls: list[tuple[torch.dtype, bool]] = []

    def spy(bits_dtype: torch.dtype, wait: bool = True) -> None:
        calls.append((bits_dtype, wait))
        return None  # not ready: the host path goes on

    monkeypatch.setattr(kern, "_compiled_kernel", spy)
    monkeypatch.setattr(kern, "_verified", {})
    monkeypatch.setattr(kern, "_host_bytes", 0)
    monkeypatch.setattr(kern, "AUTO_COMPILE_AFTER_BYTES", threshold_mib << 20)
    state = {"a": planted(torch.float32, kern.COMPILED_BLOCK + 100, 40, specials=False),
             "b": planted(torch.bfloat16, kern.COMPILED_BLOCK + 50, 41, specials=False),
             "small": planted(torch.float32, 1000, 42, specials=False)}
    with backend(name):
        cs.save(state, os.fspath(tmp_path / "d"), fingerprint=True, sync_files=False)
    assert calls == want
    m = read_manifest(os.fspath(tmp_path / "d"))
    assert m is not None
    with backend("numpy"):
        assert all(m.tensors[k].fingerprint == fp.tensor_fingerprint(t).value for k, t in state.items())


def test_kernel_widths_of_the_plan() -> None:
    """Which compilation of the CPU kernel each dtype takes (the one a save starts compiling for)."""
    for dtype in (torch.float32, torch.bfloat16, torch.float8_e4m3fn, torch.complex64):
        assert kern.cpu_kernel_dtype(dtype) == torch.int32, dtype
    for dtype in (torch.float64, torch.complex128, torch.int64):
        assert kern.cpu_kernel_dtype(dtype) == torch.int64, dtype


@pytest.mark.parametrize(("name", "expected"), [
    ("float8_e4m3fn", (1, 0)), ("float8_e4m3fnuz", (3, 0)), ("float8_e5m2fnuz", (3, 0)), ("float8_e8m0fnu", (3, 0)),
    ("float8_e5m2", (1, 2)),
])
def test_float8_counts_are_the_nans_and_infinities_the_format_holds(name: str, expected: tuple[int, int]) -> None:
    """A format with no infinity holds an Inf as a NaN (or, e4m3fn, saturates it to its largest value): its
    counts are the NaNs it holds and no Inf, never a negative count and never none at all; e5m2 keeps its
    infinities."""
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        pytest.skip(f"this torch has no {name}")
    t = torch.tensor([1.0, float("nan"), float("inf"), -float("inf"), 2.0]).to(dtype)
    assert int(torch.isnan(t).sum()) == expected[0]  # what the format holds, as torch converts to it
    assert writer_mod._nonfinite_counts(t) == expected
    assert writer_mod._nonfinite_counts(torch.tensor([1.0, 2.0]).to(dtype)) == (0, 0)
