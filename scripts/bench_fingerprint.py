#!/usr/bin/env python
"""Throughput of the logical tensor fingerprint, against the copy bandwidth of the same tensor.

For float32 and bfloat16 tensors of ``--size-mib`` MiB (256 by default) on the CPU (and on CUDA when
available) this times each path of ``tensor_fingerprint``, and ``t.clone()`` as the ceiling a pass over the
tensor can reach. Paths: ``numpy`` (CPU backend ``numpy``: what ``auto`` uses until the compiled kernel is ready,
and where no C++ compiler is), ``compiled`` (CPU backend ``compiled``, the fused ``torch.compile`` kernel),
``triton`` (CUDA: the Triton kernel) and ``eager`` (eager torch on any device: what a device no fused kernel
serves takes). Each figure is the best of ``--repeats`` runs; each path is warmed up (compiled) first and a
one-off compile time is printed apart.

    python scripts/bench_fingerprint.py
    python scripts/bench_fingerprint.py --size-mib 64 --threads 1 --paths numpy,eager
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import time
from collections.abc import Callable

import torch

from ckptverify import fingerprint as fp
from ckptverify.fingerprint import eager, kernels

#: The paths a device has (the others do not apply to it).
PATHS = {"cpu": ("numpy", "compiled", "eager"), "cuda": ("triton", "eager")}


def _fingerprint(path: str, t: torch.Tensor) -> object:
    if path == "eager":
        return kernels.eager_fingerprint_lanes(t, [0] * t.dim(), list(t.shape), eager.dtype_name(t.dtype))
    if path in ("numpy", "compiled"):
        fp.set_fingerprint_backend(path)
    return fp.tensor_fingerprint(t).lanes


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _idle_fraction(interval: float = 0.5) -> float:
    """Share of CPU time spent idle over ``interval`` seconds (Linux ``/proc/stat``; 1.0 elsewhere)."""
    try:
        with open("/proc/stat") as f:
            a = [int(v) for v in f.readline().split()[1:8]]
        time.sleep(interval)
        with open("/proc/stat") as f:
            b = [int(v) for v in f.readline().split()[1:8]]
    except OSError:
        return 1.0
    delta = [y - x for x, y in zip(a, b, strict=True)]
    return (delta[3] + delta[4]) / max(1, sum(delta))


WAIT_IDLE = 0.0


def _wait_idle() -> None:
    """On a shared machine, wait (at most ``--wait-idle`` seconds) until the CPUs are idle."""
    deadline = time.monotonic() + WAIT_IDLE
    while time.monotonic() < deadline and _idle_fraction() < 0.9:
        pass


def _time(fn: Callable[[], object], device: torch.device, repeats: int) -> list[float]:
    times = []
    for _ in range(repeats):
        _wait_idle()
        _sync(device)
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - start)
    return times


def _load() -> str:
    try:
        return " ".join(open("/proc/loadavg").read().split()[:3])
    except OSError:
        return "n/a"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-mib", type=int, default=256, help="tensor size in MiB (default 256)")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per figure; the best counts")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    parser.add_argument("--paths", default="numpy,compiled,triton,eager",
                        help="comma-separated: numpy, compiled (CPU), triton (CUDA), eager (any device)")
    parser.add_argument("--dtypes", default="float32,bfloat16", help="comma-separated dtype names")
    parser.add_argument("--devices", default=None, help="comma-separated (default: cpu, and cuda if present)")
    parser.add_argument(
        "--wait-idle",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="before each timed run, wait up to this long for the CPUs to be idle (shared machines)",
    )
    args = parser.parse_args()
    global WAIT_IDLE
    WAIT_IDLE = args.wait_idle

    if args.threads:
        torch.set_num_threads(args.threads)
    devices = args.devices.split(",") if args.devices else ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    paths = [b for b in args.paths.split(",") if b]
    nbytes = args.size_mib << 20
    print(f"torch {torch.__version__}, {torch.get_num_threads()} CPU threads, {os.cpu_count()} CPUs")
    print(f"tensor size {args.size_mib} MiB, best of {args.repeats} runs; load average at start: {_load()}")
    print()
    header = f"{'device':<7} {'dtype':<9} {'what':<22} {'best GB/s':>10} {'median GB/s':>12} {'vs clone':>9}"
    print(header)
    print("-" * len(header))
    for device_name in devices:
        device = torch.device(device_name)
        for dtype_name in args.dtypes.split(","):
            dtype = getattr(torch, dtype_name)
            numel = nbytes // torch.tensor([], dtype=dtype).element_size()
            gen = torch.Generator(device="cpu").manual_seed(0)
            t = torch.randn(numel, generator=gen, dtype=torch.float32).to(dtype).to(device)
            clone = _time(t.clone, device, args.repeats)
            ceiling = nbytes / min(clone) / 1e9
            print(
                f"{device_name:<7} {dtype_name:<9} {'t.clone() (ceiling)':<22} {ceiling:>10.2f} "
                f"{nbytes / statistics.median(clone) / 1e9:>12.2f} {1.0:>9.2f}"
            )
            dst = torch.empty_like(t)
            copy = _time(functools.partial(dst.copy_, t), device, args.repeats)
            del dst
            print(
                f"{device_name:<7} {dtype_name:<9} {'copy_ (no allocation)':<22} {nbytes / min(copy) / 1e9:>10.2f} "
                f"{nbytes / statistics.median(copy) / 1e9:>12.2f} {min(clone) / min(copy):>9.2f}"
            )
            values = set()
            for path in paths:
                if path not in PATHS.get(device.type, ("eager",)):
                    continue
                start = time.perf_counter()
                values.add(_fingerprint(path, t))  # warm-up; compiles on first use of "compiled"
                _sync(device)
                first = time.perf_counter() - start
                times = _time(functools.partial(_fingerprint, path, t), device, args.repeats)
                best = nbytes / min(times) / 1e9
                label = f"fingerprint {path}"
                print(
                    f"{device_name:<7} {dtype_name:<9} {label:<22} {best:>10.2f} "
                    f"{nbytes / statistics.median(times) / 1e9:>12.2f} {best / ceiling:>9.2f}"
                )
                if path in ("compiled", "triton") and first > 2 * min(times):
                    print(f"{'':<17} (first call incl. compile and self-check: {first:.1f} s)")
            if len(values) != 1:
                raise SystemExit(f"paths disagree on {dtype_name}: {values}")
            del t
    print()
    print(f"load average at end: {_load()} (other work on the machine lowers every figure)")


if __name__ == "__main__":
    main()
