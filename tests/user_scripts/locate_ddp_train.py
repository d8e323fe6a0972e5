"""A DDP training job as users write it: its Dataset in the script (with augmentation in the DataLoader workers),
its own activation kernel registered with ``torch.library``, dropout, AdamW, OneCycleLR, gradient clipping and
an EMA of the weights.

    torchrun --nproc_per_node 2 locate_ddp_train.py --steps 3

``LOCATE_PLANT`` plants one cause on rank 0 only:

* ``noisy-op``: the activation kernel adds noise it draws from the OS (a kernel that is nondeterministic by
  itself);
* ``numpy``: the block adds a correction computed in numpy, with noise drawn from the OS (the same kind of
  difference, made outside the dispatcher);
* unset: neither.
"""

from __future__ import annotations

import argparse
import os
import struct

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn
from torch.utils.data import DataLoader, Dataset, DistributedSampler


def os_noise(n: int) -> np.ndarray:
    return np.frombuffer(os.urandom(4 * n), dtype=np.uint32).astype(np.float32) / 2**32 * 1e-3


@torch.library.custom_op("locate_demo::scaled_gelu", mutates_args=())
def scaled_gelu(x: torch.Tensor, noisy: bool) -> torch.Tensor:
    y = F.gelu(x) * 1.5
    if noisy:
        (u,) = struct.unpack("<I", os.urandom(4))
        y = y + (u % 997 + 1) * 1e-4
    return y


@scaled_gelu.register_fake
def _(x: torch.Tensor, noisy: bool) -> torch.Tensor:
    return torch.empty_like(x)


def _backward(ctx, grad: torch.Tensor):
    (x,) = ctx.saved_tensors
    with torch.enable_grad():
        x = x.detach().requires_grad_(True)
        (g,) = torch.autograd.grad(F.gelu(x) * 1.5, x, grad)
    return g, None


def _setup(ctx, inputs, output) -> None:
    ctx.save_for_backward(inputs[0])


scaled_gelu.register_autograd(_backward, setup_context=_setup)


class Blobs(Dataset):
    """Points around four centres; each sample is jittered and randomly mirrored when it is read."""

    def __init__(self, n: int) -> None:
        g = torch.Generator().manual_seed(7)
        self.y = torch.randint(0, 4, (n,), generator=g)
        self.x = torch.randn(n, 8, generator=g) + self.y[:, None].float()

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.x[i] + 0.05 * torch.randn(8)
        if torch.rand(()) < 0.5:
            x = x.flip(0)
        return x, self.y[i]


class Block(nn.Module):
    def __init__(self, plant: str, rank: int) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 32)
        self.noisy = plant == "noisy-op" and rank == 0
        self.numpy_fix = plant == "numpy" and rank == 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        if self.numpy_fix:
            h = h + torch.from_numpy(os_noise(h.shape[-1]))
        return scaled_gelu(h, self.noisy)


class Net(nn.Module):
    def __init__(self, plant: str, rank: int) -> None:
        super().__init__()
        self.block = Block(plant, rank)
        self.drop = nn.Dropout(0.1)
        self.head = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.drop(self.block(x)))


def train(steps: int) -> float:
    rank = dist.get_rank()
    plant = os.environ.get("LOCATE_PLANT", "")
    torch.manual_seed(0)
    model = DistributedDataParallel(Net(plant, rank))
    ema = AveragedModel(model.module, multi_avg_fn=get_ema_multi_avg_fn(0.99))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1e-2, total_steps=100)
    data = Blobs(64)
    loader = DataLoader(data, batch_size=8, sampler=DistributedSampler(data, seed=0), num_workers=2)
    loss = torch.zeros(())
    for step, (x, y) in enumerate(loader, start=1):
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        ema.update_parameters(model.module)
        if step == steps:
            break
    return float(loss)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args()
    dist.init_process_group("gloo")
    print(f"rank {dist.get_rank()} loss {train(args.steps):.6f}")
    dist.destroy_process_group()
