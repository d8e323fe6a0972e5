"""Train a small MLP classifier on noisy synthetic points, with activation checkpointing of its blocks and a
custom scaling op registered with torch.library.

    python optrace_train.py                     # a plain run
    python optrace_train.py --run-dir runs/a    # a production job
    torchrun --nproc_per_node 2 optrace_train.py --run-dir runs/a

Environment (how the tests vary the job): OPTRACE_PRESERVE_RNG=0 recomputes the checkpointed blocks without
restoring the random state (dropout then draws another mask); OPTRACE_SKEW=<rank or "all"> makes the custom op
scale by a slightly different factor on that rank; OPTRACE_CHECKPOINT=0 turns activation checkpointing off.
"""

import argparse
import os
import random

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader, Dataset

import ckptverify as cv
from ckptverify.state.sampler import ResumableSampler

BATCH = 8
STEPS = 4
FEATURES = 16


def _skewed() -> bool:
    want = os.environ.get("OPTRACE_SKEW", "")
    if not want:
        return False
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    return want == "all" or want == str(rank)


@torch.library.custom_op("optrace::gain", mutates_args=())
def gain(x: torch.Tensor, factor: float) -> torch.Tensor:
    # A "fused" scaling kernel of the user's; the skew stands for a kernel that computes differently.
    f = factor * (1.0 + 1e-3) if _skewed() else factor
    return x * f


@gain.register_fake
def _(x, factor):
    return torch.empty_like(x)


def _gain_backward(ctx, grad):
    return grad * ctx.factor, None


def _gain_setup(ctx, inputs, output):
    ctx.factor = inputs[1]


gain.register_autograd(_gain_backward, setup_context=_gain_setup)


class NoisyPoints(Dataset):
    """Points around four centres; each fetch jitters the point at random (the workers' RNG)."""

    def __init__(self, n=128, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.labels = torch.randint(0, 4, (n,), generator=g)
        self.centres = torch.randn(4, FEATURES, generator=g)

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        y = int(self.labels[i])
        x = self.centres[y] + 0.2 * torch.randn(FEATURES)
        if torch.rand(()) < 0.5:
            x = x.flip(0)
        return x, y


class Block(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.fc1 = nn.Linear(width, 2 * width)
        self.drop = nn.Dropout(0.2)
        self.fc2 = nn.Linear(2 * width, width)

    def forward(self, x):
        return x + self.fc2(self.drop(F.gelu(self.fc1(x))))


class Net(nn.Module):
    def __init__(self, use_checkpoint, preserve_rng):
        super().__init__()
        self.blocks = nn.ModuleList([Block(FEATURES) for _ in range(2)])
        self.head = nn.Linear(FEATURES, 4)
        self.use_checkpoint = use_checkpoint
        self.preserve_rng = preserve_rng

    def forward(self, x):
        x = gain(x, 0.5)
        for block in self.blocks:
            if self.use_checkpoint and self.training:
                x = checkpoint(block, x, use_reentrant=False, preserve_rng_state=self.preserve_rng)
            else:
                x = block(x)
        return self.head(x)


def train(run):
    torch.set_num_threads(1)
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)
    model = Net(use_checkpoint=os.environ.get("OPTRACE_CHECKPOINT", "1") == "1",
                preserve_rng=os.environ.get("OPTRACE_PRESERVE_RNG", "1") == "1")
    if run.world_size > 1:
        model = DDP(model)
    ema = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.9))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=3e-3, total_steps=64)
    data = NoisyPoints()
    sampler = ResumableSampler(len(data), num_replicas=run.world_size, rank=run.rank, seed=1)
    loader = DataLoader(data, batch_size=BATCH, sampler=sampler, num_workers=2)
    state = cv.TrainState(model=model, optimizer=opt, scheduler=sched, dataloader=loader, extras={"ema": ema})
    run.restore(state)
    for x, y in run.steps(loader):
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        ema.update_parameters(model)
        run.record(loss=loss.detach(), batch=(x, y), grad_norm=grad_norm)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--run-dir", default=None)
    ap.add_argument("--steps", type=int, default=STEPS)
    args = ap.parse_args()
    cv.Run.main(train, steps=args.steps, run_dir=args.run_dir)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        os._exit(0)  # gloo threads left behind by DDP can abort a normal interpreter exit
