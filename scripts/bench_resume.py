"""Benchmark resume-check against the same steps run plainly, in one run.

    python scripts/bench_resume.py [--steps 20] [--resume-at 10] [--nproc 1] [--level state] [--profile]

Times (1) the same work run plainly: A (steps 1..T), A2 (1..T) and B (T-K steps), each in its own fresh
process set with start-up included, no saves, no trace; (2) ``resume_check`` of the built-in workload with
runs A, A2, B. Prints both wall times and their ratio (target <= 1.3x). ``--profile`` also prints where
resume-check's time goes: per run launch, and the comparison.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time

from ckptverify.trace.store import LEVELS

TARGET = "ckptverify.examples.workloads:correct"


def plain(steps: int, resume_at: int, nproc: int) -> float:
    from ckptverify.resume.harness import launch_jobs
    from ckptverify.resume.run import RunConfig

    t0 = time.perf_counter()
    for name, stop in (("A", steps), ("A2", steps), ("B", steps - resume_at)):
        launch_jobs(nproc, "cpu", [(TARGET, RunConfig(name=name, stop_step=stop))])
    return time.perf_counter() - t0


def checked(steps: int, resume_at: int, nproc: int, level: str, profile: bool) -> tuple[float, str]:
    from ckptverify.resume import harness

    marks: list[tuple[str, float]] = []

    def say(msg: str) -> None:
        marks.append((msg, time.perf_counter()))

    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        outcome = harness.resume_check(harness.Plan(target=TARGET, steps=steps, resume_at=resume_at, nproc=nproc,
                                                    level=level), keep=tmp, progress=say)
    total = time.perf_counter() - t0
    if profile:
        ends = [t for _, t in marks[1:]] + [t0 + total]
        for (msg, start), end in zip(marks, ends, strict=True):
            print(f"  {end - start:7.2f} s  {msg}")
    return total, outcome.verdict.kind


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--resume-at", type=int, default=10)
    p.add_argument("--nproc", type=int, default=1)
    p.add_argument("--level", default="state", choices=LEVELS)
    p.add_argument("--profile", action="store_true")
    args = p.parse_args(argv)
    base = plain(args.steps, args.resume_at, args.nproc)
    total, kind = checked(args.steps, args.resume_at, args.nproc, args.level, args.profile)
    print(f"plain A + A2 + B ({args.steps} + {args.steps} + {args.steps - args.resume_at} steps, "
          f"{args.nproc} rank(s)): {base:.2f} s")
    print(f"resume-check (level {args.level}, verdict {kind}): {total:.2f} s")
    print(f"ratio: {total / base:.2f}x (target <= 1.3x)")
    return 0 if kind == "pass" else 1


if __name__ == "__main__":
    sys.exit(main())
