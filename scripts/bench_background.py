"""Benchmark: step time of the built-in training workload while a background verification runs, against the
same workload with no verification, in one run.

The tiny GPT of ``ckptverify.examples`` trains on ``--device``; a checkpoint of ``--mib`` MiB (the model and
optimizer plus padding tensors, saved once with ``ckptverify.save``) is verified again and again by the
:class:`~ckptverify.runs.background.BackgroundVerifier` that ``save(verify="background")`` uses. Each round
has two phases in alternating order: *on* (one verification is submitted; steps run until it is stamped) and
*off* (as many steps, nothing verifying). Prints the mean and median step time of each phase and their
ratio on/off (the target: at most 1.03), the p90 ratio, and how many steps each verification overlapped.

    python scripts/bench_background.py                          # CPU, 2 GiB checkpoint, 6 rounds
    python scripts/bench_background.py --device cuda --mib 8192 # GPU training, CPU verification
    python scripts/bench_background.py --isolation thread        # verify in the worker thread, to compare
    python scripts/bench_background.py --priority normal        # at normal priority, to compare
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from typing import Any

import torch

import ckptverify as cv
from ckptverify.examples import TinyGPTConfig, build_training, make_loader, train_step
from ckptverify.runs.background import ISOLATIONS, PRIORITIES, BackgroundVerifier, VerifyOptions


def _batches(loader: Any) -> Any:
    while True:
        yield from loader


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--mib", type=int, default=2048, help="checkpoint size in MiB (padding added to the model)")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    ap.add_argument("--priority", default="idle", choices=PRIORITIES, help="the verification's CPU priority")
    ap.add_argument("--isolation", default="process", choices=ISOLATIONS,
                    help="verify in the verifier process (the default) or in the worker thread")
    ap.add_argument("--deep", action="store_true", help="deep verification (tensor fingerprints too)")
    ap.add_argument("--dir", default=None, help="where to write the checkpoint (default: a temporary directory)")
    ap.add_argument("--max-phase-seconds", type=float, default=60.0,
                    help="end an 'on' phase after this long even if its verification has not finished")
    args = ap.parse_args(argv)

    warnings.filterwarnings("ignore", category=UserWarning)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    config = TinyGPTConfig(d_model=args.d_model, n_layers=args.layers, n_heads=4, seq_len=args.seq, dropout=0.0)
    training = build_training(config, total_steps=100_000, num_sequences=4096, device=device)
    batches = _batches(make_loader(training.dataset, args.batch, seed=0))
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def step() -> float:
        t0 = time.perf_counter()
        out = train_step(training, next(batches))
        float(out["loss"])  # the host waits for the step, as a loop that logs its loss does
        sync()
        return time.perf_counter() - t0

    base = tempfile.mkdtemp(prefix="bench-background-", dir=args.dir)
    path = os.path.join(base, "step_0")
    pad_numel = max(0, args.mib * (1 << 20) // 4 // 16)
    gen = torch.Generator().manual_seed(0)
    state: dict[str, Any] = {"model": training.model.state_dict(),
                             **{f"pad.{i}": torch.randn(pad_numel, generator=gen) for i in range(16)}}
    cv.save(state, path, fingerprint=args.deep)  # fingerprints only matter to a deep verification
    del state
    size = sum(os.path.getsize(os.path.join(path, n)) for n in os.listdir(path))
    verifier = BackgroundVerifier(priority=args.priority, isolation=args.isolation)
    options = VerifyOptions(mode="background", deep=args.deep)
    print(f"checkpoint {size / (1 << 30):.2f} GiB at {path}; device {device}; torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads; {os.cpu_count()} CPUs; load average "
          f"{os.getloadavg()[0]:.2f}; verification in the {args.isolation}, priority {args.priority}; deep {args.deep}",
          flush=True)
    try:
        for _ in range(10):  # warm-up: allocator, kernels, first optimizer step
            step()
        verifier.submit(path, step=0, options=options)  # warm-up: imports, page cache
        verifier.wait()
        child = verifier._child._proc
        tid = child.pid if args.isolation == "process" and child is not None else (
            verifier._thread.native_id if verifier._thread is not None else None)
        if tid is not None and hasattr(os, "sched_getscheduler"):
            policy = {getattr(os, n): n for n in ("SCHED_OTHER", "SCHED_IDLE", "SCHED_BATCH") if hasattr(os, n)}
            print(f"verifier {args.isolation}: policy {policy.get(os.sched_getscheduler(tid), '?')}, "
                  f"nice {os.getpriority(os.PRIO_PROCESS, tid)}", flush=True)
        on: list[float] = []
        off: list[float] = []
        overlapped: list[int] = []
        verify_s: list[float] = []
        n_prev = 0
        for rnd in range(args.rounds):
            order = ("on", "off") if rnd % 2 == 0 else ("off", "on")
            n = n_prev
            phase_times: dict[str, list[float]] = {}
            for phase in order:
                if phase == "on":
                    verifier.submit(path, step=0, options=options)
                    times = []
                    t0 = time.perf_counter()
                    while (verifier.pending() or len(times) < 3) and time.perf_counter() - t0 < args.max_phase_seconds:
                        times.append(step())
                    n = len(times)
                    if verifier.pending():
                        print(f"  (the verification outlasted the {args.max_phase_seconds} s phase)", flush=True)
                        verifier.wait()
                    last = verifier.last()
                    assert last is not None and last.passed, last
                    verify_s.append(last.seconds)
                    overlapped.append(n)
                else:
                    times = [step() for _ in range(max(n, 20))]
                phase_times[phase] = times
            on.extend(phase_times["on"])
            off.extend(phase_times["off"])
            n_prev = n
            print(f"  round {rnd}: verification {verify_s[-1]:6.2f} s over {overlapped[-1]:4d} steps; mean step "
                  f"on {statistics.fmean(phase_times['on']) * 1e3:7.2f} ms, "
                  f"off {statistics.fmean(phase_times['off']) * 1e3:7.2f} ms", flush=True)
    finally:
        verifier.close(timeout=60)
        shutil.rmtree(base, ignore_errors=True)

    mean_on, mean_off = statistics.fmean(on), statistics.fmean(off)
    med_on, med_off = statistics.median(on), statistics.median(off)
    print(f"\nsteps: {len(on)} with a verification running, {len(off)} without; "
          f"{statistics.fmean(overlapped):.0f} steps per verification; verification "
          f"{statistics.median(verify_s):.2f} s median ({size / statistics.median(verify_s) / 1e9:.2f} GB/s)")
    print(f"mean step   on {mean_on * 1e3:8.3f} ms   off {mean_off * 1e3:8.3f} ms   ratio {mean_on / mean_off:6.3f}")
    print(f"median step on {med_on * 1e3:8.3f} ms   off {med_off * 1e3:8.3f} ms   ratio {med_on / med_off:6.3f}")
    print(f"p90 step    on {_pct(on, 0.9) * 1e3:8.3f} ms   off {_pct(off, 0.9) * 1e3:8.3f} ms   "
          f"ratio {_pct(on, 0.9) / _pct(off, 0.9):6.3f}")
    print(f"RATIO (mean step time, verifying / not verifying; target <= 1.03): {mean_on / mean_off:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
