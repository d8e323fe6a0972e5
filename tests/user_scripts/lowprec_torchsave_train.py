"""Fine-tuning a small adapter on top of a frozen, MX-quantized base layer, saved the plain PyTorch way: one
``torch.save`` file holding the model's state dict (the frozen base weight is torchao's ``MXTensor``: float8
data and power-of-two block scales), the optimizer, the scheduler, an EMA of the trainable weights, the step,
and a float8 export of the trained layers (``float8_e4m3fn`` and ``float8_e5m2`` copies for serving).

The data is a Dataset defined here, read by a DataLoader with two workers and augmentation; AdamW, OneCycleLR,
gradient clipping, dropout.

Usage: ``python lowprec_torchsave_train.py OUT.pt [--steps N] [--rescale] [--lr-bump]``. ``--rescale``: after
the last update, the base weight is re-quantized with every block scale one power of two larger and the data
halved to match (what a buggy re-quantization might do). ``--lr-bump``: the learning rate is doubled for the
last step instead (a different cause, in the optimizer).
"""

from __future__ import annotations

import argparse
import random
import warnings

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset

warnings.filterwarnings("ignore", message=".*register_constant.*")

FEATURES, HIDDEN, CLASSES, SAMPLES, BATCH = 64, 32, 4, 96, 8


class NoisyPoints(Dataset):
    """Points around one centre per class, with a random flip of the feature order as augmentation."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(7)
        self.centres = torch.randn(CLASSES, FEATURES, generator=g)
        self.labels = torch.randint(0, CLASSES, (SAMPLES,), generator=g)
        self.noise = 0.3 * torch.randn(SAMPLES, FEATURES, generator=g)

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.centres[self.labels[i]] + self.noise[i]
        if torch.rand(()) < 0.5:  # augmentation, from the worker's own generator
            x = x.flip(0)
        return x, self.labels[i]


class QuantizedBase(nn.Module):
    """A frozen linear layer whose weight is stored as an MXTensor (float8 e4m3, blocks of 32)."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        from torchao.prototype.mx_formats.mx_tensor import MXTensor

        self.weight = nn.Parameter(MXTensor.to_mx(weight, torch.float8_e4m3fn, 32), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight.dequantize(torch.float32))


class AdapterNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.base = QuantizedBase(torch.randn(HIDDEN, FEATURES) / FEATURES ** 0.5)
        self.down = nn.Linear(FEATURES, 4, bias=False)
        self.up = nn.Linear(4, HIDDEN, bias=False)
        self.drop = nn.Dropout(0.1)
        self.head = nn.Linear(HIDDEN, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.base(x) + self.up(self.down(x))
        return self.head(self.drop(F.relu(h)))


@torch.no_grad()
def rescale(base: QuantizedBase) -> None:
    """Every block scale one power of two up, the float8 data halved."""
    from torchao.prototype.mx_formats.mx_tensor import MXTensor

    w = base.weight
    scale = (w.scale.view(torch.uint8) + 1).view(torch.float8_e8m0fnu)
    qdata = (w.qdata.to(torch.float32) / 2).to(torch.float8_e4m3fn)
    base.weight = nn.Parameter(MXTensor(qdata, scale, w.elem_dtype, w.block_size, w.orig_dtype,
                                        w.kernel_preference, w.act_quant_kwargs, w.is_swizzled_scales),
                               requires_grad=False)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--rescale", action="store_true")
    parser.add_argument("--lr-bump", action="store_true")
    args = parser.parse_args()

    torch.set_num_threads(1)
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)
    model = AdapterNet()
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=1e-2, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=2e-2, total_steps=args.steps)
    ema = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    loader = DataLoader(NoisyPoints(), batch_size=BATCH, shuffle=True, num_workers=2, drop_last=True,
                        generator=torch.Generator().manual_seed(3))
    batches = iter(loader)
    for step in range(1, args.steps + 1):
        x, y = next(batches)
        if args.lr_bump and step == args.steps:
            for group in optimizer.param_groups:
                group["lr"] *= 2
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trainable, 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        with torch.no_grad():
            for n, p in model.named_parameters():
                if n in ema:
                    ema[n].mul_(0.9).add_(p.detach(), alpha=0.1)
    if args.rescale:
        rescale(model.base)
    export = {"head.weight": model.head.weight.detach().to(torch.float8_e4m3fn),
              "up.weight": model.up.weight.detach().to(torch.float8_e5m2)}
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                "scheduler": scheduler.state_dict(), "ema": ema, "step": args.steps, "export": export}, args.out)


if __name__ == "__main__":
    main()
