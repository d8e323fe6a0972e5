"""A training job in production mode, as users write one (the replay tests run it).

    python replay_train.py --run-dir DIR --steps 6 --save-every 3 [--fault JSON]
    torchrun --standalone --nproc_per_node 2 replay_train.py --run-dir DIR ...

A small MLP with dropout under DDP on more than one rank, AdamW, OneCycleLR, gradient clipping, an EMA of the
weights, a DataLoader with two workers over a noisy dataset (``replay_data.py``; ``REPLAY_NOISE`` picks the
noise). ``REPLAY_PLANT`` plants a mistake: ``data`` (the loader is not in the TrainState), ``rng`` (the job
re-seeds after ``run.restore``), ``scheduler`` (the LR scheduler is not in the TrainState), ``buffer`` (the
model counts its calls in a ``persistent=False`` buffer that scales its output), ``restore`` (an object of the
job whose ``load_state_dict`` ignores what it is given).
``REPLAY_LOSS=reduced`` logs the loss averaged over the ranks instead of each rank's own.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from replay_data import NoisyPoints
from torch import nn
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn
from torch.utils.data import DataLoader

import ckptverify as cv
from ckptverify.state.sampler import ResumableSampler


class Net(nn.Module):
    def __init__(self, count_calls: bool = False) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 32)
        self.drop = nn.Dropout(0.1)
        self.fc2 = nn.Linear(32, 4)
        self.count_calls = count_calls
        self.register_buffer("calls", torch.zeros(()), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.fc2(self.drop(F.gelu(self.fc1(x))))
        if self.count_calls:  # a warm-up that follows the number of calls
            self.calls += 1
            out = out * (1 + 1e-3 * self.calls)
        return out


class Tokens:
    """How many samples the job has seen (its load_state_dict forgets to read the saved value)."""

    def __init__(self) -> None:
        self.seen = 0

    def state_dict(self) -> dict:
        return {"seen": self.seen}

    def load_state_dict(self, state: dict) -> None:
        self.seen = 0


def train(run: cv.Run) -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    plant = os.environ.get("REPLAY_PLANT", "")
    net = Net(count_calls=plant == "buffer")
    tokens = Tokens()
    ema = AveragedModel(net, multi_avg_fn=get_ema_multi_avg_fn(0.9))
    model = nn.parallel.DistributedDataParallel(net) if run.world_size > 1 else net
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1e-2, total_steps=100)
    data = NoisyPoints(256)
    loader = DataLoader(data, batch_size=8, sampler=ResumableSampler(len(data), seed=1), num_workers=2)
    state = cv.TrainState(model=model, optimizer=opt, scheduler=None if plant == "scheduler" else sched,
                          dataloader=None if plant == "data" else loader,
                          extras={"ema": ema, "tokens": tokens} if plant == "restore" else {"ema": ema})
    run.restore(state)
    if plant == "rng":
        torch.manual_seed(1)
    for x, y in run.steps(loader):
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        norm = nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        ema.update_parameters(net)
        tokens.seen += len(x)
        logged = loss.detach().clone()
        if os.environ.get("REPLAY_LOSS") == "reduced" and run.world_size > 1:
            dist.all_reduce(logged)
            logged /= run.world_size
        run.record(loss=logged, batch=(x, y), grad_norm=norm, lr=sched.get_last_lr()[0])


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
        # and then aborts around them. The job is done and its files are written.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
