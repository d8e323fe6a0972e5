"""Benchmark: plain ``dcp.save`` against ``ckptverify.save`` (fingerprints on and off).

The same state dict (by default 16 float32 tensors of 64 MiB: 1 GiB) is saved by each variant in turn,
alternating the variants within every repeat so drifts in machine load hit them all alike, each time into a
fresh directory that is deleted right after. Prints every time, the best and median time of each variant and
its ratios to plain ``dcp.save``, and the CPU time each variant took (all threads of the process): what a
variant adds to ``dcp.save`` in CPU seconds is what it costs in wall seconds once no core is free to hide it
on. The load average is printed before and after the timed saves.

    python scripts/bench_save.py                                  # 1 GiB, 5 repeats, under $TMPDIR
    python scripts/bench_save.py --dir /dev/shm --no-sync --serial-hash   # no I/O to hide digests behind

``--interference`` adds two variants that are plain ``dcp.save`` again, with another process busy on one core
throughout: spinning (no memory traffic) and summing an array larger than the caches. They measure what any work
beside the write costs ``dcp.save`` on the machine: the floor under a save that digests and fingerprints on
another core, which no code of ours can go under there.

A save fingerprints each large contiguous CPU tensor beside its write (in the threads that digest each written
piece, the bytes still in the cache); ``--separate-pass`` adds a save that fingerprints every tensor in a pass
of its own over memory instead, to show what that saves.

``--serial-hash`` adds a variant whose digests are all computed in the writing thread, to show what the
concurrent digesting (a pool of threads hashing each large buffer while it is written) saves. ``--fp-threads``
adds a save whose fingerprints split over torch's threads (a save's own use one thread); ``--before`` one that
also counts NaN/Inf in a pass of its own over every chunk and stages the kernel's blocks with torch's
``copy_``, as saves did before: the before and after, in one run.
"""

from __future__ import annotations

import argparse
import gc
import os
import resource
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter

import ckptverify.checkpoint.save as cs
import ckptverify.dcp.writer as writer_mod


def make_state(n: int, mib: int, seed: int = 0) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(seed)
    numel = mib * (1 << 20) // 4
    return {f"layer{i}.weight": torch.randn(numel, generator=gen) for i in range(n)}


def variants(sync: bool, threads: int, serial: bool,
             fp_threads: bool = False, before: bool = False,
             separate_pass: bool = False) -> dict[str, Callable[[dict[str, Any], str], Any]]:
    """The variants by name; each saves ``state`` to ``path`` (returning its own time in seconds when it times
    itself)."""
    def plain(state: dict[str, Any], path: str) -> None:
        dcp.save(state, storage_writer=FileSystemWriter(path, sync_files=sync, thread_count=threads))

    def hashed(state: dict[str, Any], path: str) -> None:
        cs.save(state, path, fingerprint=False, sync_files=sync, thread_count=threads)

    def hashed_fp(state: dict[str, Any], path: str) -> None:
        cs.save(state, path, fingerprint=True, sync_files=sync, thread_count=threads)

    def hashed_serial(state: dict[str, Any], path: str) -> None:
        # Every digest computed in the writing thread, after each write (no hashing pool, no pieces).
        saved = writer_mod.PARALLEL_HASH_MIN_BYTES
        writer_mod.PARALLEL_HASH_MIN_BYTES = 1 << 62
        try:
            cs.save(state, path, fingerprint=False, sync_files=sync, thread_count=threads)
        finally:
            writer_mod.PARALLEL_HASH_MIN_BYTES = saved

    def hashed_fp_threads(state: dict[str, Any], path: str) -> None:
        # The fingerprints split over torch's intra-op threads rather than writer_mod.FINGERPRINT_THREADS.
        saved = writer_mod.FINGERPRINT_THREADS
        writer_mod.FINGERPRINT_THREADS = None
        try:
            cs.save(state, path, fingerprint=True, sync_files=sync, thread_count=threads)
        finally:
            writer_mod.FINGERPRINT_THREADS = saved

    def hashed_fp_pass(state: dict[str, Any], path: str) -> None:
        # Every fingerprint in a pass of its own over memory, in a thread beside the writes (none beside them).
        saved = writer_mod.HashingFileSystemWriter.__dict__["_fusable"]
        writer_mod.HashingFileSystemWriter._fusable = staticmethod(lambda plan, planner: {})
        try:
            cs.save(state, path, fingerprint=True, sync_files=sync, thread_count=threads)
        finally:
            writer_mod.HashingFileSystemWriter._fusable = saved

    def hashed_fp_before(state: dict[str, Any], path: str) -> None:
        # As saves fingerprinted before the NaN/Inf count rode on the kernel's pass: torch's threads, a pass
        # of its own over every chunk for the fingerprint and one for the counts, blocks staged by torch's copy_.
        from ckptverify.fingerprint import kernels

        saved = (writer_mod.FINGERPRINT_THREADS, writer_mod.chunk_fingerprint_counted, kernels.STAGE_COPY,
                 writer_mod.HashingFileSystemWriter.__dict__["_fusable"])
        counted = saved[1]
        writer_mod.FINGERPRINT_THREADS = None
        writer_mod.chunk_fingerprint_counted = lambda t, offsets, shape: (counted(t, offsets, shape)[0], None)
        kernels.STAGE_COPY = "torch"
        writer_mod.HashingFileSystemWriter._fusable = staticmethod(lambda plan, planner: {})
        try:
            cs.save(state, path, fingerprint=True, sync_files=sync, thread_count=threads)
        finally:
            (writer_mod.FINGERPRINT_THREADS, writer_mod.chunk_fingerprint_counted, kernels.STAGE_COPY,
             writer_mod.HashingFileSystemWriter._fusable) = saved

    out = {
        "dcp.save": plain,
        "ckptverify.save fingerprint=False": hashed,
        "ckptverify.save fingerprint=True": hashed_fp,
    }
    if serial:
        out["ckptverify.save fp=False serial hash"] = hashed_serial
    if fp_threads:
        out["ckptverify.save fp=True torch threads"] = hashed_fp_threads
    if separate_pass:
        out["ckptverify.save fp=True, a pass of its own"] = hashed_fp_pass
    if before:
        out["ckptverify.save fp=True as before"] = hashed_fp_before
    return out


