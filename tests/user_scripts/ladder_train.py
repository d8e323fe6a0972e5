"""Train a small regressor on a synthetic set with augmentation in the DataLoader workers; DDP on several ranks.

The second block can do one extra thing, chosen by the function started (each one a whole training job):

    train            nothing extra (deterministic)
    train_noisy_op   a custom op that adds noise of its own (nondeterministic by itself)
    train_noisy_np   the same noise added in numpy, outside the PyTorch dispatcher
    train_rank1_op   the custom op on rank 1 only (DDP carries its effect to the other ranks)
    train_silu       SiLU instead of GELU in the second block (a one-op change)
    train_lr         a larger learning rate (a change that is not one op)
    train_noisy_lr   the custom op and a larger learning rate

    python ladder_train.py                                    # a plain run
    python ladder_train.py --run-dir runs/a --save-every 2    # a production job
    python ladder_train.py --func train_noisy_op --run-dir runs/a --save-every 2
"""

import argparse
import os

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn
from torch.utils.data import DataLoader, Dataset

import ckptverify as cv
from ckptverify.state.sampler import ResumableSampler

BATCH = 8


@torch.library.custom_op("ladder::jitter", mutates_args=())
def jitter(x: torch.Tensor) -> torch.Tensor:
    """x plus a little noise from the operating system's random source: differs on every call."""
    noise = np.frombuffer(os.urandom(4 * x.numel()), dtype=np.uint32).astype(np.float32) / 2.0**32
    return x + torch.from_numpy(noise.reshape(tuple(x.shape))) * 1e-3


@jitter.register_fake
def _(x):
    return torch.empty_like(x)


jitter.register_autograd(lambda ctx, grad: grad)


class Points(Dataset):
    """Points in 8 dimensions and a smooth target; each fetch jitters the point (the workers' RNG)."""

    def __init__(self, n=64, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, 8, generator=g)
        self.y = self.x.sin().sum(1, keepdim=True)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i] + 0.05 * torch.randn(8), self.y[i]


class Block(nn.Module):
    def __init__(self, extra="", act="gelu"):
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 8)
        self.drop = nn.Dropout(0.1)
        self.extra = extra
        self.act = act

    def forward(self, x):
        h = self.fc1(x)
        h = F.silu(h) if self.act == "silu" else F.gelu(h)
        if self.extra == "op":
            h = jitter(h)
        elif self.extra == "numpy":
            noise = np.frombuffer(os.urandom(4 * h.numel()), dtype=np.uint32).astype(np.float32) / 2.0**32
            h = h + torch.from_numpy(noise.reshape(tuple(h.shape)) * np.float32(1e-3))
        return x + self.fc2(self.drop(h))


class Net(nn.Module):
    def __init__(self, extra="", act="gelu"):
        super().__init__()
        self.blocks = nn.ModuleList([Block(), Block(extra, act)])
        self.head = nn.Linear(8, 1)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def _train(run, extra="", act="gelu", lr=3e-3):
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = Net(extra, act)
    if run.world_size > 1:
        model = DDP(model)
    ema = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.9))
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=run.total_steps)
    data = Points()
    sampler = ResumableSampler(len(data), num_replicas=run.world_size, rank=run.rank, seed=1)
    loader = DataLoader(data, batch_size=BATCH, sampler=sampler, num_workers=2)
    state = cv.TrainState(model=model, optimizer=opt, scheduler=sched, dataloader=loader, extras={"ema": ema})
    run.restore(state)
    for x, y in run.steps(loader):
        loss = F.mse_loss(model(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        ema.update_parameters(model)
        run.record(loss=loss.detach(), batch=(x, y))


def train(run):
    _train(run)


def train_noisy_op(run):
    _train(run, extra="op")


def train_noisy_np(run):
    _train(run, extra="numpy")


def train_rank1_op(run):
    _train(run, extra="op" if run.rank == 1 else "")


def train_silu(run):
    _train(run, act="silu")


def train_lr(run):
    _train(run, lr=1e-2)


def train_noisy_lr(run):
    _train(run, extra="op", lr=1e-2)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--func", default="train")
    ap.add_argument("--run-dir", default=None)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--save-every", type=int, default=None)
    args = ap.parse_args()
    cv.Run.main(globals()[args.func], steps=args.steps, run_dir=args.run_dir, save_every=args.save_every,
                trace="state")
