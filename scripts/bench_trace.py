"""Benchmark the trace overhead: step time with tracing at each level vs without, in one run.

    python scripts/bench_trace.py [--config small|large|both] [--blocks 15] [--block-steps 20] [--levels ...]

Trains the built-in tiny GPT (1 process, CPU unless CUDA is available) through the Run protocol once per variant
(no trace, ``metrics``, ``state``, ``state`` every 10th step, ``comm``, ``module``, ``op`` with a window of every
step; each its own model, same config),
and drives the variants in alternation: block after block of ``--block-steps`` steps, the variants in a new
random order each block, so that load from other processes falls on all of them alike. A variant's step time is
the median over blocks of its mean step time (the whole loop iteration: the work ``run.steps()`` does before
yielding counts; rows are written in the background every 64 steps, and those writes are inside the blocks).
Printed per variant: wall time and the training thread's CPU time per step, and their ratios to the untraced
step. Targets: ``state`` <= 1.02x, ``state`` with ``trace_every=10`` <= 1.005x, on both configs: ``small`` (the
defaults of the built-in workload, a 5-10 ms step) and ``large`` (``d_model`` 256, 4 layers, batch 16, a
120-170 ms step).

Variant ``bytes`` (host only) is no trace plus the one thing level ``state`` cannot avoid: reading every byte it
digests (gradients, parameters, optimizer state) with xxh3 right where the trace reads them. Its ratio is the
floor under ``state`` on that machine: on a small model those bytes no longer sit in the caches after the step,
so the floor is set by memory bandwidth, not by the trace's code.

Whole-step ratios on a shared machine move by more than what separates ``state`` from its floor, so on the
host the difference is also measured directly (:func:`in_loop_costs`, :func:`state_over_floor`): the
recorder's calls against the floor's digests, timed around those calls only inside real training steps (CPU
time of the training thread), then the same calls back to back with warm caches, and the CPU time the store
takes to write a row on its background thread.

Level ``comm`` is printed against ``state`` too (target: under 1% of the step on the large config): on one
process there is no collective, so what it measures is the dispatch mode that watches for them, a Python call
per op. Level ``op`` is printed as microseconds per op over level ``module`` (the op log's size per step is read
from the trace).

On CUDA, ``--sync-debug`` also counts the host synchronizations of each variant's steps
(``torch.cuda.set_sync_debug_mode("warn")``: one warning per synchronizing call) and prints them per step, and
over the untraced step's (a traced step should add at most one: its row's read-back).

It also measures the fixed cost of a tensor site: a category of 1000 one-element tensors recorded at detail
``category``, per tensor (target <= 5 microseconds).
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

CONFIGS = {"small": (64, 2, 8), "large": (256, 4, 16)}
LEVELS = ["none", "bytes", "metrics", "state", "state/10", "comm", "module", "op"]


@dataclass
class Variant:
    name: str
    run: Any
    training: Any
    steps: Any
    wall: list[float] = field(default_factory=list)
    cpu: list[float] = field(default_factory=list)
    after_step: Any = None
    #: Host synchronizations per step of each block (``--sync-debug`` on CUDA).
    syncs: list[float] = field(default_factory=list)


def hash_bytes_only(training: Any, spent: list[float] | None = None) -> Any:
    """The floor of level ``state`` on the host: reading every byte it digests (the gradients, in an optimizer
    pre-hook, then the parameters and the optimizer state after the step) with xxh3 and nothing else. Returns
    the function to call after each step. With ``spent``, the CPU seconds both take are added to ``spent[0]``
    and their calls to ``spent[1]``."""
    import xxhash

    from ckptverify.trace.category import HostViews

    params = list(training.model.parameters())
    opt = training.optimizer
    clock = time.thread_time if spent is not None else None  # CPU time: a preempted call is not charged

    def grads(*_: Any) -> None:
        t0 = clock() if clock else 0.0
        for p in params:
            if p.grad is not None:
                xxhash.xxh3_128_intdigest(p.grad.numpy())
        if clock:
            spent[0] += clock() - t0  # type: ignore[index]
            spent[1] += 1  # type: ignore[index]

    opt.register_step_pre_hook(grads)
    state: list[Any] = []

    def after() -> None:
        t0 = clock() if clock else 0.0
        if not state:
            tensors = [*params, *(v for st in opt.state.values() for v in st.values() if hasattr(v, "numel"))]
            state.append(HostViews([t.detach() for t in tensors]))
        state[0].digests()
        if clock:
            spent[0] += clock() - t0  # type: ignore[index]
            spent[1] += 1  # type: ignore[index]

    return after


def _timed(spent: list[float], fn: Any) -> Any:
    """``fn``, adding the CPU seconds of this thread each call takes to ``spent[0]`` and the call to
    ``spent[1]``."""
    def call(*args: Any, **kwargs: Any) -> Any:
        t0 = time.thread_time()
        try:
            return fn(*args, **kwargs)
        finally:
            spent[0] += time.thread_time() - t0
            spent[1] += 1

    return call


def in_loop_costs(config: str, blocks: int = 10, steps: int = 20) -> tuple[float, float, float]:
    """Level ``state``'s own work inside real training steps, against its floor's: microseconds per step spent
    in the recorder's calls (the step's start, the optimizer hook's digests and hyperparameters, the row) in a
    traced run, and in the floor's digests (variant ``bytes``) in an untraced one, both timed around those
    calls only and in CPU time of the training thread, so the rest of the step and preemption by other
    processes stay out; the two runs alternate block by block, and each
    figure is the median over blocks. Also the training thread's CPU time per step of the untraced run (the
    ``bytes`` run less its digests), in microseconds, to express the difference as a share of a step."""
    d_model, layers, batch = CONFIGS[config]
    with tempfile.TemporaryDirectory() as tmp:
        traced = make_variant("state", (blocks + 1) * steps, d_model, layers, batch, tmp)
        floor = make_variant("none", (blocks + 1) * steps, d_model, layers, batch, tmp)
        rec = traced.run._recorder
        spent_traced, spent_floor = [0.0, 0], [0.0, 0]
        # What reading the clock costs a timed call (taken off each call's time): the clock is a system call.
        probe = [0.0, 0]
        nothing = _timed(probe, lambda: None)
        for _ in range(20000):
            nothing()
        clock = probe[0] / probe[1]
        rec.record_step_start = _timed(spent_traced, rec.record_step_start)
        rec.record_step = _timed(spent_traced, rec.record_step)
        rec.record_grads = _timed(spent_traced, rec.record_grads)
        rec._hparams = _timed(spent_traced, rec._hparams)
        floor.after_step = hash_bytes_only(floor.training, spent_floor)
        per_traced, per_floor, cpu = [], [], []
        for block in range(blocks + 1):
            for v, spent, out in ((traced, spent_traced, per_traced), (floor, spent_floor, per_floor)):
                spent[0], spent[1] = 0.0, 0
                run_block(v, steps)
                if block:
                    out.append((spent[0] - spent[1] * clock) / steps)
            if block:
                cpu.append(floor.cpu[-1] - per_floor[-1])
        for v in (traced, floor):
            v.run.close()
    return (statistics.median(per_traced) * 1e6, statistics.median(per_floor) * 1e6,
            statistics.median(cpu) * 1e6)


def make_variant(name: str, total: int, d_model: int, layers: int, batch: int, trace_dir: str) -> Variant:
    import torch

    from ckptverify.examples import TinyGPTConfig, build_training, make_loader
    from ckptverify.resume.run import Run, RunConfig
    from ckptverify.state.train_state import TrainState

    config = TinyGPTConfig(d_model=d_model, n_layers=layers, n_heads=4, seq_len=32)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    training = build_training(config, total_steps=total + 10, num_sequences=batch * (total + 2), device=device)
    loader = make_loader(training.dataset, batch)
    untraced = name in ("none", "bytes")
    level, _, every = ("state" if untraced else name).partition("/")
    cfg = RunConfig(name=name, stop_step=total, trace_dir=None if untraced else f"{trace_dir}/{name}",
                    level=level, trace_every=int(every or 1), op_window={} if level == "op" else None)
    run = Run(cfg)
    run.restore(TrainState(model=training.model, optimizer=training.optimizer, scheduler=training.scheduler,
                           dataloader=loader))
    after = hash_bytes_only(training) if name == "bytes" and device == "cpu" else None
    return Variant(name, run, training, iter(run.steps(loader)), after_step=after)


def run_block(v: Variant, steps: int, sync_debug: bool = False) -> None:
    import warnings

    import torch

    from ckptverify.examples import train_step

    cuda = torch.cuda.is_available()
    counting = sync_debug and cuda
    t0, c0 = time.perf_counter(), time.thread_time()
    with warnings.catch_warnings(record=True) as seen:
        if counting:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
        try:
            for _ in range(steps):
                batch = next(v.steps)
                out = train_step(v.training, batch)
                v.run.record(loss=out["loss"], batch=batch, lr=out["lr"], grad_norm=out["grad_norm"])
                if v.after_step is not None:
                    v.after_step()
        finally:
            if counting:
                torch.cuda.set_sync_debug_mode(0)
    if counting:
        v.syncs.append(sum("synchroniz" in str(w.message) for w in seen) / steps)
    if cuda:
        torch.cuda.synchronize()
    v.wall.append((time.perf_counter() - t0) / steps)
    v.cpu.append((time.thread_time() - c0) / steps)


def bench_config(name: str, levels: list[str], blocks: int, block_steps: int, sync_debug: bool = False
                 ) -> tuple[dict[str, tuple[float, float]], int]:
    """Per variant, the median wall and CPU time of a step; and the ops a step of level ``op`` logs (0 without
    that variant)."""
    d_model, layers, batch = CONFIGS[name]
    total = (blocks + 1) * block_steps
    order = random.Random(0)
    with tempfile.TemporaryDirectory() as tmp:
        variants = [make_variant(level, total, d_model, layers, batch, tmp) for level in levels]
        for block in range(blocks + 1):
            order.shuffle(variants)
            for v in variants:
                run_block(v, block_steps, sync_debug)
            if block == 0:  # warm-up
                for v in variants:
                    v.wall.clear()
                    v.cpu.clear()
                    v.syncs.clear()
        if sync_debug:
            base = next((statistics.median(v.syncs) for v in variants if v.name == "none" and v.syncs), None)
            for v in variants:
                if v.syncs and base is not None:
                    print(f"{name} config, {v.name}: {statistics.median(v.syncs):.2f} host synchronizations a step "
                          f"({statistics.median(v.syncs) - base:+.2f} over the untraced step)")
        for v in variants:
            v.run.close()
        ops = 0
        if "op" in levels:
            from ckptverify.trace.oplog import read_ops

            ops = len(read_ops(f"{tmp}/op", 0, total))
    return {v.name: (statistics.median(v.wall), statistics.median(v.cpu)) for v in variants}, ops


def state_over_floor(config: str, repeats: int = 7, steps: int = 300) -> tuple[float, float, float]:
    """What level ``state`` adds to a step beyond its floor, measured directly on one model of ``config``
    (host only), free of the step's own noise: microseconds per step of the recorder's calls (the step's
    start, the optimizer hook, the row) and of the floor (the same gradients, parameters and optimizer state
    read with xxh3, as variant ``bytes``), each the fastest of ``repeats`` loops of ``steps`` calls with the
    rows kept in memory; and microseconds of CPU time (all threads) the store takes to write a row, measured
    on its own (rows are written on a background thread, which shares the cores with the step)."""
    import torch
    import xxhash

    from ckptverify.examples import train_step
    from ckptverify.trace.store import TraceHeader, TraceWriter

    d_model, layers, batch = CONFIGS[config]
    with tempfile.TemporaryDirectory() as tmp:
        v = make_variant("state", 50, d_model, layers, batch, tmp)
        run_block(v, 5)
        rec, state, opt = v.run._recorder, v.run.state, v.training.optimizer
        rec.writer.flush_every = 10 ** 9  # rows stay buffered: the writer is measured below, on its own
        data = next(v.steps)
        out = train_step(v.training, data)
        params = list(v.training.model.parameters())
        for p in params:  # the loop cleared them; the hook reads them as a step would
            p.grad = torch.randn_like(p)
        metrics = {"loss": out["loss"], "lr": out["lr"], "grad_norm": out["grad_norm"]}
        after = hash_bytes_only(v.training)
        step = [rec.writer.rows + 10 ** 6]

        def traced() -> None:
            rec.record_step_start(state)
            rec._optimizer_hook(opt, (), {})
            step[0] += 1
            rec.record_step(step[0], metrics=metrics, batch=data, state=state)

        def floor() -> None:
            for p in params:
                xxhash.xxh3_128_intdigest(p.grad.numpy())
            after()

        def best(fn: Any) -> float:
            times = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                for _ in range(steps):
                    fn()
                times.append((time.perf_counter() - t0) / steps)
            return min(times) * 1e6

        traced_us, floor_us = [], []
        for _ in range(2):  # interleaved: load from other processes falls on both alike
            traced_us.append(best(traced))
            floor_us.append(best(floor))
        cells = rec._state_cells(step[0], state)
        v.run.close()
        header = TraceHeader(run="w", level="state", workload="bench")
        rows = 64 * 20
        writer = TraceWriter(f"{tmp}/writer", header=header, background=False)
        c0 = time.process_time()
        for s in range(1, rows + 1):
            writer.append(s, cells)
        writer.close()
        write_us = (time.process_time() - c0) / rows * 1e6
    return min(traced_us), min(floor_us), write_us


def site_cost(n: int = 1000, repeats: int = 30) -> float:
    """Microseconds per tensor of recording one category of ``n`` one-element tensors (digest and sum)."""
    import torch

    from ckptverify.trace.members import _Digester, _Members

    tensors = [torch.zeros(1) for _ in range(n)]
    members = _Members("param.*", "param", [f"param.t{i}" for i in range(n)], tensors)
    digester = _Digester([members], owners=tensors)
    digester.cells(digester.digests_later()[0], "category")  # type: ignore[index]
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        digester.cells(digester.digests_later()[0], "category")  # type: ignore[index]
        times.append(time.perf_counter() - t0)
    return statistics.median(times) / n * 1e6


def comm_costs(repeats: int = 2000, ops: int = 20000) -> tuple[float, float]:
    """What level ``comm`` adds on one process, measured directly: microseconds per traced step of starting and
    ending the step tracer (optimizer phase hooks, the collectives' kernels handed the step), and microseconds
    per op that is not a collective (none: the kernels sit on the collectives only)."""
    import torch

    from ckptverify.trace.ops import OpContext, StepTracer

    tracer = StepTracer(OpContext(), rank=0, window=None, emit=lambda item: 0,
                        fill=lambda index, item: None)
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        for step in range(repeats):
            tracer.begin(step)
            tracer.end()
        times.append((time.perf_counter() - t0) / repeats)
    x = torch.ones(4)

    def loop() -> float:
        t0 = time.perf_counter()
        for _ in range(ops):
            torch.add(x, x)
        return (time.perf_counter() - t0) / ops

    plain, traced = [], []
    for _ in range(5):
        plain.append(loop())
        tracer.begin(0)
        traced.append(loop())
        tracer.end()
    tracer.close()
    return statistics.median(times) * 1e6, (statistics.median(traced) - statistics.median(plain)) * 1e6


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", choices=["small", "large", "both"], default="both")
    ap.add_argument("--blocks", type=int, default=15, help="blocks per variant (after one warm-up block)")
    ap.add_argument("--block-steps", type=int, default=20)
    ap.add_argument("--large-blocks", type=int, default=6, help="blocks per variant for the large config")
    ap.add_argument("--large-block-steps", type=int, default=10)
    ap.add_argument("--levels", nargs="+", default=LEVELS, choices=LEVELS)
    ap.add_argument("--sync-debug", action="store_true",
                    help="on CUDA, count each variant's host synchronizations a step (set_sync_debug_mode)")
    args = ap.parse_args(argv)
    import torch

    torch.set_num_threads(1)
    levels = ["none", *[lvl for lvl in args.levels if lvl != "none"]]
    configs = ["small", "large"] if args.config == "both" else [args.config]
    verdicts = []
    for config in configs:
        blocks, steps = (args.blocks, args.block_steps) if config == "small" else (
            args.large_blocks, args.large_block_steps)
        d, layers, batch = CONFIGS[config]
        print(f"\n{config} config (d_model {d}, {layers} layers, batch {batch}): {blocks} blocks of {steps} steps "
              "per variant, alternated")
        result, ops = bench_config(config, levels, blocks, steps, args.sync_debug)
        wall0, cpu0 = result["none"]
        print(f"{'trace level':<12}{'wall ms':>10}{'x none':>9}{'cpu ms':>10}{'x none':>9}")
        for level in levels:
            wall, cpu = result[level]
            print(f"{level:<12}{wall * 1e3:>10.2f}{wall / wall0:>9.4f}{cpu * 1e3:>10.2f}{cpu / cpu0:>9.4f}")
        for level, target in (("state", 1.02), ("state/10", 1.005)):
            if level in result:
                ratio = result[level][0] / wall0
                verdicts.append(f"{config}, {level}: {ratio:.4f}x wall, {result[level][1] / cpu0:.4f}x cpu "
                                f"(target <= {target}): {'MET' if ratio <= target else 'NOT MET'}")
        if "comm" in result and "state" in result:
            ratio = result["comm"][0] / result["state"][0]
            target = 1.01 if config == "large" else None
            verdicts.append(f"{config}, comm over state: {ratio:.4f}x wall, "
                            f"{result['comm'][1] / result['state'][1]:.4f}x cpu"
                            + (f" (target <= {target}): {'MET' if ratio <= target else 'NOT MET'}" if target else ""))
        if "state" in result and not torch.cuda.is_available():
            traced, floor, write = state_over_floor(config)
            over = traced - floor
            verdicts.append(f"{config}, state measured directly, warm loop: {traced:.0f} us a step for {floor:.0f} "
                            f"us of digesting the same bytes: +{over:.0f} us = {over / (cpu0 * 1e6) * 100:.2f}% "
                            f"of the untraced step's CPU time over the floor; the store writes a row in "
                            f"{write:.0f} us of CPU time on its own thread ({write / (cpu0 * 1e6) * 100:.2f}%)")
            traced, floor, step = in_loop_costs(config, blocks, steps)
            over = traced - floor
            verdicts.append(f"{config}, state measured directly, in the training loop: {traced:.0f} us a step in "
                            f"the recorder for {floor:.0f} us of digesting the same bytes: +{over:.0f} us = "
                            f"{over / step * 100:.2f}% of a {step / 1e3:.2f} ms step over the floor")
        if "comm" in result:
            fixed, per_op = comm_costs()
            n = ops or 0
            added = fixed + max(per_op, 0.0) * n  # a negative difference is timing noise, not a saving
            verdicts.append(f"{config}, comm measured directly: {fixed:.1f} us a step + {per_op:.3f} us per op"
                            + (f" x {n} ops = {added:.0f} us, {added / (cpu0 * 1e6) * 100:.3f}% of the untraced "
                               f"step's CPU time (target < 1%): {'MET' if added < cpu0 * 1e4 else 'NOT MET'}"
                               if n else ""))
        if ops and "module" in result:
            per_op = (result["op"][0] - result["module"][0]) / ops * 1e6
            verdicts.append(f"{config}, op over module: {ops} ops a step, {per_op:.1f} us per op "
                            f"({result['op'][0] / result['module'][0]:.2f}x the step)")
    per_site = site_cost()
    print()
    for line in verdicts:
        print(line)
    print(f"fixed cost per tensor site: {per_site:.2f} us (target <= 5): {'MET' if per_site <= 5 else 'NOT MET'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