#: What the other process does beside ``dcp.save`` in the ``--interference`` variants.
_BUSY = {
    "spinning": "while True:\n    pass\n",
    "streaming memory": "import numpy as np\na = np.ones(1 << 27, dtype=np.float32)\nwhile True:\n    a.sum()\n",
}


Save = Callable[[dict[str, Any], str], Any]


def interference_variants(plain: Save) -> dict[str, Save]:
    """Plain ``dcp.save`` with another process busy throughout (started before, killed after each save)."""
    import subprocess

    def busy(code: str) -> Callable[[dict[str, Any], str], Any]:
        def run(state: dict[str, Any], path: str) -> float:
            other = subprocess.Popen([sys.executable, "-c", code])
            try:
                time.sleep(0.3)  # started and busy (numpy imported, the array filled) before the save
                t0 = time.perf_counter()
                plain(state, path)
                return time.perf_counter() - t0
            finally:
                other.kill()
                other.wait()

        return run

    return {f"dcp.save, a process {what} beside": busy(code) for what, code in _BUSY.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tensors", type=int, default=16)
    ap.add_argument("--mib", type=int, default=64, help="MiB per tensor")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1, help="FileSystemWriter thread_count")
    ap.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    ap.add_argument("--no-sync", action="store_true", help="sync_files=False (no fsync)")
    ap.add_argument("--only", default=None, help="run only the variants whose name contains this")
    ap.add_argument("--serial-hash", action="store_true",
                    help="add a variant that digests in the writing thread (no concurrent hashing)")
    ap.add_argument("--fp-threads", action="store_true",
                    help="add a variant whose fingerprints split over torch's threads (not the save's default)")
    ap.add_argument("--before", action="store_true",
                    help="add a variant that fingerprints as saves did before: torch's threads, a separate "
                         "pass for the NaN/Inf counts, blocks staged by torch's copy_")
    ap.add_argument("--separate-pass", action="store_true",
                    help="add a variant that fingerprints every tensor in a pass of its own (none beside the writes)")
    ap.add_argument("--interference", action="store_true",
                    help="add dcp.save with another process spinning, and one streaming memory, on another core")
    ap.add_argument("--fingerprint-backend", default=None, choices=["auto", "numpy", "compiled"],
                    help="tensor fingerprint backend (default: the library's, 'auto')")
    args = ap.parse_args(argv)

    warnings.filterwarnings("ignore", category=UserWarning)
    from ckptverify.fingerprint import get_fingerprint_backend, set_fingerprint_backend, tensor_fingerprint

    if args.fingerprint_backend:
        set_fingerprint_backend(args.fingerprint_backend)
    state = make_state(args.tensors, args.mib)
    total = sum(t.numel() * t.element_size() for t in state.values())
    runs = variants(not args.no_sync, args.threads, args.serial_hash, args.fp_threads, args.before,
                    args.separate_pass)
    if args.interference:
        runs.update(interference_variants(runs["dcp.save"]))
    if args.only:
        runs = {k: v for k, v in runs.items() if args.only in k or k == "dcp.save"}
    base = tempfile.mkdtemp(prefix="bench-save-", dir=args.dir)
    print(f"state: {args.tensors} x {args.mib} MiB float32 = {total / (1 << 30):.2f} GiB; "
          f"sync_files={not args.no_sync}; thread_count={args.threads}; torch {torch.__version__}; "
          f"{os.cpu_count()} CPUs; torch threads {torch.get_num_threads()}; "
          f"fingerprint backend {get_fingerprint_backend()}; dir {base}")
    # Warm-up (imports, first use of the fingerprint kernels, their compilation if asked), not timed. Backend
    # "auto" would compile its fused CPU kernel in the background during the first timed saves: compile it
    # now, so every timed save sees the state a long-running job is in.
    if get_fingerprint_backend() in ("auto", "compiled"):
        from ckptverify.fingerprint import kernels

        t0 = time.perf_counter()
        ready = kernels.prepare_compiled(torch.float32)
        print(f"compiled fingerprint kernel: {'ready' if ready else 'unavailable (host path)'} "
              f"after {time.perf_counter() - t0:.1f} s")
    tensor_fingerprint(next(iter(state.values())))
    warm = make_state(2, 4)
    for name, fn in runs.items():
        path = os.path.join(base, "warm")
        fn(warm, path)
        shutil.rmtree(path)
        del name
    times: dict[str, list[float]] = {k: [] for k in runs}
    cpu: dict[str, list[float]] = {k: [] for k in runs}
    print(f"load average before: {_load()}")
    try:
        for rep in range(args.repeats):
            order = list(runs) if rep % 2 == 0 else list(reversed(runs))
            for name in order:
                path = os.path.join(base, f"ckpt-{rep}")
                gc.collect()
                c0 = _cpu()
                t0 = time.perf_counter()
                timed = runs[name](state, path)
                # A variant that times itself (the interference ones: not their other process's start) says so.
                dt = timed if isinstance(timed, float) else time.perf_counter() - t0
                dc = _cpu() - c0
                shutil.rmtree(path)
                times[name].append(dt)
                cpu[name].append(dc)
                print(f"  repeat {rep}: {name:48s} {dt:7.3f} s  ({total / dt / 1e9:5.2f} GB/s)  cpu {dc:6.3f} s",
                      flush=True)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    print(f"load average after: {_load()}")

    ref = min(times["dcp.save"])
    ref_med = statistics.median(times["dcp.save"])
    ref_cpu = statistics.median(cpu["dcp.save"])
    print(f"\n{'variant':48s}  best s   median s   ratio(best)  ratio(median)   cpu s (median)")
    for name, ts in times.items():
        best, med = min(ts), statistics.median(ts)
        c = statistics.median(cpu[name])
        print(f"{name:48s} {best:7.3f}   {med:7.3f}     {best / ref:6.3f}       {med / ref_med:6.3f}"
              f"        {c:6.3f} ({c - ref_cpu:+.3f})")
    on, off = times.get("ckptverify.save fingerprint=True"), times.get("ckptverify.save fingerprint=False")
    if on and off:
        # The fingerprint's own cost: the same save with and without it.
        print(f"\nfingerprint=True / fingerprint=False: {min(on) / min(off):.3f} (best), "
              f"{statistics.median(on) / statistics.median(off):.3f} (median)")
    for name in ("ckptverify.save fingerprint=False", "ckptverify.save fingerprint=True"):
        ts = times.get(name)
        if ts:
            # Where the machine is idle, the extra CPU time can run beside the write on the other cores: the
            # save cannot take less than its CPU time spread over every core, nor less than dcp.save.
            floor = max(ref, statistics.median(cpu[name]) / (os.cpu_count() or 1))
            print(f"{name.removeprefix('ckptverify.save ')} / dcp.save: {min(ts) / ref:.3f} (best), "
                  f"{statistics.median(ts) / ref_med:.3f} (median); CPU {statistics.median(cpu[name]):.3f} s "
                  f"against {ref_cpu:.3f} s, so at best {floor / ref:.3f} on {os.cpu_count()} idle cores")
    return 0


def _cpu() -> float:
    """CPU seconds of this process so far, every thread included."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _load() -> str:
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "unknown"


if __name__ == "__main__":
    sys.exit(main())
