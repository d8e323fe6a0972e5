"""Benchmark: step time of the built-in training workload while a background verification runs, against the
same workload with no verification, in one run.

The tiny GPT of ``ckptverify.examples`` trains on ``--device``; a checkpoint of ``--mib`` MiB (the model and
optimizer plus padding tensors, saved once with ``ckptverify.save``) is verified again and again by the
:class:`~ckptverify.verifier.background.BackgroundVerifier` that ``save(verify="background")`` uses. Each round,
for each training thread count (``--threads``: by default torch's, which uses every core, and one fewer,
which leaves a core free), runs three phases in an order that rotates from round to round: *off* (nothing
verifying), *unthrottled* (a verification at idle priority, reading at full speed; steps run until it is
stamped, and until ``--min-steps`` steps ran, verifying again as needed) and *throttled* (the same, pacing its
reads: the default, :mod:`ckptverify.verifier.throttle`). An *off* phase runs as many steps as a verifying phase
on average. Prints, per thread count, the mean, median and p90 step time of each phase and their ratios to
*off* (the target: at most 1.03), each round's median ratio, the training's CPU time per step, how long each
verification took, how much of it was spent throttled and how much of a core the verifier used. A
verification still running after ``--max-phase-seconds`` ends its phase (it then finishes unthrottled,
untimed: a job waiting for it does the same).

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
from ckptverify.options import VerifyOptions
from ckptverify.verifier.background import ISOLATIONS, PRIORITIES, AfterSave, BackgroundVerifier

#: The phases of a round: no verification, one at idle priority only, one that also paces its reads.
VARIANTS = ("off", "unthrottled", "throttled")


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
    ap.add_argument("--threads", default="default,free",
                    help="training thread counts to alternate, comma-separated: 'default' (torch's: every core), "
                         "'free' (one fewer: a core left free) or numbers")
    ap.add_argument("--variants", default=",".join(VARIANTS),
                    help="phases to alternate: 'off' (no verification), 'unthrottled', 'throttled'")
    ap.add_argument("--priority", default="idle", choices=PRIORITIES, help="the verification's CPU priority")
    ap.add_argument("--isolation", default="process", choices=ISOLATIONS,
                    help="verify in the verifier process (the default) or in the worker thread")
    ap.add_argument("--deep", action="store_true", help="deep verification (tensor fingerprints too)")
    ap.add_argument("--dir", default=None, help="where to write the checkpoint (default: a temporary directory)")
    ap.add_argument("--min-steps", type=int, default=20,
                    help="a phase with a verification runs at least this many steps (verifying again as needed)")
    ap.add_argument("--max-phase-seconds", type=float, default=30.0,
                    help="end an 'on' phase after this long even if its verification has not finished")
    args = ap.parse_args(argv)

    warnings.filterwarnings("ignore", category=UserWarning)
    device = torch.device(args.device)
    config = TinyGPTConfig(d_model=args.d_model, n_layers=args.layers, n_heads=4, seq_len=args.seq, dropout=0.0)
    training = build_training(config, total_steps=100_000, num_sequences=4096, device=device)
    batches = _batches(make_loader(training.dataset, args.batch, seed=0))
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    step_cpu: list[float] = []  # the training process's CPU seconds of each step, as step() appends them

    def step() -> float:
        t0, c0 = time.perf_counter(), time.process_time()
        out = train_step(training, next(batches))
        float(out["loss"])  # the host waits for the step, as a loop that logs its loss does
        sync()
        step_cpu.append(time.process_time() - c0)
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
    options = AfterSave(verify=VerifyOptions(when="background", deep=args.deep))
    threads = _thread_counts(args.threads, device)
    variants = [v for v in VARIANTS if v in args.variants.split(",")]
    print(f"checkpoint {size / (1 << 30):.2f} GiB at {path}; device {device}; torch {torch.__version__}, "
          f"training threads {threads}; {os.cpu_count()} CPUs; load average {_load()}; verification in the "
          f"{args.isolation}, priority {args.priority}; deep {args.deep}; phases {', '.join(variants)}", flush=True)
    times: dict[tuple[int, str], list[float]] = {(t, v): [] for t in threads for v in variants}
    verify_s: dict[tuple[int, str], list[float]] = {(t, v): [] for t in threads for v in variants}
    throttled_s: dict[tuple[int, str], list[float]] = {(t, v): [] for t in threads for v in variants}
    overlapped: dict[tuple[int, str], list[int]] = {(t, v): [] for t in threads for v in variants}
    cpu_s: dict[tuple[int, str], list[float]] = {(t, v): [] for t in threads for v in variants}
    medians: dict[tuple[int, str], list[float]] = {(t, v): [] for t in threads for v in variants}  # per round
    share: dict[tuple[int, str], list[float]] = {(t, v): [] for t in threads for v in variants}  # cores used
    cpu_steps: dict[tuple[int, str], list[float]] = {(t, v): [] for t in threads for v in variants}
    try:
        torch.set_num_threads(threads[0])
        for _ in range(10):  # warm-up: allocator, kernels, first optimizer step
            step()
        verifier.submit(path, step=0, options=options)  # warm-up: imports, page cache
        verifier.wait()
        _describe_verifier(verifier, args.isolation)
        for rnd in range(args.rounds):
            for t in (threads if rnd % 2 == 0 else threads[::-1]):
                torch.set_num_threads(t)
                for _ in range(3):
                    step()
                order = variants[rnd % len(variants):] + variants[: rnd % len(variants)]
                n_on = [n for (tt, v), ns in overlapped.items() if tt == t and v != "off" for n in ns]
                line = []
                for variant in order:
                    if variant == "off":
                        # as many steps as a verification overlaps on average (at least 20)
                        phase = [step() for _ in range(max(20, round(statistics.fmean(n_on)) if n_on else 0))]
                    else:
                        verifier.throttle = variant == "throttled"
                        cpu0 = _child_cpu(verifier)
                        verifier.submit(path, step=0, options=options)
                        phase, done = [], 0
                        t0 = time.perf_counter()
                        while time.perf_counter() - t0 < args.max_phase_seconds:
                            if not verifier.pending():  # one verification finished
                                done += 1
                                _record(verifier, verify_s[(t, variant)], throttled_s[(t, variant)])
                                if len(phase) >= args.min_steps:
                                    break
                                verifier.submit(path, step=0, options=options)  # too few steps yet: another
                            phase.append(step())
                        cut = bool(verifier.pending())
                        cpu_s[(t, variant)].append(_child_cpu(verifier) - cpu0)
                        if cut:
                            verifier.wait()  # a verification cut short reads on unthrottled: not timed
                            _record(verifier, verify_s[(t, variant)], throttled_s[(t, variant)])
                        overlapped[(t, variant)].append(len(phase))
                        line.append(f"{variant}: {done} verification(s) done")
                        if cut:
                            line.append(f"{variant} cut at {args.max_phase_seconds:.0f} s")
                    times[(t, variant)].extend(phase)
                    cpu_steps[(t, variant)].extend(step_cpu[-len(phase):])
                    medians[(t, variant)].append(statistics.median(phase))
                    if variant != "off":
                        share[(t, variant)].append(cpu_s[(t, variant)][-1] / sum(phase))
                    line.append(f"{variant} {statistics.median(phase) * 1e3:7.2f} ms x{len(phase)}")
                print(f"  round {rnd} ({t} threads): " + "; ".join(line) + f"; load {_load()}", flush=True)
    finally:
        verifier.close(timeout=60)
        shutil.rmtree(base, ignore_errors=True)

    print(f"\nload average at the end {_load()}")
    ratios: list[float] = []
    for t in threads:
        off = times.get((t, "off")) or []
        print(f"\ntraining with {t} thread(s) on {os.cpu_count()} CPUs:")
        for variant in variants:
            got = times[(t, variant)]
            if not got:
                continue
            extra = ""
            if variant != "off" and verify_s[(t, variant)]:
                extra = (f"; verification {statistics.median(verify_s[(t, variant)]):.2f} s median, "
                         f"throttled {statistics.median(throttled_s[(t, variant)]):.2f} s; the verifier used "
                         f"{statistics.fmean(share[(t, variant)]):.3f} of a core during the phase; "
                         f"{statistics.fmean(overlapped[(t, variant)]):.0f} steps per phase")
            ratio = ""
            if off and variant != "off":
                r = statistics.fmean(got) / statistics.fmean(off)
                ratios.append(r)
                ratio = (f"   mean ratio {r:6.3f}   median ratio {statistics.median(got) / statistics.median(off):6.3f}"
                         f"   p90 ratio {_pct(got, 0.9) / _pct(off, 0.9):6.3f}")
            print(f"  {variant:12s} mean {statistics.fmean(got) * 1e3:8.2f} ms  median "
                  f"{statistics.median(got) * 1e3:8.2f} ms  ({len(got)} steps){ratio}{extra}")
            cpu, cpu_off = cpu_steps[(t, variant)], cpu_steps.get((t, "off")) or []
            if cpu and cpu_off and variant != "off":
                # CPU time per step: what the verifier costs the training threads (caches, memory bandwidth,
                # waiting for a slowest thread that spins), without the time other jobs take the CPU away.
                print(f"  {'':12s} training CPU per step {statistics.median(cpu) * 1e3:8.2f} ms, without a "
                      f"verification {statistics.median(cpu_off) * 1e3:8.2f} ms: median ratio "
                      f"{statistics.median(cpu) / statistics.median(cpu_off):6.3f}")
        for variant in variants:
            if variant != "off" and off and times[(t, variant)]:
                # Each round's median step against the same round's 'off' median: the load of other jobs
                # moves between rounds, much less within one.
                paired = [m / o for m, o in zip(medians[(t, variant)], medians[(t, "off")], strict=True)]
                print(f"RATIO {t} threads, {variant} (mean step time, verifying / not verifying; target <= 1.03): "
                      f"{statistics.fmean(times[(t, variant)]) / statistics.fmean(off):.3f}; per-round median "
                      f"ratios {' '.join(f'{r:.3f}' for r in paired)}, their median {statistics.median(paired):.3f}")
    return 0


def _thread_counts(raw: str, device: torch.device) -> list[int]:
    """``default`` (torch's own count), ``free`` (one fewer: a core left free) or numbers, comma-separated."""
    default = torch.get_num_threads()
    out: list[int] = []
    for part in raw.split(","):
        part = part.strip()
        n = default if part == "default" else max(1, default - 1) if part == "free" else int(part)
        if n not in out:
            out.append(n)
    return out


def _record(verifier: BackgroundVerifier, seconds: list[float], throttled: list[float]) -> None:
    last = verifier.last()
    if last is None or not last.passed:
        raise SystemExit(f"the verification did not pass: {last}")
    seconds.append(last.seconds)
    throttled.append(last.throttled_s)


def _child_cpu(verifier: BackgroundVerifier) -> float:
    """CPU seconds the verifier process has used (0 where ``/proc`` cannot tell)."""
    child = verifier._child._proc
    try:
        with open(f"/proc/{child.pid}/stat") as f:  # type: ignore[union-attr]
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (AttributeError, OSError, IndexError, ValueError):
        return 0.0


def _load() -> str:
    return f"{os.getloadavg()[0]:.2f}" if hasattr(os, "getloadavg") else "?"


def _describe_verifier(verifier: BackgroundVerifier, isolation: str) -> None:
    child = verifier._child._proc
    tid = child.pid if isolation == "process" and child is not None else (
        verifier._thread.native_id if verifier._thread is not None else None)
    if tid is not None and hasattr(os, "sched_getscheduler"):
        policy = {getattr(os, n): n for n in ("SCHED_OTHER", "SCHED_IDLE", "SCHED_BATCH") if hasattr(os, n)}
        print(f"verifier {isolation}: policy {policy.get(os.sched_getscheduler(tid), '?')}, "
              f"nice {os.getpriority(os.PRIO_PROCESS, tid)}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
