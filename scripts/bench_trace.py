"""Benchmark the trace overhead: step time with tracing at each level vs without, in one run.

    python scripts/bench_trace.py [--steps 40] [--repeats 3] [--d-model 64] [--layers 2] [--batch 8]

Trains the built-in tiny GPT (1 process, CPU unless CUDA is available) through the Run protocol, alternating
no trace / ``metrics`` / ``state`` / ``state`` every 10th step / ``module`` on every repeat, and prints the mean
step time of each (the whole loop iteration: the work ``run.steps()`` does before yielding counts) and its ratio
to the untraced step. Targets: ``state`` <= 1.02x, ``state`` with ``trace_every=10`` <= 1.005x. Run it once with
the defaults (a 5-10 ms step) and once with ``--d-model 256 --layers 4 --batch 16`` (the large config).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time


def measure(variant: str | None, steps: int, d_model: int, layers: int, batch: int) -> float:
    import torch

    from ckptverify.examples import TinyGPTConfig, build_training, make_loader, train_step
    from ckptverify.resume.run import Run, RunConfig
    from ckptverify.state.train_state import TrainState

    config = TinyGPTConfig(d_model=d_model, n_layers=layers, n_heads=4, seq_len=32)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    training = build_training(config, total_steps=steps + 10, num_sequences=batch * (steps + 2), device=device)
    loader = make_loader(training.dataset, batch)
    with tempfile.TemporaryDirectory() as tmp:
        level, _, every = (variant or "state").partition("/")
        cfg = RunConfig(name="bench", stop_step=steps, trace_dir=tmp if variant else None, level=level,
                        trace_every=int(every or 1))
        run = Run(cfg)
        state = TrainState(model=training.model, optimizer=training.optimizer, scheduler=training.scheduler,
                           dataloader=loader)
        run.restore(state)
        times = []
        t0 = time.perf_counter()
        for batch_ in run.steps(loader):
            out = train_step(training, batch_)
            run.record(loss=out["loss"], batch=batch_, lr=out["lr"], grad_norm=out["grad_norm"])
            if device == "cuda":
                torch.cuda.synchronize()
            now = time.perf_counter()
            times.append(now - t0)
            t0 = now
        run.close()
    return statistics.fmean(times[5:])  # skip warm-up steps


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--d-model", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--batch", type=int, default=8)
    args = ap.parse_args(argv)
    import torch

    torch.set_num_threads(1)
    levels: list[str | None] = [None, "metrics", "state", "state/10", "module"]
    results: dict[str | None, list[float]] = {lvl: [] for lvl in levels}
    for _ in range(args.repeats):
        for lvl in levels:
            results[lvl].append(measure(lvl, args.steps, args.d_model, args.layers, args.batch))
    base = statistics.median(results[None])
    print(f"{'trace level':<14}{'step ms':>10}{'x untraced':>12}")
    for lvl in levels:
        t = statistics.median(results[lvl])
        print(f"{lvl or 'none':<14}{t * 1e3:>10.2f}{t / base:>12.4f}")
    ratio = statistics.median(results["state"]) / base
    every = statistics.median(results["state/10"]) / base
    print(f"\nstate, every step = {ratio:.4f}x (target <= 1.02): {'MET' if ratio <= 1.02 else 'NOT MET'}")
    print(f"state, every 10th step = {every:.4f}x (target <= 1.005): {'MET' if every <= 1.005 else 'NOT MET'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
