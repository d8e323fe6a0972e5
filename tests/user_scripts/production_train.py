"""A classifier trained as a production job, written the way a user writes one.

    python production_train.py --run-dir DIR --steps 8 --save-every 2 [--resume auto|required|never]
    torchrun --standalone --nproc_per_node 2 production_train.py --run-dir DIR ... [--fault JSON]

An MLP with dropout under DDP, AdamW, OneCycleLR, gradient clipping, an exponential moving average of the
weights saved with the rest, and a DataLoader with two workers over a dataset defined in production_data.py.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys

import torch
import torch.nn.functional as F
from production_data import NoisyBlobs
from torch.utils.data import DataLoader

import ckptverify as cv
from ckptverify.state.sampler import ResumableSampler


class EMA:
    """An exponential moving average of a model's weights."""

    def __init__(self, model: torch.nn.Module, decay: float = 0.9) -> None:
        self.decay = decay
        self.shadow = copy.deepcopy(model).eval()
        for p in self.shadow.parameters():
            p.requires_grad_(False)

    @torch.no_grad()
    def update(self, model: torch.nn.Module) -> None:
        for s, p in zip(self.shadow.parameters(), model.parameters(), strict=True):
            s.mul_(self.decay).add_(p.detach(), alpha=1 - self.decay)

    def state_dict(self) -> dict:
        return {"decay": self.decay, "shadow": self.shadow.state_dict()}

    def load_state_dict(self, sd: dict) -> None:
        self.decay = sd["decay"]
        self.shadow.load_state_dict(sd["shadow"])


def train(run: cv.Run) -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Dropout(0.1),
                                torch.nn.Linear(32, 4))
    ema = EMA(model)
    if run.world_size > 1:
        model = torch.nn.parallel.DistributedDataParallel(model)
    dataset = NoisyBlobs()
    sampler = ResumableSampler(len(dataset), num_replicas=run.world_size, rank=run.rank, shuffle=True, seed=1,
                               drop_last=True)
    loader = DataLoader(dataset, batch_size=16, sampler=sampler, num_workers=2, drop_last=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=5e-2, total_steps=64)
    state = cv.TrainState(model=model, optimizer=opt, scheduler=sched, dataloader=loader, extras={"ema": ema})
    run.restore(state)
    model.train()
    for x, y in run.steps(loader):
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        ema.update(getattr(model, "module", model))
        run.record(loss=loss, batch=(x, y))


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--run-dir", required=True)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--save-every", type=int, default=2)
    ap.add_argument("--resume", default="auto")
    ap.add_argument("--fault", default=None)
    ap.add_argument("--trace", default="state")
    ap.add_argument("--deep", action="store_true", help="verify each checkpoint deep, in the background")
    args = ap.parse_args()
    cv.Run.main(train, steps=args.steps, run_dir=args.run_dir, save_every=args.save_every, resume=args.resume,
                fault=args.fault, trace=args.trace,
                verify=cv.VerifyOptions(when="background", deep=True) if args.deep else "background")
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        # gloo leaves threads behind after the group is destroyed; exit at once, the job's files are written.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
