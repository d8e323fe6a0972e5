"""Fine-tune a small regressor; batches come from torchdata's StatefulDataLoader with forked workers.

    python harness_stateful.py --steps 20
"""

import argparse
import copy
import random
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn as nn
from torch.utils.data import Dataset
from torchdata.stateful_dataloader import StatefulDataLoader

import ckptverify as cv


@dataclass
class Config:
    n: int = 64
    dim: int = 6
    batch: int = 4
    lr: float = 1e-2
    ema_decay: float = 0.95


CFG = Config()


class Jittered(Dataset):
    """Points on a plane; each fetch scales the input by a random factor (drawn in the worker)."""

    def __init__(self, cfg):
        g = torch.Generator().manual_seed(3)
        self.x = torch.randn(cfg.n, cfg.dim, generator=g)
        self.y = self.x @ torch.randn(cfg.dim, 1, generator=g)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        scale = 1.0 + 0.05 * (torch.rand(()) - 0.5)
        return self.x[i] * scale, self.y[i]


def seed_worker(worker_id):
    seed = torch.initial_seed() % 2**32
    np.random.seed(seed)
    random.seed(seed)


class Ema:
    """An exponential moving average of the weights, kept outside the TrainState."""

    def __init__(self, model, decay):
        self.decay = decay
        self.shadow = copy.deepcopy(model).eval()

    @torch.no_grad()
    def update(self, model):
        for s, p in zip(self.shadow.parameters(), model.parameters(), strict=True):
            s.lerp_(p, 1 - self.decay)


def train(run):
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(CFG.dim, 16), nn.GELU(), nn.Dropout(0.1), nn.Linear(16, 1))
    ema = Ema(model, CFG.ema_decay)
    opt = torch.optim.AdamW(model.parameters(), lr=CFG.lr)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=50)
    loader = StatefulDataLoader(Jittered(CFG), batch_size=CFG.batch, shuffle=True, num_workers=2,
                                worker_init_fn=seed_worker, multiprocessing_context="fork")
    run.restore(cv.TrainState(model=model, optimizer=opt, scheduler=sched, dataloader=loader))
    for x, y in run.steps(loader):
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        sched.step()
        opt.zero_grad()
        ema.update(model)
        print(f"step {run.step + 1}: loss={loss.item():.5f}")
        run.record(loss=loss.detach(), batch=(x, y))


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=20)
    cv.Run.main(train, steps=ap.parse_args().steps)
