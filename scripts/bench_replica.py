"""Benchmark the cross-replica check: step time with a check after every optimizer step vs without, in one run.

    python scripts/bench_replica.py [--blocks 6] [--block-steps 5] [--d-model 256] [--layers 4] [--batch 16] [--nproc 2]

Trains the built-in tiny GPT under DDP on ``--nproc`` ranks (gloo on CPU, NCCL on CUDA) in blocks of steps
without a check, with :class:`~ckptverify.hardware.replica.ReplicaCheck` of the parameters after every step,
and with the check of parameters plus AdamW state (one 16-byte ``all_gather`` each), interleaved, and prints on
rank 0 the median step time of each and its ratio to the step without a check. Target: <= 1% of the step on the built-in
workload's large config (the defaults).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time


def _worker(rank: int, nproc: int, port: int, args: argparse.Namespace) -> None:
    import dataclasses

    import torch
    import torch.distributed as dist

    from ckptverify.examples import TinyGPTConfig, build_training, make_loader, train_step
    from ckptverify.hardware.replica import ReplicaCheck

    torch.set_num_threads(1)
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(rank)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=nproc)
    try:
        config = TinyGPTConfig(d_model=args.d_model, n_layers=args.layers, n_heads=4, seq_len=32)
        device = "cuda" if cuda else "cpu"
        total = 3 * (args.blocks + 1) * args.block_steps
        training = build_training(config, total_steps=total + 10, device=device,
                                  num_sequences=args.batch * nproc * (total + 2))
        ddp = torch.nn.parallel.DistributedDataParallel(training.model)
        training = dataclasses.replace(training, model=ddp)
        loader = iter(make_loader(training.dataset, args.batch, rank=rank, world_size=nproc))
        variants = {"none": None, "parameters": ReplicaCheck(ddp),
                    "parameters+optimizer": ReplicaCheck(ddp, optimizer=training.optimizer)}
        # Blocks of steps between barriers, variants interleaved: the check's all_gather also absorbs the
        # ranks' skew, which the next step's gradient all-reduce would absorb anyway, so the fair measure is
        # the wall time of whole steps, not the check's own time on one rank.
        per_step: dict[str, list[float]] = {name: [] for name in variants}
        step = 0
        for block in range(args.blocks + 1):
            for name, check in variants.items():
                dist.barrier()
                t0 = time.perf_counter()
                for _ in range(args.block_steps):
                    train_step(training, next(loader))
                    step += 1
                    if check is not None:
                        assert not check.check(step)
                if cuda:
                    torch.cuda.synchronize()
                dist.barrier()
                if block:  # the first round warms up
                    per_step[name].append((time.perf_counter() - t0) / args.block_steps)
        if rank == 0:
            base = statistics.median(per_step["none"])
            params = sum(p.numel() for p in ddp.parameters())
            print(f"ranks {nproc}, {device}, {params} parameters, {args.blocks} blocks of {args.block_steps} steps")
            print(f"{'check':<24}{'step ms':>10}{'x none':>9}  tensors")
            for name, check in variants.items():
                t = statistics.median(per_step[name])
                print(f"{name:<24}{t * 1e3:>10.2f}{t / base:>9.4f}  {check.compared if check else 0}")
            ratio = statistics.median(per_step["parameters"]) / base
            print(f"parameters check: {ratio:.4f}x the step without (target <= 1.01): "
                  f"{'MET' if ratio <= 1.01 else 'NOT MET'}")
        dist.barrier()
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", type=int, default=6)
    ap.add_argument("--block-steps", type=int, default=5)
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--nproc", type=int, default=2)
    args = ap.parse_args(argv)
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(_worker, args=(args.nproc, port, args), nprocs=args.nproc, join=True, start_method="spawn")
    return 0


if __name__ == "__main__":
    sys.exit(main())
