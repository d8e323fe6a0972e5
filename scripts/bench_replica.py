"""Benchmark the cross-replica check: step time with a check after every optimizer step vs without, in one run.

    python scripts/bench_replica.py [--blocks 8] [--block-steps 4] [--d-model 256] [--layers 4] [--batch 16] [--nproc 2]

Trains the built-in tiny GPT under DDP on ``--nproc`` ranks (gloo on CPU, NCCL on CUDA) in blocks of steps, the
variants interleaved block after block:

- ``trace``: a state-level trace of every step (the production setting the target is about), no check;
- ``trace+check``: the same, and :class:`~ckptverify.hardware.replica.ReplicaCheck` of the parameters after every
  step, reusing the digests the trace made for its row (one 16-byte ``all_gather``);
- ``none`` and ``check`` (the check alone, digesting the parameters itself), for reference.

Rank 0 prints the median step time of each and its ratio to ``trace``, the check's ratio to the same run
without it, and the median CPU time rank 0's main thread spends inside ``check()`` (the wall time there is
mostly waiting in the collective for the slower rank, which the next gradient all-reduce would wait anyway).
Target: ``trace+check`` <= 1.01x ``trace`` on the built-in workload's large config (the defaults).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from helpers.multiproc import FileRendezvous


def _worker(rank: int, nproc: int, init_method: str, args: argparse.Namespace, trace_dir: str) -> None:
    import dataclasses

    import torch
    import torch.distributed as dist

    from ckptverify.examples import TinyGPTConfig, build_training, make_loader, train_step
    from ckptverify.hardware.replica import ReplicaCheck
    from ckptverify.state.train_state import TrainState
    from ckptverify.trace import TraceHeader, TraceRecorder

    torch.set_num_threads(1)
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if cuda else "gloo", init_method=init_method, rank=rank, world_size=nproc)
    try:
        config = TinyGPTConfig(d_model=args.d_model, n_layers=args.layers, n_heads=4, seq_len=32)
        device = "cuda" if cuda else "cpu"
        total = 4 * (args.blocks + 1) * args.block_steps
        training = build_training(config, total_steps=total + 10, device=device,
                                  num_sequences=args.batch * nproc * (total + 2))
        ddp = torch.nn.parallel.DistributedDataParallel(training.model)
        training = dataclasses.replace(training, model=ddp)
        loader = iter(make_loader(training.dataset, args.batch, rank=rank, world_size=nproc))
        state = TrainState(model=ddp, optimizer=training.optimizer, scheduler=training.scheduler)
        recorder = TraceRecorder(trace_dir, header=TraceHeader(run="bench", level="state"))
        recorder.attach(ddp, optimizer=training.optimizer)
        reusing = ReplicaCheck(ddp)
        reusing.digest_source = recorder
        variants = {"none": (False, None), "trace": (True, None), "trace+check": (True, reusing),
                    "check": (False, ReplicaCheck(ddp))}
        # Blocks of steps between barriers, variants interleaved: the check's all_gather also absorbs the
        # ranks' skew, which the next step's gradient all-reduce would absorb anyway, so the fair measure is
        # the wall time of whole steps, not the check's own time on one rank.
        per_step: dict[str, list[float]] = {name: [] for name in variants}
        in_check: dict[str, list[float]] = {name: [] for name in variants}
        step = 0
        for block in range(args.blocks + 1):
            for name, (traced, check) in variants.items():
                dist.barrier()
                t0 = time.perf_counter()
                for _ in range(args.block_steps):
                    if traced:
                        recorder.record_step_start(state)
                    else:
                        recorder.begin_skipped_step()
                    batch = next(loader)
                    train_step(training, batch)
                    step += 1
                    if traced:
                        recorder.record_step(step, batch=batch, state=state)
                    else:
                        recorder.skip_step()
                    if check is not None:
                        c0 = time.thread_time()
                        assert not check.check(step)
                        if block:
                            in_check[name].append(time.thread_time() - c0)
                if cuda:
                    torch.cuda.synchronize()
                dist.barrier()
                if block:  # the first round warms up
                    per_step[name].append((time.perf_counter() - t0) / args.block_steps)
        recorder.close()
        if rank == 0:
            base = statistics.median(per_step["trace"])
            params = sum(p.numel() for p in ddp.parameters())
            print(f"ranks {nproc}, {device}, {params} parameters, {args.blocks} blocks of {args.block_steps} steps "
                  "per variant, interleaved")
            print(f"{'variant':<14}{'step ms':>10}{'x trace':>9}{'check cpu':>10}  tensors compared / reused")
            for name, (_, check) in variants.items():
                t = statistics.median(per_step[name])
                counts = f"{check.compared} / {check.reused}" if check else "-"
                own = f"{statistics.median(in_check[name]) * 1e3:>10.3f}" if in_check[name] else f"{'-':>10}"
                print(f"{name:<14}{t * 1e3:>10.2f}{t / base:>9.4f}{own}  {counts}")
            ratio = statistics.median(per_step["trace+check"]) / base
            alone = statistics.median(per_step["check"]) / statistics.median(per_step["none"])
            own = statistics.median(in_check["trace+check"]) / base
            print(f"check with the trace: {ratio:.4f}x the traced step without it (target <= 1.01): "
                  f"{'MET' if ratio <= 1.01 else 'NOT MET'}; CPU time of rank 0's main thread inside the check: "
                  f"{own * 100:.2f}% of the step; the check alone: {alone:.4f}x the untraced step")
        dist.barrier()
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", type=int, default=8)
    ap.add_argument("--block-steps", type=int, default=4)
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--nproc", type=int, default=2)
    args = ap.parse_args(argv)
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp, FileRendezvous() as init_method:  # no port to race for
        mp.start_processes(_worker, args=(args.nproc, init_method, args, tmp), nprocs=args.nproc, join=True,
                           start_method="spawn")
    return 0


if __name__ == "__main__":
    sys.exit(main())
