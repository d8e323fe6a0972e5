"""A data-parallel training script in production mode, written the way users write one (used by the tests).

    python tests/production_workload.py --run-dir DIR --steps 6 --save-every 3 [--fault JSON]
    torchrun --standalone --nproc_per_node 2 tests/production_workload.py --run-dir DIR ...

The tiny GPT under DDP (one replica per rank), AdamW, warmup+cosine, a resumable sampler.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import random
import sys

import numpy as np
import torch

import ckptverify as cv
from ckptverify.examples import TinyGPTConfig, build_training, make_loader, train_step

CONFIG = TinyGPTConfig(d_model=32, n_layers=1, n_heads=2, seq_len=16)


def train(run: cv.Run) -> None:
    torch.set_num_threads(1)
    random.seed(run.rank)
    np.random.seed(run.rank)
    training = build_training(CONFIG, total_steps=40, num_sequences=512, seed=0)
    if run.world_size > 1:
        ddp = torch.nn.parallel.DistributedDataParallel(training.model)
        training = dataclasses.replace(training, model=ddp)
    loader = make_loader(training.dataset, 4, rank=run.rank, world_size=run.world_size, seed=1)
    state = cv.TrainState(model=training.model, optimizer=training.optimizer, scheduler=training.scheduler,
                          dataloader=loader)
    run.restore(state)
    wobble = os.environ.get("PRODUCTION_WORKLOAD_NONDETERMINISTIC") == "1"
    for batch in run.steps(loader):
        out = train_step(training, batch)
        if wobble:  # a job that is not deterministic: each process nudges a weight by a different amount
            # Random and relative to the weight: two processes' nudges differ after rounding to float32 except
            # with a chance of about 2e-5 (a clock-based nudge of a few ulps could round to the same float).
            u = 0.5 + int.from_bytes(os.urandom(4), "little") / 2**32
            with torch.no_grad():
                w = next(training.model.parameters()).view(-1)[:1]
                w.add_(w.abs().clamp_min(1e-3) * 1e-2 * u)
        run.record(loss=out["loss"], batch=batch, lr=out["lr"])


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--run-dir", required=True)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--save-every", type=int, default=3)
    ap.add_argument("--trace", default="state")
    ap.add_argument("--fault", default=None)
    args = ap.parse_args()
    cv.Run.main(train, steps=args.steps, run_dir=args.run_dir, save_every=args.save_every, trace=args.trace,
                fault=args.fault)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        # A gloo group that DDP used leaves threads alive after it is destroyed; a normal interpreter exit now
        # and then aborts around them (torch, not this script). The job is done and its files are written.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
